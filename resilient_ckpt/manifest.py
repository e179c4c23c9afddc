"""The validity manifest: versioned, strictly parsed JSON records of one saved step.

A manifest is the commit record of one (step, tier, process): it lists every
leaf of every item (key path, kind, shape, dtype, sharding) and, for array
leaves, every chunk this process wrote (global offsets and sizes, object key,
byte sizes, crc32c, codec). It is pure data: no I/O, no jax. Parsing is strict:
an unknown version, a missing or an unknown field is an error, never skipped.
docs/format.md is the specification of what is here.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, cast

from .codec import CODECS  # the one list of codec names
from .errors import CorruptCheckpointError, UnsupportedFormatError

FORMAT_NAME = "resilient_ckpt"
FORMAT_VERSION = 1
LEAF_KINDS = ("array", "prng_key", "numpy", "numpy_scalar", "scalar", "none")
ITEM_KINDS = ("pytree", "json")
PATH_KINDS = ("key", "index", "attr")
SHARDING_TYPES = ("named", "single_device", "other")

PathEntry = tuple[str, Any]  # ("key", "params") | ("index", 0) | ("attr", "w")


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One stored object: a box [offsets, offsets + sizes) of one leaf."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str  # object name, relative to the step's directory or prefix
    nbytes: int  # uncompressed, C-order bytes
    stored_nbytes: int  # bytes of the object as stored (after the codec)
    crc32c: int  # over the uncompressed bytes
    codec: str = "raw"
    block_bytes: int = 0  # > 0: the bytes are also checksummed in blocks of this size
    block_crc32c: tuple[int, ...] = ()  # per block, over the uncompressed bytes


@dataclasses.dataclass(frozen=True)
class LeafRecord:
    path: tuple[PathEntry, ...]
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str | None = None
    sharding: dict | None = None
    key_impl: str | None = None  # prng_key leaves: the PRNG implementation name
    value: Any = None  # scalar leaves: {"type": ..., "value": ...}
    chunks: tuple[ChunkRecord, ...] = ()


@dataclasses.dataclass(frozen=True)
class ItemRecord:
    name: str
    kind: str  # "pytree" or "json"
    leaves: tuple[LeafRecord, ...] = ()
    value: Any = None  # json items


@dataclasses.dataclass(frozen=True)
class Manifest:
    step: int
    save_id: str
    created: float
    process_index: int
    process_count: int
    items: tuple[ItemRecord, ...]
    metrics: Any = None
    custom_metadata: Any = None
    version: int = FORMAT_VERSION

    def item(self, name: str) -> ItemRecord:
        for it in self.items:
            if it.name == name:
                return it
        raise KeyError(name)

    def chunks(self):
        """Yields (item name, leaf index, ChunkRecord) for every chunk."""
        for it in self.items:
            for i, leaf in enumerate(it.leaves):
                for c in leaf.chunks:
                    yield it.name, i, c

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for _, _, c in self.chunks())


def path_str(path: tuple[PathEntry, ...]) -> str:
    """A readable key path, as jax.tree_util.keystr prints it."""
    out = []
    for kind, v in path:
        out.append(f".{v}" if kind == "attr" else f"[{v!r}]")
    return "".join(out) or "<root>"


def encode_scalar(v: Any) -> dict:
    if isinstance(v, bool):
        return {"type": "bool", "value": v}
    if isinstance(v, int):
        return {"type": "int", "value": v}
    if isinstance(v, float):
        return {"type": "float", "value": v.hex()}  # exact, and nan/inf safe
    if isinstance(v, str):
        return {"type": "str", "value": v}
    raise TypeError(f"not a scalar leaf: {type(v).__name__}")


_SCALAR_TYPES = {"bool": bool, "int": int, "str": str, "float": str}


def decode_scalar(d: dict) -> Any:
    t, v = d["type"], d["value"]
    want = _SCALAR_TYPES.get(t)
    if want is None:
        raise UnsupportedFormatError(f"unknown scalar type {t!r} in manifest")
    if type(v) is not want:  # noqa: E721 - bool is not an int here
        raise ValueError(f"a {t} scalar holds {v!r}")
    return float.fromhex(cast(str, v)) if t == "float" else v  # a float is stored as hex


# ---------------------------------------------------------------- to JSON

def _chunk_to_json(c: ChunkRecord) -> dict:
    return {"offsets": list(c.offsets), "sizes": list(c.sizes), "key": c.key,
            "nbytes": c.nbytes, "stored_nbytes": c.stored_nbytes,
            "crc32c": c.crc32c, "codec": c.codec, "block_bytes": c.block_bytes,
            "block_crc32c": list(c.block_crc32c)}


def _leaf_to_json(leaf: LeafRecord) -> dict:
    return {"path": [list(p) for p in leaf.path], "kind": leaf.kind,
            "shape": list(leaf.shape), "dtype": leaf.dtype,
            "sharding": leaf.sharding, "key_impl": leaf.key_impl,
            "value": leaf.value,
            "chunks": [_chunk_to_json(c) for c in leaf.chunks]}


def to_json(m: Manifest) -> bytes:
    doc = {
        "format": FORMAT_NAME, "version": m.version, "step": m.step,
        "save_id": m.save_id, "created": m.created,
        "process": {"index": m.process_index, "count": m.process_count},
        "items": [{"name": it.name, "kind": it.kind,
                   "leaves": [_leaf_to_json(lf) for lf in it.leaves],
                   "value": it.value} for it in m.items],
        "metrics": m.metrics, "custom_metadata": m.custom_metadata,
    }
    # Leaf floats are hex strings; NaN/Infinity can only come from user metrics
    # (a diverged loss is worth recording) and use Python's JSON tokens for them.
    return json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()


# ---------------------------------------------------------------- parsing

class _Reader:
    """Strict field access that names where in the manifest a problem is."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {msg}")

    def obj(self, d: Any, ctx: str, fields: set[str]) -> dict:
        if not isinstance(d, dict):
            raise self.fail(f"{ctx} is not an object")
        missing, extra = fields - d.keys(), d.keys() - fields
        if extra:
            raise UnsupportedFormatError(
                f"{self.where}: {ctx} has unknown fields {sorted(extra)}; it was "
                "written by a newer resilient_ckpt: upgrade to read it")
        if missing:
            raise self.fail(f"{ctx} lacks fields {sorted(missing)}")
        return d

    def int_(self, v: Any, ctx: str, lo: int = 0, hi: int | None = None) -> int:
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            raise self.fail(f"{ctx} must be an integer in [{lo}, {hi or 'inf'}], got {v!r}")
        return v

    def ints(self, v: Any, ctx: str) -> tuple[int, ...]:
        if not isinstance(v, list):
            raise self.fail(f"{ctx} must be a list")
        return tuple(self.int_(x, ctx) for x in v)

    def str_(self, v: Any, ctx: str, choices: tuple[str, ...] | None = None) -> str:
        if not isinstance(v, str) or (choices is not None and v not in choices):
            raise self.fail(f"{ctx} must be one of {choices}, got {v!r}"
                            if choices else f"{ctx} must be a string, got {v!r}")
        return v


