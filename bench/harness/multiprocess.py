"""bench's multi-process cases, on resilient_ckpt.testing.multiprocess and .relaunch.

Real jax.distributed jobs on 127.0.0.1, one process per simulated host
(mh's exact state of resilient_ckpt/testing/multiprocess.py).

multihost.py's jobs (`job`, `record`): a 2-process job saves or restores
with one system in a worker (`MULTIHOST_WORKER`), every process's times,
peak memory (harness.measure.PeakRss) and exactness reported back.

recovery.py's multi-process cases:

- "relaunch_lost_host" (`measure_relaunch`): a lost host in a 2-process job
  (2 processes x 4 CPU devices, a (replica=2, data=2, model=2) mesh, one
  replica per process, so Orbax's emergency manager runs on the same state),
  run under `resilient_ckpt.elastic.supervisor`. The training script is
  resilient_ckpt/testing/relaunch.py's worker: each step is saved to the
  host's own directory under /dev/shm and every 3 steps to the shared one.
  After step 5, process 1 is SIGKILLed and its /dev/shm directory removed (a
  lost host); the supervisor ends process 0 (SIGTERM, SIGKILL after
  --grace-s), starts a fresh pair, and each restores the newest step it can.
  A run is the time from the SIGKILL to the end of the first step after the
  restore (the slowest process's); its phases: detect (the supervisor sees
  the death), end (the survivor ended by SIGTERM: jobenv.initialize takes it
  back from jax.distributed's preemption notifier; SIGKILL only after
  --grace-s), start (the fresh pair spawned), init (interpreter, imports,
  jax.distributed formed), open (the manager opened), restore, first_step.
  Systems, interleaved per repeat: resilient_ckpt (RamTier per host, every
  step, + shared LocalTier; host 1's share comes from host 0's RAM replica,
  device to device) and orbax_emergency (Orbax's emergency CheckpointManager,
  the same two directories as its local and persistent ones; with host 1's
  local copy gone it restores the persistent step).
- "survivors" (`measure_survivors`; one lost host, 2 processes x 4 devices):
  process 1 stops answering before step 6 and is SIGKILLed; with jax's
  recoverability settings process 0 gets the failure (a lost process that
  is not in a collective is found by jax's heartbeat, --heartbeat-timeout-s;
  one that is, by the collective timeout, --collective-timeout-s), shrinks
  the replica axis and restores from its own RAM tier, in-process
  (survivors_worker.py beside this file). Beside it, in the same repeat, the
  baseline of issue #11: every process relaunched and restored with Orbax's
  emergency CheckpointManager (the relaunch case's run). Both timed from the
  SIGKILL to the first step completed after the restore. Each step sleeps
  --mc-step-s after its work, a stand-in for the compute of a real step.
- "goodput_mc" (`measure_goodput`): a long run with a host lost every
  --fail-every steps, in three ways: ours in-process (4 processes x 2
  devices; processes 3, 2, 1 are lost in turn and the survivors go on, since
  a lost process cannot rejoin a running CPU job), ours relaunched (2
  processes under the supervisor, process 1 lost each time with its RAM
  directory) and Orbax's emergency manager relaunched the same way. Goodput
  = (steps - 1) x the median ordinary step time / the wall time from the end
  of step 1 to the end of the last step, on process 0; the cost of one
  failure is what it adds to the wall time.
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time

from resilient_ckpt.testing.multiprocess import describe, run_job, start_job
from resilient_ckpt.testing.relaunch import prepare as prepare_worker

from .options import BENCH_DIR, size_label
from .report import emit

HERE = os.path.dirname(os.path.abspath(__file__))
SURVIVORS_WORKER = os.path.join(HERE, "survivors_worker.py")
KILL_BEFORE = 6
PHASES = ("health_s", "rebuild_s", "restore_s", "resume_s")
SYSTEMS = ("resilient_ckpt", "orbax_emergency")
KILL_AFTER, LOCAL_EVERY = 5, 3
log = logging.getLogger("bench.recovery")


# ---------------------------------------------------------------- multihost.py's jobs

NPROCS, DEVICES, MESH = 2, 4, "2,2,2"  # (replica, data, model), one replica a process
MULTIHOST_WORKER = r'''
import argparse, collections, os, shutil, sys, time
import mh
ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--system", required=True)
p.add_argument("--phase", required=True, choices=["save", "restore"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lose", action="store_true")
p.add_argument("--bench", required=True)  # bench/, for harness.measure
o = p.parse_args(ctx.extra)
sys.path.insert(0, o.bench)
from harness.measure import PeakRss


def manager(abstract):
    if o.system == "resilient_ckpt":
        return mh.ours(ctx, ram_every=1, ram_keep=2, local_every=3, local_keep=2)
    if o.system == "orbax":
        return mh.orbax(ctx, every=1, keep=2)
    return mh.orbax_emergency(ctx, ctx.ram, ctx.dir, abstract, local_every=1, local_keep=2,
                              persistent_every=3, persistent_keep=2)


def save_args(state):
    import orbax.checkpoint as ocp
    if o.system == "resilient_ckpt":
        return ocp.args.StandardSave(state)
    if o.system == "orbax":
        return ocp.args.StandardSave(mh.orbax_state(state))
    return ocp.args.Composite(state=ocp.args.PyTreeSave(mh.orbax_state(state)))


def restore(mngr, abstract):
    import orbax.checkpoint as ocp
    out = {"latest": mngr.latest_step()}
    mh.barrier("restore-start")
    peak = PeakRss().__enter__()  # to the restored state's check: it is alive then
    t = time.perf_counter()
    if o.system == "resilient_ckpt":
        state = mngr.restore(None, args=ocp.args.StandardRestore(abstract))
        rec = mngr.last_restore
        out["step"] = rec.step
        out["bytes_by_tier"] = {k: int(v) for k, v in rec.bytes_by_tier.items()}
    elif o.system == "orbax":
        state = mh.from_orbax(mngr.restore(
            out["latest"], args=ocp.args.StandardRestore(mh.orbax_abstract(abstract))))
        out["step"] = out["latest"]
    else:
        state = mh.from_orbax(mngr.restore(out["latest"]).state)
        out["step"] = out["latest"]
    import jax
    jax.block_until_ready(state)
    out["seconds"] = time.perf_counter() - t
    peak.__exit__(None, None, None)
    out["peak_extra_bytes"] = peak.extra
    out["mismatches"] = len(ctx.check_exact(state, out["step"]))
    del state
    return out


def run(ctx):
    import jax
    abstract = ctx.abstract()
    out = {"pid": ctx.pid, "target_bytes": ctx.target_bytes(abstract)}
    if o.phase == "save":
        mngr = manager(abstract)
        state = ctx.initial_state()
        times, peaks = [], []
        for k in range(1, o.steps + 1):
            state = jax.block_until_ready(ctx.train_step(state, k))
            mh.barrier(f"save-{k}")
            with PeakRss() as peak:  # the save and its writes, the state alive before
                t = time.perf_counter()
                mngr.save(k, args=save_args(state))
                times.append(time.perf_counter() - t)
                mngr.wait_until_finished()
            peaks.append(peak.extra)
        mh.barrier("saved")
        out["save_s"], out["save_peak_extra_bytes"] = times, peaks
        mngr.close()
        mh.report(out)
        return
    mngr = manager(abstract)
    out["restore"] = restore(mngr, abstract)
    if o.lose:
        mngr.close()
        mh.barrier("lose")
        if ctx.pid == 1:  # host 1 lost what it held locally
            shutil.rmtree(ctx.ram, ignore_errors=True)
            if o.system == "orbax_emergency":
                os.makedirs(ctx.ram)  # its manager wants the directory to exist
        mh.barrier("lost")
        mngr = manager(abstract)
        out["lost"] = restore(mngr, abstract)
    mngr.close()
    mh.report(out)


mh.main(run, ctx)
'''


def job(workdir: str, shm: str, system: str, phase: str, nbytes: int, lose: bool = False,
        devices: int = DEVICES, mesh: str = MESH):
    """One 2-process job; returns (reports per process, error or None)."""
    args = ["--dir", os.path.join(workdir, "shared"), "--ram", os.path.join(shm, "ram{pid}"),
            "--mesh", mesh, "--state-bytes", str(nbytes), "--system", system,
            "--phase", phase, "--bench", BENCH_DIR
            ] + (["--lose"] if lose else [])
    timeout = 120 + nbytes / 5e6  # a generous bound: 1 GB gets 5+ minutes
    try:
        res = run_job(MULTIHOST_WORKER, NPROCS, devices, args, timeout_s=timeout, fail_fast_s=15)
    except AssertionError as e:  # the harness's hard timeout
        return None, f"timeout: {str(e)[:1500]}"
    reports = [r.last("pid") for r in res]
    errors = [r.last("error") for r in res if r.last("error")]
    if errors:
        return reports, errors[0]["error"][-1500:]
    if not all(r.ok for r in res) or not all(reports):
        return reports, describe(res, 1200)[-2500:]
    return reports, None


def restore_run(system: str, reports: list, key: str) -> tuple[dict, float, list]:
    """One restore of a job's processes (`key` in their reports): its record
    (the steps, whether they agree and every value is exact; for ours the bytes
    by tier, from the shared tier and from peers, host 1's share, and the most a
    process read over its share), the slowest process's seconds and every
    process's peak."""
    rs = [r[key] for r in reports]
    steps = [r["step"] for r in rs]
    info = {"steps": steps, "agree": len(set(steps)) == 1,
            "exact": all(r["mismatches"] == 0 for r in rs)}
    if system == "resilient_ckpt":
        tiers = [r.get("bytes_by_tier", {}) for r in rs]
        info["bytes_by_tier"] = tiers
        info["shared_bytes"] = sum(t.get("local", 0) for t in tiers)
        info["peer_bytes"] = sum(t.get("peers", 0) for t in tiers)
        info["lost_share"] = reports[1]["target_bytes"]
        info["read_vs_share"] = round(max(
            sum(t.values()) / p["target_bytes"]
            for t, p in zip(tiers, reports, strict=True) if p["target_bytes"]), 4)
    return info, max(r["seconds"] for r in rs), [r["peak_extra_bytes"] for r in rs]


