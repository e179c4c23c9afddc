"""The validity manifest: versioned, checksummed, strictly parsed JSON records
of one saved step.

A manifest is the commit record of one (step, tier, process): it lists every
leaf of every item (key path, kind, shape, dtype, sharding) and, for array
leaves, every chunk this process wrote (global offsets and sizes, object key,
byte sizes, crc32c, codec). It is pure data: no I/O, no jax. Its bytes end in
their own CRC-32C, verified before anything in them is trusted; then every
field is checked against the spec (types, ranges, dtypes, byte counts, boxes,
sharding records, bounded sizes and nesting): an unknown version, a missing or
an unknown field is an error, never skipped. docs/format.md is the
specification of what is here.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, cast

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..native import crc32c
from . import layout
from .codec import CODECS  # the one list of codec names
from .strictjson import MAX_INT, Reader, short

FORMAT_NAME = "resilient_ckpt"
MAX_CREATED = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a date can hold
# 2: a trailing manifest_crc32c; 3: chunks in packs (`pack`, `pack_offset`);
# 4: each mesh once, in `meshes`, its device ids as runs, named from the leaves;
# 5: `writers`, the saving job's writer of each device, as runs.
# Versions 1 to 4 are still read.
FORMAT_VERSION = 5
# A chunk in a pack starts on this boundary, so a range of the pack can be
# mapped (mmap wants a page-aligned file offset).
PACK_ALIGN = 4096
LEAF_KINDS = ("array", "prng_key", "numpy", "numpy_scalar", "scalar", "none")
ARRAY_KINDS = ("array", "prng_key", "numpy", "numpy_scalar")  # leaves with chunks
ITEM_KINDS = ("pytree", "json")
PATH_KINDS = ("key", "index", "attr")
SHARDING_TYPES = ("named", "single_device", "other")
_SHARDING_FIELDS = {"named": {"axis_names", "mesh_shape", "device_ids", "spec"},
                    "single_device": {"device_id"}, "other": {"device_ids", "repr"}}
_TOP_FIELDS = ("format", "version", "step", "save_id", "created", "process", "items",
               "metrics", "custom_metadata")
_MESH_FIELDS = {"axis_names", "mesh_shape", "device_ids"}  # a `meshes` entry, version 4 on
WriterRuns = tuple[tuple[int, int, int], ...]  # (first device id, count, writer label)

# Limits of what a manifest may hold (format.md, section 6). Whatever sits at a
# manifest's name is read whole and parsed, so its size and its nesting are
# bounded before any of it is believed; the writer refuses what would fail them.
MAX_MANIFEST_BYTES = 256 * 2**20
MAX_RANK = 64
MAX_DEVICES = 2**20  # devices of one mesh, and of `writers` (runs hold at most these)
MAX_LEAF_BYTES = 2**62
# Integer fields are at most MAX_INT (2**63 - 1), so int64 arithmetic downstream
# never wraps; free JSON (metrics, custom_metadata, json items) nests at most
# MAX_VALUE_DEPTH (100) arrays or objects deep: both from strictjson.

# The element dtypes resilient_ckpt saves, by numpy (and ml_dtypes) name, with
# their itemsize. Names carry no byte order: the bytes are little-endian.
DTYPES: dict[str, int] = {
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4,
    "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
    **dict.fromkeys(("bool", "int8", "uint8", "int2", "int4", "uint2", "uint4",
                     "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "float8_e3m4",
                     "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
                     "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"), 1)}

# The end of a version-2 manifest: its CRC-32C over every byte before the comma.
_TRAILER = re.compile(rb',"manifest_crc32c":(0|[1-9][0-9]{0,9})\}\Z')


def max_stored_nbytes(nbytes: int) -> int:
    """The most bytes a chunk of `nbytes` may take as stored: a zstd frame is
    at most slightly larger than its input."""
    return nbytes + nbytes // 128 + 4096


# The most bytes one stored byte of a zstd frame can decode to: a block holds at
# most 128 KiB, and the smallest (an RLE block) takes 4 bytes. A claim beyond
# it is one no stored object can back, so it is refused before anything is
# allocated for it (a manifest claiming a terabyte leaf in a 4 KiB object).
MAX_ZSTD_RATIO = (128 << 10) // 4


def min_stored_nbytes(codec_name: str, nbytes: int) -> int:
    """The fewest bytes a chunk of `nbytes` may take as stored with `codec_name`."""
    return nbytes if codec_name == "raw" else -(-nbytes // MAX_ZSTD_RATIO)


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
    pack: str | None = None  # the pack object holding it; None: its own object `key`
    pack_offset: int = 0  # where its stored bytes start in `pack`

    @property
    def object(self) -> str:
        """The name, inside the step's directory, of the object holding the
        chunk's stored bytes (from `pack_offset` on): the one place that says
        where a chunk lives."""
        return self.pack or self.key

    def observed(self, size: int | None) -> int | None:
        """The chunk's stored size as a tier holds it, given the size of the
        object holding it (None: absent): its own object's size, or, in a
        pack, `stored_nbytes` where the pack covers it, else the part it does."""
        if size is None or self.pack is None:
            return size
        return min(self.stored_nbytes, max(0, size - self.pack_offset))


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
    # The saving job's writer label of each of its devices (version 5 on; empty
    # where a manifest does not say): which writer holds which box, for a
    # restore onto another layout or by a job of another shape (core.writers).
    writers: WriterRuns = dataclasses.field(default=(), compare=False)
    # Copies of one save in formats 1 to 5 are the same records.
    version: int = dataclasses.field(default=FORMAT_VERSION, compare=False)

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

    def objects(self) -> list[str]:
        """The objects its chunks live in (packs and unpacked chunks), each once,
        in order: what deleting this process's share of a step removes."""
        return list(dict.fromkeys(c.object for _, _, c in self.chunks()))


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

