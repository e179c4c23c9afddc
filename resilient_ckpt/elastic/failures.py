"""The failure classifier: what a failure is, and which devices still work.

This module owns the two questions the elastic loop asks first:
`is_recoverable(exc)`: does this exception mean lost devices or hosts (go on
with the rest) or a bug (re-raise)? And `HealthCheck`: which devices still
compute? It knows the Pathways slice-down errors (through pathwaysutils where
it is installed), multi-controller process failures and gloo peer losses.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np

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
    """
    if _is_process_failure(exc):
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
