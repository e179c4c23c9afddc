"""The fsspec tier's storages against the storage contract and their own
promises: S3 on moto's server (create-only commit by If-None-Match), gcsfs on
fake-gcs-server (generation 0), file:// on a directory, a store with no
create-only write refused; racing writers; faults through the proxy."""
import concurrent.futures as cf
import errno
import io
import multiprocessing
import os

import pytest

from resilient_ckpt import RetryPolicy, StorageError
from resilient_ckpt.storage.fsspec_store import FsspecStorage, SharedFiles, open_url
from resilient_ckpt.testing.gcs_proxy import FaultProxy
from resilient_ckpt.testing.storage_contract import StorageContract
from resilient_ckpt.tiers import FsspecTier

FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)


def s3_storage(s3, endpoint=None, **kw) -> FsspecStorage:
    return FsspecStorage(f"s3://{s3.bucket()}/run", s3.options(endpoint), retry=FAST,
                         piece_bytes=5 << 20, **kw)


class TestS3Storage(StorageContract):
    overwrite_rounds = 10

    def make_storage(self, tmp_path):
        return s3_storage(self.request.getfixturevalue("s3"))


class TestGcsfsStorage(StorageContract):
    overwrite_rounds = 5

    def make_storage(self, tmp_path):
        gcs = self.request.getfixturevalue("gcs")
        bucket = "f-" + os.urandom(6).hex()
        gcs.create_bucket(bucket)
        return FsspecStorage(f"gs://{bucket}/run", {"endpoint_url": gcs.endpoint,
                                                    "token": "anon"},
                             retry=FAST, piece_bytes=5 << 20)

    def stream_bytes(self, storage):
        return (1 << 20) + 123  # gcsfs's resumable writer: the 5 MiB pieces are S3's


class TestSharedFiles(StorageContract):
    def make_storage(self, tmp_path):
        return open_url(f"file://{tmp_path}/shared")


def test_flags_and_names_per_store(s3, tmp_path):
    st = s3_storage(s3)
    assert (st.kind, st.remote, st.shared, st.create_only_commit) == ("s3", True, True, True)
    assert st.url.startswith("s3://b-") and st.url.endswith("/run")
    st.close()
    f = open_url(f"file://{tmp_path}")
    assert isinstance(f, SharedFiles) and f.kind == "file" and f.remote and f.shared
    assert f.url == f"file://{tmp_path}"


def test_a_store_without_create_only_writes_cannot_be_written(tmp_path):
    st = FsspecStorage("memory://nowhere/run")
    assert not st.create_only_commit
    st.put("1/a", b"x")
    with pytest.raises(StorageError) as ei:
        st.put_if_absent("1/manifest.0-of-1.json", b"{}")
    assert ei.value.errno == errno.ENOTSUP
    assert st.list("1") == ["a"]
    tier = FsspecTier("memory://nowhere/run")
    with pytest.raises(ValueError, match="no create-only write"):
        tier.open(str(tmp_path), create=True)
    tier.open(str(tmp_path), create=False).close()  # read-only: restores only


def test_a_second_create_only_put_on_s3_is_refused_by_the_server(s3):
    import boto3
    from botocore.exceptions import ClientError
    st = s3_storage(s3)
    assert st.put_if_absent("1/m", b"one")
    bucket = st.url[5:].split("/")[0]
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    with pytest.raises(ClientError) as ei:  # the server's own answer, not ours
        client.put_object(Bucket=bucket, Key="run/1/m", Body=b"two", IfNoneMatch="*")
    assert ei.value.response["Error"]["Code"] == "PreconditionFailed"
    assert not st.put_if_absent("1/m", b"two")
    assert st.read("1/m") == b"one"
    st.close()


def _commit_in_process(root, i, barrier):
    barrier.wait()
    return open_url(f"file://{root}").put_if_absent("7/manifest.0-of-1.json",
                                                    f"writer {i}".encode())


