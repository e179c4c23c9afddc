"""Recovery from lost devices: the in-process elastic loop vs relaunching.

The model is a stand-in for an embedding-heavy network: a table and its
momentum (most of the state, rows sharded over every device) updated sparsely,
and a small dense layer, so a step costs little next to the state's size. Eight
CPU devices form a (data=4, model=2) mesh; devices 4-7 "fail" (a DATA_LOSS
raised at a chosen step, their buffers deleted: the simulated fault of
resilient_ckpt.testing.faults) and training goes on with 4.

Cases, each timed from the failure to the next completed step, interleaved
within each repeat so that other tenants' noise hits all alike:

- resilient_ckpt / loop: `Elastic` with `build=` (the step for the likely
  smaller mesh compiled ahead of time, in the background) and `reserve=True`
  (touched buffers for the state on that mesh, which the restore is copied
  into, so the first step donates them): health check, RAM tier restore onto
  the 4-device mesh, first step;
- resilient_ckpt / loop_host_snapshot: the same without the reserve but with
  a HostSnapshotTier (issue #12: copies in the devices' hosts' pinned_host
  memory, backups half the ring of data groups away), restored from first;
- resilient_ckpt / loop_plain: the same without the reserve (the first step
  after the restore writes the state into fresh memory);
- resilient_ckpt / loop_jit: the same without `build=` (the step is jitted and
  compiled on the recovery path);
- orbax / relaunch: what a job does without in-process recovery: a fresh
  Python process imports jax, builds the 4-device mesh, restores the same state
  with orbax.checkpoint.CheckpointManager from local disk (warm page cache) and
  runs one step; timed from the spawn, the failure detection by a scheduler
  and the rescheduling not counted;
- orbax / relaunch_compile_cache: the same with jax's persistent compilation
  cache already holding the step (the best a relaunch can do on compiles).

Then the multi-process case "relaunch_lost_host" (`--only relaunch` runs it
alone; bench/harness/multiprocess.py, at --relaunch-size): a 2-process jax.distributed job under
resilient_ckpt.elastic.supervisor loses host 1 (SIGKILL, its /dev/shm
directory removed); the whole set is relaunched and restores, ours from the
survivor's RAM (host 1's share from its replica) plus the shared tier, against
Orbax's emergency CheckpointManager in the same job; timed from the SIGKILL
to the first step done after the restore.

Then the multi-controller cases of bench/harness/multiprocess.py, at --mc-size:
"survivors" (a 2-process job loses host 1, process 0 goes on in-process,
against every process relaunched with Orbax's emergency manager) and
"goodput_mc" (a host lost every --fail-every steps: ours in-process, ours
relaunched, Orbax's emergency manager relaunched).

Then one goodput run: --goodput-steps steps with devices 4-7 failing every
--fail-every steps and coming back --fail-every/2 steps later; goodput = time
on steps that are kept / wall time (a kept step counts for the median step time
of its mesh when its own time includes a compile or a wait).

Each single-process case's line also has its peak resident memory
(`peak_extra_bytes`, the worst run): in the loop, from the failure to the first
step after the restore, above the level just before the failure (which holds
the reserve where there is one); in a relaunch, over its restore and first step.

Output (docs/bench_contract.md): JSON lines on stdout, the summary last; logs on stderr.

    python bench/recovery.py                  # 1 GB state, 3 repeats; goodput 1000 steps at 256 MB
    python bench/recovery.py --quick          # 128 MB, 2 repeats; goodput 400 steps at 64 MB
    python bench/recovery.py --sizes 512MB --repeats 5 --plot docs/benchmarks_recovery.png
    python bench/recovery.py --only relaunch --relaunch-size 1GB --repeats 3
    python bench/recovery.py --only survivors --only goodput_mc --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time

from harness.options import bench_parser, parse_options, prepare, size_label, size_option

prepare(devices=8)  # jax itself is imported where used: the relaunched child times it

from harness.measure import PeakRss  # noqa: E402
from harness.report import emit, emit_summary, median, worst_peak  # noqa: E402
from harness.state import make_mesh  # noqa: E402
from harness.systems import Orbax, Ours  # noqa: E402

BENCH = "recovery"
D = 256          # embedding width
BATCH = 1024     # rows looked up per step
GOALS = {  # summary key prefix -> (comparison, goal), from the issue
    "loop_fraction_of_relaunch": ("<=", 0.10),
    "goodput": (">=", 0.90),
    "steps_lost_max_vs_ram_interval": ("<=", 1.0),
    "relaunch_lost_host_fraction_of_orbax_emergency": ("<=", 1.0),
}
CASES = ("loop", "relaunch", "goodput", "survivors", "goodput_mc")
log = logging.getLogger("bench.recovery")


# ---------------------------------------------------------------- the model

def build(mesh, nbytes: int):
    """(compiled step(state) -> (state, loss), abstract state, init) on `mesh`
    for a state of about `nbytes`: table + momentum (V x D f32 each, rows
    sharded over every device), a replicated D x D layer, a step counter."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    rows = max(64, nbytes // (2 * 4 * D) // 64 * 64)
    by_row = NamedSharding(mesh, P(tuple(mesh.axis_names), None))
    rep = NamedSharding(mesh, P())
    sh = {"emb": by_row, "mom": by_row, "w": rep, "count": rep}

    def init():
        return {"emb": jax.random.normal(jax.random.key(0), (rows, D)) * 0.1,
                "mom": jnp.zeros((rows, D)),
                "w": jax.random.normal(jax.random.key(1), (D, D)) / D ** 0.5,
                "count": jnp.zeros((), jnp.int32)}

    def step(s):
        idx = jax.random.randint(jax.random.fold_in(jax.random.key(2), s["count"]),
                                 (BATCH,), 0, rows)
        x = s["emb"][idx]
        target = jnp.sin(x[:, ::-1])

        def loss_fn(x, w):
            return jnp.mean((jnp.tanh(x @ w) - target) ** 2)

        loss, (gx, gw) = jax.value_and_grad(loss_fn, argnums=(0, 1))(x, s["w"])
        mom = s["mom"].at[idx].multiply(0.9).at[idx].add(gx)
        emb = s["emb"].at[idx].add(-0.5 * mom[idx])
        return {"emb": emb, "mom": mom, "w": s["w"] - 0.1 * gw, "count": s["count"] + 1}, loss

    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init), sh)
    jitted = jax.jit(step, donate_argnums=0, out_shardings=(sh, rep))
    return jitted, abstract, jax.jit(init, out_shardings=sh)


