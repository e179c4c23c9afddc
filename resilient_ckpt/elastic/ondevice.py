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
  device: jax compiles a program per device set, and a compile per device
  would sit on the recovery path.
  `assemble` checks each block moved to a target device and places the
  elements each target block needs from them, on that device. They are
  held as compiled executables, which outlive `jax.clear_caches()`, until
  `drop` names one of their devices lost; `prepare_assemble` compiles one
  before it is needed.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..core.ambient import apart

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


ROW = 256   # words per row of the (rows, ROW) view `checksum` sums along both axes


def checksum(x: jax.Array) -> jax.Array:
    """(sum of the words, sum of word i times 2i+1), uint32, on x's device.

    Computed as s0 + 2 * s1, s1 the sum of word i times i: with the words
    viewed as rows of ROW (word i = r * ROW + c), s1 = ROW * sum(r * row sum
    r) + sum(c * column sum c), two plain sums over the block (which XLA
    vectorizes; the iota product per word did not) and small ones; the words
    past the last whole row are weighted one by one. The same numbers mod
    2**32 (`checksum_np` is the direct formula)."""
    u32, w = jnp.uint32, words(x)
    m = w.size // ROW
    head, tail = w[:m * ROW].reshape(m, ROW), w[m * ROW:]
    rows, cols = jnp.sum(head, axis=1, dtype=u32), jnp.sum(head, axis=0, dtype=u32)
    at = jax.lax.iota(u32, tail.size) + u32((m * ROW) % 2**32)
    s0 = jnp.sum(rows, dtype=u32) + jnp.sum(tail, dtype=u32)
    s1 = (u32(ROW) * jnp.sum(rows * jax.lax.iota(u32, m), dtype=u32)
          + jnp.sum(cols * jax.lax.iota(u32, ROW), dtype=u32) + jnp.sum(tail * at, dtype=u32))
    return jnp.stack([s0, u32(2) * s1 + s0])


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
    """The compiled programs, one per (kind, devices, shapes, dtype): ahead-of-time
    executables (`jit(...).lower(...).compile()`), which `jax.clear_caches()`
    (the loop's, after a failure) does not drop, so a restore onto devices
    that are still alive reuses those compiled before it (`prepare_assemble`,
    in the background after a snapshot commits). `drop` forgets those that
    name a lost device. Safe to use from several threads: a program being
    compiled in one is waited for, not compiled again, by another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple, cf.Future] = {}

    def _mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        return Mesh(np.array(list(devices)), (AXIS,))

    def _get(self, key: tuple, make: Callable[[], Any]) -> Any:
        """The executable of `key`, compiled by `make()` once."""
        with self._lock:
            fut = self._cache.get(key)
            mine = fut is None
            if fut is None:
                fut = self._cache[key] = cf.Future()
        if not mine:
            try:
                return fut.result()
            except Exception:  # noqa: BLE001 - its compile failed elsewhere: compile here, and raise here
                return make()
        try:
            fut.set_result(make())
        except BaseException as e:
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]
            fut.set_exception(e)
            raise
        return fut.result()

    def drop(self, lost_ids: Collection[int]) -> None:
        """Forgets the programs over a lost device (their executables name it)."""
        lost = set(lost_ids)
        with self._lock:
            for key in [k for k in self._cache if lost.intersection(k[1])]:
                del self._cache[key]

    def held(self) -> list[tuple]:
        """The keys of the programs compiled (or being compiled): (kind, device ids, ...)."""
        with self._lock:
            return list(self._cache)

    @apart()
    def checksums(self, arrays: Sequence[jax.Array]) -> jax.Array:
        """Per array (single-device, ndim >= 1, one shape and dtype, distinct
        devices), its `checksum`, as an (n, 2) array on those devices
        (dispatched, not waited for)."""
        devices = [next(iter(a.devices())) for a in arrays]
        mesh = self._mesh(devices)
        stacked = stack(arrays, mesh)
        key = ("checksums", tuple(d.id for d in devices), stacked.shape, str(stacked.dtype))
        return self._get(key, lambda: jax.jit(jax.shard_map(
            lambda x: checksum(x)[None], mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
        ).lower(jax.ShapeDtypeStruct(stacked.shape, stacked.dtype,
                                     sharding=stacked.sharding)).compile())(stacked)

    @apart()
    def prepare_assemble(self, devices: Sequence[jax.Device], layout: tuple, dtype: Any) -> Any:
        """The executable `assemble` runs for blocks of `layout` and `dtype`
        moved to `devices` (compiled now unless it is held)."""
        dtype = jnp.dtype(dtype)
        mesh = self._mesh(devices)
        key = ("assemble", tuple(d.id for d in devices), layout, str(dtype))

        def make() -> Any:
            identity = is_identity(layout)

            def local(*blocks: jax.Array) -> Any:
                checks = jnp.stack([checksum(b) for b in blocks])[None]
                return checks if identity else (checks, _placed(layout, dtype, blocks))
            k, sharding = len(layout[1]), NamedSharding(mesh, P(AXIS))
            fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS),) * k,
                                       out_specs=P(AXIS) if identity else (P(AXIS), P(AXIS)),
                                       check_vma=False))
            return fn.lower(*[jax.ShapeDtypeStruct((shape[0] * len(devices),) + shape[1:],
                                                   dtype, sharding=sharding)
                              for shape, _, _ in layout[1]]).compile()
        return self._get(key, make)

    @apart()
    def assemble(self, moved: Sequence[Sequence[jax.Array]], layout: tuple
                 ) -> tuple[list[jax.Array] | None, jax.Array]:
        """`moved[i][k]`: the k-th block moved to the i-th device (each device
        one row, all with `layout`). Returns the assembled target block per
        device (None when `layout` is the identity: the moved block is it)
        and the checksums of the moved blocks, (devices, blocks, 2)."""
        devices = [next(iter(row[0].devices())) for row in moved]
        mesh = self._mesh(devices)
        fn = self.prepare_assemble(devices, layout, moved[0][0].dtype)
        out = fn(*[stack([row[k] for row in moved], mesh) for k in range(len(layout[1]))])
        if is_identity(layout):
            return None, out
        checks, placed = out
        by_device = {s.device: s.data for s in placed.addressable_shards}
        return [by_device[d] for d in devices], checks
