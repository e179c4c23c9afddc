"""Writing a step to a tier and reading what tiers hold, under the commit rule.

Write order per (step, tier): mark the step as being written, put every chunk
(each atomically), flush, then commit the manifest with a create-only put: the
manifest is the commit record, so a step without one does not exist for any
reader. Reading side: `observe` lists steps and parses manifests (never every
object of every step: sizes are asked only of the chunks manifests name), and
`cleanup` removes dead writers' leftovers without touching live saves.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import errno
import logging
import time
from collections.abc import Callable

from . import layout, manifest as mf, transfer
from .claim import read as read_claim
from .errors import CorruptCheckpointError, StepAlreadyExistsError
from .selection import TierStep
from .snapshot import Snapshot
from .storage.base import Storage
from .transfer import Encoding

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

    def put(i: int) -> mf.ChunkRecord:
        c = snap.chunks[i]
        return transfer.put_host(storage, f"{d}/{c.key}", c.data, snap.record(i), enc)

    d = naming.name(snap.step)

    def manifest(stored: dict) -> mf.Manifest:
        return mf.Manifest(step=snap.step, save_id=snap.save_id,
                           items=_with_stored(snap.manifest_items(primary_only), stored),
                           **header)
    idx = snap.indices(primary_only)
    return _commit(storage, tier, snap.step, d, [snap.chunks[i].key for i in idx],
                   [(put, i, snap.chunks[i].data.nbytes) for i in idx], manifest, io, on_commit,
                   "host snapshot", claim)


def copy_step(storage: Storage, tier: str, naming: layout.StepNaming, m: mf.Manifest,
              sources: list[tuple[str, Storage]], io: cf.Executor, encoding: Encoding,
              on_commit: Callable[[mf.Manifest], None] | None = None,
              only: frozenset[str] | None = None,
              claim: Callable[[], None] | None = None) -> TierWrite:
    """Copies one process's committed step `m` (only the chunks in `only`,
    when given) from the first of `sources` (tier name, storage) whose copy of
    each chunk verifies, encoding on the way, and commits it to `storage` under
    the same save; raises on failure, after removing what it wrote. The devices
    are not read again."""
    d = naming.name(m.step)
    if only is not None:
        m = dataclasses.replace(m, items=tuple(dataclasses.replace(it, leaves=tuple(
            dataclasses.replace(lf, chunks=tuple(c for c in lf.chunks if c.key in only))
            for lf in it.leaves)) for it in m.items))
    chunks = [c for _, _, c in m.chunks()]
    for c in chunks:
        if c.codec != "raw":
            raise CorruptCheckpointError(f"step {m.step}: chunk {c.key} is stored as "
                                         f"{c.codec} in {sources[0][0]}; copies are made "
                                         "from raw copies only")
    used: set[str] = set()

    def put(c: mf.ChunkRecord) -> mf.ChunkRecord:
        srcs = [transfer.TierSource(st, f"{d}/{c.key}", c.nbytes) for _, st in sources]
        rec, i = transfer.store_first(storage, f"{d}/{c.key}", srcs, c, encoding)
        used.add(sources[i][0])
        return rec

    def manifest(stored: dict) -> mf.Manifest:
        return dataclasses.replace(m, items=_with_stored(m.items, stored))
    tw = _commit(storage, tier, m.step, d, [c.key for c in chunks],
                 [(put, c, c.stored_nbytes) for c in chunks], manifest, io, on_commit, None,
                 claim)
    return dataclasses.replace(tw, source="+".join(n for n, _ in sources if n in used) or None)


def _commit(storage: Storage, tier: str, step: int, d: str, keys: list[str], jobs: list,
            manifest: Callable[[dict], mf.Manifest], io: cf.Executor,
            on_commit: Callable[[mf.Manifest], None] | None, source: str | None,
            claim: Callable[[], None] | None = None) -> TierWrite:
    """`commit_chunks`, the chunks written by the chunk jobs (fn, arg, bytes)
    on `io`, small ones in groups (`_groups`)."""
    def write() -> list[mf.ChunkRecord]:
        futures = [io.submit(_run_group, g) for g in _groups(jobs)]
        stored, errors = [], []
        for f in futures:
            try:
                stored.extend(f.result())
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
    per chunk (at 256 MB in 83 KB chunks, a sixth of the pool's samples). A
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
        if claim is not None:
            claim()
        committing = True
        if not storage.put_if_absent(f"{d}/{name}", mf.to_json(m)):
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
            storage.end_write(d)
            raise
        # Known not committed (a chunk failed, another writer won, or the
        # manifest's write failed before its link, as on a full disk).
        _remove(storage, d, keys)
        storage.end_write(d)
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


# What reading or parsing one manifest copy may raise when its file is damaged
# or hostile (deep nesting, a huge size, bad bytes). Each makes that copy
# unusable, with the reason kept: one bad file never stops a manager from
# opening, nor hides another step or another tier's copy.
_UNREADABLE = (CorruptCheckpointError, OSError, RecursionError, MemoryError, UnicodeError,
               ValueError)


def read_manifests(storage: Storage, d: str, names: list[str],
                   known: mf.Manifest | None = None) -> tuple:
    """The manifests among `names` in step directory `d`, each parsed, or the
    CorruptCheckpointError saying why that copy cannot be used (logged once as
    a warning, never raised). `known`, a manifest this process just committed
    there, stands for its own name as it is, not read back."""
    mine = layout.manifest_name(known.process_index, known.process_count) if known else None
    return tuple(known if name == mine else _read_manifest(storage, d, name)
                 for name in sorted(names) if layout.parse_manifest_name(name) is not None)


def _read_manifest(storage: Storage, d: str, name: str) -> mf.Manifest | CorruptCheckpointError:
    where = f"{storage.url}/{d}/{name}"
    try:
        m = mf.parse(storage.read(f"{d}/{name}", max_bytes=mf.MAX_MANIFEST_BYTES), where)
        if layout.parse_manifest_name(name) != (m.process_index, m.process_count):
            raise CorruptCheckpointError(
                f"{where}: holds process {m.process_index} of {m.process_count}, "
                "which its name contradicts")
        return m
    except _UNREADABLE as e:
        err = e if isinstance(e, CorruptCheckpointError) else CorruptCheckpointError(
            f"{where}: unreadable ({type(e).__name__}: {e})")
        if err is not e:
            err.__cause__ = e
        log.warning("ignoring the manifest %s; its step is read from other copies, if "
                    "any: %s", where, err)
        return err


def tier_step(tier: str, manifests: tuple) -> TierStep:
    """A view of one step in a tier whose chunk sizes are taken from the
    manifests (checked when read), as for GCS, where asking costs requests."""
    sizes = {k: n for m in manifests if isinstance(m, mf.Manifest)
             for k, n in _recorded_sizes(m)}
    return TierStep(tier, tuple(manifests), sizes)


def _recorded_sizes(m: mf.Manifest):
    """(chunk key, stored size) as the manifest records them."""
    return ((c.key, c.stored_nbytes) for _, _, c in m.chunks())


def _manifest_names(storage: Storage, d: str) -> list[str]:
    """The manifests in step directory `d` (listed by name prefix, which a
    remote store filters on its side)."""
    names = storage.list(d, starts_with=layout.MANIFEST_PREFIX)
    return sorted(n for n in names if layout.parse_manifest_name(n))


def observe_step(storage: Storage, tier: str, naming: layout.StepNaming, step: int,
                 known: mf.Manifest | None = None) -> TierStep | None:
    """What `tier` holds of `step` (None: no manifest). A step directory that
    cannot be listed shows as one unusable copy, with the reason, never an error.

    `known` is a manifest this process just committed there (after its chunks
    were written and flushed): it is taken as written, its chunks' sizes as it
    stored them, so a commit neither parses its own manifest back nor asks the
    size of every chunk it wrote; only other processes' manifests are read."""
    d = naming.name(step)
    try:
        if storage.sizes_from_manifest:
            manifests = read_manifests(storage, d, _manifest_names(storage, d), known)
            return tier_step(tier, manifests) if manifests else None
        names = storage.list(d) if known is None else _manifest_names(storage, d)
    except OSError as e:
        err = CorruptCheckpointError(f"{storage.url}/{d}: cannot be listed ({e}); its "
                                     "step is read from other tiers, if any")
        log.warning("%s", err)
        return TierStep(tier, (err,), {})
    manifests = read_manifests(storage, d, names, known)
    if not manifests:
        return None
    present = set(names) if known is None else None  # else only manifests were listed
    sizes: dict[str, int | None] = {}
    for m in manifests:
        if m is known:
            sizes.update(_recorded_sizes(known))
        elif isinstance(m, mf.Manifest):
            for _, _, c in m.chunks():
                sizes[c.key] = (_size(storage, d, c.key) if present is None or c.key in present
                                else None)
    return TierStep(tier, manifests, sizes)


