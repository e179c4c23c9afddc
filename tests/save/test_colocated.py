"""Saves written by the hosts that own the shards (`write_on_owning_hosts`,
colocated.py), on the 8 CPU devices.

On the CPU backend the colocated CPU devices are the devices themselves and
colocated Python runs the function in this process (after pickling it, as for
a remote host), so what is checked here is the protocol: every chunk of a jax
leaf is put inside the colocated function, from the shard of the device that
holds its replica 0, the controller commits from the returned records alone,
and the step reads back bit-exactly through an ordinary manager. That the
function really runs on other hosts under Pathways is not tested here
(docs/pathways.md).
"""
from __future__ import annotations

import errno
import logging
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.core.sharding import index_to_box
from resilient_ckpt.save import colocated
from resilient_ckpt.storage import FileStorage

HOST_THREADS = "rc-host-io"  # the owning hosts' writer threads (colocated._write_on_host)


def make_state(mesh: Mesh, seed: int = 0) -> dict:
    r = np.random.default_rng(seed)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "params": {"w": put(r.standard_normal((8, 4), dtype=np.float32), P("data", None)),
                   "m": put(r.integers(-9, 9, (8, 8), dtype=np.int32), P("data", "model")),
                   "b": put(r.standard_normal((6,), dtype=np.float32), P())},
        "rng": jax.random.key(seed),  # one device
        "mask": r.integers(0, 2, (5,)).astype(np.int8),  # numpy: the controller holds it
        "step": seed,
    }


def host(tree):
    return jax.tree.map(lambda x: np.array(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x, copy=True) if hasattr(x, "dtype") else x, tree)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def assert_exact(got, want, what: str) -> None:
    g, w = host(got), want
    flat_g, flat_w = jax.tree_util.tree_leaves_with_path(g), jax.tree_util.tree_leaves_with_path(w)
    assert [p for p, _ in flat_g] == [p for p, _ in flat_w], what
    for (p, a), (_, b) in zip(flat_g, flat_w, strict=True):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape, (what, p)
            assert a.tobytes() == b.tobytes(), f"{what}: {p} differs"
        else:
            assert a == b, (what, p)


def options(**kw) -> rc.CheckpointManagerOptions:
    return rc.CheckpointManagerOptions(write_on_owning_hosts=True, **kw)


def manifest_of(directory, step: int) -> mf.Manifest:
    path = os.path.join(directory, str(step), layout.manifest_name(0, 1))
    with open(path, "rb") as f:
        return mf.parse(f.read(), path)


