"""Writing a step to a tier under the commit rule.

Write order per (step, tier): mark the step as being written, put every chunk
(each atomically), flush, then commit the manifest with a create-only put: the
manifest is the commit record, so a step without one does not exist for any
reader. What a tier holds is read back by `catalog.tier_steps`; dead writers'
leftovers are removed by `cleanup`.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import time
from collections.abc import Callable

from ..core import layout, manifest as mf
from ..core.codec import Encoding
from ..errors import CorruptCheckpointError, StepAlreadyExistsError
from ..storage.base import Storage
from . import packing, transfer
from .snapshot import Snapshot

log = logging.getLogger("resilient_ckpt")


@dataclasses.dataclass(frozen=True)
class TierWrite:
    """What one tier's write of one step did."""

    tier: str
    step: int
    ok: bool
    seconds: float
    bytes: int
    error: str | None = None
    source: str | None = None  # where the bytes came from: "host snapshot", or tier names
    stored_bytes: int | None = None  # bytes as stored (after the codec)
    skipped: str | None = None  # why the write never ran (superseded, ...); ok is False
    # Seconds of each part of a committed write: "chunks" (every chunk put),
    # "flush" (made durable), "manifest" (built and committed), "observe" (the
    # catalog's view updated with it); their sum is `seconds`.
    phases: dict[str, float] | None = None

    @classmethod
    def skip(cls, tier: str, step: int, reason: str) -> TierWrite:
        return cls(tier, step, False, 0.0, 0, skipped=reason)


def write_step(storage: Storage, tier: str, naming: layout.StepNaming, snap: Snapshot,
               header: dict, io: cf.Executor, encoding: Encoding | None = None,
               on_commit: Callable[[mf.Manifest], None] | None = None,
               primary_only: bool = False, claim: Callable[[], None] | None = None
               ) -> TierWrite:
    """Writes `snap` (only its primary chunks, on a tier every host shares) to
    `storage` and commits it; raises on failure, after removing what it wrote
    (never anything committed)."""
    enc = encoding or Encoding()
    d = naming.name(snap.step)
    idx = snap.indices(primary_only)
    sizes = [int(snap.chunks[i].data.nbytes) for i in idx]
    keys = [snap.chunks[i].key for i in idx]
    groups = packing.plan(sizes)
    objects = [packing.object_name(g, keys, sizes, snap.save_id, header["process_index"])
               for g in groups]

    def put(job: tuple[list[int], str]) -> list[mf.ChunkRecord]:
        group, name = job
        recs = [snap.record(idx[j]) for j in group]
        data = [snap.chunks[idx[j]].data for j in group]
        if not packing.packed(group, sizes):
            return [transfer.put_host(storage, f"{d}/{name}", data[0], recs[0], enc)]
        if enc.codec == "raw":
            return packing.put_raw(storage, d, name, recs, [x.data for x in data])
        return packing.put_streamed(storage, d, name, recs,
                                    [[transfer.MemorySource(x)] for x in data], enc)[0]

    def manifest(stored: dict) -> mf.Manifest:
        return mf.Manifest(step=snap.step, save_id=snap.save_id,
                           items=_with_stored(snap.manifest_items(primary_only), stored),
                           **header)
    return _commit(storage, tier, snap.step, d, objects,
                   [(put, (g, o), sum(sizes[j] for j in g)) for g, o in zip(groups, objects,
                                                                           strict=True)],
                   manifest, io, on_commit, "host snapshot", claim)


