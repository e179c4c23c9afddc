"""Retrying remote requests: which failures are transient, and how long to try.

A request is retried on HTTP 408, 429 and 5xx, on connection resets and
refusals, on timeouts, and on bodies cut short, with exponential backoff and
full jitter (so that hundreds of hosts throttled at once do not come back in
step), until the request's deadline. Everything else (404, 403, 412, a bad
request) is final at once. The policy is a frozen record passed in explicitly.
"""
from __future__ import annotations

import dataclasses
import errno
import http.client
import logging
import random
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import CheckpointError, StorageError

log = logging.getLogger("resilient_ckpt")
T = TypeVar("T")

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """`deadline_s`: total time one request may take over all its attempts;
    `attempt_timeout_s`: how long one attempt may wait for the server to
    connect or to send the next bytes (not the whole transfer, so a large
    object that keeps moving is never cut); backoff doubles from `initial_s`
    up to `max_delay_s`, each wait drawn uniformly below that bound."""

    deadline_s: float = 300.0
    attempt_timeout_s: float = 60.0
    initial_s: float = 0.1
    max_delay_s: float = 10.0
    multiplier: float = 2.0

    def __post_init__(self):
        if min(self.deadline_s, self.attempt_timeout_s, self.initial_s, self.max_delay_s) <= 0:
            raise ValueError(f"RetryPolicy times must be positive: {self}")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")


class Transient(Exception):
    """Raised by a request body to ask for another attempt (a short body, say)."""


def http_status(e: BaseException) -> int | None:
    """The HTTP status an exception carries, for the clients we use."""
    code = getattr(e, "code", None)  # google.api_core.exceptions.GoogleAPICallError
    if isinstance(code, int) and 100 <= code < 600:
        return code
    resp = getattr(e, "response", None)  # requests and resumable-media errors
    status = getattr(resp, "status_code", None)
    return status if isinstance(status, int) else None


def is_transient(e: BaseException) -> bool:
    if isinstance(e, CheckpointError):
        return False  # our own verdict, already final (retries exhausted inside, say)
    if isinstance(e, Transient) or type(e).__name__ == "DataCorruption":
        return True  # a checksum mismatch in transit: the same request may succeed
    status = http_status(e)
    if status is not None:
        return status in RETRYABLE_STATUS
    # Connection resets, refusals, timeouts and bodies cut short show up as any
    # of these, depending on where in the stack they were noticed.
    if isinstance(e, (ConnectionError, TimeoutError, socket.timeout, http.client.HTTPException)):
        return True
    try:
        import requests
        import urllib3
        if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                          requests.exceptions.ChunkedEncodingError,
                          requests.exceptions.ContentDecodingError,
                          urllib3.exceptions.HTTPError)):
            return True
    except ImportError:
        pass
    try:
        import google.auth.exceptions
        if isinstance(e, google.auth.exceptions.TransportError):
            return True
    except ImportError:
        pass
    # A cause chain may hide the real failure (requests wraps urllib3 wraps socket).
    inner = e.__cause__ or e.__context__
    return inner is not None and inner is not e and is_transient(inner)


def call(fn: Callable[[], T], policy: RetryPolicy, what: str,
         on_final: Callable[[BaseException], BaseException] | None = None) -> T:
    """`fn()` until it succeeds, a failure is final, or the deadline passes.

    Final failures go through `on_final` (which turns them into our errors);
    a deadline passed raises StorageError(ETIMEDOUT) naming `what`, the number
    of attempts and the last failure, caused by it.
    """
    start = time.monotonic()
    bound, attempt = policy.initial_s, 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified right below
            if not is_transient(e):
                raise (on_final(e) if on_final else e) from e
            elapsed = time.monotonic() - start
            delay = random.uniform(0, bound)
            if elapsed + delay >= policy.deadline_s:
                raise StorageError(
                    errno.ETIMEDOUT,
                    f"{what}: still failing after {attempt} attempts over {elapsed:.1f} s "
                    f"(last: {_short(e)}); check the network, the bucket's quotas, or "
                    "raise RetryPolicy.deadline_s") from e
            log.debug("%s: attempt %d failed (%s); retrying in %.2f s", what, attempt,
                      _short(e), delay)
            time.sleep(delay)
            bound = min(bound * policy.multiplier, policy.max_delay_s)


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}"
