"""The catalog's view of a step this process just committed: built from the
manifest it wrote (not read back, its chunks not asked one by one), the same
as what a later reload reads from the directory; other processes' manifests
there are still read. And a committed write's phases add up to its seconds."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest
from test_corruption import device_state

import resilient_ckpt as rc
from resilient_ckpt import commit, layout, manifest as mf
from resilient_ckpt.errors import CorruptCheckpointError
from resilient_ckpt.storage.files import FileStorage


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
        import orbax.checkpoint as ocp
        assert m.save(1, args=ocp.args.StandardSave(device_state(1)))
        m.wait_until_finished()
        assert not [k for k in reads if layout.parse_manifest_name(k.rpartition("/")[2])], \
            f"a save read its own manifest back: {reads}"
        for tier, st in m.catalog.storages().items():
            view = m.catalog.view(tier)[1]
            fresh = commit.observe_step(st, tier, layout.StepNaming(), 1)
            assert fresh is not None and view.manifests == fresh.manifests, tier
            assert view.sizes == fresh.sizes, tier
            tw = m.save_records[-1].tiers[tier]
            assert tw.ok and set(tw.phases) == {"chunks", "flush", "manifest", "observe"}
            assert sum(tw.phases.values()) == pytest.approx(tw.seconds, abs=1e-6)


def test_other_processes_manifests_are_still_read(tmp_path):
    with _manager(tmp_path) as m:
        import orbax.checkpoint as ocp
        assert m.save(1, args=ocp.args.StandardSave(device_state(1)))
        m.wait_until_finished()
        (mine,) = m.catalog.view("local")[1].manifests
        st = m.catalog.storages()["local"]
    step_dir = tmp_path / "ckpt" / "1"
    (step_dir / layout.manifest_name(1, 2)).write_bytes(b"not a manifest")
    seen = commit.observe_step(st, "local", layout.StepNaming(), 1, known=mine)
    assert seen is not None and len(seen.manifests) == 2
    assert seen.manifests[0] is mine  # taken as it is
    assert isinstance(seen.manifests[1], CorruptCheckpointError)
    assert layout.manifest_name(1, 2) in str(seen.manifests[1])
    assert seen.sizes == {c.key: c.stored_nbytes for _, _, c in mine.chunks()}
    assert isinstance(mine, mf.Manifest)
