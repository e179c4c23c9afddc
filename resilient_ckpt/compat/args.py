"""Translating Orbax's `args` objects into items, and back into results.

The manager speaks Orbax's checkpoint-args protocol; this module reads those
objects by type name so users pass Orbax's own classes unchanged. Supported:
StandardSave/Restore, PyTreeSave/Restore, JsonSave/Restore, Composite, and the
one-value handlers' args, ArraySave/Restore, JaxRandomKeySave/Restore and
NumpyRandomKeySave/Restore, whose value is kept as a pytree item of one leaf
(or of the key's parts). ProtoSave/Restore and args of handlers registered by
users are refused with an error naming the item, the class and what to use.
It also owns the constructor's `item_names` (which Composite items a manager
may save and restore) and the item mode (`ItemMode`: whether its calls take
single-item args or Composite args).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from ..core import layout
from ..errors import ItemNotFoundError, UnsupportedArgsError

DEFAULT_ITEM = "default"
_PYTREE_SAVE = ("StandardSave", "PyTreeSave")
_PYTREE_RESTORE = ("StandardRestore", "PyTreeRestore")
# Args of Orbax's one-value handlers: the value is saved as a pytree item.
_VALUE_SAVE = ("ArraySave", "JaxRandomKeySave", "NumpyRandomKeySave")
_VALUE_RESTORE = ("ArrayRestore", "JaxRandomKeyRestore", "NumpyRandomKeyRestore")
_SUPPORTED_SAVE = "StandardSave, PyTreeSave, JsonSave, ArraySave, JaxRandomKeySave or " \
    "NumpyRandomKeySave"
_SUPPORTED_RESTORE = "StandardRestore, PyTreeRestore, JsonRestore, ArrayRestore, " \
    "JaxRandomKeyRestore or NumpyRandomKeyRestore"
_INSTEAD = {
    "ProtoSave": "save the message as JsonSave(json_format.MessageToDict(msg)) "
                 "(google.protobuf.json_format)",
    "ProtoRestore": "restore it with JsonRestore() and rebuild the message with "
                    "json_format.ParseDict(data, MessageClass())",
}


# Orbax's own first words for the same mistakes: ours follow them, so code and
# tests that match Orbax's message match ours too.
ORBAX_NEEDS_COMPOSITE = ("Must provide `args` of type `Composite` when dealing with "
                         "multiple checkpointable objects.")
ORBAX_NO_COMPOSITE = ("Cannot provide `args` of type `Composite` when dealing with a "
                      "single, unnamed (default) checkpointable object.")
ORBAX_ITEMS_ARE_ARGS = "Found an instance of `CheckpointArgs` provided for `items`."


def orbax_unregistered(name: str, a: Any) -> str:
    return f'Item "{name}" and args "{_name(a)}" does not match with any registered handler!'


@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    kind: str  # "pytree" or "json"
    item: Any = None  # target tree (abstract or concrete), or None
    restore_args: Any = None
    partial: bool = False
    # A NumpyRandomKeyRestore: a legacy (tuple) key comes back as a tuple.
    as_tuple: bool = False

    def finish(self, value: Any) -> Any:
        return tuple(value) if self.as_tuple and isinstance(value, list) else value


def _name(a: Any) -> str:
    n = type(a).__name__
    return n[:-4] if n.endswith("Args") else n


def _is_composite(a: Any) -> bool:
    return any(c.__name__ == "Composite" for c in type(a).__mro__)


def declared_items(item_names: Any, item_handlers: Any) -> frozenset[str] | None:
    """The Composite items a manager may save and restore, as Orbax reads its
    constructor: `item_names` and the names of an `item_handlers` mapping;
    None (any item) when neither is given."""
    if item_names is None and not isinstance(item_handlers, dict):
        return None
    return frozenset(item_names or ()) | frozenset(
        item_handlers if isinstance(item_handlers, dict) else ())


class ItemMode:
    """Orbax's item mode: once set, a manager's save and restore args are all
    single-item or all `Composite`, and the other kind raises ValueError.

    Set at open by `item_names` or `item_handlers` (a mapping: Composite; one
    handler: single) or by legacy `checkpointers`; else by the first save (its
    args' kind) or the first restore or step metadata (Composite unless the
    step holds an item named "default", as Orbax reads a step; a step that is
    not there sets nothing, where Orbax reads it as Composite: the manager's
    `_composite_step`). `lock=False` (the option `lock_item_mode`) sets and
    checks nothing.
    """

    def __init__(self, lock: bool, checkpointers: Any = None, item_names: Any = None,
                 item_handlers: Any = None):
        self.lock = lock
        self.composite: bool | None = None  # unset
        # Legacy `checkpointers={name: Checkpointer(handler)}`: each item's
        # args kind ("Standard", "Json", ...), for the legacy `items=` form.
        self.legacy: dict[str, str] | None = None
        if checkpointers is not None:
            self.composite = isinstance(checkpointers, Mapping)
            if self.composite:
                self.legacy = {k: _legacy_kind(k, c) for k, c in checkpointers.items()}
        elif item_names is not None or item_handlers is not None:
            self.composite = item_handlers is None or isinstance(item_handlers, Mapping)

    def save_args(self, args: Any, items: Any) -> Any:
        """A save's args (legacy `items=` as StandardSave), after setting the
        mode from them if unset and checking them against it."""
        _items_not_args(items, "save")
        if self.lock and (args is not None or items is not None):
            if self.composite is None:
                self.composite = args is not None and _is_composite(args)
            self._check(args, "save")
        if self.legacy is not None and args is None and items is not None:
            return self._legacy_composite(items, "Save")
        return legacy_args(args, items, "StandardSave")

    def restore_args(self, args: Any, items: Any,
                     step_is_composite: Callable[[], bool | None]) -> Any:
        """A restore's args (legacy `items=` as StandardRestore; None for
        every item as saved), after setting the mode if unset from the step
        read (`step_is_composite`, None when there is none) and checking them."""
        _items_not_args(items, "restore")
        if self.lock:
            if self.composite is None:
                self.composite = step_is_composite()
            self._check(args, "restore")
        if self.legacy is not None and args is None and items is not None:
            return self._legacy_composite(items, "Restore")
        return legacy_args(args, items, "StandardRestore")

    def _legacy_composite(self, items: Any, what: str) -> Any:
        """The legacy `items` of a manager made with a mapping of
        checkpointers, as `ocp.args.Composite` of each item's args kind."""
        import orbax.checkpoint as ocp
        if not isinstance(items, Mapping):
            raise ValueError(f"{what.lower()}: this manager was created with checkpointers "
                             f"for items {sorted(self.legacy or {})}: pass `items` as a dict "
                             f"of them, or args=ocp.args.Composite(...)")
        kinds = self.legacy or {}
        unknown = sorted(set(items) - set(kinds))
        if unknown:
            raise ValueError(f"{what.lower()}: items {unknown} have no checkpointer in this "
                             f"manager (items: {sorted(kinds)})")
        return ocp.args.Composite(**{
            name: getattr(ocp.args, kinds[name] + what)(value)
            for name, value in items.items()
            if what == "Restore" or value is not None})

    def _check(self, args: Any, what: str) -> None:
        if args is None or self.composite is None or _is_composite(args) == self.composite:
            return
        if self.composite:
            raise ValueError(
                f"{ORBAX_NEEDS_COMPOSITE} {what} got {_name(args)}, but this manager "
                "works with Composite args "
                "(set by item_names, or by its first save or restore): pass "
                "ocp.args.Composite(<item name>=...), or create the manager with "
                "CheckpointManagerOptions(lock_item_mode=False) to mix both kinds")
        raise ValueError(
            f"{ORBAX_NO_COMPOSITE} {what} got Composite args, but this manager works "
            "with single-item args "
            "(set by its first save or restore): pass one args object such as "
            "ocp.args.StandardSave(state), or create the manager with "
            "CheckpointManagerOptions(lock_item_mode=False) to mix both kinds")


