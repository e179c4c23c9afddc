"""Multi-host behaviour in real multi-process JAX jobs (resilient_ckpt/testing/multiprocess.py).

Every job is N local processes forming one JAX job on 127.0.0.1; each process
is a simulated host with its OWN RAM-tier directory (under /dev/shm) and all of
them share one local-tier directory. Only the public API is used:
`resilient_ckpt.CheckpointManager` with `RamTier(path=<this host's>, every=1,
keep=2)` and `LocalTier(path=<shared>, every=3, keep=2)`, Orbax's args, and
`last_restore`. A restore is always a FRESH job (new processes, new port), as
after a lost host; its values are compared bit for bit with the known state of
the step it says it restored (the state's arithmetic is exact).

`test_harness_control_orbax_agrees` runs the same scenarios with Orbax's own
CheckpointManager on the shared directory: it checks the harness (kills,
fresh jobs, comparisons), and must pass.

Sizes are options of tests/conftest.py: `--multihost-trials` (kill trials of
a 2-process job in the default run, default 1), `--multihost-campaign-trials`
(the same, slow run, default 8; the long run in docs/benchmarks.md sets 250),
`--multihost-trials-4` (4 processes, slow, default 4),
`--multihost-control-trials` (the Orbax control, slow, default 3), `--seed`
(default 0). Jobs of 4 processes and waits on timeouts are marked slow. Every
job has a hard timeout (the harness kills it and fails the test).
"""
import collections
import os
import random
import shutil
import time

import pytest

from resilient_ckpt.testing.multiprocess import (
    JobTimeout,
    describe,
    run_job,
    start_job,
    step_dirs,
)

pytestmark = pytest.mark.multiprocess
JOB_S = 90  # hard timeout of one job

# ---------------------------------------------------------------- worker scripts

TRAIN = r'''
import argparse, os, sys, time
import mh
ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--system", default="ours")
p.add_argument("--steps", type=int, default=7)
p.add_argument("--report-each", action="store_true")
p.add_argument("--ram-keep", type=int, default=2)
p.add_argument("--local-every", type=int, default=3)
o = p.parse_args(ctx.extra)


def run(ctx):
    import orbax.checkpoint as ocp
    if o.system in ("ours", "ours-vote"):
        mngr, wrap = mh.ours(ctx, ram_keep=o.ram_keep, local_every=o.local_every,
                             vote=o.system == "ours-vote" or None), None
    else:
        mngr, wrap = mh.orbax(ctx), mh.orbax_state
    state = ctx.initial_state()
    mh.mark("ready")
    for step in range(1, o.steps + 1):
        state = ctx.train_step(state, step)
        mngr.save(step, args=ocp.args.StandardSave(wrap(state) if wrap else state))
        mh.mark(f"saved {step}")
        if o.report_each:
            mh.report({"event": "saved", "step": step, "latest": mngr.latest_step(),
                       "all": [int(s) for s in mngr.all_steps()]})
    mngr.wait_until_finished()
    ram = ([n for n in sorted(os.listdir(ctx.ram)) if n.isdigit()]
           if ctx.ram and os.path.isdir(ctx.ram) else None)
    mh.report({"event": "finished", "latest": mngr.latest_step(),
               "all": [int(s) for s in mngr.all_steps()], "ram_dirs": ram})
    mngr.close()


mh.main(run, ctx)
'''

