"""How the GCS backend splits an upload: what `GcsStorage.put` and
`put_stream` do with an object, through the store's own requests (storage/gcs.py
owns the session, client, retries and thread pool, each request, the commit,
and the reads, listing and deleting).

- `put` sends an object of up to `piece_bytes` in one request. A larger one
  (or one of unknown size, compressed on the fly) is read once, in
  `piece_bytes` parts, each uploaded as its own object and retried on its own,
  then composed into the final object, whose crc32c is checked; so one upload
  holds at most two parts in memory, and a fault costs one part, not the object.

Also here: `_Status`, the error for a non-2xx answer to one of our own
requests, which the reads in storage/gcs.py raise too.
"""
from __future__ import annotations

import base64
import errno
import io
from collections.abc import Callable

import numpy as np

from ..errors import StorageError
from ..native import crc32c

PART = ".part"  # temporary objects of a composed upload: <key>.part00012


class _Status(Exception):
    """A non-2xx answer to one of our own requests; `code` drives
    retry.is_transient, `headers` (its Retry-After) retry.retry_after."""

    def __init__(self, code: int, text: str, headers=None):
        super().__init__(f"HTTP {code}: {text[:200]}")
        self.code, self.headers = code, headers


class _Reader(io.RawIOBase):
    """A file over a memoryview, so uploads read pieces of it without a copy."""

    def __init__(self, data: memoryview):
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), len(self._view) - self._pos)
        b[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1
                                             else len(self._view) + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos


def _read_full(stream, n: int) -> bytes:
    """Exactly n bytes, fewer only at the end (streams may return short reads)."""
    parts, want = [], n
    while want > 0:
        part = stream.read(want)
        if not part:
            break
        parts.append(part)
        want -= len(part)
    return b"".join(parts)


class GcsUploads:
    """The uploads of one GcsStorage (see the module's docstring). It keeps no
    state of its own: each request (`put_media`, `compose`, `delete`), the
    thread pool and `piece_bytes` belong to the store."""

    def __init__(self, store):
        self._store = store  # the GcsStorage these uploads are for

    def put(self, key: str, data) -> None:
        view = memoryview(data).cast("B")
        if len(view) <= self._store.piece_bytes:
            self._store.put_media(key, view)
        else:
            self._put_composed(key, _Reader(view))

    def put_stream(self, key: str, opener: Callable[[], io.RawIOBase], size: int | None) -> None:
        with opener() as stream:
            if size is not None and size <= self._store.piece_bytes:
                self._store.put_media(key, _read_full(stream, size))
            else:
                self._put_composed(key, stream)

    def _put_composed(self, key: str, stream) -> None:
        # A resumable upload would be the usual way, but after a fault it must
        # ask the server where it got to and rewind the stream, which a stream
        # compressed on the fly cannot do, and the emulator answers that
        # question by finalizing the object (docs/gcs.md). Parts are plain
        # idempotent uploads instead, each retried alone.
        st = self._store
        size = st.piece_bytes
        first = _read_full(stream, size)
        second = _read_full(stream, size) if len(first) == size else b""
        if not second:
            st.put_media(key, first)
            return

        def pieces():
            yield first
            yield second
            while buf := _read_full(stream, size):
                yield buf
        parts: list[str] = []
        crc, total = 0, 0
        try:
            for buf in pieces():
                parts.append(f"{key}{PART}{len(parts):05d}")
                st.put_media(parts[-1], buf)
                crc = crc32c.extend(crc, np.frombuffer(buf, np.uint8))
                total += len(buf)
            self._compose(key, parts, crc, total)
        finally:
            st.in_parallel(self._delete_quietly, parts)

    def _compose(self, key: str, parts: list[str], crc: int, total: int) -> None:
        """Composes `parts` into `key` (32 at a time, in rounds) and checks the
        result's size and crc32c."""
        st = self._store
        level = 0
        while len(parts) > 32:
            groups = [parts[i:i + 32] for i in range(0, len(parts), 32)]
            names = [f"{key}{PART}c{level}_{i:05d}" for i in range(len(groups))]
            for name, group in zip(names, groups, strict=True):
                st.compose(name, group)
            parts, level = names, level + 1
        blob = st.compose(key, parts)
        want = base64.b64encode(crc.to_bytes(4, "big")).decode()
        if int(blob.size) != total or (blob.crc32c and blob.crc32c != want):
            self._delete_quietly(key)
            raise StorageError(errno.EIO, f"{st.where(key)}: composed object has "
                                          f"{blob.size} bytes, crc32c {blob.crc32c}; expected "
                                          f"{total}, {want}; it was removed")

    def _delete_quietly(self, key: str) -> None:
        try:
            self._store.delete(key)
        except StorageError:
            pass  # a leftover part; removed with its step, or as an orphan
