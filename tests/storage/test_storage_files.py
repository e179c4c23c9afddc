"""FileStorage (the RAM and local tiers) under commit's cleanup and deletion.

What every backend promises (puts, reads, commits, listing, mappings) is in
test_storage_contract.py; here, what depends on files: dead writers' markers
and temporaries, the order a step is deleted in, and the local tier's
O_DIRECT writes (what they write, what they leave out of the page cache, and
the way back to buffered writes)."""
import concurrent.futures as cf
import ctypes
import errno
import mmap
import os
import pathlib
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

from resilient_ckpt.catalog import tier_steps
from resilient_ckpt.core import layout
from resilient_ckpt.errors import StorageError
from resilient_ckpt.native import hostmem
from resilient_ckpt.save import cleanup
from resilient_ckpt.storage import FileStorage, direct as direct_mod, durable, files as files_mod


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
    removed = cleanup.cleanup(s, naming)
    assert sorted(os.listdir(tmp_path)) == ["2", "3", "5", "6"]
    assert sorted(os.listdir(tmp_path / "6")) == ["_CHECKPOINT_METADATA", "default"]
    assert sorted(os.listdir(tmp_path / "3")) == ["0123abcd.c0.0.0", "manifest.0-of-1.json"]
    assert len(os.listdir(tmp_path / "2")) == 3
    assert "1" in removed and "4" in removed


def test_cleanup_removes_a_dead_writers_temporary_at_the_root(tmp_path):
    """A kill while the tiers record (or the root metadata) was written leaves
    its temporary at the tier's root, beside the step directories: removed
    when its writer is dead, kept when it is alive or not ours. (It stayed
    forever before: cleanup looked only into step directories.)"""
    s = FileStorage(str(tmp_path), "local")
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    me = layout.Writer.me()
    dead = layout.Writer(me.host, p.pid, me.start)
    dead_tmp, live_tmp = dead.tmp_name(".rc-tiers.json"), me.tmp_name(".rc-tiers.json")
    other = layout.Writer("otherhost", 1, 1).tmp_name("_CHECKPOINT_METADATA")
    for name in (dead_tmp, live_tmp, other, ".rc-tiers.json", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    s.put("3/0123abcd.c0.0.0", b"x")
    assert s.put_if_absent("3/manifest.0-of-1.json", b"{}")
    removed = cleanup.cleanup(s, layout.StepNaming())
    assert removed == [dead_tmp]
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["3", live_tmp, other, ".rc-tiers.json", "notes.txt"])


def test_delete_step_removes_manifest_first(tmp_path, monkeypatch):
    s = FileStorage(str(tmp_path), "local")
    s.put("7/abc.c0.0.0", b"x")
    s.put_if_absent("7/manifest.0-of-1.json", b"{}")
    order = []
    monkeypatch.setattr(s, "delete", lambda key: (order.append(key), os.unlink(tmp_path / key)))
    tier_steps.delete_step(s, layout.StepNaming(), 7)
    assert order == ["7/manifest.0-of-1.json"]
    assert not os.path.exists(tmp_path / "7")


