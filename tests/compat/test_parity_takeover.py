"""Parity with Orbax 0.12.8 where a user moving an Orbax codebase meets it
first: a second manager on one directory in one process, Orbax's wording at
the start of our errors, and Orbax's RootMetadata type.

Each scenario runs on Orbax's manager and on ours (tests/support/parity.py);
what ours does beyond Orbax (the older manager refuses to save once a newer
one took over) is asserted on ours alone, as docs/orbax_differences.md says.
Two processes never both write: tests/faults/test_two_writers.py.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import re  # noqa: E402

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402
from orbax.checkpoint import metadata as ocp_metadata  # noqa: E402

import resilient_ckpt as rc  # noqa: E402
from tests.support.parity import OURS, run_both  # noqa: E402


@pytest.fixture(autouse=True)
def _orbax_gives_up_soon(monkeypatch):
    """An Orbax save that raises part-way (the error cases below) leaves its
    commit thread waiting for a signal that never comes, for Orbax's
    coordination timeout (300 s): the test process then waits that long at
    exit. Here it waits 10 s."""
    from orbax.checkpoint._src.multihost import multihost
    monkeypatch.setattr(multihost, "_DEFAULT_BARRIER_TIMEOUT", 10)


def _tree(i: int) -> dict:
    return {"a": np.arange(8, dtype=np.float32) + i, "b": {"c": np.full((2, 3), i, np.int32)}}


def _save(m, step: int) -> bool:
    return m.save(step, args=ocp.args.StandardSave(_tree(step)))


# ------------------------------------------------------------ a second manager


def test_a_newer_manager_takes_over_the_directory(tmp_path):
    """The older manager is still referenced (not closed, not collected): the
    newer one saves, sees the older one's steps, and the older one's reload
    sees the newer one's."""
    def fn(impl, d):
        opts = impl.options(enable_async_checkpointing=True)
        old = impl.manager(d, options=opts)
        out = [_save(old, 0), _save(old, 1)]
        old.wait_until_finished()  # Orbax's newer manager would not see step 1 otherwise
        new = impl.manager(d, options=opts)
        out += [_save(new, 2), _save(new, 3)]
        new.wait_until_finished()
        out.append(new.all_steps())
        old.reload()
        out.append(old.all_steps())
        out.append(new.restore(1, args=ocp.args.StandardRestore(_tree(0)))["a"].tolist())
        new.close()
        old.close()
        return out

    ref, ours = run_both(tmp_path, fn)
    assert ref[:4] == [True] * 4 and ref[4] == ref[5] == [0, 1, 2, 3]
    assert all(got == ref for got in ours)


def test_the_older_manager_finishes_its_saves_then_refuses_more(tmp_path):
    d = str(tmp_path / "c")
    old = rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
        enable_async_checkpointing=True))
    assert _save(old, 0)  # still writing, perhaps, when the newer one saves
    new = rc.CheckpointManager(d)
    assert _save(new, 1)
    # The older one's step committed before the newer one wrote, and the newer saw it.
    assert new.all_steps() == [0, 1]
    with pytest.raises(rc.DirectoryInUseError, match="newer CheckpointManager") as e:
        _save(old, 2)
    assert d in str(e.value) and isinstance(e.value, RuntimeError)
    assert not os.path.exists(os.path.join(d, "2"))
    old.close()  # closing the older one leaves the newer one's lock alone
    assert _save(new, 3)
    with pytest.raises(rc.DirectoryInUseError, match="newer"):  # still, after its close
        _save(old, 4)
    new.close()
    with rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(read_only=True)) as r:
        assert r.all_steps() == [0, 1, 3]
        for s in (0, 1, 3):
            got = r.restore(s, args=ocp.args.StandardRestore(_tree(0)))
            np.testing.assert_array_equal(got["a"], _tree(s)["a"])


def test_a_notebook_cell_that_makes_a_manager_runs_again(tmp_path):
    """The cell's manager from the first run stays referenced (here by a list,
    in a notebook by Out[] or a traceback); the second run's saves go on, on
    Orbax's manager and on ours."""
    def fn(impl, d):
        kept, out = [], []
        for run in range(2):  # the same cell, run twice
            mngr = impl.manager(d, options=impl.options(max_to_keep=3))
            kept.append(mngr)
            for step in range(run * 3, run * 3 + 3):
                out.append(_save(mngr, step))
            mngr.wait_until_finished()
        out.append(kept[-1].all_steps())
        for m in reversed(kept):
            m.close()
        return out

    ref, ours = run_both(tmp_path, fn)
    assert ref == [True] * 6 + [[3, 4, 5]]
    assert all(got == ref for got in ours)