def record(sink: tuple, system: str, case: str, reports: list, key: str) -> bool:
    """Adds one restore run of `case` to `sink` (runs, extra, errors, peaks,
    each by (system, case)); whether it was right."""
    runs, extra, errors, peaks = sink
    info, seconds, run_peaks = restore_run(system, reports, key)
    extra[(system, case)].append(info)
    if not (info["agree"] and info["exact"]):
        errors[(system, case)].append(
            f"processes restored steps {info['steps']}, exact: {info['exact']}")
        return False
    runs[(system, case)].append(seconds)
    peaks[(system, case)] += run_peaks
    return True


# ---------------------------------------------------------------- recovery.py: relaunch

def one_run(a, system: str, nbytes: int) -> dict:
    """One supervised job, one lost host: the relaunch record and its time from the kill."""
    from resilient_ckpt.elastic.supervisor import Supervisor, format_relaunches
    work = tempfile.mkdtemp(prefix=f"rc-relaunch-{system}-", dir=a.workdir)
    shm = tempfile.mkdtemp(prefix=f"rc-relaunch-{system}-", dir=a.shm)
    shared = os.path.join(work, "shared")
    os.makedirs(shared)
    argv, env = prepare_worker(os.path.join(work, "job"))
    argv += ["--dir", shared, "--ram", os.path.join(shm, "ram{pid}"), "--devices", "4",
             "--mesh", "2,2,2", "--state-bytes", str(nbytes), "--steps", str(KILL_AFTER + 3),
             "--local-every", str(LOCAL_EVERY), "--step-sleep", "0.2",
             "--system", "ours" if system == "resilient_ckpt" else system]

    def lose_host(rec) -> None:
        for i in rec.failed:
            shutil.rmtree(os.path.join(shm, f"ram{i}"), ignore_errors=True)

    sup = Supervisor(argv, 2, max_restarts=1, grace_s=a.grace_s, env=env,
                     log_dir=os.path.join(work, "logs"), before_relaunch=lose_host,
                     deadline_s=300 + nbytes / 5e6)
    try:
        sup.start()
        if not sup.wait_for_step(KILL_AFTER, process=1, timeout=240 + nbytes / 5e6):
            sup.wait()
            raise RuntimeError(f"{system}: process 1 never reached step {KILL_AFTER}")
        t_kill = sup.kill(1)
        rc = sup.wait()
        rec = sup.timeline[0] if sup.timeline else None
        if rc != 0 or rec is None or rec.first_step_t is None:
            raise RuntimeError(f"{system}: the relaunched job failed (exit {rc}):\n"
                               f"{format_relaunches(sup.timeline)}\nlogs: {work}/logs")
        fresh = sup.reports()[-1]
        exact = [r for rs in fresh for r in rs if r["event"] in ("checked", "final")]
        # The harness's exactness check sits between the restore and the first
        # step: its time (the slowest process's) is not the recovery's.
        check = max(next(r["check_s"] for r in rs if r["event"] == "checked") for rs in fresh)

        def at(event: str) -> float:  # the slowest process's report of it
            return max(next(r["t"] for r in rs if r["event"] == event) for rs in fresh)
        return {"total_s": rec.first_step_t - t_kill - check,
                "detect_s": rec.detected_t - t_kill,
                "end_s": rec.since(rec.ended_t), "start_s": rec.relaunched_t - rec.ended_t,
                "init_s": at("initialized") - rec.relaunched_t,
                "open_s": at("opened") - at("initialized"),
                "restore_s": rec.restored_t - at("opened"),
                "first_step_s": rec.first_step_t - rec.restored_t - check, "check_s": check,
                "steps_lost": rec.steps_lost, "restored_step": rec.restored_step,
                "restored_from": rec.restored_from,
                "exact": all(r["mismatches"] == 0 for r in exact), "_work": work}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def measure_relaunch(a, nbytes: int) -> dict:
    """Both systems, interleaved per repeat; emits a line per system; returns the summary part."""
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    errors: dict[str, list[str]] = {s: [] for s in SYSTEMS}
    for r in range(a.repeats):
        order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
        for system in order:
            try:
                out = one_run(a, system, nbytes)
            except RuntimeError as e:
                errors[system].append(str(e)[-2000:])
                log.info("%s relaunch %s repeat %d failed", size_label(nbytes), system, r)
                continue
            shutil.rmtree(out.pop("_work"), ignore_errors=True)
            runs[system].append(out)
            log.info("%s relaunch %s repeat %d: %.3f s, restored step %s", size_label(nbytes),
                     system, r, out["total_s"], out["restored_step"])
    medians = {}
    for system, outs in runs.items():
        totals = [o["total_s"] for o in outs]
        phases = {k: statistics.median([o[k] for o in outs])
                  for k in ("detect_s", "end_s", "start_s", "init_s", "open_s", "restore_s",
                            "first_step_s", "check_s")
                  if outs}
        line = {"bench": "recovery", "system": system, "case": "relaunch_lost_host",
                "size": size_label(nbytes), "bytes": nbytes, "processes": 2, "devices": 8,
                "mesh": "replica=2,data=2,model=2", "grace_s": a.grace_s,
                "runs_s": totals, "median_s": statistics.median(totals) if totals else None,
                "phases_median_s": phases, "steps_lost": [o["steps_lost"] for o in outs],
                "restored_step": [o["restored_step"] for o in outs],
                "exact": all(o["exact"] for o in outs),
                "restored_from": outs[-1]["restored_from"] if outs else None}
        if errors[system]:
            line["error"], line["errors"] = errors[system][0], len(errors[system])
        emit(line)
        medians[system] = line["median_s"]
    ours, em = medians["resilient_ckpt"], medians["orbax_emergency"]
    label = size_label(nbytes)
    both = bool(ours and em)
    return {f"relaunch_lost_host_fraction_of_orbax_emergency_{label}": ours / em if both else None,
            f"relaunch_lost_host_speedup_vs_orbax_emergency_{label}": em / ours if both else None}