RESTORE = r'''
import argparse, collections, sys, time
import mh
ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--system", default="ours")
p.add_argument("--target", default="same", choices=["same", "reshard"])
o = p.parse_args(ctx.extra)


def run(ctx):
    import numpy as np
    import orbax.checkpoint as ocp
    abstract = ctx.abstract(specs=mh.RESHARD_SPECS if o.target == "reshard" else None)
    out = {"pid": ctx.pid, "target_bytes": ctx.target_bytes(abstract)}
    if o.system in ("ours", "ours-vote"):
        mngr = mh.ours(ctx, vote=o.system == "ours-vote" or None)
    else:
        mngr = mh.orbax(ctx)
    out["latest"] = latest = mngr.latest_step()
    out["all"] = [int(s) for s in mngr.all_steps()]
    if latest is None:
        out["step"] = None
        mh.report(out)
        return
    t = time.perf_counter()
    if o.system != "orbax":
        state = mngr.restore(None, args=ocp.args.StandardRestore(abstract))
        rec = mngr.last_restore
        out["step"] = rec.step
        out["bytes_by_tier"] = {k: int(v) for k, v in rec.bytes_by_tier.items()}
        out["served"] = dict(collections.Counter(rec.served.values()))
    else:
        state = mh.from_orbax(mngr.restore(
            latest, args=ocp.args.StandardRestore(mh.orbax_abstract(abstract))))
        out["step"] = latest
        out["bytes_by_tier"] = {}
        out["served"] = {"orbax": 1}
    out["restore_s"] = time.perf_counter() - t
    out["votes"] = getattr(getattr(mngr, "_coord", None), "votes", None)
    out["state_step"] = int(np.asarray(state["step"].addressable_shards[0].data))
    bad = ctx.check_exact(state, out["step"])
    out["mismatches"] = len(bad)
    out["mismatch_sample"] = bad[:5]
    if bad:  # which step each leaf does hold: a mixed step or a wrong one
        out["leaf_steps"] = ctx.matching_steps(state, max(out["step"], out["state_step"]) + 3)
    mh.report(out)
    mngr.close()


mh.main(run, ctx)
'''

SLEEPER = r'''
import time
print("ready", flush=True)
time.sleep(600)
'''


# ---------------------------------------------------------------- helpers

def common(h):
    return ["--dir", h["dir"], "--ram", h["ram"]]


def must_succeed(results, what):
    assert all(r.ok for r in results), f"{what} failed:\n{describe(results)}"
    errors = [r.last("error") for r in results if r.last("error")]
    assert not errors, f"{what} reported errors: {errors}"


def train(h, nprocs=2, devices=4, steps=7, extra=(), system="ours"):
    res = run_job(TRAIN, nprocs, devices, common(h) + ["--steps", str(steps),
                                                       "--system", system, *extra],
                  timeout_s=JOB_S)
    must_succeed(res, f"training job ({system}, {nprocs} processes)")
    return res


def restore(h, nprocs=2, devices=4, extra=(), system="ours", ram=None):
    args = common(h) + ["--system", system, *extra]
    if ram is not None:
        args = [a if a != h["ram"] else ram for a in args]
    res = run_job(RESTORE, nprocs, devices, args, timeout_s=JOB_S)
    return res, [r.last("pid") for r in res]


def summary(reports):
    return [{k: r.get(k) for k in ("pid", "latest", "all", "step", "state_step", "mismatches",
                                   "mismatch_sample", "leaf_steps", "bytes_by_tier", "served",
                                   "target_bytes", "error")} if r else None for r in reports]


def assert_agree_exact(res, reports, what):
    must_succeed(res, what)
    steps = [r["step"] for r in reports]
    assert len(set(steps)) == 1, f"{what}: processes disagree on the step: {summary(reports)}"
    latest = [r["latest"] for r in reports]
    assert len(set(latest)) == 1, \
        f"{what}: processes disagree on latest_step(): {summary(reports)}"
    assert all(r.get("mismatches", 0) == 0 for r in reports), \
        f"{what}: values not exact: {summary(reports)}"
    return steps[0]


# ---------------------------------------------------------------- (a) and (b)

@pytest.fixture
def seven_steps(hosts):
    """2 processes trained 7 steps, saving each (RAM every 1, local every 3)."""
    return hosts, train(hosts, steps=7, extra=["--report-each"])


def test_processes_report_the_same_steps_while_saving(seven_steps):
    _, res = seven_steps
    per = [[r for r in p.results if r.get("event") == "saved"] for p in res]
    assert [len(x) for x in per] == [7, 7]
    fin = [p.last("event", "finished") for p in res]
    problems = []
    for a, b in zip(*per, strict=True):
        if (a["latest"], a["all"]) != (b["latest"], b["all"]):
            problems.append(f"after save {a['step']}: process 0 latest {a['latest']} all "
                            f"{a['all']}; process 1 latest {b['latest']} all {b['all']}")
        if a["latest"] != a["step"] or b["latest"] != b["step"]:
            problems.append(f"after save {a['step']}: latest_step() {a['latest']}, "
                            f"{b['latest']}")
    if not fin[0]["latest"] == fin[1]["latest"] == 7 or fin[0]["all"] != fin[1]["all"]:
        problems.append(f"after wait_until_finished: latest {fin[0]['latest']}, "
                        f"{fin[1]['latest']}; all {fin[0]['all']}, {fin[1]['all']}")
    assert not problems, "\n".join(problems)


