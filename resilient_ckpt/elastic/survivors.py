"""Multi-controller recovery in-process: the survivors of a lost process go on.

This module owns what the elastic loop does differently in a job of several
processes (`jax.distributed`, one per host), where a lost host is a process
that stops answering and cannot come back into the running job:

- the step guard (`guarded`): the step inside jax's `live_devices` and
  waited for there, so that with jax's recoverability settings a lost
  process surfaces on every survivor alike, as a `ProcessFailureError` that
  names its devices, a few seconds (the collective timeout) after the loss;
- `explain`: a manager's agreement that timed out (a process lost between
  two steps, while the others waited for its view) becomes the same kind of
  failure, from one more `live_devices` round among the survivors;
- going on (`go_on`): which processes are left (`live_after`), the checks
  the new mesh must pass (process 0 survived; every survivor has a device
  in it), and telling the manager (`tell_manager`: `set_live_processes`,
  after which its agreements, restores, retention and saves involve the
  survivors only);
- `LocalHealth`: a health check that probes only this process's devices
  (another process's cannot be run from here; a lost one is named by the
  failure).

The job's settings for this (docs/elastic.md, "Survivors go on"):
`jax.config.update("jax_enable_recoverability", True)` before
`jax.distributed.initialize`, and a collective timeout
(`XLA_FLAGS=--xla_cpu_collective_timeout_seconds=5` on CPU).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from ..errors import AgreementError
from .failures import DeviceLossError, HealthFn, named_lost
from .protocol import ManagerLike

log = logging.getLogger("resilient_ckpt.elastic")


def multi() -> bool:
    """Whether this is a job of several processes."""
    return jax.process_count() > 1


def own(devices: Any) -> list[jax.Device]:
    """Those of `devices` that this process drives."""
    return [d for d in devices if d.process_index == jax.process_index()]


def guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`; in a job of several processes inside jax's
    `live_devices` and waited for, so that every survivor of a lost process
    raises the same `ProcessFailureError` (atomically: all or none)."""
    if not multi():
        return fn(*args, **kwargs)
    from jax.experimental import multihost_utils
    with multihost_utils.live_devices(jax.devices()):
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
    return out


def explain(exc: Exception, live: Sequence[int]) -> Exception:
    """For an `AgreementError` in a job of several processes: the failure that
    names the devices of the processes lost since `live` was the job, found
    by a `live_devices` round among the processes left (each survivor timed
    out at the same exchange, on the same missing view, so each comes here);
    `exc` itself when none was lost or it is something else."""
    if not multi() or not isinstance(exc, AgreementError) or named_lost(exc):
        return exc
    from jax.experimental import multihost_utils
    try:
        with multihost_utils.live_devices(jax.devices()) as alive:
            pass
    except multihost_utils.ProcessFailureError as e:
        e.__cause__ = exc
        return e
    gone = set(live) - {d.process_index for d in alive}
    if not gone:
        return exc
    lost = DeviceLossError([d for d in jax.devices() if d.process_index in gone],
                           f"processes {sorted(gone)} lost (an agreement timed out)")
    lost.__cause__ = exc
    return lost


def live_after(lost_ids: Collection[int], live: Sequence[int]) -> list[int]:
    """The processes of `live` left after losing the devices `lost_ids`: a
    process is lost with every one of its devices (a lost host), not with
    some; with one process, it is always left."""
    if not multi():
        return list(live)
    left = {d.process_index for d in jax.devices() if d.id not in lost_ids}
    return [q for q in live if q in left]


def gone(live: Sequence[int]) -> frozenset[int]:
    """The ids of the devices of processes no longer in `live` (lost before)."""
    return frozenset(d.id for d in jax.devices() if d.process_index not in live)


def mesh_problem(mesh: Mesh, live: Sequence[int]) -> str | None:
    """Why the job cannot go on with `mesh` among the `live` processes, or None."""
    if 0 not in live:
        return ("process 0 (the jax.distributed coordinator) was lost, and the others "
                "cannot go on without it; relaunch the job")
    used = {d.process_index for d in mesh.devices.flat}
    idle = sorted(set(live) - used)
    if idle:
        return (f"the mesh chosen for the survivors leaves processes {idle} without a "
                "device, and every process must take part in each step. Where each "
                "host's devices fill whole rows of the data axis, "
                "functools.partial(shrink_data_axis, divisor=False) keeps a device of "
                "every survivor; where a row spans hosts (a model axis across hosts, "
                "e.g. one device per host), a lost host leaves the other hosts of its "
                "row without a whole row: lay the mesh out with each row on one host, "
                "pass a choose_mesh that gives every survivor a device, or relaunch "
                "the job (it restores the same step)")
    return None


def go_on(manager: ManagerLike, lost_ids: Collection[int], live: Sequence[int],
          mesh: Mesh) -> tuple[list[int], str | None]:
    """After the loss of `lost_ids` with `mesh` chosen: the processes left of
    `live` and, when some were lost, either why the job cannot go on with
    `mesh`, or None once the manager was told (a collective among them)."""
    left = live_after(lost_ids, live)
    if left == list(live):
        return left, None
    why = mesh_problem(mesh, left)
    if why is None:
        log.warning("elastic: processes %s lost; going on with processes %s",
                    sorted(set(live) - set(left)), left)
        tell_manager(manager, left)
    return left, why


def tell_manager(manager: ManagerLike, live: Sequence[int]) -> None:
    """`manager.set_live_processes(live)`: a collective among the survivors."""
    hook = getattr(manager, "set_live_processes", None)
    if hook is None:
        raise TypeError(f"{type(manager).__name__} has no set_live_processes(processes): "
                        "the survivors of a lost process cannot go on with it")
    hook(list(live))


class LocalHealth:
    """A health check over this process's devices only; the others count as
    healthy (a lost process is named by its failure, `ProcessFailureError`)."""

    def __init__(self, health: HealthFn):
        self._health = health

    @property
    def last_errors(self) -> Any:
        return getattr(getattr(self._health, "__self__", self._health), "last_errors", None)

    def __call__(self, devices: Collection[jax.Device], timeout_s: float) -> frozenset:
        me = jax.process_index()
        mine = [d for d in devices if d.process_index == me]
        return (frozenset(self._health(mine, timeout_s))
                | frozenset(d for d in devices if d.process_index != me))
