"""Device-to-host snapshots into reused host memory.

This is the only part of a save that blocks training. Each unique shard (replica
0 of each box this process holds) is copied into a slab from `HostPool`; the
copy completes before `take` returns, so the next step may donate or overwrite
the state's buffers. Slabs are anonymous huge-page mappings kept for the next
save: the first save pays for touching fresh memory (on a VM an order of
magnitude slower than a copy into memory already touched; docs/environment.md),
unless the pool faulted its slab in ahead (`HostPool.warm`: after a restore,
or a save call that was not due); every later save of the same state copies
into warm memory. The pool holds at most what the host-memory budget lets be in
flight.

On the CPU backend the devices' buffers are host memory already, and jax
neither donates nor frees a buffer that a numpy view holds. There a save that
finds no slab ready takes views instead of copies (`viewed`: nothing copied on
the training thread); the views go when the tiers let go of the snapshot, and
then the pool faults a slab in for the next save in the background (not
before: faulting in on both cores beside the save's own writes slowed them).

Threads: `rc-pool-warm`, a daemon that faults one slab in (`native.hostmem`,
whose own pool interpreter exit joins); it touches no jax array, so exit may
end it and the slab is simply not kept. `rc-view-check` (`check_views_early`),
once per process: the views' one check, ahead of the first save.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import mmap
import threading
import warnings
from typing import Any

import jax
import numpy as np

from ..core import layout
from ..core.ambient import apart
from ..core.manifest import ChunkRecord, ItemRecord, LeafRecord, encode_scalar
from ..core.planner import block_bytes_for, unique_boxes
from ..core.pytree import flatten, leaf_kind
from ..core.sharding import box_elements, describe, index_to_box
from ..native import crc32c
from ..native.hostmem import host_mmap

_ALIGN = 4096
COPY_THREADS = 2  # the copy pool's (saver.py): a snapshot gives each one job
log = logging.getLogger("resilient_ckpt")


class HostPool:
    """Slabs of host memory reused across saves, bounded by what callers hold.

    `warm` faults a slab in ahead, on a thread of its own (without the GIL),
    so that the first save copies into touched memory too; a `take` that
    such a slab would fit waits for it rather than faulting in another.
    """

    def __init__(self):
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._warming: tuple[int, threading.Event] | None = None
        self._closed = False  # `close`: no more slabs faulted in or kept

    def take(self, nbytes: int) -> tuple[mmap.mmap, bool]:
        """A slab of at least `nbytes`, and whether it is fresh (faulted in now)."""
        with self._lock:
            warming = self._warming
        if warming is not None and warming[0] >= nbytes:
            warming[1].wait()  # part faulted in already: less to wait for than a new one
        with self._lock:
            fits = [m for m in self._free if len(m) >= nbytes]
            if fits:
                m = min(fits, key=len)
                self._free.remove(m)
                return m, False
        return host_mmap(nbytes, threads=2), True  # populated in two calls, not page by page

    def warm(self, nbytes: int) -> bool:
        """Starts faulting in a slab of `nbytes` in the background, unless one
        that size fits is free or on its way; whether it started one."""
        with self._lock:
            if nbytes <= 0 or self._closed or self._warming is not None or any(
                    len(m) >= nbytes for m in self._free):
                return False
            self._warming = (nbytes, threading.Event())
        threading.Thread(target=self._fault_in, args=(nbytes,), name="rc-pool-warm",
                         daemon=True).start()
        return True

    def _fault_in(self, nbytes: int) -> None:
        try:
            m = host_mmap(nbytes, threads=2)  # half the time: done before the first save
        except OSError as e:  # out of memory now: the first save faults its own slab in
            log.warning("could not fault in %d bytes of host memory ahead of the first "
                        "save (%s)", nbytes, e)
            m = None
        with self._lock:
            if m is not None and not self._closed:
                self._free.append(m)
            assert self._warming is not None
            done, self._warming = self._warming[1], None
        done.set()

    def settled(self, timeout: float | None = None) -> bool:
        """Waits until no slab is being faulted in; whether none is."""
        with self._lock:
            warming = self._warming
        return warming is None or warming[1].wait(timeout)

    def give(self, m: mmap.mmap) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(m)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._free)

    def has(self, nbytes: int) -> bool:
        """Whether a free slab of `nbytes` is ready now (none is faulted in by a take)."""
        with self._lock:
            return any(len(m) >= nbytes for m in self._free)

    def close(self) -> None:
        """Drops every slab, and any being faulted in once it is; warms no more."""
        with self._lock:
            self._closed = True
            self._free.clear()


@dataclasses.dataclass
class SnapChunk:
    item: int
    leaf: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str
    data: np.ndarray  # uint8 view into the slab
    itemsize: int = 1
    crc: int | None = None
    block_bytes: int = 0
    blocks: tuple[int, ...] = ()
    primary: bool = True  # written for the job; False: a copy kept for this host only


@dataclasses.dataclass
class Snapshot:
    """One step's host copy: leaf records without chunks, and the chunk bytes."""

    step: int
    save_id: str
    items: list[ItemRecord]
    chunks: list[SnapChunk]
    nbytes: int
    slab: mmap.mmap | None
    copy_s: float = 0.0
    fresh_bytes: int = 0  # of the slab, faulted in by this snapshot (none from a warm pool)
    # The chunks are views of the devices' own buffers (`viewed`), not a slab.
    views: bool = False
    # The copy on the owning hosts, when the devices' shards stay there
    # (colocated.py); `chunks` then holds only what the controller itself holds.
    placed: Any = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def crc(self, i: int) -> int:
        """The chunk's crc32c (computing it and its block checksums once)."""
        c = self.chunks[i]
        if c.crc is None:
            bb, blocks, whole = checksums(c.data, c.sizes, c.itemsize)
            with self._lock:
                c.block_bytes, c.blocks, c.crc = bb, blocks, whole
        return c.crc

    def record(self, i: int) -> ChunkRecord:
        """Chunk `i`'s record as stored raw (checksums computed)."""
        c, crc = self.chunks[i], self.crc(i)
        n = int(c.data.nbytes)
        return ChunkRecord(c.offsets, c.sizes, c.key, n, n, crc, "raw", c.block_bytes, c.blocks)

    def indices(self, primary_only: bool) -> list[int]:
        """The chunks a tier writes: all, or only the primary ones."""
        return [i for i, c in enumerate(self.chunks) if c.primary or not primary_only]

    def manifest_items(self, primary_only: bool = False) -> tuple[ItemRecord, ...]:
        """Item records with this snapshot's chunks (checksums computed)."""
        per_leaf: dict[tuple[int, int], list[ChunkRecord]] = {}
        for i in self.indices(primary_only):
            c = self.chunks[i]
            per_leaf.setdefault((c.item, c.leaf), []).append(self.record(i))
        return with_chunks(self.items, per_leaf)


