"""Assembling a selected step: restore targets, arrays on their devices, items.

Each target leaf becomes a `LeafTarget` (a jax array on a sharding, a numpy
value, or as saved) checked against its record (its shape must match; another
dtype is a cast of the verified host copy, as Orbax casts; `ocp.PLACEHOLDER`
leaves are not read and come back as they are); per leaf, the boxes this
process's devices need are planned against the saved chunks (once per layout
for all the leaves of it: `Layouts`) and read through a `reader.ChunkReader`.
Target shards that are exactly one saved chunk are used as read (on the CPU
backend, aliased into the jax array without a copy). So host memory peaks at
the restored state plus the reader's staging budget.
An `Into` leaf (CPU backend) names an XLA-owned array that the bytes are read
straight into, the elastic loop's touched reserve (`elastic.state`).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import ctypes
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..compat import args as args_lib, metadata
from ..core import layout
from ..core.ambient import apart
from ..core.manifest import ChunkRecord, ItemRecord, LeafRecord, decode_scalar, path_str
from ..core.planner import LayoutPlans, plan_target
from ..core.pytree import PLACEHOLDER, build_nested, flatten, match_target, unflatten
from ..core.selection import Choice
from ..core.sharding import Box, box_elements, index_to_box, rebuild
from ..errors import TargetMismatchError
from ..native.hostmem import carve, untouched_zeros
from ..storage.base import Storage
from .reader import ChunkReader, RestoreRecord

__all__ = ["ChunkReader", "RestoreRecord", "LeafTarget", "Into", "target_for",
           "restore_leaves", "restore_choice"]


class Into(jax.ShapeDtypeStruct):
    """A restore target leaf that is an existing jax array on the CPU backend,
    which the restored bytes are written into, shard by shard, in place: the
    restore returns that very array (XLA owns its memory, so the next step can
    donate it, and no fresh memory is touched). The array must not be in use
    by anything else while the restore runs, nor share its memory with a
    numpy array (on CPU, `device_put` of a numpy array may alias it: that
    array would be overwritten too). Where it cannot be written in
    place (another backend or sharding, a cast, shards read from peers) the
    leaf is restored as for a ShapeDtypeStruct."""

    __slots__ = ("array",)

    def __init__(self, array: jax.Array):
        super().__init__(array.shape, array.dtype, sharding=array.sharding)
        self.array = array


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """How to produce one leaf: a jax array on `sharding`, a numpy value, or as saved."""

    kind: str  # "jax", "numpy", "value"
    shape: tuple | None = None
    dtype: Any = None
    sharding: jax.sharding.Sharding | None = None
    into: jax.Array | None = None  # see Into


def target_for(leaf: Any, restore_arg: Any = None) -> LeafTarget:
    """The target of one leaf: its own shape, dtype and sharding, each
    overridden by the restore arg's where that gives one (as in Orbax)."""
    sharding = getattr(restore_arg, "sharding", None)
    dtype = getattr(restore_arg, "dtype", None)
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        into = leaf.array if isinstance(leaf, Into) else None
        return LeafTarget("jax", tuple(leaf.shape), dtype or leaf.dtype,
                          sharding or getattr(leaf, "sharding", None), into)
    if isinstance(leaf, np.ndarray):
        return LeafTarget("numpy", tuple(leaf.shape), dtype or leaf.dtype)
    if sharding is not None:
        return LeafTarget("jax", None, dtype, sharding)
    return LeafTarget("value", dtype=dtype)


