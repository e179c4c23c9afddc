"""Pure planning: which boxes each process writes, and where each byte of a
restore target comes from.

No I/O and no jax arrays here, only boxes (offsets, sizes) and records, so the
property tests can check the two promises directly: a save writes every element
of a leaf exactly once across processes (one copy of replicated data), and a
restore plan covers every element of a target box exactly once.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from .manifest import ChunkRecord
from .sharding import Box, box_elements, intersect, relative

# Chunks are checksummed in blocks of whole first-dimension rows of about this
# size, so a restore that needs part of a chunk reads and verifies only the
# blocks it touches. 256 KiB keeps the overread of a partial read to about 1%
# for shards of a few tens of MB and the block list to 4096 entries per GB.
BLOCK_TARGET_BYTES = 256 * 1024


def block_bytes_for(sizes: Sequence[int], itemsize: int) -> int:
    """Bytes per checksum block of a chunk: a whole number of its rows."""
    nbytes = box_elements(((0,) * len(sizes), tuple(sizes))) * itemsize
    if not sizes or nbytes == 0:
        return max(nbytes, 1)
    row = nbytes // sizes[0]
    return max(1, BLOCK_TARGET_BYTES // max(row, 1)) * row if row else 1


def rows_per_block(c: ChunkRecord) -> int | None:
    """Rows of the chunk's first dimension per block, or None when blocks do
    not follow rows (0-d chunks, or a writer that chose other blocks)."""
    if not c.sizes or not c.block_bytes or c.sizes[0] == 0:
        return None
    row = c.nbytes // c.sizes[0]
    if row == 0 or c.block_bytes % row:
        return None
    return c.block_bytes // row


def blocks_for_rows(c: ChunkRecord, row_ranges: Iterable[tuple[int, int]]
                    ) -> list[tuple[int, int]]:
    """Coalesced [first, last) block spans covering the given row ranges."""
    rpb = rows_per_block(c)
    nblocks = len(c.block_crc32c)
    if rpb is None:
        return [(0, nblocks)] if nblocks else []
    wanted = sorted({b for lo, hi in row_ranges if hi > lo
                     for b in range(lo // rpb, (hi - 1) // rpb + 1)})
    spans: list[tuple[int, int]] = []
    for b in wanted:
        if spans and spans[-1][1] == b:
            spans[-1] = (spans[-1][0], b + 1)
        else:
            spans.append((b, b + 1))
    return spans


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
    if covered != need or not _disjoint(box, inters):
        raise ValueError(f"{where}: the saved chunks cover {covered} of the {need} "
                         f"elements of box {box} (missing or overlapping chunks)")
    return TargetPlan(box, tuple(pieces))


def plan_boxes(boxes: Sequence[Box], chunks: Sequence[ChunkRecord], where: str
               ) -> list[TargetPlan]:
    """plan_target of each box, for chunks that tile their array, as a
    selected step's do (selection checks chunks_cover): a box that is exactly
    one chunk is planned as that chunk, without comparing it with every other
    (quadratic in the chunks: a large share of a RAM-tier restore of many
    chunks went there)."""
    exact = {(c.offsets, c.sizes): c for c in chunks}
    plans = []
    for box in boxes:
        c = exact.get(box)
        n = box_elements(box)
        if c is None or n == 0:
            plans.append(plan_target(box, chunks, where))
            continue
        whole = tuple(slice(0, k) for k in box[1])
        plans.append(TargetPlan(box, (Piece(c, whole, whole, n),)))
    return plans


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """plan_boxes's answer for one layout, by chunk position rather than by
    chunk: the same for every leaf whose target boxes and whose chunks' boxes
    (in order) are the same, as the many leaves of one shape and sharding in a
    model's state are. `exact` holds the boxes that are exactly one chunk
    (box, its position), `parts` the others (box, pieces as (chunk position,
    src, dst, elements))."""

    exact: tuple[tuple[Box, int], ...]
    parts: tuple[tuple[Box, tuple[tuple[int, tuple[slice, ...], tuple[slice, ...], int], ...]],
                 ...]

    def singles(self, chunks: Sequence[ChunkRecord]) -> dict[Box, ChunkRecord]:
        """The boxes that are exactly one of `chunks`, each with its chunk."""
        return {box: chunks[i] for box, i in self.exact}

    def targets(self, chunks: Sequence[ChunkRecord], with_exact: bool = True
                ) -> dict[Box, TargetPlan]:
        """The plan of each box against `chunks` (with_exact=False: of the
        `parts` boxes only)."""
        out = {}
        if with_exact:
            for box, i in self.exact:
                whole = tuple(slice(0, k) for k in box[1])
                out[box] = TargetPlan(box, (Piece(chunks[i], whole, whole, box_elements(box)),))
        for box, pieces in self.parts:
            out[box] = TargetPlan(box, tuple(Piece(chunks[i], src, dst, n)
                                             for i, src, dst, n in pieces))
        return out


def plan_layout(boxes: Sequence[Box], chunks: Sequence[ChunkRecord], where: str
                ) -> LayoutPlan:
    """plan_boxes of `boxes` against `chunks`, by chunk position (LayoutPlan)."""
    at = {id(c): i for i, c in enumerate(chunks)}
    exact, parts = [], []
    for plan in plan_boxes(boxes, chunks, where):
        single = plan.single
        if single is not None:
            exact.append((plan.box, at[id(single)]))
        else:
            parts.append((plan.box, tuple((at[id(p.chunk)], p.src, p.dst, p.elements)
                                          for p in plan.pieces)))
    return LayoutPlan(tuple(exact), tuple(parts))


class LayoutPlans:
    """plan_layout, worked out once per layout and reused for every leaf of
    it: planning each of a state's thousands of chunks anew was a large part
    of a restore's Python time, though a model has a handful of layouts. A
    layout is the target boxes and the chunks' boxes in order, all a plan
    depends on (not the dtype: plans count elements). One per restore."""

    def __init__(self) -> None:
        self._plans: dict[tuple, LayoutPlan] = {}

    def plan(self, boxes: Sequence[Box], chunks: Sequence[ChunkRecord], where: str
             ) -> LayoutPlan:
        """plan_layout(boxes, chunks, where), remembered; a layout that fails
        to plan raises ValueError naming `where` each time."""
        key = (tuple(boxes), tuple([(c.offsets, c.sizes) for c in chunks]))
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = plan_layout(boxes, chunks, where)
        return got


def _disjoint(box: Box, inters: list[Box]) -> bool:
    """Whether boxes (each inside `box`) overlap nowhere. A few are compared
    pairwise; many on the grid their edges make, marking each cell once, so a
    manifest with a million chunks costs seconds, not hours. A layout whose
    grid would exceed _MAX_CELLS cells (no sharding makes one) counts as
    overlapping."""
    if len(inters) <= 64:
        return not any(intersect(a, b) is not None
                       for i, a in enumerate(inters) for b in inters[i + 1:])
    edges = [sorted({o for b in inters for o in (b[0][d], b[0][d] + b[1][d])})
             for d in range(len(box[0]))]
    if math.prod(len(e) - 1 for e in edges) > _MAX_CELLS:
        return False
    grid = np.zeros([len(e) - 1 for e in edges], dtype=np.uint8)
    for o, s in inters:
        cell = tuple(slice(bisect.bisect_left(e, a), bisect.bisect_left(e, a + n))
                     for e, a, n in zip(edges, o, s, strict=True))
        if grid[cell].any():
            return False
        grid[cell] = 1
    return True


_MAX_CELLS = 1 << 24


def chunks_cover(shape: Sequence[int], chunks: Sequence[ChunkRecord]) -> bool:
    """True when the chunks tile the whole array exactly once. Answered once
    per layout (shape and chunk boxes): a model's leaves share a handful, and
    judging a step judges every leaf (876 plans were a third of a fresh
    manager's first restore of a decoder's state)."""
    key = (tuple(shape), tuple([(c.offsets, c.sizes) for c in chunks]))
    got = _COVERS.get(key)
    if got is None:
        full: Box = (tuple(0 for _ in shape), tuple(shape))
        try:
            plan_target(full, chunks, "")
            got = True
        except ValueError:
            got = False
        if len(_COVERS) >= 1024:
            _COVERS.clear()
        _COVERS[key] = got
    return got


_COVERS: dict[tuple, bool] = {}  # chunks_cover's answers, by layout