def with_chunks(items: list[ItemRecord], per_leaf: dict[tuple[int, int], list[ChunkRecord]]
                ) -> tuple[ItemRecord, ...]:
    """Item records whose leaves hold the chunks of `per_leaf` ((item, leaf) ->
    chunk records), none where it has no entry."""
    out = []
    for ii, it in enumerate(items):
        leaves = tuple(dataclasses.replace(lf, chunks=tuple(per_leaf.get((ii, li), ())))
                       for li, lf in enumerate(it.leaves))
        out.append(dataclasses.replace(it, leaves=leaves))
    return tuple(out)


def checksums(data: np.ndarray, sizes: tuple[int, ...], itemsize: int
              ) -> tuple[int, tuple[int, ...], int]:
    """(block_bytes, block crc32cs, whole crc32c) of a chunk's raw bytes
    (`data`, uint8), in blocks of whole rows (format.md, section 4)."""
    bb = block_bytes_for(sizes, itemsize)
    n = int(data.nbytes)
    blocks = [crc32c.value(data[start:start + bb]) for start in range(0, n, bb)]
    # one pass over the bytes: the whole CRC from the blocks'
    return (bb if blocks else 0), tuple(blocks), crc32c.combined(blocks, bb, n)


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


@apart()
def describe_items(items: list[tuple[str, str, Any]], save_id: str, process_index: int,
                   replicas: bool = False
                   ) -> tuple[list[ItemRecord], list[tuple[int, int, tuple, str, Any, bool]]]:
    """Leaf records for (name, kind, value) items, and the chunk sources this
    process must copy: (item, leaf, box, key, source, primary).

    Primary sources are the boxes this process writes for the job (replica 0
    of each box; numpy leaves on process 0). With `replicas`, also one copy of
    every other box its devices hold (and the numpy leaves), for tiers that
    keep what each host holds, so a host restores its own shards alone.
    """
    records, sources = [], []
    for ii, (name, kind, value) in enumerate(items):
        if kind == "json":
            records.append(ItemRecord(name, "json", (), value))
            continue
        leaves = []
        for li, (path, leaf) in enumerate(flatten(value)[0]):
            k = leaf_kind(leaf, path)
            if k in ("array", "prng_key"):
                impl = str(jax.random.key_impl(leaf)) if k == "prng_key" else None
                data = jax.random.key_data(leaf) if k == "prng_key" else leaf
                leaves.append(LeafRecord(path, k, tuple(data.shape), _dtype_name(data.dtype),
                                         describe(data.sharding), impl))
                shards = {(index_to_box(s.index, data.shape), s.replica_id): s
                          for s in data.addressable_shards}
                primary = unique_boxes(shards)
                for box in primary:
                    key = f"{save_id[:8]}." + layout.chunk_key(ii, li, box[0])
                    sources.append((ii, li, box, key, shards[(box, 0)].data, True))
                if replicas:
                    held: dict[tuple, int] = {}  # box -> its lowest replica held here
                    for b, r in shards:
                        held[b] = min(r, held.get(b, r))
                    for box in [b for b in held if b not in set(primary)]:
                        key = f"{save_id[:8]}." + layout.chunk_key(ii, li, box[0])
                        sources.append((ii, li, box, key, shards[(box, held[box])].data, False))
            elif k in ("numpy", "numpy_scalar"):
                # ascontiguousarray makes 0-d arrays 1-d; keep the leaf's own shape.
                arr = np.ascontiguousarray(leaf).reshape(np.shape(leaf))
                if not arr.dtype.isnative:  # stored bytes are native order (format.md)
                    arr = arr.astype(arr.dtype.newbyteorder("="))
                leaves.append(LeafRecord(path, k, tuple(arr.shape), _dtype_name(arr.dtype)))
                if process_index == 0 or replicas:
                    box = (tuple(0 for _ in arr.shape), tuple(arr.shape))
                    key = f"{save_id[:8]}." + layout.chunk_key(ii, li, box[0])
                    sources.append((ii, li, box, key, arr, process_index == 0))
            elif k == "scalar":
                leaves.append(LeafRecord(path, k, value=encode_scalar(leaf)))
            else:
                leaves.append(LeafRecord(path, "none"))
        records.append(ItemRecord(name, "pytree", tuple(leaves)))
    return records, sources


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def slab_layout(sources: list) -> tuple[list[int], list[int], int]:
    """(bytes, slab offset) of each of `describe_items`'s sources, and the
    slab's size (every source page-aligned in it)."""
    sizes = [box_elements(box) * np.dtype(src.dtype).itemsize
             for _, _, box, _, src, _ in sources]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return sizes, offsets, total


