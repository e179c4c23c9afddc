"""Which file tiers a job shares, from the probes each process finds.

At the open every process puts a probe file in each file tier and, after a
barrier, looks for the first live process's probe there: a process that
finds it says only that (`BESIDE_FIRST`: one stat, not a listing of N
probes on every host); the others, and the first, list the probes they see
(`probe_view`: "shared", "own", or the first few). Each reports a few
bytes per tier, so the open's round stays O(N) on the coordinator, and the
rule over those reports (`tier_kinds`) must decide what the rule over the
whole listings decides:
shared when every process sees every probe, its own when each sees only
its own, an error naming a process for anything between (a directory some
processes share, or a leftover probe of a dead launch).
"""
from hypothesis import given, strategies as st

from resilient_ckpt.catalog.catalog import BESIDE_FIRST, probe_view, tier_kinds


def _reference(live: list[int], seen: dict[int, set[int]]) -> str:
    """The rule over the whole listings: "shared", "own" or "error"."""
    if all(seen[q] == set(live) for q in live):
        return "shared"
    if all(seen[q] == {q} for q in live):
        return "own"
    return "error"


def _sight(q: int, seen: set[int], live: list[int]):
    """As `Coordinator._sight` does from a directory holding `seen`'s probes."""
    if q != live[0] and live[0] in seen:
        return BESIDE_FIRST
    return probe_view(seen, live, q)


def _kinds(live: list[int], tiers: dict[str, dict[int, set[int]]]) -> dict[str, str]:
    views = [{"probes": {"process": q, "tiers": {n: _sight(q, seen[q], live)
                                                 for n, seen in tiers.items()}}}
             for q in live]
    return tier_kinds(views)


@st.composite
def _job(draw):
    """Live process indices (a gap where a process was lost) and, per tier,
    which directory each process's probe went to: what each one then lists
    is the probes of its directory's processes, plus maybe a leftover."""
    n = draw(st.integers(2, 40))
    live = sorted(draw(st.sets(st.integers(0, n + 3), min_size=2, max_size=n)))
    tiers = {}
    for name in draw(st.lists(st.sampled_from(["ram", "local", "nfs"]), min_size=1,
                              max_size=3, unique=True)):
        dirs = draw(st.sampled_from(["one", "each", "some"]))
        home = {q: 0 if dirs == "one" else q if dirs == "each"
                else draw(st.integers(0, 3)) for q in live}
        seen = {q: {p for p in live if home[p] == home[q]} for q in live}
        for q in draw(st.sets(st.sampled_from(live), max_size=2)):  # a dead launch's probe
            seen[q].add(draw(st.integers(0, n + 3)))
        tiers[name] = seen
    return live, tiers


@given(_job())
def test_the_reports_decide_what_the_whole_listings_decide(job):
    live, tiers = job
    got = _kinds(live, tiers)
    assert set(got) == set(tiers)
    for name, seen in tiers.items():
        want = _reference(live, {q: s & set(live) for q, s in seen.items()})
        if want == "error":
            assert got[name] not in ("shared", "own")
            assert "process " in got[name], got[name]  # names who sees what
        else:
            assert got[name] == want


@given(_job())
def test_a_report_is_a_few_bytes_whatever_the_job(job):
    live, tiers = job
    for seen in tiers.values():
        for q in live:
            view = _sight(q, seen[q], live)
            assert view in ("shared", "own", BESIDE_FIRST) or len(view) <= 9


def test_the_error_names_the_processes_that_see_too_much():
    live = [0, 1, 2, 3]
    seen = {0: {0, 1}, 1: {0, 1}, 2: {2}, 3: {3}}  # 0 and 1 share a directory
    got = _kinds(live, {"local": seen})["local"]
    assert "process 0 sees the probes of [0, 1]" in got
    assert "process 1" not in got and "process 2" not in got  # as expected of them
    seen = {0: {0}, 1: {1, 2}, 2: {1, 2}}  # 1 and 2 share one the first does not see
    got = _kinds([0, 1, 2], {"local": seen})["local"]
    assert got == "process 1 sees the probes of [1, 2]; process 2 sees the probes of [1, 2]"
    seen = {0: {0, 1, 2}, 1: {0, 1, 2}, 2: {2}}  # (a listing that missed a probe)
    got = _kinds([0, 1, 2], {"local": seen})["local"]
    assert "process 0 sees the probes of [0, 1, 2]" not in got and "process 2" in got, got


def test_a_process_that_did_not_probe_is_named():
    views = [{"probes": {"process": 0, "tiers": {"local": "shared"}}}, {}]
    assert tier_kinds(views) == {"local": "process 1 did not probe it"}
    assert tier_kinds([{}, {}]) == {}  # read-only managers: nothing probed
