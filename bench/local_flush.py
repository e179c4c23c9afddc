"""How the local tier makes a step's chunks durable: synced together vs an fsync each.

On the unique shards of save_restore.py's state (harness.state's "train"
layout), each round writes one step through the local tier's storage
(FileStorage, O_DIRECT as configured by LocalTier): begin_write, the chunks
on 8 threads, flush, the manifest's create-only put, end_write. Two ways,
interleaved within each repeat:

- resilient_ckpt `write_syncfs`: the default where syncfs reports write-back
  errors (Linux 5.8 on, storage/durable.py): no fsync per chunk, a syncfs
  every `durable.SYNC_EVERY` bytes written and one at the flush;
- resilient_ckpt `write_fsync_each`: the fallback elsewhere (an fsync per
  chunk, then one of the directory), as every release before did;
- limit `write_fsync`: each shard written to its own file and fsynced, on as
  many threads, then the directory fsynced (save_restore.py's limit).

And beside them, on a tmpfs (`--shm`, default /dev/shm), where no disk
decides the time and what is left is the per-chunk cost:

- resilient_ckpt `ram_write`: the same chunks through the RAM tier's
  storage (no fsync, as RamTier configures it);
- limit `ram_write_plain`: each shard written to its own file there, no fsync.

Orbax has no such setting; its whole local save is timed in save_restore.py.
Each round writes into a fresh directory and the rounds before are renamed
aside, not deleted, until the end: this machine's root file system is
mounted with `discard`, and writes in the 15-30 s after a large deletion run
2.5-4x slower (docs/environment.md), which would decide the result. Each line
carries the block device's writes and flushes per round
(/sys/dev/block/M:m/stat), where it can be read.

    python bench/local_flush.py                       # 256 MB and 1 GB, 3 repeats
    python bench/local_flush.py --quick               # 64 MB, 2 repeats
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import statistics
import sys
import tempfile
import time

from harness.options import bench_parser, parse_options, prepare, size_label

prepare()

import numpy as np  # noqa: E402
from harness.measure import set_aside, settle  # noqa: E402
from harness.report import emit, emit_summary  # noqa: E402
from harness.state import build_state, make_mesh, unique_shards  # noqa: E402
from harness.systems import write_files  # noqa: E402

from resilient_ckpt.core import layout  # noqa: E402
from resilient_ckpt.storage import FileStorage, durable  # noqa: E402


def device_ops(path: str) -> tuple[int, int] | None:
    """(writes, flushes) completed so far by the block device under `path`."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            fields = [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None
    return (fields[4], fields[15]) if len(fields) > 15 else None


def ours(root: str, shards: list[np.ndarray], threads: int, how: str) -> None:
    """One step's chunks through our storage; `how`: "ram" (the RAM tier's
    storage), "syncfs" or "fsync" (the local tier's, one syncfs at the flush
    or an fsync per chunk)."""
    saved = durable.syncfs
    if how != "ram":  # the module's switch between the local tier's two ways
        durable.syncfs = saved if how == "syncfs" else None
    try:
        st = (FileStorage(root, "ram", fsync=False, zero_copy=True) if how == "ram"
              else FileStorage(root, "local", direct=True))
        st.begin_write("1")
        with cf.ThreadPoolExecutor(threads) as ex:
            # Named as a save's chunks are (a save id, then item, leaf, offsets).
            list(ex.map(lambda i: st.put(f"1/0123abcd.{layout.chunk_key(0, i, ())}",
                                         memoryview(shards[i].view(np.uint8))),
                        range(len(shards))))
        st.flush("1")
        assert st.put_if_absent("1/manifest.0-of-1.json", b"{}")
        st.end_write("1")
    finally:
        durable.syncfs = saved


def limit(root: str, shards: list[np.ndarray], threads: int, how: str) -> None:
    os.makedirs(root)
    write_files(root, shards, threads, fsync=how != "ram")


def run_size(nbytes: int, repeats: int, workdir: str, shm: str, threads: int) -> dict:
    state = build_state("train", nbytes, make_mesh(4, 2))
    shards = [np.ascontiguousarray(s).reshape(-1) for s in unique_shards(state)]
    total = sum(s.nbytes for s in shards)
    ways = [("resilient_ckpt", "write_syncfs", ours, "syncfs"),
            ("resilient_ckpt", "write_fsync_each", ours, "fsync"),
            ("limit", "write_fsync", limit, "fsync")]
    if durable.syncfs is None:
        sys.stderr.write("no syncfs that reports write-back errors here: only the fallback\n")
        ways = ways[1:]
    ways += [("resilient_ckpt", "ram_write", ours, "ram"),
             ("limit", "ram_write_plain", limit, "ram")]
    runs: dict[str, list[float]] = {case: [] for _, case, _, _ in ways}
    ops: dict[str, list] = {case: [] for _, case, _, _ in ways}
    for r in range(repeats):
        for _system, case, fn, how in ways[r % len(ways):] + ways[:r % len(ways)]:
            # Fresh: main deletes the disk's rounds at the end; a tmpfs round is
            # deleted right after it (no discard there, and it holds memory).
            on = shm if how == "ram" else workdir
            root = os.path.join(on, "step")
            set_aside(root)
            os.sync()
            settle()
            before = device_ops(on)
            t0 = time.perf_counter()
            fn(root, shards, threads, how)
            runs[case].append(round(time.perf_counter() - t0, 4))
            after = device_ops(on)
            ops[case].append(None if before is None or after is None else
                             [after[0] - before[0], after[1] - before[1]])
            if on == shm:
                shutil.rmtree(root)
    label = size_label(nbytes)
    for system, case, _, _ in ways:
        emit({"bench": "local_flush", "system": system, "case": case, "bytes": total,
              "size": label, "chunks": len(shards), "threads": threads,
              "device_writes_flushes": ops[case], "runs_s": runs[case],
              "median_s": round(statistics.median(runs[case]), 4)})
    med = {case: statistics.median(v) for case, v in runs.items()}
    key = label.lower()
    out = {f"write_fsync_each_vs_limit_{key}":
           round(med["write_fsync"] / med["write_fsync_each"], 2)}
    if "write_syncfs" in med:
        out[f"syncfs_speedup_over_fsync_each_{key}"] = round(
            med["write_fsync_each"] / med["write_syncfs"], 2)
        out[f"write_syncfs_vs_limit_{key}"] = round(med["write_fsync"] / med["write_syncfs"], 2)
    out[f"ram_write_vs_limit_{key}"] = round(med["ram_write_plain"] / med["ram_write"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes="256MB,1GB", quick_sizes="64MB")
    p.add_argument("--dir", default=None,
                   help="a directory on the disk to measure (default: a new one in "
                        "the current directory)")
    p.add_argument("--shm", default="/dev/shm",
                   help="a tmpfs for the RAM-tier cases (default /dev/shm)")
    p.add_argument("--threads", type=int, default=8)
    a = parse_options(p, argv)
    summary: dict = {}
    workdir = tempfile.mkdtemp(prefix="rc-local-flush-", dir=a.dir or os.getcwd())
    shm = tempfile.mkdtemp(prefix="rc-local-flush-", dir=a.shm)
    try:
        for n in a.sizes:
            summary.update(run_size(n, a.repeats, workdir, shm, a.threads))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    emit_summary("local_flush", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