# Orbax's handlers (by class name, a subclass counts) -> the args kind that
# stands for them in the legacy mapping of checkpointers.
_LEGACY_HANDLERS = {"JsonCheckpointHandler": "Json", "ArrayCheckpointHandler": "Array",
                    "StandardCheckpointHandler": "Standard", "PyTreeCheckpointHandler": "PyTree",
                    "JaxRandomKeyCheckpointHandler": "JaxRandomKey",
                    "NumpyRandomKeyCheckpointHandler": "NumpyRandomKey"}


def _legacy_kind(name: str, checkpointer: Any) -> str:
    """The args kind of a legacy checkpointer's handler (UnsupportedArgsError
    naming the item for another handler)."""
    handler = given = getattr(checkpointer, "handler", None)
    for _ in range(4):  # Orbax wraps a handler without registered args in one of its own
        for c in type(handler).__mro__:
            if c.__name__ in _LEGACY_HANDLERS:
                return _LEGACY_HANDLERS[c.__name__]
        handler = getattr(handler, "_handler", None)
    raise UnsupportedArgsError(
        f"item {name!r}: a checkpointer of {type(given).__name__} is not supported by "
        f"resilient_ckpt; give each item a Checkpointer of {sorted(_LEGACY_HANDLERS)}, or "
        "pass item_names and save with ocp.args.Composite")


