"""Parity of `resilient_ckpt.training.Checkpointer` with Orbax's v1
`training.Checkpointer` (0.12.8).

The same calls run on Orbax's class and on ours, each in its own temporary
directory, and what comes back is compared: save results, steps, latest,
metrics, loaded trees (bit-exact, typed PRNG keys included) and the class of
every error. A MaxText-like loop runs as MaxText (>= 0.2.5) drives the class.
Ours alone: the tiers keyword, our options, and reading a step through our
CheckpointManager that the face saved, and the other way round. Last, Orbax's
own tests of its class (checkpointer_test_base.py) run against ours, with the
ones that test Orbax's internals or a documented difference skipped, each with
its reason.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import datetime  # noqa: E402
import shutil  # noqa: E402
import unittest  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import orbax.checkpoint.experimental.v1 as ocp_v1  # noqa: E402
import pytest  # noqa: E402
from absl import flags  # noqa: E402

import resilient_ckpt as rc  # noqa: E402
from resilient_ckpt import training  # noqa: E402
from tests.support.parity import abstract, assert_same_tree, make_state  # noqa: E402

SDP = ocp_v1.training.save_decision_policies
PP = ocp_v1.training.preservation_policies
IMPLS = {"orbax": ocp_v1.training.Checkpointer, "ours": training.Checkpointer}


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", value), or ("err", the exception)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 - compared by the caller
        return "err", e


def both(tmp_path, fn: Callable[[type, str], Any]) -> list[Any]:
    """fn(cls, directory) on Orbax's class and on ours: [Orbax's result, ours]."""
    return [fn(cls, str(tmp_path / name)) for name, cls in IMPLS.items()]


def same_error(theirs: Any, ours: Any) -> None:
    """Both raised, and ours is an instance of every builtin class Orbax's is,
    and of Orbax's own class when that is one of the v1 training errors."""
    assert theirs[0] == ours[0] == "err", (theirs, ours)
    t, o = theirs[1], ours[1]
    for c in type(t).__mro__:
        if c.__module__ == "builtins" or c in (ocp_v1.training.errors.StepAlreadyExistsError,
                                               ocp_v1.training.errors.StepNotFoundError):
            assert isinstance(o, c), f"Orbax raised {type(t).__mro__}, ours {type(o).__mro__}"


# ------------------------------------------------------------------ the class


def test_is_orbax_checkpointer_and_overrides_everything(tmp_path):
    with training.Checkpointer(tmp_path) as ck:
        assert isinstance(ck, ocp_v1.training.Checkpointer)
        ck.use_async = True  # MaxText keeps a flag of its own on the instance
        assert ck.use_async is True
        assert ck.directory == tmp_path and ck.latest is None and ck.checkpoints == []
    # No public member of Orbax's class is inherited (each would reach Orbax's machinery).
    public = [n for n in vars(ocp_v1.training.Checkpointer) if not n.startswith("_")]
    assert public and [n for n in public if n not in vars(training.Checkpointer)] == []
    assert "__contextmanager__" in vars(training.Checkpointer)


def test_maxtext_loop(tmp_path):
    """The calls MaxText makes: a policy every 5 steps, keep all, latest and
    the step list before each save, async saves of {"items": state} with
    custom metadata, FileExistsError taken as "skipped", wait, then a resumed
    run loading {"items": abstract} and saving on."""
    def state(i):
        s = make_state(i)
        del s["bf16"]  # not needed here; keeps the loop short
        return s

    def run(cls, d):
        kw = dict(context=ocp_v1.Context(), save_decision_policy=SDP.FixedIntervalPolicy(5),
                  preservation_policy=PP.LatestN(None))
        log = []
        ck = cls(d, **kw)
        for step in [0, 1, 5, 5, 7, 10]:
            latest = ck.latest.step if ck.latest is not None else None
            if step in [c.step for c in ck.checkpoints]:
                log.append((step, latest, "exists"))
                continue
            r = ck.save_checkpointables_async(step, {"items": state(step)}, force=False,
                                              custom_metadata={"step": step})
            log.append((step, latest, r is not None))
        ck.wait()
        try:  # a save of a step that exists, as MaxText catches it
            ck.save_checkpointables(10, {"items": state(10)}, force=True)
            log.append("saved over 10")
        except FileExistsError:
            log.append("10 skipped")
        ck.close()
        ck = cls(d, **kw)  # the resumed run
        latest = ck.latest
        assert isinstance(latest.time, datetime.datetime)
        got = ck.load_checkpointables(latest.step, {"items": abstract(state(0))})
        log.append(ck.save_checkpointables(11, {"items": state(11)}, force=True))
        log.append(ck.save_checkpointables(12, {"items": state(12)}))
        ck.wait()
        out = (log, [c.step for c in ck.checkpoints], latest.step, latest.metrics,
               ck.metadata(5).custom_metadata, sorted(got))
        loaded = ck.load_checkpointables(11, {"items": abstract(state(0))})["items"]
        ck.close()
        return out, got["items"], loaded

    ref, ours = both(tmp_path, run)
    assert ours[0] == ref[0]
    assert ref[0][0][:6] == [(0, None, True), (1, 0, False), (5, 0, True), (5, 5, "exists"),
                             (7, 5, False), (10, 5, True)]
    assert_same_tree(ours[1], ref[1])
    assert_same_tree(ours[1], state(10))
    assert_same_tree(ours[2], state(11))


