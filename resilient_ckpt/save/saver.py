"""The save machinery: starting a save, tier workers, uploads, retention
runs and background errors (the snapshots in flight, their pins and the
memory budget are inflight.py's).

`Saver.start` reserves budget, takes the snapshot (the only part the training
loop waits for) and queues one job per due tier on that tier's own worker
thread, so one tier writes one step at a time, in order, and a slow disk never
delays the RAM tier. A remote tier (GCS) waits for a faster tier to commit the
step and uploads that tier's copy, the step pinned against the faster tier's
retention meanwhile, so the snapshot is freed at local speed and the devices
are read once. After each commit the tier's retention runs (the catalog says
what may go).

Failures: a failed tier write is a `SaveFailedError` with its `.step` and
`.tier`; `raise_errors` raises every one not yet raised, once (several as one
listing them). A failed retention delete is only logged; the catalog keeps
the step for the next run. The training thread never waits for GCS: a queued
remote write of an older step is dropped as superseded (recorded, logged)
when a newer step is due there (an upload) or needs its memory (a write from
the snapshot, with no faster tier).

Locking: `InFlight`'s one Condition (inflight.py) guards the budget, the
jobs in flight, the flights and the pins; the errors have a lock of their own.
Neither is held across storage I/O.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..catalog.catalog import Catalog
from ..compat import metadata
from ..core import writers
from ..core.manifest import Manifest
from ..errors import SaveFailedError, StepNotFoundError
from ..options import Plan
from ..storage.base import Storage
from . import colocated, commit, snapshot
from .claim import StepClaim
from .commit import TierWrite
from .inflight import Flight, InFlight, SaveRecord, Tier, ok

log = logging.getLogger("resilient_ckpt")


class Saver:
    """Runs saves in the background, tier by tier, within a memory budget."""

    def __init__(self, plan: Plan, storages: dict[str, Storage], catalog: Catalog,
                 io_threads: int, budget: int | None, over_budget: str):
        self._plan, self._catalog, self._io_threads = plan, catalog, io_threads
        self._io = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="rc-io")
        self.tiers = [Tier(p, storages[p.name],
                           cf.ThreadPoolExecutor(1, thread_name_prefix=f"rc-{p.name}"),
                           cf.ThreadPoolExecutor(p.own_io, thread_name_prefix=f"rc-{p.name}-io")
                           if p.own_io else self._io) for p in plan.tiers]
        self._copy = cf.ThreadPoolExecutor(snapshot.COPY_THREADS, thread_name_prefix="rc-copy")
        self._flying = InFlight(catalog.invalidate, budget, over_budget)
        self._flying.unpinned = self._unpinned
        self._errors: list[SaveFailedError] = []
        self._errors_lock = threading.Lock()
        self._warmed = False

    def tier(self, name: str) -> Tier:
        return next(t for t in self.tiers if t.name == name)

    # ------------------------------------------------------------ starting a save

    def start(self, step: int, due: list[Tier], items: list, metrics: Any,
              custom_metadata: Any, save_id: str) -> SaveRecord:
        """Snapshots `items` and queues the writes to the `due` tiers under
        `save_id` (the same on every process)."""
        tiers, feeds = route(self.tiers, due, self._plan.on_owning_hosts)
        self._warmed = True
        rec = SaveRecord(step)
        t0 = time.perf_counter()
        replicas = any(_keeps_replicas(t) for t in tiers)
        peers = self._catalog.peers  # after a loss, the survivors' labels (agree.py)
        records, sources = snapshot.describe_items(items, save_id, peers.rank, replicas)
        layout = snapshot.slab_layout(sources)  # jax's .nbytes costs per shard: once a save
        need = sum(layout[0])
        self._flying.reserve(need, rec, [t.name for t in tiers if t.storage.remote])
        try:
            t1 = time.perf_counter()
            if self._plan.on_owning_hosts:  # the devices' shards stay on their hosts
                snap = colocated.take(step, save_id, items, records, sources,
                                      self._flying.pool, self._copy)
            else:
                snap = snapshot.take(step, save_id, records, sources, self._flying.pool,
                                     self._copy, layout)
            rec.snapshot_s = time.perf_counter() - t1
        except BaseException:
            self._flying.unreserve(need)
            raise
        rec.bytes, rec.fresh_bytes, rec.viewed = snap.nbytes, snap.fresh_bytes, snap.views
        header = dict(created=time.time(), process_index=peers.rank,
                      process_count=peers.size, writers=writers.runs_of(peers.live),
                      metrics=metadata.jsonable(metrics),
                      custom_metadata=metadata.jsonable(custom_metadata))
        self._catalog.note_in_flight(step, header["created"], header["metrics"])
        flight = Flight(snap, need, rec, {t.name for t in tiers}, header, StepClaim(
            step, save_id, header["process_index"], header["process_count"],
            self._plan.naming, [(t.name, t.storage) for t in tiers]))
        self._flying.launch(flight, tiers, feeds, self._write, self._upload)
        rec.blocking_s = time.perf_counter() - t0
        return rec

    def warm(self, trees: list) -> None:
        """Starts faulting in, in the background and once, the host memory a
        snapshot of `trees` (the state, as restored or as passed to a save
        that was not due) takes, so the first save copies at memory speed.
        Never after a save started: its slab stays in the pool."""
        if self._warmed or self._plan.on_owning_hosts:
            return
        self._warmed = True
        replicas = any(_keeps_replicas(t) for t in self.tiers)
        try:
            _, sources = snapshot.describe_items([("", "pytree", t) for t in trees], "",
                                                 self._catalog.peers.rank, replicas)
        except (TypeError, ValueError):  # not a savable tree (ocp.PLACEHOLDER leaves, ...)
            return
        self._flying.pool.warm(snapshot.slab_layout(sources)[2])

    def _unpinned(self, tier: str) -> None:
        """The source tier may now delete what it kept for an upload."""
        try:
            src = self.tier(tier)
            src.worker.submit(self._retention_job, src)
        except RuntimeError:
            pass  # closing: the next save's retention catches up

    # ------------------------------------------------------------ tier jobs

    def _job(self, t: Tier, flight: Flight, body: Callable[[], bool]) -> None:
        """Runs one tier's job for `flight`; then, unless `body` says the write
        was skipped, that tier's retention. A failed write is handed to the
        training thread; the tier lets go of the snapshot either way."""
        try:
            try:
                written = body()
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                self._failed(t, flight.snap.step, e, flight.rec)
                written = False
            if written:
                self._retention_job(t)
        finally:
            # Before `done`: once the step is no longer pending, it may be saved again.
            flight.claim.settle(t.name, ok(flight.rec, t.name))
            self._flying.done(t.name, flight)

    def _write(self, t: Tier, flight: Flight) -> None:
        self._job(t, flight, lambda: self._write_snapshot(t, flight))

    def _write_snapshot(self, t: Tier, flight: Flight) -> bool:
        if flight.snap.placed is not None:
            flight.rec.tiers[t.name] = colocated.write_step(
                t.storage, t.name, self._plan.naming, flight.snap, flight.header, t.io,
                t.plan.config, self._plan.directory, t.plan.own_io or self._io_threads,
                encoding=t.plan.encoding,
                on_commit=lambda m: self._catalog.committed(t.name, t.storage, m),
                claim=lambda: flight.claim.take(t.name, t.storage))
            return True
        flight.rec.tiers[t.name] = commit.write_step(
            t.storage, t.name, self._plan.naming, flight.snap, flight.header, t.io,
            encoding=t.plan.encoding,
            on_commit=lambda m: self._catalog.committed(t.name, t.storage, m),
            primary_only=not _keeps_replicas(t),
            claim=lambda: flight.claim.take(t.name, t.storage))
        return True

    def _upload(self, t: Tier, flight: Flight, feeds: list) -> None:
        self._job(t, flight, lambda: self._upload_step(t, flight, feeds))

    def _upload_step(self, t: Tier, flight: Flight, feeds: list) -> bool:
        """A remote tier's job: once a faster tier has committed the step, upload
        that tier's copy; only if none did, the host snapshot. False if skipped."""
        snap, rec = flight.snap, flight.rec
        cf.wait([fut for _, fut in feeds])
        done = [n for n, _ in feeds if ok(rec, n)]
        if done:
            self._upload_copy(t, flight, done)
            return True
        if all(rec.tiers.get(n) is not None and rec.tiers[n].skipped for n, _ in feeds):
            reason = rec.tiers[feeds[0][0]].skipped or ""
            rec.tiers[t.name] = TierWrite.skip(t.name, snap.step, reason)
            log.warning("step %d not uploaded to the %s tier: %s", snap.step, t.name, reason)
            return False
        log.warning("no faster tier committed step %d; uploading it to the %s tier "
                    "from host memory", snap.step, t.name)
        return self._write_snapshot(t, flight)

    def _upload_copy(self, t: Tier, flight: Flight, done: list[str]) -> None:
        snap = flight.snap
        self._flying.release(t.name, flight)
        mine = {n: self._own_manifest(n, flight) for n in done}
        sources = [(n, self.tier(n).storage, m) for n, m in mine.items() if m is not None]
        if not sources:
            raise StepNotFoundError(f"step {snap.step} vanished from the {done[0]} "
                                    "tier before its upload")
        flight.rec.tiers[t.name] = commit.copy_step(
            t.storage, t.name, self._plan.naming, sources[0][2], sources, t.io,
            t.plan.encoding,
            on_commit=lambda m: self._catalog.committed(t.name, t.storage, m),
            only=None if _keeps_replicas(t) else frozenset(
                c.key for c in snap.chunks if c.primary),
            claim=lambda: flight.claim.take(t.name, t.storage))

    def _own_manifest(self, tier: str, flight: Flight) -> Manifest | None:
        """This process's manifest of the flight's save in `tier`, as committed."""
        ts = self._catalog.view(tier).get(flight.snap.step)
        return next((m for m in (ts.manifests if ts else ())
                     if isinstance(m, Manifest) and m.save_id == flight.snap.save_id
                     and m.process_index == flight.header["process_index"]), None)

    def _failed(self, t: Tier, step: int, e: BaseException, rec: SaveRecord) -> None:
        rec.tiers[t.name] = TierWrite(t.name, step, False, 0.0, 0, str(e))
        err = _save_failed(t, step, e)
        log.error("%s", err)
        with self._errors_lock:
            self._errors.append(err)

    # ------------------------------------------------------------ retention

    def _retention_job(self, t: Tier) -> None:
        """Applies `t`'s retention; a failed delete is logged (never a failed
        save) and ends this run, so a dead network costs one deadline."""
        step = None
        try:
            pinned = self._flying.pinned(t.name)
            for step in self._catalog.doomed(t.name, t.plan.keep, self._plan.retention,
                                             pinned):
                self._catalog.delete(t.name, t.storage, step)
        except Exception as e:  # noqa: BLE001 - logged: retention is retried next time
            what = f"could not delete step {step}" if step is not None else "failed"
            log.warning("retention in the %s tier (%s) %s: %s; the step is kept and "
                        "deleting it is retried at the next retention run", t.name,
                        t.storage.url, what, e)

    # ------------------------------------------------------------ waiting and errors

    def pending(self) -> set[int]:
        """Steps with a tier write still queued or running."""
        return self._flying.pending()

    def wait_step(self, step: int, for_restore: bool = False) -> None:
        """Waits for `step`'s tier writes; `for_restore`: only for the local
        ones when there are any (a restore reads the fastest copy: it need not
        wait minutes for an upload on the recovery path)."""
        jobs = self._flying.jobs(step)
        if for_restore and (fast := {n for n in self._flying.sent_to(step)
                                     if not self.tier(n).storage.remote}):
            # Only the fast tiers' writes still running: one that finished
            # already is no reason to wait for the upload.
            jobs = {n: f for n, f in jobs.items() if n in fast}
        cf.wait(list(jobs.values()))

    def wait_for_restore(self, step: int | None, viable: Callable[[int], bool]) -> None:
        """Waits for what a restore of `step` (None: the newest) may read: the
        local tiers' writes, and an upload only when no faster copy is viable."""
        for s in (self.pending() if step is None else [step]):
            self.wait_step(s, for_restore=True)
        if step is not None and not viable(step):
            self.wait_step(step)

    def wait_all(self) -> None:
        while futures := self._flying.all_jobs():
            cf.wait(futures)

    def take_errors(self) -> list[SaveFailedError]:
        """The background failures not yet raised (they will not be raised again)."""
        with self._errors_lock:
            errors, self._errors = self._errors, []
        return errors

    def run_retention(self) -> list[cf.Future]:
        """Applies every tier's retention again, each on its tier's worker
        (after an agreement changed what the tiers may delete)."""
        futures = []
        for t in self.tiers:
            try:
                futures.append(t.worker.submit(self._retention_job, t))
            except RuntimeError:
                break  # closing
        return futures

    def raise_errors(self) -> None:
        """Raises every background failure not yet raised, once: one as it is,
        several as one SaveFailedError listing them all."""
        errors = self.take_errors()
        if errors:
            raise SaveFailedError.listing(errors)

    def close(self) -> None:
        """Stops the workers (after `wait_all`) and closes the storages."""
        for t in self.tiers:
            t.worker.shutdown(wait=True)
        for t in self.tiers:
            if t.io is not self._io:
                t.io.shutdown(wait=True)
            t.storage.close()
        self._io.shutdown(wait=True)
        self._copy.shutdown(wait=True)
        self._flying.pool.close()