def test_fresh_job_restores_the_ram_only_step_from_ram(seven_steps):
    """Step 7 is on the RAM tiers only (local every 3): it must be restorable,
    by both processes, exactly, without reading the local tier."""
    h, _ = seven_steps
    res, reports = restore(h)
    step = assert_agree_exact(res, reports, "fresh 2-process restore")
    assert step == 7, f"restored step {step}, not the RAM-only step 7: {summary(reports)}"
    local = [r["bytes_by_tier"].get("local", 0) for r in reports]
    assert local == [0, 0], f"bytes read from the local tier: {local}: {summary(reports)}"


def test_ram_retention_is_bounded_per_host(seven_steps):
    h, res = seven_steps
    fin = [p.last("event", "finished") for p in res]
    keep = 2
    dirs = [step_dirs(h["ram_of"](i)) for i in range(2)]
    for i, d in enumerate(dirs):
        assert len(d) <= keep + 1, f"host {i}'s RAM tier holds {d} (keep={keep})"
        assert fin[i]["ram_dirs"] is not None and len(fin[i]["ram_dirs"]) <= keep + 1, fin[i]
    assert dirs[0] == dirs[1], f"the hosts' RAM tiers hold different steps: {dirs}"
    assert dirs[0] and dirs[0][-1] == 7, dirs


# ---------------------------------------------------------------- (c) kill trials

def kill_trials(h, trials, nprocs, devices, system, seed):
    """Each trial: train (saving every step) in a fresh directory set, SIGKILL a
    random process 0.3-2.5 s after it is ready, then the survivors (a lost host
    ends the job), and restore in a fresh job. Returns a record per trial."""
    rng = random.Random(seed)
    records = []
    timeouts = 0
    for t in range(trials):
        trial = {"ram": os.path.join(h["base"], f"t{t}", "ram{pid}"),
                 "dir": os.path.join(h["dir"], f"t{t}")}
        os.makedirs(trial["dir"])
        victim, delay = rng.randrange(nprocs), rng.uniform(0.3, 2.5)
        after = rng.uniform(0.0, 0.5)
        rec = {"trial": t, "victim": victim, "delay_s": round(delay, 2),
               "survivors_after_s": round(after, 2)}
        job = start_job(TRAIN, nprocs, devices,
                        common(trial) + ["--steps", "100000", "--system", system],
                        timeout_s=JOB_S)
        with job:
            if not job.wait_for(victim, "ready"):
                job.kill_all()
                rec["error"] = "training did not start:\n" + describe(job.collect(False))
                records.append(rec)
                continue
            time.sleep(delay)
            job.kill(victim)
            time.sleep(after)
            job.kill_all()
            train_res = job.collect(raise_on_timeout=False)
        rec["saved"] = [max([int(m.split()[1]) for m in r.markers if m.startswith("saved ")],
                            default=0) for r in train_res]
        try:
            res, reports = restore(trial, nprocs, devices, system=system)
        except JobTimeout as e:
            rec["error"] = f"restore timed out: {str(e)[:3000]}"
            records.append(rec)
            timeouts += 1
            if timeouts >= 2:
                break
            continue
        rec["steps"] = [r and r.get("step") for r in reports]
        rec["latest"] = [r and r.get("latest") for r in reports]
        rec["mismatches"] = [r and r.get("mismatches") for r in reports]
        rec["served"] = [r and r.get("served") for r in reports]
        rec["bytes_by_tier"] = [r and r.get("bytes_by_tier") for r in reports]
        rec["leaf_steps"] = [r and r.get("leaf_steps") for r in reports]
        if not all(r.ok for r in res) or not all(reports):
            rec["error"] = describe(res, 1500)
        records.append(rec)
        shutil.rmtree(os.path.join(h["base"], f"t{t}"), ignore_errors=True)
    return records


