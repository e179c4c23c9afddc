"""A remote tier's small reads during a restore come from a few window reads
(`restore.readahead.ReadAhead`), on a real FileStorage under a wrapper that
counts what reaches it."""
from __future__ import annotations

import concurrent.futures as cf
import os

import numpy as np
import pytest

from resilient_ckpt.errors import StorageError
from resilient_ckpt.restore.readahead import ReadAhead
from resilient_ckpt.storage.files import FileStorage
from resilient_ckpt.storage.wrapper import StorageWrapper

W = 1 << 16


class Counting(StorageWrapper):
    def __init__(self, inner):
        super().__init__(inner)
        self.reads: list[tuple[int, int]] = []

    def read_into(self, key, out, offset=0):
        self.reads.append((offset, len(memoryview(out).cast("B"))))
        self.inner.read_into(key, out, offset)


@pytest.fixture
def pack(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 10 * W + 123, np.uint8)
    os.makedirs(tmp_path / "1")
    (tmp_path / "1" / "p").write_bytes(data.tobytes())
    st = Counting(FileStorage(str(tmp_path)))
    return st, data


def read(st, at, n):
    out = np.empty(n, np.uint8)
    st.read_into("1/p", out.data, at)
    return out


def test_small_reads_in_one_window_are_one_request_and_exact(pack):
    st, data = pack
    ra = ReadAhead(st, {"1/p": len(data)}, window=W, keep=4)
    for at in range(0, W - 100, 997):
        assert np.array_equal(read(ra, at, 100), data[at:at + 100])
    assert st.reads == [(0, W)] and ra.requests == 1


def test_a_read_across_windows_and_the_last_short_window(pack):
    st, data = pack
    ra = ReadAhead(st, {"1/p": len(data)}, window=W, keep=4)
    at = 2 * W - 50
    assert np.array_equal(read(ra, at, 100), data[at:at + 100])
    assert np.array_equal(read(ra, len(data) - 10, 10), data[-10:])
    assert st.reads == [(W, W), (2 * W, W), (10 * W, 123)]


def test_big_reads_unknown_objects_and_reads_past_the_extent_go_straight_through(pack):
    st, data = pack
    ra = ReadAhead(st, {"1/p": 5 * W}, window=W, keep=4)
    assert np.array_equal(read(ra, 3, W), data[3:3 + W])  # as large as a window
    assert np.array_equal(read(ra, 5 * W - 5, 10), data[5 * W - 5:5 * W + 5])  # past it
    assert ra.requests == 0 and st.reads == [(3, W), (5 * W - 5, 10)]
    ra = ReadAhead(st, {}, window=W, keep=4)
    st.reads.clear()
    read(ra, 0, 10)
    assert st.reads == [(0, 10)]


def test_at_most_keep_windows_are_held_the_oldest_going_first(pack):
    st, data = pack
    ra = ReadAhead(st, {"1/p": len(data)}, window=W, keep=2)
    for w in (0, 1, 2, 0):
        assert np.array_equal(read(ra, w * W + 1, 10), data[w * W + 1:w * W + 11])
    assert [a for a, _ in st.reads] == [0, W, 2 * W, 0]  # window 0 was dropped, read again


def test_readers_of_one_window_wait_for_one_read(pack):
    st, data = pack
    ra = ReadAhead(st, {"1/p": len(data)}, window=W, keep=4)
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda at: (at, read(ra, at, 64)), range(0, W - 64, 512)))
    assert all(np.array_equal(o, data[at:at + 64]) for at, o in outs)
    assert st.reads == [(0, W)]


def test_a_pack_cut_short_fails_only_the_reads_past_the_cut(pack, tmp_path):
    st, data = pack
    os.truncate(tmp_path / "1" / "p", W + 100)  # the records say 10 windows and more
    ra = ReadAhead(st, {"1/p": len(data)}, window=W, keep=4)
    assert np.array_equal(read(ra, W + 10, 50), data[W + 10:W + 60])  # before the cut
    with pytest.raises(StorageError):
        read(ra, W + 200, 50)
    assert ra.requests == 0  # no window of the short object was kept
