"""Agreement across processes, as pure functions (Hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from resilient_ckpt.core.shares import Share, agree, box_report, covered, unsettled
from tests.support import effort
from tests.support.shares import TIERS, reports


@settings(max_examples=effort.examples(300))
@given(reports())
def test_a_save_is_viable_exactly_when_every_share_is_somewhere(data):
    views, truth = data
    agreed = agree(views)
    for (step, sid), (count, held, whole, _) in truth.items():
        everyone = whole or all(held[q] for q in range(count))
        rivals = [(c, s) for (st_, s), (n, h, w, c) in truth.items() if st_ == step
                  and (w or all(h[q] for q in range(n)))]
        if not everyone:
            assert step not in agreed or agreed[step].save_id != sid
            continue
        best = max(rivals)
        assert agreed[step].save_id == best[1]
        if best[1] == sid:  # a tier serves it alone when it holds every share
            alone = {t for t in TIERS if all(t in held[q] for q in range(count))}
            assert agreed[step].complete_in == alone
    assert set(agreed) == {s for (s, _), (n, h, w, _) in truth.items()
                           if w or all(h[q] for q in range(n))}


@given(reports(), st.randoms())
def test_every_process_decides_the_same_from_the_same_reports(data, rnd):
    """Whatever the order shares arrive in, or who reported them, the answer
    is the same: it is what every process computes from the exchange."""
    views, _ = data
    flat = [s for v in views for s in v]
    rnd.shuffle(flat)
    regrouped = [flat[i::3] for i in range(3)]
    assert agree(views) == agree(regrouped) == agree([sorted(flat)])


def test_json_round_trip():
    s = Share(3, "ab", 1, 2, "ram", 1.5)
    assert Share.from_json(s.to_json()) == s


def test_readable_uses_every_copy_of_a_process_manifest():
    """A per-host tier's copy of a manifest lists a replica chunk too; the
    shared tier's copy does not. Both contribute: the chunk whose RAM copy
    failed is still read from the shared tier, and the replica from RAM."""
    from resilient_ckpt.core import manifest as mf
    from resilient_ckpt.core.selection import TierStep
    from resilient_ckpt.core.shares import readable

    def chunk(row):
        return mf.ChunkRecord((row,), (2,), f"00000000.c0.0.{row}", 8, 8, row)

    def manifest(rows):
        leaf = mf.LeafRecord((("key", "w"),), "array", (4,), "float32", None, None, None,
                             tuple(chunk(r) for r in rows))
        return mf.Manifest(5, "s" * 32, 1.0, 0, 2, (mf.ItemRecord("default", "pytree", (leaf,)),))

    ram = TierStep("ram", (manifest([0, 2]),), {chunk(0).key: 8, chunk(2).key: 8})
    local = TierStep("local", (manifest([0]),), {chunk(0).key: 8})
    c = readable([ram, local], ["ram", "local"], frozenset({("ram", chunk(0).key)}),
                 5, "s" * 32)
    assert c is not None
    assert c.sources == {chunk(0).key: ("local",), chunk(2).key: ("ram",)}
    assert {ch.key for ch in c.manifest.items[0].leaves[0].chunks} == {chunk(0).key,
                                                                      chunk(2).key}


def test_a_copy_packed_elsewhere_is_no_source_of_the_kept_record():
    """After a loss, a survivor reads with the shared tier's manifests too.
    Its own RAM pack holds a replica of writer 0's chunk, at another place
    than writer 0's pack on the shared tier, and its own chunk at another
    place than its own pack there: each chunk is read only from the tiers
    that hold it where its kept record says (before, the survivor looked for
    writer 0's pack in its own RAM, failed, and fell back with a warning)."""
    from resilient_ckpt.core import manifest as mf
    from resilient_ckpt.core.selection import TierStep
    from resilient_ckpt.core.shares import readable

    def chunk(row, pack, at):
        return mf.ChunkRecord((row,), (2,), f"00000000.c0.0.{row}", 8, 8, row,
                              pack=pack, pack_offset=at)

    def manifest(process, chunks):
        leaf = mf.LeafRecord((("key", "w"),), "array", (4,), "float32", None, None, None,
                             tuple(chunks))
        return mf.Manifest(5, "s" * 32, 1.0, process, 2,
                           (mf.ItemRecord("default", "pytree", (leaf,)),))

    k0, k2 = chunk(0, "x", 0).key, chunk(2, "x", 0).key
    ram = TierStep("ram", (manifest(1, [chunk(0, "00000000.p1.a", 0),
                                        chunk(2, "00000000.p1.a", 64)]),), {k0: 8, k2: 8})
    local = TierStep("local", (manifest(0, [chunk(0, "00000000.p0.b", 0)]),
                               manifest(1, [chunk(2, "00000000.p1.c", 0)])), {k0: 8, k2: 8})
    c = readable([ram, local], ["ram", "local"], frozenset(), 5, "s" * 32)
    assert c is not None
    assert c.sources == {k0: ("local",), k2: ("ram",)}
    kept = {ch.key: ch for ch in c.manifest.items[0].leaves[0].chunks}
    assert kept[k0].object == "00000000.p0.b" and kept[k2].object == "00000000.p1.a"
    # The same pack at the same place in both tiers: both are sources.
    same = TierStep("local", (manifest(1, [chunk(0, "00000000.p1.a", 0),
                                           chunk(2, "00000000.p1.a", 64)]),), {k0: 8, k2: 8})
    c = readable([ram, same], ["ram", "local"], frozenset(), 5, "s" * 32)
    assert c is not None and c.sources == {k0: ("ram", "local"), k2: ("ram", "local")}


# ---------------------------------------------------------------- the union of what processes read

def _grid(rows: int, cols: int, gr: int, gc: int) -> list[list]:
    """The boxes ([offsets, sizes]) of a (rows, cols) leaf cut in gr x gc blocks."""
    br, bc = rows // gr, cols // gc
    return [[[i * br, j * bc], [br, bc]] for i in range(gr) for j in range(gc)]


def _box_report(step, sid, count, boxes, shape=(4, 6)):
    return [[step, sid, count, [["default", 0, list(shape), boxes]]]]


@settings(max_examples=effort.examples(300))
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.data())
def test_a_save_is_covered_exactly_when_every_box_is_held_somewhere(gr, gc, nprocs, data):
    """Each box on any subset of processes (replicas on several, or none):
    the save counts exactly when every box is held by some process, however
    they are spread, and a box held many times never stands in for another."""
    boxes = _grid(4 * gr, 3 * gc, gr, gc)
    holders = [data.draw(st.sets(st.integers(0, nprocs - 1), max_size=nprocs)) for _ in boxes]
    reports = [_box_report(7, "s", 2, [b for b, h in zip(boxes, holders, strict=True) if q in h],
                           (4 * gr, 3 * gc)) for q in range(nprocs)]
    shares_ = [[Share(7, "s", 0, 2, "ram", 3.0)]]  # process 1's share is lost
    got = covered(shares_, [(7, "s", 2)], reports)
    assert (7 in got) == all(holders), (holders, got)
    if all(holders):
        assert got[7].save_id == "s" and got[7].created == 3.0 and got[7].count == 2
        assert got[7].complete_in == frozenset()  # no tier holds every share
    # Regrouped or reordered, the same answer: every process computes it alike.
    assert covered(shares_, [(7, "s", 2)], reports[::-1]) == got