def _aligned(nbytes: int) -> np.ndarray:
    """Random bytes at the start of a page (as a snapshot's chunks are)."""
    a = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    a[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    return a


def _cached_pages(path) -> int:
    """Pages of the file in the page cache (mincore of a mapping of it)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        addr = np.frombuffer(m, np.uint8).ctypes.data
        assert ctypes.CDLL(None).mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        return sum(v & 1 for v in vec)


@pytest.mark.parametrize("nbytes", [4 << 20, (3 << 20) + 123])  # whole blocks, a partial last one
def test_direct_writes_hold_the_exact_bytes_and_skip_the_page_cache(tmp_path, nbytes):
    data = _aligned(nbytes)
    direct = FileStorage(str(tmp_path / "direct"), "local", direct=True)
    cached = FileStorage(str(tmp_path / "cached"), "local", direct=False)
    for s in (direct, cached):
        s.put("1/chunk", data.data)
        assert s.size("1/chunk") == nbytes
        assert s.read("1/chunk") == data.tobytes()
    assert direct._direct  # /tmp takes O_DIRECT: the write did not fall back
    # read() above goes through the cache; look before it, on a fresh object
    direct.put("2/chunk", data.data)
    cached.put("2/chunk", data.data)
    assert _cached_pages(tmp_path / "direct" / "2" / "chunk") == 0
    assert _cached_pages(tmp_path / "cached" / "2" / "chunk") > 0


@pytest.mark.parametrize("nbytes", [(2 << 20) + 1, (17 << 20) + 4096 + 3])  # 1 and 3 stages
def test_unaligned_objects_go_past_the_cache_through_a_stage_and_small_ones_through_it(
        tmp_path, nbytes):
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned(nbytes + 64)
    data[:] = np.random.default_rng(nbytes).integers(0, 256, data.size, dtype=np.uint8)
    s.put("1/odd", data[64:].data)  # 64 bytes into a page, as a jax CPU buffer starts
    s.put("1/small", b"manifest bytes")
    assert _cached_pages(tmp_path / "1" / "odd") == 0 and s._direct
    assert _cached_pages(tmp_path / "1" / "small") > 0
    assert s.read("1/odd") == data[64:].tobytes() and s.read("1/small") == b"manifest bytes"
    assert s.size("1/odd") == nbytes


@pytest.mark.parametrize("nbytes", [4 << 20, (3 << 20) + 123])  # whole blocks, a partial last one
def test_uncached_objects_are_read_past_the_cache_into_aligned_buffers(tmp_path, nbytes):
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned(nbytes)
    s.put("1/chunk", data.data)  # written with O_DIRECT: nothing of it cached
    path = tmp_path / "1" / "chunk"
    out = hostmem.host_buffer(nbytes)
    s.read_into("1/chunk", out.data)
    assert (out == data).all() and s._direct
    # only the partial last block, if any, went through the cache
    assert _cached_pages(path) == (1 if nbytes % 4096 else 0)
    # an unaligned buffer, or a storage without `direct`, reads through it
    odd = hostmem.host_buffer(nbytes + 64)[64:]
    s.read_into("1/chunk", odd.data)
    assert (odd == data).all() and _cached_pages(path) == -(-nbytes // 4096)


def test_a_ranged_read_of_an_uncached_object_at_a_block_offset_goes_past_the_cache(tmp_path):
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned(8 << 20)
    s.put("1/chunk", data.data)
    out = hostmem.host_buffer(2 << 20)
    s.read_into("1/chunk", out.data, 4 << 20)
    assert (out == data[4 << 20:6 << 20]).all()
    assert _cached_pages(tmp_path / "1" / "chunk") == 0


def test_residency_is_asked_of_the_range_read_not_of_the_file_before_it(tmp_path):
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned(8 << 20)
    s.put("1/chunk", data.data)  # nothing of it cached
    tail = hostmem.host_buffer((2 << 20) + 64)[64:]  # unaligned: read through the cache
    s.read_into("1/chunk", tail.data, 6 << 20)
    assert (tail == data[6 << 20:]).all()
    fd = os.open(tmp_path / "1" / "chunk", os.O_RDONLY)
    try:
        assert hostmem.cached(fd, 2 << 20, 6 << 20)
        assert hostmem.cached(fd, 1000, (6 << 20) + 100)  # off a page boundary
        assert not hostmem.cached(fd, 8 << 20) and not hostmem.cached(fd, 4096, 4096)
    finally:
        os.close(fd)
    out = hostmem.host_buffer(2 << 20)  # aligned: the cached range is read from the cache
    s.read_into("1/chunk", out.data, 6 << 20)
    assert (out == data[6 << 20:]).all()
    assert _cached_pages(tmp_path / "1" / "chunk") == 512  # the tail's pages only


def test_a_refused_direct_read_is_read_through_the_cache(tmp_path, monkeypatch):
    # A mock: every file system here takes O_DIRECT, so its refusal (EINVAL
    # when the flag is set on the descriptor) cannot be caused otherwise.
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned(3 << 20)
    s.put("1/chunk", data.data)
    real_fcntl = direct_mod.fcntl.fcntl

    def fcntl(fd, cmd, arg=0):
        if cmd == direct_mod.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(direct_mod.fcntl, "fcntl", fcntl)
    out = hostmem.host_buffer(3 << 20)
    s.read_into("1/chunk", out.data)
    assert (out == data).all()
    assert not s._direct  # not tried again on this storage
    assert _cached_pages(tmp_path / "1" / "chunk") > 0


@pytest.mark.parametrize("refused", ["open", "write"])
def test_a_refused_direct_write_is_written_through_the_cache(tmp_path, monkeypatch, refused):
    # A mock: every file system here takes O_DIRECT, so its refusal (EINVAL at
    # open, as FUSE or old tmpfs do, or at a write, for a stricter alignment)
    # cannot be caused otherwise.
    real_open, real_pwrite = os.open, os.pwrite

    def open_(path, flags, *a, **kw):
        if refused == "open" and flags & os.O_DIRECT:
            os.close(real_open(path, flags & ~os.O_DIRECT, *a, **kw))  # created, then refused
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    def pwrite(fd, data, pos):
        if refused == "write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(files_mod.os, "open", open_)
    monkeypatch.setattr(direct_mod.os, "pwrite", pwrite)
    s = FileStorage(str(tmp_path), "local", direct=True)
    data = _aligned((3 << 20) + 5)
    s.put("1/chunk", data.data)
    assert not s._direct  # not tried again on this storage
    monkeypatch.undo()
    assert s.read("1/chunk") == data.tobytes()
    assert os.listdir(tmp_path / "1") == ["chunk"]  # no temporary left behind


# ------------------------------------------------------------ durability of a save's chunks


def _count_syncs(monkeypatch):
    """Counts fsync and syncfs calls while still making them (a spy, not a
    mock: which call made a file durable cannot be observed otherwise, short
    of cutting the power)."""
    calls = {"fsync": 0, "syncfs": 0}
    real_fsync, real_syncfs = os.fsync, durable.syncfs

    def fsync(fd):
        calls["fsync"] += 1
        return real_fsync(fd)

    def syncfs(fd):
        calls["syncfs"] += 1
        return real_syncfs(fd)

    monkeypatch.setattr(files_mod.os, "fsync", fsync)
    if real_syncfs is not None:
        monkeypatch.setattr(durable, "syncfs", syncfs)
    return calls


def _fds_under(path) -> list[str]:
    """What this process's open descriptors under `path` point at (counting
    them all instead failed when another test's leftover thread closed one)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own, say)
        if target == str(path) or target.startswith(f"{path}/"):
            out.append(target)
    return out


def _fs_type(path) -> str | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return durable.fs_type(fd)
    finally:
        os.close(fd)


@pytest.mark.skipif(durable.syncfs is None, reason="no syncfs that reports write-back "
                                                      "errors here (Linux 5.8 on)")
def test_a_saves_chunks_are_made_durable_by_one_syncfs_at_its_flush(tmp_path, monkeypatch):
    if _fs_type(tmp_path) not in durable.SYNCFS_TYPES:
        pytest.skip(f"{tmp_path} is on {_fs_type(tmp_path)}, where chunks are fsynced")
    s = FileStorage(str(tmp_path), "local", direct=True)
    calls = _count_syncs(monkeypatch)
    assert _fds_under(tmp_path) == []
    data = [_aligned(1 << 20), _aligned(5000)]  # an O_DIRECT chunk and a buffered one
    s.begin_write("4")
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: s.put(f"4/c{i}", data[i % 2].data), range(12)))
    assert _fds_under(tmp_path) == [str(tmp_path / "4")]  # the step's, held for its puts
    s.put("root-object", b"x")  # outside the step being written: fsynced as ever
    assert calls == {"fsync": 1, "syncfs": 0}
    s.flush("4")
    assert calls == {"fsync": 1, "syncfs": 1}
    assert s.put_if_absent("4/manifest", b"{}")  # the commit: its file and directory
    assert calls == {"fsync": 3, "syncfs": 1}
    s.put("4/late", b"y")  # after the flush: fsynced again
    assert calls == {"fsync": 4, "syncfs": 1}
    s.end_write("4")
    assert _fds_under(tmp_path) == []  # the step's descriptor was closed
    assert all(s.read(f"4/c{i}") == data[i % 2].tobytes() for i in range(12))
    s.flush("4")  # a delete's flush: the directory, as before
    assert calls == {"fsync": 5, "syncfs": 1}


