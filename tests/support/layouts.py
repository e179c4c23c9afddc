"""A state of leaves that share layouts (several of one shape, dtype and
sharding, others of their own), saved once to a RAM and a local tier, for the
restore tests of layouts and of the RAM tier's deferred checks."""
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier

DEVICES = jax.devices()
SHAPE = (48, 16)


def mesh(n, shape, names):
    return Mesh(np.array(DEVICES[:n]).reshape(shape), names)


def host_values():
    """Leaves of one shape: float32 ones of one layout, a bfloat16 and an
    int32 one, replicated vectors, each with values of its own."""
    rng = np.random.default_rng(3)
    out = {f"a{i}": rng.standard_normal(SHAPE).astype(np.float32) for i in range(4)}
    out["b"] = rng.standard_normal(SHAPE).astype(jnp.bfloat16)
    out["c"] = rng.integers(-1000, 1000, SHAPE).astype(np.int32)
    out.update({f"n{i}": rng.standard_normal(16).astype(np.float32) for i in range(3)})
    return out


def saved(root, ram, host):
    rows = NamedSharding(mesh(8, (8,), ("a",)), P("a"))
    cols = NamedSharding(mesh(8, (8,), ("a",)), P(None, "a"))
    rep = NamedSharding(mesh(8, (8,), ("a",)), P())
    state = {k: jax.device_put(v, rep if k.startswith("n") else cols if k == "c" else rows)
             for k, v in host.items()}
    state["key"] = jax.random.split(jax.random.key(5), 8)
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram), LocalTier()])
    with CheckpointManager(root, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
    return state
