"""Save and restore of a sharded train state: resilient_ckpt vs Orbax vs the machine.

One run measures, interleaved within each repeat so that noise from other
tenants hits every system alike:

- limit: the physical references on the same bytes: a plain per-shard copy of
  the state to fresh host memory (np.array of each unique shard: the floor of a
  donation-safe snapshot), the same copy into pre-touched memory, first touch of
  fresh memory, the page faults of a first read of the bytes mapped from one
  /dev/shm file as a RAM-tier restore maps its packs and a CRC-32C of them
  there (their sum: what a restore that checks every byte and hands out the
  RAM tier's pages pays on one thread), disk write + fsync of one file per
  shard, and sequential reads of those files from a cold and a warm page cache;
- resilient_ckpt: CheckpointManager with a RAM tier (/dev/shm) and a local
  tier, both every step: the blocking time of `save` (also of a fresh job's
  first save, and of the first save of a new manager that restored the state
  1 s before: a resumed job's), each tier's write time (its lines carry the
  write's phases, `chunks_s`, `flush_s`, `manifest_s`, `observe_s`, from
  TierWrite.phases), restore from the RAM tier, and
  from the local tier with a warm and a cold page cache;
- orbax: orbax.checkpoint.CheckpointManager (async) on the same state: the
  blocking time of `save` (and of its first), save + wait_until_finished, restore with a warm and
  a cold page cache. On this CPU backend Orbax's blocking part keeps
  `np.asarray` views of the device buffers and copies nothing (its
  replica_slices.transfer_arrays_to_host); ours copies into host memory, as
  both do on an accelerator.

Every timed restore, of either system, and each system's first save start
after `harness.measure.settle` (3 s for what the case before left running, threads
and the kernel's writeback, to finish), so no case runs in another's wake.
The limit's write and the local tier's write alone follow no large delete of
the bench's own: their directories are renamed aside and deleted at the end
(`set_aside`). The managers' own deletes (retention, `drop`) stay as they are.

Peak memory: every save (with its tier writes) and every restore of either
system is run inside a reset of the process's resident high-water mark
(harness.measure.PeakRss), and its line carries the worst run's bytes above the level
before it (`peak_extra_bytes`, the restored state included); the summary
holds each system's worst save and restore over the state + 256 MiB.

Output (docs/bench_contract.md): one JSON object per line on stdout, one per
(system, case, size), then a summary line with the ratios; logs go to stderr.

    python bench/save_restore.py                 # 1 GB and 4 GB, 3 repeats
    python bench/save_restore.py --quick         # 128 MB, 2 repeats (< 2 min)
    python bench/save_restore.py --sizes 2GB --repeats 5 --plot docs/x.png
"""
from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

from harness.options import bench_parser, parse_options, prepare, size_label

