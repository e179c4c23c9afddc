"""The storage contract as a pytest suite: what every Storage backend must do.

`StorageContract` holds one test per promise of `storage.base.Storage` (its
docstring is the specification): atomic puts and ranged reads, create-only
commits, listing one level with a name filter, idempotent deletes, the write
and delete call order, copy-on-write mappings where `zero_copy` (or
`maps_cached` and the object is resident), the errors raised. A backend (or
a wrapper over one) passes it by subclassing it in a test module, with a name
pytest collects, and saying how to open a fresh, empty storage:

    from resilient_ckpt.testing.storage_contract import StorageContract

    class TestMyStorage(StorageContract):
        def make_storage(self, tmp_path):
            return MyStorage(str(tmp_path))

`make_storage` may ask for other fixtures through `self.request` (the pytest
request of the test), e.g. `self.request.getfixturevalue("gcs")`. Each test
gets its own storage, closed afterwards (`close_storage`, a hook). Needs
pytest (the `test` extra); nothing here runs at import beyond that.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import io
import threading

import numpy as np
import pytest

from ..errors import StorageError
from ..storage.base import Storage

MANIFEST = "manifest.0-of-1.json"


def payload(n: int, seed: int = 0) -> np.ndarray:
    """`n` random bytes (the same for the same seed)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


