"""The elastic loop: survive lost devices in-process, and scale back up.

This module owns what happens between "a step raised" and "the next step
completed": with the verdict and the health check of `failures`, it chooses
the mesh to go on with (`shrink_data_axis`), restores the last viable step onto
it through the `CheckpointManager`, re-enters the user's training function,
builds programs for likely meshes ahead of time, grows the mesh back, and
keeps the record of each event (`RecoveryEvent`, `format_timeline`).

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

import concurrent.futures as cf
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
from .failures import HealthCheck, describe_error, first_line, is_recoverable, warm_up

log = logging.getLogger("resilient_ckpt.elastic")


# ------------------------------------------------------------------ policy

@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
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
    `health_s` the health checks (and any waiting for devices), dropping the
    lost arrays and caches; `rebuild_s` from then to the call of `restore`
    (the function's own set-up: jit, or waiting for a program being built
    ahead); `restore_s` choosing and restoring the step; `resume_s` from the
    restore to the first completed step (a compile, if the step is not
    compiled yet); `total_s` from the fault to that step. `steps_lost`: completed steps that must be recomputed.
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
    rebuild_s: float | None = None
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
                    f"unhealthy devices {list(self.lost_devices)}")
            if self.mesh_after:
                what += (f"; mesh {_shape_str(self.mesh_after)} "
                         f"({len(self.devices_after)} devices)")
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
            "rebuild ms", "restore ms", "restored (tiers)", "resume ms", "total ms", "lost",
            "outcome")
    rows = [head]
    for i, e in enumerate(events, 1):
        restored = ("-" if e.restored_step is None
                    else f"{e.restored_step} ({_tiers_str(e.restored_from)})")
        rows.append((str(i), e.kind, str(e.step),
                     f"{len(e.devices_before)}->{len(e.devices_after) or '?'}",
                     _shape_str(e.mesh_after), ms(e.detect_s), ms(e.health_s),
                     ms(e.rebuild_s), ms(e.restore_s), restored, ms(e.resume_s), ms(e.total_s),
                     "-" if e.steps_lost is None else str(e.steps_lost),
                     first_line(e.outcome, 40)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


# ------------------------------------------------------------------ programs

def _mesh_key(mesh: Mesh) -> tuple:
    return (tuple(mesh.axis_names), mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))


class _Programs:
    """What `build(mesh)` returned, per mesh; built ahead of time in a
    background thread where asked, so the compile leaves the recovery path."""

    def __init__(self, build: Callable[[Mesh], Any]):
        self._build = build
        self._lock = threading.Lock()
        self._futures: dict[tuple, cf.Future] = {}

    def start(self, meshes: Sequence[Mesh]) -> None:
        """Builds, one after the other in a background thread, those not yet
        built. Not a daemon: interpreter exit waits for a compile in flight
        rather than killing it inside XLA."""
        todo = []
        with self._lock:
            for m in meshes:
                if _mesh_key(m) not in self._futures:
                    self._futures[_mesh_key(m)] = fut = cf.Future()
                    todo.append((m, fut))
        if not todo:
            return

        def work() -> None:
            for m, fut in todo:
                t0 = time.perf_counter()
                try:
                    fut.set_result(self._build(m))
                    log.info("elastic: built the program for mesh %s ahead of time in %.2f s",
                             dict(m.shape), time.perf_counter() - t0)
                except BaseException as e:  # noqa: BLE001 - handed to whoever asks for it
                    fut.set_exception(e)
        threading.Thread(target=work, name="rc-precompile").start()

    def done(self, mesh: Mesh) -> bool:
        """Not being built: built, failed (then `get` builds again, and raises,
        in the caller's thread), or never asked for."""
        with self._lock:
            fut = self._futures.get(_mesh_key(mesh))
        return fut is None or fut.done()

    def get(self, mesh: Mesh) -> Any:
        """The program for `mesh`: waits for one being built, else builds it now."""
        key = _mesh_key(mesh)
        with self._lock:
            fut = self._futures.get(key)
        if fut is not None:
            try:
                return fut.result()
            except Exception as e:  # noqa: BLE001 - build again in this thread, and raise here
                log.warning("elastic: building ahead for mesh %s failed (%s); building again",
                            dict(mesh.shape), describe_error(e))
        program = self._build(mesh)
        done: cf.Future = cf.Future()
        done.set_result(program)
        with self._lock:
            self._futures[key] = done
        return program

    def drop(self, lost_ids: Collection[int]) -> None:
        """Forgets the programs of meshes with a lost device (their executables
        name it), as jax.clear_caches() does for jit's own cache."""
        lost = set(lost_ids)
        with self._lock:
            for key in [k for k in self._futures if lost.intersection(k[2])]:
                del self._futures[key]


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
    devices` (default a `HealthCheck`). Devices missing from the mesh are
    re-checked every `rescale_every_s` seconds, or at the next step after
    `request_rescale()` (safe to call from a signal handler). `clear_caches`:
    drop jax's compiled caches after a failure, as pathwaysutils does.

    `build(mesh)`, optional, makes what the function needs for a mesh (e.g. the
    AOT-compiled step, `jax.jit(f).lower(abstract).compile()`, and the abstract
    state); `program(mesh)` returns it, cached per mesh. With it the loop
    builds ahead of time, in a background thread, the programs for the
    `precompile` likeliest smaller meshes (each one data row lost) once the
    first step is done, and for a larger mesh as soon as lost devices are back
    (scaling up at the first save point after it is built, or after
    `grow_wait_s`, whichever comes first), so no compile sits on the recovery
    path. `build` must not depend on anything but the mesh.
    """

    def __init__(self, manager: Any, mesh: Mesh, *, data_axis: str = "data",
                 retry: RecoveryPolicy = RecoveryPolicy(),
                 choose_mesh: Callable[[Collection[jax.Device], Mesh], Mesh | None] | None = None,
                 health_check: Callable[[Collection[jax.Device], float], Collection] | None = None,
                 rescale_every_s: float = 60.0, clear_caches: bool = True,
                 build: Callable[[Mesh], Any] | None = None, precompile: int = 1,
                 grow_wait_s: float = 120.0):
        if data_axis not in mesh.axis_names:
            raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh "
                             f"{dict(mesh.shape)}; pass data_axis= one of {mesh.axis_names}")
        self.manager = manager
        self.full_mesh = mesh
        self.mesh = mesh
        self.retry = retry
        self.timeline: list[RecoveryEvent] = []
        self._data_axis = data_axis
        self._choose = choose_mesh or functools.partial(shrink_data_axis, data_axis=data_axis)
        self._programs = _Programs(build) if build is not None else None
        self._precompile = precompile
        self._precompile_started = precompile <= 0
        self._grow_to: Mesh | None = None   # a larger mesh whose program is being built
        self._grow_since = 0.0
        self._grow_wait_s = grow_wait_s
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
        self._t_fault = self._t_ready = self._t_restored = 0.0
        self._episode: list[RecoveryEvent] = []
        self._waited = 0.0
        self._stash: tuple[int, Any] | None = None
        warm_up()

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

    def program(self, mesh: Mesh | None = None) -> Any:
        """What `build(mesh)` returns for `mesh` (default: the current mesh),
        built once per mesh; waits for it if it is being built ahead of time."""
        if self._programs is None:
            raise ValueError("Elastic.program needs Elastic(..., build=fn), fn(mesh) making "
                             "the step and abstract state for a mesh")
        return self._programs.get(mesh if mesh is not None else self.mesh)

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
        if ev is not None:
            ev.rebuild_s = t0 - self._t_ready
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
            ev.steps_lost = (self._done - step) if self._done is not None else None
        self._done, self._mark = step, now
        return state, step

    def save(self, step: int, state: Any = None, *, args: Any = None, **save_kwargs: Any) -> bool:
        """Call after every completed step: `manager.save` (which saves only when
        a tier is due), the end of a pending recovery, the check for returned
        devices (when `rescale_every_s` has passed or `request_rescale()` was
        called) and the scale-up: at the first save point after they are back
        (with `build`, the first one at which the larger mesh's program is
        built, so training goes on while it compiles, or after `grow_wait_s`).
        Returns whether the manager saved."""
        if self._pending is not None:
            self._finish(step, state)
        if args is None:
            if state is None:
                raise ValueError("Elastic.save needs the state (or args=)")
            args = _standard_save(state)
        saved = self.manager.save(step, args=args, **save_kwargs)
        self._done, self._mark = step, time.perf_counter()
        if self._programs is not None and not self._precompile_started:
            self._precompile_started = True
            self._programs.start(self._likely_meshes(self._precompile))
        just_checked = self._grow_to is None and self._rescale_due()
        if just_checked:
            self._look_for_devices()
        if saved and self._grow_to is not None and (
                self._programs is None or self._programs.done(self._grow_to)
                or time.monotonic() - self._grow_since >= self._grow_wait_s):
            self._scale_up(step, state, recheck=not just_checked)
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
            self._pending.outcome = f"failed again: {describe_error(exc)}"
        self._stash = None
        self._t_fault = fault_time if isinstance(fault_time, float) else self._mark
        ev = RecoveryEvent("failure", (self._done + 1) if self._done is not None else 0,
                           error=describe_error(exc), devices_before=_mesh_ids(self.mesh),
                           detect_s=max(0.0, t_detect - self._t_fault),
                           attempt=len(self._episode) + 1)
        self.timeline.append(ev)
        self._pending = ev
        log.warning("elastic: step %d failed with %s; recovering", ev.step, ev.error)
        if len(self._episode) >= self.retry.max_attempts:
            self._give_up(ev, f"{self.retry.max_attempts} attempts without a completed step")
        self._episode.append(ev)
        mesh = self._wait_for_mesh(ev)
        lost = set(self.full_mesh.devices.flat) - set(mesh.devices.flat)
        self._drop_arrays(lost)
        if self._programs is not None:
            self._programs.drop(d.id for d in lost)
        self._grow_to = None
        ev.health_s = time.perf_counter() - t_detect
        self.mesh = mesh
        ev.devices_after, ev.mesh_after = _mesh_ids(mesh), _mesh_shape(mesh)
        log.warning("elastic: going on with %d devices, mesh %s", mesh.size,
                    _shape_str(ev.mesh_after))
        # The traceback holds the failed attempt's frames and, through them, its
        # arrays: release them before the next attempt restores a new copy.
        exc.__traceback__ = None
        self._t_ready = time.perf_counter()

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
                # A HealthCheck, or a bound method of an object that keeps last_errors.
                errors = getattr(getattr(self._health, "__self__", self._health),
                                 "last_errors", None)
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
            "which resumes from that step; or allow more with RecoveryPolicy(max_attempts=, "
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

    def _look_for_devices(self) -> None:
        """Health-checks the devices missing from the mesh; when enough are back
        for a larger mesh, remembers it (and starts building its program)."""
        self._rescale_requested = False
        self._last_rescale_check = time.monotonic()
        current = set(self.mesh.devices.flat)
        missing = [d for d in self.full_mesh.devices.flat if d not in current]
        back = frozenset(self._health(missing, self.retry.health_timeout_s))
        mesh = self._choose(current | back, self.full_mesh) if back else None
        if mesh is None or mesh.size <= self.mesh.size:
            return
        self._grow_to, self._grow_since = mesh, time.monotonic()
        log.warning("elastic: devices %s are back; growing to %d devices at the next save "
                    "point", sorted(d.id for d in back), mesh.size)
        if self._programs is not None:
            self._programs.start([mesh])  # compiles while training goes on

    def _scale_up(self, step: int, state: Any, recheck: bool) -> None:
        """At a save point: re-checks the returning devices (unless they were
        checked on this very step), then unwinds the training function to go on
        from this step on the larger mesh."""
        mesh, self._grow_to = self._grow_to, None
        t0 = time.perf_counter()
        new = [d for d in mesh.devices.flat if d not in set(self.mesh.devices.flat)]
        if recheck and set(self._health(new, self.retry.health_timeout_s)) != set(new):
            log.warning("elastic: devices %s failed their health check again; not growing",
                        sorted(d.id for d in new))
            return
        ev = RecoveryEvent("scale_up", step, devices_before=_mesh_ids(self.mesh),
                           devices_after=_mesh_ids(mesh), mesh_after=_mesh_shape(mesh),
                           detect_s=0.0, health_s=time.perf_counter() - t0)
        self.timeline.append(ev)
        self._pending, self._t_fault = ev, t0
        self._stash = (step, state) if state is not None else None
        self.mesh = mesh
        self._t_ready = time.perf_counter()
        raise _Rescale()

    def _likely_meshes(self, n: int) -> list[Mesh]:
        """The meshes `choose_mesh` would pick after losing one data row, last
        rows first, distinct, up to n."""
        rows = np.moveaxis(self.full_mesh.devices, self.full_mesh.axis_names.index(
            self._data_axis), 0)
        every = set(self.full_mesh.devices.flat)
        out: dict[tuple, Mesh] = {}
        for r in reversed(range(rows.shape[0])):
            m = self._choose(every - set(rows[r].flat), self.full_mesh)
            if m is not None and m.size < self.full_mesh.size:
                out.setdefault(_mesh_key(m), m)
        return list(out.values())[:n]

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
    """`x` on `target`'s sharding. Through host memory: a device-to-device
    reshard onto another device set compiles a copy program first (0.6 s for
    256 MB here, and again after each jax.clear_caches()); the host path took
    0.12-0.15 s every time."""
    sharding = getattr(target, "sharding", None)
    if not isinstance(x, jax.Array) or sharding is None:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_put(x, sharding)  # typed keys have no host form; they are small
    return jax.device_put(np.asarray(x), sharding)


def _standard_save(state: Any) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.StandardSave(state)


def _standard_restore(abstract: Any) -> Any:
    import orbax.checkpoint as ocp
    return ocp.args.StandardRestore(abstract)
