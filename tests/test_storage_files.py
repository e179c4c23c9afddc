"""Contract tests of FileStorage (the RAM and local tiers) and of cleanup."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from resilient_ckpt import StorageError, commit, layout
from resilient_ckpt.storage import FileStorage


@pytest.fixture(params=["local", "ram"])
def store(request, tmp_path):
    root = tmp_path if request.param == "local" else None
    if root is None:
        import tempfile
        root = tempfile.mkdtemp(dir="/dev/shm")
    s = FileStorage(str(root), request.param, fsync=request.param == "local")
    yield s
    if request.param == "ram":
        import shutil
        shutil.rmtree(root, ignore_errors=True)


def test_put_read_size_list_delete(store):
    data = np.arange(1000, dtype=np.uint8)
    store.put("5/a", memoryview(data))
    assert store.size("5/a") == 1000 and store.size("5/b") is None
    out = np.zeros(10, np.uint8)
    store.read_into("5/a", memoryview(out), offset=100)
    assert list(out) == list(range(100, 110))
    assert store.list("5") == ["a"] and "5" in store.list("")
    store.delete("5/a")
    store.delete("5/a")  # already gone is fine
    assert store.list("5") == []


def test_short_read_is_an_error(store):
    store.put("1/a", b"abc")
    with pytest.raises(StorageError, match="truncated"):
        store.read_into("1/a", memoryview(bytearray(5)))
    with pytest.raises(StorageError) as ei:
        store.read_into("1/missing", memoryview(bytearray(1)))
    assert isinstance(ei.value, OSError)


def test_put_if_absent_admits_exactly_one_of_racing_writers(store):
    wins = []
    barrier = threading.Barrier(8)

    def commit_it(i):
        barrier.wait()
        if store.put_if_absent("3/manifest.0-of-1.json", f"writer {i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=commit_it, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.read("3/manifest.0-of-1.json") == f"writer {wins[0]}".encode()
    assert [n for n in store.list("3") if ".tmp." in n] == []


def test_map_is_zero_copy_only_on_ram_and_never_sees_later_writes(store):
    store.put("2/a", b"x" * 8192)
    view = store.map("2/a", 8192)
    if store.kind != "ram":
        assert view is None
        return
    assert bytes(view[:4]) == b"xxxx"
    store.put("2/a", b"y" * 8192)  # replaced by rename: the mapping keeps old bytes
    store.delete("2/a")
    assert bytes(view[:4]) == b"xxxx"
    view[0] = 0  # writes are private to the mapping
    assert store.size("2/a") is None


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
