"""Reading a selected step back: verified chunk reads and array assembly.

Each chunk is read from the first tier in its source list whose copy passes its
crc32c; a failed copy is marked bad and the next tier is tried. Target shards
that are exactly one saved chunk are used as read (on the CPU backend, aliased
into the jax array without a copy); others are assembled from the intersecting
chunks. The record says which tier served each chunk and what fell back.
"""
from __future__ import annotations

import collections
import dataclasses
import mmap
import time
from typing import Any, Mapping

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np

from . import codec, layout
from .errors import CorruptCheckpointError, StorageError, TargetMismatchError
from .manifest import ChunkRecord, LeafRecord, decode_scalar, path_str
from .planner import plan_target
from .selection import Choice
from .sharding import box_to_slices, index_to_box, rebuild
from .storage.base import Storage


@dataclasses.dataclass
class RestoreRecord:
    step: int
    seconds: float = 0.0
    bytes_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    chunks_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    served: dict = dataclasses.field(default_factory=dict)  # chunk key -> tier
    fallbacks: list = dataclasses.field(default_factory=list)


def host_buffer(nbytes: int) -> np.ndarray:
    """A fresh page-aligned buffer (huge pages where the kernel gives them)."""
    m = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=np.uint8)[:nbytes]


class ChunkReader:
    def __init__(self, storages: Mapping[str, Storage], naming: layout.StepNaming,
                 choice: Choice, bad: set, record: RestoreRecord):
        self.storages, self.choice, self.bad, self.record = storages, choice, bad, record
        self.dir = naming.name(choice.step)

    def get(self, c: ChunkRecord, where: str, zero_copy: bool) -> np.ndarray:
        tried = []
        for tier in self.choice.sources.get(c.key, ()):
            if (tier, c.key) in self.bad:
                continue
            st = self.storages[tier]
            key = f"{self.dir}/{c.key}"
            try:
                raw = c.codec == "raw"
                buf = st.map(key, c.stored_nbytes) if zero_copy and raw else None
                if buf is None:
                    buf = host_buffer(c.stored_nbytes)
                    st.read_into(key, memoryview(buf))
                if not raw:
                    buf = codec.decode(c.codec, buf, c.nbytes, host_buffer(c.nbytes))
                if google_crc32c.value(buf) != c.crc32c:
                    raise CorruptCheckpointError(f"crc32c mismatch in {st.url}/{key}")
            except (CorruptCheckpointError, StorageError) as e:
                self.bad.add((tier, c.key))
                tried.append(f"{tier}: {e}")
                self.record.fallbacks.append(
                    f"step {self.choice.step}, {where}: chunk {c.key} from the {tier} tier "
                    f"failed ({e}); trying the next copy")
                continue
            self.record.bytes_by_tier[tier] += c.stored_nbytes
            self.record.chunks_by_tier[tier] += 1
            self.record.served[c.key] = tier
            return buf
        raise CorruptCheckpointError(
            f"step {self.choice.step}, {where}: chunk {c.key} has no intact copy "
            f"(tried {tried or 'none'}); restore an older step (latest_step() now "
            "skips this one)")


@dataclasses.dataclass(frozen=True)
class LeafTarget:
    """How to produce one leaf: a jax array on `sharding`, a numpy value, or as saved."""

    kind: str  # "jax", "numpy", "value"
    shape: tuple | None = None
    dtype: Any = None
    sharding: jax.sharding.Sharding | None = None


def target_for(leaf: Any, restore_arg: Any = None) -> LeafTarget:
    sharding = getattr(restore_arg, "sharding", None)
    if isinstance(leaf, (jax.ShapeDtypeStruct, jax.Array)):
        return LeafTarget("jax", tuple(leaf.shape), leaf.dtype,
                          sharding or getattr(leaf, "sharding", None))
    if isinstance(leaf, np.ndarray):
        return LeafTarget("numpy", tuple(leaf.shape), leaf.dtype)
    if sharding is not None:
        return LeafTarget("jax", None, getattr(restore_arg, "dtype", None), sharding)
    return LeafTarget("value")


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
    if tgt.dtype is None:
        return
    is_key = jnp.issubdtype(tgt.dtype, jax.dtypes.prng_key)
    if is_key != (rec.kind == "prng_key") or (
            not is_key and np.dtype(tgt.dtype).name != rec.dtype):
        saved = f"key<{rec.key_impl}>" if rec.kind == "prng_key" else rec.dtype
        raise TargetMismatchError(f"{where}: saved with dtype {saved}, target has dtype "
                                  f"{tgt.dtype}")


