"""`writers.needed` works back, from a leaf's record, which writer of a save
on a tier the whole job sees wrote each box a process's devices hold: it
must agree with the replica ids jax gives the saved array's shards (the
save writes replica 0 of each box from the process of its device), and a
description it cannot follow (devices this job lacks, a spec jax refuses, a
sharding of another kind) gives None, never an error. Eight CPU devices
stand for a job of four processes of two devices each (device d on
process d // 2)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt.core import writers
from resilient_ckpt.core.manifest import ChunkRecord, ItemRecord, LeafRecord, Manifest
from resilient_ckpt.core.sharding import describe, index_to_box

WRITER_OF = {d: d // 2 for d in range(8)}


def _mine(q: int) -> set[int]:
    return {d for d, w in WRITER_OF.items() if w == q}


def _manifest(*leaves: LeafRecord, index: int = 0) -> Manifest:
    return Manifest(1, "s" * 32, 0.0, index, 4, (ItemRecord("default", "pytree", leaves),))


def _leaf(a: jax.Array, kind: str = "array") -> LeafRecord:
    return LeafRecord((), kind, tuple(a.shape), str(a.dtype), describe(a.sharding))


def _from_jax(a: jax.Array, q: int) -> dict[int, set]:
    """What jax's replica ids say: per writer, the boxes process q's devices
    hold whose replica 0 that writer's device holds."""
    first = {index_to_box(s.index, a.shape): WRITER_OF[s.device.id]
             for s in a.addressable_shards if s.replica_id == 0}
    out: dict[int, set] = {}
    for s in a.addressable_shards:
        if s.device.id in _mine(q):
            box = index_to_box(s.index, a.shape)
            out.setdefault(first[box], set()).add((0, 0, box))
    return out


def _meshes() -> list[Mesh]:
    devs = np.array(jax.devices())
    return [Mesh(devs.reshape(4, 2), ("data", "model")),
            Mesh(devs[::-1].reshape(2, 4), ("data", "model")),  # devices in another order
            Mesh(devs[[3, 0, 6, 1, 7, 2, 5, 4]].reshape(4, 2), ("data", "model"))]


@pytest.mark.parametrize("mesh", range(3))
@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("data"), P(),
                                  P(("model", "data")), P("model", "data")])
def test_the_predicted_writers_are_those_of_jaxs_replica_ids(mesh, spec):
    a = jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8),
                       NamedSharding(_meshes()[mesh], spec))
    m = _manifest(_leaf(a))
    for q in range(4):
        assert writers.needed(m, WRITER_OF, _mine(q)) == _from_jax(a, q), (mesh, spec, q)


def test_single_device_numpy_and_key_leaves():
    on3 = jax.device_put(jnp.ones((4, 4)), jax.devices()[3])
    key = jax.device_put(jax.random.key_data(jax.random.key(0)),
                         NamedSharding(_meshes()[0], P()))
    m = _manifest(_leaf(on3), LeafRecord((), "numpy", (5,), "int32"),
                  LeafRecord((), "scalar", value={"type": "int", "value": 1}),
                  _leaf(key, "prng_key"))
    full4, full5, full2 = ((0, 0), (4, 4)), ((0,), (5,)), ((0,), (2,))
    # the device-3 leaf is process 1's alone; numpy leaves come from writer 0
    assert writers.needed(m, WRITER_OF, _mine(1)) == {
        1: {(0, 0, full4)}, 0: {(0, 1, full5), (0, 3, full2)}}
    assert writers.needed(m, WRITER_OF, _mine(2)) == {0: {(0, 1, full5), (0, 3, full2)}}


def _named(ids, mesh_shape, spec, shape=(16,)) -> LeafRecord:
    return LeafRecord((), "array", shape, "float32",
                      {"type": "named", "axis_names": ["x", "y"][:len(mesh_shape)],
                       "mesh_shape": list(mesh_shape), "device_ids": list(ids), "spec": spec})


@pytest.mark.parametrize("leaf", [
    _named(range(100, 108), [8], ["x"]),            # devices this job lacks
    _named(range(8), [8], ["x"], shape=(7,)),       # 7 rows over 8 devices: jax refuses
    _named(range(8), [8], ["z"]),                   # an axis the mesh lacks
    _named(range(8), [4], ["x"]),                   # a mesh that does not hold its devices
    _named([0, 0, 1, 1, 2, 2, 3, 3], [8], ["x"]),   # a device twice
    LeafRecord((), "array", (16,), "float32", {"type": "single_device", "device_id": 99}),
    LeafRecord((), "array", (16,), "float32", {"type": "other", "device_ids": [0, 1],
                                               "repr": "GSPMDSharding"}),
    LeafRecord((), "array", (16,), "float32", None),
    LeafRecord((), "array", (16,), "float32", {"type": "named"}),  # fields missing
], ids=["absent-devices", "indivisible", "unknown-axis", "bad-mesh", "twice", "single-absent",
        "other", "none", "fields-missing"])
def test_a_description_it_cannot_follow_gives_none(leaf):
    assert writers.needed(_manifest(leaf), WRITER_OF, _mine(1)) is None


def test_a_writer_not_in_the_map_gives_none():
    a = jax.device_put(jnp.ones(16), NamedSharding(_meshes()[0], P()))
    assert writers.needed(_manifest(_leaf(a)), {d: 0 for d in range(1, 8)}, {1}) is None


def _chunk(box) -> ChunkRecord:
    return ChunkRecord(box[0], box[1], f"k{box[0]}", 4, 4, 0)


def test_confirmed_only_when_each_writer_lists_every_box_predicted_of_it():
    boxes = [((0,), (8,)), ((8,), (8,))]
    leaf = LeafRecord((), "array", (16,), "float32")

    def writer(i, *bs):
        return _manifest(LeafRecord((), "array", (16,), "float32",
                                    chunks=tuple(_chunk(b) for b in bs)), index=i)
    wanted = {0: {(0, 0, boxes[0])}, 1: {(0, 0, boxes[1])}}
    assert writers.confirmed(wanted, {0: writer(0, boxes[0]), 1: writer(1, boxes[1])})
    assert not writers.confirmed(wanted, {0: writer(0, boxes[0])})  # writer 1 not read
    assert not writers.confirmed(wanted, {0: writer(0, boxes[1]), 1: writer(1, boxes[0])})
    assert writers.confirmed({}, {}) and leaf.chunks == ()
