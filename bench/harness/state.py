"""The one state builder, meshes, restore targets and value checks.

`build_state(layout, total, mesh, ...)` builds the pytree a bench measures,
of about `total` bytes on `mesh` (a (data, model) mesh, `make_mesh`). Each
layout is the state one bench has always measured, so that figures stay
comparable across commits:

- "train" (save_restore.py, local_flush.py): a train-state-like pytree:
  params and two Adam moments of the same structure (an embedding, a
  replicated position embedding, a head replicated over "model", and
  layers of float32 and bfloat16 leaves of varied shapes sharded over (data,
  model)), an int32 count and step; values uniform in [0, 1);
- "reshard" (reshard.py): params, mu and nu of 4 float32 leaves (1024
  columns, rows a multiple of 48 so that 8, 6 and 4 devices divide them),
  all P("data", "model"), and a Python int step; params normal, mu = params
  x 0.1, nu = params^2;
- "weights" (gcs.py): 16 leaves of `dtype`, 512-2048 columns, sharded four
  ways in turn; normal, std 0.02 (as at initialization);
- "rows" (s3.py; reliability.py with leaves=8, std=1 and `seed` its step):
  `leaves` float32 leaves of 512 columns, all P("data", "model"); normal;
- "decoder" (save_restore.py `--state decoder`): a real model's shape, a
  LLaMA-style decoder of 32 layers with Adam's moments: 9 tensors a layer,
  about 870 leaves at every size, FSDP over the whole mesh with the norms
  replicated (`decoder_layout`).

Every leaf is made shard by shard (jax.make_array_from_callback), each shard's
values drawn from numpy's default_rng seeded by the leaf's seed and the
shard's offsets, so a state is the same whatever the mesh and is rebuilt
exactly (reliability.py compares restores with a rebuilt state).

Nothing here imports jax at module level.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a state: its shape, dtype, PartitionSpec (a tuple of axis
    names or None) and values: `fill` "uniform" ([0, 1)) or "normal", times
    `scale`, squared with `square`, drawn in float32 and cast to `dtype`,
    from default_rng([*seed, *shard offsets])."""
    shape: tuple[int, ...]
    dtype: str
    spec: tuple = ()
    seed: tuple[int, ...] = (0,)
    fill: str = "uniform"
    scale: float = 1.0
    square: bool = False


@dataclasses.dataclass(frozen=True)
class Scalar:
    """A replicated int32 scalar (device_put of np.int32(value))."""
    value: int


@dataclasses.dataclass(frozen=True)
class Key:
    """A replicated threefry RNG key (jax.random.key(seed)), as a train state holds."""
    seed: int


def _dtype(name: str):
    import ml_dtypes
    import numpy as np
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def make_leaf(leaf: Leaf, mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    dtype, shape = _dtype(leaf.dtype), leaf.shape

    def cb(index):
        sub = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        start = tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))
        rng = np.random.default_rng([*leaf.seed, *start])
        x = (rng.random(sub, dtype=np.float32) if leaf.fill == "uniform"
             else rng.standard_normal(sub, dtype=np.float32))
        if leaf.scale != 1.0:
            x = x * leaf.scale
        if leaf.square:
            x = x * x
        return x.astype(dtype)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, P(*leaf.spec)), cb)


