"""Strict reads of untrusted JSON: decoding with bounded nesting, and typed,
range-checked field access whose every error is a CorruptCheckpointError
naming the file and the field (`items[0].leaves[2].shape[1]`).

What the manifest parser is built on; it knows nothing of manifests itself.
An unknown field is an UnsupportedFormatError (the file is newer than this
reader), never skipped.
"""
from __future__ import annotations

import gc
import json
from collections.abc import Collection
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedFormatError

MAX_INT = 2**63 - 1  # the default bound of every integer field
MAX_VALUE_DEPTH = 100  # arrays/objects nested in a free JSON value (`shallow`)


def short(v: Any) -> str:
    """`v` for a message: short, and never a long walk of a large or deep value."""
    if isinstance(v, (dict, list)) and len(v) > 8:
        return f"a JSON {'object' if isinstance(v, dict) else 'array'} of {len(v)}"
    try:
        s = repr(v)
    except RecursionError:
        return "a deeply nested value"
    return s if len(s) <= 80 else s[:77] + "..."


class Reader:
    """Strict field access that names where in the file a problem is."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {msg}")

    def load(self, data: bytes) -> Any:
        """The JSON value of UTF-8 `data`; too deep, too large or not JSON is
        corrupt. No garbage collection runs during the parse: one that starts
        while a hostile file's nesting holds the parser at the recursion
        limit runs other objects' finalizers with no stack left, and they
        fail (unraisable RecursionErrors, seen as a flaky test)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return json.loads(data.decode("utf-8"))
        except RecursionError:
            raise self.fail("nested too deeply to be parsed; the file is corrupt") from None
        except MemoryError:
            raise self.fail("too large to parse; the file is corrupt") from None
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
            raise self.fail(f"not valid UTF-8 JSON ({e}); the file is torn or "
                            "corrupt") from None
        finally:
            if collecting:
                gc.enable()

    def obj(self, d: Any, ctx: str, fields: set[str]) -> dict:
        if not isinstance(d, dict):
            raise self.fail(f"{ctx} is not an object, got {short(d)}")
        missing, extra = fields - d.keys(), d.keys() - fields
        if extra:
            raise UnsupportedFormatError(
                f"{self.where}: {ctx} has unknown fields {sorted(extra)[:10]}; it was "
                "written by a newer resilient_ckpt: upgrade to read it")
        if missing:
            raise self.fail(f"{ctx} lacks fields {sorted(missing)}")
        return d

    def int_(self, v: Any, ctx: str, lo: int = 0, hi: int = MAX_INT) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise self.fail(f"{ctx} must be an integer in [{lo}, {hi}], got {short(v)}")
        return v

    def list_(self, v: Any, ctx: str, max_len: int | None = None) -> list:
        if not isinstance(v, list):
            raise self.fail(f"{ctx} must be a list, got {short(v)}")
        if max_len is not None and len(v) > max_len:
            raise self.fail(f"{ctx} has {len(v)} entries, more than {max_len}")
        return v

    def ints(self, v: Any, ctx: str, max_len: int | None = None, lo: int = 0,
             hi: int = MAX_INT) -> tuple[int, ...]:
        return tuple(self.int_(x, f"{ctx}[{i}]", lo, hi)
                     for i, x in enumerate(self.list_(v, ctx, max_len)))

    def str_(self, v: Any, ctx: str, choices: Collection[str] | None = None) -> str:
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self.fail(f"{ctx} must be one of {sorted(choices)}, got {short(v)}"
                            if choices is not None else
                            f"{ctx} must be a string, got {short(v)}")
        return v

    def null(self, v: Any, ctx: str, why: str) -> None:
        if v is not None:
            raise self.fail(f"{ctx} must be null {why}, got {short(v)}")

    def shallow(self, v: Any, ctx: str) -> Any:
        """`v` (any JSON value), unless arrays or objects in it nest deeper than
        MAX_VALUE_DEPTH (the value itself is level 1); walked without recursion."""
        todo = [(v, 1)]
        while todo:
            x, depth = todo.pop()
            if isinstance(x, (dict, list, tuple)):
                if depth > MAX_VALUE_DEPTH:
                    raise self.fail(f"{ctx} nests deeper than {MAX_VALUE_DEPTH} levels")
                todo.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
        return v