def judge(records, trials):
    """Counts of failed trials: (errors, disagreements, inexact or mixed)."""
    errors = sum(1 for r in records if "error" in r)
    disagree = sum(1 for r in records if "error" not in r and len(set(r["steps"])) != 1)
    inexact = sum(1 for r in records if "error" not in r and any(m for m in r["mismatches"]))
    lines = []
    for r in records:
        if "error" in r:
            lines.append(f"trial {r['trial']}: kill {r['victim']} after {r['delay_s']} s: "
                         f"ERROR {r['error'][:1500]}")
        else:
            tiers = [sorted(s or {}) for s in r["served"]]
            lines.append(f"trial {r['trial']}: kill {r['victim']} after {r['delay_s']} s, "
                         f"saved up to {r['saved']}: latest {r['latest']} restored "
                         f"{r['steps']} mismatches {r['mismatches']} tiers {tiers} "
                         f"bytes {r['bytes_by_tier']}"
                         + (f" leaf steps {r['leaf_steps']}" if any(r["leaf_steps"]) else ""))
    table = "\n".join(lines)
    print(f"\n{len(records)} of {trials} trials\n{table}")
    return errors, disagree, inexact, table


@pytest.mark.parametrize("nprocs,devices", [  # a trial: 6-10 s (2 processes), 10-17 s (4)
    pytest.param(2, 4, id="2proc", marks=pytest.mark.trials("multihost_trials", 60)),
    pytest.param(2, 4, id="2proc-campaign", marks=[
        pytest.mark.slow, pytest.mark.trials("multihost_campaign_trials", 60)]),
    pytest.param(4, 2, id="4proc", marks=[
        pytest.mark.slow, pytest.mark.trials("multihost_trials_4", 90)]),
    # the same kills in a job that votes (multihost.vote) on every save
    pytest.param(2, 4, id="2proc-voting", marks=[
        pytest.mark.slow, pytest.mark.trials("multihost_campaign_trials", 60)])])
def test_kill_trials_agree_and_exact(hosts, nprocs, devices, trials, seed, request):
    system = "ours-vote" if "voting" in request.node.callspec.id else "ours"
    records = kill_trials(hosts, trials, nprocs, devices, system, seed + nprocs)
    errors, disagree, inexact, table = judge(records, trials)
    assert len(records) == trials and (errors, disagree, inexact) == (0, 0, 0), (
        f"{errors} errors, {disagree} disagreements, {inexact} inexact/mixed "
        f"in {len(records)} of {trials} trials:\n{table}")


# ---------------------------------------------------------------- (d) a lost host's RAM

def _lost_ram_restore(hosts):
    train(hosts, steps=6)  # steps 3 and 6 on the local tier; 5 and 6 in RAM
    shutil.rmtree(hosts["ram_of"](1))
    res, reports = restore(hosts)
    step = assert_agree_exact(res, reports, "restore after host 1 lost its RAM tier")
    local = sum(r["bytes_by_tier"].get("local", 0) for r in reports)
    share = reports[1]["target_bytes"]
    print(f"\nstep {step}; bytes by tier per process "
          f"{[r['bytes_by_tier'] for r in reports]}; host 1's share {share}; "
          f"local/share {local / share:.3f}")
    return step, local, share, reports


def test_lost_host_ram_restore_reads_at_most_its_share_from_local(hosts):
    step, local, share, reports = _lost_ram_restore(hosts)
    assert step == 6, f"restored {step}, not step 6 (on the local tier): {summary(reports)}"
    assert local <= 1.05 * share, (
        f"{local} bytes from the shared local tier, more than 1.05 x host 1's share "
        f"({share}): {summary(reports)}")


def test_lost_host_ram_is_filled_from_its_peers_replicas(hosts):
    """A data-parallel job (the state replicated over a replica axis that spans
    the hosts, so each host's RAM tier keeps a whole copy): host 1 loses its
    RAM, and the fresh job still restores the newest step, held in RAM only,
    host 1's shards moved from host 0's devices: 0 bytes from the shared tier."""
    mesh = ["--mesh", "2,2,2"]
    train(hosts, steps=7, extra=mesh)  # step 7 is in RAM only (local: 3 and 6)
    shutil.rmtree(hosts["ram_of"](1))
    res, reports = restore(hosts, extra=mesh)
    step = assert_agree_exact(res, reports, "restore after host 1 lost its RAM tier")
    assert step == 7, f"restored {step}, not the RAM-only step 7: {summary(reports)}"
    assert all(r["bytes_by_tier"].get("local", 0) == 0 for r in reports), summary(reports)
    assert reports[1]["bytes_by_tier"].get("peers") == reports[1]["target_bytes"], \
        summary(reports)
    assert reports[0]["bytes_by_tier"].get("peers", 0) == 0, summary(reports)