def take(step: int, save_id: str, items: list[ItemRecord], sources: list, pool: HostPool,
         executor: cf.Executor | None,
         layout: tuple[list[int], list[int], int] | None = None) -> Snapshot:
    """Copies every source into one pooled slab (at `layout`, slab_layout's of
    `sources` if given); returns when the copy is done. Where no slab is
    ready and the state's buffers are host memory that views keep safe
    (`viewable`), the snapshot is `viewed` instead (its release faults a
    slab in for the next save: InFlight)."""
    sizes, offsets, total = layout or slab_layout(sources)
    if total >= VIEW_MIN_BYTES and not pool.has(total) and viewable(sources):
        return viewed(step, save_id, items, sources, total)
    for *_, src, _ in sources:  # start every device-to-host transfer before waiting
        if isinstance(src, jax.Array) and not _on_host(src):
            src.copy_to_host_async()
    slab, fresh = pool.take(total) if total else (None, False)
    flat = np.frombuffer(slab, dtype=np.uint8) if slab is not None else None
    chunks = []
    for (ii, li, box, key, src, primary), off, n in zip(sources, offsets, sizes, strict=True):
        chunks.append(SnapChunk(ii, li, box[0], box[1], key, flat[off:off + n]
                                if flat is not None else np.zeros(0, np.uint8),
                                np.dtype(src.dtype).itemsize, primary=primary))

    def copy(batch: list[int]) -> None:
        for i in batch:
            np.copyto(chunks[i].data, as_bytes(np.asarray(sources[i][4])))

    order = sorted(range(len(sources)), key=lambda i: -sizes[i])
    if executor is None or len(order) < 2:
        copy(order)
    else:  # one job per copy thread, largest first, dealt in turn: a future per
        # shard costs the training thread dearly for a state of many shards
        for f in [executor.submit(copy, order[j::COPY_THREADS])
                  for j in range(COPY_THREADS)]:
            f.result()
    return Snapshot(step, save_id, items, chunks, total, slab,
                    fresh_bytes=len(slab) if fresh and slab is not None else 0)