def _check(rec: LeafRecord, tgt: LeafTarget, where: str) -> None:
    if tgt.kind == "value" or rec.kind in ("scalar", "none"):
        if tgt.kind != "value" and rec.kind in ("scalar", "none"):
            raise TargetMismatchError(f"{where}: saved as a {rec.kind}, but the target "
                                      "asks for an array")
        return
    saved_shape = rec.shape[:-1] if rec.kind == "prng_key" else rec.shape
    if tgt.shape is not None and tuple(tgt.shape) != tuple(saved_shape):
        raise TargetMismatchError(f"{where}: saved with shape {tuple(saved_shape)}, target "
                                  f"has shape {tuple(tgt.shape)}")
    if tgt.sharding is not None and tgt.kind == "jax":
        try:  # a target its own sharding cannot split fails every step alike
            tgt.sharding.shard_shape(tuple(saved_shape))
        except ValueError as e:
            raise TargetMismatchError(
                f"{where}: the target's sharding cannot split shape {tuple(saved_shape)} "
                f"({e}); give a sharding whose mesh axes divide it (on a smaller mesh "
                "after a loss: a mesh policy that keeps a dividing number of rows, "
                "such as shrink_data_axis with divisor=True)") from e
    if tgt.dtype is None:
        return
    # Another numeric dtype is a cast (`_cast`); a key and a number are not.
    if jnp.issubdtype(tgt.dtype, jax.dtypes.prng_key) != (rec.kind == "prng_key"):
        saved = f"key<{rec.key_impl}>" if rec.kind == "prng_key" else rec.dtype
        raise TargetMismatchError(f"{where}: saved with dtype {saved}, target has dtype "
                                  f"{tgt.dtype}")


def _cast_to(rec: LeafRecord, tgt: LeafTarget) -> np.dtype | None:
    """The dtype to cast the stored values to, or None when they are restored
    as stored (no copy is made for a cast then)."""
    if tgt.dtype is None or rec.kind == "prng_key":
        return None
    want = np.dtype(tgt.dtype)
    return None if want == jnp.dtype(rec.dtype) else want


def _key_data_sharding(s: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec, None))
    return s


def _default_sharding(rec: LeafRecord, where: str, layouts: Layouts) -> jax.sharding.Sharding:
    s = rebuild(rec.sharding, layouts.meshes)
    if s is not None:
        return s
    if rec.sharding and rec.sharding.get("type") != "other":
        raise TargetMismatchError(
            f"{where}: saved on devices {rec.sharding.get('device_ids', rec.sharding)}, "
            "not all of which exist now; restore with a target that gives shardings "
            "(StandardRestore(abstract_tree) with jax.ShapeDtypeStruct leaves)")
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _read_boxes(rec: LeafRecord, boxes: list, reader: ChunkReader, where: str,
                zero_copy: bool, dest: dict | None = None,
                layouts: LayoutPlans | None = None) -> Callable[[], dict]:
    """Starts reading the host arrays for each target box of one leaf; the
    returned call waits for them and returns them by box. Whole chunks are
    read on the reader's pool, so the next leaves' reads run meanwhile, into
    buffers cut from one mapping here first (`hostmem.carve`); boxes that
    stack whole rows of RAM-tier chunks are views of those chunks mapped in
    row order, checked on the pool (`ChunkReader.stitch`). With `dest`
    (box -> array), every box is read into its array instead. The plan
    comes from `layouts` (planned once per layout) where given."""
    dtype = jnp.dtype(rec.dtype)
    layout = (layouts or LayoutPlans()).plan(boxes, rec.chunks, where)
    wholes: dict = {}
    if dest is None:
        singles, plans = layout.singles(rec.chunks), layout.targets(rec.chunks, with_exact=False)
    else:
        singles, plans = {}, layout.targets(rec.chunks)
    reader.vouch([c for c in singles.values()] + [p.chunk for plan in plans.values()
                                                 for p in plan.pieces], where)
    mapped: dict = {}
    stitched = plans
    if zero_copy and dest is None and plans:  # views of RAM-tier chunks mapped in row order
        mapped, left = reader.stitch(plans, dtype)
        plans = {b: stitched[b] for b in left}
    views: dict = {}
    if zero_copy and singles and reader.deferring:  # RAM-tier chunks mapped in one pass
        got = reader.mapped(list(singles.values()), where)
        views = {b: v for b, v in zip(singles, got, strict=True) if v is not None}
        singles = {b: c for b, c in singles.items() if b not in views}
    read = [b for b, c in singles.items() if not _mappable(reader, c, zero_copy)]
    bufs = dict(zip(read, carve([singles[b].nbytes for b in read]), strict=True))
    for box, c in singles.items():
        wholes[box] = _start_whole(reader, c, where, zero_copy, bufs.get(box))
    assembled = _assemble(plans, dtype, reader, where, dest)

    def done() -> dict:
        out, unmapped = assembled(), {}
        for box, (view, checks) in mapped.items():
            if all([f.result() for f in checks]):
                out[box] = view
            else:  # a copy failed its check: read from the next one
                unmapped[box] = stitched[box]
        if unmapped:
            out.update(_assemble(unmapped, dtype, reader, where)())
        out.update({b: v.view(dtype).reshape(b[1]) for b, v in views.items()})
        out.update({b: f.result().view(dtype).reshape(b[1]) for b, f in wholes.items()})
        return out
    return done