def test_a_lost_hosts_share_comes_from_its_peers_ram_before_the_shared_tier(hosts):
    """Step 6 is in every host's RAM and on the shared tier; host 1 loses its
    RAM. The fresh job restores step 6 with host 1's shards moved from host
    0's devices (its RAM holds replicas), not read from the shared tier,
    which at scale is GCS: 0 bytes from it on any host."""
    mesh = ["--mesh", "2,2,2"]
    train(hosts, steps=6, extra=mesh)  # step 6: RAM on both hosts and the local tier
    shutil.rmtree(hosts["ram_of"](1))
    res, reports = restore(hosts, extra=mesh)
    step = assert_agree_exact(res, reports, "restore after host 1 lost its RAM tier")
    assert step == 6, summary(reports)
    assert all(r["bytes_by_tier"].get("local", 0) == 0 for r in reports), summary(reports)
    assert reports[1]["bytes_by_tier"].get("peers") == reports[1]["target_bytes"], \
        summary(reports)


def test_a_voting_job_restores_by_votes_and_takes_a_hole_through_the_store(hosts):
    """In a job that votes, a restore's rounds (what exists, who reads the
    step, each process's outcome) are votes; when host 1 has lost its RAM,
    the vote says some process lacks the step and which has it, the records
    and the holes go through the store, and host 1's shards still come from
    host 0's devices: the same step, exact, as without votes."""
    mesh = ["--mesh", "2,2,2"]
    train(hosts, steps=7, extra=mesh)  # step 7 is in RAM only (local: 3 and 6)
    res, reports = restore(hosts, extra=mesh, system="ours-vote")
    assert assert_agree_exact(res, reports, "a voting job's restore") == 7, summary(reports)
    assert [r["votes"] for r in reports] == [3, 3], [r["votes"] for r in reports]
    assert all(r["bytes_by_tier"].get("peers", 0) == 0 for r in reports), summary(reports)
    shutil.rmtree(hosts["ram_of"](1))
    res, reports = restore(hosts, extra=mesh, system="ours-vote")
    step = assert_agree_exact(res, reports, "a voting job's restore after host 1 lost its RAM")
    assert step == 7, summary(reports)
    # what exists and who reads by votes; host 1's hole by the store's round
    assert [r["votes"] for r in reports] == [2, 2], [r["votes"] for r in reports]
    assert reports[1]["bytes_by_tier"].get("peers") == reports[1]["target_bytes"], \
        summary(reports)


# ---------------------------------------------------------------- (e) process count changes

@pytest.fixture
def six_steps(hosts):
    train(hosts, steps=6)
    return hosts


@pytest.mark.parametrize("nprocs,devices", [
    pytest.param(1, 8, id="1proc"), pytest.param(4, 2, id="4proc", marks=pytest.mark.slow)])
def test_restore_with_another_process_count_resharded(six_steps, nprocs, devices):
    """A 2-process (4,2)-mesh checkpoint restored by 1 process of 8 devices (no
    jax.distributed) or 4 processes of 2 (hosts 2 and 3 with empty RAM tiers),
    onto a (2,4) mesh with other partition specs: exact, and each process reads
    no more than 1.05 x the bytes of its own target shards."""
    h = six_steps
    res, reports = restore(h, nprocs, devices, extra=["--target", "reshard", "--mesh", "2,4"])
    step = assert_agree_exact(res, reports, f"{nprocs}-process resharded restore")
    assert step == 6, summary(reports)
    for r in reports:
        read = sum(r["bytes_by_tier"].values())
        assert read <= 1.05 * r["target_bytes"], (
            f"process {r['pid']} read {read} bytes for {r['target_bytes']} of target "
            f"shards: {summary(reports)}")


