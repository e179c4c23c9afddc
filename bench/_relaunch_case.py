"""bench/recovery.py's "relaunch" case: a lost host in a 2-process job, the whole set relaunched.

Two jax.distributed processes x 4 CPU devices on 127.0.0.1, a (replica=2,
data=2, model=2) mesh (one replica per process, so Orbax's emergency manager
runs on the same state), run under `resilient_ckpt.elastic.supervisor`. The
training script is resilient_ckpt/testing/relaunch.py's worker: each step is saved to the
host's own directory under /dev/shm and every --local-every (3) steps to the
shared one. After step 5, process 1 is SIGKILLed and its /dev/shm directory
removed (a lost host); the supervisor ends process 0 (SIGTERM, SIGKILL after
--grace-s), starts a fresh pair, and each restores the newest step it can.
A run is the time from the SIGKILL to the end of the first step after the
restore (the slowest process's); its phases: detect (the supervisor sees the
death), end (the survivor ended by SIGTERM: jobenv.initialize takes it back
from jax.distributed's preemption notifier; SIGKILL only after --grace-s),
start (the fresh pair
spawned), init (interpreter, imports, jax.distributed formed), open (the
manager opened), restore, first_step. Systems, interleaved per repeat:

- resilient_ckpt: RamTier per host (every step) + shared LocalTier; host 1's
  share comes from host 0's RAM replica, device to device;
- orbax_emergency: Orbax's emergency CheckpointManager, the same two
  directories as its local and persistent ones; with host 1's local copy
  gone it restores the persistent step.
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from resilient_ckpt.testing.relaunch import prepare as prepare_worker  # noqa: E402

SYSTEMS = ("resilient_ckpt", "orbax_emergency")
KILL_AFTER, LOCAL_EVERY = 5, 3
log = logging.getLogger("bench.recovery")


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


def measure(a, nbytes: int, emit, size_label) -> dict:
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
