"""The elastic loop: survive lost devices in-process, and scale back up.

This module owns `Elastic`, what happens between "a step raised" and "the
next step completed": with the verdict of `failures` and the lost devices
the failure names (else the health check's answer), it chooses the mesh to go
on with (`mesh.shrink_data_axis`, `devices`), restores the last viable step
onto it through the checkpoint manager (`protocol`),
re-enters the user's training function, and grows the mesh back
(`scaleup`). The record of each event is kept by `timeline`; the programs
built ahead of time by `programs`.

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

A recoverable failure unwinds `train`; `run` records it, takes the lost
devices from the failure (its `failed_devices`) or else health-checks the
devices, drops arrays on the lost ones and the compiled caches, builds the
smaller mesh and calls `train(mesh)` again, whose `el.restore` now restores the
newest viable step (RAM tier first) onto it. Anything else is re-raised at once.
The attempts are bounded by progress: a failure that comes back before
training gets past the highest step completed before it counts against
`RecoveryPolicy.max_attempts`, so one that recurs at the same step ends.
When lost devices pass the health check again, `el.save` interrupts the loop at
the next save point and training resumes on the larger mesh from that very
step (resharded from the live state: no step is lost).

With several processes (`jax.distributed`, one per host), the survivors of a
lost process go on in-process (`survivors`): each step runs through
`el.step(step_fn, ...)` (inside jax's `live_devices`), so every survivor gets
the same `ProcessFailureError` naming the lost devices; the loop builds the
mesh from the survivors' devices, tells the manager which processes are
left (its agreements, restores and saves are among them from then on), and
restores onto that mesh; a lost process never comes back into the running
job, so the mesh does not grow again.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection
from typing import Any, NoReturn

import jax
from jax.sharding import Mesh

from ..errors import RecoveryFailedError
from . import survivors
from .devices import drop_arrays, wait_for_mesh
from .failures import HealthCheck, HealthFn, is_recoverable, named_lost, warm_up
from .hostsnap import HostSnapshotTier, for_loop, lose, restore_first, snapshot_due
from .mesh import ChooseMesh, mesh_ids, mesh_shape, shape_str, shrink_data_axis
from .policy import RecoveryPolicy
from .programs import Programs, likely_meshes
from .protocol import ManagerLike
from .scaleup import ScaleUpWatcher
from .state import StateReserve, check_on_mesh, reshard_live, restore_latest, standard_save
from .timeline import Recorder, RecoveryEvent, no_loss_advice

log = logging.getLogger("resilient_ckpt.elastic")


def _gave_up(manager: ManagerLike, ev: RecoveryEvent, why: str, attempts: str,
             advice: str | None) -> RecoveryFailedError:
    if advice is None:
        advice = ("Check the devices (the health check errors above), then relaunch the "
                  "job, which resumes from that step; or allow more with "
                  "RecoveryPolicy(max_attempts=, max_wait_s=).")
    return RecoveryFailedError(
        f"elastic recovery gave up after the failure at step {ev.step}: {why}.\n"
        f"Attempts:\n{attempts}\n"
        f"The newest viable checkpoint is step {manager.latest_step()} in "
        f"{manager.directory}. {advice}")


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
    `precompile` likeliest smaller meshes (one more data row lost) once the
    first step on each mesh is done (`compiled(mesh)` says whether one is
    ready; with several processes, only meshes this process is part of), and for
    a larger mesh as soon as lost devices are back (scaling up at the first
    save point after it is built, or after
    `grow_wait_s`, whichever comes first), so no compile sits on the recovery
    path. `build` must not depend on anything but the mesh.

    `reserve=True` (CPU backend): also keeps touched buffers for the state on
    the likeliest smaller mesh, which a restore onto it reads into, so the
    first step after it donates them instead of filling fresh memory; costs
    one more state in host memory (`state.StateReserve`; `el.reserve.wait()`).

    `host_snapshot`: a `HostSnapshotTier` (copies in the devices' own hosts'
    memory), taken by `save` when due, restored from first after a failure.
    """

    def __init__(self, manager: ManagerLike, mesh: Mesh, *, data_axis: str = "data",
                 retry: RecoveryPolicy = RecoveryPolicy(),  # noqa: B008 - frozen
                 choose_mesh: ChooseMesh | None = None,
                 health_check: HealthFn | None = None,
                 rescale_every_s: float = 60.0, clear_caches: bool = True,
                 build: Callable[[Mesh], Any] | None = None, precompile: int = 1,
                 grow_wait_s: float = 120.0, reserve: bool = False,
                 host_snapshot: HostSnapshotTier | None = None):
        if data_axis not in mesh.axis_names:
            raise ValueError(f"data_axis {data_axis!r} is not an axis of the mesh "
                             f"{dict(mesh.shape)}; pass data_axis= one of {mesh.axis_names}")
        self.manager, self.full_mesh, self.mesh = manager, mesh, mesh
        self.retry = retry
        self._data_axis = data_axis
        self._choose = choose_mesh or functools.partial(shrink_data_axis, data_axis=data_axis)
        self._programs = Programs(build, precompile) if build is not None else None
        health_check = HealthCheck() if health_check is None else health_check
        if isinstance(health_check, HealthCheck):  # compile now, not when recovering
            health_check.prepare(survivors.own(mesh.devices.flat))
        if survivors.multi():  # only this process's devices can be probed from here
            health_check = survivors.LocalHealth(health_check)
        self._health = health_check
        self._live, self._grows = list(range(jax.process_count())), True  # a lost one stays lost
        self._clear_caches = clear_caches
        self._watch = ScaleUpWatcher(health_check, self._choose, mesh, every_s=rescale_every_s,
                                     grow_wait_s=grow_wait_s, programs=self._programs)
        self._rec = Recorder()
        self._stash: tuple[int, Any] | None = None   # (save step, live state) of a scale-up
        self.reserve = StateReserve(reserve)
        self.host_snapshot = for_loop(host_snapshot, data_axis, self._choose)
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
                    err = survivors.explain(e, self._live)  # an agreement that timed out
                    if not is_recoverable(err):
                        if err is e:
                            raise
                        raise err from e
                    self._recover(err)
        return wrapper

    def program(self, mesh: Mesh | None = None) -> Any:
        """What `build(mesh)` returns for `mesh` (default: the current mesh),
        built once per mesh; waits for it if it is being built ahead of time."""
        if self._programs is None:
            raise ValueError("Elastic.program needs Elastic(..., build=fn), fn(mesh) making "
                             "the step and abstract state for a mesh")
        return self._programs.get(mesh if mesh is not None else self.mesh)

    def compiled(self, target: Mesh | Collection[jax.Device]) -> bool:
        """Whether the program for `target` is ready: `build` has returned for
        that mesh (ahead of time or through `program`), so going on with it
        costs no compile. `target` is a mesh, or devices (e.g. the survivors
        of a failure), meaning the mesh `choose_mesh` makes of them. False
        while it is being built, after its build failed, after a lost device
        dropped it, for devices too few for any mesh, and without `build=`."""
        if self._programs is None:
            return False
        mesh = target if isinstance(target, Mesh) else self._choose(frozenset(target),
                                                                    self.full_mesh)
        return mesh is not None and self._programs.built(mesh)

    def restore(self, abstract: Any = None, init: Callable[[], Any] | None = None, *,
                init_step: int = 0, args: Any = None) -> tuple[Any, int]:
        """The state to (re)start from and its step, on the current mesh.

        After a failure: the newest viable step onto `abstract`
        (jax.ShapeDtypeStruct leaves with shardings on the mesh `fn` was given),
        from the host snapshot if it holds one as new, else the manager's tiers,
        RAM tier first. After a scale-up: the state of the save
        step, resharded from the live arrays. On a first call: the newest viable
        step if there is one (a relaunched job resumes), else `init()` at
        `init_step`. `args` replaces `abstract` with an Orbax restore args object.
        """
        if abstract is None and args is None:
            raise ValueError("Elastic.restore needs the abstract state for the current mesh "
                             "(jax.ShapeDtypeStruct leaves with shardings on el.mesh) or args=")
        check_on_mesh(abstract, self.mesh)
        self.reserve.note(abstract, self.mesh == self.full_mesh)
        ev, t0 = self._rec.pending, self._rec.restoring()
        if ev is not None and ev.kind == "scale_up" and self._stash is not None:
            step, live = self._stash
            self._stash = None
            state, tiers = reshard_live(self.manager, live, abstract, args, step)
        elif (got := restore_first(self.host_snapshot, self.manager, abstract,
                                   self.retry.health_timeout_s)) is not None:
            state, step, tiers = got
        elif self.manager.latest_step() is None:
            if ev is not None and ev.kind == "failure":
                log.warning("no viable step to restore after the failure at step %d; "
                            "starting again from init()", ev.step)
            if init is None:
                raise ValueError(f"nothing to restore in {self.manager.directory} and no "
                                 "init given: pass init= to Elastic.restore")
            state, step, tiers = init(), init_step, {}
            warm = getattr(self.manager, "warm", None)  # ours; Orbax's manager has none
            if warm is not None:
                warm(state)
        else:
            target = abstract if args is not None else self.reserve.target(abstract, self.mesh)
            state, step, tiers = restore_latest(self.manager, target, args)
        self._rec.restored(step, tiers, t0)
        return state, step

    def step(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args)`; with several processes, inside jax's live_devices (`survivors.guarded`)."""
        return survivors.guarded(fn, *args, **kwargs)

    def save(self, step: int, state: Any = None, *, args: Any = None, **save_kwargs: Any) -> bool:
        """Call after every completed step: `manager.save` (which saves only when
        a tier is due), the end of a pending recovery, the check for returned
        devices (when `rescale_every_s` has passed or `request_rescale()` was
        called) and the scale-up: at the first save point after they are back
        (with `build`, the first one at which the larger mesh's program is
        built, so training goes on while it compiles, or after `grow_wait_s`).
        Returns whether the manager saved."""
        self._rec.completed(step, state)
        if args is None:
            if state is None:
                raise ValueError("Elastic.save needs the state (or args=)")
            args = standard_save(state)
        snapshot_due(self.host_snapshot, step, state)
        saved = self.manager.save(step, args=args, **save_kwargs)
        self._rec.saved(step)
        if self._programs is not None:
            self._programs.start_likely(self._choose, self.full_mesh, self._data_axis,
                                        self.mesh)
        if self.mesh == self.full_mesh:
            self.reserve.start(lambda: likely_meshes(self._choose, self.full_mesh,
                                                     self._data_axis, 1))
        if self._grows:
            just_checked = self._watch.poll(self.mesh, self.retry.health_timeout_s)
            if saved and self._watch.ready():
                self._scale_up(step, state, recheck=not just_checked)
        return saved

    def request_rescale(self) -> None:
        """Check the lost devices at the next save point (signal-handler safe)."""
        self._watch.request()

    @property
    def timeline(self) -> list[RecoveryEvent]:
        """Every failure and scale-up so far, in order."""
        return self._rec.events

    @property
    def events(self) -> list[dict]:
        """The timeline as plain dicts, ready for a JSON log."""
        return [e.to_dict() for e in self.timeline]

    # -------------------------------------------------------------- events

    def _recover(self, exc: Exception) -> None:
        """After a recoverable failure: records it, waits for a usable mesh
        (without the devices the failure names, else the healthy ones), drops
        what was on the lost devices and makes that mesh current."""
        t_detect = time.perf_counter()
        self._stash = None
        ev = self._rec.failure(exc, self.mesh, t_detect)
        log.warning("elastic: step %d failed with %s; recovering", ev.step, ev.error)
        if ev.attempt > self.retry.max_attempts:
            self._give_up(ev, exc, f"{self.retry.max_attempts} attempts without progress past "
                          f"step {self._rec.best}", no_loss_advice(self._rec.episode, ev))
        self._rec.episode.append(ev)
        mesh, self._rec.waited, why = wait_for_mesh(self._health, self._choose, self.full_mesh,
                                                    self.retry, ev, self._rec.waited,
                                                    named_lost(exc) | survivors.gone(self._live))
        if mesh is None:
            self._give_up(ev, exc, why)
        lost = set(self.full_mesh.devices.flat) - set(mesh.devices.flat)
        busy = lose(self.host_snapshot, ev.lost_devices,  # first: a snapshot in flight
                    self.retry.health_timeout_s)
        drop_arrays(lost, self._clear_caches, keep=busy)
        if self._programs is not None:
            self._programs.drop(d.id for d in lost)
        self._watch.cancel()
        live, problem = survivors.go_on(self.manager, ev.lost_devices, self._live, mesh)
        if problem is not None:
            self._give_up(ev, exc, problem, "Relaunch the job; it resumes from that step.")
        self._live, self._grows = live, self._grows and live == self._live
        ev.health_s = time.perf_counter() - t_detect
        self.mesh = mesh
        ev.devices_after, ev.mesh_after = mesh_ids(mesh), mesh_shape(mesh)
        log.warning("elastic: going on with %d devices, mesh %s", mesh.size,
                    shape_str(ev.mesh_after))
        # The traceback holds the failed attempt's frames and, through them, its
        # arrays: release them before the next attempt restores a new copy.
        exc.__traceback__ = None
        self._rec.ready()

    def _give_up(self, ev: RecoveryEvent, exc: Exception, why: str,
                 advice: str | None = None) -> NoReturn:
        raise _gave_up(self.manager, ev, why, self._rec.give_up(ev, why), advice) from exc

    def _scale_up(self, step: int, state: Any, recheck: bool) -> None:
        """At a save point: re-checks the returning devices (unless they were
        checked on this very step), then unwinds the training function to go on
        from this step on the larger mesh."""
        t0 = time.perf_counter()
        mesh = self._watch.take(self.mesh, self.retry.health_timeout_s, recheck)
        if mesh is None:
            return
        self._rec.scale_up(step, self.mesh, mesh, t0)
        self._stash = (step, state) if state is not None else None
        self.mesh = mesh
        self._rec.ready()
        raise _Rescale()