@pytest.mark.slow
def test_a_4_process_checkpoint_restores_in_2_processes(hosts):
    """Saved by 4 processes (2 devices each), restored by 2 (4 each): the
    shared tier's 4-process step, exact, the same step on both."""
    train(hosts, nprocs=4, devices=2, steps=6)
    res, reports = restore(hosts, 2, 4)
    step = assert_agree_exact(res, reports, "2-process restore of a 4-process checkpoint")
    assert step == 6, summary(reports)
    for r in reports:
        read = sum(r["bytes_by_tier"].values())
        assert read <= 1.05 * r["target_bytes"], summary(reports)


@pytest.mark.slow
def test_a_job_that_finds_nothing_ends_cleanly(hosts):
    """4 processes open managers on empty tiers and end at once: every one
    exits 0. (The cleanup thread asked jax for the process index as the
    program ended, which restarted the backend against a coordinator that
    was gone: 11 of 15 such jobs lost a process to SIGABRT.)"""
    for _ in range(5):
        res, reports = restore(hosts, 4, 2)
        assert [r.rc for r in res] == [0, 0, 0, 0], [r.tail() for r in res if r.rc]
        assert [r["step"] for r in reports] == [None] * 4, summary(reports)


def test_when_no_step_restores_every_process_says_why_the_newest_failed(hosts):
    """Every chunk of every step, in every tier, has a flipped byte: each
    process's StepNotFoundError names the newest step's cause on every
    process (before, only the steps tried)."""
    train(hosts, steps=4)
    flipped = 0
    for top in (hosts["base"], hosts["dir"]):
        for d, _, names in os.walk(top):
            for n in names:
                if not n.endswith(".json"):
                    with open(os.path.join(d, n), "r+b") as f:
                        size = f.seek(0, 2)
                        if size:
                            f.seek(size // 2)
                            b = f.read(1)
                            f.seek(size // 2)
                            f.write(bytes([b[0] ^ 0xFF]))
                            flipped += 1
    assert flipped
    res = run_job(RESTORE, 2, 4, common(hosts), timeout_s=JOB_S)
    for r in res:
        e = (r.last("error") or {}).get("error", "")
        assert "StepNotFoundError" in e and "tried [" in e, describe(res)
        assert "; step 4: process 0:" in e and "process 1:" in e, e[-1500:]


# ---------------------------------------------------------------- the harness itself

def test_harness_timeout_kills_and_fails(tmp_path):
    job = start_job(SLEEPER, 2, 1, timeout_s=4)
    assert job.wait_all("ready", timeout=30)
    t = time.monotonic()
    with pytest.raises(JobTimeout):
        job.collect()
    assert time.monotonic() - t < 15
    assert all(p.poll() is not None for p in job.procs)


@pytest.mark.slow
@pytest.mark.trials("multihost_control_trials", 60)
def test_harness_control_orbax_agrees(hosts, trials, seed):
    """The positive control: Orbax's own CheckpointManager on the shared
    directory, (a) and (c) as above (no RAM tier: every step is on disk)."""
    h = hosts
    train(h, steps=7, system="orbax")
    res, reports = restore(h, system="orbax")
    step = assert_agree_exact(res, reports, "Orbax control restore")
    assert step == 7, summary(reports)
    records = kill_trials(h, trials, 2, 4, "orbax", seed)
    errors, disagree, inexact, table = judge(records, trials)
    assert len(records) == trials and (errors, disagree, inexact) == (0, 0, 0), table
    steps = collections.Counter(r["steps"][0] for r in records)
    assert sum(n for s, n in steps.items() if s is not None) >= 1, table


# ---------------------------------------------------------------- a peer that is gone

SKIPPER = r'''
import sys, time
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import resilient_ckpt as rc
    tiers = [rc.RamTier(path=ctx.ram, every=1, keep=2), rc.LocalTier(path=ctx.dir)]
    mngr = rc.CheckpointManager(ctx.dir, options=rc.CheckpointManagerOptions(
        tiers=tiers, agreement_timeout_s=3))
    if ctx.pid == 1:  # never makes the collective call process 0 makes
        time.sleep(6)
        mh.report({"pid": 1, "slept": True})
        return
    t0 = time.monotonic()
    try:
        mngr.reload()
        mh.report({"pid": 0, "raised": None})
    except rc.AgreementError as e:
        mh.report({"pid": 0, "raised": str(e), "after_s": time.monotonic() - t0,
                   "timeout_error": isinstance(e, TimeoutError)})
mh.main(run, ctx)
'''


@pytest.mark.slow  # waits for the peer's timeout
def test_a_peer_that_does_not_answer_is_named_not_a_hang(hosts):
    """Process 1 skips a collective call: process 0 raises AgreementError (a
    TimeoutError) naming process 1 and the call, after agreement_timeout_s."""
    res = run_job(SKIPPER, 2, 2, common(hosts), timeout_s=JOB_S)
    got = res[0].last("pid")
    assert got is not None, res[0].tail()
    assert got["raised"] and "process 1 of 2" in got["raised"] and "reload" in got["raised"], got
    assert got["timeout_error"] and 2.5 < got["after_s"] < 15, got


LOCKED = r'''
import sys, time
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    tiers = [rc.RamTier(path=ctx.ram, every=1, keep=2), rc.LocalTier(path=ctx.dir)]
    mngr = rc.CheckpointManager(ctx.dir, options=rc.CheckpointManagerOptions(
        tiers=tiers, agreement_timeout_s=30))
    t0 = time.monotonic()
    try:
        mngr.save(1, args=ocp.args.StandardSave(ctx.initial_state()))
        mh.report({"pid": ctx.pid, "raised": None})
    except rc.DirectoryInUseError as e:
        mh.report({"pid": ctx.pid, "raised": str(e), "after_s": time.monotonic() - t0})
mh.main(run, ctx)
'''


def test_a_directory_locked_by_another_writer_is_refused_on_every_process(hosts):
    """Another live writer holds the shared tier's lock: process 0 cannot take
    it, and every process raises DirectoryInUseError at the first save (the
    save's agreement carries the refusal) instead of one raising and the
    other waiting for an agreement timeout."""
    import fcntl
    fd = os.open(os.path.join(hosts["dir"], ".rc-writer.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"host test pid %d" % os.getpid())
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        res = run_job(LOCKED, 2, 2, common(hosts), timeout_s=JOB_S)
    finally:
        os.close(fd)
    got = [r.last("pid") for r in res]
    assert all(g is not None for g in got), [r.tail() for r in res]
    assert all(g["raised"] and hosts["dir"] in g["raised"] for g in got), got
    assert "process 0 of the job" in got[1]["raised"], got
    assert all(g["after_s"] < 25 for g in got), got  # not the 30 s agreement timeout
    assert not os.path.exists(os.path.join(hosts["dir"], "1")), "nothing was written"


OFF_THREAD = r'''
import os, sys, time
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    tiers = [rc.RamTier(path=ctx.ram, every=1, keep=2), rc.LocalTier(path=ctx.dir, every=1)]
    mngr = rc.CheckpointManager(ctx.dir, options=rc.CheckpointManagerOptions(
        tiers=tiers, agreement_timeout_s=30))
    state = ctx.initial_state()
    mngr.save(1, args=ocp.args.StandardSave(state))  # agreed before it starts (the locks)
    flag = os.path.join(ctx.dir, "process-0-saved-2")
    if ctx.pid == 0:
        mngr.save(2, args=ocp.args.StandardSave(state))
        open(flag, "w").close()  # process 1 saves step 2 only after this
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        mh.report({"pid": 1, "saw_flag": os.path.exists(flag)})
        mngr.save(2, args=ocp.args.StandardSave(state))
    mngr.wait_until_finished()
    mh.report({"pid": ctx.pid, "steps": [int(s) for s in mngr.all_steps()],
               "latest": mngr.latest_step()})
    mngr.close()
mh.main(run, ctx)
'''


def test_a_save_after_the_first_does_not_wait_for_the_other_processes(hosts):
    """Once every process holds its writer lock, a save's agreement runs off
    the training thread: process 0's save of step 2 returns while process 1
    has not called save yet (process 1 waits for process 0's return first, so
    a save that waited for the agreement would hang until the timeout), and
    both then agree on the same steps."""
    res = run_job(OFF_THREAD, 2, 2, common(hosts), timeout_s=JOB_S)
    must_succeed(res, "the off-thread agreement job")
    assert res[1].last("saw_flag", True) is not None, res[1].tail()
    ends = [r.last("steps") for r in res]
    assert ends[0]["steps"] == ends[1]["steps"] == [1, 2], ends
    assert ends[0]["latest"] == ends[1]["latest"] == 2
