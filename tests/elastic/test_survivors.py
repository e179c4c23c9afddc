"""Survivors of a lost process go on in-process (issue #11, item 4).

A real job of 2 or 4 processes (jax.distributed on 127.0.0.1, the harness of
resilient_ckpt/testing/multiprocess.py) with jax's recoverability settings trains a
deterministic model under the elastic loop, saving every step to each host's
own RAM tier and every 3rd to a tier every host sees. One process other than
0 (the coordinator, without which the others abort) stalls in a step and is
SIGKILLed by the test. The survivors must each get the failure naming its
devices, agree on the step, rebuild the mesh from their devices, restore (own
RAM first, the lost share from the shared tier), train to the end, and hold
exactly the state a replay of every step gives; the saves made after the loss
carry the survivors' own manifests and restore again.
"""
from __future__ import annotations

import json
import os

import pytest

from resilient_ckpt.testing.multiprocess import describe, start_job, step_dirs

WORKER = r'''
import os, sys, time, functools, argparse
import mh
ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--victim", type=int)
p.add_argument("--die-at", type=int)
p.add_argument("--total", type=int)
p.add_argument("--stall", default="step", choices=["step", "save"])
p.add_argument("--axis", default="data")
p.add_argument("--vote", action="store_true", help="agreement_vote=True")
opt = p.parse_args(ctx.extra)

import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import resilient_ckpt as rc
from resilient_ckpt.elastic import Elastic, RecoveryPolicy, shrink_data_axis

ROWS, COLS = 48, 16  # rows divide by 4, 3 and 2 data rows
SPECS = {"w": P("data", "model"), "b": P(None, "model"), "step": P()}


def host_init():
    i = np.arange(ROWS * COLS, dtype=np.int64)
    return {"w": (i * 2654435761 % 1000003).astype(np.int32).reshape(ROWS, COLS),
            "b": (i % 1024).astype(np.float32).reshape(ROWS, COLS) / 8,
            "step": np.zeros((), np.int32)}


def host_step(st, s):  # the replay: wrapping int32, exact float32 scaling
    with np.errstate(over="ignore"):
        total = st["w"].sum(dtype=np.int32)
        w = st["w"] * np.int32(3) + total + np.int32(s)
    return {"w": w, "b": st["b"] * np.float32(0.5) + np.float32(s), "step": st["step"] + 1}


def replay(n):
    st = host_init()
    for s in range(1, n + 1):
        st = host_step(st, s)
    return st


def mismatches(state, n):
    want, bad = replay(n), []
    for k, x in state.items():
        for sh in x.addressable_shards:
            if not np.array_equal(np.asarray(sh.data), want[k][sh.index]):
                bad.append(f"{k}{sh.index}")
    return bad


def jax_step(st, s):  # the sum is an all-reduce across every process
    return {"w": st["w"] * 3 + jnp.sum(st["w"]) + s, "b": st["b"] * 0.5 + s.astype(jnp.float32),
            "step": st["step"] + 1}


mngr = rc.CheckpointManager(ctx.dir, options=rc.CheckpointManagerOptions(
    tiers=[rc.RamTier(path=ctx.ram, every=1, keep=3), rc.LocalTier(path=ctx.dir, every=3, keep=2)],
    agreement_timeout_s=8, agreement_vote=True if opt.vote else None))
el = Elastic(mngr, ctx.mesh, rescale_every_s=1e9, data_axis=opt.axis,
             choose_mesh=functools.partial(shrink_data_axis, data_axis=opt.axis, divisor=False),
             retry=RecoveryPolicy(max_attempts=2, max_wait_s=30))


def stall(where, s):
    if ctx.pid == opt.victim and s == opt.die_at and opt.stall == where:
        mh.mark("dying")
        time.sleep(600)


@el.run
def train(mesh):
    sh = {k: NamedSharding(mesh, v) for k, v in SPECS.items()}
    init = host_init()
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh[k]) for k, v in init.items()}
    step_fn = jax.jit(jax_step, out_shardings=sh)
    if el.timeline:
        mh.mark(f"recovering {len(el.timeline)}")  # the restore after a failure starts now
    state, start = el.restore(abstract, lambda: {
        k: jax.make_array_from_callback(v.shape, sh[k], lambda i, v=v: v[i])
        for k, v in init.items()})
    if el.timeline:
        mh.report({"restored": start, "bytes": mngr.last_restore.bytes_by_tier,
                   "mesh": dict(mesh.shape), "exact": mismatches(state, start),
                   "votes": mngr._coord.votes})
    for s in range(start + 1, opt.total + 1):
        stall("step", s)
        state = el.step(step_fn, state, jnp.int32(s))
        stall("save", s)
        el.save(s, state)
    return state


final = train()
mngr.wait_until_finished()
bad = mismatches(final, opt.total)
import orbax.checkpoint as ocp
again = mngr.restore(None, args=ocp.args.StandardRestore(
    {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in final.items()}))
mh.report({"done": True, "exact": bad, "events": el.events,
           "latest": mngr.latest_step(), "again": mngr.last_restore.step,
           "again_exact": mismatches(again, mngr.last_restore.step),
           "votes": mngr._coord.votes})
mngr.wait_until_finished()  # every survivor has reported before any exits
if ctx.pid == 0:
    time.sleep(2)  # the others exit first: without process 0 they would abort
os._exit(0)
'''

