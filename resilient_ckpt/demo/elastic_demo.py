"""The elastic demo: `python -m resilient_ckpt.demo --elastic [--mb 160] [--steps 60]`.

This module owns the elastic demo only; it uses the public API as a user would.
One process drives 8 CPU devices as a (data=4, model=2) mesh and trains a small
pure-JAX MLP (params and Adam moments written by hand, about --mb MiB of state)
with a jitted step that donates the state. A RAM tier saves every 3 steps and a
local-disk tier every 15. At step --fail-at devices 4-7 "fail" (the step raises
DATA_LOSS and their buffers are deleted: simulated by
`resilient_ckpt.testing.faults`, since CPU devices cannot die); `Elastic`
health-checks the devices, goes on with the 4 healthy ones on a (data=2,
model=2) mesh from the newest viable step, and when the devices pass the health
check again (from step --repair-at) it scales back to 8 at the next save point.
It ends with the recovery timeline and the loss before and after both events.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

from ..elastic import Elastic, format_timeline
from ..manager import CheckpointManager, CheckpointManagerOptions
from ..testing.faults import DeviceFault, FaultInjector
from ..tiers import LocalTier, RamTier
from .model import demo_mesh, model_on
from .options import add_run_args, parser

BATCH = 64   # global batch; divides every data-axis size the mesh can shrink to


def build(mesh, mb: float):
    """(compiled step(state) -> (state, loss), abstract state on `mesh`, init)
    for a state of ~mb MiB: the crash demo's model (`model.model_on`). The step
    is compiled here, ahead of time, so that `Elastic` can build it for a
    likely mesh before it is needed. The batch of each step is a function of
    the step count, so a replayed step sees the same data."""
    import jax

    shardings, init_fn, step_fn = model_on(mesh, mb, BATCH)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init_fn), shardings)
    return step_fn.lower(abstract).compile(), abstract, init_fn


def run(a) -> int:
    mesh = demo_mesh()
    mngr = CheckpointManager(a.dir, options=CheckpointManagerOptions(
        tiers=[RamTier(every=a.ram_every, keep=2), LocalTier(every=a.local_every, keep=2)]))
    if mngr.all_steps():
        sys.exit(f"{a.dir} already holds steps {mngr.all_steps()}; pass a fresh --dir")
    faults = FaultInjector([DeviceFault(a.fail_at, (4, 5, 6, 7), a.repair_at)])
    # The demo checks for returned devices at every save point; a real job would
    # keep the default interval (60 s) or call el.request_rescale() on a signal.
    el = Elastic(mngr, mesh, health_check=faults.health_check, rescale_every_s=0,
                 build=functools.partial(build, mb=a.mb), grow_wait_s=a.grow_wait_s)
    losses: dict[int, float] = {}

    @el.run
    def train(mesh):
        step_fn, abstract, init = el.program(mesh)
        step_fn = faults.wrap(step_fn)
        state, start = el.restore(abstract, init)
        print(f"  -- {mesh.size} devices, mesh {dict(mesh.shape)}, from step {start}",
              flush=True)
        for step in range(start + 1, a.steps + 1):
            state, loss = step_fn(step, state)
            losses[step] = float(loss)
            el.save(step, state, metrics={"loss": losses[step]})
            if step % 5 == 0 or step in (start + 1, a.steps):
                print(f"  step {step:3d}  loss {losses[step]:.4f}", flush=True)

    t0 = time.perf_counter()
    train()
    mngr.wait_until_finished()
    mngr.close()
    return report(a, el, losses, time.perf_counter() - t0)


def report(a, el: Elastic, losses: dict[int, float], wall_s: float) -> int:
    """Prints the timeline and the loss; returns 0 when the run checks out."""
    print("\nrecovery timeline (ms):")
    print(format_timeline(el.timeline))
    fail = next((e for e in el.timeline if e.kind == "failure"), None)
    up = next((e for e in el.timeline if e.kind == "scale_up"), None)

    def mean(lo: int, hi: int) -> float:
        return statistics.fmean(losses[s] for s in range(max(1, lo), hi + 1) if s in losses)

    first, before = mean(1, 3), mean(a.fail_at - 3, a.fail_at - 1)
    middle = mean(up.step - 2, up.step) if up else float("nan")
    last = mean(a.steps - 2, a.steps)
    rows = [("state size", f"{a.mb:g} MiB, {a.steps} steps in {wall_s:.1f} s"),
            ("loss, steps 1-3", f"{first:.4f}"),
            (f"loss before the failure (steps {a.fail_at - 3}-{a.fail_at - 1}, 8 devices)",
             f"{before:.4f}")]
    if fail is not None:
        rows.append(("failure", fail.summary()))
    if up is not None:
        rows += [(f"loss before the scale-up (steps {up.step - 2}-{up.step}, 4 devices)",
                  f"{middle:.4f}"), ("scale-up", up.summary())]
    rows.append((f"loss at the end (steps {a.steps - 2}-{a.steps}, 8 devices)", f"{last:.4f}"))
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    ok = (fail is not None and fail.outcome == "resumed" and up is not None
          and up.outcome == "resumed" and first > before > middle > last)
    if not ok:
        print("the elastic run does not check out (expected a recovered failure, a "
              "scale-up, and a loss falling across both)", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    """The elastic demo (the arguments after `--elastic`)."""
    p = parser("python -m resilient_ckpt.demo --elastic", __doc__)
    add_run_args(p, mb=160, steps=60)
    p.add_argument("--fail-at", type=int, default=20,
                   help="the step at which devices 4-7 fail (default 20)")
    p.add_argument("--repair-at", type=int, default=35,
                   help="the step from which they pass health checks again (default 35)")
    p.add_argument("--ram-every", type=int, default=3, help="RAM tier interval (default 3)")
    p.add_argument("--local-every", type=int, default=15,
                   help="local tier interval (default 15)")
    p.add_argument("--grow-wait-s", type=float, default=120,
                   help="how long to go on with 4 devices while the 8-device step compiles "
                        "in the background once they are back (default 120; 0: grow at the "
                        "next save point, waiting for the compile there)")
    p.add_argument("-v", "--verbose", action="store_true", help="log the loop's decisions")
    a = p.parse_args(argv)
    if not 4 <= a.fail_at < a.repair_at < a.steps - 3:
        p.error("need 4 <= --fail-at < --repair-at < --steps - 3")
    logging.basicConfig(level=logging.INFO if a.verbose else logging.ERROR,
                        format="%(asctime)s %(name)s: %(message)s")
    own = a.dir is None
    a.dir = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="resilient_ckpt_elastic_"))
    ram_root = RamTier().open(a.dir, False).root
    try:
        return run(a)
    finally:
        if own:
            shutil.rmtree(a.dir, ignore_errors=True)
            shutil.rmtree(ram_root, ignore_errors=True)
