"""Filling the shards a process could not read from the replicas its peers hold.

When a host lost its RAM tier but its data-parallel peers still hold the same
shards, the restore places the data where it exists and lets JAX move it: a
collective over the target sharding's replica axes (the mesh axes its
PartitionSpec does not use), in which every shard is taken from the first
replica that read it, so the bytes travel device to device, never through a
tier. Every process of the job must call `fill_all` for the same leaves in
the same order (it is a collective).

The program does not depend on the leaves' shapes: the leaves of one layout
(the same mesh, replica axes and sharded axes) are packed, per device, as
bytes into one buffer (each leaf at a page-aligned offset; zeros where the
device read nothing), and one selection over those buffers moves them all.
Its shape is (replicas, cells, bytes) with the bytes rounded up to a power of
two, so a state of hundreds of leaves compiles a few programs, not one per
leaf (a compile each, seconds for a state of many leaves).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..core.ambient import apart
from ..native.hostmem import carve, host_buffer

# Bytes of leaves packed per program, over all of this process's devices:
# a round holds its packs, their gathered replicas and the selection (about
# replicas + 2 times this), so a round stays within the restore's budget of
# 256 MiB past the state however many devices a host has (it was 256 MiB per
# device). What a lost-host fill still takes beyond that is XLA's:
# docs/benchmarks.md.
GROUP_BYTES = 64 * 1024 * 1024
_ALIGN = 4096


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _layout(s: NamedSharding, ndim: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(replica axes, sharded axes in the spec's order) of a sharding."""
    spec = tuple(s.spec) + (None,) * (ndim - len(s.spec))
    used = tuple(a for e in spec for a in _axes(e))
    return tuple(a for a in s.mesh.axis_names if a not in used), used


def can_fill(sharding: jax.sharding.Sharding) -> bool:
    """Whether `fill_all` handles this sharding: named, with a replica axis."""
    if not isinstance(sharding, NamedSharding):
        return False
    used = {a for e in sharding.spec for a in _axes(e)}
    return any(a not in used for a in sharding.mesh.axis_names)


@apart()
def fill_all(holes: Sequence[tuple[jax.Array, dict]],
             group_bytes: int = GROUP_BYTES) -> tuple[list[jax.Array], bool]:
    """Each `array` (target-sharded, on a `can_fill` sharding) with every
    shard that some replica holds taken from the first replica holding it,
    in order; `have[device]` says whether that device's shard was read. Also
    returns whether every shard on this process's devices had a holder."""
    by_layout: dict[tuple, list[int]] = {}
    for i, (array, _) in enumerate(holes):
        s = array.sharding
        assert isinstance(s, NamedSharding)
        by_layout.setdefault((s.mesh, *_layout(s, array.ndim)), []).append(i)
    out: list[jax.Array | None] = [None] * len(holes)
    ok = True
    for key in by_layout:  # the same order on every process: the targets are the same
        for group in _groups(by_layout[key], holes, group_bytes):
            filled, good = _fill_group([holes[i] for i in group], *key)
            ok = ok and good
            for i, a in zip(group, filled, strict=True):
                out[i] = a
    return [a for a in out if a is not None], ok


