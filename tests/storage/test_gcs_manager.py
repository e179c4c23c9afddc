"""The GCS tier in the manager, against fake-gcs-server through the real client:
uploads from a faster tier, codecs, failures, the commit race, retention."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    GcsTier,
    LocalTier,
    RamTier,
    RetryPolicy,
    SaveFailedError,
    StepAlreadyExistsError,
)
from resilient_ckpt.core import layout
from resilient_ckpt.save import cleanup
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.gcs_proxy import FaultProxy
from tests.support.gcs_manager import FAST, abstract, assert_equal, host, make_state


def gcs_only(url, endpoint, **kw):
    return CheckpointManagerOptions(tiers=[GcsTier(url, endpoint=endpoint, retry=FAST, **kw)])


def manifests(gcs, url, step):
    st = GcsStorage(url, endpoint=gcs.endpoint)
    return st.list(str(step), starts_with=layout.MANIFEST_PREFIX)


def test_gcs_alone_round_trips_bit_exact_with_zstd(gcs, url, mesh):
    state = make_state(mesh, 1)
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint, codec="zstd")) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        tw = m.save_records[-1].tiers["gcs"]
        assert tw.ok and tw.source == "host snapshot" and tw.stored_bytes < tw.bytes
    # A new machine: nothing but the bucket.
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as m2:
        assert m2.all_steps() == [1]
        assert_equal(m2.restore(1, args=ocp.args.StandardRestore(abstract(state))), state)
        assert set(m2.last_restore.bytes_by_tier) == {"gcs"}
        codecs = {c.codec for _, _, c in m2.catalog.viable()[1].manifest.chunks()}
        assert codecs == {"raw", "zstd"}  # bf16 and f32 shrink; int8 and keys do not


def test_raw_is_the_default_codec(gcs, url, mesh):
    state = make_state(mesh, 2)
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as m:
        m.save(2, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert {c.codec for _, _, c in m.catalog.viable()[2].manifest.chunks()} == {"raw"}
        assert_equal(m.restore(2), state)


def test_gs_directory_is_one_gcs_tier(gcs, url, mesh, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
    with CheckpointManager(url, options=CheckpointManagerOptions(max_to_keep=1)) as m:
        assert m.tier_names == ["gcs"] and str(m.directory) == url
        for s in (0, 1):
            m.save(s, args=ocp.args.StandardSave({"x": jnp.arange(4.0) + s}))
        m.wait_until_finished()
        assert m.all_steps() == [1]
        assert np.array_equal(m.restore()["x"], np.arange(4.0) + 1)
    with pytest.raises(ValueError, match="gs://"):
        CheckpointManager(url, options=CheckpointManagerOptions(tiers=[LocalTier()]))


def test_upload_streams_from_ram_never_from_devices(gcs, url, mesh, ram_path, tmp_path):
    opts = CheckpointManagerOptions(tiers=[
        RamTier(path=ram_path, every=1, keep=2),
        GcsTier(url, endpoint=gcs.endpoint, every=3, keep=2, retry=FAST)])
    want = {}
    with CheckpointManager(tmp_path, options=opts) as m:
        for s in range(1, 7):
            state = make_state(mesh, s)
            want[s] = host(state)
            m.save(s, args=ocp.args.StandardSave(state))
            # The devices' buffers are gone once save returns: an upload that
            # read them again would fail.
            for leaf in jax.tree.leaves(state):
                if isinstance(leaf, jax.Array):
                    leaf.delete()
            if s in (1, 3):  # else a slow upload is superseded by the next (by design)
                m.wait_until_finished()
        m.wait_until_finished()
        uploads = {r.step: r.tiers["gcs"] for r in m.save_records if "gcs" in r.tiers}
        assert sorted(uploads) == [1, 3, 6]  # the first save goes everywhere
        assert all(tw.ok and tw.source == "ram" for tw in uploads.values()), uploads
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as g:
        assert g.all_steps() == [3, 6]
        for s in (3, 6):
            assert_equal(host(g.restore(s)), want[s])


def test_a_step_due_on_gcs_alone_goes_to_ram_too(gcs, url, mesh, ram_path, tmp_path):
    opts = CheckpointManagerOptions(tiers=[
        RamTier(path=ram_path, every=2, keep=5),
        GcsTier(url, endpoint=gcs.endpoint, every=3, retry=FAST)])
    with CheckpointManager(tmp_path, options=opts) as m:
        for s in range(1, 4):
            m.save(s, args=ocp.args.StandardSave(make_state(mesh, s)))
        m.wait_until_finished()
        rec3 = m.save_records[-1]
        assert rec3.tiers["ram"].ok and rec3.tiers["gcs"].source == "ram"
    assert sorted(n for n in os.listdir(ram_path) if n[0] != ".") == ["1", "2", "3"]


def test_source_step_is_kept_until_its_upload_ends(gcs, url, mesh, ram_path, tmp_path):
    # Uploads are slowed by the proxy holding each upload request for a while.
    with FaultProxy(gcs.endpoint, faults=["stall"], stall_s=0.3,
                    match=lambda m, p: "/upload/" in p) as proxy:
        proxy.set(fraction=1.0)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves(make_state(mesh, 0))
                          if hasattr(x, "nbytes"))
        opts = CheckpointManagerOptions(tiers=[
            RamTier(path=ram_path, every=1, keep=1),
            GcsTier(url, endpoint=proxy.endpoint, every=1, keep=1, retry=FAST)],
            host_memory_budget=state_bytes + 4096)  # room for one snapshot only
        m = CheckpointManager(tmp_path, options=opts)
        for s in range(3):
            m.save(s, args=ocp.args.StandardSave(make_state(mesh, s)))
        time.sleep(0.2)
        # RAM keeps one step, but those still being uploaded stay until then.
        assert len(os.listdir(ram_path)) > 1
        m.wait_until_finished()
        m.close()  # runs the retention the uploads deferred
    assert [n for n in os.listdir(ram_path) if not n.startswith(".")] == ["2"]
    gcs_writes = [r.tiers["gcs"] for r in m.save_records]
    # Step 1's upload was still queued behind step 0's when step 2 came: only
    # the newest needs to reach GCS, so it was dropped (and its RAM pin with it).
    assert gcs_writes[0].source == gcs_writes[2].source == "ram"
    assert "superseded by step 2" in gcs_writes[1].skipped
    # The snapshot went back once RAM had the step, not after the slow upload.
    assert max(r.waited_s for r in m.save_records) < gcs_writes[0].seconds / 2
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as g:
        assert g.all_steps() == [2]


def test_restore_does_not_wait_for_an_upload(gcs, url, mesh, ram_path, tmp_path):
    with FaultProxy(gcs.endpoint, stall_s=2, match=lambda m, p: "/upload/" in p) as proxy:
        proxy.queue(*["stall"] * 8)  # the upload's first requests hang for 2 s
        opts = CheckpointManagerOptions(tiers=[
            RamTier(path=ram_path), GcsTier(url, endpoint=proxy.endpoint, retry=FAST)])
        with CheckpointManager(tmp_path, options=opts) as m:
            state = make_state(mesh, 4)
            m.save(4, args=ocp.args.StandardSave(state))
            t0 = time.monotonic()
            assert_equal(m.restore(4), state)  # from RAM, while GCS is still uploading
            assert time.monotonic() - t0 < 1.5 and m.is_saving_in_progress()
            assert_equal(m.restore(), state)
            assert set(m.last_restore.bytes_by_tier) == {"ram"}


def test_a_failed_upload_is_reported_and_training_goes_on(gcs, url, mesh, ram_path, tmp_path):
    short = RetryPolicy(deadline_s=1.0, attempt_timeout_s=1, initial_s=0.01, max_delay_s=0.1)
    with FaultProxy(gcs.endpoint, faults=["503"],
                    match=lambda m, p: "/upload/" in p) as proxy:
        opts = CheckpointManagerOptions(tiers=[
            RamTier(path=ram_path, every=1, keep=3),
            GcsTier(url, endpoint=proxy.endpoint, every=1, retry=short)])
        m = CheckpointManager(tmp_path, options=opts)
        m.save(0, args=ocp.args.StandardSave(make_state(mesh, 0)))
        m.wait_until_finished()
        proxy.set(fraction=1.0)  # GCS refuses every upload from now on
        m.save(1, args=ocp.args.StandardSave(make_state(mesh, 1)))
        with pytest.raises(SaveFailedError, match="step 1 to the gcs tier") as ei:
            m.wait_until_finished()
        assert isinstance(ei.value.__cause__, OSError)
        rec = m.save_records[-1]
        assert rec.tiers["ram"].ok and not rec.tiers["gcs"].ok
        assert manifests(gcs, url, 1) == []  # not committed on GCS
        assert m.all_steps() == [0, 1]  # the RAM copy still counts
        proxy.set(fraction=0.0)
        m.save(2, args=ocp.args.StandardSave(make_state(mesh, 2)))  # no error left to raise
        m.close()
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as g:
        assert g.all_steps() == [0, 2]


def test_two_managers_racing_for_one_step_commit_once(gcs, url, mesh):
    states = [make_state(mesh, 10), make_state(mesh, 20)]
    managers = [CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) for _ in states]
    barrier, errors = threading.Barrier(2), [None, None]

    def run(i):
        barrier.wait()
        managers[i].save(7, args=ocp.args.StandardSave(states[i]))
        try:
            managers[i].wait_until_finished()
        except SaveFailedError as e:
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    losers = [i for i in range(2) if errors[i] is not None]
    assert len(losers) == 1
    assert isinstance(errors[losers[0]].__cause__, StepAlreadyExistsError)
    winner = 1 - losers[0]
    assert manifests(gcs, url, 7) == ["manifest.0-of-1.json"]
    for m in managers:
        m.close()
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as g:
        assert_equal(g.restore(7), states[winner])
        keys = set(g.catalog.viable()[7].manifest.objects())
    st = GcsStorage(url, endpoint=gcs.endpoint)
    # the loser cleaned up; the winner's claim stays with the step
    assert set(st.list("7")) == keys | {"manifest.0-of-1.json", "claim.0-of-1.json"}


def test_retention_deletes_manifest_first_and_orphans_are_collected(gcs, url, mesh):
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint, keep=2)) as m:
        for s in range(4):
            m.save(s, args=ocp.args.StandardSave(make_state(mesh, s)))
            # Each in turn: saved back to back, a GCS-only manager drops queued
            # writes (superseded) rather than make save() wait for GCS.
            m.wait_until_finished()
        assert m.all_steps() == [2, 3]
    st = GcsStorage(url, endpoint=gcs.endpoint)
    assert st.list("") == ["2", "3"]
    # A deletion that died after the manifest: the step is gone for readers...
    st.delete("2/manifest.0-of-1.json")
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as m:
        assert m.all_steps() == [3]
    assert len(st.list("2")) > 0  # ...its young chunks are left (a live writer's, maybe)
    naming = layout.StepNaming()
    assert cleanup.collect_orphans(st, naming, min_age_s=3600) == []
    removed = cleanup.collect_orphans(st, naming, min_age_s=0)
    assert removed and st.list("") == ["3"]


def test_a_damaged_gcs_step_is_skipped_on_read(gcs, url, mesh):
    states = [make_state(mesh, s) for s in range(2)]
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as m:
        for s, state in enumerate(states):
            m.save(s, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        key = next(c.object for _, _, c in m.catalog.viable()[1].manifest.chunks())
    st = GcsStorage(url, endpoint=gcs.endpoint)
    st.put(f"1/{key}", memoryview(b"garbage"))  # wrong size: found when read
    with CheckpointManager(url, options=gcs_only(url, gcs.endpoint)) as m:
        assert m.latest_step() == 1  # presence comes from the manifest: no request per chunk
        assert_equal(m.restore(), states[0])  # step 1 fails its read; step 0 is whole
        assert m.last_restore.step == 0 and m.latest_step() == 0
