"""States and checks the GCS fault tests share (tests/faults/test_gcs_faults.py,
test_gcs_fault_matrix.py): a sharded state of float32, bfloat16, big replicated
and PRNG leaves, an exact comparison, and the steps whose manifest's chunks are
all whole on the server."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.storage.gcs import GcsStorage


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
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=False):
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
            assert all(c.object in present and c.observed(st.size(f"{name}/{c.object}"))
                       == c.stored_nbytes for _, _, c in m.chunks()), \
                f"step {name} committed without its chunks"
            out.add(int(name))
    return out
