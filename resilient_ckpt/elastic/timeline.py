"""The recovery timeline: one `RecoveryEvent` per failure or scale-up, timed.

This module owns the record (`RecoveryEvent`, `format_timeline`) and its
bookkeeping (`Recorder`): when the fault happened, when the loop was ready to
re-enter the training function, when the restore was done, which failures
make one episode (the attempt budget: failures without progress, that is
without completing a step beyond the highest one completed before them), and
when the event ends with the first completed step after it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from .failures import describe_error, fault_time, first_line
from .mesh import mesh_ids, mesh_shape, shape_str

log = logging.getLogger("resilient_ckpt.elastic")

EventKind = Literal["failure", "scale_up"]


@dataclasses.dataclass
class RecoveryEvent:
    """One failure (or one scale-up) and what the loop did about it.

    `lost_devices`: the devices the loop went on without, as the failure named
    them (`lost_from` "failure": its `failed_devices`) or as the health check
    found them (`lost_from` "health check").

    Times are seconds: `detect_s` from the fault (its `fault_time` when the
    exception carries one, as injected faults do; otherwise the end of the last
    completed step, an upper bound) to the exception reaching the loop;
    `health_s` the health checks (and any waiting for devices), dropping the
    lost arrays and caches; `rebuild_s` from then to the call of `restore`
    (the function's own set-up: jit, or waiting for a program being built
    ahead); `restore_s` choosing and restoring the step; `resume_s` from the
    restore to the first completed step (a compile, if the step is not
    compiled yet); `total_s` from the fault to that step. `steps_lost`:
    completed steps that must be recomputed.
    """

    kind: EventKind
    step: int                      # the step that failed / the save step of a scale-up
    error: str = ""
    devices_before: tuple = ()
    devices_after: tuple = ()
    lost_devices: tuple = ()       # named by the failure, or unhealthy at the check
    lost_from: str = ""            # "failure" or "health check"
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
            what = f"attempt {self.attempt}, {where} failed ({self.error})"
            if self.lost_from:
                what += f"; lost devices {list(self.lost_devices)} (by the {self.lost_from})"
            if self.mesh_after:
                what += (f"; mesh {shape_str(self.mesh_after)} "
                         f"({len(self.devices_after)} devices)")
        if self.restored_step is not None:
            what += f"; restored step {self.restored_step} from {_tiers_str(self.restored_from)}"
        return f"{what}; {self.outcome}"


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
                     shape_str(e.mesh_after), ms(e.detect_s), ms(e.health_s),
                     ms(e.rebuild_s), ms(e.restore_s), restored, ms(e.resume_s), ms(e.total_s),
                     "-" if e.steps_lost is None else str(e.steps_lost),
                     first_line(e.outcome, 40)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def no_loss_advice(earlier: Sequence[RecoveryEvent], ev: RecoveryEvent) -> str | None:
    """What to do when the attempts ran out (`ev` one too many) and none of
    the `earlier` attempts lost a device of its mesh; None when one did."""
    if any(set(e.lost_devices) & set(e.devices_before) for e in earlier):
        return None
    where = (f"step {ev.step} failed again" if all(e.step == ev.step for e in earlier)
             else "the steps failed again")
    return (f"No device was lost in any attempt, and {where} after each restore: this "
            f"looks like an error of the step itself (a bug or bad input, reported as "
            f"{ev.error}), not a lost device. Fix it, then relaunch the job, which resumes "
            "from that checkpoint.")


class Recorder:
    """The timeline, the event in progress and its clock.

    `events`: every event so far. `pending`: the event waiting for its first
    completed step. `episode`: the failures since the last progress (the
    attempt budget), `waited` the seconds they spent waiting for devices.
    `done`: the last completed (or restored) step. `best`: the highest step
    ever completed; only a completed step above it is progress, and ends the
    episode (a step replayed after a restore is not).
    """

    def __init__(self) -> None:
        self.events: list[RecoveryEvent] = []
        self.pending: RecoveryEvent | None = None
        self.episode: list[RecoveryEvent] = []
        self.waited = 0.0
        self.done: int | None = None
        self.best: int | None = None
        self._mark = time.perf_counter()   # when `done` completed (or was restored)
        self._t_fault = self._t_ready = self._t_restored = 0.0

    def failure(self, exc: BaseException, mesh: Mesh, t_detect: float) -> RecoveryEvent:
        """Records a failure of the step after `done` on `mesh`, seen at `t_detect`."""
        t_fault = fault_time(exc, t_detect)
        prev = self.pending or (self.episode[-1] if self.episode else None)
        if prev is not None:  # no progress since: this failure is its next attempt
            prev.outcome = (f"failed again: {describe_error(exc)}" if prev.first_step is None
                            else f"resumed at step {prev.first_step}, then step "
                                 f"{(self.done or 0) + 1} failed before any progress")
        self._t_fault = t_fault if t_fault is not None else self._mark
        ev = RecoveryEvent("failure", (self.done + 1) if self.done is not None else 0,
                           error=describe_error(exc), devices_before=mesh_ids(mesh),
                           detect_s=max(0.0, t_detect - self._t_fault),
                           attempt=len(self.episode) + 1)
        self.events.append(ev)
        self.pending = ev
        return ev

    def scale_up(self, step: int, before: Mesh, after: Mesh, t0: float) -> None:
        """Records a scale-up at save step `step`, decided at `t0`."""
        ev = RecoveryEvent("scale_up", step, devices_before=mesh_ids(before),
                           devices_after=mesh_ids(after), mesh_after=mesh_shape(after),
                           detect_s=0.0, health_s=time.perf_counter() - t0)
        self.events.append(ev)
        self.pending, self._t_fault = ev, t0

    def ready(self) -> None:
        """The new mesh is chosen: the training function is called again now."""
        self._t_ready = time.perf_counter()

    def restoring(self) -> float:
        """The function asks for its state: closes the pending event's rebuild."""
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.rebuild_s = t0 - self._t_ready
        return t0

    def restored(self, step: int, tiers: dict, t0: float) -> None:
        """The state of `step` is ready (from `tiers`, bytes each), after `t0`."""
        now = time.perf_counter()
        ev = self.pending
        if ev is not None:
            ev.restored_step, ev.restored_from = step, tiers
            ev.restore_s = now - t0
            self._t_restored = now
            ev.steps_lost = (self.done - step) if self.done is not None else None
        self.done, self._mark = step, now

    def completed(self, step: int, state: Any) -> None:
        """`step` completed: the first one after a recovery or scale-up closes
        its event (waiting for `state`, so the time is honest); one above
        `best` is progress, and ends the episode."""
        if self.best is None or step > self.best:
            self.best = step
            self.episode, self.waited = [], 0.0
        ev = self.pending
        if ev is None:
            return
        if state is not None:
            jax.block_until_ready(state)
        now = time.perf_counter()
        ev.first_step = step
        ev.resume_s = now - self._t_restored
        ev.total_s = now - self._t_fault
        ev.outcome = "resumed"
        self.pending = None
        log.warning("elastic: %s", ev.summary())

    def saved(self, step: int) -> None:
        """The manager has taken `step` (saved or not): the newest completed step."""
        self.done, self._mark = step, time.perf_counter()

    def give_up(self, ev: RecoveryEvent, why: str) -> str:
        """Ends `ev` as given up; returns the episode's attempts, one a line."""
        ev.outcome = f"gave up: {why}"
        episode = self.episode if ev in self.episode else self.episode + [ev]
        self.pending = None
        return "\n".join(f"  {e.summary()}" for e in episode)
