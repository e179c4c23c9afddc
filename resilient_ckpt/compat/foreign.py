"""Reading an Orbax step this package did not write (`import`), safely.

Orbax trusts its own directories: it joins the array names of an item's
`_METADATA` to the item's path (an absolute or `..` name reads elsewhere),
opens whatever is at a file's name (a FIFO blocks it for ever), allocates
an array or chunk of whatever shape `.zarray` says (a huge one aborts the
process) and lets malformed JSON escape as AttributeError or RecursionError.
So before Orbax reads anything, this module refuses all of that with a
CorruptCheckpointError naming the file: every entry under the step is a
directory or a regular file, never followed (`check_entries`); the JSON it
reads (`_CHECKPOINT_METADATA`, `_METADATA`, a JSON item) goes through the
guarded file storage read (regular files only, O_NONBLOCK, bounded size) and
the strict JSON reader (bounded nesting, typed fields); every array key that
names a directory is one path component (`layout.check_name`); and the arrays' and chunks' sizes
(Orbax's metadata, read without the data) must fit a bound before anything
is allocated: for an import the caller's `max_item_bytes` per item (default
`default_item_bytes`, a quarter of this host's memory), since a chunk file
of a few KiB may decode to gigabytes and the data present bounds nothing
useful; for a step read in place, this host's memory. Whatever Orbax still raises on
content these checks let through becomes a CorruptCheckpointError naming
the item. `check_step` is the same checks for an Orbax step that a manager
reads in place (compat/orbax_steps.py).
"""
from __future__ import annotations

import contextlib
import math
import os
import stat
from typing import Any

import numpy as np

from ..core import layout
from ..core.strictjson import Reader, short
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.files import FileStorage

STEP_METADATA = "_CHECKPOINT_METADATA"
PYTREE_METADATA = "_METADATA"
JSON_ITEM_FILE = "metadata"  # what Orbax's JsonCheckpointHandler names its file
MAX_JSON_BYTES = 256 << 20  # one metadata file, as a manifest (format.md, section 6)
MAX_ENTRIES = 1 << 20  # files and directories under one step


def memory_bytes() -> int:
    """This host's memory: no array read here can be larger."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_item_bytes() -> int:
    """The most bytes one item of an import may hold unless the caller says
    otherwise: a quarter of this host's memory (an import holds the step,
    our save a second copy, the RAM tier a third)."""
    return memory_bytes() // 4


def check_entries(path: str) -> None:
    """Every entry under `path` is a directory or a regular file (a link,
    FIFO, socket or device is refused, never opened or followed)."""
    todo, seen = [path], 0
    while todo:
        with os.scandir(todo.pop()) as it:
            for e in it:
                seen += 1
                mode = e.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    todo.append(e.path)
                elif not stat.S_ISREG(mode):
                    raise CorruptCheckpointError(
                        f"{e.path}: not a regular file or directory (an Orbax step holds "
                        "only those); nothing was imported: remove it or import another step")
                if seen > MAX_ENTRIES:
                    raise CorruptCheckpointError(f"{path}: more than {MAX_ENTRIES} entries; "
                                                 "not an Orbax step this import reads")


def read_json(step: str, key: str) -> Any:
    """The JSON value of file `key` under `step`, read guardedly and strictly."""
    store = FileStorage(step, "orbax step", create=False, fsync=False)
    r = Reader(os.path.join(step, key))
    return r.shallow(r.load(store.read(key, max_bytes=MAX_JSON_BYTES)), "the file")


def step_metadata(step: str) -> dict:
    """The step's `_CHECKPOINT_METADATA`, its fields that import uses typed."""
    r = Reader(os.path.join(step, STEP_METADATA))
    doc = read_json(step, STEP_METADATA)
    if not isinstance(doc, dict):
        raise r.fail(f"not a JSON object, got {short(doc)}")
    for field in ("item_handlers", "metrics", "custom_metadata"):
        if not isinstance(doc.get(field), (dict, type(None))):
            raise r.fail(f"{field} must be an object or null, got {short(doc[field])}")
    for name, handler in (doc.get("item_handlers") or {}).items():
        if not isinstance(handler, (str, type(None))):
            raise r.fail(f"item_handlers[{short(name)}] must be a string or null, "
                         f"got {short(handler)}")
    return doc