def test_processes_racing_on_a_shared_file_system_commit_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    n = 2  # each child imports jax (spawn); CI has two cores
    with ctx.Manager() as mgr, cf.ProcessPoolExecutor(n, mp_context=ctx) as ex:
        barrier = mgr.Barrier(n)
        wins = [i for i, won in enumerate(ex.map(_commit_in_process, [str(tmp_path)] * n,
                                                 range(n), [barrier] * n)) if won]
    assert len(wins) == 1
    st = open_url(f"file://{tmp_path}")
    assert st.read("7/manifest.0-of-1.json") == f"writer {wins[0]}".encode()
    assert st.list("7") == ["manifest.0-of-1.json"]  # no temporaries left


def test_s3_faults_are_retried(s3):
    data = os.urandom(100_000)
    with FaultProxy(s3.endpoint) as proxy:
        st = s3_storage(s3, proxy.endpoint)
        proxy.queue("503", "reset", "429")
        st.put("1/a", memoryview(data))
        proxy.queue("reset", "truncate", "503")
        assert st.read("1/a") == data
        proxy.queue("503", "reset")
        assert st.list("1") == ["a"] and st.size("1/a") == len(data)
        proxy.queue("reset", "503")
        st.delete("1/a")
        assert st.size("1/a") is None
        assert sum(proxy.faulted.values()) == 10
        st.close()


def test_a_commit_whose_answer_was_lost_is_still_ours(s3):
    with FaultProxy(s3.endpoint) as proxy:
        st = s3_storage(s3, proxy.endpoint)
        proxy.queue("reset_after")  # landed upstream, the answer never came
        assert st.put_if_absent("2/manifest.0-of-1.json", b"mine")
        assert proxy.faulted["reset_after"] == 1
        assert not st.put_if_absent("2/manifest.0-of-1.json", b"someone else")
        assert st.read("2/manifest.0-of-1.json") == b"mine"
        st.close()


def test_an_outage_past_the_deadline_is_a_storage_error_naming_the_url(s3):
    with FaultProxy(s3.endpoint, fraction=1.0, faults=("503",)) as proxy:
        st = s3_storage(s3, proxy.endpoint)
        st.retry = RetryPolicy(deadline_s=0.3, attempt_timeout_s=2, initial_s=0.01,
                               max_delay_s=0.05)
        with pytest.raises(StorageError) as ei:
            st.put("1/a", memoryview(b"x"))
        assert ei.value.errno == errno.ETIMEDOUT and st.url in str(ei.value)
        st.close()


def test_s3_client_failures_are_classified():
    from botocore.exceptions import ClientError, EndpointConnectionError

    from resilient_ckpt.storage import retry

    def client_error(status, code, headers=None):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {
            "HTTPStatusCode": status, "HTTPHeaders": headers or {}}}, "PutObject")
    slow = client_error(503, "SlowDown", {"retry-after": "2"})
    assert retry.is_transient(slow) and retry.retry_after(slow) == 2.0
    wrapped = OSError(errno.EIO, "s3fs's translation")
    wrapped.__cause__ = slow
    assert retry.is_transient(wrapped)
    assert not retry.is_transient(client_error(404, "NoSuchKey"))
    assert not retry.is_transient(client_error(403, "AccessDenied"))
    assert not retry.is_transient(client_error(412, "PreconditionFailed"))
    assert retry.is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))


class _Failing(io.RawIOBase):
    """A stream that gives `n` bytes, then fails (a source tier that broke)."""

    def __init__(self, n):
        self.left = n

    def readable(self):
        return True

    def readinto(self, b):
        if self.left <= 0:
            raise StorageError(errno.EIO, "the source broke")
        k = min(len(b), self.left)
        b[:k] = b"x" * k
        self.left -= k
        return k


def test_a_stream_that_fails_midway_writes_nothing(s3):
    st = s3_storage(s3)
    with pytest.raises(StorageError, match="the source broke"):
        st.put_stream("1/big", lambda: io.BufferedReader(_Failing(12 << 20)), None)
    assert st.size("1/big") is None and st.list("1") == []
    st.close()