def _calls(cls, d):
    """A run of plain calls; every answer (or error) in order."""
    tree = make_state(1)
    del tree["opt"]["nesterov"]  # Orbax's metadata() gives None for a tree with a bool
    out: list[Any] = []
    ck = cls(d, custom_metadata={"run": "a"})
    out.append(ck.should_save(0))
    out.append(ck.save(0, tree, metrics={"loss": 0.5}, custom_metadata={"k": 1}))
    out.append(outcome(lambda: ck.save(0, tree)))  # exists
    out.append(ck.should_save(0))
    out.append(ck.save(1, make_state(2), metrics={"loss": 0.25}))
    out.append(([c.step for c in ck.checkpoints], ck.latest.step, ck.latest.metrics))
    out.append(ck.load(0, abstract(tree)))
    out.append(ck.load())  # the latest, no abstract tree
    md = ck.metadata(0)
    out.append((md.step, md.custom_metadata, md.metrics, sorted(md.metadata)))
    out.append(ck.root_metadata().custom_metadata)
    out.append(outcome(lambda: ck.load(9)))
    out.append(outcome(lambda: ck.load_checkpointables(0, {"nope": None})))
    for bad in ({}, {"metrics": 1.0}, {"x": None}):
        out.append(outcome(lambda b=bad: ck.save_checkpointables(2, b)))
    out.append(ck.save(1, make_state(3), overwrite=True))
    out.append(ck.load(1))
    out.append((ck.delete(0), ck.delete(7, missing_ok=True), outcome(lambda: ck.delete(7))))
    out.append([c.step for c in ck.checkpoints])
    ck.close()
    out.append([c.step for c in cls(d).checkpoints])
    return out


def same(r: Any, o: Any, where: str = "") -> None:
    """Orbax's answer `r` and ours `o` agree: errors by class, trees bit for
    bit, everything else by equality (sequences element by element)."""
    if isinstance(r, tuple) and len(r) == 2 and r[0] in ("ok", "err"):
        if r[0] == "err":
            return same_error(r, o)
        assert o[0] == "ok", f"{where}: Orbax returned {r[1]!r}, ours raised {o[1]!r}"
        return same(r[1], o[1], where)
    if isinstance(r, dict) and any(isinstance(x, (jax.Array, np.ndarray))
                                   for x in jax.tree.leaves(r)):
        return assert_same_tree(o, r)
    if isinstance(r, (list, tuple)):
        assert type(o) is type(r) and len(o) == len(r), f"{where}: {r!r} vs {o!r}"
        for i, (a, b) in enumerate(zip(r, o, strict=True)):
            same(a, b, f"{where}[{i}]")
        return None
    assert o == r, f"{where}: Orbax {r!r}, ours {o!r}"


def test_same_calls_same_answers(tmp_path):
    ref, ours = both(tmp_path, _calls)
    same(ref, ours)
    assert isinstance(ours[2][1], training.StepAlreadyExistsError)
    assert_same_tree(ours[16], make_state(3))  # the overwritten step


def test_checkpointables_beside_the_state(tmp_path):
    """A JSON-like dict beside the state (Orbax resolves both to its pytree
    handler), loaded whole, in part and against an abstract state."""
    cfg = {"a": 1, "b": "x", "l": [1, 2.5, None], "nested": {"flag": True}}

    def run(cls, d):
        with cls(d) as ck:
            ck.save_checkpointables(0, {"state": make_state(0), "cfg": cfg})
            whole = ck.load_checkpointables(0)
            part = ck.load_checkpointables(0, {"cfg": None})
            typed = ck.load_checkpointables(0, {"state": abstract(make_state(0)), "cfg": None})
            return whole, part, typed, sorted(ck.checkpointables_metadata(0).metadata)

    ref, ours = both(tmp_path, run)
    for r, o in zip(ref[:3], ours[:3], strict=True):
        assert sorted(o) == sorted(r)
        assert o["cfg"] == r["cfg"] == cfg
        if "state" in r:
            assert_same_tree(o["state"], r["state"])
    assert ours[3] == ref[3] == ["cfg", "state"]