def _size(storage: Storage, d: str, key: str) -> int | None:
    """The object's size, or None (no usable copy) where it cannot be asked."""
    try:
        return storage.size(f"{d}/{key}")
    except OSError as e:
        log.warning("%s/%s/%s: cannot be read (%s); another copy is used", storage.url, d,
                    key, e)
        return None


def observe(storage: Storage, tier: str, naming: layout.StepNaming) -> dict[int, TierStep]:
    """Every step of a tier that has at least one manifest (valid or not).

    A remote tier is observed with one listing of its step directories and,
    per step, one listing of that step's manifests and a read of each, several
    steps at once: never a listing of every object. A damaged step (a manifest
    that does not read or parse, a directory that does not list) shows with
    its reasons and is never raised; only a tier root that cannot be listed is.
    """
    steps = sorted(s for s in map(naming.parse, storage.list("")) if s is not None)
    if storage.shared and len(steps) > 1:
        with cf.ThreadPoolExecutor(min(8, len(steps)), thread_name_prefix="rc-observe") as ex:
            views = list(ex.map(lambda s: observe_step(storage, tier, naming, s), steps))
    else:
        views = [observe_step(storage, tier, naming, s) for s in steps]
    return {s: ts for s, ts in zip(steps, views, strict=True) if ts is not None}


