"""Parity with Orbax 0.12.8 for its policy objects: `save_decision_policy`
and `preservation_policy`, given to Orbax's manager and to ours (with our
options and with Orbax's options class), in lockstep.

Each test drives the managers step by step side by side, so the few
time-based cases share one short `time.sleep`: Orbax's time-based policies
read the wall clock (`datetime.now()` in its manager) and take no clock of
their own, so no fake clock can be handed to them. The sleeps add up to
about 3 s.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt import LocalTier, RamTier
from tests.support.policies import IMPLS, _loss, lockstep

cm = ocp.checkpoint_managers


def assert_same(traces: dict[str, list[tuple]]) -> list[tuple]:
    ref = traces["orbax"]
    for name, got in traces.items():
        assert got == ref, f"{name} differs from Orbax:\n{got}\n{ref}"
    return ref


# ------------------------------------------------------------------ save decisions

SAVE_CASES: dict[str, tuple[Callable[[], Any], Sequence[int], dict]] = {
    # no InitialSavePolicy: the first save waits for the interval, unlike our default
    "fixed_interval": (lambda: cm.FixedIntervalPolicy(3), range(1, 8), {}),
    "specific_steps": (lambda: cm.SpecificStepsPolicy({2, 5}), range(7), {}),
    "initial_only": (lambda: cm.InitialSavePolicy(), range(1, 4), {}),
    "any": (lambda: cm.AnySavePolicy([cm.FixedIntervalPolicy(4), cm.SpecificStepsPolicy({1, 6}),
                                      cm.InitialSavePolicy()]), range(1, 10), {}),
    "preemption": (lambda: cm.AnySavePolicy([cm.FixedIntervalPolicy(5),
                                             cm.PreemptionCheckpointingPolicy()]),
                   range(7), dict(preempt=frozenset({3}))),
    "continuous": (lambda: cm.ContinuousCheckpointingPolicy(), range(3), {}),
    # 1 s apart at least: step 1 comes too soon, step 2 after the pause
    "continuous_min_interval": (lambda: cm.ContinuousCheckpointingPolicy(minimum_interval_secs=1),
                                range(4), dict(pause={2: 1.3})),
}


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_save_decision_policy(tmp_path, case):
    policy, steps, kw = SAVE_CASES[case]
    ref = assert_same(lockstep(tmp_path, lambda o: o(save_decision_policy=policy()), steps,
                               **kw))
    if case != "continuous":  # that one saves whenever no save is running
        assert any(not row[2] for row in ref[:-1]), "the policy must refuse some step"


class RecordingSavePolicy:
    """A user's own policy (no Orbax base class): records what it is given;
    saves the first step, then once the last saved step's loss is high and
    two steps have passed."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def should_save(self, step, previous_steps, *, context) -> bool:
        assert step.time.tzinfo is not None
        assert abs(step.time - datetime.datetime.now(datetime.UTC)).total_seconds() < 60
        assert all(p.time <= step.time for p in previous_steps)
        self.calls.append((step.step, step.metrics, [(p.step, p.metrics) for p in previous_steps],
                           context.is_saving_in_progress, context.reached_preemption))
        if not previous_steps:
            return True
        last = previous_steps[-1]
        return last.metrics["loss"] > 0.5 and step.step - last.step >= 2


def test_user_written_save_policy_gets_what_orbax_gives(tmp_path):
    made: list[RecordingSavePolicy] = []

    def options(o):
        made.append(RecordingSavePolicy())
        return o(save_decision_policy=made[-1], max_to_keep=3)
    losses = [0.9, 0.8, 0.3, 0.7, 0.6, 0.9, 0.2, 0.8, 0.9]
    assert_same(lockstep(tmp_path, options, range(9), metrics=lambda s: {"loss": losses[s]},
                         preempt=frozenset({4})))
    ref = made[0].calls
    assert len(ref) > 9  # should_save, then save's own call, for each step
    for policy in made[1:]:
        assert policy.calls == ref


# ------------------------------------------------------------------ preservation


PRESERVE_CASES: dict[str, tuple[Callable[[], Any], Sequence[int], dict]] = {
    # ours with Orbax's options maps a bare LatestN to max_to_keep; ours with ours does not
    "latest_n": (lambda: cm.LatestN(2), range(5), {}),
    "every_n_steps": (lambda: cm.AnyPreservationPolicy([cm.EveryNSteps(3), cm.LatestN(1)]),
                      range(8), {}),
    "every_n_steps_inexact": (lambda: cm.AnyPreservationPolicy([
        cm.EveryNSteps(3, exact_interval=False, max_to_keep=2), cm.LatestN(1)]), range(10), {}),
    "custom_steps": (lambda: cm.AnyPreservationPolicy([cm.CustomSteps([1, 4]), cm.LatestN(2)]),
                     range(7), {}),
    "best_n": (lambda: cm.AnyPreservationPolicy([
        cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2), cm.LatestN(1)]),
               range(8), dict(metrics=_loss)),
    "best_n_without_metrics_dropped": (lambda: cm.AnyPreservationPolicy([
        cm.BestN(get_metric_fn=lambda m: m["loss"], n=2, keep_checkpoints_without_metrics=False),
        cm.LatestN(1)]), range(6), dict(metrics=lambda s: None if s % 2 else _loss(s))),
    # 1 s apart: step 1 comes too soon and goes once it is not the latest
    "every_n_seconds": (lambda: cm.AnyPreservationPolicy([cm.EveryNSeconds(1), cm.LatestN(1)]),
                        range(4), dict(pause={2: 1.6})),
}


