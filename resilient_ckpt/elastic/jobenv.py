"""What a process of a supervised job reads from its environment, and what it reports back.

This module owns the launch contract between `elastic.supervisor` (or any
launcher that sets the same variables) and the training script: the names of
the environment variables, `JobEnv` (the values read once, explicitly, by
`from_env`), `initialize`, which forms the `jax.distributed` job from them (and
says whether SIGTERM ends the process),
and `report`, which appends a progress line (a step done, a restore) to the
file the supervisor watches. Nothing else in the package reads these
variables; without them `initialize` leaves the job's shape to jax's own
cluster detection (GKE, Cloud TPU, Slurm, MPI), so one script runs under the
local supervisor and under a real scheduler alike.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

COORDINATOR = "RESILIENT_CKPT_COORDINATOR"      # host:port of process 0's coordinator
NUM_PROCESSES = "RESILIENT_CKPT_NUM_PROCESSES"  # processes in the job
PROCESS_ID = "RESILIENT_CKPT_PROCESS_ID"        # this process, 0 .. n-1
ATTEMPT = "RESILIENT_CKPT_ATTEMPT"              # 0 at the first launch, +1 per relaunch
STATUS = "RESILIENT_CKPT_STATUS"                # a file to append progress lines to
NAMES = (COORDINATOR, NUM_PROCESSES, PROCESS_ID, ATTEMPT, STATUS)


@dataclasses.dataclass(frozen=True)
class JobEnv:
    """The launch contract as this process got it. `coordinator`,
    `num_processes` and `process_id` are None when no launcher set them (a
    real scheduler: jax detects them); `status` is None when nobody watches."""
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    attempt: int = 0
    status: str | None = None

    @property
    def supervised(self) -> bool:
        return self.coordinator is not None


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number; the launcher that "
                         "started this process set it wrong") from None


def from_env(env: Mapping[str, str] | None = None) -> JobEnv:
    """The contract from `env` (default: os.environ). The coordinator, the
    process count and the process id come together or not at all."""
    env = os.environ if env is None else env
    job = JobEnv(coordinator=env.get(COORDINATOR) or None,
                 num_processes=_int(env, NUM_PROCESSES), process_id=_int(env, PROCESS_ID),
                 attempt=_int(env, ATTEMPT) or 0, status=env.get(STATUS) or None)
    given = [job.coordinator is not None, job.num_processes is not None,
             job.process_id is not None]
    if any(given) and not all(given):
        raise ValueError(f"{COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} must be set "
                         f"together; got {job}")
    if job.supervised:
        n, i = job.num_processes, job.process_id
        assert n is not None and i is not None  # checked above
        if not 0 <= i < n:
            raise ValueError(f"{PROCESS_ID}={i} is not in [0, {NUM_PROCESSES}={n})")
    return job


def initialize(job: JobEnv | None = None, *, end_on_sigterm: bool | None = None,
               **kwargs: Any) -> JobEnv:
    """Forms the jax.distributed job. With the supervisor's variables set: from
    them (a job of one process skips it). Without: `jax.distributed.initialize(
    **kwargs)`, which finds the job's shape itself on a cluster it knows (GKE
    and Cloud TPU, Slurm, Open MPI) or from `kwargs` and JAX_COORDINATOR_ADDRESS,
    and raises elsewhere. Call it before any device is used; `kwargs` also go
    to the supervised call (timeouts, for instance). Returns the contract used.

    `end_on_sigterm`: jax.distributed catches SIGTERM as a preemption notice
    (what `multihost_utils.reached_preemption_sync_point` reads), so the
    process goes on until SIGKILL. True gives SIGTERM back its default, ending
    the process at once: a scheduler's or the supervisor's "this launch is
    over" then takes milliseconds instead of the whole grace period (committed
    steps are whole; a write in flight is never committed, its leftovers are
    swept). Default: True under the supervisor, False otherwise (keep jax's
    notice when the loop saves at the preemption sync point)."""
    import jax
    job = from_env() if job is None else job
    if not job.supervised:
        jax.distributed.initialize(**kwargs)
    elif job.num_processes != 1:
        jax.distributed.initialize(coordinator_address=job.coordinator,
                                   num_processes=job.num_processes,
                                   process_id=job.process_id, **kwargs)
    if end_on_sigterm is None:
        end_on_sigterm = job.supervised
    if end_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # after jax installed its notifier
    return job


def report(job: JobEnv, event: str, step: int, **fields: Any) -> None:
    """Appends one progress line to the status file, if the launcher gave one:
    {"event": event, "step": step, "t": time.time(), ...fields}. Events the
    supervisor reads: "restored" (the step a restore returned) and "step" (a
    step done, saved or not). One `write` per line, so a reader never sees a
    torn line from a process that was killed between two reports."""
    if job.status is None:
        return
    line = json.dumps({"event": event, "step": int(step), "t": time.time(), **fields},
                      default=str) + "\n"
    fd = os.open(job.status, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
