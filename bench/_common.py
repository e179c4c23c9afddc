"""Helpers every bench script shares: sizes, JSON-line output, memory trim.

Bench scripts run as `python bench/NAME.py`, so this directory is on their
path and `from _common import ...` finds this file; run_all.py skips it.
"""
from __future__ import annotations

import gc
import json
import sys

PRINTED: list[dict] = []  # every line printed so far, for --plot


def parse_size(s: str) -> int:
    """'1GB', '512MB', '4e9' -> bytes (decimal units)."""
    s = s.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * mult)
    return int(float(s))


def size_label(n: int) -> str:
    """A size as it appears in summary keys: 1gb, 1p5gb, 128mb."""
    if n >= 10**9 and n % 10**9 == 0:
        return f"{n // 10**9}gb"
    if n >= 10**9:
        return f"{n / 10**9:g}gb".replace(".", "p")
    return f"{round(n / 10**6)}mb"


def emit(obj: dict) -> None:
    """One JSON line on stdout (../shared/BENCH.md), kept for --plot."""
    PRINTED.append(obj)
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def trim() -> None:
    """Garbage-collects and gives glibc's freed heap back (ENVIRONMENT.md:
    without it a process grows about 0.7 GB per save+restore of 1 GB)."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to give back this way
        pass
