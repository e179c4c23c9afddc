"""Host memory for restores: fresh buffers, and regions stitched from files.

`host_buffer` gives a fresh page-aligned buffer, backed by huge pages and
populated by the kernel in one call where it can (first touch of fresh memory
is the slowest step of a restore on a VM, docs/environment.md); `carve` cuts several
such buffers from one mapping, for one leaf's shards; `BufferPool` lends
such buffers again and again (compressed chunks on their way in or out),
within a bound on their bytes; `cached` says whether the page cache holds
a file whole (then the file tiers map it instead), and `read_ahead` asks
for a mapped file's range to be read into it; `untouched_zeros` gives
aligned zeros that take no memory until written. `Region` reserves an
address range and maps several RAM-tier files into it side by side,
copy-on-write, so target shards that stack whole rows of several saved chunks
(a smaller data axis after a failure) become views of it without copying.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import mmap
import threading
import weakref

import numpy as np

PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; ignored where unknown
_MADV_WILLNEED = 3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10


def host_mmap(nbytes: int, threads: int = 1) -> mmap.mmap:
    """Fresh anonymous memory of at least `nbytes`, populated where it is big
    (by `threads` threads side by side, each faulting in its share)."""
    m = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    if nbytes >= 1 << 20:
        _populate(m, max(1, threads))
    return m


def _populate(m: mmap.mmap, threads: int) -> None:
    """Has the kernel fault `m` in, without the GIL: mmap.madvise holds it
    (every other thread stops for as long as the kernel faults), ctypes
    releases it."""
    anchor = ctypes.c_char.from_buffer(m)
    try:
        base, step = ctypes.addressof(anchor), -(-len(m) // threads // PAGE) * PAGE
        parts = [(base + lo, min(step, len(m) - lo)) for lo in range(0, len(m), step)]
        if len(parts) == 1:
            rcs = [_madvise(*parts[0])]
        else:
            with cf.ThreadPoolExecutor(len(parts), thread_name_prefix="rc-populate") as ex:
                rcs = list(ex.map(lambda p: _madvise(*p), parts))
    finally:
        del anchor  # lets `m` be closed again
    err = next((e for e in rcs if e), 0)
    if err and err != errno.EINVAL:  # EINVAL: a kernel before 5.14; pages fault in on use
        raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {len(m)} bytes failed")


def _madvise(addr: int, length: int) -> int:
    """The errno of MADV_POPULATE_WRITE on [addr, addr + length), 0 if none."""
    return 0 if _libc.madvise(addr, length, _MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()


def cached(fd: int, nbytes: int, offset: int = 0) -> bool:
    """Whether every page of the `nbytes` of file `fd` from `offset` is in the
    page cache (mincore(2) of a mapping made for the question); False where
    the file cannot be mapped."""
    if nbytes <= 0:
        return False
    start = offset - offset % PAGE  # a mapping starts on a page
    span = nbytes + offset - start
    addr = _libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return False
    try:
        vec = np.empty(-(-span // PAGE), np.uint8)
        if _libc.mincore(addr, span, vec.ctypes.data) != 0:
            return False
        return bool((vec & 1).all())
    finally:
        _libc.munmap(addr, span)


def read_ahead(mapped: np.ndarray, start: int, length: int) -> None:
    """Asks the kernel to read bytes [start, start + length) of a file
    mapping (`mapped`: a uint8 view of it from its first byte; `start` a
    multiple of the page size) into the page cache (MADV_WILLNEED). It
    returns once the reads are queued, which can take as long as reading
    them where the device's queue is full; the GIL is released meanwhile.
    Advice only: a failure changes nothing (the pages are read when used)."""
    length = min(length, len(mapped) - start)
    if length > 0 and start % PAGE == 0:
        _libc.madvise(mapped.ctypes.data + start, length, _MADV_WILLNEED)


def host_buffer(nbytes: int) -> np.ndarray:
    """A fresh, page-aligned uint8 buffer of `nbytes`."""
    return np.frombuffer(host_mmap(nbytes), dtype=np.uint8)[:nbytes]


# One mapping of `carve` holds at most this much: a leaf's buffers share it
# (and its lifetime), and its reads start only once it is populated.
CARVE_BYTES = 64 << 20


def carve(sizes: list[int], threads: int = 2) -> list[np.ndarray]:
    """Fresh page-aligned uint8 buffers of `sizes`, cut from as few populated
    mappings as CARVE_BYTES allows; a mapping is freed when all its buffers
    are. Meant for the buffers of one leaf, which live and die together.
    Few large mappings populate faster than many small ones (fewer mappings
    and threads contending where a guest gets no huge pages;
    docs/benchmarks.md)."""
    groups: list[list[int]] = []  # sizes
    held = CARVE_BYTES  # of the last group: the first size starts one
    for n in sizes:
        if held + _pages(n) > CARVE_BYTES:
            groups.append([])
            held = 0
        groups[-1].append(n)
        held += _pages(n)
    out = []
    for group in groups:
        at = np.cumsum([0] + [_pages(n) for n in group])
        whole = np.frombuffer(host_mmap(int(at[-1]), threads), np.uint8)
        out += [whole[lo:lo + n] for lo, n in zip(at[:-1], group, strict=True)]
    return out


def _pages(n: int) -> int:
    return -(-max(n, 1) // PAGE) * PAGE


class BufferPool:
    """`host_buffer`s lent and taken back, so that the next user finds its
    pages already faulted in (a fresh buffer per compressed chunk faulted in
    as many new pages as the state again, docs/benchmarks.md). All of them,
    idle or lent, hold at most `cap` bytes: `take` waits for one to come
    back (dropping idle ones too small) rather than pass it; a request over
    `cap` gets a buffer of its own. With `keep_idle` False the idle ones are
    dropped whenever none is lent, so nothing stays held between uses."""

    def __init__(self, cap: int, keep_idle: bool = True):
        self.cap, self.keep_idle = cap, keep_idle
        self._idle: list[np.ndarray] = []
        self._bytes = 0  # idle and lent
        self._lent = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes`, to hand back to `give`."""
        if nbytes > self.cap:
            return host_buffer(nbytes)
        with self._cond:
            while True:
                for i, b in enumerate(self._idle):
                    if len(b) >= nbytes:
                        self._lent += 1
                        return self._idle.pop(i)
                while self._idle and self._bytes + nbytes > self.cap:
                    self._bytes -= len(self._idle.pop())
                if self._bytes + nbytes <= self.cap:
                    self._bytes += nbytes
                    self._lent += 1
                    break
                self._cond.wait()
        return host_buffer(nbytes)

    def give(self, buf: np.ndarray) -> None:
        if len(buf) > self.cap:
            return  # its own: freed with its last reference
        with self._cond:
            self._lent -= 1
            self._idle.append(buf)
            if not self.keep_idle and self._lent == 0:
                self._drop_idle()
            self._cond.notify()

    def clear(self) -> None:
        """Drops the idle buffers."""
        with self._cond:
            self._drop_idle()
            self._cond.notify_all()

    def _drop_idle(self) -> None:
        self._bytes -= sum(len(b) for b in self._idle)
        self._idle.clear()

    @property
    def held(self) -> int:
        """Bytes of the buffers idle or lent (at most `cap`, but for own ones)."""
        with self._cond:
            return self._bytes


