"""Selection of the last viable step, as pure functions over observations.

A tier shows, per step, the manifests it holds (parsed, or the parse error)
and the observed size of each object they name. A step is viable when, for one
save of it (one save_id), every writing process has a valid manifest in some
tier and every chunk those manifests list has a copy of its recorded size in a
tier that holds that process's manifest, and the chunks tile every array leaf.
Checksums are checked later, when bytes are read: a chunk that fails there is
reported by `restore`, which excludes it and selects again. `why_not` says,
for tools, which of these rules a step breaks.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

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
    # Holds only some writers' manifests of a tier the whole job sees (those
    # predicted to hold this process's boxes): a restore first checks that
    # its targets' boxes are covered (restore.assemble.Uncovered).
    partial: bool = False


def has_copy(sizes: Mapping[str, int | None], tier: str, c: ChunkRecord,
             bad: frozenset) -> bool:
    """Whether `tier` (its observed object sizes) holds a usable copy of `c`:
    one of the recorded size, not already known to fail its checksum."""
    return sizes.get(c.key) == c.stored_nbytes and (tier, c.key) not in bad


def _candidate(step: int, save_id: str, views: Sequence[TierStep],
               tier_order: Sequence[str], bad: frozenset) -> Choice | None:
    # Copies of one process's manifest normally agree; where they differ (one
    # damaged in a way that still parses), each variant is tried on its own, with
    # only the tiers that hold that variant as sources for its chunks.
    variants: dict[int, list[tuple[Manifest, list[str]]]] = {}
    rank = {t: i for i, t in enumerate(tier_order)}
    for ts in sorted(views, key=lambda v: rank.get(v.tier, 99)):
        for m in ts.manifests:
            if isinstance(m, Manifest) and m.save_id == save_id and m.step == step:
                vs = variants.setdefault(m.process_index, [])
                for known, tiers in vs:
                    if known == m:
                        tiers.append(ts.tier)
                        break
                else:
                    vs.append((m, [ts.tier]))
    counts = {m.process_count for vs in variants.values() for m, _ in vs}
    if len(counts) != 1 or set(variants) != set(range(counts.pop())):
        return None
    procs = sorted(variants)
    for combo in itertools.product(*(variants[p] for p in procs)):
        c = _combine(step, save_id, combo, {ts.tier: ts.sizes for ts in views}, rank, bad)
        if c is not None:
            return c
    return None


def _leaves(m: Manifest) -> list:
    """What every process's manifest of one save must agree on: the items and
    each leaf's path, kind, shape and dtype (only the chunks differ)."""
    return [(it.name, it.kind, [(lf.path, lf.kind, lf.shape, lf.dtype) for lf in it.leaves])
            for it in m.items]


def _combine(step, save_id, combo, sizes, rank, bad) -> Choice | None:
    if len(combo) > 1 and any(_leaves(m) != _leaves(combo[0][0]) for m, _ in combo[1:]):
        return None  # the processes' records disagree: chunks would be read as another leaf
    sources: dict[str, tuple[str, ...]] = {}
    merged: dict[tuple[int, int], list[ChunkRecord]] = {}
    for m, holders in combo:
        for ii, it in enumerate(m.items):
            for li, leaf in enumerate(it.leaves):
                merged.setdefault((ii, li), []).extend(leaf.chunks)
                for c in leaf.chunks:
                    ok = [t for t in holders if has_copy(sizes[t], t, c, bad)]
                    if not ok:
                        return None
                    sources[c.key] = tuple(sorted(set(ok), key=lambda t: rank.get(t, 99)))
    base = combo[0][0]
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
           bad: frozenset = frozenset(), memo: dict | None = None) -> dict[int, Choice]:
    """Every viable step, mapped to its choice (the newest viable save of it).

    `bad` holds (tier, object key) pairs known to fail their checksum. `memo`
    (kept by the caller between calls, rewritten by each) holds each step's
    answer with the very TierStep objects and `bad` it came from: a step whose
    views are the same objects is not judged again (judging a step of
    thousands of chunks is not free, and it ran on the training thread after
    every commit).
    """
    out, seen = {}, {}
    basis = (bad, tuple(tier_order))
    for step, views in observations.items():
        views = tuple(views)
        old = memo.get(step) if memo is not None else None
        if old is not None and old[0] == basis and len(old[1]) == len(views) and all(
                a is b for a, b in zip(old[1], views, strict=True)):
            c = old[2]
        else:
            c = _newest_viable_save(step, views, tier_order, bad)
        seen[step] = (basis, views, c)
        if c is not None:
            out[step] = c
    if memo is not None:
        memo.clear()
        memo.update(seen)
    return out


