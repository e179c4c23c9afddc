"""Pytrees in and out: key paths, leaf kinds, and matching a restore target.

Flattening turns a user's tree into (path, leaf) pairs with JSON-able paths and
tells each leaf's kind (jax array, typed PRNG key, numpy array or scalar, Python
scalar, None). Rebuilding puts restored leaves back into the target's structure,
or, with no target, into nested dicts and lists taken from the saved paths.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import TargetMismatchError
from .manifest import PathEntry, path_str

# Orbax's `ocp.PLACEHOLDER`: a target leaf that is not read and comes back as is.
PLACEHOLDER = ...


def _is_leaf(x: Any) -> bool:
    return x is None


def _entry(k: Any) -> PathEntry:
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        key = k.key
        return ("key", key if isinstance(key, (str, int)) and not isinstance(key, bool)
                else str(key))
    if isinstance(k, tu.SequenceKey):
        return ("index", k.idx)
    if isinstance(k, tu.GetAttrKey):
        return ("attr", k.name)
    if isinstance(k, tu.FlattenedIndexKey):
        return ("index", k.key)
    return ("key", str(k))


def flatten(tree: Any) -> tuple[list[tuple[tuple[PathEntry, ...], Any]], Any]:
    """(path, leaf) pairs in jax's leaf order, and the treedef."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    out = [(tuple(_entry(k) for k in path), leaf) for path, leaf in pairs]
    seen: set = set()
    for path, _ in out:
        if path in seen:
            raise ValueError(f"two leaves share the key path {path_str(path)}")
        seen.add(path)
    return out, treedef


def leaf_kind(leaf: Any, path: tuple[PathEntry, ...]) -> str:
    if leaf is None:
        return "none"
    if isinstance(leaf, jax.Array):
        return "prng_key" if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else "array"
    if isinstance(leaf, np.ndarray):
        return "numpy"
    if isinstance(leaf, np.generic):
        return "numpy_scalar"
    if isinstance(leaf, (bool, int, float, str)):
        return "scalar"
    raise TypeError(
        f"leaf {path_str(path)} is a {type(leaf).__name__}, which cannot be "
        "checkpointed; make it a jax or numpy array, a Python scalar or a "
        "string, or keep it in a JsonSave item")


def unflatten(treedef: Any, leaves: list[Any]) -> Any:
    return jax.tree_util.tree_unflatten(treedef, leaves)


def build_nested(pairs: list[tuple[tuple[PathEntry, ...], Any]]) -> Any:
    """Nested dicts (for keys and attributes) and lists (for indices)."""
    if len(pairs) == 1 and not pairs[0][0]:
        return pairs[0][1]
    root: dict = {}
    for path, value in pairs:
        node = root
        for kind, name in path[:-1]:
            node = node.setdefault((kind, name), {})
        node[path[-1]] = value

    def finish(node: Any) -> Any:
        if not isinstance(node, dict) or not node or not isinstance(next(iter(node)), tuple):
            return node
        if all(k[0] == "index" for k in node):
            return [finish(node[k]) for k in sorted(node, key=lambda k: k[1])]
        return {k[1]: finish(v) for k, v in node.items()}

    return finish(root)


def match_target(saved_paths: list[tuple[PathEntry, ...]],
                 target_paths: list[tuple[PathEntry, ...]], *, partial: bool,
                 where: str, placeholders: tuple = ()) -> list[int]:
    """For each target leaf, the index of the saved leaf it restores from.

    The `placeholders` (paths of PLACEHOLDER leaves, not in `target_paths`)
    are not read, but count as named by the target: a saved leaf there is not
    missing from it, and one the step lacks is no error. Raises
    TargetMismatchError naming the leaves that do not correspond.
    """
    # Orbax's own first words for a structure mismatch, so that code matching
    # its message matches ours.
    orbax = "User-provided restore item and on-disk value metadata tree structures do not match:"
    index = {p: i for i, p in enumerate(saved_paths)}
    missing = [path_str(p) for p in target_paths if p not in index]
    if missing:
        raise TargetMismatchError(
            f"{orbax} {where}: the restore target has leaves the checkpoint lacks: "
            f"{_some(missing)}; check the target's "
            "tree structure against item_metadata(step)")
    if not partial:
        tset = set(target_paths) | set(placeholders)
        extra = [path_str(p) for p in saved_paths if p not in tset]
        if extra:
            raise TargetMismatchError(
                f"{orbax} {where}: the checkpoint has leaves the restore target lacks: "
                f"{_some(extra)}; pass the full tree, "
                "or PyTreeRestore(..., partial_restore=True) to restore a subset")
    return [index[p] for p in target_paths]


def _some(names: list[str]) -> str:
    """The first few names, for an error message."""
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"
