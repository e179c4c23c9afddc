"""Which GCS client for the GCS tier: throughput and preconditions, measured.

Through one fake-gcs-server on 127.0.0.1 (the bundled binary), for each
candidate, interleaved within each repeat:

- google-cloud-storage, its own paths: `Blob.upload_from_file` (multipart up to
  8 MiB, resumable above) and `Blob.download_to_file` of byte ranges;
- resilient_ckpt: the GCS tier's storage (google-cloud-storage's session:
  single media uploads of up to a piece, composed above; ranged reads streamed
  straight into the destination buffer);
- tensorstore: the `gcs` kvstore (`write` / `read`);
- gcsfs: `pipe` / `cat` (skipped when gcsfs is not installed).

Each writes N objects of SIZE bytes (float32 normal weights) with 4 in flight,
then reads them back, 4 in flight. Also checked once per client: is a
create-only write (if_generation_match=0, or the client's equivalent) refused
when the object exists? That is what a commit needs.

Output (docs/bench_contract.md): one JSON line per (system, case), where `system`
names the client; then a summary line with each client's throughput relative
to google-cloud-storage's own paths. Logs go to stderr.

    python bench/gcs_clients.py                  # 16 x 32 MB, 3 repeats
    python bench/gcs_clients.py --quick          # 8 x 8 MB, 2 repeats
    python bench/gcs_clients.py --objects 32 --object-size 64MB

It takes no state sizes: --sizes (and --plot), which run_all.py passes to every
script, are ignored.
"""
from __future__ import annotations

import concurrent.futures as cf
import io
import logging
import os
import statistics
import sys
import time

from harness.options import bench_parser, parse_options, prepare, size_option

prepare(devices=8)

import numpy as np  # noqa: E402
from harness.report import emit, emit_summary  # noqa: E402

from resilient_ckpt.testing.fake_gcs import FakeGcs  # noqa: E402

log = logging.getLogger("bench.gcs_clients")
BENCH = "gcs_clients"
BUCKET = "bench-clients"
INFLIGHT = 4


class _Sink(io.RawIOBase):
    """A writable file over a buffer (for download_to_file)."""

    def __init__(self, buf: memoryview):
        self.v, self.n = buf, 0

    def writable(self) -> bool:
        return True

    def write(self, d) -> int:
        k = len(d)
        self.v[self.n:self.n + k] = d
        self.n += k
        return k


def clients(endpoint: str) -> dict:
    """name -> (put(key, memoryview), get(key, out memoryview), create_only(key, bytes) -> bool)."""
    from google.api_core.exceptions import PreconditionFailed
    from google.cloud import storage

    from resilient_ckpt.storage.gcs import GcsStorage

    gcs = storage.Client().bucket(BUCKET)

    def gcs_put(key, view):
        gcs.blob(f"gcs/{key}").upload_from_file(io.BytesIO(view), size=len(view), retry=None)

    def gcs_get(key, out):
        gcs.blob(f"gcs/{key}").download_to_file(_Sink(out), start=0, end=len(out) - 1,
                                                raw_download=True, checksum=None)

    def gcs_create(key, data):
        try:
            gcs.blob(f"gcs/{key}").upload_from_string(data, if_generation_match=0)
            return True
        except PreconditionFailed:
            return False

    ours = GcsStorage(f"gs://{BUCKET}/ours", endpoint=endpoint)
    out = {
        "google-cloud-storage": (gcs_put, gcs_get, gcs_create),
        "resilient_ckpt": (lambda k, v: ours.put(k, v),
                           lambda k, o: ours.read_into(k, o),
                           lambda k, d: ours.put_if_absent(k, d)),
    }
    import tensorstore as ts
    kv = ts.KvStore.open({"driver": "gcs", "bucket": BUCKET, "path": "ts/"}).result()

    def ts_create(key, data):
        # if_equal=b"\x02", the "no value" generation, is tensorstore's
        # create-only write (checked on its memory kvstore); b"" means refused.
        gen = kv.write(key, data, if_equal=b"\x02").result().generation
        return bool(gen)
    out["tensorstore"] = (lambda k, v: kv.write(k, bytes(v)).result(),
                          lambda k, o: _copy(kv.read(k).result().value, o), ts_create)
    try:
        import gcsfs
    except ImportError:
        log.warning("gcsfs is not installed: skipped (pip install gcsfs)")
        return out
    fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon")

    def fs_create(key, data):
        try:
            fs.pipe_file(f"{BUCKET}/fs/{key}", data, mode="create")
            return True
        except (FileExistsError, OSError, TypeError, ValueError):
            return False
    out["gcsfs"] = (lambda k, v: fs.pipe_file(f"{BUCKET}/fs/{k}", bytes(v)),
                    lambda k, o: _copy(fs.cat_file(f"{BUCKET}/fs/{k}"), o), fs_create)
    return out


