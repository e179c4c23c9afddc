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
    # Seen by every host of a job (GCS): cleanup and retention run on process 0 only.
    shared: bool = False
    # Listing a step costs requests here, so selection takes chunk sizes from the
    # manifests and leaves presence and size to be checked when a chunk is read.
    sizes_from_manifest: bool = False
    # Chunks larger than this are written as a stream, this many bytes at a time.
    piece_bytes: int = 8 << 20

    @abc.abstractmethod
    def put(self, key: str, data: memoryview) -> None:
        """Writes an object atomically and durably: whole, or not at all."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only write; False (and nothing changed) if `key` exists."""

    @abc.abstractmethod
    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        """Fills `out` with bytes [offset, offset + len(out)) of `key`."""

    def put_stream(self, key: str, opener, size: int | None) -> None:
        """Writes what `opener()` (a fresh readable stream per call) yields, as
        `put` does; backends that can upload in pieces keep memory bounded."""
        with opener() as f:
            data = f.read()
        self.put(key, memoryview(data))

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

    def place(self, key: str, region, file_offset: int, dest_offset: int,
              length: int) -> bool:
        """Maps object bytes into a hostmem.Region (copy-on-write, zero-copy)
        where the backend can; False where it cannot."""
        return False

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Byte size of an object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names directly under `prefix` (a directory or '' for the root)."""

    def list_manifests(self, prefix: str) -> list[str]:
        """The manifest names in a step directory (backends may list only those)."""
        from ..layout import parse_manifest_name
        return [n for n in self.list(prefix) if parse_manifest_name(n)]

    def object_ages(self, prefix: str) -> dict[str, float] | None:
        """Seconds since each object under `prefix` was written, where the backend
        can tell (for collecting orphans no live writer may still be adding to)."""
        return None

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

    def close(self) -> None:
        """Releases connections and threads (the manager calls it at close)."""