def _items_not_args(items: Any, what: str) -> None:
    """Args passed where the legacy `items` go (positionally, without args=)."""
    if any(c.__name__ == "CheckpointArgs" for c in type(items).__mro__):
        raise ValueError(f"{ORBAX_ITEMS_ARE_ARGS} {what}() got {_name(items)} as `items` "
                         f"(its second positional argument): pass it by keyword, "
                         f"{what}(step, args=...)")


def legacy_args(args: Any, items: Any, kind: str) -> Any:
    """Orbax's legacy `items=` form as `ocp.args.<kind>(items)`; a save needs one."""
    if args is not None or (items is None and kind.endswith("Restore")):
        return args
    if items is None:
        raise ValueError("save needs args=, e.g. args=ocp.args.StandardSave(state)")
    import orbax.checkpoint as ocp
    return getattr(ocp.args, kind)(items)


def _require_composite(args: Any, declared: frozenset[str] | None, what: str) -> None:
    if declared is not None and args is not None and not _is_composite(args):
        raise ValueError(f"{ORBAX_NEEDS_COMPOSITE} {what} got {_name(args)}, but this "
                         "manager was created with "
                         f"item_names={sorted(declared)}: pass ocp.args.Composite("
                         "<item name>=...) naming the items")


def save_items(args: Any, declared: frozenset[str] | None = None
               ) -> tuple[list[tuple[str, str, Any]], bool]:
    """[(item name, kind, value)] and whether the save was a Composite.
    With `declared` (the constructor's item_names), every item must be one."""
    _require_composite(args, declared, "save")
    if _is_composite(args):
        out = []
        for name, a in args.items():
            layout.check_item_name(name, "save")
            if a is None:
                continue
            if declared is not None and name not in declared:
                raise ValueError(f"{orbax_unregistered(name, a)} save: item {name!r} "
                                 f"({_name(a)}) is not one of the "
                                 f"item_names this manager was created with "
                                 f"({sorted(declared)}); add it to item_names")
            out.append(_save_item(name, a))
        return out, True
    return [_save_item(DEFAULT_ITEM, args)], False


