"""The reader's buffers for compressed chunks: reused from chunk to chunk, and
never more than half the restore budget in all, idle or in use, whatever the
number of threads asking; a zstd restore through them is bit-exact."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import random
import threading
import types

import orbax.checkpoint as ocp
from test_gcs_manager import FAST, abstract, assert_equal, make_state

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, GcsTier
from resilient_ckpt.reader import ChunkReader, RestoreRecord


def _reader(budget: int) -> ChunkReader:
    naming = types.SimpleNamespace(name=lambda step: str(step))
    choice = types.SimpleNamespace(step=1, sources={})
    return ChunkReader({}, naming, choice, set(), RestoreRecord(1), budget=budget)


def test_buffers_stay_within_half_the_budget_under_threads():
    budget = 1 << 20
    cap = budget // 2
    r = _reader(budget)
    held, worst, errors = {}, [0], []
    lock = threading.Lock()

    def work(seed):
        rng = random.Random(seed)
        for _ in range(60):
            n = rng.randint(1, cap)
            buf = r._take_packed(n)
            try:
                assert len(buf) >= n
                with lock:
                    assert all(b is not buf for b in held.values()), "one buffer lent twice"
                    held[seed] = buf
                    idle = sum(len(b) for b in r._packed)
                    worst[0] = max(worst[0], idle + sum(len(b) for b in held.values()))
                buf[:n] = seed  # the holder's own bytes
                assert (buf[:n] == seed).all()
                with lock:
                    del held[seed]
            except AssertionError as e:
                errors.append(e)
            finally:
                r._give_packed(buf)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads), "a taker waited forever"
    assert 0 < worst[0] <= cap
    assert r._packed_bytes <= cap
    big = r._take_packed(cap + 1)  # too large to pool: a buffer of its own
    r._give_packed(big)
    assert all(b is not big for b in r._packed)
    r.close()


def test_zstd_restore_with_a_small_budget_is_bit_exact(gcs, url, mesh):
    state = make_state(mesh, 5)
    tier = GcsTier(url, endpoint=gcs.endpoint, retry=FAST, codec="zstd")
    with CheckpointManager(url, options=CheckpointManagerOptions(tiers=[tier])) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
    # A budget of 48 KiB: the buffers hold 24 KiB in all, two or three of the
    # compressed chunks here (7-13 KiB), so the reader's 4 threads take turns.
    opts = CheckpointManagerOptions(tiers=[tier], restore_memory_budget=48 * 1024)
    with CheckpointManager(url, options=opts) as m2:
        out = m2.restore(1, args=ocp.args.StandardRestore(abstract(state)))
        assert_equal(out, state)
        codecs = {c.codec for _, _, c in m2.catalog.viable()[1].manifest.chunks()}
        assert "zstd" in codecs
