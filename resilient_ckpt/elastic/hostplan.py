"""Pure planning for the host-memory snapshot tier (`hostsnap`).

This module owns the records of a host snapshot and the decisions made over
them, with no jax arrays and no I/O: which devices' hosts keep a copy of each
block of a leaf (one primary per replica group, a backup in the group
half the ring away when no other group holds the block), which snapshots are viable given the
copies still usable, which snapshots the memory budget and the retention drop,
and, for a restore onto new shardings, which copy of which source block each
target device takes (same device first, then same host) and where its
elements go. Devices are named by id, hosts by any hashable key.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence

from ..core.sharding import Box, box_elements, intersect, relative

Checksum = tuple[int, int]
Copy = tuple[int, int, int]          # (leaf index, block index, device id)
Slices = tuple[tuple[int, int], ...]  # (start, stop) per dimension: hashable slices


@dataclasses.dataclass(frozen=True)
class BlockRecord:
    """One distinct block (box) of a leaf and where its copies live.

    `primaries`: the devices whose host memory holds the primary copy, one
    per replica group that holds the block on its devices; `backups`: devices
    (of the group half the ring away) holding a backup, for a block held by one
    group only. `checksum`: of the block's bytes (`ondevice.checksum`), None
    until the snapshot is committed."""

    box: Box
    nbytes: int
    primaries: tuple[int, ...]
    backups: tuple[int, ...] = ()
    checksum: Checksum | None = None

    @property
    def holders(self) -> tuple[int, ...]:
        return self.primaries + self.backups


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    """One leaf: its key path, shape, dtype and sharding as snapshotted.
    `blocks` is None for a leaf kept as a host value (not a jax array).
    `key_impl`: the PRNG implementation of a key array (its key data is kept)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    blocks: tuple[BlockRecord, ...] | None
    key_impl: str | None = None


@dataclasses.dataclass(frozen=True)
class SnapshotRecord:
    """A snapshot's manifest: the step, every leaf, and whether every copy
    and checksum is done (`complete`; only complete ones are selectable)."""

    step: int
    leaves: tuple[LeafRecord, ...]
    complete: bool = False

    def copies(self) -> list[tuple[Copy, int]]:
        """Every copy (leaf, block, device) with its bytes."""
        return [((li, bi, d), b.nbytes) for li, leaf in enumerate(self.leaves)
                for bi, b in enumerate(leaf.blocks or ()) for d in b.holders]

    def bytes_per_host(self, host_of: Mapping[int, Hashable]) -> dict[Hashable, int]:
        """Host-memory bytes of every copy (primaries and backups), per host."""
        out: dict[Hashable, int] = {}
        for (_, _, d), n in self.copies():
            out[host_of[d]] = out.get(host_of[d], 0) + n
        return out


def place_copies(device_boxes: Mapping[int, Box], order: Sequence[int],
                 group_of: Mapping[int, int], next_of: Mapping[int, int],
                 nbytes: Mapping[Box, int]) -> tuple[BlockRecord, ...]:
    """The blocks of one leaf and the devices keeping their copies.

    `device_boxes`: the box each device holds; `order`: the devices in mesh
    order (the first holder of a box in a group keeps that group's copy);
    `group_of`: each device's replica group (all 0 without a replica axis);
    `next_of`: the device at the same mesh position in the backup group (absent
    when there is no other group). A block held in two groups or more needs
    no backup: losing one group leaves another's copy."""
    groups: dict[Box, dict[int, int]] = {}
    for d in order:
        box = device_boxes[d]
        groups.setdefault(box, {}).setdefault(group_of[d], d)
    blocks = []
    for box in sorted(groups):
        primaries = tuple(groups[box][g] for g in sorted(groups[box]))
        backups: tuple[int, ...] = ()
        if len(primaries) == 1 and next_of.get(primaries[0], primaries[0]) != primaries[0]:
            backups = (next_of[primaries[0]],)
        blocks.append(BlockRecord(box, nbytes[box], primaries, backups))
    return tuple(blocks)


