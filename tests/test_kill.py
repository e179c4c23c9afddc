"""SIGKILL at random moments of a stream of saves never loses a committed step.

A child process (tests/_saver.py) saves deterministic steps to a RamTier and a
LocalTier; the parent kills it with SIGKILL (only that pid) at a random moment,
either any time after it opened its manager or within a few ms of one of its
save calls, then opens a fresh manager on the same directories and checks that
  * a step is selected whenever one was ever reported committed, and it is no
    older than the newest reported one;
  * the oldest and newest viable steps, and restore() of the latest, are
    bit-exact equal to those steps' deterministic states, with no chunk
    falling back to another copy;
  * the fresh manager's background cleanup (joined) removes the dead child's
    temporaries and in-progress markers and empties uncommitted step
    directories, and never removes a file of a step directory that holds a
    manifest.
One pair of directories is reused across all trials, so later children start
on top of older steps and of whatever the previous kill left behind; every
other trial skips the parent's cleanup so the next child's own cleanup has to
deal with the leftovers while it saves.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import collections
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import pytest

import resilient_ckpt as rc
from resilient_ckpt import layout

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _saver  # noqa: E402  (the child's script: what each step holds)

TRIALS = 36  # kills; fewer (never under MIN_TRIALS) when the machine is slow
MIN_TRIALS = 24
BUDGET_S = 60.0  # no trial starts after this, once MIN_TRIALS are done


@pytest.fixture
def dirs():
    ram = tempfile.mkdtemp(prefix="rc-kill-", dir="/dev/shm")
    local = tempfile.mkdtemp(prefix="rc-kill-")
    yield ram, local
    shutil.rmtree(ram, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)


class Child:
    """One _saver.py process, started early; its stdout is read by a thread."""

    def __init__(self, ram: str, local: str):
        self.err = tempfile.TemporaryFile("w+")
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                   JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_saver.py"), ram, local],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
            text=True, env=env)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def wait_for(self, prefix: str, timeout: float = 60, exact: bool = False) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hit = [ln for ln in self.lines
                       if (ln == prefix if exact else ln.startswith(prefix))]
                if hit:
                    return hit[0]
                if "<eof>" in self.lines:
                    raise AssertionError(f"child exited before {prefix!r}: "
                                         f"{self._stderr()}")
                left = deadline - time.monotonic()
                assert left > 0, f"child did not print {prefix!r} in {timeout} s"
                self.cond.wait(left)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> list[int]:
        """SIGKILLs this child (only its pid), reaps it, returns the steps it
        reported committed."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()  # reaped: a zombie would still look alive to cleaners
        self.reader.join(10)
        self.proc.stdin.close()
        self.err.close()
        return [int(ln.split()[1]) for ln in self.lines if ln.startswith("committed ")]


def _leftovers(root: str) -> list[str]:
    """Temporaries and in-progress markers anywhere in a tier."""
    out = []
    for dirpath, _, files in os.walk(root):
        for n in files:
            if layout.parse_tmp_name(n) or layout.parse_marker_name(n):
                out.append(os.path.join(dirpath, n))
    return out


def _step_dirs(root: str) -> dict[int, set[str]]:
    """Step -> names of its committed files (chunks and manifests), for the step
    directories that hold a manifest."""
    out = {}
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        files = set(os.listdir(os.path.join(root, name)))
        if any(layout.parse_manifest_name(n) for n in files):
            out[int(name)] = {n for n in files
                              if not (layout.parse_tmp_name(n) or layout.parse_marker_name(n))}
    return out


def _check_exact(restored: dict, step: int) -> None:
    want = _saver.make_state(step)
    assert restored["n"] == step
    for k in ("w", "v", "b"):
        got = np.asarray(restored[k])
        assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
        assert got.tobytes() == want[k].tobytes(), f"step {step}, leaf {k} differs"


def _abstract():
    sh = _saver.shardings()
    out = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sh[k])
           for k, (shape, dtype) in _saver.SHAPES.items()}
    out["n"] = 0
    return out