def cleanup(storage: Storage, naming: layout.StepNaming) -> list[str]:
    """Removes leftovers of dead writers on this host; returns what it removed.

    Only what is recognisably ours is touched: temporaries and markers of dead
    writers (in step directories; at the root, temporaries of the tiers record
    or the root metadata), and the chunks and claims of an uncommitted step
    (no manifest) that no live writer is working on (a claim names its
    writer). A directory holding anything else (an Orbax step, a user's file)
    keeps those entries.
    Entries are deleted one by one from the listing, so a save that starts in
    the directory meanwhile keeps its files.
    An entry the storage refuses (a link, a directory where a chunk should be)
    is logged and skipped: it never stops the cleanup of the rest.
    """
    removed: list[str] = []
    for name in storage.list(""):
        if naming.parse(name) is None:
            # At the root only a temporary of a dead writer is ours to remove
            # (of the tiers record or the root metadata, its write killed).
            w = layout.parse_tmp_name(name)
            if w is not None and w.alive() is False:
                _removed(storage, name, removed)
            continue
        try:
            names = storage.list(name)
            committed = any(layout.parse_manifest_name(n) for n in names)
            owners = [layout.parse_marker_name(n) or layout.parse_tmp_name(n)
                      or (None if committed else _claim_writer(storage, name, n))
                      for n in names]
            live = any(w is not None and w.alive() is not False for w in owners)
            here = 0
            for n, w in zip(names, owners, strict=True):
                dead_own = w is not None and w.alive() is False
                orphan = not committed and not live and (layout.is_chunk_name(n)
                                                         or layout.is_claim_name(n))
                if (dead_own or orphan) and _removed(storage, f"{name}/{n}", removed):
                    here += 1
            if here and not committed and not live and storage.remove_empty_dir(name):
                removed.append(name)
        except OSError as e:
            _skipped(storage, name, e)
    return removed


