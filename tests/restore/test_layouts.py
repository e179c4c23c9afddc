"""Leaves that share a layout, restored together: the boxes and plans worked
out once for a layout serve each of its leaves with that leaf's own chunks,
and leaves of another dtype, sharding or target are restored as alone."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from tests.support import packs

DEVICES = jax.devices()
SHAPE = (48, 16)


def mesh(n, shape, names):
    return Mesh(np.array(DEVICES[:n]).reshape(shape), names)


def host_values():
    """Leaves of one shape: float32 ones of one layout, a bfloat16 and an
    int32 one, replicated vectors, each with values of its own."""
    rng = np.random.default_rng(3)
    out = {f"a{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(4)}
    out["b"] = rng.standard_normal(SHAPE).astype(jnp.bfloat16)
    out["c"] = rng.integers(-1000, 1000, SHAPE).astype(np.int32)
    out.update({f"n{i}": rng.standard_normal(16).astype(np.float32) for i in range(3)})
    return out


def saved(root, ram, host):
    rows = NamedSharding(mesh(8, (8,), ("a",)), P("a"))
    cols = NamedSharding(mesh(8, (8,), ("a",)), P(None, "a"))
    rep = NamedSharding(mesh(8, (8,), ("a",)), P())
    state = {k: jax.device_put(v, rep if k.startswith("n") else cols if k == "c" else rows)
             for k, v in host.items()}
    state["key"] = jax.random.split(jax.random.key(5), 8)
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
    return state


def test_leaves_of_one_layout_each_restore_exactly_whatever_their_target(dirs):
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    same = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}
    small = NamedSharding(mesh(4, (2, 2), ("x", "y")), P("x", "y"))
    target = dict(same)
    target["a1"] = jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=small)  # resharded
    target["a2"] = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16,  # cast
                                        sharding=state["a2"].sharding)
    target["a3"] = np.zeros(SHAPE, np.float32)  # a numpy value
    target["c"] = jax.ShapeDtypeStruct(SHAPE, jnp.int32, sharding=state["a0"].sharding)
    target["n1"] = jax.ShapeDtypeStruct((16,), jnp.float32,
                                        sharding=NamedSharding(small.mesh, P("x")))
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(target))
        assert set(m.last_restore.bytes_by_tier) == {"ram"}
    want = dict(host, a2=host["a2"].astype(jnp.bfloat16))
    for k, v in want.items():
        got = out[k]
        assert np.array_equal(np.asarray(got), v), k
        assert got.dtype == v.dtype, k
        if k == "a3":
            assert isinstance(got, np.ndarray)
            continue
        assert got.sharding == target[k].sharding, k
        for s in got.addressable_shards:  # each device holds exactly its slice
            assert np.array_equal(np.asarray(s.data), v[s.index]), (k, s.device)
    assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(state["key"]))


def test_a_bad_chunk_of_one_leaf_falls_back_alone_among_leaves_of_its_layout(dirs):
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        leaves = {lf.path[-1][1]: lf for lf in
                  m.catalog.viable()[1].manifest.items[0].leaves}
    victim = leaves["a2"].chunks[3].key
    packs.overwrite(os.path.join(ram, "1"), victim, 8, b"\x13\x37")
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
              for k, v in state.items()}
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(target))
        rec = m.last_restore
    for k, v in host.items():
        assert np.array_equal(np.asarray(out[k]), v), k
    assert {k for k, t in rec.served.items() if t == "local"} == {victim}
    assert rec.chunks_by_tier["local"] == 1
    assert len(rec.fallbacks) == 1 and victim in rec.fallbacks[0]
