"""Unit and property tests of planning: save de-duplication and restore coverage."""
import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from resilient_ckpt.core import layout, planner
from resilient_ckpt.core.manifest import ChunkRecord
from resilient_ckpt.core.sharding import box_to_slices, index_to_box


def grid_chunks(shape, splits):
    """Chunks that tile `shape`, cut at the given split points per dimension."""
    edges = [sorted({0, n, *[c for c in cuts if 0 < c < n]})
             for n, cuts in zip(shape, splits, strict=False)]
    out = []
    for cell in itertools.product(*[list(zip(e[:-1], e[1:], strict=False)) for e in edges]):
        offs = tuple(a for a, _ in cell)
        sizes = tuple(b - a for a, b in cell)
        n = int(np.prod(sizes)) * 4
        out.append(ChunkRecord(offs, sizes, layout.chunk_key(0, 0, offs), n, n, 0))
    return out


def test_unique_boxes_keeps_one_copy_of_replicas():
    a, b = ((0,), (4,)), ((4,), (4,))
    shards = [(a, 0), (a, 1), (b, 1), (b, 0), (a, 0)]
    assert planner.unique_boxes(shards) == [a, b]


def test_index_to_box():
    assert index_to_box((slice(2, 4), slice(None)), (8, 3)) == ((2, 0), (2, 3))
    assert index_to_box((), ()) == ((), ())


def test_plan_rejects_gaps_and_overlaps():
    chunks = grid_chunks((4, 4), [[2], [2]])
    with pytest.raises(ValueError, match="cover"):
        planner.plan_target(((0, 0), (4, 4)), chunks[:-1], "leaf x")
    overlapping = chunks + [ChunkRecord((1, 1), (1, 1), "dup", 4, 4, 0)]
    assert not planner.chunks_cover((4, 4), overlapping)
    # an overlap and a gap of equal size must not cancel out
    shifted = chunks[:-1] + [ChunkRecord((1, 1), (2, 2), "odd", 16, 16, 0)]
    assert not planner.chunks_cover((4, 4), shifted)


def test_an_answer_kept_for_a_layout_is_that_layouts_alone():
    # chunks_cover answers once per (shape, chunk boxes): the same boxes of
    # other chunks get it again, another shape or one box more or less its own
    chunks = grid_chunks((4, 4), [[2], [2]])
    assert planner.chunks_cover((4, 4), chunks)
    others = [ChunkRecord(c.offsets, c.sizes, c.key + "'", c.nbytes, c.nbytes, 1) for c in chunks]
    assert planner.chunks_cover((4, 4), others)
    assert not planner.chunks_cover((4, 5), chunks)
    assert not planner.chunks_cover((4, 4), chunks[:-1])
    assert not planner.chunks_cover((4, 4), chunks + chunks[:1])
    assert planner.chunks_cover((4, 4), chunks)


dims = st.integers(1, 7)
# (shape, the saved chunks' cuts per dimension, the targets' cuts per dimension)
cut_grids = st.lists(dims, min_size=0, max_size=3).flatmap(lambda shape: st.tuples(
    st.just(tuple(shape)),
    st.tuples(*[st.lists(st.integers(0, n), max_size=3) for n in shape]),
    st.tuples(*[st.lists(st.integers(0, n), max_size=3) for n in shape])))


@given(st.lists(dims, min_size=0, max_size=3).flatmap(lambda shape: st.tuples(
    st.just(tuple(shape)),
    st.tuples(*[st.lists(st.integers(1, max(1, n - 1)), max_size=3) for n in shape]),
    st.tuples(*[st.lists(st.integers(1, max(1, n - 1)), max_size=3) for n in shape]))))
def test_plan_covers_every_target_element_exactly_once(case):
    shape, save_cuts, target_cuts = case
    chunks = grid_chunks(shape, save_cuts)
    assert planner.chunks_cover(shape, chunks)
    full = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for t in grid_chunks(shape, target_cuts):
        box = (t.offsets, t.sizes)
        plan = planner.plan_target(box, chunks, "leaf")
        out = np.full(t.sizes, -1, dtype=np.int64)
        hits = np.zeros(t.sizes, dtype=np.int64)
        for p in plan.pieces:
            src = full[box_to_slices((p.chunk.offsets, p.chunk.sizes))]
            out[p.dst] = src[p.src]
            hits[p.dst] += 1
        assert (hits == 1).all()
        assert np.array_equal(out, full[box_to_slices(box)])
        assert sum(p.elements for p in plan.pieces) == int(np.prod(t.sizes))


