"""The agreement protocol (`multihost.agree.Peers`) driven for simulated jobs
of many processes (threads) against `testing.kvservice`, the in-process
stand-in for jax.distributed's coordination service: what every process
gets, what a silent process costs, and how many requests one agreement makes
of the coordinator (the figure the protocol's cost at thousands of hosts
follows from)."""
from __future__ import annotations

import threading

import pytest

from resilient_ckpt.errors import AgreementError
from resilient_ckpt.multihost.agree import Peers
from resilient_ckpt.testing.kvservice import KeyValueService


def run_job(n, body, service=None, timeout_s=10.0):
    """`body(peers)` on n threads, one simulated process each; their results
    (or exceptions) in process order."""
    service = service or KeyValueService(n)
    out: list = [None] * n

    def one(i):
        try:
            out[i] = body(Peers("/ckpt", timeout_s, job=(service.client(i), i, n)))
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a simulated process hung"
    return out, service


@pytest.mark.parametrize("n", [2, 5, 16])
def test_every_process_gets_every_view_in_process_order(n):
    out, _ = run_job(n, lambda p: [p.exchange("test", {"i": p.index, "r": r}) for r in range(3)])
    for views in out:
        assert views == [[{"i": q, "r": r} for q in range(n)] for r in range(3)]


@pytest.mark.parametrize("n", [2, 8, 32])
def test_one_all_to_all_agreement_costs_n_squared_requests(n):
    """Opening (one counter increment each), then one exchange: each process
    sets its key, reads the n-1 others', waits at the barrier and deletes its
    key. This is the cost the issue of thousands of hosts is about: n*(n+2)
    requests per agreement, every view read n-1 times."""
    service = KeyValueService(n)
    run_job(n, lambda p: None, service)
    assert service.totals()[0] == n  # the opening increments
    service.reset_counts()
    view = {"shares": [[7, "a" * 32, 0, n, "ram", 1.0]] * 3}
    out, _ = run_job(n, lambda p: p.exchange("save of step 7", view), service)
    assert all(v == [view] * n for v in out)
    requests, nbytes = service.totals()
    assert requests == n + n * (n + 2)  # this job's opening, then the exchange
    assert nbytes >= n * n * len(str(view))  # every view crosses the coordinator n times


def test_a_silent_process_is_named_not_a_hang():
    def body(p):
        if p.index == 2:
            return "silent"  # never makes the call the others make
        return p.exchange("restore of step 3", {"i": p.index})
    out, _ = run_job(3, body, timeout_s=0.5)
    assert out[2] == "silent"
    for e in out[:2]:
        assert isinstance(e, AgreementError) and "process 2 of 3" in str(e)
        assert "restore of step 3" in str(e)


def test_a_simulated_process_out_of_range_is_refused():
    with pytest.raises(ValueError, match="process 4 is not in a job of 4"):
        KeyValueService(4).client(4)


# ------------------------------------------------------------ hostile inputs


@pytest.mark.parametrize("count,service_s,per_byte_s", [(0, 0, 0), (-3, 0, 0), (2, -1, 0),
                                                        (2, 0, -1e-9)])
def test_a_job_of_no_process_or_a_negative_cost_is_refused(count, service_s, per_byte_s):
    with pytest.raises(ValueError, match="at least 1 process and costs >= 0"):
        KeyValueService(count, service_s, per_byte_s)


@pytest.mark.parametrize("index", [-1, 3, 10**9])
def test_a_simulated_process_outside_the_job_is_refused(index):
    with pytest.raises(ValueError, match=f"process {index} is not in a job of 3"):
        KeyValueService(3).client(index)
    client = KeyValueService(5).client(0)
    with pytest.raises(ValueError, match=f"simulated process {index} is not in a job of 3"):
        Peers("/ckpt", 1.0, job=(client, index, 3))


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