@pytest.mark.parametrize("case", list(PRESERVE_CASES))
def test_preservation_policy(tmp_path, case):
    policy, steps, kw = PRESERVE_CASES[case]
    ref = assert_same(lockstep(tmp_path, lambda o: o(preservation_policy=policy()), steps,
                               **kw))
    assert len(ref[-1][1]) < len(steps), "the policy must delete some step"


def test_best_n_alone_keeps_our_newest_step(tmp_path):
    """BestN alone can drop the step Orbax just saved; ours keeps the newest
    step (docs/orbax_differences.md) and otherwise deletes what Orbax does."""
    def policy():
        return cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2)
    traces = lockstep(tmp_path, lambda o: o(preservation_policy=policy()), range(8),
                      metrics=_loss)
    for name in ("ours", "ours+ocp_options"):
        for got, ref in zip(traces[name][:-1], traces["orbax"][:-1], strict=True):
            assert got[:3] == ref[:3]
            assert got[3] == sorted(set(ref[3]) | {got[0]}), (name, got, ref)
    assert traces["orbax"][6][3] == [3, 5]  # Orbax dropped step 6 at once
    assert traces["ours"][6][3] == [3, 5, 6]
    assert traces["orbax"][-1] == traces["ours"][-1] == ("reopened", [5, 7])


class KeepFlagged:
    """A user's own preservation policy: keeps the steps whose metrics say
    so, and the newest."""

    def __init__(self) -> None:
        self.seen: list[list[tuple]] = []

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        assert all(c.time.tzinfo is not None for c in checkpoints)
        self.seen.append([(c.step, c.metrics) for c in checkpoints])
        return [bool(c.metrics and c.metrics["keep"]) or c is checkpoints[-1]
                for c in checkpoints]


def test_user_written_preservation_policy(tmp_path):
    made: list[KeepFlagged] = []

    def options(o):
        made.append(KeepFlagged())
        return o(preservation_policy=made[-1])
    ref = assert_same(lockstep(tmp_path, options, range(6),
                               metrics=lambda s: {"keep": s in (1, 3, 5)}))
    assert ref[-1] == ("reopened", [1, 3, 5])
    # the last call saw the same steps, oldest first, with their metrics
    assert made[1].seen[-1] == made[0].seen[-1] == made[2].seen[-1]


def test_orbax_keep_time_interval_is_its_rule(tmp_path):
    """Orbax's `keep_time_interval` (ours has no such field) with
    `max_to_keep`, given in Orbax's options."""
    def options(o):
        return o(keep_time_interval=datetime.timedelta(seconds=1), max_to_keep=1)
    ref = assert_same(lockstep(tmp_path, options, range(4), pause={2: 1.6},
                               impls=(IMPLS[0], IMPLS[2])))
    assert ref[-1] == ("reopened", [0, 2, 3])


@pytest.mark.parametrize("extra", [dict(max_to_keep=2), dict(keep_period=3)])
def test_policy_and_delete_options_exclude_each_other(tmp_path, extra):
    for n, mgr, opts in IMPLS:
        with pytest.raises(ValueError):
            mgr(str(tmp_path / n), options=opts(preservation_policy=cm.LatestN(1), **extra))


# ------------------------------------------------------------------ ours: tiers


def test_policies_govern_the_tiers_that_take_the_managers_options(tmp_path, ram_path):
    """A tier with its own interval and keep (the RAM tier) keeps them; the
    local tier saves when the save policy says so and keeps what the
    preservation policy keeps (and its newest step)."""
    o = rc.CheckpointManagerOptions(
        tiers=(RamTier(every=1, keep=1, path=ram_path), LocalTier()),
        save_decision_policy=cm.FixedIntervalPolicy(3),
        preservation_policy=cm.CustomSteps([3]))
    with rc.CheckpointManager(str(tmp_path / "tiers"), options=o) as m:
        for s in range(1, 8):
            m.save(s, args=ocp.args.StandardSave({"x": np.arange(3) + s}))
            m.wait_until_finished()
        assert sorted(m.catalog.view("ram")) == [7]
        assert sorted(m.catalog.view("local")) == [3, 6]
        assert m.all_steps() == [3, 6, 7]


def test_orbax_options_carry_the_policy_objects():
    save, keep = cm.FixedIntervalPolicy(2), cm.EveryNSteps(4)
    ours = rc.CheckpointManagerOptions.from_any(
        ocp.CheckpointManagerOptions(save_decision_policy=save, preservation_policy=keep))
    assert ours.save_decision_policy is save and ours.preservation_policy is keep
    latest = rc.CheckpointManagerOptions.from_any(
        ocp.CheckpointManagerOptions(preservation_policy=cm.LatestN(3)))
    assert latest.max_to_keep == 3 and latest.preservation_policy is None
