"""The meshes of the elastic loop: which one to go on with, and how to name one.

This module owns the default mesh policy (`shrink_data_axis`: keep every other
axis whole, shrink the data axis to its whole rows) and the small keys the
loop records and caches meshes by (device ids, axis sizes).
"""
from __future__ import annotations

from collections.abc import Callable, Collection

import jax
import numpy as np
from jax.sharding import Mesh

# choose_mesh(healthy devices, full mesh) -> the mesh to go on with, or None: wait.
ChooseMesh = Callable[[Collection[jax.Device], Mesh], "Mesh | None"]


def shrink_data_axis(healthy: Collection[jax.Device], mesh: Mesh,
                     data_axis: str = "data", divisor: bool = True) -> Mesh | None:
    """The default mesh policy: keep every other axis whole and shrink `data_axis`.

    Keeps the rows along `data_axis` (model-parallel groups, as laid out in
    `mesh`) whose devices are all healthy, as many as the largest divisor of the
    original data size allows (so a global batch that divided the old data axis
    divides the new one), in their original order; with `divisor=False`, every
    whole row (so that with several processes each survivor keeps its devices
    in the mesh; the state's sharded sizes must then divide by the rows left).
    None when no row is whole.
    """
    axis = mesh.axis_names.index(data_axis)
    rows = np.moveaxis(mesh.devices, axis, 0)
    whole = [i for i in range(rows.shape[0]) if all(d in healthy for d in rows[i].flat)]
    size = rows.shape[0]
    n = max((k for k in range(1, len(whole) + 1) if size % k == 0 or not divisor), default=0)
    if n == 0:
        return None
    return Mesh(np.moveaxis(rows[whole[:n]], 0, axis), mesh.axis_names)


def mesh_ids(mesh: Mesh | None) -> tuple[int, ...]:
    """The mesh's device ids, sorted (empty for no mesh)."""
    return tuple(sorted(d.id for d in mesh.devices.flat)) if mesh is not None else ()


def mesh_shape(mesh: Mesh | None) -> dict:
    """Axis name -> size (empty for no mesh)."""
    return dict(mesh.shape) if mesh is not None else {}


def mesh_key(mesh: Mesh) -> tuple:
    """What tells two meshes apart: axis names, shape and devices in order."""
    return (tuple(mesh.axis_names), mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))


def shape_str(shape: dict) -> str:
    """"data=2xmodel=2", or "-" for no shape."""
    return "x".join(f"{k}={v}" for k, v in shape.items()) or "-"
