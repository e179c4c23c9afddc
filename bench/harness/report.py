"""What a bench prints (docs/bench_contract.md): JSON lines, the summary and
its goals, peak-memory fields, and the reader of an earlier run's lines."""
from __future__ import annotations

import json
import statistics
import sys

PRINTED: list[dict] = []  # every line printed so far, for --plot

BUDGET_EXTRA = 256 * 2**20  # memory a save or restore may use beyond the state (issue #14)


def emit(obj: dict) -> None:
    """One JSON line on stdout (docs/bench_contract.md), kept for --plot."""
    PRINTED.append(obj)
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def median(xs) -> float | None:
    """The median of `xs`, None where there is none."""
    xs = list(xs)
    return statistics.median(xs) if xs else None


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
        from .plot import plot as draw
        draw(PRINTED, plot)


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of an earlier run, saved from a script's stdout."""
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip().startswith("{")]


# ---------------------------------------------------------------- peak memory

def worst_peak(peaks: list, nbytes: int) -> dict:
    """A line's peak fields from its runs' PeakRss.extra values: the worst
    run's bytes and their fraction of the state's `nbytes`, both None where
    no run could be measured (docs/bench_contract.md)."""
    known = [p for p in peaks if p is not None]
    worst = max(known) if known else None
    return {"peak_extra_bytes": worst,
            "peak_extra_vs_state": round(worst / nbytes, 3) if known else None}


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