def materialize(spec, mesh):
    """The arrays of a tree of Leaf and Scalar (other values are kept as they are)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    if isinstance(spec, dict):
        return {k: materialize(v, mesh) for k, v in spec.items()}
    if isinstance(spec, Leaf):
        return make_leaf(spec, mesh)
    if isinstance(spec, Scalar):
        return jax.device_put(np.int32(spec.value), NamedSharding(mesh, P()))
    if isinstance(spec, Key):
        return jax.device_put(jax.random.key(spec.seed), NamedSharding(mesh, P()))
    return spec


# ---------------------------------------------------------------- the layouts

def train_layout(total: int) -> dict:
    pbytes = total // 3
    d = 1024 if pbytes >= 96 * 2**20 else 256
    f = 4 * d
    layer_bytes = 4 * 3 * d * d + 4 * d * d + 2 * d * f * 2 + 4 * f + 4 * 2 * d
    n_layers = max(1, int(pbytes * 0.7) // layer_bytes)
    pos = 4 * 512 * d  # replicated, 8 copies in memory: keep it small
    rest = max(pbytes - n_layers * layer_bytes - pos, 8 * d * 4)
    vocab = max(8, (rest // 2 // (4 * d)) // 8 * 8)
    head = max(8, (rest - vocab * d * 4) // (4 * d) // 8 * 8)
    names = {  # name -> (shape, dtype, spec)
        "embed": ((vocab, d), "float32", ("data", "model")),
        "pos_embed": ((512, d), "float32", ()),
        "lm_head": ((d, head), "float32", (None, "data")),  # replicated over "model"
    }
    for i in range(n_layers):
        names.update({
            f"layer_{i:02d}/qkv": ((d, 3 * d), "float32", ("data", "model")),
            f"layer_{i:02d}/out": ((d, d), "float32", ("model", "data")),
            f"layer_{i:02d}/mlp_in": ((d, f), "bfloat16", ("data", "model")),
            f"layer_{i:02d}/mlp_out": ((f, d), "bfloat16", ("model", "data")),
            f"layer_{i:02d}/mlp_bias": ((f,), "float32", ("model",)),
            f"layer_{i:02d}/ln_scale": ((d,), "float32", ()),
        })

    def tree(seed: int) -> dict:
        out: dict = {}
        for j, (name, (shape, dtype, spec)) in enumerate(names.items()):
            node = out
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = Leaf(shape, dtype, spec, (seed * 10_000 + j,))
        return out

    return {"params": tree(1), "opt_state": {"mu": tree(2), "nu": tree(3), "count": Scalar(7)},
            "step": Scalar(7)}


def reshard_layout(total: int) -> dict:
    per = total // 3
    cols = 1024
    sizes = [per // 2, per // 4, per // 8, per - per // 2 - per // 4 - per // 8]
    shapes = {f"layer{i}": (max(48, (n // (cols * 4)) // 48 * 48), cols)
              for i, n in enumerate(sizes)}

    def tree(**values) -> dict:
        return {k: Leaf(s, "float32", ("data", "model"), (i,), "normal", **values)
                for i, (k, s) in enumerate(shapes.items())}
    return {"params": tree(), "mu": tree(scale=0.1), "nu": tree(square=True), "step": 7}


def weights_layout(total: int, dtype: str = "float32") -> dict:
    per = total // 16 // _dtype(dtype).itemsize
    specs = [("data", "model"), ("model", "data"), ("data", None), (None, "model")]
    out = {}
    for i in range(16):
        cols = 512 * (1 + i % 4)
        rows = max(8, per // cols // 8 * 8)
        out[f"w{i:02d}"] = Leaf((rows, cols), dtype, specs[i % 4], (i,), "normal", 0.02)
    return out


def rows_layout(total: int, leaves: int = 16, std: float = 0.02, seed: tuple = (),
                prefix: str = "w{:02d}") -> dict:
    rows = max(8, total // leaves // 4 // 512 // 8 * 8)
    return {prefix.format(i): Leaf((rows, 512), "float32", ("data", "model"), (*seed, i),
                                   "normal", std) for i in range(leaves)}


def decoder_layout(total: int, layers: int = 32) -> dict:
    """A LLaMA-style decoder's train state: per layer the attention's q, k, v,
    o, the MLP's gate, up and down, and two RMSNorm scales; the token
    embedding, a final norm and the output head; params and Adam's two
    moments of the same structure (float32), Adam's count, the step and an
    RNG key. FSDP as real configs shard it: every matrix over all of the
    mesh on its first axis, the norms replicated. `d` is the largest
    multiple of 32 that keeps the state within `total` (at least 64), the
    MLP width 8d/3 rounded up to a multiple of 64, the vocabulary 16d."""
    def size(d: int) -> int:
        f, vocab = -(-8 * d // 3 // 64) * 64, 16 * d
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        return 3 * 4 * (layers * per_layer + 2 * vocab * d + d)
    d = 64
    while size(d + 32) <= total:
        d += 32
    f, vocab = -(-8 * d // 3 // 64) * 64, 16 * d
    fsdp = (("data", "model"),)
    names: dict[str, tuple[tuple[int, ...], tuple]] = {
        "embed": ((vocab, d), fsdp), "final_norm": ((d,), ()), "lm_head": ((d, vocab), fsdp)}
    for i in range(layers):
        for k, shape in (("attn/q", (d, d)), ("attn/k", (d, d)), ("attn/v", (d, d)),
                         ("attn/o", (d, d)), ("mlp/gate", (d, f)), ("mlp/up", (d, f)),
                         ("mlp/down", (f, d))):
            names[f"layer_{i:02d}/{k}"] = (shape, fsdp)
        names[f"layer_{i:02d}/attn_norm"] = ((d,), ())
        names[f"layer_{i:02d}/mlp_norm"] = ((d,), ())

    def tree(seed: int, **values) -> dict:
        out: dict = {}
        for j, (name, (shape, spec)) in enumerate(names.items()):
            node = out
            *parents, leaf = name.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = Leaf(shape, "float32", spec, (seed * 10_000 + j,), "normal", **values)
        return out

    return {"params": tree(1, scale=0.02),
            "opt_state": {"mu": tree(2, scale=0.001), "nu": tree(3, scale=0.001, square=True),
                          "count": Scalar(7)},
            "step": Scalar(7), "rng": Key(7)}


LAYOUTS = {"train": train_layout, "reshard": reshard_layout, "weights": weights_layout,
           "rows": rows_layout, "decoder": decoder_layout}


def build_state(layout: str, total: int, mesh, **kw) -> dict:
    """The state of `layout` (see the module's docstring), about `total`
    bytes, on `mesh`; `kw` goes to the layout (weights: dtype; rows: leaves,
    std, seed, prefix)."""
    return materialize(LAYOUTS[layout](total, **kw), mesh)


# ---------------------------------------------------------------- meshes, targets, checks

def make_mesh(data: int, model: int):
    """A (data, model) mesh over the first data * model devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    devices = np.array(jax.devices()[:data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def abstract_of(tree, mesh=None, spec=None):
    """A restore target: a ShapeDtypeStruct per array, with the array's
    sharding, or with NamedSharding(mesh, spec) where both are given (a
    resharded restore); other leaves are kept."""
    import jax
    from jax.sharding import NamedSharding

    def one(a):
        if not isinstance(a, jax.Array):
            return a
        sh = a.sharding if mesh is None else NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
    return jax.tree.map(one, tree)


def same_values(a_tree, b_tree) -> bool:
    """Shard-by-shard equality and equivalent shardings (numpy, no jit)."""
    import jax
    import numpy as np
    a_leaves, b_leaves = jax.tree.leaves(a_tree), jax.tree.leaves(b_tree)
    if len(a_leaves) != len(b_leaves):
        return False
    for a, b in zip(a_leaves, b_leaves, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or not a.sharding.is_equivalent_to(
                b.sharding, a.ndim):
            return False
        a, b = raw(a), raw(b)
        bs = {s.device: s for s in b.addressable_shards}
        for s in a.addressable_shards:
            if not np.array_equal(np.asarray(s.data), np.asarray(bs[s.device].data)):
                return False
    return True


def raw(a):
    """An array's stored values: a PRNG key array's key data, else itself."""
    import jax
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(a)
    return a


def unique_shards(state, largest_first: bool = True) -> list:
    """Zero-copy numpy views of every unique shard (replica 0) of the state's
    arrays, largest first (or in tree order)."""
    import jax
    import numpy as np
    out = [np.asarray(s.data) for a in jax.tree.leaves(state) if isinstance(a, jax.Array)
           for s in raw(a).addressable_shards if s.replica_id == 0]
    return sorted(out, key=lambda v: -v.nbytes) if largest_first else out


def tree_bytes(state) -> int:
    """Bytes of the state's arrays (one copy each)."""
    import jax
    return sum(a.nbytes for a in jax.tree.leaves(state) if isinstance(a, jax.Array))