def owners(state: dict) -> dict[tuple, int]:
    """(leaf path text, chunk offsets) -> id of the device holding replica 0."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if not isinstance(leaf, jax.Array):
            continue
        data = jax.random.key_data(leaf) if jax.dtypes.issubdtype(
            leaf.dtype, jax.dtypes.prng_key) else leaf
        for s in data.addressable_shards:
            if s.replica_id == 0:
                out[(jax.tree_util.keystr(path), index_to_box(s.index, data.shape)[0])] = \
                    s.device.id
    return out


def host_writes(caplog) -> dict[str, list[int]]:
    """Chunk key -> the devices from whose shard the colocated function put it."""
    out: dict[str, list[int]] = {}
    for r in caplog.records:
        if hasattr(r, "rc_chunk"):
            assert r.threadName.startswith(HOST_THREADS), r.threadName
            out.setdefault(r.rc_chunk, []).append(r.rc_device)
    return out


def test_each_chunk_is_written_by_its_owning_device_and_restores_exactly(tmp_path, mesh,
                                                                          caplog):
    caplog.set_level(logging.DEBUG, logger="resilient_ckpt")
    state = make_state(mesh, 3)
    want = host(state)
    with rc.CheckpointManager(tmp_path, options=options()) as mngr:
        assert mngr.save(3, args=ocp.args.StandardSave(state), metrics={"loss": 0.5})
        mngr.wait_until_finished()
        tw = mngr.save_records[-1].tiers["local"]
        assert tw.ok and tw.source == colocated.SOURCE
        # The controller's host memory held only the numpy leaf (one 4 KiB page),
        # not the 14 device chunks the ordinary snapshot would have copied there.
        assert mngr._saver._flying.pool.free_bytes() == 4096

    m = manifest_of(tmp_path, 3)
    wrote = host_writes(caplog)
    where = owners(state)
    device_chunks = 0
    for lf in m.items[0].leaves:
        text = "".join(f"[{k!r}]" for _, k in lf.path)
        for c in lf.chunks:
            if lf.kind in ("array", "prng_key"):
                # put exactly once, inside the colocated function, from its owner's shard
                assert wrote.get(c.key) == [where[(text, c.offsets)]], (text, c.key)
                device_chunks += 1
            else:
                assert c.key not in wrote  # a numpy leaf: the controller wrote it
    assert device_chunks == len(wrote) == 4 + 8 + 1 + 1  # w, m, b, rng

    # An ordinary manager (no colocated Python) restores it, on the same mesh ...
    with rc.CheckpointManager(tmp_path) as plain:
        assert_exact(plain.restore(3, args=ocp.args.StandardRestore(abstract(state))),
                     want, "same mesh")
        assert plain.metrics(3) == {"loss": 0.5}
        # ... and onto another one.
        other = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
        target = abstract(make_state(other, 0))
        by_column = NamedSharding(other, P(None, "model"))
        target["params"]["w"] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=by_column)
        out = plain.restore(3, args=ocp.args.StandardRestore(target))
        assert out["params"]["w"].sharding == target["params"]["w"].sharding
        assert_exact(out, want, "other mesh")


def test_gcs_tier_written_on_the_owning_hosts(gcs, url, mesh, caplog):
    caplog.set_level(logging.DEBUG, logger="resilient_ckpt")
    state = make_state(mesh, 5)
    tiers = (rc.GcsTier(url, endpoint=gcs.endpoint),)
    with rc.CheckpointManager(url, options=options(tiers=tiers)) as mngr:
        mngr.save(5, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        assert mngr.save_records[-1].tiers["gcs"].source == colocated.SOURCE
    assert len(host_writes(caplog)) == 14
    with rc.CheckpointManager(url, options=rc.CheckpointManagerOptions(tiers=tiers)) as plain:
        assert_exact(plain.restore(5, args=ocp.args.StandardRestore(abstract(state))),
                     host(state), "gcs")


def test_a_failure_inside_the_colocated_write_commits_nothing(tmp_path, mesh, monkeypatch):
    """A fault injected into the owning hosts' writes: a full disk cannot be
    caused here, so FileStorage.put is patched to fail the 3rd chunk put from
    the colocated function's writer threads with ENOSPC, as the real put
    reports it. The controller's own writes are untouched."""
    real_put = FileStorage.put
    calls = {"n": 0}

    def failing_put(self, key, data):
        if threading.current_thread().name.startswith(HOST_THREADS) and key.startswith("2/"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise self._err("write of", key, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return real_put(self, key, data)

    with rc.CheckpointManager(tmp_path, options=options(io_threads=2)) as mngr:
        mngr.save(1, args=ocp.args.StandardSave(make_state(mesh, 1)))
        mngr.wait_until_finished()
        monkeypatch.setattr(FileStorage, "put", failing_put)
        mngr.save(2, args=ocp.args.StandardSave(make_state(mesh, 2)))
        deadline = time.monotonic() + 60
        while mngr.is_saving_in_progress():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        monkeypatch.setattr(FileStorage, "put", real_put)
        assert calls["n"] >= 3
        with pytest.raises(rc.SaveFailedError, match="No space left") as ei:
            mngr.check_for_errors()
        assert ei.value.__cause__.errno == errno.ENOSPC
        d = tmp_path / "2"  # what the hosts had put is gone, and no manifest
        assert not d.exists() or list(d.iterdir()) == []
        assert mngr.all_steps() == [1]
        mngr.save(3, args=ocp.args.StandardSave(make_state(mesh, 3)))
        mngr.wait_until_finished()
    with rc.CheckpointManager(tmp_path) as plain:
        assert plain.all_steps() == [1, 3]
        assert_exact(plain.restore(3, args=ocp.args.StandardRestore(abstract(
            make_state(mesh)))), host(make_state(mesh, 3)), "after the failure")


def test_save_returns_before_the_hosts_write_and_wait_waits(tmp_path, mesh, monkeypatch):
    """The owning hosts' writes are held on an event (a disk cannot be made slow
    on demand here): FileStorage.put, patched, waits in their writer threads."""
    entered, gate = threading.Event(), threading.Event()
    real_put = FileStorage.put

    def slow_put(self, key, data):
        if threading.current_thread().name.startswith(HOST_THREADS):
            entered.set()
            assert gate.wait(60)
        return real_put(self, key, data)

    monkeypatch.setattr(FileStorage, "put", slow_put)
    state = make_state(mesh, 4)
    with rc.CheckpointManager(tmp_path, options=options()) as mngr:
        assert mngr.save(4, args=ocp.args.StandardSave(state))
        assert entered.wait(30)  # the hosts are writing, and save has returned
        assert mngr.is_saving_in_progress()
        assert not (tmp_path / "4" / layout.manifest_name(0, 1)).exists()
        threading.Timer(0.3, gate.set).start()
        t0 = time.monotonic()
        mngr.wait_until_finished()
        assert time.monotonic() - t0 >= 0.2
        assert (tmp_path / "4" / layout.manifest_name(0, 1)).exists()
        assert_exact(mngr.restore(4, args=ocp.args.StandardRestore(abstract(state))),
                     host(state), "after waiting")


_DONATE = jax.jit(lambda s: jax.tree.map(lambda x: x * 3 + 1, s), donate_argnums=0)


def test_donating_the_state_right_after_save_is_safe(tmp_path, mesh):
    state = {k: jax.device_put(np.arange(4096, dtype=np.float32).reshape(64, 64) * (i + 1),
                               NamedSharding(mesh, spec))
             for i, (k, spec) in enumerate([("a", P("data", "model")), ("b", P("model")),
                                            ("c", P())])}
    saved = {}
    with rc.CheckpointManager(tmp_path, options=options()) as mngr:
        for step in range(4):
            saved[step] = host(state)
            mngr.save(step, args=ocp.args.StandardSave(state))
            old, state = state, _DONATE(state)  # overwrites old's buffers in place
            assert all(a.is_deleted() for a in old.values()), "donation did not happen"
        mngr.wait_until_finished()
        assert saved[0]["a"].tobytes() != saved[1]["a"].tobytes()
    with rc.CheckpointManager(tmp_path) as plain:
        for step in range(4):
            assert_exact(plain.restore(step, args=ocp.args.StandardRestore(abstract(state))),
                         saved[step], f"step {step}")


def test_options_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="RamTier"):
        options(tiers=(rc.RamTier(), rc.LocalTier()))
    # An environment without cloudpickle (a None entry makes its import fail).
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(rc.MissingDependencyError, match="cloudpickle") as ei:
        rc.CheckpointManager(tmp_path, options=options())
    assert isinstance(ei.value, ImportError)
    assert list(tmp_path.iterdir()) == []  # refused before anything was opened
