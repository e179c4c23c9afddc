"""Scale-up watching: when lost devices are back, grow at a save point.

This module owns the second state machine of the elastic loop: when to
re-check the devices missing from the mesh (every `every_s` seconds, or at the
next save point after `request()`, which is signal-handler safe), the larger
mesh found (its program started building in the background), and when to grow
to it (at the first save point at which its program is built, or after
`grow_wait_s`), re-checking the returning devices then.
"""
from __future__ import annotations

import logging
import time

from jax.sharding import Mesh

from .failures import HealthFn
from .mesh import ChooseMesh
from .programs import Programs

log = logging.getLogger("resilient_ckpt.elastic")


class ScaleUpWatcher:
    """Looks for returned devices and holds the larger mesh until a save point.

    `health` and `choose` are the loop's health check and mesh policy,
    `full_mesh` the mesh it started with; `programs`, when the loop builds
    programs, gets the larger mesh's to build ahead.
    """

    def __init__(self, health: HealthFn, choose: ChooseMesh, full_mesh: Mesh, *,
                 every_s: float, grow_wait_s: float, programs: Programs | None):
        self._health = health
        self._choose = choose
        self._full_mesh = full_mesh
        self._every_s = every_s
        self._grow_wait_s = grow_wait_s
        self._programs = programs
        self._requested = False
        self._last_check = time.monotonic()
        self._target: Mesh | None = None   # a larger mesh whose program is being built
        self._since = 0.0

    def request(self) -> None:
        """Check the lost devices at the next save point (signal-handler safe)."""
        self._requested = True

    def cancel(self) -> None:
        """Forgets the larger mesh (a failure came first)."""
        self._target = None

    def poll(self, mesh: Mesh, timeout_s: float) -> bool:
        """At a save point on `mesh`: looks for returned devices when a check
        is due and no larger mesh is waiting. Returns whether it checked."""
        if self._target is not None or not self._due(mesh):
            return False
        self._look(mesh, timeout_s)
        return True

    def ready(self) -> bool:
        """A larger mesh is waiting and its program is built (or there are no
        programs, or it has waited `grow_wait_s`): grow now."""
        return self._target is not None and (
            self._programs is None or self._programs.done(self._target)
            or time.monotonic() - self._since >= self._grow_wait_s)

    def take(self, mesh: Mesh, timeout_s: float, recheck: bool) -> Mesh | None:
        """The larger mesh to grow to from `mesh` (forgotten here), after
        re-checking its returning devices when `recheck`; None when they
        fail that check."""
        target, self._target = self._target, None
        if target is None:
            return None
        new = [d for d in target.devices.flat if d not in set(mesh.devices.flat)]
        if recheck and set(self._health(new, timeout_s)) != set(new):
            log.warning("elastic: devices %s failed their health check again; not growing",
                        sorted(d.id for d in new))
            return None
        return target

    def _due(self, mesh: Mesh) -> bool:
        if mesh.size >= self._full_mesh.size:
            return False
        if self._requested:
            return True
        return time.monotonic() - self._last_check >= self._every_s

    def _look(self, mesh: Mesh, timeout_s: float) -> None:
        """Health-checks the devices missing from `mesh`; when enough are back
        for a larger mesh, remembers it (and starts building its program)."""
        self._requested = False
        self._last_check = time.monotonic()
        current = set(mesh.devices.flat)
        missing = [d for d in self._full_mesh.devices.flat if d not in current]
        back = frozenset(self._health(missing, timeout_s))
        larger = self._choose(current | back, self._full_mesh) if back else None
        if larger is None or larger.size <= mesh.size:
            return
        self._target, self._since = larger, time.monotonic()
        log.warning("elastic: devices %s are back; growing to %d devices at the next save "
                    "point", sorted(d.id for d in back), larger.size)
        if self._programs is not None:
            self._programs.start([larger])  # compiles while training goes on
