"""The peer fill on 8 CPU devices in one process: shards the replica-1
devices did not read come back from replica 0, bit for bit, for leaves of
several dtypes, layouts and sizes packed into one program; and a shard no
replica read is reported, not made up. (The multi-process fill of a lost
host's RAM is tests/multihost/test_multihost.py's.)"""
import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt.multihost import peer_fill


@pytest.fixture(scope="module")
def mesh3():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("replica", "data", "model"))


def _leaves(mesh3):
    rng = np.random.default_rng(0)
    out = []
    for shape, dtype, spec in [((8, 6), np.float32, P("data", "model")),
                               ((4, 10), ml_dtypes.bfloat16, P(None, "model")),
                               ((3,), np.int8, P()),
                               ((6, 4), np.bool_, P("model", "data")),
                               ((2, 2, 2), np.uint32, P("data")),
                               ((4096 + 8, 2), np.float32, P("data", "model"))]:
        host = rng.standard_normal(shape).astype(dtype) if dtype != np.bool_ \
            else rng.random(shape) > 0.5
        out.append((host, jax.device_put(host, NamedSharding(mesh3, spec))))
    return out


def _zeroed(array, have):
    """`array` with the shards of the devices that did not read theirs zeroed."""
    shards = [jax.device_put(np.asarray(s.data) if have[s.device]
                             else np.zeros_like(np.asarray(s.data)), s.device)
              for s in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)


def test_replica_0s_shards_fill_the_others_exactly(mesh3):
    first = set(mesh3.devices[0].flat)
    have = {d: d in first for d in mesh3.devices.flat}
    leaves = _leaves(mesh3)
    holes = [(_zeroed(a, have), have) for _, a in leaves]
    filled, ok = peer_fill.fill_all(holes, group_bytes=64 * 1024)  # several programs
    assert ok
    for (host, a), got in zip(leaves, filled, strict=True):
        assert got.sharding == a.sharding and got.dtype == a.dtype
        for s in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), host[s.index])


def test_a_shard_no_replica_read_is_reported(mesh3):
    lost = set(mesh3.devices[:, 1].flat)  # data row 1 of both replicas
    have = {d: d not in lost for d in mesh3.devices.flat}
    host, a = _leaves(mesh3)[0]
    _, ok = peer_fill.fill_all([(_zeroed(a, have), have)])
    assert not ok


def test_each_cell_comes_from_whichever_replica_holds_it(mesh3):
    """Holders differ per cell and per layout: replica 1 holds data row 0's
    cells, replica 0 the rest; a leaf sharded over `data` only has four
    replicas over two mesh axes (replica, model), of which one holds each cell."""
    have = {d: (i == 1) if j == 0 else (i == 0)
            for (i, j, _), d in np.ndenumerate(mesh3.devices)}
    by_data = {d: (i, k) == (1, 1) if j == 0 else (i, k) == (0, 1)
               for (i, j, k), d in np.ndenumerate(mesh3.devices)}
    leaves = _leaves(mesh3)
    rng = np.random.default_rng(1)
    wide = rng.standard_normal((6, 5)).astype(np.float32)
    leaves.append((wide, jax.device_put(wide, NamedSharding(mesh3, P("data")))))
    holes = [(_zeroed(a, have), have) for _, a in leaves[:-1]]
    holes.append((_zeroed(leaves[-1][1], by_data), by_data))
    filled, ok = peer_fill.fill_all(holes)
    assert ok
    for (host, _), got in zip(leaves, filled, strict=True):
        for s in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), host[s.index])


def test_the_fill_is_one_all_reduce_not_a_gather_of_every_replica(mesh3):
    """What makes the fan-in bounded: each device gets its cell's bytes from
    a sum over the replica axes (about twice the cell's bytes sent and received
    per device, however many replicas), never every replica's copy."""
    width, rep, used = 1 << 16, ("replica",), ("data", "model")
    x = jax.ShapeDtypeStruct((2, 4, width), np.uint8,
                             sharding=NamedSharding(mesh3, P(rep, used, None)))
    h = jax.ShapeDtypeStruct((2, 4), np.bool_, sharding=NamedSharding(mesh3, P(rep, used)))
    hlo = peer_fill._select(mesh3, rep, used).lower(x, h).compile().as_text()
    assert "all-reduce" in hlo and "all-gather" not in hlo and "all-to-all" not in hlo


@pytest.mark.parametrize("how", ["context", "thread setting"])
def test_the_fill_ignores_the_callers_mesh_context(mesh3, how):
    """The caller's own mesh of some of the devices (jax.set_mesh, as a
    context or as the thread's setting) does not reach the fill's program:
    it was refused ("incompatible devices ... jit's context mesh")."""
    first = set(mesh3.devices[0].flat)
    have = {d: d in first for d in mesh3.devices.flat}
    host, a = _leaves(mesh3)[0]
    theirs = Mesh(np.array(jax.devices()[:4]), ("x",))
    if how == "context":
        with jax.set_mesh(theirs):
            filled, ok = peer_fill.fill_all([(_zeroed(a, have), have)])
            assert jax.sharding.get_mesh() is theirs  # the caller's context is left as it was
    else:
        jax.set_mesh(theirs)
        try:
            filled, ok = peer_fill.fill_all([(_zeroed(a, have), have)])
        finally:
            jax.set_mesh(None)
    assert ok
    for s in filled[0].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), host[s.index])
