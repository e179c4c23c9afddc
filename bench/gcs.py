"""Save and restore through GCS: resilient_ckpt's GCS tier vs Orbax, same emulator.

One fake-gcs-server (the bundled binary, memory backend) on 127.0.0.1 serves
both systems in one run, interleaved within each repeat. The state: weights of
one dtype (float32 or bfloat16; normal, std 0.02, as at initialization) on 8
CPU devices, a (data=4, model=2) mesh, 16 leaves of varied shapes.

- resilient_ckpt, `save_gcs_zstd` / `save_gcs_raw`: a manager whose only tier is
  GcsTier (codec zstd, the default; or raw): `save` + `wait_until_finished`,
  i.e. until the manifest is committed on GCS;
- resilient_ckpt, `save_gcs_from_ram`: RamTier + GcsTier (raw, the default),
  the usual setup: the RAM tier writes the step, then the upload reads the RAM
  tier's copy; timed from `save` until the GCS commit; `upload_gcs_from_ram`
  is the upload alone (the GCS tier's write, after the RAM tier committed);
- resilient_ckpt, `restore_gcs_zstd` / `restore_gcs_raw`: a fresh manager on
  the GCS tier alone (a new machine), `restore` onto the saved shardings;
- orbax: `orbax.checkpoint.CheckpointManager` on gs:// (tensorstore through the
  emulator): `save` + `wait_until_finished`, and `restore` by a fresh manager;
- limit: zstd level 1 compression and decompression of the state's bytes on
  one thread (ratio and GB/s), the codec's own cost.

Output (docs/bench_contract.md): one JSON line per (system, case, dtype, size),
then a summary line: `*_speedup_vs_orbax` = Orbax's time / ours (> 1: we are
faster). Goals: restore >= 2, save >= 1.

    python bench/gcs.py                       # 1 GB, float32 and bfloat16, 3 repeats
    python bench/gcs.py --quick               # 128 MB, 2 repeats (< 2 min)
    python bench/gcs.py --sizes 1GB,4GB --dtypes bfloat16 --repeats 5
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from _common import (
    PeakRss,
    abstract_of,
    bench_parser,
    emit,
    emit_summary,
    make_mesh,
    parse_options,
    peaks_vs_budget,
    prepare,
    read_jsonl,
    same_values,
    size_label,
    trim,
    worst_peak,
)

prepare(devices=8)

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from _plot import plot  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from resilient_ckpt.testing.fake_gcs import FakeGcs  # noqa: E402

log = logging.getLogger("bench.gcs")
BENCH = "gcs"
BUCKET = "bench-gcs"


def build_state(total: int, dtype, mesh: Mesh) -> dict:
    """16 leaves of about total/16 bytes each, shapes varied, sharded over (data, model)."""
    item = np.dtype(dtype).itemsize
    per = total // 16 // item
    specs = [P("data", "model"), P("model", "data"), P("data", None), P(None, "model")]
    out = {}
    for i in range(16):
        cols = 512 * (1 + i % 4)
        rows = max(8, per // cols // 8 * 8)
        sharding = NamedSharding(mesh, specs[i % 4])

        def cb(index, shape=(rows, cols), seed=i):
            sub = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))
            start = tuple(s.indices(n)[0] for s, n in zip(index, shape))
            rng = np.random.default_rng([seed, *start])
            return (rng.standard_normal(sub, dtype=np.float32) * 0.02).astype(dtype)
        out[f"w{i:02d}"] = jax.make_array_from_callback((rows, cols), sharding, cb)
    return out


def timed_save(manager, state: dict) -> tuple[float, int | None]:
    """Seconds of `save` + `wait_until_finished` of step 1, and its peak
    memory above the level before (_common.PeakRss)."""
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        manager.save(1, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        dt = time.perf_counter() - t0
    return dt, peak.extra


def timed_restore(open_manager, state: dict, who: str) -> tuple[float, int | None]:
    """Seconds from opening a fresh manager to step 1 restored onto the
    state's shardings, and the peak memory meanwhile (the restored state
    included); the values are then checked against `state`."""
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        with open_manager() as m:
            out = m.restore(1, args=ocp.args.StandardRestore(abstract_of(state)))
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
    assert same_values(out, state), f"{who} restored different values"
    return dt, peak.extra


class Ours:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def tier(self, url: str, codec: str):
        from resilient_ckpt import GcsTier
        return GcsTier(url, endpoint=self.endpoint, codec=codec)

    def save(self, url: str, state: dict, codec: str, ram: str | None = None) -> tuple:
        from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, RamTier
        tiers = [self.tier(url, codec)] + ([RamTier(path=ram)] if ram else [])
        with CheckpointManager(url, options=CheckpointManagerOptions(tiers=tiers)) as m:
            dt, peak = timed_save(m, state)
            tw = m.save_records[-1].tiers["gcs"]
        return dt, tw.stored_bytes, tw.seconds, peak

    def restore(self, url: str, state: dict, codec: str) -> tuple[float, int | None]:
        from resilient_ckpt import CheckpointManager, CheckpointManagerOptions
        opts = CheckpointManagerOptions(tiers=[self.tier(url, codec)], read_only=True)
        return timed_restore(lambda: CheckpointManager(url, options=opts), state,
                             "resilient_ckpt")


class Orbax:
    def save(self, url: str, state: dict) -> tuple[float, int | None]:
        import orbax.checkpoint as ocp
        with ocp.CheckpointManager(url) as m:
            return timed_save(m, state)

    def restore(self, url: str, state: dict) -> tuple[float, int | None]:
        import orbax.checkpoint as ocp
        return timed_restore(lambda: ocp.CheckpointManager(url), state, "orbax")


def remove(endpoint: str, url: str) -> None:
    from resilient_ckpt.storage.gcs import GcsStorage
    st = GcsStorage(url, endpoint=endpoint)
    for name in st.list(""):
        st.delete_dir(name)
    st.close()


def codec_limit(state: dict, level: int = 1) -> dict:
    """zstd on one thread over every unique shard: ratio, compress and decompress GB/s."""
    import zstandard
    shards = [np.asarray(s.data) for a in state.values() for s in a.addressable_shards
              if s.replica_id == 0]
    raw = sum(x.nbytes for x in shards)
    t0 = time.perf_counter()
    packed = [zstandard.ZstdCompressor(level=level).compress(x) for x in shards]
    tc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, x in zip(packed, shards):
        zstandard.ZstdDecompressor().decompress(p, max_output_size=x.nbytes)
    td = time.perf_counter() - t0
    return {"ratio": raw / sum(len(p) for p in packed), "compress_gb_s": raw / tc / 1e9,
            "decompress_gb_s": raw / td / 1e9}


def run_one(size: int, dtype_name: str, repeats: int, endpoint: str, mesh: Mesh) -> dict:
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    state = build_state(size, dtype, mesh)
    nbytes = sum(a.nbytes for a in state.values())
    ours, orbax, runs, stored, lims = Ours(endpoint), Orbax(), {}, {}, []
    peaks: dict[tuple[str, str], list[int]] = {}
    ram = tempfile.mkdtemp(prefix="bench_gcs_ram_", dir="/dev/shm" if os.path.isdir("/dev/shm")
                           else None)

    def add(system: str, case: str, seconds: float, peak: int | None = None) -> None:
        runs.setdefault((system, case), []).append(seconds)
        if peak is not None:
            peaks.setdefault((system, case), []).append(peak)
        log.info("%s %s %s %s: %.2f s (%.0f MB/s)", size_label(size), dtype_name, system, case,
                 seconds, nbytes / seconds / 1e6)
    try:
        for _ in range(repeats):
            run = uuid.uuid4().hex[:8]
            urls = {k: f"gs://{BUCKET}/{run}/{k}" for k in ("zstd", "raw", "ram", "orbax")}
            dt, stored["zstd"], _, peak = ours.save(urls["zstd"], state, "zstd")
            add("resilient_ckpt", "save_gcs_zstd", dt, peak)
            add("orbax", "save_gcs", *orbax.save(urls["orbax"], state))
            dt, stored["raw"], _, peak = ours.save(urls["raw"], state, "raw")
            add("resilient_ckpt", "save_gcs_raw", dt, peak)
            dt, _, upload, peak = ours.save(urls["ram"], state, "raw", ram=ram)
            add("resilient_ckpt", "save_gcs_from_ram", dt, peak)
            add("resilient_ckpt", "upload_gcs_from_ram", upload)
            shutil.rmtree(ram, ignore_errors=True)
            trim()
            add("resilient_ckpt", "restore_gcs_zstd", *ours.restore(urls["zstd"], state, "zstd"))
            trim()
            add("orbax", "restore_gcs", *orbax.restore(urls["orbax"], state))
            trim()
            add("resilient_ckpt", "restore_gcs_raw", *ours.restore(urls["raw"], state, "raw"))
            trim()
            for u in urls.values():
                remove(endpoint, u)
            lims.append(codec_limit(state))
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    del state
    trim()
    common = {"bench": BENCH, "bytes": nbytes, "dtype": dtype_name, "devices": 8}
    for (system, case), xs in runs.items():
        med = statistics.median(xs)
        extra = {"stored_bytes": stored[case.rsplit("_", 1)[1]]} if case in (
            "save_gcs_zstd", "save_gcs_raw") else {}
        if (system, case) in peaks:  # the worst run
            extra.update(worst_peak(peaks[(system, case)], nbytes))
        emit({**common, "system": system, "case": case, "runs_s": xs, "median_s": med,
              "mb_per_s": round(nbytes / med / 1e6, 1), **extra})
    emit({**common, "system": "limit", "case": "zstd_level1_one_thread",
          **{k: round(statistics.median(x[k] for x in lims), 3) for k in lims[0]},
          "runs": lims})
    med = {k: statistics.median(v) for k, v in runs.items()}
    key = f"{size_label(size)}_{dtype_name}"
    o_save, o_rest = med[("orbax", "save_gcs")], med[("orbax", "restore_gcs")]
    return {
        f"restore_gcs_zstd_speedup_vs_orbax_{key}": o_rest / med[("resilient_ckpt",
                                                                  "restore_gcs_zstd")],
        f"restore_gcs_raw_speedup_vs_orbax_{key}": o_rest / med[("resilient_ckpt",
                                                                 "restore_gcs_raw")],
        f"save_gcs_zstd_speedup_vs_orbax_{key}": o_save / med[("resilient_ckpt",
                                                               "save_gcs_zstd")],
        f"save_gcs_raw_speedup_vs_orbax_{key}": o_save / med[("resilient_ckpt", "save_gcs_raw")],
        f"save_gcs_from_ram_speedup_vs_orbax_{key}": o_save / med[("resilient_ckpt",
                                                                   "save_gcs_from_ram")],
        f"upload_gcs_from_ram_speedup_vs_orbax_save_{key}": o_save / med[
            ("resilient_ckpt", "upload_gcs_from_ram")],
        f"zstd_stored_fraction_{key}": stored["zstd"] / nbytes,
        **peaks_vs_budget({k: max(v) for k, v in peaks.items()}, nbytes, key),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes="1GB", quick_sizes="128MB", plots=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--from-jsonl", metavar="FILE", help="only plot the lines of an earlier run")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if a.from_jsonl:
        plot(read_jsonl(a.from_jsonl), a.plot or "gcs.png")
        return 0
    for name in ("absl", "jax", "orbax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    mesh = make_mesh(4, 2)
    summary = {}
    with FakeGcs() as server:
        os.environ.update(server.env())  # Orbax (tensorstore) reads these at first use
        server.create_bucket(BUCKET)
        for size in a.sizes:
            for dt in a.dtypes.split(","):
                summary.update(run_one(size, dt, a.repeats, server.endpoint, mesh))
    emit_summary(BENCH, {k: round(v, 3) for k, v in summary.items()}, plot=a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
