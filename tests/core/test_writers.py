"""`writers.needed` works back, from a leaf's record, which writer of a save
on a tier the whole job sees wrote each box a process's devices hold, and
`writers.covering`, from a version-5 manifest's `writers` table, which
writers wrote the saved boxes that target boxes of another layout overlap:
both must agree with the replica ids jax gives the saved array's shards (the
save writes replica 0 of each box from the process of its device), and a
description they cannot follow (devices this job or the table lacks, a spec
jax refuses, a sharding of another kind) gives None, never an error. Eight
CPU devices stand for a job of four processes of two devices each (device d
on process d // 2)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt.core import manifest as mf, writers
from resilient_ckpt.core.manifest import ChunkRecord, ItemRecord, LeafRecord, Manifest
from resilient_ckpt.core.sharding import describe, index_to_box

WRITER_OF = {d: d // 2 for d in range(8)}


def _mine(q: int) -> set[int]:
    return {d for d, w in WRITER_OF.items() if w == q}


def _manifest(*leaves: LeafRecord, index: int = 0, writers: tuple = ()) -> Manifest:
    return Manifest(1, "s" * 32, 0.0, index, 4, (ItemRecord("default", "pytree", leaves),),
                    writers=writers)


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


# --------------------------------------------------------------- covering, runs_of

RUNS = ((0, 2, 0), (2, 2, 1), (4, 2, 2), (6, 2, 3))  # WRITER_OF as a `writers` table
SHAPE = (48, 12)  # splits 2, 3, 4, 6 and 8 ways along rows, 2, 3, 4 and 6 along columns


def _overlap(a, b) -> bool:
    """Whether boxes a and b (offsets, sizes) share an element."""
    return all(ao < bo + bs and bo < ao + as_ and as_ > 0 and bs > 0
               for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def _targets() -> list:
    """Target layouts other than the saved ones: other meshes and specs, one
    mesh over only 4 of the 8 devices (processes 2 and 3), one over 6 whose
    3-way split of the rows cuts across a 2- or 4-way saved one, one device."""
    devs = np.array(jax.devices())
    m24 = Mesh(devs.reshape(2, 4), ("a", "b"))
    half = Mesh(devs[4:].reshape(2, 2), ("a", "b"))
    six = Mesh(devs[[1, 2, 4, 5, 6, 7]].reshape(3, 2), ("a", "b"))
    flat = Mesh(devs[[5, 2, 7, 0, 3, 6, 1, 4]], ("a",))
    return [NamedSharding(m24, P("a", "b")), NamedSharding(m24, P("b")),
            NamedSharding(m24, P("b", "a")), NamedSharding(half, P("a", "b")),
            NamedSharding(half, P(("b", "a"))), NamedSharding(half, P()),
            NamedSharding(six, P("a", "b")), NamedSharding(six, P("a")),
            NamedSharding(six, P(None, "a")), NamedSharding(flat, P("a")),
            jax.sharding.SingleDeviceSharding(devs[5])]


def _target_boxes(target, q: int, shape=SHAPE) -> list:
    """The boxes process q's devices hold under `target`."""
    return [index_to_box(index, shape) for d, index in target.devices_indices_map(shape).items()
            if d.id in _mine(q)]


def _covered_from_jax(a: jax.Array, boxes: list) -> dict[int, set]:
    """Per writer, the boxes of `a` whose replica 0 (by jax) its devices
    hold and that some box of `boxes` overlaps."""
    out: dict[int, set] = {}
    for s in a.addressable_shards:
        box = index_to_box(s.index, a.shape)
        if s.replica_id == 0 and any(_overlap(box, t) for t in boxes):
            out.setdefault(WRITER_OF[s.device.id], set()).add((0, 0, box))
    return out


@pytest.mark.parametrize("mesh", range(3))
@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("data"), P(),
                                  P(("model", "data")), P("model", "data")])
