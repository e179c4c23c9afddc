"""The local tier maps its files copy-on-write instead of copying them into new
memory: outside a restore those the page cache holds whole (others are
read); within one, a step's packs whatever the cache holds of them, the
ranges handed out read ahead into the cache.

Real files on the test machine's disk, real CPU devices; the page cache is
emptied of a file with posix_fadvise(DONTNEED) (clean pages, not mapped).
"""
import gc
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
    LocalTier,
)
from resilient_ckpt.native.hostmem import cached
from resilient_ckpt.storage.files import FileStorage
from tests.support import packs


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path):
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


def mapped_file(addr):
    """The file the process maps at `addr`, or None (anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                name = fields[5].strip() if len(fields) > 5 else ""
                return name if name.startswith("/") and not name.startswith("/dev/zero") else None
    return None


def is_cached(path):
    """Whether any page of the file is in the page cache (a pack holds many
    chunks: one still cached would be mapped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return any(cached(fd, 4096, at) for at in range(0, os.fstat(fd).st_size, 4096))
    finally:
        os.close(fd)


def test_map_of_a_cached_object_is_a_private_view_and_an_evicted_one_is_read(tmp_path):
    st = FileStorage(str(tmp_path), "local", maps_cached=True)
    data = np.random.default_rng(0).integers(0, 255, 5 * 4096 + 7, dtype=np.uint8)
    st.put("1/a", data.data)
    st.put("1/b", data.data)
    path_a, path_b = tmp_path / "1" / "a", tmp_path / "1" / "b"
    read_all(path_a)
    assert st.resident("1/a", data.nbytes)
    view = st.map("1/a", data.nbytes)
    assert view is not None and np.array_equal(view, data)
    assert mapped_file(view.ctypes.data) == str(path_a)
    view[:10] = 0  # copy-on-write: the file keeps its bytes
    assert st.read("1/a") == data.tobytes()
    st.put("1/a", b"y" * data.nbytes)  # replaced, then deleted: the view keeps its bytes
    st.delete("1/a")
    assert np.array_equal(view[10:], data[10:]) and not view[:10].any()

    evict(path_b)
    if is_cached(path_b):
        pytest.skip("this file system keeps the file cached after POSIX_FADV_DONTNEED")
    assert not st.resident("1/b", data.nbytes)
    assert st.map("1/b", data.nbytes) is None  # read instead: no page-by-page faults
    assert not FileStorage(str(tmp_path), "local").resident("1/b", data.nbytes)
    read_all(path_b)
    assert FileStorage(str(tmp_path), "local").map("1/b", data.nbytes) is None  # not asked to


def _state(mesh, seed):
    r = np.random.default_rng(seed)
    return {"w": jax.device_put(r.standard_normal((512, 1024)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(r.standard_normal((4096,)).astype(np.float32),
                                NamedSharding(mesh, P("data")))}


def _abstract(state):
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()}


def _chunk_files(step_dir):
    return [os.path.join(step_dir, n) for n in os.listdir(step_dir)
            if not n.startswith(("manifest", "claim", "."))]


def _shard_files(out):
    return [mapped_file(s.data.unsafe_buffer_pointer())
            for v in out.values() for s in v.addressable_shards]


@pytest.mark.parametrize("map_cached", [True, False])
def test_a_local_restore_maps_the_packs_warm_or_cold(tmp_path, map_cached):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    state = _state(mesh, 1)
    want = {k: np.asarray(v) for k, v in state.items()}
    root = str(tmp_path / "ckpt")
    opts = CheckpointManagerOptions(tiers=[LocalTier(direct_io=False, map_cached=map_cached)])
    with CheckpointManager(root, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave(state))
    files = _chunk_files(os.path.join(root, "1"))
    for f in files:
        read_all(f)
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(_abstract(state)))
        assert m.last_restore.bytes_by_tier == {"local": sum(v.nbytes for v in want.values())}
    for k, v in want.items():
        assert np.array_equal(np.asarray(out[k]), v), k
    where = _shard_files(out)
    if map_cached:
        assert all(w is not None and w.startswith(os.path.join(root, "1")) for w in where), where
    else:
        assert where == [None] * len(where)
    del out
    gc.collect()  # the mappings go with the arrays; mapped pages stay cached

    for f in files:
        evict(f)
    if any(is_cached(f) for f in files):
        pytest.skip("this file system keeps files cached after POSIX_FADV_DONTNEED")
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(_abstract(state)))
    for k, v in want.items():
        assert np.array_equal(np.asarray(out[k]), v), k
    assert m.last_restore.bytes_by_tier == {"local": sum(v.nbytes for v in want.values())}
    # Mapped as when warm (the kernel read the packs into the page cache as
    # the restore asked for their ranges); without map_cached, read.
    cold = _shard_files(out)
    if map_cached:
        assert all(w is not None and w.startswith(os.path.join(root, "1")) for w in cold), cold
        assert all(is_cached(f) for f in files)
    else:
        assert cold == [None] * len(cold)


def test_a_cached_chunk_that_fails_its_checksum_is_not_restored(tmp_path):
    """The mapped copy is checked as a read one is: a flipped byte in a cached
    chunk file fails the restore of that step, naming the chunk."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    state = _state(mesh, 2)
    root = str(tmp_path / "ckpt")
    opts = CheckpointManagerOptions(tiers=[LocalTier(direct_io=False)])
    with CheckpointManager(root, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave(state))
    key = sorted(packs.places(os.path.join(root, "1")))[3]
    victim, at, _ = packs.places(os.path.join(root, "1"))[key]
    with open(victim, "r+b") as f:  # through the page cache: the cached copy is the bad one
        f.seek(at + 100)
        b = f.read(1)
        f.seek(at + 100)
        f.write(bytes([b[0] ^ 1]))
    for f in _chunk_files(os.path.join(root, "1")):
        read_all(f)
    assert is_cached(victim)
    with CheckpointManager(root, options=opts) as m:
        with pytest.raises(CorruptCheckpointError, match=key):
            m.restore(1, args=ocp.args.StandardRestore(_abstract(state)))