# The records' tuples go to json.dumps as they are (it writes a tuple as a
# JSON array): copying them into lists made three more objects per chunk, and
# a manifest of thousands of chunks then set off many garbage collections.
def _chunk_to_json(c: ChunkRecord) -> dict:
    return {"offsets": c.offsets, "sizes": c.sizes, "key": c.key,
            "nbytes": c.nbytes, "stored_nbytes": c.stored_nbytes,
            "crc32c": c.crc32c, "codec": c.codec, "block_bytes": c.block_bytes,
            "block_crc32c": c.block_crc32c, "pack": c.pack, "pack_offset": c.pack_offset}


def _leaf_to_json(leaf: LeafRecord, meshes: _Meshes) -> dict:
    return {"path": leaf.path, "kind": leaf.kind,
            "shape": leaf.shape, "dtype": leaf.dtype,
            "sharding": meshes.refer(leaf.sharding), "key_impl": leaf.key_impl,
            "value": leaf.value,
            "chunks": [_chunk_to_json(c) for c in leaf.chunks]}


class _Meshes:
    """The `meshes` table of one manifest being written: each distinct mesh of
    its named shardings once. A mesh of a thousand hosts names thousands of
    devices; written in every leaf's sharding, as up to version 3, a
    1,000-leaf state on 16,384 devices made each writer's manifest 80 MB, and
    its parse checked every id of every leaf."""

    def __init__(self) -> None:
        self.table: list[dict] = []
        self._by_id: dict[tuple[int, int, int], int] = {}  # the lists' identities
        self._by_value: dict[tuple, int] = {}

    def refer(self, desc: dict | None) -> dict | None:
        """`desc` as written: a named sharding by its mesh's index."""
        if not desc or desc.get("type") != "named":
            return desc
        axes, shape, ids = desc["axis_names"], desc["mesh_shape"], desc["device_ids"]
        fast = (id(axes), id(shape), id(ids))  # the leaves of one mesh share its lists
        i = self._by_id.get(fast)
        if i is None:
            key = (tuple(axes), tuple(shape), tuple(ids))
            i = self._by_value.get(key)
            if i is None:
                i = self._by_value[key] = len(self.table)
                self.table.append({"axis_names": axes, "mesh_shape": shape,
                                   "device_ids": _runs(ids)})
            self._by_id[fast] = i
        return {"type": "named", "mesh": i, "spec": desc["spec"]}


