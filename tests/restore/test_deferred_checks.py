"""A RAM-tier restore's checks, deferred and run in bulk while the arrays are
placed (ChunkReader.check_deferred): a damaged chunk anywhere in a run of a
pack is still found, falls back alone to the next tier before the restore
returns, and is counted where it was served from; bytes between chunks (a
pack's padding) are never mistaken for a chunk's. And the batched put of each
leaf's shards gives the arrays jax's public call gives."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from resilient_ckpt.restore import assemble, reader
from tests.support import packs
from tests.support.layouts import host_values, saved


def restore(root, ram, state):
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
              for k, v in state.items()}
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        out = m.restore(1, args=ocp.args.StandardRestore(target))
        return out, m.last_restore


def assert_exact(out, state, host):
    for k, v in host.items():
        assert np.array_equal(np.asarray(out[k]), v), k
        assert out[k].sharding == state[k].sharding, k
    assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(state["key"]))


@pytest.mark.parametrize("checkers, batch", [(None, None), (3, 4096)],
                         ids=["as-configured", "3-checkers-4KiB-batches"])
def test_two_bad_chunks_in_one_run_of_a_pack_each_fall_back_and_nothing_else(
        dirs, monkeypatch, checkers, batch):
    """Also with three checker threads taking batches of a few chunks each
    at once (a host with more cores), the restoring thread taking the last."""
    if checkers is not None:
        monkeypatch.setattr(reader, "CHECKERS", checkers)
        monkeypatch.setattr(reader, "DEFER_BATCH_BYTES", batch)
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    where = packs.places(os.path.join(ram, "1"))
    by_pack: dict = {}
    for key, (path, at, n) in where.items():
        by_pack.setdefault(path, []).append((at, key, n))
    run = sorted(max(by_pack.values(), key=len))  # the pack with the most chunks
    assert len(run) >= 8
    victims = {run[1][1], run[-2][1]}  # two chunks inside one run, of different leaves
    _, whole = restore(root, ram, state)  # undamaged: every chunk from RAM
    assert set(whole.served.values()) == {"ram"}
    for v in victims:
        packs.overwrite(os.path.join(ram, "1"), v, 0, b"\x13\x37")
    out, rec = restore(root, ram, state)
    assert_exact(out, state, host)
    assert {k for k, t in rec.served.items() if t == "local"} == victims
    assert rec.chunks_by_tier["local"] == 2
    assert rec.chunks_by_tier["ram"] == whole.chunks_by_tier["ram"] - 2
    lost = sum(where[v][2] for v in victims)
    assert rec.bytes_by_tier["ram"] == whole.bytes_by_tier["ram"] - lost
    assert rec.bytes_by_tier["local"] == lost
    assert len(rec.fallbacks) == 2
    assert all("crc32c" in f and "ram" in f for f in rec.fallbacks)


def test_bytes_between_a_packs_chunks_are_not_a_chunks(dirs):
    # The run's one checksum covers the zeros between chunks: garbage there
    # fails it, and the chunks, checked one by one then, are all intact.
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    where = packs.places(os.path.join(ram, "1"))
    gaps = [(path, at + n) for path, at, n in where.values() if n % 4096]
    assert gaps
    for path, end in gaps:
        with open(path, "r+b") as f:
            f.seek(end)
            f.write(b"\xff" * min(8, 4096 - end % 4096))
    out, rec = restore(root, ram, state)
    assert_exact(out, state, host)
    assert rec.fallbacks == [] and set(rec.served.values()) == {"ram"}


def test_the_batched_put_gives_the_arrays_the_public_call_gives(dirs, monkeypatch):
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    assert assemble._batched_put is not None  # this jax has it: the restores below use it
    fast, _ = restore(root, ram, state)
    assert_exact(fast, state, host)
    monkeypatch.setattr(assemble, "_batched_put", None)
    public, _ = restore(root, ram, state)
    assert_exact(public, state, host)
    for k in host:
        a = sorted((s.device.id, s.index, np.asarray(s.data).tobytes())
                   for s in fast[k].addressable_shards)
        b = sorted((s.device.id, s.index, np.asarray(s.data).tobytes())
                   for s in public[k].addressable_shards)
        assert a == b, k


def test_a_jax_whose_batched_put_refuses_its_arguments_gets_the_public_call(dirs, monkeypatch):
    # Another jax's private put with another signature: a TypeError is caught
    # once, and the public call is used from then on (a fault we cannot
    # cause with the installed jax, hence the stand-in).
    root, ram = dirs
    host = host_values()
    state = saved(root, ram, host)
    calls = []

    def refuses(*a):
        calls.append(a)
        raise TypeError("batched_device_put() takes 3 positional arguments")
    monkeypatch.setattr(assemble, "_batched_put", refuses)
    out, _ = restore(root, ram, state)
    assert_exact(out, state, host)
    assert len(calls) == 1 and assemble._batched_put is None
