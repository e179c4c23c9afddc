"""Set-up, sizes and the options every bench script takes (docs/bench_contract.md)."""
from __future__ import annotations

import argparse
import os
import re
import sys
from decimal import Decimal

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)  # the checkout

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"(?P<num>(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*(?P<unit>[kmgt]i?)?b?")


# ---------------------------------------------------------------- set-up

def prepare(devices: int = 8) -> None:
    """Call before jax or resilient_ckpt is imported: `devices` CPU devices
    (XLA_FLAGS, unless it already sets a device count), the CPU platform
    (unless JAX_PLATFORMS is set), and this checkout first on sys.path, so
    that a bench measures the tree it sits in."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


# ---------------------------------------------------------------- sizes

def parse_size(text: str) -> int:
    """One size in bytes: '256MB', '1GB', '1.5GB', '4e9', '1000000'. KB, MB,
    GB and TB are decimal (10**3 ...), KiB, MiB, GiB and TiB binary; case and
    the trailing B are optional. Raises ValueError for anything else."""
    m = _SIZE.fullmatch(text.strip().lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (write e.g. 256MB, 1GB, 1.5GB or 1000000)")
    n = (Decimal(m["num"]) * _UNITS[m["unit"] or ""]).to_integral_value()
    if n < 1:
        raise ValueError(f"size {text!r} is less than one byte")
    return int(n)


def parse_sizes(text: str) -> list[int]:
    """Sizes separated by commas or spaces ('1GB,4GB', '256MB 1.5GB',
    '1 GB, 4 GB'), in bytes and in order; see `parse_size`."""
    joined = re.sub(r"(?<=[\d.])\s+(?=[a-zA-Z])", "", text)  # '1 GB' is one size
    tokens = [t for t in re.split(r"[,\s]+", joined) if t]
    if not tokens:
        raise ValueError("no size given (write e.g. 1GB or 256MB,1GB)")
    return [parse_size(t) for t in tokens]


def size_label(n: int) -> str:
    """A size as it appears in summary keys: 1gb, 1p5gb, 128mb."""
    if n >= 10**9 and n % 10**9 == 0:
        return f"{n // 10**9}gb"
    if n >= 10**9:
        return f"{n / 10**9:g}gb".replace(".", "p")
    return f"{round(n / 10**6)}mb"


def _sizes_option(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_option(text: str) -> int:
    """`parse_size` as an argparse type (a bad size is a usage error)."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def at_least(low: int):
    """An argparse type: a whole number of at least `low` (else a usage error
    that argparse prefixes with the option's name)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {n}")
        return n
    return parse


# ---------------------------------------------------------------- options

def bench_parser(doc: str, *, sizes: str | None, quick_sizes: str | None = None,
                 repeats: int = 3, quick_repeats: int = 2, plots: bool = False,
                 quick_help: str | None = None) -> argparse.ArgumentParser:
    """A parser with the options every bench script takes: --quick, --sizes,
    --repeats and --plot (docs/bench_contract.md); read it with `parse_options`.

    `sizes` and `repeats` are a full run's defaults, `quick_sizes` and
    `quick_repeats` those of --quick; what the command line gives wins over
    both. A script that takes no state sizes (sizes=None) or draws no plot
    (plots=False) still accepts the option, since run_all.py passes the same
    options to every script, and ignores it with a warning."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Prints one JSON object per line on stdout, the summary last; logs go\n"
               "to stderr (docs/bench_contract.md).")
    quick = quick_help or f"{quick_sizes}, {quick_repeats} repeats"
    p.add_argument("--quick", action="store_true",
                   help=f"a check in under two minutes: {quick}; options given "
                        "explicitly still win")
    p.add_argument("--sizes", type=_sizes_option, default=None, metavar="SIZES",
                   help=f"state sizes, commas or spaces between, e.g. 256MB,1.5GB,4e9 "
                        f"(default {sizes})" if sizes else
                   "ignored: this bench takes no state sizes (run_all.py passes it)")
    p.add_argument("--repeats", type=at_least(1), default=None,
                   help=f"repeats of each case (default {repeats}; --quick {quick_repeats})")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw the medians into this PNG (needs matplotlib: the "
                        "[bench] extra)" if plots else
                   "ignored: this bench draws no plot (run_all.py passes it)")
    p.set_defaults(bench_defaults=(sizes, quick_sizes, repeats, quick_repeats, plots))
    return p


def parse_options(p: argparse.ArgumentParser, argv: list[str] | None = None
                  ) -> argparse.Namespace:
    """Parses `argv` and resolves --quick: `sizes` (bytes, a list) and
    `repeats` (an int) are the command line's, else --quick's, else the full
    run's defaults; ignored options are warned about and set to None."""
    a = p.parse_args(argv)
    sizes, quick_sizes, repeats, quick_repeats, plots = a.bench_defaults
    del a.bench_defaults
    if sizes is None:
        if a.sizes is not None:
            sys.stderr.write(f"{p.prog}: --sizes ignored: this bench takes no state sizes\n")
        a.sizes = None
    elif a.sizes is None:
        a.sizes = parse_sizes(quick_sizes if a.quick else sizes)
    a.repeats = a.repeats or (quick_repeats if a.quick else repeats)
    if a.plot and not plots:
        sys.stderr.write(f"{p.prog}: --plot ignored: this bench draws no plot\n")
        a.plot = None
    return a

