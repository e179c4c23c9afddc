"""O_DIRECT file writes: which buffers qualify, and writing one past the page cache.

A buffered write needs a fresh page-cache page for every 4 KiB it writes; on
the VMs this runs on, fresh memory is the slowest thing there is
(docs/environment.md), so the local tier writes a snapshot's chunks straight
from host memory to the disk: 4 GB in 3.3-3.6 s against 7.9-9.4 s buffered
here. O_DIRECT wants the buffer's address, the length and the file offset on
the device's block size; a buffer that is not so aligned, is small, or meets
a file system that refuses the flag is written through the cache instead
(storage/files.py).
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


def qualifies(view: memoryview) -> bool:
    """Whether `view` (bytes) is big enough and starts on a block boundary."""
    return (bool(FLAG) and len(view) >= MIN_BYTES
            and np.frombuffer(view, np.uint8).ctypes.data % BLOCK == 0)


def write(fd: int, view: memoryview) -> bool:
    """Writes `view` to `fd` (opened with O_DIRECT): its whole blocks straight
    from it, the last part through a zero-padded page, the size then cut back.
    False, with the file emptied and O_DIRECT cleared, where the kernel refuses
    the alignment (EINVAL): the caller then writes it through the cache."""
    whole = len(view) - len(view) % BLOCK
    try:
        pos = 0
        while pos < whole:
            n = os.pwrite(fd, view[pos:whole], pos)
            if n <= 0 or n % BLOCK:
                raise OSError(errno.EINVAL, "short unaligned direct write")
            pos += n
        if whole < len(view):
            with mmap.mmap(-1, BLOCK) as page:
                page[:len(view) - whole] = view[whole:]
                os.pwrite(fd, page, whole)
            os.ftruncate(fd, len(view))
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~FLAG)
    os.ftruncate(fd, 0)
    return False
