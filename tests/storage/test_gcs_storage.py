"""The GCS backend against a real server (fake-gcs-server) through the real client,
with the project's fault-injecting proxy in between where faults are needed."""
import errno
import time
import uuid

import numpy as np
import pytest

from resilient_ckpt import RetryPolicy, StorageError
from resilient_ckpt.catalog import tier_steps
from resilient_ckpt.core import layout
from resilient_ckpt.storage.base import READ_SPLIT
from resilient_ckpt.storage.gcs import GcsStorage, parse_url
from resilient_ckpt.testing.gcs_proxy import FaultProxy

FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)


@pytest.fixture
def bucket(gcs):
    name = "t-" + uuid.uuid4().hex[:12]
    gcs.create_bucket(name)
    return name


@pytest.fixture
def proxy(gcs):
    with FaultProxy(gcs.endpoint, seed=7) as p:
        yield p


def open_store(endpoint, bucket, **kw):
    kw.setdefault("retry", FAST)
    return GcsStorage(f"gs://{bucket}/run", endpoint=endpoint, **kw)


def data(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_large_objects_compose_in_rounds_and_read_as_parallel_ranges(gcs, bucket):
    """Puts, reads, listing and deletes in general are the storage contract's
    (test_storage_contract.py); here, what is GCS's own: an object of more
    than 32 parts (two rounds of compose) read back as parallel ranges."""
    st = open_store(gcs.endpoint, bucket, piece_bytes=1 << 20)
    big = data(READ_SPLIT + 2**20 + 13, 1)
    st.put("3/b", memoryview(big))
    assert st.list("3") == ["b"]  # the parts are gone
    assert st.size("3/b") == big.nbytes
    out = np.empty_like(big)
    st.read_into("3/b", memoryview(out))  # several parallel ranges
    assert np.array_equal(out, big)
    part = np.empty(5000, np.uint8)
    st.read_into("3/b", memoryview(part), offset=3 * 2**20 - 7)
    assert np.array_equal(part, big[3 * 2**20 - 7:3 * 2**20 - 7 + 5000])
    st.close()


def test_manifests_are_listed_by_name_prefix_on_the_server(gcs, bucket, proxy):
    st = open_store(proxy.endpoint, bucket)
    for name in ("0123abcd.c0.0.0", "manifest.0-of-1.json", "other"):
        st.put(f"1/{name}", b"x")
    proxy.log.clear()
    assert st.list("1", starts_with="manifest.") == ["manifest.0-of-1.json"]
    lists = [path for method, path, _ in proxy.log
             if method == "GET" and path.split("?")[0].endswith("/o")]
    assert len(lists) == 1 and "prefix=run%2F1%2Fmanifest." in lists[0], proxy.log


def test_failures_are_our_errors_naming_the_path(gcs, bucket):
    st = open_store(gcs.endpoint, bucket)
    with pytest.raises(StorageError) as ei:
        st.read_into("9/nothing", memoryview(bytearray(10)))
    assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOENT
    assert f"gs://{bucket}/run/9/nothing" in str(ei.value)
    st.put("9/short", memoryview(data(100)))
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="truncated"):  # really short: final at once
        st.read_into("9/short", memoryview(bytearray(200)))
    assert time.monotonic() - t0 < 5
    missing = open_store(gcs.endpoint, "no-such-bucket-" + uuid.uuid4().hex[:6])
    with pytest.raises(StorageError, match="no-such-bucket"):
        missing.list("")
    with pytest.raises(ValueError, match="gs://"):
        parse_url("s3://x/y")


@pytest.mark.parametrize("fault", ["429", "503", "reset", "reset_after", "truncate"])
def test_each_fault_is_retried(gcs, bucket, proxy, fault):
    st = open_store(proxy.endpoint, bucket)
    payload = data(70_000, 3)
    for op in ("put", "read", "list", "commit", "delete"):
        proxy.queue(fault, fault)
        if op == "put":
            st.put("2/x", memoryview(payload))
        elif op == "read":
            out = np.empty_like(payload)
            st.read_into("2/x", memoryview(out))
            assert np.array_equal(out, payload)
        elif op == "list":
            assert st.list("2") == ["x"]
        elif op == "commit":
            # "reset_after": the first try lands and its answer is lost; the
            # retry is refused (412) and must still count as our own commit.
            assert st.put_if_absent("2/manifest.0-of-1.json", b"mine")
            assert st.read("2/manifest.0-of-1.json") == b"mine"
        else:
            st.delete("2/x")
            assert st.size("2/x") is None
    assert proxy.faulted[fault] == 10


def test_a_lost_commit_answer_is_not_mistaken_for_another_writer(gcs, bucket, proxy):
    st = open_store(proxy.endpoint, bucket)
    proxy.queue("reset_after")
    assert st.put_if_absent("4/manifest.0-of-1.json", b"ours")
    other = open_store(gcs.endpoint, bucket)
    assert not other.put_if_absent("4/manifest.0-of-1.json", b"theirs")


def test_persistent_failure_ends_at_the_deadline(gcs, bucket, proxy):
    proxy.set(fraction=1.0, faults=["503"])
    st = open_store(proxy.endpoint, bucket,
                    retry=RetryPolicy(deadline_s=1.0, initial_s=0.01, max_delay_s=0.1))
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.put("5/x", memoryview(data(10)))
    assert ei.value.errno == errno.ETIMEDOUT and "attempts" in str(ei.value)
    assert 0.5 < time.monotonic() - t0 < 5


def test_a_stalled_request_times_out_and_is_retried(gcs, bucket, proxy):
    proxy.set(faults=["stall"])
    proxy.stall_s = 3.0
    st = open_store(proxy.endpoint, bucket,
                    retry=RetryPolicy(deadline_s=20, attempt_timeout_s=0.5, initial_s=0.01))
    st.put("6/x", memoryview(data(10)))
    proxy.queue("stall")
    t0 = time.monotonic()
    assert st.read("6/x") == data(10).tobytes()
    assert time.monotonic() - t0 < 2.5  # gave up on the stalled try, did not wait it out


def test_finding_steps_lists_manifests_only(gcs, bucket, proxy):
    """Observing a tier costs one listing, then per step one manifest listing
    and one read per manifest: never a listing or a size request per chunk."""
    st = open_store(gcs.endpoint, bucket)
    naming = layout.StepNaming()
    steps, chunks = 4, 30
    for s in range(steps):
        for i in range(chunks):
            st.put(f"{s}/deadbeef.c0.0.{i}", memoryview(data(10)))
        st.put_if_absent(f"{s}/manifest.0-of-1.json", b"{}")  # unparsable, still read
    watched = open_store(proxy.endpoint, bucket)
    seen = tier_steps.observe(watched, "gcs", naming)
    assert sorted(seen) == list(range(steps))
    methods = [(m, path.split("?")[0]) for m, path, _ in proxy.log]
    lists = [p for m, p in methods if m == "GET" and p.endswith("/o")]
    reads = [p for m, p in methods if "/download/" in p]
    # google-cloud-storage may also fetch the bucket's metadata once per client.
    bucket_gets = [p for m, p in methods if p == f"/storage/v1/b/{bucket}"]
    assert len(lists) == 1 + steps and len(reads) == steps and len(bucket_gets) <= 1
    assert len(methods) == len(lists) + len(reads) + len(bucket_gets)
