"""Child process for tests/faults/test_two_writers.py: a second writer of one directory.

    python tests/support/writer.py race RAM LOCAL SYNC INDEX
    python tests/support/writer.py loop RAM LOCAL STOP

`race`: opens a manager on RamTier(RAM) + LocalTier(LOCAL), creates
SYNC/ready.INDEX, waits for SYNC/go, saves step 1 holding `state(INDEX)` and
prints "won" or "in use MESSAGE". The winner waits for
SYNC/tried.<other> and closes, then creates SYNC/closed; the other creates
SYNC/tried.INDEX, waits for SYNC/closed, saves step 2 (`state(10 + INDEX)`)
and prints "saved 2".

`loop`: saves steps 1, 2, ... (step N holds `state(N)`), keeping one step per
tier, until the file STOP exists; prints "saved N" after each.

The parent imports this module for `state`, `abstract` and `exact`.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import resilient_ckpt as rc


def _sharding() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))


def host(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((64, 32), dtype=np.float32)


def state(seed: int) -> dict:
    return {"w": jax.device_put(host(seed), _sharding()), "n": seed}


def abstract() -> dict:
    return {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=_sharding()), "n": 0}


def exact(out: dict, seed: int) -> bool:
    return out["n"] == seed and np.asarray(out["w"]).tobytes() == host(seed).tobytes()


def open_manager(ram: str, local: str, keep: int | None = None) -> rc.CheckpointManager:
    return rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=(rc.RamTier(path=ram, keep=keep), rc.LocalTier(path=local, keep=keep))))


def _wait_for(path: str) -> None:
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"gave up waiting for {path}")
        time.sleep(0.02)


def _touch(path: str) -> None:
    open(path, "w").close()


def race(ram: str, local: str, sync: str, index: int) -> None:
    m = open_manager(ram, local)
    _touch(os.path.join(sync, f"ready.{index}"))
    _wait_for(os.path.join(sync, "go"))
    try:
        m.save(1, args=ocp.args.StandardSave(state(index)))
        m.wait_until_finished()
    except rc.DirectoryInUseError as e:
        print("in use", str(e).replace("\n", " "), flush=True)
        _touch(os.path.join(sync, f"tried.{index}"))
        _wait_for(os.path.join(sync, "closed"))
        m.save(2, args=ocp.args.StandardSave(state(10 + index)))
        m.close()
        print("saved 2", flush=True)
        return
    print("won", flush=True)
    _wait_for(os.path.join(sync, f"tried.{1 - index}"))
    m.close()
    _touch(os.path.join(sync, "closed"))


def loop(ram: str, local: str, stop: str) -> None:
    with open_manager(ram, local, keep=1) as m:
        step = 1
        while not os.path.exists(stop):
            m.save(step, args=ocp.args.StandardSave(state(step)))
            m.wait_until_finished()
            print("saved", step, flush=True)
            step += 1


if __name__ == "__main__":
    mode, ram, local, arg = sys.argv[1:5]
    if mode == "race":
        race(ram, local, arg, int(sys.argv[5]))
    else:
        loop(ram, local, arg)