def _runs(ids: list[int]) -> list[list[int]]:
    """Device ids as [first, count] runs of consecutive ids (a mesh of
    jax.devices() in order is one run)."""
    out: list[list[int]] = []
    for d in ids:
        if out and out[-1][0] + out[-1][1] == d:
            out[-1][1] += 1
        else:
            out.append([d, 1])
    return out


def to_json(m: Manifest) -> bytes:
    """The manifest's bytes in the current format (whatever `m.version` was
    read as), ending in their checksum; raises ValueError, before anything is
    written, for records a reader would refuse."""
    _check_writable(m)
    meshes = _Meshes()
    items = [{"name": it.name, "kind": it.kind,
              "leaves": [_leaf_to_json(lf, meshes) for lf in it.leaves],
              "value": it.value} for it in m.items]
    doc = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "step": m.step,
        "save_id": m.save_id, "created": m.created,
        "process": {"index": m.process_index, "count": m.process_count},
        "meshes": meshes.table, "writers": [list(w) for w in m.writers], "items": items,
        "metrics": m.metrics, "custom_metadata": m.custom_metadata,
    }
    # Leaf floats are hex strings; NaN/Infinity can only come from user metrics
    # (a diverged loss is worth recording) and use Python's JSON tokens for them.
    body = json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()[:-1]
    out = body + b',"manifest_crc32c":%d}' % crc32c.value(body)
    if len(out) > MAX_MANIFEST_BYTES:
        raise ValueError(f"the manifest of step {m.step} would be {len(out)} bytes, over "
                         f"the {MAX_MANIFEST_BYTES}-byte limit readers accept; save fewer "
                         "or larger chunks, or less metadata")
    return out


def _check_writable(m: Manifest) -> None:
    where = f"step {m.step}"
    end = 0
    for first, n, label in m.writers:
        if first < end or n < 1 or not 0 <= label < m.process_count:
            raise ValueError(f"{where}: the writers table {list(m.writers)[:4]}... is not "
                             "ascending, disjoint runs of the save's writers")
        end = first + n
    for it in m.items:
        for lf in it.leaves:
            if lf.kind in ARRAY_KINDS and lf.dtype not in DTYPES:
                raise ValueError(f"{where}: leaf {path_str(lf.path)} of item {it.name!r} has "
                                 f"dtype {lf.dtype}, which resilient_ckpt cannot save; "
                                 f"convert it to one of {sorted(DTYPES)}")
    values = [("metrics", m.metrics), ("custom_metadata", m.custom_metadata)] + \
        [(f"item {it.name!r}", it.value) for it in m.items]
    for what, v in values:
        try:
            Reader(where).shallow(v, what)
        except CorruptCheckpointError as e:
            raise ValueError(f"{e}; readers refuse deeper JSON: flatten it") from None


# ---------------------------------------------------------------- parsing

_CHUNK_FIELDS = {"offsets", "sizes", "key", "nbytes", "stored_nbytes", "crc32c", "codec",
                 "block_bytes", "block_crc32c"}
_PACK_FIELDS = {"pack", "pack_offset"}  # version 3 on