def build_aot(mesh, nbytes: int):
    step, abstract, init = build(mesh, nbytes)
    return step.lower(abstract).compile(), abstract, init


def meshes():
    """The full 8-device mesh and the 4-device one left after devices 4-7 fail."""
    return make_mesh(4, 2), make_mesh(2, 2)


# ---------------------------------------------------------------- the relaunched process

def child(a) -> int:
    """A relaunched job: import jax, mesh, Orbax restore, one step. Prints phases."""
    t0 = time.perf_counter()
    import jax
    if a.compile_cache:
        jax.config.update("jax_compilation_cache_dir", a.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import orbax.checkpoint as ocp
    t_import = time.perf_counter()
    _, small = meshes()
    step, abstract, _ = build(small, a.nbytes)
    t_mesh = time.perf_counter()
    mngr = ocp.CheckpointManager(a.orbax_dir)
    with PeakRss() as peak:  # the restore and the first step
        state = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(state)
        t_restore = time.perf_counter()
        state, loss = step(state)
        float(loss)
        t_step = time.perf_counter()
    emit({"import_s": t_import - t0, "mesh_s": t_mesh - t_import,
          "restore_s": t_restore - t_mesh, "first_step_s": t_step - t_restore,
          "peak_extra_bytes": peak.extra})
    mngr.close()
    return 0


def relaunch(a, nbytes: int, orbax_dir: str, cache: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--nbytes", str(nbytes),
           "--orbax-dir", orbax_dir] + (["--compile-cache", cache] if cache else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    total = time.perf_counter() - t0
    proc.wait()
    if proc.returncode or not line:
        raise RuntimeError(f"the relaunched process failed ({proc.returncode}): {cmd}")
    phases = json.loads(line)
    peak = phases.pop("peak_extra_bytes")
    # The interpreter's own start, before the child's first line ran.
    return {"total_s": total, "spawn_s": total - sum(phases.values()), **phases,
            "peak_extra_bytes": peak}


# ---------------------------------------------------------------- the loop

@contextlib.contextmanager
def manager(a, tag: str):
    """A manager with the RAM and local tiers in fresh directories, closed and
    its directories removed on exit."""
    from resilient_ckpt import LocalTier, RamTier
    local = tempfile.mkdtemp(prefix=f"rc-recovery-{tag}-", dir=a.workdir)
    ram = tempfile.mkdtemp(prefix=f"rc-recovery-{tag}-", dir=a.shm)
    sut = Ours(local, [RamTier(every=a.ram_every, keep=2, path=ram),
                       LocalTier(every=a.local_every, keep=2)])
    try:
        yield sut.mngr
    finally:
        sut.close()
        for d in (local, ram):
            shutil.rmtree(d, ignore_errors=True)


def loop_recovery(a, nbytes: int, aot: bool, check, reserve: bool = False,
                  host_snapshot: bool = False) -> dict:
    """One elastic run that fails once: the failure's RecoveryEvent, as a dict.
    With `host_snapshot`, the loop also keeps a HostSnapshotTier (every RAM
    interval, one kept, backups along the data axis) and restores from it."""
    import jax

    from resilient_ckpt import Elastic, HostSnapshotTier
    from resilient_ckpt.testing.faults import DeviceFault, FaultInjector
    full, small = meshes()
    fail_at = 2 * a.ram_every + a.ram_every // 2 + 1
    faults = FaultInjector([DeviceFault(fail_at, (4, 5, 6, 7))], check=check)
    with manager(a, "loop") as mngr:
        el = Elastic(mngr, full, health_check=faults.health_check,
                     build=(lambda m: build_aot(m, nbytes)) if aot else None,
                     reserve=reserve, host_snapshot=HostSnapshotTier(
                         every=a.ram_every, keep=1, replica_axis="data")
                     if host_snapshot else None)

        @el.run
        def train(mesh):
            step_fn, abstract, init = el.program(mesh) if aot else build(mesh, nbytes)
            step_fn = faults.wrap(step_fn)
            state, start = el.restore(abstract, init)
            for step in range(start + 1, fail_at + 4):
                if step == fail_at and mesh.size == full.size:
                    # A job fails hours in, not seconds: let the background build
                    # of the smaller mesh's step (and its reserve) finish first,
                    # and the steps and tier writes already started (with steps of
                    # a few ms, step 20's writes would still be running at step
                    # 26, and the restore would wait for them; a relaunch reads
                    # from an idle disk).
                    t0 = time.perf_counter()
                    if aot:
                        el.program(small)
                        el.reserve.wait()
                    if el.host_snapshot is not None:
                        el.host_snapshot.wait()
                    jax.block_until_ready(state)
                    mngr.wait_until_finished()
                    settle.append(time.perf_counter() - t0)
                    window.append(PeakRss().__enter__())  # until the first step after
                t0 = time.perf_counter()
                state, loss = step_fn(step, state)
                if mesh.size < full.size and step == start + 1:
                    jax.block_until_ready(state)
                    window[0].__exit__(None, None, None)
                elif mesh.size < full.size:  # an ordinary step, timed
                    jax.block_until_ready(state)
                    after.append(time.perf_counter() - t0)
                el.save(step, state)

        after: list[float] = []
        settle: list[float] = []
        window: list[PeakRss] = []  # resident memory from the failure to the first step
        train()
        mngr.wait_until_finished()
        return {**el.timeline[0].to_dict(), "ordinary_step_s": median(after),
                "settled_before_fault_s": settle[0], "peak_extra_bytes": window[0].extra}


def orbax_checkpoint(a, nbytes: int) -> str:
    """The same state, saved with Orbax to local disk, for the relaunch cases."""
    full, _ = meshes()
    step, _, init = build(full, nbytes)
    state, _ = step(init())
    d = tempfile.mkdtemp(prefix="rc-recovery-orbax-", dir=a.workdir)
    with Orbax(d) as sut:
        sut.save(1, state)
    return d


def measure_size(a, nbytes: int, check) -> dict:
    orbax_dir = orbax_checkpoint(a, nbytes)
    cache = tempfile.mkdtemp(prefix="rc-recovery-xla-cache-", dir=a.workdir)
    runs: dict[str, list[dict]] = {k: [] for k in ("loop", "loop_host_snapshot", "loop_plain",
                                                   "loop_jit", "relaunch",
                                                   "relaunch_compile_cache")}
    try:
        relaunch(a, nbytes, orbax_dir, cache)  # fills the compilation cache (not timed)
        cases = list(runs)
        for r in range(a.repeats):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:
                if case.startswith("loop"):
                    out = loop_recovery(a, nbytes, case != "loop_jit", check,
                                        reserve=case == "loop",
                                        host_snapshot=case == "loop_host_snapshot")
                else:
                    out = relaunch(a, nbytes, orbax_dir,
                                   cache if case == "relaunch_compile_cache" else None)
                runs[case].append(out)
                log.info("%s %s repeat %d: %.3f s", size_label(nbytes), case, r,
                         out["total_s"])
    finally:
        shutil.rmtree(orbax_dir, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    medians = {}
    for case, outs in runs.items():
        system = "resilient_ckpt" if case.startswith("loop") else "orbax"
        totals = [o["total_s"] for o in outs]
        extra = ("ordinary_step_s", "settled_before_fault_s")  # not phases of the recovery
        phases = {k: median([o[k] for o in outs if o.get(k) is not None])
                  for k in outs[0] if k.endswith("_s") and k not in ("total_s",) + extra}
        line = {"bench": BENCH, "system": system, "case": case, "size": size_label(nbytes),
                "bytes": nbytes, "devices": "8->4", "runs_s": totals,
                "median_s": median(totals), "phases_median_s": phases}
        peak = worst_peak([o["peak_extra_bytes"] for o in outs], nbytes)
        if peak["peak_extra_bytes"] is not None:  # from the failure (a relaunch: its restore)
            line.update(peak)
        if system == "resilient_ckpt":
            line.update({f"{k[:-2]}_median_s": median([o[k] for o in outs]) for k in extra})
            line["steps_lost"] = [o["steps_lost"] for o in outs]
            line["restored_from"] = outs[-1]["restored_from"]
        emit(line)
        medians[case] = median(totals)
    medians["step"] = median([o["ordinary_step_s"] for o in runs["loop"]])
    return medians


# ---------------------------------------------------------------- goodput

def goodput(a, nbytes: int, check) -> dict:
    """A long run with a failure every --fail-every steps (devices 4-7, back
    half an interval later). Goodput = time on kept steps / wall time, both from
    the end of step 1 (start-up costs are the same with or without failures)
    to the end of the last step. A kept step counts for its own time (saves
    included), except the first step after a restore or scale-up, whose time
    includes the recovery: it counts for the median step time of its mesh."""
    from resilient_ckpt import Elastic
    from resilient_ckpt.testing.faults import DeviceFault, FaultInjector
    full, _ = meshes()
    every = a.fail_every
    faults = FaultInjector([DeviceFault(s, (4, 5, 6, 7), s + every // 2)
                            for s in range(every, a.goodput_steps, every)], check=check)
    done: list[tuple[int, float, int, bool]] = []  # step, end time, mesh size, first after entry
    entries: list[tuple[int, int]] = []            # (index into done, restored step)
    with manager(a, "goodput") as mngr:
        el = Elastic(mngr, full, health_check=faults.health_check, rescale_every_s=1.0,
                     build=lambda m: build_aot(m, nbytes))

        @el.run
        def train(mesh):
            step_fn, abstract, init = el.program(mesh)
            step_fn = faults.wrap(step_fn)
            state, start = el.restore(abstract, init)
            entries.append((len(done), start))
            for step in range(start + 1, a.goodput_steps + 1):
                state, loss = step_fn(step, state)
                loss.block_until_ready()  # time each step, not its dispatch
                el.save(step, state)
                done.append((step, time.perf_counter(), mesh.size, step == start + 1))

        train()
        mngr.wait_until_finished()
    kept: dict[int, tuple[float | None, int]] = {}  # step -> (seconds, or None if first; size)
    for i, (step, t_end, size, first) in enumerate(done):
        for idx, restored in entries:
            if idx == i:  # a (re)entry restored `restored`: later steps done so far are lost
                for s in [s for s in kept if s > restored]:
                    del kept[s]
        kept[step] = (None if first else t_end - done[i - 1][1], size)
    kept.pop(1, None)
    wall = done[-1][1] - done[0][1]
    med = {size: median([sec for sec, sz in kept.values() if sz == size and sec is not None])
           for size in {sz for _, sz in kept.values()}}
    useful = sum(med[size] if sec is None else sec for sec, size in kept.values())
    fails = [e for e in el.timeline if e.kind == "failure"]
    ups = [e for e in el.timeline if e.kind == "scale_up"]
    line = {"bench": BENCH, "system": "resilient_ckpt", "case": "goodput",
            "size": size_label(nbytes), "bytes": nbytes, "devices": "8<->4",
            "steps": a.goodput_steps, "fail_every": every, "ram_every": a.ram_every,
            "wall_s": wall, "useful_s": useful, "goodput": useful / wall,
            "failures": len(fails), "scale_ups": len(ups),
            "steps_lost": [e.steps_lost for e in fails],
            "recovery_total_s": [e.total_s for e in fails],
            "scale_up_total_s": [e.total_s for e in ups],
            "phases_median_s": {kind: {k: median([getattr(e, k) for e in evs
                                                  if getattr(e, k) is not None])
                                       for k in ("health_s", "rebuild_s", "restore_s",
                                                 "resume_s")}
                                for kind, evs in (("failure", fails), ("scale_up", ups)) if evs},
            "median_step_s": {str(k): v for k, v in med.items()},
            "kept_steps": len(kept) + 1}
    emit(line)
    return line


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, sizes="1GB", quick_sizes="128MB", plots=True,
                      quick_help="128MB, 2 repeats, a goodput run of 400 steps at 64MB")
    ap.add_argument("--goodput-size", type=size_option, default=None, metavar="SIZE",
                    help="state size of the goodput run, e.g. 256MB (default 256MB; "
                         "--quick 64MB)")
    ap.add_argument("--goodput-steps", type=int, default=None,
                    help="steps of the goodput run (default 1000; quick 400)")
    ap.add_argument("--fail-every", type=int, default=200,
                    help="a failure every N steps in the goodput run (default 200)")
    ap.add_argument("--ram-every", type=int, default=10, help="RAM tier interval (default 10)")
    ap.add_argument("--local-every", type=int, default=50, help="local tier interval (default 50)")
    ap.add_argument("--workdir", default=None, help="directory for the local tiers and Orbax")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the RAM tier")
    ap.add_argument("--relaunch-size", type=size_option, default=None, metavar="SIZE",
                    help="state size of the relaunch case (default 256MB; --quick 8MB)")
    ap.add_argument("--grace-s", type=float, default=1.0,
                    help="relaunch case: seconds between SIGTERM and SIGKILL of the "
                         "survivors (default 1)")
    ap.add_argument("--mc-size", type=size_option, default=None, metavar="SIZE",
                    help="state size of the survivors and goodput_mc cases (default 128MB; "
                         "--quick 8MB)")
    ap.add_argument("--mc-step-s", type=float, default=0.25,
                    help="survivors/goodput_mc: seconds each step sleeps, a stand-in for "
                         "a real step's compute (default 0.25)")
    ap.add_argument("--mc-local-every", type=int, default=50,
                    help="goodput_mc: shared tier interval (default 50)")
    ap.add_argument("--collective-timeout-s", type=float, default=5.0,
                    help="survivors/goodput_mc: XLA's CPU collective timeout, after which "
                         "the survivors of a lost process get the failure (default 5)")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                    help="survivors/goodput_mc: jax.distributed's heartbeat timeout, after "
                         "which a lost process that was not in a collective is found "
                         "(default 5; jax's own default is 100)")
    ap.add_argument("--only", action="append", choices=CASES, default=None,
                    help="run only these cases (repeatable; default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--orbax-dir", help=argparse.SUPPRESS)
    ap.add_argument("--compile-cache", help=argparse.SUPPRESS)
    a = parse_options(ap, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("resilient_ckpt").setLevel(logging.ERROR)
    if a.child:
        return child(a)
    a.goodput_steps = a.goodput_steps or (400 if a.quick else 1000)
    goodput_bytes = a.goodput_size or (64 if a.quick else 256) * 10**6
    own = a.workdir is None
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="rc-bench-recovery-")
    import jax

    from resilient_ckpt import HealthCheck
    check = HealthCheck()
    check.prepare(jax.devices()[:8])
    summary: dict = {}
    only = set(a.only or CASES)
    try:
        for n in (a.sizes if "loop" in only else []):
            m = measure_size(a, n, check)
            label = size_label(n)
            summary[f"loop_fraction_of_relaunch_{label}"] = m["loop"] / m["relaunch"]
            summary[f"loop_vs_relaunch_compile_cache_fraction_{label}"] = (
                m["loop"] / m["relaunch_compile_cache"])
            summary[f"recovery_speedup_vs_relaunch_{label}"] = m["relaunch"] / m["loop"]
            summary[f"loop_jit_fraction_of_relaunch_{label}"] = m["loop_jit"] / m["relaunch"]
            summary[f"loop_plain_fraction_of_relaunch_{label}"] = m["loop_plain"] / m["relaunch"]
            summary[f"host_snapshot_loop_fraction_of_relaunch_{label}"] = (
                m["loop_host_snapshot"] / m["relaunch"])
            summary[f"host_snapshot_vs_ram_tier_loop_{label}"] = (
                m["loop_host_snapshot"] / m["loop"])
            # The floor: no recovery can end before one ordinary step on the new mesh.
            summary[f"one_step_fraction_of_relaunch_{label}"] = m["step"] / m["relaunch"]
        if "relaunch" in only:
            from harness.multiprocess import measure_relaunch  # imports jax: not at the top
            summary.update(measure_relaunch(
                a, a.relaunch_size or (8 if a.quick else 256) * 10**6))
        mc_bytes = a.mc_size or (8 if a.quick else 128) * 10**6
        if "survivors" in only:
            from harness.multiprocess import measure_survivors
            summary.update(measure_survivors(a, mc_bytes))
        if "goodput_mc" in only:
            from harness.multiprocess import measure_goodput
            summary.update(measure_goodput(a, mc_bytes))
        if "goodput" in only:
            g = goodput(a, goodput_bytes, check)
            summary[f"goodput_{size_label(goodput_bytes)}"] = g["goodput"]
            lost = [s for s in g["steps_lost"] if s is not None]
            summary["steps_lost_max_vs_ram_interval"] = (
                max(lost) / a.ram_every if lost else None)
    finally:
        if own:
            shutil.rmtree(a.workdir, ignore_errors=True)
    emit_summary(BENCH, summary, GOALS, plot=a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
