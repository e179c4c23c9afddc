"""Work the background threads do on big buffers runs without the GIL:
crc32c's checksums (the same values as google_crc32c) and hostmem's
populating of fresh memory. Held, they stopped the training thread."""
from __future__ import annotations

import mmap
import sys
import threading
import time

import google_crc32c
import numpy as np
import pytest

from resilient_ckpt.native import crc32c, hostmem


@pytest.mark.parametrize("n", [0, 1, 9, 64 * 1024 - 1, 64 * 1024, 300_001, 2**22 + 3])
def test_values_match_google_crc32c_for_every_kind_of_buffer(n):
    raw = np.random.default_rng(n).integers(0, 256, n + 7, dtype=np.uint8)
    for buf in (raw[:n], raw[7:7 + n], bytes(raw[:n]), memoryview(raw[3:3 + n]),
                raw[:n].view(np.uint8)):
        assert crc32c.value(buf) == google_crc32c.value(bytes(buf))
        assert crc32c.extend(0xDEADBEEF, buf) == google_crc32c.extend(0xDEADBEEF, bytes(buf))
    wide = raw[: n - n % 4].view(np.float32)  # not bytes: the same memory
    assert crc32c.value(wide) == google_crc32c.value(wide.tobytes())
    with pytest.raises(ValueError):  # not contiguous: refused, as google_crc32c refuses it
        crc32c.value(raw[::2])


def _ticks_inside(fn, *args) -> int:
    """How often this thread ran in the middle half of another thread's
    fn(*args) call. A call that holds the GIL lets it run only in the GIL
    switch intervals at the call's two ends, which the margins exclude: the
    count does not depend on how loaded the machine is, as an iteration
    count would."""
    started = threading.Event()
    span: list[float] = []

    def work() -> None:
        started.set()
        span.append(time.perf_counter())
        fn(*args)
        span.append(time.perf_counter())
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        t = threading.Thread(target=work)
        t.start()
        started.wait()
        ticks = []
        while t.is_alive():
            ticks.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(interval)
    begin, end = span
    margin = (end - begin) / 4
    assert margin > 0.002, f"the call took {end - begin:.4f} s: too short to tell"
    return sum(begin + margin < x < end - margin for x in ticks)


def test_a_large_checksum_lets_other_threads_run():
    assert crc32c.releases_gil(), "google_crc32c's wheel should ship its C library"
    big = np.ones(256 * 2**20, np.uint8)
    assert _ticks_inside(google_crc32c.value, big) == 0  # the control: holds the GIL
    assert _ticks_inside(crc32c.value, big) > 0


def test_populating_fresh_host_memory_lets_other_threads_run():
    n = 256 * 2**20
    fresh = mmap.mmap(-1, n)
    try:  # the control: mmap's own madvise holds the GIL (munmap, left out, does not)
        assert _ticks_inside(fresh.madvise, 23) == 0  # MADV_POPULATE_WRITE
    except OSError:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    finally:
        fresh.close()
    kept = []
    assert _ticks_inside(lambda: kept.append(hostmem.host_mmap(n))) > 0
    kept[0].close()