def test_save_async_responses(tmp_path):
    def run(cls, d):
        with cls(d, save_decision_policy=SDP.FixedIntervalPolicy(100)) as ck:
            done: list[bool] = []
            r = ck.save_async(0, make_state(0))
            r.on_complete(done.append)
            assert r.result() is True and r.result(timeout=60) is True
            ck.wait()
            skipped = ck.save_async(1, make_state(1))
            return done, skipped, ck.is_saving_in_progress()

    ref, ours = both(tmp_path, run)
    assert ours == ref == ([True], None, False)


def test_background_failure_reaches_result(tmp_path):
    ck = training.Checkpointer(tmp_path)
    r = ck.save_async(0, make_state(0))
    boom = rc.SaveFailedError("step 0 to local failed")
    with mock.patch.object(ck.manager, "wait_until_finished", side_effect=boom):
        for _ in range(2):  # raised again on every call, as Orbax's response does
            with pytest.raises(rc.SaveFailedError, match="step 0"):
                r.result()
    ck.close()


# ------------------------------------------------------------------ ours alone


def test_tiers_keyword_and_fallback(tmp_path, ram_path):
    tiers = [rc.RamTier(path=ram_path, keep=2), rc.LocalTier()]
    with training.Checkpointer(tmp_path, tiers=tiers) as ck:
        assert ck.manager.tier_names == ["ram", "local"]
        assert ck.save(0, make_state(0))
        assert os.path.isdir(os.path.join(ram_path, "0"))
        assert os.path.isdir(tmp_path / "0")
        shutil.rmtree(os.path.join(ram_path, "0"))  # the RAM copy is lost
        ck.reload()
        assert_same_tree(ck.load(0, abstract(make_state(0))), make_state(0))
        assert set({t for t, n in ck.manager.last_restore.bytes_by_tier.items() if n}) == {"local"}


def test_our_options_and_step_names(tmp_path):
    opts = rc.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2)
    with training.Checkpointer(tmp_path / "a", options=opts) as ck:
        saved = [ck.save(s, {"x": np.arange(3) + s}) for s in range(6)]
        assert saved == [True, False, True, False, True, False]
        assert [c.step for c in ck.checkpoints] == [2, 4]
    fmt = ocp_v1.path.step.standard_name_format(step_prefix="run", step_format_fixed_length=4)
    with training.Checkpointer(tmp_path / "b", step_name_format=fmt) as ck:
        ck.save(3, {"x": np.arange(3)})
        assert os.listdir(tmp_path / "b").count("run_0003") == 1
        assert str(ck.latest.path).endswith("run_0003")
    odd = mock.Mock(build_name=lambda s: f"s{s}x")
    with pytest.raises(ValueError, match="standard_name_format"):
        training.Checkpointer(tmp_path / "c", step_name_format=odd)


def test_face_and_manager_read_each_other(tmp_path):
    state = make_state(4)
    with training.Checkpointer(tmp_path) as ck:
        ck.save_checkpointables(0, {"items": state, "cfg": ocp.args.JsonSave({"a": [1, 2]})})
    with rc.CheckpointManager(tmp_path) as m:
        got = m.restore(0, args=ocp.args.Composite(
            items=ocp.args.StandardRestore(abstract(state)), cfg=ocp.args.JsonRestore()))
        assert_same_tree(got["items"], state)
        assert got["cfg"] == {"a": [1, 2]}
        m.save(1, args=ocp.args.Composite(items=ocp.args.StandardSave(make_state(5))))
    with rc.CheckpointManager(tmp_path) as m:  # a new manager: no item mode set yet
        m.save(2, args=ocp.args.StandardSave(make_state(6)))  # no Composite: item "default"
    with training.Checkpointer(tmp_path) as ck:
        assert [c.step for c in ck.checkpoints] == [0, 1, 2]
        assert_same_tree(ck.load_checkpointables(1, {"items": abstract(state)})["items"],
                         make_state(5))
        assert_same_tree(ck.load_checkpointables(2)["default"], make_state(6))


