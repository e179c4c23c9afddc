"""The GCS tier through the fault proxy at 5%, 20% and 50% of requests faulted.

FaultProxy (resilient_ckpt/testing/gcs_proxy.py) sits between the real
google-cloud-storage client and the real fake-gcs-server and answers a chosen
fraction of requests with 429 or 503, resets the connection before or after
the server acted, or cuts the body short. At each rate, a manager with a
GcsTier alone and one with RamTier + GcsTier save a few steps; then
  * each save either commits or fails cleanly: a failure is raised once, as a
    SaveFailedError naming its own step and the gcs tier, and never again
    (check_for_errors, the next save and close stay quiet);
  * the save's record agrees with what was raised;
  * every committed step is on GCS with all its chunks whole (read past the
    proxy), and a fresh GCS-only manager, reading through the faults,
    restores it bit-exact; no step is listed that does not restore exact.
Two deterministic cases follow: every request failing (the save fails
cleanly, the step before it stays restorable, a RAM copy of the failed step
stays usable), and uploads held at the proxy (the training thread's save()
and a restore from RAM go on while GCS cannot answer). Speed under faults and
Orbax on the same proxy are measured by bench/reliability.py, not here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile
import threading
import time
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
    SaveFailedError,
)
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.gcs_proxy import FaultProxy
from tests.support.gcs_state import complete_steps, equal, make_state

# Short enough that a save at 50% faults may run out of time (and must then
# fail cleanly), long enough that most commit.
RETRY = RetryPolicy(deadline_s=4, attempt_timeout_s=3, initial_s=0.01, max_delay_s=0.2)
STEPS = 3


@pytest.fixture
def dirs():
    ram = tempfile.mkdtemp(dir="/dev/shm")
    local = tempfile.mkdtemp()
    yield ram, local
    shutil.rmtree(ram, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)


@pytest.fixture
def mesh8():
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def bucket_url(gcs) -> str:
    bucket = "m-" + uuid.uuid4().hex[:12]
    gcs.create_bucket(bucket)
    return f"gs://{bucket}/run"


def save_once(m: CheckpointManager, step: int, state) -> bool:
    """Saves `step` and waits; True if it committed to GCS. A failure must be
    raised here, once, naming this step and the gcs tier."""
    m.save(step, args=ocp.args.StandardSave(state))
    raised = None
    try:
        m.wait_until_finished()
    except SaveFailedError as e:
        raised = e
    m.check_for_errors()  # reported once: nothing is left to raise
    rec = m.save_records[-1]
    assert rec.step == step
    ok = rec.tiers["gcs"].ok
    if raised is None:
        assert ok, f"step {step}: GCS write not ok and nothing raised: {rec.tiers['gcs']}"
    else:
        assert not ok, f"step {step}: raised {raised} for a write recorded as ok"
        assert f"step {step} " in str(raised) and "gcs tier" in str(raised), str(raised)
    return ok


def check_reader(url: str, tier: GcsTier, states: dict, must: set[int]) -> set[int]:
    """A fresh GCS-only manager (through the faults) lists every step of `must`
    and restores every step it lists exactly; returns the steps it listed."""
    reader = CheckpointManager(url, options=CheckpointManagerOptions(
        tiers=[tier], read_only=True))
    try:
        listed = set(reader.all_steps())
        assert must <= listed, f"committed steps {sorted(must - listed)} not listed"
        for step in sorted(listed):
            assert step in states, f"step {step} was never saved"
            assert equal(reader.restore(step), states[step]), f"step {step} differs"
        return listed
    finally:
        reader.close()


@pytest.mark.parametrize("rate", [  # at 50%, saves run into their deadline: slow
    pytest.param(0.05, id="5pct"), pytest.param(0.2, id="20pct"),
    pytest.param(0.5, id="50pct", marks=pytest.mark.slow)])
@pytest.mark.parametrize("with_ram", [False, True], ids=["gcs", "ram_gcs"])
def test_each_save_commits_or_fails_cleanly_under_faults(gcs, dirs, mesh8, rate, with_ram):
    ram, local = dirs
    url = bucket_url(gcs)
    seed = int(rate * 100) + 7 * with_ram
    with FaultProxy(gcs.endpoint, fraction=rate, seed=seed) as proxy:
        tier = GcsTier(url, endpoint=proxy.endpoint, keep=STEPS + 1, retry=RETRY,
                       piece_bytes=2**18)
        tiers = [RamTier(path=ram, keep=STEPS + 1), tier] if with_ram else [tier]
        states, committed = {}, set()
        m = CheckpointManager(local, options=CheckpointManagerOptions(tiers=tiers))
        try:
            for step in range(STEPS):
                states[step] = make_state(mesh8, step)
                if save_once(m, step, states[step]):
                    committed.add(step)
        finally:
            m.close()  # raises nothing: every failure was reported already
        direct = GcsStorage(url, endpoint=gcs.endpoint)
        complete = complete_steps(direct)  # asserts every manifest's chunks are whole
        direct.close()
        assert committed <= complete
        listed = check_reader(url, tier, states, committed)
        assert listed <= complete
        assert sum(proxy.faulted.values()) > 0


def test_every_request_failing_fails_the_save_cleanly(gcs, dirs, mesh8):
    ram, local = dirs
    url = bucket_url(gcs)
    short = RetryPolicy(deadline_s=1.5, attempt_timeout_s=1, initial_s=0.01, max_delay_s=0.1)
    with FaultProxy(gcs.endpoint) as proxy:
        tier = GcsTier(url, endpoint=proxy.endpoint, retry=short, piece_bytes=2**18)
        m = CheckpointManager(local, options=CheckpointManagerOptions(
            tiers=[RamTier(path=ram), tier]))
        s0, s1 = make_state(mesh8, 0), make_state(mesh8, 1)
        assert save_once(m, 0, s0)
        proxy.set(fraction=1.0, faults=("503", "429", "reset", "truncate"))
        assert not save_once(m, 1, s1)
        assert m.latest_step() == 1  # the RAM tier's copy is whole
        assert equal(m.restore(1), s1)
        proxy.set(fraction=0.0)
        s2 = make_state(mesh8, 2)
        assert save_once(m, 2, s2)  # the next save neither raises step 1's failure again
        m.close()
        assert check_reader(url, tier, {0: s0, 2: s2}, {0, 2}) == {0, 2}


@pytest.mark.parametrize("ram_done", [False, True], ids=["ram_running", "ram_done"])
def test_uploads_held_at_the_proxy_never_hold_the_training_thread(gcs, dirs, mesh8, ram_done):
    """A restore reads the RAM copy while the upload is held, whether the RAM
    write is still running when the restore starts or done already (`ram_done`:
    a finished fast write is no reason to wait for the upload)."""
    ram, local = dirs
    url = bucket_url(gcs)
    entered, release = threading.Event(), threading.Event()

    def hold_uploads(method: str, path: str) -> bool:
        # Called by the proxy for each request before it is forwarded: an
        # upload waits here until the test lets it go (no fault is injected).
        if "/upload/" in path:
            entered.set()
            release.wait(120)
        return False

    patient = RetryPolicy(deadline_s=300, attempt_timeout_s=150)
    with FaultProxy(gcs.endpoint, match=hold_uploads) as proxy:
        tier = GcsTier(url, endpoint=proxy.endpoint, retry=patient)
        m = CheckpointManager(local, options=CheckpointManagerOptions(
            tiers=[RamTier(path=ram), tier]))
        try:
            states = {s: make_state(mesh8, s) for s in range(2)}
            for step, state in states.items():
                assert m.save(step, args=ocp.args.StandardSave(state))  # returns: GCS is held
            assert entered.wait(60), "the upload never reached the proxy"
            assert "gcs" not in m.save_records[0].tiers  # still held there
            if ram_done:
                deadline = time.monotonic() + 60
                while "ram" not in m.save_records[1].tiers and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert m.save_records[1].tiers["ram"].ok
            assert equal(m.restore(1), states[1])  # from RAM, the upload still held
            assert m.last_restore is not None
            assert m.is_saving_in_progress()
        finally:
            release.set()
            m.close()
        assert all(r.tiers["gcs"].ok or r.tiers["gcs"].skipped for r in m.save_records)
        assert proxy.log, "no request went through the proxy"
        check_reader(url, GcsTier(url, endpoint=gcs.endpoint), states, {1})
