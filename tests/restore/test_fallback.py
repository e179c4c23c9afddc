"""Hypothesis property: restore(None) falls back correctly when newer steps
turn out corrupt, on real files in a RAM and a local tier.

Bytes are flipped in place (sizes unchanged, so selection still lists the
step); only the checksum check on read can find them. The oracle reads every
copy itself and says which steps still have an intact copy of every chunk.
"""
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
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    CorruptCheckpointError,
    LocalTier,
    RamTier,
    StepNotFoundError,
)
from tests.support import effort, packs

STEPS = (1, 2, 3)


def state_for(step, mesh):
    rng = np.random.default_rng(step)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
            "b": jnp.full((8,), step, jnp.int32), "step": step}


def chunk_files(mngr, step):
    """{(tier, chunk key): (path, offset, size)} for every chunk copy of a step."""
    out = {}
    for t in mngr.tiers:
        d = os.path.join(t.storage.root, str(step))
        if os.path.isdir(d):
            out.update({(t.name, k): p for k, p in packs.places(d).items()})
    return out


def _bytes(place) -> bytes:
    path, at, n = place
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(n)


@settings(max_examples=effort.examples(12), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_restore_latest_falls_back_past_corrupt_steps(mesh, data):
    root = tempfile.mkdtemp()
    ram = tempfile.mkdtemp(dir="/dev/shm")
    try:
        opts = CheckpointManagerOptions(tiers=[RamTier(every=1, keep=5, path=ram),
                                               LocalTier(every=1, keep=5)])
        with CheckpointManager(root, options=opts) as m:
            for s in STEPS:
                m.save(s, args=ocp.args.StandardSave(state_for(s, mesh)))
            m.wait_until_finished()
            manifests = {s: m.catalog.viable()[s].manifest for s in STEPS}
        crcs = {s: {c.key: c.crc32c for _, _, c in manifests[s].chunks()} for s in STEPS}
        m = CheckpointManager(root, options=opts)
        files = {s: chunk_files(m, s) for s in STEPS}
        for s in STEPS:
            victims = data.draw(st.lists(st.sampled_from(sorted(files[s])), unique=True,
                                         max_size=len(files[s])), label=f"corrupt@{s}")
            for tier_key in victims:
                path, at, _ = files[s][tier_key]
                with open(path, "r+b") as f:
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0xFF]))

        def intact(s):
            for key, crc in crcs[s].items():
                copies = [p for (t, k), p in files[s].items() if k == key]
                if not any(google_crc32c.value(_bytes(p)) == crc for p in copies):
                    return False
            return True

        good = [s for s in STEPS if intact(s)]
        if not good:
            with pytest.raises(StepNotFoundError):
                m.restore(None)
        else:
            out = m.restore(None)
            expect = state_for(max(good), mesh)
            assert m.last_restore.step == max(good)
            assert np.array_equal(np.asarray(out["w"]), np.asarray(expect["w"]))
            assert np.array_equal(np.asarray(out["b"]), np.asarray(expect["b"]))
            assert out["step"] == max(good)
            assert m.latest_step() == max(good)  # corrupt newer steps are skipped now
        bad = [s for s in STEPS if s not in good]
        if bad:
            with pytest.raises(CorruptCheckpointError) as ei:
                m.restore(max(bad))
            assert isinstance(ei.value, ValueError) or isinstance(ei.value, FileNotFoundError)
        m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