# A RAM-tier chunk up to this size is mapped and checked on the restoring
# thread: a pool task's hand-offs cost more than a small chunk's checksum. Much
# larger, and the restoring thread checks most of a big state's chunks itself
# while the pool's threads idle; smaller gains nothing (docs/benchmarks.md).
INLINE_BYTES = 256 << 10


def _mappable(reader: ChunkReader, c: ChunkRecord, zero_copy: bool) -> bool:
    """Whether `whole` maps the chunk's first copy instead of reading it."""
    return zero_copy and reader.maps(c)


class _Ready:
    """The outcome of a read done on the restoring thread, waited for as a
    pool task's future is (a Future per small chunk cost more than its read)."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: Exception | None = None):
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def _start_whole(reader: ChunkReader, c: ChunkRecord, where: str, zero_copy: bool,
                 out: np.ndarray | None) -> cf.Future | _Ready:
    """reader.whole(c) into `out` (None: the chunk is `_mappable`) started on
    the reader's pool, or done on this thread for a small chunk mapped from
    the RAM tier: on the pool its few system calls each waited for the GIL
    while this thread planned the next leaves."""
    defer = out is None and reader.deferring  # mapped here, checked in bulk later
    if not defer and (out is not None or c.stored_nbytes > INLINE_BYTES):
        return reader.pool.submit(reader.whole, c, where, zero_copy, out)
    try:
        return _Ready(reader.whole(c, where, zero_copy, out, defer))
    except Exception as e:  # raised where the caller waits, as from the pool
        return _Ready(error=e)


def _assemble(plans: dict, dtype: np.dtype, reader: ChunkReader, where: str,
              dest: dict | None = None) -> Callable[[], dict]:
    """Starts copying each box of `plans` (box -> plan) together from the
    parts of the chunks it needs, into a buffer of its own (or its `dest`
    array, every part read straight into place); each chunk is read once for
    all the boxes it serves. The returned call waits for the boxes."""
    in_place = dest is not None
    if dest is None:
        bufs = carve([box_elements(box) * dtype.itemsize for box in plans])
        dest = {box: b.view(dtype).reshape(box[1]) for box, b in zip(plans, bufs, strict=True)}
    out, parts, chunks = {box: dest[box] for box in plans}, collections.defaultdict(list), {}
    for box, plan in plans.items():
        for p in plan.pieces:
            parts[p.chunk.key].append((p.src, out[box][p.dst]))
            chunks[p.chunk.key] = p.chunk
    futures = []
    for key, c in chunks.items():
        futures += reader.pieces(c, dtype, parts[key], where, in_place=in_place)

    def done() -> dict:
        for f in futures:
            f.result()
        return out
    return done


@dataclasses.dataclass
class Hole:
    """A jax leaf as this process assembled it, for a fill from its peers."""

    array: jax.Array  # on the target sharding; shards it could not read are zeros
    have: dict  # device -> whether that device's shard was read
    out: Any = None  # the leaf as placed in the restored tree
    key_impl: str | None = None  # for PRNG keys: rewrap the filled key data

    def missing_bytes(self) -> int:
        boxes = {index_to_box(s.index, self.array.shape) for s in self.array.addressable_shards
                 if not self.have[s.device]}
        return sum(box_elements(b) for b in boxes) * self.array.dtype.itemsize

    def filled(self, array: jax.Array) -> Any:
        return array if self.key_impl is None else jax.random.wrap_key_data(
            array, impl=self.key_impl)


def _readable(box, rec: LeafRecord, where: str) -> bool:
    try:
        plan_target(box, rec.chunks, where)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Targets:
    """The boxes a sharding puts on this process's devices for one shape."""

    by_box: dict  # box -> the devices that hold it
    cpu: bool  # every one of those devices is a CPU
    # id(index) -> (index, box) for the indices jax hands `_place`'s callback:
    # those of the map it caches per (sharding, shape), held here.
    of_index: dict
    devices: list  # this process's devices, in the map's order
    boxes: list  # the box of each of them
    avals: dict = dataclasses.field(default_factory=dict)  # dtype -> the leaf's aval

    @classmethod
    def of(cls, sharding: jax.sharding.Sharding, shape: tuple) -> Targets:
        by_box, of_index, devices, boxes = collections.defaultdict(list), {}, [], []
        for d, idx in sharding.addressable_devices_indices_map(shape).items():
            # jax annotates the map's values `Index | None`, but each is a subset of
            # devices_indices_map's, which are never None.
            box = index_to_box(idx, shape)  # type: ignore[arg-type]
            by_box[box].append(d)
            of_index[id(idx)] = (idx, box)
            devices.append(d)
            boxes.append(box)
        # jaxlib ships no stubs for _jax, so jax's Device type is unresolved.
        cpu = all(d.platform == "cpu" for ds in by_box.values() for d in ds)  # type: ignore[attr-defined]
        return cls(dict(by_box), cpu, of_index, devices, boxes)

    def box(self, index: tuple, shape: tuple) -> Box:
        """The box of a shard index: looked up when it is one of the map's."""
        known = self.of_index.get(id(index))
        return known[1] if known is not None and known[0] is index \
            else index_to_box(index, shape)