def test_spread_coverage_counts_where_no_share_and_no_process_does():
    """Four boxes of one leaf, process 1's share lost; its boxes are held by
    processes 2 and 3, one each: no share rule and no whole copy counts the
    save, the union of what the processes read does."""
    b = _grid(4, 6, 2, 2)
    shares_ = [[Share(5, "s", 0, 4, "ram", 1.0)], [], [Share(5, "s", 2, 4, "ram", 1.0)],
               [Share(5, "s", 3, 4, "ram", 1.0)]]
    assert 5 not in agree(shares_)
    reports = [_box_report(5, "s", 4, [b[0]]), [], _box_report(5, "s", 4, [b[0], b[1]]),
               _box_report(5, "s", 4, [b[2], b[3]])]
    assert set(covered(shares_, [(5, "s", 4)], reports)) == {5}
    missing = [_box_report(5, "s", 4, [b[0]]), [], _box_report(5, "s", 4, [b[0], b[1]]),
               _box_report(5, "s", 4, [b[2], b[2]])]  # box 3 nowhere, box 2 twice
    assert covered(shares_, [(5, "s", 4)], missing) == {}


def test_replicas_are_counted_once_not_by_their_elements():
    """Two copies of one box have the elements of two boxes; they still leave
    the other box uncovered."""
    b = _grid(4, 6, 2, 1)
    reports = [_box_report(5, "s", 2, [b[0]]), _box_report(5, "s", 2, [b[0]])]
    assert covered([], [(5, "s", 2)], reports) == {}


def test_records_that_disagree_on_a_leaf_are_not_counted():
    b = _grid(4, 6, 2, 1)
    reports = [_box_report(5, "s", 2, [b[0]]), _box_report(5, "s", 2, [b[1]], shape=(4, 7))]
    assert covered([], [(5, "s", 2)], reports) == {}
    assert set(covered([], [(5, "s", 2)], [_box_report(5, "s", 2, [b[0]]),
                                           _box_report(5, "s", 2, [b[1]])])) == {5}


