"""The writing side of the GCS backend: what `GcsStorage.put`, `put_stream` and
`put_if_absent` do, sent through the store's session, client, retries and
thread pool (storage/gcs.py owns those, and the reads, listing and deleting).

- `put` sends an object of up to `piece_bytes` in one request. A larger one
  (or one of unknown size, compressed on the fly) is read once, in
  `piece_bytes` parts, each uploaded as its own object and retried on its own,
  then composed into the final object, whose crc32c is checked; so one upload
  holds at most two parts in memory, and a fault costs one part, not the object.
- `put_if_absent` (the commit) is a multipart upload with
  `if_generation_match=0`. If it is refused (412) the object is read back: a
  retried request whose first try had in fact landed finds its own bytes there
  and counts as committed; anything else means another writer won.

Also here: `_Status`, the error for a non-2xx answer to one of our own
requests, which the reads in storage/gcs.py raise too.
"""
from __future__ import annotations

import base64
import errno
import io
import urllib.parse
from collections.abc import Callable

import numpy as np

from ..errors import StorageError
from ..native import crc32c
from .base import ours_already
from .retry import Transient

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
    state of its own: the store's session, bucket, retries (`_call`), thread
    pool and `piece_bytes` are read from the store at each call."""

    def __init__(self, store):
        self._store = store  # the GcsStorage these uploads are for

    def put(self, key: str, data) -> None:
        view = memoryview(data).cast("B")
        if len(view) <= self._store.piece_bytes:
            self._put_media(key, view)
        else:
            self._put_composed(key, _Reader(view))

    def put_stream(self, key: str, opener: Callable[[], io.RawIOBase], size: int | None) -> None:
        with opener() as stream:
            if size is not None and size <= self._store.piece_bytes:
                self._put_media(key, _read_full(stream, size))
            else:
                self._put_composed(key, stream)

    def _put_composed(self, key: str, stream) -> None:
        # A resumable upload would be the usual way, but after a fault it must
        # ask the server where it got to and rewind the stream, which a stream
        # compressed on the fly cannot do, and the emulator answers that
        # question by finalizing the object (docs/gcs.md). Parts are plain
        # idempotent uploads instead, each retried alone.
        size = self._store.piece_bytes
        first = _read_full(stream, size)
        second = _read_full(stream, size) if len(first) == size else b""
        if not second:
            self._put_media(key, first)
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
                self._put_media(parts[-1], buf)
                crc = crc32c.extend(crc, np.frombuffer(buf, np.uint8))
                total += len(buf)
            self._compose(key, parts, crc, total)
        finally:
            for f in [self._store._pool.submit(self._delete_quietly, p) for p in parts]:
                f.result()

    def _put_media(self, key: str, data) -> None:
        """One upload request (no precondition), checked against the size and
        crc32c the server reports."""
        st = self._store
        url = (f"{st._api}/upload/storage/v1/b/{st.bucket_name}/o?uploadType=media&name="
               + urllib.parse.quote(st._name(key), safe=""))
        want = base64.b64encode(crc32c.value(np.frombuffer(data, np.uint8))
                                .to_bytes(4, "big")).decode()

        def attempt():
            resp = st._session.post(url, data=data, timeout=st._timeout(),
                                    headers={"Content-Type": "application/octet-stream"})
            if resp.status_code != 200:
                raise _Status(resp.status_code, resp.text, resp.headers)
            got = resp.json()
            if int(got.get("size", -1)) != len(data) or got.get("crc32c", want) != want:
                raise Transient(f"stored {got.get('size')} bytes with crc32c "
                                f"{got.get('crc32c')}; sent {len(data)} with {want}")
        st._call(attempt, "upload of", key)

    def _compose(self, key: str, parts: list[str], crc: int, total: int) -> None:
        """Composes `parts` into `key` (32 at a time, in rounds) and checks the
        result's size and crc32c."""
        level = 0
        while len(parts) > 32:
            groups = [parts[i:i + 32] for i in range(0, len(parts), 32)]
            names = [f"{key}{PART}c{level}_{i:05d}" for i in range(len(groups))]
            for name, group in zip(names, groups, strict=True):
                self._compose_once(name, group)
            parts, level = names, level + 1
        blob = self._compose_once(key, parts)
        want = base64.b64encode(crc.to_bytes(4, "big")).decode()
        if int(blob.size) != total or (blob.crc32c and blob.crc32c != want):
            self._delete_quietly(key)
            raise StorageError(errno.EIO, f"{self._store._where(key)}: composed object has "
                                          f"{blob.size} bytes, crc32c {blob.crc32c}; expected "
                                          f"{total}, {want}; it was removed")

    def _compose_once(self, key: str, parts: list[str]):
        st = self._store

        def attempt():
            blob = st._bucket.blob(st._name(key))
            blob.compose([st._bucket.blob(st._name(p)) for p in parts], retry=None,
                         timeout=st._timeout())
            return blob
        return st._call(attempt, "compose of", key)

    def _delete_quietly(self, key: str) -> None:
        try:
            self._store.delete(key)
        except StorageError:
            pass  # a leftover part; removed with its step, or as an orphan

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from google.api_core.exceptions import PreconditionFailed

        st = self._store
        data = bytes(data)

        def attempt() -> bool:
            blob = st._bucket.blob(st._name(key))
            try:
                # Up to 8 MiB this is one multipart request, the kind the
                # emulator also holds to the precondition (docs/environment.md).
                blob.upload_from_file(io.BytesIO(data), size=len(data), if_generation_match=0,
                                      checksum="crc32c", retry=None, timeout=st._timeout())
                return True
            except PreconditionFailed:
                return False
        return st._call(attempt, "commit of", key) or ours_already(st, key, data)
