"""FileStorage (the RAM and local tiers) under commit's cleanup and deletion.

What every backend promises (puts, reads, commits, listing, mappings) is in
test_storage_contract.py; here, what depends on files: dead writers' markers
and temporaries, and the order a step is deleted in."""
import os
import subprocess
import sys

from resilient_ckpt import commit, layout
from resilient_ckpt.storage import FileStorage


def test_cleanup_removes_dead_leftovers_and_spares_live_and_committed(tmp_path):
    s = FileStorage(str(tmp_path), "local")
    naming = layout.StepNaming()
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    me = layout.Writer.me()
    dead = layout.Writer(me.host, p.pid, me.start)
    # a dead writer's half-written step: marker, a chunk, a temporary
    os.makedirs(tmp_path / "1")
    (tmp_path / "1" / dead.marker_name()).touch()
    (tmp_path / "1" / "0123abcd.c0.0.0").write_bytes(b"x")
    (tmp_path / "1" / dead.tmp_name("0123abcd.c0.1.0")).write_bytes(b"x")
    # a live save in progress (ours)
    s.begin_write("2")
    s.put("2/0123abcd.c0.0.0", b"x")
    (tmp_path / "2" / me.tmp_name("0123abcd.c0.1.0")).write_bytes(b"x")
    # a committed step with a dead temporary beside it
    s.put("3/0123abcd.c0.0.0", b"x")
    assert s.put_if_absent("3/manifest.0-of-1.json", b"{}")
    (tmp_path / "3" / dead.tmp_name("0123abcd.c0.0.0")).write_bytes(b"x")
    # a step whose manifest was deleted but chunks remain (crash mid-delete)
    s.put("4/0123abcd.c0.0.0", b"x")
    # another host's save in progress: not ours to judge
    os.makedirs(tmp_path / "5")
    (tmp_path / "5" / layout.Writer("otherhost", 1, 1).marker_name()).touch()
    # an Orbax checkpoint (no manifest of ours): never touched
    os.makedirs(tmp_path / "6" / "default")
    (tmp_path / "6" / "_CHECKPOINT_METADATA").write_text("{}")
    (tmp_path / "6" / "default" / "ocdbt.process_0").write_text("x")
    removed = commit.cleanup(s, naming)
    assert sorted(os.listdir(tmp_path)) == ["2", "3", "5", "6"]
    assert sorted(os.listdir(tmp_path / "6")) == ["_CHECKPOINT_METADATA", "default"]
    assert sorted(os.listdir(tmp_path / "3")) == ["0123abcd.c0.0.0", "manifest.0-of-1.json"]
    assert len(os.listdir(tmp_path / "2")) == 3
    assert "1" in removed and "4" in removed


def test_delete_step_removes_manifest_first(tmp_path, monkeypatch):
    s = FileStorage(str(tmp_path), "local")
    s.put("7/abc.c0.0.0", b"x")
    s.put_if_absent("7/manifest.0-of-1.json", b"{}")
    order = []
    monkeypatch.setattr(s, "delete", lambda key: (order.append(key), os.unlink(tmp_path / key)))
    commit.delete_step(s, layout.StepNaming(), 7)
    assert order == ["7/manifest.0-of-1.json"]
    assert not os.path.exists(tmp_path / "7")
