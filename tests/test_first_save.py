"""The first save does not stall on fresh host memory when the manager saw
the state before: a save call that was not due, or a restore, faults the
snapshot's memory in ahead, in the background (`SaveRecord.fresh_bytes` is
what a snapshot had to fault in on the training thread)."""
from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from _tiers import manager


def _state(seed: float) -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    w = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024) + seed
    return {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
            "b": jax.device_put(np.full(4096, seed, np.float32), NamedSharding(mesh, P()))}


def _abstract(state: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


def _reopened(mngr):
    from resilient_ckpt import CheckpointManager, CheckpointManagerOptions
    return CheckpointManager(mngr.directory, options=CheckpointManagerOptions(  # the same tiers
        tiers=[t.plan.config for t in mngr.tiers]))


def test_a_save_that_is_not_due_warms_the_first_one():
    with manager(ram_every=2, local_every=None) as first:
        first.save(2, args=ocp.args.StandardSave(_state(2)))  # a job's first save: due
        first.wait_until_finished()
        first.close()
        with _reopened(first) as mngr:
            assert not mngr.save(3, args=ocp.args.StandardSave(_state(3)))  # not due: warms
            assert mngr.save(4, args=ocp.args.StandardSave(_state(4)))
            rec = mngr.save_records[-1]
            assert rec.fresh_bytes == 0 and rec.bytes >= 4 * 2**20
            mngr.wait_until_finished()
            got = mngr.restore(4, args=ocp.args.StandardRestore(_abstract(_state(4))))
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_state(4)["w"]))


def test_a_first_call_that_saves_faults_in_and_the_next_save_reuses_it():
    with manager(ram_every=2, local_every=None) as mngr:
        assert mngr.save(0, args=ocp.args.StandardSave(_state(0)))
        assert mngr.save_records[-1].fresh_bytes >= mngr.save_records[-1].bytes
        mngr.wait_until_finished()
        assert mngr.save(2, args=ocp.args.StandardSave(_state(2)))
        assert mngr.save_records[-1].fresh_bytes == 0  # the first slab, back in the pool


def test_a_restore_warms_the_next_save():
    with manager(ram_every=2, local_every=None) as first:
        first.save(2, args=ocp.args.StandardSave(_state(2)))
        first.wait_until_finished()
        first.close()
        with _reopened(first) as again:
            restored = again.restore(2, args=ocp.args.StandardRestore(_abstract(_state(2))))
            assert again.save(4, args=ocp.args.StandardSave(restored))
            assert again.save_records[-1].fresh_bytes == 0


def test_a_fresh_elastic_job_s_first_save_copies_into_warm_memory():
    from resilient_ckpt.elastic import Elastic
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    with manager(ram_every=1, local_every=None) as mngr:
        el = Elastic(mngr, mesh, data_axis="x", health_check=lambda devices, timeout: list(devices))
        state, step = el.restore(_abstract(_state(0)), init=lambda: _state(0))
        assert step == 0
        assert el.save(0, state)  # nothing to restore: init(), then the job's first save
        rec = mngr.save_records[-1]
        assert rec.fresh_bytes == 0 and rec.bytes >= 4 * 2**20