def route(all_tiers: list[Tier], due: list[Tier], on_owning_hosts: bool
          ) -> tuple[list[Tier], dict[str, list[str]]]:
    """The tiers to write, fastest first, and per remote tier the faster due
    tiers it uploads from. A step due on a remote tier alone also goes to the
    fastest tier, to upload from: the devices are read once, into the snapshot.
    Written on the owning hosts, each tier is written from their copy."""
    if on_owning_hosts:
        return list(due), {}
    fast = [t for t in due if not t.storage.remote]
    remote = [t for t in due if t.storage.remote]
    if remote and not fast:
        fast = [t for t in all_tiers if not t.storage.remote][:1]
    return fast + remote, {t.name: [f.name for f in fast] for t in remote}


def _save_failed(t: Tier, step: int, e: BaseException) -> SaveFailedError:
    """The error a failed write of `step` to `t` is reported as (with a hint when
    the tier is out of space)."""
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    hint = f"; the {t.name} tier is out of space: free some, or lower its keep" if full else ""
    err = SaveFailedError(f"save of step {step} to the {t.name} tier "
                          f"({t.storage.url}) failed: {e}{hint}")
    err.__cause__, err.step, err.tier = e, step, t.name
    return err


def _keeps_replicas(t: Tier) -> bool:
    """Whether `t` keeps every shard this host holds (a per-host tier asked to),
    not only the ones it writes for the job."""
    return t.plan.replicas and not t.storage.shared