def test_covering_names_the_writers_of_jaxs_replica_0_boxes_the_targets_overlap(mesh, spec):
    a = jax.device_put(jnp.arange(48 * 12, dtype=jnp.float32).reshape(SHAPE),
                       NamedSharding(_meshes()[mesh], spec))
    m = _manifest(_leaf(a), writers=RUNS)
    for t, target in enumerate(_targets()):
        for q in range(4):
            boxes = _target_boxes(target, q)
            assert writers.covering(m, {(0, 0): boxes}) == _covered_from_jax(a, boxes), \
                (mesh, spec, t, q)


def test_covering_by_hand():
    """Rows split 4 ways over (0, 1), (2, 3), (4, 5), (6, 7), replica 0 on the
    first of each; a target splitting them 3 ways on 6 devices."""
    a = jax.device_put(jnp.zeros(SHAPE), NamedSharding(_meshes()[0], P("data")))
    six = Mesh(np.array(jax.devices())[[1, 2, 4, 5, 6, 7]].reshape(3, 2), ("a", "b"))
    target = NamedSharding(six, P("a"))
    rows = {r: (0, 0, ((r, 0), (12, 12))) for r in (0, 12, 24, 36)}
    # the same table, written as runs of one device where they could be longer
    m = _manifest(_leaf(a), writers=((0, 1, 0), (1, 1, 0), (2, 2, 1), (4, 1, 2), (5, 1, 2),
                                     (6, 2, 3)))
    assert writers.covering(m, {(0, 0): _target_boxes(target, 3)}) == {  # rows 32 to 48
        2: {rows[24]}, 3: {rows[36]}}
    assert writers.covering(m, {(0, 0): _target_boxes(target, 0)}) == {  # device 1: rows 0 to 16
        0: {rows[0]}, 1: {rows[12]}}
    assert writers.covering(m, {(0, 0): []}) == {}  # process 0 of a 4-device target
    assert writers.covering(m, {}) == {}


def test_covering_of_several_leaves_and_kinds():
    devs = jax.devices()
    on3 = jax.device_put(jnp.ones((4, 4)), devs[3])  # writer 1
    key = jax.device_put(jax.random.key_data(jax.random.key(0)),
                         NamedSharding(_meshes()[1], P()))  # replica 0 on device 7: writer 3
    m = _manifest(_leaf(on3), LeafRecord((), "numpy", (5,), "int32"),
                  LeafRecord((), "numpy_scalar", (), "float32"),
                  LeafRecord((), "scalar", value={"type": "int", "value": 1}),
                  _leaf(key, "prng_key"), writers=RUNS)
    full4, full5, full2 = ((0, 0), (4, 4)), ((0,), (5,)), ((0,), (2,))
    wants = {(0, 0): [((2, 2), (1, 1))], (0, 1): [full5], (0, 2): [((), ())],
             (0, 3): [((), ())], (0, 4): [((1,), (1,))]}
    assert writers.covering(m, wants) == {   # numpy leaves from writer 0, the scalar from none
        1: {(0, 0, full4)}, 0: {(0, 1, full5), (0, 2, ((), ()))}, 3: {(0, 4, full2)}}
    assert writers.covering(m, {(0, 0): [((0, 0), (4, 0))]}) == {}  # an empty target box


def test_covering_without_a_writers_table_gives_none():
    a = jax.device_put(jnp.ones(SHAPE), NamedSharding(_meshes()[0], P("data")))
    m = _manifest(_leaf(a))  # a manifest before version 5
    assert writers.covering(m, {(0, 0): [((0, 0), SHAPE)]}) is None
    assert writers.covering(m, {}) is None


