"""Restoring the leaves of a host snapshot onto new shardings.

This module owns the device side of `HostSnapshotTier.restore` for a leaf:
the sharding its data goes onto (`target_sharding`: the target's, checked
against the record; a PRNG key array's key data takes the key's sharding
with a trailing dimension), moving the source blocks each target device's
box needs from the chosen copies (`hostplan.plan_leaf`) into that device's
memory, checking every moved block against its checksum there and assembling
the target blocks (`ondevice`), and trying other copies when one fails
(`restore_leaves`: every leaf dispatched before any is waited for). It
counts the bytes moved by kind (`KINDS`). `prepare_leaf` compiles, ahead of
a restore, the programs it will run.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ..core.sharding import Box, index_to_box
from ..errors import CorruptCheckpointError, TargetMismatchError
from . import hostplan, ondevice
from .hostplan import Copy, LeafRecord

log = logging.getLogger("resilient_ckpt.elastic")

# From the target device's own host copy; another device's on the same host; another host's.
KINDS = ("same_device", "same_host", "other_host")


def restore_leaves(step: int, leaves: Sequence[tuple[int, LeafRecord, Any]],
                   copies: Mapping[Copy, jax.Array], usable: set[Copy], bad: set[Copy],
                   hosts: Mapping[int, Hashable], programs: ondevice.Programs,
                   kinds: dict[str, int]) -> list[jax.Array]:
    """Leaves (index, record, target) of snapshot `step` on their targets'
    shardings, from the `usable` copies: every leaf's moves and programs are
    dispatched before any leaf's checksums are waited for, so the moves of
    one overlap the checks of another. A leaf with a copy that fails its
    checksum is moved again (`restore_leaf`)."""
    started = [(li, leaf, target, *_start(step, li, leaf, copies, target, usable, hosts,
                                          programs, kinds)) for li, leaf, target in leaves]
    out = []
    for li, leaf, target, sharding, blocks, checks in started:
        failed = _failed(leaf, li, checks)
        if failed:
            _warn_failed(step, leaf, failed)
            bad |= failed
            usable -= failed
            out.append(restore_leaf(step, li, leaf, copies, target, usable, bad, hosts,
                                    programs, kinds))
        else:
            out.append(_assembled(leaf, sharding, blocks))
    return out


def restore_leaf(step: int, li: int, leaf: LeafRecord, copies: Mapping[Copy, jax.Array],
                 target: Any, usable: set[Copy], bad: set[Copy], hosts: Mapping[int, Hashable],
                 programs: ondevice.Programs, kinds: dict[str, int]) -> jax.Array:
    """Leaf `li` of snapshot `step` on `target`'s sharding, from the
    `usable` copies. A copy that fails its checksum moves from `usable` to
    `bad`; the bytes moved are added to `kinds`. Raises
    CorruptCheckpointError when a block has no intact copy left."""
    while True:
        sharding, blocks, checks = _start(step, li, leaf, copies, target, usable, hosts,
                                          programs, kinds)
        failed = _failed(leaf, li, checks)
        if not failed:
            return _assembled(leaf, sharding, blocks)
        _warn_failed(step, leaf, failed)
        bad |= failed
        usable -= failed


def _start(step: int, li: int, leaf: LeafRecord, copies: Mapping[Copy, jax.Array],
           target: Any, usable: set[Copy], hosts: Mapping[int, Hashable],
           programs: ondevice.Programs, kinds: dict[str, int]
           ) -> tuple[jax.sharding.Sharding, dict[int, jax.Array], list[_Check]]:
    """Plans the leaf's moves from the `usable` copies and dispatches them
    and its programs: (the sharding, the target blocks by device id, the
    checks to wait for)."""
    sharding = target_sharding(step, leaf, target)
    devices: Mapping[Any, Any] = sharding.devices_indices_map(leaf.shape)
    targets = {d.id: index_to_box(i, leaf.shape) for d, i in devices.items()}
    plan = hostplan.plan_leaf(leaf, li, targets, usable, hosts)
    if isinstance(plan, int):
        raise CorruptCheckpointError(
            f"host snapshot of step {step}: block {plan} of leaf {leaf.path} has no "
            "intact copy on a live device; restore an older step or from the "
            "manager's tiers")
    return (sharding, *_move(leaf, li, copies, plan, targets, hosts, programs, kinds))


def _assembled(leaf: LeafRecord, sharding: jax.sharding.Sharding,
               blocks: dict[int, jax.Array]) -> jax.Array:
    devices: Mapping[Any, Any] = sharding.devices_indices_map(leaf.shape)
    arr = jax.make_array_from_single_device_arrays(
        leaf.shape, sharding, [blocks[d.id] for d in devices])
    return jax.random.wrap_key_data(arr, impl=leaf.key_impl) if leaf.key_impl else arr


def _warn_failed(step: int, leaf: LeafRecord, failed: set[Copy]) -> None:
    log.warning("host snapshot of step %d: copies %s of leaf %s failed their "
                "checksums; trying other copies", step, sorted(failed), leaf.path)


# Per group of target devices: the pieces moved to each, and their checksums
# (an (devices, pieces, 2) array being computed, or computed on the host).
_Check = tuple[list[tuple[hostplan.Piece, ...]], Any]


def _move(leaf: LeafRecord, li: int, copies: Mapping[Copy, jax.Array],
          plan: dict[int, tuple[hostplan.Piece, ...]], targets: dict[int, Box],
          hosts: Mapping[int, Hashable], programs: ondevice.Programs, kinds: dict[str, int]
          ) -> tuple[dict[int, jax.Array], list[_Check]]:
    """Moves the planned copies to their target devices and dispatches the
    programs that check them there and assemble each target block. Returns
    the blocks (being computed) and the checks to wait for (`_failed`)."""
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
    checks: list[_Check] = []
    for dev, pieces in plan.items():
        if not pieces:   # an empty target block
            blocks[dev] = jax.device_put(np.zeros(targets[dev][1], leaf.dtype), by_id[dev])
    for layout, devs in _groups(leaf, plan, targets).items():
        if not ondevice.on_device(layout[0]):   # 0-d or empty: one block, checked on the host
            sums: Any = np.array([[ondevice.checksum_np(np.asarray(rows[d][0]))]
                                  for d in devs], np.uint32)
            assembled = None
        else:
            assembled, sums = programs.assemble([rows[d] for d in devs], layout)
        checks.append(([plan[d] for d in devs], sums))
        for i, dev in enumerate(devs):
            blocks[dev] = rows[dev][0] if assembled is None else assembled[i]
    return blocks, checks


def _failed(leaf: LeafRecord, li: int, checks: list[_Check]) -> set[Copy]:
    """Waits for the checksums of the moved copies: those that differ from the record's."""
    assert leaf.blocks is not None
    bad: set[Copy] = set()
    for pieces, sums in checks:
        for row, got_row in zip(pieces, np.asarray(sums), strict=True):
            for p, got in zip(row, got_row, strict=True):
                if (int(got[0]), int(got[1])) != leaf.blocks[p.block].checksum:
                    bad.add((li, p.block, p.source))
    return bad


