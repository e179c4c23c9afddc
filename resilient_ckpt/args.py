"""Translating Orbax's `args` objects into items, and back into results.

The manager speaks Orbax's checkpoint-args protocol (StandardSave/Restore,
PyTreeSave/Restore, JsonSave/Restore, Composite); this module reads those
objects by type name so users pass Orbax's own classes unchanged.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from .errors import UnsupportedArgsError

DEFAULT_ITEM = "default"
_PYTREE_SAVE = ("StandardSave", "PyTreeSave")
_PYTREE_RESTORE = ("StandardRestore", "PyTreeRestore")


@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    kind: str  # "pytree" or "json"
    item: Any = None  # target tree (abstract or concrete), or None
    restore_args: Any = None
    partial: bool = False


def _name(a: Any) -> str:
    n = type(a).__name__
    return n[:-4] if n.endswith("Args") else n


def _is_composite(a: Any) -> bool:
    return any(c.__name__ == "Composite" for c in type(a).__mro__)


def save_items(args: Any) -> tuple[list[tuple[str, str, Any]], bool]:
    """[(item name, kind, value)] and whether the save was a Composite."""
    if _is_composite(args):
        out = []
        for name, a in args.items():
            if a is None:
                continue
            out.append(_save_item(name, a))
        return out, True
    return [_save_item(DEFAULT_ITEM, args)], False


def _save_item(name: str, a: Any) -> tuple[str, str, Any]:
    if _name(a) in _PYTREE_SAVE:
        return (name, "pytree", a.item)
    if _name(a) == "JsonSave":
        try:
            json.dumps(a.item, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"item {name!r}: JsonSave needs JSON-serializable data "
                            f"({e})") from None
        return (name, "json", a.item)
    raise UnsupportedArgsError(f"item {name!r}: unsupported save args {_name(a)}; use "
                               "StandardSave, PyTreeSave or JsonSave")


def restore_requests(args: Any) -> tuple[dict[str, RestoreRequest] | None, bool]:
    """Per item, what to restore; None means every item as saved."""
    if args is None:
        return None, False
    if _is_composite(args):
        return {name: _restore_item(a) for name, a in args.items()}, True
    return {DEFAULT_ITEM: _restore_item(args)}, False


def _restore_item(a: Any) -> RestoreRequest:
    if a is None:
        return RestoreRequest("any")
    if _name(a) in _PYTREE_RESTORE:
        return RestoreRequest("pytree", getattr(a, "item", None),
                              getattr(a, "restore_args", None),
                              bool(getattr(a, "partial_restore", False)))
    if _name(a) == "JsonRestore":
        return RestoreRequest("json")
    raise UnsupportedArgsError(f"unsupported restore args {_name(a)}; use StandardRestore, "
                               "PyTreeRestore or JsonRestore")


def composite(values: dict[str, Any]) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.Composite(**values)
