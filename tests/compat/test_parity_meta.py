"""API parity with Orbax 0.12.8 for root metadata, `item_metadata` without
handlers, restores with `ocp.PLACEHOLDER` leaves, and dtype casts on restore.

As in test_parity.py, each test runs the same calls on Orbax's manager and on
ours (each in its own directory) and compares what comes back. Deliberate
differences (docs/orbax_differences.md) are asserted as documented instead.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402

import resilient_ckpt as rc  # noqa: E402
from resilient_ckpt.compat import rootmeta
from resilient_ckpt.core import layout, manifest  # noqa: E402
from tests.support.parity import NS, OURS, P, _mesh, assert_same_tree, run_both  # noqa: E402
from tests.support.tiers import flip  # noqa: E402

PH = ocp.PLACEHOLDER
ROOT_FILE = os.path.join("metadata", "_ROOT_METADATA")


def _dev():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_dev())


def _state() -> dict:
    return {"a": jnp.array([-2.7, -0.5, 0.25, 1.5, 3.9999, 100.2], jnp.float32),
            "b": {"c": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7,
                  "i": np.array([-3, 0, 7, 120], np.int32)},
            "n": np.array([-2.7, 0.5, 1.5, 300.2], np.float32), "s": 3}


def _saved(impl, d, **kw):
    m = impl.manager(d, **kw)
    m.save(0, args=ocp.args.StandardSave(_state()))
    m.wait_until_finished()
    return m


def _root(m) -> tuple:
    md = m.metadata()
    return md.custom_metadata, md.internal_metadata


# ------------------------------------------------------------------ root metadata


def _root_story(impl, d):
    """Every rule of Orbax's root metadata, as (what metadata() says, whether
    the file exists) after each call."""
    out = []
    first = impl.manager(os.path.join(d, "a"), metadata={"v": 1, "n": {"x": [1, 2.5]}})
    out.append(("first", _root(first), os.path.exists(os.path.join(d, "a", ROOT_FILE))))
    first.close()
    for label, kw in [("other", dict(metadata={"v": 2})), ("none", {}),
                      ("read_only", dict(metadata={"v": 3}, options=impl.options(
                          read_only=True)))]:
        m = impl.manager(os.path.join(d, "a"), **kw)
        out.append((label, _root(m)))
        m.close()
    m = impl.manager(os.path.join(d, "ro"), metadata={"v": 4},
                     options=impl.options(read_only=True))
    out.append(("read_only new", _root(m), os.path.exists(os.path.join(d, "ro"))))
    m.close()
    unsaved = dict(metadata={"v": 5}, options=ocp.CheckpointManagerOptions(
        save_root_metadata=False))
    for name, kw in [("plain", {}), ("empty", dict(metadata={})), ("unsaved", unsaved)]:
        m = impl.manager(os.path.join(d, name), **kw)
        out.append((name, _root(m), os.path.exists(os.path.join(d, name, ROOT_FILE))))
        m.close()
    with open(os.path.join(d, "a", ROOT_FILE)) as f:
        out.append(("file", json.load(f)))
    return out


def test_root_metadata_matches_orbax(tmp_path):
    ref, ours = run_both(tmp_path, _root_story)
    assert ref[0] == ("first", ({"v": 1, "n": {"x": [1, 2.5]}}, {}), True)
    assert ref[1][1] == ref[0][1] and ref[3][1][0] == {"v": 1, "n": {"x": [1, 2.5]}}
    assert ref[4] == ("read_only new", ({"v": 4}, {}), False)
    for got in ours:
        assert got == ref


def test_root_metadata_is_read_across_managers(tmp_path):
    d = str(tmp_path / "x")
    ocp.CheckpointManager(d, metadata={"by": "orbax"}).close()
    with rc.CheckpointManager(d, metadata={"by": "ours"}) as m:
        assert m.metadata().custom_metadata == {"by": "orbax"}
    d = str(tmp_path / "y")
    rc.CheckpointManager(d, metadata={"by": "ours"}).close()
    m = ocp.CheckpointManager(d, metadata={"by": "orbax"})
    assert m.metadata().custom_metadata == {"by": "ours"}
    m.close()


def test_root_metadata_only_process_zero_writes_and_bad_values(tmp_path):
    d = str(tmp_path)
    one = rootmeta.RootMetadataFile(d, {}, {"k": 1}, True, process_index=1)
    assert not os.path.exists(os.path.join(d, ROOT_FILE))
    assert one.get().custom_metadata == {"k": 1}  # what it was given, until written
    rootmeta.RootMetadataFile(d, {}, {"k": 0}, True, process_index=0)
    assert rootmeta.RootMetadataFile(d, {}, None, True, 1).get().custom_metadata == {"k": 0}
    with pytest.raises(TypeError, match="JSON"):
        rc.CheckpointManager(tmp_path / "bad", metadata={"f": object()})
    with open(os.path.join(d, ROOT_FILE), "w") as f:
        f.write("{not json")
    with pytest.raises(rc.CorruptCheckpointError, match="_ROOT_METADATA"):
        rc.CheckpointManager(d).metadata()


def test_root_metadata_on_gcs(gcs, url, tmp_path):
    opts = rc.CheckpointManagerOptions(tiers=[rc.GcsTier(url, endpoint=gcs.endpoint)])
    rc.CheckpointManager(url, options=opts, metadata={"v": 1}).close()
    with rc.CheckpointManager(url, options=opts, metadata={"v": 2}) as m:
        assert m.metadata().custom_metadata == {"v": 1}
    # No tier is the directory itself: nothing is written there.
    local = rc.CheckpointManagerOptions(tiers=[rc.LocalTier(path=str(tmp_path / "l"))])
    with rc.CheckpointManager(url + "2", options=local, metadata={"v": 3}) as m:
        assert m.metadata().custom_metadata == {"v": 3}
    with rc.CheckpointManager(url + "2", options=opts) as m:
        assert m.metadata().custom_metadata == {}


# ------------------------------------------------------------------ item_metadata


def test_item_metadata_without_handlers(tmp_path):
    """Orbax's fresh manager knows no handler and gives None (per item of a
    Composite); ours describes what was saved (documented difference)."""
    def story(impl, d):
        _saved(impl, os.path.join(d, "s")).close()
        m = impl.manager(os.path.join(d, "c"))
        m.save(0, args=ocp.args.Composite(x=ocp.args.StandardSave(_state()),
                                          j=ocp.args.JsonSave({"k": 1})))
        m.wait_until_finished()
        m.close()
        return (impl.manager(os.path.join(d, "s")).item_metadata(0),
                impl.manager(os.path.join(d, "c")).item_metadata(0))
    ref, ours = run_both(tmp_path, story)
    assert ref[0] is None and dict(ref[1]) == {"x": None, "j": None}
    for single, comp in ours:
        assert isinstance(comp, ocp.args.Composite) and comp["j"] == {"k": 1}
        for tree in (single, comp["x"]):
            want = jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), _state())
            assert jax.tree.map(lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x,
                                tree) == {**want, "s": 3}


# ------------------------------------------------------------------ placeholders


PLACEHOLDER_TARGETS = {
    "mixed": lambda: {"a": PH, "b": {"c": _sds((2, 3), jnp.float32), "i": PH},
                      "n": np.zeros(4, np.float32), "s": PH},
    "all": lambda: {"a": PH, "b": {"c": PH, "i": PH}, "n": PH, "s": PH},
    "absent key": lambda: {"a": _sds((6,), jnp.float32), "b": {"c": PH, "i": PH},
                           "n": PH, "s": PH, "zz": PH},
    "leaf left out": lambda: {"a": PH, "b": {"c": PH}, "n": PH, "s": PH},  # ValueError
}


@pytest.mark.parametrize("case", list(PLACEHOLDER_TARGETS))
def test_placeholder_restore_matches_orbax(tmp_path, case):
    def story(impl, d):
        _saved(impl, d).close()
        m = impl.manager(d)  # fresh: Orbax's handler is not locked to StandardRestore
        return m.restore(0, args=ocp.args.PyTreeRestore(PLACEHOLDER_TARGETS[case]()))
    ref, ours = run_both(tmp_path, story, expect_ok=case != "leaf left out")
    if case != "leaf left out":
        for got in ours:
            assert_same_tree(got, ref)
        assert ref["a"] is PH or ref["zz"] is PH


def _chunk_of(d: str, leaf: tuple) -> tuple[str, int]:
    """The file holding the leaf's first chunk, and the offset of its middle byte."""
    step = os.path.join(d, "0")
    with open(os.path.join(step, layout.manifest_name(0, 1)), "rb") as f:
        m = manifest.parse(f.read())
    (lf,) = [lf for lf in m.items[0].leaves if lf.path == leaf]
    c = lf.chunks[0]
    return os.path.join(step, c.object), c.pack_offset + c.stored_nbytes // 2