def copy_step(storage: Storage, tier: str, naming: layout.StepNaming, m: mf.Manifest,
              sources: list[tuple[str, Storage, mf.Manifest]], io: cf.Executor,
              encoding: Encoding, on_commit: Callable[[mf.Manifest], None] | None = None,
              only: frozenset[str] | None = None,
              claim: Callable[[], None] | None = None) -> TierWrite:
    """Copies one process's committed step `m` (only the chunks in `only`,
    when given) from the first of `sources` (tier name, storage, its manifest
    of `m` there, which says where each chunk lies in it) whose copy of each
    chunk verifies, encoding on the way, and commits it to `storage` under
    the same save; raises on failure, after removing what it wrote. The
    devices are not read again."""
    d = naming.name(m.step)
    if only is not None:
        m = dataclasses.replace(m, items=tuple(dataclasses.replace(it, leaves=tuple(
            dataclasses.replace(lf, chunks=tuple(c for c in lf.chunks if c.key in only))
            for lf in it.leaves)) for it in m.items))
    chunks = [c for _, _, c in m.chunks()]
    at = [{c.key: c for _, _, c in sm.chunks()} for _, _, sm in sources]
    for c in chunks:
        if any(c.key in a and a[c.key].codec != "raw" for a in at):
            raise CorruptCheckpointError(f"step {m.step}: chunk {c.key} is stored as "
                                         f"zstd in one of {[n for n, _, _ in sources]}; "
                                         "copies are made from raw copies only")
    used: set[str] = set()

    def srcs(c: mf.ChunkRecord) -> tuple[list[transfer.Source], list[str]]:
        found = [(n, transfer.TierSource(st, d, a[c.key]))
                 for (n, st, _), a in zip(sources, at, strict=True) if c.key in a]
        return [s for _, s in found], [n for n, _ in found]

    def put(job: tuple[list[int], str]) -> list[mf.ChunkRecord]:
        group, name = job
        cs = [chunks[j] for j in group]
        got = [srcs(c) for c in cs]
        if not packing.packed(group, sizes):
            rec, i = transfer.store_first(storage, f"{d}/{name}", got[0][0], cs[0], encoding)
            used.add(got[0][1][i])
            return [rec]
        recs, picked = packing.put_streamed(storage, d, name, cs, [s for s, _ in got],
                                            encoding)
        used.update(names[i] for (_, names), i in zip(got, picked, strict=True))
        return recs

    def manifest(stored: dict) -> mf.Manifest:
        return dataclasses.replace(m, items=_with_stored(m.items, stored))
    sizes = [c.nbytes for c in chunks]
    keys = [c.key for c in chunks]
    groups = packing.plan(sizes)
    objects = [packing.object_name(g, keys, sizes, m.save_id, m.process_index) for g in groups]
    tw = _commit(storage, tier, m.step, d, objects,
                 [(put, (g, o), sum(sizes[j] for j in g))
                  for g, o in zip(groups, objects, strict=True)],
                 manifest, io, on_commit, None, claim)
    return dataclasses.replace(tw, source="+".join(n for n, _, _ in sources if n in used)
                               or None)


def _commit(storage: Storage, tier: str, step: int, d: str, keys: list[str], jobs: list,
            manifest: Callable[[dict], mf.Manifest], io: cf.Executor,
            on_commit: Callable[[mf.Manifest], None] | None, source: str | None,
            claim: Callable[[], None] | None = None) -> TierWrite:
    """`commit_chunks`, the chunks written by the chunk jobs (fn, arg, bytes)
    on `io`, small ones in groups (`_groups`)."""
    def write() -> list[mf.ChunkRecord]:
        futures = [io.submit(_run_group, g) for g in _groups(jobs)]
        stored: list[mf.ChunkRecord] = []
        errors = []
        for f in futures:
            try:
                stored.extend(rec for recs in f.result() for rec in recs)
            except BaseException as e:  # noqa: BLE001 - collected and re-raised
                errors.append(e)
        if errors:
            raise errors[0]
        return stored
    return commit_chunks(storage, tier, step, d, keys, write, manifest, on_commit, source,
                         claim)


GROUP_BYTES = 4 << 20  # chunks go to the I/O pool in runs of up to this many bytes,
GROUP_MOST = 32  # ... and of up to this many chunks,
MIN_GROUPS = 64  # ... in no fewer runs than this (given as many chunks): every thread has work