ENV = {"JAX_ENABLE_RECOVERABILITY": "true",
       "XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=5"}


def _manifests(path: str, step: int) -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(path, str(step)))
                  if n.startswith("manifest."))


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs,devices,victim,stall", [
    pytest.param(2, 4, 1, "step", id="2proc", marks=pytest.mark.slow),
    pytest.param(4, 2, 2, "step", id="4proc", marks=pytest.mark.slow),
    pytest.param(4, 2, 1, "save", id="4proc-between-steps", marks=pytest.mark.slow),
    # the job votes (multihost.vote): the loss lands on a vote under way
    pytest.param(4, 2, 1, "save+vote", id="4proc-between-steps-voting",
                 marks=pytest.mark.slow),
    pytest.param(2, 4, 1, "step+vote", id="2proc-voting", marks=pytest.mark.slow),
    # long enough for retention to drop the whole job's saves: then the
    # survivors vote among themselves
    pytest.param(4, 2, 2, "step+vote+long", id="4proc-voting-after-the-loss",
                 marks=pytest.mark.slow)])
def test_survivors_go_on(hosts, nprocs, devices, victim, stall):
    stall, vote, long = (stall.split("+") + ["", ""])[:3]
    die_at, total = 8, 20 if long else 11
    job = start_job(WORKER, nprocs, devices, args=[
        "--dir", hosts["dir"], "--ram", hosts["ram"], "--victim", str(victim),
        "--die-at", str(die_at), "--total", str(total), "--stall", stall,
        *(["--vote"] if vote else [])],
        timeout_s=110, env=ENV, fail_fast_s=20)
    job.kill_after(victim, 0.5, after="dying")
    results = job.collect()
    why = describe(results)
    assert results[victim].killed, why
    alive = [r for r in results if r.index != victim]
    for r in alive:
        assert r.rc == 0 and not r.reaped, why
        restored, done = r.last("restored"), r.last("done")
        assert restored and done, why
        # Step 6 is the newest with the lost share on the shared tier (every 3rd);
        # each survivor read its own part from its own RAM tier first.
        assert restored["restored"] == 6, why
        assert restored["exact"] == [] and done["exact"] == [], why
        assert restored["bytes"].get("local", 0) > 0, why
        assert restored["bytes"].get("ram", 0) > 0, why
        assert restored["mesh"] == {"data": 2 if nprocs == 2 else 3, "model": 2}, why
        [ev] = done["events"]
        lost = set(ev["lost_devices"])
        assert len(lost) == devices and ev["lost_from"] == "failure", ev
        assert ev["restored_step"] == 6 and ev["outcome"] == "resumed", ev
        # Saves after the loss are the survivors': they restore again, exactly.
        assert done["latest"] == total and done["again"] == total, why
        assert done["again_exact"] == [], why
        assert (done["votes"] >= 5) == bool(vote), why  # saves before the loss voted
        # and the survivors' saves, once no view speaks of the whole job's
        assert (done["votes"] - restored["votes"] >= 3) == bool(long), why
    assert all(r.last("done")["events"][0]["lost_devices"] ==
               alive[0].last("done")["events"][0]["lost_devices"] for r in alive)
    # The shared tier: step 6 by the whole job, step 9 by the survivors only
    # (a long run keeps only the survivors' 18 and 15).
    n = nprocs - 1
    if not long:
        assert _manifests(hosts["dir"], 6) == [f"manifest.{i}-of-{nprocs}.json"
                                              for i in range(nprocs)]
    for s in (15, 18) if long else (9,):
        assert _manifests(hosts["dir"], s) == [f"manifest.{i}-of-{n}.json" for i in range(n)]
        assert s in step_dirs(hosts["dir"])
    json.dumps(alive[0].last("done"))  # the events are plain data


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_loss_during_the_recovery_is_recovered_from_too(hosts):
    """4 processes: process 2 is lost at step 8; process 1 is killed as the
    survivors start restoring (their restore's agreements then time out, a
    second failure before any progress). Processes 0 and 3 go on, with the
    attempt budget (2) spent on the two, and end exactly."""
    die_at, total = 8, 11
    job = start_job(WORKER, 4, 2, args=[
        "--dir", hosts["dir"], "--ram", hosts["ram"], "--victim", "2",
        "--die-at", str(die_at), "--total", str(total)],
        timeout_s=150, env=ENV, heartbeat_timeout_s=5, fail_fast_s=30)
    job.kill_after(2, 0.5, after="dying")
    job.kill_after(1, 0.0, after="recovering 1")
    results = job.collect()
    why = describe(results)
    assert results[2].killed and results[1].killed, why
    for r in (results[0], results[3]):
        assert r.rc == 0 and not r.reaped, why
        done = r.last("done")
        assert done and done["exact"] == [] and done["again_exact"] == [], why
        failures = [e for e in done["events"] if e["kind"] == "failure"]
        assert len(failures) == 2, done["events"]
        first, second = (set(f["lost_devices"]) for f in failures)
        # process 2's two devices, then those and process 1's
        assert len(first) == 2 and first < second and len(second) == 4, failures
        assert failures[1]["attempt"] == 2 and failures[1]["outcome"] == "resumed", failures
        assert r.last("restored")["mesh"] == {"data": 2, "model": 2}, why
        assert done["latest"] == total, why


