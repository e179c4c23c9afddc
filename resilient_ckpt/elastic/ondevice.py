"""On-device work of the host snapshot tier: block checksums and assembly.

This module owns the jax programs of `hostsnap`:

- `checksum`: two 32-bit sums over a block's bytes, computed on the device
  that holds the block, so only 8 bytes per block reach the controller. The
  bytes are read as unsigned words (32-bit dtypes as themselves, 8-byte ones
  as two words, 1- and 2-byte ones and bools one word per element, complex
  numbers as their real and imaginary parts); the first sum is of the words,
  the second weights word i by 2i+1 (mod 2**32). A change of one word (so
  any flipped bit) always changes the first; a change at one position
  always changes the second (odd weights are invertible mod 2**32);
  reordered words mostly change the second. It is not a cryptographic hash,
  and weaker than crc32c against many changes at once.
  `checksum_np` is the same function on the host, for 0-d blocks and tests.
- `Programs.checksums` and `Programs.assemble`: one SPMD program over a 1-D
  mesh of the devices concerned, whose blocks of one shape are stacked along
  their first dimension (`stack`, no copy), instead of one program per
  device: jax compiles a program per device set, about 0.1 s each on this
  project's CPU machines, which per device would sit on the recovery path.
  `assemble` checks each block moved to a target device and places the
  elements each target block needs from them, on that device.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "rc_block"


def words(x: jax.Array) -> jax.Array:
    """The block's bytes as a flat array of uint32 words (see the module docstring)."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        w = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        w = jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16)
        w = w.astype(jnp.uint32)
    return w.reshape(-1)


def checksum(x: jax.Array) -> jax.Array:
    """(sum of the words, sum of word i times 2i+1), uint32, on x's device."""
    w = words(x)
    i = jax.lax.iota(jnp.uint32, w.size)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32),
                      jnp.sum(w * (i * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)])


def checksum_np(a: Any) -> tuple[int, int]:
    """`checksum` of a host array, computed with numpy: the same two numbers."""
    a = np.ascontiguousarray(a)
    if np.iscomplexobj(a):
        a = np.stack([a.real, a.imag], axis=-1)
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    size = a.dtype.itemsize
    w = (a.view(np.uint32) if size >= 4 else
         a.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)).reshape(-1)
    i = np.arange(w.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        return (int(np.sum(w, dtype=np.uint32)),
                int(np.sum(w * (i * np.uint32(2) + np.uint32(1)), dtype=np.uint32)))


def stack(arrays: Sequence[jax.Array], mesh: Mesh) -> jax.Array:
    """Single-device arrays of one shape (ndim >= 1), one per device of
    `mesh` in its order, as one array stacked along dimension 0 (no copy)."""
    first = arrays[0]
    shape = (first.shape[0] * len(arrays),) + tuple(first.shape[1:])
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, P(AXIS)), list(arrays))


def on_device(shape: tuple[int, ...]) -> bool:
    """Whether a block of this shape is checked by an on-device program (0-d
    and empty blocks are checked on the host: they cannot be stacked, and
    are a few bytes)."""
    return len(shape) > 0 and all(n > 0 for n in shape)


def _placed(layout: tuple, dtype: Any, blocks: Sequence[jax.Array]) -> jax.Array:
    tshape, parts = layout
    out = jnp.zeros(tshape, dtype)
    for b, (_, src, dst) in zip(blocks, parts, strict=True):
        out = out.at[tuple(slice(*d) for d in dst)].set(b[tuple(slice(*s) for s in src)])
    return out


def is_identity(layout: tuple) -> bool:
    """One block that is exactly the target block: nothing to assemble."""
    tshape, parts = layout
    return (len(parts) == 1 and parts[0][0] == tshape
            and all(s == (0, n) for s, n in zip(parts[0][1], tshape, strict=True))
            and parts[0][1] == parts[0][2])


class Programs:
    """The jitted programs, one per (devices, layout, dtype), kept so later
    snapshots and restores reuse jax's compiled executables."""

    def __init__(self) -> None:
        self._cache: dict[tuple, Any] = {}

    def _mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        return Mesh(np.array(list(devices)), (AXIS,))

    def checksums(self, arrays: Sequence[jax.Array]) -> jax.Array:
        """Per array (single-device, ndim >= 1, one shape and dtype, distinct
        devices), its `checksum`, as an (n, 2) array on those devices
        (dispatched, not waited for)."""
        devices = [next(iter(a.devices())) for a in arrays]
        key = ("checksums", tuple(d.id for d in devices))
        fn = self._cache.get(key)
        mesh = self._mesh(devices)
        if fn is None:
            fn = jax.jit(jax.shard_map(lambda x: checksum(x)[None], mesh=mesh,
                                       in_specs=P(AXIS), out_specs=P(AXIS)))
            self._cache[key] = fn
        return fn(stack(arrays, mesh))

    def assemble(self, moved: Sequence[Sequence[jax.Array]], layout: tuple
                 ) -> tuple[list[jax.Array] | None, jax.Array]:
        """`moved[i][k]`: the k-th block moved to the i-th device (each device
        one row, all with `layout`). Returns the assembled target block per
        device (None when `layout` is the identity: the moved block is it)
        and the checksums of the moved blocks, (devices, blocks, 2)."""
        devices = [next(iter(row[0].devices())) for row in moved]
        dtype = moved[0][0].dtype
        mesh = self._mesh(devices)
        key = ("assemble", tuple(d.id for d in devices), layout, str(dtype))
        fn = self._cache.get(key)
        identity = is_identity(layout)
        if fn is None:
            def local(*blocks: jax.Array) -> Any:
                checks = jnp.stack([checksum(b) for b in blocks])[None]
                return checks if identity else (checks, _placed(layout, dtype, blocks))
            k = len(layout[1])
            fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS),) * k,
                                       out_specs=P(AXIS) if identity else (P(AXIS), P(AXIS)),
                                       check_vma=False))
            self._cache[key] = fn
        stacked = [stack([row[k] for row in moved], mesh) for k in range(len(layout[1]))]
        out = fn(*stacked)
        if identity:
            return None, out
        checks, placed = out
        by_device = {s.device: s.data for s in placed.addressable_shards}
        return [by_device[d] for d in devices], checks
