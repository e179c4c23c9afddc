"""The agreement protocol (`multihost.agree.Peers`) driven for simulated jobs
of many processes (threads) against `testing.kvservice`, the in-process
stand-in for jax.distributed's coordination service: what every process
gets, what a silent process costs, and how many requests one agreement makes
of the coordinator (the figure the protocol's cost at thousands of hosts
follows from)."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from resilient_ckpt.catalog.catalog import JobView
from resilient_ckpt.errors import AgreementError
from resilient_ckpt.multihost.agree import PROTOCOLS, Peers
from resilient_ckpt.testing.kvservice import KeyValueService
from tests.support import effort
from tests.support.shares import reports as shares_reports


def run_job(n, body, service=None, timeout_s=10.0, protocol="gather"):
    """`body(peers)` on n threads, one simulated process each; their results
    (or exceptions) in process order."""
    service = service or KeyValueService(n)
    out: list = [None] * n

    def one(i):
        try:
            out[i] = body(Peers(timeout_s, job=(service.client(i), i, n),
                                protocol=protocol))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a simulated process hung"
    return out, service


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("n", [2, 5, 16])
def test_every_process_gets_every_view_in_process_order(n, protocol):
    out, _ = run_job(n, lambda p: [p.decide("test", {"i": p.index, "r": r}, list)
                                   for r in range(3)], protocol=protocol)
    for views in out:
        assert views == [[{"i": q, "r": r} for q in range(n)] for r in range(3)]


@pytest.mark.parametrize("n", [2, 8, 32])
def test_one_all_to_all_agreement_costs_n_squared_requests(n):
    """Opening (one counter increment each), then one all-to-all round: each
    process sets its key, reads the n-1 others', waits at the barrier and
    deletes its key: n*(n+2) requests, every view read n-1 times (the
    reference protocol, and the cost the gather protocol removes)."""
    service = KeyValueService(n)
    run_job(n, lambda p: None, service, protocol="all-to-all")
    assert service.totals()[0] == n  # the opening increments
    service.reset_counts()
    view = {"shares": [[7, "a" * 32, 0, n, "ram", 1.0]] * 3}
    out, _ = run_job(n, lambda p: p.decide("save of step 7", view, list), service,
                     protocol="all-to-all")
    assert all(v == [view] * n for v in out)
    requests, nbytes = service.totals()
    assert requests == n + n * (n + 2)  # this job's opening, then the exchange
    assert nbytes >= n * n * len(str(view))  # every view crosses the coordinator n times


def _digest(views):
    """A rule whose decision does not grow with the job: a count and a sum."""
    return {"n": len(views), "sum": sum(v["x"] for v in views)}


@pytest.mark.parametrize("n", [2, 8, 64])
def test_a_gather_round_costs_at_most_3n_requests_and_linear_bytes(n):
    """Each process but the leader puts its view and reads the decision; the
    leader reads the views (one directory read, then a wait for each late
    one), puts the decision, and from the second round on deletes the round
    before: at most 3n requests a round, every view read once, the decision
    n - 1 times."""
    view = {"x": 1, "pad": "p" * 500}
    per_round = []
    for rounds in (1, 4):
        service = KeyValueService(n)
        out, _ = run_job(n, lambda p, r=rounds: [p.decide("save", dict(view, x=p.index),
                                                          _digest) for _ in range(r)], service)
        assert all(d == [{"n": n, "sum": n * (n - 1) // 2}] * rounds for d in out), out
        requests, nbytes = service.totals()
        requests -= n  # the opening's increments
        assert requests <= 3 * n * rounds, (n, rounds, requests)
        assert nbytes <= rounds * 2 * n * (len(str(view)) + 100), (n, rounds, nbytes)
        per_round.append(requests / rounds)
    assert per_round[0] >= 2 * n - 1  # n - 1 views in and n - 1 decisions out at least
    assert service.totals()[0] and not [k for k, _ in service.client(0).key_value_dir_get(
        "resilient_ckpt/x/") if "/0/" in k]  # round 0 was deleted by round 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_silent_process_is_named_not_a_hang(protocol):
    def body(p):
        if p.index == 2:
            return "silent"  # never makes the call the others make
        return p.decide("restore of step 3", {"i": p.index}, list)
    out, _ = run_job(3, body, timeout_s=0.5, protocol=protocol)
    assert out[2] == "silent"
    for e in out[:2]:
        assert isinstance(e, AgreementError) and "process 2 of 3" in str(e)
        assert "restore of step 3" in str(e)


def test_a_barrier_costs_one_request_a_process_and_names_who_did_not_come():
    """`Peers.barrier` (the open's wait for every probe): one request per
    process beside each one's opening count, and the rounds after it stay in
    step; a process that never comes is named, with the call, on every
    process that waited."""
    def body(p):
        p.barrier("open (probes written)")
        return p.decide("open", {"x": p.index}, _digest)
    out, _ = run_job(5, body)
    assert out == [{"n": 5, "sum": 10}] * 5, out
    _, service = run_job(6, lambda p: p.barrier("open (probes written)"))
    assert service.totals()[0] == 6 + 6  # the opening increments, the barrier
    out, _ = run_job(4, lambda p: "silent" if p.index == 3
                     else p.barrier("open (probes written)"), timeout_s=0.3)
    assert out[3] == "silent"
    for e in out[:3]:
        assert isinstance(e, AgreementError) and "open (probes written)" in str(e)
        assert "[3]" in str(e), e  # the service's account: process 3 did not arrive


def test_a_silent_leader_is_named_by_every_process_waiting_for_it():
    def body(p):
        if p.index == 0:
            return "silent"
        return p.decide("save of step 9", {"i": p.index}, _digest)
    out, _ = run_job(4, body, timeout_s=0.3)
    for e in out[1:]:
        assert isinstance(e, AgreementError) and "process 0 of 4" in str(e)
        assert "its decision" in str(e) and "save of step 9" in str(e)


def test_a_rule_that_fails_fails_on_every_process():
    """A rule that raises (a bug) raises on the leader, and every other
    process gets an AgreementError that says so, instead of waiting."""
    def body(p):
        return p.decide("reload", {"x": None}, _digest)  # sum() of None: TypeError
    out, _ = run_job(3, body, timeout_s=5.0)
    assert isinstance(out[0], TypeError)
    for e in out[1:]:
        assert isinstance(e, AgreementError) and "could not decide reload" in str(e)
        assert "TypeError" in str(e)


def test_a_round_a_lost_process_left_ends_at_once_when_the_leader_abandons_it():
    """A round reserved earlier (a save's agreement in the background) that
    process 2 will never join: once the leader abandons it for process 2,
    every process waiting in it raises AgreementError naming process 2 at
    once, not after the timeout; the next round goes on among the others."""
    n, t0 = 3, time.monotonic()

    def body(p):
        at = p.reserve()
        if p.index == 2:
            return "lost"
        if p.index == 0:
            threading.Timer(0.3, p.abandon, args=(at, {2})).start()
        try:
            p.decide("save of step 4", {"x": p.index}, _digest, at=at)
        except AgreementError as e:
            p.set_live([0, 1])
            return str(e), p.decide("a change of the live processes", {"x": 1}, _digest)
        return "decided"
    out, _ = run_job(n, body, timeout_s=30.0)
    assert time.monotonic() - t0 < 10  # not the 30 s timeout
    for msg, after in out[:2]:
        assert "process 2 of 3" in msg and "save of step 4" in msg, msg
        assert after == {"n": 2, "sum": 2}


def test_an_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="agreement protocol 'ring'"):
        Peers(1.0, job=(KeyValueService(2).client(0), 0, 2), protocol="ring")


@settings(max_examples=effort.examples(40), deadline=None)
@given(shares_reports(max_processes=6), st.sampled_from([None, 2, 4]))
def test_the_gather_protocol_decides_what_the_all_to_all_decided(data, boxes_from):
    """The job's rule (`catalog.JobView`, with a second round of boxes when a
    save is unsettled) through both protocols on the same views: every
    process of both gets the very same decision."""
    reports, _ = data
    n = len(reports)
    views = [{"shares": [s.to_json() for s in r], "pending": [], "errors": [f"e{q}"] * (q % 2),
              "orbax": [1, 2] if q % 3 else [1], "save_id": f"id{q}", "in_use": None}
             for q, r in enumerate(reports)]

    def body(p):
        kept = []

        def first(vs):
            kept.append(JobView.decided(vs))
            return kept[-1].to_json()
        d = p.decide("save", views[p.index], first)
        job = JobView.from_json(d)
        if job.unsettled:
            box = [[s, sid, c, [["default", 0, [4], [[[p.index % (boxes_from or 1)], [1]]]]]]
                   for s, sid, c in job.unsettled]
            d = p.decide("boxes", {"boxes": box}, lambda vs: kept[-1].cover(vs).to_json())
        return d
    got = {proto: run_job(n, body, protocol=proto)[0] for proto in PROTOCOLS}
    for proto, out in got.items():
        assert not any(isinstance(x, Exception) for x in out), (proto, out)
    assert got["gather"] == got["all-to-all"] == [got["gather"][0]] * n


def test_a_simulated_process_out_of_range_is_refused():
    with pytest.raises(ValueError, match="process 4 is not in a job of 4"):
        KeyValueService(4).client(4)


# ------------------------------------------------------------ hostile inputs


@pytest.mark.parametrize("count,service_s,per_byte_s,rtt_s", [
    (0, 0, 0, 0), (-3, 0, 0, 0), (2, -1, 0, 0), (2, 0, -1e-9, 0), (2, 0, 0, -0.5)])
def test_a_job_of_no_process_or_a_negative_cost_is_refused(count, service_s, per_byte_s, rtt_s):
    with pytest.raises(ValueError, match="at least 1 process and costs >= 0"):
        KeyValueService(count, service_s, per_byte_s, rtt_s)


@pytest.mark.parametrize("index", [-1, 3, 10**9])
def test_a_simulated_process_outside_the_job_is_refused(index):
    with pytest.raises(ValueError, match=f"process {index} is not in a job of 3"):
        KeyValueService(3).client(index)
    client = KeyValueService(5).client(0)
    with pytest.raises(ValueError, match=f"simulated process {index} is not in a job of 3"):
        Peers(1.0, job=(client, index, 3))


def test_keys_behave_as_the_coordination_service_s():
    """A key set twice is refused (nothing overwritten), a missing key or
    process times out naming it, and deleting a key takes the keys under it
    as a directory, never a sibling that merely shares its prefix."""
    c = KeyValueService(2).client(0)
    c.key_value_set("x/1", "a")
    with pytest.raises(RuntimeError, match="ALREADY_EXISTS: key x/1"):
        c.key_value_set("x/1", "b")
    assert c.blocking_key_value_get("x/1", 100) == "a"
    c.key_value_set("x/1", "b", allow_overwrite=True)
    assert c.blocking_key_value_get("x/1", 100) == "b"
    with pytest.raises(TimeoutError, match="key nowhere not set"):
        c.blocking_key_value_get("nowhere", 50)
    with pytest.raises(TimeoutError, match=r"processes \[1\] did not arrive"):
        c.wait_at_barrier("b", 50)
    for k in ("x/1/a", "x/10", "x/1b"):
        c.key_value_set(k, "v")
    c.key_value_delete("x/1")
    assert [k for k, _ in c.key_value_dir_get("x/")] == ["x/10", "x/1b"]
    assert c.key_value_increment("n", 2) == 2 and c.key_value_increment("n", -5) == -3


def test_a_non_positive_heartbeat_is_refused_before_any_process_starts(tmp_path):
    from resilient_ckpt.testing.multiprocess import start_job
    for bad in (0, -5):
        with pytest.raises(ValueError, match="heartbeat_timeout_s must be at least 1"):
            start_job("print('never')\n", 2, 1, heartbeat_timeout_s=bad,
                      workdir=str(tmp_path / "job"))
    assert not (tmp_path / "job").exists()  # nothing written, nothing started
