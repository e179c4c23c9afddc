"""Hostile step numbers from the caller: negative, past int64, bools, floats,
numpy non-integers. Every entry point that takes a step (the manager's save,
restore, delete and metadata, the training Checkpointer, the command line)
refuses them with a ValueError naming the step and the range, before anything
is written, claimed or locked; a numpy integer is a step like any other.

Before the shared check, save(2**63) and save(10**23) returned True and were
listed by that manager but by no later one (their manifests are refused on
read): a save silently lost.
"""
from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt import training
from resilient_ckpt.core import layout
from tests.support.cli import run

BAD = [-1, 2**63, 10**23, True, False, 1.5, 3.0, np.float32(2.0), np.float64(4.0),
       np.bool_(True), "7", None]
BAD_IDS = [f"{type(v).__name__}({v!r})" for v in BAD]


def manager(d) -> rc.CheckpointManager:
    return rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
        tiers=(rc.LocalTier(),)))


def item(v: float = 1.0):
    return ocp.args.StandardSave({"a": np.full(3, v)})


def refused(call, step) -> None:
    with pytest.raises(ValueError, match=r"steps are whole numbers in \[0, 9223372036854775807\]"
                       ) as ei:
        call(step)
    assert "not a step number" in str(ei.value) and repr(step)[:20] in str(ei.value)


@pytest.mark.parametrize("step", BAD, ids=BAD_IDS)
def test_check_step_refuses_what_no_reader_lists(step):
    refused(layout.check_step, step)


def test_check_step_takes_ints_and_numpy_integers_as_ints():
    for v in (0, 5, layout.MAX_STEP, np.int64(9), np.uint8(3), np.int32(0)):
        out = layout.check_step(v)
        assert type(out) is int and out == int(v)


@pytest.mark.parametrize("step", BAD, ids=BAD_IDS)
def test_save_refuses_a_bad_step_before_writing_anything(tmp_path, step):
    d = tmp_path / "c"
    with manager(d) as m:
        before = sorted(os.listdir(d))
        refused(lambda s: m.save(s, args=item(), force=True), step)
        assert sorted(os.listdir(d)) == before  # no step, no lock, no tiers record
        assert m.all_steps() == [] and not m.is_saving_in_progress()


def test_every_step_taking_call_refuses_and_nothing_is_lost(tmp_path):
    d = tmp_path / "c"
    with manager(d) as m:
        assert m.save(np.int64(1), args=item()) is True  # a numpy integer is a step
        m.wait_until_finished()
        for step in (-1, 2**63, True, 1.0):
            refused(lambda s: m.save(s, args=item()), step)
            refused(m.restore, step)
            refused(m.delete, step)
            refused(m.metadata, step)
            refused(m.item_metadata, step)
        assert m.all_steps() == [1] and type(m.all_steps()[0]) is int
        assert m.restore(np.int64(1))["a"].tolist() == [1.0, 1.0, 1.0]
    with manager(d) as m:  # every step a manager listed, a new one lists too
        assert m.all_steps() == [1]


def test_the_training_checkpointer_refuses_before_touching_a_step(tmp_path):
    with training.Checkpointer(tmp_path / "t") as ck:
        ck.save(1, {"a": np.arange(3)})
        for step in (True, -1, 2**63, 1.0):
            # True == 1: an unchecked overwrite would have deleted step 1
            refused(lambda s: ck.save(s, {"a": np.arange(4)}, overwrite=True), step)
            refused(ck.load, step)
        assert [c.step for c in ck.checkpoints] == [1]
        assert ck.load(1)["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("argv", [
    ["inspect", "{d}", "-1"], ["inspect", "{d}", "9223372036854775808"],
    ["verify", "{d}", "100000000000000000000000"], ["inspect", "{d}", "1.5"],
    ["export", "{d}", "-1", "{d}/out"], ["import", "{d}", "{d}/x", "--step", "-3"],
])
def test_the_command_line_refuses_bad_steps_as_a_usage_error(tmp_path, argv):
    p = run(*[a.format(d=tmp_path) for a in argv], code=2)
    assert "steps are whole numbers in [0, 9223372036854775807]" in p.stderr
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "x")
