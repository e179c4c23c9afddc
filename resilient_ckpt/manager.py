"""The Orbax-compatible CheckpointManager, orchestrating tiers asynchronously.

`save` takes the host snapshot (the only blocking part), then hands it to one
worker thread per due tier; each writes and commits the step, applies that
tier's retention, and gives the snapshot back when the last tier is done. A
GCS tier instead waits for a faster tier to commit the step and uploads that
tier's copy (the step pinned against that tier's retention meanwhile), so the
snapshot is freed at local speed and the devices are never read again.
`restore` selects the newest viable step across every tier, reads each chunk
from the fastest intact copy, and falls back to an older step when asked for
"the latest" and the newest turns out corrupt. Background failures are raised
once, by the next `save`, `wait_until_finished`, `check_for_errors` or `close`.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import os
import threading
import time
import uuid
from typing import Any, Callable, Container

import jax
from etils import epath

from . import args as args_lib, commit, layout, legacy, metadata, retention, selection, snapshot
from .errors import (CorruptCheckpointError, ItemNotFoundError, SaveFailedError,
                     StepAlreadyExistsError, StepNotFoundError, TargetMismatchError)
from .pytree import build_nested, flatten, match_target, unflatten
from .restore import ChunkReader, RestoreRecord, restore_leaves, target_for
from .tiers import GcsTier, LocalTier, RamTier
from .transfer import Encoding

log = logging.getLogger("resilient_ckpt")


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
    """Orbax's common options, plus `tiers` and the host-memory budget.

    With no `tiers`, the directory is one local tier (one GCS tier for a gs://
    directory) saving every `save_interval_steps` and keeping `max_to_keep`,
    exactly as in Orbax. `progress`: show a progress bar (tqdm, on stderr) while
    restoring.
    `host_memory_budget`: bytes of snapshots in flight (default: two states);
    when a save would exceed it, `over_budget="wait"` blocks until an older
    snapshot is written; `"skip"` first cancels the queued, not yet started
    writes of older steps (the newer step supersedes them; recorded in their
    SaveRecord), and waits only if that frees too little.
    """

    save_interval_steps: int = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: str = "max"
    keep_checkpoints_without_metrics: bool = True
    step_prefix: str | None = None
    step_format_fixed_length: int | None = None
    create: bool = True
    cleanup_tmp_directories: bool = True
    save_on_steps: Container[int] | None = None
    should_save_fn: Callable[[int, int | None], bool] | None = None
    read_only: bool = False
    enable_async_checkpointing: bool = True
    tiers: tuple = ()
    host_memory_budget: int | None = None
    over_budget: str = "wait"
    io_threads: int = 8
    restore_memory_budget: int = 256 * 1024 * 1024
    progress: bool = False

    def __post_init__(self):
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.max_to_keep is not None and self.max_to_keep < 0:
            raise ValueError("max_to_keep must be None or non-negative")
        if self.over_budget not in ("wait", "skip"):
            raise ValueError(f"over_budget must be 'wait' or 'skip', got {self.over_budget!r}")
        object.__setattr__(self, "tiers", tuple(self.tiers))

    @staticmethod
    def from_any(options: Any) -> "CheckpointManagerOptions":
        """Ours as given, or Orbax's CheckpointManagerOptions field by field."""
        if options is None:
            return CheckpointManagerOptions()
        if isinstance(options, CheckpointManagerOptions):
            return options
        names = {f.name for f in dataclasses.fields(CheckpointManagerOptions)}
        kw = {n: getattr(options, n) for n in names if hasattr(options, n)}
        pp = getattr(options, "preservation_policy", None)
        if pp is not None and type(pp).__name__ == "LatestN":
            kw["max_to_keep"] = pp.n
        return CheckpointManagerOptions(**kw)


@dataclasses.dataclass
class SaveRecord:
    """What one save did: blocking time, bytes, and each tier's outcome."""

    step: int
    blocking_s: float = 0.0
    snapshot_s: float = 0.0
    waited_s: float = 0.0
    bytes: int = 0
    tiers: dict = dataclasses.field(default_factory=dict)  # name -> TierWrite | str


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    step: int
    item_metadata: Any
    metrics: Any
    custom_metadata: Any
    time: float


