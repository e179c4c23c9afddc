"""The storage interface every tier backend implements, and what it promises.

Keys are '/'-separated names relative to the tier's root ("<step dir>/<object>").
Kept small on purpose: put, put-if-absent (the commit primitive), ranged get,
size, list, delete, plus hooks with do-nothing defaults. What a backend can do
beyond that is said by capability flags (`shared`, `remote`, `zero_copy`, ...),
never by its `kind`, which is only a name for records and messages.

Call order a backend can rely on (commit.py and restore.py keep it):

- A step is written as: `begin_write(d)`, then `put` / `put_stream` of its
  chunks under `d/` (many at once, from several threads), then `flush(d)`,
  then `put_if_absent(d/<manifest>)` (the commit), then `end_write(d)`, which
  also follows a failure anywhere after `begin_write`.
- A step is deleted as: `delete` of each manifest first, `flush(d)`, then
  `delete_dir(d)`; so a crash part-way never leaves a step that looks committed.
- Reads (`read`, `read_into`, `map`, `place`, `size`, `list`) come from many
  threads at once, also while other steps are being written or deleted.

Every method blocks, and is safe to call from many threads at once: callers
bring the concurrency. "Atomic" for `put` means a reader sees the old object
whole or the new one whole, never a mix or a prefix, and a failed put leaves
the old object (or none) in place. Failures leave as the project's
StorageError (an OSError) naming the object's full path. `read(key,
max_bytes=)` refuses an object larger than the caller expects before
allocating for it (a manifest is small; whatever sits at its name may not be),
and a failed `put_if_absent` sets `nothing_written` when the final name was
certainly not created. `read_in_ranges` is the remote backends' shared way of
reading a large object as parallel ranges, `ours_already` their read-back
after a create-only put found the name taken.
"""
from __future__ import annotations

import abc
import contextlib
import errno
import io
from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import StorageError


