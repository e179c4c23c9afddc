"""The elastic loop: survive lost devices in-process, and scale back up.

This module owns what happens between "a step raised" and "the next step
completed": classifying the failure (`is_recoverable`), checking which devices
still compute (`HealthCheck`), choosing the mesh to go on with
(`shrink_data_axis`), restoring the last viable step onto it through the
`CheckpointManager`, re-entering the user's training function, and the record
of each event (`RecoveryEvent`, `format_timeline`).

The user's loop stays a plain loop inside one function that takes the mesh:

    el = Elastic(mngr, mesh)

    @el.run                                   # called again after each recovery
    def train(mesh):
        step_fn, abstract, init = build(mesh) # shardings and jit for this mesh
        state, start = el.restore(abstract, init)
        for step in range(start + 1, total + 1):
            state, loss = step_fn(state, step)
            el.save(step, state)              # saves when due; may scale up here
        return state

A recoverable failure unwinds `train`; `run` records it, health-checks the
devices, drops arrays on the lost ones and the compiled caches, builds the
smaller mesh and calls `train(mesh)` again, whose `el.restore` now restores the
newest viable step (RAM tier first) onto it. Anything else is re-raised at once.
When lost devices pass the health check again, `el.save` interrupts the loop at
the next save point and training resumes on the larger mesh from that very
step (resharded from the live state: no step is lost). The loop is for one
controller driving every device (Pathways, or one process with many devices);
the classifier also knows multi-controller failures.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable, Collection, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from .errors import RecoveryFailedError

log = logging.getLogger("resilient_ckpt.elastic")

# The Pathways slice-down family (pathwaysutils/elastic/elastic.py): DATA_LOSS for
# sure; the others may or may not be a lost slice, and are treated as one with a
# warning. Used only when pathwaysutils is not installed; otherwise it decides.
_SLICE_DOWN = ("DATA_LOSS",)
_MAYBE_SLICE_DOWN = ("DEADLINE_EXCEEDED", "NOT_FOUND", "INTERNAL")
# Gloo (the CPU collectives of multi-controller JAX) reports a dead peer as
# "UNKNOWN: Gloo all-reduce failed ... Connection closed by peer".
_GLOO_PEER_LOSS = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused",
                   "Timed out", "timed out")


# ------------------------------------------------------------------ classification

def is_recoverable(exc: BaseException) -> bool:
    """True when `exc` means devices or hosts were lost, so recovering onto the
    devices that are left makes sense; False for anything else (a bug: re-raise).

    Recoverable: a `jax.errors.JaxRuntimeError` of the Pathways slice-down family
    (its text has DATA_LOSS; or DEADLINE_EXCEEDED, NOT_FOUND, INTERNAL, with a
    warning), decided by pathwaysutils' `is_error_due_to_slice_down` where it is
    installed; the device loss injected by `resilient_ckpt.testing.faults` (a
    DATA_LOSS error); a multi-controller `ProcessFailureError`
    (`jax.experimental.multihost_utils.live_devices`); a gloo collective that
    lost its peer. Only `exc` itself is looked at, not its cause or context.
    """
    if _is_process_failure(exc):
        return True
    if not isinstance(exc, jax.errors.JaxRuntimeError):
        return False
    text = str(exc)
    if "Gloo" in text and any(p in text for p in _GLOO_PEER_LOSS):
        return True
    pathways = _pathways_rule()
    if pathways is not None:
        return bool(pathways(exc, log_traceback=False))
    if any(k in text for k in _SLICE_DOWN):
        return True
    if any(k in text for k in _MAYBE_SLICE_DOWN):
        log.warning("treating %s as a lost device (it may also be a bug): %s",
                    type(exc).__name__, _first_line(text))
        return True
    return False


@functools.cache
def _pathways_rule() -> Callable[..., bool] | None:
    """pathwaysutils' slice-down test, or None where it is not installed."""
    try:
        from pathwaysutils.elastic import elastic as pathways_elastic
        return pathways_elastic.is_error_due_to_slice_down
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        log.debug("pathwaysutils not usable (%s); using the built-in slice-down rule", e)
        return None


def _is_process_failure(exc: BaseException) -> bool:
    try:
        from jax.experimental.multihost_utils import ProcessFailureError
    except ImportError:  # an older jax without live_devices
        return False
    return isinstance(exc, ProcessFailureError)


