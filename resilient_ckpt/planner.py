"""Pure planning: which boxes each process writes, and where each byte of a
restore target comes from.

No I/O and no jax arrays here, only boxes (offsets, sizes) and records, so the
property tests can check the two promises directly: a save writes every element
of a leaf exactly once across processes (one copy of replicated data), and a
restore plan covers every element of a target box exactly once.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from .manifest import ChunkRecord
from .sharding import Box, box_elements, intersect, relative


@dataclasses.dataclass(frozen=True)
class Piece:
    """Copy chunk[src] into target[dst]."""

    chunk: ChunkRecord
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    elements: int


@dataclasses.dataclass(frozen=True)
class TargetPlan:
    box: Box
    pieces: tuple[Piece, ...]

    @property
    def single(self) -> ChunkRecord | None:
        """The chunk that is exactly the target box, when one is (no assembly)."""
        if len(self.pieces) == 1:
            c = self.pieces[0].chunk
            if (c.offsets, c.sizes) == self.box:
                return c
        return None


def unique_boxes(shards: Iterable[tuple[Box, int]]) -> list[Box]:
    """Boxes to write from (box, replica_id) pairs: replica 0 of each box, once."""
    seen: dict[Box, None] = {}
    for box, replica in shards:
        if replica == 0:
            seen.setdefault(box, None)
    return list(seen)


def plan_target(box: Box, chunks: Sequence[ChunkRecord], where: str) -> TargetPlan:
    """The pieces that assemble `box` from saved chunks.

    Raises ValueError naming `where` if the chunks leave part of the box
    uncovered or cover some of it twice (a torn or inconsistent manifest).
    """
    pieces, inters = [], []
    covered = 0
    for c in chunks:
        cbox = (c.offsets, c.sizes)
        inter = intersect(box, cbox)
        if inter is None:
            continue
        n = box_elements(inter)
        if n == 0:
            continue
        pieces.append(Piece(c, relative(inter, cbox), relative(inter, box), n))
        inters.append(inter)
        covered += n
    need = box_elements(box)
    overlap = any(intersect(a, b) is not None
                  for i, a in enumerate(inters) for b in inters[i + 1:])
    if covered != need or overlap:
        raise ValueError(f"{where}: the saved chunks cover {covered} of the {need} "
                         f"elements of box {box} (missing or overlapping chunks)")
    return TargetPlan(box, tuple(pieces))


def chunks_cover(shape: Sequence[int], chunks: Sequence[ChunkRecord]) -> bool:
    """True when the chunks tile the whole array exactly once."""
    full: Box = (tuple(0 for _ in shape), tuple(shape))
    try:
        plan_target(full, chunks, "")
    except ValueError:
        return False
    return True
