"""O_DIRECT file I/O: which buffers qualify, and writing or reading one past the page cache.

A buffered write needs a fresh page-cache page for every 4 KiB it writes; on
the VMs this runs on, fresh memory is the slowest thing there is
(docs/environment.md), so the local tier writes a snapshot's chunks straight
from host memory to the disk, in about half the time of a buffered write
(docs/benchmarks.md). O_DIRECT wants the buffer's address, the length and the file offset on
the device's block size. A buffer that does not start on a block (a jax CPU
buffer starts 64 bytes into a page: a snapshot that views the state,
snapshot.viewed) is copied through a reused, page-aligned staging buffer a
piece at a time: a copy into touched memory is an order of magnitude faster
than a buffered write's fresh page-cache pages. A small buffer, or a
file system that refuses the flag, is written through the cache instead
(storage/files.py). Reads of big files the page cache does not hold go
past it the same way, into the restore's page-aligned buffers.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np

BLOCK = 4096  # covers 512-byte and 4K disks
MIN_BYTES = 1 << 20  # smaller objects go through the page cache
FLAG = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none


STAGE_BYTES = 8 << 20  # an unaligned buffer is written this much at a time


def qualifies(view: memoryview) -> bool:
    """Whether `view` (bytes) is big enough to go past the page cache."""
    return bool(FLAG) and len(view) >= MIN_BYTES


def aligned(view: memoryview) -> bool:
    """Whether `view` starts on a block boundary (else it needs a stage)."""
    return np.frombuffer(view, np.uint8).ctypes.data % BLOCK == 0


def write(fd: int, view: memoryview, stage: np.ndarray | None = None, at: int = 0) -> bool:
    """Writes `view` to `fd` (opened with O_DIRECT) at file offset `at` (on a
    block; the file ends after it, so parts go in offset order): its whole blocks straight
    from it, or, where it is not `aligned`, copied through `stage` (uint8,
    page-aligned, a whole number of blocks) a piece at a time; the last part
    through a zero-padded page, the size then cut back. False, with the file
    emptied and O_DIRECT cleared, where the kernel refuses the alignment
    (EINVAL): the caller then writes it through the cache."""
    whole = len(view) - len(view) % BLOCK
    src = None if aligned(view) else np.frombuffer(view, np.uint8)
    if src is not None and (stage is None or len(stage) < BLOCK):
        raise ValueError("an unaligned buffer needs a stage to be written with O_DIRECT")
    try:
        pos = 0
        while pos < whole:
            if src is None:
                n = os.pwrite(fd, view[pos:whole], at + pos)
            else:
                assert stage is not None
                k = min(len(stage) - len(stage) % BLOCK, whole - pos)
                stage[:k] = src[pos:pos + k]
                n = os.pwrite(fd, stage[:k].data, at + pos)
            if n <= 0 or n % BLOCK:
                raise OSError(errno.EINVAL, "short unaligned direct write")
            pos += n
        if whole < len(view):
            with mmap.mmap(-1, BLOCK) as page:
                page[:len(view) - whole] = view[whole:]
                os.pwrite(fd, page, at + whole)
            os.ftruncate(fd, at + len(view))
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~FLAG)
    os.ftruncate(fd, 0)
    return False


def readable(view: memoryview, offset: int) -> bool:
    """Whether `view` (bytes, to be filled from file offset `offset`) can be
    read past the page cache: big enough, and both on block boundaries."""
    return qualifies(view) and offset % BLOCK == 0 and aligned(view)


def read(fd: int, view: memoryview, offset: int) -> int | None:
    """Reads the whole blocks of `view` from `fd` at `offset` with O_DIRECT,
    set on the descriptor for the call (the rest, a partial last block, is
    the caller's to read through the cache). The bytes read (fewer only at
    the end of the file), or None where the file system refuses the flag or
    the alignment (EINVAL): nothing was read then."""
    whole = len(view) - len(view) % BLOCK
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    pos = 0
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | FLAG)
        while pos < whole:
            n = os.preadv(fd, [view[pos:whole]], offset + pos)
            pos += n
            if n == 0 or n % BLOCK:
                break  # the end of the file
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None if pos == 0 else pos
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return pos
