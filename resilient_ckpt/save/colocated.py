"""Saves written by the hosts that own the shards, through colocated Python;
the process that calls `save` only commits.

Under Pathways one controller process drives the devices of every host, so
the ordinary save (a snapshot into the caller's memory, then tier writes from
it) would pull the whole state through the controller. With
`write_on_owning_hosts`, `take` instead copies each jax leaf to the CPU devices
colocated with its devices (their own hosts' memory; save waits for that copy,
so the state may be donated right after), and `write_step` runs
`_write_on_host` there with `jax.experimental.colocated_python`: each host puts
the replica-0 shards its devices hold as chunk objects, with their checksums,
and returns only their records (a few words per chunk) as a small uint32 array,
one row per device. The controller reads those rows, writes the numpy leaves it
holds itself, and commits the manifest as every save does (commit.py), so the
format and the validity rules are unchanged and the ordinary reader restores
the step.

On a Pathways cluster the function runs in each worker's colocated Python
process, which must import this package and reach the tier (a GCS bucket, or
a file system every host mounts). On the CPU backend the colocated CPU devices
are the devices themselves and the function runs in this process, serialized
and deserialized as it would be for a remote host (docs/pathways.md).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import importlib
import logging
from typing import Any

import jax
import numpy as np

from ..core import layout
from ..core.codec import CODECS, Encoding
from ..core.manifest import ChunkRecord, ItemRecord, Manifest
from ..core.planner import block_bytes_for
from ..core.pytree import flatten, leaf_kind
from ..core.sharding import box_elements, index_to_box
from ..errors import CorruptCheckpointError, MissingDependencyError
from ..native import crc32c
from ..storage.base import Storage
from . import commit, snapshot, transfer

log = logging.getLogger("resilient_ckpt")

SOURCE = "owning hosts (colocated Python)"  # TierWrite.source of such a write
_HEAD = 5  # words of a chunk's record before its block checksums (see _words)


def require() -> None:
    """Raises MissingDependencyError unless colocated Python can run here."""
    try:
        importlib.import_module("cloudpickle")  # colocated Python pickles functions with it
        from jax.experimental import colocated_python as cp
    except ImportError as e:
        raise MissingDependencyError(
            f"write_on_owning_hosts=True needs jax.experimental.colocated_python and "
            f"cloudpickle ({e}); install them with pip install 'resilient_ckpt[pathways]', "
            "or set write_on_owning_hosts=False") from e
    try:
        cp.colocated_cpu_devices(jax.devices()[:1])
    except (ValueError, AttributeError) as e:
        raise MissingDependencyError(
            f"write_on_owning_hosts=True: the {jax.default_backend()} backend has no CPU "
            f"devices colocated with its devices ({e}); set write_on_owning_hosts=False"
        ) from e


@dataclasses.dataclass
class _Group:
    """The leaves on one list of devices: one colocated call writes them all.
    Row r of the call's result holds the records of the chunks that device
    r's host writes, in the order of `rows[r]` (records without checksums)."""

    arrays: list[jax.Array]  # copies on the colocated CPU devices
    leaves: list[tuple[int, int]]  # (item, leaf) of each array
    rows: list[list[tuple[int, int, ChunkRecord]]]  # (item, leaf, chunk)
    out: jax.sharding.NamedSharding  # of the result: one row per device
    width: int = 1  # words per row


@dataclasses.dataclass
class Placed:
    """One step's copy on the owning hosts, grouped by device list."""

    groups: list[_Group]

    def chunks(self) -> list[ChunkRecord]:
        return [c for g in self.groups for row in g.rows for _, _, c in row]

    def delete(self) -> None:
        """Frees the copies (the last tier is done with the step)."""
        for g in self.groups:
            for a in g.arrays:
                a.delete()


