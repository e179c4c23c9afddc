"""Leaves that share a layout, restored together: the boxes and plans worked
out once for a layout serve each of its leaves with that leaf's own chunks,
and leaves of another dtype, sharding or target are restored as alone."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from tests.support import packs
from tests.support.layouts import SHAPE, host_values, mesh, saved


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
