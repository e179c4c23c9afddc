"""The failure classifier: what a failure is, what it says, which devices still work.

This module owns the questions the elastic loop asks first:
`is_recoverable(exc)`: does this exception mean lost devices or hosts (go on
with the rest) or a bug (re-raise)? What does the failure itself say
(`named_lost`, `fault_time`)? And `HealthCheck`: which devices still compute?
It knows the Pathways slice-down errors (through pathwaysutils where it is
installed), multi-controller process failures and gloo peer losses.

What the loop reads from a failure, before anything else, so that an injected
or custom failure can say what it knows (`DeviceLossError` sets both):

- `failed_devices`: the lost devices, as `jax.Device` objects or integer
  device ids, any iterable. jax's own `ProcessFailureError`
  (`jax.experimental.multihost_utils.live_devices`) sets it to the set of
  devices whose processes failed. When it is there and not empty, the loop
  goes on without those devices and does not ask the health check about this
  failure, and the exception is recoverable whatever its type. Ids that are
  not in the loop's mesh are ignored.
- `fault_time`: when the fault happened, as a `time.perf_counter()` reading
  (the loop's clock; not `time.time()`). The timeline's detection time runs
  from it. Without one (or with one not yet reached when the loop sees the
  failure) it runs from the end of the last completed step, an upper bound.

The other errors name no device: a Pathways slice loss is a `JaxRuntimeError`
whose text says DATA_LOSS (or DEADLINE_EXCEEDED, NOT_FOUND, INTERNAL), a gloo
peer loss names a peer address. For those the health check tells the lost
devices.

Threads: `HealthCheck` probes each device in a daemon thread `rc-health-<id>`
and waits for them up to its timeout: a hung device never answers, so its
probe must not hold up interpreter exit (a healthy one ends in milliseconds).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import jax
import numpy as np

from ..core.ambient import apart

log = logging.getLogger("resilient_ckpt.failures")

# The Pathways slice-down family (pathwaysutils/elastic/elastic.py): DATA_LOSS for
# sure; the others may or may not be a lost slice, and are treated as one with a
# warning. Used only when pathwaysutils is not installed; otherwise it decides.
_SLICE_DOWN = ("DATA_LOSS",)
_MAYBE_SLICE_DOWN = ("DEADLINE_EXCEEDED", "NOT_FOUND", "INTERNAL")
# Gloo (the CPU collectives of multi-controller JAX) reports a dead peer as
# "UNKNOWN: Gloo all-reduce failed ... Connection closed by peer" (or "Read
# error ...: Connection reset by peer"), as a JaxRuntimeError or, when it surfaces
# while dispatching the next computation, a ValueError (seen with jax 0.10.2).
_GLOO_PEER_LOSS = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused",
                   "Timed out", "timed out")


def is_recoverable(exc: BaseException) -> bool:
    """True when `exc` means devices or hosts were lost, so recovering onto the
    devices that are left makes sense; False for anything else (a bug: re-raise).

    Recoverable: a `jax.errors.JaxRuntimeError` of the Pathways slice-down family
    (its text has DATA_LOSS; or DEADLINE_EXCEEDED, NOT_FOUND, INTERNAL, with a
    warning), decided by pathwaysutils' `is_error_due_to_slice_down` where it is
    installed; the device loss injected by `resilient_ckpt.testing.faults` (a
    DATA_LOSS error); a multi-controller `ProcessFailureError`
    (`jax.experimental.multihost_utils.live_devices`); a gloo collective that
    lost its peer (a JaxRuntimeError, or the ValueError jax raises when the
    loss surfaces at dispatch). Only `exc` itself is looked at, not its cause
    or context.

    DEADLINE_EXCEEDED, NOT_FOUND and INTERNAL are ambiguous: a lost slice, or
    a bug. They stay recoverable, as pathwaysutils has them, because a slice
    that is back by the time of the health check shows up as one of them with
    every device healthy, and a retry is then right. What keeps a bug reported
    that way from looping is the loop's progress rule (`RecoveryPolicy`): it
    fails again at the same step after each restore and ends after
    `max_attempts` with RecoveryFailedError, which says no device was lost.
    An exception that names lost devices (`failed_devices`, not empty) is
    recoverable whatever its type.
    """
    if _is_process_failure(exc) or named_lost(exc):
        return True
    if not isinstance(exc, (jax.errors.JaxRuntimeError, ValueError)):
        return False
    text = str(exc)
    if "Gloo" in text and any(p in text for p in _GLOO_PEER_LOSS):
        return True
    if not isinstance(exc, jax.errors.JaxRuntimeError):
        return False
    pathways = _pathways_rule()
    if pathways is not None:
        return bool(pathways(exc, log_traceback=False))
    if any(k in text for k in _SLICE_DOWN):
        return True
    if any(k in text for k in _MAYBE_SLICE_DOWN):
        log.warning("treating %s as a lost device (it may also be a bug): %s",
                    type(exc).__name__, first_line(text))
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


class DeviceLossError(jax.errors.JaxRuntimeError):
    """A lost-device failure that says which devices and when: raise it from
    your own monitoring (or a fault injector) to have the loop go on without
    `devices` (jax.Device objects or ids) at once, timing detection from
    `fault_time` (`time.perf_counter()`, default now). Its text starts with
    DATA_LOSS, as a Pathways slice loss does, so pathwaysutils agrees."""

    def __init__(self, devices: Iterable[Any], why: str = "devices lost",
                 fault_time: float | None = None):
        ids = sorted(_device_id(d) for d in devices)
        super().__init__(f"DATA_LOSS: {why} (devices {ids})")
        self.failed_devices = frozenset(ids)
        self.fault_time = time.perf_counter() if fault_time is None else fault_time


def named_lost(exc: BaseException) -> frozenset[int]:
    """The ids of the devices `exc` says are lost (its `failed_devices`), or
    an empty set when it does not say (or says something unreadable)."""
    devices = getattr(exc, "failed_devices", None)
    if devices is None or isinstance(devices, (str, bytes)):
        return frozenset()
    try:
        return frozenset(_device_id(d) for d in devices)
    except (TypeError, ValueError) as e:
        log.warning("ignoring the failed_devices of %s, which are neither devices nor ids: %s",
                    type(exc).__name__, e)
        return frozenset()


def _device_id(d: Any) -> int:
    return int(d.id) if hasattr(d, "id") else int(d)


def fault_time(exc: BaseException, seen_at: float) -> float | None:
    """`exc.fault_time` (a `time.perf_counter()` reading) when it is a number
    not later than `seen_at`, when the loop saw the failure; else None."""
    t = getattr(exc, "fault_time", None)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t <= seen_at:
        if t is not None:
            log.warning("ignoring fault_time=%r of %s: not a time.perf_counter() reading "
                        "before the failure reached the loop", t, type(exc).__name__)
        return None
    return float(t)


def warm_up() -> None:
    """Imports pathwaysutils (about a second) now, not on the recovery path."""
    _pathways_rule()


def first_line(text: str, limit: int = 160) -> str:
    """The first line of an error text, cut at `limit` characters."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def describe_error(exc: BaseException) -> str:
    """"Type: first line of the message", for records and logs."""
    return f"{type(exc).__name__}: {first_line(str(exc))}"


# ------------------------------------------------------------------ health

# health_check(devices, timeout_s) -> the healthy ones.
HealthFn = Callable[[Collection[jax.Device], float], Collection]

def _plus_one(x):
    return x + 1


class HealthCheck:
    """Runs `x + 1` on each device, each in its own thread, with a timeout.

    The tiny program is compiled once per device, ahead of time, and held here,
    so the check stays a few milliseconds even right after `jax.clear_caches()`
    (a fresh jit per device costs a compile each). `prepare` compiles
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

    @apart()
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

    @apart()
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
                errors[d.id] = describe_error(e)

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
