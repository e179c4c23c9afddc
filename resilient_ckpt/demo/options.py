"""What both demos share at start-up: common arguments and the host devices.

This module owns the command-line arguments the two demos have in common
(`--dir`, `--mb`, `--steps`) and `want_host_devices`, which the entry point
calls before the jax backend starts, so that the CPU backend has 8 devices.
Importing it changes nothing.
"""
from __future__ import annotations

import argparse
import os

_FLAG = "xla_force_host_platform_device_count"


def want_host_devices(n: int = 8) -> None:
    """Asks XLA for `n` host (CPU) devices, unless XLA_FLAGS already sets a
    count. XLA reads the flag when the backend starts (first device use), so
    this works after jax is imported, as long as no device was used yet."""
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --{_FLAG}={n}").strip()


def parser(prog: str, description: str | None) -> argparse.ArgumentParser:
    """An argument parser showing `description` as written."""
    return argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_run_args(p: argparse.ArgumentParser, mb: float, steps: int) -> None:
    """`--dir`, `--mb` (default `mb`) and `--steps` (default `steps`)."""
    p.add_argument("--dir", help="checkpoint directory (default: a fresh temporary one, "
                                 "removed at the end with its RAM tier)")
    p.add_argument("--mb", type=float, default=mb, help=f"state size in MiB (default {mb:g})")
    p.add_argument("--steps", type=int, default=steps,
                   help=f"training steps (default {steps})")
