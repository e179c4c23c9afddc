"""Removing dead writers' leftovers from a tier without touching live saves.

A file tier is cleaned by writer liveness (markers, temporaries and claims
name their writer); a remote store, where no marker can tell a dead writer
on another host from a live one, by age. Only names this package writes are
removed, one entry at a time from a listing, so a save that starts meanwhile
keeps its files; an entry the storage refuses is logged and skipped.
"""
from __future__ import annotations

import errno
import logging

from ..catalog.tier_steps import manifest_names
from ..core import layout
from ..storage.base import Storage
from .claim import read as read_claim

log = logging.getLogger("resilient_ckpt")


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
            if manifest_names(storage, name):
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
