"""What a step tells callers about itself, and what they hand in beside it.

Abstract item trees for `item_metadata` (ShapeDtypeStructs with the saved
shardings), the per-leaf `ArrayRestoreArgs` of a restore, and metrics and
custom metadata made plain JSON before they go into a manifest.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from orbax.checkpoint.metadata import RootMetadata as _OrbaxRootMetadata

from ..core.manifest import ItemRecord, Manifest, decode_scalar
from ..core.pytree import build_nested, flatten
from ..core.sharding import rebuild
from .args import DEFAULT_ITEM, composite


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """What `metadata(step)` returns, field for field as Orbax's."""

    step: int
    item_metadata: Any
    metrics: Any
    custom_metadata: Any
    time: float


class RootMetadata(_OrbaxRootMetadata):
    """What `metadata()` without a step returns: Orbax's RootMetadata (an
    `isinstance` check passes), equal to Orbax's with the same fields whichever
    side is asked (its `internal_metadata` is Orbax's own and holds nothing
    of ours)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _OrbaxRootMetadata):
            return NotImplemented
        return (self.custom_metadata, self.internal_metadata) == (
            other.custom_metadata, other.internal_metadata)

    __hash__ = None  # type: ignore[assignment]  # mutable, as Orbax's


def step_metadata(m: Manifest) -> StepMetadata:
    per_item = {it.name: abstract_item(it) for it in m.items}
    item_md = (per_item[DEFAULT_ITEM] if list(per_item) == [DEFAULT_ITEM]
               else composite(per_item))
    # Orbax's StepMetadata gives {} (not None) when there are none.
    return StepMetadata(m.step, item_md, {} if m.metrics is None else m.metrics,
                        {} if m.custom_metadata is None else m.custom_metadata, m.created)


def restore_arg_for(restore_args: Any, path) -> Any:
    """The ArrayRestoreArgs for a leaf, from a tree of them (or one for all)."""
    if restore_args is None:
        return None
    if hasattr(restore_args, "sharding"):
        return restore_args
    for p, leaf in flatten(restore_args)[0]:
        if p == path:
            return leaf
    return None


def abstract_item(item: ItemRecord) -> Any:
    """The item as saved, abstractly: ShapeDtypeStructs (with the saved
    sharding where its devices exist), scalar values, JSON values."""
    if item.kind == "json":
        return item.value
    pairs: list[tuple] = []
    meshes: dict = {}  # each saved mesh rebuilt once
    for lf in item.leaves:
        if lf.kind == "array":
            v = jax.ShapeDtypeStruct(lf.shape, jnp.dtype(lf.dtype),
                                     sharding=rebuild(lf.sharding, meshes))
        elif lf.kind == "prng_key":
            v = jax.ShapeDtypeStruct(lf.shape[:-1], jax.random.key(0, impl=lf.key_impl).dtype)
        elif lf.kind in ("numpy", "numpy_scalar"):
            v = jax.ShapeDtypeStruct(lf.shape, jnp.dtype(lf.dtype))
        elif lf.kind == "scalar":
            v = decode_scalar(lf.value)
        else:
            v = None
        pairs.append((lf.path, v))
    return build_nested(pairs)


def jsonable(x: Any) -> Any:
    """Metrics and metadata as plain JSON values (numpy and jax scalars become
    Python numbers); raises TypeError naming what cannot be stored."""
    def conv(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): conv(u) for k, u in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(u) for u in v]
        if isinstance(v, (jax.Array, np.ndarray, np.generic)):
            return np.asarray(v).tolist()
        return v

    if x is None:
        return None
    out = conv(x)
    try:
        json.dumps(out, allow_nan=True)
    except TypeError as e:
        raise TypeError(f"metrics/custom_metadata must be JSON-serializable: {e}") from None
    return out
