"""How hard the elastic loop tries before it gives up: `RecoveryPolicy`.

This module owns the loop's retry budget, a frozen record passed in
explicitly. It is not `storage.retry.RetryPolicy`: that one backs off with
jitter between attempts at one request until a deadline; this one counts
recoveries in a row and polls the health check at a fixed interval.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RecoveryPolicy:
    """How hard the loop tries before it gives up with RecoveryFailedError.

    `max_attempts`: recoveries in a row without a completed step in between (a
    completed step after a recovery starts a new count). `max_wait_s`: total
    time one failure may spend waiting for enough healthy devices, polling every
    `poll_s`. `health_timeout_s`: how long a health check waits for a device's
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
