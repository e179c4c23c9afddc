"""Simulated device loss on real CPU devices, for tests and the elastic demo.

This module owns the one simulated part of the elastic story: CPU devices do
not die, so `FaultInjector` makes chosen devices behave as lost from a chosen
step until a chosen repair step:

- at the fault's step, `before_step` deletes every live buffer on those devices
  (each shard of each live jax array placed there: the arrays stay, reading
  them fails), then raises `InjectedDeviceLoss`, a `jax.errors.JaxRuntimeError`
  whose text starts with "DATA_LOSS:" as a Pathways slice loss does. So nothing
  can recover by reading a dead device: only the checkpoint tiers and the
  surviving devices' buffers are left;
- until repaired, a step handed arrays on a lost device raises the same error
  (computing on a dead device), and `health_check` reports those devices as
  failing; every other device gets the real check (`elastic.HealthCheck`).

It is in the spirit of pathwaysutils' `DeviceLossSimulator`, which is not used
here: it patches numpy and jax globally (np.asarray, jax.jit, Primitive.bind)
and marks arrays corrupt without freeing any buffer, whereas this injector
needs no patching (the step, or `wrap`, calls it explicitly) and really deletes
the buffers.

    faults = FaultInjector([DeviceFault(step=20, devices=(4, 5, 6, 7), repair_step=35)])
    el = Elastic(mngr, mesh, health_check=faults.health_check)
    step_fn = faults.wrap(jitted_step)       # now step_fn(step, state, ...)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax

from ..elastic.failures import HealthCheck
from ..elastic.hostsnap import HostSnapshotTier

log = logging.getLogger("resilient_ckpt.testing.faults")


@dataclasses.dataclass(frozen=True)
class DeviceFault:
    """Devices (by id) lost when step `step` runs, back from `repair_step` on
    (never, when None). Each fault fires once."""

    step: int
    devices: tuple[int, ...]
    repair_step: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "devices", tuple(sorted(int(d) for d in self.devices)))
        if not self.devices:
            raise ValueError("a DeviceFault needs at least one device")
        if self.repair_step is not None and self.repair_step <= self.step:
            raise ValueError(f"repair_step ({self.repair_step}) must come after the fault's "
                             f"step ({self.step})")


class InjectedDeviceLoss(jax.errors.JaxRuntimeError):
    """The simulated loss: a JaxRuntimeError with DATA_LOSS in its text, as on
    Pathways. `fault_time` (time.perf_counter) lets the loop time detection."""

    step: int
    devices: tuple[int, ...]
    fault_time: float


def _loss(step: int, devices: Sequence[int], why: str, fault_time: float) -> InjectedDeviceLoss:
    e = InjectedDeviceLoss(f"DATA_LOSS: {why} (simulated by resilient_ckpt.testing.faults: "
                           f"devices {list(devices)}, step {step})")
    e.step, e.devices, e.fault_time = step, tuple(devices), fault_time
    return e


class FaultInjector:
    """Fires `faults` as the steps named in them run; see the module docstring.

    `check`: the real health check for devices that are not lost (default: a
    new `HealthCheck`, compiled for every device now, off the recovery path).
    `host_snapshot`: the loop's `HostSnapshotTier`, if any: a loss tells it
    first (`lose`) and waits for its snapshot in flight to be discarded
    before deleting anything: its commit thread reads that snapshot's arrays,
    and on the CPU backend deleting an array another thread is reading crashes
    the process, which no real loss does. `log` lists what was injected and
    repaired, and when.
    """

    def __init__(self, faults: Sequence[DeviceFault], check: HealthCheck | None = None,
                 host_snapshot: HostSnapshotTier | None = None):
        self.faults = tuple(sorted(faults, key=lambda f: f.step))
        self.host_snapshot = host_snapshot
        if check is None:
            check = HealthCheck()
            check.prepare(jax.devices())
        self.check = check
        self.last_errors: dict[int, str] = {}
        self._fired: set[int] = set()
        self._repaired: set[int] = set()
        self.log: list[dict] = []

    @property
    def lost(self) -> frozenset[int]:
        """Ids of the devices lost now."""
        return frozenset(d for i, f in enumerate(self.faults)
                         if i in self._fired and i not in self._repaired for d in f.devices)

    def before_step(self, step: int, *trees: Any) -> None:
        """Call as step `step` starts, with the arrays it is about to use:
        repairs what is due, fires what is due (raising), and raises if `trees`
        touch a lost device."""
        for i, f in enumerate(self.faults):
            if i in self._fired and i not in self._repaired and (
                    f.repair_step is not None and step >= f.repair_step):
                self._repaired.add(i)
                self.log.append({"event": "repair", "step": step, "devices": f.devices,
                                 "time": time.perf_counter()})
                log.info("devices %s repaired at step %d", list(f.devices), step)
        for i, f in enumerate(self.faults):
            if i not in self._fired and step >= f.step:
                self._fired.add(i)
                raise self._fire(f, step)
        lost = self.lost
        if lost:
            touched = sorted({d.id for t in trees for leaf in jax.tree.leaves(t)
                              if isinstance(leaf, jax.Array) for d in leaf.devices()} & lost)
            if touched:
                raise _loss(step, touched, f"step {step} uses lost devices {touched}",
                            time.perf_counter())

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn(*args)` becomes `wrapped(step, *args)`, checked by `before_step`."""
        def wrapped(step: int, *args: Any, **kwargs: Any) -> Any:
            self.before_step(step, args, kwargs)
            return fn(*args, **kwargs)
        return wrapped

    def health_check(self, devices: Collection[jax.Device], timeout_s: float) -> frozenset:
        """Lost devices fail (as with DATA_LOSS); the others get the real check."""
        lost = self.lost
        alive = [d for d in devices if d.id not in lost]
        healthy = frozenset(self.check(alive, timeout_s))
        self.last_errors = dict(self.check.last_errors)
        self.last_errors.update({d.id: "DATA_LOSS: lost (simulated)" for d in devices
                                 if d.id in lost})
        return healthy

    def _fire(self, f: DeviceFault, step: int) -> InjectedDeviceLoss:
        if self.host_snapshot is not None:
            self.host_snapshot.lose(f.devices)
            self.host_snapshot.wait()
        deleted = delete_buffers_on(self.lost)
        t = time.perf_counter()  # the step raises now: the loop's detection starts here
        self.log.append({"event": "fault", "step": step, "devices": f.devices, "time": t,
                         "buffers_deleted": deleted})
        log.info("devices %s lost at step %d (%d buffers deleted)", list(f.devices), step,
                 deleted)
        return _loss(step, f.devices, f"devices {list(f.devices)} lost", t)


def delete_buffers_on(device_ids: Collection[int]) -> int:
    """Deletes the buffer of every shard of every live jax array that lies on one
    of `device_ids`; the arrays stay, and reading them fails. Returns the count.
    Each array is first waited for: on the CPU backend, deleting a buffer that a
    copy is still writing corrupts the process's memory, which no real loss does."""
    ids, n = set(device_ids), 0
    for a in jax.live_arrays():
        try:
            if a.is_deleted() or ids.isdisjoint(d.id for d in a.devices()):
                continue
            a.block_until_ready()
            for shard in a.addressable_shards:
                if shard.device.id in ids:
                    shard.data.delete()
                    n += 1
        except Exception as e:  # noqa: BLE001 - a buffer already gone is fine
            log.debug("an array on lost devices was already unusable: %s", e)
    return n