# ------------------------------------------------------------ recovery.py: survivors, goodput_mc

def _env(a) -> dict:
    return {"JAX_ENABLE_RECOVERABILITY": "true",
            "XLA_FLAGS": f"--xla_cpu_collective_timeout_seconds={a.collective_timeout_s:g}"}


def _run_in_process(a, nbytes: int, nprocs: int, victims: dict[int, int], steps: int,
                    local_every: int = 3) -> tuple[list, dict[int, float]]:
    """One in-process job; returns its results and the time each victim was killed."""
    work = tempfile.mkdtemp(prefix="rc-mc-", dir=a.workdir)
    shm = tempfile.mkdtemp(prefix="rc-mc-", dir=a.shm)
    shared = os.path.join(work, "shared")
    os.makedirs(shared)
    mesh = f"{nprocs},{8 // nprocs // 2},2"
    job = start_job(SURVIVORS_WORKER, nprocs, 8 // nprocs, args=[
        "--dir", shared, "--ram", os.path.join(shm, "ram{pid}"), "--state-bytes", str(nbytes),
        "--mesh", mesh, "--steps", str(steps), "--local-every", str(local_every),
        "--step-sleep", str(a.mc_step_s),
        "--victims", ",".join(f"{i}:{s}" for i, s in victims.items())],
        timeout_s=240 + steps * (a.mc_step_s + 0.2) + nbytes / 2e6, env=_env(a),
        heartbeat_timeout_s=max(1, round(a.heartbeat_timeout_s)),
        workdir=os.path.join(work, "job"), fail_fast_s=30)
    killed: dict[int, float] = {}
    try:
        for i in sorted(victims, key=victims.get):
            if job.wait_for(i, "dying"):
                killed[i] = time.time()
                job.kill(i)
        results = job.collect()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    ok = all(r.rc == 0 and r.last("event", "final") for r in results if r.index not in victims)
    if not ok or len(killed) != len(victims):
        raise RuntimeError(f"in-process job failed; logs in {work}:\n{describe(results, 1500)}")
    shutil.rmtree(work, ignore_errors=True)
    return results, killed