def untouched_zeros(shape: tuple, dtype) -> np.ndarray:
    """Zeros in fresh page-aligned memory that is not populated: no resident
    memory until written, and aligned, so jax's CPU client aliases it rather
    than copying it (np.zeros is not: a lost host's shards to fill from its
    peers were copied and resident)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8)[:n].view(dtype).reshape(shape)


class Region:
    """An address range filled by `place` with copy-on-write file mappings.

    Every placement but the last must start and end on a page boundary. The
    region is unmapped when the array from `array()` (and all views of it, a
    jax array aliasing it included) is gone.
    """

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.size = -(-max(nbytes, 1) // PAGE) * PAGE
        addr = _libc.mmap(None, self.size, 0,  # PROT_NONE until placed
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "could not reserve address space")
        self.addr = addr
        self._buf = (ctypes.c_uint8 * self.size).from_address(addr)
        weakref.finalize(self._buf, _libc.munmap, addr, self.size)

    def place(self, fd: int, file_offset: int, dest_offset: int, length: int) -> bool:
        """Maps file bytes [file_offset, +length) at dest_offset; False if the
        offsets are not page aligned or the kernel refuses."""
        if file_offset % PAGE or dest_offset % PAGE or dest_offset + length > self.nbytes:
            return False
        if (dest_offset + length) % PAGE and dest_offset + length != self.nbytes:
            return False
        got = _libc.mmap(self.addr + dest_offset, -(-length // PAGE) * PAGE,
                         mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED,
                         fd, file_offset)
        return got == self.addr + dest_offset

    def array(self) -> np.ndarray:
        # numpy's stubs list the buffer types frombuffer takes before Python 3.12
        # (no typing.Buffer); a ctypes array is a buffer but not among them.
        return np.frombuffer(self._buf, dtype=np.uint8)[:self.nbytes]  # type: ignore[call-overload]
