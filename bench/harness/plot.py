"""Plots of bench output: rows (the JSON lines a bench printed) in, a PNG out.

save_restore: per size, the median seconds of every save case and every
restore case, coloured by system; gcs: the median seconds of every case, per
dtype and size; recovery: per size, each case's median recovery time split
into its phases. The scaling plot (save_restore lines of several sizes, from
one run or several concatenated): seconds against state size on log-log axes,
ours and Orbax's save and restore cases, with a line of slope 1 (time
growing linearly with the bytes) for reference. Scripts' --plot calls `plot`
on the lines they printed (report.emit_summary); bench/_plot.py draws the
saved lines of an earlier run. Needs matplotlib (not a dependency of the
package: it comes with the [bench] extra, `pip install -e '.[bench]'`);
without it `plot` warns and draws nothing. This module reads no files and
imports nothing of the harness.
"""
from __future__ import annotations

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
RECOVERY_CASES = ("loop", "loop_jit", "relaunch", "relaunch_compile_cache")
PHASE_COLORS = {"spawn_s": "#ff7f0e", "detect_s": "#999999", "health_s": "#8c564b",
                "rebuild_s": "#bcbd22", "restore_s": "#1f77b4", "resume_s": "#2ca02c",
                "import_s": "#d62728", "mesh_s": "#999999", "first_step_s": "#2ca02c"}


def _medians(ax, rows: list[dict], labels: list[str]) -> None:
    """One bar per line: its median seconds, whiskers from its fastest to its
    slowest run, the median written beside it."""
    med = [ln["median_s"] for ln in rows]
    lo = [m - min(ln["runs_s"]) for m, ln in zip(med, rows, strict=True)]
    hi = [max(ln["runs_s"]) - m for m, ln in zip(med, rows, strict=True)]
    ax.barh(range(len(rows)), med, xerr=[lo, hi], capsize=2,
            color=[COLORS.get(ln["system"], "k") for ln in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, (m, h) in enumerate(zip(med, hi, strict=True)):
        ax.text(m + h, i, f"  {m:.2f}s", va="center", fontsize=7)
    ax.set_xlabel("seconds (median, whiskers: min-max)")


def _save(plt, fig, out: str, title: str | None = None) -> None:
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_save_restore(plt, lines: list[dict], out: str) -> None:
    rows = [ln for ln in lines if "case" in ln]
    sizes = list(dict.fromkeys(ln["size"] for ln in rows))
    fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 3.6 * len(sizes)), squeeze=False)
    for r, size in enumerate(sizes):
        by = {(ln["system"], ln["case"]): ln for ln in rows if ln["size"] == size}
        nbytes = next(iter(by.values()))["bytes"]
        for c, (title, cases) in enumerate((("save", SAVE), ("restore", RESTORE))):
            ax = axes[r][c]
            present = [k for k in cases if k in by]
            _medians(ax, [by[k] for k in present], [f"{s}: {case}" for s, case in present])
            ax.set_xlim(0, max(max(by[k]["runs_s"]) for k in present) * 1.15
                        if present else 1)
            ax.set_title(f"{title}, {nbytes / 1e9:.2f} GB state, 8 CPU devices", fontsize=10)
    _save(plt, fig, out, "bench/save_restore.py: resilient_ckpt vs orbax vs the machine's "
          "limits (lower is better)")


def plot_gcs(plt, lines: list[dict], out: str) -> None:
    rows = [ln for ln in lines if ln.get("runs_s")]  # the zstd limit has no times
    panels = list(dict.fromkeys((ln["dtype"], ln["bytes"]) for ln in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (dtype, nbytes) in zip(axes[0], panels, strict=True):
        here = [ln for ln in rows if (ln["dtype"], ln["bytes"]) == (dtype, nbytes)]
        _medians(ax, here, [f"{ln['system']}: {ln['case']}" for ln in here])
        ax.set_title(f"{nbytes / 1e9:.2f} GB of {dtype}, through fake-gcs-server", fontsize=10)
    _save(plt, fig, out, "bench/gcs.py: resilient_ckpt's GCS tier vs orbax vs plain requests "
          "(limit; lower is better)")


def plot_recovery(plt, lines: list[dict], out: str) -> None:
    rows = [ln for ln in lines if ln.get("case") in RECOVERY_CASES]
    sizes = list(dict.fromkeys(ln["size"] for ln in rows))
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 2.8 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes, strict=True):
        cases = [ln for ln in rows if ln["size"] == size]
        for y, ln in enumerate(cases):
            left = 0.0
            for k, v in ln["phases_median_s"].items():
                ax.barh(y, v or 0.0, left=left, color=PHASE_COLORS.get(k, "#cccccc"),
                        label=k[:-2] if y == 0 or ln["system"] == "orbax" else None)
                left += v or 0.0
            ax.text(ln["median_s"], y, f" {ln['median_s']:.2f} s (median total)", va="center")
        ax.set_yticks(range(len(cases)), [f"{ln['system']}\n{ln['case']}" for ln in cases])
        ax.set_xlabel("seconds from the failure to the next completed step")
        ax.set_title(f"recovery, {size} state, 8 -> 4 CPU devices (phases: medians)")
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles, strict=True))
        ax.legend(uniq.values(), uniq.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8)
        ax.set_xlim(0, max(ln["median_s"] for ln in cases) * 1.35)
    _save(plt, fig, out)


SCALING = [("resilient_ckpt", "save_blocking"), ("orbax", "save_blocking"),
           ("resilient_ckpt", "save_total"), ("orbax", "save_total"),
           ("resilient_ckpt", "restore_ram"), ("resilient_ckpt", "restore_local_warm"),
           ("orbax", "restore_local_warm"), ("resilient_ckpt", "restore_local_cold"),
           ("orbax", "restore_local_cold")]


def plot_scaling(plt, lines: list[dict], out: str) -> None:
    rows = [ln for ln in lines if ln.get("bench") == "save_restore" and "case" in ln]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, kind in zip(axes, ("save", "restore"), strict=True):
        for system, case in [k for k in SCALING if k[1].startswith(kind)]:
            pts = sorted((ln["bytes"] / 1e9, ln["median_s"]) for ln in rows
                         if (ln["system"], ln["case"]) == (system, case))
            if len(pts) < 2:
                continue
            style = "-" if system == "resilient_ckpt" else "--"
            ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{system}: {case}")
        xs = sorted({ln["bytes"] / 1e9 for ln in rows})
        if xs:
            ax.plot(xs, [x / xs[0] * 0.1 for x in xs], ":", color="#888888",
                    label="slope 1 (linear), for reference")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size, GB (8 CPU devices)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(kind, fontsize=10)
        ax.legend(fontsize=7)
    _save(plt, fig, out, "bench/save_restore.py: time against state size (lower is better)")


PLOTS = {"save_restore": plot_save_restore, "gcs": plot_gcs, "recovery": plot_recovery}


def plot(lines: list[dict], out: str, scaling: bool = False) -> bool:
    """Draws the lines of one bench into the PNG `out` (`scaling`: the
    save_restore scaling plot); False, with a warning on stderr, where there
    is no plot for that bench or no matplotlib."""
    bench = next((ln["bench"] for ln in lines if "bench" in ln), None)
    draw = plot_scaling if scaling else PLOTS.get(bench)
    if draw is None:
        sys.stderr.write(f"no plot: none is drawn for bench {bench!r}\n")
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("no plot: matplotlib is not installed (pip install -e '.[bench]')\n")
        return False
    draw(plt, lines, out)
    return True

