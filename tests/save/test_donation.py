"""The snapshot is the state at save time, even when the next train step
donates (and so overwrites) the state's buffers; and a tier failing in the
background is reported once, as SaveFailedError, without stopping training or
leaving a step that looks committed in that tier.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import errno
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import resilient_ckpt as rc
from resilient_ckpt.core import layout
from resilient_ckpt.storage import FileStorage


def _shardings() -> dict:
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    return {"w": NamedSharding(mesh, P("x", "y")), "m": NamedSharding(mesh, P("x")),
            "b": NamedSharding(mesh, P())}


def initial_state() -> dict:
    r = np.random.default_rng(7)
    sh = _shardings()
    host = {"w": r.standard_normal((1024, 1024), dtype=np.float32),  # 4 MiB
            "m": r.standard_normal((2048, 256), dtype=np.float32),
            "b": r.integers(-1000, 1000, (1024,), dtype=np.int32)}
    return {k: jax.device_put(v, sh[k]) for k, v in host.items()}


def _train_step(s: dict) -> dict:
    # Every output has its input's shape, dtype and sharding, so XLA reuses the
    # donated buffers for the results: the old values are overwritten in place.
    return {"w": s["w"] * 1.5 + jnp.sin(s["m"]).sum() * 1e-3, "m": s["m"] - 0.25 * s["m"],
            "b": s["b"] * 3 + 1}


train_step = jax.jit(_train_step, donate_argnums=0)


def host_copy(state: dict) -> dict:
    return {k: np.array(v, copy=True) for k, v in state.items()}


def abstract(state: dict) -> dict:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


def assert_exact(restored: dict, want: dict, what: str) -> None:
    assert set(restored) == set(want)
    for k, v in want.items():
        got = np.asarray(restored[k])
        assert got.dtype == v.dtype and got.shape == v.shape
        assert got.tobytes() == v.tobytes(), f"{what}: leaf {k} differs"


@pytest.fixture
def ram():
    d = tempfile.mkdtemp(prefix="rc-donate-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _manager(directory, ram, local, **kw) -> rc.CheckpointManager:
    return rc.CheckpointManager(directory, options=rc.CheckpointManagerOptions(
        tiers=(rc.RamTier(path=ram, keep=None), rc.LocalTier(path=local, keep=None)), **kw))


# --------------------------------------------------------------- donation

def test_next_step_donating_the_state_does_not_change_the_snapshot(tmp_path, ram):
    local = str(tmp_path / "local")
    state = initial_state()
    saved = {}
    overlapped = copied = 0
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        assert mngr._options.enable_async_checkpointing
        for step in range(6):
            saved[step] = host_copy(state)
            assert mngr.save(step, args=ocp.args.StandardSave(state))
            overlapped += mngr.is_saving_in_progress()
            viewed = mngr.save_records[-1].viewed  # no warm slab yet: views, not copies
            old = state
            state = train_step(state)  # donates old's buffers right away, if it can
            if not viewed:  # (views hold the buffers till the tiers are written:
                # the step then gets new ones; test_first_save.py holds the writes back)
                assert all(a.is_deleted() for a in old.values()), "donation did not happen"
                copied += 1
            del old
            if step == 0:
                mngr._saver._flying.pool.settled(timeout=60)  # the next saves copy
        jax.block_until_ready(state)
        mngr.wait_until_finished()
        # The saves really ran while later steps overwrote the donated buffers.
        assert overlapped >= 3 and copied >= 3, (overlapped, copied)
        assert mngr.all_steps() == list(range(6))
        for step in range(6):
            out = mngr.restore(step, args=ocp.args.StandardRestore(abstract(state)))
            assert_exact(out, saved[step], f"step {step}")
        # The saved states differ from each other (the check above can fail).
        assert saved[0]["w"].tobytes() != saved[1]["w"].tobytes()

    # A fresh manager (a restarted job) reads the same bytes, from either tier.
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        for step in (0, 5):
            out = mngr.restore(step, args=ocp.args.StandardRestore(abstract(state)))
            assert_exact(out, saved[step], f"fresh manager, step {step}")
            assert set(mngr.last_restore.served.values()) == {"ram"}
    shutil.rmtree(ram)
    os.makedirs(ram)
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        out = mngr.restore(5, args=ocp.args.StandardRestore(abstract(state)))
        assert_exact(out, saved[5], "local tier, step 5")
        assert set(mngr.last_restore.served.values()) == {"local"}


def test_donating_a_restored_state_does_not_change_the_checkpoint(tmp_path, ram):
    """Restored arrays may alias the RAM tier's pages; a train step that donates
    them and writes its results in place must not reach the stored bytes."""
    local = str(tmp_path / "local")
    state = initial_state()
    want = host_copy(state)
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        restored = mngr.restore(1, args=ocp.args.StandardRestore(abstract(state)))
        assert set(mngr.last_restore.served.values()) == {"ram"}
        # "m" and "b" are replicated: several devices' shards alias one host
        # buffer. Every donated step must still compute from intact inputs.
        expect = {k: jax.device_put(v, state[k].sharding) for k, v in want.items()}
        for _ in range(3):
            restored, expect = train_step(restored), train_step(expect)
        jax.block_until_ready(restored)
        for k in want:
            for got, ref in zip(restored[k].addressable_shards, expect[k].addressable_shards,
                                strict=True):
                assert np.asarray(got.data).tobytes() == np.asarray(ref.data).tobytes(), \
                    f"leaf {k}, device {got.device}: donated steps differ"
        again = mngr.restore(1, args=ocp.args.StandardRestore(abstract(state)))
        assert_exact(again, want, "restore after donating the restored state")
    with _manager(tmp_path / "ckpt", ram, local) as mngr:
        assert_exact(mngr.restore(1, args=ocp.args.StandardRestore(abstract(state))),
                     want, "fresh manager")


# --------------------------------------------------------------- background failures

def _wait_idle(mngr: rc.CheckpointManager, timeout: float = 60) -> None:
    """Waits for background writes without consuming their errors (unlike
    wait_until_finished, which would raise them)."""
    deadline = time.monotonic() + timeout
    while mngr.is_saving_in_progress():
        assert time.monotonic() < deadline, "background save did not finish"
        time.sleep(0.01)


def _committed_files(local: str, step: int) -> list[str]:
    d = os.path.join(local, str(step))
    return [n for n in os.listdir(d) if layout.parse_manifest_name(n)] if os.path.isdir(d) else []


@pytest.mark.parametrize("next_call", ["save", "check_for_errors", "wait_until_finished"])
def test_tier_failure_is_raised_once_and_training_goes_on(tmp_path, ram, next_call):
    """A real fault: after the manager is opened, the local tier's directory is
    replaced by a regular file (as when a disk is remounted elsewhere), so every
    write to it fails with ENOTDIR/EEXIST. Tests run as root, so chmod would not
    stop the writes; this does."""
    local = str(tmp_path / "local")
    state = initial_state()
    want = {}
    mngr = _manager(tmp_path / "ckpt", ram, local)
    try:
        want[1] = host_copy(state)
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()

        os.rename(local, local + ".away")
        with open(local, "w") as f:
            f.write("not a directory")
        state = train_step(state)
        want[2] = host_copy(state)
        assert mngr.save(2, args=ocp.args.StandardSave(state))  # returns: the write is async
        state = train_step(state)
        _wait_idle(mngr)
        rec = mngr.save_records[-1]
        assert rec.step == 2 and rec.tiers["ram"].ok and not rec.tiers["local"].ok

        want[3] = host_copy(state)
        with pytest.raises(rc.SaveFailedError) as ei:
            if next_call == "save":
                mngr.save(3, args=ocp.args.StandardSave(state))
            else:
                getattr(mngr, next_call)()
        err = ei.value
        assert "step 2" in str(err) and "local" in str(err)
        assert isinstance(err.__cause__, OSError)
        told = [(e.step, e.tier) for e in (err.failures or (err,))]
        if next_call == "save":
            # save(3) started step 3 before raising step 2's failure; step 3's
            # own write to the broken tier fails too, and is reported once:
            # with step 2's when it was that quick, else by the next call.
            _wait_idle(mngr)
            try:
                mngr.check_for_errors()
            except rc.SaveFailedError as e:
                told += [(x.step, x.tier) for x in (e.failures or (e,))]
        assert sorted(told) == [(2, "local")] + ([(3, "local")] if next_call == "save" else [])
        # Raised exactly once: nothing more to report.
        mngr.check_for_errors()
        mngr.wait_until_finished()
        mngr.check_for_errors()

        os.remove(local)
        os.rename(local + ".away", local)  # the disk is back; training goes on
        state = train_step(state)
        want[4] = host_copy(state)
        if next_call != "save":  # save(3) raised after saving step 3 (to RAM only)
            assert mngr.save(3, args=ocp.args.StandardSave(state))
            want[3] = want[4]
        assert mngr.save(4, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2, 3, 4]
        assert 2 not in mngr.catalog.view("local")
    finally:
        try:
            mngr.close()
        finally:
            if os.path.isfile(local):
                os.remove(local)
                os.rename(local + ".away", local)

    # A new manager: step 2 exists in the RAM tier only, nothing of it in local.
    with _manager(tmp_path / "ckpt", ram, local) as m2:
        m2._cleanup.join(30)
        assert 2 not in m2.catalog.view("local") and 2 in m2.catalog.view("ram")
        assert _committed_files(local, 2) == []
        for step in m2.all_steps():
            out = m2.restore(step, args=ocp.args.StandardRestore(abstract(state)))
            assert_exact(out, want[step], f"step {step}")
            if step == 2:
                assert set(m2.last_restore.served.values()) == {"ram"}
    shutil.rmtree(ram)
    os.makedirs(ram)
    with _manager(tmp_path / "ckpt", ram, local) as m3:  # local alone: 2 is not there
        assert 2 not in m3.all_steps() and 1 in m3.all_steps()


def test_failure_mid_write_leaves_nothing_committed_looking(tmp_path, ram, monkeypatch):
    """A write that fails after some chunks are in place (a full disk). ENOSPC
    cannot be caused for real here without mounting a small file system, so
    this test monkeypatches FileStorage.put_parts to fail the 2nd pack written
    to the local tier with ENOSPC, the way the real put reports it."""
    local = str(tmp_path / "local")
    real_put = FileStorage.put_parts
    calls = {"n": 0}

    def failing_put(self, key, parts, size):
        if self.kind == "local" and key.startswith("2/"):
            calls["n"] += 1
            if calls["n"] == 2:
                raise self._err("write of", key, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return real_put(self, key, parts, size)

    state = initial_state()
    want = {1: host_copy(state)}
    with _manager(tmp_path / "ckpt", ram, local, io_threads=2) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        monkeypatch.setattr(FileStorage, "put_parts", failing_put)
        state = train_step(state)
        want[2] = host_copy(state)
        mngr.save(2, args=ocp.args.StandardSave(state))
        _wait_idle(mngr)
        monkeypatch.setattr(FileStorage, "put_parts", real_put)
        assert calls["n"] >= 2
        with pytest.raises(rc.SaveFailedError, match="No space left") as ei:
            mngr.check_for_errors()
        assert isinstance(ei.value.__cause__, rc.StorageError)
        assert ei.value.__cause__.errno == errno.ENOSPC
        mngr.check_for_errors()  # once only
        # What the failed write had put in place is gone; no manifest was written.
        d = os.path.join(local, "2")
        left = os.listdir(d) if os.path.isdir(d) else []
        assert left == [], left
        state = train_step(state)
        want[3] = host_copy(state)
        assert mngr.save(3, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
    with _manager(tmp_path / "ckpt", ram, local) as m2:
        m2._cleanup.join(30)
        assert sorted(m2.catalog.view("local")) == [1, 3]
        assert sorted(m2.catalog.view("ram")) == [1, 2, 3]
        d = os.path.join(local, "2")  # at most an empty directory is left
        assert not os.path.isdir(d) or os.listdir(d) == []
        for step in (1, 2, 3):
            assert_exact(m2.restore(step, args=ocp.args.StandardRestore(abstract(state))),
                         want[step], f"step {step}")