def _first_line(text: str, limit: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {_first_line(str(exc))}"


# ------------------------------------------------------------------ policy

@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How hard the loop tries before it gives up with RecoveryFailedError.

    `max_attempts`: recoveries in a row without a completed step in between (a
    completed step after a recovery starts a new count). `max_wait_s`: total
    time one failure may spend waiting for enough healthy devices, polling every
    `poll_s`. `health_timeout_s`: how long a health check waits for a device's
    answer. `min_devices`: the smallest mesh worth training on.
    """

    max_attempts: int = 3
    max_wait_s: float = 300.0
    poll_s: float = 1.0
    health_timeout_s: float = 10.0
    min_devices: int = 1

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_wait_s < 0 or self.poll_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("max_wait_s must be >= 0, poll_s and health_timeout_s > 0")
        if self.min_devices < 1:
            raise ValueError(f"min_devices must be at least 1, got {self.min_devices}")


# ------------------------------------------------------------------ health

def _plus_one(x):
    return x + 1


class HealthCheck:
    """Runs `x + 1` on each device, each in its own thread, with a timeout.

    The tiny program is compiled once per device, ahead of time, and held here,
    so the check stays a few milliseconds even right after `jax.clear_caches()`
    (a fresh jit per device costs ~70 ms each on these CPUs). `prepare` compiles
    for devices up front, off the recovery path. A device is healthy when its
    answer is right within the timeout; `last_errors` says why the others are not.
    """

    def __init__(self):
        self._compiled: dict[jax.Device, Any] = {}
        self._lock = threading.Lock()
        self.last_errors: dict[int, str] = {}

    def prepare(self, devices: Collection[jax.Device]) -> None:
        for d in devices:
            self._executable(d)

    def _executable(self, device: jax.Device) -> Any:
        with self._lock:
            exe = self._compiled.get(device)
        if exe is None:
            spec = jax.ShapeDtypeStruct((), np.int32,
                                        sharding=jax.sharding.SingleDeviceSharding(device))
            exe = jax.jit(_plus_one).lower(spec).compile()
            with self._lock:
                self._compiled[device] = exe
        return exe

    def probe(self, device: jax.Device) -> None:
        """Raises unless `device` computes 41 + 1 correctly."""
        out = int(self._executable(device)(jax.device_put(np.int32(41), device)))
        if out != 42:
            raise RuntimeError(f"device {device.id} computed 41 + 1 = {out}")

    def __call__(self, devices: Collection[jax.Device], timeout_s: float) -> frozenset:
        devices = list(devices)
        errors: dict[int, str] = {}
        ok: set = set()

        def run(d: jax.Device) -> None:
            try:
                self.probe(d)
                ok.add(d)
            except Exception as e:  # noqa: BLE001 - any failure makes the device unhealthy
                errors[d.id] = _describe(e)

        threads = [threading.Thread(target=run, args=(d,), daemon=True,
                                    name=f"rc-health-{d.id}") for d in devices]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        healthy = frozenset(d for d in devices if d in ok)
        for d in devices:
            if d not in healthy and d.id not in errors:
                errors[d.id] = f"no answer within {timeout_s:g} s"
        self.last_errors = dict(errors)
        return healthy


# ------------------------------------------------------------------ the mesh

def shrink_data_axis(healthy: Collection[jax.Device], mesh: Mesh,
                     data_axis: str = "data") -> Mesh | None:
    """The default mesh policy: keep every other axis whole and shrink `data_axis`.

    Keeps the rows along `data_axis` (model-parallel groups, as laid out in
    `mesh`) whose devices are all healthy, as many as the largest divisor of the
    original data size allows (so a global batch that divided the old data axis
    divides the new one), in their original order. None when no row is whole.
    """
    axis = mesh.axis_names.index(data_axis)
    rows = np.moveaxis(mesh.devices, axis, 0)
    whole = [i for i in range(rows.shape[0]) if all(d in healthy for d in rows[i].flat)]
    size = rows.shape[0]
    n = max((k for k in range(1, len(whole) + 1) if size % k == 0), default=0)
    if n == 0:
        return None
    return Mesh(np.moveaxis(rows[whole[:n]], 0, axis), mesh.axis_names)


def _mesh_ids(mesh: Mesh | None) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in mesh.devices.flat)) if mesh is not None else ()


def _mesh_shape(mesh: Mesh | None) -> dict:
    return dict(mesh.shape) if mesh is not None else {}


# ------------------------------------------------------------------ records

@dataclasses.dataclass
class RecoveryEvent:
    """One failure (or one scale-up) and what the loop did about it.

    Times are seconds: `detect_s` from the fault (its `fault_time` when the
    exception carries one, as injected faults do; otherwise the end of the last
    completed step, an upper bound) to the exception reaching the loop;
    `health_s` the health checks (and any waiting for devices); `restore_s`
    choosing and restoring the step; `resume_s` from the restore to the first
    completed step (re-jit and compile included); `total_s` from the fault to
    that step. `steps_lost`: completed steps that must be recomputed.
    """

    kind: str                      # "failure" or "scale_up"
    step: int                      # the step that failed / the save step of a scale-up
    error: str = ""
    devices_before: tuple = ()
    devices_after: tuple = ()
    lost_devices: tuple = ()       # unhealthy at the check (failure)
    mesh_after: dict = dataclasses.field(default_factory=dict)
    restored_step: int | None = None
    restored_from: dict = dataclasses.field(default_factory=dict)  # tier -> bytes
    first_step: int | None = None
    steps_lost: int | None = None
    detect_s: float | None = None
    health_s: float | None = None
    restore_s: float | None = None
    resume_s: float | None = None
    total_s: float | None = None
    attempt: int = 1
    outcome: str = "in progress"   # "resumed", "failed again: ...", "gave up: ..."

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """One line saying what happened, for logs and error messages."""
        where = f"step {self.step}"
        if self.kind == "scale_up":
            what = (f"scale-up at save {where}: {len(self.devices_before)} -> "
                    f"{len(self.devices_after)} devices")
        else:
            what = (f"attempt {self.attempt}, {where} failed ({self.error}); "
                    f"{len(self.devices_before) - len(self.lost_devices)}/"
                    f"{len(self.devices_before)} devices healthy")
            if self.lost_devices:
                what += f", lost {list(self.lost_devices)}"
            if self.mesh_after:
                what += f"; mesh {_shape_str(self.mesh_after)}"
        if self.restored_step is not None:
            what += f"; restored step {self.restored_step} from {_tiers_str(self.restored_from)}"
        return f"{what}; {self.outcome}"


def _shape_str(shape: dict) -> str:
    return "x".join(f"{k}={v}" for k, v in shape.items()) or "-"


def _tiers_str(by_tier: dict) -> str:
    total = sum(by_tier.values())
    if not total:
        return "-"
    return ", ".join(f"{t} {100 * b / total:.0f}%" for t, b in by_tier.items())


def format_timeline(events: Sequence[RecoveryEvent]) -> str:
    """The events as a table (one row each), for a log or a terminal."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    head = ("#", "event", "step", "devices", "mesh after", "detect ms", "health ms",
            "restore ms", "restored (tiers)", "resume ms", "total ms", "lost", "outcome")
    rows = [head]
    for i, e in enumerate(events, 1):
        restored = ("-" if e.restored_step is None
                    else f"{e.restored_step} ({_tiers_str(e.restored_from)})")
        rows.append((str(i), e.kind, str(e.step),
                     f"{len(e.devices_before)}->{len(e.devices_after) or '?'}",
                     _shape_str(e.mesh_after), ms(e.detect_s), ms(e.health_s),
                     ms(e.restore_s), restored, ms(e.resume_s), ms(e.total_s),
                     "-" if e.steps_lost is None else str(e.steps_lost),
                     _first_line(e.outcome, 40)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# ------------------------------------------------------------------ the loop

class _Rescale(Exception):
    """Unwinds the training function at a save point to go on with more devices.
    An Exception (not BaseException), so do not swallow it in the loop body."""


class Elastic:
    """Runs a training function on the healthy part of `mesh`, re-entering it
    after each recoverable failure and after each scale-up.

    `manager`: the CheckpointManager to save to and restore from. `mesh`: the
    full mesh. `choose_mesh(healthy_devices, full_mesh) -> Mesh | None` decides
    the mesh to go on with (default `shrink_data_axis` on `data_axis`; None means
    "not enough devices yet: wait"). `health_check(devices, timeout_s) -> healthy
    devices` (default a `HealthCheck`). Lost devices are re-checked at save
    points every `rescale_every_s` seconds, or at the next save point after
    `request_rescale()` (safe to call from a signal handler). `clear_caches`:
    drop jax's compiled caches after a failure, as pathwaysutils does.
    """

    def __init__(self, manager: Any, mesh: Mesh, *, data_axis: str = "data",
                 retry: RetryPolicy = RetryPolicy(),
                 choose_mesh: Callable[[Collection[jax.Device], Mesh], Mesh | None] | None = None,
                 health_check: Callable[[Collection[jax.Device], float], Collection] | None = None,
                 rescale_every_s: float = 60.0, clear_caches: bool = True):
        if data_axis not in mesh.axis_names:
            raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh "
                             f"{dict(mesh.shape)}; pass data_axis= one of {mesh.axis_names}")
        self.manager = manager
        self.full_mesh = mesh
        self.mesh = mesh
        self.retry = retry
        self.timeline: list[RecoveryEvent] = []
        self._choose = choose_mesh or functools.partial(shrink_data_axis, data_axis=data_axis)
        if health_check is None:
            health_check = HealthCheck()
        if isinstance(health_check, HealthCheck):
            health_check.prepare(list(mesh.devices.flat))  # compile now, not when recovering
        self._health = health_check
        self._rescale_every_s = rescale_every_s
        self._clear_caches = clear_caches
        self._rescale_requested = False
        self._last_rescale_check = time.monotonic()
        self._done: int | None = None       # the last completed step
        self._mark = time.perf_counter()    # when it completed (or was restored)
        self._pending: RecoveryEvent | None = None
        self._t_fault = self._t_restored = 0.0
        self._episode: list[RecoveryEvent] = []
        self._waited = 0.0
        self._stash: tuple[int, Any] | None = None
        _pathways_rule()  # import pathwaysutils now, not on the recovery path

    # -------------------------------------------------------------- public

    def run(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator: `fn(mesh, *args, **kwargs)` is called with the mesh to use,
        again after each recovery or scale-up; returns what `fn` returns."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            while True:
                try:
                    return fn(self.mesh, *args, **kwargs)
                except _Rescale:
                    continue
                except Exception as e:  # noqa: BLE001 - classified, and re-raised unless recoverable
                    if not is_recoverable(e):
                        raise
                    self._recover(e)
        return wrapper

    def restore(self, abstract: Any = None, init: Callable[[], Any] | None = None, *,
                init_step: int = 0, args: Any = None) -> tuple[Any, int]:
        """The state to (re)start from and its step, on the current mesh.

        After a failure: the newest viable step, restored by the manager onto
        `abstract` (jax.ShapeDtypeStruct leaves with shardings on the mesh `fn`
        was given), RAM tier first. After a scale-up: the state of the save
        step, resharded from the live arrays. On a first call: the newest viable
        step if there is one (a relaunched job resumes), else `init()` at
        `init_step`. `args` replaces `abstract` with an Orbax restore args object.
        """
        if abstract is None and args is None:
            raise ValueError("Elastic.restore needs the abstract state for the current mesh "
                             "(jax.ShapeDtypeStruct leaves with shardings on el.mesh) or args=")
        self._check_on_mesh(abstract)
        ev, t0 = self._pending, time.perf_counter()
        if ev is not None and ev.kind == "scale_up" and self._stash is not None:
            step, live = self._stash
            self._stash = None
            state, tiers = self._reshard(live, abstract, args, step)
        elif self.manager.latest_step() is None:
            if ev is not None and ev.kind == "failure":
                log.warning("no viable step to restore after the failure at step %d; "
                            "starting again from init()", ev.step)
            if init is None:
                raise ValueError(f"nothing to restore in {self.manager.directory} and no "
                                 "init given: pass init= to Elastic.restore")
            state, step, tiers = init(), init_step, {}
        else:
            state = self.manager.restore(None, args=args if args is not None
                                         else _standard_restore(abstract))
            rec = self.manager.last_restore
            step, tiers = rec.step, dict(rec.bytes_by_tier)
        now = time.perf_counter()
        if ev is not None:
            ev.restored_step, ev.restored_from = step, tiers
            ev.restore_s = now - t0
            self._t_restored = now
            if ev.kind == "failure":
                ev.steps_lost = (self._done - step) if self._done is not None else None
        self._done, self._mark = step, now
        return state, step

    def save(self, step: int, state: Any = None, *, args: Any = None, **save_kwargs: Any) -> bool:
        """Call after every completed step: `manager.save` (which saves only when
        a tier is due), the end of a pending recovery, and, at a save point,
        the scale-up check. Returns whether the manager saved."""
        if self._pending is not None:
            self._finish(step, state)
        if args is None:
            if state is None:
                raise ValueError("Elastic.save needs the state (or args=)")
            args = _standard_save(state)
        saved = self.manager.save(step, args=args, **save_kwargs)
        self._done, self._mark = step, time.perf_counter()
        if saved and self._rescale_due():
            self._maybe_scale_up(step, state)
        return saved

    def request_rescale(self) -> None:
        """Check the lost devices at the next save point (signal-handler safe)."""
        self._rescale_requested = True

    @property
    def events(self) -> list[dict]:
        """The timeline as plain dicts, ready for a JSON log."""
        return [e.to_dict() for e in self.timeline]

    # -------------------------------------------------------------- recovery

    def _recover(self, exc: Exception) -> None:
        t_detect = time.perf_counter()
        fault_time = getattr(exc, "fault_time", None)
        if self._pending is not None:
            self._pending.outcome = f"failed again: {_describe(exc)}"
        self._stash = None
        self._t_fault = fault_time if isinstance(fault_time, float) else self._mark
        ev = RecoveryEvent("failure", (self._done + 1) if self._done is not None else 0,
                           error=_describe(exc), devices_before=_mesh_ids(self.mesh),
                           detect_s=max(0.0, t_detect - self._t_fault),
                           attempt=len(self._episode) + 1)
        self.timeline.append(ev)
        self._pending = ev
        log.warning("elastic: step %d failed with %s; recovering", ev.step, ev.error)
        if len(self._episode) >= self.retry.max_attempts:
            self._give_up(ev, f"{self.retry.max_attempts} attempts without a completed step")
        self._episode.append(ev)
        mesh = self._wait_for_mesh(ev)
        self._drop_arrays(set(self.full_mesh.devices.flat) - set(mesh.devices.flat))
        ev.health_s = time.perf_counter() - t_detect
        self.mesh = mesh
        ev.devices_after, ev.mesh_after = _mesh_ids(mesh), _mesh_shape(mesh)
        log.warning("elastic: going on with %d devices, mesh %s", mesh.size,
                    _shape_str(ev.mesh_after))
        # The traceback holds the failed attempt's frames and, through them, its
        # arrays: release them before the next attempt restores a new copy.
        exc.__traceback__ = None

    def _wait_for_mesh(self, ev: RecoveryEvent) -> Mesh:
        """Health-checks every device of the full mesh until `choose_mesh` gives
        a large enough mesh, within the policy's total waiting time."""
        every = list(self.full_mesh.devices.flat)
        t0 = time.perf_counter()
        while True:
            healthy = frozenset(self._health(every, self.retry.health_timeout_s))
            ev.lost_devices = tuple(sorted(d.id for d in every if d not in healthy))
            mesh = self._choose(healthy, self.full_mesh)
            if mesh is not None and mesh.size >= self.retry.min_devices:
                self._waited += time.perf_counter() - t0
                return mesh
            waited = self._waited + time.perf_counter() - t0
            if waited + self.retry.poll_s > self.retry.max_wait_s:
                self._waited = waited
                errors = getattr(self._health, "last_errors", None)
                self._give_up(ev, f"waited {waited:.1f} s (max_wait_s="
                              f"{self.retry.max_wait_s:g}) for a mesh of at least "
                              f"{self.retry.min_devices} devices; healthy: "
                              f"{sorted(d.id for d in healthy)}"
                              + (f"; health check errors: {errors}" if errors else ""))
            time.sleep(self.retry.poll_s)

    def _drop_arrays(self, lost: set) -> None:
        """Deletes every live array with a buffer on a lost device, then (by
        default) jax's compiled caches, whose executables may name those devices."""
        if lost:
            for a in jax.live_arrays():
                try:
                    if not a.is_deleted() and not lost.isdisjoint(a.devices()):
                        a.delete()
                except Exception as e:  # noqa: BLE001 - a dead buffer may refuse even this
                    log.debug("could not delete a live array on a lost device: %s", e)
        if self._clear_caches:
            jax.clear_caches()

    def _give_up(self, ev: RecoveryEvent, why: str) -> None:
        ev.outcome = f"gave up: {why}"
        episode = self._episode if ev in self._episode else self._episode + [ev]
        attempts = "\n".join(f"  {e.summary()}" for e in episode)
        latest = self.manager.latest_step()
        self._pending = None
        raise RecoveryFailedError(
            f"elastic recovery gave up after the failure at step {ev.step}: {why}.\n"
            f"Attempts:\n{attempts}\n"
            f"The newest viable checkpoint is step {latest} in {self.manager.directory}. "
            "Check the devices (the health check errors above), then relaunch the job, "
            "which resumes from that step; or allow more with RetryPolicy(max_attempts=, "
            "max_wait_s=).")

    def _finish(self, step: int, state: Any) -> None:
        """The first step completed after a recovery or scale-up: close its record."""
        ev = self._pending
        if state is not None:
            jax.block_until_ready(state)
        now = time.perf_counter()
        ev.first_step = step
        ev.resume_s = now - self._t_restored
        ev.total_s = now - self._t_fault
        ev.outcome = "resumed"
        self._pending = None
        self._episode, self._waited = [], 0.0
        log.warning("elastic: %s", ev.summary())

    # -------------------------------------------------------------- scale-up

    def _rescale_due(self) -> bool:
        if self.mesh.size >= self.full_mesh.size:
            return False
        if self._rescale_requested:
            return True
        return time.monotonic() - self._last_rescale_check >= self._rescale_every_s

    def _maybe_scale_up(self, step: int, state: Any) -> None:
        self._rescale_requested = False
        self._last_rescale_check = time.monotonic()
        t0 = time.perf_counter()
        current = set(self.mesh.devices.flat)
        missing = [d for d in self.full_mesh.devices.flat if d not in current]
        back = frozenset(self._health(missing, self.retry.health_timeout_s))
        if not back:
            return
        mesh = self._choose(current | back, self.full_mesh)
        if mesh is None or mesh.size <= self.mesh.size:
            return
        ev = RecoveryEvent("scale_up", step, devices_before=_mesh_ids(self.mesh),
                           devices_after=_mesh_ids(mesh), mesh_after=_mesh_shape(mesh),
                           detect_s=0.0, health_s=time.perf_counter() - t0)
        self.timeline.append(ev)
        self._pending, self._t_fault = ev, t0
        self._stash = (step, state) if state is not None else None
        self.mesh = mesh
        log.warning("elastic: devices %s are back; going on with %d devices from step %d",
                    sorted(d.id for d in back), mesh.size, step)
        raise _Rescale()

    def _reshard(self, live: Any, abstract: Any, args: Any, step: int) -> tuple[Any, dict]:
        """The live state of the save step, moved onto the new shardings; the
        manager's copy of that step if the live tree does not fit `abstract`."""
        if abstract is not None:
            try:
                state = jax.tree.map(_put_like, live, abstract)
                jax.block_until_ready(state)
                nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
                return state, {"live": nbytes}
            except (ValueError, TypeError) as e:
                log.warning("scale-up: the live state does not match the restore target "
                            "(%s); restoring step %d from the manager", e, step)
        state = self.manager.restore(step, args=args if args is not None
                                     else _standard_restore(abstract))
        return state, dict(self.manager.last_restore.bytes_by_tier)

    def _check_on_mesh(self, abstract: Any) -> None:
        allowed = set(self.mesh.devices.flat)
        for leaf in jax.tree.leaves(abstract):
            s = getattr(leaf, "sharding", None)
            if s is not None and not set(s.device_set) <= allowed:
                raise ValueError(
                    f"the restore target has a leaf sharded over devices "
                    f"{sorted(d.id for d in s.device_set)}, outside the current mesh "
                    f"{_mesh_ids(self.mesh)}; build its shardings from the mesh your "
                    "function was called with")


def _put_like(x: Any, target: Any) -> Any:
    sharding = getattr(target, "sharding", None)
    if isinstance(x, jax.Array) and sharding is not None:
        return jax.device_put(x, sharding)
    return x


def _standard_save(state: Any) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.StandardSave(state)


def _standard_restore(abstract: Any) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.StandardRestore(abstract)