@pytest.mark.multiprocess  # the default run's survivors test: 2 processes, one lost
def test_a_lone_survivor_restores_the_newest_step_from_its_own_ram(hosts):
    """One replica per process (mesh replica=2, data=2, model=2): the survivor's
    RAM tier holds the whole state of every step, so the job's newest save
    (made by both processes) is whole there although the other's manifest is
    gone with it: nothing is lost, nothing comes from the shared tier."""
    die_at, total = 8, 10
    job = start_job(WORKER, 2, 4, args=[
        "--dir", hosts["dir"], "--ram", hosts["ram"], "--victim", "1", "--die-at", str(die_at),
        "--total", str(total), "--mesh", "2,2,2", "--axis", "replica"],
        timeout_s=110, env=ENV, heartbeat_timeout_s=5, fail_fast_s=20)
    job.kill_after(1, 0.5, after="dying")
    results = job.collect()
    why = describe(results)
    r = results[0]
    assert results[1].killed and r.rc == 0 and not r.reaped, why
    restored, done = r.last("restored"), r.last("done")
    assert restored and done, why
    assert restored["restored"] == die_at - 1 and restored["exact"] == [], why
    assert set(restored["bytes"]) == {"ram"}, why
    assert restored["mesh"] == {"replica": 1, "data": 2, "model": 2}, why
    [ev] = done["events"]
    assert ev["steps_lost"] == 0 and ev["outcome"] == "resumed", ev
    assert done["exact"] == [] and done["latest"] == total and done["again_exact"] == [], why


# ---------------------------------------------------------------- the pure parts, one process

def test_a_mesh_for_the_survivors_keeps_every_whole_row(mesh):
    from resilient_ckpt.elastic import shrink_data_axis
    d = list(mesh.devices.flat)
    left = set(d) - {d[4], d[5]}                       # data row 2 lost: 3 rows left
    assert shrink_data_axis(left, mesh).shape["data"] == 2            # divides 4
    kept = shrink_data_axis(left, mesh, divisor=False)
    assert kept.shape == {"data": 3, "model": 2}
    assert [x.id for x in kept.devices.flat] == [x.id for x in d if x in left]


def test_survivors_checks_and_the_managers_labels(mesh):
    from resilient_ckpt.elastic import survivors
    from resilient_ckpt.multihost.agree import Peers
    assert survivors.mesh_problem(mesh, [0]) is None
    assert "process 0" in survivors.mesh_problem(mesh, [1, 2])
    idle = survivors.mesh_problem(mesh, [0, 1])   # process 1 has no device in it
    assert "[1]" in idle and "divisor=False" in idle
    assert "row spans hosts" in idle and "relaunch" in idle  # what divisor=False cannot mend
    assert survivors.live_after({0, 1}, [0]) == [0]      # one process: never lost
    peers = Peers()
    assert (peers.rank, peers.size, peers.many) == (0, 1, False)
    with pytest.raises(ValueError, match="must include this process"):
        peers.set_live([1])
    with pytest.raises(TypeError, match="set_live_processes"):
        survivors.tell_manager(object(), [0])