@pytest.mark.skipif(durable.syncfs is None, reason="no syncfs that reports write-back "
                                                    "errors here (Linux 5.8 on)")
def test_a_large_save_is_synced_every_few_mib_while_it_writes(tmp_path, monkeypatch):
    if _fs_type(tmp_path) not in durable.SYNCFS_TYPES:
        pytest.skip(f"{tmp_path} is on {_fs_type(tmp_path)}, where chunks are fsynced")
    monkeypatch.setattr(durable, "SYNC_EVERY", 4 << 20)
    s = FileStorage(str(tmp_path), "local", direct=True)
    calls = _count_syncs(monkeypatch)
    data = _aligned(1 << 20)
    s.begin_write("4")
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: s.put(f"4/c{i}", data.data), range(24)))
    during = calls["syncfs"]
    # 24 MiB in steps of 4 MiB: up to 6 syncs, fewer when one was still running
    # as the next 4 MiB arrived (the others do not wait for it)
    assert 1 <= during <= 6 and calls["fsync"] == 0, calls
    s.flush("4")
    assert calls == {"fsync": 0, "syncfs": during + 1}
    s.end_write("4")
    assert all(s.read(f"4/c{i}") == data.tobytes() for i in range(24))


def test_a_failed_save_closes_its_descriptor_and_the_next_puts_are_fsynced(tmp_path,
                                                                           monkeypatch):
    s = FileStorage(str(tmp_path), "local")
    calls = _count_syncs(monkeypatch)
    s.begin_write("5")
    s.put("5/c0", b"x")
    assert _fds_under(tmp_path) == [str(tmp_path / "5")]
    s.end_write("5")  # the save failed before its flush
    assert _fds_under(tmp_path) == []
    before = calls["fsync"]
    s.put("5/c1", b"x")
    assert calls["fsync"] == before + 1 and calls["syncfs"] == 0


