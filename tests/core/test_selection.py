"""Hypothesis properties of selection: the last viable step, across tiers.

Observations are generated per (step, tier): the manifest absent, valid, torn
(unparseable) or incomplete (a chunk entry missing), and per chunk its object
present, missing or short. An independent oracle says which steps are viable.
"""
import random

import numpy as np
from hypothesis import given, settings, strategies as st

from resilient_ckpt.core import manifest as mf
from resilient_ckpt.core.selection import TierStep, last_viable, viable
from resilient_ckpt.errors import CorruptCheckpointError
from tests.support import effort

TIERS = ("ram", "local")


def make_manifest(step: int, n_chunks: int, drop: bool = False) -> mf.Manifest:
    rows = 2 * n_chunks
    chunks = tuple(mf.ChunkRecord((2 * i,), (2,), f"s{step}.c0.0.{2 * i}", 8, 8, i)
                   for i in range(n_chunks))
    if drop:
        chunks = chunks[:-1]
    leaf = mf.LeafRecord((("key", "w"),), "array", (rows,), "float32", None, None, None, chunks)
    return mf.Manifest(step, f"{step:032x}", float(step), 0, 1,
                       (mf.ItemRecord("default", "pytree", (leaf,)),))


tier_state = st.sampled_from(["absent", "valid", "valid", "torn", "incomplete"])
chunk_state = st.sampled_from(["ok", "ok", "ok", "missing", "short"])


@st.composite
def worlds(draw):
    steps = draw(st.lists(st.integers(0, 50), min_size=0, max_size=6, unique=True))
    world = {}
    for s in steps:
        n = draw(st.integers(1, 4))
        per_tier = {}
        for t in TIERS:
            state = draw(tier_state)
            chunks = [draw(chunk_state) for _ in range(n)]
            per_tier[t] = (state, chunks)
        world[s] = (n, per_tier)
    order_seed = draw(st.integers(0, 2**32 - 1))
    return world, order_seed


def observations(world, seed):
    rng = random.Random(seed)
    obs = {}
    steps = list(world)
    rng.shuffle(steps)  # listing order must not matter
    for s in steps:
        n, per_tier = world[s]
        good = make_manifest(s, n)
        views = []
        tiers = list(TIERS)
        rng.shuffle(tiers)
        for t in tiers:
            state, chunks = per_tier[t]
            if state == "absent":
                continue
            if state == "torn":
                m = CorruptCheckpointError("torn")
                try:  # a real torn manifest, parsed for real
                    mf.parse(mf.to_json(good)[: rng.randrange(1, 40)])
                except CorruptCheckpointError as e:
                    m = e
            elif state == "incomplete":
                m = make_manifest(s, n, drop=True)
            else:
                m = good
            sizes = {}
            for i, c in enumerate(good.items[0].leaves[0].chunks):
                cs = chunks[i]
                sizes[c.key] = {"ok": 8, "missing": None, "short": 5}[cs]
            views.append(TierStep(t, (m,), sizes))
        if views:
            obs[s] = views
    return obs


def oracle(world):
    """Steps viable by the rules, computed without the selection module."""
    out = set()
    for s, (n, per_tier) in world.items():
        holders = [t for t in TIERS if per_tier[t][0] == "valid"]
        # an incomplete manifest of the same save leaves that tier unusable only if
        # it is the only one; a valid one elsewhere still commits the step.
        if holders and all(any(per_tier[t][1][i] == "ok" for t in holders) for i in range(n)):
            out.add(s)
    return out


@settings(max_examples=effort.examples(400))
@given(worlds())
def test_selects_newest_viable_and_only_viable(w):
    world, seed = w
    expect = oracle(world)
    obs = observations(world, seed)
    chosen = last_viable(obs, TIERS)
    if not expect:
        assert chosen is None
        return
    assert chosen is not None and chosen.step == max(expect)
    # every chunk of the chosen step has a source of the recorded size
    n, per_tier = world[chosen.step]
    for i, c in enumerate(chosen.manifest.items[0].leaves[0].chunks):
        assert chosen.sources[c.key]
        for t in chosen.sources[c.key]:
            assert per_tier[t][0] == "valid" and per_tier[t][1][i] == "ok"
        # sources are ordered fastest first
        assert list(chosen.sources[c.key]) == sorted(chosen.sources[c.key], key=TIERS.index)


