"""Resharded restore: onto 4 and onto 6 devices, against same-sharding and Orbax.

A train-state-like pytree saved on 8 CPU devices (mesh data=4 x model=2) is
restored, interleaved within each repeat:
- resilient_ckpt from the RAM tier and from the local tier (warm page cache:
  the step's files are read through before each local case, since our
  restores read uncached files past the cache and leave it cold):
  onto the saved sharding ("same"), and onto a (2, 2) and a (3, 2) mesh;
- orbax: its resharded restore of the same state from local disk (warm).
Each timed restore starts after `harness.measure.settle` (3 s for what the case
before left running to finish), so no case runs in the wake of another.
Peak host memory of each case is measured apart, in a fresh process per case
(VmHWM minus the resident set just before the restore), so that memory kept by
allocators from earlier runs hides nothing: the promise "state plus the
restore memory budget" can be read off directly.

    python bench/reshard.py            # 1 GB and 4 GB, 3 repeats
    python bench/reshard.py --quick    # 96 MB, 2 repeats
    python bench/reshard.py --sizes 1GB --repeats 5

Output (docs/bench_contract.md): one JSON line per (system, case, size), then
a summary line with the ratios; logs go to stderr.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from harness.options import bench_parser, parse_options, prepare, size_label

prepare(devices=8)

import jax  # noqa: E402
from harness.measure import files_under, read_through, settle  # noqa: E402
from harness.report import emit, emit_summary, worst_peak  # noqa: E402
from harness.state import abstract_of, build_state, make_mesh, tree_bytes  # noqa: E402
from harness.systems import Orbax, Ours  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from resilient_ckpt import LocalTier, RamTier  # noqa: E402

log = logging.getLogger("bench.reshard")
BENCH = "reshard"
SPEC = P("data", "model")


def measured(fn) -> float:
    """Seconds of fn() until its result is ready, the result dropped; it starts
    settled (harness.measure.settle), so no case runs in the wake of the one before."""
    settle()
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    del out
    gc.collect()
    return dt


def peak_in_fresh_process(system: str, tier: str, target: str, ours_dir: str, ram: str,
                          orbax_dir: str) -> int | None:
    cmd = [sys.executable, __file__, "--peak", f"{system},{tier},{target}",
           "--dirs", f"{ours_dir},{ram},{orbax_dir}"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_extra_bytes"]  # None: not measurable


def peak_child(case: str, dirs: str) -> int:
    """Runs one restore in this (fresh) process and prints its peak memory."""
    system, tier, target = case.split(",")
    ours_dir, ram, orbax_dir = dirs.split(",")
    meshes = {"same": make_mesh(4, 2), "onto4": make_mesh(2, 2), "onto6": make_mesh(3, 2)}
    with Ours(ours_dir, cleanup_tmp_directories=False, read_only=True) as m:
        abstract = abstract_of(m.mngr.item_metadata(1), meshes[target], SPEC)
    if system == "orbax":
        sut = Orbax(orbax_dir)
    else:
        sut = Ours(ours_dir, [RamTier(path=ram)] if tier == "ram" else [],
                   cleanup_tmp_directories=False, read_only=True)
    for _ in range(2):
        gc.collect()
    peak = sut.restore(1, abstract, block=True)  # the restored state is alive at its end
    emit({"peak_extra_bytes": peak.peak})
    return 0


def run_size(total: int, repeats: int, mesh8, meshes: dict) -> dict:
    state = build_state("reshard", total, mesh8)
    size = tree_bytes(state)
    label = size_label(total)
    root = tempfile.mkdtemp(prefix="bench-reshard-")
    ram = tempfile.mkdtemp(prefix="bench-reshard-", dir="/dev/shm")
    ours_dir, orbax_dir = os.path.join(root, "ours"), os.path.join(root, "orbax")
    try:
        with Ours(ours_dir, [RamTier(path=ram), LocalTier()]) as m:
            m.save(1, state)
        with Orbax(orbax_dir) as om:
            om.save(1, state)
        targets = {"same": abstract_of(state, mesh8, SPEC),
                   **{name: abstract_of(state, mm, SPEC) for name, mm in meshes.items()}}
        del state
        gc.collect()
        ram_only = Ours(ours_dir, [RamTier(path=ram)], cleanup_tmp_directories=False)
        local_only = Ours(ours_dir, cleanup_tmp_directories=False)
        orbax = Orbax(orbax_dir)
        cases = []
        local_files = files_under(os.path.join(ours_dir, "1"))
        for tname, tgt in targets.items():
            for tier, sut in (("ram", ram_only), ("local", local_only)):
                cases.append(("resilient_ckpt", f"{tier}_{tname}",
                              lambda sut=sut, tgt=tgt: sut.restore(1, tgt).out))
            if tname != "same":
                cases.append(("orbax", f"local_{tname}",
                              lambda tgt=tgt: orbax.restore(1, tgt).out))
        for _, _, fn in cases:  # warm-up: page cache, compiled helpers
            measured(fn)
        runs = {(s, c): ([], []) for s, c, _ in cases}
        for _ in range(repeats):
            for s, c, fn in cases:
                if s == "resilient_ckpt" and c.startswith("local"):
                    # our restores read uncached chunk files past the page
                    # cache (O_DIRECT) and leave it as it was: warm it, as
                    # Orbax's buffered warm-up restore warmed its own files
                    read_through(local_files)
                dt = measured(fn)
                runs[(s, c)][0].append(dt)
                log.info("%s %s %s: %.3f s", label, s, c, dt)
        ram_only.close()
        local_only.close()
        orbax.close()
        for s, c, _ in cases:
            tier, tname = c.split("_")
            peak = peak_in_fresh_process(s, tier, tname, ours_dir, ram, orbax_dir)
            if peak is not None:
                runs[(s, c)][1].append(peak)
                log.info("%s %s %s: peak +%.0f MB in a fresh process", label, s, c, peak / 1e6)
        med = {}
        for (s, c), (ts, peaks) in runs.items():
            med[(s, c)] = statistics.median(ts)
            emit({"bench": BENCH, "system": s, "case": c, "bytes": size, "devices": 8,
                  "runs_s": [round(t, 4) for t in ts], "median_s": round(med[(s, c)], 4),
                  **worst_peak(peaks, size)})
        summary = {}
        for name in meshes:
            for tier in ("ram", "local"):
                summary[f"{tier}_{name}_vs_same_{label}"] = round(
                    med[("resilient_ckpt", f"{tier}_{name}")]
                    / med[("resilient_ckpt", f"{tier}_same")], 3)
            summary[f"restore_ram_{name}_speedup_vs_orbax_local_{label}"] = round(
                med[("orbax", f"local_{name}")] / med[("resilient_ckpt", f"ram_{name}")], 2)
            summary[f"restore_local_{name}_speedup_vs_orbax_local_{label}"] = round(
                med[("orbax", f"local_{name}")] / med[("resilient_ckpt", f"local_{name}")], 2)
        return summary
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)


def main(argv=None) -> int:
    ap = bench_parser(__doc__, sizes="1GB,4GB", quick_sizes="96MB")
    ap.add_argument("--peak", help=argparse.SUPPRESS)  # internal: one case, fresh process
    ap.add_argument("--dirs", help=argparse.SUPPRESS)
    a = parse_options(ap, argv)
    if a.peak:
        return peak_child(a.peak, a.dirs)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    meshes = {"onto4": make_mesh(2, 2), "onto6": make_mesh(3, 2)}
    summary = {}
    for s in a.sizes:
        summary.update(run_size(s, a.repeats, make_mesh(4, 2), meshes))
    emit_summary(BENCH, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