class _ObjectContract:
    """The storage fixture and its hooks; puts, reads and the commit."""

    # How many overwrites the atomic-overwrite test races readers against.
    overwrite_rounds: int = 20

    def make_storage(self, tmp_path) -> Storage:
        """A fresh, empty storage (tmp_path: this test's own directory)."""
        raise NotImplementedError(f"{type(self).__name__} must define "
                                  "make_storage(self, tmp_path) returning a Storage")

    def close_storage(self, storage: Storage) -> None:
        """Called after each test; closes the storage (twice: close is idempotent)."""
        storage.close()
        storage.close()

    def stream_bytes(self, storage: Storage) -> int:
        """Size of the streamed object: over two pieces, so a backend that
        uploads in pieces is exercised across piece boundaries."""
        return 2 * storage.piece_bytes + 123

    @pytest.fixture
    def storage(self, request, tmp_path):
        self.request = request
        st = self.make_storage(tmp_path)
        yield st
        self.close_storage(st)

    # ------------------------------------------------ put and read

    def test_put_then_read_whole_and_ranged(self, storage):
        data = payload(10_000)
        storage.put("1/a", data.data)
        assert storage.size("1/a") == data.nbytes
        assert storage.read("1/a") == data.tobytes()
        out = np.zeros(data.nbytes, np.uint8)
        storage.read_into("1/a", out.data)
        assert np.array_equal(out, data)
        for offset, n in [(0, 1), (100, 900), (data.nbytes - 1, 1), (0, data.nbytes)]:
            out = np.zeros(n, np.uint8)
            storage.read_into("1/a", out.data, offset)
            assert np.array_equal(out, data[offset:offset + n]), (offset, n)

    def test_put_parts_lays_each_part_at_its_offset_with_zeros_between(self, storage):
        """A pack of chunks (format 3): parts at page offsets, across pieces."""
        a, b = payload(5000, 1), payload(self.stream_bytes(storage) // 2, 2)
        at_b = -(-a.nbytes // 4096) * 4096 + 4096
        storage.put_parts("1/p", [(0, a.data), (at_b, b.data)], at_b + b.nbytes)
        assert storage.size("1/p") == at_b + b.nbytes
        out = np.frombuffer(storage.read("1/p"), np.uint8)
        assert np.array_equal(out[:a.nbytes], a) and not out[a.nbytes:at_b].any()
        assert np.array_equal(out[at_b:], b)
        got = np.zeros(100, np.uint8)
        storage.read_into("1/p", got.data, at_b + 10)
        assert np.array_equal(got, b[10:110])
        view = storage.map("1/p", 4096, at_b) if storage.zero_copy else None
        assert view is None or np.array_equal(view, b[:4096])

    def test_put_takes_bytes_and_empty_objects(self, storage):
        storage.put("1/b", b"abc")
        storage.put("1/empty", b"")
        assert storage.read("1/b") == b"abc"
        assert storage.size("1/empty") == 0 and storage.read("1/empty") == b""

    def test_reading_past_the_end_is_an_error(self, storage):
        storage.put("1/a", b"abc")
        with pytest.raises(StorageError):
            storage.read_into("1/a", memoryview(bytearray(5)))
        with pytest.raises(StorageError):
            storage.read_into("1/a", memoryview(bytearray(2)), offset=2)

    def test_read_refuses_an_object_over_max_bytes(self, storage):
        data = payload(5000, 5)
        storage.put("1/a", data.data)
        assert storage.read("1/a", max_bytes=5000) == data.tobytes()
        assert storage.read("1/a", max_bytes=1 << 40) == data.tobytes()
        with pytest.raises(StorageError) as ei:
            storage.read("1/a", max_bytes=4999)
        assert ei.value.errno == errno.EFBIG
        assert all(s in str(ei.value) for s in ("1/a", "5000", "4999")), str(ei.value)
        with pytest.raises(StorageError) as ei:
            storage.read("1/none", max_bytes=10)
        assert ei.value.errno == errno.ENOENT
        assert storage.read("1/a") == data.tobytes()

    def test_a_missing_object_raises_storage_error_naming_it(self, storage):
        for read in (lambda: storage.read_into("9/nothing", memoryview(bytearray(4))),
                     lambda: storage.read("9/nothing")):
            with pytest.raises(StorageError) as ei:
                read()
            assert isinstance(ei.value, OSError) and ei.value.errno == errno.ENOENT
            assert "9/nothing" in str(ei.value)

    def test_size_is_none_when_absent(self, storage):
        assert storage.size("1/a") is None
        storage.put("1/a", b"x" * 7)
        assert storage.size("1/a") == 7
        assert storage.size("1/b") is None and storage.size("2/a") is None

    def test_overwrite_is_atomic_for_readers(self, storage):
        n = 64 * 1024
        versions = {bytes([v]) * n for v in range(2)}
        storage.put("1/a", b"\0" * n)
        stop, bad = threading.Event(), []

        def reader():
            while not stop.is_set():
                got = storage.read("1/a")
                if got not in versions:
                    bad.append((len(got), set(got[:64])))
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(self.overwrite_rounds):
                storage.put("1/a", bytes([(i + 1) % 2]) * n)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not bad, f"readers saw objects that are neither version: {bad[:5]}"
        assert storage.list("1") == ["a"]  # no temporaries left beside it

    def test_put_stream(self, storage):
        big = payload(self.stream_bytes(storage), 1)
        small = payload(1000, 2)
        storage.put_stream("1/big", lambda: io.BytesIO(big.tobytes()), big.nbytes)
        storage.put_stream("1/unsized", lambda: io.BytesIO(big.tobytes()), None)
        storage.put_stream("1/small", lambda: io.BytesIO(small.tobytes()), small.nbytes)
        for key, want in [("1/big", big), ("1/unsized", big), ("1/small", small)]:
            assert storage.size(key) == want.nbytes, key
            assert storage.read(key) == want.tobytes(), key
        assert sorted(storage.list("1")) == ["big", "small", "unsized"]

    # ------------------------------------------------ the commit

    def test_put_if_absent_is_create_only(self, storage):
        if not storage.create_only_commit:
            pytest.skip("create_only_commit is False for this storage")
        assert storage.put_if_absent(f"1/{MANIFEST}", b"first")
        assert not storage.put_if_absent(f"1/{MANIFEST}", b"second")
        assert storage.read(f"1/{MANIFEST}") == b"first"
        assert storage.list("1") == [MANIFEST]

    def test_put_if_absent_admits_exactly_one_of_racing_writers(self, storage):
        if not storage.create_only_commit:
            pytest.skip("create_only_commit is False for this storage")
        barrier = threading.Barrier(6)

        def commit(i):
            barrier.wait()
            return storage.put_if_absent(f"3/{MANIFEST}", f"writer {i}".encode())
        with cf.ThreadPoolExecutor(6) as ex:
            wins = [i for i, won in enumerate(ex.map(commit, range(6))) if won]
        assert len(wins) == 1, wins
        assert storage.read(f"3/{MANIFEST}") == f"writer {wins[0]}".encode()
        assert storage.list("3") == [MANIFEST]



class StorageContract(_ObjectContract):
    """Subclass as `Test...` and define `make_storage(tmp_path)`; the hooks
    `close_storage`, `stream_bytes` and `overwrite_rounds` may be overridden."""

    # ------------------------------------------------ listing

    def test_list_names_directly_under_a_prefix(self, storage):
        for key in ("d/a", "d/b", "d/sub/c", "d/manifest.0-of-2.json",
                    "d/manifest.1-of-2.json", "dd/x", "top"):
            storage.put(key, b"x")
        assert sorted(storage.list("d")) == ["a", "b", "manifest.0-of-2.json",
                                             "manifest.1-of-2.json", "sub"]
        assert sorted(storage.list("")) == ["d", "dd", "top"]
        assert sorted(storage.list()) == ["d", "dd", "top"]
        assert storage.list("d/sub") == ["c"]
        assert sorted(storage.list("d", starts_with="manifest.")) == [
            "manifest.0-of-2.json", "manifest.1-of-2.json"]
        assert storage.list("d", starts_with="s") == ["sub"]
        assert storage.list("d", starts_with="zz") == []
        assert sorted(storage.list("", starts_with="d")) == ["d", "dd"]
        assert storage.list("absent") == [] and storage.list("d/a") == []  # an object

    # ------------------------------------------------ deleting

    def test_delete_is_idempotent(self, storage):
        storage.put("1/a", b"x")
        storage.put("1/b", b"y")
        storage.delete("1/a")
        storage.delete("1/a")
        storage.delete("1/never")
        assert storage.size("1/a") is None and storage.list("1") == ["b"]

    def test_delete_dir_removes_everything_under_it_only(self, storage):
        for key in ("5/a", "5/sub/b", f"5/{MANIFEST}", "55/a"):
            storage.put(key, b"x")
        storage.delete_dir("5")
        storage.delete_dir("5")  # gone already: no error
        storage.delete_dir("never")
        assert storage.list("") == ["55"] and storage.list("5") == []
        assert storage.read("55/a") == b"x"

    def test_remove_empty_dir_keeps_what_is_there(self, storage):
        storage.put("6/a", b"x")
        assert storage.remove_empty_dir("6") is False
        assert storage.read("6/a") == b"x"
        storage.delete("6/a")
        assert storage.remove_empty_dir("6") in (True, False)
        assert "6" not in storage.list("")
        assert storage.remove_empty_dir("never") is False

    # ------------------------------------------------ the documented call order

    def test_write_then_delete_in_the_documented_order(self, storage):
        chunks = {f"0123abcd.c0.0.{i}": payload(3000 + i, i) for i in range(8)}
        storage.begin_write("7")
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda kv: storage.put(f"7/{kv[0]}", memoryview(kv[1])),
                        chunks.items()))
        storage.flush("7")
        assert storage.put_if_absent(f"7/{MANIFEST}", b"{}")
        storage.end_write("7")
        assert sorted(storage.list("7")) == sorted([*chunks, MANIFEST])
        with cf.ThreadPoolExecutor(4) as ex:  # concurrent reads
            got = dict(zip(chunks, ex.map(lambda k: storage.read(f"7/{k}"), chunks), strict=True))
        assert all(got[k] == v.tobytes() for k, v in chunks.items())
        storage.delete(f"7/{MANIFEST}")
        storage.flush("7")
        storage.delete_dir("7")
        assert storage.list("") == []

    def test_end_write_follows_a_failed_write(self, storage):
        storage.begin_write("8")
        storage.put("8/0123abcd.c0.0.0", b"x")
        storage.end_write("8")  # no commit: the save failed
        storage.delete_dir("8")
        assert storage.list("") == []

    def test_object_ages_when_known(self, storage):
        storage.put("9/a", b"x")
        ages = storage.object_ages("9")
        if ages is not None:
            assert set(ages) == {"a"} and all(a > -60 for a in ages.values())

    # ------------------------------------------------ zero-copy views

    def test_map_is_copy_on_write_where_zero_copy(self, storage):
        data = payload(3 * 4096, 3)
        storage.put("2/a", data.data)
        assert storage.read("2/a") == data.tobytes()  # held in memory now, where it can be
        mapped = storage.zero_copy or (storage.maps_cached
                                       and storage.resident("2/a", data.nbytes))
        if storage.zero_copy:
            assert storage.resident("2/a", data.nbytes)
        view = storage.map("2/a", data.nbytes)
        if not mapped:
            assert view is None
            return
        assert view is not None and np.array_equal(view, data)
        view[:10] = 0  # writes stay in the mapping
        assert storage.read("2/a") == data.tobytes()
        storage.put("2/a", b"y" * data.nbytes)  # a later put never changes it
        storage.delete("2/a")
        assert np.array_equal(view[10:], data[10:]) and not view[:10].any()

    def test_place_is_copy_on_write_where_zero_copy(self, storage):
        from ..native.hostmem import PAGE, Region
        data = payload(2 * PAGE, 4)
        storage.put("2/b", data.data)
        region = Region(2 * PAGE)
        assert storage.read("2/b") == data.tobytes()
        mapped = storage.zero_copy or (storage.maps_cached
                                       and storage.resident("2/b", data.nbytes))
        placed = storage.place("2/b", region, PAGE, 0, PAGE)
        if not mapped:
            assert placed is False
            return
        assert placed and storage.place("2/b", region, 0, PAGE, PAGE)
        arr = region.array()
        assert np.array_equal(arr[:PAGE], data[PAGE:])
        assert np.array_equal(arr[PAGE:], data[:PAGE])
        arr[:] = 0
        storage.put("2/b", b"z" * data.nbytes)
        assert storage.read("2/b") == b"z" * data.nbytes

    # ------------------------------------------------ flags and names

    def test_flags_and_names(self, storage):
        for flag in ("shared", "sizes_from_manifest", "zero_copy", "maps_cached", "remote",
                     "create_only_commit"):
            assert isinstance(getattr(storage, flag), bool), flag
        assert isinstance(storage.kind, str) and storage.kind
        assert isinstance(storage.url, str) and storage.url
        assert isinstance(storage.piece_bytes, int) and storage.piece_bytes > 0
