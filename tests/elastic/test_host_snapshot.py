"""The host-memory snapshot tier (`elastic.hostsnap`) on 8 real CPU devices.

The mesh is (replica=2, data=2, model=2); devices 4-7 are replica group 1.
Copies, checksums, donation, the device loss (`testing.faults`: the lost
devices' buffers, pinned copies included, are really deleted), resharding
and the elastic loop are all real. The two injected faults, each said where
it is made, are the device loss and a corrupted host copy (a copy's pinned
array replaced by one with a flipped bit: host memory cannot be corrupted
otherwise from here).

The training step works on unsigned integers, so its result does not depend
on the mesh, and `reference` (numpy) says what every step's state must be.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import logging

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from resilient_ckpt import CorruptCheckpointError
from resilient_ckpt.core.sharding import index_to_box
from resilient_ckpt.elastic import (
    Elastic,
    HealthCheck,
    HostSnapshotTier,
    hostleaf,
    hostplan,
    ondevice,
)
from resilient_ckpt.testing.faults import DeviceFault, FaultInjector, delete_buffers_on
from tests.support import effort
from tests.support.tiers import manager

SPECS = {"w": P(("replica", "data"), "model"),   # FSDP-style: sharded along the replica axis
         "r": P("data", "model"),                 # replicated along the replica axis
         "b": P("model"), "n": P()}


# ------------------------------------------------------------------ the model

def init_host() -> dict:
    return {"w": np.arange(16 * 8, dtype=np.uint32).reshape(16, 8),
            "r": (np.arange(64, dtype=np.uint32) * np.uint32(3)).reshape(8, 8),
            "b": np.arange(8, dtype=np.uint32) * np.uint32(7),
            "n": np.uint32(0)}


def _next(s, xp):
    u = xp.uint32
    total = xp.sum(s["w"], dtype=u)
    w = s["w"] * u(1664525) + u(1013904223) + total + s["b"][None, :] + s["n"]
    r = s["r"] ^ (w[:s["r"].shape[0], :s["r"].shape[1]] >> u(3))
    return {"w": w, "r": r, "b": s["b"] ^ (total >> u(3)),
            "n": s["n"] + u(1)}


def reference(steps: int) -> list[dict]:
    out = [init_host()]
    for _ in range(steps):
        out.append(_next(out[-1], np))
    return out


def shardings(mesh: Mesh) -> dict:
    return {k: NamedSharding(mesh, v) for k, v in SPECS.items()}


def abstract_of(mesh: Mesh, specs: dict | None = None) -> dict:
    specs = specs or SPECS
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype,
                                    sharding=NamedSharding(mesh, specs[k]))
            for k, v in init_host().items()}


def build(mesh: Mesh):
    sh = shardings(mesh)
    step = jax.jit(lambda s: _next(s, jnp), donate_argnums=0, out_shardings=sh)
    return step, abstract_of(mesh), lambda: jax.device_put(init_host(), sh)


def host(state: dict) -> dict:
    return {k: np.asarray(v) for k, v in state.items()}


def assert_state(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"{what}: leaf {k}")


def nbytes(tree) -> int:
    return sum(np.asarray(v).nbytes for v in jax.tree.leaves(tree))


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def devices():
    return jax.devices()[:8]


@pytest.fixture(scope="module")
def mesh3(devices):
    return Mesh(np.array(devices).reshape(2, 2, 2), ("replica", "data", "model"))


@pytest.fixture(scope="module")
def small(devices):
    """The (replica=1, data=2, model=2) mesh left after replica group 1 (devices 4-7) is lost."""
    return Mesh(np.array(devices[:4]).reshape(1, 2, 2), ("replica", "data", "model"))


@pytest.fixture(scope="module")
def check(devices):
    hc = HealthCheck()
    hc.prepare(devices)
    return hc


def put(mesh: Mesh, state: dict | None = None) -> dict:
    return jax.device_put(state if state is not None else init_host(), shardings(mesh))


def taken(tier: HostSnapshotTier, step: int, state) -> None:
    assert tier.take(step, state)
    assert tier.wait(30)


# ------------------------------------------------------------------ checksums

DTYPES = [np.float32, np.int32, np.uint16, ml_dtypes.bfloat16, np.int8, np.bool_, np.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_checksum_on_device_matches_numpy_and_sees_one_flipped_bit(devices, dtype):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 100, (6, 5)).astype(dtype)
    on_device = jax.jit(ondevice.checksum)
    want = ondevice.checksum_np(a)
    assert tuple(int(v) for v in on_device(jax.device_put(a, devices[3]))) == want
    for pos in [(0, 0), (2, 3), (5, 4)]:
        flipped = a.copy()
        if dtype is np.bool_:
            flipped[pos] = not flipped[pos]
        else:
            raw = flipped.view(np.uint8).reshape(6, -1)
            raw[pos[0], pos[1] * np.dtype(dtype).itemsize] ^= 0x10
        assert ondevice.checksum_np(flipped) != want
        assert tuple(int(v) for v in on_device(jax.device_put(flipped, devices[3]))) != want
    if dtype is not np.bool_:
        swapped = a.copy()
        swapped[0, 0], swapped[0, 1] = a[0, 1], a[0, 0]
        if a[0, 0] != a[0, 1]:
            assert ondevice.checksum_np(swapped) != want   # the position weights see it
    # The same numbers from one program over several devices (stacked blocks).
    blocks = [jax.device_put(a if i != 2 else a[::-1].copy(), d)
              for i, d in enumerate(devices[:4])]
    got = np.asarray(ondevice.Programs().checksums(blocks))
    assert [tuple(map(int, r)) for r in got] == [want, want, ondevice.checksum_np(a[::-1]), want]


# ------------------------------------------------------------------ placement and records

def test_copies_survive_the_loss_of_any_replica_group(mesh3):
    """Each block of a leaf sharded along the replica axis gets a backup in
    the group half the ring away (the next one of two); a leaf replicated
    along it has a copy per group and no backup; so without any one group's
    devices every block is still held."""
    tier = HostSnapshotTier(replica_axis="replica")
    state = put(mesh3)
    taken(tier, 1, state)
    rec = tier.record(1)
    assert rec.complete and rec.step == 1
    leaves = {leaf.path: leaf for leaf in rec.leaves}
    w = leaves["['w']"]
    assert w.shape == (16, 8) and w.dtype == "uint32" and "replica" in w.spec
    assert len(w.blocks) == 8
    for b in w.blocks:
        (p,), (k,) = b.primaries, b.backups
        assert k == (p + 4) % 8       # same position, next replica group
        assert b.nbytes == 4 * 4 * 4
    for name in ("['r']", "['b']", "['n']"):
        for b in leaves[name].blocks:
            assert b.backups == () and len(b.primaries) == 2
            assert {d // 4 for d in b.primaries} == {0, 1}
    host_state = host(state)
    for leaf in rec.leaves:
        key = leaf.path[2:-2]
        for b in leaf.blocks:
            sl = tuple(slice(o, o + s) for o, s in zip(*b.box, strict=True))
            assert b.checksum == ondevice.checksum_np(host_state[key][sl])
    for group in ({0, 1, 2, 3}, {4, 5, 6, 7}):
        live = [d for d in mesh3.devices.flat if d.id not in group]
        assert tier.viable(live) == 1
    # Primaries and backups: twice the state in host memory (one host here).
    assert tier.bytes_per_host() == {0: 2 * nbytes(host_state)}


AXES = ("replica", "data", "model")
SPEC_CHOICES = [P(), P("replica"), P("data"), P(("replica", "data")), P(None, "model"),
                P(("replica", "data"), "model"), P("model", ("data", "replica")),
                P(("model", "replica"))]


def _blocks(sharding, shape, axis):
    boxes = {d.id: index_to_box(i, shape)
             for d, i in sharding.devices_indices_map(shape).items()}
    order, group, nxt = hostleaf.replica_ring(sharding, axis)
    sizes = {b: int(np.prod(b[1])) * 4 for b in boxes.values()}
    leaf = hostplan.LeafRecord("x", shape, "uint32", str(sharding.spec),
                               hostplan.place_copies(boxes, order, group, nxt, sizes))
    return leaf, order, group


@hypothesis.settings(max_examples=effort.examples(40), deadline=None)
@hypothesis.given(mesh_shape=st.sampled_from([(2, 2, 2), (2, 1, 4), (4, 2, 1), (2, 4, 1),
                                              (1, 2, 4)]),
                  spec=st.sampled_from(SPEC_CHOICES), target=st.sampled_from(SPEC_CHOICES),
                  lost_group=st.integers(0, 7))
def test_placement_and_restore_plans_property(mesh_shape, spec, target, lost_group):
    """Pure planning over real shardings: with two replica groups or more,
    the blocks held outside any one group cover the leaf, and the plan onto
    the surviving group's devices (any specs) covers every target box exactly
    once, from copies outside the lost group, each block moved whole."""
    devs = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devs, AXES)
    shape = (48, 24)   # divisible on every mesh and its survivors
    leaf, order, group = _blocks(NamedSharding(mesh, spec), shape, "replica")
    groups = mesh_shape[0]
    assert sum(int(np.prod(b.box[1])) for b in leaf.blocks) == 48 * 24  # a partition
    for b in leaf.blocks:
        assert len(set(b.holders)) == len(b.holders)
        assert len({group[d] for d in b.primaries}) == len(b.primaries)  # one per group
        if groups >= 2:
            assert len({group[d] for d in b.holders}) >= 2
    if groups < 2:
        return
    g = lost_group % groups
    alive = [d for d in order if group[d] != g]
    usable = {(0, bi, d) for bi, b in enumerate(leaf.blocks) for d in b.holders if d in alive}
    assert hostplan.is_viable(hostplan.SnapshotRecord(1, (leaf,), complete=True), usable)
    survivors = Mesh(np.delete(devs, g, axis=0), AXES)
    tsh = NamedSharding(survivors, target)
    targets = {d.id: index_to_box(i, shape) for d, i in tsh.devices_indices_map(shape).items()}
    plan = hostplan.plan_leaf(leaf, 0, targets, usable, {d: 0 for d in range(8)})
    assert not isinstance(plan, int)
    for dev, pieces in plan.items():
        assert all(p.source in alive for p in pieces)
        covered = np.zeros(targets[dev][1], int)
        for p in pieces:
            covered[tuple(slice(*d) for d in p.dst)] += 1
            src_shape = tuple(b - a for a, b in p.src)
            assert src_shape == tuple(b - a for a, b in p.dst)
            assert p.nbytes == int(np.prod(leaf.blocks[p.block].box[1])) * 4
        assert (covered == 1).all()
        assert any(p.source == dev for p in pieces) or all(
            dev not in leaf.blocks[p.block].holders for p in pieces)  # own copy first


def test_budget_drops_never_exceed_the_budget():
    kept = [(1, {"a": 5, "b": 1}), (2, {"a": 5}), (3, {"b": 7})]
    assert hostplan.budget_drops(kept, {"a": 4}, None) == []
    assert hostplan.budget_drops(kept, {"a": 4}, 14) == []     # a: 5 + 5 + 4
    assert hostplan.budget_drops(kept, {"a": 4}, 13) == [1]
    assert hostplan.budget_drops(kept, {"a": 4, "b": 4}, 9) == [1, 2, 3]
    assert hostplan.budget_drops(kept, {"b": 10}, 9) is None
    assert hostplan.budget_drops([], {"a": 9}, 9) == []


def test_backups_half_the_ring_away_survive_a_lost_half(devices):
    """Four groups along the replica axis (data=4): a backup sits two groups
    away, so losing devices 4-7 (groups 2 and 3, a block of hosts) or any two
    adjacent groups leaves every block; losing two groups two apart does not
    (both copies of their blocks are gone)."""
    mesh = Mesh(np.array(devices).reshape(4, 2), ("data", "model"))
    x = jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8),
                       NamedSharding(mesh, P("data", "model")))
    tier = HostSnapshotTier(replica_axis="data")
    taken(tier, 1, {"x": x})
    [leaf] = tier.record(1).leaves
    assert sorted((b.primaries[0], b.backups[0]) for b in leaf.blocks) == [
        (p, (p + 4) % 8) for p in range(8)]
    for lost in ({4, 5, 6, 7}, {0, 1, 2, 3}, {2, 3, 4, 5}, {6, 7, 0, 1}, {2, 3}):
        assert tier.viable([d for d in devices if d.id not in lost]) == 1, lost
    assert tier.viable([d for d in devices if d.id not in {0, 1, 4, 5}]) is None


def test_a_block_whose_copies_are_all_lost_makes_the_step_not_viable(mesh3):
    tier = HostSnapshotTier(replica_axis="replica")
    taken(tier, 3, put(mesh3))
    tier.lose([0])
    assert tier.viable() == 3            # device 0's blocks have a backup on device 4
    tier.lose([4])
    assert tier.viable() is None         # block rows 0-3, cols 0-3 of w: both copies gone
    with pytest.raises(CorruptCheckpointError, match="no intact copy"):
        tier.restore(3, abstract_of(mesh3))


def test_budget_drops_oldest_first_and_skips_what_cannot_fit(mesh3, caplog):
    state = put(mesh3)
    one = 2 * nbytes(host(state))        # a snapshot: primaries and backups
    tier = HostSnapshotTier(keep=2, budget_bytes=one + one // 2, replica_axis="replica")
    for step in (1, 2, 3):
        assert tier.take(step, state)
        assert tier.bytes_per_host()[0] <= tier.budget_bytes   # while it is being taken
        assert tier.wait(30)
        assert tier.bytes_per_host()[0] <= tier.budget_bytes
        assert tier.steps() == [step]    # room for one: the older one went first
    big = HostSnapshotTier(keep=2, budget_bytes=2 * one, replica_axis="replica")
    for step in (1, 2, 3):
        taken(big, step, state)
        assert big.bytes_per_host()[0] <= big.budget_bytes
    assert big.steps() == [2, 3]
    tiny = HostSnapshotTier(budget_bytes=one - 1, replica_axis="replica")
    with caplog.at_level(logging.WARNING, "resilient_ckpt.elastic"):
        assert tiny.take(1, state) is False and tiny.take(2, state) is False
    warned = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warned) == 1 and str(one) in warned[0] and f"budget_bytes={one - 1}" in warned[0]
    assert tiny.steps() == [] and tiny.skipped == [1, 2] and tiny.bytes_per_host() == {}


def test_budget_is_per_host(mesh3):
    """With two hosts (devices 0-3 and 4-7), each holds half the copies."""
    state = put(mesh3)
    half = nbytes(host(state))
    tier = HostSnapshotTier(budget_bytes=half, replica_axis="replica",
                            host_of=lambda d: d.id // 4)
    taken(tier, 1, state)
    assert tier.bytes_per_host() == {0: half, 1: half}
    assert HostSnapshotTier(budget_bytes=half - 1, replica_axis="replica",
                            host_of=lambda d: d.id // 4).take(1, state) is False


@pytest.mark.parametrize("keep", [1, 2])
def test_retention_keeps_the_newest_and_frees_the_rest(mesh3, keep):
    tier = HostSnapshotTier(keep=keep, replica_axis="replica")
    state = put(mesh3)
    one = 2 * nbytes(host(state))
    for step in (1, 2, 3, 4):
        taken(tier, step, state)
    assert tier.steps() == [4, 3][:keep][::-1]
    assert tier.bytes_per_host() == {0: keep * one}
    assert not hostplan.beyond_keep([1, 2], 2) and hostplan.beyond_keep([1, 2, 5], 2) == [1]


# ------------------------------------------------------------------ donation

def test_a_donating_step_right_after_take_leaves_the_snapshot_intact(mesh3):
    big = {"w": np.arange(1024 * 512, dtype=np.uint32).reshape(1024, 512),
           "r": np.arange(512 * 512, dtype=np.uint32).reshape(512, 512),
           "b": np.arange(512, dtype=np.uint32), "n": np.uint32(5)}
    step = jax.jit(lambda s: _next(s, jnp), donate_argnums=0, out_shardings=shardings(mesh3))
    ab = {n: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=shardings(mesh3)[n])
          for n, v in big.items()}
    tier = HostSnapshotTier(keep=3, replica_axis="replica")
    state, want = put(mesh3, big), [big]
    for k in (1, 2, 3):
        assert tier.take(k, state)
        before = state
        state = step(step(state))        # dispatched at once, donating the snapshotted buffers
        assert before["w"].is_deleted()  # the donation really happened
        want.append(_next(_next(want[-1], np), np))
    assert tier.wait(60)
    for k in (1, 2, 3):
        assert_state(host(tier.restore(k, ab)), {n: np.asarray(v) for n, v in want[k - 1].items()},
                     f"snapshot {k}")
    # A restored state donated by the next step does not change the snapshot either.
    restored = tier.restore(3, ab)
    jax.block_until_ready(step(restored))
    assert restored["w"].is_deleted()
    assert_state(host(tier.restore(3, ab)), {n: np.asarray(v) for n, v in want[2].items()},
                 "snapshot 3 after its restored state was donated")


# ------------------------------------------------------------------ restore

def test_restore_after_losing_a_replica_group_onto_four_devices(mesh3, small, devices):
    tier = HostSnapshotTier(replica_axis="replica", host_of=lambda d: d.id // 2)
    state = put(mesh3)
    want = host(state)
    taken(tier, 7, state)
    # Injected fault: devices 4-7 are lost; their buffers, pinned copies included, are deleted.
    assert delete_buffers_on([4, 5, 6, 7]) > 0
    tier.lose([4, 5, 6, 7])
    assert tier.viable(devices[:4]) == 7
    got = tier.restore(7, abstract_of(small))
    assert_state(host(got), want, "restored onto 4 devices")
    for k, a in got.items():
        assert a.sharding == NamedSharding(small, SPECS[k]), k
        assert {d.id for d in a.devices()} <= {0, 1, 2, 3}
    kinds = tier.last_restore.bytes_by_kind
    # Each of the 4 devices gets two blocks of w (4x4 uint32), one of r, one of b
    # and n: from surviving copies on devices 0-3, none on another device twice.
    assert tier.last_restore.step == 7 and all(v >= 0 for v in kinds.values())
    assert kinds["same_device"] > 0 and kinds["same_host"] > 0 and kinds["other_host"] > 0
    assert sum(kinds.values()) == 4 * 2 * 64 + 4 * 64 + 4 * 16 + 4 * 4


def test_restore_programs_are_compiled_ahead_and_survive_clear_caches(mesh3, small, devices):
    """After a commit the restore's programs for `likely_meshes` are compiled
    in the background; jax.clear_caches() (the loop's, after a failure) keeps
    them, `lose` drops those over a lost device, and the restore onto the
    likely mesh compiles nothing more (and still checks every block moved)."""
    tier = HostSnapshotTier(replica_axis="replica")
    tier.likely_meshes = lambda mesh: [small]
    state = put(mesh3)
    want = host(state)
    taken(tier, 3, state)
    assert tier.preparing is not None
    tier.preparing.join(60)
    prepared = {k for k in tier._programs.held() if k[0] == "assemble"}
    assert prepared and all(set(k[1]) <= {0, 1, 2, 3} for k in prepared)
    assert delete_buffers_on([4, 5, 6, 7]) > 0
    tier.lose([4, 5, 6, 7])
    jax.clear_caches()
    assert all(not {4, 5, 6, 7} & set(k[1]) for k in tier._programs.held())
    before = set(tier._programs.held())
    assert prepared <= before
    assert_state(host(tier.restore(3, abstract_of(small))), want, "restored onto 4 devices")
    assert set(tier._programs.held()) == before
    # A corrupted copy is still caught by the precompiled program.
    copy = next(c for c in tier.record(3).copies() if c[0][2] == 0 and c[1] > 4)[0]
    bad = np.asarray(tier._get(3).copies[copy]).copy()
    bad.reshape(-1)[0] ^= 1
    tier.corrupt(3, copy, jax.device_put(bad, SingleDeviceSharding(devices[0],
                                                                 memory_kind="pinned_host")))
    with pytest.raises(CorruptCheckpointError):   # its only other copy was on device 4
        tier.restore(3, abstract_of(small))
    assert copy in tier._get(3).bad


def test_checksum_by_rows_is_the_direct_formula():
    """`checksum` sums by rows of ROW words; blocks with a partial last row
    (or none whole) give the same numbers as `checksum_np`."""
    rng = np.random.default_rng(1)
    for n in (1, ondevice.ROW - 1, ondevice.ROW, 3 * ondevice.ROW + 5):
        for dtype in (np.uint32, np.uint8, np.float16):
            a = rng.integers(0, 2**15, n).astype(dtype)
            got = tuple(int(v) for v in np.asarray(jax.jit(ondevice.checksum)(a)))
            assert got == ondevice.checksum_np(a), (n, dtype)


def test_restore_onto_other_specs_and_finer_shardings(mesh3, small):
    tier = HostSnapshotTier(replica_axis="replica")
    state = put(mesh3)
    want = host(state)
    taken(tier, 2, state)
    finer = {"w": P(("replica", "data", "model")), "r": P(None, ("replica", "data", "model")),
             "b": P(("replica", "data", "model")), "n": P()}
    assert_state(host(tier.restore(2, abstract_of(mesh3, finer))), want, "finer shardings")
    other = {"w": P("model", "data"), "r": P(), "b": P(), "n": P()}
    assert_state(host(tier.restore(2, abstract_of(small, other))), want, "other specs")


def test_keys_narrow_dtypes_and_host_values(mesh3, small):
    sh = NamedSharding(mesh3, P(("replica", "data")))
    state = {"key": jax.device_put(jax.random.split(jax.random.key(3), 8), sh),
             "bf": jax.device_put(np.linspace(-2, 2, 16).astype(ml_dtypes.bfloat16), sh),
             "mask": jax.device_put(np.arange(16) % 3 == 0, sh),
             "count": 41, "table": np.arange(5)}
    tier = HostSnapshotTier(replica_axis="replica")
    taken(tier, 1, state)
    tsh = NamedSharding(small, P("data"))
    ab = {k: (jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=tsh) if isinstance(v, jax.Array)
              else v) for k, v in state.items()}
    got = tier.restore(1, ab)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                  jax.random.key_data(state["key"]))
    assert jax.dtypes.issubdtype(got["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(got["bf"]), np.asarray(state["bf"]))
    np.testing.assert_array_equal(np.asarray(got["mask"]), np.asarray(state["mask"]))
    assert got["count"] == 41 and got["table"] is not state["table"]
    np.testing.assert_array_equal(got["table"], np.arange(5))


def _flipped_copy(tier: HostSnapshotTier, step: int, copy):
    """Injected fault: copy `copy`'s pinned array replaced by its bytes with one bit flipped."""
    good = tier._get(step).copies[copy]
    bad = np.asarray(good).copy()
    bad.reshape(-1)[0] ^= np.uint32(1)
    dev = next(iter(good.devices()))
    tier.corrupt(step, copy, jax.device_put(bad, SingleDeviceSharding(dev,
                                                                      memory_kind="pinned_host")))


def test_a_corrupted_host_copy_falls_back_to_the_other_copy(mesh3, caplog):
    tier = HostSnapshotTier(keep=2, replica_axis="replica")
    state = put(mesh3)
    want = host(state)
    taken(tier, 1, state)
    taken(tier, 2, state)
    tier.restore(2, abstract_of(mesh3))
    clean = tier.last_restore.bytes_by_kind
    li = [leaf.path for leaf in tier.record(2).leaves].index("['w']")
    bi = next(i for i, b in enumerate(tier.record(2).leaves[li].blocks) if b.primaries == (0,))
    _flipped_copy(tier, 2, (li, bi, 0))
    with caplog.at_level(logging.WARNING, "resilient_ckpt.elastic"):
        got = tier.restore(2, abstract_of(mesh3))
    assert_state(host(got), want, "restored around the corrupted copy")
    assert any("failed their checksums" in r.getMessage() for r in caplog.records)
    # The backup (device 4) served that 64-byte block to device 0, not its own copy.
    assert tier.last_restore.bytes_by_kind["same_host"] == clean["same_host"] + 64
    # Both copies corrupted: step 2 is not viable any more; step 1 is.
    _flipped_copy(tier, 2, (li, bi, 4))
    with pytest.raises(CorruptCheckpointError, match="no intact copy"):
        tier.restore(2, abstract_of(mesh3))
    assert tier.viable() == 1
    assert_state(host(tier.restore(1, abstract_of(mesh3))), want, "the older snapshot")


# ------------------------------------------------------------------ the elastic loop

def trainer(el: Elastic, faults: FaultInjector, total: int, seen: dict, hook=None):
    @el.run
    def train(mesh):
        step_fn, abstract, init = build(mesh)
        step_fn = faults.wrap(step_fn)
        state, start = el.restore(abstract, init)
        seen.setdefault(start, []).append(host(state))
        for step in range(start + 1, total + 1):
            state = step_fn(step, state)
            el.save(step, state)
            if hook is not None:
                hook(step)
        return host(state)
    return train


def test_the_loop_recovers_from_the_surviving_replicas_host_copy(mesh3, devices, check):
    total, fail_at = 12, 7
    want = reference(total)
    faults = FaultInjector([DeviceFault(fail_at, (4, 5, 6, 7))], check=check)
    tier = HostSnapshotTier(every=1, keep=2)   # replica axis: the loop's data axis
    with manager(ram_every=4, local_every=100) as mngr:
        el = Elastic(mngr, mesh3, data_axis="replica", health_check=faults.health_check,
                     rescale_every_s=0, host_snapshot=tier)
        assert tier.replica_axis == "replica"
        seen: dict = {}
        # Each snapshot is committed before the next step, so step 6's is when
        # the fault fires (one still in flight at a loss is discarded).
        final = trainer(el, faults, total, seen, hook=lambda step: tier.wait(30))()
        mngr.wait_until_finished()
    ev = el.timeline[0]
    assert (ev.kind, ev.step, ev.outcome) == ("failure", fail_at, "resumed")
    assert ev.devices_after == (0, 1, 2, 3)
    # The manager's newest step was 4; the host snapshot held step 6: no step lost.
    assert ev.restored_step == fail_at - 1 and ev.steps_lost == 0
    assert set(ev.restored_from) == {"host_snapshot"} and ev.restored_from["host_snapshot"] > 0
    assert "host_snapshot 100%" in ev.summary()
    assert_state(seen[fail_at - 1][-1], want[fail_at - 1], "the state restored")
    assert_state(final, want[total], "final state, against the replay")
    assert tier.wait(30) and tier.steps() == [total - 1, total]  # and go on, on 4 devices


def test_the_loop_falls_back_to_the_manager_when_the_host_copies_are_corrupt(mesh3, check):
    total, fail_at = 10, 7
    want = reference(total)
    faults = FaultInjector([DeviceFault(fail_at, (4, 5, 6, 7))], check=check)
    tier = HostSnapshotTier(every=1, keep=2)

    def corrupt_every_w_copy(step):
        # Injected fault: after step 6, every host copy of w's first block is corrupted.
        if step == fail_at - 1:
            tier.wait(30)
            for s in tier.steps():
                rec = tier.record(s)
                li = [leaf.path for leaf in rec.leaves].index("['w']")
                for d in rec.leaves[li].blocks[0].holders:
                    _flipped_copy(tier, s, (li, 0, d))

    with manager(ram_every=4, local_every=100) as mngr:
        el = Elastic(mngr, mesh3, data_axis="replica", health_check=faults.health_check,
                     rescale_every_s=0, host_snapshot=tier)
        seen: dict = {}
        final = trainer(el, faults, total, seen, hook=corrupt_every_w_copy)()
        mngr.wait_until_finished()
    ev = el.timeline[0]
    assert ev.outcome == "resumed" and ev.restored_step == 4
    assert "host_snapshot" not in ev.restored_from and ev.restored_from.get("ram", 0) > 0
    assert_state(final, want[total], "final state, against the replay")
