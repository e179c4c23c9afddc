"""API parity with Orbax 0.12.8 for `item_names`, Orbax's own error classes and
the args of Orbax's other handlers (ArraySave, JaxRandomKeySave, ...).

As in test_parity.py, each test runs the same calls on Orbax's manager and on
ours (each in its own directory) and compares what comes back, call by call:
the value, or the builtin class of the error. Deliberate differences
(docs/orbax_differences.md) are asserted as documented instead.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import inspect  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import orbax.checkpoint.checkpoint_manager as ocp_cm  # noqa: E402
import pytest  # noqa: E402

import resilient_ckpt as rc  # noqa: E402
from tests.support.parity import (  # noqa: E402
    NS,
    OURS,
    OURS_BOTH,
    Impl,
    P,
    _builtin_base,
    _force_existing,
    _mesh,
    assert_same_tree,
    run_both,
)

# Synchronous saves on both sides: an Orbax save refused midway otherwise leaves
# background threads waiting for its step directory until they time out.
SYNC = dict(enable_async_checkpointing=False)


class Calls:
    """Records, per labelled call, its value or the builtin class of its error."""

    def __init__(self) -> None:
        self.out: dict[str, tuple[str, Any]] = {}

    def __call__(self, label: str, fn) -> Any:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - compared across managers
            self.out[label] = ("err", _builtin_base(e), e)
            return None
        self.out[label] = ("ok", value)
        return value


def assert_same_calls(ref: Calls, got: Calls, impl: str) -> None:
    assert list(got.out) == list(ref.out)
    for label, r in ref.out.items():
        g = got.out[label]
        assert g[0] == r[0], f"{impl} {label}: Orbax {r}, ours {g}"
        if r[0] == "err":
            assert isinstance(g[2], r[1]), f"{impl} {label}: Orbax {r[1]}, ours {g[2]!r}"
        elif isinstance(r[1], ocp.args.Composite) or isinstance(g[1], ocp.args.Composite):
            assert dict(g[1].items()).keys() == dict(r[1].items()).keys(), label
            for k in dict(r[1].items()):
                assert_same_tree(g[1][k], r[1][k])
        else:
            assert g[1] == r[1], f"{impl} {label}: Orbax {r[1]!r}, ours {g[1]!r}"


# ------------------------------------------------------------------ item_names


def _item_names(impl: Impl, d: str) -> Calls:
    c = Calls()
    state, meta = {"a": np.arange(3)}, {"lr": 0.5}
    with impl.manager(d, item_names=("state", "meta"), options=impl.options(**SYNC)) as m:
        c("save_undeclared", lambda: m.save(0, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), other=ocp.args.JsonSave({"x": 1}))))
        c("steps_after_refused_save", lambda: list(m.all_steps()))
        c("restore_undeclared_missing_step", lambda: m.restore(0, args=ocp.args.Composite(
            other=ocp.args.JsonRestore())))
        c("save_declared_subset", lambda: m.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state))))
        m.wait_until_finished()
        c("restore_undeclared_absent", lambda: m.restore(1, args=ocp.args.Composite(
            other=ocp.args.JsonRestore())))
        c("restore_declared_absent", lambda: m.restore(1, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())))
        c("restore_no_args", lambda: m.restore(1))
        c("restore_declared", lambda: m.restore(1, args=ocp.args.Composite(
            state=ocp.args.StandardRestore())))
        c("save_single_item", lambda: m.save(2, args=ocp.args.StandardSave(state)))
        c("restore_single_item", lambda: m.restore(1, args=ocp.args.StandardRestore()))
        c("save_both", lambda: m.save(3, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))))
        m.wait_until_finished()
        c("steps", lambda: list(m.all_steps()))
    with impl.manager(d, item_names=("meta",), options=impl.options(**SYNC)) as m2:
        c("other_manager_restore_undeclared_saved", lambda: m2.restore(3, args=ocp.args.Composite(
            state=ocp.args.StandardRestore())))
        c("other_manager_restore_no_args", lambda: m2.restore(3))
        c("other_manager_restore_declared", lambda: m2.restore(3, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())))
    with impl.manager(d, item_names=(), options=impl.options(**SYNC)) as m3:
        c("no_items_declared_save", lambda: m3.save(9, args=ocp.args.Composite(
            meta=ocp.args.JsonSave(meta))))
    return c


def test_item_names_enforced(tmp_path):
    ref, ours = run_both(tmp_path, _item_names)
    # What Orbax does (and so what ours must do), pinned so the test can fail.
    kinds = {k: (v[0], v[1] if v[0] == "err" else None) for k, v in ref.out.items()}
    assert kinds["save_undeclared"] == ("err", ValueError)
    assert ref.out["steps_after_refused_save"][1] == []
    assert kinds["restore_undeclared_missing_step"] == ("err", FileNotFoundError)
    assert kinds["restore_undeclared_absent"] == ("err", KeyError)
    assert kinds["save_single_item"] == ("err", ValueError)
    assert kinds["other_manager_restore_undeclared_saved"] == ("err", ValueError)
    assert kinds["other_manager_restore_no_args"] == ("err", ValueError)
    assert kinds["no_items_declared_save"] == ("err", ValueError)
    assert ref.out["steps"][1] == [1, 3]
    for impl, got in zip(OURS_BOTH, ours, strict=True):
        assert_same_calls(ref, got, impl.name)
    # ours says which item and what to do
    msg = str(ours[0].out["save_undeclared"][2])
    assert "'other'" in msg and "item_names" in msg


def test_item_handlers_names_declare_items_too(tmp_path):
    """An `item_handlers` mapping declares its names, as Orbax reads it."""
    def fn(impl, d):
        handlers = {"state": ocp.StandardCheckpointHandler()}
        with impl.manager(d, item_handlers=handlers, options=impl.options(**SYNC)) as m:
            return m.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave({"x": 1})))
    ref, ours = run_both(tmp_path, fn, expect_ok=False)
    assert isinstance(ref, ValueError), ref


# ------------------------------------------------------------------ Orbax's error classes


def _orbax_manager_error_classes() -> list[type]:
    return [obj for _, obj in inspect.getmembers(ocp_cm, inspect.isclass)
            if issubclass(obj, Exception) and obj.__module__ == ocp_cm.__name__]


def test_every_orbax_manager_error_class_has_our_subclass():
    found = _orbax_manager_error_classes()
    assert ocp_cm.StepAlreadyExistsError in found
    for orbax_cls in found:
        ours = getattr(rc, orbax_cls.__name__)
        assert issubclass(ours, orbax_cls), (ours.__mro__, orbax_cls)
        assert issubclass(ours, rc.CheckpointError)
        for base in orbax_cls.__mro__:
            if base.__module__ == "builtins":
                assert issubclass(ours, base)


def test_step_already_exists_caught_by_orbax_except(tmp_path):
    def fn(impl, d):
        try:
            _force_existing(impl, d)
        except ocp_cm.StepAlreadyExistsError as e:  # an `except` written against Orbax
            return ("caught", isinstance(e, ValueError))
        return ("not raised", None)
    ref, ours = run_both(tmp_path, fn)
    assert ref == ("caught", True)
    assert all(got == ref for got in ours)
    with pytest.raises(rc.StepAlreadyExistsError):
        _force_existing(OURS, str(tmp_path / "direct"))


# ------------------------------------------------------------------ other handlers' args


def _values() -> dict:
    mesh = _mesh((4, 2), ("x", "y"))
    return {
        "arr": jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(8, 4),
                              NS(mesh, P("x", "y"))),
        "np": np.arange(5, dtype=np.int32) * 3,
        "scalar": 3.5,
        "key": jax.random.key(4),
        "raw_key": jax.random.PRNGKey(5),
        "np_key": np.random.RandomState(3).get_state(),
    }


_SAVE = {"arr": "ArraySave", "np": "ArraySave", "scalar": "ArraySave",
         "key": "JaxRandomKeySave", "raw_key": "JaxRandomKeySave",
         "np_key": "NumpyRandomKeySave"}


def _one_value_args(impl: Impl, d: str) -> dict:
    v = _values()
    mesh2 = _mesh((2, 4), ("a", "b"))
    other = NS(mesh2, P("b", "a"))
    out: dict = {}
    with impl.manager(d, options=impl.options(**SYNC)) as m:
        assert m.save(0, args=ocp.args.Composite(
            **{k: getattr(ocp.args, cls)(v[k]) for k, cls in _SAVE.items()}))
        m.wait_until_finished()
        out["arrays"] = dict(m.restore(0, args=ocp.args.Composite(
            arr=ocp.args.ArrayRestore(), np=ocp.args.ArrayRestore(),
            scalar=ocp.args.ArrayRestore())).items())
        out["resharded"] = m.restore(0, args=ocp.args.Composite(arr=ocp.args.ArrayRestore(
            restore_args=ocp.ArrayRestoreArgs(sharding=other)))).arr
        out["keys"] = dict(m.restore(0, args=ocp.args.Composite(
            key=ocp.args.JaxRandomKeyRestore(), raw_key=ocp.args.JaxRandomKeyRestore(),
            np_key=ocp.args.NumpyRandomKeyRestore())).items())
        no_args = dict(m.restore(0).items())
        out["no_args"] = {k: x for k, x in no_args.items() if k != "np_key"}
        out["no_args_np_key"] = no_args["np_key"]
    return out


def test_one_value_handlers_args(tmp_path):
    ref, ours = run_both(tmp_path, _one_value_args)
    v = _values()
    assert_same_tree(ref["arrays"], {k: v[k] for k in ("arr", "np", "scalar")})
    assert ref["resharded"].sharding.spec == P("b", "a")
    assert type(ref["keys"]["np_key"]) is tuple
    for got in ours:
        for key in ("arrays", "keys", "no_args"):
            assert sorted(got[key]) == sorted(ref[key]), key
            for item in ref[key]:
                assert_same_tree(got[key][item], ref[key][item])
        assert_same_tree(got["resharded"], ref["resharded"])
        # Documented: without NumpyRandomKeyRestore a legacy key comes back as
        # the list a tuple pytree restores to (Orbax gives the tuple).
        assert_same_tree(tuple(got["no_args_np_key"]), tuple(ref["no_args_np_key"]))
        # the key still draws the same numbers
        rs_ref, rs_got = np.random.RandomState(), np.random.RandomState()
        rs_ref.set_state(ref["keys"]["np_key"])
        rs_got.set_state(got["keys"]["np_key"])
        assert np.array_equal(rs_got.rand(4), rs_ref.rand(4))


@dataclasses.dataclass
class _MyArgs(ocp.args.CheckpointArgs):
    """A user's own args class, registered with no handler."""
    item: Any = None