@given(cut_grids)
def test_planning_many_boxes_at_once_agrees_with_one_at_a_time(case):
    # The short path (a box that is one chunk) must give what the full
    # comparison gives, for boxes that are chunks, cross chunks or hold several.
    shape, save_cuts, target_cuts = case
    chunks = grid_chunks(shape, save_cuts)
    boxes = [(c.offsets, c.sizes) for c in grid_chunks(shape, target_cuts) + chunks]
    want = [planner.plan_target(b, chunks, "leaf") for b in boxes]
    assert planner.plan_boxes(boxes, chunks, "leaf") == want
    if not shape:
        return
    with pytest.raises(ValueError, match="cover"):  # a box off the tiles is still refused
        planner.plan_boxes([(tuple(0 for _ in shape), tuple(n + 1 for n in shape))],
                           chunks, "leaf")


def other_leaf(chunks, name):
    """The chunks of another leaf of the same layout: the same boxes, in the
    same order, under other keys and of another size (another dtype)."""
    return [dataclasses.replace(c, key=f"{name}/{c.key}", nbytes=c.nbytes * 2,
                                stored_nbytes=c.stored_nbytes * 2) for c in chunks]


@given(cut_grids)
def test_a_layout_planned_once_gives_each_leaf_its_own_fresh_plan(case):
    # Boxes that are chunks, cross chunks or hold several: the plan kept from
    # one leaf, given another leaf's chunks, is what planning that leaf anew gives.
    shape, save_cuts, target_cuts = case
    a = grid_chunks(shape, save_cuts)
    boxes = list(dict.fromkeys((c.offsets, c.sizes)
                               for c in grid_chunks(shape, target_cuts) + a))
    plans = planner.LayoutPlans()
    kept = plans.plan(boxes, a, "leaf a")
    for chunks in (a, other_leaf(a, "b")):
        got = plans.plan(boxes, chunks, "leaf b")
        assert got is kept
        fresh = planner.plan_boxes(boxes, chunks, "leaf b")
        assert got.targets(chunks) == {p.box: p for p in fresh}
        assert got.singles(chunks) == {p.box: p.single for p in fresh if p.single is not None}
        parts = {p.box: p for p in fresh if p.single is None}
        assert got.targets(chunks, with_exact=False) == parts


def test_another_layout_is_planned_anew():
    plans = planner.LayoutPlans()
    rows = grid_chunks((8, 4), [[2, 4, 6], []])
    kept = plans.plan([(c.offsets, c.sizes) for c in rows], rows, "leaf a")
    # Other target boxes (another sharding) of the same chunks.
    halves = [((0, 0), (4, 4)), ((4, 0), (4, 4))]
    got = plans.plan(halves, rows, "leaf b")
    assert got is not kept
    assert got.targets(rows) == {p.box: p for p in planner.plan_boxes(halves, rows, "b")}
    # The same target boxes against chunks cut otherwise (saved on another mesh).
    cols = grid_chunks((8, 4), [[], [2]])
    same_boxes = [(c.offsets, c.sizes) for c in rows]
    got = plans.plan(same_boxes, cols, "leaf c")
    assert got is not kept
    assert got.targets(cols) == {p.box: p for p in planner.plan_boxes(same_boxes, cols, "c")}
    assert got.singles(cols) == {}


def test_a_layout_that_fails_to_plan_fails_for_every_leaf_by_name():
    plans = planner.LayoutPlans()
    chunks = grid_chunks((4, 4), [[2], [2]])[:-1]  # a corner missing
    full = [((0, 0), (4, 4))]
    for name in ("leaf a", "leaf b"):
        with pytest.raises(ValueError, match=f"{name}: the saved chunks cover 12 of the 16"):
            plans.plan(full, other_leaf(chunks, name), name)
