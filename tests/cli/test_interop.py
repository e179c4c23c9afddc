"""Export to and import from Orbax's own format (interop.py), checked by
restoring through Orbax and through ours, bit for bit."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from resilient_ckpt.cli import interop
from resilient_ckpt.errors import StepNotFoundError
from tests.support import packs


def state(mesh, seed):
    rng = np.random.default_rng(seed)
    return {"params": {"w": jax.device_put(rng.standard_normal((16, 8)).astype(np.float32),
                                           NamedSharding(mesh, P("data", "model"))),
                       "e": jax.device_put(jnp.asarray(rng.standard_normal((8, 4)),
                                                       jnp.bfloat16),
                                           NamedSharding(mesh, P(None, "model")))},
            "count": jax.device_put(np.arange(12, dtype=np.int32), NamedSharding(mesh, P())),
            "layers": [np.arange(6, dtype=np.int64).reshape(2, 3), 2.5],
            "step": seed}


def target(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.Array) else x, tree)


def assert_exact(got, want):
    g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(g, w, strict=True):
        if isinstance(b, (jax.Array, np.ndarray)):
            assert np.asarray(a).dtype == np.asarray(b).dtype
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
            if isinstance(b, jax.Array):
                assert a.sharding.is_equivalent_to(b.sharding, b.ndim)
        else:
            assert a == b and type(a) is type(b)


@pytest.fixture
def ours(tmp_path, ram_path, mesh):
    """Step 5 (one item) and step 6 (composite) in a RAM and a local tier."""
    d = tmp_path / "ours"
    # lock_item_mode=False: one manager saves both kinds (Orbax's would refuse the second).
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, keep=None), LocalTier()],
                                    lock_item_mode=False)
    with CheckpointManager(d, options=opts) as m:
        m.save(5, args=ocp.args.StandardSave(state(mesh, 5)), metrics={"loss": 0.5})
        m.save(6, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 6)),
                                          extra=ocp.args.JsonSave({"lr": 0.1, "n": [1, 2]})))
        m.wait_until_finished()
    return d, ram_path


def test_export_restores_exactly_through_orbax(ours, tmp_path, mesh):
    d, _ = ours
    dest = tmp_path / "orbax"
    out = interop.export_step(d, 5, dest, group_bytes=200)  # several partial saves
    assert out.groups > 1 and out.items == ("default",)
    want = state(mesh, 5)
    got = ocp.StandardCheckpointer().restore(dest / "5" / "default", target(want))
    assert_exact(got, want)
    with ocp.CheckpointManager(dest) as theirs:
        assert theirs.all_steps() == [5]
        assert_exact(theirs.restore(5, args=ocp.args.StandardRestore(target(want))), want)
    # each leaf keeps its chunking: Orbax's zarr chunks are the saved shards
    meta = ocp.StandardCheckpointer().metadata(dest / "5" / "default").item_metadata
    assert tuple(meta["params"]["w"].storage.chunk_shape) == (4, 4)


def test_export_of_a_composite_step(ours, tmp_path, mesh):
    d, _ = ours
    dest = tmp_path / "orbax"
    out = interop.export_step(d, 6, dest)
    assert out.items == ("state", "extra") and out.groups == 1
    want = state(mesh, 6)
    with ocp.CheckpointManager(dest, item_names=("state", "extra")) as theirs:
        got = theirs.restore(6, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target(want)), extra=ocp.args.JsonRestore()))
    assert_exact(got["state"], want)
    assert got["extra"] == {"lr": 0.1, "n": [1, 2]}


def test_export_from_the_local_tier_when_ram_is_gone(ours, tmp_path, mesh):
    d, ram = ours
    for n in os.listdir(os.path.join(ram, "5")):
        os.remove(os.path.join(ram, "5", n))
    with pytest.raises(StepNotFoundError, match="ram tier"):
        interop.export_step(d, 5, tmp_path / "x", tier="ram")
    assert not (tmp_path / "x" / "5").exists()
    interop.export_step(d, 5, tmp_path / "orbax", tier="local")
    want = state(mesh, 5)
    assert_exact(ocp.StandardCheckpointer().restore(tmp_path / "orbax" / "5" / "default",
                                                    target(want)), want)


def test_a_missing_chunk_names_the_step_and_leaf_and_writes_nothing(ours, tmp_path):
    d, ram = ours
    where = packs.places(str(d / "5"))
    victim = min((k for k in where if ".c0.3." in k),  # leaf 3 in flatten order: params/e
                 key=lambda k: where[k][1])
    packs.cut(str(d / "5"), victim)  # it and what follows it in its pack
    packs.cut(os.path.join(ram, "5"), victim)
    dest = tmp_path / "orbax"
    with pytest.raises(StepNotFoundError, match=r"step 5.*is 0 bytes in.*leaf \['params'\]\['e'\]"):
        interop.export_step(d, 5, dest)
    assert not dest.exists() or os.listdir(dest) == []


def test_a_corrupt_chunk_fails_part_way_and_leaves_nothing(ours, tmp_path):
    d, ram = ours
    for root in (str(d / "5"), ram + "/5"):
        packs.flip(root, next(k for k in sorted(packs.places(root)) if ".c0.3." in k))
    dest = tmp_path / "orbax"
    with pytest.raises(ValueError, match=r"step 5.*\['params'\]\['e'\].*no intact copy"):
        interop.export_step(d, 5, dest, group_bytes=200)
    assert not dest.exists()  # nor the directory the export created


def test_import_an_orbax_checkpoint(tmp_path, mesh):
    src = tmp_path / "theirs"
    want = state(mesh, 3)
    with ocp.CheckpointManager(src) as theirs:
        theirs.save(3, args=ocp.args.StandardSave(want))
        theirs.save(4, args=ocp.args.StandardSave(state(mesh, 4)))
        theirs.wait_until_finished()
    dest = tmp_path / "ours"
    out = interop.import_step(src, dest, step=3)
    assert out.step == 3 and out.items == ("default",)
    with CheckpointManager(dest) as m:
        assert m.all_steps() == [3]
        assert m.catalog.viable()  # committed in our format, not an Orbax step
        assert_exact(m.restore(3, args=ocp.args.StandardRestore(target(want))), want)
    sc = tmp_path / "sc"
    with ocp.StandardCheckpointer() as c:
        c.save(sc, want)
    with pytest.raises(StepNotFoundError, match="not an Orbax checkpoint"):
        interop.import_step(tmp_path / "nothing", tmp_path / "o3")
    with pytest.raises(interop.ExportError, match="--step"):
        interop.import_step(sc, tmp_path / "o2")
    interop.import_step(sc, tmp_path / "o2", step=9)
    with CheckpointManager(tmp_path / "o2") as m:
        assert_exact(m.restore(9, args=ocp.args.StandardRestore(target(want))), want)


def test_export_then_import_round_trip_of_a_composite(ours, tmp_path, mesh):
    d, _ = ours
    interop.export_step(d, 6, tmp_path / "orbax")
    interop.import_step(tmp_path / "orbax", tmp_path / "back")
    want = state(mesh, 6)
    with CheckpointManager(tmp_path / "back") as m:
        got = m.restore(6, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target(want)), extra=ocp.args.JsonRestore()))
    assert_exact(got["state"], want)
    assert got["extra"] == {"lr": 0.1, "n": [1, 2]}


def test_keys_numpy_scalars_and_none_export(tmp_path):
    d = tmp_path / "ours"
    st = {"key": jax.random.key(3), "s": np.float32(2.5), "n": None, "v": np.arange(3.0)}
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=[LocalTier()])) as m:
        m.save(1, args=ocp.args.StandardSave(st))
    interop.export_step(d, 1, tmp_path / "orbax")
    got = ocp.StandardCheckpointer().restore(tmp_path / "orbax" / "1" / "default")
    assert got["n"] is None and got["s"].dtype == np.float32 and got["s"] == 2.5
    assert np.array_equal(jax.random.key_data(got["key"]), jax.random.key_data(st["key"]))
    assert got["v"].tobytes() == st["v"].tobytes()
