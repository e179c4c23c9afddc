"""Helpers every bench script shares: options, sizes, JSON lines, state helpers.

Bench scripts run as `python bench/NAME.py`, so this directory is on their
path and `from _common import ...` finds this file; run_all.py skips it (and
every `_*.py`). The output contract these helpers implement is
docs/bench_contract.md. Nothing here imports jax at module level: `prepare`
must run before jax is imported, and bench/recovery.py times jax's import in a
child process.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from decimal import Decimal

PRINTED: list[dict] = []  # every line printed so far, for --plot

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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


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


def _repeats_option(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--repeats takes a whole number, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--repeats must be at least 1, not {n}")
    return n


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
    p.add_argument("--repeats", type=_repeats_option, default=None,
                   help=f"repeats of each case (default {repeats}; --quick {quick_repeats})")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="also draw the medians into this PNG (needs matplotlib: the "
                        "[bench] extra)" if plots else
                   "ignored: this bench draws no plot (run_all.py passes it)")
    p.set_defaults(_defaults=(sizes, quick_sizes, repeats, quick_repeats, plots))
    return p


def parse_options(p: argparse.ArgumentParser, argv: list[str] | None = None
                  ) -> argparse.Namespace:
    """Parses `argv` and resolves --quick: `sizes` (bytes, a list) and
    `repeats` (an int) are the command line's, else --quick's, else the full
    run's defaults; ignored options are warned about and set to None."""
    a = p.parse_args(argv)
    sizes, quick_sizes, repeats, quick_repeats, plots = a._defaults
    del a._defaults
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


# ---------------------------------------------------------------- output

def emit(obj: dict) -> None:
    """One JSON line on stdout (docs/bench_contract.md), kept for --plot."""
    PRINTED.append(obj)
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def goals_met(summary: dict, goals: dict[str, tuple[str, float]]) -> dict[str, bool | None]:
    """Per summary key that a goal names (the goal's key alone, or it, "_" and
    a size label such as 1gb): True or False, or None where not measured.
    `goals` maps a key to (">=" or "<=", the goal)."""
    out: dict[str, bool | None] = {}
    for key, value in summary.items():
        for prefix, (op, goal) in goals.items():
            rest = key[len(prefix):]
            if key.startswith(prefix) and (rest == "" or (rest[0] == "_"
                                                          and "_" not in rest[1:])):
                out[key] = None if value is None else (
                    value >= goal if op == ">=" else value <= goal)
    return out


def emit_summary(bench: str, summary: dict,
                 goals: dict[str, tuple[str, float]] | None = None,
                 plot: str | None = None) -> None:
    """A script's last line: its summary, and with `goals` which were met.
    With `plot` (a PNG path, from --plot), then draws every line printed."""
    line: dict = {"bench": bench, "summary": summary}
    if goals:
        line["goals_met"] = goals_met(summary, goals)
        line["goals"] = {k: f"{op} {g}" for k, (op, g) in goals.items()}
    emit(line)
    if plot:
        from _plot import plot as draw  # _plot imports this module
        draw(PRINTED, plot)


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of an earlier run, saved from a script's stdout."""
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip().startswith("{")]


# ---------------------------------------------------------------- state and memory

def files_under(d: str) -> list[str]:
    out = []
    for root, _, names in os.walk(d):
        out.extend(os.path.join(root, n) for n in sorted(names))
    return out


def read_through(paths: list[str], buf=None) -> int:
    """Reads every file sequentially into one reused buffer, so the page cache
    holds them (a warm restore); returns bytes read."""
    import numpy as np
    if buf is None:
        buf = np.empty(16 << 20, np.uint8)
    mv, total = memoryview(buf), 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while True:
                n = os.readv(fd, [mv])
                if n == 0:
                    break
                total += n
        finally:
            os.close(fd)
    return total


def make_mesh(data: int, model: int):
    """A (data, model) mesh over the first data * model devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    devices = np.array(jax.devices()[:data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def abstract_of(tree):
    """A restore target: a ShapeDtypeStruct with the sharding of each array."""
    import jax
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def same_values(a_tree, b_tree) -> bool:
    """Shard-by-shard equality and equivalent shardings (numpy, no jit)."""
    import jax
    import numpy as np
    a_leaves, b_leaves = jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)
    if len(a_leaves) != len(b_leaves):
        return False
    for a, b in zip(a_leaves, b_leaves, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or not a.sharding.is_equivalent_to(
                b.sharding, a.ndim):
            return False
        bs = {s.device: s for s in b.addressable_shards}
        for s in a.addressable_shards:
            if not np.array_equal(np.asarray(s.data), np.asarray(bs[s.device].data)):
                return False
    return True


def proc_kb(path: str, field: str) -> int:
    """A "Field: N kB" value of a /proc file (/proc/meminfo, /proc/self/status)."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """This process's peak resident memory above its level at entry, over a
    `with` block: the kernel's high-water mark (VmHWM) is reset on entry
    (writing 5 to /proc/self/clear_refs, Linux 4.0+) and read at exit. Pages
    the block maps count (a RAM-tier restore's mapped files, as in
    bench/reshard.py's figures); the page cache does not. `extra` is the bytes
    above the entry level, or None where the kernel refuses the reset."""

    extra: int | None = None

    def __enter__(self) -> PeakRss:
        self.base = proc_kb("/proc/self/status", "VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        return self

    def __exit__(self, *exc) -> None:
        if self.reset:
            self.extra = max(0, proc_kb("/proc/self/status", "VmHWM") - self.base) * 1024


def worst_peak(peaks: list, nbytes: int) -> dict:
    """A line's peak fields from its runs' PeakRss.extra values: the worst
    run's bytes and their fraction of the state's `nbytes`, both None where
    no run could be measured (docs/bench_contract.md)."""
    known = [p for p in peaks if p is not None]
    worst = max(known) if known else None
    return {"peak_extra_bytes": worst,
            "peak_extra_vs_state": round(worst / nbytes, 3) if known else None}


BUDGET_EXTRA = 256 * 2**20  # memory a save or restore may use beyond the state (issue #14)


def peaks_vs_budget(peaks: dict[tuple[str, str], int], nbytes: int, label: str
                    ) -> dict[str, float]:
    """Each system's worst peak memory over its cases named save* and over
    those named restore*, as a fraction of the state + BUDGET_EXTRA (<= 1
    keeps the promise): `peak_save_vs_budget_<label>` for resilient_ckpt,
    `orbax_peak_save_vs_budget_<label>` for Orbax, the same for restore."""
    out = {}
    for system, name in (("resilient_ckpt", ""), ("orbax", "orbax_")):
        for kind in ("save", "restore"):
            got = [v for (s, c), v in peaks.items() if s == system and c.startswith(kind)]
            if got:
                out[f"{name}peak_{kind}_vs_budget_{label}"] = round(
                    max(got) / (nbytes + BUDGET_EXTRA), 3)
    return out


def trim() -> None:
    """Garbage-collects and gives glibc's freed heap back (docs/environment.md:
    without it a process grows about 0.7 GB per save+restore of 1 GB)."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to give back this way
        pass


SETTLE_S = 3.0


def settle(seconds: float = SETTLE_S) -> None:
    """`trim`, then a wait, so that a timed case does not start while what the
    case before left behind is still running: another system's background
    threads, the kernel's writeback and reclaim. It does not wait for the VM
    to take freed memory back: 1 GB faulted in 0.64-0.81 s whether 4 GB had
    been unmapped 0.2 s or 30 s before (docs/benchmarks.md, Dec 3 16:41)."""
    trim()
    time.sleep(seconds)


if __name__ == "__main__":
    print(__doc__)
