"""A short training that ends normally: the child script of the clean-exit tests
(tests/elastic/test_exit.py).

    python tests/support/exits.py MODE DIRECTORY

on 8 CPU devices, mesh (replica=2, data=2, model=2), a manager with a RAM
tier (under /dev/shm) and a local tier in DIRECTORY. MODE:

- "manager": the manager alone, saving every step;
- "elastic": the elastic loop (`Elastic`, with `build=` and `reserve=True`,
  so its ahead-of-time compile and reserve threads run);
- "host_snapshot": the loop with a `HostSnapshotTier`;
- "loss": that, with devices 4-7 lost (`testing.faults`) at several steps,
  each as the step right after a snapshot was taken starts: the snapshot's
  copies are still being made (in flight) when the devices go. They come
  back two steps later and the loop grows back to 8 devices.

The script checks the final state against a replay and prints
`done <json>` last; the test checks the exit code and that stderr holds no
traceback or fatal error. It imports nothing from tests/.
"""
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier  # noqa: E402
from resilient_ckpt.elastic import Elastic, HostSnapshotTier  # noqa: E402
from resilient_ckpt.testing.faults import DeviceFault, FaultInjector  # noqa: E402

ROWS = 1 << 16   # 2 MiB per leaf
TOTAL = {"loss": 40}     # steps; 8 in the other modes (the last compile is still on at exit)
SPECS = {"w": P(("replica", "data"), "model"), "r": P("data", "model")}
LOSSES = tuple(range(4, TOTAL["loss"], 5))   # devices 4-7 lost as these start, back 2 later


def expected(steps: int) -> int:
    v = 0
    for _ in range(steps):
        v = (v * 3 + 1) % 2**32
    return v


def build(mesh: Mesh):
    sh = {k: NamedSharding(mesh, v) for k, v in SPECS.items()}
    step = jax.jit(lambda s: {k: v * np.uint32(3) + np.uint32(1) for k, v in s.items()},
                   donate_argnums=0, out_shardings=sh)
    abstract = {k: jax.ShapeDtypeStruct((ROWS, 8), np.uint32, sharding=sh[k]) for k in SPECS}
    return step, abstract, lambda: jax.device_put(
        {k: np.zeros((ROWS, 8), np.uint32) for k in SPECS}, sh)


def check(state: dict, steps: int) -> None:
    want = expected(steps)
    for k, v in state.items():
        got = np.unique(np.asarray(v))
        assert got.tolist() == [want], f"leaf {k} after {steps} steps: {got[:4]}, not {want}"


def manager_only(mngr: CheckpointManager, mesh: Mesh, total: int) -> dict:
    import orbax.checkpoint as ocp
    step_fn, _, init = build(mesh)
    state = init()
    for step in range(1, total + 1):
        state = step_fn(state)
        mngr.save(step, args=ocp.args.StandardSave(state))
    check(state, total)
    return {"saved": mngr.all_steps()}


def elastic(mngr: CheckpointManager, mesh: Mesh, mode: str, total: int) -> dict:
    tier = HostSnapshotTier(every=1, keep=2) if mode in ("host_snapshot", "loss") else None
    faults = FaultInjector([DeviceFault(s, (4, 5, 6, 7), repair_step=s + 2) for s in LOSSES]
                           if mode == "loss" else [], host_snapshot=tier)
    el = Elastic(mngr, mesh, data_axis="replica", health_check=faults.health_check,
                 rescale_every_s=0, grow_wait_s=0, host_snapshot=tier,
                 build=build if mode == "elastic" else None, reserve=mode == "elastic")

    @el.run
    def train(mesh: Mesh) -> dict:
        step_fn, abstract, init = el.program(mesh) if mode == "elastic" else build(mesh)
        step_fn = faults.wrap(step_fn)
        state, start = el.restore(abstract, init)
        check(state, start)
        for step in range(start + 1, total + 1):
            state = step_fn(step, state)
            el.save(step, state)
        return state

    check(train(), total)
    return {"events": [(e.kind, e.step, e.outcome, sorted(e.restored_from))
                       for e in el.timeline],
            "snapshots": tier.steps() if tier is not None else None}


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("replica", "data", "model"))
    ram = tempfile.mkdtemp(prefix="rc-exits-", dir="/dev/shm")
    try:
        mngr = CheckpointManager(directory, options=CheckpointManagerOptions(tiers=[
            RamTier(every=1 if mode == "manager" else 4, keep=2, path=ram),
            LocalTier(every=5, keep=2)]))
        with mngr:
            total = TOTAL.get(mode, 8)
            out = (manager_only(mngr, mesh, total) if mode == "manager"
                   else elastic(mngr, mesh, mode, total))
            mngr.wait_until_finished()
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    print("done", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
