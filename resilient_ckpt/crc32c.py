"""CRC32C of buffers, computed without holding the GIL.

`google_crc32c.value` holds the GIL while it runs (two threads checksumming
two buffers here took longer than one thread doing both), so a save's
background checksums stalled the training thread and a restore's read pool
checksummed on one core. The same C library ships inside the google_crc32c
wheel; called through ctypes, which drops the GIL for the call, checksums on
several threads run side by side. Small buffers and installs without that
library use google_crc32c itself (same values; a buffer that is not
contiguous is refused by it, as before).
"""
from __future__ import annotations

import ctypes
import glob
import os
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
