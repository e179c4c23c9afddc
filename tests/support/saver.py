"""Child process for tests/faults/test_kill.py: saves a stream of deterministic steps
until it is killed, or kills itself at a chosen point of a chosen phase.

    python tests/support/saver.py RAM_DIR LOCAL_DIR [GCS_URL GCS_ENDPOINT]

It imports jax, prints "imported", waits for one line on stdin (so the parent
can start it early, while it still checks the previous trial), opens a manager
on a RamTier, a LocalTier and (given a URL) a GcsTier, prints "ready <latest
step or -1>", then saves steps latest+1, latest+2, ... forever, printing
"saving N" as it calls save and "committed N TIERS" (TIERS: the tiers whose
write of N succeeded, comma-separated) once step N and every step before it
have finished in every tier.

Self-kill (RC_KILL_PHASE, RC_KILL_COUNT, RC_KILL_POINT, RC_KILL_SEED): a kill
from outside cannot be aimed at one phase of a save, so this child wraps the
library function of that phase (test code; the library is not changed) and on
its RC_KILL_COUNT-th call sends SIGKILL to itself, "before" the call, "after"
it returned, "during" it (a timer thread, a random few ms into the call) or,
for a file write, with the temporary written, at its rename or link ("tmp"). It
prints "hook PHASE POINT COUNT" just before. The phases:

  snapshot   snapshot.take (the device-to-host copy)
  chunk      FileStorage.put_parts (a pack or a chunk into the RAM or the local tier)
  manifest   FileStorage.put_if_absent (the manifest: the commit record)
  retention  tier_steps.delete_step (a step dropped by retention); "mid": after
             its manifests are gone, before the rest of the step is
  upload     GcsStorage.put / put_stream / put_if_absent (GCS chunk or commit)

The state of step N is `make_state(N)`; the parent imports this module to know
what each step holds.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading

import numpy as np

SHAPES = {"w": ((512, 768), np.float32), "v": ((1024, 256), np.float32),
          "b": ((4096,), np.int32)}
PHASES = ("snapshot", "chunk", "manifest", "retention", "upload")
# Points of a phase's call where a self-kill may land, and how long the
# "during" timer may wait (seconds: about how long one call takes here).
POINTS = {"snapshot": ("before", "during", "after"),
          "chunk": ("before", "tmp", "during", "after"),
          "manifest": ("before", "tmp", "during", "after"),
          "retention": ("before", "mid", "during", "after"),
          "upload": ("before", "during", "after")}
SPAN_S = {"snapshot": 0.004, "chunk": 0.002, "manifest": 0.001, "retention": 0.003,
          "upload": 0.03}
# RC_KILL_COUNT is drawn from 1..COUNTS[phase]: a few saves' worth of calls.
COUNTS = {"snapshot": 4, "chunk": 20, "manifest": 6, "retention": 5, "upload": 40}


def make_state(step: int) -> dict:
    """The host values step `step` saves: a few MB, a function of the step only."""
    r = np.random.default_rng(1000 + step)
    return {"w": r.standard_normal(SHAPES["w"][0], dtype=np.float32),
            "v": r.standard_normal(SHAPES["v"][0], dtype=np.float32),
            "b": r.integers(-2**31, 2**31 - 1, SHAPES["b"][0], dtype=np.int32),
            "n": step}


def tiers(ram: str, local: str, gcs_url: str | None = None, endpoint: str | None = None,
          orphan_age_s: float = 3600.0) -> tuple:
    """The child's tiers; keeps small so that retention deletes at every save."""
    from resilient_ckpt import GcsTier, LocalTier, RamTier, RetryPolicy
    out: tuple = (RamTier(path=ram, keep=2), LocalTier(path=local, keep=3))
    if gcs_url:
        out += (GcsTier(gcs_url, endpoint=endpoint, keep=2, orphan_age_s=orphan_age_s,
                        retry=RetryPolicy(deadline_s=30, attempt_timeout_s=10)),)
    return out


def shardings():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    return {"w": NamedSharding(mesh, P("x", "y")), "v": NamedSharding(mesh, P(("x", "y"))),
            "b": NamedSharding(mesh, P())}


# ---------------------------------------------------------------- the self-kill hook