# Below this, a first save copies instead of viewing: faulting in a small
# slab costs a few milliseconds, less than `_views_pin_buffers`'s one check
# (a jit compile, 60 ms of CPU here), which a job of many processes on few
# cores would pay on every process at its first save.
VIEW_MIN_BYTES = 2 << 20


def viewable(sources: list) -> bool:
    """Whether a snapshot of `sources` may hold views of their buffers instead
    of copies: every jax source lies on CPU devices (its buffer is host
    memory, and numpy views it without a copy), and jax here neither donates
    nor frees a buffer that a view holds (`_views_pin_buffers`)."""
    arrays = [src for *_, src, _ in sources if isinstance(src, jax.Array)]
    if not (arrays and all(_on_host(a) for a in arrays)):
        return False
    with _check_lock:
        started = _check_thread
    if started is not None:  # its answer is cached once it ends
        started.join()
    return _views_pin_buffers()


def _on_host(a: jax.Array) -> bool:
    """Whether `a`'s buffer is host memory already (the CPU backend), where
    numpy reads it in place: there an asynchronous copy to the host only
    costs its call (35 us a shard for arrays a restore made here)."""
    return all(d.platform == "cpu" for d in a.devices())


_check_lock = threading.Lock()
_check_thread: threading.Thread | None = None


def check_views_early() -> None:
    """Starts `_views_pin_buffers` on a thread of its own (`rc-view-check`,
    once per process, on the CPU backend; a writable manager's open calls
    it), so that a job's first save
    does not block for its compile (about 50 ms of a 0.1-0.2 s first save
    here) when there is time between the open and that save. Not a daemon:
    exit waits for the one tiny CPU program it compiles and runs."""
    global _check_thread
    if jax.default_backend() != "cpu":  # an accelerator's state is copied, not viewed
        return
    with _check_lock:
        if _check_thread is not None:
            return
        _check_thread = threading.Thread(target=_views_pin_buffers, name="rc-view-check")
        _check_thread.start()


def viewed(step: int, save_id: str, items: list[ItemRecord], sources: list,
           nbytes: int) -> Snapshot:
    """A snapshot whose chunks view the jax sources' buffers: nothing copied,
    no fresh memory touched on the training thread (faulting in a new slab
    is slow on a VM, docs/environment.md: it would block a fresh job's first
    save for seconds). jax arrays are immutable, and a buffer a view holds is
    neither donated to the next step nor freed by its deletion, so the views
    keep the saved bytes until the tiers let go of the snapshot. numpy
    sources are the caller's, who may write them after save returns: copied."""
    chunks = []
    for ii, li, box, key, src, primary in sources:
        data = as_bytes(np.asarray(src)) if isinstance(src, jax.Array) \
            else as_bytes(np.array(src, copy=True))
        chunks.append(SnapChunk(ii, li, box[0], box[1], key, data,
                                np.dtype(src.dtype).itemsize, primary=primary))
    return Snapshot(step, save_id, items, chunks, nbytes, None, views=True)


@functools.cache
@apart()
def _views_pin_buffers() -> bool:
    """Whether this jax keeps a CPU buffer that a numpy view holds: a jitted
    step that donates it gets a new buffer instead, and the view still reads
    the old bytes (jax 0.10.2 does). Checked once per process, so a jax
    that donated such buffers would make every snapshot a copy, not corrupt
    one."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]  # this process's: jax.distributed
    except RuntimeError:
        return False
    x = jax.device_put(np.zeros(1024, np.float32), cpu)
    view = np.asarray(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "donated buffers were not usable"
        y = jax.jit(lambda a: a + 1, donate_argnums=0)(x)
        y.block_until_ready()
    return not x.is_deleted() and not view.any() and bool((np.asarray(y) == 1).all())
