"""The state reserve: touched, XLA-owned buffers a restore reads into.

On 8 CPU devices with real RAM and local tiers: the restored values land in
the reserve's own buffers (`restore.Into` leaves), the next step donates them
(the point of the reserve), a bad copy in the RAM tier falls back to the local
one while writing in place, a box several devices hold reaches each of their
buffers, an Into leaf that cannot be written in place (another sharding, a
cast) is restored as usual and leaves its array alone, a target that does not
fit the reserve is left as it is, and the elastic loop with `reserve=True`
recovers to the same state as a run without failures.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import Elastic
from resilient_ckpt.elastic.state import StateReserve, retarget, standard_restore, standard_save
from resilient_ckpt.restore.assemble import Into
from resilient_ckpt.testing.faults import DeviceFault, FaultInjector
from tests.support.tiers import flip, manager as tiers_manager

ROWS, COLS = 4096, 128  # 2 MiB of uint32 per table: above the reserve's threshold


@pytest.fixture(scope="module")
def meshes():
    devs = np.array(jax.devices()[:8])
    if len(devs) < 8:
        pytest.skip("needs 8 CPU devices")
    return Mesh(devs.reshape(4, 2), ("data", "model")), Mesh(devs[:4].reshape(2, 2),
                                                             ("data", "model"))


def abstract_on(mesh: Mesh) -> dict:
    rows = NamedSharding(mesh, P(("data", "model"), None))
    rep = NamedSharding(mesh, P())
    return {"emb": jax.ShapeDtypeStruct((ROWS, COLS), jnp.uint32, sharding=rows),
            "mom": jax.ShapeDtypeStruct((ROWS, COLS), jnp.uint32, sharding=rows),
            "count": jax.ShapeDtypeStruct((), jnp.uint32, sharding=rep)}


def init(mesh: Mesh) -> dict:
    a = abstract_on(mesh)
    host = {"emb": np.arange(ROWS * COLS, dtype=np.uint32).reshape(ROWS, COLS),
            "mom": np.full((ROWS, COLS), 7, np.uint32), "count": np.uint32(0)}
    return {k: jax.device_put(v, a[k].sharding) for k, v in host.items()}


def _step(s):
    i = s["count"] % ROWS
    emb = s["emb"].at[i].add(s["mom"][i] + s["count"])
    return {"emb": emb, "mom": s["mom"].at[i].add(1), "count": s["count"] + 1}


def step_on(mesh: Mesh):
    a = abstract_on(mesh)
    return jax.jit(_step, donate_argnums=0,
                   out_shardings={k: v.sharding for k, v in a.items()})


def manager(every: int = 2):
    """A RAM-only manager (tests/support/tiers.py's, without its local tier)."""
    return tiers_manager(ram_every=every, local_every=None)


def pointers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def host(state: dict) -> dict:
    return {k: np.asarray(v) for k, v in state.items()}


def ready_reserve(full: Mesh, small: Mesh) -> StateReserve:
    r = StateReserve(True)
    r.note(abstract_on(full), True)
    r.start(lambda: [small])
    assert r.wait(60)
    return r


def test_restore_lands_in_the_reserve_and_the_next_step_donates_it(meshes):
    full, small = meshes
    r = ready_reserve(full, small)
    spare = r._spares[next(iter(r._spares))].result()
    spare_ptrs = [pointers(b) for b in spare.buffers]
    with manager(every=1) as mngr:
        state = step_on(full)(init(full))
        mngr.save(1, args=standard_save(state))
        mngr.wait_until_finished()
        want = host(state)
        target = r.target(abstract_on(small), small)
        assert isinstance(target["emb"], Into) and not isinstance(target["count"], Into)
        got = mngr.restore(1, args=standard_restore(target))
        assert mngr.last_restore.bytes_by_tier["ram"] > 0
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)
        assert got[k].sharding == abstract_on(small)[k].sharding
    assert got["emb"] is target["emb"].array and got["mom"] is target["mom"].array
    assert [pointers(got["emb"]), pointers(got["mom"])] == spare_ptrs
    before = pointers(got["emb"])
    after = step_on(small)(got)
    assert pointers(after["emb"]) == before  # donated: the step wrote in place
    plain = abstract_on(small)
    assert r.target(plain, small) is plain  # used once


def _flip_ram_copies(mngr, step: int) -> int:
    """Flips a byte in every RAM-tier chunk file of `step`; returns how many."""
    ram = next(t for t in mngr.tiers if t.name == "ram")
    d = os.path.join(ram.storage.root, str(step))
    n = 0
    for name in os.listdir(d):
        if not name.startswith(("manifest", ".")):
            flip(os.path.join(d, name))
            n += 1
    return n


def zeros_on(abstract: dict) -> dict:
    return {k: jax.device_put(np.zeros(v.shape, v.dtype), v.sharding)
            for k, v in abstract.items()}


