"""Batched durability for the file tiers: a save's chunks made durable by
syncfs(2) of their file system instead of an fsync each.

Owns whether syncfs can stand in for fsync here, and `Batch`, one save's
share of it. syncfs can where it reports write-back errors (Linux 5.8 on;
before, it returned 0 for pages that never reached the disk) and on a local
block-device file system, whose syncfs commits the journal and flushes the
device's cache (on NFS, FUSE or overlay what it does for durability varies).

A Batch holds a descriptor of the step directory opened when the save starts;
the save's puts create their chunks through it (`hold`), so the directory is
not walked again per chunk. Where syncfs serves, a write-back error of any
chunk written since it was opened is reported to it (the error is sampled
per open file), and every `SYNC_EVERY` bytes written, one of the writing
threads runs syncfs while the others go on writing, so the device is
flushed in a pipeline, as per-chunk fsyncs would, with a few flushes
instead of one per chunk, and the sync at the commit waits only for the
tail. (Periodic syncing by bytes written is the idea of RocksDB's
`bytes_per_sync`.) Elsewhere each chunk is fsynced by its put and the
batch's sync fsyncs the directory; in a tier that does not fsync (the RAM
tier, on tmpfs) nothing is.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading

SYNC_EVERY = 16 << 20  # 1 GB in 64 syncs: chosen by bench/local_flush.py (docs/benchmarks.md)
# Local block-device file systems: their syncfs writes every dirty page and
# journal entry to the device and flushes its cache.
SYNCFS_TYPES = frozenset({"ext4", "ext3", "xfs", "btrfs", "f2fs"})


def _load_syncfs():
    """libc's syncfs where it reports write-back errors (Linux 5.8 on), else None."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release) if sys.platform == "linux" else None
    if m is None or (int(m[1]), int(m[2])) < (5, 8):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


syncfs = _load_syncfs()


def fs_type(fd: int) -> str | None:
    """The type of the file system `fd` lies on, from /proc/self/mountinfo."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 3 and fields[2] == dev and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        pass
    return None


def usable(fd: int) -> bool:
    """Whether syncfs makes what is written below directory `fd` durable."""
    return syncfs is not None and fs_type(fd) in SYNCFS_TYPES


class Batch:
    """One save's chunks under one directory: `mode` "syncfs" syncs them
    together; "fsync" leaves them to their puts and syncs the directory; None
    syncs nothing (tmpfs)."""

    def __init__(self, fd: int, mode: str | None):
        self.fd = fd  # owned: closed by `close`, or by the last `release` after it
        self.mode = mode
        self._lock = threading.Lock()
        self._syncing = threading.Lock()
        self._unsynced = 0
        self._users = 0
        self._closed = False

    def hold(self) -> bool:
        """Whether `fd` may be used (until `release`): False once closed, so a
        put never creates a file through a descriptor number reused since."""
        with self._lock:
            if self._closed:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._closed and not self._users
        if last:
            os.close(self.fd)

    def wrote(self, nbytes: int) -> None:
        """Counts a chunk written; syncs when `SYNC_EVERY` bytes wait and no
        other thread is syncing. Raises OSError if the sync reports an error."""
        if self.mode != "syncfs":
            return
        with self._lock:
            self._unsynced += nbytes
            if self._unsynced < SYNC_EVERY or not self._syncing.acquire(blocking=False):
                return
            self._unsynced = 0
        try:
            self._sync()
        finally:
            self._syncing.release()

    def sync(self) -> None:
        """Makes every chunk written so far durable; raises OSError if any may not be."""
        with self._syncing:
            self._sync()

    def _sync(self) -> None:
        if self.mode == "fsync":
            os.fsync(self.fd)
        elif self.mode == "syncfs" and syncfs(self.fd) != 0:
            n = ctypes.get_errno()
            raise OSError(n, f"{os.strerror(n)} (reported by a syncfs of the save's file "
                             "system: a write-back error)")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = not self._users
        if idle:
            os.close(self.fd)
