"""Chunk codecs: how a chunk's bytes are stored ("raw", or "zstd" frames).

The one list of codec names (`CODECS`, the `Codec` type), the check options
are validated with, and the one place zstd is called: whole (`compress`,
`encode`, `decode`), into a given buffer (`compress_into`; `decode` too) or
as a stream (`compress_stream`, for chunks uploaded in pieces). The checksum
in the manifest is always over the uncompressed bytes, so a reader verifies
what it will use, whatever the codec.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from ..errors import CorruptCheckpointError

Codec = Literal["raw", "zstd"]
CODECS: tuple[Codec, ...] = ("raw", "zstd")


def check(codec: str, what: str) -> None:
    """Raises ValueError, naming the option `what`, unless `codec` is known."""
    if codec not in CODECS:
        names = " or ".join(repr(c) for c in CODECS)
        raise ValueError(f"{what} must be {names}, got {codec!r}")


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a tier stores chunks: `codec` "raw" or "zstd" (at `level`), zstd only
    where it saves at least `min_gain` of a chunk's bytes."""

    codec: Codec = "raw"
    level: int = 1
    min_gain: float = 0.03

    def __post_init__(self):
        check(self.codec, "codec")


def compress(data, level: int = 1) -> bytes:
    """One zstd frame of `data` (any buffer)."""
    import zstandard
    return zstandard.ZstdCompressor(level=level).compress(data)


def compress_into(data, out: np.ndarray, level: int = 1) -> int | None:
    """One zstd frame of `data` written into `out` (uint8); its length, or
    None when the frame does not fit (then `out` holds part of it)."""
    import zstandard
    with zstandard.ZstdCompressor(level=level).stream_reader(
            data, size=memoryview(data).nbytes) as r:
        got = _fill(r, out.reshape(-1).view(np.uint8).data)
        return got if not r.read(1) else None


FRAME_HEADER_MAX = 18  # the most bytes a zstd frame header takes


def frame_content_size(head: bytes) -> int | None:
    """The decoded size a zstd frame's header (its first bytes, up to
    FRAME_HEADER_MAX) records; None when it is no frame header or records none
    (every frame written here records it)."""
    import zstandard
    try:
        n = zstandard.frame_content_size(head)
    except zstandard.ZstdError:
        return None
    return n if n >= 0 else None


def _fill(stream, view: memoryview) -> int:
    """Reads `stream` into `view` until it is full or the stream ends; the
    bytes read."""
    got = 0
    while got < len(view) and (n := stream.readinto(view[got:])):
        got += n
    return got


def compress_stream(raw, level: int, size: int, read_size: int):
    """A stream reading one zstd frame of what `raw` (`size` bytes) yields,
    pulling `read_size` bytes of it at a time."""
    import zstandard
    return zstandard.ZstdCompressor(level=level).stream_reader(raw, size=size,
                                                               read_size=read_size)


def encode(codec: str, data: np.ndarray, level: int = 1) -> memoryview:
    if codec == "raw":
        return data.data
    if codec == "zstd":
        return memoryview(compress(data, level))
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def decode(codec: str, stored: np.ndarray, nbytes: int, out: np.ndarray | None = None
           ) -> np.ndarray:
    """The uncompressed bytes (into `out` when given); raises
    CorruptCheckpointError when the stored bytes do not decode to `nbytes`."""
    if codec == "raw":
        return stored
    if codec == "zstd":
        import zstandard
        # Decoded straight into `out`: no chunk-sized temporary (fresh memory
        # and a second copy of every byte, docs/benchmarks.md).
        if out is None:
            out = np.empty(nbytes, np.uint8)
        try:
            with zstandard.ZstdDecompressor().stream_reader(stored.data) as r:
                got = _fill(r, out.reshape(-1).view(np.uint8)[:nbytes].data)
                more = r.read(1) if got == nbytes else b""
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"zstd frame does not decode: {e}") from None
        if got != nbytes or more:
            raise CorruptCheckpointError(
                f"zstd frame decodes to {'more than ' if more else ''}{got} bytes, "
                f"the manifest says {nbytes}")
        return out[:nbytes]
    raise CorruptCheckpointError(f"unknown codec {codec!r}")
