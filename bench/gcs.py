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
Every timed case starts settled (`_common.settle`: 3 s for what the case
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

import concurrent.futures as cf
import http.client
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
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
    settle,
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

from resilient_ckpt.native.hostmem import host_buffer  # noqa: E402
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
            sub = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
            start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))
            rng = np.random.default_rng([seed, *start])
            return (rng.standard_normal(sub, dtype=np.float32) * 0.02).astype(dtype)
        out[f"w{i:02d}"] = jax.make_array_from_callback((rows, cols), sharding, cb)
    return out


def timed_save(manager, state: dict, step: int = 1) -> tuple[float, int | None]:
    """Seconds of `save` + `wait_until_finished` of `step`, and its peak
    memory above the level before (_common.PeakRss)."""
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        dt = time.perf_counter() - t0
    return dt, peak.extra


def timed_restore(open_manager, state: dict, who: str) -> tuple[float, int | None]:
    """Seconds from opening a fresh manager to its latest step restored onto
    the state's shardings, and the peak memory meanwhile (the restored state
    included); the values are then checked against `state`."""
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        with open_manager() as m:
            out = m.restore(m.latest_step(),
                            args=ocp.args.StandardRestore(abstract_of(state)))
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
    assert same_values(out, state), f"{who} restored different values"
    return dt, peak.extra


def _again(manager, state: dict, dt: float, peak: int | None, then) -> tuple | None:
    """With `then`: then(dt, peak) of step 1, step 2 saved by the same
    manager, step 1 deleted; step 2's (seconds, peak). Without: None."""
    if then is None:
        return None
    then(dt, peak)
    again = timed_save(manager, state, step=2)
    manager.delete(1)
    return again


class Ours:
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
        from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, RamTier
        tiers = [self.tier(url, codec)] + ([RamTier(path=ram)] if ram else [])
        with CheckpointManager(url, options=CheckpointManagerOptions(tiers=tiers)) as m:
            dt, peak = timed_save(m, state)
            tw = m.save_records[-1].tiers["gcs"]
            return dt, tw.stored_bytes, tw.seconds, peak, _again(m, state, dt, peak, then)

    def restore(self, url: str, state: dict, codec: str) -> tuple[float, int | None]:
        from resilient_ckpt import CheckpointManager, CheckpointManagerOptions
        opts = CheckpointManagerOptions(tiers=[self.tier(url, codec)], read_only=True)
        return timed_restore(lambda: CheckpointManager(url, options=opts), state,
                             "resilient_ckpt")


class Orbax:
    def save(self, url: str, state: dict, then=None) -> tuple:
        """(seconds, peak) of step 1, then step 2's or None, as Ours.save."""
        import orbax.checkpoint as ocp
        with ocp.CheckpointManager(url) as m:
            dt, peak = timed_save(m, state)
            return dt, peak, _again(m, state, dt, peak, then)

    def restore(self, url: str, state: dict) -> tuple[float, int | None]:
        import orbax.checkpoint as ocp
        return timed_restore(lambda: ocp.CheckpointManager(url), state, "orbax")


def remove(endpoint: str, url: str) -> None:
    from resilient_ckpt.storage.gcs import GcsStorage
    st = GcsStorage(url, endpoint=endpoint)
    for name in st.list(""):
        st.delete_dir(name)
    st.close()


def unique_shards(state: dict) -> list[np.ndarray]:
    return [np.asarray(s.data) for a in state.values() for s in a.addressable_shards
            if s.replica_id == 0]


class Transport:
    """The emulator's own bound: the state's unique shards as objects, each
    POSTed in one media upload and read back whole, on 8 threads with one
    http.client connection each (no client library, no checksum)."""

    def __init__(self, endpoint: str, shards: list[np.ndarray]):
        u = urllib.parse.urlparse(endpoint)
        self.host, self.port = u.hostname, u.port
        self.shards = [x.reshape(-1).view(np.uint8) for x in shards]
        self.local = threading.local()
        self.pool = cf.ThreadPoolExecutor(8)
        self.touched = [np.ones(x.nbytes, np.uint8) for x in self.shards]

    def _conn(self) -> http.client.HTTPConnection:
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return self.local.conn

    def _post(self, name: str, data: np.ndarray) -> None:
        c = self._conn()
        c.request("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name="
                  + urllib.parse.quote(name, safe=""), body=data.data,
                  headers={"Content-Type": "application/octet-stream"})
        r = c.getresponse()
        r.read()
        assert r.status == 200, f"upload of {name}: HTTP {r.status}"

    def _get(self, name: str, out: np.ndarray) -> None:
        c = self._conn()
        c.request("GET", f"/download/storage/v1/b/{BUCKET}/o/"
                  + urllib.parse.quote(name, safe="") + "?alt=media")
        r = c.getresponse()
        view, got = out.data, 0
        while got < len(view) and (n := r.readinto(view[got:])):
            got += n
        r.read()
        assert r.status == 200 and got == len(view), f"read of {name}: HTTP {r.status}"

    def put(self, prefix: str) -> None:
        list(self.pool.map(lambda i: self._post(f"{prefix}/{i}", self.shards[i]),
                           range(len(self.shards))))

    def get(self, prefix: str, fresh: bool) -> None:
        outs = [host_buffer(x.nbytes) for x in self.shards] if fresh else self.touched
        list(self.pool.map(lambda i: self._get(f"{prefix}/{i}", outs[i]),
                           range(len(self.shards))))
        assert all(np.array_equal(o, x) for o, x in zip(outs, self.shards, strict=True))

    def close(self) -> None:
        self.pool.shutdown()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def codec_limit(state: dict, level: int = 1) -> dict:
    """zstd on one thread over every unique shard: ratio, compress and decompress GB/s."""
    import zstandard
    shards = unique_shards(state)
    raw = sum(x.nbytes for x in shards)
    t0 = time.perf_counter()
    packed = [zstandard.ZstdCompressor(level=level).compress(x) for x in shards]
    tc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, x in zip(packed, shards, strict=True):
        zstandard.ZstdDecompressor().decompress(p, max_output_size=x.nbytes)
    td = time.perf_counter() - t0
    return {"ratio": raw / sum(len(p) for p in packed), "compress_gb_s": raw / tc / 1e9,
            "decompress_gb_s": raw / td / 1e9}


def run_one(size: int, dtype_name: str, repeats: int, endpoint: str, server_pid: int,
            mesh: Mesh) -> dict:
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    state = build_state(size, dtype, mesh)
    nbytes = sum(a.nbytes for a in state.values())
    ours, orbax, runs, stored, lims = Ours(endpoint), Orbax(), {}, {}, []
    transport = Transport(endpoint, unique_shards(state))
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
        t0 = time.perf_counter()
        fn()
        add("limit", case, time.perf_counter() - t0)
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
                remove(endpoint, urls[key])
            limit("put_media", lambda run=run: transport.put(f"{run}/limit"))
            limit("get_fresh", lambda run=run: transport.get(f"{run}/limit", fresh=True))
            limit("get_touched", lambda run=run: transport.get(f"{run}/limit", fresh=False))
            remove(endpoint, f"gs://{BUCKET}/{run}/limit")
            trim()
            lims.append(codec_limit(state))
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        transport.close()
    del state
    trim()
    common = {"bench": BENCH, "bytes": nbytes, "dtype": dtype_name, "devices": 8}
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
    key = f"{size_label(size)}_{dtype_name}"
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
                summary.update(run_one(size, dt, a.repeats, server.endpoint,
                                       server.pid, mesh))
    emit_summary(BENCH, {k: round(v, 3) for k, v in summary.items()}, plot=a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
