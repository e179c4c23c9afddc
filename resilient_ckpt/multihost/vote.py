"""One all-reduce (elementwise max) of a small int64 vector over the job's
devices: the transport of `core.summary`'s vectors.

The reduction runs on every device of the live processes, as a program of
its own, so it is ordered with the training program's collectives the way any
jax program is: by the order in which each process dispatches it. `start`
must therefore be called at the same point of every process's program, on
the thread that dispatches the training steps (the manager's `save`); it
dispatches and returns at once. `wait` collects the result, on any thread:
it polls the result's readiness, so it ends when the round is given up
(`cancel`, set when a process of the job is lost) or after `timeout_s`,
without blocking inside jax. A reduction that fails (a device or process
gone, which jax reports after its collective timeout) raises
`AgreementError`; nothing here retries. There are no threads here.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.ambient import apart
from ..errors import AgreementError

AUTO_FROM = 64  # processes: from here on a job votes unless told not to (options.py)


class DeviceVote:
    """The reduction among the processes `live` (jax indices, ascending)."""

    def __init__(self, live: Sequence[int], width: int):
        self.live, self.width = tuple(live), width
        # Every device of the live processes, each holding its process's row:
        # the device set of a training program's collectives over the whole
        # job, so the vote joins the communicator those already set up
        # rather than making one of its own (whose setup waits for every
        # process, and costs the job a rendezvous).
        devices = sorted((d for d in jax.devices() if d.process_index in self.live),
                         key=lambda d: (d.process_index, d.id))
        missing = set(self.live) - {d.process_index for d in devices}
        if missing:
            raise AgreementError(f"processes {sorted(missing)} have no device for the "
                                 "job's vote")
        self._mine = [d for d in devices if d.process_index == jax.process_index()]
        self._count = len(devices)
        mesh = Mesh(np.array(devices), ("devices",))
        self._rows = NamedSharding(mesh, PartitionSpec("devices"))
        with jax.enable_x64(True):
            self._max = jax.jit(lambda x: jnp.max(x, axis=0),
                                out_shardings=NamedSharding(mesh, PartitionSpec()))

    @apart()  # the caller's mesh context does not reach the vote
    def start(self, row: np.ndarray) -> jax.Array:
        """Dispatches the reduction of this process's `row`; returns its
        (future) result. Every live process calls it at the same point."""
        if row.shape != (self.width,) or row.dtype != np.int64:
            raise ValueError(f"a vote is {self.width} int64 values, not {row.dtype} "
                             f"{row.shape}")
        with jax.enable_x64(True):
            rows = jax.make_array_from_single_device_arrays(
                (self._count, self.width), self._rows,
                [jax.device_put(row[None], d) for d in self._mine])
            return self._max(rows)

    @staticmethod
    def wait(result: jax.Array, what: str, timeout_s: float,
             cancel: threading.Event | None = None) -> np.ndarray:
        """The reduced vector, once every process has sent its row."""
        deadline, pause = time.monotonic() + timeout_s, 1e-4
        while not result.is_ready():  # type: ignore[attr-defined]  # not in jax's stubs
            if cancel is not None and cancel.is_set():
                raise AgreementError(f"{what}: the job's vote was given up (a process of "
                                     "the job was lost)")
            if time.monotonic() > deadline:
                raise AgreementError(
                    f"{what}: the job's vote did not complete within {timeout_s:g} s: a "
                    "process is gone, or not making the same calls; every process must "
                    "call save, restore, reload and wait_until_finished in the same order")
            time.sleep(pause)
            pause = min(2 * pause, 2e-3)
        try:
            return np.asarray(result.addressable_data(0))
        except Exception as e:  # noqa: BLE001 - jax's runtime errors are untyped
            raise AgreementError(f"{what}: the job's vote failed on the devices: {e}") from e