prepare(devices=8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness.measure import (  # noqa: E402
    drop_caches,
    files_under,
    mem_available,
    read_through,
    set_aside,
    settle,
    timed,
    trim,
)
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
from harness.systems import Limit, Orbax, Ours, tier_seconds  # noqa: E402

log = logging.getLogger("bench.save_restore")
BENCH = "save_restore"
GOALS = {  # summary key prefix -> (comparison, goal), from issues #5 and #14
    "restore_ram_speedup_vs_orbax_local_warm": (">=", 8.0),
    "restore_ram_vs_limit_pretouched": ("<=", 1.5),
    "restore_local_cold_vs_limit": ("<=", 1.3),
    "save_local_vs_limit": (">=", 0.8),  # a tier write at most 1.25x the limit's
    "save_local_alone_vs_limit": (">=", 0.8),  # the same, without the RAM tier beside it
    "save_blocking_vs_limit": ("<=", 1.3),
    "first_save_after_restore_vs_later": ("<=", 2.0),
    "first_save_vs_later": ("<=", 2.0),
    "peak_save_vs_budget": ("<=", 1.0),  # state + 256 MiB, the restored state included
    "peak_restore_vs_budget": ("<=", 1.0),
}


# ---------------------------------------------------------------- the cases of a system

def save_case(sut, step: int, state) -> tuple[dict[str, float], int | None, dict]:
    """One save of `sut` (Ours or Orbax) with nothing else held (every step
    deleted first: the memory is tight): seconds per case, the peak memory of
    the save and its writes, and (ours) each tier write's phases (case ->
    {"chunks_s": ..., ...})."""
    sut.drop()
    trim()
    saved = sut.save(step, state)
    out = {"save_blocking": saved.blocking_s, "save_total": saved.total_s}
    phases = {}
    rec = saved.record
    if rec is not None:
        out["save_snapshot"] = rec.snapshot_s
        for name, tw in rec.tiers.items():
            out[f"save_tier_{name}"] = tier_seconds(rec, name, step)
            phases[f"save_tier_{name}"] = {f"{k}_s": round(v, 4)
                                           for k, v in (tw.phases or {}).items()}
    return out, saved.peak, phases


def restore_case(sut, step: int, abstract, step_dir: str | None, cold: bool, check=None
                 ) -> tuple[float, dict]:
    """One timed restore of `step` by `sut`, settled first; with `step_dir`
    (files on disk), its page cache first emptied (`cold`) or filled."""
    extra = {}
    if step_dir is not None:
        if cold:
            extra["cold_method"] = drop_caches(files_under(step_dir))
        else:
            read_through(files_under(step_dir))
    settle()
    got = sut.restore(step, abstract)
    extra["peak_extra_bytes"] = got.peak
    if got.record is not None:
        extra["served_bytes"] = dict(got.record.bytes_by_tier)
    if check is not None:
        extra["equal"] = same_values(check, got.out)
    seconds = got.seconds
    del got
    trim()
    return seconds, extra


class OursCases:
    """resilient_ckpt: a RAM tier (in `shm_dir`) and a local tier, both every step."""

    def __init__(self, workdir: str, shm_dir: str):
        import resilient_ckpt as rc
        self.rc = rc
        self.dir = os.path.join(workdir, "resilient_ckpt")
        self.shm = shm_dir
        self.sut = self.open(keep=1)

    def open(self, keep: int) -> Ours:
        rc = self.rc
        return Ours(self.dir, [rc.RamTier(every=1, keep=keep, path=self.shm),
                               rc.LocalTier(every=1, keep=keep)])

    def save(self, step: int, state) -> tuple[dict[str, float], int | None, dict]:
        return save_case(self.sut, step, state)

    def restore(self, tier: str, step: int, abstract, cold: bool, check=None
                ) -> tuple[float, dict]:
        rc = self.rc
        t = rc.RamTier(every=1, keep=1, path=self.shm) if tier == "ram" else rc.LocalTier(
            every=1, keep=1)
        with Ours(self.dir, [t], read_only=True, cleanup_tmp_directories=False) as r:
            return restore_case(r, step, abstract, None if tier == "ram" else
                                os.path.join(self.dir, str(step)), cold, check)

    def first_save_after_restore(self, step: int, abstract) -> float:
        """A resumed job's first save: a new manager on the same tiers restores
        `step` and, 1 s later, saves the restored state as step + 1; its
        blocking time."""
        import orbax.checkpoint as ocp
        self.sut.close()  # one writer per directory: this job "ended"
        m = self.open(keep=2).mngr
        try:
            restored = m.restore(step, args=ocp.args.StandardRestore(abstract))
            time.sleep(1.0)  # the resumed job's first steps (a compile, at least)
            t, started = timed(m.save, step + 1, args=ocp.args.StandardSave(restored))
            assert started, f"step {step + 1} was not saved"
            m.wait_until_finished()
            del restored
            m.delete(step + 1)
        finally:
            m.close()
            self.sut = self.open(keep=1)
        trim()
        return t

    def save_local_alone(self, step: int, state) -> float:
        """The local tier's write time when it is the manager's only tier."""
        d = self.dir + "-local-alone"
        sut = Ours(d, [self.rc.LocalTier(every=1, keep=1)])
        try:
            return tier_seconds(sut.save(step, state).record, "local", step)
        finally:
            sut.close()
            set_aside(d)
            trim()

    def lose_ram_copy(self, step: int) -> None:
        """Removes the RAM tier's copy of `step`, as a host that lost its memory
        would (a restore reads the local tier when the RAM tier has no copy), so
        the local restores run with what Orbax's run with: no RAM-tier copy in
        /dev/shm (4 GB of a 24 GB machine at 4 GB)."""
        shutil.rmtree(os.path.join(self.shm, str(step)), ignore_errors=True)
        trim()

    def drop(self) -> None:
        self.sut.drop()
        trim()

    def close(self) -> None:
        self.sut.close()


class OrbaxCases:
    """Orbax: its CheckpointManager (async) on the local disk."""

    def __init__(self, workdir: str):
        self.dir = os.path.join(workdir, "orbax")
        self.sut = Orbax(self.dir, enable_async_checkpointing=True)

    def save(self, step: int, state) -> tuple[dict[str, float], int | None, dict]:
        return save_case(self.sut, step, state)

    def restore(self, step: int, abstract, cold: bool, check=None) -> tuple[float, dict]:
        return restore_case(self.sut, step, abstract, os.path.join(self.dir, str(step)),
                            cold, check)

    def drop(self) -> None:
        self.sut.drop()

    def close(self) -> None:
        self.sut.close()


# ---------------------------------------------------------------- one size

def fit_size(want: int, shm_dir: str) -> tuple[int, str | None]:
    """The state size that fits: the RAM tier needs one state in /dev/shm, and
    the process about 4.5 states of memory at its peak (state, snapshot pool,
    RAM-tier copy, a restored state, Orbax's host copy)."""
    shm_free = shutil.disk_usage(os.path.dirname(shm_dir) or "/dev/shm").free
    mem = mem_available()
    fits = min(want, int(shm_free / 1.2), int(mem / 4.5))
    if fits < want:
        why = (f"shrunk from {want} to {fits} bytes: /dev/shm has {shm_free} free, "
               f"MemAvailable is {mem}")
        log.warning("%s", why)
        return fits, why
    return want, None


def state_label(want: int, state: str) -> str:
    """The size label of a run's lines and summary keys (the state's name
    first, for any state but the usual one)."""
    return size_label(want) if state == "train" else f"{state}-{size_label(want)}"


def run_size(want: int, repeats: int, args, mesh
             ) -> tuple[dict[tuple[str, str], float], list[dict]]:
    """The medians per (system, case), and the lines printed."""
    label = state_label(want, args.state)
    workdir = tempfile.mkdtemp(prefix=f"bench-sr-{label}-", dir=args.workdir)
    shm_dir = tempfile.mkdtemp(prefix=f"bench-sr-{label}-", dir=args.shm)
    nbytes, shrunk = fit_size(want, shm_dir)
    log.info("[%s] building the state (%d bytes asked) ...", label, nbytes)
    t, state = timed(build_state, args.state, nbytes, mesh)
    jax.block_until_ready(state)
    actual = tree_bytes(state)
    leaves = jax.tree.leaves(state)
    shards = unique_shards(state)
    log.info("[%s] state: %d leaves, %d unique shards, %.3f GB, built in %.1fs; "
             "MemAvailable %.1f GB", label, len(leaves), len(shards), actual / 1e9, t,
             mem_available() / 1e9)
    abstract = abstract_of(state)
    runs: dict[tuple[str, str], list[float]] = {}
    extras: dict[tuple[str, str], dict] = {}

    def add(system: str, case: str, seconds: float, extra: dict | None = None) -> None:
        runs.setdefault((system, case), []).append(seconds)
        for k, v in (extra or {}).items():
            extras.setdefault((system, case), {}).setdefault(k, []).append(v)

    limit = Limit(workdir, args.write_threads)
    ours = OursCases(workdir, shm_dir)
    orbax = OrbaxCases(workdir)
    read_buf = np.zeros(max(v.nbytes for v in shards), np.uint8)
    try:
        log.info("[%s] first saves (a fresh job's: fresh memory)", label)
        for system, sut in (("resilient_ckpt", ours), ("orbax", orbax)):
            # Both settled: without the wait the second system's first save
            # ran right after the first one's clean-up (4 GB: Orbax 1.8 s
            # against our 8.3 s, ours first).
            settle()
            times, peak, _ = sut.save(0, state)
            add(system, "save_blocking_first", times["save_blocking"],
                {"peak_extra_bytes": peak})
            sut.drop()
        for r in range(repeats):
            step = r + 1
            check = state if (r == 0 and not args.no_verify) else None
            # limit
            add("limit", "host_copy", limit.host_copy(shards))
            touch, copy = limit.fresh_and_pretouched(shards, actual)
            add("limit", "first_touch_fresh", touch)
            add("limit", "host_copy_pretouched", copy)
            faults, check = limit.mapped_checksum(shards, actual)
            add("limit", "tmpfs_map_faults", faults)
            add("limit", "crc32c_touched", check)
            trim()
            t, paths = limit.write(shards)
            add("limit", "disk_write_fsync", t, {"threads": args.write_threads})
            for case, t in limit.reads(paths, read_buf).items():
                add("limit", case, t, {"cold_method": limit.cold_method}
                    if "cold" in case else None)
            limit.clean()
            log.info("[%s] repeat %d: limit done", label, r)
            # resilient_ckpt
            times, peak, phases = ours.save(step, state)
            for case, t in times.items():
                add("resilient_ckpt", case, t,
                    {"peak_extra_bytes": peak} if case == "save_total" else phases.get(case))
            t, extra = ours.restore("ram", step, abstract, False, check)
            add("resilient_ckpt", "restore_ram", t, extra)
            ours.lose_ram_copy(step)
            t, extra = ours.restore("local", step, abstract, False, check)
            add("resilient_ckpt", "restore_local_warm", t, extra)
            t, extra = ours.restore("local", step, abstract, True, check)
            add("resilient_ckpt", "restore_local_cold", t, extra)
            if r == repeats - 1:  # last: the bench's writer is reopened (a fresh pool) after it
                add("resilient_ckpt", "save_blocking_first_after_restore",
                    ours.first_save_after_restore(step, abstract))
            # before drop(): a timed write must not follow a large delete (set_aside)
            add("resilient_ckpt", "save_tier_local_alone", ours.save_local_alone(step, state))
            ours.drop()
            log.info("[%s] repeat %d: resilient_ckpt done", label, r)
            # orbax
            times, peak, _ = orbax.save(step, state)
            for case, t in times.items():
                add("orbax", case, t,
                    {"peak_extra_bytes": peak} if case == "save_total" else None)
            t, extra = orbax.restore(step, abstract, False, check)
            add("orbax", "restore_local_warm", t, extra)
            t, extra = orbax.restore(step, abstract, True, check)
            add("orbax", "restore_local_cold", t, extra)
            orbax.drop()
            log.info("[%s] repeat %d: orbax done; %s", label, r, {
                f"{s}/{c}": round(v[-1], 3) for (s, c), v in runs.items()})
    finally:
        ours.close()
        orbax.close()
        limit.clean()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)

    medians, lines = {}, []
    for (system, case), v in runs.items():
        med = statistics.median(v)
        medians[(system, case)] = med
        line = {"bench": BENCH, "system": system, "case": case, "bytes": actual,
                "devices": jax.device_count(), "size": label, "state": args.state,
                "leaves": len(leaves), "unique_shards": len(shards),
                "runs_s": [round(x, 4) for x in v], "median_s": round(med, 4),
                "gb_per_s": round(actual / med / 1e9, 3) if med > 0 else None}
        for k, vals in extras.get((system, case), {}).items():
            if k == "peak_extra_bytes":  # the worst run
                line.update(worst_peak(vals, actual))
                continue
            uniq = [x for i, x in enumerate(vals) if x not in vals[:i]]
            line[k] = uniq[0] if len(uniq) == 1 else vals
        if shrunk:
            line["shrunk"] = shrunk
        emit(line)
        lines.append(line)
    del state, shards, abstract, leaves
    trim()
    return medians, lines