class Storage(abc.ABC):
    kind: str  # "ram", "local", "gcs": a name used in records, not a capability
    url: str   # where the tier lives (a directory or gs://bucket/prefix), for messages
    # Seen by every host of a job (GCS): cleanup and retention run on process 0 only.
    shared: bool = False
    # Listing a step costs requests here, so selection takes chunk sizes from the
    # manifests and leaves presence and size to be checked when a chunk is read.
    sizes_from_manifest: bool = False
    # `map`/`place` give copy-on-write views of objects, without a copy (the RAM
    # tier on tmpfs); elsewhere they return None/False and bytes are read.
    zero_copy: bool = False
    # `map`/`place` give such views of the objects `resident` says are held in
    # memory whole (a local disk's files in the page cache).
    maps_cached: bool = False
    # A slow durable store (GCS): steps reach it as uploads of a faster tier's
    # committed copy, and a restore does not wait for its uploads.
    remote: bool = False
    # `put_if_absent` is an atomic create-only write: of two writers racing for
    # one key, exactly one succeeds.
    create_only_commit: bool = True
    # Chunks larger than this are written as a stream, this many bytes at a time.
    piece_bytes: int = 8 << 20

    @abc.abstractmethod
    def put(self, key: str, data: memoryview) -> None:
        """Writes an object atomically and durably: whole, or not at all. A
        chunk put between `begin_write(d)` and `flush(d)` may become durable
        only at that flush, and a new chunk's name (one not yet under `d`)
        may show a partial object until the put returns: no reader opens a
        chunk before a committed manifest names it. The caller may reuse
        `data`'s memory once put returns."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create-only write; False (and nothing changed) if `key` exists."""

    @abc.abstractmethod
    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        """Fills `out` with bytes [offset, offset + len(out)) of `key`; an object
        that is missing or shorter raises StorageError."""

    def put_stream(self, key: str, opener, size: int | None) -> None:
        """Writes what `opener()` (a fresh readable stream per call) yields, as
        `put` does; backends that can upload in pieces keep memory bounded."""
        with opener() as f:
            data = f.read()
        self.put(key, memoryview(data))

    def put_parts(self, key: str, parts: Sequence[tuple[int, memoryview]], size: int
                  ) -> None:
        """Writes, as `put` does, an object of `size` bytes that holds each
        (offset, bytes) of `parts` (in offset order, none overlapping) and
        zeros between them: a pack of chunks. The default streams them through
        `put_stream`, so memory stays bounded; the file tiers write each part
        in place, without a copy."""
        self.put_stream(key, lambda: _Parts(parts, size), size)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole object; StorageError if it does not exist, and (errno EFBIG,
        before anything is allocated) if it is larger than `max_bytes`."""
        n = self.size(key)
        if n is None:
            raise StorageError(errno.ENOENT, f"{self.url}/{key}: no such object")
        check_size(f"{self.url}/{key}", n, max_bytes)
        buf = bytearray(n)
        self.read_into(key, memoryview(buf))
        return bytes(buf)

    def map(self, key: str, nbytes: int, offset: int = 0) -> np.ndarray | None:
        """A zero-copy uint8 view of the object's `nbytes` from `offset` (a
        multiple of the page size), where the backend can give one
        (`zero_copy`, or `maps_cached` and the object is `resident`, or held
        by `holding` whatever the page cache holds of it) that later
        writes and deletes never change and whose own writes never reach
        storage (copy-on-write); else None."""
        return None

    def place(self, key: str, region, file_offset: int, dest_offset: int,
              length: int) -> bool:
        """Maps object bytes into a hostmem.Region (copy-on-write, zero-copy)
        where the backend can (`zero_copy`, or `maps_cached` and the bytes are
        resident); False where it cannot."""
        return False

    def resident(self, key: str, nbytes: int, offset: int = 0) -> bool:
        """Whether `map` of the object's `nbytes` from `offset` would give a view now
        (`zero_copy`, or `maps_cached` and every page is held in memory or
        the object's step is held by `holding`); a hint: the answer may change before the `map`."""
        return False

    @contextlib.contextmanager
    def holding(self, prefix: str) -> Iterator[None]:
        """Within the block, reads of objects under `prefix` (a step being
        restored) may skip walking to it for each object; a no-op here."""
        yield

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Byte size of an object, or None if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        """Names directly under `prefix` (a directory, or '' for the root) that
        start with `starts_with`: objects and sub-directories alike, in no
        particular order; [] when there is nothing under `prefix`."""

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
        """Makes the objects put under `prefix` durable (before the commit);
        raises if any of them may not be."""

    def end_write(self, prefix: str) -> None:
        """Drops the mark of `begin_write` (after the commit, or a failure)."""

    def close(self) -> None:
        """Releases connections and threads (the manager calls it at close);
        calling it again does nothing."""


class _Parts(io.RawIOBase):
    """The bytes of `put_parts`' object in order: each part, zeros between."""

    def __init__(self, parts: Sequence[tuple[int, memoryview]], size: int):
        self._parts = [(at, memoryview(v).cast("B")) for at, v in parts]
        self._size, self._pos, self._i = size, 0, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        while self._i < len(self._parts) and \
                self._pos >= self._parts[self._i][0] + len(self._parts[self._i][1]):
            self._i += 1
        if self._i == len(self._parts):
            n = min(len(out), self._size - self._pos)
            out[:n] = bytes(n)
        else:
            at, view = self._parts[self._i]
            if self._pos < at:
                n = min(len(out), at - self._pos)
                out[:n] = bytes(n)
            else:
                n = min(len(out), at + len(view) - self._pos)
                out[:n] = view[self._pos - at:self._pos - at + n]
        self._pos += n
        return n


def check_size(where: str, size: int, max_bytes: int | None) -> None:
    """Raises StorageError(EFBIG) naming `where` when `size` is over `max_bytes`."""
    if max_bytes is not None and size > max_bytes:
        raise StorageError(errno.EFBIG, f"{where} is {size} bytes, more than the "
                                        f"{max_bytes} this read allows, so it was not "
                                        "read; check what wrote it there")


# Larger reads of a remote object go as parallel ranges of this size: one
# stream tops out well below what the server can do, and much smaller ranges
# cost more in per-request overhead than they gain (docs/gcs.md).
READ_SPLIT = 16 * 2**20


def read_in_ranges(pool, read_range, out: memoryview, offset: int) -> None:
    """`read_range(view, offset)` for `out` whole, or for each READ_SPLIT
    slice of it in parallel on `pool` (a concurrent.futures executor)."""
    view = memoryview(out).cast("B")
    if len(view) <= READ_SPLIT:
        read_range(view, offset)
        return
    futures = [pool.submit(read_range, view[a:a + READ_SPLIT], offset + a)
               for a in range(0, len(view), READ_SPLIT)]
    for f in futures:
        f.result()


def ours_already(st: Storage, key: str, data: bytes) -> bool:
    """After a create-only put found `key` taken: whether it holds `data`, so
    that an earlier attempt of ours landed and only its answer was lost. A
    larger object is someone else's. One that cannot be read back raises
    StorageError: who committed is then unknown, which the caller must not
    take for a lost race (it would remove chunks a commit may need)."""
    try:
        return st.read(key, max_bytes=len(data)) == bytes(data)
    except StorageError as e:
        if e.errno == errno.EFBIG:
            return False
        raise StorageError(e.errno, f"commit of {st.url}/{key}: the object exists but "
                                    f"could not be read back to tell whose it is: {e}") from e
