"""Verified reads of one selected step's chunks, fastest intact copy first.

Each chunk is read from the first tier in its source list whose copy passes its
checksums; a failed copy is marked bad and the next tier is tried. A chunk is
read whole (on a zero-copy tier, mapped; a compressed one through buffers
reused from chunk to chunk, a quarter of the budget in all), mapped whole
with the RAM-tier chunks that follow it along rows into one region (a target
box stacking rows of several is then a view of it), or in parts: only the
checksum blocks holding the rows a target needs, straight into place where
the rows line up, else through a staging buffer bounded by the restore memory
budget. Before anything is allocated for a chunk of 256 MiB or more whose
size its tier's view took from the manifest (GCS, fsspec), that tier is asked
the object's size (`vouch`), so a large claim is never allocated on the
manifest's word alone. A mapped copy's check can be deferred and run in
bulk on a thread of its own (`defer_checks`, `check_deferred`: a pack's
adjacent chunks as one checksum pass). The
`RestoreRecord` says which tier served each chunk, the bytes read per tier,
and what fell back.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..core import codec, layout
from ..core.manifest import PACK_ALIGN, ChunkRecord
from ..core.planner import blocks_for_rows, rows_per_block
from ..core.selection import Choice
from ..core.sharding import box_elements
from ..errors import CorruptCheckpointError, StorageError
from ..native import crc32c
from ..native.hostmem import PAGE, BufferPool, Region, host_buffer
from ..storage.base import Storage
from .readahead import DISK_BELOW, ReadAhead


@dataclasses.dataclass
class RestoreRecord:
    step: int
    seconds: float = 0.0
    bytes_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    chunks_by_tier: dict = dataclasses.field(default_factory=collections.Counter)
    served: dict = dataclasses.field(default_factory=dict)  # chunk key -> tier
    fallbacks: list = dataclasses.field(default_factory=list)


# A chunk claiming fewer stored bytes than this is read without asking its
# size first, and a zstd chunk claiming fewer decoded bytes without reading
# its frame's header first: allocating it is harmless, and its read fails if
# the object holds less, while a request per chunk would cost a restore from
# GCS a round trip per leaf.
VOUCH_MIN_BYTES = 256 << 20

# Deferred checks of mapped copies start in batches of this many bytes, so the
# pool checksums while the restoring thread maps the next leaves too.
DEFER_BATCH_BYTES = 64 << 20


def _checkers() -> int:
    """Threads that run the deferred checks: every core this process may use
    but one, which the restoring thread keeps, and at most 4. A RAM restore
    of a big state is its checksums and their first touch of the mapped
    pages (0.13 s a GiB on one core here, halved on two); on two cores a
    second checker starved the restoring thread (docs/benchmarks.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores - 1))