def _parse_chunk(r: Reader, d: Any, shape: tuple[int, ...], itemsize: int,
                 ctx: str, packed: bool) -> ChunkRecord:
    d = r.obj(d, ctx, _CHUNK_FIELDS | _PACK_FIELDS if packed else _CHUNK_FIELDS)
    ndim = len(shape)
    pack = None if not packed or d["pack"] is None else r.str_(d["pack"], ctx + ".pack")
    c = ChunkRecord(r.ints(d["offsets"], ctx + ".offsets", MAX_RANK),
                    r.ints(d["sizes"], ctx + ".sizes", MAX_RANK),
                    r.str_(d["key"], ctx + ".key"),
                    r.int_(d["nbytes"], ctx + ".nbytes"),
                    r.int_(d["stored_nbytes"], ctx + ".stored_nbytes"),
                    r.int_(d["crc32c"], ctx + ".crc32c", hi=2**32 - 1),
                    r.str_(d["codec"], ctx + ".codec", CODECS),
                    r.int_(d["block_bytes"], ctx + ".block_bytes"),
                    r.ints(d["block_crc32c"], ctx + ".block_crc32c", hi=2**32 - 1),
                    pack, r.int_(d["pack_offset"], ctx + ".pack_offset") if packed else 0)
    if len(c.offsets) != ndim or len(c.sizes) != ndim:
        raise r.fail(f"{ctx} has offsets/sizes of rank {len(c.offsets)}/{len(c.sizes)}, "
                     f"its leaf rank {ndim}")
    if any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True)):
        raise r.fail(f"{ctx} (box at {list(c.offsets)} of sizes {list(c.sizes)}) lies "
                     f"outside the leaf's shape {list(shape)}")
    if not c.key or c.key.startswith("/") or ".." in c.key.split("/"):
        raise r.fail(f"{ctx}.key {short(c.key)} is not a relative object name")
    want = math.prod(c.sizes) * itemsize
    if c.nbytes != want:
        raise r.fail(f"{ctx}.nbytes is {c.nbytes}, but sizes {list(c.sizes)} of "
                     f"{itemsize}-byte elements make {want}")
    if c.codec == "raw" and c.stored_nbytes != c.nbytes:
        raise r.fail(f"{ctx}.stored_nbytes {c.stored_nbytes} != nbytes {c.nbytes} "
                     "for a raw chunk")
    if c.stored_nbytes < min_stored_nbytes(c.codec, c.nbytes):
        raise r.fail(f"{ctx}.stored_nbytes {c.stored_nbytes} cannot hold the {c.nbytes} "
                     f"bytes it claims (a {c.codec} object of n bytes decodes to at most "
                     f"{MAX_ZSTD_RATIO} * n); the manifest is corrupt")
    if c.stored_nbytes > max_stored_nbytes(c.nbytes):
        raise r.fail(f"{ctx}.stored_nbytes {c.stored_nbytes} is more than a {c.codec} "
                     f"encoding of {c.nbytes} bytes can take ({max_stored_nbytes(c.nbytes)})")
    expect_blocks = -(-c.nbytes // c.block_bytes) if c.block_bytes else 0
    if len(c.block_crc32c) != expect_blocks:
        raise r.fail(f"{ctx}.block_crc32c has {len(c.block_crc32c)} checksums for "
                     f"{expect_blocks} blocks of {c.block_bytes} bytes")
    return c


def _parse_path(r: Reader, v: Any, ctx: str) -> tuple[PathEntry, ...]:
    out = []
    for i, e in enumerate(r.list_(v, ctx)):
        if not (isinstance(e, list) and len(e) == 2 and e[0] in PATH_KINDS):
            raise r.fail(f"{ctx}[{i}] {short(e)} is not [kind, name]")
        kind, name = e
        if kind == "index":
            r.int_(name, f"{ctx}[{i}][1]")
        elif (kind == "attr" and not isinstance(name, str)) or \
                not isinstance(name, (str, int)) or isinstance(name, bool):
            raise r.fail(f"{ctx}[{i}] {short(e)} has a bad name")
        out.append((kind, name))
    return tuple(out)


def _parse_spec(r: Reader, v: Any, axes: tuple[str, ...], ndim: int, ctx: str) -> None:
    used: list[str] = []
    for i, p in enumerate(r.list_(v, ctx, ndim)):
        names = [] if p is None else [p] if isinstance(p, str) else r.list_(p, f"{ctx}[{i}]")
        for j, a in enumerate(names):
            r.str_(a, f"{ctx}[{i}]" + (f"[{j}]" if isinstance(p, list) else ""), axes)
        used += names
    if len(set(used)) != len(used):
        raise r.fail(f"{ctx} uses a mesh axis twice")


def _parse_meshes(r: Reader, v: Any) -> list[dict]:
    """A version-4 manifest's `meshes` (section 4.5): each checked once, its
    device ids expanded from their runs only once their count is known to be
    the mesh's, at most MAX_DEVICES."""
    out = []
    for i, m in enumerate(r.list_(v, "meshes")):
        ctx = f"meshes[{i}]"
        m = r.obj(m, ctx, _MESH_FIELDS)
        axes = _axes(r, m, ctx)
        total = math.prod(m["mesh_shape"])
        if total > MAX_DEVICES:
            raise r.fail(f"{ctx}.mesh_shape {list(m['mesh_shape'])} holds {total} devices, "
                         f"more than the {MAX_DEVICES} a mesh may")
        ids: list[int] = []
        for j, raw in enumerate(r.list_(m["device_ids"], ctx + ".device_ids", total)):
            where = f"{ctx}.device_ids[{j}]"
            run = r.ints(raw, where, 2)
            if len(run) != 2 or run[1] < 1:
                raise r.fail(f"{where} must be a run [first, count] of count >= 1, got "
                             f"{short(raw)}")
            first, count = run
            if len(ids) + count > total or first + count - 1 > MAX_INT:
                raise r.fail(f"{where}: its {count} devices from {first} overrun the mesh "
                             f"of {total} devices (or the largest id)")
            ids.extend(range(first, first + count))
        if len(ids) != total:
            raise r.fail(f"{ctx}: mesh_shape {list(m['mesh_shape'])} does not hold the "
                         f"{len(ids)} devices of its device_ids")
        if len(set(ids)) != len(ids):
            raise r.fail(f"{ctx}.device_ids names a device twice")
        out.append({"axis_names": list(axes), "mesh_shape": list(m["mesh_shape"]),
                    "device_ids": ids})
    return out


def _parse_writers(r: Reader, v: Any, count: int) -> WriterRuns:
    """A version-5 manifest's `writers` (section 4.6): runs [first device
    id, count, writer label] in ascending order of id, disjoint, each label
    one of the save's `count` writers, at most MAX_DEVICES devices in all."""
    out: list[tuple[int, int, int]] = []
    end = total = 0
    for j, raw in enumerate(r.list_(v, "writers", MAX_DEVICES)):
        where = f"writers[{j}]"
        run = r.ints(raw, where, 3)
        if len(run) != 3 or run[1] < 1 or not 0 <= run[2] < count:
            raise r.fail(f"{where} must be a run [first device id, count >= 1, writer label "
                         f"below process.count {count}], got {short(raw)}")
        first, n, label = run
        total += n
        if first < end or total > MAX_DEVICES or first + n - 1 > MAX_INT:
            raise r.fail(f"{where}: runs must name ascending, disjoint device ids, at most "
                         f"{MAX_DEVICES} devices in all; devices from {first} overlap or "
                         "overrun them")
        end = first + n
        out.append((first, n, label))
    return tuple(out)


def _axes(r: Reader, s: dict, ctx: str) -> tuple[str, ...]:
    """A mesh's axis names, checked against its mesh_shape."""
    axes = tuple(r.str_(a, f"{ctx}.axis_names[{i}]")
                 for i, a in enumerate(r.list_(s["axis_names"], ctx + ".axis_names", MAX_RANK)))
    mesh = r.ints(s["mesh_shape"], ctx + ".mesh_shape", MAX_RANK, lo=1)
    if len(set(axes)) != len(axes) or len(mesh) != len(axes):
        raise r.fail(f"{ctx}: axis_names {list(axes)} are not unique names, one per "
                     f"entry of mesh_shape {list(mesh)}")
    return axes


def _parse_sharding(r: Reader, s: Any, ndim: int, ctx: str,
                    meshes: list[dict] | None) -> dict:
    """A sharding description with every field its `type` needs (section 4.5);
    from version 4 (`meshes`), a named one's mesh by its index there."""
    if not isinstance(s, dict):
        raise r.fail(f"{ctx} is not an object")
    kind = r.str_(s.get("type"), ctx + ".type", SHARDING_TYPES)
    if kind == "named" and meshes is not None:
        r.obj(s, ctx, {"type", "mesh", "spec"})
        if not meshes:
            raise r.fail(f"{ctx}.mesh names a mesh, and the manifest's meshes are empty")
        mesh = meshes[r.int_(s["mesh"], ctx + ".mesh", 0, len(meshes) - 1)]
        _parse_spec(r, s["spec"], tuple(mesh["axis_names"]), ndim, ctx + ".spec")
        return {"type": "named", **mesh, "spec": s["spec"]}
    r.obj(s, ctx, {"type"} | _SHARDING_FIELDS[kind])
    if kind == "single_device":
        r.int_(s["device_id"], ctx + ".device_id")
        return s
    ids = r.ints(s["device_ids"], ctx + ".device_ids")
    if len(set(ids)) != len(ids):
        raise r.fail(f"{ctx}.device_ids names a device twice")
    if kind == "other":
        if list(ids) != sorted(ids):
            raise r.fail(f"{ctx}.device_ids are not sorted")
        if len(r.str_(s["repr"], ctx + ".repr")) > 200:
            raise r.fail(f"{ctx}.repr is longer than 200 characters")
        return s
    axes = _axes(r, s, ctx)
    mesh = s["mesh_shape"]
    if math.prod(mesh) != len(ids):
        raise r.fail(f"{ctx}: mesh_shape {list(mesh)} does not hold the {len(ids)} "
                     "device_ids")
    _parse_spec(r, s["spec"], axes, ndim, ctx + ".spec")
    return s


def _parse_leaf(r: Reader, d: Any, ctx: str, packed: bool,
                meshes: list[dict] | None) -> LeafRecord:
    d = r.obj(d, ctx, {"path", "kind", "shape", "dtype", "sharding", "key_impl",
                       "value", "chunks"})
    kind = r.str_(d["kind"], ctx + ".kind", LEAF_KINDS)
    shape = r.ints(d["shape"], ctx + ".shape", MAX_RANK)
    path = _parse_path(r, d["path"], ctx + ".path")
    array_like = kind in ARRAY_KINDS
    if not array_like or kind == "numpy_scalar":
        if shape:
            raise r.fail(f"{ctx}.shape must be [] for a {kind} leaf, got {list(shape)}")
    if kind == "prng_key" and (not shape or d["dtype"] != "uint32"):
        raise r.fail(f"{ctx}: a prng_key leaf stores uint32 key data of rank >= 1, got "
                     f"{short(d['dtype'])} of shape {list(shape)}")
    itemsize = 0
    if array_like:
        itemsize = DTYPES.get(d["dtype"], 0) if isinstance(d["dtype"], str) else 0
        if not itemsize:
            raise r.fail(f"{ctx}.dtype {short(d['dtype'])} is not a dtype resilient_ckpt "
                         "saves (numbers and bool in native byte order: format.md, 4.3)")
        if math.prod(shape) * itemsize > MAX_LEAF_BYTES:
            raise r.fail(f"{ctx}.shape {list(shape)} of {d['dtype']} is more than "
                         f"{MAX_LEAF_BYTES} bytes")
    else:
        r.null(d["dtype"], ctx + ".dtype", f"for a {kind} leaf")
    sharding = d["sharding"]
    if kind in ("array", "prng_key") and sharding is not None:
        sharding = _parse_sharding(r, sharding, len(shape), ctx + ".sharding", meshes)
    elif kind not in ("array", "prng_key"):
        r.null(sharding, ctx + ".sharding", f"for a {kind} leaf")
    if kind == "prng_key":
        if not r.str_(d["key_impl"], ctx + ".key_impl"):
            raise r.fail(f"{ctx}.key_impl is empty")
    else:
        r.null(d["key_impl"], ctx + ".key_impl", "except for a prng_key leaf")
    if kind == "scalar":
        v = r.obj(d["value"], ctx + ".value", {"type", "value"})
        try:
            decode_scalar(v)
        except (TypeError, ValueError, OverflowError) as e:
            raise r.fail(f"{ctx}.value is not a valid scalar: {e}") from None
    else:
        r.null(d["value"], ctx + ".value", "except for a scalar leaf")
    chunks = r.list_(d["chunks"], ctx + ".chunks")
    if chunks and not array_like:
        raise r.fail(f"{ctx}: a {kind} leaf cannot have chunks")
    return LeafRecord(path, kind, shape, d["dtype"], sharding, d["key_impl"], d["value"],
                      tuple(_parse_chunk(r, c, shape, itemsize, f"{ctx}.chunks[{i}]", packed)
                            for i, c in enumerate(chunks)))


def _parse_item(r: Reader, it: Any, ctx: str, packed: bool,
                meshes: list[dict] | None) -> ItemRecord:
    it = r.obj(it, ctx, {"name", "kind", "leaves", "value"})
    name = r.str_(it["name"], ctx + ".name")
    kind = r.str_(it["kind"], ctx + ".kind", ITEM_KINDS)
    raw = r.list_(it["leaves"], ctx + ".leaves")
    if kind == "json":
        if raw:
            raise r.fail(f"{ctx}.leaves must be empty for a json item")
        return ItemRecord(name, kind, (), r.shallow(it["value"], ctx + ".value"))
    r.null(it["value"], ctx + ".value", "for a pytree item")
    leaves = tuple(_parse_leaf(r, lf, f"{ctx}.leaves[{j}]", packed, meshes)
                   for j, lf in enumerate(raw))
    seen: dict[tuple, int] = {}
    for j, lf in enumerate(leaves):
        if lf.path in seen:
            raise r.fail(f"{ctx}.leaves[{j}].path {path_str(lf.path)} is also the path "
                         f"of {ctx}.leaves[{seen[lf.path]}]")
        seen[lf.path] = j
    return ItemRecord(name, kind, leaves)


def _check_packs(r: Reader, step: int, chunks: list[ChunkRecord]) -> None:
    """The rules of a version-3 manifest's packs (format.md, section 15): a pack
    is one path component that is no unpacked chunk's name; a packed chunk
    starts on PACK_ALIGN and ends within MAX_INT; no two overlap in one pack;
    an unpacked chunk has offset 0."""
    unpacked = {c.key for c in chunks if c.pack is None}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for c in chunks:
        what = f"step {step}: chunk {short(c.key)}"
        if c.pack is None:
            if c.pack_offset:
                raise r.fail(f"{what} is in no pack but has pack_offset {c.pack_offset}")
            continue
        what += f" in pack {short(c.pack)}"
        if not layout.is_name(c.pack) or c.pack in unpacked:
            raise r.fail(f"{what}: the pack's name is not one path component, or is "
                         "an unpacked chunk's; it was not used as a path")
        if c.pack_offset % PACK_ALIGN or c.pack_offset + c.stored_nbytes > MAX_INT:
            raise r.fail(f"{what}: pack_offset {c.pack_offset} is not a multiple of "
                         f"{PACK_ALIGN}, or the chunk would end past {MAX_INT}")
        spans.setdefault(c.pack, []).append((c.pack_offset, c.stored_nbytes, c.key))
    for pack, got in spans.items():
        got.sort()
        for (a, n, k), (b, _, k2) in zip(got, got[1:], strict=False):
            if a + n > b:
                raise r.fail(f"step {step}: chunks {short(k)} and {short(k2)} overlap in "
                             f"pack {short(pack)} (bytes {a}+{n} and {b}+)")


def _verify(r: Reader, data: bytes) -> bool:
    """Checks the trailing checksum (section 2 of format.md) when there is one;
    returns whether there was."""
    m = _TRAILER.search(data, max(0, len(data) - 64))
    if m is None:
        return False
    if crc32c.value(data[:m.start()]) != int(m[1]):
        raise r.fail("manifest_crc32c does not match the manifest's bytes: the file "
                     "is damaged; its step is read from another tier's copy, if any")
    return True


def _load(r: Reader, data: bytes) -> Any:
    if len(data) > MAX_MANIFEST_BYTES:
        raise r.fail(f"{len(data)} bytes is over the {MAX_MANIFEST_BYTES}-byte limit of a "
                     "manifest; it is not one")
    checked = _verify(r, data)
    d = r.load(data)
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise r.fail("not a resilient_ckpt manifest")
    version = d.get("version")
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"{r.where}: format version {short(version)} is not supported by this "
            f"resilient_ckpt (reads versions 1 to {FORMAT_VERSION}); upgrade resilient_ckpt")
    if checked != (version >= 2):
        raise r.fail(f"a version {version} manifest " + (
            "without a valid trailing manifest_crc32c: the file is damaged" if not checked
            else "cannot carry manifest_crc32c"))
    return d


