"""A remote or disk tier's small reads during one restore, served from a few
larger ones.

On an object store every read is a request, and a step of a real model is
thousands of small chunks packed into a few objects (format 3). Read one by
one, they cost a request each, as when every chunk was an object.
`ReadAhead` wraps such a tier (GCS, fsspec) for the life of one restore,
and a disk tier too, for its reads under `DISK_BELOW` where its packs are
read rather than mapped (`LocalTier(map_cached=False)`; a cold restore of a
decoder's 5,622 chunks read one by one: 1.25 s, from 8 MiB windows:
0.97 s, a plain cold read of the bytes being 0.48 s); a disk's larger reads
go past the page cache on their own (windowed, a 1 GB state of 1.5 MB chunks
restored cold in 1.21 s against 0.84 s). A
read smaller than a window, of an object whose extent the step's records
give, is served from that object's window: an aligned `WINDOW` bytes, read
once in one request. Concurrent readers of one window wait for the one
read. At most `KEEP` windows are held, the least recently used dropped
first, so memory stays within `WINDOW x KEEP` plus the reads in flight.
A window that cannot be read (a pack cut short) is not kept: the read
that asked for it is made on its own, and fails or succeeds as it would
have. The bytes are checked per chunk by the reader, as before.
Everything else goes to the tier unchanged. It starts no threads.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

import numpy as np

from ..storage.base import Storage
from ..storage.wrapper import StorageWrapper

WINDOW = 8 << 20
KEEP = 8
DISK_BELOW = 1 << 20


class _Window:
    def __init__(self):
        self.done = threading.Event()
        self.data: np.ndarray | None = None


class ReadAhead(StorageWrapper):
    """`inner`'s reads in windows; `extents`: object key -> the bytes the
    step's records place in it (no window reaches past them)."""

    def __init__(self, inner: Storage, extents: Mapping[str, int], window: int = WINDOW,
                 keep: int = KEEP, below: int | None = None):
        super().__init__(inner)
        self._extents, self._size, self._keep = extents, window, keep
        self._below = window if below is None else min(below, window)  # reads windowed
        self._lock = threading.Lock()
        self._windows: collections.OrderedDict = collections.OrderedDict()
        self.requests = 0  # window reads made

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        out = memoryview(out).cast("B")
        n, end = len(out), self._extents.get(key, 0)
        if n == 0 or n >= self._below or offset < 0 or offset + n > end:
            self.inner.read_into(key, out, offset)
            return
        pos = offset
        while pos < offset + n:
            w = pos // self._size
            data = self._window(key, w, end)
            if data is None:  # that window could not be read: this read alone
                self.inner.read_into(key, out, offset)
                return
            start = w * self._size
            stop = min(offset + n, start + len(data))
            out[pos - offset:stop - offset] = data[pos - start:stop - start].data
            pos = stop

    def _window(self, key: str, w: int, end: int) -> np.ndarray | None:
        with self._lock:
            known: _Window | None = self._windows.get((key, w))
            mine = known is None
            got = _Window() if known is None else known
            if mine:
                self._windows[(key, w)] = got
                while len(self._windows) > self._keep:
                    old = next(iter(self._windows))
                    if not self._windows[old].done.is_set():
                        break
                    del self._windows[old]
            else:
                self._windows.move_to_end((key, w))
        if not mine:
            got.done.wait()
            return got.data
        start = w * self._size
        buf = np.empty(min(self._size, end - start), np.uint8)
        try:
            self.inner.read_into(key, buf.data, start)
            got.data = buf
            with self._lock:
                self.requests += 1
        except Exception:  # noqa: BLE001 - the read alone then says what failed
            with self._lock:
                self._windows.pop((key, w), None)
        finally:
            got.done.set()
        return got.data