def check_pytree(item: str) -> None:
    """An item's `_METADATA`: every array key that names a file one path
    component. In an OCDBT item (`use_ocdbt`) keys name entries of its
    database, never files, so a key there may hold `/` (Haiku's
    `mlp/~/linear_0`); elsewhere each array is a directory named by its keys."""
    r = Reader(os.path.join(item, PYTREE_METADATA))
    doc = read_json(item, PYTREE_METADATA)
    if not isinstance(doc, dict):
        raise r.fail(f"not a JSON object, got {short(doc)}")
    tree, ocdbt = doc.get("tree_metadata"), doc.get("use_ocdbt", False)
    if not isinstance(tree, dict):
        raise r.fail(f"tree_metadata must be an object, got {short(tree)}")
    if not isinstance(ocdbt, bool):
        raise r.fail(f"use_ocdbt must be true or false, got {short(ocdbt)}")
    for name, leaf in tree.items():
        ctx = f"tree_metadata[{short(name)}]"
        if not isinstance(leaf, dict):
            raise r.fail(f"{ctx} must be an object, got {short(leaf)}")
        for i, k in enumerate(r.list_(leaf.get("key_metadata"), f"{ctx}.key_metadata", 1000)):
            key, where = k.get("key") if isinstance(k, dict) else None, f"{ctx}.key_metadata[{i}]"
            if type(key) is int:  # an index: digits, a name of its own
                continue
            if not ocdbt:
                layout.check_name(key, f"{r.where}: {where}.key")
            elif not isinstance(key, str):
                raise r.fail(f"{where}.key must be a string or an integer, got {short(key)}")


def check_sizes(item: str, meta: Any, limit: int | None = None) -> None:
    """Every array and chunk of Orbax's metadata `meta` of `item`, and all of
    its arrays together, hold at most `limit` bytes (an import's
    `max_item_bytes`; None: this host's memory, for a step read in place)."""
    import jax
    bound = memory_bytes() if limit is None else limit
    total = 0
    for path, m in jax.tree_util.tree_flatten_with_path(meta)[0]:
        shape, dtype = getattr(m, "shape", None), getattr(m, "dtype", None)
        if shape is None or dtype is None:
            continue
        size = np.dtype(dtype).itemsize
        chunk = getattr(getattr(m, "storage", None), "chunk_shape", None) or shape
        total += math.prod(shape) * size
        if math.prod(chunk) * size > bound or total > bound:
            raise CorruptCheckpointError(
                f"{item}: array {jax.tree_util.keystr(path)} of shape {tuple(shape)} "
                f"(chunks {tuple(chunk)}, {np.dtype(dtype)}) claims "
                f"{math.prod(shape) * size} bytes, bringing the item to {total} bytes, "
                f"chunks to {math.prod(chunk) * size} bytes, more than {_bound(bound, limit)}"
                "; nothing was read")


def _bound(bound: int, limit: int | None) -> str:
    """The bound `check_sizes` applied, and what to do about it, in words."""
    if limit is None:
        return (f"this host's {bound} bytes of memory: its metadata is damaged or "
                "hostile (or read it on a larger host)")
    return (f"the {bound} bytes an import allows one item (max_item_bytes; by default "
            "a quarter of this host's memory): if the step is genuine and this host "
            "holds it, import it with a larger bound (resilient-ckpt import "
            "--max-item-bytes N, interop.import_step(max_item_bytes=N)); else its "
            "metadata is damaged or hostile")


@contextlib.contextmanager
def _orbax_errors(item: str):
    """Orbax's failures on a damaged item (of every class) as one naming it."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{item}: Orbax could not read this item "
                                     f"({type(e).__name__}: {short(str(e))}); the step is "
                                     "damaged: it was not read") from e


def check_item(item: str, limit: int | None = None) -> None:
    """A pytree item's (or a StandardCheckpointer directory's) metadata: its
    keys (`check_pytree`), then its arrays' sizes from Orbax's metadata,
    against `limit` bytes (`check_sizes`)."""
    import orbax.checkpoint as ocp
    check_pytree(item)
    with _orbax_errors(item), ocp.StandardCheckpointer() as c:
        check_sizes(item, c.metadata(item).item_metadata, limit)


def read_pytree(item: str, limit: int | None = None) -> Any:
    """A pytree item (or a StandardCheckpointer directory) restored by Orbax
    after `check_item` (arrays of at most `limit` bytes together); Orbax's
    own failures name the item."""
    import orbax.checkpoint as ocp
    check_item(item, limit)
    with _orbax_errors(item), ocp.StandardCheckpointer() as c:
        return c.restore(item)


def check_files(paths: list[str]) -> None:
    """Each of `paths` that exists is a regular file (never opened here)."""
    for p in paths:
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(
                f"{p}: not a regular file, and Orbax would open it; nothing was read: "
                "remove it")


def check_step(step: str, items: bool = True) -> None:
    """Everything above for an Orbax step directory, before Orbax reads it
    (its items' metadata only when `items`)."""
    check_entries(step)
    step_metadata(step)
    for name in sorted(os.listdir(step)) if items else ():
        if is_item(os.path.join(step, name)):
            check_item(os.path.join(step, name))


def read_json_item(item: str) -> Any:
    """A JSON item's value (what Orbax's JsonCheckpointHandler wrote)."""
    return read_json(item, JSON_ITEM_FILE)


def is_item(path: str) -> bool:
    """Whether `path` is a directory (not a link) holding a pytree item's metadata."""
    return os.path.isdir(path) and not os.path.islink(path) and \
        os.path.lexists(os.path.join(path, PYTREE_METADATA))

