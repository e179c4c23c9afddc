"""Child process for tests/test_kill.py: saves a stream of deterministic steps
until it is killed.

    python tests/_saver.py RAM_DIR LOCAL_DIR

It imports jax, prints "imported", waits for one line on stdin (so the parent
can start it early, while it still checks the previous trial), opens a manager
on a RamTier and a LocalTier, prints "ready <latest step or -1>", then saves
steps latest+1, latest+2, ... forever, printing "saving N" as it calls save and
"committed N" once step N (and every step before it) is committed to every tier.
The state of step N is `make_state(N)`; the parent imports this module to know what each step holds.
"""
from __future__ import annotations

import os
import sys

import numpy as np

SHAPES = {"w": ((512, 768), np.float32), "v": ((1024, 256), np.float32),
          "b": ((4096,), np.int32)}


def make_state(step: int) -> dict:
    """The host values step `step` saves: a few MB, a function of the step only."""
    r = np.random.default_rng(1000 + step)
    return {"w": r.standard_normal(SHAPES["w"][0], dtype=np.float32),
            "v": r.standard_normal(SHAPES["v"][0], dtype=np.float32),
            "b": r.integers(-2**31, 2**31 - 1, SHAPES["b"][0], dtype=np.int32),
            "n": step}


def tiers(ram: str, local: str) -> tuple:
    from resilient_ckpt import LocalTier, RamTier
    return (RamTier(path=ram, keep=2), LocalTier(path=local, keep=3))


def shardings():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    return {"w": NamedSharding(mesh, P("x", "y")), "v": NamedSharding(mesh, P(("x", "y"))),
            "b": NamedSharding(mesh, P())}


def main() -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import orbax.checkpoint as ocp

    import resilient_ckpt as rc

    ram, local = sys.argv[1], sys.argv[2]
    sh = shardings()
    print("imported", flush=True)
    if not sys.stdin.readline():
        return
    mngr = rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=tiers(ram, local)))
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
        unreported.append(step)
        if step % 3 != 1:  # sometimes let two saves overlap in the background
            mngr.wait_until_finished()
            for s in unreported:
                print(f"committed {s}", flush=True)
            unreported = []
        step += 1


if __name__ == "__main__":
    main()
