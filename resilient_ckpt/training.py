"""Orbax's v1 training API, `ocp.training.Checkpointer`, over our CheckpointManager.

`Checkpointer` subclasses Orbax's `orbax.checkpoint.experimental.v1.training.
Checkpointer` (frameworks check `isinstance`), but none of Orbax's machinery
runs: Orbax's constructor is not called and every public method is our own,
handed to one `CheckpointManager`, so the tiers, manifests, agreement between
processes and restore fallbacks are the manager's. A step saved here is a
Composite of its checkpointables (each a pytree, or an `ocp.args` object such
as `JsonSave`), which the manager restores like any other, and the other way
round. This module also owns the face's errors (each also Orbax v1's) and the
responses of its async calls.

Threads: `rc-save-response`, a daemon per async response that waits for the
manager's writes of its step and runs the response's callbacks; it holds no
jax call, so interpreter exit may end it.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
from orbax.checkpoint.experimental.v1 import training as v1
from orbax.checkpoint.experimental.v1.training import Checkpointer as _Orbax

from . import errors
from .compat.args import DEFAULT_ITEM
from .core.layout import StepNaming, check_step
from .core.pytree import flatten, leaf_kind
from .manager import CheckpointManager
from .options import CheckpointManagerOptions, TierConfig

__all__ = ["Checkpointer", "StepAlreadyExistsError", "StepNotFoundError"]

# The name `save(step, state)` keeps the state under, as Orbax's own version says.
STATE = inspect.signature(_Orbax.save).parameters["checkpointable_name"].default
_RESERVED = frozenset({"", "metrics"})  # Orbax keeps a step's metrics under "metrics"


class StepAlreadyExistsError(errors.StepAlreadyExistsError, v1.errors.StepAlreadyExistsError):
    """A save of a step that exists: ours, Orbax v1's (a FileExistsError) and
    Orbax v0's (a ValueError), so any of their `except` clauses catches it."""


class StepNotFoundError(errors.StepNotFoundError, v1.errors.StepNotFoundError):
    """No such step: ours and Orbax v1's, and so a FileNotFoundError."""