def _parse_chunk(r: _Reader, d: Any, ndim: int, ctx: str) -> ChunkRecord:
    d = r.obj(d, ctx, {"offsets", "sizes", "key", "nbytes", "stored_nbytes",
                       "crc32c", "codec", "block_bytes", "block_crc32c"})
    c = ChunkRecord(r.ints(d["offsets"], ctx + ".offsets"),
                    r.ints(d["sizes"], ctx + ".sizes"),
                    r.str_(d["key"], ctx + ".key"),
                    r.int_(d["nbytes"], ctx + ".nbytes"),
                    r.int_(d["stored_nbytes"], ctx + ".stored_nbytes"),
                    r.int_(d["crc32c"], ctx + ".crc32c", hi=2**32 - 1),
                    r.str_(d["codec"], ctx + ".codec", CODECS),
                    r.int_(d["block_bytes"], ctx + ".block_bytes"),
                    tuple(r.int_(x, ctx + ".block_crc32c", hi=2**32 - 1)
                          for x in (d["block_crc32c"] if isinstance(d["block_crc32c"], list)
                                    else [None])))
    if len(c.offsets) != ndim or len(c.sizes) != ndim:
        raise r.fail(f"{ctx} has offsets/sizes of rank != {ndim}")
    if not c.key or c.key.startswith("/") or ".." in c.key.split("/"):
        raise r.fail(f"{ctx}.key {c.key!r} is not a relative object name")
    if c.codec == "raw" and c.stored_nbytes != c.nbytes:
        raise r.fail(f"{ctx}: raw chunk with stored_nbytes != nbytes")
    expect_blocks = -(-c.nbytes // c.block_bytes) if c.block_bytes else 0
    if len(c.block_crc32c) != expect_blocks:
        raise r.fail(f"{ctx}: {len(c.block_crc32c)} block checksums for "
                     f"{expect_blocks} blocks of {c.block_bytes} bytes")
    return c


def _parse_path(r: _Reader, v: Any, ctx: str) -> tuple[PathEntry, ...]:
    if not isinstance(v, list):
        raise r.fail(f"{ctx} must be a list")
    out = []
    for e in v:
        if not (isinstance(e, list) and len(e) == 2 and e[0] in PATH_KINDS):
            raise r.fail(f"{ctx} entry {e!r} is not [kind, name]")
        if e[0] == "index":
            r.int_(e[1], ctx)
        elif not isinstance(e[1], (str, int)) or isinstance(e[1], bool):
            raise r.fail(f"{ctx} entry {e!r} has a bad name")
        out.append((e[0], e[1]))
    return tuple(out)


def _parse_leaf(r: _Reader, d: Any, ctx: str) -> LeafRecord:
    d = r.obj(d, ctx, {"path", "kind", "shape", "dtype", "sharding", "key_impl",
                       "value", "chunks"})
    kind = r.str_(d["kind"], ctx + ".kind", LEAF_KINDS)
    shape = r.ints(d["shape"], ctx + ".shape")
    if not isinstance(d["chunks"], list):
        raise r.fail(f"{ctx}.chunks must be a list")
    chunks = tuple(_parse_chunk(r, c, len(shape), f"{ctx}.chunks[{i}]")
                   for i, c in enumerate(d["chunks"]))
    sharding = d["sharding"]
    if sharding is not None and (not isinstance(sharding, dict)
                                 or sharding.get("type") not in SHARDING_TYPES):
        raise r.fail(f"{ctx}.sharding is not a known sharding description")
    leaf = LeafRecord(_parse_path(r, d["path"], ctx + ".path"), kind, shape,
                      d["dtype"], sharding, d["key_impl"], d["value"], chunks)
    if kind in ("array", "prng_key", "numpy", "numpy_scalar"):
        r.str_(leaf.dtype, ctx + ".dtype")
        for c in chunks:
            if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=False)):
                raise r.fail(f"{ctx}: chunk {c.key} lies outside shape {shape}")
    elif chunks:
        raise r.fail(f"{ctx}: a {kind} leaf cannot have chunks")
    if kind == "prng_key":
        r.str_(leaf.key_impl, ctx + ".key_impl")
    if kind == "scalar":
        v = r.obj(leaf.value, ctx + ".value", {"type", "value"})
        try:
            decode_scalar(v)
        except (TypeError, ValueError) as e:
            raise r.fail(f"{ctx}.value is not a valid scalar: {e}") from None
    return leaf