def test_without_syncfs_every_chunk_is_fsynced(tmp_path, monkeypatch):
    # As on kernels before 5.8, or off Linux: the loader found no syncfs to trust.
    monkeypatch.setattr(durable, "syncfs", None)
    s = FileStorage(str(tmp_path), "local")
    calls = _count_syncs(monkeypatch)
    s.begin_write("6")
    for i in range(5):
        s.put(f"6/c{i}", b"x")
    assert calls["fsync"] == 5
    s.flush("6")
    assert calls["fsync"] == 6  # the directory
    s.end_write("6")


def test_a_tier_without_fsync_neither_fsyncs_nor_syncs_the_file_system(tmp_path, monkeypatch):
    s = FileStorage(str(tmp_path), "ram", fsync=False)
    calls = _count_syncs(monkeypatch)
    s.begin_write("7")
    s.put("7/c0", b"x")
    s.flush("7")
    assert s.put_if_absent("7/manifest", b"{}")
    s.end_write("7")
    assert calls == {"fsync": 0, "syncfs": 0}


def test_a_tier_on_a_file_system_off_the_list_fsyncs_every_chunk(monkeypatch):
    # /dev/shm is tmpfs: not a block-device file system whose syncfs is known
    # to reach the device, so even with fsync on, chunks are fsynced one by one.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        assert _fs_type(root) == "tmpfs"
        s = FileStorage(root, "local")
        calls = _count_syncs(monkeypatch)
        s.begin_write("8")
        for i in range(4):
            s.put(f"8/0123abcd.c0.1.{i}", b"x")  # chunks, written in place
        s.flush("8")
        s.end_write("8")
        assert calls == {"fsync": 5, "syncfs": 0}  # each chunk, then the directory


