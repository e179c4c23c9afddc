"""bench/recovery.py's multi-controller cases: survivors in-process, relaunch, goodput.

Real jax.distributed jobs on 127.0.0.1, one process per simulated host, one
data-parallel replica per process ((replica, data, model) mesh; mh's exact
state of resilient_ckpt/testing/multiprocess.py). Each step sleeps --mc-step-s after its work, a
stand-in for the compute of a real step.

- "survivors" (one lost host, 2 processes x 4 devices): process 1 stops
  answering before step 6 and is SIGKILLed; with jax's recoverability
  settings process 0 gets the failure (a lost process that is not in a
  collective is found by jax's heartbeat, --heartbeat-timeout-s; one that is,
  by the collective timeout, --collective-timeout-s), shrinks the replica
  axis and restores from its own RAM tier, in-process
  (bench/_survivors_worker.py). Beside it, in the same repeat, the baseline
  of issue #11: every process relaunched and restored with Orbax's emergency
  CheckpointManager (bench/_relaunch_case.py's run). Both timed from
  the SIGKILL to the first step completed after the restore.
- "goodput_mc": a long run with a host lost every --fail-every steps, in
  three ways: ours in-process (4 processes x 2 devices; processes 3, 2, 1 are
  lost in turn and the survivors go on, since a lost process cannot rejoin a
  running CPU job), ours relaunched (2 processes under the supervisor, process
  1 lost each time with its RAM directory) and Orbax's emergency manager
  relaunched the same way. Goodput = (steps - 1) x the median ordinary step
  time / the wall time from the end of step 1 to the end of the last step,
  on process 0; the cost of one failure is what it adds to the wall time.
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from resilient_ckpt.testing.multiprocess import describe, start_job  # noqa: E402
from resilient_ckpt.testing.relaunch import prepare as prepare_worker  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_survivors_worker.py")
KILL_BEFORE = 6
PHASES = ("health_s", "rebuild_s", "restore_s", "resume_s")
log = logging.getLogger("bench.recovery")


def _env(a) -> dict:
    return {"JAX_ENABLE_RECOVERABILITY": "true",
            "RC_HEARTBEAT_TIMEOUT_S": str(max(1, round(a.heartbeat_timeout_s))),
            "XLA_FLAGS": f"--xla_cpu_collective_timeout_seconds={a.collective_timeout_s:g}"}


def _run_in_process(a, nbytes: int, nprocs: int, victims: dict[int, int], steps: int,
                    local_every: int = 3) -> tuple[list, dict[int, float]]:
    """One in-process job; returns its results and the time each victim was killed."""
    work = tempfile.mkdtemp(prefix="rc-mc-", dir=a.workdir)
    shm = tempfile.mkdtemp(prefix="rc-mc-", dir=a.shm)
    shared = os.path.join(work, "shared")
    os.makedirs(shared)
    mesh = f"{nprocs},{8 // nprocs // 2},2"
    job = start_job(WORKER, nprocs, 8 // nprocs, args=[
        "--dir", shared, "--ram", os.path.join(shm, "ram{pid}"), "--state-bytes", str(nbytes),
        "--mesh", mesh, "--steps", str(steps), "--local-every", str(local_every),
        "--step-sleep", str(a.mc_step_s),
        "--victims", ",".join(f"{i}:{s}" for i, s in victims.items())],
        timeout_s=240 + steps * (a.mc_step_s + 0.2) + nbytes / 2e6, env=_env(a),
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


def measure_survivors(a, nbytes: int, emit, size_label) -> dict:
    """Ours in-process vs Orbax's emergency manager relaunched, interleaved per repeat."""
    import _relaunch_case
    runs: dict[str, list[dict]] = {"resilient_ckpt": [], "orbax_emergency": []}
    for r in range(a.repeats):
        for system in (("resilient_ckpt", "orbax_emergency") if r % 2 == 0
                       else ("orbax_emergency", "resilient_ckpt")):
            if system == "resilient_ckpt":
                out = survivors_once(a, nbytes)
            else:
                out = _relaunch_case.one_run(a, "orbax_emergency", nbytes)
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


def measure_goodput(a, nbytes: int, emit, size_label) -> dict:
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
