"""Index arithmetic and sharding descriptions.

A chunk or a target shard is a box: per dimension an offset and a size in the
global array. This module turns jax shard indices into boxes, intersects boxes,
and writes / rebuilds the JSON description of a jax sharding kept in manifests.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def index_to_box(index: tuple, shape: Sequence[int]) -> Box:
    """A jax shard index (a tuple of slices) as (offsets, sizes)."""
    offs, sizes = [], []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        offs.append(start)
        sizes.append(max(0, stop - start))
    return tuple(offs), tuple(sizes)


def box_to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*box, strict=False))


def intersect(a: Box, b: Box) -> Box | None:
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=False):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that select `inner` (global coordinates) inside `outer`."""
    return tuple(slice(io - oo, io - oo + s)
                 for io, oo, s in zip(inner[0], outer[0], inner[1], strict=False))


def box_elements(box: Box) -> int:
    return int(math.prod(box[1]))  # much quicker than np.prod on a few ints


def describe(sharding: jax.sharding.Sharding) -> dict:
    """A JSON description of a sharding, enough to rebuild it on the same
    devices. The leaves of one mesh share its lists (`_mesh_lists`): never
    change a description in place."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        axes, shape, ids = _mesh_lists(sharding.mesh)
        spec = [list(p) if isinstance(p, tuple) else p for p in sharding.spec]
        return {"type": "named", "axis_names": axes, "mesh_shape": shape,
                "device_ids": ids, "spec": spec}
    # jaxlib ships no stubs for _jax, so jax's Device type is unresolved.
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (d,) = sharding.device_set
        return {"type": "single_device", "device_id": int(d.id)}  # type: ignore[attr-defined]
    return {"type": "other",
            "device_ids": sorted(int(d.id) for d in sharding.device_set),  # type: ignore[attr-defined]
            "repr": repr(sharding)[:200]}


@functools.lru_cache(maxsize=64)
def _mesh_lists(mesh: jax.sharding.Mesh) -> tuple[list[str], list[int], list[int]]:
    """A mesh's axis names, shape and device ids, made once per mesh: on
    thousands of hosts a mesh has tens of thousands of devices, and a state a
    thousand leaves (jax hashes a mesh once)."""
    return (list(mesh.axis_names), list(mesh.devices.shape),
            [int(d.id) for d in mesh.devices.flat])


def rebuild(desc: dict | None, meshes: dict | None = None) -> jax.sharding.Sharding | None:
    """The described sharding on this job's devices, or None when any of its
    devices is gone (or it cannot be rebuilt) and the caller must choose one.
    `meshes`: the caller's memo of the meshes rebuilt (one per mesh, where the
    leaves of a manifest share their mesh's lists) for as long as the devices
    do not change, as in one restore."""
    if not desc:
        return None
    if desc["type"] == "single_device":
        d = {d.id: d for d in jax.devices()}.get(desc["device_id"])
        return jax.sharding.SingleDeviceSharding(d) if d is not None else None
    if desc["type"] != "named":
        return None
    lists = (desc["device_ids"], desc["mesh_shape"], desc["axis_names"])
    key = tuple(map(id, lists))
    held = meshes.get(key) if meshes is not None else None
    # (the memo keeps the lists its key names alive: no id is reused meanwhile)
    if held is None or any(a is not b for a, b in zip(held[0], lists, strict=True)):
        held = (lists, _mesh(desc))
        if meshes is not None:
            meshes[key] = held
    mesh = held[1]
    if mesh is None:
        return None
    spec = jax.sharding.PartitionSpec(
        *[tuple(p) if isinstance(p, list) else p for p in desc["spec"]])
    return jax.sharding.NamedSharding(mesh, spec)


def _mesh(desc: dict) -> jax.sharding.Mesh | None:
    """A named description's mesh on this job's devices; None where one is gone."""
    by_id = {d.id: d for d in jax.devices()}
    ids = desc["device_ids"]
    if any(i not in by_id for i in ids):
        return None
    # (np.fromiter: np.array of a list of devices probes each as a sequence,
    # 40 times slower at thousands of devices)
    devs = np.fromiter((by_id[i] for i in ids), dtype=object, count=len(ids))
    return jax.sharding.Mesh(devs.reshape(desc["mesh_shape"]), tuple(desc["axis_names"]))
