"""The catalog's view of a step this process just committed: built from the
manifest it wrote (not read back, its chunks not asked one by one), the same
as what a later reload reads from the directory; other processes' manifests
there are still read. A committed write's phases add up to its seconds. And
the runs the chunk jobs go to the I/O pool in."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import orbax.checkpoint as ocp
import pytest
from hypothesis import given, strategies as st

import resilient_ckpt as rc
from resilient_ckpt.catalog import tier_steps
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.errors import CorruptCheckpointError
from resilient_ckpt.save import commit
from resilient_ckpt.storage.files import FileStorage
from tests.support.corruption import device_state


def _manager(tmp_path):
    return rc.CheckpointManager(str(tmp_path / "ckpt"), options=rc.CheckpointManagerOptions(
        tiers=[rc.RamTier(every=1, keep=2, path=str(tmp_path / "ram")),
               rc.LocalTier(every=1, keep=2)]))


def test_a_saves_view_is_the_one_a_reload_reads(tmp_path, monkeypatch):
    reads = []
    real_read = FileStorage.read

    def read(self, key, max_bytes=None):  # a spy: the real read, recorded
        reads.append(key)
        return real_read(self, key, max_bytes)
    monkeypatch.setattr(FileStorage, "read", read)
    with _manager(tmp_path) as m:
        assert m.save(1, args=ocp.args.StandardSave(device_state(1)))
        m.wait_until_finished()
        assert not [k for k in reads if layout.parse_manifest_name(k.rpartition("/")[2])], \
            f"a save read its own manifest back: {reads}"
        for tier, st in m.catalog.storages().items():
            view = m.catalog.view(tier)[1]
            fresh = tier_steps.observe_step(st, tier, layout.StepNaming(), 1)
            assert fresh is not None and view.manifests == fresh.manifests, tier
            assert view.sizes == fresh.sizes, tier
            tw = m.save_records[-1].tiers[tier]
            assert tw.ok and set(tw.phases) == {"chunks", "flush", "manifest", "observe"}
            assert sum(tw.phases.values()) == pytest.approx(tw.seconds, abs=1e-6)


def test_other_processes_manifests_are_still_read(tmp_path):
    with _manager(tmp_path) as m:
        assert m.save(1, args=ocp.args.StandardSave(device_state(1)))
        m.wait_until_finished()
        (mine,) = m.catalog.view("local")[1].manifests
        assert isinstance(mine, mf.Manifest)
        st = m.catalog.storages()["local"]
    step_dir = tmp_path / "ckpt" / "1"
    (step_dir / layout.manifest_name(1, 2)).write_bytes(b"not a manifest")
    seen = tier_steps.observe_step(st, "local", layout.StepNaming(), 1, known=mine)
    assert seen is not None and len(seen.manifests) == 2
    assert seen.manifests[0] is mine  # taken as it is
    assert isinstance(seen.manifests[1], CorruptCheckpointError)
    assert layout.manifest_name(1, 2) in str(seen.manifests[1])
    assert seen.sizes == {c.key: c.stored_nbytes for _, _, c in mine.chunks()}


@given(st.lists(st.integers(0, 3 * commit.GROUP_BYTES), max_size=3000))
def test_chunk_jobs_go_in_order_in_bounded_runs(sizes):
    jobs = [(None, i, n) for i, n in enumerate(sizes)]
    runs = commit._groups(jobs)
    assert [arg for run in runs for _, arg in run] == list(range(len(sizes)))  # each once
    assert all(run for run in runs)
    if len(sizes) >= commit.MIN_GROUPS:  # every pool thread has work
        assert len(runs) >= commit.MIN_GROUPS
    for run in runs:
        if len(run) > 1:
            assert sum(sizes[arg] for _, arg in run) <= commit.GROUP_BYTES


def test_a_failing_chunk_fails_its_save_and_leaves_nothing(tmp_path, monkeypatch):
    """320 chunks (40 leaves in 8 pieces), written as a pack; its put fails
    (a wrapper that raises for it: one failing file is not otherwise caused
    here): the save fails, nothing of it stays, and the next save commits."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("x",))
    state = {f"l{i}": jax.device_put(np.full((8, 4), i, np.float32), NamedSharding(mesh, P("x")))
             for i in range(40)}  # 320 chunks
    real_put = FileStorage.put_parts
    seen = []

    def put(self, key, parts, size):
        if layout.is_chunk_name(key.rpartition("/")[2]):
            seen.append(key)
        if len(seen) == 1:
            raise OSError(5, "injected write error")
        return real_put(self, key, parts, size)
    with rc.CheckpointManager(str(tmp_path / "ckpt"), options=rc.CheckpointManagerOptions(
            tiers=[rc.LocalTier(every=1, keep=2)])) as m:
        monkeypatch.setattr(FileStorage, "put_parts", put)
        with pytest.raises(rc.SaveFailedError):
            m.save(1, args=ocp.args.StandardSave(state))
            m.wait_until_finished()
        monkeypatch.setattr(FileStorage, "put_parts", real_put)
        d = tmp_path / "ckpt" / "1"
        left = [n for n in (os.listdir(d) if d.exists() else []) if layout.is_chunk_name(n)]
        assert left == [] and m.all_steps() == []
        assert m.save(2, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert m.all_steps() == [2]