@dataclasses.dataclass(frozen=True)
class HostJob:
    """What `_write_on_host` needs, pickled to every owning host."""

    config: Any  # the tier's configuration (tiers.py): each host opens it
    directory: str  # the manager's directory, which the configuration may default to
    step_dir: str
    prefix: str  # the save id's first 8 hex digits, which chunk keys start with
    leaves: tuple[tuple[int, int], ...]
    encoding: Encoding
    out: jax.sharding.NamedSharding
    width: int
    threads: int


def take(step: int, save_id: str, items: list, records: list[ItemRecord], sources: list,
         pool: snapshot.HostPool, executor: cf.Executor | None) -> snapshot.Snapshot:
    """A snapshot whose jax leaves are copied to their colocated CPU devices
    (waited for: the state may be donated once this returns) and whose numpy
    leaves, which the caller holds, are copied into its pool as usual."""
    groups, where = _place(items)
    for ii, li, box, key, src, _ in sources:
        if isinstance(src, jax.Array):  # replica 0 of a box: written by its device's host
            g, devices = where[(ii, li)]
            itemsize = np.dtype(src.dtype).itemsize
            n = box_elements(box) * itemsize
            bb = block_bytes_for(box[1], itemsize) if n else 0
            g.rows[devices.index(next(iter(src.devices())))].append(
                (ii, li, ChunkRecord(box[0], box[1], key, n, n, 0, "raw", bb)))
    for g in groups:
        g.width = max([1] + [sum(_HEAD + _blocks(c) for _, _, c in row) for row in g.rows])
    jax.block_until_ready([a for g in groups for a in g.arrays])
    snap = snapshot.take(step, save_id, records,
                         [s for s in sources if not isinstance(s[4], jax.Array)], pool, executor)
    snap.placed = Placed(groups)
    snap.nbytes += sum(c.nbytes for c in snap.placed.chunks())
    return snap


def _place(items: list) -> tuple[list[_Group], dict[tuple[int, int], tuple[_Group, tuple]]]:
    """Starts copying every jax leaf of `items` to its colocated CPU devices,
    grouped by device list; and per (item, leaf), its group and its devices in
    the order of the group's rows."""
    groups: dict[tuple, _Group] = {}
    where = {}
    for ii, (_, kind, value) in enumerate(items):
        if kind == "json":
            continue
        for li, (path, leaf) in enumerate(flatten(value)[0]):
            k = leaf_kind(leaf, path)
            if k not in ("array", "prng_key"):
                continue
            data = jax.random.key_data(leaf) if k == "prng_key" else leaf
            cpu = _colocated_sharding(data.sharding, path)
            devices = _devices(cpu)
            g = groups.get(devices)
            if g is None:  # row r of the call's result: device r of the list
                rows = jax.sharding.Mesh(np.array(devices), ("rc_rows",))
                g = groups[devices] = _Group([], [], [[] for _ in devices],
                                             jax.sharding.NamedSharding(
                                                 rows, jax.sharding.PartitionSpec("rc_rows")))
            g.arrays.append(jax.device_put(data, cpu, may_alias=False))
            g.leaves.append((ii, li))
            where[(ii, li)] = (g, _devices(data.sharding))  # colocated_cpu_devices keeps order
    return list(groups.values()), where