def survivors_once(a, nbytes: int) -> dict:
    results, killed = _run_in_process(a, nbytes, 2, {1: KILL_BEFORE}, KILL_BEFORE + 3)
    r0 = results[0].results
    final = r0[-1]
    [ev] = final["events"]
    restored = next(r for r in r0 if r["event"] == "restored")
    first = next(r for r in r0 if r["event"] == "step" and r["t"] > restored["t"])
    t_kill, check = killed[1], restored["check_s"]  # the harness's check is not recovery
    return {"total_s": first["t"] - t_kill - check,
            "detect_s": first["t"] - t_kill - (ev["health_s"] + ev["rebuild_s"] +
                                               ev["restore_s"] + ev["resume_s"]),
            "health_s": ev["health_s"], "rebuild_s": ev["rebuild_s"],
            "restore_s": ev["restore_s"], "resume_s": ev["resume_s"] - check,
            "check_s": check,
            "restored_step": ev["restored_step"], "steps_lost": ev["steps_lost"],
            "restored_from": ev["restored_from"],
            "exact": restored["mismatches"] == 0 and final["mismatches"] == 0}


def measure_survivors(a, nbytes: int) -> dict:
    """Ours in-process vs Orbax's emergency manager relaunched, interleaved per repeat."""
    runs: dict[str, list[dict]] = {"resilient_ckpt": [], "orbax_emergency": []}
    for r in range(a.repeats):
        for system in (("resilient_ckpt", "orbax_emergency") if r % 2 == 0
                       else ("orbax_emergency", "resilient_ckpt")):
            if system == "resilient_ckpt":
                out = survivors_once(a, nbytes)
            else:
                out = one_run(a, "orbax_emergency", nbytes)
                shutil.rmtree(out.pop("_work"), ignore_errors=True)
            runs[system].append(out)
            log.info("%s survivors %s repeat %d: %.3f s", size_label(nbytes), system, r,
                     out["total_s"])
    medians = {}
    for system, outs in runs.items():
        keys = [k for k in outs[0] if k.endswith("_s")]
        line = {"bench": "recovery", "system": system,
                "case": "survivors_in_process" if system == "resilient_ckpt"
                else "relaunch_lost_host", "size": size_label(nbytes), "bytes": nbytes,
                "processes": 2, "devices": 8, "mesh": "replica=2,data=2,model=2",
                "collective_timeout_s": a.collective_timeout_s,
                "heartbeat_timeout_s": a.heartbeat_timeout_s, "step_sleep_s": a.mc_step_s,
                "runs_s": [o["total_s"] for o in outs],
                "median_s": statistics.median(o["total_s"] for o in outs),
                "phases_median_s": {k: statistics.median(o[k] for o in outs)
                                    for k in keys if k != "total_s"},
                "steps_lost": [o["steps_lost"] for o in outs],
                "restored_step": [o["restored_step"] for o in outs],
                "exact": all(o["exact"] for o in outs), "restored_from": outs[-1]["restored_from"]}
        emit(line)
        medians[system] = line
    ours, em = medians["resilient_ckpt"], medians["orbax_emergency"]
    label = size_label(nbytes)
    after = ours["median_s"] - ours["phases_median_s"]["detect_s"]
    return {f"survivors_fraction_of_orbax_emergency_relaunch_{label}":
            ours["median_s"] / em["median_s"],
            f"survivors_after_detection_fraction_of_orbax_emergency_relaunch_{label}":
            after / em["median_s"]}


