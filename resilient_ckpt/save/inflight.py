"""Snapshots in flight: their tier jobs, upload pins and the host-memory budget.

A `Tier` is a tier as it runs (its plan, storage, worker and I/O pool); a
`Flight` is one step's snapshot on its way to its tiers; `InFlight` keeps
them all, with the budget (`reserve`, waiting or cancelling superseded queued
writes), the queued and running tier jobs per step, and the pins that keep a
faster tier's copy while an upload reads it. The last tier done with a
snapshot frees its memory. `Saver` (saver.py) drives it from the training
thread and from its tier workers.

Locking: one Condition guards everything here; it may be held while calling
the catalog's `invalidate` (whose own lock is never held across a call out),
and is never held across storage I/O.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from ..options import TierPlan
from ..storage.base import Storage
from . import snapshot
from .claim import StepClaim
from .commit import TierWrite

log = logging.getLogger("resilient_ckpt")


@dataclasses.dataclass
class Tier:
    """A tier at run time: its plan, its storage, its worker and its I/O pool."""

    plan: TierPlan
    storage: Storage
    worker: cf.ThreadPoolExecutor
    io: cf.Executor  # chunk puts: the shared pool, or a remote tier's own

    @property
    def name(self) -> str:
        return self.plan.name


@dataclasses.dataclass
class SaveRecord:
    """What one save did: blocking time, bytes, and each tier's outcome."""

    step: int
    blocking_s: float = 0.0
    snapshot_s: float = 0.0
    waited_s: float = 0.0
    bytes: int = 0
    fresh_bytes: int = 0  # host memory the snapshot faulted in (0 from a warm pool)
    viewed: bool = False  # the snapshot viewed the state's buffers (snapshot.viewed)
    tiers: dict[str, TierWrite] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Flight:
    """A snapshot on its way to its tiers; its memory is freed when no tier
    holds it any more (an upload lets go once it can read a tier's copy)."""

    snap: snapshot.Snapshot
    need: int
    rec: SaveRecord
    holders: set[str]
    header: dict
    claim: StepClaim  # the step's claim (claim.py), shared by its tier jobs
    pins: dict[str, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    sent: frozenset[str] = frozenset()  # the tiers it was sent to, done ones included


class InFlight:
    """Snapshots in flight, their tier jobs, upload pins and the memory budget.

    Everything here is guarded by one Condition; `Saver` calls in from the
    training thread and from tier workers.
    """

    def __init__(self, invalidate: Callable[[], None], budget: int | None, over_budget: str):
        # invalidate: the catalog's, called whenever a tier is done with a step
        self._invalidate, self._budget, self._over_budget = invalidate, budget, over_budget
        self._pool = snapshot.HostPool()
        self._lock = threading.Condition()
        self._held = 0
        self._pending: dict[int, dict[str, cf.Future]] = {}
        self._flights: dict[int, Flight] = {}
        self._pins: collections.Counter = collections.Counter()  # (tier, step) -> uploads
        self.unpinned: Callable[[str], None] = lambda tier: None  # a pin on `tier` ended

    @property
    def pool(self) -> snapshot.HostPool:
        return self._pool

    def reserve(self, need: int, rec: SaveRecord, remote: list[str]) -> None:
        """Holds `need` bytes of the host-memory budget. Over budget, first drops
        queued older writes to the `remote` tiers this step is due on (never
        wait for GCS); then "wait" blocks until older snapshots are written,
        "skip" first drops the queued writes this newer step supersedes."""
        budget = self._budget or 2 * need
        t0 = time.perf_counter()
        with self._lock:
            while self._held and self._held + need > budget:
                if any([self._supersede(name, rec.step) for name in remote]):
                    continue
                if self._over_budget == "skip" and self._shed(rec.step):
                    continue
                self._lock.wait()
            self._held += need
        rec.waited_s = time.perf_counter() - t0

    def unreserve(self, need: int) -> None:
        with self._lock:
            self._held -= need
            self._lock.notify_all()

    def launch(self, flight: Flight, tiers: list[Tier], feeds: dict[str, list[str]],
               write: Callable, upload: Callable) -> None:
        """Queues `flight`'s job on each tier's worker, faster tiers first
        (uploads wait on their futures)."""
        step = flight.snap.step
        with self._lock:
            jobs = self._pending.setdefault(step, {})
            self._flights[step] = flight
            flight.sent = frozenset(t.name for t in tiers)
            for t in tiers:
                if feeds.get(t.name):
                    self._supersede(t.name, step)
                    flight.pins[t.name] = [(n, step) for n in feeds[t.name]]
                    self._pins.update(flight.pins[t.name])
                    jobs[t.name] = t.worker.submit(upload, t, flight,
                                                   [(n, jobs[n]) for n in feeds[t.name]])
                else:
                    jobs[t.name] = t.worker.submit(write, t, flight)

    def _supersede(self, name: str, step: int) -> bool:
        """Drops writes to remote tier `name` queued behind a running one (only
        the newest step needs to get there); True if one was. Holds the lock."""
        dropped = False
        for old in sorted(self._pending):
            fut = self._pending[old].get(name)
            if old != step and fut is not None and fut.cancel():
                flight = self._flights[old]
                flight.rec.tiers[name] = TierWrite.skip(
                    name, old, f"superseded by step {step} (the {name} tier was "
                    "still writing an earlier step)")
                log.warning("step %d not written to the %s tier: superseded by step %d, "
                            "the tier is still busy with an earlier step", old, name, step)
                self._job_done(name, flight)
                dropped = True
        return dropped

    def _shed(self, newer: int) -> bool:
        """Cancels the oldest queued tier write; True if one was. Holds the lock."""
        busy = {name for jobs in self._pending.values()
                for name, fut in jobs.items() if fut.running()}
        for step in sorted(self._pending):
            flight = self._flights[step]
            for name, fut in list(self._pending[step].items()):
                # queued behind a slow write, and holding memory that cancelling frees
                if name in busy and name in flight.holders and fut.cancel():
                    flight.rec.tiers[name] = TierWrite.skip(
                        name, step, f"superseded by step {newer} (host-memory budget)")
                    log.warning("step %d not written to the %s tier: superseded by step %d "
                                "under the host-memory budget", step, name, newer)
                    self._job_done(name, flight)
                    return True
        return False

    def done(self, name: str, flight: Flight) -> None:
        """Tier `name` is done with `flight` (committed, failed or cancelled)."""
        with self._lock:
            self._job_done(name, flight)

    def _job_done(self, name: str, flight: Flight) -> None:
        """Bookkeeping when one tier is done with a step. Holds the lock."""
        step = flight.snap.step
        jobs = self._pending.get(step, {})
        jobs.pop(name, None)
        if not jobs:
            self._pending.pop(step, None)
            self._flights.pop(step, None)
        self._invalidate()
        self._release(name, flight)
        if ok(flight.rec, name):
            # An upload waiting for this tier's copy no longer needs the snapshot.
            for up, pins in flight.pins.items():
                if (name, step) in pins:
                    self._release(up, flight)
        for pin in flight.pins.pop(name, ()):
            self._pins[pin] -= 1
            if self._pins[pin] <= 0:
                del self._pins[pin]
                self.unpinned(pin[0])

    def release(self, name: str, flight: Flight) -> None:
        with self._lock:
            self._release(name, flight)

    def _release(self, name: str, flight: Flight) -> None:
        """`name` no longer needs the snapshot; the last one frees it. Holds the lock."""
        if name not in flight.holders:
            return
        flight.holders.discard(name)
        if not flight.holders:
            if flight.snap.slab is not None:
                self._pool.give(flight.snap.slab)
            if flight.snap.views:  # let the state's buffers go (snapshot.viewed),
                empty = np.zeros(0, np.uint8)  # and ready a slab for the next save
                for c in flight.snap.chunks:
                    c.data = empty
                self._pool.warm(flight.snap.nbytes)
            if flight.snap.placed is not None:
                flight.snap.placed.delete()  # the copy on the owning hosts (colocated.py)
            self._held -= flight.need
            self._lock.notify_all()

    def pinned(self, tier: str) -> frozenset[int]:
        """Steps of `tier` that an upload is reading."""
        with self._lock:
            return frozenset(s for (n, s) in self._pins if n == tier)

    def pending(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def jobs(self, step: int) -> dict[str, cf.Future]:
        """`step`'s queued or running jobs, by tier."""
        with self._lock:
            return dict(self._pending.get(step, {}))

    def sent_to(self, step: int) -> frozenset[str]:
        """The tiers `step` was sent to while any of them is still writing it
        (empty once all are done, or for a step not in flight)."""
        with self._lock:
            flight = self._flights.get(step)
            return flight.sent if flight is not None else frozenset()

    def all_jobs(self) -> list[cf.Future]:
        with self._lock:
            return [f for jobs in self._pending.values() for f in jobs.values()]


def ok(rec: SaveRecord, tier: str) -> bool:
    tw = rec.tiers.get(tier)
    return tw is not None and tw.ok