def _newest_viable_save(step: int, views: Sequence[TierStep], tier_order: Sequence[str],
                        bad: frozenset) -> Choice | None:
    save_ids = {(m.created, m.save_id) for ts in views for m in ts.manifests
                if isinstance(m, Manifest) and m.step == step}
    for _, sid in sorted(save_ids, reverse=True):
        c = _candidate(step, sid, views, tier_order, bad)
        if c is not None:
            return c
    return None


def last_viable(observations: Mapping[int, Sequence[TierStep]], tier_order: Sequence[str],
                bad: frozenset = frozenset(), below: int | None = None) -> Choice | None:
    """The newest viable step (strictly below `below` when given), or None."""
    choices = viable(observations, tier_order, bad)
    steps = [s for s in choices if below is None or s < below]
    return choices[max(steps)] if steps else None


def why_not(step: int, views: Sequence[TierStep], tier_order: Sequence[str],
            bad: frozenset = frozenset()) -> str | None:
    """None when `step` is viable over `views`; else, in words, why its newest
    save is not (the rules of `viable`, first broken first), for tools."""
    if viable({step: views}, tier_order, bad):
        return None
    ms = [(ts, m) for ts in views for m in ts.manifests if isinstance(m, Manifest)]
    errors = [m for ts in views for m in ts.manifests if not isinstance(m, Manifest)]
    ours = [(ts, m) for ts, m in ms if m.step == step]
    if not ours:
        if errors:
            return f"no readable manifest (torn or damaged): {errors[0]}"
        if ms:
            return f"its manifest is of step {ms[0][1].step}, not {step}"
        return "no manifest"
    _, sid = max((m.created, m.save_id) for _, m in ours)
    save = [(ts, m) for ts, m in ours if m.save_id == sid]
    counts = sorted({m.process_count for _, m in save})
    if len(counts) != 1:
        return f"save {sid[:8]}: its manifests disagree on the process count {counts}"
    missing = sorted(set(range(counts[0])) - {m.process_index for _, m in save})
    if missing:
        return (f"save {sid[:8]}: no manifest of process(es) {missing} of {counts[0]} "
                "(not every process committed)")
    for _, m in save:
        for _, _, c in m.chunks():
            holders = [ts for ts, x in save if x == m]
            if not any(has_copy(ts.sizes, ts.tier, c, bad) for ts in holders):
                return (f"save {sid[:8]}: chunk {c.key}"
                        + (f" (in pack {c.pack})" if c.pack else "") + " "
                        + _chunk_problem(holders, c, bad))
    return (f"save {sid[:8]}: its chunks do not tile every array, or its processes' "
            "records disagree")


def _chunk_problem(holders: Sequence[TierStep], c: ChunkRecord, bad: frozenset) -> str:
    for ts in holders:
        if (ts.tier, c.key) in bad:
            return f"failed its checksum in {ts.tier}"
    for ts in holders:
        size = ts.sizes.get(c.key)
        if size is not None:
            return f"is {size} bytes in {ts.tier}, its manifest says {c.stored_nbytes}"
    return "is missing (" + ", ".join(ts.tier for ts in holders) + ")"
