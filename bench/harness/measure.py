"""Timing, memory and the page cache: what a timed case needs around it.

Nothing here imports jax (numpy only where a buffer is needed)."""
from __future__ import annotations

import gc
import os
import time


def timed(fn, *a, **kw) -> tuple[float, object]:
    """(seconds, result) of fn(*a, **kw)."""
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


# ---------------------------------------------------------------- memory

def proc_kb(path: str, field: str) -> int:
    """A "Field: N kB" value of a /proc file (/proc/meminfo, /proc/self/status)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    return proc_kb("/proc/meminfo", "MemAvailable") * 1024


class PeakRss:
    """This process's peak resident memory above its level at entry, over a
    `with` block: the kernel's high-water mark (VmHWM) is reset on entry
    (writing 5 to /proc/self/clear_refs, Linux 4.0+) and read at exit. Pages
    the block maps count (a RAM-tier restore's mapped files, as in
    bench/reshard.py's figures); the page cache does not. `extra` is the bytes
    above the entry level, or None where the kernel refuses the reset."""

    extra: int | None = None

    def __enter__(self) -> PeakRss:
        self.base = proc_kb("/proc/self/status", "VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        return self

    def __exit__(self, *exc) -> None:
        if self.reset:
            self.extra = max(0, proc_kb("/proc/self/status", "VmHWM") - self.base) * 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trim() -> None:
    """Garbage-collects and gives glibc's freed heap back (docs/environment.md:
    without it a process grows about 0.7 GB per save+restore of 1 GB)."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to give back this way
        pass


SETTLE_S = 3.0


def settle(seconds: float = SETTLE_S) -> None:
    """`trim`, then a wait, so that a timed case does not start while what the
    case before left behind is still running: another system's background
    threads, the kernel's writeback and reclaim. It does not wait for the VM
    to take freed memory back: faulting memory in took as long whether memory
    had been unmapped a moment or half a minute before (docs/environment.md)."""
    trim()
    time.sleep(seconds)


# ---------------------------------------------------------------- files and the page cache

def files_under(d: str) -> list[str]:
    out = []
    for root, _, names in os.walk(d):
        out.extend(os.path.join(root, n) for n in sorted(names))
    return out


def read_through(paths: list[str], buf=None) -> int:
    """Reads every file sequentially into one reused buffer, so the page cache
    holds them (a warm restore); returns bytes read."""
    import numpy as np
    if buf is None:
        buf = np.empty(16 << 20, np.uint8)
    mv, total = memoryview(buf), 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [mv])
                if n == 0:
                    break
                total += n
        finally:
            os.close(fd)
    return total


def drop_caches(paths: list[str]) -> str:
    """Empties the page cache of `paths`: drop_caches where permitted (root),
    else posix_fadvise(DONTNEED) per file. Returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def set_aside(d: str) -> None:
    """Moves directory `d` (if there) into the directory "aside" beside it,
    removed with the bench's work directory after the last repeat: on a file
    system mounted with `discard` (this machine's root), writes in the 15-30 s
    after a large deletion run 2.5-4x slower (docs/environment.md), so a write
    timed after a delete would time that."""
    if os.path.exists(d):
        aside = os.path.join(os.path.dirname(d), "aside")
        os.makedirs(aside, exist_ok=True)
        os.rename(d, os.path.join(aside, f"{os.path.basename(d)}.{time.time_ns()}"))