def _shard_bytes(array: jax.Array) -> int:
    """The bytes of one shard, page-aligned (the largest, if uneven)."""
    n = max(s.data.nbytes for s in array.addressable_shards)
    return -(-n // _ALIGN) * _ALIGN


def _groups(indices: list[int], holes: Sequence[tuple[jax.Array, dict]],
            group_bytes: int) -> list[list[int]]:
    groups: list[list[int]] = [[]]
    size = 0
    for i in indices:
        n = _shard_bytes(holes[i][0]) * len(holes[i][0].addressable_shards)
        if groups[-1] and size + n > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _fill_group(holes: Sequence[tuple[jax.Array, dict]], mesh, rep: tuple[str, ...],
                used: tuple[str, ...]) -> tuple[list[jax.Array], bool]:
    offsets, total = [], 0
    for array, _ in holes:
        offsets.append(total)
        total += _shard_bytes(array)
    width = 1 << max(total - 1, 1).bit_length()  # a power of two: few distinct programs
    r = math.prod(mesh.shape[a] for a in rep)
    cells = math.prod(mesh.shape[a] for a in used)
    stacked = NamedSharding(mesh, PartitionSpec(rep, used or None, None))
    devices = [s.device for s in holes[0][0].addressable_shards]
    packs, flags = [], []
    for d in devices:
        pack, held = host_buffer(width), True
        pack[total:] = 0
        for (array, have), off in zip(holes, offsets, strict=True):
            data = np.asarray(next(s.data for s in array.addressable_shards if s.device == d))
            flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            pack[off:off + flat.size] = flat if have[d] else 0
            held = held and bool(have[d])
        packs.append(jax.device_put(pack.reshape(1, 1, width), d, may_alias=True))
        flags.append(jax.device_put(np.full((1, 1), held), d))
    x = jax.make_array_from_single_device_arrays((r, cells, width), stacked, packs)
    h = jax.make_array_from_single_device_arrays((r, cells), NamedSharding(
        mesh, PartitionSpec(rep, used or None)), flags)
    picked, any_held = _select(mesh, rep, used)(x, h)
    ok = all(bool(np.asarray(s.data).all()) for s in any_held.addressable_shards)
    return [_unpack(array, have, picked, off) for (array, have), off in zip(
        holes, offsets, strict=True)], ok


def _unpack(array: jax.Array, have: dict, picked: jax.Array, offset: int) -> jax.Array:
    """One leaf out of the selected packs: a shard its device read is kept as
    it is, the others are copied out of the selection (copying them all
    doubled the memory of a holder's restore)."""
    by_device = {s.device: np.asarray(s.data).reshape(-1) for s in picked.addressable_shards}
    fill = [s for s in array.addressable_shards if not have[s.device]]
    # One mapping for the leaf's copied shards, freed to the system with it.
    bufs = dict(zip((s.device for s in fill), carve([s.data.nbytes for s in fill]), strict=True))
    shards = []
    for s in array.addressable_shards:
        if have[s.device]:
            shards.append(s.data)
            continue
        host = bufs[s.device]
        host[:] = by_device[s.device][offset:offset + s.data.nbytes]
        host = host.view(s.data.dtype).reshape(s.data.shape)
        shards.append(jax.device_put(host, s.device, may_alias=True))
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)


@functools.lru_cache(maxsize=64)
def _select(mesh, rep: tuple[str, ...], used: tuple[str, ...]):
    """Per cell, the bytes of the first replica that holds it (exact for every
    dtype: they cross as 32-bit words), and whether any does.

    A sum over the replica axes in which only that replica's bytes are not
    zero: one all-reduce by construction, so each device sends and receives
    about twice its cell's bytes however many replicas there are, and no
    holder serves every other replica itself. (Written as a pick out of the
    stacked replicas, the same bound held only as long as XLA's partitioner
    chose to lower the pick that way.)"""
    cells = used or None
    nobody = jnp.iinfo(jnp.int32).max  # the first holder's index where none holds

    def select(x, h):  # per device: x (1, 1, width) bytes, h (1, 1) held
        me = jax.lax.axis_index(rep)
        first = jax.lax.pmin(jnp.where(h[0, 0], me, nobody), rep)
        words = jax.lax.bitcast_convert_type(x[0].reshape(1, -1, 4), jnp.uint32)
        mine = jnp.where(me == first, words, jnp.zeros_like(words))
        picked = jax.lax.bitcast_convert_type(jax.lax.psum(mine, rep), jnp.uint8)
        return picked.reshape(1, -1), (first < nobody).reshape(1)
    return jax.jit(jax.shard_map(
        select, mesh=mesh, in_specs=(PartitionSpec(rep, cells, None), PartitionSpec(rep, cells)),
        out_specs=(PartitionSpec(cells, None), PartitionSpec(cells))))
