"""A progress bar for long restores: bytes read from each tier, shown with tqdm.

`wrap` puts a counting layer (a StorageWrapper, so every other member of the
storage is the backend's own) over each tier's storage for one restore; every
byte read, mapped or placed moves one shared bar (on stderr). The total is the
chosen step's stored bytes when this process reads all of them (one process);
otherwise the bar counts without a total.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..core.selection import Choice
from ..storage.base import Storage
from ..storage.wrapper import StorageWrapper


class _Counting(StorageWrapper):
    """Forwards everything to `inner`; reads advance `bar`."""

    def __init__(self, inner: Storage, bar: Any, lock: threading.Lock):
        super().__init__(inner)
        self._bar, self._lock = bar, lock

    def _tick(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def read_into(self, key, out, offset=0):
        self.inner.read_into(key, out, offset)
        self._tick(len(memoryview(out).cast("B")))

    def read(self, key, max_bytes=None):
        data = self.inner.read(key, max_bytes)
        self._tick(len(data))
        return data

    def map(self, key, nbytes, offset=0):
        m = self.inner.map(key, nbytes, offset)
        if m is not None:
            self._tick(nbytes)
        return m

    def place(self, key, region, file_offset, dest_offset, length):
        ok = self.inner.place(key, region, file_offset, dest_offset, length)
        if ok:
            self._tick(length)
        return ok


def wrap(storages: Mapping[str, Storage], choice: Choice, all_mine: bool
         ) -> tuple[dict[str, Storage], Any]:
    """(storages that count into a new bar, the bar); close the bar when done."""
    from tqdm import tqdm
    total = sum(c.stored_nbytes for _, _, c in choice.manifest.chunks()) if all_mine else None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"restore step {choice.step}", leave=True, dynamic_ncols=True)
    lock = threading.Lock()
    return {n: _Counting(s, bar, lock) for n, s in storages.items()}, bar