@pytest.mark.parametrize("leaf", [
    LeafRecord((), "array", (16,), "float32", {"type": "other", "device_ids": [0, 1],
                                               "repr": "GSPMDSharding"}),
    LeafRecord((), "array", (16,), "float32", None),
    _named(range(8), [8], ["x"], shape=(7,)),       # 7 rows over 8 devices
    _named([0, 0, 1, 1, 2, 2, 3, 3], [8], ["x"]),   # a device twice
    _named(range(8), [4], ["x"]),                   # a mesh that does not hold its devices
    _named(range(8), [8], ["z"]),                   # an axis the mesh lacks
    _named(range(100, 108), [8], ["x"]),            # devices the table lacks
    LeafRecord((), "array", (16,), "float32", {"type": "single_device", "device_id": 99}),
], ids=["other", "none", "indivisible", "twice", "bad-mesh", "unknown-axis", "absent-devices",
        "single-absent"])
def test_covering_a_layout_it_cannot_follow_gives_none(leaf):
    assert writers.covering(_manifest(leaf, writers=RUNS), {(0, 0): [((0,), (16,))]}) is None


def test_covering_a_box_on_a_device_missing_from_the_table_gives_none():
    a = jax.device_put(jnp.ones(SHAPE), NamedSharding(_meshes()[0], P("data")))
    m = _manifest(_leaf(a), writers=RUNS[:3])  # devices 6 and 7 (rows 36 to 48) unlisted
    assert writers.covering(m, {(0, 0): [((30, 0), (12, 12))]}) is None


@pytest.mark.parametrize("at", [(1, 0), (0, 1), (-1, 0), (0, -1), (5, 5)])
def test_covering_an_index_the_manifest_lacks_gives_none(at):
    a = jax.device_put(jnp.ones(SHAPE), NamedSharding(_meshes()[0], P("data")))
    m = _manifest(_leaf(a), writers=RUNS)
    assert writers.covering(m, {(0, 0): [((0, 0), SHAPE)], at: [((0, 0), SHAPE)]}) is None


def test_covering_from_a_parsed_manifest():
    """The table as a manifest carries it, through its bytes."""
    a = jax.device_put(jnp.ones(SHAPE), NamedSharding(_meshes()[2], P("model", "data")))
    rec = _leaf(a)
    rec = LeafRecord((("key", "w"),), rec.kind, rec.shape, rec.dtype, rec.sharding)
    m = mf.parse(mf.to_json(_manifest(rec, writers=RUNS)))
    assert m.writers == RUNS
    for q in range(4):
        boxes = _target_boxes(_targets()[6], q)
        assert writers.covering(m, {(0, 0): boxes}) == _covered_from_jax(a, boxes)


def test_runs_of_one_process_of_8_devices():
    assert writers.runs_of(range(1)) == ((0, 8, 0),)
    assert writers.runs_of([]) == ()
    assert writers.writer_map(writers.runs_of(range(1))) == {d: 0 for d in range(8)}


def test_runs_label_each_live_process_by_its_rank():
    four = tuple((d, d // 2) for d in range(8))  # (device id, process index)
    assert writers._runs((0, 1, 2, 3), four) == RUNS
    assert writers._runs((0, 1, 2, 3), four[::-1]) == RUNS  # in any order of devices
    assert writers._runs((1, 3), four) == ((2, 2, 0), (6, 2, 1))  # 0 and 2 lost
    alternate = tuple((d, d % 2) for d in range(6))
    assert writers._runs((0, 1), alternate) == tuple((d, 1, d % 2) for d in range(6))
    assert writers._runs((0,), ((0, 0), (1, 0), (5, 0))) == ((0, 2, 0), (5, 1, 0))


def test_writer_map_inverts_runs():
    assert writers.writer_map(RUNS) == WRITER_OF
    assert writers.writer_map(((3, 2, 1), (9, 1, 0))) == {3: 1, 4: 1, 9: 0}
    assert writers.writer_map(()) == {}
    live = (1, 3)
    devices = tuple((d, d // 2) for d in range(8))
    label = {q: r for r, q in enumerate(live)}
    assert writers.writer_map(writers._runs(live, devices)) == {
        d: label[q] for d, q in devices if q in label}
