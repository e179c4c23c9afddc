"""Retention, as a pure function: which of a tier's steps to delete.

Orbax's preservation rules, applied per tier: keep the newest `keep` steps (all
when None), or with `best_fn` the best `keep` by metric (steps without metrics
kept when `keep_checkpoints_without_metrics`); also keep every step that is a
multiple of `keep_period`. With a preservation `policy` (Orbax's objects,
policies.py) the policy alone decides instead. Never delete any step in
`protected`, nor (unless `keep_newest=False`, Orbax's own rule) the tier's
newest step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from . import policies

BestMode = Literal["min", "max"]


@dataclasses.dataclass(frozen=True)
class Retention:
    """Orbax's preservation rule, applied to every tier with that tier's `keep`;
    a preservation `policy` instead, on the tiers it governs."""

    keep_period: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: BestMode = "max"
    keep_without_metrics: bool = True
    policy: Any = None  # a preservation policy, for the tiers named in `policy_tiers`
    policy_tiers: frozenset[str] = frozenset()
    keep_newest: bool = True  # never delete the newest step (False: Orbax's rule alone)


def to_delete(steps: Sequence[int], keep: int | None, *, keep_period: int | None = None,
              best_fn: Callable[[Any], float] | None = None, best_mode: str = "max",
              metrics: Mapping[int, Any] | None = None,
              keep_checkpoints_without_metrics: bool = True,
              protected: frozenset = frozenset(), policy: Any = None,
              times: Mapping[int, float] | None = None, keep_newest: bool = True) -> list[int]:
    steps = sorted(set(steps))
    if not steps:
        return []
    metrics = metrics or {}
    kept: set[int] = ({steps[-1]} if keep_newest else set()) | (set(protected) & set(steps))
    if policy is not None:  # `times`: when each step's save started
        infos = [policies.StepInfo.known(s, (times or {}).get(s), metrics.get(s)) for s in steps]
        return [s for s in steps if s not in kept | policies.preserved(policy, infos)]
    if keep_period:
        kept |= {s for s in steps if s % keep_period == 0}
    if best_fn is None:
        kept |= set(steps if keep is None else steps[max(0, len(steps) - keep):] if keep else [])
    elif keep is None or len(steps) <= keep:
        kept |= set(steps)  # as Orbax's BestN: nothing goes until there are more than `keep`
    else:
        if keep_checkpoints_without_metrics:
            kept |= {s for s in steps if metrics.get(s) is None}
        ranked = rank_best(steps, metrics, best_fn, best_mode)
        kept |= set(ranked[-keep:] if keep else [])
    return [s for s in steps if s not in kept]


def rank_best(steps: Sequence[int], metrics: Mapping[int, Any],
              best_fn: Callable[[Any], float], best_mode: str = "max") -> list[int]:
    """The steps that have metrics, worst first and best last.

    As Orbax: a stable sort of the steps in ascending order, so among equal
    values the newer step ranks better.
    """
    with_m = [s for s in sorted(steps) if metrics.get(s) is not None]
    return sorted(with_m, key=lambda s: best_fn(metrics[s]), reverse=(best_mode == "min"))
