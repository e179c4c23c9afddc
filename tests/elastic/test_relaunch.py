"""Relaunch recovery: a fresh set of processes restores from the survivors' RAM and the shared tier.

The supervisor (`resilient_ckpt.elastic.supervisor`) runs real jax.distributed
jobs on 127.0.0.1: 2 processes x 4 CPU devices, or 4 x 2, on a (replica=2,
data=2, model=2) mesh, so each host's shards also live on a host of the other
replica. Each process has its own RAM-tier directory (every step, keep 2)
and all share one local tier (every 4th step). Process 1 is SIGKILLed mid-run
and, as a lost host loses its /dev/shm, its RAM directory is removed before
the supervisor relaunches the set; the fresh job restores the newest step,
the lost host's share from its peers' replicas or the shared tier, and
trains on. The state's arithmetic is exact (resilient_ckpt/testing/multiprocess.py), so the
restored step and the final one are compared bit for bit with the values of
an uninterrupted run of the same steps.

The first tests drive the supervisor with tiny scripts (no jax): relaunch,
giving up, SIGKILL after the grace period, the variables each process gets.
"""
from __future__ import annotations

import os
import shutil
import sys
import textwrap

import pytest

from resilient_ckpt.elastic import jobenv  # noqa: E402
from resilient_ckpt.elastic.supervisor import Supervisor, SupervisorError, format_relaunches
from resilient_ckpt.testing.relaunch import prepare

STEPS, LOCAL_EVERY, KILL_AFTER = 16, 4, 6


def _script(tmp_path, body: str) -> list[str]:
    path = tmp_path / "s.py"
    path.write_text("import os, sys, time\nfrom resilient_ckpt.elastic import jobenv\n"
                    "job = jobenv.from_env()\n" + textwrap.dedent(body))
    return [sys.executable, str(path)]


# ---------------------------------------------------------------- the supervisor alone

def test_a_failed_process_ends_its_peers_and_the_set_is_relaunched(tmp_path):
    argv = _script(tmp_path, """
        jobenv.report(job, "step", 1, coordinator=job.coordinator, pid=job.process_id,
                      n=job.num_processes)
        if job.attempt == 0:
            if job.process_id == 1:
                sys.exit(3)
            time.sleep(60)  # ended by the supervisor's SIGTERM
    """)
    sup = Supervisor(argv, 3, max_restarts=2, grace_s=10, workdir=str(tmp_path / "w"),
                     deadline_s=60)
    assert sup.run() == 0
    assert len(sup.timeline) == 1, format_relaunches(sup.timeline)
    rec = sup.timeline[0]
    assert rec.attempt == 0 and rec.failed == {1: "exit 3"} and rec.forced == ()
    assert rec.relaunched_t is not None and rec.first_step == 1
    launches = sup.reports()
    assert len(launches) == 2
    # In the first launch a peer may be ended before it reported (process 1
    # exits at once); the relaunched set runs to its end.
    for reps in launches:
        assert len(reps) == 3
        assert [r[0]["pid"] for r in reps if r] == [q for q, r in enumerate(reps) if r]
        assert {r[0]["n"] for r in reps if r} == {3}
        assert len({r[0]["coordinator"] for r in reps if r}) == 1
    assert all(launches[1]), launches[1]
    assert [p.returncode for p in sup.launches[0].procs] == [-15, 3, -15]


def test_restarts_run_out(tmp_path):
    argv = _script(tmp_path, "sys.exit(5 if job.process_id == 0 else 0)\n")
    sup = Supervisor(argv, 2, max_restarts=1, workdir=str(tmp_path / "w"), deadline_s=60)
    assert sup.run() == 5
    assert [r.attempt for r in sup.timeline] == [0, 1]
    assert sup.timeline[-1].relaunched_t is None


def test_a_directory_of_its_own_is_removed_at_the_end(tmp_path):
    argv = _script(tmp_path, """
        jobenv.report(job, "step", 1)
        sys.exit(5 if job.attempt == 0 and job.process_id == 1 else 0)
    """)
    sup = Supervisor(argv, 2, max_restarts=1, deadline_s=60)
    assert os.path.isdir(sup.workdir)
    assert sup.run() == 0
    assert [r.attempt for r in sup.timeline] == [0]  # one relaunch, its reports kept
    assert all(sup.reports()[1]), sup.reports()
    assert not os.path.exists(sup.workdir)


@pytest.mark.slow  # waits out the grace period
def test_a_process_deaf_to_sigterm_is_killed_after_the_grace(tmp_path):
    argv = _script(tmp_path, """
        import signal
        if job.attempt == 0 and job.process_id == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            jobenv.report(job, "step", 0)
            time.sleep(60)
        if job.attempt == 0:
            while not os.path.exists(job.status.replace("proc1", "proc0")):
                time.sleep(0.01)
            os.kill(os.getpid(), 9)
    """)
    sup = Supervisor(argv, 2, max_restarts=1, grace_s=0.5, workdir=str(tmp_path / "w"),
                     deadline_s=60)
    assert sup.run() == 0
    assert sup.timeline[0].failed == {1: "SIGKILL"} and sup.timeline[0].forced == (0,)


def test_the_deadline_ends_every_process(tmp_path):
    sup = Supervisor(_script(tmp_path, "time.sleep(60)\n"), 2, workdir=str(tmp_path / "w"),
                     deadline_s=1, grace_s=1)
    with pytest.raises(SupervisorError, match="deadline"):
        sup.run()
    assert all(p.poll() is not None for p in sup.launches[0].procs)