# ------------------------------------------------------------ a save's chunks written in place

_CHUNK = "0123abcd.c0.1.{}"  # a chunk's name: it carries its save's id


@pytest.fixture(params=["syncfs", "fsync", "ram"])
def saving(request, tmp_path):
    """A root and FileStorage options for each way a save syncs its chunks:
    with syncfs (a disk file system), an fsync each (one off syncfs's list:
    tmpfs with fsync on), or not at all (the RAM tier)."""
    if request.param == "syncfs":
        if durable.syncfs is None or _fs_type(tmp_path) not in durable.SYNCFS_TYPES:
            pytest.skip(f"{tmp_path} is on {_fs_type(tmp_path)} or has no syncfs")
        yield tmp_path, {"direct": True}
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        yield pathlib.Path(root), {"fsync": request.param == "fsync"}


def _count_renames(monkeypatch) -> list:
    """A spy on the renames FileStorage makes (whether a chunk was renamed into
    place leaves no trace in the directory)."""
    seen, real = [], os.replace

    def replace(src, dst, **kw):
        seen.append(dst)
        return real(src, dst, **kw)
    monkeypatch.setattr(files_mod.os, "replace", replace)
    return seen


def test_a_saves_new_chunks_are_written_under_their_names(saving, monkeypatch):
    tmp_path, options = saving
    s = FileStorage(str(tmp_path), "local", **options)
    renames = _count_renames(monkeypatch)
    data = [_aligned(1 << 20), _aligned(5000)]  # an O_DIRECT chunk and a buffered one
    s.begin_write("4")
    with cf.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda i: s.put(f"4/{_CHUNK.format(i)}", data[i % 2].data), range(8)))
    assert renames == []
    s.put("4/other", b"x")  # not a chunk's name: renamed into place, as ever
    assert renames == ["other"]
    s.flush("4")
    assert s.put_if_absent("4/manifest.0-of-1.json", b"{}")
    s.end_write("4")
    assert all(s.read(f"4/{_CHUNK.format(i)}") == data[i % 2].tobytes() for i in range(8))
    assert sorted(os.listdir(tmp_path / "4")) == sorted(
        [_CHUNK.format(i) for i in range(8)] + ["other", "manifest.0-of-1.json"])


def test_a_chunk_already_there_is_replaced_whole(saving, monkeypatch):
    # A copy of the same save resumed: the name may be a committed chunk that
    # a reader has open, so it is replaced by a rename, never rewritten in place.
    tmp_path, options = saving
    s = FileStorage(str(tmp_path), "local", **options)
    key = f"5/{_CHUNK.format(0)}"
    s.put(key, b"old" * 1000)
    with open(tmp_path / key, "rb") as reader:
        renames = _count_renames(monkeypatch)
        s.begin_write("5")
        s.put(key, b"new" * 2000)
        s.flush("5")
        s.end_write("5")
        assert renames == [_CHUNK.format(0)]
        assert reader.read() == b"old" * 1000  # the open copy is untouched
    assert s.read(key) == b"new" * 2000
    assert os.listdir(tmp_path / "5") == [_CHUNK.format(0)]  # no temporary left


def test_a_failed_chunk_write_leaves_nothing_under_its_name(saving):
    import resource
    import signal
    tmp_path, options = saving
    s = FileStorage(str(tmp_path), "local", **options)
    s.begin_write("6")
    s.put(f"6/{_CHUNK.format(0)}", b"x" * 1000)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # a file of at most 64 KiB
    try:
        with pytest.raises(OSError) as ei:
            s.put(f"6/{_CHUNK.format(1)}", b"y" * (256 << 10))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ei.value.errno == errno.EFBIG and f"6/{_CHUNK.format(1)}" in str(ei.value)
    s.end_write("6")
    assert os.listdir(tmp_path / "6") == [_CHUNK.format(0)]  # the torn one was removed