def is_viable(record: SnapshotRecord, usable: set[Copy]) -> bool:
    """Whether every block of every array leaf has a usable copy."""
    return record.complete and all(
        any((li, bi, d) in usable for d in b.holders)
        for li, leaf in enumerate(record.leaves) for bi, b in enumerate(leaf.blocks or ()))


def budget_drops(kept: Sequence[tuple[int, Mapping[Hashable, int]]],
                 new: Mapping[Hashable, int], budget: int | None) -> list[int] | None:
    """The oldest kept snapshots to drop before taking one of `new` bytes per
    host, so that no host holds more than `budget` bytes; None when `new`
    alone exceeds it (skip the snapshot). `kept`: (step, bytes per host)."""
    if budget is None:
        return []
    if any(n > budget for n in new.values()):
        return None
    kept = sorted(kept, key=lambda k: k[0])
    drops: list[int] = []
    while True:
        total = dict(new)
        for _, per_host in kept[len(drops):]:
            for h, n in per_host.items():
                total[h] = total.get(h, 0) + n
        if all(n <= budget for n in total.values()):
            return drops
        drops.append(kept[len(drops)][0])


def beyond_keep(steps: Iterable[int], keep: int) -> list[int]:
    """The committed steps retention drops: all but the `keep` newest."""
    ordered = sorted(steps)
    return ordered[:max(0, len(ordered) - keep)]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Block `block` of a leaf, its copy on device `source`, moved whole to a
    target device; its elements `src` (block coordinates) go to `dst` (target
    block coordinates)."""

    block: int
    source: int
    src: Slices
    dst: Slices
    nbytes: int


def _as_pairs(slices: tuple[slice, ...]) -> Slices:
    return tuple((s.start, s.stop) for s in slices)


def choose_copy(holders: Sequence[int], target: int, usable: Iterable[int],
                host_of: Mapping[int, Hashable]) -> int | None:
    """The copy to move to `target`: on the same device, else on the same
    host, else the lowest device id; None when no holder is usable."""
    live = set(usable)
    ok = [d for d in holders if d in live]
    if not ok:
        return None
    return min(ok, key=lambda d: (d != target, host_of.get(d) != host_of.get(target), d))


def plan_leaf(leaf: LeafRecord, li: int, targets: Mapping[int, Box], usable: set[Copy],
              host_of: Mapping[int, Hashable]) -> dict[int, tuple[Piece, ...]] | int:
    """For each target device (id -> its box), the source blocks covering its
    box, whole, from a chosen copy. Returns the block index with no usable
    copy instead when one is needed and lost. Raises ValueError when the
    blocks do not cover a target box exactly once."""
    assert leaf.blocks is not None
    by_block: dict[int, set[int]] = {}
    for l2, b2, d in usable:
        if l2 == li:
            by_block.setdefault(b2, set()).add(d)
    out: dict[int, tuple[Piece, ...]] = {}
    for dev, box in targets.items():
        pieces, covered = [], 0
        for bi, b in enumerate(leaf.blocks):
            inter = intersect(b.box, box) if box_elements(box) else None
            if inter is None:
                continue
            src = choose_copy(b.holders, dev, by_block.get(bi, ()), host_of)
            if src is None:
                return bi
            pieces.append(Piece(bi, src, _as_pairs(relative(inter, b.box)),
                                _as_pairs(relative(inter, box)), b.nbytes))
            covered += box_elements(inter)
        if covered != box_elements(box):
            raise ValueError(f"the snapshot's blocks of {leaf.path} cover {covered} of the "
                             f"{box_elements(box)} elements of target box {box}")
        out[dev] = tuple(pieces)
    return out


def layout_of(leaf: LeafRecord, pieces: Sequence[Piece], box: Box) -> tuple:
    """What the program assembling one target block depends on: the target
    block's shape, the shapes of the blocks moved and where each goes.
    Target devices with the same layout share one program."""
    assert leaf.blocks is not None
    return (box[1], tuple((leaf.blocks[p.block].box[1], p.src, p.dst) for p in pieces))
