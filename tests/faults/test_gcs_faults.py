"""Saves and restores through a proxy that faults one request in five (429, 503,
connection resets before and after the server acted, bodies cut short): every
restore is bit-exact and no step is ever selected without all of its chunks."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    GcsTier,
    RamTier,
    RetryPolicy,
)
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.fake_gcs import FakeGcs
from resilient_ckpt.testing.gcs_proxy import FaultProxy

RETRY = RetryPolicy(deadline_s=60, attempt_timeout_s=10, initial_s=0.01, max_delay_s=0.2)


def make_state(mesh, seed):
    r = np.random.default_rng(seed)
    return {
        # 16 chunks of float32 and bfloat16, replicated leaves larger than a
        # piece (uploaded in parts, composed), one of them incompressible (raw
        # even under zstd), and small and PRNG leaves.
        "w": jax.device_put(r.standard_normal((256, 128)).astype(np.float32),
                            NamedSharding(mesh, P("data", "model"))),
        "h": jax.device_put(r.standard_normal((1024, 64)).astype(jnp.bfloat16),
                            NamedSharding(mesh, P("data", "model"))),
        "big": jax.device_put(r.integers(0, 256, 2**20 + 5, dtype=np.uint8),
                              NamedSharding(mesh, P())),
        "wide": jax.device_put(r.standard_normal(2**18 + 3).astype(jnp.bfloat16),
                               NamedSharding(mesh, P())),
        "rng": jax.random.key(seed), "step": seed,
    }


def equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, jax.Array):
            if np.asarray(x).dtype != np.asarray(y).dtype or \
                    not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x != y:
            return False
    return True


def complete_steps(st: GcsStorage) -> set[int]:
    """Steps whose manifest names only chunks that are there, whole: read past
    the proxy, straight from the server."""
    out = set()
    for name in st.list(""):
        for mname in st.list(name, starts_with=layout.MANIFEST_PREFIX):
            m = mf.parse(st.read(f"{name}/{mname}"), mname)
            present = set(st.list(name))
            assert all(c.key in present and st.size(f"{name}/{c.key}") == c.stored_nbytes
                       for _, _, c in m.chunks()), f"step {name} committed without its chunks"
            out.add(int(name))
    return out


@pytest.mark.parametrize("with_ram,codec", [(True, "zstd"), (False, "raw")],
                         ids=["from_ram_zstd", "from_snapshot_raw"])
def test_twenty_saves_and_restores_with_one_request_in_five_faulted(with_ram, codec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    ram = tempfile.mkdtemp(dir="/dev/shm")
    local = tempfile.mkdtemp()
    bucket = "t-" + uuid.uuid4().hex[:12]
    url = f"gs://{bucket}/run"
    try:
        with FakeGcs() as gcs, FaultProxy(gcs.endpoint, fraction=0.2, seed=3) as proxy:
            gcs.create_bucket(bucket)
            tier = GcsTier(url, endpoint=proxy.endpoint, keep=3, retry=RETRY,
                           piece_bytes=2**18, codec=codec)
            tiers = [RamTier(path=ram, keep=2), tier] if with_ram else [tier]
            direct = GcsStorage(url, endpoint=gcs.endpoint)
            m = CheckpointManager(local, options=CheckpointManagerOptions(tiers=tiers))
            for step in range(20):
                state = make_state(mesh, step)
                m.save(step, args=ocp.args.StandardSave(state))
                m.wait_until_finished()
                assert m.save_records[-1].tiers["gcs"].ok
                assert max(complete_steps(direct)) == step
                # A new host, GCS alone, through the faults: the newest step, exact.
                reader = CheckpointManager(url, options=CheckpointManagerOptions(
                    tiers=[tier], read_only=True))
                assert reader.latest_step() == step
                assert equal(reader.restore(), state), f"step {step} differs"
                reader.close()
            m.close()
            assert sorted(complete_steps(direct)) == [17, 18, 19]
            assert sum(proxy.faulted.values()) > 50 and len(proxy.faulted) == 5
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)