def _groups(jobs: list) -> list[list]:
    """`jobs` (fn, arg, bytes) in consecutive runs, each one task of the pool:
    a save of thousands of small chunks paid a submit, a wake-up and a future
    per chunk, a large share of the pool's time. A
    chunk of GROUP_BYTES or more is a run of its own."""
    most = max(1, min(GROUP_MOST, len(jobs) // MIN_GROUPS))
    groups: list[list] = []
    run: list = []
    size = 0
    for fn, arg, nbytes in jobs:
        if run and (size + nbytes > GROUP_BYTES or len(run) == most):
            groups.append(run)
            run, size = [], 0
        run.append((fn, arg))
        size += nbytes
    if run:
        groups.append(run)
    return groups


def _run_group(group: list) -> list:
    """One run's jobs in order; the first failure ends it (the save fails and
    removes all its chunks, written or not)."""
    return [fn(arg) for fn, arg in group]


def commit_chunks(storage: Storage, tier: str, step: int, d: str, keys: list[str],
                  write: Callable[[], list[mf.ChunkRecord]],
                  manifest: Callable[[dict], mf.Manifest],
                  on_commit: Callable[[mf.Manifest], None] | None, source: str | None,
                  claim: Callable[[], None] | None = None) -> TierWrite:
    """Marks `d` as being written, runs `write` (it puts the chunks named
    `keys` and returns their records as stored), then takes the step's `claim`
    (claim.py; it raises if another save holds the step) and commits the
    manifest create-only. On a failure before the commit, every one of `keys`
    is removed (none belongs to another save)."""
    t0 = time.perf_counter()
    storage.begin_write(d)
    committing = False
    try:
        stored = {rec.key: rec for rec in write()}
        t1 = time.perf_counter()
        storage.flush(d)
        t2 = time.perf_counter()
        m = manifest(stored)
        name = layout.manifest_name(m.process_index, m.process_count)
        data = mf.to_json(m)  # a manifest the writer refuses is known not committed
        if claim is not None:
            claim()
        committing = True
        if not storage.put_if_absent(f"{d}/{name}", data):
            committing = False
            raise StepAlreadyExistsError(
                f"step {step} was committed to the {tier} tier ({storage.url}/{d}) "
                "by another writer first; this save of it was dropped")
    except BaseException as e:
        if committing and not getattr(e, "nothing_written", False):
            # The commit itself failed, so whether our manifest landed is
            # unknown: removing the chunks could tear a committed step. They
            # stay; without a manifest, cleanup or orphan collection removes them.
            log.warning("commit of step %d to the %s tier (%s/%s) failed with its "
                        "outcome unknown; its chunks are left in place", step, tier,
                        storage.url, d)
            _end_quietly(storage, d)
            raise
        # Known not committed (a chunk failed, another writer won, or the
        # manifest's write failed before its link, as on a full disk).
        _remove(storage, d, keys)
        _end_quietly(storage, d)
        try:
            storage.remove_empty_dir(d)
        except OSError:
            pass  # not empty after all, or gone: cleanup has it either way
        raise
    storage.end_write(d)
    t3 = time.perf_counter()
    if on_commit is not None:
        on_commit(m)
    t4 = time.perf_counter()
    phases = {"chunks": t1 - t0, "flush": t2 - t1, "manifest": t3 - t2, "observe": t4 - t3}
    return TierWrite(tier, step, True, t4 - t0, m.nbytes, source=source,
                     stored_bytes=sum(r.stored_nbytes for r in stored.values()), phases=phases)


def _end_quietly(storage: Storage, d: str) -> None:
    """`end_write` after a failure: its own failure (the disk that failed the
    save, remounted read-only) is logged, so the save's error is the one raised."""
    try:
        storage.end_write(d)
    except OSError as e:
        log.warning("could not end the failed save in %s/%s (%s); cleanup removes its "
                    "marker", storage.url, d, e)


def _remove(storage: Storage, d: str, keys: list[str]) -> None:
    """Removes a failed save's chunks (its keys carry its own save id, so nothing
    of another save is touched). Any chunk may have landed, even one whose put
    reported a failure, so all are tried; the first failure stops it (the rest
    are orphans that cleanup collects) so a dead network does not hold the
    worker for one retry deadline per chunk. On a file tier, this writer's
    temporaries left in `d` go too (a remote tier's parts are removed by its
    upload)."""
    for key in keys:
        try:
            storage.delete(f"{d}/{key}")
        except OSError as e:
            log.warning("could not remove %s/%s/%s after a failed save (%s); later cleanup "
                        "removes it", storage.url, d, key, e)
            return
    if storage.remote:
        return
    me = layout.Writer.me()
    try:
        for n in storage.list(d):
            if layout.parse_tmp_name(n) == me:
                storage.delete(f"{d}/{n}")
    except OSError as e:
        log.warning("could not remove temporaries in %s/%s after a failed save (%s); "
                    "later cleanup removes them", storage.url, d, e)


def _with_stored(items: tuple, stored: dict) -> tuple:
    """Item records whose chunks are replaced by their records as stored."""
    return tuple(dataclasses.replace(it, leaves=tuple(
        dataclasses.replace(lf, chunks=tuple(stored.get(c.key, c) for c in lf.chunks))
        for lf in it.leaves)) for it in items)
