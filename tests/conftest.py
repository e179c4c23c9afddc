"""Fixtures several test modules share: the 8-device mesh, a RAM-tier
directory under /dev/shm, a fake-gcs-server on 127.0.0.1, and a fresh
bucket's gs:// URL on it."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile
import uuid

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


@pytest.fixture(scope="module")
def mesh():
    """8 CPU devices as (data=4, model=2)."""
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


@pytest.fixture
def ram_path():
    p = tempfile.mkdtemp(dir="/dev/shm")
    yield p
    shutil.rmtree(p, ignore_errors=True)


@pytest.fixture(scope="module")
def gcs():
    """The bundled fake-gcs-server, started for a module and stopped after it."""
    from resilient_ckpt.testing.fake_gcs import FakeGcs
    with FakeGcs() as g:
        yield g


@pytest.fixture
def url(gcs):
    """gs://<a new bucket>/run on the module's fake-gcs-server."""
    name = "t-" + uuid.uuid4().hex[:12]
    gcs.create_bucket(name)
    return f"gs://{name}/run"


@pytest.fixture(scope="session")
def s3():
    """moto's S3 server on 127.0.0.1 (a real HTTP server, no client mocks), for
    the session; `s3.endpoint` is its URL, `s3.bucket()` makes a fresh bucket."""
    from resilient_ckpt.testing.moto_s3 import MotoS3
    with MotoS3() as server:
        yield server
