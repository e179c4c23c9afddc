"""Agreement across processes, as pure functions (Hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from resilient_ckpt.shares import WHOLE, Share, agree

TIERS = ["ram", "local", "gcs"]


@st.composite
def reports(draw):
    """Random shares of a few saves of a few steps, spread over processes'
    reports, with the truth of which saves are whole."""
    out: list[list[Share]] = [[] for _ in range(draw(st.integers(1, 4)))]
    truth = {}
    for step in range(draw(st.integers(0, 4))):
        for k in range(draw(st.integers(1, 2))):
            sid, count = f"s{step}.{k}", draw(st.integers(1, 4))
            created = float(draw(st.integers(0, 5)))
            held: dict[int, set[str]] = {}
            for q in range(count):
                tiers = draw(st.sets(st.sampled_from(TIERS), max_size=3))
                held[q] = tiers
                for t in tiers:
                    reporter = draw(st.integers(0, len(out) - 1))
                    out[reporter].append(Share(step, sid, q, count, t, created))
            whole = draw(st.booleans()) and draw(st.integers(0, 3)) == 0
            if whole:
                out[0].append(Share(step, sid, WHOLE, count, "*", created))
            truth[(step, sid)] = (count, held, whole, created)
    return out, truth


@settings(max_examples=300, deadline=None)
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


@settings(max_examples=200, deadline=None)
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
    from resilient_ckpt import manifest as mf
    from resilient_ckpt.selection import TierStep
    from resilient_ckpt.shares import readable

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
