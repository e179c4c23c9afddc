"""Save and restore of a sharded train state: resilient_ckpt vs Orbax vs the machine.

One run measures, interleaved within each repeat so that noise from other
tenants hits every system alike:

- limit: the physical references on the same bytes: a plain per-shard copy of
  the state to fresh host memory (np.array of each unique shard: the floor of a
  donation-safe snapshot), the same copy into pre-touched memory, first touch of
  fresh memory, disk write + fsync of one file per shard, and sequential reads
  of those files from a cold and a warm page cache;
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
after `_common.settle` (3 s for what the case before left running, threads
and the kernel's writeback, to finish), so no case runs in another's wake.
The limit's write and the local tier's write alone follow no large delete of
the bench's own: their directories are renamed aside and deleted at the end
(`set_aside`). The managers' own deletes (retention, `drop`) stay as they are.

Peak memory: every save (with its tier writes) and every restore of either
system is run inside a reset of the process's resident high-water mark
(_common.PeakRss), and its line carries the worst run's bytes above the level
before it (`peak_extra_bytes`, the restored state included); the summary
holds each system's worst save and restore over the state + 256 MiB.

Output (docs/bench_contract.md): one JSON object per line on stdout, one per
(system, case, size), then a summary line with the ratios; logs go to stderr.

    python bench/save_restore.py                 # 1 GB and 4 GB, 3 repeats
    python bench/save_restore.py --quick         # 128 MB, 2 repeats (< 2 min)
    python bench/save_restore.py --sizes 2GB --repeats 5 --plot docs/x.png
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

from _common import (
    PeakRss,
    abstract_of,
    bench_parser,
    emit,
    emit_summary,
    files_under,
    make_mesh,
    parse_options,
    peaks_vs_budget,
    prepare,
    proc_kb,
    read_jsonl,
    read_through,
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

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


# ---------------------------------------------------------------- helpers

def mem_available() -> int:
    return proc_kb("/proc/meminfo", "MemAvailable") * 1024


def timed(fn, *a, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


def drop_caches(paths: list[str]) -> str:
    """Empties the page cache of `paths`: drop_caches where permitted (root),
    else posix_fadvise(DONTNEED) per file. Returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


# ---------------------------------------------------------------- the state

