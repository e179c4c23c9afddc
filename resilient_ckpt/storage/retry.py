"""Retrying remote requests: which failures are transient, and how long to try.

A request is retried on HTTP 408, 429 and 5xx, on connection resets and
refusals, on timeouts, and on bodies cut short (as google-cloud-storage,
requests, botocore and aiohttp report them), until the request's deadline;
everything else (404, 403, 412, a bad request) is final at once. The waits
follow GCS's documented truncated exponential backoff: the bound starts at
`initial_s` (1 s), grows by `multiplier` (2) up to `max_delay_s` (32 s), and
each wait is drawn uniformly between the bound and `1 + jitter` times it, so
hosts throttled together do not come back together. A `Retry-After` header
on the answer (seconds, or an HTTP date) is honoured: the next attempt waits
at least that long; when it would fall past the deadline the request gives up
at once, saying so. The policy is a frozen record passed in explicitly.
"""
from __future__ import annotations

import dataclasses
import email.utils
import errno
import http.client
import logging
import random
import socket
import threading
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
    object that keeps moving is never cut). Between attempts the bound starts
    at `initial_s` and grows by `multiplier` up to `max_delay_s`; each wait
    is drawn uniformly from [bound, bound * (1 + jitter)], and is at least
    what a `Retry-After` header asked for. Tests may use small values."""

    deadline_s: float = 300.0
    attempt_timeout_s: float = 60.0
    initial_s: float = 1.0
    max_delay_s: float = 32.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self):
        if min(self.deadline_s, self.attempt_timeout_s, self.initial_s, self.max_delay_s) <= 0:
            raise ValueError(f"RetryPolicy times must be positive: {self}")
        if self.multiplier < 1:
            raise ValueError(f"RetryPolicy.multiplier must be >= 1, got {self.multiplier}")
        if self.jitter < 0:
            raise ValueError(f"RetryPolicy.jitter must be >= 0, got {self.jitter}")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after failed attempt number `attempt` (1 for the first)."""
        bound = min(self.initial_s * self.multiplier ** min(attempt - 1, 64), self.max_delay_s)
        return bound * (1 + (rng or random).uniform(0, self.jitter))


class Transient(Exception):
    """Raised by a request body to ask for another attempt (a short body, say)."""


def http_status(e: BaseException) -> int | None:
    """The HTTP status an exception carries, for the clients we use."""
    code = getattr(e, "code", None)  # google.api_core.exceptions.GoogleAPICallError
    if isinstance(code, int) and 100 <= code < 600:
        return code
    resp = getattr(e, "response", None)  # requests and resumable-media errors
    if isinstance(resp, dict):  # botocore's ClientError (S3 through s3fs)
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return status if isinstance(status, int) else None
    status = getattr(resp, "status_code", None)
    return status if isinstance(status, int) else None


def retry_after(e: BaseException, now: float | None = None) -> float | None:
    """Seconds the server asked us to wait (a `Retry-After` header on the
    answer `e` carries: delta-seconds or an HTTP date), or None."""
    headers = getattr(e, "headers", None)  # our own requests' errors (gcs_upload._Status)
    resp = getattr(e, "response", None)
    if headers is None and isinstance(resp, dict):  # botocore: lower-cased names
        headers = {k.title(): v for k, v in
                   resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).items()}
    if headers is None:
        headers = getattr(resp, "headers", None)  # the client's
    value = headers.get("Retry-After") if headers is not None else None
    if not isinstance(value, str) or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None  # malformed: back off as usual
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


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
    if _fsspec_transient(e):
        return True
    # A cause chain may hide the real failure (requests wraps urllib3 wraps socket).
    inner = e.__cause__ or e.__context__
    return inner is not None and inner is not e and is_transient(inner)


def _fsspec_transient(e: BaseException) -> bool:
    """Connection-level failures of the S3 (botocore, aiohttp) clients under
    s3fs; they do not derive from the builtin ConnectionError."""
    try:
        import botocore.exceptions as bx
        if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError,
                          bx.ResponseStreamingError)):
            return True
    except ImportError:
        pass
    try:
        import aiohttp
        if isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)):
            return True
    except ImportError:
        pass
    return False


def call(fn: Callable[[], T], policy: RetryPolicy, what: str,
         on_final: Callable[[BaseException], BaseException] | None = None) -> T:
    """`fn()` until it succeeds, a failure is final, or the deadline passes.

    Final failures go through `on_final` (which turns them into our errors);
    a deadline passed (or a `Retry-After` past it) raises
    StorageError(ETIMEDOUT) naming `what`, the number of attempts and the last
    failure, caused by it.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified right below
            if not is_transient(e):
                raise (on_final(e) if on_final else e) from e
            elapsed = time.monotonic() - start
            asked = retry_after(e)
            delay = max(policy.backoff(attempt), asked or 0.0)
            if elapsed + delay >= policy.deadline_s:
                why = (f"the server asked to retry after {asked:.0f} s (Retry-After), past "
                       "the deadline" if asked is not None and asked >= delay
                       else "the deadline was reached")
                raise StorageError(
                    errno.ETIMEDOUT,
                    f"{what}: gave up after {attempt} attempts over {elapsed:.1f} s: {why} "
                    f"({policy.deadline_s:g} s; last: {_short(e)}); check the network, the "
                    "bucket's quotas, or raise RetryPolicy.deadline_s") from e
            log.debug("%s: attempt %d failed (%s); retrying in %.2f s", what, attempt,
                      _short(e), delay)
            time.sleep(delay)


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}"


class Attempts:
    """`call`, counting every attempt (retries included): a backend's request
    count, for tests and records; safe from many threads."""

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T], policy: RetryPolicy, what: str,
             on_final: Callable[[BaseException], BaseException] | None = None) -> T:
        def attempt() -> T:
            with self._lock:
                self.count += 1
            return fn()
        return call(attempt, policy, what, on_final)