def test_placeholder_leaves_are_not_read_and_standard_restore_takes_them(tmp_path):
    d = str(tmp_path / "p")
    _saved(OURS, d).close()
    flip(*_chunk_of(d, (("key", "a"),)))
    with rc.CheckpointManager(d) as m:
        # Orbax's StandardRestore refuses PLACEHOLDER (ValueError); ours takes it.
        got = m.restore(0, args=ocp.args.StandardRestore(
            {"a": PH, "b": {"c": PH, "i": PH}, "n": np.zeros(4, np.float32), "s": PH}))
        assert got["a"] is PH and got["b"]["c"] is PH
        np.testing.assert_array_equal(got["n"], _state()["n"])
        # partial_restore: a placeholder is still not read (Orbax reads a saved one).
        got = m.restore(0, args=ocp.args.PyTreeRestore({"a": PH, "s": 0},
                                                       partial_restore=True))
        assert got == {"a": PH, "s": 3}
        with pytest.raises(rc.CorruptCheckpointError):
            m.restore(0, args=ocp.args.PyTreeRestore({"a": np.zeros(6, np.float32)},
                                                     partial_restore=True))


# ------------------------------------------------------------------ dtype casts


CAST_TARGETS = {
    "jax": lambda: {"a": _sds((6,), jnp.bfloat16),
                    "b": {"c": _sds((2, 3), jnp.float16), "i": _sds((4,), jnp.float32)},
                    "n": _sds((4,), jnp.int32), "s": 0},
    "jax to int": lambda: {"a": _sds((6,), jnp.int32),
                           "b": {"c": _sds((2, 3), jnp.bfloat16), "i": _sds((4,), jnp.int8)},
                           "n": _sds((4,), jnp.float16), "s": 0},
    "numpy": lambda: {"a": np.zeros(6, np.float16), "b": {"c": np.zeros((2, 3), np.float64),
                                                          "i": np.zeros(4, np.float32)},
                      "n": np.zeros(4, np.int16), "s": 0},
    "sharded": lambda: {"a": _sds((6,), jnp.bfloat16),
                        "b": {"c": jax.ShapeDtypeStruct((2, 3), jnp.float16, sharding=NS(
                            _mesh((2, 4), ("x", "y")), P("x", None))),
                              "i": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NS(
                                  _mesh((2, 4), ("x", "y")), P("y")))},
                        "n": np.zeros(4, np.float32), "s": 0},
    "arrays": lambda: {"a": jnp.zeros(6, jnp.bfloat16), "b": {"c": jnp.zeros((2, 3), jnp.int32),
                                                              "i": jnp.zeros(4, jnp.float16)},
                       "n": np.zeros(4, np.float32), "s": 0},
}


