"""States, targets and a fast retry policy of the GCS-tier manager tests
(tests/storage/test_gcs_manager.py, tests/native/test_buffer_pool.py)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import (
    RetryPolicy,
)

FAST = RetryPolicy(deadline_s=20, attempt_timeout_s=5, initial_s=0.01, max_delay_s=0.05)


def make_state(mesh, seed):
    r = np.random.default_rng(seed)
    return {"w": jax.device_put(r.standard_normal((256, 64)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "h": jax.device_put(r.standard_normal((512, 64)).astype(jnp.bfloat16),
                                NamedSharding(mesh, P("data"))),
            "i": jnp.asarray(r.integers(0, 9, (7,)), jnp.int8),
            "rng": jax.random.key(seed), "np": np.arange(5.0) + seed, "step": seed}


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def host(tree):
    """Plain values to compare, taken before the arrays may be deleted."""
    def one(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return ("key", np.asarray(jax.random.key_data(x)))
        return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x
    return jax.tree.map(one, tree)


def assert_equal(got, want):
    g, w = jax.tree.leaves(host(got)), jax.tree.leaves(host(want))
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=False):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b
