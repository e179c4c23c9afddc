"""Filling the shards a process could not read from the replicas its peers hold.

When a host lost its RAM tier but its data-parallel peers still hold the same
shards, the restore places the data where it exists and lets JAX move it: a
collective over the target sharding's replica axes (the mesh axes its
PartitionSpec does not use), in which every shard is taken from the first
replica that read it. Each device contributes its shard (zeros where it read
nothing) and one flag; XLA turns the selection into a reduction across the
replica group, so the bytes travel device to device, never through a tier.
Every process of the job must call `fill` for the same leaves in the same
order (it is a collective).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def can_fill(sharding: jax.sharding.Sharding) -> bool:
    """Whether `fill` handles this sharding: named, with a replica axis."""
    if not isinstance(sharding, NamedSharding):
        return False
    used = {a for e in sharding.spec for a in _axes(e)}
    return any(a not in used for a in sharding.mesh.axis_names)


def fill(array: jax.Array, have: dict) -> tuple[jax.Array, bool]:
    """`array` (target-sharded) with every shard that some replica holds taken
    from the first replica holding it; `have[device]` says whether that
    device's shard was read. Also returns whether every shard on this
    process's devices had a holder (a collective; see the module docstring)."""
    s = array.sharding
    assert isinstance(s, NamedSharding)
    mesh, spec = s.mesh, tuple(s.spec) + (None,) * (array.ndim - len(s.spec))
    used = {a for e in spec for a in _axes(e)}
    rep = tuple(a for a in mesh.axis_names if a not in used)
    r = math.prod(mesh.shape[a] for a in rep)
    grid = [math.prod(mesh.shape[a] for a in _axes(e)) for e in spec]
    stacked = NamedSharding(mesh, PartitionSpec(rep, *spec))
    flags = NamedSharding(mesh, PartitionSpec(rep, *spec))
    xs, hs = [], []
    for shard in array.addressable_shards:
        xs.append(jnp.expand_dims(shard.data, 0))
        flag = np.full((1,) * (1 + array.ndim), bool(have[shard.device]))
        hs.append(jax.device_put(flag, shard.device))
    x = jax.make_array_from_single_device_arrays((r, *array.shape), stacked, xs)
    h = jax.make_array_from_single_device_arrays((r, *grid), flags, hs)
    out, held = _select(tuple(grid), s, NamedSharding(mesh, PartitionSpec(*spec)))(x, h)
    ok = all(bool(np.asarray(sh.data).all()) for sh in held.addressable_shards)
    return out, ok


@functools.lru_cache(maxsize=64)
def _select(grid: tuple[int, ...], out_sharding: NamedSharding, held_sharding: NamedSharding):
    def select(x, h):
        # Per grid cell, the first replica that holds it; gathered along the
        # replica axis (exact for every dtype: a copy, not arithmetic).
        first = jnp.argmax(h, axis=0)
        shape = x.shape[1:]
        blocks = [n // g for n, g in zip(shape, grid, strict=True)]
        split = (x.shape[0],) + tuple(v for g, b in zip(grid, blocks, strict=True) for v in (g, b))
        idx = first.reshape((1,) + tuple(v for g in grid for v in (g, 1)))
        idx = jnp.broadcast_to(idx, (1,) + split[1:])
        picked = jnp.take_along_axis(x.reshape(split), idx, axis=0).reshape(shape)
        return picked, h.any(axis=0)
    return jax.jit(select, out_shardings=(out_sharding, held_sharding))
