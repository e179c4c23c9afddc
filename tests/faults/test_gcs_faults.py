"""Saves and restores through a proxy that faults one request in five (429, 503,
connection resets before and after the server acted, bodies cut short): every
restore is bit-exact and no step is ever selected without all of its chunks."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    GcsTier,
    RamTier,
    RetryPolicy,
)
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.fake_gcs import FakeGcs
from resilient_ckpt.testing.gcs_proxy import FaultProxy
from tests.support.gcs_state import complete_steps, equal, make_state

RETRY = RetryPolicy(deadline_s=60, attempt_timeout_s=10, initial_s=0.01, max_delay_s=0.2)


@pytest.mark.slow  # 20 saves, 10 s a case; test_gcs_fault_matrix.py has the quick ones
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
