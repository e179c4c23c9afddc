"""Moving one chunk into a tier: from the host snapshot or from another tier's
committed copy, checked against its crc32c, encoded on the way, in bounded pieces.

This is how the GCS tier uploads a step that a faster tier already holds
without touching the devices again, and how any tier stores zstd chunks. A
chunk up to the storage's `piece_bytes` is read (or mapped) whole, checked,
encoded (a zstd frame into a buffer reused from chunk to chunk, `PACKED`) and
put in one request; a put must be done with the bytes when it returns. A
larger one is streamed: the source is read piece by piece, its crc32c is
accumulated on the way and compared before the last piece leaves (so a
corrupt source never completes an upload), and zstd compresses the stream as
one frame. Memory per chunk in flight is therefore a few pieces, whatever the
chunk's size.

A chunk is stored with zstd only where that saves at least `min_gain` of its
bytes (judged on the whole chunk, or on a leading sample of a streamed one);
otherwise raw. The checksum in the manifest stays over the uncompressed bytes.
"""
from __future__ import annotations

import dataclasses
import errno
import io
from collections.abc import Sequence

import numpy as np

from ..core.codec import Encoding, compress, compress_into, compress_stream
from ..core.manifest import ChunkRecord
from ..errors import CorruptCheckpointError, StorageError
from ..native import crc32c
from ..native.hostmem import BufferPool
from ..storage.base import Storage

SAMPLE_BYTES = 1 << 20
# Chunks compressed whole are compressed into these, reused from chunk to chunk
# (a fresh frame per chunk faulted in new pages for every byte stored): 128 MiB
# in all across the process, none kept once no chunk is being compressed.
PACKED = BufferPool(128 << 20, keep_idle=False)


class SourceError(StorageError):
    """Reading the copy a chunk is copied from failed (not writing it)."""


class Source:
    """Where a chunk's raw bytes come from: `view()` (whole, no copy) when it
    can, else `read_into`. `trusted`: bytes just copied from the devices (the
    checksum is computed from them, so there is nothing to verify)."""

    trusted = False
    where = "?"

    def view(self) -> memoryview | None:
        return None

    def read_into(self, out: memoryview, offset: int) -> None:
        raise NotImplementedError


class MemorySource(Source):
    trusted = True

    def __init__(self, data: np.ndarray, where: str = "host snapshot"):
        self._data, self.where = data, where

    def view(self) -> memoryview:
        return self._data.data.cast("B")


class TierSource(Source):
    """A committed copy in another tier, in step directory `d` as its record
    `c` there places it (mapped without a copy on the RAM tier)."""

    def __init__(self, storage: Storage, d: str, c: ChunkRecord):
        self.storage, self.key, self.nbytes = storage, f"{d}/{c.object}", c.nbytes
        self.at = c.pack_offset
        self.where = f"{storage.url}/{self.key}" + (f" at byte {self.at}" if c.pack else "")

    def view(self) -> memoryview | None:
        try:
            m = self.storage.map(self.key, self.nbytes, self.at)
        except OSError as e:
            raise SourceError(e.errno or errno.EIO,
                              f"reading {self.where} to copy it failed: {e}") from e
        return None if m is None else m.data.cast("B")

    def read_into(self, out: memoryview, offset: int) -> None:
        try:
            self.storage.read_into(self.key, out, self.at + offset)
        except OSError as e:
            raise SourceError(e.errno or errno.EIO,
                              f"reading {self.where} to copy it failed: {e}") from e


class _Raw(io.RawIOBase):
    """A source's bytes in order, crc32c accumulated and checked at the end."""

    def __init__(self, src: Source, c: ChunkRecord):
        self._src, self._c = src, c
        self._view = src.view()
        self._pos, self._crc = 0, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self._c.nbytes - self._pos)
        if n <= 0:
            return 0
        out = memoryview(b).cast("B")[:n]
        if self._view is not None:
            out[:] = self._view[self._pos:self._pos + n]
        else:
            self._src.read_into(out, self._pos)
        self._crc = crc32c.extend(self._crc, np.frombuffer(out, np.uint8))
        self._pos += n
        if self._pos == self._c.nbytes and not self._src.trusted and self._crc != self._c.crc32c:
            raise CorruptCheckpointError(f"crc32c mismatch in {self._src.where} while "
                                         "copying it; that copy is corrupt")
        return n


class _Counted(io.RawIOBase):
    """Passes reads through and counts them: the stored size of a zstd stream."""

    def __init__(self, inner):
        self._inner, self.count = inner, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self.count += len(data)
        return data