def _copy(data, out: memoryview) -> None:
    out[:len(data)] = data


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes=None, quick_help="8 objects of 8MB, 2 repeats")
    p.add_argument("--objects", type=int, default=None, help="objects (default 16; --quick 8)")
    p.add_argument("--object-size", type=size_option, default=None, metavar="SIZE",
                   help="bytes per object, e.g. 32MB (default 32MB; --quick 8MB)")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    a.objects = a.objects or (8 if a.quick else 16)
    size = a.object_size or (8 if a.quick else 32) * 10**6
    data = np.random.default_rng(0).standard_normal(size // 4).astype(np.float32)
    view = memoryview(data).cast("B")
    outs = [np.empty(len(view), np.uint8) for _ in range(a.objects)]
    with FakeGcs() as server:
        os.environ.update(server.env())  # before any client reads them
        server.create_bucket(BUCKET)
        cs = clients(server.endpoint)
        runs: dict = {(n, c): [] for n in cs for c in ("write", "read")}
        with cf.ThreadPoolExecutor(INFLIGHT) as ex:
            for r in range(a.repeats):
                for name, (put, get, _) in cs.items():
                    t0 = time.perf_counter()
                    list(ex.map(lambda i, put=put, r=r: put(f"{r}/{i}", view), range(a.objects)))
                    runs[(name, "write")].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    list(ex.map(lambda i, get=get, r=r: get(f"{r}/{i}", memoryview(outs[i])),
                                range(a.objects)))
                    runs[(name, "read")].append(time.perf_counter() - t0)
                    assert all(np.array_equal(o, np.frombuffer(view, np.uint8)) for o in outs), name
                    for o in outs:
                        o.fill(0)
                    log.info("repeat %d, %s: write %.2f s, read %.2f s", r, name,
                             runs[(name, "write")][-1], runs[(name, "read")][-1])
        total = a.objects * size
        for (name, case), xs in runs.items():
            emit({"bench": BENCH, "system": name, "case": case, "bytes": total,
                  "objects": a.objects, "in_flight": INFLIGHT, "runs_s": xs,
                  "median_s": statistics.median(xs),
                  "mb_per_s": round(total / statistics.median(xs) / 1e6, 1)})
        enforced = {}
        for name, (_, _, create) in cs.items():
            first, second = create("commit", b"a"), create("commit", b"b")
            enforced[name] = bool(first and not second)
            emit({"bench": BENCH, "system": name, "case": "create_only_enforced",
                  "value": enforced[name]})
    base = {c: statistics.median(runs[("google-cloud-storage", c)]) for c in ("write", "read")}
    summary = {}
    for name in cs:
        for c in ("write", "read"):
            summary[f"{c}_{name}_vs_google-cloud-storage"] = round(
                base[c] / statistics.median(runs[(name, c)]), 2)
        summary[f"create_only_enforced_{name}"] = enforced[name]
    emit_summary(BENCH, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