def test_a_bad_ram_copy_falls_back_to_the_local_tier_in_place(meshes):
    full, small = meshes
    with tiers_manager(ram_every=1, local_every=1) as mngr:
        state = step_on(full)(init(full))
        mngr.save(1, args=standard_save(state))
        mngr.wait_until_finished()
        want = host(state)
        assert _flip_ram_copies(mngr, 1) > 0
        dest = zeros_on(abstract_on(small))
        ptrs = pointers(dest["emb"])
        got = mngr.restore(1, args=standard_restore({k: Into(v) for k, v in dest.items()}))
        assert mngr.last_restore.bytes_by_tier["local"] > 0 and mngr.last_restore.fallbacks
    assert got["emb"] is dest["emb"] and pointers(got["emb"]) == ptrs
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=k)


def test_a_replicated_box_reaches_every_device_that_holds_it(meshes):
    full, small = meshes
    cols = NamedSharding(small, P(None, "model"))  # each box on both data rows
    with manager(every=1) as mngr:
        state = init(full)
        mngr.save(1, args=standard_save(state))
        mngr.wait_until_finished()
        dest = jax.device_put(np.zeros((ROWS, COLS), np.uint32), cols)
        got = mngr.restore(1, args=standard_restore({**abstract_on(small), "emb": Into(dest)}))
    assert got["emb"] is dest
    want = np.asarray(state["emb"])
    for shard in dest.addressable_shards:  # each device's own buffer
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_an_into_leaf_that_cannot_be_written_in_place_is_left_alone(meshes):
    full, small = meshes
    with manager(every=1) as mngr:
        state = init(full)
        mngr.save(1, args=standard_save(state))
        mngr.wait_until_finished()
        dest = zeros_on(abstract_on(small))
        cast = jax.device_put(np.zeros((ROWS, COLS), np.float32), dest["mom"].sharding)
        target = {**abstract_on(small), "emb": Into(dest["emb"]), "mom": Into(cast)}
        # restore args that give "emb" another sharding than its array's
        other = NamedSharding(small, P(None, "model"))
        moved = mngr.restore(1, args=ocp.args.PyTreeRestore(
            target, restore_args={"emb": ocp.ArrayRestoreArgs(sharding=other), "mom": None,
                                  "count": None}))
        got = mngr.restore(1, args=standard_restore(target))
    assert moved["emb"] is not dest["emb"] and moved["emb"].sharding == other
    np.testing.assert_array_equal(np.asarray(moved["emb"]), np.asarray(state["emb"]))
    assert got["emb"] is dest["emb"] and got["mom"] is not cast  # a cast: not in place
    np.testing.assert_array_equal(np.asarray(got["mom"]), np.asarray(state["mom"]))
    assert got["mom"].dtype == np.float32
    assert not np.asarray(cast).any()  # never written


def test_a_target_of_concrete_arrays_gets_the_reserve_too(meshes):
    full, small = meshes
    r = ready_reserve(full, small)
    target = r.target(zeros_on(abstract_on(small)), small)  # arrays as the restore target
    assert isinstance(target["emb"], Into) and isinstance(target["mom"], Into)


def test_a_state_that_does_not_fit_is_left_as_it_is(meshes):
    full, small = meshes
    r = ready_reserve(full, small)
    other = NamedSharding(small, P(None, "model"))
    target = {**abstract_on(small),
              "emb": jax.ShapeDtypeStruct((ROWS, COLS), jnp.uint32, sharding=other)}
    assert r.target(target, small) is target
    plain = abstract_on(full)
    assert r.target(plain, full) is plain  # no reserve for that mesh


def test_disabled_or_off_cpu_targets_build_nothing(meshes):
    full, small = meshes
    r = StateReserve(False)
    r.note(abstract_on(full), True)
    r.start(lambda: [small])
    assert not r.wait(0)
    assert retarget({"x": jax.ShapeDtypeStruct((4,), jnp.float32)}, small) is not None


def test_elastic_with_reserve_recovers_to_the_same_state(meshes):
    full, small = meshes
    total, fail_at = 12, 8
    want = init(full)
    for _ in range(total):
        want = step_on(full)(want)
    want = host(want)
    faults = FaultInjector([DeviceFault(fail_at, (4, 5, 6, 7))])
    with manager(every=2) as mngr:
        el = Elastic(mngr, full, health_check=faults.health_check, reserve=True,
                     build=lambda m: (step_on(m), abstract_on(m)))

        @el.run
        def train(mesh):
            step_fn, abstract = el.program(mesh)
            step_fn = faults.wrap(step_fn)
            state, start = el.restore(abstract, lambda: init(mesh))
            for step in range(start + 1, total + 1):
                if step == fail_at and mesh == full:
                    assert el.reserve.wait(60)
                    taken.append(True)
                state = step_fn(step, state)
                el.save(step, state)
            return state

        taken: list[bool] = []
        got = host(train())
    assert taken == [True]
    assert el.timeline[0].kind == "failure" and el.timeline[0].restored_step == 6
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