# ------------------------------------------------------------ Orbax's wording


def _raises(tmp_path, fn) -> list[str]:
    """Each side's error message for fn; all sides raised the same builtin class."""
    msgs: list[str] = []

    def catch(impl, d):
        try:
            fn(impl, d)
        except ValueError as e:
            msgs.append(str(e))
            raise
        raise AssertionError(f"{impl.name}: no ValueError")

    run_both(tmp_path, catch, ours=(OURS,), expect_ok=False)
    return msgs


@pytest.mark.parametrize("case, orbax_words", [
    ("single_args_to_a_composite_manager",
     r"Must provide `args` of type `Composite` when dealing with multiple checkpointable"),
    ("composite_args_to_a_single_item_manager",
     r"Cannot provide `args` of type `Composite` when dealing with a single"),
    ("an_item_not_registered", r'Item "other" and args .* does not match with any registered'),
    ("args_passed_as_items", r"Found an instance of `CheckpointArgs` provided for `items`"),
    ("a_partial_target_without_partial_restore",
     r"User-provided restore item and on-disk value metadata tree structures do not match"),
])
def test_errors_start_with_orbaxs_wording(tmp_path, case, orbax_words):
    def fn(impl, d):
        if case == "single_args_to_a_composite_manager":
            with impl.manager(d, item_names=("p", "q")) as m:
                _save(m, 0)
        elif case == "composite_args_to_a_single_item_manager":
            with impl.manager(d) as m:
                _save(m, 0)
                m.save(1, args=ocp.args.Composite(p=ocp.args.StandardSave(_tree(1))))
        elif case == "an_item_not_registered":
            with impl.manager(d, item_names=("p",)) as m:
                m.save(0, args=ocp.args.Composite(other=ocp.args.PyTreeSave(_tree(0))))
        elif case == "args_passed_as_items":
            with impl.manager(d, item_names=("p",)) as m:
                m.save(0, ocp.args.Composite(p=ocp.args.PyTreeSave(_tree(0))))
        else:
            with impl.manager(d) as m:
                m.save(0, args=ocp.args.PyTreeSave(_tree(0)))
                m.wait_until_finished()
                part = {"a": np.zeros(8, np.float32)}  # no "b"
                m.restore(0, args=ocp.args.PyTreeRestore(part))

    theirs, ours = _raises(tmp_path, fn)
    assert re.search(orbax_words, theirs, re.S), theirs
    start = re.match(orbax_words, ours, re.S)  # Orbax's words first, then ours
    assert start and len(ours) > start.end() + 40, ours


# ------------------------------------------------------------ Orbax's types


def test_root_metadata_is_orbaxs_type_and_equal_both_ways(tmp_path):
    def fn(impl, d):
        with impl.manager(d, metadata={"state": 123}) as m:
            return m.metadata()

    ref, ours = run_both(tmp_path, fn)
    theirs = ocp_metadata.RootMetadata(custom_metadata={"state": 123})
    assert ref == theirs
    for got in ours:
        assert isinstance(got, ocp_metadata.RootMetadata)
        assert got == theirs and theirs == got and got == ref and ref == got
        assert not (got != theirs) and got != ocp_metadata.RootMetadata(custom_metadata={})
        assert repr(got) == repr(ref)
        got.custom_metadata["state"] = 0  # Orbax's type is mutable: the next call is not
    with rc.CheckpointManager(tmp_path / OURS.name) as m:
        assert m.metadata().custom_metadata == {"state": 123}


def test_older_orbaxs_root_metadata_file_is_read(tmp_path):
    """Older Orbax kept the custom metadata alone, as a JSON item `metadata`."""
    def fn(impl, d):
        ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(
            os.path.join(d, "metadata"), args=ocp.args.JsonSave({"blah": "hello"}))
        with impl.manager(d) as m:
            return m.metadata().custom_metadata

    ref, ours = run_both(tmp_path, fn)
    assert ref == {"blah": "hello"} and all(got == ref for got in ours)


@pytest.mark.parametrize("content", [b"[1, 2]", b"{", b"\xff", b"[" * 5000 + b"]" * 5000])
def test_a_bad_older_root_metadata_file_is_a_corrupt_checkpoint(tmp_path, content):
    d = tmp_path / "c"
    (d / "metadata").mkdir(parents=True)
    (d / "metadata" / "metadata").write_bytes(content)
    with rc.CheckpointManager(d) as m, pytest.raises(rc.CorruptCheckpointError) as e:
        m.metadata()
    assert os.path.join("metadata", "metadata") in str(e.value)
    json.dumps(str(e.value))