class Layouts:
    """What the leaves of one layout share, worked out once per restore
    rather than per leaf (a model's state has thousands of leaves and a
    handful of layouts): the target boxes of a (sharding, shape), and the
    plans of those boxes against the saved chunks (planner.LayoutPlans), and
    the saved meshes rebuilt (`sharding.rebuild`)."""

    def __init__(self) -> None:
        self.plans = LayoutPlans()
        self.meshes: dict = {}
        self._targets: dict[tuple, Targets] = {}

    def targets(self, sharding: jax.sharding.Sharding, shape: tuple) -> Targets:
        key = (sharding, tuple(shape))
        got = self._targets.get(key)
        if got is None:
            got = self._targets[key] = Targets.of(sharding, tuple(shape))
        return got


def _start_jax(rec: LeafRecord, sharding: jax.sharding.Sharding, reader: ChunkReader,
               where: str, cast: np.dtype | None = None, into: jax.Array | None = None,
               layouts: Layouts | None = None) -> Callable[[], jax.Array]:
    """Starts the reads of one jax leaf; the returned call assembles it (or,
    with `into`, fills that array in place and returns it)."""
    shape = rec.shape
    layouts = layouts or Layouts()
    targets = layouts.targets(sharding, shape)
    by_box, cpu = targets.by_box, targets.cpu
    boxes = list(by_box)
    missing = [] if reader.fills is None else [b for b in boxes
                                               if not _readable(b, rec, where)]
    views = _writable(into, sharding, by_box) \
        if into is not None and cpu and cast is None and not missing else None
    pending = _read_boxes(rec, [b for b in boxes if b not in missing], reader, where, cpu,
                          None if views is None else {b: v[0] for b, v in views.items()},
                          layouts.plans)

    def finish() -> jax.Array:
        host = pending()
        if views is not None:
            for first, *others in views.values():  # a box several devices hold
                for v in others:
                    np.copyto(v, first)
            assert into is not None  # views are made only with it
            out = into
        else:
            if cast is not None:  # after the reader checked the stored bytes
                host = {b: a.astype(cast) for b, a in host.items()}
            for b in missing:  # filled from the peers' replicas, after every process read
                host[b] = untouched_zeros(b[1], cast or jnp.dtype(rec.dtype))
            out = _place(shape, sharding, host, targets)
        if reader.fills is not None:
            gone = set(missing)
            reader.fills[where] = Hole(out, {d: b not in gone for b, ds in by_box.items()
                                             for d in ds}, out)
        return out
    return finish


