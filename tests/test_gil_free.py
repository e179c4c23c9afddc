"""Work the background threads do on big buffers runs without the GIL:
crc32c's checksums (the same values as google_crc32c) and hostmem's
populating of fresh memory. Held, they stopped the training thread."""
from __future__ import annotations

import mmap
import threading

import google_crc32c
import numpy as np
import pytest

from resilient_ckpt import crc32c, hostmem


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


def _iterations_while(fn, *args) -> int:
    """How often this thread runs a loop while another runs fn(*args)."""
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        fn(*args)
        done.set()
    t = threading.Thread(target=work)
    t.start()
    started.wait()
    n = 0
    while not done.is_set():
        n += 1
    t.join()
    return n


def test_a_large_checksum_lets_other_threads_run():
    assert crc32c.releases_gil(), "google_crc32c's wheel should ship its C library"
    big = np.ones(256 * 2**20, np.uint8)
    ours = _iterations_while(crc32c.value, big)
    held = _iterations_while(google_crc32c.value, big)  # the control: holds the GIL
    # Held, this thread runs only around the call; released, all through it.
    assert ours > 2 * held, (ours, held)


def test_populating_fresh_host_memory_lets_other_threads_run():
    n = 256 * 2**20
    ours = _iterations_while(lambda: hostmem.host_mmap(n).close())

    def held() -> None:  # the control: mmap's own madvise holds the GIL
        m = mmap.mmap(-1, n)
        try:
            m.madvise(23)  # MADV_POPULATE_WRITE
        except OSError:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        finally:
            m.close()
    assert ours > 2 * _iterations_while(held)