CHECKERS = _checkers()


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
        self.choice, self.bad, self.record = choice, bad, record
        self.dir = naming.name(choice.step)
        # A remote or disk tier's small reads come from a few larger ones (readahead.py).
        extents: dict[str, int] = {}
        for _, _, c in choice.manifest.chunks():
            if c.pack is not None:
                key = self._key(c)
                extents[key] = max(extents.get(key, 0), c.pack_offset + c.stored_nbytes)
        self.storages = {n: ReadAhead(st, extents, below=None if st.sizes_from_manifest
                                      else DISK_BELOW)
                         if (st.sizes_from_manifest or st.maps_cached) and extents
                         else st for n, st in storages.items()}
        self.budget = max(1, budget)
        self._staging: np.ndarray | None = None
        self._lock = threading.Lock()
        self._why: dict[tuple[str, str], str] = {}  # (tier, key) -> why that copy failed
        self._resident: dict[tuple[str, str], bool] = {}  # (tier, key) -> maps() said
        self._vouched: set[tuple[str, str]] = set()  # (tier, key) whose size was asked
        # Whole-chunk reads of one leaf run side by side: preadv and the
        # checksum overlap across chunks (faster on a cold disk, docs/benchmarks.md).
        self.pool = cf.ThreadPoolExecutor(4, thread_name_prefix="rc-restore")
        # With several processes: every jax leaf by name, for a fill of the
        # shards this process could not read from its peers (restore.Hole);
        # None: a leaf that cannot be read whole here is an error.
        self.fills: dict[str, Any] | None = None
        # Compressed chunks are read into these before decoding: a quarter of
        # the budget in all (half brought a restore near its memory promise,
        # and a quarter read as fast), reused from chunk to chunk.
        self.packed = BufferPool(self.budget // 4)
        # Mapped copies whose checks are deferred (`defer_checks`): checked in
        # bulk by `check_deferred`; None: every copy is checked as it is read.
        self._deferred: list | None = None
        self._deferred_bytes = 0
        self._counted: set[str] = set()  # chunks a deferred check counted as served
        # Batches of deferred copies, each with its check on `_checker`.
        self._checks: list[tuple[list, cf.Future]] = []
        # As many threads as leave the restoring thread a core (`CHECKERS`).
        self._checker = cf.ThreadPoolExecutor(CHECKERS, thread_name_prefix="rc-check")
        self._tier_of = {id(st): n for n, st in self.storages.items()}
        self._held = contextlib.ExitStack()  # the step's directory, open till close
        for st in storages.values():
            self._held.enter_context(st.holding(self.dir))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._checker.shutdown(wait=True)
        self.packed.clear()
        self._held.close()

    def _stage(self, nbytes: int) -> np.ndarray:
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = host_buffer(min(max(nbytes, 1 << 20), max(self.budget, nbytes)))
        return self._staging[:nbytes]

    def _key(self, c: ChunkRecord) -> str:
        """The object holding `c`'s stored bytes (from `c.pack_offset` on)."""
        return f"{self.dir}/{c.object}"

    def _from_tiers(self, c: ChunkRecord, where: str, read):
        """Runs read(storage, key, offset) against each copy until one
        verifies: the object holding the chunk and where in it the chunk starts."""
        tried = []
        for tier in self.choice.sources.get(c.key, ()):
            if (tier, c.key) in self.bad:  # failed before (a mapped run's check, ...)
                tried.append(f"{tier}: {self._why.get((tier, c.key), 'failed before')}")
                continue
            st = self.storages[tier]
            try:
                out, nread = read(st, self._key(c), c.pack_offset)
            except (CorruptCheckpointError, StorageError) as e:
                tried.append(f"{tier}: {e}")
                self._failed(tier, c.key, f"step {self.choice.step}, {where}: chunk {c.key} "
                             f"from the {tier} tier failed ({e}); trying the next copy", str(e))
                continue
            if nread is not None:  # (None: a deferred check counts it, `_check_mapped`)
                self._served(tier, c.key, nread)
            return out
        raise CorruptCheckpointError(
            f"step {self.choice.step}, {where}: chunk {c.key} has no intact copy "
            f"(tried {tried or 'none'}); restore an older step (latest_step() now "
            "skips this one)")

    def vouch(self, chunks: Iterable[ChunkRecord], where: str) -> None:
        """Checks, before anything is allocated for `chunks`, that the copy of
        each to be read first is of the size its manifest records, where the
        tier's view took that size from the manifest itself (a tier that
        `sizes_from_manifest`, as GCS; every other tier's sizes were observed
        at selection). That tier is asked the object's size; a copy of another
        size is marked bad, as a failed read is (the next copy is tried; with
        none left, CorruptCheckpointError names the step and restore() falls
        back to an older one). A zstd chunk's claimed decoded size is checked
        against its frame's header the same way, on every tier. So no claim is
        allocated on a manifest's word alone: a 4 KiB object claimed as 32 TiB
        raised ENOMEM before any read."""
        todo = [c for c in chunks if self._unvouched(c)]
        if len(todo) == 1:
            self._vouch(todo[0], where)
        elif todo:
            list(self.pool.map(lambda c: self._vouch(c, where), todo))

    def _unvouched(self, c: ChunkRecord) -> bool:
        if c.stored_nbytes < VOUCH_MIN_BYTES and c.nbytes < VOUCH_MIN_BYTES:
            return False  # no tier doubts it (`_doubt`): asked first, it is the cheaper test
        tier = self.first_copy(c)
        return tier is not None and (tier, c.key) not in self._vouched and \
            self._doubt(c, self.storages[tier])

    @staticmethod
    def _doubt(c: ChunkRecord, st: Storage) -> bool:
        """Whether the copy of `c` on `st` is checked before allocating: its
        stored size where it came from the manifest, or the size a zstd frame
        decodes to (up to 32768 times its stored size, `MAX_ZSTD_RATIO`)."""
        return (c.stored_nbytes >= VOUCH_MIN_BYTES and st.sizes_from_manifest) or \
            (c.codec == "zstd" and c.nbytes >= VOUCH_MIN_BYTES)

    def _vouch(self, c: ChunkRecord, where: str) -> None:
        tried = []
        for tier in self.choice.sources.get(c.key, ()):
            st = self.storages[tier]
            if (tier, c.key) in self.bad:
                continue
            if not self._doubt(c, st) or (tier, c.key) in self._vouched:
                return  # observed at selection, or asked already
            why = self._why_not(c, st)
            if why is None:
                with self._lock:
                    self._vouched.add((tier, c.key))
                return
            tried.append(f"{tier}: {why}")
            self._failed(tier, c.key, f"step {self.choice.step}, {where}: chunk {c.key} in the "
                         f"{tier} tier: {why}; trying the next copy", why)
        raise CorruptCheckpointError(
            f"step {self.choice.step}, {where}: chunk {c.key} has no copy of the size its "
            f"manifest claims (tried {tried or 'none'}); nothing was allocated for it; "
            "restore an older step (latest_step() now skips this one)")

    def _why_not(self, c: ChunkRecord, st: Storage) -> str | None:
        """Why the copy of `c` on `st` is not what its manifest claims (None: it is):
        its size, asked where it came from the manifest; for a zstd chunk, the
        decoded size its frame header records (read: a few bytes)."""
        key = self._key(c)
        try:
            if c.stored_nbytes >= VOUCH_MIN_BYTES and st.sizes_from_manifest:
                size = c.observed(st.size(key))
                if size != c.stored_nbytes:
                    return (f"{st.url}/{key} holds {size} bytes of it, its manifest claims "
                            f"{c.stored_nbytes}")
            if c.codec == "zstd" and c.nbytes >= VOUCH_MIN_BYTES:
                head = bytearray(min(codec.FRAME_HEADER_MAX, c.stored_nbytes))
                st.read_into(key, memoryview(head), c.pack_offset)
                size = codec.frame_content_size(bytes(head))
                if size != c.nbytes:
                    return (f"the zstd frame of {st.url}/{key} decodes to "
                            f"{'an unrecorded size' if size is None else f'{size} bytes'}, "
                            f"its manifest claims {c.nbytes}")
        except StorageError as e:
            return str(e)
        return None

    def whole(self, c: ChunkRecord, where: str, zero_copy: bool,
              out: np.ndarray | None = None, defer: bool = False) -> np.ndarray:
        """The chunk's verified, uncompressed bytes in `out` (c.nbytes, uint8)
        or a buffer of its own (or, with zero_copy, a copy-on-write mapping of
        a RAM-tier object). With `defer`, from the thread that called
        `defer_checks`, a mapped copy is returned unchecked and checked by
        `check_deferred`."""
        def read(st: Storage, key: str, at: int):
            raw = c.codec == "raw"
            buf = st.map(key, c.stored_nbytes, at) if zero_copy and raw else None
            if buf is not None and defer and self._deferred is not None:
                self._defer(c, where, st, buf)
                return buf, None
            if buf is None and raw:
                buf = out if out is not None else host_buffer(c.stored_nbytes)
                st.read_into(key, buf.data, at)
            elif not raw:
                packed = self.packed.take(c.stored_nbytes)
                try:
                    st.read_into(key, packed[:c.stored_nbytes].data, at)
                    buf = codec.decode(c.codec, packed[:c.stored_nbytes], c.nbytes,
                                       out if out is not None else host_buffer(c.nbytes))
                finally:
                    self.packed.give(packed)
            if crc32c.value(buf) != c.crc32c:
                raise CorruptCheckpointError(f"crc32c mismatch in {st.url}/{key}")
            return buf, c.stored_nbytes
        return self._from_tiers(c, where, read)

    def mapped(self, chunks: Sequence[ChunkRecord], where: str) -> list[np.ndarray | None]:
        """What `whole(c, where, zero_copy=True, defer=True)` returns for each
        of `chunks` whose first copy is a raw one on a RAM tier (`zero_copy`):
        its mapping, unchecked, its check deferred; None for any other chunk,
        to be read by `whole`, which also reports a copy that failed to map. One
        pass for a leaf's chunks: a thousand-leaf state has thousands of
        small chunks, and the calls of `whole` per chunk were most of a RAM
        restore of one (docs/benchmarks.md). Only from the thread that
        called `defer_checks`."""
        out: list[np.ndarray | None] = []
        if self._deferred is None:
            return [None] * len(chunks)
        for c in chunks:
            tier = self.first_copy(c) if c.codec == "raw" else None
            st = None if tier is None else self.storages[tier]
            buf = None
            if st is not None and st.zero_copy:
                try:
                    buf = st.map(self._key(c), c.stored_nbytes, c.pack_offset)
                except (CorruptCheckpointError, StorageError):
                    buf = None  # `whole` tries it again, and says why
            out.append(buf)
            if st is not None and buf is not None:
                self._defer(c, where, st, buf)
        return out

    def _defer(self, c: ChunkRecord, where: str, st: Storage, buf: np.ndarray) -> None:
        """Notes a mapped copy whose check is deferred; every
        `DEFER_BATCH_BYTES` of them start being checked meanwhile."""
        assert self._deferred is not None  # only between defer_checks and check_deferred
        self._deferred.append((c, where, st, buf))
        self._deferred_bytes += c.stored_nbytes
        if self._deferred_bytes >= DEFER_BATCH_BYTES:
            self._check_batch()

    @property
    def deferring(self) -> bool:
        return self._deferred is not None

    def defer_checks(self) -> None:
        """From now until `check_deferred`, mapped copies read by `whole(defer=True)`
        are checked later, in bulk, on the pool: in batches of
        `DEFER_BATCH_BYTES` as they come, and the rest at `check_deferred`."""
        self._deferred, self._deferred_bytes, self._checks = [], 0, []

    def _check_batch(self) -> None:
        if self._deferred:
            self._checks.append((self._deferred,
                                 self._checker.submit(self._check_mapped, self._deferred)))
        self._deferred, self._deferred_bytes = [], 0

    def check_deferred(self) -> Callable[[], set[str]]:
        """Starts checking the copies deferred since `defer_checks` and not yet
        being checked; the returned call waits for every batch and returns
        the keys of the chunks whose copy failed (marked bad, so a second read
        of them takes the next copy).

        Adjacent chunks of one pack mapping (with under `PACK_ALIGN` zeros
        between them) are checked as one run: one checksum of the run's bytes
        without the GIL, against the CRC32C combined from theirs. A run that
        does not match, or cannot be combined, is checked chunk by chunk. So a
        RAM-tier restore checksums on a second core while the restoring thread
        places the arrays, where it checked thousands of chunks itself first."""
        self._check_batch()
        checks, self._deferred, self._checks = self._checks, None, []

        def wait() -> set[str]:  # the waiting thread checks the batches not yet begun,
            # from the last (the checker takes them from the first)
            return set().union(*[self._check_mapped(batch) if f.cancel() else f.result()
                                 for batch, f in reversed(checks)])
        return wait

    def _check_mapped(self, pending: list) -> set[str]:
        by_base: dict[int, list] = collections.defaultdict(list)
        for item in pending:  # the views of one mapping share its array as their base
            by_base[id(item[3].base)].append(item)
        failed: set[str] = set()
        for items in by_base.values():
            items.sort(key=lambda it: it[0].pack_offset)
            for run in _adjacent(items):
                if len(run) == 1 or not _run_intact(run):
                    failed.update(k for k in map(self._check_one, run) if k is not None)
        with self._lock:  # what each intact copy served
            for c, _, st, _ in pending:
                if c.key not in failed:
                    tier = self._tier_of[id(st)]
                    self.record.bytes_by_tier[tier] += c.stored_nbytes
                    self.record.chunks_by_tier[tier] += 1
                    self.record.served[c.key] = tier
                    self._counted.add(c.key)
        return failed

    def _check_one(self, item: tuple) -> str | None:
        """None if a deferred copy is intact; else marks it bad and returns its
        chunk's key."""
        c, where, st, buf = item
        if crc32c.value(buf) == c.crc32c:
            return None
        tier, why = self._tier_of[id(st)], f"crc32c mismatch in {st.url}/{self._key(c)}"
        self._failed(tier, c.key, f"step {self.choice.step}, {where}: chunk {c.key} from the "
                     f"{tier} tier failed ({why}); trying the next copy", why)
        return c.key

    def pieces(self, c: ChunkRecord, dtype: np.dtype,
               parts: list[tuple[tuple[slice, ...], np.ndarray]], where: str,
               in_place: bool = False) -> list:
        """Copies chunk[src] into dst for each (src, dst) of `parts`; returns
        futures of the parts read straight into their destination meanwhile
        (from a disk tier, or with `in_place` from any tier: a RAM-tier
        object is then read rather than mapped and copied)."""
        rpb = rows_per_block(c)
        if c.codec != "raw" or rpb is None:
            arr = self.whole(c, where, True).view(dtype).reshape(c.sizes)
            for src, dst in parts:
                dst[...] = arr[src]
            return []
        first = self.first_copy(c)
        futures = []
        if first is not None and (in_place or not self.storages[first].zero_copy):
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

        def read(st: Storage, key: str, at: int):
            nread = 0
            if len(inner):
                r_lo, r_hi = inner.start * rpb, min(inner.stop * rpb, n)
                seg = flat[(r_lo - a) * row:(r_hi - a) * row]
                st.read_into(key, seg.data, offset=at + r_lo * row)
                nread += len(seg)
                bad = crc32c.bad_block(seg, bb, c.block_crc32c[inner.start:inner.stop])
                if bad is not None:
                    raise CorruptCheckpointError(
                        f"crc32c mismatch in block {inner.start + bad} of {st.url}/{key}")
            for blk in ends:
                start, stop = blk * bb, min((blk + 1) * bb, c.nbytes)
                stage = np.empty(stop - start, np.uint8)
                st.read_into(key, stage.data, offset=at + start)
                nread += len(stage)
                if crc32c.value(stage) != c.block_crc32c[blk]:
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

        def read(st: Storage, key: str, at: int):
            mapped = st.map(key, c.nbytes, at)
            nread = 0
            for b0, b1 in spans:
                for lo in range(b0, b1, step_blocks):
                    hi = min(b1, lo + step_blocks)
                    start, stop = lo * c.block_bytes, min(hi * c.block_bytes, c.nbytes)
                    if mapped is not None:
                        seg = mapped[start:stop]
                    else:
                        seg = self._stage(stop - start)
                        st.read_into(key, seg.data, offset=at + start)
                    nread += stop - start
                    bad = crc32c.bad_block(seg, c.block_bytes, c.block_crc32c[lo:hi])
                    if bad is not None:
                        raise CorruptCheckpointError(
                            f"crc32c mismatch in block {lo + bad} of {st.url}/{key}")
                    r0 = lo * rpb
                    rows = seg.view(dtype).reshape(((stop - start) // row_bytes,) + c.sizes[1:])
                    _copy_rows(parts, rows, r0)
            return None, nread
        self._from_tiers(c, where, read)


    def stitch(self, plans: dict, dtype: np.dtype) -> tuple[dict, list]:
        """Maps the target boxes of `plans` (box -> plan) that stack whole rows
        of chunks that `maps` (RAM-tier ones, cached local ones), without a
        copy: chunks with one trailing extent that follow each other along
        rows are mapped whole, in row order, into one region (a run), and each
        such box is a view of its run. The rows
        the boxes need are then checked where they lie, a task per chunk on
        the pool. Returns ({box: (view, futures of its chunks' checks)}, the
        other boxes); a check's result is False where that copy failed.

        Resharded onto fewer devices, a box spans parts of two chunks; mapped
        box by box, each box took its own region, two placements and a second
        mapping of each partly placed checksum block (several times the mmap
        calls of the same sharding, and more time); as runs, a leaf takes a
        region and a placement per chunk."""
        groups: dict[tuple, dict[str, ChunkRecord]] = {}
        need: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        stack, left = {}, []
        for box, plan in plans.items():
            extent = (box[0][1:], box[1][1:])
            if box_elements(box) == 0 or not all(self._runs_with(p.chunk, extent)
                                                 for p in plan.pieces):
                left.append(box)
                continue
            stack[box] = plan
            for p in plan.pieces:
                groups.setdefault(extent, {})[p.chunk.key] = p.chunk
                need[p.chunk.key].append((p.src[0].start, p.src[0].stop))
        runs: dict[str, tuple[int, np.ndarray, dict]] = {}  # chunk key -> (row 0, bytes, checks)
        for chunks in groups.values():
            following: list[list[ChunkRecord]] = []
            for c in sorted(chunks.values(), key=lambda c: c.offsets[0]):
                prev = following[-1][-1] if following else None
                if prev is not None and c.offsets[0] == prev.offsets[0] + prev.sizes[0]:
                    following[-1].append(c)
                else:
                    following.append([c])
            for run in following:
                mapped = self._map_run(run, need)
                if mapped is not None:
                    runs.update({c.key: mapped for c in run})
        out = {}
        for box, plan in stack.items():
            got = runs.get(plan.pieces[0].chunk.key)
            if got is None:
                left.append(box)
                continue
            row0, arr, checks = got
            first = plan.pieces[0].chunk
            row = first.nbytes // first.sizes[0]
            lo = (box[0][0] - row0) * row
            out[box] = (arr[lo:lo + box[1][0] * row].view(dtype).reshape(box[1]),
                        [checks[p.chunk.key] for p in plan.pieces])
        return out, left

    def maps(self, c: ChunkRecord) -> bool:
        """Whether the chunk's first copy can be mapped rather than read: a
        RAM-tier object, or a local one `Storage.resident` says maps (a pack
        of the held step, cached or not; else one the page cache holds
        whole), asked once per chunk."""
        tier = self.first_copy(c)
        if c.codec != "raw" or tier is None:
            return False
        st = self.storages[tier]
        if st.zero_copy or not st.maps_cached:
            return st.zero_copy
        known = self._resident.get((tier, c.key))  # asked once a chunk: boxes share chunks
        if known is None:
            known = self._resident[(tier, c.key)] = st.resident(self._key(c), c.stored_nbytes,
                                                                 c.pack_offset)
        return known

    def _runs_with(self, c: ChunkRecord, extent: tuple) -> bool:
        """Whether chunk `c` can be mapped whole into a run of `extent`."""
        return (rows_per_block(c) is not None and (c.offsets[1:], c.sizes[1:]) == extent
                and self.maps(c))

    def _map_run(self, run: list[ChunkRecord], need: dict
                 ) -> tuple[int, np.ndarray, dict] | None:
        """(first row, the run's bytes, check futures by chunk key) of chunks
        mapped whole and in row order into one region; None when one does not
        end on a page boundary (but the last) or the kernel refuses it."""
        if any(c.nbytes % PAGE for c in run[:-1]):
            return None
        region = Region(sum(c.nbytes for c in run))
        at, placed = 0, []
        for c in run:
            tier = self.first_copy(c)
            assert tier is not None  # _runs_with checked it
            if not self.storages[tier].place(self._key(c), region, c.pack_offset, at,
                                             c.nbytes):
                return None
            placed.append((c, tier, at))
            at += c.nbytes
        arr = region.array()
        checks = {c.key: self.pool.submit(self._check_rows, c, tier, arr[lo:lo + c.nbytes],
                                          need[c.key])
                  for c, tier, lo in placed}
        return run[0].offsets[0], arr, checks

    def _check_rows(self, c: ChunkRecord, tier: str, placed: np.ndarray,
                    rows: list[tuple[int, int]]) -> bool:
        """Checks the blocks of chunk `c` holding `rows`, where they were
        placed (their pages fault in once, not once for the check and again
        for the first use); False, with the copy marked bad, on a mismatch."""
        bb, nread = c.block_bytes, 0
        for b0, b1 in blocks_for_rows(c, rows):
            seg = placed[b0 * bb:min(b1 * bb, c.nbytes)]
            bad = crc32c.bad_block(seg, bb, c.block_crc32c[b0:b1])
            if bad is not None:
                why = (f"crc32c mismatch in block {b0 + bad} of "
                       f"{self.storages[tier].url}/{self._key(c)}")
                self._failed(tier, c.key, f"step {self.choice.step}: chunk {c.key} from the "
                             f"{tier} tier failed ({why}); trying the next copy", why)
                return False
            nread += len(seg)
        self._served(tier, c.key, nread)
        return True

    def first_copy(self, c: ChunkRecord) -> str | None:
        """The tier whose copy of `c` is read first, if any is left."""
        for t in self.choice.sources.get(c.key, ()):  # (asked twice a chunk: no generator)
            if (t, c.key) not in self.bad:
                return t
        return None

    def _failed(self, tier: str, key: str, msg: str, why: str) -> None:
        with self._lock:
            self.bad.add((tier, key))
            self._why[(tier, key)] = why
            self.record.fallbacks.append(msg)

    def _served(self, tier: str, key: str, nread: int) -> None:
        with self._lock:
            if key in self._counted:
                return  # mapped again for a leaf read again (`check_deferred`): counted once
            self.record.bytes_by_tier[tier] += nread
            self.record.chunks_by_tier[tier] += 1
            self.record.served[key] = tier


def _adjacent(items: list) -> Iterator[list]:
    """Deferred copies of one mapping, by offset, cut into runs of chunks of
    one pack with only the zeros before an aligned offset between them."""
    run: list = []
    for it in items:
        c = it[0]
        if run:
            p = run[-1][0]
            gap = c.pack_offset - (p.pack_offset + p.stored_nbytes)
            if c.pack is None or c.pack != p.pack or not 0 <= gap < PACK_ALIGN:
                yield run
                run = []
        run.append(it)
    if run:
        yield run


def _address(a: np.ndarray) -> int:
    return a.ctypes.data


def _run_intact(run: list) -> bool:
    """Whether a run of deferred copies (views of one mapping, by offset) holds
    exactly its chunks' bytes: one checksum of the span from the first chunk
    to the end of the last, against the CRC32C of their bytes and the zeros
    between them. False also where the views are not slices of one mapping of
    the pack at their offsets, or the run has too many distinct lengths."""
    base = run[0][3].base
    lo = run[0][0].pack_offset
    hi = run[-1][0].pack_offset + run[-1][0].stored_nbytes
    if not crc32c.releases_gil() or not isinstance(base, np.ndarray) or base.ndim != 1 \
            or base.dtype != np.uint8 or len(base) < hi:
        return False
    span = base[lo:hi]
    at, parts, pos = _address(span) - lo, [], lo
    for c, _, _, view in run:
        if _address(view) != at + c.pack_offset or view.nbytes != c.stored_nbytes:
            return False
        if c.pack_offset > pos:
            parts.append((crc32c.zeros(c.pack_offset - pos), c.pack_offset - pos))
        parts.append((c.crc32c, c.stored_nbytes))
        pos = c.pack_offset + c.stored_nbytes
    if len({n for _, n in parts}) > crc32c.MAX_LENGTHS:
        return False
    return crc32c.value(span) == crc32c.concatenated(parts)


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
