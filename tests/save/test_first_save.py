"""The first save does not stall on fresh host memory when the manager saw
the state before: a save call that was not due, or a restore, faults the
snapshot's memory in ahead, in the background (`SaveRecord.fresh_bytes` is
what a snapshot had to fault in on the training thread)."""
from __future__ import annotations

import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt.core import layout
from tests.support.tiers import manager


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


def test_a_first_call_that_saves_views_the_buffers_and_the_next_save_copies():
    """The first save finds no slab: on CPU devices it holds views of the
    state's buffers (nothing copied, nothing faulted in on the training
    thread) and a slab is faulted in for the next one, which copies."""
    with manager(ram_every=2, local_every=None) as mngr:
        assert mngr.save(0, args=ocp.args.StandardSave(_state(0)))
        rec = mngr.save_records[-1]
        assert rec.viewed and rec.fresh_bytes == 0 and rec.bytes >= 4 * 2**20
        mngr.wait_until_finished()
        assert mngr._saver._flying.pool.settled(timeout=60)
        assert mngr.save(2, args=ocp.args.StandardSave(_state(2)))
        rec = mngr.save_records[-1]
        assert not rec.viewed and rec.fresh_bytes == 0  # the slab faulted in meanwhile
        mngr.wait_until_finished()
        for step in (0, 2):
            got = mngr.restore(step, args=ocp.args.StandardRestore(_abstract(_state(step))))
            np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(_state(step)["w"]))


def test_a_viewed_first_save_survives_donation_deletion_and_a_written_numpy_leaf(
        monkeypatch):
    """While the first save's views hold the state's buffers, the next step
    that donates them gets new ones, a deleted array keeps its bytes for the
    save, and a numpy leaf the caller writes after `save` returned was copied;
    once written, the buffers are let go (a donation takes them again). The
    tier writes are held back until the step ran (a slow disk, which cannot
    be made to order here: FileStorage.put_parts, which every put of a file
    tier goes through, waits on an event)."""
    from resilient_ckpt.storage.files import FileStorage
    gate, put = threading.Event(), FileStorage.put_parts

    def slow_put(self, key, parts, size):
        if "/" in key:  # a step's pack or chunk, not the root's records
            assert gate.wait(60)
        return put(self, key, parts, size)
    step_fn = jax.jit(lambda w: w * 2 + 1, donate_argnums=0)
    with manager(ram_every=1, local_every=1) as mngr:
        monkeypatch.setattr(FileStorage, "put_parts", slow_put)
        state = _state(5)
        want = {k: np.array(v) for k, v in state.items()}
        host = np.arange(1000, dtype=np.int32)
        assert mngr.save(1, args=ocp.args.StandardSave({**state, "host": host}))
        assert mngr.save_records[-1].viewed
        host[:] = -1
        new_w = step_fn(state["w"])
        new_w.block_until_ready()
        assert not state["w"].is_deleted()  # a view holds it: not donated
        state["b"].delete()
        gate.set()
        mngr.wait_until_finished()
        target = {**_abstract(state), "host": np.zeros(1000, np.int32)}
        got = mngr.restore(1, args=ocp.args.StandardRestore(target))
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(got[k]), v)
        np.testing.assert_array_equal(got["host"], np.arange(1000, dtype=np.int32))
        assert mngr.last_restore.bytes_by_tier.get("ram")
        step_fn(state["w"]).block_until_ready()
        assert state["w"].is_deleted()  # the views are gone: donated now
        del new_w


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


def test_a_viewed_save_writes_the_local_tier_past_the_page_cache(tmp_path):
    """A view starts 64 bytes into a page, where O_DIRECT cannot start: its
    chunks go through a staging buffer, not the page cache (a buffered first
    save of 1 GB wrote at half the speed here, docs/benchmarks.md)."""
    import os

    from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier
    from resilient_ckpt.native.hostmem import cached
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    w = np.random.default_rng(9).standard_normal((2048, 2048)).astype(np.float32)
    state = {"w": jax.device_put(w, NamedSharding(mesh, P("x", "y")))}  # 2 MiB chunks
    root = str(tmp_path / "ckpt")
    opts = CheckpointManagerOptions(tiers=[LocalTier(map_cached=False)])
    with CheckpointManager(root, options=opts) as mngr:
        assert mngr.save(1, args=ocp.args.StandardSave(state))
        assert mngr.save_records[-1].viewed
        mngr.wait_until_finished()
        step_dir = os.path.join(root, "1")
        packs = [os.path.join(step_dir, n) for n in os.listdir(step_dir)
                 if layout.is_chunk_name(n)]
        assert sum(os.path.getsize(p) for p in packs) == 8 * (2 << 20)  # 8 chunks, packed
        for path in packs:
            fd = os.open(path, os.O_RDONLY)
            try:
                for at in range(0, os.path.getsize(path), 2 << 20):  # each chunk's start
                    assert not cached(fd, 4096, at), (path, at)  # not even its first page
            finally:
                os.close(fd)
        got = mngr.restore(1, args=ocp.args.StandardRestore(_abstract(state)))
        np.testing.assert_array_equal(np.asarray(got["w"]), w)


CHECK_EARLY = r"""
import os, sys, tempfile, threading, time
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import resilient_ckpt as rc
from resilient_ckpt.save import snapshot

def checks():
    return [t for t in threading.enumerate() if t.name == "rc-view-check"]

d, ram = tempfile.mkdtemp(), tempfile.mkdtemp(dir="/dev/shm")
tiers = [rc.RamTier(every=1, keep=1, path=ram)]
with rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(tiers=tiers,
                                                                 read_only=True)):
    assert snapshot._check_thread is None, "a read-only manager never saves"
m = rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(tiers=tiers))
first = snapshot._check_thread
assert first is not None and first.name == "rc-view-check" and not first.daemon
first.join(60)
assert not checks(), "the check ends by itself"
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
w = jax.device_put(np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024),
                   NamedSharding(mesh, P("x", "y")))
m.save(0, args=ocp.args.StandardSave({"w": w}))
viewed = m.save_records[-1].viewed
m.wait_until_finished()
got = m.restore(0, args=ocp.args.StandardRestore({"w": jax.ShapeDtypeStruct(
    w.shape, w.dtype, sharding=w.sharding)}))
m.close()
ram2 = tempfile.mkdtemp(dir="/dev/shm")
m2 = rc.CheckpointManager(d + "-2", options=rc.CheckpointManagerOptions(tiers=[
    rc.RamTier(every=1, keep=1, path=ram2)]))
assert snapshot._check_thread is first, "once per process"
m2.close()
print("RESULT", viewed, bool(np.array_equal(np.asarray(got["w"]), np.asarray(w))))
import shutil
for p in (d, d + "-2", ram, ram2):
    shutil.rmtree(p, ignore_errors=True)
"""


def test_a_writable_managers_open_checks_views_once_per_process_off_the_first_save():
    """The first save's one check of this jax (that a viewed buffer is kept
    when a step donates it: a jit compile) runs on a thread of its own from
    a writable manager's open, once per process; the first save then views
    the state and restores exact. A fresh process: the check is per process."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHECK_EARLY], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT True True" in out.stdout, out.stdout + out.stderr[-2000:]
