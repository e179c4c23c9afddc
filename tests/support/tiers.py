"""A manager with a RAM tier under /dev/shm and a local tier (none with
local_every=None), in fresh directories that are removed on exit: the
elastic-loop tests' shared set-up; and `flip`, the corruption tests' byte flip
of a stored file."""
import contextlib
import shutil
import tempfile

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier


@contextlib.contextmanager
def manager(ram_every: int = 2, local_every: int | None = 5, keep: int | None = 2):
    local = tempfile.mkdtemp(prefix="rc-elastic-")
    ram = tempfile.mkdtemp(prefix="rc-elastic-", dir="/dev/shm")
    tiers = [RamTier(every=ram_every, keep=keep, path=ram)]
    if local_every is not None:
        tiers.append(LocalTier(every=local_every, keep=keep))
    mngr = CheckpointManager(local, options=CheckpointManagerOptions(tiers=tiers))
    try:
        yield mngr
    finally:
        mngr.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)


def flip(path: str, at: int | None = None) -> None:
    """Flips bits of one byte of the file at `path` in place (the middle one,
    or `at`): its size stays, only a checksum can tell."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        i = len(data) // 2 if at is None else at
        data[i] ^= 0x5A
        f.seek(0)
        f.write(data)
