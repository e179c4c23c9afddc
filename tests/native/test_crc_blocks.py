"""Checking runs of checksum blocks in one pass (crc32c.combine, bad_block),
and the resharded reads that use it: a flipped byte in any block of a run is
still found, named by its block, and the restore falls back or fails."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
    LocalTier,
    RamTier,
)
from resilient_ckpt.native import crc32c
from tests.support import effort, packs


@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000), seed=st.integers(0, 2**32 - 1))
def test_combine_is_the_crc_of_the_concatenation(a, b, seed):
    assert crc32c.combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) \
        == google_crc32c.value(a + b)
    # a CRC that did not start at zero extends the same way
    assert crc32c.combine(google_crc32c.extend(seed & 0xFFFFFFFF, a), google_crc32c.value(b),
                          len(b)) == google_crc32c.extend(seed & 0xFFFFFFFF, a + b)


@settings(max_examples=effort.examples(100))
@given(pieces=st.lists(st.binary(max_size=5000), max_size=12), gaps=st.data())
def test_concatenated_pieces_and_zeros_are_the_crc_of_the_whole(pieces, gaps):
    # a pack's run: chunks with the zeros before each aligned offset between them
    parts, whole = [], b""
    for p in pieces:
        z = gaps.draw(st.integers(0, 4095))
        parts += [(crc32c.zeros(z), z), (google_crc32c.value(p), len(p))]
        whole += bytes(z) + p
    assert crc32c.concatenated(parts) == google_crc32c.value(whole)
    if whole.strip(b"\0"):  # one changed byte anywhere changes it
        spoiled = bytearray(whole)
        spoiled[len(whole) // 2] ^= 1
        assert crc32c.concatenated(parts) != google_crc32c.value(bytes(spoiled))


@settings(max_examples=effort.examples(100))
@given(n=st.integers(0, 40_000), block=st.integers(1, 5000))
def test_combined_block_crcs_are_the_crc_of_the_whole(n, block):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    crcs = [google_crc32c.value(bytes(buf[i:i + block])) for i in range(0, n, block)]
    assert crc32c.combined(crcs, block, n) == google_crc32c.value(bytes(buf))


@settings(max_examples=effort.examples(60))
@given(n=st.integers(1, 40_000), block=st.integers(1, 5000), flip=st.integers(0, 2**31),
       data=st.data())
def test_bad_block_finds_the_first_block_that_does_not_match(n, block, flip, data):
    buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = [google_crc32c.value(bytes(buf[i:i + block])) for i in range(0, n, block)]
    assert crc32c.bad_block(buf, block, want) is None
    spoiled = buf.copy()
    at = flip % n
    spoiled[at] ^= 1 << (flip % 8)
    assert crc32c.bad_block(spoiled, block, want) == at // block
    wrong = list(want)  # a wrong expected value is found just the same
    k = data.draw(st.integers(0, len(want) - 1))
    wrong[k] ^= 1
    assert crc32c.bad_block(buf, block, wrong) == k
    with pytest.raises(ValueError):
        crc32c.bad_block(buf, block, want + [0])


ROWS, COLS = 4608, 1024  # float32: 4 KiB rows, 64 rows per 256 KiB block


@pytest.fixture
def saved():
    """One leaf saved on 8 row shards (chunks of 576 rows, 9 blocks each) to a
    RAM and a local tier."""
    root, ram = tempfile.mkdtemp(), tempfile.mkdtemp(dir="/dev/shm")
    host = np.random.default_rng(7).standard_normal((ROWS, COLS)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("a",))
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave({"w": jax.device_put(
            host, NamedSharding(mesh, P("a")))}))
    yield root, ram, host
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(ram, ignore_errors=True)


def spoil(tier_dir: str, row: int) -> str:
    """Flips a byte of row `row` of the chunk holding rows 576-1151; its key."""
    d = os.path.join(tier_dir, "1")
    where = packs.places(d)
    (key,) = [k for k in where if k.endswith(".576_0")]
    path, at, _ = where[key]  # a range of a pack
    with open(path, "r+b") as f:
        f.seek(at + (row - 576) * COLS * 4 + 123)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    return key


def target(n: int, spec: P):
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(n), ("a",))
    return {"w": jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32,
                                      sharding=NamedSharding(mesh, spec))}


# Onto 6 row shards (768 rows each) the second shard takes that chunk's rows
# 192-575, blocks 3-8, as one run: a byte in block 4 (rows 832-895 of the array).
def test_a_stitched_ram_restore_finds_a_bad_block_in_a_run_and_falls_back(saved):
    root, ram, host = saved
    key = spoil(ram, 576 + 4 * 64 + 10)
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(target(6, P("a"))))
        assert np.array_equal(np.asarray(out["w"]), host)
        rec = m.last_restore
    assert rec.served[key] == "local"
    assert any("block 4 of" in f and key in f for f in rec.fallbacks), rec.fallbacks


@pytest.mark.parametrize("spec, n, why", [
    (P("a"), 6, "rows read straight into place"),
    (P(None, "a"), 2, "half rows, through the staging buffer"),
])
def test_a_disk_read_names_the_bad_block_of_a_run(saved, spec, n, why):
    root, ram, host = saved
    key = spoil(os.path.join(root), 576 + 4 * 64 + 10)
    opts = CheckpointManagerOptions(tiers=[LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        with pytest.raises(CorruptCheckpointError) as e:
            m.restore(1, args=ocp.args.StandardRestore(target(n, spec)))
    assert "block 4 of" in str(e.value) and key in str(e.value), (why, str(e.value))
    # with the RAM tier's intact copy beside it, the same restore succeeds
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(target(n, spec)))
        assert np.array_equal(np.asarray(out["w"]), host)