def _groups(leaf: LeafRecord, plan: Mapping[int, tuple[hostplan.Piece, ...]],
            targets: Mapping[int, Box]) -> dict[tuple, list[int]]:
    """The target devices (in `plan`'s order) with something to move, by layout:
    each layout's devices share one program."""
    groups: dict[tuple, list[int]] = {}
    for dev, pieces in plan.items():
        if pieces:
            groups.setdefault(hostplan.layout_of(leaf, pieces, targets[dev]), []).append(dev)
    return groups


def prepare_leaf(li: int, leaf: LeafRecord, sharding: jax.sharding.Sharding,
                 programs: ondevice.Programs) -> int:
    """Compiles (unless held) the programs a restore of leaf `li` onto
    `sharding` runs; how many it compiled or found held. Which copy each
    target device takes changes only where its moves come from, not these
    programs, so every copy is assumed usable."""
    if leaf.blocks is None:
        return 0
    devices: Mapping[Any, Any] = sharding.devices_indices_map(leaf.shape)
    by_id = {d.id: d for d in devices}
    targets = {d.id: index_to_box(i, leaf.shape) for d, i in devices.items()}
    every = {(li, bi, d) for bi, b in enumerate(leaf.blocks) for d in b.holders}
    plan = hostplan.plan_leaf(leaf, li, targets, every, {})
    assert not isinstance(plan, int)  # every copy is usable
    n = 0
    for layout, devs in _groups(leaf, plan, targets).items():
        if ondevice.on_device(layout[0]):
            programs.prepare_assemble([by_id[d] for d in devs], layout, leaf.dtype)
            n += 1
    return n


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
