"""Which writer of a save holds which box, worked back from its records.

On a tier the whole job sees, a save writes replica 0 of each box of a jax
leaf from the process whose device holds it (jax's replica ids: in the
order of the mesh's devices, the first device holding a box is replica 0),
and the numpy leaves from the first writer (`save.snapshot`,
`describe_items`). A manifest from version 5 on says which writer each of
the saving job's devices belonged to (`runs_of` writes it, `Manifest.writers`).
From one writer's manifest of a save, then, `covering` says which writers
wrote the saved boxes that any target boxes overlap (a restore onto another
layout, or by a job of another shape, reads those writers' manifests only),
and `needed`, for a manifest without that table, which writers wrote the
boxes one process's devices hold, from the current job's device -> writer
map (a restore of the same shape). The boxes of a layout are worked out
from its description alone (`_Layout`), whether or not its devices still
exist. A prediction is only a guess (a manifest may say what is not so):
`confirmed` checks it against the manifests read, and the caller reads
every manifest where it fails.
"""
from __future__ import annotations

import functools
import math
import types
from collections.abc import Collection, Mapping, Sequence

import jax
import numpy as np

from .manifest import Manifest, WriterRuns
from .sharding import Box

Wanted = dict[int, set[tuple[int, int, Box]]]  # writer -> (item, leaf, box) it wrote
Wants = Mapping[tuple[int, int], Sequence[Box]]  # (item, leaf) -> target boxes


def runs_of(live: Sequence[int]) -> WriterRuns:
    """The `writers` runs of a save by the processes `live` (jax indices,
    ascending; each one's label its rank among them): every device of
    theirs, by id."""
    return _runs(tuple(live), tuple((int(d.id), int(d.process_index))
                                    for d in jax.devices()))


@functools.lru_cache(maxsize=8)
def _runs(live: tuple[int, ...], devices: tuple[tuple[int, int], ...]) -> WriterRuns:
    label = {q: r for r, q in enumerate(live)}
    out: list[list[int]] = []
    for d, q in sorted(devices):
        if q not in label:
            continue
        if out and out[-1][0] + out[-1][1] == d and out[-1][2] == label[q]:
            out[-1][1] += 1
        else:
            out.append([d, 1, label[q]])
    return tuple((a, b, c) for a, b, c in out)


@functools.lru_cache(maxsize=8)
def writer_map(runs: WriterRuns) -> Mapping[int, int]:
    """Device id -> writer label of a manifest's `writers` runs (read-only:
    one map serves every call on the same runs)."""
    return types.MappingProxyType({d: w for first, n, w in runs
                                   for d in range(first, first + n)})


class _Layout:
    """The boxes of one saved leaf layout (a description and a shape), each
    with its replica-0 device, from the description alone."""

    def __init__(self, boxes: list[Box], first: list[int], box_of: dict[int, int]):
        self.boxes, self.first, self.box_of = boxes, first, box_of  # box_of: device -> index
        n = len(boxes[0][0]) if boxes else 0
        self.lo = np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), n)
        self.hi = self.lo + np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), n)

    def overlapping(self, box: Box) -> np.ndarray:
        """Indices of the boxes `box` overlaps (shares an element with)."""
        lo, hi = np.array(box[0], np.int64), np.array(box[0], np.int64) + box[1]
        return np.flatnonzero(np.all((self.lo < hi) & (lo < self.hi), axis=1)
                              & np.all(self.hi > self.lo, axis=1))


