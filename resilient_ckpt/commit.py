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
import logging
import time

from . import layout, manifest as mf
from .errors import CorruptCheckpointError, StepAlreadyExistsError
from .selection import TierStep
from .snapshot import Snapshot
from .storage.base import Storage

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


def write_step(storage: Storage, tier: str, naming: layout.StepNaming, snap: Snapshot,
               header: dict, io: cf.Executor) -> TierWrite:
    """Writes `snap` to `storage` and commits it; raises on failure, after
    removing what it wrote (never anything committed)."""
    t0 = time.perf_counter()
    d = naming.name(snap.step)
    storage.begin_write(d)
    written: list[str] = []
    try:
        def put(i: int) -> str:
            c = snap.chunks[i]
            snap.crc(i)
            storage.put(f"{d}/{c.key}", c.data)
            return c.key

        futures = [io.submit(put, i) for i in range(len(snap.chunks))]
        errors = []
        for f in futures:
            try:
                written.append(f.result())
            except BaseException as e:  # noqa: BLE001 - collected and re-raised
                errors.append(e)
        if errors:
            raise errors[0]
        storage.flush(d)
        m = mf.Manifest(step=snap.step, save_id=snap.save_id, items=snap.manifest_items(),
                        **header)
        if not storage.put_if_absent(f"{d}/{layout.manifest_name(m.process_index, m.process_count)}",
                                     mf.to_json(m)):
            raise StepAlreadyExistsError(
                f"step {snap.step} was committed to the {tier} tier ({storage.url}/{d}) "
                "by another writer first; this save of it was dropped")
    except BaseException:
        for key in written:
            try:
                storage.delete(f"{d}/{key}")
            except OSError:
                log.warning("could not remove %s/%s/%s after a failed save", storage.url, d, key)
        storage.end_write(d)
        raise
    storage.end_write(d)
    return TierWrite(tier, snap.step, True, time.perf_counter() - t0, snap.nbytes)


def read_manifests(storage: Storage, d: str, names: list[str]) -> tuple:
    out = []
    for name in sorted(names):
        if layout.parse_manifest_name(name) is None:
            continue
        where = f"{storage.url}/{d}/{name}"
        try:
            m = mf.parse(storage.read(f"{d}/{name}"), where)
            if layout.parse_manifest_name(name) != (m.process_index, m.process_count):
                raise CorruptCheckpointError(
                    f"{where}: holds process {m.process_index} of {m.process_count}, "
                    "which its name contradicts")
            out.append(m)
        except (CorruptCheckpointError, OSError) as e:
            log.warning("ignoring %s: %s", where, e)
            out.append(e if isinstance(e, CorruptCheckpointError)
                       else CorruptCheckpointError(f"{where}: unreadable: {e}"))
    return tuple(out)


def observe_step(storage: Storage, tier: str, naming: layout.StepNaming, step: int
                 ) -> TierStep | None:
    d = naming.name(step)
    names = storage.list(d)
    manifests = read_manifests(storage, d, names)
    if not manifests:
        return None
    present = set(names)
    sizes = {}
    for m in manifests:
        if isinstance(m, mf.Manifest):
            for _, _, c in m.chunks():
                sizes[c.key] = storage.size(f"{d}/{c.key}") if c.key in present else None
    return TierStep(tier, manifests, sizes)


def observe(storage: Storage, tier: str, naming: layout.StepNaming) -> dict[int, TierStep]:
    """Every step of a tier that has at least one manifest (valid or not)."""
    out = {}
    for name in storage.list(""):
        step = naming.parse(name)
        if step is None:
            continue
        ts = observe_step(storage, tier, naming, step)
        if ts is not None:
            out[step] = ts
    return out


def cleanup(storage: Storage, naming: layout.StepNaming) -> list[str]:
    """Removes leftovers of dead writers on this host; returns what it removed.

    Only what is recognisably ours is touched: temporaries and markers of dead
    writers, and the chunks of an uncommitted step (no manifest) that no live
    writer is working on. A directory holding anything else (an Orbax step, a
    user's file) keeps those entries. Entries are deleted one by one from the
    listing, so a save that starts in the directory meanwhile keeps its files.
    """
    removed = []
    for name in storage.list(""):
        if naming.parse(name) is None:
            continue
        names = storage.list(name)
        owners = [layout.parse_marker_name(n) or layout.parse_tmp_name(n) for n in names]
        live = any(w is not None and w.alive() is not False for w in owners)
        committed = any(layout.parse_manifest_name(n) for n in names)
        here = 0
        for n, w in zip(names, owners):
            dead_own = w is not None and w.alive() is False
            orphan = not committed and not live and layout.is_chunk_name(n)
            if dead_own or orphan:
                storage.delete(f"{name}/{n}")
                removed.append(f"{name}/{n}")
                here += 1
        if here and not committed and not live and storage.remove_empty_dir(name):
            removed.append(name)
    return removed


def delete_step(storage: Storage, naming: layout.StepNaming, step: int) -> None:
    """Deletes manifests first, so a crash part-way never leaves a step that
    looks committed and is not; the rest is removed after (or by `cleanup`)."""
    d = naming.name(step)
    for n in storage.list(d):
        if layout.parse_manifest_name(n):
            storage.delete(f"{d}/{n}")
    storage.flush(d)
    storage.delete_dir(d)