def test_a_step_directory_removed_under_a_save_fails_its_next_chunk(saving):
    # Chunks go through the directory the save opened: one removed meanwhile (a
    # user's rm -rf, another cleaner) fails the save instead of being made again
    # with only the chunks written after.
    tmp_path, options = saving
    s = FileStorage(str(tmp_path), "local", **options)
    s.begin_write("7")
    s.put(f"7/{_CHUNK.format(0)}", b"x")
    for n in os.listdir(tmp_path / "7"):
        os.unlink(tmp_path / "7" / n)
    os.rmdir(tmp_path / "7")
    with pytest.raises(OSError) as ei:
        s.put(f"7/{_CHUNK.format(1)}", b"x")
    assert ei.value.errno == errno.ENOENT and str(tmp_path / "7") in str(ei.value)
    assert not (tmp_path / "7").exists()
    s.end_write("7")


def test_reads_under_a_held_step_directory_skip_the_walk_and_still_refuse_links(tmp_path,
                                                                                monkeypatch):
    # A restore holds its step's directory open (ChunkReader): each chunk is
    # opened relative to it, with the same refusals as a walked open.
    s = FileStorage(str(tmp_path), "ram", fsync=False, zero_copy=True)
    s.put("1/a", memoryview(b"abcdefgh"))
    (tmp_path / "outside").write_bytes(b"secret!!")
    os.symlink(tmp_path / "outside", tmp_path / "1" / "link")
    fds = len(os.listdir("/proc/self/fd"))
    walks = []
    real = files_mod._Walker._open_dir
    monkeypatch.setattr(files_mod._Walker, "_open_dir",
                        lambda self, parts, create=False: walks.append(parts) or
                        real(self, parts, create))
    with s.holding("1"), s.holding("1"), s.holding("9"):  # nested; 9 is not there
        walks.clear()
        assert s.read("1/a") == b"abcdefgh"
        assert bytes(s.map("1/a", 8)) == b"abcdefgh"
        buf = bytearray(3)
        s.read_into("1/a", memoryview(buf), 2)
        assert bytes(buf) == b"cde" and walks == []
        with pytest.raises(StorageError) as ei:
            s.read("1/link")
        assert ei.value.errno == errno.ELOOP and "1/link" in str(ei.value)
        with pytest.raises(StorageError) as ei:
            s.read("9/x")
        assert "9/x" in str(ei.value)
    assert len(os.listdir("/proc/self/fd")) == fds  # every held descriptor closed
    assert s._held == {}
    walks.clear()
    assert s.read("1/a") == b"abcdefgh" and walks == [["1"]]  # walked again


def _readahead_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "rc-readahead"]


