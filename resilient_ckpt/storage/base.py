"""The storage interface every tier backend implements.

Keys are '/'-separated names relative to the tier's root ("<step dir>/<object>").
Methods block and are safe to call from many threads at once; the callers
(commit, restore) bring the concurrency. Kept small on purpose: put,
put-if-absent (the commit primitive), ranged get, size, list, delete.
"""
from __future__ import annotations

import abc

import numpy as np


class Storage(abc.ABC):
    kind: str  # "ram", "local", "gcs": also the name used in records
    url: str

    @abc.abstractmethod
    def put(self, key: str, data: memoryview) -> None:
        """Writes an object atomically and durably: whole, or not at all."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only write; False (and nothing changed) if `key` exists."""

    @abc.abstractmethod
    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        """Fills `out` with bytes [offset, offset + len(out)) of `key`."""

    def read(self, key: str) -> bytes:
        n = self.size(key)
        if n is None:
            from ..errors import StorageError
            raise StorageError(f"{self.url}/{key}: no such object")
        buf = bytearray(n)
        self.read_into(key, memoryview(buf))
        return bytes(buf)

    def map(self, key: str, nbytes: int) -> np.ndarray | None:
        """A zero-copy uint8 view of the object, where the backend can give one
        that later writes and deletes never change and whose own writes never
        reach storage (copy-on-write); else None."""
        return None

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Byte size of an object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names directly under `prefix` (a directory or '' for the root)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Deletes one object; no error if it is already gone."""

    @abc.abstractmethod
    def delete_dir(self, prefix: str) -> None:
        """Deletes a step's directory or prefix and what is left in it."""

    def remove_empty_dir(self, prefix: str) -> bool:
        """Removes a directory only if it is empty (prefix stores: no-op)."""
        return False

    def begin_write(self, prefix: str) -> None:
        """Marks `prefix` as being written by this process (for cleaners)."""

    def flush(self, prefix: str) -> None:
        """Makes the objects put under `prefix` durable (before the commit)."""

    def end_write(self, prefix: str) -> None:
        """Drops the mark of `begin_write` (after the commit, or a failure)."""
