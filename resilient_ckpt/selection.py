"""Selection of the last viable step, as pure functions over observations.

A tier shows, per step, the manifests it holds (parsed, or the parse error)
and the observed size of each object they name. A step is viable when, for one
save of it (one save_id), every writing process has a valid manifest in some
tier and every chunk those manifests list has a copy of its recorded size in a
tier that holds that process's manifest, and the chunks tile every array leaf.
Checksums are checked later, when bytes are read: a chunk that fails there is
reported by `restore`, which excludes it and selects again.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .manifest import ChunkRecord, ItemRecord, Manifest
from .planner import chunks_cover


@dataclasses.dataclass(frozen=True)
class TierStep:
    """What one tier shows for one step."""

    tier: str
    manifests: tuple[Manifest | Exception, ...]
    sizes: Mapping[str, int | None]  # object key -> observed size (None: absent)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A viable step: its merged records and, per chunk, the tiers to read from
    in order of preference."""

    step: int
    save_id: str
    created: float
    manifest: Manifest  # process 0's, with every process's chunks merged in
    sources: Mapping[str, tuple[str, ...]]


def _candidate(step: int, save_id: str, views: Sequence[TierStep],
               tier_order: Sequence[str], bad: frozenset) -> Choice | None:
    by_proc: dict[int, Manifest] = {}
    holders: dict[int, list[str]] = {}
    counts = set()
    for ts in views:
        for m in ts.manifests:
            if isinstance(m, Manifest) and m.save_id == save_id and m.step == step:
                by_proc.setdefault(m.process_index, m)
                holders.setdefault(m.process_index, []).append(ts.tier)
                counts.add(m.process_count)
    if len(counts) != 1:
        return None
    (count,) = counts
    if set(by_proc) != set(range(count)):
        return None
    sizes = {ts.tier: ts.sizes for ts in views}
    rank = {t: i for i, t in enumerate(tier_order)}
    sources: dict[str, tuple[str, ...]] = {}
    merged: dict[tuple[int, int], list[ChunkRecord]] = {}
    for p, m in by_proc.items():
        for ii, it in enumerate(m.items):
            for li, leaf in enumerate(it.leaves):
                merged.setdefault((ii, li), []).extend(leaf.chunks)
                for c in leaf.chunks:
                    ok = [t for t in holders[p] if (t, c.key) not in bad
                          and sizes[t].get(c.key) == c.stored_nbytes]
                    if not ok:
                        return None
                    sources[c.key] = tuple(sorted(set(ok), key=lambda t: rank.get(t, 99)))
    base = by_proc[0]
    items = []
    for ii, it in enumerate(base.items):
        leaves = []
        for li, leaf in enumerate(it.leaves):
            chunks = tuple(merged.get((ii, li), ()))
            if leaf.kind in ("array", "prng_key", "numpy", "numpy_scalar") and \
                    not chunks_cover(leaf.shape, chunks):
                return None
            leaves.append(dataclasses.replace(leaf, chunks=chunks))
        items.append(ItemRecord(it.name, it.kind, tuple(leaves), it.value))
    merged_manifest = dataclasses.replace(base, items=tuple(items))
    return Choice(step, save_id, base.created, merged_manifest, sources)


def viable(observations: Mapping[int, Sequence[TierStep]], tier_order: Sequence[str],
           bad: frozenset = frozenset()) -> dict[int, Choice]:
    """Every viable step, mapped to its choice (the newest viable save of it).

    `bad` holds (tier, object key) pairs known to fail their checksum.
    """
    out = {}
    for step, views in observations.items():
        save_ids = {(m.created, m.save_id) for ts in views for m in ts.manifests
                    if isinstance(m, Manifest) and m.step == step}
        for _, sid in sorted(save_ids, reverse=True):
            c = _candidate(step, sid, views, tier_order, bad)
            if c is not None:
                out[step] = c
                break
    return out


def last_viable(observations: Mapping[int, Sequence[TierStep]], tier_order: Sequence[str],
                bad: frozenset = frozenset(), below: int | None = None) -> Choice | None:
    """The newest viable step (strictly below `below` when given), or None."""
    choices = viable(observations, tier_order, bad)
    steps = [s for s in choices if below is None or s < below]
    return choices[max(steps)] if steps else None