def _layout_of(desc: dict | None, shape: tuple) -> _Layout | None:
    """A leaf layout's boxes; None for a description this cannot work out
    (not named or single-device, a device twice, a dimension its mesh axes
    do not divide, anything malformed)."""
    if not desc or desc.get("type") not in ("named", "single_device"):
        return None
    full = (tuple(0 for _ in shape), tuple(shape))
    if desc["type"] == "single_device":
        return _Layout([full], [int(desc["device_id"])], {int(desc["device_id"]): 0})
    try:
        mesh, axes = list(desc["mesh_shape"]), list(desc["axis_names"])
        ids = np.asarray(desc["device_ids"], np.int64)
        if len(set(ids.tolist())) != ids.size or ids.size != math.prod(mesh):
            return None
        coords = np.indices(mesh).reshape(len(mesh), -1)  # each device's place, flat order
        spec = list(desc["spec"]) + [None] * (len(shape) - len(desc["spec"]))
        blocks, sizes, parts = [], [], []
        for n, p in zip(shape, spec, strict=True):
            names = [] if p is None else [p] if isinstance(p, str) else list(p)
            block = np.zeros(ids.size, np.int64)
            count = 1
            for a in names:
                k = axes.index(a)
                block, count = block * mesh[k] + coords[k], count * mesh[k]
            if n % count:
                return None
            blocks.append(block)
            sizes.append(n // count)
            parts.append(count)
        key = (np.ravel_multi_index(blocks, parts) if shape else np.zeros(ids.size, np.int64))
        _, first_at, which = np.unique(key, return_index=True, return_inverse=True)
    except (KeyError, TypeError, ValueError, IndexError):  # a hostile description
        return None
    boxes = [(tuple(int(b[f]) * s for b, s in zip(blocks, sizes, strict=True)), tuple(sizes))
             for f in first_at.tolist()]
    return _Layout(boxes, [int(ids[f]) for f in first_at.tolist()],
                   dict(zip(ids.tolist(), which.ravel().tolist(), strict=True)))


def covering(m: Manifest, wants: Wants) -> Wanted | None:
    """Per writer label, the saved boxes (item index, leaf index, box) of
    `m`'s save that the target boxes `wants` names overlap, numpy leaves'
    from writer 0; None where `m` does not say which writer each device was
    (a manifest before version 5), or a leaf's layout cannot be worked out
    or names a device the table lacks."""
    if not m.writers:
        return None
    writer_of = writer_map(m.writers)
    out: Wanted = {}
    layouts: dict[tuple, _Layout | None] = {}
    hits: dict[tuple, list[tuple[int, Box]] | None] = {}  # (layout, targets) -> writer, box
    for (ii, li), targets in wants.items():
        if not (0 <= ii < len(m.items) and 0 <= li < len(m.items[ii].leaves)):
            return None
        leaf = m.items[ii].leaves[li]
        if leaf.kind in ("numpy", "numpy_scalar"):
            out.setdefault(0, set()).add((ii, li, (tuple(0 for _ in leaf.shape),
                                                   tuple(leaf.shape))))
            continue
        if leaf.kind not in ("array", "prng_key"):
            continue
        key = _layout_key(leaf.sharding, leaf.shape)
        if key not in layouts:
            layouts[key] = _layout_of(leaf.sharding, tuple(leaf.shape))
        if any(len(t[0]) != len(leaf.shape) or len(t[1]) != len(leaf.shape) for t in targets):
            return None  # boxes of another rank: not this leaf's targets
        hit = (key, tuple(targets))
        if hit not in hits:
            hits[hit] = _overlapped(layouts[key], targets, writer_of)
        found = hits[hit]
        if found is None:
            return None
        for w, box in found:
            out.setdefault(w, set()).add((ii, li, box))
    return out


def _overlapped(lay: _Layout | None, targets: Sequence[Box], writer_of: Mapping[int, int]
                ) -> list[tuple[int, Box]] | None:
    """(writer, saved box) of each box of `lay` some target box overlaps."""
    if lay is None:
        return None
    out = []
    for j in sorted({j for t in targets for j in lay.overlapping(t).tolist()}):
        w = writer_of.get(lay.first[j])
        if w is None:
            return None
        out.append((w, lay.boxes[j]))
    return out


def needed(m: Manifest, writer_of: Mapping[int, int], mine: Collection[int]) -> Wanted | None:
    """Per writer label, the boxes of `m`'s leaves (item index, leaf index,
    box) that the devices `mine` hold under the shardings the leaves were
    saved with and that writer wrote, numpy leaves from writer 0. None when
    it cannot be worked out: a leaf saved with a sharding other than a named
    or a single-device one, on a device whose writer `writer_of` (device id
    -> writer label) does not know, or a description that cannot be worked
    out."""
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
                layouts[key] = _held(_layout_of(leaf.sharding, tuple(leaf.shape)),
                                     writer_of, mine)
            held = layouts[key]
            if held is None:
                return None
            for box, w in held.items():
                out.setdefault(w, set()).add((ii, li, box))
    return out


def _layout_key(desc: dict | None, shape: tuple) -> tuple:
    """What a leaf's boxes and writers depend on (many leaves share it),
    within one call on one manifest: its meshes' lists by identity (the
    leaves of a mesh share them, and the manifest keeps them alive), as a
    mesh of thousands of devices costs more to hash than the leaf."""
    if not desc:
        return (None, tuple(shape))
    return (desc.get("type"), desc.get("device_id"), id(desc.get("device_ids")),
            id(desc.get("mesh_shape")), id(desc.get("axis_names")), repr(desc.get("spec")),
            tuple(shape))


def _held(lay: _Layout | None, writer_of: Mapping[int, int], mine: Collection[int]
          ) -> dict[Box, int] | None:
    """Box -> writer of each box the devices `mine` hold of one leaf layout."""
    if lay is None:
        return None
    if any(f not in writer_of for f in lay.first):  # a save on devices this job lacks
        return None
    held = {lay.box_of[d] for d in mine if d in lay.box_of}
    return {lay.boxes[j]: writer_of[lay.first[j]] for j in held}


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