def _writable(into: jax.Array, sharding: jax.sharding.Sharding, by_box: dict
              ) -> dict | None:
    """Writable host views of `into`'s shards (CPU backend), by target box:
    the views of the devices that hold each box, or None when `into` is not
    on `sharding`, not alive or a scalar (whose box has no view)."""
    if into.ndim == 0 or into.is_deleted() or into.sharding != sharding:
        return None
    shard = {s.device: s.data for s in into.addressable_shards}
    views: dict[tuple, list[np.ndarray]] = {}
    for box, devices in by_box.items():
        views[box] = []
        for d in devices:
            data = shard[d]
            raw = (ctypes.c_char * data.nbytes).from_address(data.unsafe_buffer_pointer())
            views[box].append(np.frombuffer(raw, dtype=data.dtype).reshape(data.shape))
    return views


def _place(shape: tuple, sharding: jax.sharding.Sharding, host: dict, targets: Targets
           ) -> jax.Array:
    """The jax array of a leaf from its host boxes, in one batched put (a put
    per shard costs an order of magnitude more than one per leaf). On the
    CPU backend each device's shard aliases its box's host buffer, several
    devices' the same one where a box is replicated, as jax's own device_put
    of a numpy array does: XLA never writes into memory it does not own (a
    donated aliased shard gets a new buffer; tests/save/test_donation.py)."""
    global _batched_put
    if _batched_put is not None and targets.boxes:
        values = [host[b] for b in targets.boxes]
        dtype = values[0].dtype
        if not jnp.issubdtype(dtype, jax.dtypes.extended):
            try:
                aval = targets.avals.get(dtype)
                if aval is None:
                    aval = targets.avals[dtype] = _core.update_aval_with_sharding(
                        _core.ShapedArray(shape, dtype), sharding)
                return _batched_put(aval, sharding, values, targets.devices)
            except (TypeError, AttributeError):  # another jax: its public way from now on
                _batched_put = None
    # (jax annotates the index `Index | None`; it never passes None.)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: host[targets.box(index, shape)])  # type: ignore[arg-type]


# jax's make_array_from_callback ends in this batched put, after about 65 us a
# leaf of checks in Python (its callback's answers' types, dtypes and shapes)
# that boxes of the planned shape and dtype never fail: a thousand leaves'
# 60 ms. Private (jax 0.10): where it is missing or refuses its arguments,
# the public call is used.
_batched_put: Callable[..., jax.Array] | None
try:
    from jax._src import core as _core
    from jax._src.interpreters.pxla import batched_device_put as _batched_put
except ImportError:  # pragma: no cover - another jax
    _batched_put = None


def _leaf_target(rec: LeafRecord, tgt: LeafTarget, where: str, layouts: Layouts
                 ) -> tuple[str, jax.sharding.Sharding | None]:
    """How one checked leaf is restored: ("none" | "scalar" | "numpy" |
    "key" | "jax", the sharding its chunks' data is placed on (key leaves:
    their key data's))."""
    if rec.kind in ("none", "scalar"):
        return rec.kind, None
    if tgt.kind == "numpy" or (tgt.kind == "value" and rec.kind.startswith("numpy")):
        return "numpy", None
    sharding = tgt.sharding if tgt.kind == "jax" else None
    if rec.kind == "prng_key":
        return "key", _key_data_sharding(sharding) or _default_sharding(rec, where, layouts)
    return "jax", sharding or _default_sharding(rec, where, layouts)


def start_leaf(rec: LeafRecord, tgt: LeafTarget, reader: ChunkReader,
               where: str, layouts: Layouts | None = None) -> Callable[[], Any]:
    """Checks one leaf's target and starts its reads; the returned call
    returns the restored leaf. `layouts` carries what leaves of one layout
    share (one per restore; None: worked out for this leaf alone)."""
    layouts = layouts or Layouts()
    _check(rec, tgt, where)
    how, sharding = _leaf_target(rec, tgt, where, layouts)
    if how == "none":
        return lambda: None
    if how == "scalar":
        value = decode_scalar(rec.value)
        return lambda: value
    cast = _cast_to(rec, tgt)
    if how == "numpy":
        full = (tuple(0 for _ in rec.shape), tuple(rec.shape))
        read = _read_boxes(rec, [full], reader, where, False, layouts=layouts.plans)

        def numpy_leaf() -> Any:
            got = read()[full]
            arr = np.array(got) if cast is None else got.astype(cast)
            return arr[()] if rec.kind == "numpy_scalar" and tgt.kind == "value" else arr
        return numpy_leaf
    assert sharding is not None  # jax and key leaves have one
    if how == "key":
        data = _start_jax(rec, sharding, reader, where, layouts=layouts)

        def key_leaf() -> Any:
            key = jax.random.wrap_key_data(data(), impl=rec.key_impl)
            if reader.fills is not None:
                reader.fills[where].out, reader.fills[where].key_impl = key, rec.key_impl
            return key
        return key_leaf
    return _start_jax(rec, sharding, reader, where, cast, tgt.into, layouts)


