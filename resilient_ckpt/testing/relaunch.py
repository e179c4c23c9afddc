"""The training script of the relaunch tests and bench, run under the supervisor.

`prepare(workdir)` writes the worker (`worker.py`) and the multi-host worker
library of `multiprocess` (`mh.py`, for its exact state) into `workdir`
and returns (argv prefix, env) for `resilient_ckpt.elastic.supervisor.Supervisor`.
The worker reads the launch contract with `resilient_ckpt.elastic.jobenv`
(the supervisor's variables), forms the jax.distributed job from it, opens
the manager (ours: this host's RamTier every step, the shared LocalTier every
--local-every; or Orbax's emergency CheckpointManager with the same two
directories), restores the newest step if there is one, and trains to
--steps, reporting each step and the restore to the supervisor. The state is
mh's: after step s its values are known bit for bit (`mh.expected`), so
"equal to an uninterrupted run" is checked exactly, on every process's
shards. Worker options: --dir (shared), --ram (this host's, {pid} replaced),
--devices, --state-bytes, --mesh, --steps, --local-every, --step-sleep,
--system ours|orbax_emergency. Besides "restored", "step" and "final", it
reports "initialized" (the job formed: interpreter, imports, jax.distributed)
and "opened" (the manager opened), for the bench's phases.
"""
from __future__ import annotations

import os
import sys

from .multiprocess import REPO, WORKER_LIB

WORKER = r'''
import argparse, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--dir", required=True)
p.add_argument("--ram", required=True)
p.add_argument("--devices", type=int, default=4)
p.add_argument("--state-bytes", type=int, default=1 << 18)
p.add_argument("--mesh", default="2,2,2")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--local-every", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--system", default="ours", choices=["ours", "orbax_emergency"])
o = p.parse_args()
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={o.devices}"
os.environ["JAX_PLATFORMS"] = "cpu"

from resilient_ckpt.elastic import jobenv
job = jobenv.from_env()
jobenv.initialize(job, initialization_timeout=60, heartbeat_timeout_seconds=20,
                  shutdown_timeout_seconds=30)
jobenv.report(job, "initialized", 0)
import jax
import numpy as np
import orbax.checkpoint as ocp
import mh

ctx = mh.Ctx()
ctx.pid, ctx.nprocs = jax.process_index(), jax.process_count()
ctx.dir, ctx.ram = o.dir, o.ram.replace("{pid}", str(ctx.pid))
ctx.shapes = mh.state_shapes(o.state_bytes)
ctx.mesh = mh.make_mesh(o.mesh)
mh.bind(ctx)


def open_manager(abstract):
    if o.system == "ours":
        return mh.ours(ctx, ram_every=1, ram_keep=2, local_every=o.local_every, local_keep=2)
    os.makedirs(ctx.ram, exist_ok=True)  # a lost host's directory is back, empty
    return mh.orbax_emergency(ctx, ctx.ram, ctx.dir, abstract, local_every=1, local_keep=2,
                              persistent_every=o.local_every, persistent_keep=2)


def restore(mngr, abstract):
    if o.system == "ours":
        state = mngr.restore(None, args=ocp.args.StandardRestore(abstract))
        rec = mngr.last_restore
        return state, rec.step, {k: int(v) for k, v in rec.bytes_by_tier.items()}
    step = mngr.latest_step()
    return mh.from_orbax(mngr.restore(step).state), step, {}


def save(mngr, step, state):
    if o.system == "ours":
        mngr.save(step, args=ocp.args.StandardSave(state))
    else:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(mh.orbax_state(state))))


def main():
    abstract = ctx.abstract()
    mngr = open_manager(abstract)
    jobenv.report(job, "opened", 0)
    start = mngr.latest_step()
    if start is None:
        state, start = ctx.initial_state(), 0
    else:
        state, start, tiers = restore(mngr, abstract)
        jax.block_until_ready(state)
        jobenv.report(job, "restored", start, bytes_by_tier=tiers,
                      target_bytes=ctx.target_bytes(abstract))
        # Checked after the report, and timed: benches take the check off the recovery.
        t0 = time.perf_counter()
        bad = ctx.check_exact(state, start)
        jobenv.report(job, "checked", start, mismatches=len(bad),
                      check_s=time.perf_counter() - t0)
    for step in range(start + 1, o.steps + 1):
        state = jax.block_until_ready(ctx.train_step(state, step))
        save(mngr, step, state)
        jobenv.report(job, "step", step)
        time.sleep(o.step_sleep)
    mngr.wait_until_finished()
    bad = ctx.check_exact(state, o.steps)
    jobenv.report(job, "final", o.steps, mismatches=len(bad), sample=bad[:3],
                  attempt=job.attempt)
    mngr.close()


main()
'''


def prepare(workdir: str, src: str | None = None) -> tuple[list[str], dict[str, str | None]]:
    """Writes worker.py and mh.py into `workdir`; returns (argv, env) for the
    supervisor. `src`: the directory the workers import the package from
    (default: the tree of this module)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "mh.py"), "w") as f:
        f.write(WORKER_LIB)
    path = os.path.join(workdir, "worker.py")
    with open(path, "w") as f:
        f.write(WORKER)
    src = src or REPO
    env: dict[str, str | None] = {
        "PYTHONPATH": os.pathsep.join([workdir, src] + (
            [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
        "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTEST_CURRENT_TEST": None,
        "XLA_FLAGS": None, "JAX_PLATFORMS": None}
    return [sys.executable, path], env
