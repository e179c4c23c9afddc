"""Failures are reported right: once, for the step and tier they belong to, and
none is lost; a failed retention delete is not a failed save and is retried;
an old failure never costs a new save; GCS retries honour Retry-After and
back off as GCS documents; a GCS outage never makes `save` wait. All through
fake-gcs-server and the fault proxy, nothing mocked."""
import email.utils
import errno
import logging
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    GcsTier,
    RamTier,
    RetryPolicy,
    SaveFailedError,
    StorageError,
)
from resilient_ckpt.core import layout
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.gcs_proxy import FaultProxy

HANG = 120  # seconds: only to detect a hang, never a speed assertion
FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)
# A hung request waits for the proxy (attempt_timeout_s); a refused one fails in 0.5 s.
SHORT = RetryPolicy(deadline_s=0.5, attempt_timeout_s=30, initial_s=0.01, max_delay_s=0.05)


def make_state(mesh, seed):
    r = np.random.default_rng(seed)
    return {"w": jax.device_put(r.standard_normal((64, 32)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "np": np.arange(5.0) + seed, "step": seed}


def save(m, mesh, step):
    return m.save(step, args=ocp.args.StandardSave(make_state(mesh, step)))


def committed_on_server(gcs, url) -> set[int]:
    """Steps with a manifest on the server, read past the proxy."""
    st = GcsStorage(url, endpoint=gcs.endpoint)
    try:
        return {int(n) for n in st.list("")
                if st.list(n, starts_with=layout.MANIFEST_PREFIX)}
    finally:
        st.close()


def wait_idle(m):
    """Waits for the background writes without raising their failures."""
    deadline = time.monotonic() + HANG
    while m.is_saving_in_progress():
        assert time.monotonic() < deadline, "background writes hang"
        time.sleep(0.02)


def reported(err: SaveFailedError) -> list[tuple[int, str]]:
    return [(e.step, e.tier) for e in (err.failures or (err,))]


# ------------------------------------------------------------ retries


def retry_times(proxy: FaultProxy, fault: str) -> tuple[float, float]:
    """When the first request answered with `fault` and its retry (the next
    request of the same method and path) reached the proxy, from its log."""
    i = next(k for k, (_, _, f) in enumerate(proxy.log) if f == fault)
    j = next(k for k in range(i + 1, len(proxy.log)) if proxy.log[k][:2] == proxy.log[i][:2])
    return proxy.times[i], proxy.times[j]


def gap_after_fault(proxy: FaultProxy, fault: str) -> float:
    first, retry = retry_times(proxy, fault)
    return retry - first


def test_retry_after_in_seconds_is_honoured(gcs, url):
    with FaultProxy(gcs.endpoint, retry_after="2",
                    match=lambda m, p: "/upload/" in p) as proxy:
        st = GcsStorage(url, endpoint=proxy.endpoint, retry=FAST)
        proxy.queue("429")
        st.put("a/media", memoryview(b"x" * 1000))  # our own request's answer
        proxy.queue("503")
        assert st.put_if_absent("a/commit", b"{}")  # the client's (multipart) answer
        st.close()
        assert proxy.faulted == {"429": 1, "503": 1}
        # FAST alone would retry within 0.05 s; the server asked for 2 s.
        assert gap_after_fault(proxy, "429") >= 2.0
        assert gap_after_fault(proxy, "503") >= 2.0
    direct = GcsStorage(url, endpoint=gcs.endpoint)
    assert direct.read("a/media") == b"x" * 1000 and direct.read("a/commit") == b"{}"
    direct.close()


def test_retry_after_as_an_http_date_is_honoured(gcs, url):
    with FaultProxy(gcs.endpoint, match=lambda m, p: m == "DELETE") as proxy:
        st = GcsStorage(url, endpoint=proxy.endpoint, retry=FAST)
        st.put("b", memoryview(b"y"))
        when = int(time.time()) + 2
        proxy.set(retry_after=email.utils.formatdate(when, usegmt=True))
        proxy.queue("429")
        st.delete("b")
        st.close()
        assert retry_times(proxy, "429")[1] >= when  # not before the date it named
    assert GcsStorage(url, endpoint=gcs.endpoint).size("b") is None


def test_a_retry_after_past_the_deadline_gives_up_at_once(gcs, url):
    with FaultProxy(gcs.endpoint, retry_after="3600",
                    match=lambda m, p: "/upload/" in p) as proxy:
        st = GcsStorage(url, endpoint=proxy.endpoint, retry=FAST)
        proxy.queue("429")
        with pytest.raises(StorageError, match="Retry-After") as ei:
            st.put("c", memoryview(b"z"))
        st.close()
    assert ei.value.errno == errno.ETIMEDOUT and "gs://" in str(ei.value)
    assert [f for m, p, f in proxy.log if "/upload/" in p] == ["429"]  # no second try


def test_backoff_is_gcs_truncated_exponential_with_jitter():
    import random
    policy, rng = RetryPolicy(), random.Random(1)
    assert (policy.initial_s, policy.multiplier, policy.max_delay_s) == (1.0, 2.0, 32.0)
    for attempt in range(1, 12):
        bound = min(2.0 ** (attempt - 1), 32.0)
        waits = [policy.backoff(attempt, rng) for _ in range(50)]
        assert all(bound <= w <= 1.5 * bound for w in waits)
        assert len(set(waits)) > 1  # jittered: hosts do not come back together
    small = RetryPolicy(initial_s=0.01, max_delay_s=0.05, jitter=0)
    assert [small.backoff(a) for a in (1, 2, 3, 4)] == [0.01, 0.02, 0.04, 0.05]


# ------------------------------------------------------------ retention


def test_a_failed_retention_delete_is_not_a_failed_save_and_is_retried(
        gcs, url, mesh, tmp_path, caplog):
    with FaultProxy(gcs.endpoint, faults=["503"], match=lambda m, p: m == "DELETE") as proxy:
        opts = CheckpointManagerOptions(tiers=[
            GcsTier(url, endpoint=proxy.endpoint, every=1, keep=2, retry=SHORT)])
        m = CheckpointManager(url, options=opts)
        for s in (0, 1):
            save(m, mesh, s)
            m.wait_until_finished()
        proxy.set(fraction=1.0)  # every DELETE fails from now on
        with caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
            save(m, mesh, 2)
            m.wait_until_finished()  # the save committed: nothing to raise
        assert m.save_records[-1].tiers["gcs"].ok
        assert any("retention" in r.message and "could not delete step 0" in r.message
                   for r in caplog.records)
        assert committed_on_server(gcs, url) == {0, 1, 2}  # keep + the one that failed
        assert 0 in m.catalog.view("gcs")  # still counted, so retried
        save(m, mesh, 3)
        m.wait_until_finished()
        # Never a newer step deleted in place of the older ones that failed.
        assert committed_on_server(gcs, url) == {0, 1, 2, 3}
        proxy.set(fraction=0.0)  # deletes work again
        save(m, mesh, 4)
        m.wait_until_finished()
        assert committed_on_server(gcs, url) == {3, 4}
        assert sorted(m.catalog.view("gcs")) == [3, 4]
        m.check_for_errors()  # nothing was ever a failed save
        m.close()


# ------------------------------------------------------------ failed saves


def failing_uploads(gcs, ram_path, url):
    proxy = FaultProxy(gcs.endpoint, faults=["503"], match=lambda m, p: "/upload/" in p)
    proxy.start()
    opts = CheckpointManagerOptions(tiers=[
        RamTier(path=ram_path, every=1, keep=10),
        GcsTier(url, endpoint=proxy.endpoint, every=1, keep=10, retry=SHORT,
                concurrency=1)])
    return proxy, opts


def test_several_failures_are_each_reported_once(gcs, url, mesh, ram_path, tmp_path):
    proxy, opts = failing_uploads(gcs, ram_path, url)
    try:
        m = CheckpointManager(tmp_path, options=opts)
        proxy.set(fraction=1.0)
        proxy.pause()  # step 1's upload hangs until both saves have returned
        save(m, mesh, 1)
        save(m, mesh, 2)  # its upload waits behind step 1's
        proxy.resume()
        wait_idle(m)  # both uploads fail, neither raised yet
        with pytest.raises(SaveFailedError) as ei:
            m.check_for_errors()
        assert reported(ei.value) == [(1, "gcs"), (2, "gcs")]
        for e in ei.value.failures:
            assert isinstance(e.__cause__, OSError) and f"step {e.step} to the gcs" in str(e)
        assert all(f"step {s} to the gcs tier" in str(ei.value) for s in (1, 2))
        m.check_for_errors()  # each was reported once: nothing left
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]  # the RAM copies
        proxy.set(fraction=0.0)
        m.close()
    finally:
        proxy.stop()


def test_a_save_after_a_failed_save_still_writes_its_own_step(gcs, url, mesh, ram_path,
                                                               tmp_path):
    proxy, opts = failing_uploads(gcs, ram_path, url)
    try:
        m = CheckpointManager(tmp_path, options=opts)
        proxy.set(fraction=1.0)
        save(m, mesh, 1)
        wait_idle(m)
        proxy.set(fraction=0.0)  # GCS is back
        with pytest.raises(SaveFailedError) as ei:
            save(m, mesh, 2)  # raises step 1's failure, after starting step 2
        assert reported(ei.value) == [(1, "gcs")]
        m.wait_until_finished()  # step 2's own writes: nothing failed
        rec = m.save_records[-1]
        assert rec.step == 2 and rec.tiers["ram"].ok and rec.tiers["gcs"].ok
        assert 2 in m.catalog.view("ram") and 2 in m.catalog.view("gcs")
        assert committed_on_server(gcs, url) == {2}
        m.check_for_errors()
        m.close()
    finally:
        proxy.stop()


# ------------------------------------------------------------ GCS outage


def test_a_gcs_outage_never_makes_save_wait(gcs, url, mesh):
    patient = RetryPolicy(deadline_s=HANG, attempt_timeout_s=5, initial_s=0.05,
                          max_delay_s=0.2)
    with FaultProxy(gcs.endpoint, faults=["503"]) as proxy:
        opts = CheckpointManagerOptions(tiers=[
            GcsTier(url, endpoint=proxy.endpoint, every=1, keep=10, retry=patient)])
        m = CheckpointManager(url, options=opts)
        save(m, mesh, 0)
        m.wait_until_finished()
        proxy.set(fraction=1.0)  # GCS refuses every request
        before = proxy.faulted["503"]
        for s in (1, 2, 3, 4):
            t = threading.Thread(target=save, args=(m, mesh, s))
            t.start()
            t.join(HANG / 2)
            assert not t.is_alive(), f"save({s}) waited for GCS"
            deadline = time.monotonic() + HANG
            while s == 1 and proxy.faulted["503"] == before and time.monotonic() < deadline:
                time.sleep(0.01)  # step 1's write is running (not queued) before step 2
        # All four returned while step 1's write was still failing against GCS.
        assert m.is_saving_in_progress() and proxy.faulted["503"] > 0
        assert committed_on_server(gcs, url) == {0}
        proxy.set(fraction=0.0)
        m.wait_until_finished()
        gcs_writes = {r.step: r.tiers["gcs"] for r in m.save_records}
        assert gcs_writes[1].ok and gcs_writes[4].ok
        for s in (2, 3):  # queued behind the stuck write: dropped, said so
            assert not gcs_writes[s].ok and "superseded by step" in gcs_writes[s].skipped
        assert committed_on_server(gcs, url) == {0, 1, 4}
        m.close()