def write_step(storage: Storage, tier: str, naming: layout.StepNaming, snap: snapshot.Snapshot,
               header: dict, io: cf.Executor, config: Any, directory: str, threads: int,
               encoding: Encoding | None = None, on_commit: Any = None, claim: Any = None
               ) -> commit.TierWrite:
    """Writes `snap` (from `take`) to `storage` and commits it: the owning hosts
    put the chunks of the jax leaves (opening the tier from `config` there),
    this process those of its numpy leaves, then the manifest. On a failure
    anywhere, nothing is committed and the chunks are removed (commit.py)."""
    enc = encoding or Encoding()
    placed: Placed = snap.placed
    root = getattr(storage, "root", None)  # a file tier's absolute path, for every host
    if root and hasattr(config, "path"):
        config = dataclasses.replace(config, path=root)
    d = naming.name(snap.step)
    mine = snap.indices(primary_only=True)

    def put(i: int) -> ChunkRecord:
        c = snap.chunks[i]
        return transfer.put_host(storage, f"{d}/{c.key}", c.data, snap.record(i), enc)

    def write() -> list[ChunkRecord]:
        errors: list[BaseException] = []
        calls = []
        for g in placed.groups:  # asynchronous under Pathways; on CPU each runs here
            job = HostJob(config, directory, d, snap.save_id[:8], tuple(g.leaves), enc,
                          g.out, g.width, threads)
            calls.append((g, _attempt(errors, _call, job, g.arrays)))
        stored = [_attempt(errors, f.result) for f in [io.submit(put, i) for i in mine]]
        for g, out in calls:
            if out is not None:
                stored += _attempt(errors, _records, g, out, d) or []
        if errors:
            raise errors[0]
        return stored

    def manifest(stored: dict) -> Manifest:
        per_leaf: dict[tuple[int, int], list[ChunkRecord]] = {}
        for i in mine:
            sc = snap.chunks[i]
            per_leaf.setdefault((sc.item, sc.leaf), []).append(stored[sc.key])
        for g in placed.groups:
            for row in g.rows:
                for ii, li, c in row:
                    per_leaf.setdefault((ii, li), []).append(stored[c.key])
        for recs in per_leaf.values():
            recs.sort(key=lambda c: c.offsets)
        return Manifest(step=snap.step, save_id=snap.save_id,
                        items=snapshot.with_chunks(snap.items, per_leaf), **header)
    keys = [snap.chunks[i].key for i in mine] + [c.key for c in placed.chunks()]
    return commit.commit_chunks(storage, tier, snap.step, d, keys, write, manifest, on_commit,
                                SOURCE, claim)


def _attempt(errors: list[BaseException], fn: Any, *args: Any) -> Any:
    """`fn(*args)`, or None with its exception kept (so every write is waited
    for before a failed save's chunks are removed)."""
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - collected and re-raised
        errors.append(e)
        return None


def _call(job: HostJob, arrays: list[jax.Array]) -> jax.Array:
    """Starts `_write_on_host` on the hosts of `arrays`; its result is their rows."""
    from jax.experimental import colocated_python as cp
    spec = jax.ShapeDtypeStruct((job.out.mesh.size, job.width), np.uint32, sharding=job.out)
    fn = cp.colocated_python(functools.partial(_write_on_host, job))
    return fn.specialize(out_specs_fn=lambda *_args, **_kw: spec)(arrays)


def _write_on_host(job: HostJob, arrays: list[jax.Array]) -> jax.Array:
    """Runs on each host that owns devices of `arrays` (in its colocated Python
    process): puts the replica-0 shards its devices hold and returns their
    records, one row per device, `job.width` words each."""
    shape = (job.out.mesh.size, job.width)
    here = job.out.addressable_devices
    mine: dict[Any, list] = {dev: [] for dev in job.out.mesh.devices.flat if dev in here}
    for j, a in enumerate(arrays):
        for s in a.addressable_shards:
            if s.replica_id == 0 and s.device in mine:
                mine[s.device].append((j, s))
    storage = job.config.open(job.directory, False)
    try:
        with cf.ThreadPoolExecutor(job.threads, thread_name_prefix="rc-host-io") as ex:
            futures = {dev: [ex.submit(_put_shard, storage, job, arrays[j], j, s)
                             for j, s in shards] for dev, shards in mine.items()}
            recs = {dev: [f.result() for f in fs] for dev, fs in futures.items()}
        storage.flush(job.step_dir)
    finally:
        storage.close()
    out = []
    for dev in mine:
        row = np.zeros((1, job.width), np.uint32)
        words = [w for c in recs[dev] for w in _words(c)]
        if len(words) > job.width:
            raise CorruptCheckpointError(
                f"{job.step_dir}: device {dev} holds more chunks than the controller "
                "planned for it; the controller and this host see different shardings")
        row[0, :len(words)] = words
        out.append(jax.device_put(row, dev))
    return jax.make_array_from_single_device_arrays(shape, job.out, out)


