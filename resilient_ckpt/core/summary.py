"""A save's (and a restore's) agreement as one fixed-size vector per process,
combined by max.

The job's rule (`catalog.JobView.decided` over every process's view) needs
every view; at thousands of hosts, moving them through one coordinator costs
at least 2N requests a round. In the common case, a job that runs normally,
each view says little that the others cannot predict: every process reports
its own share of the same few saves in the same tiers, the steps it is still
writing, no failure, the same Orbax steps. This module writes that much of
a view as a vector of a fixed size, `encode`, such that the elementwise
maximum of all processes' vectors (one all-reduce on the devices,
`multihost.vote`) is enough for `decide` to compute exactly the decision the
full rule would make from the full views. Anything a vector cannot say
(a failure, a save that is not among the candidates, a share reported for
another process other than in whole by the first one, tiers or Orbax steps
that differ between processes) makes the vector irregular, and the job then
agrees through the store as before: every process sees the same maximum, so
every process takes the same way.

The candidates are the saves the vectors speak of, the same list on every
process (built from the last agreed view and the saves started since, which
every process knows alike). A candidate's slot holds maxima of:
- `any`: a process reports some share of it; `whole`: one holds a whole copy;
- `missing[t]`: a process lacks its own share in tier t (so its negation,
  after the max, is "every process holds its own share in t");
- `missing_any`: a process has its own share in no tier;
- `extras[t]`: the first process reports every writer's share in t (it
  holds them all: a save by a job of another size, where each process
  reports its part of the writers, makes the vector irregular anyway);
- `pending`: a process is still writing the candidate's step;
- `created`: the newest `created` of the shares reported, as the bits of a
  non-negative float64 (whose order as integers is the floats' order).
A restore's two later rounds are vectors of the same width (`reader_row`,
`outcome_row`): who reads the step, and whether every process read its part
whole.
Pure functions of their inputs, checked against the full rule by a
Hypothesis property (tests/core/test_summary.py).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from .shares import WHOLE, Save

SLOTS = 32  # candidate saves one vector speaks of; more: agree through the store
TIERS = 8  # tiers it speaks of (every vector has the same length on every process)
_HEAD = 5  # irregular, tiers' hash and its negation, Orbax steps' hash and its negation
_ANY, _WHOLE, _MISSING_ANY, _PENDING, _CREATED = range(5)
_FIXED = 5  # per slot, before missing[t] and extras[t]


WIDTH = _HEAD + SLOTS * (_FIXED + 2 * TIERS)  # every vector's length


def _hash(value: Any) -> int:
    """A 62-bit digest of a JSON-able value (so that its negation fits too)."""
    raw = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
    return int.from_bytes(raw[:8], "big") >> 2


def _slot(c: int) -> int:
    return _HEAD + c * (_FIXED + 2 * TIERS)


def encode(view: dict, candidates: Sequence[Save], tiers: Sequence[str], rank: int,
           size: int) -> np.ndarray:
    """This process's vector: `view` as `catalog.Catalog.report` builds it,
    `rank` its writer label among `size` live processes."""
    out = np.zeros(WIDTH, np.int64)
    out[1], out[3] = _hash(list(tiers)), _hash(sorted(view.get("orbax", ())))
    out[2], out[4] = -out[1], -out[3]
    index = {key: c for c, key in enumerate(candidates)}
    where = {t: i for i, t in enumerate(tiers)}
    if (len(candidates) > SLOTS or len(tiers) > TIERS or view.get("errors") or view.get("in_use")
            or view.get("save_id") is not None or "boxes" in view):
        out[0] = 1
        return out
    own = np.zeros((SLOTS, len(tiers)), bool)
    others: dict[tuple[int, int], set[int]] = {}
    created = np.zeros(SLOTS, np.float64)
    seen = np.zeros(SLOTS, bool)
    for raw in view.get("shares", ()):
        step, sid, process, count, tier, when = raw
        c = index.get((int(step), str(sid), int(count)))
        if c is None or count != size or not when >= 0.0 or (
                tier not in where and process != WHOLE):
            out[0] = 1
            return out
        seen[c] = True
        created[c] = max(created[c], float(when))
        base = _slot(c)
        if process == WHOLE:
            out[base + _WHOLE] = 1
        elif process == rank:
            own[c, where[tier]] = True
        elif rank == 0 and 0 <= process < count:
            others.setdefault((c, where[tier]), set()).add(int(process))
        else:
            out[0] = 1
            return out
    for (c, t), labels in others.items():
        if labels | ({rank} if own[c, t] else set()) != set(range(size)):
            out[0] = 1  # part of the others' shares: only the whole views tell
            return out
        out[_slot(c) + _FIXED + TIERS + t] = 1
    steps = {int(s) for s in view.get("pending", ())}
    if not steps <= {key[0] for key in candidates}:
        out[0] = 1
        return out
    for c, (step, _, _) in enumerate(candidates):
        base = _slot(c)
        out[base + _ANY] = int(seen[c])
        out[base + _MISSING_ANY] = int(not own[c].any())
        out[base + _PENDING] = int(step in steps)
        out[base + _CREATED] = created[c:c + 1].view(np.int64)[0]
        out[base + _FIXED:base + _FIXED + len(tiers)] = ~own[c]
    return out


def decide(reduced: np.ndarray, candidates: Sequence[Save], tiers: Sequence[str],
           orbax: Sequence[int]) -> dict | None:
    """The job's decision (`catalog.JobView.to_json`'s form) from the
    elementwise maximum of every process's vector; None when some process's
    view was irregular (agree through the store). `orbax`: this process's
    Orbax steps (the same on every process when the vector is regular)."""
    if reduced[0] or reduced[1] != -reduced[2] or reduced[3] != -reduced[4]:
        return None
    n = len(tiers)
    agreed: dict[int, list] = {}
    pending: set[int] = set()
    reported: list[Save] = []
    for c, key in enumerate(candidates):
        step, sid, count = key
        base = _slot(c)
        if reduced[base + _PENDING]:
            pending.add(step)
        if not reduced[base + _ANY]:
            continue
        reported.append(key)
        extras = reduced[base + _FIXED + TIERS:base + _FIXED + TIERS + n].astype(bool)
        complete = [t for i, t in enumerate(tiers)
                    if extras[i] or not reduced[base + _FIXED + i]]
        if reduced[base + _WHOLE] or extras.any() or not reduced[base + _MISSING_ANY]:
            created = float(reduced[base + _CREATED:base + _CREATED + 1].view(np.float64)[0])
            old = agreed.get(step)
            if old is None or (created, sid) > (old[2], old[1]):
                agreed[step] = [step, sid, created, count, sorted(complete)]
    newest = max(agreed, default=None)
    unsettled = sorted({k for k in reported
                        if (newest is None or k[0] > newest) and k[0] not in pending})
    return {"steps": [agreed[s] for s in sorted(agreed)], "pending": sorted(pending),
            "errors": [], "orbax": sorted(set(orbax) - set(agreed)),
            "unsettled": [list(u) for u in unsettled], "save_id": None, "refusals": []}


# A restore's two later rounds, in the first values of a vector of the same
# width (the job's one reduction program): who reads the step, each
# process's outcome. Beside each encoding, the store's rule over every view.

def reader_row(has: bool, rank: int, size: int) -> np.ndarray:
    """Whether this process lacks the step, and (size - rank) where it has it:
    after the max, whether some process lacks it and the first that has it."""
    out = np.zeros(WIDTH, np.int64)
    out[0], out[1] = int(not has), size - rank if has else 0
    return out


def first_reader(reduced: np.ndarray, size: int) -> int | None:
    """The first process (a rank) that has the step where some process lacks
    it; None where every process has it, or none does."""
    return size - int(reduced[1]) if reduced[0] and reduced[1] else None


def first_reader_of(views: Sequence[dict]) -> int | None:
    """The store's rule: the same answer from every process's {"has": bool}."""
    if all(v["has"] for v in views):
        return None
    return next((q for q, v in enumerate(views) if v["has"]), None)


def outcome_row(failed: bool, holes: bool) -> np.ndarray:
    """Whether this process failed its part of a restore or left shards unread:
    after the max, whether the round needs every process's account (the store)."""
    out = np.zeros(WIDTH, np.int64)
    out[0] = int(failed or holes)
    return out