# ---------------------------------------------------------------- goodput

def _goodput(steps: list[tuple[int, float]], restarts: list[float],
             checks_s: float = 0.0) -> dict:
    """From process 0's (step, time) reports in order, with the times at which a
    failure struck: goodput, the median ordinary step and each failure's cost.
    `checks_s`: the harness's own exactness checks after the restores, taken
    off the wall time (they are not recovery)."""
    last: dict[int, float] = {}
    for s, t in steps:
        last[s] = t        # a replayed step: its last completion is the kept one
    n = max(last)
    ordinary = [t1 - t0 for (s0, t0), (s1, t1) in zip(steps, steps[1:], strict=False)
                if s1 == s0 + 1 and not any(t0 < f < t1 for f in restarts)]
    med = statistics.median(ordinary)
    wall = last[n] - last[1] - checks_s
    useful = (n - 1) * med
    return {"goodput": useful / wall, "wall_s": wall, "useful_s": useful,
            "median_step_s": med, "steps": n,
            "cost_per_failure_s": (wall - useful) / max(len(restarts), 1)}


def _first_after(reports: list[dict], restored: dict) -> dict:
    """The first step completed after a restore: from the restore, and its save's part."""
    first = next(r for r in reports if r["event"] == "step" and r["t"] > restored["t"])
    return {"s": round(first["t"] - restored["t"] - restored["check_s"], 3),
            "save_s": round(first["save_s"], 3)}


