"""A manager with a RAM tier under /dev/shm and a local tier, in fresh
directories that are removed on exit: the elastic-loop tests' shared set-up."""
import contextlib
import shutil
import tempfile

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier


@contextlib.contextmanager
def manager(ram_every: int = 2, local_every: int = 5, keep: int | None = 2):
    local = tempfile.mkdtemp(prefix="rc-elastic-")
    ram = tempfile.mkdtemp(prefix="rc-elastic-", dir="/dev/shm")
    mngr = CheckpointManager(local, options=CheckpointManagerOptions(tiers=[
        RamTier(every=ram_every, keep=keep, path=ram), LocalTier(every=local_every, keep=keep)]))
    try:
        yield mngr
    finally:
        mngr.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