def test_a_held_disk_object_is_mapped_once_and_only_the_ranges_asked_for_are_read_ahead(
        tmp_path, monkeypatch):
    # On a disk tier that maps what the page cache holds, a held step's pack
    # is opened and mapped once, cached or not (its chunks are views of it).
    # Of one the cache did not hold whole, each range handed out is read
    # ahead, the window of COLD_WINDOW bytes holding it and no other (a
    # resharded restore that needs part of a pack reads only that part),
    # on a thread that ends once nothing more is asked; unheld, a cold
    # object is not mapped (it is read).
    s = FileStorage(str(tmp_path), "local", direct=True, maps_cached=True)
    page, w = 1 << 20, files_mod.COLD_WINDOW
    data = _aligned(4 * w)
    s.put("1/cold", data.data)  # written past the cache: nothing of it cached
    s.put("1/warm", data[:4 * page].data)
    (tmp_path / "1" / "warm").read_bytes()  # now cached whole
    fd = os.open(tmp_path / "1" / "cold", os.O_RDONLY)

    def cached(nbytes, at):
        return hostmem.cached(fd, nbytes, at)
    if any(cached(page, at) for at in range(0, 4 * w, page)):
        pytest.skip("this file system caches what O_DIRECT wrote")
    opens = []
    real = files_mod._Walker._open_in
    monkeypatch.setattr(files_mod._Walker, "_open_in",
                        lambda self, dirs, name: opens.append(name) or real(self, dirs, name))
    try:
        with s.holding("1"):
            assert all(s.resident("1/warm", page, i * page) for i in range(4))
            views = [s.map("1/warm", page, i * page) for i in range(4)]
            assert opens == ["warm"]  # four chunks: one open, one question, one mapping
            assert all((v == data[i * page:(i + 1) * page]).all() for i, v in enumerate(views))
            assert len({id(v.base) for v in views}) == 1
            assert s.map("1/warm", 2 * page, 3 * page) is None  # runs past its end
            assert _readahead_threads() == []  # nothing to read ahead of a cached pack

            assert s.resident("1/cold", page, 2 * w + page)
            chunk = s.map("1/cold", page, 2 * w + page)
            more = s.map("1/cold", 2 * page, 2 * w + 4 * page)  # the same window: asked once
            assert chunk is not None and more is not None and chunk.base is more.base
            assert opens == ["warm", "cold"]
            for t in _readahead_threads():
                t.join(10)  # it ends by itself once idle
            assert _readahead_threads() == []
            assert cached(w, 2 * w)  # its window read ahead, before any byte of it was used
            assert not any(cached(page, at) for at in (0, w, 3 * w, 4 * w - page))
            assert (chunk == data[2 * w + page:2 * w + 2 * page]).all()
            assert (more == data[2 * w + 4 * page:2 * w + 6 * page]).all()
            assert s.map("1/cold", 2 * page, 4 * w - page) is None  # runs past its end
        assert s._whole == {} and s._mapped == {} and s._cold == {}
        assert not s.resident("1/cold", page) and s.map("1/cold", page) is None  # unheld
        assert s.resident("1/cold", page, 2 * w)  # (cached now: mapped, as any cached range)
    finally:
        os.close(fd)


def test_a_held_steps_objects_are_mapped_once_and_keep_the_bytes_they_were_opened_on(
        tmp_path, monkeypatch):
    # On a zero-copy tier, while a restore holds a step, each object (a pack of
    # thousands of chunks) is mapped once and its chunks are views of that
    # mapping: one open per object, not per chunk, with the same refusals,
    # and the views outlive the hold, a replacement and a delete alike.
    s = FileStorage(str(tmp_path), "ram", fsync=False, zero_copy=True)
    page = mmap.ALLOCATIONGRANULARITY
    s.put("1/pack", memoryview(bytes(range(256)) * (3 * page // 256)))
    s.put("1/empty", memoryview(b""))
    (tmp_path / "outside").write_bytes(b"x" * page)
    os.symlink(tmp_path / "outside", tmp_path / "1" / "link")
    os.mkfifo(tmp_path / "1" / "fifo")
    opens = []
    real = files_mod._Walker._open_in
    monkeypatch.setattr(files_mod._Walker, "_open_in",
                        lambda self, dirs, name: opens.append(name) or real(self, dirs, name))
    with s.holding("1"):
        views = [s.map("1/pack", page, i * page) for i in range(3)]
        assert opens == ["pack"]  # three chunks, one open and one mapping
        assert [bytes(v[:4]) for v in views] == [bytes(range(4))] * 3
        assert s.map("1/pack", 2 * page, 2 * page) is None  # runs past the end: no copy
        assert s.map("1/empty", page) is None
        for key, why in (("1/link", "symbolic link"), ("1/fifo", "not a regular file")):
            with pytest.raises(StorageError, match=why):
                s.map(key, page)
        os.replace(tmp_path / "1" / "pack", tmp_path / "1" / "old")
        s.put("1/pack", memoryview(b"\xff" * 3 * page))  # replaced by rename meanwhile
        assert bytes(s.map("1/pack", 4)) == bytes(range(4))  # the bytes it was opened on
        views[0][0] = 99  # copy-on-write: the view's own writes reach no file
    assert (tmp_path / "1" / "old").read_bytes()[0] == 0
    assert s._whole == {} and s._mapped == {}  # dropped with the hold
    os.remove(tmp_path / "1" / "old")
    assert bytes(views[1][:4]) == bytes(range(4))  # a deleted object's view lives on
    assert bytes(s.map("1/pack", 4)) == b"\xff" * 4  # unheld: mapped afresh, the new bytes