def _save_one(impl: Impl, d: str, a: Any) -> Any:
    with impl.manager(d, options=impl.options(**SYNC)) as m:
        return m.save(0, args=ocp.args.Composite(x=a))


ARG_ERRORS = {
    "array_save_of_a_tree": lambda i, d: _save_one(i, d, ocp.args.ArraySave({"q": np.arange(3)})),
    "unregistered_args_class": lambda i, d: _save_one(i, d, _MyArgs(np.arange(2))),
}


@pytest.mark.parametrize("case", list(ARG_ERRORS))
def test_one_value_args_errors(tmp_path, case):
    ref, ours = run_both(tmp_path, lambda i, d: ARG_ERRORS[case](i, d), expect_ok=False)
    assert isinstance(ref, Exception), ref


def test_unsupported_args_name_item_class_and_alternative(tmp_path):
    """ProtoSave/ProtoRestore and a user's own args: a clear error (Orbax would
    save protos; a documented difference)."""
    with rc.CheckpointManager(tmp_path / "p") as m:
        with pytest.raises(rc.UnsupportedArgsError) as e:
            m.save(0, args=ocp.args.Composite(cfg=ocp.args.ProtoSave(item=None)))
        assert "'cfg'" in str(e.value) and "ProtoSave" in str(e.value)
        assert "JsonSave" in str(e.value) and "MessageToDict" in str(e.value)
        assert isinstance(e.value, ValueError)
        with pytest.raises(rc.UnsupportedArgsError, match=r"'mine'.*_MyArgs.*StandardSave"):
            m.save(0, args=ocp.args.Composite(mine=_MyArgs(1)))
        m.save(0, args=ocp.args.Composite(x=ocp.args.JsonSave({"a": 1})))
        m.wait_until_finished()
        with pytest.raises(rc.UnsupportedArgsError, match=r"'x'.*ProtoRestore.*JsonRestore"):
            m.restore(0, args=ocp.args.Composite(x=ocp.args.ProtoRestore(item=dict)))
        assert list(m.all_steps()) == [0]


def test_numpy_bit_generator_state_saved(tmp_path):
    """A bit generator's state dict (Orbax 0.12.8 fails to save it; documented)."""
    state = np.random.default_rng(5).bit_generator.state
    with rc.CheckpointManager(tmp_path / "g", options=ocp.CheckpointManagerOptions(**SYNC)) as m:
        m.save(0, args=ocp.args.Composite(g=ocp.args.NumpyRandomKeySave(state)))
        got = m.restore(0, args=ocp.args.Composite(g=ocp.args.NumpyRandomKeyRestore())).g
    assert got == state
    rng = np.random.default_rng()
    rng.bit_generator.state = got
    assert rng.random() == np.random.default_rng(5).random()