def _die(phase: str, point: str, count: int) -> None:
    print(f"hook {phase} {point} {count}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _Hook:
    """Counts calls of one phase's functions; the `count`-th call dies at `point`."""

    def __init__(self, phase: str, count: int, point: str, seed: int):
        self.phase, self.count, self.point = phase, count, point
        self.rng = random.Random(seed)
        self.calls = 0
        self.lock = threading.Lock()

    def due(self) -> bool:
        with self.lock:
            self.calls += 1
            return self.calls == self.count

    def run(self, call, tmp: bool = False, mid=None):
        """Runs `call()`, dying at this hook's point when this is its call.
        `tmp`: the call is a file write (it dies at its rename or link, the
        temporary written); `mid(die)`: runs the call with a callback at its
        middle point."""
        if not self.due():
            return call()
        die = lambda: _die(self.phase, self.point, self.count)  # noqa: E731
        if self.point == "before":
            die()
        if self.point == "tmp" and tmp:
            _AT_RENAME.die = die
            return call()
        if self.point == "mid" and mid is not None:
            return mid(die)
        if self.point == "during":
            t = threading.Timer(self.rng.uniform(0, SPAN_S[self.phase]), die)
            t.daemon = True
            t.start()
            return call()
        out = call()
        die()  # "after", and points a phase has no way to reach
        return out


_AT_RENAME = threading.local()  # .die: what this thread's next rename or link calls first


def _arm_renames() -> None:
    """os.replace and os.link (how FileStorage puts a temporary in place) call
    the current thread's pending `die` first."""
    for name in ("replace", "link"):
        orig = getattr(os, name)

        def wrapped(*a, _orig=orig, **k):
            die = getattr(_AT_RENAME, "die", None)
            if die is not None:
                die()
            return _orig(*a, **k)
        setattr(os, name, wrapped)


def install_hook(phase: str, count: int, point: str, seed: int) -> None:
    """Wraps the library function of `phase` (see the module docstring)."""
    from resilient_ckpt.catalog import tier_steps
    from resilient_ckpt.save import snapshot
    from resilient_ckpt.storage.files import FileStorage
    from resilient_ckpt.storage.gcs import GcsStorage
    from resilient_ckpt.storage.wrapper import StorageWrapper

    hook = _Hook(phase, count, point, seed)
    if phase == "snapshot":
        take = snapshot.take
        snapshot.take = lambda *a, **k: hook.run(lambda: take(*a, **k))
    elif phase in ("chunk", "manifest"):
        # every put of a file tier (a pack, a chunk of its own) is a put_parts
        name = "put_parts" if phase == "chunk" else "put_if_absent"
        orig = getattr(FileStorage, name)

        def wrapped(self, key, *a):
            return hook.run(lambda: orig(self, key, *a), tmp=True)
        setattr(FileStorage, name, wrapped)
        _arm_renames()
    elif phase == "retention":
        delete_step = tier_steps.delete_step

        class DieAtFlush(StorageWrapper):  # delete_step flushes once the manifests are gone
            def __init__(self, inner, die):
                super().__init__(inner)
                self.die = die

            def flush(self, prefix):
                self.die()

        tier_steps.delete_step = lambda st, naming, step, *rest: hook.run(
            lambda: delete_step(st, naming, step, *rest),
            mid=lambda die: delete_step(DieAtFlush(st, die), naming, step, *rest))
    elif phase == "upload":
        for name in ("put", "put_stream", "put_if_absent"):
            orig = getattr(GcsStorage, name)
            setattr(GcsStorage, name, lambda self, *a, _orig=orig: hook.run(
                lambda: _orig(self, *a)))
    else:
        raise ValueError(f"unknown phase {phase!r}; choose from {PHASES}")


# ---------------------------------------------------------------- main

def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import orbax.checkpoint as ocp

    import resilient_ckpt as rc

    ram, local = sys.argv[1], sys.argv[2]
    gcs_url, endpoint = (sys.argv[3], sys.argv[4]) if len(sys.argv) > 4 else (None, None)
    sh = shardings()
    if os.environ.get("RC_KILL_PHASE"):
        install_hook(os.environ["RC_KILL_PHASE"], int(os.environ["RC_KILL_COUNT"]),
                     os.environ["RC_KILL_POINT"], int(os.environ.get("RC_KILL_SEED", "0")))
    print("imported", flush=True)
    if not sys.stdin.readline():
        return
    mngr = rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=tiers(ram, local, gcs_url, endpoint)))
    latest = mngr.latest_step()
    print(f"ready {-1 if latest is None else latest}", flush=True)
    step = 0 if latest is None else latest + 1
    unreported = []
    while True:
        host = make_state(step)
        state = {k: jax.device_put(host[k], sh[k]) for k in ("w", "v", "b")}
        state["n"] = host["n"]
        print(f"saving {step}", flush=True)
        assert mngr.save(step, args=ocp.args.StandardSave(state), force=True)
        unreported.append((step, mngr.save_records[-1]))
        if step % 3 != 1:  # sometimes let two saves overlap in the background
            mngr.wait_until_finished()
            for s, rec in unreported:
                ok = ",".join(n for n, tw in rec.tiers.items() if tw.ok)
                print(f"committed {s} {ok}", flush=True)
            unreported = []
        step += 1


if __name__ == "__main__":
    main()