def _open(ram: str, local: str, cleanup: bool) -> rc.CheckpointManager:
    return rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=_saver.tiers(ram, local), cleanup_tmp_directories=cleanup))


def test_sigkill_at_random_moments_never_loses_a_committed_step(dirs):
    import orbax.checkpoint as ocp

    ram, local = dirs
    rng = random.Random(20240229)
    newest_committed = None
    kills_with_leftovers = cleaned = 0
    restored_steps = set()
    t0 = time.monotonic()
    # Children are started two trials ahead: they import jax while earlier
    # trials run and are checked, and only open the manager when told "go".
    ahead = collections.deque(Child(ram, local) for _ in range(min(2, TRIALS)))
    child = ahead[0]
    try:
        for trial in range(TRIALS):
            child = ahead.popleft()
            last = trial == TRIALS - 1 or (trial + 1 >= MIN_TRIALS
                                           and time.monotonic() - t0 > BUDGET_S)
            if trial + len(ahead) + 1 < TRIALS and not last:
                ahead.append(Child(ram, local))
            child.wait_for("imported")
            child.go()
            first = int(child.wait_for("ready").split()[1]) + 1
            if trial % 3 == 0:
                # Anywhere from opening the manager to several saves in.
                time.sleep(rng.choice([0.0, 0.02, rng.uniform(0, 0.15), rng.uniform(0, 0.8)]))
            else:
                # Within a few ms of a save call, where the writes are under way.
                child.wait_for(f"saving {first + rng.randrange(4)}", exact=True)
                time.sleep(rng.uniform(0, 0.03))
            committed = child.kill()
            if committed:
                newest_committed = max(committed + [newest_committed or -1])

            before = {root: _step_dirs(root) for root in (ram, local)}
            had_leftovers = any(_leftovers(root) for root in (ram, local))
            kills_with_leftovers += had_leftovers
            cleanup = trial % 2 == 0 or last
            mngr = _open(ram, local, cleanup)
            try:
                if cleanup:
                    mngr._cleanup.join(30)
                    assert not mngr._cleanup.is_alive()
                    for root in (ram, local):
                        assert _leftovers(root) == [], f"trial {trial}: dead leftovers remain"
                        for name in os.listdir(root):  # uncommitted step dirs are emptied
                            if name.isdigit() and int(name) not in before[root]:
                                left = os.listdir(os.path.join(root, name))
                                assert left == [], f"trial {trial}: {root}/{name}: {left}"
                    cleaned += had_leftovers
                for root in (ram, local):  # cleanup never removes committed files
                    after = _step_dirs(root)
                    for step, files in before[root].items():
                        assert step in after and files <= after[step], \
                            f"trial {trial}: committed step {step} in {root} was altered"

                latest = mngr.latest_step()
                if newest_committed is not None:
                    assert latest is not None and latest >= newest_committed, \
                        f"trial {trial}: latest {latest}, newest committed {newest_committed}"
                steps = mngr.all_steps()
                for step in sorted({steps[0], steps[-1]} if steps else ()):  # oldest, newest
                    out = mngr.restore(step, args=ocp.args.StandardRestore(_abstract()))
                    _check_exact(out, step)
                    assert mngr.last_restore.fallbacks == []
                    restored_steps.add(step)
                if latest is not None:
                    _check_exact(mngr.restore(), latest)  # latest, as a restarted job does
            finally:
                mngr.close()
            if last:
                break
    finally:  # a failed trial leaves no child running (each killed by its own pid)
        for c in list(ahead) + [child]:
            if c.proc.poll() is None:
                c.kill()
    elapsed = time.monotonic() - t0
    print(f"{trial + 1} kills in {elapsed:.1f} s; newest committed step {newest_committed}; "
          f"{kills_with_leftovers} left temporaries or markers ({cleaned} cleaned "
          "by the checking manager, the rest by the next child); "
          f"{len(restored_steps)} distinct steps restored")
    assert newest_committed is not None and newest_committed >= 10
    assert cleaned > 0, "no kill landed inside a write; tune the delays"
