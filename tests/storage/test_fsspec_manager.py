"""The fsspec tier in the manager, against moto's S3 server through s3fs (no
client mocks): background uploads from the RAM tier, restore from S3 alone,
retention, a lost chunk, two writers racing for one step, faults."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    CheckpointManager,
    CheckpointManagerOptions,
    RamTier,
    RetryPolicy,
    SaveFailedError,
    StepAlreadyExistsError,
)
from resilient_ckpt.core import layout
from resilient_ckpt.storage.fsspec_store import FsspecStorage
from resilient_ckpt.testing.gcs_proxy import FaultProxy
from resilient_ckpt.tiers import FsspecTier

FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)


def make_state(mesh, seed):
    r = np.random.default_rng(seed)
    return {"w": jax.device_put(r.standard_normal((256, 64)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "h": jax.device_put(r.standard_normal((128, 64)).astype(jnp.bfloat16),
                                NamedSharding(mesh, P("data"))),
            "rng": jax.random.key(seed), "np": np.arange(5.0) + seed, "step": seed}


def assert_equal(got, want):
    def host(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x
    g, w = jax.tree.leaves(jax.tree.map(host, got)), jax.tree.leaves(jax.tree.map(host, want))
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        assert (a.dtype == b.dtype and np.array_equal(a, b)) if isinstance(b, np.ndarray) \
            else a == b


def s3_tier(s3, url, endpoint=None, **kw):
    return FsspecTier(url, storage_options=s3.options(endpoint), retry=FAST, **kw)


def s3_only(s3, url, **kw):
    return CheckpointManagerOptions(tiers=[s3_tier(s3, url, **kw)])


def store(s3, url):
    return FsspecStorage(url, s3.options(), retry=FAST)


def save(m, step, state):
    m.save(step, args=ocp.args.StandardSave(state))


def test_ram_and_s3_round_trip_and_restore_from_s3_alone(s3, mesh, ram_path, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    states = [make_state(mesh, s) for s in range(3)]
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, every=1, keep=1),
                                           s3_tier(s3, url, every=1, keep=5)])
    with CheckpointManager(tmp_path / "a", options=opts) as m:
        assert m.tier_names == ["ram", "s3"]
        for s, st in enumerate(states):
            save(m, s, st)
            m.wait_until_finished()
        assert m.save_records[-1].tiers["s3"].ok
    shutil.rmtree(ram_path)
    shutil.rmtree(tmp_path / "a")  # the faster tiers are gone: a new machine
    assert store(s3, url).list("") == ["0", "1", "2"]
    with CheckpointManager(tmp_path / "b", options=s3_only(s3, url)) as m:
        assert m.all_steps() == [0, 1, 2]
        assert_equal(m.restore(2), states[2])
        assert_equal(m.restore(0), states[0])


def test_retention_on_s3_keeps_its_own_count(s3, mesh, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    with CheckpointManager(tmp_path, options=s3_only(s3, url, keep=2)) as m:
        for s in range(4):
            save(m, s, make_state(mesh, s))
            m.wait_until_finished()
        assert m.all_steps() == [2, 3]
    assert store(s3, url).list("") == ["2", "3"]


def test_a_lost_chunk_never_comes_back_as_data(s3, mesh, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    states = [make_state(mesh, s) for s in range(2)]
    with CheckpointManager(tmp_path / "a", options=s3_only(s3, url)) as m:
        for s, st in enumerate(states):
            save(m, s, st)
            m.wait_until_finished()
        key = next(c.object for _, _, c in m.catalog.viable()[1].manifest.chunks())
    store(s3, url).delete(f"1/{key}")  # a pack, or a chunk of its own
    with CheckpointManager(tmp_path / "b", options=s3_only(s3, url)) as m:
        assert_equal(m.restore(), states[0])  # step 1 fails its read; step 0 is whole
        assert m.last_restore.step == 0 and m.latest_step() == 0


def test_two_managers_racing_for_one_step_on_s3_commit_once(s3, mesh, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    states = [make_state(mesh, 10), make_state(mesh, 20)]
    managers = [CheckpointManager(tmp_path / f"m{i}", options=s3_only(s3, url))
                for i in range(2)]
    barrier, errors = threading.Barrier(2), [None, None]

    def run(i):
        barrier.wait()
        save(managers[i], 7, states[i])
        try:
            managers[i].wait_until_finished()
        except SaveFailedError as e:
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    losers = [i for i in range(2) if errors[i] is not None]
    assert len(losers) == 1
    assert isinstance(errors[losers[0]].__cause__, StepAlreadyExistsError)
    for m in managers:
        m.close()
    st = store(s3, url)
    assert st.list("7", starts_with=layout.MANIFEST_PREFIX) == ["manifest.0-of-1.json"]
    with CheckpointManager(tmp_path / "r", options=s3_only(s3, url)) as m:
        assert_equal(m.restore(7), states[1 - losers[0]])


def test_saves_through_faults_commit_and_restore(s3, mesh, ram_path, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    state = make_state(mesh, 3)
    with FaultProxy(s3.endpoint, fraction=0.3, faults=("503", "reset", "truncate"),
                    seed=2) as proxy:
        opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, every=1),
                                               s3_tier(s3, url, proxy.endpoint, every=1)])
        with CheckpointManager(tmp_path / "a", options=opts) as m:
            save(m, 0, state)
            m.wait_until_finished()
            assert m.save_records[-1].tiers["s3"].ok
        with CheckpointManager(tmp_path / "b", options=CheckpointManagerOptions(
                tiers=[s3_tier(s3, url, proxy.endpoint)])) as m:
            assert_equal(m.restore(0), state)
        assert sum(proxy.faulted.values()) > 0


def test_a_shared_file_system_tier_round_trips(mesh, ram_path, tmp_path):
    url = f"file://{tmp_path}/nfs/run"
    state = make_state(mesh, 4)
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, every=1),
                                           FsspecTier(url, every=1)])
    with CheckpointManager(tmp_path / "a", options=opts) as m:
        assert m.tier_names == ["ram", "file"]
        save(m, 0, state)
        m.wait_until_finished()
    shutil.rmtree(ram_path)
    with CheckpointManager(tmp_path / "b", options=CheckpointManagerOptions(
            tiers=[FsspecTier(url)])) as m:
        assert_equal(m.restore(0), state)


@pytest.mark.slow  # 8 s: runs of the tool; the S3 tier itself is tested above
def test_the_command_line_lists_and_verifies_an_s3_tier(s3, mesh, ram_path, tmp_path):
    """`resilient-ckpt` finds the S3 tier from the directory's tiers record;
    the store's endpoint and credentials come from the environment, never
    from the record."""
    import json
    import subprocess
    import sys
    url = f"s3://{s3.bucket()}/run"
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, every=1, keep=1),
                                           s3_tier(s3, url, every=1, keep=5)])
    with CheckpointManager(tmp_path / "a", options=opts) as m:
        save(m, 3, make_state(mesh, 3))
        m.wait_until_finished()
    env = dict(os.environ, AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID="testing",
               AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    tool = [sys.executable, "-m", "resilient_ckpt.cli.main"]
    out = subprocess.run(tool + ["ls", str(tmp_path / "a"), "--json"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "testing" not in (tmp_path / "a" / ".rc-tiers.json").read_text()
    # The recorded URL is listed, not followed; the store is read when given.
    assert [t["where"] for t in json.loads(out.stdout)["ignored"]] == [url]
    out = subprocess.run(tool + ["ls", str(tmp_path / "a"), "--tier", f"s3={url}", "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    s3_steps = [s for s in listed["steps"] for c in s["copies"] if c["tier"] == "s3"]
    assert url in json.dumps(listed) and s3_steps and s3_steps[0]["step"] == 3, listed
    ok = subprocess.run(tool + ["verify", str(tmp_path / "a"), "3", "--tier", f"s3={url}"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
