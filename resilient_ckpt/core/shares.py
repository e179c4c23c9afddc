"""Viability across processes, from each process's small view: pure functions.

On one host every tier is visible and `selection.viable` decides from the
whole picture. With many processes, each sees only its own per-host tiers (RAM,
a local SSD) and the shared ones. So each reports, per step and save, whose
shares (a process's manifest and the chunks it lists) are intact in which of
its tiers (`local_shares`); the reports are exchanged (`agree.Peers`), and
`agree` decides from all of them, identically on every process: a save of a
step is viable when every writing process's share is intact somewhere, and a
tier can serve it alone when every share is intact in it. `readable` is what
this process itself can read of one save, for its own part of a restore.

A lost host's share may survive only as replicas spread over its peers, no
one of which holds it all. So the saves newer than every agreed step that
`agree` did not count (`unsettled`, decided from the exchanged shares alone)
are asked about in a second round: each process reports the boxes it can
read of them (`box_report`), and `covered` counts a save whose boxes, over
every process, tile each leaf.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .manifest import ChunkRecord, ItemRecord, Manifest
from .planner import chunks_cover
from .selection import Choice, TierStep, has_copy


@dataclasses.dataclass(frozen=True, order=True)
class Share:
    """Process `process`'s share of one save of `step` is intact in `tier`."""

    step: int
    save_id: str
    process: int
    count: int  # processes that wrote the save
    tier: str
    created: float

    def to_json(self) -> list:
        return [self.step, self.save_id, self.process, self.count, self.tier, self.created]

    @staticmethod
    def from_json(v: Sequence[Any]) -> Share:
        return Share(int(v[0]), str(v[1]), int(v[2]), int(v[3]), str(v[4]), float(v[5]))


WHOLE = -1  # a Share's `process` when one process holds a whole copy of the save
ANY_TIER = "*"  # its `tier`: the copy may span this process's tiers


@dataclasses.dataclass(frozen=True)
class AgreedStep:
    """A save of a step that every writing process's share makes whole."""

    step: int
    save_id: str
    created: float
    count: int
    complete_in: frozenset[str]  # tiers holding every share: each could serve it alone


def _intact(m: Manifest, ts: TierStep, bad: frozenset) -> bool:
    return all(has_copy(ts.sizes, ts.tier, c, bad) for _, _, c in m.chunks())


def local_shares(observations: Mapping[int, Sequence[TierStep]], bad: frozenset,
                 reports: Callable[[str, int], bool]) -> list[Share]:
    """The shares this process sees intact; `reports(tier, process)` says which
    to report (on a tier every process sees, one reporter is enough)."""
    out = set()
    for step, views in observations.items():
        for ts in views:
            for m in ts.manifests:
                if (isinstance(m, Manifest) and m.step == step
                        and reports(ts.tier, m.process_index) and _intact(m, ts, bad)):
                    out.add(Share(step, m.save_id, m.process_index, m.process_count, ts.tier,
                                  m.created))
    return sorted(out)


Save = tuple[int, str, int]  # (step, save_id, count of writing processes)
_STORED = ("array", "prng_key", "numpy", "numpy_scalar")  # leaf kinds held as chunks