def _put_shard(storage: Storage, job: HostJob, a: jax.Array, j: int, shard: Any) -> ChunkRecord:
    ii, li = job.leaves[j]
    offsets, sizes = index_to_box(shard.index, a.shape)
    key = f"{job.prefix}." + layout.chunk_key(ii, li, offsets)
    data = snapshot.as_bytes(np.asarray(shard.data))
    bb, blocks, crc = snapshot.checksums(data, sizes, np.dtype(a.dtype).itemsize)
    n = int(data.nbytes)
    rec = transfer.put_host(storage, f"{job.step_dir}/{key}", data,
                            ChunkRecord(offsets, sizes, key, n, n, crc, "raw", bb, blocks),
                            job.encoding)
    log.debug("%s/%s written on its owning host, from the shard on %s", job.step_dir, key,
              shard.device, extra={"rc_chunk": key, "rc_device": shard.device.id})
    return rec


def _words(c: ChunkRecord) -> list[int]:
    """A chunk's record as uint32 words: its key's crc32c (to check the rows
    line up), its crc32c, its stored size (low, high), its codec, its blocks."""
    return [crc32c.value(c.key.encode()), c.crc32c, c.stored_nbytes & 0xFFFFFFFF,
            c.stored_nbytes >> 32, CODECS.index(c.codec), *c.block_crc32c]


def _records(g: _Group, result: jax.Array, d: str) -> list[ChunkRecord]:
    """The stored records of `g`'s chunks, read from the rows the hosts
    returned (waiting for them): only this process's, with several."""
    rows = {s.index[0].start or 0: np.asarray(s.data)[0] for s in result.addressable_shards}
    out = []
    for r, planned in enumerate(g.rows):
        pos, row = 0, rows.get(r, ())  # a missing row fails the check below
        for _, _, c in planned:
            w = [int(x) for x in row[pos:pos + _HEAD + _blocks(c)]]
            pos += len(w)
            if len(w) < _HEAD or w[0] != crc32c.value(c.key.encode()) \
                    or w[4] >= len(CODECS):
                raise CorruptCheckpointError(
                    f"{d}/{c.key}: the record its owning host returned does not match the "
                    "chunk the controller planned there; the step is not committed")
            out.append(dataclasses.replace(c, crc32c=w[1], stored_nbytes=w[2] | w[3] << 32,
                                           codec=CODECS[w[4]], block_crc32c=tuple(w[_HEAD:])))
    return out


def _blocks(c: ChunkRecord) -> int:
    return -(-c.nbytes // c.block_bytes) if c.block_bytes else 0


def _devices(sharding: Any) -> tuple:
    """A NamedSharding's or a single device's devices, in their mesh's order
    (the order colocated Python gives a call's devices)."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return tuple(sharding.mesh.devices.flat)
    return tuple(sharding.device_set)


def _colocated_sharding(sharding: Any, path: Any) -> Any:
    """`sharding` on the CPU devices colocated with its devices."""
    from jax.experimental import colocated_python as cp
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh,
                                                                       jax.sharding.Mesh):
        return jax.sharding.NamedSharding(cp.colocated_cpu_devices(sharding.mesh),
                                          sharding.spec)
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return jax.sharding.SingleDeviceSharding(
            cp.colocated_cpu_devices(list(sharding.device_set))[0])
    raise ValueError(f"leaf {path}: write_on_owning_hosts=True writes arrays with a "
                     f"NamedSharding or on one device, not {type(sharding).__name__}; "
                     "put it on a NamedSharding first")
