"""The failure path's device work: wait for a usable mesh, drop what was lost.

This module owns the two steps between "a recoverable failure" and "the mesh
to go on with": taking the devices the failure names as lost, or else polling
the health check, until the mesh policy yields a large enough mesh (within
the `RecoveryPolicy`'s waiting time), and deleting every live array with a
buffer on a lost device, with jax's compiled caches.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Collection

import jax
from jax.sharding import Mesh

from .failures import HealthFn
from .mesh import ChooseMesh
from .policy import RecoveryPolicy
from .timeline import RecoveryEvent

log = logging.getLogger("resilient_ckpt.elastic")


def wait_for_mesh(health: HealthFn, choose: ChooseMesh, full_mesh: Mesh,
                  policy: RecoveryPolicy, ev: RecoveryEvent,
                  waited: float, named: frozenset[int] = frozenset()
                  ) -> tuple[Mesh | None, float, str]:
    """Finds the healthy devices of `full_mesh` until `choose` gives a large
    enough mesh, within the policy's total waiting time (`waited` seconds of
    it already spent in this episode): first from `named`, the ids the failure
    says are lost, without a health check; when it names none, or to look
    again after a poll, by health-checking every device. Records the lost
    devices in `ev`. Returns (mesh, seconds waited in all, ""), or (None,
    seconds, why) when the waiting time is up."""
    every = list(full_mesh.devices.flat)
    t0 = time.perf_counter()
    while True:
        if named:
            healthy = frozenset(d for d in every if d.id not in named)
            ev.lost_from, named = "failure", frozenset()  # a later look asks the check
        else:
            healthy = frozenset(health(every, policy.health_timeout_s))
            ev.lost_from = "health check"
        ev.lost_devices = tuple(sorted(d.id for d in every if d not in healthy))
        mesh = choose(healthy, full_mesh)
        if mesh is not None and mesh.size >= policy.min_devices:
            return mesh, waited + time.perf_counter() - t0, ""
        total = waited + time.perf_counter() - t0
        if total + policy.poll_s > policy.max_wait_s:
            # A HealthCheck, or a bound method of an object that keeps last_errors.
            errors = getattr(getattr(health, "__self__", health), "last_errors", None)
            return None, total, (f"waited {total:.1f} s (max_wait_s={policy.max_wait_s:g}) "
                                 f"for a mesh of at least {policy.min_devices} devices; "
                                 f"healthy: {sorted(d.id for d in healthy)}"
                                 + (f"; health check errors: {errors}" if errors else ""))
        time.sleep(policy.poll_s)


def drop_arrays(lost: set, clear_caches: bool, keep: Collection[int] = ()) -> None:
    """Deletes every live array with a buffer on a lost device, except those
    whose `id()` is in `keep` (another thread waits on them and frees them
    itself), then (with `clear_caches`) jax's compiled caches, whose
    executables may name those devices."""
    if lost:
        for a in jax.live_arrays():
            try:
                if (id(a) not in keep and not a.is_deleted()
                        and not lost.isdisjoint(a.devices())):
                    a.delete()
            except Exception as e:  # noqa: BLE001 - a dead buffer may refuse even this
                log.debug("could not delete a live array on a lost device: %s", e)
    if clear_caches:
        jax.clear_caches()
