"""The demos' model: a small pure-JAX MLP with hand-written Adam, and its mesh.

This module owns what both demos train: the MLP (`model_on`: shardings,
jitted init and a jitted train step that donates the state, for a state of
about `mb` MiB) and the (data=4, model=2) mesh over 8 CPU devices
(`demo_mesh`). jax is imported inside the functions, after the entry point
has asked for 8 host devices.
"""
from __future__ import annotations

import os
import sys
from typing import Any

D = 256          # input and output width of the MLP
LR = 1e-3


def hidden_width(mb: float) -> int:
    """Hidden width giving a state (params + two Adam moments, f32) of ~mb MiB."""
    n = mb * 2**20 / 12  # parameters: 3 copies of 4 bytes each
    h = -D + (D * D + n) ** 0.5  # h*h + 2*D*h = n
    return max(16, int(h) // 16 * 16)


def demo_mesh() -> Any:
    """The (data=4, model=2) mesh over the first 8 CPU devices; exits when
    there are fewer (XLA_FLAGS must ask for them before the backend starts)."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices("cpu")
    if len(devices) < 8:
        sys.exit(f"the demo needs 8 CPU devices, got {len(devices)}; "
                 f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    import numpy as np
    return Mesh(np.array(devices[:8]).reshape(4, 2), ("data", "model"))


def model_on(mesh, mb: float, batch_size: int):
    """(state shardings, jitted init, jitted train step) of the demo's MLP with
    hand-written Adam on `mesh`, for a state of ~mb MiB; the elastic demo uses
    it too. The step donates the state."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    h = hidden_width(mb)
    shapes = {"w1": (D, h), "b1": (h,), "w2": (h, h), "b2": (h,), "w3": (h, D), "b3": (D,)}
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None),
             "b2": P(), "w3": P(None, "model"), "b3": P("model")}
    ns = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    shardings = {"params": ns, "m": ns, "v": ns, "count": NamedSharding(mesh, P())}

    def init():
        keys = dict(zip(shapes, jax.random.split(jax.random.key(0), len(shapes)), strict=True))
        params = {k: (jax.random.normal(keys[k], s) / s[0] ** 0.5 if len(s) == 2
                      else jnp.zeros(s)) for k, s in shapes.items()}
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"params": params, "m": zeros, "v": zeros,
                "count": jnp.zeros((), jnp.int32)}

    def batch(count):
        """The batch of step count+1: a function of the step, so a replay matches."""
        kx = jax.random.fold_in(jax.random.key(1), count)
        x = jax.random.normal(kx, (batch_size, D))
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data", None)))
        teacher = jax.random.normal(jax.random.key(2), (D, D)) / D ** 0.5
        return x, jnp.tanh(x @ teacher)

    def loss_fn(p, x, y):
        z = jax.nn.gelu(x @ p["w1"] + p["b1"])
        z = jax.nn.gelu(z @ p["w2"] + p["b2"])
        return jnp.mean((z @ p["w3"] + p["b3"] - y) ** 2)

    def step(state):
        x, y = batch(state["count"])
        loss, g = jax.value_and_grad(loss_fn)(state["params"], x, y)
        t = state["count"] + 1
        b1, b2 = 0.9, 0.999
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], g)
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        params = jax.tree.map(lambda p, m, v: p - LR * (m / c1) / (jnp.sqrt(v / c2) + 1e-8),
                              state["params"], m, v)
        return {"params": params, "m": m, "v": v, "count": t}, loss

    init_fn = jax.jit(init, out_shardings=shardings)
    train_step = jax.jit(step, donate_argnums=0,
                         out_shardings=(shardings, NamedSharding(mesh, P())))
    return shardings, init_fn, train_step