def parse(data: bytes, where: str = "manifest") -> Manifest:
    """Parses manifest bytes; raises CorruptCheckpointError (or its subclass
    UnsupportedFormatError for a newer format) naming `where` and the field."""
    r = Reader(where)
    d = _load(r, bytes(data))
    fields = set(_TOP_FIELDS) | ({"manifest_crc32c"} if d["version"] >= 2 else set()) \
        | ({"meshes"} if d["version"] >= 4 else set()) \
        | ({"writers"} if d["version"] >= 5 else set())
    d = r.obj(d, "manifest", fields)
    proc = r.obj(d["process"], "process", {"index", "count"})
    count = r.int_(proc["count"], "process.count", 1)
    index = r.int_(proc["index"], "process.index")
    if index >= count:
        raise r.fail(f"process.index {index} >= process.count {count}")
    created = d["created"]
    if type(created) is int and abs(created) <= MAX_INT:
        created = float(created)
    if type(created) is not float or not 0 <= created <= MAX_CREATED:
        raise r.fail(f"created must be a finite number in [0, {MAX_CREATED:.0f}] (a Unix "
                     f"time up to the year 9999), got {short(created)}")
    step = r.int_(d["step"], "step")
    meshes = _parse_meshes(r, d["meshes"]) if d["version"] >= 4 else None
    writers = _parse_writers(r, d["writers"], count) if d["version"] >= 5 else ()
    items = [_parse_item(r, it, f"items[{i}]", d["version"] >= 3, meshes)
             for i, it in enumerate(r.list_(d["items"], "items"))]
    names = [it.name for it in items]
    if len(set(names)) != len(names):
        raise r.fail(f"items repeat a name: {sorted(names)}")
    chunks = [c for it in items for lf in it.leaves for c in lf.chunks]
    keys = [c.key for c in chunks]
    if len(set(keys)) != len(keys):
        raise r.fail("two chunks share one object key")
    _check_packs(r, step, chunks)
    return Manifest(step, r.str_(d["save_id"], "save_id"),
                    created, index, count, tuple(items),
                    r.shallow(d["metrics"], "metrics"),
                    r.shallow(d["custom_metadata"], "custom_metadata"), writers, d["version"])
