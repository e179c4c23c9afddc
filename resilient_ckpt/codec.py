"""Chunk codecs: how a chunk's bytes are stored ("raw", or "zstd" frames).

The checksum in the manifest is always over the uncompressed bytes, so a reader
verifies what it will use, whatever the codec.
"""
from __future__ import annotations

import numpy as np

from .errors import CorruptCheckpointError

CODECS = ("raw", "zstd")


def encode(codec: str, data: np.ndarray, level: int = 1) -> memoryview:
    if codec == "raw":
        return memoryview(data)
    if codec == "zstd":
        import zstandard
        return memoryview(zstandard.ZstdCompressor(level=level).compress(data))
    raise ValueError(f"unknown codec {codec!r}; use one of {CODECS}")


def decode(codec: str, stored: np.ndarray, nbytes: int, out: np.ndarray | None = None
           ) -> np.ndarray:
    """The uncompressed bytes (into `out` when given); raises
    CorruptCheckpointError when the stored bytes do not decode to `nbytes`."""
    if codec == "raw":
        return stored
    if codec == "zstd":
        import zstandard
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=nbytes)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"zstd frame does not decode: {e}") from None
        if len(raw) != nbytes:
            raise CorruptCheckpointError(f"zstd frame decodes to {len(raw)} bytes, "
                                         f"the manifest says {nbytes}")
        arr = np.frombuffer(raw, dtype=np.uint8)
        if out is None:
            return arr
        out[:] = arr
        return out
    raise CorruptCheckpointError(f"unknown codec {codec!r}")