@given(worlds(), st.integers(0, 2**32 - 1))
def test_selection_does_not_depend_on_listing_order(w, seed2):
    world, seed = w
    a = viable(observations(world, seed), TIERS)
    b = viable(observations(world, seed2), TIERS)
    assert {s: (c.save_id, dict(c.sources)) for s, c in a.items()} == \
           {s: (c.save_id, dict(c.sources)) for s, c in b.items()}
    assert set(a) == oracle(world)


@given(worlds(), st.data())
def test_bad_copies_move_selection_to_the_next_copy_or_older_step(w, data):
    world, seed = w
    obs = observations(world, seed)
    first = last_viable(obs, TIERS)
    if first is None:
        return
    # a checksum failure on one copy of one chunk of the chosen step
    key = data.draw(st.sampled_from(sorted(first.sources)))
    tier = first.sources[key][0]
    again = last_viable(obs, TIERS, bad=frozenset({(tier, key)}))
    if len(first.sources[key]) > 1:
        assert again.step == first.step and tier not in again.sources[key]
    else:
        older = {s for s in oracle(world) if s < first.step}
        assert (again is None and not older) or again.step == max(older)


def test_a_newer_save_of_a_step_wins_only_when_viable():
    old = make_manifest(5, 2)
    new = mf.Manifest(5, "f" * 32, 99.0, 0, 1, old.items)  # same keys, other save
    sizes = {c.key: 8 for _, _, c in old.chunks()}
    obs = {5: [TierStep("ram", (new,), {k: None for k in sizes}),
               TierStep("local", (old,), sizes)]}
    c = last_viable(obs, TIERS)
    assert c.save_id == old.save_id and set(sum(c.sources.values(), ())) == {"local"}
    obs[5][0] = TierStep("ram", (new,), sizes)
    assert last_viable(obs, TIERS).save_id == new.save_id


def test_multi_process_step_needs_every_process_manifest():
    def part(p):
        c = mf.ChunkRecord((2 * p,), (2,), f"k{p}", 8, 8, 0)
        leaf = mf.LeafRecord((("key", "w"),), "array", (4,), "float32", None, None, None, (c,))
        return mf.Manifest(3, "a" * 32, 1.0, p, 2, (mf.ItemRecord("default", "pytree", (leaf,)),))
    obs = {3: [TierStep("local", (part(0),), {"k0": 8})]}
    assert last_viable(obs, TIERS) is None
    obs[3].append(TierStep("ram", (part(1),), {"k1": 8}))
    c = last_viable(obs, TIERS)
    assert c.step == 3 and c.sources == {"k0": ("local",), "k1": ("ram",)}
    assert np.sum([len(lf.chunks) for lf in c.manifest.items[0].leaves]) == 2


def _summary(choices):
    return {s: (c.save_id, dict(c.sources)) for s, c in choices.items()}


@given(worlds(), worlds(), st.data())
def test_a_memo_carried_between_calls_never_changes_the_answer(w1, w2, data):
    # A catalog between two calls: some steps' views kept as the very same
    # objects, others replaced (a commit, a delete, a re-read), new ones added,
    # and maybe a copy found bad; the memo must reuse only what did not change.
    before = observations(*w1)
    memo: dict = {}
    assert _summary(viable(before, TIERS, memo=memo)) == _summary(viable(before, TIERS))
    after = observations(*w2)
    for s in before:
        if data.draw(st.booleans()):
            after[s] = before[s]  # unchanged: the same objects
    keys = sorted({(ts.tier, k) for views in after.values() for ts in views for k in ts.sizes})
    bad = frozenset(data.draw(st.lists(st.sampled_from(keys), max_size=2)) if keys else ())
    assert _summary(viable(after, TIERS, bad, memo)) == _summary(viable(after, TIERS, bad))
    assert _summary(viable(after, TIERS, bad, memo)) == _summary(viable(after, TIERS, bad))
