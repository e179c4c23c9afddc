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
- `*_again`: a second save (step 2) by the same manager, ours raw and
  Orbax's: what a training job pays for each periodic save after its first
  (our host pool is then already faulted in);
Every timed case starts settled (`harness.measure.settle`: 3 s for what the case
before left running, the emulator's garbage collection included).

- limit: zstd level 1 compression and decompression of the state's bytes on
  one thread (ratio and GB/s), the codec's own cost; and the emulator's own
  transport bound: `put_media`, the state's unique shards each POSTed in one
  media upload on 8 threads (plain http.client, one connection per thread),
  `get_fresh` / `get_touched`, the same objects read back on 8 threads into
  fresh memory (as a new machine's restore must) and into memory already
  touched. Every timed case also gives `server_cpu_s`, the CPU time the
  emulator process spent meanwhile (from /proc): on 2 cores the server's
  work, not the client's, bounds the saves here.

Output (docs/bench_contract.md): one JSON line per (system, case, dtype, size),
then a summary line: `*_speedup_vs_orbax` = Orbax's time / ours (> 1: we are
faster); `*_vs_limit` = ours / the limit's (>= 1; near 1: at the bound).
Goals: restore >= 2, save >= 1.

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
import uuid

from harness.options import bench_parser, parse_options, prepare, size_label

prepare(devices=8)

import jax  # noqa: E402
from harness.measure import cpu_seconds, settle, timed, trim  # noqa: E402
from harness.plot import plot  # noqa: E402
from harness.report import (  # noqa: E402
    emit,
    emit_summary,
    peaks_vs_budget,
    read_jsonl,
    worst_peak,
)
from harness.state import (  # noqa: E402
    abstract_of,
    build_state,
    make_mesh,
    same_values,
    tree_bytes,
    unique_shards,
)
from harness.systems import (  # noqa: E402
    GcsTransport,
    Orbax,
    Ours,
    codec_limit,
    timed_open_restore,
)

from resilient_ckpt.testing.fake_gcs import FakeGcs  # noqa: E402

log = logging.getLogger("bench.gcs")
BENCH = "gcs"
BUCKET = "bench-gcs"


def _again(sut, state: dict, saved, then) -> tuple | None:
    """With `then`: then(seconds, peak) of step 1, step 2 saved by the same
    manager, step 1 deleted; step 2's (seconds, peak). Without: None."""
    if then is None:
        return None
    then(saved.total_s, saved.peak)
    again = sut.save(2, state)
    sut.mngr.delete(1)
    return again.total_s, again.peak


class OursGcs:
    """resilient_ckpt with a GcsTier (and a RamTier beside it, or not)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def tier(self, url: str, codec: str):
        from resilient_ckpt import GcsTier
        return GcsTier(url, endpoint=self.endpoint, codec=codec)

    def save(self, url: str, state: dict, codec: str, ram: str | None = None,
             then=None) -> tuple:
        """(seconds, stored bytes, the GCS write's seconds, peak) of step 1,
        then step 2's (seconds, peak) or None: with `then`, it is called with
        step 1's (seconds, peak) and step 2 is saved by the same manager
        (step 1 is then deleted, so that the emulator holds one copy: it keeps
        objects in memory, and was killed for it at 21 GB here)."""
        from resilient_ckpt import RamTier
        tiers = [self.tier(url, codec)] + ([RamTier(path=ram)] if ram else [])
        with Ours(url, tiers) as sut:
            saved = sut.save(1, state)
            tw = saved.record.tiers["gcs"]
            return (saved.total_s, tw.stored_bytes, tw.seconds, saved.peak,
                    _again(sut, state, saved, then))

    def restore(self, url: str, state: dict, codec: str) -> tuple[float, int | None]:
        """A fresh manager on the GCS tier alone (a new machine): seconds from
        its opening to the restored state, and the peak; the values checked."""
        got = timed_open_restore(
            lambda: Ours(url, [self.tier(url, codec)], read_only=True), abstract_of(state))
        assert same_values(got.out, state), "resilient_ckpt restored different values"
        return got.seconds, got.peak


class OrbaxGcs:
    def save(self, url: str, state: dict, then=None) -> tuple:
        """(seconds, peak) of step 1, then step 2's or None, as OursGcs.save."""
        with Orbax(url) as sut:
            saved = sut.save(1, state)
            return saved.total_s, saved.peak, _again(sut, state, saved, then)

    def restore(self, url: str, state: dict) -> tuple[float, int | None]:
        got = timed_open_restore(lambda: Orbax(url), abstract_of(state))
        assert same_values(got.out, state), "orbax restored different values"
        return got.seconds, got.peak


def objects(endpoint: str, url: str) -> int:
    """How many objects lie under `url` (every step of it, everything)."""
    from resilient_ckpt.storage.gcs import GcsStorage
    st = GcsStorage(url, endpoint=endpoint)
    try:
        return len(st._list("", None)[0])  # every object under it, not one level
    finally:
        st.close()


def remove(endpoint: str, url: str) -> None:
    from resilient_ckpt.storage.gcs import GcsStorage
    st = GcsStorage(url, endpoint=endpoint)
    for name in st.list(""):
        st.delete_dir(name)
    st.close()


def run_one(size: int, dtype_name: str, repeats: int, endpoint: str, server_pid: int,
            mesh, layout: str = "weights") -> dict:
    state = (build_state("decoder", size, mesh) if layout == "decoder"
             else build_state("weights", size, mesh, dtype=dtype_name))
    nbytes, leaves = tree_bytes(state), len(jax.tree.leaves(state))
    ours, orbax, runs, stored, lims = OursGcs(endpoint), OrbaxGcs(), {}, {}, []
    counted: dict[str, int] = {}  # objects a step leaves, by system
    shards = unique_shards(state, largest_first=False)
    transport = GcsTransport(endpoint, BUCKET, shards)
    peaks: dict[tuple[str, str], list[int]] = {}
    server_cpu: dict[tuple[str, str], list[float]] = {}
    ram = tempfile.mkdtemp(prefix="bench_gcs_ram_", dir="/dev/shm" if os.path.isdir("/dev/shm")
                           else None)
    mark = [cpu_seconds(server_pid)]

    def add(system: str, case: str, seconds: float, peak: int | None = None) -> None:
        """Records a case that ended just now; the server's CPU since the last mark."""
        runs.setdefault((system, case), []).append(seconds)
        if peak is not None:
            peaks.setdefault((system, case), []).append(peak)
        now = cpu_seconds(server_pid)
        server_cpu.setdefault((system, case), []).append(now - mark[0])
        mark[0] = now
        log.info("%s %s %s %s: %.2f s (%.0f MB/s), server CPU %.2f s", size_label(size),
                 dtype_name, system, case, seconds, nbytes / seconds / 1e6,
                 server_cpu[(system, case)][-1])

    def start() -> None:
        settle()  # the emulator too: its garbage collection of the case before
        mark[0] = cpu_seconds(server_pid)

    def first_then_settle(system: str, case: str):
        """What a save with a second one calls between the two."""
        def then(dt: float, peak: int | None) -> None:
            add(system, case, dt, peak)
            start()
        return then

    def limit(case: str, fn) -> None:
        start()
        add("limit", case, timed(fn)[0])
    try:
        for _ in range(repeats):
            run = uuid.uuid4().hex[:8]
            urls = {k: f"gs://{BUCKET}/{run}/{k}" for k in ("zstd", "raw", "ram", "orbax")}
            start()
            dt, stored["zstd"], _, peak, _ = ours.save(urls["zstd"], state, "zstd")
            add("resilient_ckpt", "save_gcs_zstd", dt, peak)
            start()
            *_, again = orbax.save(urls["orbax"], state,
                                   then=first_then_settle("orbax", "save_gcs"))
            add("orbax", "save_gcs_again", *again)
            start()
            _, stored["raw"], _, _, again = ours.save(
                urls["raw"], state, "raw",
                then=first_then_settle("resilient_ckpt", "save_gcs_raw"))
            add("resilient_ckpt", "save_gcs_raw_again", *again)
            start()
            dt, _, upload, peak, _ = ours.save(urls["ram"], state, "raw", ram=ram)
            add("resilient_ckpt", "save_gcs_from_ram", dt, peak)
            runs.setdefault(("resilient_ckpt", "upload_gcs_from_ram"), []).append(upload)
            shutil.rmtree(ram, ignore_errors=True)
            remove(endpoint, urls["ram"])
            for system, case, key in (("resilient_ckpt", "restore_gcs_zstd", "zstd"),
                                      ("orbax", "restore_gcs", "orbax"),
                                      ("resilient_ckpt", "restore_gcs_raw", "raw")):
                start()
                add(system, case, *(orbax.restore(urls[key], state) if system == "orbax"
                                    else ours.restore(urls[key], state, key)))
                if key in ("raw", "orbax"):  # one step there, after a save of two
                    counted[system] = objects(endpoint, urls[key])
                remove(endpoint, urls[key])
            limit("put_media", lambda run=run: transport.put(f"{run}/limit"))
            limit("get_fresh", lambda run=run: transport.get(f"{run}/limit", fresh=True))
            limit("get_touched", lambda run=run: transport.get(f"{run}/limit", fresh=False))
            remove(endpoint, f"gs://{BUCKET}/{run}/limit")
            trim()
            lims.append(codec_limit(shards))
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        transport.close()
    del state, shards
    trim()
    common = {"bench": BENCH, "bytes": nbytes, "dtype": dtype_name, "devices": 8,
              "state": layout, "leaves": leaves,
              "objects_per_step": counted}
    for (system, case), xs in runs.items():
        med = statistics.median(xs)
        extra = {"stored_bytes": stored[case.rsplit("_", 1)[1]]} if case in (
            "save_gcs_zstd", "save_gcs_raw") else {}
        if (system, case) in peaks:  # the worst run
            extra.update(worst_peak(peaks[(system, case)], nbytes))
        if (system, case) in server_cpu:
            extra["server_cpu_s"] = round(statistics.median(server_cpu[(system, case)]), 3)
        emit({**common, "system": system, "case": case, "runs_s": xs, "median_s": med,
              "mb_per_s": round(nbytes / med / 1e6, 1), **extra})
    emit({**common, "system": "limit", "case": "zstd_level1_one_thread",
          **{k: round(statistics.median(x[k] for x in lims), 3) for k in lims[0]},
          "runs": lims})
    med = {k: statistics.median(v) for k, v in runs.items()}
    key = f"{'decoder-' if layout == 'decoder' else ''}{size_label(size)}_{dtype_name}"
    o_save, o_rest = med[("orbax", "save_gcs")], med[("orbax", "restore_gcs")]
    o_again = med[("orbax", "save_gcs_again")]
    ours_med = {c: t for (s_, c), t in med.items() if s_ == "resilient_ckpt"}
    return {
        f"restore_gcs_zstd_speedup_vs_orbax_{key}": o_rest / ours_med["restore_gcs_zstd"],
        f"restore_gcs_raw_speedup_vs_orbax_{key}": o_rest / ours_med["restore_gcs_raw"],
        f"save_gcs_zstd_speedup_vs_orbax_{key}": o_save / ours_med["save_gcs_zstd"],
        f"save_gcs_raw_speedup_vs_orbax_{key}": o_save / ours_med["save_gcs_raw"],
        f"save_gcs_raw_again_speedup_vs_orbax_again_{key}": o_again / ours_med[
            "save_gcs_raw_again"],
        f"save_gcs_from_ram_speedup_vs_orbax_{key}": o_save / ours_med["save_gcs_from_ram"],
        f"upload_gcs_from_ram_speedup_vs_orbax_save_{key}": o_save / ours_med[
            "upload_gcs_from_ram"],
        f"save_gcs_raw_again_vs_limit_{key}": ours_med["save_gcs_raw_again"]
        / med[("limit", "put_media")],
        f"orbax_save_gcs_again_vs_limit_{key}": o_again / med[("limit", "put_media")],
        f"restore_gcs_raw_vs_limit_fresh_{key}": ours_med["restore_gcs_raw"]
        / med[("limit", "get_fresh")],
        f"orbax_restore_gcs_vs_limit_fresh_{key}": o_rest / med[("limit", "get_fresh")],
        f"zstd_stored_fraction_{key}": stored["zstd"] / nbytes,
        f"objects_per_step_{key}": counted.get("resilient_ckpt", 0),
        f"orbax_objects_per_step_{key}": counted.get("orbax", 0),
        **peaks_vs_budget({k: max(v) for k, v in peaks.items()}, nbytes, key),
    }


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes="1GB", quick_sizes="128MB", plots=True)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--state", choices=("weights", "decoder"), default="weights",
                   help="the state: 'weights' (the figures' usual state, in each of "
                        "--dtypes) or 'decoder' (a 32-layer decoder with Adam's moments, "
                        "about 870 leaves, FSDP, float32: bench/harness/state.py)")
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
            for dt in (a.dtypes.split(",") if a.state == "weights" else ["float32"]):
                summary.update(run_one(size, dt, a.repeats, server.endpoint,
                                       server.pid, mesh, a.state))
    emit_summary(BENCH, {k: round(v, 3) for k, v in summary.items()}, plot=a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