def build_state(total_bytes: int, mesh: Mesh) -> dict:
    """A train-state-like pytree of about `total_bytes`: params and two Adam
    moments of the same structure, float32 and bfloat16 leaves of varied shapes,
    sharded over (data, model), some leaves replicated, plus a step counter."""
    pbytes = total_bytes // 3
    d = 1024 if pbytes >= 96 * 2**20 else 256
    f = 4 * d
    layer_bytes = 4 * 3 * d * d + 4 * d * d + 2 * d * f * 2 + 4 * f + 4 * 2 * d
    n_layers = max(1, int(pbytes * 0.7) // layer_bytes)
    pos = 4 * 512 * d  # replicated, 8 copies in memory: keep it small
    rest = max(pbytes - n_layers * layer_bytes - pos, 8 * d * 4)
    vocab = max(8, (rest // 2 // (4 * d)) // 8 * 8)
    head = max(8, (rest - vocab * d * 4) // (4 * d) // 8 * 8)
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    spec = {  # name -> (shape, dtype, PartitionSpec)
        "embed": ((vocab, d), f32, P("data", "model")),
        "pos_embed": ((512, d), f32, P()),
        "lm_head": ((d, head), f32, P(None, "data")),  # replicated over "model"
    }
    for i in range(n_layers):
        spec.update({
            f"layer_{i:02d}/qkv": ((d, 3 * d), f32, P("data", "model")),
            f"layer_{i:02d}/out": ((d, d), f32, P("model", "data")),
            f"layer_{i:02d}/mlp_in": ((d, f), bf16, P("data", "model")),
            f"layer_{i:02d}/mlp_out": ((f, d), bf16, P("model", "data")),
            f"layer_{i:02d}/mlp_bias": ((f,), f32, P("model")),
            f"layer_{i:02d}/ln_scale": ((d,), f32, P()),
        })

    def make(name: str, seed: int) -> jax.Array:
        shape, dtype, pspec = spec[name]
        sharding = NamedSharding(mesh, pspec)

        def cb(index):
            sub = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
            start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))
            rng = np.random.default_rng([seed, *start])
            return rng.random(sub, dtype=np.float32).astype(dtype)
        return jax.make_array_from_callback(shape, sharding, cb)

    def tree(seed: int) -> dict:
        out: dict = {}
        for j, name in enumerate(spec):
            node = out
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = make(name, seed * 10_000 + j)
        return out

    rep = NamedSharding(mesh, P())
    return {"params": tree(1),
            "opt_state": {"mu": tree(2), "nu": tree(3),
                          "count": jax.device_put(np.int32(7), rep)},
            "step": jax.device_put(np.int32(7), rep)}


def unique_shards(state) -> list[np.ndarray]:
    """Zero-copy numpy views of every unique shard (replica 0), largest first."""
    out = [np.asarray(s.data) for a in jax.tree.leaves(state)
           for s in a.addressable_shards if s.replica_id == 0]
    return sorted(out, key=lambda v: -v.nbytes)


def tree_bytes(state) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(state))


# ---------------------------------------------------------------- the systems

def write_files(d: str, shards: list[np.ndarray], threads: int, fsync: bool = True
                ) -> list[str]:
    """One file per unique shard in directory `d`, buffered write + fsync each,
    in a pool of `threads` (as wide as resilient_ckpt's I/O pool); then the
    directory is fsynced. With `fsync` False, no fsync at all (a RAM tier's
    writes into tmpfs). Returns the paths."""
    paths = [os.path.join(d, f"shard.{i:05d}") for i in range(len(shards))]

    def put(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(shards[i].reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(put, range(len(paths))))
    if not fsync:
        return paths
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return paths


class Limit:
    """The physical references on the bytes of the state."""

    def __init__(self, workdir: str, write_threads: int):
        self.dir = os.path.join(workdir, "limit")
        self.write_threads = write_threads
        self.cold_method = None

    def host_copy(self, shards: list[np.ndarray]) -> float:
        t, copies = timed(lambda: [np.array(v) for v in shards])
        del copies
        return t

    def fresh_and_pretouched(self, shards: list[np.ndarray], nbytes: int) -> tuple[float, float]:
        """First touch of fresh memory (np.empty + fill), then a copy of every
        shard into that now-touched memory (what a reused buffer pool costs)."""
        t0 = time.perf_counter()
        pool = np.empty(nbytes, np.uint8)
        pool.fill(0)
        touch = time.perf_counter() - t0
        t0 = time.perf_counter()
        off = 0
        for v in shards:
            n = v.nbytes
            np.copyto(pool[off:off + n], v.reshape(-1).view(np.uint8))
            off += n
        copy = time.perf_counter() - t0
        del pool
        return touch, copy

    def write(self, shards: list[np.ndarray]) -> tuple[float, list[str]]:
        """`write_files` into a fresh directory (its time only)."""
        set_aside(self.dir)
        os.makedirs(self.dir)
        t0 = time.perf_counter()
        paths = write_files(self.dir, shards, self.write_threads)
        return time.perf_counter() - t0, paths

    def reads(self, paths: list[str], buf: np.ndarray) -> dict[str, float]:
        out = {}
        self.cold_method = drop_caches(paths)
        out["read_cold"], _ = timed(read_through, paths, buf)
        out["read_warm"], _ = timed(read_through, paths, buf)
        self.cold_method = drop_caches(paths)
        t0 = time.perf_counter()
        fresh = []
        for p in paths:  # into fresh memory, as a restore must (its arrays are new)
            m = mmap.mmap(-1, max(os.path.getsize(p), 1))
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            read_through([p], np.frombuffer(m, np.uint8))
            fresh.append(m)
        out["read_cold_fresh_memory"] = time.perf_counter() - t0
        for m in fresh:
            m.close()
        del fresh
        self.cold_method = drop_caches(paths)
        bufs = np.split(buf[:buf.size // 4 * 4], 4)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda i: read_through(paths[i::4], bufs[i]), range(4)))
        out["read_cold_4threads"] = time.perf_counter() - t0
        return out

    def clean(self) -> None:
        set_aside(self.dir)


def set_aside(d: str) -> None:
    """Moves directory `d` (if there) into the directory "aside" beside it,
    removed with the bench's work directory after the last repeat: on a file
    system mounted with `discard` (this machine's root), writes in the 15-30 s
    after a large deletion run 2.5-4x slower (docs/environment.md), so a write
    timed after a delete would time that."""
    if os.path.exists(d):
        aside = os.path.join(os.path.dirname(d), "aside")
        os.makedirs(aside, exist_ok=True)
        os.rename(d, os.path.join(aside, f"{os.path.basename(d)}.{time.time_ns()}"))


def tier_seconds(tw, name: str, step: int) -> float:
    """A tier write's seconds; raises if that tier did not save `step`."""
    if isinstance(tw, str) or not tw.ok:
        raise RuntimeError(f"tier {name} did not save step {step}: {tw}")
    return tw.seconds


class Ours:
    def __init__(self, workdir: str, shm_dir: str):
        import resilient_ckpt as rc
        self.rc = rc
        self.dir = os.path.join(workdir, "resilient_ckpt")
        self.shm = shm_dir
        self.mngr = self.open(keep=1)

    def open(self, keep: int):
        rc = self.rc
        return rc.CheckpointManager(self.dir, options=rc.CheckpointManagerOptions(tiers=[
            rc.RamTier(every=1, keep=keep, path=self.shm), rc.LocalTier(every=1, keep=keep)]))

    def save(self, step: int, state) -> tuple[dict[str, float], int | None, dict]:
        """Seconds per case, the peak memory of the save and its writes, and
        each tier write's phases (case -> {"chunks_s": ..., ...})."""
        import orbax.checkpoint as ocp
        for s in self.mngr.all_steps():  # one step at a time in RAM: the memory is tight
            self.mngr.delete(s)
        trim()
        with PeakRss() as peak:
            t0 = time.perf_counter()
            started = self.mngr.save(step, args=ocp.args.StandardSave(state))
            blocking = time.perf_counter() - t0
            self.mngr.wait_until_finished()
            total = time.perf_counter() - t0
        assert started, f"step {step} was not saved"
        rec = self.mngr.save_records[-1]
        out = {"save_blocking": blocking, "save_total": total, "save_snapshot": rec.snapshot_s}
        phases = {}
        for name, tw in rec.tiers.items():
            out[f"save_tier_{name}"] = tier_seconds(tw, name, step)
            phases[f"save_tier_{name}"] = {f"{k}_s": round(v, 4)
                                           for k, v in (tw.phases or {}).items()}
        return out, peak.extra, phases

    def reader(self, tier: str):
        rc = self.rc
        t = rc.RamTier(every=1, keep=1, path=self.shm) if tier == "ram" else rc.LocalTier(
            every=1, keep=1)
        return rc.CheckpointManager(self.dir, options=rc.CheckpointManagerOptions(
            tiers=[t], read_only=True, cleanup_tmp_directories=False))

    def restore(self, tier: str, step: int, abstract, cold: bool, check=None
                ) -> tuple[float, dict]:
        import orbax.checkpoint as ocp
        r = self.reader(tier)
        try:
            step_dir = os.path.join(self.shm if tier == "ram" else self.dir, str(step))
            extra = {}
            if tier == "local":
                if cold:
                    extra["cold_method"] = drop_caches(files_under(step_dir))
                else:
                    read_through(files_under(step_dir))
            settle()
            with PeakRss() as peak:  # the restored state is alive at its end
                t, out = timed(r.restore, step, args=ocp.args.StandardRestore(abstract))
            extra["peak_extra_bytes"] = peak.extra
            extra["served_bytes"] = dict(r.last_restore.bytes_by_tier)
            if check is not None:
                extra["equal"] = same_values(check, out)
            del out
            trim()
            return t, extra
        finally:
            r.close()

    def first_save_after_restore(self, step: int, abstract) -> float:
        """A resumed job's first save: a new manager on the same tiers restores
        `step` and, 1 s later, saves the restored state as step + 1; its
        blocking time."""
        import orbax.checkpoint as ocp
        self.mngr.close()  # one writer per directory: this job "ended"
        m = self.open(keep=2)
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
            self.mngr = self.open(keep=1)
        trim()
        return t

    def save_local_alone(self, step: int, state) -> float:
        """The local tier's write time when it is the manager's only tier."""
        import orbax.checkpoint as ocp
        rc, d = self.rc, self.dir + "-local-alone"
        mngr = rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
            tiers=[rc.LocalTier(every=1, keep=1)]))
        try:
            assert mngr.save(step, args=ocp.args.StandardSave(state)), f"step {step} not saved"
            mngr.wait_until_finished()
            return tier_seconds(mngr.save_records[-1].tiers["local"], "local (alone)", step)
        finally:
            mngr.close()
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
        for s in self.mngr.all_steps():
            self.mngr.delete(s)
        trim()

    def close(self) -> None:
        self.mngr.close()


class Orbax:
    def __init__(self, workdir: str):
        import orbax.checkpoint as ocp
        self.ocp = ocp
        self.dir = os.path.join(workdir, "orbax")
        self.mngr = ocp.CheckpointManager(self.dir, options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True))

    def save(self, step: int, state) -> tuple[dict[str, float], int | None, dict]:
        """As Ours.save; Orbax reports no phases."""
        for s in self.mngr.all_steps():
            self.mngr.delete(s)
        trim()
        with PeakRss() as peak:
            t0 = time.perf_counter()
            started = self.mngr.save(step, args=self.ocp.args.StandardSave(state))
            blocking = time.perf_counter() - t0
            self.mngr.wait_until_finished()
            total = time.perf_counter() - t0
        assert started, f"orbax did not save step {step}"
        return {"save_blocking": blocking, "save_total": total}, peak.extra, {}

    def restore(self, step: int, abstract, cold: bool, check=None) -> tuple[float, dict]:
        step_dir = os.path.join(self.dir, str(step))
        extra = {}
        if cold:
            extra["cold_method"] = drop_caches(files_under(step_dir))
        else:
            read_through(files_under(step_dir))
        settle()
        with PeakRss() as peak:
            t, out = timed(self.mngr.restore, step, args=self.ocp.args.StandardRestore(abstract))
        extra["peak_extra_bytes"] = peak.extra
        if check is not None:
            extra["equal"] = same_values(check, out)
        del out
        trim()
        return t, extra

    def drop(self) -> None:
        for s in self.mngr.all_steps():
            self.mngr.delete(s)

    def close(self) -> None:
        self.mngr.close()


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


def run_size(want: int, repeats: int, args, mesh: Mesh
             ) -> tuple[dict[tuple[str, str], float], list[dict]]:
    """The medians per (system, case), and the lines printed."""
    label = size_label(want)
    workdir = tempfile.mkdtemp(prefix=f"bench-sr-{label}-", dir=args.workdir)
    shm_dir = tempfile.mkdtemp(prefix=f"bench-sr-{label}-", dir=args.shm)
    nbytes, shrunk = fit_size(want, shm_dir)
    log.info("[%s] building the state (%d bytes asked) ...", label, nbytes)
    t, state = timed(build_state, nbytes, mesh)
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
    ours = Ours(workdir, shm_dir)
    orbax = Orbax(workdir)
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
                "devices": jax.device_count(), "size": label,
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
        summary.update(ratios(medians, size_label(n)))
        summary.update(memory_ratios(lines, size_label(n)))
    emit_summary(BENCH, summary, GOALS, plot=args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