def test_resumes_a_directory_orbax_wrote(tmp_path):
    """Orbax's class wrote steps 0 and 1; ours lists them, loads them (with
    and without an abstract tree) and their metadata, and saves on."""
    with ocp_v1.training.Checkpointer(tmp_path) as theirs:
        theirs.save_checkpointables(0, {"items": make_state(0)}, metrics={"loss": 2.0})
        theirs.save(1, make_state(1), metrics={"loss": 1.0})
    with training.Checkpointer(tmp_path) as ck:
        assert [c.step for c in ck.checkpoints] == [0, 1]
        assert ck.latest.metrics == {"loss": 1.0}
        assert_same_tree(ck.load(abstract_state=abstract(make_state(0))), make_state(1))
        assert_same_tree(ck.load_checkpointables(0)["items"], make_state(0))
        md = ck.checkpointables_metadata(0)
        assert (md.step, sorted(md.metadata), md.metrics) == (0, ["items"], {"loss": 2.0})
        assert ck.save(2, make_state(2))
        assert_same_tree(ck.load(), make_state(2))
        assert [c.step for c in ck.checkpoints] == [0, 1, 2]


def test_unsupported_checkpointables_and_item_delete(tmp_path):
    class Opaque:
        pass
    with training.Checkpointer(tmp_path) as ck:
        with pytest.raises(rc.UnsupportedArgsError, match="'obj'.*not supported"):
            ck.save_checkpointables(0, {"obj": Opaque()})
        ck.save(0, {"x": np.arange(2)})
        with pytest.raises(NotImplementedError, match="whole steps"):
            ck.delete(0, checkpointable_name="state")
        with pytest.warns(DeprecationWarning, match="Use `save` instead"):
            assert ck.save_pytree(1, {"x": np.arange(2)}, force=True)
        assert ck.load_async(1).result()["x"].tolist() == [0, 1]


# ------------------------------------------------------------------ Orbax's own tests

# Orbax's tests of its class that do not apply to ours, and why.
NOT_OURS = {
    "test_custom_checkpointables": "custom CheckpointableHandlers (Foo, Bar) are not supported",
    "test_different_custom_checkpointables": "custom CheckpointableHandlers are not supported",
    "test_load_with_switched_abstract_checkpointables": "custom CheckpointableHandlers",
    "test_checkpointables_metadata0": "custom CheckpointableHandlers (Baz)",
    "test_checkpointables_metadata1": "custom CheckpointableHandlers (Baz)",
    "test_gcs_deletion_options": "reads Orbax's manager's private options",
    "test_lightweight_initialize_true": "reads Orbax's manager's private options",
    "test_lightweight_initialize_false": "reads Orbax's manager's private options",
    "test_save_async": "holds Orbax's serialization back with a mock",
    "test_save_async_raises_on_background_failure": "counts calls into Orbax's manager",
    "test_context_constructor_override": "checks Orbax's array format (OCDBT) files",
    "test_close": "a step's directory exists while it is written (its manifest commits it)",
    "test_context_manager_close": "as test_close",
    **{f"test_preservation{i}": "mocks datetime.now; our step times come from time.time"
       for i in range(7)},
    "test_preservation_metrics1": "the newest step is never deleted (orbax_differences.md)",
    "test_preservation_metrics3": "the newest step is never deleted (orbax_differences.md)",
}


try:  # Orbax's tests of its class ship in its wheel, under a private path
    from orbax.checkpoint.experimental.v1._src.training import (
        checkpointer_test_base as orbax_base,
    )
except ImportError:  # moved in a later Orbax: run ours only
    orbax_base = None


def _with_ours(cls: type) -> type:
    class Ours(cls):  # type: ignore[misc, valid-type]
        def setUp(self):
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()  # absltest's tempdirs read a flag
            self.enter_context(mock.patch.object(orbax_base, "Checkpointer",
                                                 training.Checkpointer))
            super().setUp()
            if isinstance(getattr(self, "directory", None), str):  # DeprecationsTest's
                self.directory = self.create_tempdir().full_path

    for name, why in NOT_OURS.items():
        if hasattr(cls, name):
            setattr(Ours, name, unittest.skip(why)(lambda self: None))
    return Ours


if orbax_base is not None:
    TestOrbaxBase = _with_ours(orbax_base.CheckpointerTestBase.Test)
    TestOrbaxDeprecations = _with_ours(orbax_base.CheckpointerTestBase.DeprecationsTest)


def test_orbax_base_skips_name_real_tests():
    """Every skip names a test Orbax has (a renamed one would skip nothing)."""
    if orbax_base is None:
        pytest.skip("this Orbax does not ship checkpointer_test_base.py")
    assert [n for n in NOT_OURS if not hasattr(orbax_base.CheckpointerTestBase.Test, n)] == []
