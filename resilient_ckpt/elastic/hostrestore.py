"""Restoring one leaf of a host snapshot onto new shardings.

This module owns the device side of `HostSnapshotTier.restore` for a leaf:
the sharding its data goes onto (`target_sharding`: the target's, checked
against the record; a PRNG key array's key data takes the key's sharding
with a trailing dimension), moving the source blocks each target device's
box needs from the chosen copies (`hostplan.plan_leaf`) into that device's
memory, checking every moved block against its checksum there and
assembling the target blocks (`ondevice`), and trying other copies when
one fails. It counts the bytes moved by kind (`KINDS`).
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ..errors import CorruptCheckpointError, TargetMismatchError
from ..sharding import Box, index_to_box
from . import hostplan, ondevice
from .hostplan import Copy, LeafRecord

log = logging.getLogger("resilient_ckpt.elastic")

# From the target device's own host copy; another device's on the same host; another host's.
KINDS = ("same_device", "same_host", "other_host")


def restore_leaf(step: int, li: int, leaf: LeafRecord, copies: Mapping[Copy, jax.Array],
                 target: Any, usable: set[Copy], bad: set[Copy], hosts: Mapping[int, Hashable],
                 programs: ondevice.Programs, kinds: dict[str, int]) -> jax.Array:
    """Leaf `li` of snapshot `step` on `target`'s sharding, from the
    `usable` copies. A copy that fails its checksum moves from `usable` to
    `bad`; the bytes moved are added to `kinds`. Raises
    CorruptCheckpointError when a block has no intact copy left."""
    sharding = target_sharding(step, leaf, target)
    devices: Mapping[Any, Any] = sharding.devices_indices_map(leaf.shape)
    targets = {d.id: index_to_box(i, leaf.shape) for d, i in devices.items()}
    while True:
        plan = hostplan.plan_leaf(leaf, li, targets, usable, hosts)
        if isinstance(plan, int):
            raise CorruptCheckpointError(
                f"host snapshot of step {step}: block {plan} of leaf {leaf.path} has no "
                "intact copy on a live device; restore an older step or from the "
                "manager's tiers")
        blocks, failed = _move(leaf, li, copies, plan, targets, hosts, programs, kinds)
        if not failed:
            break
        log.warning("host snapshot of step %d: copies %s of leaf %s failed their "
                    "checksums; trying other copies", step, sorted(failed), leaf.path)
        bad |= failed
        usable -= failed
    arr = jax.make_array_from_single_device_arrays(
        leaf.shape, sharding, [blocks[d.id] for d in devices])
    return jax.random.wrap_key_data(arr, impl=leaf.key_impl) if leaf.key_impl else arr


def _move(leaf: LeafRecord, li: int, copies: Mapping[Copy, jax.Array],
          plan: dict[int, tuple[hostplan.Piece, ...]], targets: dict[int, Box],
          hosts: Mapping[int, Hashable], programs: ondevice.Programs, kinds: dict[str, int]
          ) -> tuple[dict[int, jax.Array], set[Copy]]:
    """Moves the planned copies to their target devices, checks them there
    and assembles each target block. Returns the blocks and the bad copies."""
    assert leaf.blocks is not None
    by_id = {d.id: d for d in jax.devices()}
    order = [(dev, p) for dev, pieces in plan.items() for p in pieces]
    moved = jax.device_put(
        [copies[(li, p.block, p.source)] for _, p in order],
        [SingleDeviceSharding(by_id[dev], memory_kind="device") for dev, _ in order])
    rows: dict[int, list[jax.Array]] = {}
    for (dev, p), a in zip(order, moved, strict=True):
        rows.setdefault(dev, []).append(a)
        kinds[KINDS[0] if p.source == dev else
              KINDS[1] if hosts[p.source] == hosts[dev] else KINDS[2]] += p.nbytes
    blocks: dict[int, jax.Array] = {}
    bad: set[Copy] = set()
    groups: dict[tuple, list[int]] = {}
    for dev, pieces in plan.items():
        if not pieces:   # an empty target block
            blocks[dev] = jax.device_put(np.zeros(targets[dev][1], leaf.dtype), by_id[dev])
            continue
        groups.setdefault(hostplan.layout_of(leaf, pieces, targets[dev]), []).append(dev)
    for layout, devs in groups.items():
        if not ondevice.on_device(layout[0]):   # 0-d or empty: one block, checked on the host
            checks = [[ondevice.checksum_np(np.asarray(rows[d][0]))] for d in devs]
            assembled = None
        else:
            assembled, arr = programs.assemble([rows[d] for d in devs], layout)
            checks = [[(int(c[0]), int(c[1])) for c in row] for row in np.asarray(arr)]
        for i, dev in enumerate(devs):
            blocks[dev] = rows[dev][0] if assembled is None else assembled[i]
            for p, got in zip(plan[dev], checks[i], strict=True):
                if got != leaf.blocks[p.block].checksum:
                    bad.add((li, p.block, p.source))
    return blocks, bad


def target_sharding(step: int, leaf: LeafRecord, target: Any) -> jax.sharding.Sharding:
    """The sharding the leaf's (key) data is restored onto; checks shape and dtype."""
    sharding = getattr(target, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TargetMismatchError(f"host snapshot of step {step}: leaf {leaf.path} needs a "
                                  "target with a sharding (jax.ShapeDtypeStruct(..., sharding=))")
    is_key = jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key)
    shape = tuple(target.shape)
    if is_key != (leaf.key_impl is not None) or (
            not is_key and (shape != leaf.shape or str(np.dtype(target.dtype)) != leaf.dtype)) \
            or (is_key and shape != leaf.shape[:len(shape)]):
        raise TargetMismatchError(f"host snapshot of step {step}: leaf {leaf.path} was "
                                  f"{leaf.shape} {leaf.key_impl or leaf.dtype}, the target is "
                                  f"{shape} {target.dtype}")
    if not is_key:
        return sharding
    if not isinstance(sharding, NamedSharding):
        raise TargetMismatchError(f"host snapshot of step {step}: key leaf {leaf.path} needs "
                                  "a NamedSharding target")
    spec = tuple(sharding.spec) + (None,) * (len(leaf.shape) - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec))