def test_the_command_line_relaunches_and_prints_the_timeline(tmp_path):
    import json
    import subprocess
    argv = _script(tmp_path, "sys.exit(7 if job.attempt == 0 and job.process_id == 1 else 0)\n")
    out = subprocess.run([sys.executable, "-m", "resilient_ckpt.elastic.supervisor",
                          "--processes", "2", "--max-restarts", "1", "--grace-s", "1",
                          "--timeline", str(tmp_path / "t.json"), "--", *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "process 1 exit 7" in out.stderr and "fresh processes started" in out.stderr
    [rec] = json.loads((tmp_path / "t.json").read_text())
    assert rec["failed"] == {"1": "exit 7"} and rec["attempt"] == 0


def test_jobenv_reads_the_contract_whole_or_not_at_all():
    assert not jobenv.from_env({}).supervised
    job = jobenv.from_env({jobenv.COORDINATOR: "127.0.0.1:5", jobenv.NUM_PROCESSES: "2",
                           jobenv.PROCESS_ID: "1", jobenv.ATTEMPT: "3"})
    assert (job.coordinator, job.num_processes, job.process_id, job.attempt) == (
        "127.0.0.1:5", 2, 1, 3)
    with pytest.raises(ValueError, match="together"):
        jobenv.from_env({jobenv.COORDINATOR: "127.0.0.1:5"})
    with pytest.raises(ValueError, match="not in"):
        jobenv.from_env({jobenv.COORDINATOR: "h:1", jobenv.NUM_PROCESSES: "2",
                         jobenv.PROCESS_ID: "2"})


# ---------------------------------------------------------------- relaunch of a real job

def _logs(sup: Supervisor) -> str:
    out = []
    for name in sorted(os.listdir(sup.log_dir or ".")):
        with open(os.path.join(sup.log_dir or ".", name), errors="replace") as f:
            lines = [ln for ln in f.read().splitlines()
                     if not (len(ln) > 1 and ln[0] in "IW" and ln[1:5].isdigit())]
        out.append(f"--- {name}\n" + "\n".join(lines[-25:]))
    return "\n".join(out)


@pytest.mark.parametrize("nprocs,devices", [
    pytest.param(2, 4, id="2proc"), pytest.param(4, 2, id="4proc", marks=pytest.mark.slow)])
@pytest.mark.multiprocess
def test_lost_host_relaunch_resumes_exactly(hosts, nprocs, devices):
    argv, env = prepare(os.path.join(hosts["work"], "job"))
    argv += ["--dir", hosts["dir"], "--ram", hosts["ram"], "--devices", str(devices),
             "--steps", str(STEPS), "--local-every", str(LOCAL_EVERY), "--step-sleep", "0.1"]
    victim = 1

    def lose_host(rec):  # a lost host loses its /dev/shm; the survivors keep theirs
        for i in rec.failed:
            shutil.rmtree(hosts["ram_of"](i), ignore_errors=True)

    sup = Supervisor(argv, nprocs, max_restarts=1, grace_s=2, env=env,
                     log_dir=os.path.join(hosts["work"], "logs"), before_relaunch=lose_host,
                     deadline_s=150)
    sup.start()
    reached = sup.wait_for_step(KILL_AFTER, process=victim, timeout=120)
    if reached:
        sup.kill(victim)
    rc = sup.wait()
    what = f"{format_relaunches(sup.timeline)}\n{_logs(sup)}"
    print(f"\n{nprocs} processes:\n{format_relaunches(sup.timeline)}")
    assert reached, f"process {victim} never reported step {KILL_AFTER}\n{what}"
    assert rc == 0 and len(sup.timeline) == 1, what
    rec = sup.timeline[0]
    assert rec.failed == {victim: "SIGKILL"}, what
    # jobenv.initialize gives SIGTERM back its default under the supervisor
    # (jax's preemption notifier would swallow it): no survivor waits for SIGKILL.
    assert rec.forced == (), f"survivors needed SIGKILL after the grace: {rec.forced}\n{what}"
    assert rec.last_step is not None and KILL_AFTER <= rec.last_step < STEPS, what

    launches = sup.reports()
    assert len(launches) == 2, what
    restored = [next(r for r in rs if r["event"] == "restored") for rs in launches[1]]
    steps = {r["step"] for r in restored}
    assert steps == {rec.restored_step}, f"processes restored {steps}\n{what}"
    assert rec.steps_lost is not None and rec.steps_lost <= 1, (  # the RAM interval
        f"lost {rec.steps_lost} steps (newest reported {rec.last_step}, restored "
        f"{rec.restored_step})\n{what}")
    checked = [next(r for r in rs if r["event"] == "checked") for rs in launches[1]]
    assert all(r["mismatches"] == 0 for r in checked), f"restore not exact: {checked}"
    lost = restored[victim]["bytes_by_tier"]
    assert lost.get("ram", 0) == 0, f"the lost host read its removed RAM tier: {lost}"
    assert lost.get("peers", 0) + lost.get("local", 0) >= restored[victim]["target_bytes"], lost
    survivors = [r["bytes_by_tier"].get("ram", 0) for i, r in enumerate(restored) if i != victim]
    assert all(b > 0 for b in survivors), f"survivors did not read their RAM: {restored}"
    if rec.restored_step % LOCAL_EVERY:  # not on the shared tier: the lost share from peers
        assert lost.get("peers", 0) == restored[victim]["target_bytes"], lost

    finals = [next((r for r in rs if r["event"] == "final"), None) for rs in launches[1]]
    assert all(f is not None and f["mismatches"] == 0 for f in finals), (
        f"final state differs from an uninterrupted run: {finals}\n{what}")
    firsts = [next(r for r in rs if r["event"] == "step")["step"] for rs in launches[1]]
    assert firsts == [rec.restored_step + 1] * nprocs, firsts
