"""A jax leaf as the host snapshot tier sees it: its blocks and the copies to make.

This module owns the step from a jax array to `hostplan`'s records: the
boxes its sharding places on each device, the replica groups of its mesh
(the devices at the same position along the replica axis, and the device
at each position in the group half the ring away, which keeps its backup:
`replica_ring`), and the copies to make
(`describe`). A PRNG key array is described by its key data.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..core.sharding import box_elements, index_to_box
from . import hostplan
from .hostplan import Copy, LeafRecord


def replica_ring(sharding: jax.sharding.Sharding, axis: str | None
          ) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """(devices in mesh order, replica group of each, device at the same
    position in the group n // 2 further along the axis of n groups, the next
    one when n is 2 or 3): one group when there is no replica axis."""
    if not isinstance(sharding, NamedSharding):
        devices: set[Any] = set(sharding.device_set)   # jaxlib's Device has no stubs
        ids = sorted(d.id for d in devices)
        return ids, dict.fromkeys(ids, 0), {}
    devs = sharding.mesh.devices
    order = [d.id for d in devs.flat]
    names = sharding.mesh.axis_names
    if axis not in names or devs.shape[names.index(axis)] < 2:
        return order, dict.fromkeys(order, 0), {}
    ax = names.index(axis)
    # Half the ring away: losing one group, or any contiguous half of them (a
    # block of hosts, the usual shape of a lost slice or rack) leaves a copy.
    rolled = np.roll(devs, -(devs.shape[ax] // 2), axis=ax)
    group = {d.id: pos[ax] for pos, d in np.ndenumerate(devs)}
    nxt: dict[int, int] = {d.id: rolled[pos].id  # type: ignore[union-attr]
                           for pos, d in np.ndenumerate(devs)}
    return order, group, nxt


def describe(li: int, path: str, x: jax.Array, axis: str | None
              ) -> tuple[LeafRecord, list[tuple[Copy, jax.Array, int]]]:
    """The leaf's record (without checksums) and its copies to make:
    (copy, the device-memory shard to copy, the device whose host keeps it)."""
    impl = None
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl, x = str(jax.random.key_impl(x)), jax.random.key_data(x)
    if not x.is_fully_addressable:
        raise ValueError(f"host snapshot: leaf {path} is not fully addressable from this "
                         "process; the tier is for a single-controller (Pathways) job")
    where: Mapping[Any, Any] = x.sharding.devices_indices_map(x.shape)
    boxes = {d.id: index_to_box(i, x.shape) for d, i in where.items()}
    order, group, nxt = replica_ring(x.sharding, axis)
    itemsize = np.dtype(x.dtype).itemsize
    nbytes = {b: box_elements(b) * itemsize for b in boxes.values()}
    blocks = hostplan.place_copies(boxes, [d for d in order if d in boxes], group, nxt, nbytes)
    spec = str(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else repr(x.sharding)
    leaf = LeafRecord(path, tuple(x.shape), str(x.dtype), spec, blocks, impl)
    shards = {s.device.id: s.data for s in x.addressable_shards}
    todo = [((li, bi, d), shards[b.primaries[0] if d in b.backups else d], d)
            for bi, b in enumerate(blocks) for d in b.holders]
    return leaf, todo