@pytest.mark.parametrize("case", list(CAST_TARGETS))
def test_dtype_cast_matches_orbax(tmp_path, case):
    def story(impl, d):
        return _saved(impl, d).restore(0, args=ocp.args.StandardRestore(CAST_TARGETS[case]()))
    ref, ours = run_both(tmp_path, story)
    want = jax.tree.map(lambda t: getattr(t, "dtype", None), CAST_TARGETS[case]())
    assert jax.tree.map(lambda x: getattr(x, "dtype", None), ref) == want
    for got in ours:
        assert_same_tree(got, ref)


def test_dtype_cast_by_restore_args_matches_orbax(tmp_path):
    def story(impl, d):
        _saved(impl, d).close()
        ra = {"a": ocp.ArrayRestoreArgs(dtype=jnp.bfloat16, sharding=_dev()),
              "b": {"c": ocp.RestoreArgs(dtype=jnp.float16),
                    "i": ocp.RestoreArgs(dtype=np.float64)},
              "n": ocp.ArrayRestoreArgs(dtype=jnp.float16, sharding=_dev()), "s": ocp.RestoreArgs()}
        return impl.manager(d).restore(0, args=ocp.args.PyTreeRestore(restore_args=ra))
    ref, ours = run_both(tmp_path, story, ours=(OURS,))
    assert ref["b"]["c"].dtype == jnp.float16 and ref["b"]["i"].dtype == np.float64
    for got in ours:
        assert_same_tree(got, ref, check_sharding=False)
        assert got["a"].sharding == ref["a"].sharding


def test_cast_comes_after_the_checksum_and_shapes_still_must_match(tmp_path):
    def shape(impl, d):
        return _saved(impl, d).restore(0, args=ocp.args.StandardRestore(
            {**CAST_TARGETS["jax"](), "a": _sds((5,), jnp.bfloat16)}))
    run_both(tmp_path, shape, expect_ok=False)  # both a ValueError
    with rc.CheckpointManager(tmp_path / OURS.name) as m:
        with pytest.raises(rc.TargetMismatchError, match=r"leaf \['a'\].*shape \(6,\).*\(5,\)"):
            shape(OURS, str(tmp_path / "again"))
        flip(*_chunk_of(str(tmp_path / OURS.name), (("key", "a"),)))
        with pytest.raises(rc.CorruptCheckpointError):
            m.restore(0, args=ocp.args.StandardRestore(CAST_TARGETS["jax"]()))
    # A key is never cast to a number.
    with rc.CheckpointManager(tmp_path / "key") as m:
        m.save(0, args=ocp.args.StandardSave({"k": jax.random.key(1)}))
        m.wait_until_finished()
        with pytest.raises(rc.TargetMismatchError, match="dtype"):
            m.restore(0, args=ocp.args.StandardRestore({"k": _sds((), jnp.uint32)}))

