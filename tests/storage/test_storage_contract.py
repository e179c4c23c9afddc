"""Every backend, and the forwarding wrapper, against the one storage contract
(resilient_ckpt/testing/storage_contract.py): the RAM tier's FileStorage on
tmpfs, the local-disk FileStorage (also pinned to a descriptor of its root),
GcsStorage on fake-gcs-server, and a StorageWrapper; then what the wrapper
must forward that a __getattr__ missed."""
import io
import os
import threading
import uuid

import numpy as np
from tqdm import tqdm

from resilient_ckpt import RetryPolicy
from resilient_ckpt.restore import progress
from resilient_ckpt.storage import FileStorage, Storage, StorageWrapper, files
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.storage_contract import StorageContract

FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)


def ram_storage(path: str) -> FileStorage:
    return FileStorage(path, "ram", fsync=False, zero_copy=True)


def gcs_storage(gcs) -> GcsStorage:
    bucket = "c-" + uuid.uuid4().hex[:12]
    gcs.create_bucket(bucket)
    return GcsStorage(f"gs://{bucket}/run", endpoint=gcs.endpoint, retry=FAST,
                      piece_bytes=1 << 16)


class TestRamFileStorage(StorageContract):
    def make_storage(self, tmp_path):
        return ram_storage(self.request.getfixturevalue("ram_path"))


class TestLocalFileStorage(StorageContract):
    def make_storage(self, tmp_path):
        return FileStorage(str(tmp_path / "tier"), "local")


class TestLocalFileStorageMappingCached(StorageContract):
    """The local tier as LocalTier opens it: page-cached objects mapped."""

    def make_storage(self, tmp_path):
        return FileStorage(str(tmp_path / "tier"), "local", direct=True, maps_cached=True)


class TestPinnedFileStorage(StorageContract):
    """A FileStorage pinned to a descriptor of its root (as the tool opens a
    recorded tier it checked): the same contract, walked from the descriptor."""

    def make_storage(self, tmp_path):
        (tmp_path / "tier").mkdir()
        fd = files.open_below(str(tmp_path), "tier")
        try:
            return FileStorage(str(tmp_path / "tier"), "local", root_fd=fd)
        finally:
            os.close(fd)


class TestGcsStorage(StorageContract):
    overwrite_rounds = 10

    def make_storage(self, tmp_path):
        return gcs_storage(self.request.getfixturevalue("gcs"))


class TestStorageWrapper(StorageContract):
    def make_storage(self, tmp_path):
        return StorageWrapper(ram_storage(self.request.getfixturevalue("ram_path")))


def test_the_wrapper_forwards_every_member_of_the_interface():
    members = {n for n in dir(Storage) if not n.startswith("_")}
    missing = sorted(n for n in members if n not in vars(StorageWrapper))
    assert not missing, f"StorageWrapper inherits Storage's defaults for {missing}"
    assert "__getattr__" not in vars(progress._Counting)


def counting(inner: Storage):
    bar = tqdm(file=io.StringIO(), mininterval=3600)
    return progress._Counting(inner, bar, threading.Lock()), bar


def test_a_counted_gcs_storage_is_the_backends_own(gcs):
    inner = gcs_storage(gcs)
    st, bar = counting(inner)
    assert (st.piece_bytes, st.remote, st.shared, st.sizes_from_manifest) == (
        1 << 16, True, True, True)
    assert st.kind == "gcs" and st.url == inner.url and not st.zero_copy
    st.put("1/a", memoryview(np.arange(100, dtype=np.uint8)))
    ages = st.object_ages("1")
    assert set(ages) == {"a"}
    assert st.read("1/a") == bytes(range(100))
    out = bytearray(10)
    st.read_into("1/a", memoryview(out), 90)
    assert bar.n == 110
    st.close()


class _Flushes(FileStorage):
    """A real FileStorage that also notes the directories it flushed."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.flushed = []

    def flush(self, prefix):
        self.flushed.append(prefix)
        super().flush(prefix)


def test_a_counted_file_storage_is_the_backends_own(ram_path):
    inner = _Flushes(ram_path, "ram", fsync=False, zero_copy=True)
    st, bar = counting(inner)
    assert st.zero_copy and not st.remote and st.kind == "ram"
    st.begin_write("4")
    assert any(n.startswith(".writing.") for n in os.listdir(os.path.join(ram_path, "4")))
    st.put("4/a", b"x" * 8192)
    st.flush("4")
    assert inner.flushed == ["4"]
    st.end_write("4")
    assert os.listdir(os.path.join(ram_path, "4")) == ["a"]
    view = st.map("4/a", 8192)
    assert view is not None and bytes(view[:2]) == b"xx" and bar.n == 8192
    st.delete("4/a")
    assert st.remove_empty_dir("4") and not os.path.exists(os.path.join(ram_path, "4"))
