"""The damaged-checkpoint tests' state (tests/faults/test_corruption.py and
others): a small sharded state per step, its abstract target, an exact check."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("x",))


def host_state(step: int) -> dict:
    r = np.random.default_rng(step)
    return {"w": r.standard_normal((256, 64), dtype=np.float32),
            "b": r.integers(-2**31, 2**31 - 1, (32,), dtype=np.int32), "n": step}


def device_state(step: int) -> dict:
    h = host_state(step)
    mesh = _mesh()
    return {"w": jax.device_put(h["w"], NamedSharding(mesh, P("x"))),
            "b": jax.device_put(h["b"], NamedSharding(mesh, P())), "n": h["n"]}


def abstract() -> dict:
    mesh = _mesh()
    return {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh, P("x"))),
            "b": jax.ShapeDtypeStruct((32,), np.int32, sharding=NamedSharding(mesh, P())),
            "n": 0}


def assert_exact(out: dict, step: int) -> None:
    want = host_state(step)
    assert out["n"] == step
    for k in ("w", "b"):
        got = np.asarray(out[k])
        assert got.dtype == want[k].dtype and got.tobytes() == want[k].tobytes(), \
            f"leaf {k} of step {step} differs"
