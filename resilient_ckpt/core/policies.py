"""Orbax's policy objects, asked the way Orbax's own manager asks them.

This module owns the two calls into a user's policy: `should_save` hands a
save-decision policy (Orbax's `FixedIntervalPolicy`, `ContinuousCheckpointingPolicy`,
`AnySavePolicy`, ... or any object with a `should_save(step, previous_steps, *,
context)` method) the step about to be saved, the steps that exist, and an
Orbax `DecisionContext`; `preserved` hands a preservation policy (`LatestN`,
`EveryNSteps`, `BestN`, `AnyPreservationPolicy`, ... or any object with
`should_preserve(checkpoints, *, context)`) a tier's steps, oldest first, and
returns the ones it keeps. Steps travel as `StepInfo`, which has the three
attributes of Orbax's `PolicyCheckpointInfo`: `step`, `time`, `metrics`.
"""
from __future__ import annotations

import datetime
import functools
import time as time_lib
from collections.abc import Callable, Sequence
from typing import Any


class StepInfo:
    """One step as a policy sees it. `time` is a UTC datetime (when the step's
    save started; the epoch when unknown) and `metrics` what `save` was given.
    Both are read on first use: a policy that never looks costs no reads."""

    def __init__(self, step: int, read_time: Callable[[], float | None],
                 read_metrics: Callable[[], Any]):
        self.step = step
        self._read_time, self._read_metrics = read_time, read_metrics

    @classmethod
    def known(cls, step: int, created: float | None, metrics: Any) -> StepInfo:
        """A step whose time and metrics are already at hand."""
        return cls(step, lambda: created, lambda: metrics)

    @functools.cached_property
    def time(self) -> datetime.datetime:
        seconds = self._read_time()
        return datetime.datetime.fromtimestamp(seconds or 0.0, tz=datetime.UTC)

    @functools.cached_property
    def metrics(self) -> Any:
        return self._read_metrics()

    def __repr__(self) -> str:
        return f"StepInfo(step={self.step})"


def should_save(policy: Any, step: int, previous: Sequence[StepInfo], *, saving: bool,
                preempted: bool) -> bool:
    """`policy`'s answer for `step`. As in Orbax, the step is stamped now and
    has no metrics, and the context holds whether a save is still running
    and whether a preemption was reached."""
    from orbax.checkpoint import checkpoint_managers, options
    context = checkpoint_managers.DecisionContext(
        is_saving_in_progress=saving, reached_preemption=preempted,
        multiprocessing_options=options.MultiprocessingOptions())
    now = StepInfo.known(step, time_lib.time(), None)
    return bool(policy.should_save(now, previous_steps=list(previous), context=context))


def preserved(policy: Any, steps: Sequence[StepInfo]) -> set[int]:
    """The steps (given oldest first) that `policy` preserves."""
    from orbax.checkpoint import checkpoint_managers
    flags = list(policy.should_preserve(list(steps),
                                        context=checkpoint_managers.PreservationContext()))
    if len(flags) != len(steps):
        raise ValueError(f"preservation policy {policy!r} answered {len(flags)} flags for "
                         f"{len(steps)} steps; should_preserve must return one per step")
    return {s.step for s, keep in zip(steps, flags, strict=True) if keep}
