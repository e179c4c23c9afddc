"""Unit tests of step naming (Orbax's), writer identity, and retention rules."""
import os
import subprocess
import sys

import pytest

from resilient_ckpt.core import layout, retention


@pytest.mark.parametrize("prefix,length,step,name", [
    (None, None, 7, "7"), ("ckpt", None, 7, "ckpt_7"), (None, 4, 7, "0007"),
    ("step", 3, 1234, "step_1234"),
])
def test_step_names_match_orbax(prefix, length, step, name):
    n = layout.StepNaming(prefix, length)
    assert n.name(step) == name and n.parse(name) == step


@pytest.mark.parametrize("name", ["x", "ckpt_7", "07", ".7", "7.tmp", "-1", "", "٣"])
def test_non_step_names_are_ignored(name):
    assert layout.StepNaming().parse(name) is None


def test_manifest_names():
    assert layout.parse_manifest_name(layout.manifest_name(2, 4)) == (2, 4)
    assert layout.parse_manifest_name("manifest.4-of-4.json") is None
    assert layout.parse_manifest_name("manifest.0-of-1.json.tmp") is None


def test_writer_liveness_uses_pid_and_start_time():
    me = layout.Writer.me()
    assert me.alive() is True
    assert layout.parse_tmp_name(me.tmp_name("c0.1.0")) == me
    assert layout.parse_marker_name(me.marker_name()) == me
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = layout.Writer(me.host, p.pid, me.start)
    assert dead.alive() is False
    reused = layout.Writer(me.host, os.getpid(), me.start + 1)  # same pid, other process
    assert reused.alive() is False
    assert layout.Writer("elsewhere", 1, 1).alive() is None


def test_latest_n_and_keep_period():
    steps = list(range(0, 100, 10))
    assert retention.to_delete(steps, 3) == list(range(0, 70, 10))
    assert retention.to_delete(steps, None) == []
    assert retention.to_delete(steps, 2, keep_period=30) == [10, 20, 40, 50, 70]


def test_best_n_keeps_best_and_steps_without_metrics():
    steps = [1, 2, 3, 4, 5]
    metrics = {1: {"loss": 5}, 2: {"loss": 1}, 3: None, 4: {"loss": 3}, 5: {"loss": 9}}
    kw = dict(best_fn=lambda m: m["loss"], metrics=metrics)
    assert retention.to_delete(steps, 2, best_mode="min", **kw) == [1]
    assert retention.to_delete(steps, 2, best_mode="max", **kw) == [2, 4]
    assert retention.to_delete(steps, 1, best_mode="min",
                               keep_checkpoints_without_metrics=False, **kw) == [1, 3, 4]


def test_never_deletes_newest_or_protected():
    assert retention.to_delete([1, 2, 3], 0) == [1, 2]
    assert retention.to_delete([1, 2, 3], 1, protected=frozenset({1})) == [2]
    assert retention.to_delete([], 1) == []