@dataclasses.dataclass(frozen=True)
class RootMetadata:
    custom_metadata: Any = None


@dataclasses.dataclass
class _Flight:
    """A snapshot on its way to its tiers; its memory is freed when no tier
    holds it any more (a GCS upload lets go once it can read a tier's copy)."""

    snap: snapshot.Snapshot
    need: int
    rec: SaveRecord
    holders: set
    pins: dict = dataclasses.field(default_factory=dict)  # tier -> [(source tier, step)]


@dataclasses.dataclass
class _Tier:
    name: str
    every: int
    keep: int | None
    storage: Any
    worker: cf.ThreadPoolExecutor
    io: cf.Executor  # chunk puts: the shared pool, or a GCS tier's own
    config: Any
    encoding: Encoding = Encoding()


class CheckpointManager:
    """Drop-in for orbax.checkpoint.CheckpointManager, with tiers."""

    def __init__(self, directory: str | os.PathLike, checkpointers: Any = None,
                 options: Any = None, metadata: Any = None, item_names: Any = None,
                 item_handlers: Any = None, logger: Any = None, handler_registry: Any = None):
        del checkpointers, metadata, item_names, item_handlers, logger, handler_registry
        self._options = o = CheckpointManagerOptions.from_any(options)
        self._directory = epath.Path(directory)
        remote = str(self._directory).startswith("gs://")
        if not o.create and not remote and not os.path.isdir(directory) and not o.read_only:
            raise FileNotFoundError(f"{directory} does not exist and options.create=False")
        self._naming = layout.StepNaming(o.step_prefix, o.step_format_fixed_length)
        self._io = cf.ThreadPoolExecutor(o.io_threads, thread_name_prefix="rc-io")
        self._pins: collections.Counter = collections.Counter()  # (tier, step) -> uploads
        self._tiers = self._open_tiers(o, str(self._directory))
        self._copy = cf.ThreadPoolExecutor(2, thread_name_prefix="rc-copy")
        self._pool = snapshot.HostPool()
        self._lock = threading.Condition()
        self._held = 0
        self._pending: dict[int, dict[str, cf.Future]] = {}
        self._flights: dict[int, _Flight] = {}
        self._errors: list[BaseException] = []
        self._bad: set = set()
        self._obs: dict[str, dict] = {}
        self._orbax_steps: set[int] = set()
        self._viable_cache: dict | None = None
        self._local_info: dict[int, tuple[float, Any]] = {}
        self.save_records: collections.deque = collections.deque(maxlen=256)
        self.restore_records: collections.deque = collections.deque(maxlen=64)
        self.reload()
        self._cleanup = None
        if o.cleanup_tmp_directories and not o.read_only:
            self._cleanup = threading.Thread(target=self._clean, name="rc-cleanup", daemon=True)
            self._cleanup.start()

    # ------------------------------------------------------------ setup

    def _open_tiers(self, o: CheckpointManagerOptions, directory: str) -> list[_Tier]:
        remote = directory.startswith("gs://")
        configs = list(o.tiers) or [GcsTier() if remote else LocalTier()]
        order = {"ram": 0, "local": 1, "gcs": 2}
        configs.sort(key=lambda t: order.get(t.kind, 9))
        tiers, names = [], collections.Counter()
        for t in configs:
            name = t.kind if not names[t.kind] else f"{t.kind}{names[t.kind]}"
            names[t.kind] += 1
            every = t.every if t.every is not None else o.save_interval_steps
            keep = t.keep if (t.keep is not None or isinstance(t, RamTier)) else o.max_to_keep
            storage = t.open(directory, o.create and not o.read_only)
            gcs = t.kind == "gcs"
            # A GCS tier gets its own pool, so slow uploads never hold the
            # shared pool's threads that the RAM and local tiers write through.
            io = cf.ThreadPoolExecutor(t.concurrency, thread_name_prefix=f"rc-{name}-io") \
                if gcs else self._io
            tiers.append(_Tier(name, every, keep, storage,
                               cf.ThreadPoolExecutor(1, thread_name_prefix=f"rc-{name}"), io, t,
                               Encoding(t.codec, t.level) if gcs else Encoding()))
        return tiers

    def _tier(self, name: str) -> _Tier:
        return next(t for t in self._tiers if t.name == name)

    def _clean(self) -> None:
        for t in self._tiers:
            try:
                if t.storage.shared:  # seen by every host: one of them collects
                    if jax.process_index() != 0:
                        continue
                    removed = commit.collect_orphans(t.storage, self._naming,
                                                     t.config.orphan_age_s)
                else:
                    removed = commit.cleanup(t.storage, self._naming)
                if removed:
                    log.info("cleaned %d leftovers of dead saves in %s", len(removed),
                             t.storage.url)
            except OSError as e:
                log.warning("cleanup of %s failed: %s", t.storage.url, e)

    # ------------------------------------------------------------ what exists

    @property
    def directory(self) -> epath.Path:
        return self._directory

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def reload(self) -> None:
        """Re-reads every tier (steps written by other processes appear)."""
        obs = {t.name: commit.observe(t.storage, t.name, self._naming) for t in self._tiers}
        home = self._home_tier()
        orbax = legacy.orbax_steps(home.storage, self._naming) if home else set()
        with self._lock:
            self._obs = obs
            self._orbax_steps = orbax - {s for o in obs.values() for s in o}
            self._viable_cache = None

    def _home_tier(self) -> _Tier | None:
        """The local tier at the manager's directory, where Orbax steps may be."""
        for t in self._tiers:
            if getattr(t.storage, "root", None) == os.path.abspath(str(self._directory)):
                return t
        return None

    def _observations(self) -> dict[int, list]:
        merged: dict[int, list] = collections.defaultdict(list)
        for tier in self._tiers:
            for step, ts in self._obs.get(tier.name, {}).items():
                merged[step].append(ts)
        return merged

    def _viable(self) -> dict[int, selection.Choice]:
        with self._lock:
            if self._viable_cache is None:
                self._viable_cache = selection.viable(
                    self._observations(), self.tier_names, frozenset(self._bad))
            return self._viable_cache

    def all_steps(self, read: bool = False) -> list[int]:
        """Committed viable steps and steps whose save is still in flight."""
        if read:
            self.reload()
        with self._lock:
            pending = set(self._pending)
        return sorted(set(self._viable()) | pending | self._orbax_steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _metrics_of(self, step: int) -> Any:
        if step in self._orbax_steps:
            return legacy.metrics(str(self._directory), self._naming, step)
        c = self._viable().get(step)
        if c is not None:
            return c.manifest.metrics
        return self._local_info.get(step, (0.0, None))[1]

    def metrics(self, step: int) -> Any:
        return self._metrics_of(step)

    def best_step(self) -> int | None:
        o = self._options
        if o.best_fn is None:
            return self.latest_step()
        scored = [(o.best_fn(m), s) for s in self.all_steps()
                  if (m := self._metrics_of(s)) is not None]
        if not scored:
            return None
        # As Orbax: sort worst to best (stable, so among equal values the newer
        # step sorts later) and take the last.
        ranked = sorted(scored, key=lambda vs: vs[0], reverse=(o.best_mode == "min"))
        return ranked[-1][1]

    # ------------------------------------------------------------ save policy

    def reached_preemption(self, step: int) -> bool:
        from orbax.checkpoint import utils as ocp_utils
        return bool(ocp_utils.reached_preemption(step))

    def _due_tiers(self, step: int) -> list[_Tier]:
        o = self._options
        if o.read_only:
            return []
        if o.should_save_fn is not None:
            every = o.should_save_fn(step, self.latest_step())
            return list(self._tiers) if every or self.reached_preemption(step) else []
        if (not self.all_steps() or (o.save_on_steps and step in o.save_on_steps)
                or self.reached_preemption(step)):
            return list(self._tiers)
        return [t for t in self._tiers if t.every and step % t.every == 0]

    def should_save(self, step: int) -> bool:
        latest = self.latest_step()
        if self._options.read_only or (latest is not None and latest >= step):
            return False
        return bool(self._due_tiers(step))

    # ------------------------------------------------------------ save

    def save(self, step: int, items: Any = None, save_kwargs: Any = None,
             metrics: Any = None, force: bool | None = False, args: Any = None,
             custom_metadata: dict | None = None) -> bool:
        """Snapshots the state to host memory and writes it to every due tier in
        the background. Returns whether a save was started."""
        del save_kwargs
        self._raise_errors()
        if args is None and items is None:
            raise ValueError("save needs args=, e.g. args=ocp.args.StandardSave(state)")
        if args is None:
            import orbax.checkpoint as ocp
            args = ocp.args.StandardSave(items)
        item_list, _ = args_lib.save_items(args)
        if self._options.read_only:
            log.warning("%s is read only; save of step %d skipped", self._directory, step)
            return False
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            raise StepAlreadyExistsError(
                f"step {step} already exists in {self._directory}; delete it first "
                "or save another step")
        tiers, feeds = self._plan(self._due_tiers(step) if not force else list(self._tiers))
        rec = SaveRecord(step)
        t0 = time.perf_counter()
        save_id = _shared_save_id()
        records, sources = snapshot.describe_items(item_list, save_id, jax.process_index())
        need = sum(int(s[4].nbytes) if hasattr(s[4], "nbytes") else 0 for s in sources)
        self._reserve(need, rec)
        try:
            t1 = time.perf_counter()
            snap = snapshot.take(step, save_id, records, sources, self._pool, self._copy)
            rec.snapshot_s = time.perf_counter() - t1
        except BaseException:
            with self._lock:
                self._held -= need
                self._lock.notify_all()
            raise
        rec.bytes = snap.nbytes
        header = dict(created=time.time(), process_index=jax.process_index(),
                      process_count=jax.process_count(), metrics=metadata.jsonable(metrics),
                      custom_metadata=metadata.jsonable(custom_metadata))
        flight = _Flight(snap, need, rec, {t.name for t in tiers})
        with self._lock:
            self._local_info[step] = (header["created"], header["metrics"])
            jobs = self._pending.setdefault(step, {})
            self._flights[step] = flight
            for t in tiers:  # faster tiers first: uploads wait on their futures
                if feeds.get(t.name):
                    self._supersede_uploads(t, step)
                    flight.pins[t.name] = [(n, step) for n in feeds[t.name]]
                    self._pins.update(flight.pins[t.name])
                    jobs[t.name] = t.worker.submit(self._upload, t, flight, header,
                                                   [(n, jobs[n]) for n in feeds[t.name]])
                else:
                    jobs[t.name] = t.worker.submit(self._write, t, flight, header)
        rec.blocking_s = time.perf_counter() - t0
        self.save_records.append(rec)
        if not self._options.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def _plan(self, due: list[_Tier]) -> tuple[list[_Tier], dict[str, list[str]]]:
        """The tiers to write, fastest first, and per GCS tier the faster due
        tiers it uploads from. A step due on GCS alone also goes to the fastest
        tier, to upload from: the devices are read once, into the snapshot."""
        fast = [t for t in due if t.storage.kind != "gcs"]
        remote = [t for t in due if t.storage.kind == "gcs"]
        if remote and not fast:
            fast = [t for t in self._tiers if t.storage.kind != "gcs"][:1]
        return fast + remote, {t.name: [f.name for f in fast] for t in remote}

    def _supersede_uploads(self, t: _Tier, step: int) -> None:
        """Drops uploads to `t` still queued behind a running one: only the
        newest step needs to reach GCS, and each queued upload pins its source
        step in the faster tier. Holds the lock."""
        for old in sorted(self._pending):
            fut = self._pending[old].get(t.name)
            if old != step and fut is not None and fut.cancel():
                flight = self._flights[old]
                flight.rec.tiers[t.name] = (f"skipped: superseded by step {step} (the "
                                            f"{t.name} tier was still uploading)")
                log.warning("step %d not uploaded to the %s tier: superseded by step %d, "
                            "the tier is still busy with an earlier step", old, t.name, step)
                self._job_done(t.name, flight)

    def _reserve(self, need: int, rec: SaveRecord) -> None:
        """Holds `need` bytes of the host-memory budget. Over budget, "wait"
        blocks until older snapshots are written; "skip" first drops the queued
        (not started) writes of older steps that this newer step supersedes."""
        budget = self._options.host_memory_budget or 2 * need
        t0 = time.perf_counter()
        with self._lock:
            while self._held and self._held + need > budget:
                if self._options.over_budget == "skip" and self._shed(rec.step):
                    continue
                self._lock.wait()
            self._held += need
        rec.waited_s = time.perf_counter() - t0

    def _shed(self, newer: int) -> bool:
        """Cancels the oldest queued tier write; True if one was. Holds the lock."""
        busy = {name for jobs in self._pending.values()
                for name, fut in jobs.items() if fut.running()}
        for step in sorted(self._pending):
            flight = self._flights[step]
            for name, fut in list(self._pending[step].items()):
                # queued behind a slow write, and holding memory that cancelling frees
                if name in busy and name in flight.holders and fut.cancel():
                    flight.rec.tiers[name] = (f"skipped: superseded by step {newer} "
                                              "(host-memory budget)")
                    log.warning("step %d not written to the %s tier: superseded by step %d "
                                "under the host-memory budget", step, name, newer)
                    self._job_done(name, flight)
                    return True
        return False

    def _job_done(self, name: str, flight: "_Flight") -> None:
        """Bookkeeping when one tier is done with a step. Holds the lock."""
        step = flight.snap.step
        jobs = self._pending.get(step, {})
        jobs.pop(name, None)
        if not jobs:
            self._pending.pop(step, None)
            self._flights.pop(step, None)
        self._viable_cache = None
        self._release(name, flight)
        if getattr(flight.rec.tiers.get(name), "ok", False):
            # An upload waiting for this tier's copy no longer needs the snapshot.
            for up, pins in flight.pins.items():
                if (name, step) in pins:
                    self._release(up, flight)
        for pin in flight.pins.pop(name, ()):
            self._pins[pin] -= 1
            if self._pins[pin] <= 0:
                del self._pins[pin]
                try:  # the source tier may now delete what it kept for the upload
                    src = self._tier(pin[0])
                    src.worker.submit(self._retention_job, src)
                except RuntimeError:
                    pass  # closing: the next save's retention catches up

    def _release(self, name: str, flight: "_Flight") -> None:
        """`name` no longer needs the snapshot; the last one frees it. Holds the lock."""
        if name not in flight.holders:
            return
        flight.holders.discard(name)
        if not flight.holders:
            if flight.snap.slab is not None:
                self._pool.give(flight.snap.slab)
            self._held -= flight.need
            self._lock.notify_all()

    def _write(self, t: _Tier, flight: "_Flight", header: dict) -> None:
        snap, rec = flight.snap, flight.rec
        try:
            rec.tiers[t.name] = commit.write_step(
                t.storage, t.name, self._naming, snap, header, t.io, encoding=t.encoding,
                on_commit=lambda m: self._committed(t, m))
            self._apply_retention(t)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._failed(t, snap.step, e, rec)
        finally:
            with self._lock:
                self._job_done(t.name, flight)

    def _upload(self, t: _Tier, flight: "_Flight", header: dict, feeds: list) -> None:
        """A GCS tier's job: once a faster tier has committed the step, upload
        that tier's copy; only if none did, the host snapshot."""
        snap, rec = flight.snap, flight.rec
        try:
            cf.wait([fut for _, fut in feeds])
            done = [n for n, _ in feeds if getattr(rec.tiers.get(n), "ok", False)]
            if done:
                with self._lock:
                    self._release(t.name, flight)
                    ts = self._obs.get(done[0], {}).get(snap.step)
                mine = [m for m in (ts.manifests if ts else ())
                        if getattr(m, "save_id", None) == snap.save_id
                        and m.process_index == jax.process_index()]
                if not mine:
                    raise StepNotFoundError(f"step {snap.step} vanished from the {done[0]} "
                                            "tier before its upload")
                rec.tiers[t.name] = commit.copy_step(
                    t.storage, t.name, self._naming, mine[0],
                    [(n, self._tier(n).storage) for n in done], t.io, t.encoding,
                    on_commit=lambda m: self._committed(t, m))
            elif all(isinstance(rec.tiers.get(n), str) for n, _ in feeds):
                rec.tiers[t.name] = f"skipped: {rec.tiers[feeds[0][0]]}"
                log.warning("step %d not uploaded to the %s tier: %s", snap.step, t.name,
                            rec.tiers[t.name])
                return
            else:
                log.warning("no faster tier committed step %d; uploading it to the %s tier "
                            "from host memory", snap.step, t.name)
                rec.tiers[t.name] = commit.write_step(
                    t.storage, t.name, self._naming, snap, header, t.io,
                    encoding=t.encoding, on_commit=lambda m: self._committed(t, m))
            self._apply_retention(t)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._failed(t, snap.step, e, rec)
        finally:
            with self._lock:
                self._job_done(t.name, flight)

    def _committed(self, t: _Tier, m) -> None:
        """Updates this tier's view with a manifest just committed to it."""
        if t.storage.sizes_from_manifest and not (t.storage.shared and m.process_count > 1
                                                  and jax.process_index() == 0):
            # Our own manifest is all we need to know: reading every process's
            # back after every upload would cost hosts x hosts requests per step.
            with self._lock:
                old = self._obs.get(t.name, {}).get(m.step)
            others = tuple(x for x in (old.manifests if old else ())
                           if not (getattr(x, "process_index", None) == m.process_index
                                   and getattr(x, "save_id", None) == m.save_id))
            ts = commit.tier_step(t.name, others + (m,))
        else:  # process 0 of a shared tier reads them all: it runs retention there
            ts = commit.observe_step(t.storage, t.name, self._naming, m.step)
        with self._lock:
            if ts is not None:
                self._obs.setdefault(t.name, {})[m.step] = ts
            self._viable_cache = None

    def _failed(self, t: _Tier, step: int, e: BaseException, rec: SaveRecord) -> None:
        rec.tiers[t.name] = commit.TierWrite(t.name, step, False, 0.0, 0, str(e))
        err = SaveFailedError(f"save of step {step} to the {t.name} tier "
                              f"({t.storage.url}) failed: {e}")
        err.__cause__ = e
        log.error("%s", err)
        with self._lock:
            self._errors.append(err)

    def _retention_job(self, t: _Tier) -> None:
        try:
            self._apply_retention(t)
        except OSError as e:
            log.warning("retention in the %s tier (%s) failed: %s", t.name, t.storage.url, e)

    def _apply_retention(self, t: _Tier) -> None:
        o = self._options
        with self._lock:
            own = dict(self._obs.get(t.name, {}))
            pinned = {s for (n, s) in self._pins if n == t.name}
            bad = frozenset(self._bad)
        viable = self._viable()
        # Only restorable steps take retention slots: a damaged step (bad manifest,
        # missing chunk) must not push a good older step out; it is left alone.
        steps = [s for s in sorted(own) if s in viable]
        # Kept besides: the newest step restorable at all, the newest restorable
        # from this tier alone (so GCS never loses its last complete step to one
        # that only the RAM tier can complete), and steps an upload is reading.
        alone = selection.viable({s: [ts] for s, ts in own.items()}, [t.name], bad)
        protected = frozenset(({max(viable)} if viable else set()) | pinned
                              | ({max(alone)} if alone else set()))
        metrics = {s: c.manifest.metrics for s, c in viable.items()}
        doomed = retention.to_delete(
            steps, t.keep, keep_period=o.keep_period, best_fn=o.best_fn,
            best_mode=o.best_mode, metrics=metrics,
            keep_checkpoints_without_metrics=o.keep_checkpoints_without_metrics,
            protected=protected)
        for s in doomed:
            self._delete_from(t, s)

    def _delete_from(self, t: _Tier, step: int) -> None:
        with self._lock:
            self._obs.get(t.name, {}).pop(step, None)
            self._viable_cache = None
        if t.storage.shared and jax.process_index() != 0:
            return  # every host sees it: process 0 deletes, the others only forget it
        commit.delete_step(t.storage, self._naming, step)

    # ------------------------------------------------------------ errors & waiting

    def _raise_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            if len(errors) > 1:
                log.error("%d more background save failures: %s", len(errors) - 1,
                          "; ".join(str(e) for e in errors[1:]))
            raise errors[0]

    def check_for_errors(self) -> None:
        """Raises the first background save failure not yet raised, once."""
        self._raise_errors()

    def wait_until_finished(self) -> None:
        """Blocks until every background write has finished; raises failures."""
        while True:
            with self._lock:
                futures = [f for jobs in self._pending.values() for f in jobs.values()]
            if not futures:
                break
            cf.wait(futures)
        self._raise_errors()

    def is_saving_in_progress(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def _wait_step(self, step: int, for_restore: bool = False) -> None:
        with self._lock:
            jobs = dict(self._pending.get(step, {}))
        if for_restore:
            # A restore reads the fastest copy: it need not wait for an upload
            # to GCS (minutes, on the recovery path) when a faster tier has it.
            fast = [f for n, f in jobs.items() if self._tier(n).storage.kind != "gcs"]
            jobs = dict(enumerate(fast)) if fast else jobs
        cf.wait(list(jobs.values()))

    # ------------------------------------------------------------ delete

    def delete(self, step: int) -> None:
        if self._options.read_only:
            log.warning("%s is read only; delete of step %d skipped", self._directory, step)
            return
        if step not in self.all_steps():
            raise StepNotFoundError(f"cannot delete step {step}: it does not exist in "
                                    f"{self._directory} (steps: {self.all_steps()})")
        self._wait_step(step)
        if step in self._orbax_steps:
            self._home_tier().storage.delete_dir(self._naming.name(step))
            self._orbax_steps.discard(step)
            return
        for t in self._tiers:
            self._delete_from(t, step)
        self._local_info.pop(step, None)

    # ------------------------------------------------------------ restore

    def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
                directory: Any = None, args: Any = None) -> Any:
        """Restores `step`, or with step=None the newest viable step (falling back
        to older ones, with a warning, when chunks of the newest are corrupt)."""
        del restore_kwargs
        if directory is not None and str(directory) != str(self._directory):
            other = CheckpointManager(directory, options=dataclasses.replace(
                self._options, tiers=(), read_only=True, cleanup_tmp_directories=False))
            try:
                return other.restore(step, items=items, args=args)
            finally:
                other.close()
        if args is None and items is not None:
            import orbax.checkpoint as ocp
            args = ocp.args.StandardRestore(items)
        requests, is_composite = args_lib.restore_requests(args)
        if step is not None:
            self._wait_step(step, for_restore=True)
            if step not in self._viable():  # no faster copy after all: the upload's
                self._wait_step(step)
        else:
            for s in list(self._pending):
                self._wait_step(s, for_restore=True)
        ours = self._viable()
        orbax_newest = max(self._orbax_steps, default=None)
        if step is None and orbax_newest is not None and orbax_newest > max(ours, default=-1):
            return legacy.restore(str(self._directory), self._naming, orbax_newest, args)
        if step is not None and step not in ours and step in self._orbax_steps:
            return legacy.restore(str(self._directory), self._naming, step, args)
        while True:
            choices = self._viable()
            if step is None:
                if not choices:
                    raise StepNotFoundError(f"no viable step in {self._directory} "
                                            f"(tiers: {self.tier_names})")
                chosen = choices[max(choices)]
            elif step not in choices:
                if step in selection.viable(self._observations(), self.tier_names):
                    raise CorruptCheckpointError(
                        f"step {step} in {self._directory} failed checksum verification "
                        f"in every tier; restore an older step (viable: {sorted(choices)})")
                raise StepNotFoundError(
                    f"step {step} has no viable copy in any tier of {self._directory}; "
                    f"viable steps: {sorted(choices)}")
            else:
                chosen = choices[step]
            record = RestoreRecord(chosen.step)
            try:
                out = self._restore_choice(chosen, requests, is_composite, record)
            except CorruptCheckpointError as e:
                with self._lock:
                    self._viable_cache = None
                for msg in record.fallbacks:
                    log.warning("%s", msg)
                if step is not None:
                    raise
                log.warning("step %d is not restorable (%s); falling back to the next "
                            "older viable step", chosen.step, e)
                continue
            for msg in record.fallbacks:
                log.warning("%s", msg)
            self.restore_records.append(record)
            return out

    @property
    def last_restore(self) -> RestoreRecord | None:
        return self.restore_records[-1] if self.restore_records else None

    def _restore_choice(self, chosen: selection.Choice, requests: dict | None,
                        is_composite: bool, record: RestoreRecord) -> Any:
        storages = {t.name: t.storage for t in self._tiers}
        bar = None
        if self._options.progress:
            from . import progress
            storages, bar = progress.wrap(storages, chosen, jax.process_count() == 1)
        try:
            return self._restore_with(chosen, storages, requests, is_composite, record)
        finally:
            if bar is not None:
                bar.close()

    def _restore_with(self, chosen: selection.Choice, storages: dict, requests: dict | None,
                      is_composite: bool, record: RestoreRecord) -> Any:
        m = chosen.manifest
        reader = ChunkReader(storages, self._naming, chosen, self._bad, record,
                             self._options.restore_memory_budget)
        names = [it.name for it in m.items]
        if requests is None:
            requests = {n: args_lib.RestoreRequest("any") for n in names}
            is_composite = names != [args_lib.DEFAULT_ITEM]
        out = {}
        try:
            for name, req in requests.items():
                if name not in names:
                    raise ItemNotFoundError(f"step {chosen.step} has no item {name!r} "
                                            f"(items: {names})")
                out[name] = self._restore_item(m.item(name), req, reader, chosen.step)
        finally:
            reader.close()
        if is_composite:
            return args_lib.composite(out)
        return out[args_lib.DEFAULT_ITEM]

    def _restore_item(self, item, req: args_lib.RestoreRequest, reader: ChunkReader,
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
            return build_nested(list(zip(saved_paths, values)))
        pairs, treedef = flatten(req.item)
        idx = match_target(saved_paths, [p for p, _ in pairs], partial=req.partial,
                           where=where)
        records = [item.leaves[i] for i in idx]
        targets = [target_for(leaf, metadata.restore_arg_for(req.restore_args, p))
                   for p, leaf in pairs]
        return unflatten(treedef, restore_leaves(records, targets, reader))

    # ------------------------------------------------------------ metadata

    def item_metadata(self, step: int) -> Any:
        return self.metadata(step).item_metadata

    def metadata(self, step: int | None = None) -> Any:
        if step is None:
            return RootMetadata({})
        self._wait_step(step)
        c = self._viable().get(step)
        if c is None and step in self._orbax_steps:
            return legacy.metadata(str(self._directory), self._naming, step)
        if c is None:
            raise StepNotFoundError(f"step {step} has no viable copy in {self._directory}")
        m = c.manifest
        per_item = {it.name: metadata.abstract_item(it) for it in m.items}
        item_md = (per_item[args_lib.DEFAULT_ITEM] if list(per_item) == [args_lib.DEFAULT_ITEM]
                   else args_lib.composite(per_item))
        # Orbax's StepMetadata gives {} (not None) when there are none.
        return StepMetadata(step, item_md, {} if m.metrics is None else m.metrics,
                            {} if m.custom_metadata is None else m.custom_metadata, m.created)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            if self._cleanup is not None:
                self._cleanup.join()  # it uses the storages closed below
            for t in self._tiers:
                t.worker.shutdown(wait=True)
            for t in self._tiers:
                if t.io is not self._io:
                    t.io.shutdown(wait=True)
                t.storage.close()
            self._io.shutdown(wait=True)
            self._copy.shutdown(wait=True)
            self._pool.clear()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shared_save_id() -> str:
    """A fresh save id, the same on every process of the job (process 0's)."""
    sid = uuid.uuid4()
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        raw = np.frombuffer(sid.bytes, dtype=np.uint8)
        sid = uuid.UUID(bytes=bytes(np.asarray(multihost_utils.broadcast_one_to_all(raw))))
    return sid.hex
