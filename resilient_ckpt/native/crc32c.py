"""CRC32C of buffers, computed without holding the GIL.

`google_crc32c.value` holds the GIL while it runs (two threads checksumming
two buffers take longer than one thread doing both), so a save's
background checksums stalled the training thread and a restore's read pool
checksummed on one core. The same C library ships inside the google_crc32c
wheel; called through ctypes, which drops the GIL for the call, checksums on
several threads run side by side. Small buffers and installs without that
library use google_crc32c itself (same values; a buffer that is not
contiguous is refused by it, as before).

`bad_block` checks a run of consecutive checksum blocks in one pass: their
CRC32Cs, combined (the CRC of A + B follows from those of A and B and the
length of B), must equal the CRC of the whole run. One call over 40 blocks
of 256 KiB instead of 40 keeps the readers' threads from trading the GIL 40
times (a stitched resharded restore checked block by block spent more thread
time than one of whole chunks). A mismatch is then found block by block.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Sequence
from typing import Any

import google_crc32c
import numpy as np

_BIG = 64 * 1024  # below this the ctypes call costs more than holding the GIL


def _load() -> Any:
    here = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    for path in sorted(glob.glob(os.path.join(here, "google_crc32c.libs", "libcrc32c*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if fn(0, b"123456789", 9) == 0xE3069283:  # the CRC32C check value
            return fn
    return None


_extend = _load()


def extend(crc: int, data: Any) -> int:
    """The CRC32C of what `crc` covered followed by `data` (any buffer)."""
    a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if _extend is None or a.nbytes < _BIG or not a.flags.c_contiguous:
        return google_crc32c.extend(crc, a)
    return int(_extend(crc, a.ctypes.data, a.nbytes))


def value(data: Any) -> int:
    """The CRC32C of `data` (any buffer)."""
    return extend(0, data)


def releases_gil() -> bool:
    """Whether large checksums run without the GIL here."""
    return _extend is not None


# ---------------------------------------------------------------- combining

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bits reflected: x^0 is bit 31


def _mult(a: int, b: int) -> int:
    """a * b modulo the polynomial (both in reflected bit order)."""
    p = 0
    while a:
        if a & 0x80000000:
            p ^= b
        a = (a << 1) & 0xFFFFFFFF
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_mult(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=1024)
def _x8n(nbytes: int) -> int:
    """x^(8 nbytes) modulo the polynomial: what appending `nbytes` bytes
    multiplies a CRC by."""
    s, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            s = _mult(_X2N[k & 31], s)
        n >>= 1
        k += 1
    return s


@functools.lru_cache(maxsize=128)
def _tables(nbytes: int) -> tuple[list[int], ...]:
    """Byte tables of crc -> crc * x^(8 nbytes) (linear in crc: four lookups
    instead of a multiplication), for the blocks of one size."""
    s, tables = _x8n(nbytes), []
    for j in range(4):
        t = [0] * 256
        for i in range(8):
            t[1 << i] = _mult(s, 1 << (8 * j + i))
        for v in range(3, 256):
            if v & (v - 1):
                t[v] = t[v & (v - 1)] ^ t[v & -v]
        tables.append(t)
    return tuple(tables)


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32C of A + B, from crc1 of A, crc2 of B and B's length."""
    return _mult(_x8n(len2), crc1) ^ crc2


def combined(crcs: Sequence[int], block_bytes: int, nbytes: int) -> int:
    """The CRC32C of `nbytes` bytes whose blocks of `block_bytes` (the last
    may be shorter) have the CRC32Cs `crcs`."""
    if not crcs:
        return 0
    t = _tables(block_bytes) if len(crcs) > 2 else None
    out = crcs[0]
    for i in range(1, len(crcs)):
        n = min(block_bytes, nbytes - i * block_bytes)
        if t is not None and n == block_bytes:
            out = (t[0][out & 255] ^ t[1][(out >> 8) & 255] ^ t[2][(out >> 16) & 255]
                   ^ t[3][out >> 24] ^ crcs[i])
        else:
            out = combine(out, crcs[i], n)
    return out


# A run of pieces with more distinct lengths than this is not combined:
# each length's tables cost about 0.6 ms to build (kept for 128 lengths).
MAX_LENGTHS = 64


def concatenated(parts: Sequence[tuple[int, int]]) -> int:
    """The CRC32C of consecutive pieces whose (CRC32C, length) are `parts`, in
    order: four table lookups a piece, for pieces of a few distinct lengths
    (a pack's chunks and the zeros between them)."""
    out = 0
    for crc, n in parts:
        if n:
            t = _tables(n)
            out = (t[0][out & 255] ^ t[1][(out >> 8) & 255] ^ t[2][(out >> 16) & 255]
                   ^ t[3][out >> 24] ^ crc)
    return out


@functools.lru_cache(maxsize=4096)  # a gap before an aligned offset: under 4 KiB
def zeros(nbytes: int) -> int:
    """The CRC32C of `nbytes` zero bytes."""
    return google_crc32c.value(bytes(nbytes))


def bad_block(data: Any, block_bytes: int, want: Sequence[int]) -> int | None:
    """None if `data`, cut into blocks of `block_bytes` (the last may be
    shorter), has the block CRC32Cs `want`; else the index of the first block
    that does not. Raises ValueError when `want` has not one CRC per block."""
    a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    n, blocks = a.nbytes, len(want)
    if blocks != -(-n // block_bytes) or (n == 0) != (blocks == 0):
        raise ValueError(f"{n} bytes are {-(-n // block_bytes)} blocks of {block_bytes}, "
                         f"not {blocks}")
    if not blocks or value(a) == combined(want, block_bytes, n):
        return None
    flat = a.reshape(-1).view(np.uint8)
    return next((i for i in range(blocks)
                 if value(flat[i * block_bytes:(i + 1) * block_bytes]) != want[i]), 0)
