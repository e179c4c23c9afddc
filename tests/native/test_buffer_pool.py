"""hostmem.BufferPool, the buffers that compressed chunks pass through: reused,
never more than its bound in all, idle or lent, whatever the number of threads
asking; and zstd saves and restores through it, bit-exact, with a small bound."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import random
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, GcsTier
from resilient_ckpt.core import codec
from resilient_ckpt.native.hostmem import BufferPool
from resilient_ckpt.save import transfer
from tests.support.gcs_manager import FAST, abstract, assert_equal, make_state


@pytest.mark.parametrize("keep_idle", [True, False])
def test_lent_and_idle_buffers_stay_within_the_bound_under_threads(keep_idle):
    cap = 1 << 19
    pool = BufferPool(cap, keep_idle=keep_idle)
    held, worst, errors = {}, [0], []
    lock = threading.Lock()

    def work(seed):
        rng = random.Random(seed)
        for _ in range(60):
            n = rng.randint(1, cap)
            buf = pool.take(n)
            try:
                assert len(buf) >= n
                with lock:
                    assert all(b is not buf for b in held.values()), "one buffer lent twice"
                    held[seed] = buf
                    worst[0] = max(worst[0], pool.held)
                buf[:n] = seed  # the holder's own bytes, unchanged while it holds them
                assert (buf[:n] == seed).all()
                with lock:
                    del held[seed]
            except AssertionError as e:
                errors.append(e)
            finally:
                pool.give(buf)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "a taker waited forever"
    assert 0 < worst[0] <= cap
    assert pool.held <= cap
    if not keep_idle:
        assert pool.held == 0  # none lent: none kept


def test_a_buffer_comes_back_and_a_large_one_is_its_own():
    pool = BufferPool(1 << 20)
    a = pool.take(1000)
    pool.give(a)
    assert pool.take(800) is a  # reused, pages already touched
    big = pool.take((1 << 20) + 1)
    pool.give(big)
    assert pool.held == 1000 and pool.take(1000) is not big


def test_compress_into_fits_or_says_so():
    raw = (np.random.default_rng(2).standard_normal(50_000, dtype=np.float32) * 0.02)
    whole = codec.compress(raw)
    out = np.empty(len(whole), np.uint8)
    assert codec.compress_into(raw, out) == len(whole)
    assert out.tobytes() == whole
    assert codec.compress_into(raw, np.empty(len(whole) - 1, np.uint8)) is None


def test_zstd_save_and_restore_with_small_bounds_are_bit_exact(gcs, url, mesh, monkeypatch):
    # Bounds of 24 KiB (the reader's: a quarter of its budget): two or three of
    # the compressed chunks here (7-13 KiB), so the writers' and the reader's
    # threads take turns with the buffers.
    monkeypatch.setattr(transfer, "PACKED", BufferPool(24 * 1024, keep_idle=False))
    state = make_state(mesh, 5)
    tier = GcsTier(url, endpoint=gcs.endpoint, retry=FAST, codec="zstd")
    with CheckpointManager(url, options=CheckpointManagerOptions(tiers=[tier])) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        assert m.save_records[-1].tiers["gcs"].ok
    assert transfer.PACKED.held == 0  # nothing kept once no chunk is compressed
    opts = CheckpointManagerOptions(tiers=[tier], restore_memory_budget=96 * 1024)
    with CheckpointManager(url, options=opts) as m2:
        assert_equal(m2.restore(1, args=ocp.args.StandardRestore(abstract(state))), state)
        codecs = {c.codec for _, _, c in m2.catalog.viable()[1].manifest.chunks()}
        assert codecs == {"raw", "zstd"}
