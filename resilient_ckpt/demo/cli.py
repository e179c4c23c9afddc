"""The demos' entry point: `python -m resilient_ckpt.demo [--elastic] ...`.

This module owns the choice between the two demos (`--elastic` picks the
in-process recovery demo of `elastic_demo`; otherwise the crash-and-resume
demo of `crash`, whose children are this same command with `--phase`) and the
one change to the environment they need: 8 host devices, asked for in `main`
before the chosen demo is imported and before any device is used.
"""
from __future__ import annotations

import sys

from .options import want_host_devices


def main(argv: list[str] | None = None) -> int:
    """Runs the demo named by `argv` (default: the command line); returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    want_host_devices(8)
    if "--elastic" in argv:  # the in-process recovery demo: resilient_ckpt/demo/elastic_demo.py
        from . import elastic_demo
        return elastic_demo.main([x for x in argv if x != "--elastic"])
    from . import crash
    return crash.main(argv)