class Uncovered(ValueError):
    """Raised before any read where a restore from a `Choice.partial` choice
    finds target boxes that its chunks do not cover (a layout other than the
    save's): `wants` holds, per (item index, leaf index) of the step's
    records, the target boxes of this process, for the caller to read the
    manifests of the writers that hold them (`core.writers.covering`)."""

    def __init__(self, step: int, wants: dict[tuple[int, int], list]):
        super().__init__(f"step {step}: this process's manifests do not cover its targets "
                         f"({len(wants)} leaves)")
        self.wants = wants


def _check_covered(records: list[LeafRecord], targets: list[LeafTarget],
                   reader: ChunkReader, wheres: list[str], layouts: Layouts) -> None:
    """Raises Uncovered where the choice is partial and some target box of
    this process is not covered by the chunks the choice holds: every
    target box of the item's leaves that a leaf of the layout needs."""
    if not reader.choice.partial:
        return
    index = {id(lf): (ii, li) for ii, it in enumerate(reader.choice.manifest.items)
             for li, lf in enumerate(it.leaves)}
    wants: dict[tuple[int, int], list] = {}
    for rec, tgt, where in zip(records, targets, wheres, strict=True):
        _check(rec, tgt, where)
        how, sharding = _leaf_target(rec, tgt, where, layouts)
        if how in ("none", "scalar") or math.prod(rec.shape) == 0:
            continue
        boxes = ([(tuple(0 for _ in rec.shape), tuple(rec.shape))] if sharding is None
                 else list(layouts.targets(sharding, rec.shape).by_box))
        try:
            layouts.plans.plan(boxes, rec.chunks, where)
        except ValueError:
            wants[index[id(rec)]] = boxes
    if wants:
        raise Uncovered(reader.choice.step, wants)


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No garbage collection within the block (nested blocks: the outermost
    one resumes it). A restore makes futures, views and records per chunk,
    thousands for a model's state, which set off a collection every few
    leaves, and jax's hook on each collection walks its live buffers
    (several ms each); what the block allocates is freed by refcount, and
    the counts carry over, so at most one collection follows it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def restore_leaves(records: list[LeafRecord], targets: list[LeafTarget],
                   reader: ChunkReader, item: str = "") -> list[Any]:
    """The leaves of `records` restored onto `targets`: every leaf's reads
    are started before the first leaf is assembled, so the reader's threads
    read and checksum ahead while this one places arrays. The checks of the
    chunks mapped meanwhile (the RAM tier's) are deferred and run on the pool
    while the arrays are placed (`ChunkReader.check_deferred`); a leaf with
    a copy that fails is read again, from the next copies, before any leaf
    is returned."""
    t0 = time.perf_counter()
    started, layouts = [], Layouts()
    # (named by item too, past the default one: leaves of two items may share paths)
    wheres = [f"item {item!r}, leaf {path_str(rec.path)}"
              if item not in ("", args_lib.DEFAULT_ITEM) else f"leaf {path_str(rec.path)}"
              for rec in records]
    with collections_paused():
        _check_covered(records, targets, reader, wheres, layouts)
        reader.defer_checks()
        try:
            for rec, tgt, where in zip(records, targets, wheres, strict=True):
                started.append(start_leaf(rec, tgt, reader, where, layouts))
        finally:
            checked = reader.check_deferred()  # on the pool, while this thread places arrays
        out = [finish() for finish in started]
        failed = checked()
        for i, rec in enumerate(records):  # a mapped copy failed: read from the next copy
            if failed and any(c.key in failed for c in rec.chunks):
                out[i] = start_leaf(rec, targets[i], reader, wheres[i], layouts)()
    for a in out:
        if isinstance(a, jax.Array):
            a.block_until_ready()
    reader.record.seconds += time.perf_counter() - t0
    return out


