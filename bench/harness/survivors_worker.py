"""The training script of harness.multiprocess's in-process cases (a worker, not a bench).

Started by harness/multiprocess.py through resilient_ckpt.testing.multiprocess's
`start_job`, one process per simulated host, with jax's recoverability
settings. The state is mh's (exact values after every step) on a (replica,
data, model) mesh with one replica per process (each step also all-reduces a
probe across them, as a data-parallel step's gradients would), trained under
`Elastic` with this host's RamTier every step and the shared LocalTier every
--local-every steps; the loop shrinks the replica axis when a process is lost
(`shrink_data_axis(data_axis="replica", divisor=False)`), so each survivor
restores its replica from its own RAM.

--victims i:s,j:t ... : process i stops answering before step s (it marks
"dying" and sleeps until the bench SIGKILLs it). Each process reports (RESULT
lines, wall-clock `t` from time.time()) every completed step, each recovery
event, and at the end whether its state equals the replay of every step.
"""
import argparse
import os
import sys
import time

import mh

ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--victims", default="")
p.add_argument("--steps", type=int, required=True)
p.add_argument("--local-every", type=int, default=3)
p.add_argument("--step-sleep", type=float, default=0.0)
opt = p.parse_args(ctx.extra)
victims = {int(i): int(s) for i, s in (v.split(":") for v in opt.victims.split(",") if v)}

import copy  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from resilient_ckpt.elastic import Elastic, RecoveryPolicy, shrink_data_axis  # noqa: E402


def build(mesh):
    """The step for `mesh`, compiled ahead of time (the loop builds the one of
    the likely smaller mesh in the background, so none compiles on recovery):
    mh's step, and the sum of a probe sharded over the replica axis, the
    collective a data-parallel step's gradients need and a lost process fails."""
    c = copy.copy(ctx)
    c.mesh = mesh
    mh.bind(c)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    step = c.step_fn.lower(c.abstract(mesh), scalar).compile()
    n = mesh.shape["replica"]
    probe = jax.make_array_from_callback((n,), NamedSharding(mesh, P("replica")),
                                         lambda i: np.ones(n, np.float32)[i])
    allreduce = jax.jit(jnp.sum).lower(probe).compile()

    def run(st, s):
        return step(st, np.int32(s)), allreduce(probe)
    return run


mngr = mh.ours(ctx, ram_every=1, ram_keep=2, local_every=opt.local_every, local_keep=2)
el = Elastic(mngr, ctx.mesh, data_axis="replica", rescale_every_s=1e9,
             choose_mesh=functools.partial(shrink_data_axis, data_axis="replica",
                                           divisor=False),
             retry=RecoveryPolicy(max_attempts=3, max_wait_s=60), build=build)
mh.report({"event": "opened", "t": time.time(), "init_s": ctx.init_s})


@el.run
def train(mesh):
    ctx.mesh = mesh
    mh.bind(ctx)  # shardings and abstract state on this mesh
    built_ahead = el.compiled(mesh)
    t0 = time.perf_counter()
    step = el.program(mesh)
    program_s = time.perf_counter() - t0
    state, start = el.restore(ctx.abstract(mesh), ctx.initial_state)
    if el.timeline:
        jax.block_until_ready(state)
        t_restored, t0 = time.time(), time.perf_counter()
        bad = ctx.check_exact(state, start)  # timed: the bench takes it off the recovery
        mh.report({"event": "restored", "step": start, "t": t_restored,
                   "built_ahead": built_ahead, "program_s": program_s,
                   "bytes": dict(mngr.last_restore.bytes_by_tier),
                   "mismatches": len(bad), "check_s": time.perf_counter() - t0})
    for s in range(start + 1, opt.steps + 1):
        if victims.get(ctx.pid) == s:
            mh.mark("dying")
            time.sleep(600)
        state, _ = el.step(step, state, s)
        t_step = time.time()
        el.save(s, state)
        mh.report({"event": "step", "step": s, "t": time.time(), "save_s": time.time() - t_step})
        if opt.step_sleep:
            time.sleep(opt.step_sleep)
    return state


final = train()
mngr.wait_until_finished()
mh.report({"event": "final", "step": opt.steps, "t": time.time(),
           "mismatches": len(ctx.check_exact(final, opt.steps)), "events": el.events})
mngr.close()
if ctx.pid == 0:
    time.sleep(2)  # the others exit first: without process 0 they would abort
os._exit(0)