def goodput_in_process(a, nbytes: int) -> dict:
    f = a.fail_every
    victims = {3: f, 2: 2 * f, 1: 3 * f}
    results, killed = _run_in_process(a, nbytes, 4, victims, 3 * f + f // 2,
                                      local_every=a.mc_local_every)
    r0 = results[0].results
    steps = [(r["step"], r["t"]) for r in r0 if r["event"] == "step"]
    evs = r0[-1]["events"]
    restores = [r for r in r0 if r["event"] == "restored"]
    out = _goodput(steps, sorted(killed.values()), sum(r["check_s"] for r in restores))
    out.update({"failures": len(evs), "steps_lost": [e["steps_lost"] for e in evs],
                "restored_from": [e["restored_from"] for e in evs],
                "exact": r0[-1]["mismatches"] == 0, "processes": "4->3->2->1",
                "phases_s": [{k: round(e[k], 3) for k in PHASES} for e in evs],
                "built_ahead": [r["built_ahead"] for r in restores],
                "program_wait_s": [round(r["program_s"], 3) for r in restores],
                "first_step_after_restore": [_first_after(r0, r) for r in restores]})
    return out


def goodput_relaunch(a, nbytes: int, system: str) -> dict:
    from resilient_ckpt.elastic.supervisor import Supervisor, format_relaunches
    f, failures = a.fail_every, 3
    work = tempfile.mkdtemp(prefix=f"rc-mc-{system}-", dir=a.workdir)
    shm = tempfile.mkdtemp(prefix=f"rc-mc-{system}-", dir=a.shm)
    shared = os.path.join(work, "shared")
    os.makedirs(shared)
    argv, env = prepare_worker(os.path.join(work, "job"))
    total = failures * f + f // 2
    argv += ["--dir", shared, "--ram", os.path.join(shm, "ram{pid}"), "--devices", "4",
             "--mesh", "2,2,2", "--state-bytes", str(nbytes), "--steps", str(total),
             "--local-every", str(a.mc_local_every), "--step-sleep", str(a.mc_step_s),
             "--system", "ours" if system == "resilient_ckpt" else system]

    def lose_host(rec) -> None:
        for i in rec.failed:
            shutil.rmtree(os.path.join(shm, f"ram{i}"), ignore_errors=True)

    limit = 300 + total * (a.mc_step_s + 0.2) + nbytes / 2e6
    sup = Supervisor(argv, 2, max_restarts=failures, grace_s=a.grace_s, env=env,
                     log_dir=os.path.join(work, "logs"), before_relaunch=lose_host,
                     deadline_s=limit)
    kills: list[float] = []
    try:
        sup.start()
        for k in range(failures):
            if not sup.wait_for_step((k + 1) * f, process=1, attempt=k, timeout=limit):
                break
            kills.append(time.time())
            sup.kill(1)
        rc = sup.wait()
        if rc != 0 or len(kills) != failures:
            raise RuntimeError(f"{system}: goodput job failed (exit {rc}):\n"
                               f"{format_relaunches(sup.timeline)}\nlogs: {work}/logs")
        reports = sup.reports()
        steps = [(r["step"], r["t"]) for launch in reports for r in launch[0]
                 if r["event"] == "step"]
        final = [r for r in reports[-1][0] if r["event"] == "final"]
        # Per relaunch, the slowest process's check of the restored state.
        checks = [max((r["check_s"] for r in rs if r["event"] == "checked"), default=0.0)
                  for launch in reports[1:] for rs in [sum(launch, [])]]
        checked = [r for launch in reports[1:] for rs in launch for r in rs
                   if r["event"] == "checked"]
        out = _goodput(steps, kills, sum(checks))
        out.update({"failures": len(kills), "steps_lost": [r.steps_lost for r in sup.timeline],
                    "restored_step": [r.restored_step for r in sup.timeline],
                    "exact": bool(final) and final[0]["mismatches"] == 0
                    and all(r["mismatches"] == 0 for r in checked), "processes": 2})
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    return out