def check_restore_items(step: int, saved: list[str], requests: dict[str, Any] | None,
                        declared: frozenset[str] | None) -> None:
    """A restore of `step` (items `saved`) by a manager with item_names
    `declared`: an item the step lacks is a KeyError (ItemNotFoundError, as
    Orbax), one it holds but that is not declared a ValueError (all saved
    items, when no args name them)."""
    asked = list(saved) if requests is None else list(requests)
    for name in asked:
        if name not in saved:
            raise ItemNotFoundError(f"step {step} has no item {name!r} (items: {saved})")
    undeclared = [n for n in asked if declared is not None and n not in declared]
    if undeclared:
        raise ValueError(f"restore of step {step}: items {undeclared} are not among the "
                         f"item_names this manager was created with ({sorted(declared or ())})"
                         "; add them to item_names, or name only declared items in "
                         "ocp.args.Composite")


def _save_item(name: str, a: Any) -> tuple[str, str, Any]:
    if _name(a) in _PYTREE_SAVE:
        return (name, "pytree", a.item)
    if _name(a) in _VALUE_SAVE:
        return (name, "pytree", _one_value(name, a))
    if _name(a) == "JsonSave":
        try:
            json.dumps(a.item, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"item {name!r}: JsonSave needs JSON-serializable data "
                            f"({e})") from None
        return (name, "json", a.item)
    raise _unsupported(name, a, "save", _SUPPORTED_SAVE)


def _unsupported(name: str, a: Any, what: str, supported: str) -> UnsupportedArgsError:
    instead = _INSTEAD.get(_name(a), f"use {supported}")
    return UnsupportedArgsError(
        f"item {name!r}: {what} args {type(a).__module__}.{type(a).__qualname__} "
        f"({_name(a)}) are not supported by resilient_ckpt; {instead}")


def _one_value(name: str, a: Any) -> Any:
    """The value of a one-value handler's save args, checked as Orbax's handler
    checks it (a TypeError for a value it would not save)."""
    import jax
    import numpy as np
    v, kind = a.item, _name(a)
    if kind == "ArraySave":
        ok = isinstance(v, (np.ndarray, np.generic, jax.Array, int, float)) \
            and not isinstance(v, bool)
    elif kind == "JaxRandomKeySave":
        ok = isinstance(v, jax.Array)
    else:  # NumpyRandomKeySave: np.random.get_state() or a bit generator's state
        ok = isinstance(v, (tuple, dict))
    if not ok:
        raise TypeError(f"item {name!r}: {kind} cannot save a {type(v).__name__}; "
                        "save a tree with StandardSave instead")
    return v


def restore_requests(args: Any, declared: frozenset[str] | None = None
                     ) -> tuple[dict[str, RestoreRequest] | None, bool]:
    """Per item, what to restore; None means every item as saved."""
    _require_composite(args, declared, "restore")
    if args is None:
        return None, False
    if _is_composite(args):
        return {name: _restore_item(name, a) for name, a in args.items()}, True
    return {DEFAULT_ITEM: _restore_item(DEFAULT_ITEM, args)}, False


def _restore_item(name: str, a: Any) -> RestoreRequest:
    if a is None:
        return RestoreRequest("any")
    if _name(a) in _PYTREE_RESTORE:
        return RestoreRequest("pytree", getattr(a, "item", None),
                              getattr(a, "restore_args", None),
                              bool(getattr(a, "partial_restore", False)))
    if _name(a) in _VALUE_RESTORE:  # their `item` is unused in Orbax too
        return RestoreRequest("pytree", None, getattr(a, "restore_args", None),
                              as_tuple=_name(a) == "NumpyRandomKeyRestore")
    if _name(a) == "JsonRestore":
        return RestoreRequest("json")
    raise _unsupported(name, a, "restore", _SUPPORTED_RESTORE)


def restored_trees(restored: Any) -> list:
    """The item values of what a restore returned (a Composite's, or itself)."""
    return list(restored.values()) if _is_composite(restored) else [restored]


def composite(values: dict[str, Any]) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.Composite(**values)
