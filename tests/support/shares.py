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
