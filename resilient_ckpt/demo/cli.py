"""The demos' entry point: `python -m resilient_ckpt.demo [--elastic | --hosts 2] ...`.

This module owns the choice between the demos (`--elastic` picks the
in-process recovery demo of `elastic_demo`; `--hosts 2` the relaunch demo of
`hosts_demo`, whose workers are this same command with `--hosts-worker`;
otherwise the crash-and-resume demo of `crash`, whose children are this same
command with `--phase`) and the one change to the environment they need: 8
host devices (4 per worker of `--hosts`, which the supervisor sets), asked for
in `main` before the chosen demo is imported and before any device is used.
"""
from __future__ import annotations

import sys

from .options import want_host_devices


def main(argv: list[str] | None = None) -> int:
    """Runs the demo named by `argv` (default: the command line); returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    want_host_devices(8)
    if "--hosts" in argv or "--hosts-worker" in argv:  # relaunch: demo/hosts_demo.py
        from . import hosts_demo
        return hosts_demo.main(argv)
    if "--elastic" in argv:  # the in-process recovery demo: resilient_ckpt/demo/elastic_demo.py
        from . import elastic_demo
        return elastic_demo.main([x for x in argv if x != "--elastic"])
    from . import crash
    return crash.main(argv)
