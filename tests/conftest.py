"""The suite's options, Hypothesis profiles and markers' timeouts, and the
fixtures several test modules share: the 8-device mesh, a RAM-tier directory
under /dev/shm, a fake-gcs-server on 127.0.0.1, a fresh bucket's gs:// URL on
it, moto's S3 server.

Sizes come from options, never from environment variables
(docs/contributing.md, "Tests"): an option's default is the default run's
size; the slow run (`-m slow`) has its own options; the long runs set them
higher on the command line. Hypothesis effort comes from a profile, chosen
with Hypothesis's own `--hypothesis-profile`.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import shutil
import tempfile
import uuid

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from jax.sharding import Mesh

from tests.support.effort import BASE_EXAMPLES

# ---------------------------------------------------------------- Hypothesis profiles
# A test whose examples are cheap takes the profile's max_examples as it is; a
# test whose examples are dear asks for a share of it through
# tests.support.effort.examples(n) (n at the default profile). "default" is
# what a plain `python -m pytest` runs.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("default", max_examples=BASE_EXAMPLES, **_COMMON)
# CI: the default effort, derandomized, so that a red run is the same red run
# on any machine (a new example is what "thorough" looks for).
settings.register_profile("ci", max_examples=BASE_EXAMPLES, derandomize=True,
                          print_blob=True, **_COMMON)
# While editing: a tenth of the default.
settings.register_profile("quick", max_examples=BASE_EXAMPLES // 10, **_COMMON)
# The long run (bench/reliability.py, before a release): ten times the default,
# and the state machine's longer runs.
settings.register_profile("thorough", max_examples=BASE_EXAMPLES * 10, **_COMMON)
settings.load_profile("default")  # --hypothesis-profile, when given, is loaded after this


# ---------------------------------------------------------------- options

def pytest_addoption(parser):
    g = parser.getgroup("resilient_ckpt", "resilient_ckpt's test sizes (docs/contributing.md)")
    g.addoption("--kill-trials", type=int, default=14, metavar="N",
                help="SIGKILLs in the default run's kill test (tests/faults/test_kill.py "
                     "[smoke]): exactly N; default 14, two of each kind")
    g.addoption("--kill-campaign-trials", type=int, default=0, metavar="N",
                help="SIGKILLs in the slow kill campaign (test_kill.py [campaign]): exactly "
                     "N; default 0: at least 50, up to 100 while 100 s last; the long run "
                     "sets 500")
    g.addoption("--kill-report", default=None, metavar="PATH",
                help="write the kill test's per-kind outcomes as JSON to PATH "
                     "(bench/reliability.py reads it)")
    g.addoption("--multihost-trials", type=int, default=1, metavar="N",
                help="kill trials of a 2-process job in the default run "
                     "(tests/multihost/test_multihost.py [2proc]); default 1")
    g.addoption("--multihost-campaign-trials", type=int, default=8, metavar="N",
                help="kill trials of a 2-process job in the slow run ([2proc-campaign]); "
                     "default 8; the long run (docs/benchmarks.md) sets 250")
    g.addoption("--multihost-trials-4", type=int, default=4, metavar="N",
                help="kill trials of a 4-process job, slow run ([4proc]); default 4")
    g.addoption("--multihost-control-trials", type=int, default=3, metavar="N",
                help="kill trials of the Orbax control, slow run; default 3")
    g.addoption("--seed", type=int, default=0, metavar="S",
                help="seed of the kill trials' random choices (kill and multihost "
                     "tests); default 0")


def pytest_collection_modifyitems(config, items):
    """A test marked `trials(option, per_trial_s)` gets a timeout that grows
    with its size: per_trial_s for each of the option's trials, and never
    less than pytest-timeout's own (a budgeted run, size 0, gets 600 s)."""
    try:
        given = config.getoption("timeout", None)  # pytest-timeout's --timeout
        base = float(config.getini("timeout") if given is None else given)
    except ValueError:  # pytest-timeout is not installed: no timeouts at all
        return
    if base == 0:  # --timeout=0: none
        return
    for item in items:
        m = item.get_closest_marker("trials")
        if m is None or item.get_closest_marker("timeout") is not None:
            continue
        n = config.getoption(m.args[0])
        item.add_marker(pytest.mark.timeout(max(base, 600.0 if n == 0 else 60 + n * m.args[1])))


@pytest.fixture
def trials(request):
    """The size of a test marked `trials(option, ...)`: that option's value."""
    return request.config.getoption(request.node.get_closest_marker("trials").args[0])


@pytest.fixture
def seed(request):
    return request.config.getoption("seed")


@pytest.fixture(scope="module")
def mesh():
    """8 CPU devices as (data=4, model=2)."""
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


@pytest.fixture
def ram_path():
    p = tempfile.mkdtemp(dir="/dev/shm")
    yield p
    shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def hosts(tmp_path):
    """Simulated hosts of a multi-process job: "ram", each process's RAM-tier
    path (<shm>/ram{pid}, {pid} replaced by the worker; "ram_of"(i) for process
    i; made by the tier), under "base"; "dir", a directory every process shares;
    "work", the test's own directory."""
    base = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                            prefix="rc-hosts-")
    shared = tmp_path / "shared"
    shared.mkdir()
    try:
        yield {"ram": os.path.join(base, "ram{pid}"),
               "ram_of": lambda i: os.path.join(base, f"ram{i}"),
               "dir": str(shared), "base": base, "work": str(tmp_path)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


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