def memory_ratios(lines: list[dict], label: str) -> dict[str, float]:
    """Each system's worst peak memory of a save (its first, with a fresh
    snapshot pool, or a later one with its tier writes) and of a restore
    (any tier, the restored state included), over the state + 256 MiB."""
    peaks = {(ln["system"], ln["case"]): ln["peak_extra_bytes"] for ln in lines
             if ln.get("peak_extra_bytes") is not None}
    return peaks_vs_budget(peaks, lines[0]["bytes"], label) if lines else {}


def ratios(m: dict[tuple[str, str], float], label: str) -> dict[str, float]:
    def q(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        if a not in m or b not in m or m[b] <= 0:
            return None
        return round(m[a] / m[b], 3)
    ours, orb, lim = "resilient_ckpt", "orbax", "limit"
    if (lim, "tmpfs_map_faults") in m and (lim, "crc32c_touched") in m:
        m = {**m, (lim, "mapped_checksum"): m[(lim, "tmpfs_map_faults")]
             + m[(lim, "crc32c_touched")]}
    r = {
        # > 1: we are faster
        "restore_ram_speedup_vs_orbax_local_warm": q((orb, "restore_local_warm"),
                                                     (ours, "restore_ram")),
        "restore_local_warm_speedup_vs_orbax": q((orb, "restore_local_warm"),
                                                 (ours, "restore_local_warm")),
        "restore_local_cold_speedup_vs_orbax": q((orb, "restore_local_cold"),
                                                 (ours, "restore_local_cold")),
        "save_blocking_speedup_vs_orbax": q((orb, "save_blocking"), (ours, "save_blocking")),
        # our time over the limit's: 1 is the limit, > 1 slower
        "restore_local_cold_vs_limit": q((ours, "restore_local_cold"), (lim, "read_cold")),
        "orbax_restore_local_cold_vs_limit": q((orb, "restore_local_cold"), (lim, "read_cold")),
        "restore_local_cold_vs_limit_fresh_memory": q((ours, "restore_local_cold"),
                                                      (lim, "read_cold_fresh_memory")),
        "restore_local_warm_vs_limit": q((ours, "restore_local_warm"), (lim, "read_warm")),
        "restore_ram_vs_limit_host_copy": q((ours, "restore_ram"), (lim, "host_copy")),
        "restore_ram_vs_limit_pretouched": q((ours, "restore_ram"),
                                             (lim, "host_copy_pretouched")),
        # what a checked restore from the RAM tier's own pages pays (one thread)
        "restore_ram_vs_limit_mapped_checksum": q((ours, "restore_ram"),
                                                  (lim, "mapped_checksum")),
        "first_save_vs_later": q((ours, "save_blocking_first"), (ours, "save_blocking")),
        "first_save_after_restore_vs_later": q((ours, "save_blocking_first_after_restore"),
                                               (ours, "save_blocking")),
        "orbax_first_save_vs_later": q((orb, "save_blocking_first"), (orb, "save_blocking")),
        "save_blocking_vs_limit": q((ours, "save_blocking"), (lim, "host_copy")),
        "orbax_save_blocking_vs_limit": q((orb, "save_blocking"), (lim, "host_copy")),
        "save_blocking_vs_limit_pretouched": q((ours, "save_blocking"),
                                               (lim, "host_copy_pretouched")),
        "orbax_save_blocking_vs_limit_pretouched": q((orb, "save_blocking"),
                                                     (lim, "host_copy_pretouched")),
        # bandwidth ratios (limit time / our time): 1 is the limit, < 1 slower
        "save_local_vs_limit": q((lim, "disk_write_fsync"), (ours, "save_tier_local")),
        "save_local_alone_vs_limit": q((lim, "disk_write_fsync"),
                                       (ours, "save_tier_local_alone")),
        "save_local_end_to_end_vs_limit": q((lim, "disk_write_fsync"), (ours, "save_total")),
        "orbax_save_local_vs_limit": q((lim, "disk_write_fsync"), (orb, "save_total")),
    }
    return {f"{k}_{label}": v for k, v in r.items()}


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, sizes="1GB,4GB", quick_sizes="128MB", plots=True)
    ap.add_argument("--workdir", default=None,
                    help="directory on the disk to measure (default: the system temp dir)")
    ap.add_argument("--shm", default="/dev/shm", help="tmpfs for the RAM tier (default /dev/shm)")
    ap.add_argument("--write-threads", type=int, default=8,
                    help="threads for the limit's disk write (default 8, as resilient_ckpt's "
                         "io_threads)")
    ap.add_argument("--state", choices=("train", "decoder"), default="train",
                    help="the state: 'train' (119 leaves, the figures' usual state) or "
                         "'decoder' (a 32-layer decoder with Adam's moments, about 870 "
                         "leaves, FSDP: bench/harness/state.py); a decoder run's sizes "
                         "are labelled decoder-<size>")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip checking restored values against the state (first repeat)")
    ap.add_argument("--summarize", metavar="JSONL", default=None,
                    help="measure nothing: read the lines of an earlier run from this file "
                         "and print them and the summary again (with --plot, plot them)")
    args = parse_options(ap, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if jax.device_count() != 8:
        log.warning("running on %d devices, not 8", jax.device_count())
    mesh = make_mesh(4, 2)
    summary: dict = {}
    if args.summarize:
        by_size: dict[str, dict] = {}
        lines_by_size: dict[str, list[dict]] = {}
        for ln in read_jsonl(args.summarize):
            if ln.get("bench") == BENCH and "case" in ln:
                emit(ln)
                by_size.setdefault(ln["size"], {})[(ln["system"], ln["case"])] = ln["median_s"]
                lines_by_size.setdefault(ln["size"], []).append(ln)
        for label, medians in by_size.items():
            summary.update(ratios(medians, label))
            summary.update(memory_ratios(lines_by_size[label], label))
    for n in args.sizes if not args.summarize else []:
        medians, lines = run_size(n, args.repeats, args, mesh)
        summary.update(ratios(medians, state_label(n, args.state)))
        summary.update(memory_ratios(lines, state_label(n, args.state)))
    emit_summary(BENCH, summary, GOALS, plot=args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