# ------------------------------------------------------------------ items of a step

@apart()
def restore_choice(choice: Choice, storages: Mapping[str, Storage], naming: layout.StepNaming,
                   requests: dict | None, is_composite: bool, record: RestoreRecord,
                   bad: set, declared: frozenset[str] | None, budget: int,
                   progress: bool = False,
                   settle: Callable[[dict[str, Hole]], dict[str, jax.Array]] | None = None
                   ) -> Any:
    """Restores the items `requests` names (all, when None) of a selected step,
    each one of the items `declared` (the manager's item_names) when given.

    Copies that fail a read are added to `bad` (the caller keeps them out of
    later selections); `progress` shows a bar of the bytes read. With `settle`
    (several processes), shards this process cannot read are left as zeros,
    and once every leaf is assembled `settle(holes)` returns the leaves filled
    from the peers (by name), which replace them.
    """
    bar = None
    if progress:
        from . import progress as progress_bar
        storages, bar = progress_bar.wrap(storages, choice, jax.process_count() == 1)
    reader = ChunkReader(storages, naming, choice, bad, record, budget)
    if settle is not None:
        reader.fills = {}
    try:
        m = choice.manifest
        names = [it.name for it in m.items]
        args_lib.check_restore_items(choice.step, names, requests, declared)
        if requests is None:
            requests = {n: args_lib.RestoreRequest("any") for n in names}
            is_composite = names != [args_lib.DEFAULT_ITEM]
        out = {}
        with collections_paused():  # the targets' flattening too
            for name, req in requests.items():
                out[name] = req.finish(_restore_item(m.item(name), req, reader, choice.step))
    finally:
        reader.close()
        if bar is not None:
            bar.close()
    if settle is not None and reader.fills is not None:
        out = _settled(out, reader.fills, settle(reader.fills), record)
    if is_composite:
        return args_lib.composite(out)
    return out[args_lib.DEFAULT_ITEM]


def _restore_item(item: ItemRecord, req: args_lib.RestoreRequest, reader: ChunkReader,
                  step: int) -> Any:
    if item.kind == "json":
        if req.kind == "pytree":
            raise TargetMismatchError(f"step {step}: item {item.name!r} was saved "
                                      "with JsonSave; restore it with JsonRestore")
        return item.value
    if req.kind == "json":
        raise TargetMismatchError(f"step {step}: item {item.name!r} is a pytree; "
                                  "restore it with StandardRestore or PyTreeRestore")
    saved_paths = [lf.path for lf in item.leaves]
    where = f"step {step}, item {item.name!r}"
    if req.item is None:
        records = list(item.leaves)
        targets = [target_for(None, metadata.restore_arg_for(req.restore_args, lf.path))
                   for lf in records]
        values = restore_leaves(records, targets, reader, item.name)
        return build_nested(list(zip(saved_paths, values, strict=True)))
    pairs, treedef = flatten(req.item)
    wanted = [(p, leaf) for p, leaf in pairs if leaf is not PLACEHOLDER]
    idx = match_target(saved_paths, [p for p, _ in wanted], partial=req.partial, where=where,
                       placeholders=tuple(p for p, leaf in pairs if leaf is PLACEHOLDER))
    records = [item.leaves[i] for i in idx]
    targets = [target_for(leaf, metadata.restore_arg_for(req.restore_args, p))
               for p, leaf in wanted]
    read = iter(restore_leaves(records, targets, reader, item.name))
    return unflatten(treedef, [leaf if leaf is PLACEHOLDER else next(read)
                               for _, leaf in pairs])


def _settled(out: dict, holes: dict[str, Hole], filled: dict[str, jax.Array],
             record: RestoreRecord) -> dict:
    """The restored items with the leaves the peers filled put in."""
    if not filled:
        return out
    swap = {}
    for where, array in filled.items():
        hole = holes[where]
        record.bytes_by_tier["peers"] += hole.missing_bytes()
        swap[id(hole.out)] = hole.filled(array)
    return {name: jax.tree_util.tree_map(lambda x: swap.get(id(x), x), tree)
            for name, tree in out.items()}
