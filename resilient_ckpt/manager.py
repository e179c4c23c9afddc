"""The Orbax-compatible CheckpointManager: the face users call.

It resolves its options once (`options.resolve`), opens the tiers, and hands
the work to two collaborators: the `Catalog` (what each tier holds, which steps
are viable, retention's choices) and the `Saver` (snapshots, tier workers,
uploads, the memory budget, background errors). What stays here is Orbax's
protocol: asking the save-decision questions (`should_save`; `options.due`
decides which tiers a save goes to), the step listing, the
restore loop (the newest viable step, falling back to older ones when asked
for "the latest" and the newest turns out corrupt; Orbax's own steps through
Orbax), deletion and metadata. Background failures are raised once, by the
next `save` (after it has started its own step: an old failure never costs a
new save), `wait_until_finished`, `check_for_errors` or `close`; several at
once as one SaveFailedError listing them all.

Threads: the saver's and the coordinator's pools (their workers end at
`close`, else at interpreter exit after the work queued, as every
`concurrent.futures` pool's), and `rc-cleanup`, a daemon started by the
constructor that removes the temporaries dead writers left: it runs no jax,
and one cut short at exit leaves temporaries that the next manager removes.
A writable manager on the CPU backend also starts the snapshot's one check
of this jax, once per process (`snapshot.check_views_early`).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
import weakref
from typing import Any

from etils import epath

from .catalog.catalog import Catalog
from .compat import args as args_lib, metadata, orbax_steps as legacy, rootmeta
from .coordination import Coordinator
from .core import policies, retention
from .core.layout import StepNaming, check_step
from .core.selection import Choice
from .errors import StepAlreadyExistsError, StepNotFoundError
from .multihost.agree import Peers
from .options import CheckpointManagerOptions, due, resolve
from .restore.assemble import RestoreRecord, restore_choice
from .save import cleanup, colocated, snapshot
from .save.saver import Saver, SaveRecord, Tier
from .save.writer_lock import WriterLock

__all__ = ["CheckpointManager", "CheckpointManagerOptions", "SaveRecord"]

log = logging.getLogger("resilient_ckpt")


class CheckpointManager:
    """Drop-in for orbax.checkpoint.CheckpointManager, with tiers."""

    def __init__(self, directory: str | os.PathLike, checkpointers: Any = None,
                 options: Any = None, metadata: Any = None, item_names: Any = None,
                 item_handlers: Any = None, logger: Any = None, handler_registry: Any = None):
        del logger, handler_registry
        self._options = o = CheckpointManagerOptions.from_any(options)
        _preflight(directory, o)  # before anything is opened
        self._directory = epath.Path(directory)
        self._declared = args_lib.declared_items(item_names, item_handlers)
        self._mode = args_lib.ItemMode(o.lock_item_mode, checkpointers, item_names, item_handlers)
        self._plan = plan = resolve(o, str(self._directory))
        storages = {t.name: t.config.open(str(self._directory), plan.writable) for t in plan.tiers}
        home = os.path.abspath(str(self._directory))
        self.catalog = Catalog([(t.name, storages[t.name]) for t in plan.tiers], plan.naming,
                               str(self._directory),
                               next((s for s in storages.values()
                                     if getattr(s, "root", None) == home), None),
                               Peers(o.agreement_timeout_s))
        self._root = rootmeta.for_manager(str(self._directory), storages, metadata, options,
                                          o.read_only, self.catalog.peers.index)
        self._saver = Saver(plan, storages, self.catalog, o.io_threads,
                            o.host_memory_budget, o.over_budget)
        self._coord = Coordinator(self.catalog, self._saver, str(self._directory),
                                  o.agreement_vote)
        # Taken by the first save, dropped at close or when this is collected;
        # a newer manager of this directory in this process takes it over
        # (after this one's saves in flight finish: writer_lock.py).
        self._writer_lock = WriterLock(str(self._directory), drain=self._saver.wait_all)
        weakref.finalize(self, self._writer_lock.release)
        self.save_records: collections.deque = collections.deque(maxlen=256)
        self.restore_records: collections.deque = collections.deque(maxlen=64)
        self._coord.open(plan.writable)
        if plan.writable:
            snapshot.check_views_early()  # off the first save's blocking time
        self._cleanup = None
        if o.cleanup_tmp_directories and not o.read_only:
            self._cleanup = threading.Thread(
                target=_clean, args=(self._saver.tiers, plan.naming, self.catalog.peers.index),
                name="rc-cleanup", daemon=True)
            self._cleanup.start()

    # ------------------------------------------------------------ what exists

    @property
    def directory(self) -> epath.Path:
        return self._directory

    @property
    def tier_names(self) -> list[str]:
        return self.catalog.names

    @property
    def naming(self) -> StepNaming:
        """How step directories are named (Orbax's step_prefix and fixed length)."""
        return self._plan.naming

    @property
    def tiers(self) -> list[Tier]:
        """The tiers as they run: each one's plan (interval, retention) and storage."""
        return list(self._saver.tiers)

    def reload(self) -> None:
        """Re-reads every tier (others' new steps appear, a copy that failed a
        read counts again where it is intact now); a collective with several
        processes."""
        self.catalog.forget_bad()
        self.catalog.reload()
        self._coord.refresh("reload")

    def set_live_processes(self, processes: Any) -> None:
        """After a loss, go on among `processes` only (a collective; multihost.md)."""
        self._coord.set_live(processes)

    def all_steps(self, read: bool = False) -> list[int]:
        """Committed viable steps and steps whose save is still in flight."""
        if read:
            self.reload()
        return sorted(self.catalog.steps() | self._coord.in_flight()
                      | self.catalog.orbax_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metrics(self, step: int) -> Any:
        return self.catalog.metrics_of(step)

    def best_step(self) -> int | None:
        rule = self._plan.retention
        if rule.best_fn is None:
            return self.latest_step()
        steps = self.all_steps()
        ranked = retention.rank_best(steps, {s: self.catalog.metrics_of(s) for s in steps},
                                     rule.best_fn, rule.best_mode)
        return ranked[-1] if ranked else None

    # ------------------------------------------------------------ save policy

    def reached_preemption(self, step: int) -> bool:
        from orbax.checkpoint import utils as ocp_utils
        return bool(ocp_utils.reached_preemption(step))

    def should_save(self, step: int) -> bool:
        return bool(self._due(step))

    def _due(self, step: int, force: bool = False) -> list[Tier]:
        """The tiers a save of `step` goes to: `options.due` decides, from the
        plan and this call's facts; the questions it may ask (the user's
        `should_save_fn`, the preemption check, the save-decision policy) are
        asked here, as Orbax asks them."""
        o, latest = self._options, self.latest_step()
        fn = o.should_save_fn
        chosen = {t.name for t in due(
            self._plan, step, latest, force=force,
            preempted=functools.partial(self.reached_preemption, step),
            fn_says=(lambda: bool(fn(step, latest))) if fn is not None else (lambda: False),
            policy_says=functools.partial(self._policy_says, step))}
        return [t for t in self._saver.tiers if t.plan.name in chosen]

    def _policy_says(self, step: int) -> bool:
        """The save-decision policy's answer for `step`, asked as Orbax asks it,
        with every step that exists (time and metrics read only if it looks)."""
        o = self._options
        history = [policies.StepInfo(s, functools.partial(self.catalog.created, s),
                                     functools.partial(self.metrics, s))
                   for s in self.all_steps()]
        return policies.should_save(
            o.save_decision_policy, step, history, preempted=self.reached_preemption(step),
            saving=o.enable_should_save_is_saving_in_progress_check
            and self.is_saving_in_progress())

    # ------------------------------------------------------------ save

    def save(self, step: int, items: Any = None, save_kwargs: Any = None,
             metrics: Any = None, force: bool | None = False, args: Any = None,
             custom_metadata: dict | None = None) -> bool:
        """Snapshots the state to host memory and writes it to every due tier in
        the background; returns whether a save was started. Earlier saves'
        failures are raised after this step's save started (a SaveFailedError
        from `save` is about the steps it names), each once. A `step` that is
        not a whole number in [0, 2**63 - 1] is a ValueError (`check_step`)."""
        del save_kwargs
        step = check_step(step, "save")  # before anything is written or claimed
        started = self._save(step, items, metrics, force, args, custom_metadata)
        self._coord.raise_failures()
        return started

    def _save(self, step: int, items: Any, metrics: Any, force: bool | None, args: Any,
              custom_metadata: dict | None) -> bool:
        item_list, _ = args_lib.save_items(self._mode.save_args(args, items), self._declared)
        if self._options.read_only:
            log.warning("%s is read only; save of step %d skipped", self._directory, step)
            return False
        tiers = self._due(step, bool(force))  # one policy call a save
        if not tiers:  # the memory a save of this state takes, faulted in ahead (once)
            self._saver.warm([v for _, kind, v in item_list if kind != "json"])
            return False
        if step in self.all_steps():
            raise StepAlreadyExistsError(
                f"step {step} already exists in {self._directory}; delete it first "
                "or save another step")
        lock = self._writer_lock
        in_use = lock.try_hold([(t.name, t.storage) for t in self._saver.tiers],
                               self.catalog.peers.index)
        if lock.superseded and in_use is not None:
            raise in_use  # every process of a job made the newer manager alike
        if lock.took_over:  # the older manager's last saves committed since we read
            lock.took_over = False
            self.catalog.reload()
            if step in self.all_steps():
                raise StepAlreadyExistsError(
                    f"step {step} already exists in {self._directory} (the older "
                    "manager of this directory saved it); delete it first or save another step")
        save_id = self._coord.start_save(step, in_use)
        self.save_records.append(
            self._saver.start(step, tiers, item_list, metrics, custom_metadata, save_id))
        if not self._options.enable_async_checkpointing:
            self.wait_until_finished()
        return True

    def check_for_errors(self) -> None:
        """Raises every background failure not yet raised, once (several as one
        SaveFailedError listing them in `.failures`, each with `.step`, `.tier`)."""
        self._coord.raise_failures()
        self._saver.raise_errors()

    def wait_until_finished(self) -> None:
        """Blocks until every background write has finished; raises failures
        (with several processes, a collective: any process's, on every one)."""
        self._coord.finish()

    def is_saving_in_progress(self) -> bool:
        return bool(self._saver.pending())

    def wait_for_step(self, step: int) -> None:
        """Waits for this process's tier writes of `step` (no collective, raises nothing)."""
        self._saver.wait_step(step)

    # ------------------------------------------------------------ delete

    def delete(self, step: int) -> None:
        step = check_step(step, "delete")
        if self._options.read_only:
            log.warning("%s is read only; delete of step %d skipped", self._directory, step)
            return
        if step not in self.all_steps():
            raise StepNotFoundError(f"cannot delete step {step}: it does not exist in "
                                    f"{self._directory} (steps: {self.all_steps()})")
        self._saver.wait_step(step)
        self._coord.settle()
        if step in self.catalog.orbax_steps():
            self.catalog.delete_orbax(step)
            return
        for t in self._saver.tiers:
            self.catalog.delete(t.name, t.storage, step)
        self.catalog.forget_in_flight(step)
        self.catalog.forget(step)

    # ------------------------------------------------------------ restore

    def restore(self, step: int | None = None, items: Any = None, restore_kwargs: Any = None,
                directory: Any = None, args: Any = None) -> Any:
        """Restores `step`, or with step=None the newest viable step (falling back
        to older ones, with a warning, when chunks of the newest are corrupt)."""
        del restore_kwargs
        step = None if step is None else check_step(step, "restore")
        if directory is not None and str(directory) != str(self._directory):
            return self._restore_elsewhere(directory, step, items, args)
        args = self._mode.restore_args(args, items, functools.partial(_composite_step, self, step))
        requests, is_composite = args_lib.restore_requests(args, self._declared)
        self._saver.wait_for_restore(step, lambda s: s in self.catalog.steps())
        self._coord.refresh("restore")
        theirs = _orbax_choice(step, self.catalog.steps(), self.catalog.orbax_steps())
        if theirs is not None:
            return legacy.restore(str(self._directory), self._plan.naming, theirs, args)

        def attempt(chosen: Choice, settle: Any = None) -> Any:
            record, bad = RestoreRecord(chosen.step), self.catalog.bad()
            try:
                out = restore_choice(chosen, self.catalog.storages(), self._plan.naming,
                                     requests, is_composite, record, bad, self._declared,
                                     self._options.restore_memory_budget,
                                     self._options.progress, settle)
            finally:
                self.catalog.add_bad(bad)
                for msg in record.fallbacks:
                    log.warning("%s", msg)
            self.restore_records.append(record)
            return out
        out = self._coord.restore(step, attempt)
        if not self._options.read_only:  # what the next save copies, faulted in ahead
            self._saver.warm(args_lib.restored_trees(out))
        return out

    def _restore_elsewhere(self, directory: Any, step: int | None, items: Any,
                           args: Any) -> Any:
        """`restore(directory=...)`: a read-only manager of that directory, for one
        restore, under this manager's item mode (which that restore may set)."""
        other = CheckpointManager(directory, options=dataclasses.replace(
            self._options, tiers=(), read_only=True, cleanup_tmp_directories=False))
        other._mode = self._mode
        try:
            return other.restore(step, items=items, args=args)
        finally:
            other.close()

    @property
    def last_restore(self) -> RestoreRecord | None:
        return self.restore_records[-1] if self.restore_records else None

    # ------------------------------------------------------------ metadata

    def item_metadata(self, step: int) -> Any:
        return self.metadata(step).item_metadata

    def metadata(self, step: int | None = None) -> Any:
        if step is None:
            return self._root.get()
        step = check_step(step, "metadata")
        self._saver.wait_step(step)
        c = self.catalog.choice(step)
        if c is None and step not in self.catalog.orbax_steps():
            raise StepNotFoundError(f"step {step} has no viable copy in {self._directory}")
        self._mode.restore_args(None, None, functools.partial(_composite_step, self, step))
        if c is None:
            return legacy.metadata(str(self._directory), self._plan.naming, step)
        return metadata.step_metadata(c.manifest)

    # ------------------------------------------------------------ lifecycle

    def warm(self, state: Any) -> None:
        """Starts faulting in, in the background and once, the host memory a
        save of `state` takes (as a save call that was not due does), so that
        a fresh job's first save copies into touched memory."""
        self._saver.warm([state])

    def close(self) -> None:
        try:
            self.wait_until_finished()
        finally:
            if self._cleanup is not None:
                self._cleanup.join()  # it uses the storages closed below
            try:
                self._coord.close()
                self._saver.close()
            finally:
                self._writer_lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clean(tiers: list[Tier], naming: StepNaming, process_index: int) -> None:
    """Removes dead writers' leftovers from every tier, beside the program: it
    asks jax nothing (its backend may be shutting down)."""
    for t in tiers:
        cleanup.clean_tier(t.storage, naming, getattr(t.plan.config, "orphan_age_s", None),
                          process_index)


def _preflight(directory: Any, o: CheckpointManagerOptions) -> None:
    """What must hold before anything is opened: colocated Python when asked
    for; with `create=False`, the directory (a read-only manager of a missing
    one sees no steps, as in Orbax)."""
    if o.write_on_owning_hosts:
        colocated.require()
    remote = str(directory).startswith("gs://")
    if not o.create and not remote and not os.path.isdir(directory) and not o.read_only:
        raise FileNotFoundError(f"{directory} does not exist and options.create=False")


def _orbax_choice(step: int | None, ours: Any, orbax: set[int]) -> int | None:
    """The Orbax-written step a restore of `step` reads, if it reads one: the
    asked step when only Orbax has it, or for the latest, Orbax's newest when
    it is newer than every step of ours."""
    if step is None:
        newest = max(orbax, default=None)
        return newest if newest is not None and newest > max(ours, default=-1) else None
    return step if step not in ours and step in orbax else None


def _composite_step(m: CheckpointManager, step: int | None) -> bool | None:
    """Whether `step` (None: the latest) reads as a Composite step for Orbax's
    item mode: it holds no item named "default". None, which sets no mode,
    when there is no such step (Orbax reads a missing step as Composite and
    raises a mode error where ours raises StepNotFoundError, and a manager of
    single-item steps would stay locked out of them), or when this process
    cannot tell yet (with several processes, a step whose manifest it holds
    none of)."""
    step = m.latest_step() if step is None else step
    if step is None:
        return None
    c = m.catalog.choice(step) or m.catalog.viable().get(step)
    if c is not None:
        return args_lib.DEFAULT_ITEM not in [it.name for it in c.manifest.items]
    if step not in m.catalog.orbax_steps():
        return None
    return not os.path.exists(os.path.join(str(m.directory), m.naming.name(step),
                                           args_lib.DEFAULT_ITEM))
