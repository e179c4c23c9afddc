"""The bookkeeping of a save that failed on every tier: the step is not
listed once its writes are over (in flight it may be, as in Orbax), its
failure is raised once (never again by `close` or a `with` block's exit), and
it keeps no claim, so the same step can be saved again by the same manager.

Real faults: the tiers' directories replaced by regular files (every write
fails; tests run as root, so chmod would not stop them), and metrics nested
deeper than the strict JSON writer allows (the manifest is refused).
"""
from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout


def opts(ram: str, local: str) -> rc.CheckpointManagerOptions:
    return rc.CheckpointManagerOptions(tiers=(rc.RamTier(path=ram), rc.LocalTier(path=local)))


def item(v: float):
    return ocp.args.StandardSave({"a": np.full(4, v, np.float32)})


def deep_metrics() -> dict:
    deep: list = []
    for _ in range(150):
        deep = [deep]
    return {"loss": deep}


def break_dir(path: str) -> None:
    os.rename(path, path + ".away")
    with open(path, "w") as f:
        f.write("not a directory")


def mend_dir(path: str) -> None:
    os.remove(path)
    os.rename(path + ".away", path)


@pytest.mark.parametrize("raised_by", ["wait_until_finished", "close", "with"])
def test_a_save_failed_on_every_tier_goes_from_the_listing_and_is_raised_once(
        tmp_path, ram_path, raised_by):
    local = str(tmp_path / "local")
    m = rc.CheckpointManager(local, options=opts(ram_path, local))
    m.save(1, args=item(1.0))
    m.wait_until_finished()
    for d in (ram_path, local):
        break_dir(d)
    try:
        assert m.save(2, args=item(2.0))
        with pytest.raises(rc.SaveFailedError) as ei:
            if raised_by == "with":
                with m:
                    pass
            else:
                getattr(m, raised_by)()
        told = sorted((e.step, e.tier) for e in (ei.value.failures or (ei.value,)))
        assert told == [(2, "local"), (2, "ram")]
        assert m.latest_step() == 1 and m.all_steps() == [1]
        assert not m.is_saving_in_progress()
        m.close()  # raised once: never again
        with m:
            pass
        m.check_for_errors()
    finally:
        for d in (ram_path, local):
            mend_dir(d)
    with rc.CheckpointManager(local, options=opts(ram_path, local)) as m:
        assert m.all_steps() == [1]
        assert m.save(2, args=item(2.0))
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
        assert m.restore(2)["a"].tolist() == [2.0] * 4


def test_a_save_refused_at_its_manifest_keeps_no_claim_and_can_be_saved_again(
        tmp_path, ram_path):
    local = str(tmp_path / "local")
    with rc.CheckpointManager(local, options=opts(ram_path, local)) as m:
        m.save(1, args=item(1.0))
        m.save(2, args=item(2.0), metrics=deep_metrics())
        with pytest.raises(rc.SaveFailedError) as ei:
            m.wait_until_finished()
        assert "nests deeper than" in str(ei.value)
        assert m.latest_step() == 1 and m.all_steps() == [1]
        for root in (ram_path, local):  # no chunk, no claim, no directory of step 2
            assert not os.path.exists(os.path.join(root, "2")), os.listdir(
                os.path.join(root, "2"))
        assert m.save(2, args=item(2.5), metrics={"loss": 0.5})  # the same step, again
        m.wait_until_finished()
        assert m.all_steps() == [1, 2] and m.metrics(2) == {"loss": 0.5}
    with rc.CheckpointManager(local, options=opts(ram_path, local)) as m:
        assert m.all_steps() == [1, 2]
        assert m.restore(2)["a"].tolist() == [2.5] * 4
        claim = os.path.join(local, "2", layout.claim_name(0, 1))
        assert os.path.exists(claim)  # a committed step keeps its claim
