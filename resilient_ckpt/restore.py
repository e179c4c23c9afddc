"""Reading a selected step back: verified chunk reads and array assembly.

Each chunk is read from the first tier in its source list whose copy passes its
checksums; a failed copy is marked bad and the next tier is tried. Target
shards that are exactly one saved chunk are used as read (on the CPU backend,
aliased into the jax array without a copy). Others are assembled chunk by
chunk: only the checksum blocks holding needed rows are read, through a
staging buffer bounded by the restore memory budget, so host memory peaks at
the restored state plus that budget. The record says which tier served each
chunk, the bytes read per tier, and what fell back.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np

from . import args as args_lib, codec, layout, metadata
from .errors import CorruptCheckpointError, ItemNotFoundError, StorageError, TargetMismatchError
from .hostmem import Region, host_buffer
from .manifest import ChunkRecord, ItemRecord, LeafRecord, decode_scalar, path_str
from .planner import blocks_for_rows, plan_target, rows_per_block
from .pytree import build_nested, flatten, match_target, unflatten
from .selection import Choice
from .sharding import index_to_box, rebuild
from .storage.base import Storage


@dataclasses.dataclass
class RestoreRecord:
    step: int
    seconds: float = 0.0
    bytes_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    chunks_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    served: dict = dataclasses.field(default_factory=dict)  # chunk key -> tier
    fallbacks: list = dataclasses.field(default_factory=list)


class ChunkReader:
    """Verified reads of one selected step's chunks, fastest intact copy first.

    `whole` returns a chunk's bytes; `pieces` copies parts of a chunk into
    destination arrays, reading (range reads, or a RAM-tier mapping) only the
    checksum blocks that hold the rows those parts need, through a staging
    buffer of at most `budget` bytes.
    """

    def __init__(self, storages: Mapping[str, Storage], naming: layout.StepNaming,
                 choice: Choice, bad: set, record: RestoreRecord,
                 budget: int = 256 * 1024 * 1024):
        self.storages, self.choice, self.bad, self.record = storages, choice, bad, record
        self.dir = naming.name(choice.step)
        self.budget = max(1, budget)
        self._staging: np.ndarray | None = None
        self._lock = threading.Lock()
        # Whole-chunk reads of one leaf run side by side: preadv and the
        # checksum overlap across chunks (1.4-1.75x on a cold disk here).
        self.pool = cf.ThreadPoolExecutor(4, thread_name_prefix="rc-restore")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _stage(self, nbytes: int) -> np.ndarray:
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = host_buffer(min(max(nbytes, 1 << 20), max(self.budget, nbytes)))
        return self._staging[:nbytes]

    def _from_tiers(self, c: ChunkRecord, where: str, read):
        """Runs read(storage, key) against each copy until one verifies."""
        tried = []
        for tier in self.choice.sources.get(c.key, ()):
            if (tier, c.key) in self.bad:
                continue
            st = self.storages[tier]
            try:
                out, nread = read(st, f"{self.dir}/{c.key}")
            except (CorruptCheckpointError, StorageError) as e:
                tried.append(f"{tier}: {e}")
                self._failed(tier, c.key, f"step {self.choice.step}, {where}: chunk {c.key} "
                             f"from the {tier} tier failed ({e}); trying the next copy")
                continue
            self._served(tier, c.key, nread)
            return out
        raise CorruptCheckpointError(
            f"step {self.choice.step}, {where}: chunk {c.key} has no intact copy "
            f"(tried {tried or 'none'}); restore an older step (latest_step() now "
            "skips this one)")

    def whole(self, c: ChunkRecord, where: str, zero_copy: bool) -> np.ndarray:
        """The chunk's verified, uncompressed bytes in a buffer of its own (or,
        with zero_copy, a copy-on-write mapping of a RAM-tier object)."""
        def read(st: Storage, key: str):
            raw = c.codec == "raw"
            buf = st.map(key, c.stored_nbytes) if zero_copy and raw else None
            if buf is None:
                buf = host_buffer(c.stored_nbytes)
                st.read_into(key, buf.data)
            if not raw:
                buf = codec.decode(c.codec, buf, c.nbytes, host_buffer(c.nbytes))
            if google_crc32c.value(buf) != c.crc32c:
                raise CorruptCheckpointError(f"crc32c mismatch in {st.url}/{key}")
            return buf, c.stored_nbytes
        return self._from_tiers(c, where, read)

    def pieces(self, c: ChunkRecord, dtype: np.dtype,
               parts: list[tuple[tuple[slice, ...], np.ndarray]], where: str) -> list:
        """Copies chunk[src] into dst for each (src, dst) of `parts`; returns
        futures of the parts read straight into their destination meanwhile."""
        rpb = rows_per_block(c)
        if c.codec != "raw" or rpb is None:
            arr = self.whole(c, where, True).view(dtype).reshape(c.sizes)
            for src, dst in parts:
                dst[...] = arr[src]
            return []
        first = next((t for t in self.choice.sources.get(c.key, ())
                      if (t, c.key) not in self.bad), None)
        futures = []
        if first is not None and not self.storages[first].zero_copy:
            # Parts of whole rows go straight into place; only the rest is staged.
            # (Split by index: the parts are tuples, equal ones may be distinct.)
            flags = [_rows_in_place(c, src, dst) for src, dst in parts]
            futures = [self.pool.submit(self.direct, c, dtype, src, dst, where)
                       for (src, dst), f in zip(parts, flags, strict=True) if f]
            parts = [p for p, f in zip(parts, flags, strict=True) if not f]
        if parts:
            self._staged(c, rpb, dtype, parts, where)
        return futures

    def direct(self, c: ChunkRecord, dtype: np.dtype, src: tuple, dst: np.ndarray,
               where: str) -> None:
        """Reads rows src[0] of a chunk straight into a contiguous dst (its
        trailing extent is the chunk's): blocks wholly inside are read in place
        and verified there; the at most two blocks at the ends go through a
        small buffer of their own, so no byte is read twice."""
        rpb, n, bb = rows_per_block(c), c.sizes[0], c.block_bytes
        assert rpb is not None  # pieces() sends only chunks whose blocks follow rows
        row = c.nbytes // n
        a, b = src[0].start, src[0].stop
        inner = range(-(-a // rpb), (b // rpb) if b < n else -(-n // rpb))
        ends = sorted({a // rpb, (b - 1) // rpb} - set(inner))
        flat = dst.reshape(-1).view(np.uint8)

        def read(st: Storage, key: str):
            nread = 0
            if len(inner):
                r_lo, r_hi = inner.start * rpb, min(inner.stop * rpb, n)
                seg = flat[(r_lo - a) * row:(r_hi - a) * row]
                st.read_into(key, seg.data, offset=r_lo * row)
                nread += len(seg)
                for i, blk in enumerate(inner):
                    if google_crc32c.value(seg[i * bb:(i + 1) * bb]) != c.block_crc32c[blk]:
                        raise CorruptCheckpointError(
                            f"crc32c mismatch in block {blk} of {st.url}/{key}")
            for blk in ends:
                start, stop = blk * bb, min((blk + 1) * bb, c.nbytes)
                stage = np.empty(stop - start, np.uint8)
                st.read_into(key, stage.data, offset=start)
                nread += len(stage)
                if google_crc32c.value(stage) != c.block_crc32c[blk]:
                    raise CorruptCheckpointError(
                        f"crc32c mismatch in block {blk} of {st.url}/{key}")
                rows = stage.view(dtype).reshape((len(stage) // row,) + tuple(c.sizes[1:]))
                _copy_rows([(src, dst)], rows, blk * rpb)
            return None, nread
        self._from_tiers(c, where, read)

    def _staged(self, c: ChunkRecord, rpb: int, dtype: np.dtype, parts: list,
                where: str) -> None:
        """The general case: the blocks holding the parts' rows, read through the
        shared staging buffer (or the RAM tier's mapping), then copied."""
        row_bytes = c.nbytes // c.sizes[0]
        spans = blocks_for_rows(c, [(src[0].start, src[0].stop) for src, _ in parts])
        step_blocks = max(1, self.budget // c.block_bytes)

        def read(st: Storage, key: str):
            mapped = st.map(key, c.nbytes)
            nread = 0
            for b0, b1 in spans:
                for lo in range(b0, b1, step_blocks):
                    hi = min(b1, lo + step_blocks)
                    start, stop = lo * c.block_bytes, min(hi * c.block_bytes, c.nbytes)
                    if mapped is not None:
                        seg = mapped[start:stop]
                    else:
                        seg = self._stage(stop - start)
                        st.read_into(key, seg.data, offset=start)
                    nread += stop - start
                    for i, b in enumerate(range(lo, hi)):
                        blk = seg[i * c.block_bytes:(i + 1) * c.block_bytes]
                        if google_crc32c.value(blk) != c.block_crc32c[b]:
                            raise CorruptCheckpointError(
                                f"crc32c mismatch in block {b} of {st.url}/{key}")
                    r0 = lo * rpb
                    rows = seg.view(dtype).reshape(((stop - start) // row_bytes,) + c.sizes[1:])
                    _copy_rows(parts, rows, r0)
            return None, nread
        self._from_tiers(c, where, read)


    def stitched(self, box, plan, dtype: np.dtype) -> np.ndarray | None:
        """The target box as one array mapped from RAM-tier chunk rows without a
        copy, when it stacks whole rows of chunks (same trailing extent) at page
        boundaries and every copy verifies; else None (and the caller copies)."""
        pieces = sorted(plan.pieces, key=lambda p: p.dst[0].start if p.dst else 0)
        if not pieces or not box[1]:
            return None
        picks = []
        for p in pieces:
            c = p.chunk
            full = all(sl == slice(0, n)
                       for sl, n in zip(p.src[1:], c.sizes[1:], strict=False)) and \
                tuple(c.sizes[1:]) == tuple(box[1][1:])
            tier = next((t for t in self.choice.sources.get(c.key, ())
                         if (t, c.key) not in self.bad), None)
            if not full or c.codec != "raw" or rows_per_block(c) is None or tier is None \
                    or not self.storages[tier].zero_copy:
                return None
            picks.append((p, tier))
        total = int(np.prod(box[1], dtype=np.int64)) * dtype.itemsize
        region, dest = Region(total), 0
        for p, tier in picks:
            c = p.chunk
            row = c.nbytes // c.sizes[0]
            length = (p.src[0].stop - p.src[0].start) * row
            if not self.storages[tier].place(f"{self.dir}/{c.key}", region,
                                             p.src[0].start * row, dest, length):
                return None
            dest += length
        for p, tier in picks:  # verify the blocks under every placed row
            c, st = p.chunk, self.storages[tier]
            key = f"{self.dir}/{c.key}"
            view = st.map(key, c.nbytes)
            # None only if the object is now shorter than the manifest says (it was
            # long enough for place()); that raised TypeError below before.
            assert view is not None
            nread = 0
            for b0, b1 in blocks_for_rows(c, [(p.src[0].start, p.src[0].stop)]):
                for b in range(b0, b1):
                    blk = view[b * c.block_bytes:(b + 1) * c.block_bytes]
                    nread += len(blk)
                    if google_crc32c.value(blk) != c.block_crc32c[b]:
                        self._failed(tier, c.key, f"step {self.choice.step}: chunk {c.key} "
                                     f"from the {tier} tier failed (crc32c mismatch in "
                                     f"block {b} of {st.url}/{key}); trying the next copy")
                        return None
            self._served(tier, c.key, nread)
        return region.array().view(dtype).reshape(box[1])


    def _failed(self, tier: str, key: str, msg: str) -> None:
        with self._lock:
            self.bad.add((tier, key))
            self.record.fallbacks.append(msg)

    def _served(self, tier: str, key: str, nread: int) -> None:
        with self._lock:
            self.record.bytes_by_tier[tier] += nread
            self.record.chunks_by_tier[tier] += 1
            self.record.served[key] = tier


def _rows_in_place(c: ChunkRecord, src: tuple, dst: np.ndarray) -> bool:
    """True when chunk[src] is whole rows laid out exactly as contiguous dst."""
    return (dst.flags.c_contiguous and tuple(dst.shape[1:]) == tuple(c.sizes[1:])
            and all(sl == slice(0, k) for sl, k in zip(src[1:], c.sizes[1:], strict=False)))


def _copy_rows(parts, rows: np.ndarray, r0: int) -> None:
    """Copies the rows [r0, r0 + len(rows)) that each part needs into its dst."""
    r1 = r0 + rows.shape[0]
    for src, dst in parts:
        lo, hi = max(src[0].start, r0), min(src[0].stop, r1)
        if hi <= lo:
            continue
        d0 = lo - src[0].start
        dst[(slice(d0, d0 + hi - lo),) + (slice(None),) * (dst.ndim - 1)] = \
            rows[(slice(lo - r0, hi - r0),) + tuple(src[1:])]


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


def _host_boxes(rec: LeafRecord, boxes: list, reader: ChunkReader, where: str,
                zero_copy: bool) -> dict:
    """Host arrays for each target box of one leaf, read chunk by chunk."""
    dtype = jnp.dtype(rec.dtype)
    out, parts, chunks, wholes, plans = {}, collections.defaultdict(list), {}, {}, {}
    for box in boxes:
        plan = plan_target(box, rec.chunks, where)
        if plan.single is not None:
            wholes[box] = reader.pool.submit(reader.whole, plan.single, where, zero_copy)
            continue
        mapped = reader.stitched(box, plan, dtype) if zero_copy else None
        if mapped is not None:
            out[box] = mapped
        else:
            nbytes = int(np.prod(box[1], dtype=np.int64)) * dtype.itemsize
            plans[box] = (plan, reader.pool.submit(host_buffer, nbytes))  # faulted in parallel
    for box, (plan, buf) in plans.items():
        out[box] = buf.result().view(dtype).reshape(box[1])
        for p in plan.pieces:
            parts[p.chunk.key].append((p.src, out[box][p.dst]))
            chunks[p.chunk.key] = p.chunk
    futures = []
    for key, c in chunks.items():
        futures += reader.pieces(c, dtype, parts[key], where)
    for f in futures:
        f.result()
    for box, fut in wholes.items():
        out[box] = fut.result().view(dtype).reshape(box[1])
    return out


def _to_jax(rec: LeafRecord, sharding: jax.sharding.Sharding, reader: ChunkReader,
            where: str) -> jax.Array:
    shape = rec.shape
    index_map = sharding.addressable_devices_indices_map(shape)
    by_box = collections.defaultdict(list)
    for d, idx in index_map.items():
        # jax annotates the map's values `Index | None`, but each is a subset of
        # devices_indices_map's, which are never None.
        by_box[index_to_box(idx, shape)].append(d)  # type: ignore[arg-type]
    # jaxlib ships no stubs for _jax, so jax's Device type is unresolved.
    cpu = all(d.platform == "cpu" for d in index_map)  # type: ignore[attr-defined]
    host = _host_boxes(rec, list(by_box), reader, where, cpu)
    by_dev = {}
    for box, devices in by_box.items():
        for i, d in enumerate(devices):
            # Alias a host buffer into at most one device array: two arrays on
            # one buffer would see each other's donated writes.
            by_dev[d] = jax.device_put(host[box], d, may_alias=(cpu and i == 0))
    return jax.make_array_from_single_device_arrays(shape, sharding,
                                                    [by_dev[d] for d in index_map])


def restore_leaf(rec: LeafRecord, tgt: LeafTarget, reader: ChunkReader, where: str) -> Any:
    _check(rec, tgt, where)
    if rec.kind == "none":
        return None
    if rec.kind == "scalar":
        return decode_scalar(rec.value)
    if tgt.kind == "numpy" or (tgt.kind == "value" and rec.kind.startswith("numpy")):
        full = (tuple(0 for _ in rec.shape), tuple(rec.shape))
        arr = np.array(_host_boxes(rec, [full], reader, where, False)[full])
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
    for rec, tgt in zip(records, targets, strict=True):
        out.append(restore_leaf(rec, tgt, reader, f"leaf {path_str(rec.path)}"))
    for a in out:
        if isinstance(a, jax.Array):
            a.block_until_ready()
    reader.record.seconds += time.perf_counter() - t0
    return out


# ------------------------------------------------------------------ items of a step

def restore_choice(choice: Choice, storages: Mapping[str, Storage], naming: layout.StepNaming,
                   requests: dict | None, is_composite: bool, record: RestoreRecord,
                   bad: set, budget: int, progress: bool = False) -> Any:
    """Restores the items `requests` names (all, when None) of a selected step.

    Copies that fail a read are added to `bad` (the caller keeps them out of
    later selections); `progress` shows a bar of the bytes read.
    """
    bar = None
    if progress:
        from . import progress as progress_bar
        storages, bar = progress_bar.wrap(storages, choice, jax.process_count() == 1)
    reader = ChunkReader(storages, naming, choice, bad, record, budget)
    try:
        m = choice.manifest
        names = [it.name for it in m.items]
        if requests is None:
            requests = {n: args_lib.RestoreRequest("any") for n in names}
            is_composite = names != [args_lib.DEFAULT_ITEM]
        out = {}
        for name, req in requests.items():
            if name not in names:
                raise ItemNotFoundError(f"step {choice.step} has no item {name!r} "
                                        f"(items: {names})")
            out[name] = _restore_item(m.item(name), req, reader, choice.step)
    finally:
        reader.close()
        if bar is not None:
            bar.close()
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
        values = restore_leaves(records, targets, reader)
        return build_nested(list(zip(saved_paths, values, strict=True)))
    pairs, treedef = flatten(req.item)
    idx = match_target(saved_paths, [p for p, _ in pairs], partial=req.partial, where=where)
    records = [item.leaves[i] for i in idx]
    targets = [target_for(leaf, metadata.restore_arg_for(req.restore_args, p))
               for p, leaf in pairs]
    return unflatten(treedef, restore_leaves(records, targets, reader))