def _claim_writer(storage: Storage, d: str, n: str) -> layout.Writer | None:
    """The writer of `n` if it is a claim (asked only in a step directory with
    no manifest: a claim of a committed step stays with it)."""
    if not layout.is_claim_name(n):
        return None
    held = read_claim(storage, f"{d}/{n}")
    return held[1] if held else None


def _removed(storage: Storage, key: str, removed: list[str]) -> bool:
    """Deletes `key` and adds it to `removed`; whether it could (a refusal is
    logged by _skipped and the entry left in place)."""
    try:
        storage.delete(key)
    except OSError as e:
        _skipped(storage, key, e)
        return False
    removed.append(key)
    return True


def _skipped(storage: Storage, what: str, e: OSError) -> None:
    """Logs an entry cleanup could not remove; re-raises when the store itself
    stops answering (a deadline passed), where trying the rest would only wait."""
    if e.errno == errno.ETIMEDOUT:
        raise e
    log.warning("cleanup skipped %s/%s (left in place): %s", storage.url, what, e)


def clean_tier(storage: Storage, naming: layout.StepNaming, orphan_age_s: float | None,
               process_index: int) -> None:
    """Removes dead saves' leftovers from one tier, logging what it did; on a
    tier every host sees, process 0 only. A remote store (GCS) is cleaned by
    age (`collect_orphans`: no writer marker tells a dead writer there), a
    file tier by writer liveness (`cleanup`: a writer on another host counts
    as live). A failure is logged, never raised: cleanup must not stop a
    manager from opening."""
    try:
        if storage.shared and process_index != 0:
            return  # seen by every host: one of them cleans
        if storage.remote:
            removed = collect_orphans(storage, naming, orphan_age_s or 3600.0)
        else:
            removed = cleanup(storage, naming)
        if removed:
            log.info("cleaned %d leftovers of dead saves in %s", len(removed), storage.url)
    except OSError as e:
        log.warning("cleanup of %s failed: %s", storage.url, e)


def collect_orphans(storage: Storage, naming: layout.StepNaming, min_age_s: float
                    ) -> list[str]:
    """Removes our chunks from step directories that hold no manifest, once
    every object there is at least `min_age_s` old; returns what it removed.

    For shared storage (GCS), where no writer marker can tell a dead writer
    from a live one on another host: age does. A save still uploading writes
    objects more often than `min_age_s`, so it is never touched; a crashed
    save or a half-finished deletion (manifests go first) leaves objects that
    only age. Only names this package writes for chunks are removed. A step
    whose objects cannot be listed or removed is logged and skipped.
    """
    removed = []
    for name in storage.list(""):
        if naming.parse(name) is None:
            continue
        try:
            if _manifest_names(storage, name):
                continue
            ages = storage.object_ages(name)
            if not ages or min(ages.values()) < min_age_s:
                continue
            for n in ages:
                # chunks, and the parts a composed upload left behind (<chunk>.part...)
                if layout.is_chunk_name(n.split(".part", 1)[0]) or layout.is_claim_name(n):
                    storage.delete(f"{name}/{n}")
                    removed.append(f"{name}/{n}")
        except OSError as e:
            _skipped(storage, name, e)
    return removed


def delete_step(storage: Storage, naming: layout.StepNaming, step: int) -> None:
    """Deletes manifests first, so a crash part-way never leaves a step that
    looks committed and is not; the rest is removed after (or by `cleanup`)."""
    d = naming.name(step)
    for n in _manifest_names(storage, d):
        storage.delete(f"{d}/{n}")
    storage.flush(d)
    storage.delete_dir(d)
