"""Resharded restore: onto 4 and onto 6 devices, against same-sharding and Orbax.

A train-state-like pytree saved on 8 CPU devices (mesh data=4 x model=2) is
restored, interleaved within each repeat:
- resilient_ckpt from the RAM tier and from the local tier (warm page cache:
  the step's files are read through before each local case, since our
  restores read uncached files past the cache and leave it cold):
  onto the saved sharding ("same"), and onto a (2, 2) and a (3, 2) mesh;
- orbax: its resharded restore of the same state from local disk (warm).
Each timed restore starts after `_common.settle` (3 s for what the case
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

from _common import (
    PeakRss,
    bench_parser,
    emit,
    emit_summary,
    files_under,
    make_mesh,
    parse_options,
    prepare,
    read_through,
    settle,
    size_label,
    worst_peak,
)

prepare(devices=8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    LocalTier,
    RamTier,
)

log = logging.getLogger("bench.reshard")
BENCH = "reshard"
SPEC = P("data", "model")


def build_state(total: int, mesh: Mesh) -> dict:
    """params, mu, nu (Adam-like), rows a multiple of 48 so 8, 6 and 4 divide."""
    per = total // 3
    leaves = {}
    rng = np.random.default_rng(0)
    cols = 1024
    sizes = [per // 2, per // 4, per // 8, per - per // 2 - per // 4 - per // 8]
    for i, n in enumerate(sizes):
        rows = max(48, (n // (cols * 4)) // 48 * 48)
        leaves[f"layer{i}"] = rng.standard_normal((rows, cols), dtype=np.float32)
    sh = NamedSharding(mesh, SPEC)
    put = lambda t: {k: jax.device_put(v, sh) for k, v in t.items()}  # noqa: E731
    return {"params": put(leaves), "mu": put({k: v * 0.1 for k, v in leaves.items()}),
            "nu": put({k: v * v for k, v in leaves.items()}), "step": 7}


def target_on(state, mesh: Mesh):
    sh = NamedSharding(mesh, SPEC)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                        if isinstance(x, jax.Array) else x, state)


def nbytes(state) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))


def measured(fn) -> float:
    """Seconds of fn() until its result is ready, the result dropped; it starts
    settled (_common.settle), so no case runs in the wake of the one before."""
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
    with CheckpointManager(ours_dir, options=CheckpointManagerOptions(
            cleanup_tmp_directories=False, read_only=True)) as m:
        abstract = target_on(m.item_metadata(1), meshes[target])
    if system == "orbax":
        mgr = ocp.CheckpointManager(orbax_dir)
    else:
        tiers = [RamTier(path=ram)] if tier == "ram" else []
        mgr = CheckpointManager(ours_dir, options=CheckpointManagerOptions(
            tiers=tiers, cleanup_tmp_directories=False, read_only=True))
    for _ in range(2):
        gc.collect()
    with PeakRss() as peak:  # the restored state is alive at its end
        out = mgr.restore(1, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(out)
    emit({"peak_extra_bytes": peak.extra})
    return 0


def run_size(total: int, repeats: int, mesh8: Mesh, meshes: dict) -> dict:
    state = build_state(total, mesh8)
    size = nbytes(state)
    label = size_label(total)
    root = tempfile.mkdtemp(prefix="bench-reshard-")
    ram = tempfile.mkdtemp(prefix="bench-reshard-", dir="/dev/shm")
    ours_dir, orbax_dir = os.path.join(root, "ours"), os.path.join(root, "orbax")
    try:
        opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
        with CheckpointManager(ours_dir, options=opts) as m:
            m.save(1, args=ocp.args.StandardSave(state))
        with ocp.CheckpointManager(orbax_dir) as om:
            om.save(1, args=ocp.args.StandardSave(state))
        targets = {"same": target_on(state, mesh8),
                   **{name: target_on(state, mm) for name, mm in meshes.items()}}
        del state
        gc.collect()
        ram_only = CheckpointManager(ours_dir, options=CheckpointManagerOptions(
            tiers=[RamTier(path=ram)], cleanup_tmp_directories=False))
        local_only = CheckpointManager(ours_dir, options=CheckpointManagerOptions(
            cleanup_tmp_directories=False))
        orbax = ocp.CheckpointManager(orbax_dir)
        cases = []
        local_files = files_under(os.path.join(ours_dir, "1"))
        for tname, tgt in targets.items():
            for tier, mgr in (("ram", ram_only), ("local", local_only)):
                cases.append(("resilient_ckpt", f"{tier}_{tname}",
                              lambda mgr=mgr, tgt=tgt: mgr.restore(
                                  1, args=ocp.args.StandardRestore(tgt))))
            if tname != "same":
                cases.append(("orbax", f"local_{tname}",
                              lambda tgt=tgt: orbax.restore(
                                  1, args=ocp.args.StandardRestore(tgt))))
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
