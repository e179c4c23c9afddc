"""Hypothesis strategies for agreement: random shares of a few saves spread
over the reports of a few processes, with the truth of which saves are whole."""
from __future__ import annotations

from hypothesis import strategies as st

from resilient_ckpt.core.shares import WHOLE, Share

TIERS = ["ram", "local", "gcs"]


@st.composite
def reports(draw, max_processes: int = 4):
    """(reports, truth): per process the shares it reports; per save
    (step, save_id) its writer count, who holds which tier, whether a whole
    copy was reported, and its `created`."""
    out: list[list[Share]] = [[] for _ in range(draw(st.integers(1, max_processes)))]
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


@st.composite
def job_views(draw, max_processes: int = 5):
    """(views, candidates, regular): every process's view at a save's
    agreement (`catalog.Catalog.report`'s form) as a job running normally
    makes them (each reports its own shares; the first, sometimes, every
    process's share in the shared tier), the candidate saves, and whether
    nothing was drawn that a vote cannot carry (`core.summary`). With
    `regular` False, one irregularity is drawn: a failure, a share of
    another process, part of the others' shares, a save that is not a
    candidate, a pending step that is not, or Orbax steps that differ."""
    n = draw(st.integers(1, max_processes))
    shares: list[list[Share]] = [[] for _ in range(n)]
    saves = []
    for step in draw(st.lists(st.integers(0, 9), unique=True, max_size=4)):
        for k in range(draw(st.integers(1, 2))):
            sid = f"s{step}.{k}"
            saves.append((step, sid, n))
            for q in range(n):
                when = float(draw(st.integers(0, 3)))
                for t in draw(st.sets(st.sampled_from(TIERS), max_size=3)):
                    shares[q].append(Share(step, sid, q, n, t, when))
            if draw(st.integers(0, 3)) == 0:
                shares[0] += [Share(step, sid, q, n, "gcs", 1.0) for q in range(n)]
            if draw(st.integers(0, 4)) == 0:
                shares[draw(st.integers(0, n - 1))].append(Share(step, sid, WHOLE, n, "*", 2.0))
    candidates = sorted(set(saves) | {(s, "spare", n) for s in
                                      draw(st.lists(st.integers(0, 12), max_size=2))})
    steps = sorted({c[0] for c in candidates})
    pending = [sorted(draw(st.sets(st.sampled_from(steps), max_size=2))) if steps else []
               for _ in range(n)]
    errors: list[list[str]] = [[] for _ in range(n)]
    orbax = [[1, 2]] * n
    regular = draw(st.booleans())
    if not regular:
        q = draw(st.integers(0, n - 1))
        kind = draw(st.sampled_from(["error", "other", "part", "unknown", "pending", "orbax"]))
        if kind == "error":
            errors[q] = ["disk full"]
        elif kind == "other" and n > 1 and q > 0:
            shares[q].append(Share(99, "x", (q + 1) % n, n, "gcs", 1.0))
            candidates = sorted(set(candidates) | {(99, "x", n)})
        elif kind == "part" and n > 2:
            shares[0] += [Share(50, "p", 1, n, "gcs", 1.0), Share(50, "p", 0, n, "gcs", 1.0)]
            candidates = sorted(set(candidates) | {(50, "p", n)})
        elif kind == "unknown":
            shares[q].append(Share(77, "u", q, n, "ram", 1.0))
        elif kind == "pending":
            pending[q] = [1000]
        elif kind == "orbax" and n > 1:
            orbax = [[1, 2]] * (n - 1) + [[1]]
        else:
            regular = True
    views = [{"shares": [s.to_json() for s in sorted(set(shares[q]))], "pending": pending[q],
              "errors": errors[q], "orbax": orbax[q]} for q in range(n)]
    return views, candidates, regular
