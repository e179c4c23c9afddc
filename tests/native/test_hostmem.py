"""hostmem.carve: several restore buffers cut from one populated mapping."""
from __future__ import annotations

import gc
import mmap
import weakref

import numpy as np

from resilient_ckpt.native import hostmem


def _mapping(buf: np.ndarray) -> mmap.mmap:
    base = buf
    while not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else base.base
    return base


def test_carved_buffers_are_aligned_disjoint_and_of_their_sizes():
    sizes = [1, 4096, 5000, 3 << 20, 0, 12345]
    bufs = hostmem.carve(sizes)
    assert [b.nbytes for b in bufs] == sizes
    assert all(b.dtype == np.uint8 and b.ctypes.data % hostmem.PAGE == 0 for b in bufs)
    for i, b in enumerate(bufs):
        b[:] = i + 1
    assert all((b == i + 1).all() for i, b in enumerate(bufs))  # none overwrote another
    assert len({id(_mapping(b)) for b in bufs}) == 1


def test_a_mapping_holds_at_most_carve_bytes_and_lives_until_its_last_buffer():
    cap = hostmem.CARVE_BYTES
    sizes = [cap // 2, cap // 2, 1, cap + 1, 10]
    bufs = hostmem.carve(sizes)
    maps = [_mapping(b) for b in bufs]
    assert maps[0] is maps[1] and maps[2] is not maps[1]  # the third did not fit
    assert maps[3] is not maps[2] and maps[4] is not maps[3]  # too big to share one
    assert len(maps[0]) <= cap and len(maps[2]) <= cap
    first = weakref.ref(maps[0])
    del maps
    keep = bufs[1]
    del bufs
    gc.collect()
    assert first() is not None  # one of its buffers is alive
    keep[:] = 7
    del keep
    gc.collect()
    assert first() is None  # freed with its last buffer
