"""A save's agreement as a vote (`core.summary`): the maximum of every
process's vector decides exactly what the full rule decides from every view
(`catalog.JobView.decided`), or says to agree through the store."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from resilient_ckpt.catalog.catalog import JobView
from resilient_ckpt.core import summary
from resilient_ckpt.core.shares import Share
from tests.support import effort
from tests.support.shares import TIERS, job_views


def vote(views, candidates, tiers=TIERS):
    rows = [summary.encode(v, candidates, tiers, q, len(views)) for q, v in enumerate(views)]
    return summary.decide(np.max(rows, axis=0), candidates, tiers, views[0]["orbax"])


def full(views):
    return json.loads(json.dumps(JobView.decided(views).to_json()))


@settings(max_examples=effort.examples(300), deadline=None)
@given(job_views())
def test_a_vote_decides_what_every_view_decides_or_defers(drawn):
    views, candidates, regular = drawn
    got = vote(views, candidates)
    if regular:  # a job running normally never needs the store
        assert got is not None
    if got is not None:
        assert json.loads(json.dumps(got)) == full(views)


def _view(q, n, steps=(10, 20), tiers=("ram", "gcs"), **kw):
    shares = [Share(s, f"id{s}", q, n, t, 100.0 + s + q).to_json() for s in steps for t in tiers]
    return {"shares": shares, "pending": [], "errors": [], "orbax": [], **kw}


def test_a_normal_job_s_vote_counts_its_saves_and_where_each_is_whole():
    n = 4
    views = [_view(q, n) for q in range(n)]
    views[2]["shares"] = [s for s in views[2]["shares"] if not (s[0] == 20 and s[4] == "ram")]
    views[3]["pending"] = [30]
    cands = [(10, "id10", n), (20, "id20", n), (30, "id30", n)]
    got = vote(views, cands)
    assert got == full(views)
    assert got["steps"] == [[10, "id10", 113.0, n, ["gcs", "ram"]],
                            [20, "id20", 123.0, n, ["gcs"]]]
    assert got["pending"] == [30] and got["unsettled"] == []


@pytest.mark.parametrize("change", [
    {"errors": ["the disk is full"]},  # a failure's text needs the store
    {"in_use": "locked by pid 7"},
    {"save_id": "abc"},
    {"pending": [99]},  # a step that is no candidate
    {"orbax": [5]},  # Orbax steps differ
])
def test_what_a_vector_cannot_carry_sends_the_job_to_the_store(change):
    n = 3
    views = [_view(q, n) for q in range(n)]
    views[1].update(change)
    assert vote(views, [(10, "id10", n), (20, "id20", n)]) is None


def test_a_share_of_no_candidate_or_of_another_process_sends_the_job_to_the_store():
    n = 3
    cands = [(10, "id10", n), (20, "id20", n)]
    views = [_view(q, n) for q in range(n)]
    views[1]["shares"].append(Share(30, "id30", 1, n, "ram", 1.0).to_json())
    assert vote(views, cands) is None
    views = [_view(q, n) for q in range(n)]
    views[1]["shares"].append(Share(10, "id10", 2, n, "gcs", 1.0).to_json())
    assert vote(views, cands) is None
    views = [_view(q, n) for q in range(n)]  # the first process: only every share, or its own
    views[0]["shares"].append(Share(10, "id10", 1, n, "gcs", 1.0).to_json())
    assert vote(views, cands) is None
    views[0]["shares"].append(Share(10, "id10", 2, n, "gcs", 1.0).to_json())
    assert vote(views, cands) == full(views)


def test_tiers_named_differently_on_one_process_send_the_job_to_the_store():
    n = 2
    cands = [(10, "id10", n)]
    rows = [summary.encode(_view(q, n, steps=(10,)), cands, tiers, q, n)
            for q, tiers in enumerate([("ram", "gcs"), ("ram", "gcs", "local")])]
    assert {len(r) for r in rows} == {summary.WIDTH}  # one shape for the all-reduce
    assert summary.decide(np.max(rows, axis=0), cands, ("ram", "gcs"), []) is None


def test_more_tiers_than_a_vector_holds_send_the_job_to_the_store():
    tiers = [f"t{i}" for i in range(summary.TIERS + 1)]
    assert vote([_view(0, 1, steps=(10,), tiers=tiers)], [(10, "id10", 1)], tiers) is None


def test_more_candidates_than_slots_send_the_job_to_the_store():
    cands = [(s, f"id{s}", 1) for s in range(summary.SLOTS + 1)]
    assert vote([_view(0, 1, steps=())], cands) is None


def test_a_negative_or_nan_created_sends_the_job_to_the_store():
    for when in (-1.0, float("nan")):
        views = [_view(0, 1, steps=())]
        views[0]["shares"] = [Share(10, "id10", 0, 1, "ram", when).to_json()]
        assert vote(views, [(10, "id10", 1)]) is None


@given(st.lists(st.booleans(), min_size=1, max_size=64))
@settings(max_examples=effort.examples(300), deadline=None)
def test_a_restore_s_vote_picks_the_reader_the_store_s_rule_picks(has):
    size = len(has)
    reduced = np.max([summary.reader_row(h, q, size) for q, h in enumerate(has)], axis=0)
    assert summary.first_reader(reduced, size) == summary.first_reader_of(
        [{"has": h} for h in has])


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=64))
@settings(max_examples=effort.examples(300), deadline=None)
def test_a_restore_s_outcome_vote_decides_only_when_nothing_is_missing(outcomes):
    reduced = np.max([summary.outcome_row(f, h) for f, h in outcomes], axis=0)
    assert reduced.shape == (summary.WIDTH,)
    assert (not reduced[0]) == (not any(f or h for f, h in outcomes))
