"""The save-due decision: `options.due`, one pure function of the resolved
plan and the facts of one call, which every save asks."""
from __future__ import annotations

from hypothesis import given, strategies as st

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, GcsTier, LocalTier, RamTier
from resilient_ckpt.options import SaveRule, due, resolve


class Asked:
    """An answer that records being asked."""

    def __init__(self, value: bool):
        self.value, self.times = value, 0

    def __call__(self) -> bool:
        self.times += 1
        return self.value


def plan_of(**kw):
    """A plan of a RAM tier (every 2), a local tier (the options' interval) and
    a GCS tier of its own interval (every 10)."""
    kw.setdefault("save_interval_steps", 5)
    tiers = (RamTier(every=2), LocalTier(path="/tmp/x"), GcsTier(url="gs://b/p", every=10))
    return resolve(CheckpointManagerOptions(tiers=tiers, **kw), "/data/ckpt")


def names(tiers) -> list[str]:
    return [t.name for t in tiers]


def test_the_plan_says_when_a_save_is_due():
    plan = plan_of(save_on_steps=[7], should_save_fn=None)
    assert plan.saving == SaveRule(read_only=False, on_steps=[7], by_fn=False, by_policy=False)
    assert {t.name: t.own_every for t in plan.tiers} == {"ram": True, "local": False,
                                                         "gcs": True}
    assert plan_of(read_only=True).saving.read_only
    assert plan_of(should_save_fn=lambda s, latest: True).saving.by_fn
    assert plan_of(save_decision_policy=object()).saving.by_policy


def test_intervals_first_save_save_on_steps_and_preemption():
    plan = plan_of(save_on_steps=[7])
    assert names(due(plan, 4, 3)) == ["ram"]
    assert names(due(plan, 10, 9)) == ["ram", "local", "gcs"]
    assert names(due(plan, 3, 2)) == []
    first = Asked(False)
    assert names(due(plan, 3, None, preempted=first)) == ["ram", "local", "gcs"]
    assert first.times == 0  # the first save needs no preemption check
    assert names(due(plan, 7, 6)) == ["ram", "local", "gcs"]
    assert names(due(plan, 3, 2, preempted=lambda: True)) == ["ram", "local", "gcs"]


def test_nothing_is_due_read_only_or_not_newer_and_nothing_is_asked():
    questions = [Asked(True), Asked(True), Asked(True)]
    kw = dict(zip(("preempted", "fn_says", "policy_says"), questions, strict=True))
    assert due(plan_of(read_only=True), 10, None, force=True, **kw) == ()
    assert due(plan_of(should_save_fn=lambda s, latest: True), 5, 5, **kw) == ()
    assert due(plan_of(save_decision_policy=object()), 4, 5, **kw) == ()
    assert [q.times for q in questions] == [0, 0, 0]


def test_force_saves_to_every_tier_whatever_the_latest_step():
    plan = plan_of(should_save_fn=lambda s, latest: False)
    never = Asked(False)
    assert names(due(plan, 3, 8, force=True, fn_says=never, preempted=never)) == [
        "ram", "local", "gcs"]
    assert never.times == 0


def test_should_save_fn_decides_for_every_tier_then_the_preemption():
    plan = plan_of(should_save_fn=lambda s, latest: True, save_on_steps=[4])
    yes, no, preempted = Asked(True), Asked(False), Asked(False)
    assert names(due(plan, 4, 2, fn_says=yes, preempted=preempted)) == ["ram", "local", "gcs"]
    assert preempted.times == 0  # asked only when the function says no
    assert due(plan, 4, None, fn_says=no, preempted=preempted) == ()  # no first-save rule
    assert preempted.times == 1
    assert names(due(plan, 3, 2, fn_says=no, preempted=lambda: True)) == [
        "ram", "local", "gcs"]


def test_a_policy_decides_for_the_tiers_without_their_own_interval():
    plan = plan_of(save_decision_policy=object(), save_on_steps=[3])
    preempted = Asked(True)
    assert names(due(plan, 3, None, policy_says=lambda: True, preempted=preempted)) == ["local"]
    assert names(due(plan, 10, 9, policy_says=lambda: False)) == ["ram", "gcs"]
    assert names(due(plan, 20, 9, policy_says=lambda: True)) == ["ram", "local", "gcs"]
    assert preempted.times == 0  # the policy is handed the preemption itself


opt_every = st.one_of(st.none(), st.integers(0, 6))
tier_configs = st.lists(st.one_of(
    st.builds(RamTier, every=st.integers(0, 6)),
    st.builds(LocalTier, path=st.just("/tmp/x"), every=opt_every),
    st.builds(GcsTier, url=st.just("gs://b/p"), every=opt_every)), max_size=4)


@given(tier_configs, st.integers(0, 6), st.sampled_from(["plain", "fn", "policy"]),
       st.booleans(), st.booleans(), st.integers(0, 30), st.one_of(st.none(), st.integers(0, 30)),
       st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_due_is_the_rule_of_the_options(configs, interval, how, read_only, on_steps, step,
                                        latest, force, preempted, fn, policy):
    o = CheckpointManagerOptions(
        tiers=configs, save_interval_steps=interval, read_only=read_only,
        save_on_steps=[step] if on_steps else None,
        should_save_fn=(lambda s, last: fn) if how == "fn" else None,
        save_decision_policy=object() if how == "policy" else None)
    plan = resolve(o, "/data/ckpt")
    asked = [Asked(preempted), Asked(fn), Asked(policy)]
    got = due(plan, step, latest, force=force, preempted=asked[0], fn_says=asked[1],
              policy_says=asked[2])
    every = names(plan.tiers)
    assert names(got) == [n for n in every if n in names(got)]  # the plan's order, no repeats
    on_interval = [t.name for t in plan.tiers if t.every and step % t.every == 0]
    if read_only:
        want: list[str] = []
    elif force:
        want = every
    elif latest is not None and latest >= step:
        want = []
    elif how == "policy":
        want = [t.name for t in plan.tiers
                if (t.name in on_interval if t.config.every is not None else policy)]
    elif how == "fn":
        want = every if fn or preempted else []
    else:
        want = every if latest is None or on_steps or preempted else on_interval
    assert names(got) == want
    assert all(a.times <= 1 for a in asked)  # each question at most once
    if read_only or force or (latest is not None and latest >= step):
        assert [a.times for a in asked] == [0, 0, 0]
    assert asked[1].times == (how == "fn" and not read_only and not force
                              and (latest is None or latest < step))


def test_the_manager_saves_to_the_tiers_due_says(tmp_path):
    ram = tmp_path / "ram"
    o = CheckpointManagerOptions(tiers=(RamTier(every=2, path=str(ram)),
                                        LocalTier(path=str(tmp_path / "local"))),
                                 save_interval_steps=3, enable_async_checkpointing=False)
    with CheckpointManager(tmp_path / "ckpt", options=o) as m:
        assert m.should_save(1)  # the first save
        assert m.save(1, args=_args())
        assert [m.should_save(s) for s in (2, 3, 5, 6)] == [True, True, False, True]
        assert m.save(2, args=_args())
        assert [r.step for r in m.save_records] == [1, 2]
        assert not m.save(5, args=_args())
        assert m.save(5, args=_args(), force=True)
        assert m.save_records[-1].step == 5


def _args():
    import numpy as np
    import orbax.checkpoint as ocp
    return ocp.args.StandardSave({"x": np.arange(4, dtype=np.float32)})
