"""Save and restore through S3: resilient_ckpt's fsspec tier vs Orbax, same server.

One moto S3 server (`resilient_ckpt.testing.moto_s3`, threaded, in this
process) on 127.0.0.1 serves both systems, interleaved within each repeat.
The state: float32 weights (16 leaves) on 8 CPU devices, a (data=4, model=2) mesh.

- resilient_ckpt, `save_s3_from_ram`: RamTier + FsspecTier(s3://): `save` +
  `wait_until_finished`, until the manifest is committed on S3;
  `upload_s3_from_ram` is the S3 tier's write alone;
- resilient_ckpt, `restore_s3`: a fresh manager on the S3 tier alone;
- orbax: `orbax.checkpoint.CheckpointManager` on s3:// (epath through s3fs,
  arrays through tensorstore, pointed at the server by AWS_ENDPOINT_URL).
  Orbax 0.12.8 cannot write there: its tensorstore spec builder knows gs://
  and absolute local paths only, and refuses `s3:/...` ("Checkpoint path
  should be absolute"); the script still tries, and when it fails one line
  says why (`"skipped"`) and the ratios are null.

moto keeps objects in this process's memory and shares its cores with the
client, so the figures compare clients on one machine, not S3 itself.

    python bench/s3.py             # 256 MB, 3 repeats
    python bench/s3.py --quick     # 32 MB, 2 repeats
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

from harness.report import emit, emit_summary  # noqa: E402
from harness.state import abstract_of, build_state, make_mesh, same_values, tree_bytes  # noqa: E402
from harness.systems import Orbax, Ours, timed_open_restore  # noqa: E402

log = logging.getLogger("bench.s3")
BENCH = "s3"


def s3_tier(s3, url: str):
    from resilient_ckpt.tiers import FsspecTier
    return FsspecTier(url, storage_options=s3.options())


def ours_save(s3, url: str, ram: str, state: dict) -> tuple[float, float]:
    """RamTier + the S3 tier: save + wait's seconds, and the S3 write's."""
    from resilient_ckpt import RamTier
    home = tempfile.mkdtemp(prefix="bench_s3_")
    with Ours(home, [RamTier(path=ram), s3_tier(s3, url)]) as sut:
        saved = sut.save(1, state)
    shutil.rmtree(home, ignore_errors=True)
    return saved.total_s, saved.record.tiers["s3"].seconds


def ours_restore(s3, url: str, state: dict) -> float:
    home = tempfile.mkdtemp(prefix="bench_s3_")
    got = timed_open_restore(lambda: Ours(home, [s3_tier(s3, url)], read_only=True),
                             abstract_of(state))
    shutil.rmtree(home, ignore_errors=True)
    assert same_values(got.out, state), "resilient_ckpt restored different values"
    return got.seconds


def orbax_save_restore(url: str, state: dict) -> tuple[float, float]:
    """Orbax's save and restore at `url`, run from a scratch working directory:
    where Orbax takes s3:/... for a relative local path, what it writes goes there."""
    here, scratch = os.getcwd(), tempfile.mkdtemp(prefix="bench_s3_orbax_")
    os.chdir(scratch)
    try:
        with Orbax(url) as sut:
            save = sut.save(1, state).total_s
        got = timed_open_restore(lambda: Orbax(url), abstract_of(state))
        assert same_values(got.out, state), "orbax restored different values"
        return save, got.seconds
    finally:
        os.chdir(here)
        shutil.rmtree(scratch, ignore_errors=True)


def run_one(s3, size: int, repeats: int, mesh) -> dict:
    state = build_state("rows", size, mesh)
    nbytes = tree_bytes(state)
    runs: dict[tuple[str, str], list[float]] = {}
    orbax_error = None
    ram = tempfile.mkdtemp(prefix="bench_s3_ram_",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        for _ in range(repeats):
            bucket = s3.bucket()
            url = f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
            dt, up = ours_save(s3, url + "/ours", ram, state)
            runs.setdefault(("resilient_ckpt", "save_s3_from_ram"), []).append(dt)
            runs.setdefault(("resilient_ckpt", "upload_s3_from_ram"), []).append(up)
            shutil.rmtree(ram, ignore_errors=True)
            if orbax_error is None:
                try:
                    sv, rs = orbax_save_restore(url + "/orbax", state)
                    runs.setdefault(("orbax", "save_s3"), []).append(sv)
                    runs.setdefault(("orbax", "restore_s3"), []).append(rs)
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    orbax_error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    log.warning("orbax on s3:// failed: %s", orbax_error)
            runs.setdefault(("resilient_ckpt", "restore_s3"), []).append(
                ours_restore(s3, url + "/ours", state))
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    common = {"bench": BENCH, "bytes": nbytes, "dtype": "float32", "devices": 8}
    for (system, case), xs in runs.items():
        med = statistics.median(xs)
        emit({**common, "system": system, "case": case, "runs_s": xs, "median_s": med,
              "mb_per_s": round(nbytes / med / 1e6, 1)})
    if orbax_error:
        emit({**common, "system": "orbax", "case": "save_s3", "skipped": orbax_error})
    med = {k: statistics.median(v) for k, v in runs.items()}
    key = size_label(size)

    def ratio(theirs, ours):
        return round(med[theirs] / med[ours], 3) if theirs in med else None
    return {f"save_s3_from_ram_speedup_vs_orbax_{key}": ratio(
                ("orbax", "save_s3"), ("resilient_ckpt", "save_s3_from_ram")),
            f"restore_s3_speedup_vs_orbax_{key}": ratio(
                ("orbax", "restore_s3"), ("resilient_ckpt", "restore_s3"))}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes="256MB", quick_sizes="32MB")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    for name in ("absl", "jax", "orbax", "botocore", "s3fs", "aiobotocore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    from resilient_ckpt.testing.moto_s3 import MotoS3
    summary: dict = {}
    with MotoS3() as s3:
        # Orbax reaches S3 through tensorstore's s3 driver, which reads these.
        os.environ.update({"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"})
        mesh = make_mesh(4, 2)
        for size in a.sizes:
            summary.update(run_one(s3, size, a.repeats, mesh))
    emit_summary(BENCH, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
