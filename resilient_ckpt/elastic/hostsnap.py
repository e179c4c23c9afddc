"""The host-memory snapshot tier: the state's copy kept on the hosts that own its devices.

This module owns `HostSnapshotTier`, the in-memory tier for a single-controller
(Pathways) job: a snapshot is a set of `pinned_host` arrays, each in the host
memory of a device that holds the state, never gathered to the controller.
Each distinct block of a leaf is copied to the host of one device per replica
group that holds it; a block that only one replica group holds (sharded along
the replica axis, FSDP-style) also gets a backup on the host of the device at
the same mesh position half the ring of groups away, so losing one group's
devices (or any contiguous half of the groups) leaves
a complete copy (`hostplan.place_copies`). Checksums of the blocks are
computed on their devices (`ondevice`); only they reach the controller.

A snapshot is committed (visible to `viable` and `restore`) only once every
copy and checksum is done; the waiting runs in a background thread, so `take`
costs the training loop only the dispatch. Copies are dispatched before
`take` returns, so a step that donates the state right after it cannot
change them: jax runs a donating computation only after the reads already
enqueued on its buffers (tests/elastic/test_host_snapshot.py checks it).

`restore` moves, for each target device, the source blocks its new box
needs (whole: a block's checksum covers the whole block) from a surviving
copy, preferring one on that device, then one on its host; checks them on the
target device and assembles the target block there (`hostrestore`: every
leaf's moves and programs are dispatched before any checksum is waited
for). After each commit, the programs a restore onto the likeliest smaller
mesh (`likely_meshes`) runs are compiled in a background thread
(`hostrestore.prepare_leaf`), so none compiles on the recovery path. The
loop's helpers at the end (`for_loop`, `snapshot_due`, `restore_first`,
`lose`) are what `Elastic` calls.

Threads, neither a daemon (a thread killed inside XLA at interpreter exit
aborts the process): `rc-hostsnap`, one per snapshot, waits for its copies
and checksums, then commits or discards it; it ends once they are done, and
interpreter exit waits for it. Devices lost meanwhile (`lose`, which the loop
calls before it deletes anything on them) make it discard the snapshot and
free its arrays itself: no other thread deletes arrays it is reading
(`in_flight`), which on the CPU backend would crash the process.
`rc-hostsnap-compile`, started by a commit, compiles the restore's programs
leaf by leaf; exit waits for the leaf in flight, and it stops at a loss or
once the main thread has ended.
"""
from __future__ import annotations

import copy as copy_lib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ..errors import CorruptCheckpointError, StepNotFoundError, TargetMismatchError
from . import hostleaf, hostplan, hostrestore, ondevice
from .hostplan import Copy, LeafRecord, SnapshotRecord
from .mesh import ChooseMesh, mesh_key
from .programs import likely_meshes
from .protocol import ManagerLike

log = logging.getLogger("resilient_ckpt.elastic")

HostOf = Callable[[jax.Device], Hashable]


def process_host(device: jax.Device) -> Hashable:
    """The default host of a device: its `process_index`."""
    return device.process_index


@dataclasses.dataclass(frozen=True)
class HostRestore:
    """What a restore from the tier moved: the step and the bytes per kind
    of move ("same_device": from the target device's own host copy;
    "same_host": from another device's copy on the same host; "other_host")."""

    step: int
    bytes_by_kind: dict[str, int]

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_kind.values())


@dataclasses.dataclass
class _Snapshot:
    """One snapshot: its record, its copies (pinned_host arrays), its host
    values, the copies found bad and the devices lost since it was taken."""

    record: SnapshotRecord
    copies: dict[Copy, jax.Array]
    values: dict[int, Any]
    shardings: dict[int, tuple[Mesh, PartitionSpec]]   # of the leaves on a NamedSharding
    bad: set[Copy] = dataclasses.field(default_factory=set)
    lost: set[int] = dataclasses.field(default_factory=set)
    checks: list[tuple[int, list[int], jax.Array]] = dataclasses.field(default_factory=list)
    thread: threading.Thread | None = None
    settled: bool = False   # the commit thread no longer waits on its arrays

    def arrays(self) -> list[jax.Array]:
        """Its copies and the checksums not yet read: what the commit thread waits on."""
        return list(self.copies.values()) + [arr for _, _, arr in self.checks]