def parse(data: bytes, where: str = "manifest") -> Manifest:
    """Parses manifest bytes; raises CorruptCheckpointError (or its subclass
    UnsupportedFormatError for a newer format) naming `where`."""
    r = _Reader(where)
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise r.fail(f"not valid JSON ({e}); the manifest is torn or corrupt") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise r.fail("not a resilient_ckpt manifest")
    version = d.get("version")
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"{where}: format version {version!r} is not supported by this "
            f"resilient_ckpt (reads version {FORMAT_VERSION}); upgrade resilient_ckpt")
    d = r.obj(d, "manifest", {"format", "version", "step", "save_id", "created",
                              "process", "items", "metrics", "custom_metadata"})
    proc = r.obj(d["process"], "process", {"index", "count"})
    count = r.int_(proc["count"], "process.count", 1)
    index = r.int_(proc["index"], "process.index")
    if index >= count:
        raise r.fail(f"process.index {index} >= process.count {count}")
    created = d["created"]
    if type(created) not in (int, float) or not math.isfinite(created):
        raise r.fail("created must be a finite number")
    if not isinstance(d["items"], list):
        raise r.fail("items must be a list")
    items = []
    for i, it in enumerate(d["items"]):
        ctx = f"items[{i}]"
        it = r.obj(it, ctx, {"name", "kind", "leaves", "value"})
        kind = r.str_(it["kind"], ctx + ".kind", ITEM_KINDS)
        if not isinstance(it["leaves"], list):
            raise r.fail(f"{ctx}.leaves must be a list")
        leaves = tuple(_parse_leaf(r, lf, f"{ctx}.leaves[{j}]")
                       for j, lf in enumerate(it["leaves"]))
        items.append(ItemRecord(r.str_(it["name"], ctx + ".name"), kind, leaves,
                                it["value"]))
    if len({it.name for it in items}) != len(items):
        raise r.fail("duplicate item names")
    keys = [c.key for it in items for lf in it.leaves for c in lf.chunks]
    if len(set(keys)) != len(keys):
        raise r.fail("two chunks share one object key")
    return Manifest(r.int_(d["step"], "step"), r.str_(d["save_id"], "save_id"),
                    float(created), index, count, tuple(items), d["metrics"],
                    d["custom_metadata"], version)
