"""Which writer of a save holds which box, worked back from its records.

On a tier the whole job sees, a save writes replica 0 of each box of a jax
leaf from the process whose device holds it (jax's replica ids: in the
order of the sharding's device map, the first device holding a box is
replica 0), and the numpy leaves from the first writer (`save.snapshot`,
`describe_items`). From a leaf's record (its shape and the sharding it was
saved with) and the current job's device -> writer map, `needed` says which
writers wrote the boxes one process's devices hold, so a restore of the
same shape reads those writers' manifests only. A prediction is only a
guess (the saving job's devices may have belonged to other processes):
`confirmed` checks it against the manifests read, and the caller reads
every manifest where it fails.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from .manifest import Manifest
from .sharding import Box, index_to_box, rebuild

Wanted = dict[int, set[tuple[int, int, Box]]]  # writer -> (item, leaf, box) it wrote


def needed(m: Manifest, writer_of: Mapping[int, int], mine: Collection[int]) -> Wanted | None:
    """Per writer label, the boxes of `m`'s leaves (item index, leaf index,
    box) that the devices `mine` hold under the shardings the leaves were
    saved with and that writer wrote, numpy leaves from writer 0. None when
    it cannot be worked out: a leaf saved with a sharding other than a named
    or a single-device one, on a device this job lacks or whose writer
    `writer_of` (device id -> writer label) does not know, or a description
    jax refuses."""
    out: Wanted = {}
    layouts: dict[tuple, dict[Box, int] | None] = {}
    for ii, it in enumerate(m.items):
        for li, leaf in enumerate(it.leaves):
            if leaf.kind in ("numpy", "numpy_scalar"):
                full = (tuple(0 for _ in leaf.shape), tuple(leaf.shape))
                out.setdefault(0, set()).add((ii, li, full))
                continue
            if leaf.kind not in ("array", "prng_key"):
                continue
            key = _layout_key(leaf.sharding, leaf.shape)
            if key not in layouts:
                layouts[key] = _held(leaf.sharding, tuple(leaf.shape), writer_of, mine)
            held = layouts[key]
            if held is None:
                return None
            for box, w in held.items():
                out.setdefault(w, set()).add((ii, li, box))
    return out


def _layout_key(desc: dict | None, shape: tuple) -> tuple:
    """What a leaf's boxes and writers depend on (many leaves share it)."""
    if not desc:
        return (None, shape)
    return (desc.get("type"), desc.get("device_id"), tuple(desc.get("device_ids", ())),
            tuple(desc.get("mesh_shape", ())), tuple(desc.get("axis_names", ())),
            repr(desc.get("spec")), shape)


def _held(desc: dict | None, shape: tuple, writer_of: Mapping[int, int],
          mine: Collection[int]) -> dict[Box, int] | None:
    """Box -> writer of each box the devices `mine` hold of one leaf layout."""
    if not desc or desc.get("type") not in ("named", "single_device"):
        return None
    if desc["type"] == "single_device":
        d = desc["device_id"]
        full = (tuple(0 for _ in shape), tuple(shape))
        if d not in writer_of:
            return None
        return {full: writer_of[d]} if d in mine else {}
    try:
        sharding = rebuild(desc)
        indices = sharding.devices_indices_map(shape) if sharding is not None else None
        if indices is None or len(indices) != len(desc["device_ids"]):  # a device twice
            return None
        # the first device in the map's order holding a box is its replica 0
        first: dict[Box, int] = {}
        held = set()
        for device, index in indices.items():
            box = index_to_box(index, shape)
            first.setdefault(box, int(device.id))  # type: ignore[attr-defined]
            if int(device.id) in mine:  # type: ignore[attr-defined]
                held.add(box)
    except Exception:  # noqa: BLE001 - a hostile description may make jax raise
        return None     # anything: the caller reads every manifest instead
    if any(first[b] not in writer_of for b in held):
        return None
    return {b: writer_of[first[b]] for b in held}


def confirmed(wanted: Wanted, read: Mapping[int, Manifest]) -> bool:
    """Whether each writer's manifest in `read` (writer label -> its manifest
    of the save) lists every box `wanted` says it wrote."""
    for w, boxes in wanted.items():
        m = read.get(w)
        if m is None:
            return False
        listed = {(ii, li, (c.offsets, c.sizes)) for ii, it in enumerate(m.items)
                  for li, leaf in enumerate(it.leaves) for c in leaf.chunks}
        if not boxes <= listed:
            return False
    return True