def _tally(reports: Sequence[Sequence[Share]]) -> tuple[dict, dict]:
    """Per save, the processes whose shares each tier holds; and its newest `created`."""
    saves: dict[Save, dict[str, set[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(set))
    created: dict[Save, float] = collections.defaultdict(float)
    for shares in reports:
        for s in shares:
            key = (s.step, s.save_id, s.count)
            saves[key][s.tier].add(s.process)
            created[key] = max(created[key], s.created)
    return saves, created


def _newest(out: dict[int, AgreedStep], cand: AgreedStep) -> None:
    old = out.get(cand.step)
    if old is None or (cand.created, cand.save_id) > (old.created, old.save_id):
        out[cand.step] = cand


def _agreed(key: Save, tiers: dict[str, set[int]], created: float) -> AgreedStep:
    everyone = set(range(key[2]))
    return AgreedStep(key[0], key[1], created, key[2],
                      frozenset(t for t, ps in tiers.items() if ps == everyone))


def agree(reports: Sequence[Sequence[Share]]) -> dict[int, AgreedStep]:
    """Per step, its newest save whose every share is intact somewhere."""
    saves, created = _tally(reports)
    out: dict[int, AgreedStep] = {}
    for key, tiers in sorted(saves.items()):
        seen = set().union(*tiers.values())
        if seen - {WHOLE} == set(range(key[2])) or WHOLE in seen:
            _newest(out, _agreed(key, tiers, created[key]))
    return out


def unsettled(reports: Sequence[Sequence[Share]], agreed: Mapping[int, AgreedStep],
              pending: set[int]) -> list[Save]:
    """The saves newer than every agreed step that `agree` did not count, of
    steps no process is still writing: a lost writer's boxes may still be
    held, spread over its peers. From exchanged data only, so every process
    finds the same ones (and none while running normally: an unagreed newest
    step is one still being written)."""
    newest = max(agreed, default=None)
    return sorted({(s.step, s.save_id, s.count) for shares in reports for s in shares
                   if (newest is None or s.step > newest) and s.step not in pending})


def box_report(observations: Mapping[int, Sequence[TierStep]], tier_order: Sequence[str],
               bad: frozenset, saves: Sequence[Save]) -> list[list]:
    """For the second round: per save of `saves` this process can read any of,
    [step, save_id, count, leaves], each leaf [item, leaf index, shape, the
    distinct boxes (offsets, sizes) it holds an intact copy of]."""
    out = []
    for step, sid, count in saves:
        c = readable(observations.get(step, ()), tier_order, bad, step, sid)
        if c is None or c.manifest.process_count != count:
            continue
        leaves = [[it.name, li, list(leaf.shape),
                   sorted({(ch.offsets, ch.sizes) for ch in leaf.chunks})]
                  for it in c.manifest.items for li, leaf in enumerate(it.leaves)
                  if leaf.kind in _STORED]
        out.append([step, sid, count, leaves])
    return out


def covered(reports: Sequence[Sequence[Share]], saves: Sequence[Save],
            box_reports: Sequence[Sequence[Sequence[Any]]]) -> dict[int, AgreedStep]:
    """Per step, the newest of `saves` whose boxes, over every process's
    `box_report`, tile every leaf: each distinct box counted once, so
    replicas held on several hosts do not make up for a missing one. Where
    two processes' records of a save disagree on its leaves, it is not counted."""
    wanted = set(saves)
    shapes: dict[Save, dict[tuple[str, int], tuple[int, ...]]] = {}
    boxes: dict[Save, dict[tuple[str, int], set]] = collections.defaultdict(
        lambda: collections.defaultdict(set))
    broken: set[Save] = set()
    for report in box_reports:
        for step, sid, count, leaves in report:
            key = (int(step), str(sid), int(count))
            if key not in wanted:
                continue
            mine = {(str(it), int(li)): tuple(shape) for it, li, shape, _ in leaves}
            if shapes.setdefault(key, mine) != mine:
                broken.add(key)
            for it, li, _, held in leaves:
                boxes[key][(str(it), int(li))].update(
                    (tuple(o), tuple(n)) for o, n in held)
    tally, created = _tally(reports)
    out: dict[int, AgreedStep] = {}
    for key, leaf_shapes in sorted(shapes.items()):
        if key not in broken and all(
                chunks_cover(shape, [ChunkRecord(o, n, "", 0, 0, 0) for o, n in boxes[key][k]])
                for k, shape in leaf_shapes.items()):
            _newest(out, _agreed(key, tally.get(key, {}), created.get(key, 0.0)))
    return out


def readable(views: Sequence[TierStep], tier_order: Sequence[str], bad: frozenset,
             step: int, save_id: str) -> Choice | None:
    """What this process can read of one save: every copy of its manifests in
    this process's tiers merged (records from the fastest copy of the lowest
    process), each chunk with the tiers holding a good copy; chunks with none
    are left out, so a restore that needs them fails its plan. None if
    nothing of it is here."""
    rank = {t: i for i, t in enumerate(tier_order)}
    sizes = {ts.tier: ts.sizes for ts in views}
    # Every copy of every process's manifest of this save, fastest tier first;
    # copies of one process's manifest may differ between tiers (a per-host
    # tier's lists replicas too), so each contributes what its tier holds.
    copies = sorted(((m.process_index, rank.get(ts.tier, 99), ts.tier, m) for ts in views
                     for m in ts.manifests if isinstance(m, Manifest) and m.step == step
                     and m.save_id == save_id), key=lambda x: x[:2])
    if not copies:
        return None
    sources: dict[str, set[str]] = collections.defaultdict(set)
    chunks: dict[tuple[int, int], dict[str, Any]] = collections.defaultdict(dict)
    # One record per chunk is kept (the lowest process's, fastest tier
    # first), and the reader reads and checks every source by it: a tier is
    # a source only where its record is that one (a replica in this host's
    # own RAM pack, where the shared tier holds writer 0's pack, is not).
    for _, _, tier, m in copies:
        for ii, it in enumerate(m.items):
            for li, leaf in enumerate(it.leaves):
                for c in leaf.chunks:
                    if has_copy(sizes[tier], tier, c, bad) and \
                            chunks[(ii, li)].setdefault(c.key, c) == c:
                        sources[c.key].add(tier)
    base = copies[0][3]
    items = tuple(ItemRecord(it.name, it.kind, tuple(
        dataclasses.replace(leaf, chunks=tuple(chunks[(ii, li)].values()))
        for li, leaf in enumerate(it.leaves)), it.value) for ii, it in enumerate(base.items))
    return Choice(step, save_id, base.created, dataclasses.replace(base, items=items),
                  {k: tuple(sorted(v, key=lambda t: rank.get(t, 99))) for k, v in sources.items()})


def whole_copy(views: Sequence[TierStep], tier_order: Sequence[str], bad: frozenset,
               step: int, save_id: str) -> Share | None:
    """A Share saying this process alone can read all of a save (its per-host
    tiers keep replicas, so a peer that lost its own can be filled from it),
    or None."""
    c = readable(views, tier_order, bad, step, save_id)
    if c is None:
        return None
    for it in c.manifest.items:
        for leaf in it.leaves:
            # Distinct boxes (merged by key) whose sizes add up to the leaf: a
            # count, linear in the chunks, since this runs at every agreement;
            # a manifest that lies is caught by the restore's exact plan.
            if leaf.kind in _STORED and \
                    sum(math.prod(ch.sizes) for ch in leaf.chunks) != math.prod(leaf.shape):
                return None
    return Share(step, save_id, WHOLE, c.manifest.process_count, ANY_TIER, c.created)