def _key_data_sharding(s: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec, None))
    return s


def _default_sharding(rec: LeafRecord, where: str) -> jax.sharding.Sharding:
    s = rebuild(rec.sharding)
    if s is not None:
        return s
    if rec.sharding and rec.sharding.get("type") != "other":
        raise TargetMismatchError(
            f"{where}: saved on devices {rec.sharding.get('device_ids', rec.sharding)}, "
            "not all of which exist now; restore with a target that gives shardings "
            "(StandardRestore(abstract_tree) with jax.ShapeDtypeStruct leaves)")
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _assemble(rec: LeafRecord, box, reader: ChunkReader, where: str, zero_copy: bool,
              cache: dict) -> np.ndarray:
    dtype = jnp.dtype(rec.dtype)
    plan = plan_target(box, rec.chunks, where)
    single = plan.single
    if single is not None:
        return reader.get(single, where, zero_copy).view(dtype).reshape(box[1])
    out = host_buffer(int(np.prod(box[1], dtype=np.int64)) * dtype.itemsize)
    out = out.view(dtype).reshape(box[1])
    for p in plan.pieces:
        if p.chunk.key not in cache:
            cache[p.chunk.key] = reader.get(p.chunk, where, True).view(dtype).reshape(
                p.chunk.sizes)
        out[p.dst] = cache[p.chunk.key][p.src]
    return out


def _to_jax(rec: LeafRecord, sharding: jax.sharding.Sharding, reader: ChunkReader,
            where: str) -> jax.Array:
    shape = rec.shape
    cache: dict = {}
    by_box = collections.defaultdict(list)
    for d, idx in sharding.addressable_devices_indices_map(shape).items():
        by_box[index_to_box(idx, shape)].append(d)
    arrays = []
    for box, devices in by_box.items():
        cpu = devices[0].platform == "cpu"
        host = _assemble(rec, box, reader, where, cpu, cache)
        for i, d in enumerate(devices):
            # Alias the host buffer into at most one device array: two arrays on
            # one buffer would see each other's donated writes.
            arrays.append(jax.device_put(host, d, may_alias=(cpu and i == 0)))
    by_dev = {a.devices().pop(): a for a in arrays}
    ordered = [by_dev[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, ordered)


def restore_leaf(rec: LeafRecord, tgt: LeafTarget, reader: ChunkReader, where: str) -> Any:
    _check(rec, tgt, where)
    if rec.kind == "none":
        return None
    if rec.kind == "scalar":
        return decode_scalar(rec.value)
    if tgt.kind == "numpy" or (tgt.kind == "value" and rec.kind.startswith("numpy")):
        full = (tuple(0 for _ in rec.shape), tuple(rec.shape))
        arr = np.array(_assemble(rec, full, reader, where, False, {}))
        if rec.kind == "numpy_scalar" and tgt.kind == "value":
            return arr[()]
        return arr
    sharding = tgt.sharding if tgt.kind == "jax" else None
    if rec.kind == "prng_key":
        data_sharding = _key_data_sharding(sharding) or _default_sharding(rec, where)
        data = _to_jax(rec, data_sharding, reader, where)
        return jax.random.wrap_key_data(data, impl=rec.key_impl)
    return _to_jax(rec, sharding or _default_sharding(rec, where), reader, where)


def restore_leaves(records: list[LeafRecord], targets: list[LeafTarget],
                   reader: ChunkReader) -> list[Any]:
    t0 = time.perf_counter()
    out = []
    for rec, tgt in zip(records, targets):
        out.append(restore_leaf(rec, tgt, reader, f"leaf {path_str(rec.path)}"))
    for a in out:
        if isinstance(a, jax.Array):
            a.block_until_ready()
    reader.record.seconds += time.perf_counter() - t0
    return out