def measure_goodput(a, nbytes: int) -> dict:
    summary = {}
    label = size_label(nbytes)
    for system, mode, fn in (
            ("resilient_ckpt", "in_process", lambda: goodput_in_process(a, nbytes)),
            ("resilient_ckpt", "relaunch", lambda: goodput_relaunch(a, nbytes, "resilient_ckpt")),
            ("orbax_emergency", "relaunch",
             lambda: goodput_relaunch(a, nbytes, "orbax_emergency"))):
        try:
            out = fn()
        except RuntimeError as e:
            emit({"bench": "recovery", "system": system, "case": f"goodput_{mode}",
                  "size": label, "error": str(e)[-3000:]})
            continue
        emit({"bench": "recovery", "system": system, "case": f"goodput_{mode}", "size": label,
              "bytes": nbytes, "fail_every": a.fail_every, "step_sleep_s": a.mc_step_s,
              "collective_timeout_s": a.collective_timeout_s,
              "heartbeat_timeout_s": a.heartbeat_timeout_s, "local_every": a.mc_local_every, **out})
        if system != "resilient_ckpt":
            summary[f"orbax_emergency_goodput_{mode}_{label}"] = out["goodput"]
            continue
        summary[f"goodput_{mode}_{label}"] = out["goodput"]
        lost = [s for s in out["steps_lost"] if s is not None]
        # The RAM tier saves every step (interval 1).
        summary[f"steps_lost_max_vs_ram_interval_{mode}"] = max(lost) if lost else None
    return summary