class HostSnapshotTier:
    """Snapshots of the state in its own hosts' memory (memory kind pinned_host).

    `every`: take a snapshot at steps divisible by it (`due`). `keep`: the
    newest committed snapshots kept. `budget_bytes`: the most host memory
    the tier's copies (primaries and backups, of the committed snapshots and
    the one being taken) may use on any one host; a snapshot that would
    exceed it drops the oldest first, and one that alone exceeds it is skipped
    (one warning; `skipped` lists the steps). `replica_axis`: the mesh axis
    whose groups back each other up (None: the `Elastic` loop's data axis,
    else "data"). `host_of(device)`: the host a device's pinned_host memory
    is on (default its `process_index`; see docs/elastic.md under Pathways).
    `likely_meshes(mesh)`: the meshes a restore of a leaf on `mesh` likely
    goes to (the loop's next smaller one); after each commit the restore's
    programs for them are compiled in the background (`preparing`).
    """

    def __init__(self, every: int = 1, keep: int = 1, budget_bytes: int | None = None,
                 replica_axis: str | None = None, host_of: HostOf = process_host):
        if every < 1 or keep < 1:
            raise ValueError(f"HostSnapshotTier needs every >= 1 and keep >= 1, got "
                             f"every={every}, keep={keep}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.every, self.keep, self.budget_bytes = every, keep, budget_bytes
        self.replica_axis = replica_axis
        self._host_of = host_of
        self._hosts: dict[int, Hashable] = {}
        self._lock = threading.Lock()
        self._snaps: dict[int, _Snapshot] = {}
        self._pending: _Snapshot | None = None
        self._programs = ondevice.Programs()
        self.likely_meshes: Callable[[Mesh], Sequence[Mesh]] | None = None
        self._prepared: set[tuple] = set()
        self.preparing: threading.Thread | None = None
        self._warned: set[str] = set()
        self.skipped: list[int] = []
        self.last_restore: HostRestore | None = None

    # ---------------------------------------------------------------- taking

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take(self, step: int, state: Any) -> bool:
        """Dispatches a snapshot of `state` at `step` (after waiting for the
        one in flight) and returns; it is committed in the background. False
        when the budget cannot hold it (skipped)."""
        self.wait()
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        leaves, todo, values, shardings = [], [], {}, {}
        for li, (path, x) in enumerate(flat):
            if isinstance(x, jax.Array):
                if isinstance(x.sharding, NamedSharding) and isinstance(x.sharding.mesh, Mesh):
                    shardings[li] = (x.sharding.mesh, x.sharding.spec)
                leaf, copies = hostleaf.describe(li, jax.tree_util.keystr(path), x,
                                                 self.replica_axis or "data")
                todo += copies
                self._warn_single(leaf)
            else:
                a = np.asarray(x)
                values[li] = copy_lib.deepcopy(x)
                leaf = LeafRecord(jax.tree_util.keystr(path), a.shape, str(a.dtype), "host", None)
            leaves.append(leaf)
        record = SnapshotRecord(step, tuple(leaves))
        if not self._make_room(record):
            return False
        by_id = {d.id: d for d in jax.devices()}
        pinned = jax.device_put([t[1] for t in todo],
                                [SingleDeviceSharding(by_id[t[2]], memory_kind="pinned_host")
                                 for t in todo])
        snap = _Snapshot(record, {t[0]: a for t, a in zip(todo, pinned, strict=True)}, values,
                         shardings)
        sources = {(c[0], c[1]): src for c, src, _ in todo}
        for li, leaf in enumerate(leaves):
            by_shape: dict[tuple, list[int]] = {}
            for bi, b in enumerate(leaf.blocks or ()):
                if ondevice.on_device(b.box[1]):
                    by_shape.setdefault(b.box[1], []).append(bi)
            for bis in by_shape.values():
                snap.checks.append((li, bis, self._programs.checksums(
                    [sources[(li, bi)] for bi in bis])))
        snap.thread = threading.Thread(target=self._commit, args=(snap,), name="rc-hostsnap",
                                       daemon=False)
        with self._lock:
            self._pending = snap
        snap.thread.start()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the snapshot in flight; whether none is in flight now."""
        snap = self._pending
        if snap is not None and snap.thread is not None:
            snap.thread.join(timeout)
        return self._pending is None

    def _make_room(self, record: SnapshotRecord) -> bool:
        """Drops what the budget needs dropped for `record`; False: skip it."""
        hosts = self._host_map()
        need = record.bytes_per_host(hosts)
        with self._lock:
            self._drop(record.step, "a new snapshot of the same step")
            kept = [(s, snap.record.bytes_per_host(hosts)) for s, snap in self._snaps.items()]
            drops = hostplan.budget_drops(kept, need, self.budget_bytes)
            for s in drops or ():
                self._drop(s, "the memory budget")
        if drops is None:
            self.skipped.append(record.step)
            worst = max(need.items(), key=lambda kv: kv[1])
            self._warn_once("budget", "host snapshot of step %d skipped: it needs %d bytes of "
                            "host memory on host %s, over budget_bytes=%d; raise the budget or "
                            "snapshot less (later skips are not logged)",
                            record.step, worst[1], worst[0], self.budget_bytes)
            return False
        return True

    def _commit(self, snap: _Snapshot) -> None:
        """Background: waits for the copies and checksums, then commits; or,
        when the wait failed or devices were lost meanwhile (`lose`), discards
        the snapshot and frees its arrays, which no one else deletes."""
        step = snap.record.step
        try:
            record, why = _completed(snap), ""
        except Exception as e:  # noqa: BLE001 - a failed snapshot is dropped, training goes on
            record, why = None, f"failed and is not kept: {e}"
        with self._lock:
            snap.settled = True
            if snap.lost and not why:
                why = (f"discarded: devices {sorted(snap.lost)} were lost while it was "
                       f"being copied")
        if record is None or why:
            log.warning("host snapshot of step %d %s", step, why)
            _delete(snap.arrays())
            with self._lock:
                self._pending = None
            return
        snap.record, snap.checks = record, []
        with self._lock:
            self._snaps[step] = snap
            for s in hostplan.beyond_keep(self._snaps, self.keep):
                self._drop(s, f"retention (keep={self.keep})")
        self._start_prepare(snap)
        with self._lock:  # last: `wait` returns only once `preparing` is started
            self._pending = None

    def _start_prepare(self, snap: _Snapshot) -> None:
        """After a commit: compiles the restore's programs for `likely_meshes` in
        the background, once per layout of the state (in a thread of its own, so
        the next `take` does not wait for it). Not a daemon (a thread started
        from the commit thread would be one unless told): interpreter exit
        waits for the compile in flight rather than killing it inside XLA, and
        none is started or continued once the main thread has ended."""
        sig = tuple((li, mesh_key(m), str(p)) for li, (m, p) in snap.shardings.items())
        if (self.likely_meshes is not None and sig not in self._prepared
                and threading.main_thread().is_alive()):
            self._prepared.add(sig)
            t = threading.Thread(
                target=_prepare, name="rc-hostsnap-compile", daemon=False,
                args=(snap.record, snap.shardings, self.likely_meshes, self._programs,
                      lambda: sig in self._prepared and threading.main_thread().is_alive()))
            t.start()
            self.preparing = t  # published started: a reader may join it at once

    # ---------------------------------------------------------------- reading

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        with self._lock:
            return sorted(self._snaps)

    def record(self, step: int) -> SnapshotRecord:
        """The manifest of committed step `step`."""
        return self._get(step).record

    def viable(self, live: Collection[jax.Device] | None = None) -> int | None:
        """The newest committed step every block of which has a usable copy
        (on a device in `live`, default every device not lost, not deleted,
        not found corrupt); None when there is none."""
        with self._lock:
            snaps = sorted(self._snaps.items(), reverse=True)
        for step, snap in snaps:
            if hostplan.is_viable(snap.record, self._usable(snap, live)):
                return step
        return None

    def bytes_per_host(self) -> dict[Hashable, int]:
        """Host memory held by the tier's copies now (committed and in flight), per host."""
        hosts, out = self._host_map(), dict[Hashable, int]()
        with self._lock:
            snaps = self._held()
        for snap in snaps:
            for h, n in snap.record.bytes_per_host(hosts).items():
                out[h] = out.get(h, 0) + n
        return out

    def _held(self) -> list[_Snapshot]:
        """Committed snapshots and the one in flight, each once (under the lock)."""
        pending = [self._pending] if self._pending is not None else []
        return list(self._snaps.values()) + [p for p in pending if p not in self._snaps.values()]

    def lose(self, device_ids: Collection[int]) -> None:
        """The copies on these devices' hosts are gone (the devices were lost).
        A snapshot still in flight is discarded by its commit thread once its
        wait on its arrays is over (`wait`); until then, `in_flight` names them."""
        with self._lock:
            for snap in self._held():
                snap.lost |= set(device_ids)
        self._programs.drop(device_ids)
        self._prepared.clear()

    def in_flight(self) -> set[int]:
        """The ids (`id()`) of the arrays the commit thread may still read:
        the snapshot in flight's copies and checksums. Whoever deletes what lies
        on lost devices leaves these to the tier: on the CPU backend, deleting
        an array another thread is reading crashes the process."""
        with self._lock:
            snap = self._pending
            return {id(a) for a in snap.arrays()} if snap and not snap.settled else set()

    def corrupt(self, step: int, copy: Copy, array: jax.Array) -> None:
        """Replaces one copy's array (tests: an injected fault of host memory)."""
        self._get(step).copies[copy] = array

    def restore(self, step: int, abstract: Any,
                live: Collection[jax.Device] | None = None) -> Any:
        """The state of `step` on the shardings of `abstract` (a pytree of
        jax.ShapeDtypeStruct with shardings, matching the snapshot's tree),
        from copies on `live` devices (default: every device not lost).
        Raises CorruptCheckpointError when a block has no intact copy left,
        StepNotFoundError when the step is not committed. Sets `last_restore`."""
        snap = self._get(step)
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        leaves = snap.record.leaves
        if [jax.tree_util.keystr(p) for p, _ in flat] != [leaf.path for leaf in leaves]:
            raise TargetMismatchError(
                f"host snapshot of step {step}: the restore target's leaves "
                f"{[jax.tree_util.keystr(p) for p, _ in flat]} differ from the snapshot's "
                f"{[leaf.path for leaf in leaves]}; pass the abstract state of the same tree")
        kinds = dict.fromkeys(hostrestore.KINDS, 0)
        arrays = [(li, leaf, target) for li, ((_, target), leaf) in enumerate(zip(
            flat, leaves, strict=True)) if leaf.blocks is not None]
        got = dict(zip([li for li, _, _ in arrays], hostrestore.restore_leaves(
            step, arrays, snap.copies, self._usable(snap, live), snap.bad, self._host_map(),
            self._programs, kinds), strict=True))
        out = [got[li] if li in got else copy_lib.deepcopy(snap.values[li])
               for li in range(len(leaves))]
        self.last_restore = HostRestore(step, kinds)
        return jax.tree_util.tree_unflatten(treedef, out)

    # ---------------------------------------------------------------- inside

    def _usable(self, snap: _Snapshot, live: Collection[jax.Device] | None) -> set[Copy]:
        ids = None if live is None else {d.id for d in live}
        return {c for c, a in snap.copies.items()
                if c not in snap.bad and c[2] not in snap.lost
                and (ids is None or c[2] in ids) and not a.is_deleted()}

    def _get(self, step: int) -> _Snapshot:
        with self._lock:
            snap = self._snaps.get(step)
        if snap is None:
            raise StepNotFoundError(f"the host snapshot tier holds no committed step {step} "
                                    f"(it holds {self.steps()})")
        return snap

    def _drop(self, step: int, why: str) -> None:
        """Forgets `step` and frees its copies (the caller holds the lock)."""
        snap = self._snaps.pop(step, None)
        if snap is not None:
            log.info("host snapshot of step %d dropped (%s)", step, why)
            _delete(snap.copies.values())

    def _host_map(self) -> dict[int, Hashable]:
        if not self._hosts:
            self._hosts = {d.id: self._host_of(d) for d in jax.devices()}
        return self._hosts

    def _warn_single(self, leaf: LeafRecord) -> None:
        if any(len(b.holders) < 2 for b in leaf.blocks or ()):
            self._warn_once("single", "host snapshot: leaf %s has blocks with a single copy "
                            "(no replica axis %r of size > 1 in its mesh): losing one device "
                            "loses the snapshot", leaf.path, self.replica_axis or "data")

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def _completed(snap: _Snapshot) -> SnapshotRecord:
    """Waits for the snapshot's copies and checksums: its complete record."""
    jax.block_until_ready(list(snap.copies.values()))
    sums: dict[tuple[int, int], tuple[int, int]] = {}
    for li, bis, arr in snap.checks:
        for bi, row in zip(bis, np.asarray(arr), strict=True):
            sums[(li, bi)] = (int(row[0]), int(row[1]))
    for (li, bi, _), a in snap.copies.items():  # 0-d and empty blocks: a few bytes
        if (li, bi) not in sums:
            sums[(li, bi)] = ondevice.checksum_np(np.asarray(a))
    leaves = tuple(dataclasses.replace(leaf, blocks=tuple(
        dataclasses.replace(b, checksum=sums[(li, bi)]) for bi, b in enumerate(leaf.blocks)))
        if leaf.blocks is not None else leaf for li, leaf in enumerate(snap.record.leaves))
    return SnapshotRecord(snap.record.step, leaves, complete=True)


def _prepare(record: SnapshotRecord, shardings: dict[int, tuple[Mesh, PartitionSpec]],
             likely: Callable[[Mesh], Sequence[Mesh]], programs: ondevice.Programs,
             wanted: Callable[[], bool]) -> None:
    """Compiles the programs restoring each leaf onto its spec on the meshes
    `likely` names for its mesh, while `wanted()` (a loss since, or the main
    thread's end, stops it). A
    leaf that fails (say its spec does not fit a smaller mesh) is logged; its
    restore compiles what it needs."""
    t0, n, meshes = time.perf_counter(), 0, dict[tuple, Sequence[Mesh]]()
    for li, (mesh, spec) in shardings.items():
        if not wanted():
            return
        try:
            if mesh_key(mesh) not in meshes:
                meshes[mesh_key(mesh)] = likely(mesh)
            for m in meshes[mesh_key(mesh)]:
                if not wanted():
                    return
                n += hostrestore.prepare_leaf(li, record.leaves[li],
                                              NamedSharding(m, spec), programs)
        except Exception as e:  # noqa: BLE001 - only a head start: the restore compiles it
            log.info("host snapshot: not compiling ahead the restore of leaf %s: %s",
                     record.leaves[li].path, e)
    log.info("host snapshot: %d restore programs compiled ahead in %.2f s", n,
             time.perf_counter() - t0)


def _delete(arrays: Collection[jax.Array]) -> None:
    for a in arrays:
        try:
            a.delete()
        except Exception as e:  # noqa: BLE001 - a copy on a lost device may refuse
            log.debug("could not delete a host snapshot copy: %s", e)


# ------------------------------------------------------------------ the loop's calls

def for_loop(tier: HostSnapshotTier | None, data_axis: str,
             choose: ChooseMesh | None = None) -> HostSnapshotTier | None:
    """`tier`, with the loop's data axis as its replica axis unless it names
    one, and (with the loop's mesh policy `choose`) the likeliest smaller mesh
    (one data row lost) as the one its restore programs are compiled for."""
    if tier is not None and tier.replica_axis is None:
        tier.replica_axis = data_axis
    if tier is not None and choose is not None and tier.likely_meshes is None:
        tier.likely_meshes = lambda mesh: likely_meshes(choose, mesh, data_axis, 1)
    return tier


def snapshot_due(tier: HostSnapshotTier | None, step: int, state: Any) -> None:
    """At a save point: takes a snapshot of `state` when the tier is due."""
    if tier is not None and state is not None and tier.due(step):
        tier.take(step, state)


def lose(tier: HostSnapshotTier | None, device_ids: Collection[int], wait_s: float) -> set[int]:
    """After a failure, before anything on the lost devices is deleted: the
    copies on their hosts are gone, and a snapshot in flight is discarded
    (waiting up to `wait_s` for its commit thread). Returns the ids of the
    arrays still to leave to the tier (`in_flight`)."""
    if tier is None:
        return set()
    tier.lose(device_ids)
    tier.wait(wait_s)
    return tier.in_flight()


def restore_first(tier: HostSnapshotTier | None, manager: ManagerLike, abstract: Any,
                  wait_s: float) -> tuple[Any, int, dict] | None:
    """The state, step and bytes per tier ({"host_snapshot": n}) of the
    newest viable host snapshot at least as new as the manager's latest step,
    onto `abstract`; None when there is none (or no abstract), and the loop
    restores from the manager. A snapshot found corrupt is logged and the
    next older one tried. Waits up to `wait_s` for a snapshot in flight."""
    if tier is None or abstract is None:
        return None
    tier.wait(wait_s)
    if not tier.steps():
        return None
    floor, tried = manager.latest_step(), set()
    while (step := tier.viable()) is not None and step not in tried and (
            floor is None or step >= floor):
        tried.add(step)
        try:
            state = tier.restore(step, abstract)
        except TargetMismatchError as e:
            log.warning("elastic: not restoring from the host snapshot: %s", e)
            return None
        except CorruptCheckpointError as e:
            log.warning("elastic: %s", e)
            continue
        assert tier.last_restore is not None  # the restore just made
        return state, step, {"host_snapshot": tier.last_restore.nbytes}
    return None
