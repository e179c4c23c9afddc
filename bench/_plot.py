"""Plots of bench output (a helper: bench/run_all.py skips files named _*).

    python bench/_plot.py results.jsonl docs/benchmarks_save_restore.png

reads the JSON lines a bench script printed and draws, per size, the median
seconds of every save case and every restore case, coloured by system.
Needs matplotlib (not a dependency of the project: `pip install matplotlib`).
"""
from __future__ import annotations

import json
import sys

COLORS = {"limit": "#888888", "resilient_ckpt": "#1f77b4", "orbax": "#ff7f0e"}
SAVE = [("limit", "host_copy"), ("limit", "host_copy_pretouched"),
        ("resilient_ckpt", "save_blocking"), ("orbax", "save_blocking"),
        ("limit", "disk_write_fsync"), ("resilient_ckpt", "save_tier_ram"),
        ("resilient_ckpt", "save_tier_local"), ("resilient_ckpt", "save_total"),
        ("orbax", "save_total")]
RESTORE = [("limit", "read_warm"), ("resilient_ckpt", "restore_ram"),
           ("resilient_ckpt", "restore_local_warm"), ("orbax", "restore_local_warm"),
           ("limit", "read_cold"), ("limit", "read_cold_4threads"),
           ("limit", "read_cold_fresh_memory"),
           ("resilient_ckpt", "restore_local_cold"), ("orbax", "restore_local_cold")]


def plot_save_restore(lines: list[dict], summary: dict | None, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [ln for ln in lines if "case" in ln]
    sizes = list(dict.fromkeys(ln["size"] for ln in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 3.6 * len(sizes)), squeeze=False)
    for r, size in enumerate(sizes):
        by = {(ln["system"], ln["case"]): ln for ln in rows if ln["size"] == size}
        nbytes = next(iter(by.values()))["bytes"]
        for c, (title, cases) in enumerate((("save", SAVE), ("restore", RESTORE))):
            ax = axes[r][c]
            present = [k for k in cases if k in by]
            labels = [f"{s}: {case}" for s, case in present]
            med = [by[k]["median_s"] for k in present]
            lo = [m - min(by[k]["runs_s"]) for m, k in zip(med, present)]
            hi = [max(by[k]["runs_s"]) - m for m, k in zip(med, present)]
            ax.barh(range(len(present)), med, xerr=[lo, hi],
                    color=[COLORS.get(s, "k") for s, _ in present], capsize=2)
            ax.set_yticks(range(len(present)), labels, fontsize=8)
            ax.invert_yaxis()
            for i, (m, h) in enumerate(zip(med, hi)):
                ax.text(m + h, i, f"  {m:.2f}s", va="center", fontsize=7)
            ax.set_xlim(0, max(m + h for m, h in zip(med, hi)) * 1.15 if med else 1)
            ax.set_xlabel("seconds (median, whiskers: min-max)")
            ax.set_title(f"{title}, {nbytes / 1e9:.2f} GB state, 8 CPU devices", fontsize=10)
    fig.suptitle("bench/save_restore.py: resilient_ckpt vs orbax vs the machine's limits "
                 "(lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    with open(argv[0]) as f:
        lines = [json.loads(x) for x in f if x.strip().startswith("{")]
    summary = next((ln for ln in reversed(lines) if "summary" in ln), None)
    if lines and lines[0].get("bench") == "save_restore":
        plot_save_restore(lines, summary, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
