"""Packs: which of a process's chunks of a step share one object in a tier,
and writing one pack.

A tier then holds a few objects per process and step rather than one per
chunk (an object store limits and bills requests per object). In order, a
pack takes chunks until it holds its target (PACK_BYTES, or the packed
bytes over `share` when they are fewer, but at least MIN_TARGET: a step
still writes several packs side by side, 5 to 8 as it grows, a tiny one a
single pack), so every pack but the last holds at least its target and a
process's step is at most `share` + 1 packs, or one more than its packed
bytes in PACK_BYTES; with its manifest and claim, at most 8 objects plus
one per PACK_BYTES. A chunk of PACK_BYTES or more is its own
object, as in format 2. (Bytes here count each packed chunk in whole pages:
a step of very many chunks smaller than a page takes more.) Every chunk in a
pack starts on `manifest.PACK_ALIGN`, so a range of it can be mapped (the
RAM tier's zero-copy restore) and written with O_DIRECT.

A raw pack from host memory is written with `Storage.put_parts` (in place,
without a copy, on a file tier). Otherwise (a copy from another tier, a zstd
tier) it is streamed: each chunk read from its first source that verifies,
encoded, and put through `put_stream` in pieces, so memory stays bounded;
a source that fails its checksum part-way makes the pack start again with
that chunk's next source.
"""
from __future__ import annotations

import dataclasses
import io
from collections.abc import Sequence

from ..core import layout
from ..core.codec import Encoding
from ..core.manifest import PACK_ALIGN, ChunkRecord
from ..errors import CorruptCheckpointError
from ..storage.base import Storage
from . import transfer

PACK_BYTES = 256 << 20
SHARE = 5  # a small step's packed bytes go in about this many packs (more for a big
MIN_TARGET = 4 << 20  # step, `share`), each of at least this many bytes (a tiny step: one)


def share(small: int) -> int:
    """How many packs a step of `small` packed bytes is cut into (before the
    PACK_BYTES cap): SHARE, and one more for each PACK_BYTES up to 8, so a
    big step is written by as many threads as a tier has (io_threads) while
    the objects stay within 8 plus one per PACK_BYTES."""
    return SHARE + min(3, small // PACK_BYTES)


def align(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


def plan(nbytes: Sequence[int]) -> list[list[int]]:
    """Chunk indices (in order) grouped into packs; a group of one chunk of
    PACK_BYTES or more is that chunk unpacked (`packed` says which)."""
    small = sum(align(n) for n in nbytes if n < PACK_BYTES)  # a chunk takes whole pages
    target = max(1, min(PACK_BYTES, max(MIN_TARGET, -(-small // share(small)))))
    groups: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, n in enumerate(nbytes):
        if n >= PACK_BYTES:
            groups.append([i])
            continue
        run.append(i)
        size = align(size) + n
        if size >= target:
            groups.append(run)
            run, size = [], 0
    if run:
        groups.append(run)
    return groups


def packed(group: list[int], nbytes: Sequence[int]) -> bool:
    return len(group) > 1 or nbytes[group[0]] < PACK_BYTES


def offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each chunk's offset in a pack of chunks of `sizes` (in order), and the
    pack's size (it ends with its last chunk)."""
    out, end = [], 0
    for n in sizes:
        out.append(align(end))
        end = out[-1] + n
    return out, end


def object_name(group: list[int], keys: Sequence[str], nbytes: Sequence[int], save_id: str,
                process_index: int) -> str:
    """The object a group of `plan` goes to: its pack, or its one chunk's key."""
    if not packed(group, nbytes):
        return keys[group[0]]
    return layout.pack_name(save_id, process_index, [keys[j] for j in group])


def put_raw(storage: Storage, d: str, pack: str, records: Sequence[ChunkRecord],
            views: Sequence[memoryview]) -> list[ChunkRecord]:
    """Writes raw chunks (`records`, their bytes `views`) as pack `pack` in
    step directory `d`; returns their records in it."""
    at, size = offsets([c.nbytes for c in records])
    storage.put_parts(f"{d}/{pack}", list(zip(at, views, strict=True)), size)
    return [dataclasses.replace(c, codec="raw", stored_nbytes=c.nbytes, pack=pack,
                                pack_offset=o) for c, o in zip(records, at, strict=True)]


class _SourceFailed(transfer.SourceError):
    def __init__(self, j: int, e: BaseException):
        super().__init__(getattr(e, "errno", None) or 5, str(e))
        self.j = j


def put_streamed(storage: Storage, d: str, pack: str, chunks: Sequence[ChunkRecord],
                 sources: Sequence[Sequence[transfer.Source]], enc: Encoding
                 ) -> tuple[list[ChunkRecord], list[int]]:
    """Writes `chunks` as pack `pack` in step directory `d`, each from the
    first of its `sources` whose bytes verify, encoded with `enc`; returns
    their records in it and the index of the source each came from. No
    chunk left with an intact source: CorruptCheckpointError naming it."""
    choice = [0] * len(chunks)
    errors: list[list[str]] = [[] for _ in chunks]
    out: list[ChunkRecord] = []

    def opener() -> io.RawIOBase:
        out.clear()
        return _PackStream(chunks, [s[k] if k < len(s) else None
                                    for s, k in zip(sources, choice, strict=True)],
                           enc, storage.piece_bytes, pack, out)
    while True:
        try:
            storage.put_stream(f"{d}/{pack}", opener, None)
            return out, choice
        except _SourceFailed as e:
            errors[e.j].append(str(e))
            choice[e.j] += 1
            if choice[e.j] >= len(sources[e.j]):
                raise CorruptCheckpointError(
                    f"no intact copy of chunk {chunks[e.j].key} to copy from "
                    f"({'; '.join(errors[e.j]) or 'no source'})") from None


class _PackStream(io.RawIOBase):
    """A pack's bytes in order: each chunk as stored, zeros up to the next
    chunk's aligned offset. Appends each chunk's record to `out` as it ends."""

    def __init__(self, chunks, sources, enc, piece, pack, out):
        self._chunks, self._sources, self._enc, self._piece = chunks, sources, enc, piece
        self._pack, self._out = pack, out
        self._j, self._pos, self._start, self._pad = -1, 0, 0, 0
        self._stream: io.IOBase | None = None
        self._codec = "raw"

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        while True:
            if self._pad:
                n = min(len(view), self._pad)
                view[:n] = bytes(n)
                self._pad -= n
                self._pos += n
                return n
            if self._stream is None:
                if self._j + 1 == len(self._chunks):
                    return 0
                self._j += 1
                self._start = align(self._pos)
                self._pad = self._start - self._pos
                self._stream, self._codec = self._guarded(lambda: transfer.encoded(
                    self._source(), self._chunks[self._j], self._enc, self._piece))
                continue
            data = self._guarded(lambda: self._stream.read(len(view)))
            if data:
                view[:len(data)] = data
                self._pos += len(data)
                return len(data)
            c = self._chunks[self._j]
            self._out.append(dataclasses.replace(
                c, codec=self._codec, stored_nbytes=self._pos - self._start, pack=self._pack,
                pack_offset=self._start))
            self._stream = None

    def _source(self) -> transfer.Source:
        src = self._sources[self._j]
        if src is None:
            raise CorruptCheckpointError("no source left")
        return src

    def _guarded(self, fn):
        try:
            return fn()
        except (transfer.SourceError, CorruptCheckpointError) as e:
            raise _SourceFailed(self._j, e) from e