class SaveResponse:
    """What an async save returns. `result()` waits, as `wait()` does, and
    answers True or raises the background failure; `on_complete(fn)` calls
    fn(True) once this process has written the step to every tier it was due."""

    def __init__(self, manager: CheckpointManager, step: int):
        self._manager, self.step = manager, step
        self._record = manager.save_records[-1]  # the save just started
        self._lock = threading.Lock()
        self._outcome: BaseException | bool | None = None
        self._written: threading.Event | None = None
        self._callbacks: list[Callable[[bool], None]] = []

    def result(self, timeout: float | None = None) -> bool:
        if timeout is not None and not self._local().wait(timeout):
            raise TimeoutError(f"step {self.step} was not written within {timeout} s")
        with self._lock:
            if self._outcome is None:
                try:
                    self._manager.wait_until_finished()
                    self._outcome = True
                except Exception as e:  # noqa: BLE001 - raised again below, on every call
                    self._outcome = e
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return True

    def on_complete(self, callback: Callable[[bool], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)
            done = self._written is not None and self._written.is_set()
        if done:
            self._call([callback])
        else:
            self._local()

    def _local(self) -> threading.Event:
        """Set once this process's writes of the step are done (a thread of
        its own waits for them: no collective runs off the caller's thread)."""
        with self._lock:
            if self._written is None:
                self._written = threading.Event()
                threading.Thread(target=self._wait, name="rc-save-response", daemon=True).start()
            return self._written

    def _wait(self) -> None:
        self._manager.wait_for_step(self.step)
        with self._lock:
            assert self._written is not None
            self._written.set()
            callbacks = list(self._callbacks)
        self._call(callbacks)

    def _call(self, callbacks: list[Callable[[bool], None]]) -> None:
        writes = self._record.tiers.values()
        if writes and all(w.ok for w in writes):
            for fn in callbacks:
                fn(True)


class Done:
    """A response whose work is already done (loads and deletes run in the call)."""

    def __init__(self, value: Any):
        self._value = value

    def result(self, timeout: float | None = None) -> Any:
        return self._value

    def on_complete(self, callback: Callable[[Any], None]) -> None:
        callback(self._value)


def _older(name: str, new: str) -> Callable[..., Any]:
    """Orbax's older name `name` of the method `new`: warns, then calls it."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"`{name}` is the older name of `{new}` (deprecated in Orbax). "
                      f"Use `{new}` instead.", DeprecationWarning, stacklevel=2)
        return getattr(self, new)(*args, **kwargs)
    method.__name__ = method.__qualname__ = name
    return method


class Checkpointer(_Orbax):  # Orbax marks its class @final: for type checkers only
    """Drop-in for Orbax's v1 `training.Checkpointer`, with our tiers.

    The arguments are Orbax's; `context`, `lightweight_initialize` and
    `logger` are accepted and unused (the context's `pytree.loading.
    partial_load` excepted). Ours besides: `tiers` (RamTier, LocalTier,
    GcsTier configurations), or all of our `options` (CheckpointManagerOptions,
    or Orbax's); the policies and the step name format given here override
    theirs. The manager is `.manager` (save and restore records, tiers).
    """

    def __init__(self, directory: Any, *, context: Any = None, save_decision_policy: Any = None,
                 preservation_policy: Any = None, step_name_format: Any = None,
                 custom_metadata: Any = None, cleanup_tmp_directories: bool = False,
                 lightweight_initialize: bool = False, logger: Any = None,
                 tiers: Sequence[TierConfig] | None = None, options: Any = None):
        # Orbax's __init__ is not called: it would open an Orbax manager of its own.
        del lightweight_initialize, logger
        self._context = context
        o = _options(options, tiers, save_decision_policy, preservation_policy,
                     step_name_format, cleanup_tmp_directories)
        self._manager = CheckpointManager(directory, options=o, metadata=custom_metadata)

    @property
    def manager(self) -> CheckpointManager:
        return self._manager

    @property
    def directory(self) -> Any:
        return self._manager.directory

    @property
    def latest(self) -> Any:
        steps = self._manager.all_steps()
        return self._info(steps[-1]) if steps else None

    @property
    def checkpoints(self) -> list[Any]:
        """Every step (in flight ones too), oldest first, with its time and metrics."""
        return [self._info(s) for s in self._manager.all_steps()]

    def _info(self, step: int) -> Any:
        return v1.CheckpointMetadata(
            step, self._path(step), metadata=None, metrics=self._manager.metrics(step),
            commit_timestamp_nsecs=_nsecs(self._manager.catalog.created(step)))

    def _path(self, step: int) -> Any:
        return self.directory / self._manager.naming.name(step)

    def _existing(self, step: Any) -> int | None:
        """The step asked for (None: the latest), raising when it does not exist."""
        steps = self._manager.all_steps()
        if step is None and not steps:
            raise StepNotFoundError(f"no checkpoints in {self.directory} (step=None asks "
                                    "for the latest); save one first")
        if step is not None and _step_of(step) not in steps:
            raise StepNotFoundError(f"no checkpoint of step {_step_of(step)} in "
                                    f"{self.directory} (steps: {steps})")
        return None if step is None else _step_of(step)

    def _orbax_step(self, step: int | None) -> int | None:
        """`step` (None: the latest) if Orbax wrote it in this directory, else None."""
        s = self._manager.latest_step() if step is None else step
        return s if s in self._manager.catalog.orbax_steps() else None

    def should_save(self, step: Any) -> bool:
        return self._manager.should_save(_step_of(step))

    # ------------------------------------------------------------ save

    def save(self, step: int, state: Any, *, checkpointable_name: str = STATE,
             force: bool = False, overwrite: bool = False, metrics: Any = None,
             custom_metadata: Any = None) -> bool:
        """Saves `state` if the policy says so (or `force`), and waits for it."""
        return self.save_checkpointables(step, {checkpointable_name: state}, force=force,
                                         overwrite=overwrite, metrics=metrics,
                                         custom_metadata=custom_metadata)

    def save_checkpointables(self, step: int, checkpointables: dict[str, Any], *,
                             force: bool = False, overwrite: bool = False, metrics: Any = None,
                             custom_metadata: Any = None) -> bool:
        response = self.save_checkpointables_async(
            step, checkpointables, force=force, overwrite=overwrite, metrics=metrics,
            custom_metadata=custom_metadata)
        return False if response is None else response.result()

    def save_async(self, step: int, state: Any, *, checkpointable_name: str = STATE,
                   force: bool = False, overwrite: bool = False, metrics: Any = None,
                   custom_metadata: Any = None) -> SaveResponse | None:
        return self.save_checkpointables_async(
            step, {checkpointable_name: state}, force=force, overwrite=overwrite,
            metrics=metrics, custom_metadata=custom_metadata)

    def save_checkpointables_async(self, step: int, checkpointables: dict[str, Any], *,
                                   force: bool = False, overwrite: bool = False,
                                   metrics: Any = None, custom_metadata: Any = None
                                   ) -> SaveResponse | None:
        """Starts the save (the device-to-host copy happens here) and returns a
        response, or None when the policy skips the step. A step that exists
        raises StepAlreadyExistsError (a FileExistsError), unless `overwrite`."""
        step = check_step(step, "save")  # True == 1: before `overwrite` deletes a step
        args = _save_args(checkpointables)
        if step in self._manager.all_steps():
            if not overwrite:
                raise StepAlreadyExistsError(
                    f"step {step} already exists in {self.directory}; pass overwrite=True "
                    "or save another step")
            self._manager.delete(step)
        try:
            started = self._manager.save(step, args=args, metrics=metrics, force=force,
                                         custom_metadata=custom_metadata)
        except errors.StepAlreadyExistsError as e:  # the manager's, a ValueError only
            raise StepAlreadyExistsError(str(e)) from e
        return SaveResponse(self._manager, step) if started else None

    def cancel(self, step: Any = None) -> None:
        """Orbax stops the background save; ours lets it finish, then deletes
        `step` (when given and present)."""
        self._manager.wait_until_finished()
        if step is not None and _step_of(step) in self._manager.all_steps():
            self._manager.delete(_step_of(step))

    # ------------------------------------------------------------ load

    def load(self, step: Any = None, abstract_state: Any = None, *,
             checkpointable_name: str = STATE) -> Any:
        """The state saved by `save` (None: the latest step, falling back to an
        older one when its chunks are corrupt)."""
        return self.load_checkpointables(step, {checkpointable_name: abstract_state}
                                         )[checkpointable_name]

    def load_checkpointables(self, step: Any = None,
                             abstract_checkpointables: dict[str, Any] | None = None
                             ) -> dict[str, Any]:
        """The checkpointables named by `abstract_checkpointables` (all when
        None); a None abstract value loads that one as saved."""
        args = None if abstract_checkpointables is None else _restore_args(
            abstract_checkpointables, _partial(self._context))
        want = self._existing(step)
        theirs = self._orbax_step(want)
        if theirs is not None:  # a step Orbax wrote here: its own loader reads it
            return ocp_v1.load_checkpointables(self._path(theirs), abstract_checkpointables)
        try:
            out = self._manager.restore(want, args=args)
        except errors.StepNotFoundError as e:
            raise StepNotFoundError(str(e)) from e
        return _as_dict(out)

    def load_async(self, step: Any = None, abstract_state: Any = None, *,
                   checkpointable_name: str = STATE) -> Done:
        """`load`, done in the call (Orbax's raises NotImplementedError)."""
        return Done(self.load(step, abstract_state, checkpointable_name=checkpointable_name))

    def load_checkpointables_async(self, step: Any = None,
                                   abstract_checkpointables: dict[str, Any] | None = None
                                   ) -> Done:
        """`load_checkpointables`, done in the call (Orbax's raises NotImplementedError)."""
        return Done(self.load_checkpointables(step, abstract_checkpointables))

    # ------------------------------------------------------------ metadata

    def metadata(self, step: Any = None) -> Any:
        """The step's metadata; its `.metadata` is the state's abstract tree
        (the dict of every checkpointable's when there is no state)."""
        md = self.checkpointables_metadata(step)
        items = md.metadata
        return _with_metadata(md, md.step, items[STATE] if STATE in items else items,
                              md.metrics)

    def checkpointables_metadata(self, step: Any = None) -> Any:
        """The step's metadata; its `.metadata` maps each checkpointable to its
        abstract tree."""
        s = self._existing(step)
        s = self._manager.all_steps()[-1] if s is None else s
        if self._orbax_step(s) is not None:
            md = ocp_v1.checkpointables_metadata(self._path(s))
            return _with_metadata(md, s, md.metadata, self._manager.metrics(s))
        sm = self._manager.metadata(s)
        items = _as_dict(sm.item_metadata)
        ns = _nsecs(sm.time)
        return v1.CheckpointMetadata(s, self._path(s), metadata=items, init_timestamp_nsecs=ns,
                                     commit_timestamp_nsecs=ns,
                                     custom_metadata=sm.custom_metadata,
                                     metrics=self._manager.metrics(s))

    def root_metadata(self) -> Any:
        return v1.RootMetadata(directory=self.directory,
                               custom_metadata=self._manager.metadata().custom_metadata)

    # ------------------------------------------------------------ delete, lifecycle

    def delete(self, step: Any, *, checkpointable_name: str | None = None,
               missing_ok: bool = False) -> bool:
        """Deletes the step from every tier; False when it is missing and `missing_ok`."""
        if checkpointable_name is not None:
            raise NotImplementedError(
                f"resilient_ckpt deletes whole steps only (asked: checkpointable "
                f"{checkpointable_name!r} of step {_step_of(step)}); save a new step "
                "without it, then delete this one")
        if missing_ok and _step_of(step) not in self._manager.all_steps():
            return False
        self._existing(step)
        self._manager.delete(_step_of(step))
        return True

    def delete_async(self, step: Any, *, checkpointable_name: str | None = None,
                     missing_ok: bool = False) -> Done:
        """`delete`, done in the call."""
        return Done(self.delete(step, checkpointable_name=checkpointable_name,
                                missing_ok=missing_ok))

    def reload(self) -> None:
        self._manager.reload()

    def is_saving_in_progress(self) -> bool:
        return self._manager.is_saving_in_progress()

    def wait(self) -> None:
        """Waits for every background write; raises their failures."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __contextmanager__(self) -> Iterator[Checkpointer]:
        try:
            yield self
        finally:
            self.close()

    # Orbax's older names, deprecated there (and warned about here) in favour of the short ones.
    save_pytree = _older("save_pytree", "save")
    save_pytree_async = _older("save_pytree_async", "save_async")
    load_pytree = _older("load_pytree", "load")
    load_pytree_async = _older("load_pytree_async", "load_async")
    pytree_metadata = _older("pytree_metadata", "metadata")

def _options(options: Any, tiers: Sequence[TierConfig] | None, save_policy: Any,
             keep_policy: Any, name_format: Any, cleanup: bool) -> CheckpointManagerOptions:
    """Our options from the constructor's: `options` (else Orbax's defaults
    for this class: its save policy, every step kept, no cleanup), then the
    policies, tiers and step naming given beside them."""
    if options is None:
        o = CheckpointManagerOptions(cleanup_tmp_directories=cleanup,
                                     save_decision_policy=_default_save_policy())
    else:
        o = CheckpointManagerOptions.from_any(options)
    # Orbax v1 has no item mode: a step saved as one item loads, and saves go on.
    changes: dict[str, Any] = {"lock_item_mode": False}
    if save_policy is not None:
        changes["save_decision_policy"] = save_policy
    if keep_policy is not None:
        changes["preservation_policy"] = keep_policy
    if tiers is not None:
        changes["tiers"] = tuple(tiers)
    if name_format is not None:
        naming = _naming(name_format)
        changes.update(step_prefix=naming.prefix, step_format_fixed_length=naming.fixed_length)
    return dataclasses.replace(o, **changes)


def _default_save_policy() -> Any:
    """Orbax's default for this class: the first step, then whenever no save
    is running, and on preemption."""
    p = v1.save_decision_policies
    return p.AnySavePolicy([p.InitialSavePolicy(), p.ContinuousCheckpointingPolicy(),
                            p.PreemptionCheckpointingPolicy()])


def _naming(fmt: Any) -> StepNaming:
    """Our step naming for Orbax's `standard_name_format(...)`, read off the
    names it builds; any other NameFormat is refused."""
    name = fmt.build_name(1)
    digits = len(name) - len(name.rstrip("0123456789"))
    head = name[:len(name) - digits]
    naming = StepNaming(head[:-1] or None if head.endswith("_") else None,
                        digits if digits > 1 else None)
    if head not in ("", f"{naming.prefix}_") or any(
            naming.name(s) != fmt.build_name(s) for s in (0, 7, 42, 123456)):
        raise ValueError(f"step_name_format {fmt!r} names step 1 {name!r}: only Orbax's "
                         "standard_name_format(step_prefix=, step_format_fixed_length=) "
                         "is supported")
    return naming


def _save_args(checkpointables: Any) -> Any:
    """One Composite for `checkpointables`: an `ocp.args` object as it is, any
    other value as a pytree (StandardSave), which is what Orbax's handlers
    resolve a JSON-like dict to as well."""
    if not isinstance(checkpointables, dict) or not checkpointables:
        raise ValueError("checkpointables must be a non-empty dict of names to what to "
                         f"save, got {checkpointables!r:.80}")
    items = {}
    for name, value in checkpointables.items():
        if not isinstance(name, str) or name in _RESERVED:
            raise ValueError(f"checkpointable name {name!r} is not allowed: names are "
                             f"non-empty strings other than {sorted(_RESERVED - {''})}")
        if value is None:
            raise ValueError(f"checkpointable {name!r} is None: there is nothing to save")
        if isinstance(value, ocp.args.CheckpointArgs):
            items[name] = value
            continue
        for path, leaf in flatten(value)[0]:
            try:
                leaf_kind(leaf, path)
            except TypeError as e:
                raise errors.UnsupportedArgsError(
                    f"checkpointable {name!r}: {e}. resilient_ckpt saves pytrees and "
                    "ocp.args objects (e.g. ocp.args.JsonSave(data)); Orbax's custom "
                    "CheckpointableHandlers and StatefulCheckpointables are not supported"
                ) from None
        items[name] = ocp.args.StandardSave(value)
    return ocp.args.Composite(**items)


def _restore_args(abstract: Any, partial: bool) -> Any:
    if not isinstance(abstract, dict):
        raise ValueError("abstract_checkpointables must be a dict of checkpointable names "
                         f"to abstract trees (or None), got {type(abstract).__name__}")
    return ocp.args.Composite(**{name: _restore_arg(a, partial) for name, a in abstract.items()})


def _restore_arg(abstract: Any, partial: bool) -> Any:
    if abstract is None or isinstance(abstract, ocp.args.CheckpointArgs):
        return abstract
    if partial:
        return ocp.args.PyTreeRestore(abstract, partial_restore=True)
    return ocp.args.StandardRestore(abstract)


def _partial(context: Any) -> bool:
    """Whether the Orbax Context given to the constructor allows partial loads."""
    loading = getattr(getattr(context, "pytree", None), "loading", None)
    return bool(getattr(loading, "partial_load", False))


def _with_metadata(md: Any, step: int, metadata: Any, metrics: Any) -> Any:
    """Orbax's CheckpointMetadata `md` (of a step or of a path) as `step`'s,
    with `metadata` and `metrics`."""
    return v1.CheckpointMetadata(
        step, md.path, metadata=metadata, init_timestamp_nsecs=md.init_timestamp_nsecs,
        commit_timestamp_nsecs=md.commit_timestamp_nsecs, custom_metadata=md.custom_metadata,
        metrics=metrics)


def _as_dict(out: Any) -> dict[str, Any]:
    """A restore's or a metadata's items by name (a step our manager saved
    without a Composite has one, `default`)."""
    return dict(out.items()) if isinstance(out, ocp.args.Composite) else {DEFAULT_ITEM: out}


def _step_of(step: Any) -> int:
    """A step number (`layout.check_step`), or the `.step` of Orbax's CheckpointMetadata."""
    return check_step(getattr(step, "step", step))


def _nsecs(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)
