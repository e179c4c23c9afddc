"""How hard the elastic loop tries before it gives up: `RecoveryPolicy`.

This module owns the loop's retry budget, a frozen record passed in
explicitly. It is not `storage.retry.RetryPolicy`: that one backs off with
jitter between attempts at one request until a deadline; this one counts
recoveries without progress and polls the health check at a fixed interval.

Progress is a completed step above the highest step completed before the
failure. A step replayed after a restore is not progress: restore step 6,
complete step 7 again, fail at step 8 again, and the count goes on. So a
failure that comes back at the same step, whatever the error says, ends with
RecoveryFailedError after `max_attempts` recoveries. That is also what
bounds the ambiguous errors (DEADLINE_EXCEEDED, NOT_FOUND, INTERNAL): they
stay recoverable (a lost slice may report itself so, and be back by the time
of the health check), and a deterministic bug reported as one of them fails
at the same step after each restore until the attempts run out; the error
then says that no device was lost.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    """How hard the loop tries before it gives up with RecoveryFailedError.

    `max_attempts`: recoveries without progress (the count starts again only
    when a step above the highest one completed before the failure
    completes; replayed steps do not count). `max_wait_s`: total time the
    failures of one such run may spend waiting for enough healthy devices,
    polling every `poll_s`. `health_timeout_s`: how long a health check waits for a device's
    answer. `min_devices`: the smallest mesh worth training on.
    """

    max_attempts: int = 3
    max_wait_s: float = 300.0
    poll_s: float = 1.0
    health_timeout_s: float = 10.0
    min_devices: int = 1

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_wait_s < 0 or self.poll_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError("max_wait_s must be >= 0, poll_s and health_timeout_s > 0")
        if self.min_devices < 1:
            raise ValueError(f"min_devices must be at least 1, got {self.min_devices}")