def _whole(src: Source, c: ChunkRecord) -> memoryview:
    view = src.view()
    if view is None:
        buf = bytearray(c.nbytes)
        src.read_into(memoryview(buf), 0)
        view = memoryview(buf)
    if not src.trusted and crc32c.value(np.frombuffer(view, np.uint8)) != c.crc32c:
        raise CorruptCheckpointError(f"crc32c mismatch in {src.where} while copying it; "
                                     "that copy is corrupt")
    return view


def _sample_gain(src: Source, c: ChunkRecord, enc: Encoding) -> float:
    n = min(SAMPLE_BYTES, c.nbytes)
    view = src.view()
    if view is None:
        buf = bytearray(n)
        src.read_into(memoryview(buf), 0)
        view = memoryview(buf)
    return 1 - len(compress(view[:n], enc.level)) / max(n, 1)


def encoded(src: Source, c: ChunkRecord, enc: Encoding, piece: int
            ) -> tuple[io.IOBase, str]:
    """A stream of chunk `c`'s bytes as stored (from `src`, checked against
    `c.crc32c`, as `store` checks them) and its codec: what a pack holds of
    it. A chunk up to `piece` bytes is read whole (compressed whole where
    that gains `min_gain`), a larger one streamed."""
    if c.nbytes <= piece:
        data = _whole(src, c)
        if enc.codec == "zstd":
            z = compress(data, enc.level)
            if 0 < len(z) <= int(c.nbytes * (1 - enc.min_gain)):
                return io.BytesIO(z), "zstd"
        return io.BytesIO(data), "raw"
    if enc.codec == "zstd" and _sample_gain(src, c, enc) >= enc.min_gain:
        return compress_stream(_Raw(src, c), enc.level, c.nbytes, piece), "zstd"
    return _Raw(src, c), "raw"


def store(storage: Storage, key: str, src: Source, c: ChunkRecord, enc: Encoding
          ) -> ChunkRecord:
    """Puts chunk `c` (its bytes from `src`) as `key`; returns its record as
    stored (codec, stored_nbytes). A source whose bytes fail `c.crc32c` raises
    CorruptCheckpointError; nothing is then left under `key` by a streamed
    upload (it is never finalized)."""
    piece = storage.piece_bytes
    if c.nbytes <= piece:
        data = _whole(src, c)
        most = int(c.nbytes * (1 - enc.min_gain))  # a frame any larger is not worth it
        if enc.codec == "zstd" and most > 0:
            buf = PACKED.take(most)
            try:
                n = compress_into(data, buf[:most], enc.level)
                if n is not None:
                    storage.put(key, buf[:n].data)
                    return dataclasses.replace(c, codec="zstd", stored_nbytes=n, pack=None,
                                               pack_offset=0)
            finally:
                PACKED.give(buf)
        storage.put(key, data)
        return dataclasses.replace(c, codec="raw", stored_nbytes=c.nbytes, pack=None,
                                   pack_offset=0)
    zstd = enc.codec == "zstd" and _sample_gain(src, c, enc) >= enc.min_gain
    streams: list[_Counted] = []

    def opener() -> io.RawIOBase:
        raw = _Raw(src, c)
        inner = compress_stream(raw, enc.level, c.nbytes, piece) if zstd else raw
        streams.append(_Counted(inner))
        return streams[-1]

    storage.put_stream(key, opener, None if zstd else c.nbytes)
    stored = streams[-1].count if zstd else c.nbytes
    return dataclasses.replace(c, codec="zstd" if zstd else "raw", stored_nbytes=stored,
                               pack=None, pack_offset=0)


def put_host(storage: Storage, key: str, data: np.ndarray, c: ChunkRecord, enc: Encoding
             ) -> ChunkRecord:
    """Puts chunk `c` from host memory (`data`, its raw bytes as uint8) as `key`;
    returns its record as stored. Raw chunks go in one put, from `data` itself,
    whatever their size."""
    if enc.codec == "raw":
        storage.put(key, data.data)
        return c
    return store(storage, key, MemorySource(data), c, enc)


def store_first(storage: Storage, key: str, sources: Sequence[Source], c: ChunkRecord,
                enc: Encoding) -> tuple[ChunkRecord, int]:
    """`store` from the first source whose copy reads and verifies; returns the
    stored record and the index of the source used. A failure of the
    destination is raised at once (another source would not help)."""
    errors = []
    for i, src in enumerate(sources):
        try:
            return store(storage, key, src, c, enc), i
        except (SourceError, CorruptCheckpointError) as e:
            errors.append(f"{src.where}: {e}")
    raise CorruptCheckpointError(f"no intact copy of chunk {c.key} to copy from "
                                 f"({'; '.join(errors) or 'no source'})")
