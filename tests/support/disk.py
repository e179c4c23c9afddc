"""What the full-disk and write-back tests share (tests/faults/test_disk_full.py,
tests/storage/test_writeback_errors.py): an abstract target for a state, its
host copy, an exact comparison, a step's leftovers, a file system's free bytes."""
import os

import jax
import numpy as np

from resilient_ckpt.core import layout


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def host(tree):
    return jax.tree.map(lambda x: np.array(x) if isinstance(x, (jax.Array, np.ndarray)) else x,
                        tree)


def assert_exact(got, want):
    g, w = jax.tree.leaves(host(got)), jax.tree.leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b


def leftovers(ckpt: str, step: int) -> list[str]:
    """The step's chunks, temporaries and manifests on the disk (its claim,
    claim.py's, may stay: it only says which save may commit the step)."""
    d = os.path.join(ckpt, str(step))
    names = os.listdir(d) if os.path.isdir(d) else []
    return sorted(n for n in names if layout.is_chunk_name(n) or layout.parse_tmp_name(n)
                  or layout.parse_manifest_name(n))


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
