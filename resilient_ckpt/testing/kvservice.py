"""An in-process stand-in for jax.distributed's coordination service, for
simulating jobs of many processes (threads) on one machine.

`KeyValueService` holds the keys, barriers and counters of one job; its
`client(index)` answers the calls `multihost.agree.Peers` makes of jax's
coordination client (`key_value_set`, `blocking_key_value_get`,
`key_value_dir_get`, `key_value_delete`, `key_value_increment`,
`wait_at_barrier`), with the same failures: a key set twice, a get or a
barrier that times out. Every call is one request to the coordinator; the
service counts them and the bytes that cross, per process and in all, so the
cost of an agreement protocol at N processes is counted, not guessed.
`service_s` (the coordinator's time per request) and `per_byte_s` model the
coordinator: requests are served one at a time, as by one coordinator core;
`rtt_s` is what each request costs its caller beyond that (the client's and
the network's part of a round trip), paid by callers side by side.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence


class KeyValueService:
    """The keys, barriers and counters of one simulated job (see the module docstring)."""

    def __init__(self, count: int, service_s: float = 0.0, per_byte_s: float = 0.0,
                 rtt_s: float = 0.0):
        if count < 1 or min(service_s, per_byte_s, rtt_s) < 0:
            raise ValueError(f"a job of {count} processes at {service_s} s a request, "
                             f"{per_byte_s} s a byte and {rtt_s} s a round trip: give at "
                             "least 1 process and costs >= 0")
        self.count = count
        self.service_s, self.per_byte_s, self.rtt_s = service_s, per_byte_s, rtt_s
        self._cond = threading.Condition()
        self._serve = threading.Lock()  # one request served at a time
        self._keys: dict[str, str] = {}
        self._counters: collections.Counter = collections.Counter()
        self._arrived: dict[str, set[int]] = collections.defaultdict(set)
        self.requests: collections.Counter = collections.Counter()  # by process
        self.bytes: collections.Counter = collections.Counter()  # by process, both ways

    def client(self, index: int) -> Client:
        if not 0 <= index < self.count:
            raise ValueError(f"process {index} is not in a job of {self.count}")
        return Client(self, index)

    def totals(self) -> tuple[int, int]:
        """(requests, bytes) the coordinator has served so far."""
        with self._cond:
            return sum(self.requests.values()), sum(self.bytes.values())

    def reset_counts(self) -> None:
        with self._cond:
            self.requests.clear()
            self.bytes.clear()

    def _account(self, index: int, nbytes: int) -> None:
        with self._cond:
            self.requests[index] += 1
            self.bytes[index] += nbytes
        if self.service_s or self.per_byte_s:
            with self._serve:
                time.sleep(self.service_s + nbytes * self.per_byte_s)
        if self.rtt_s:
            time.sleep(self.rtt_s)

    # ------------------------------------------------------------ requests

    def set(self, index: int, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._account(index, len(key) + len(value))
        with self._cond:
            if key in self._keys and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} is set")
            self._keys[key] = value
            self._cond.notify_all()

    def get(self, index: int, key: str, timeout_ms: int) -> str:
        """The value of `key`, once it is set (TimeoutError after `timeout_ms`)."""
        deadline = time.monotonic() + timeout_ms / 1000
        with self._cond:
            while key not in self._keys:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"DEADLINE_EXCEEDED: key {key} not set in time")
                self._cond.wait(left)
            value = self._keys[key]
        self._account(index, len(key) + len(value))
        return value

    def dir_get(self, index: int, prefix: str) -> list[tuple[str, str]]:
        with self._cond:
            out = sorted((k, v) for k, v in self._keys.items() if k.startswith(prefix))
        self._account(index, len(prefix) + sum(len(k) + len(v) for k, v in out))
        return out

    def delete(self, index: int, key: str) -> None:
        """Deletes `key` and every key below it (`key/...`)."""
        self._account(index, len(key))
        below = key.rstrip("/") + "/"
        with self._cond:
            for k in [k for k in self._keys if k == key or k.startswith(below)]:
                del self._keys[k]

    def increment(self, index: int, key: str, increment: int) -> int:
        self._account(index, len(key) + 8)
        with self._cond:
            self._counters[key] += increment
            return self._counters[key]

    def barrier(self, index: int, barrier_id: str, timeout_ms: int,
                process_ids: Sequence[int] | None = None) -> None:
        """Returns once every process of `process_ids` (all: None) arrived;
        TimeoutError naming the missing ones after `timeout_ms`."""
        self._account(index, len(barrier_id))
        members = set(range(self.count)) if process_ids is None else set(process_ids)
        deadline = time.monotonic() + timeout_ms / 1000
        with self._cond:
            self._arrived[barrier_id].add(index)
            self._cond.notify_all()
            while not members <= self._arrived[barrier_id]:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(members - self._arrived[barrier_id])
                    raise TimeoutError(f"DEADLINE_EXCEEDED: barrier {barrier_id}: "
                                       f"processes {missing} did not arrive")
                self._cond.wait(left)


class Client:
    """One process's connection to a `KeyValueService`: jax's client calls."""

    def __init__(self, service: KeyValueService, index: int):
        self._service, self.index = service, index

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self._service.set(self.index, key, value, allow_overwrite)

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self._service.get(self.index, key, timeout_in_ms)

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return self._service.dir_get(self.index, prefix)

    def key_value_delete(self, key: str) -> None:
        self._service.delete(self.index, key)

    def key_value_increment(self, key: str, increment: int) -> int:
        return self._service.increment(self.index, key, increment)

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int,
                        process_ids: Sequence[int] | None = None) -> None:
        self._service.barrier(self.index, barrier_id, timeout_in_ms, process_ids)