def test_only_unsettled_saves_are_counted_and_the_newest_save_of_a_step_wins():
    b = _grid(4, 6, 1, 1)
    reports = [_box_report(5, "old", 1, b) + _box_report(5, "new", 1, b)
               + _box_report(6, "x", 1, b)]
    shares_ = [[Share(5, "old", 0, 1, "ram", 1.0), Share(5, "new", 0, 1, "ram", 2.0)]]
    got = covered(shares_, [(5, "old", 1), (5, "new", 1)], reports)
    assert set(got) == {5} and got[5].save_id == "new"


def test_the_second_round_is_asked_only_for_saves_that_may_need_it():
    """Saves newer than every agreed step, that agree did not count, of steps
    no process is still writing: none while a job runs normally."""
    def s(step, q, count=2, sid="s"):
        return Share(step, sid, q, count, "ram", float(step))
    reports = [[s(4, 0), s(5, 0), s(6, 0), s(3, 0)], [s(4, 1)]]
    agreed = agree(reports)
    assert set(agreed) == {4}
    assert unsettled(reports, agreed, set()) == [(5, "s", 2), (6, "s", 2)]
    assert unsettled(reports, agreed, {6}) == [(5, "s", 2)]  # 6: a writer is still at it
    running = [[s(4, 0), s(5, 0)], [s(4, 1)]]  # step 5: process 1 still writing
    assert unsettled(running, agree(running), {5}) == []
    whole = [[s(4, 0), s(5, 0)], [s(4, 1), s(5, 1)]]
    assert unsettled(whole, agree(whole), set()) == []


def _tier_step(tier, process, count, rows, sizes_of=None):
    from resilient_ckpt.core import manifest as mf
    from resilient_ckpt.core.selection import TierStep

    def chunk(row):
        return mf.ChunkRecord((row, 0), (1, 3), f"00000000.c0.{row}.0", 12, 12, row)
    leaf = mf.LeafRecord((("key", "w"),), "array", (4, 3), "float32", None, None, None,
                         tuple(chunk(r) for r in rows))
    m = mf.Manifest(5, "s" * 32, 1.0, process, count,
                    (mf.ItemRecord("default", "pytree", (leaf,)),))
    sizes = {chunk(r).key: 12 for r in (rows if sizes_of is None else sizes_of)}
    return TierStep(tier, (m,), sizes)


def test_box_report_lists_the_boxes_with_an_intact_copy_here():
    """Per save asked about: each leaf's distinct boxes this process can read
    (a missing or bad copy left out); a save it holds nothing of is not listed."""
    obs = {5: [_tier_step("ram", 0, 3, [0, 1, 2], sizes_of=[0, 2])]}
    sid = "s" * 32
    rep = box_report(obs, ["ram"], frozenset(), [(5, sid, 3), (6, "t", 3)])
    assert rep == [[5, sid, 3, [["default", 0, [4, 3], [((0, 0), (1, 3)), ((2, 0), (1, 3))]]]]]
    bad = frozenset({("ram", "00000000.c0.2.0")})
    assert box_report(obs, ["ram"], bad, [(5, sid, 3)])[0][3][0][3] == [((0, 0), (1, 3))]


def test_job_view_counts_a_save_whose_boxes_the_processes_hold_together():
    """Through JSON, as the exchange carries it: the shares leave step 5
    unagreed, the second round's boxes make it agreed, on every process."""
    import json

    from resilient_ckpt.catalog.catalog import JobView
    sid = "s" * 32
    obs = [{5: [_tier_step("ram", q, 3, rows)]} for q, rows in ((0, [0, 1]), (2, [2, 3]))]
    shares_ = [Share(5, sid, q, 3, "ram", 1.0).to_json() for q in (0, 2)]
    views = [dict(shares=[v], pending=[], errors=[], orbax=[]) for v in shares_]
    job = JobView.decided(json.loads(json.dumps(views)))
    assert job.steps == {} and job.unsettled == [(5, sid, 3)]
    boxes = [{"boxes": box_report(o, ["ram"], frozenset(), job.unsettled)} for o in obs]
    job.cover(json.loads(json.dumps(boxes)))
    assert set(job.steps) == {5} and job.steps[5].complete_in == frozenset()
    again = JobView.decided(views)
    again.cover([{"boxes": box_report(obs[0], ["ram"], frozenset(), again.unsettled)},
                 {"boxes": []}])  # rows 2 and 3 nowhere
    assert again.steps == {}
