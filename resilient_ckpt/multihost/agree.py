"""Agreement between the processes of a job: small views in, one decision out.

Every decision that must be the same on every process (which steps exist,
which one to restore, whether a restore worked, whether a save failed
anywhere) is made by one pure rule over every process's small JSON view.
`Peers.decide` runs it in one of two protocols over the `jax.distributed`
key-value store:

- "gather" (the default): each process but the leader (the first live
  process) puts its view under a key of this round; the leader reads them,
  applies the rule once and puts the decision under one key, which every
  other process reads. 3N - 1 requests on the coordinator per round (N - 1
  views set and read, one decision set and read N - 1 times, and the
  leader's delete of the round before), bytes N views plus N decisions, and
  each process but the leader does two requests and parses one decision.
- "all-to-all": each process puts its view and reads every other's, then
  applies the rule itself; N(N + 2) requests and N^2 views' bytes. It is
  kept as the reference the gather protocol is checked against (same rule,
  same views: the same decision, `tests/multihost/test_kvservice.py`) and
  as the baseline of `bench/scale.py`.

Either way the decision crosses as JSON, so every process gets the same
value, and a process that does not answer in time raises `AgreementError`
naming it on every process that waited: the leader names the views it did
not get (in the decision it publishes instead, so the others name the same
process); a silent leader is named by every process waiting for its decision.

Rounds are numbered per manager; managers are told apart by the order in
which processes opened them (an atomic counter in the store, job-wide: the
processes may open different directories, e.g. each its own local one), so
every process must open managers and call their collective methods in the
same order, as with Orbax. The leader deletes the keys of the last round it
led once it has every view of the next (each was put after its process read
that decision; a round a device vote decided, `multihost.vote`, has no
keys); the last round's keys stay until the job ends.
With one process there is nothing to exchange and no store is used.

After a process of the job is lost (its host is gone and the survivors go on
in-process, `elastic.survivors`), `set_live` names the processes still
running: every round from then on is among them only, in the order of their
jax process indices, which stay those of jax. A process's `rank` among them
labels the shares it writes from then on (`rank` of `size`), so a save by the
survivors reads like a save by a smaller job.
"""
from __future__ import annotations

import concurrent.futures as futures
import json
import time
from collections.abc import Callable
from typing import Any

import jax

from ..errors import AgreementError

_ROOT = "resilient_ckpt"
PROTOCOLS = ("gather", "all-to-all")
_FAN_IN = 16  # the leader's concurrent waits for views not yet there

_GONE = '"lost"'  # a lost process's view, put by `abandon`
Rule = Callable[[list[Any]], Any]  # views in the order of `live` -> a JSON-able decision
Round = tuple[int, tuple[int, ...]]  # a round's number and its processes


class Peers:
    """This process's place in the job, and `decide` among all of it."""

    def __init__(self, timeout_s: float = 600.0, *,
                 job: tuple[Any, int, int] | None = None, protocol: str = "gather"):
        """`job`: (client, index, count) of a simulated job (a
        `testing.kvservice` client); default: jax.distributed's."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"agreement protocol {protocol!r}: use one of {PROTOCOLS}")
        if job is None:
            self.index, self.count = jax.process_index(), jax.process_count()
        else:
            self.index, self.count = job[1], job[2]
            if not 0 <= self.index < self.count:
                raise ValueError(f"simulated process {self.index} is not in a job of "
                                 f"{self.count}")
        self.live: tuple[int, ...] = tuple(range(self.count))  # jax indices, ascending
        self.timeout_s = timeout_s
        self.protocol = protocol
        self._client: Any = None
        self._round = 0
        self._led: int | None = None  # the last round this process led through the store
        self._waits: futures.ThreadPoolExecutor | None = None  # the leader's, for late views
        self.token = "solo"  # names this manager's keys (and probe files) in the job
        if self.count > 1:
            if job is not None:
                self._client = job[0]
            else:
                from jax._src import distributed
                self._client = distributed.global_state.client
            if self._client is None:
                raise AgreementError(
                    f"{self.count} processes but no jax.distributed client: call "
                    "jax.distributed.initialize() before opening a CheckpointManager")
            # The n-th manager every process opens is the same one, whatever
            # directory each gave it.
            opened = self._client.key_value_increment(f"{_ROOT}/open", 1)
            self.token = f"m{(int(opened) - 1) // self.count}"

    @property
    def many(self) -> bool:
        """Whether this is a job of several processes: what exists is decided by
        the job's protocol (shares, agreements), also for a lone survivor, whose
        tiers hold saves that the lost processes took part in (a save of two
        processes is whole in the survivor's RAM when it holds every replica)."""
        return self.count > 1

    @property
    def rank(self) -> int:
        """This process's position among the live processes: its writer label."""
        return self.live.index(self.index)

    @property
    def size(self) -> int:
        """How many processes are live: the writer count of a save made now."""
        return len(self.live)

    def set_live(self, processes: Any) -> None:
        """From now on, decide among `processes` (jax process indices) only.
        Every live process must call it with the same set at the same point."""
        live = tuple(sorted({int(q) for q in processes}))
        if self.index not in live or not set(live) <= set(range(self.count)):
            raise ValueError(f"live processes {list(live)} must include this process "
                             f"({self.index}) and lie in 0..{self.count - 1}")
        self.live = live

    def close(self) -> None:
        """Ends the leader's waiting threads, if any (the manager's close)."""
        waits, self._waits = self._waits, None
        if waits is not None:
            waits.shutdown(wait=False, cancel_futures=True)

    def reserve(self) -> Round:
        """The next round (its number and its processes), taken now, for a
        `decide` that runs later, off the training thread."""
        k = self._round
        self._round += 1
        return k, self.live

    def decide(self, what: str, view: Any, rule: Rule, at: Round | None = None) -> Any:
        """`rule` over every live process's `view` (JSON-able, in the order of
        `live`), the same JSON value on every process; a collective. `rule`
        must be a pure function of the views: it runs on one process only
        (the leader) or on each (all-to-all), and must give the same there.
        `at`: a round taken earlier with `reserve` (default: the next one)."""
        k, live = at or self.reserve()
        if len(live) == 1:
            return _through_json(rule([view]))
        if self.protocol == "all-to-all":
            return _through_json(rule(self._all_to_all(what, k, live, view)))
        return self._gather(what, k, live, view, rule)

    def barrier(self, what: str) -> None:
        """Returns once every live process has called it (a collective round
        that decides nothing): one request per process on the coordinator,
        where a `decide` costs three. A process that does not come raises
        `AgreementError` on every process that waited (with the service's
        own account of who did not)."""
        k, live = self.reserve()
        if len(live) > 1:
            self._barrier(what, k, live)

    def abandon(self, at: Round, lost: set[int]) -> None:
        """Ends round `at`, which the `lost` processes will never join, where
        the others may still wait in it (a save's agreement in the
        background when a host was lost): the leader puts a placeholder for
        each lost process's view, so the round ends at once, on every
        process, as one whose views did not all come."""
        k, live = at
        if len(live) == 1 or self.index != live[0]:
            return
        for q in sorted(lost & set(live)):
            try:
                self._client.key_value_set(self._prefix(k) + str(q), _GONE)
            except Exception:  # noqa: BLE001 - already there: that process did send it
                continue

    # ------------------------------------------------------------ protocols

    def _prefix(self, k: int) -> str:
        return f"{_ROOT}/x/{self.token}/{k}/"

    def _gather(self, what: str, k: int, live: tuple[int, ...], view: Any, rule: Rule) -> Any:
        prefix, leader = self._prefix(k), live[0]
        if self.index != leader:
            self._client.key_value_set(prefix + str(self.index), json.dumps(view))
            try:  # the leader waits timeout_s for the views, then decides
                raw = self._client.blocking_key_value_get(prefix + "d",
                                                          int(self.timeout_s * 2000))
            except Exception as e:  # noqa: BLE001 - the client's errors are untyped
                raise self._silent([leader], what, k, "its decision") from e
            out = json.loads(raw)
            if "missing" in out:
                raise self._silent(out["missing"], what, k, "its view")
            if "error" in out:
                raise AgreementError(f"process {leader} could not decide {what} (round {k}): "
                                     f"{out['error']}")
            return out["v"]
        # What has arrived, in one request; then the rest, each as it comes,
        # by a few concurrent waits (none of them past one deadline).
        got: dict[str, str | None] = {
            key.rsplit("/", 1)[-1]: raw for key, raw in self._client.key_value_dir_get(prefix)}
        late = [q for q in live[1:] if str(q) not in got]
        deadline = time.monotonic() + self.timeout_s

        def wait(q: int) -> str | None:
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                return self._client.blocking_key_value_get(prefix + str(q), left)
            except Exception:  # noqa: BLE001 - the client's errors are untyped
                return None
        if len(late) == 1:
            got[str(late[0])] = wait(late[0])
        elif late:
            if self._waits is None:  # kept: a round's own threads would cost the leader
                self._waits = futures.ThreadPoolExecutor(_FAN_IN, "rc-agree-wait")
            got.update((str(q), raw) for q, raw in zip(late, self._waits.map(wait, late),
                                                         strict=True))
        missing = [q for q in live[1:] if got[str(q)] in (None, _GONE)]
        if missing:
            self._client.key_value_set(prefix + "d", json.dumps({"missing": missing}))
            raise self._silent(missing, what, k, "its view")
        views = [view] + [json.loads(got[str(q)] or "") for q in live[1:]]
        try:
            decision = _through_json(rule(views))
        except Exception as e:
            self._client.key_value_set(prefix + "d",
                                       json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        self._client.key_value_set(prefix + "d", json.dumps({"v": decision}))
        if self._led is not None:  # every process put its view of round k after it
            # read the decision of the last round through the store (rounds a
            # vote decided, `core.summary`, left no keys)
            self._client.key_value_delete(self._prefix(self._led).rstrip("/"))
        self._led = k
        return decision

    def _silent(self, processes: list[int], what: str, k: int, thing: str) -> AgreementError:
        names = ", ".join(str(q) for q in processes)
        return AgreementError(
            f"process{'es' if len(processes) > 1 else ''} {names} of {self.count} did not "
            f"send {thing} within {self.timeout_s:g} s at {what} (round {k}): gone, or not "
            "making the same call; every process must call save, restore, reload and "
            "wait_until_finished in the same order")

    def _all_to_all(self, what: str, k: int, live: tuple[int, ...], view: Any) -> list[Any]:
        prefix = self._prefix(k)
        self._client.key_value_set(prefix + str(self.index), json.dumps(view))
        out: list[Any] = []
        for q in live:
            if q == self.index:
                out.append(view)
                continue
            try:
                raw = self._client.blocking_key_value_get(prefix + str(q),
                                                          int(self.timeout_s * 1000))
            except Exception as e:  # noqa: BLE001 - the client's errors are untyped
                raise self._silent([q], what, k, "its view") from e
            if raw == _GONE:
                raise self._silent([q], what, k, "its view")
            out.append(json.loads(raw))
        # Everyone has read everything before anyone goes on: a process that
        # finishes its program (process 0 ends the key-value service with it)
        # never leaves a peer reading, and each key can go at once.
        self._barrier(what, k, live)
        self._client.key_value_delete(prefix + str(self.index))
        return out

    def _barrier(self, what: str, k: int, live: tuple[int, ...]) -> None:
        some = list(live) if len(live) < self.count else None
        try:
            self._client.wait_at_barrier(f"{_ROOT}/b/{self.token}/{k}",
                                         int(self.timeout_s * 1000), process_ids=some)
        except Exception as e:  # noqa: BLE001 - the client's errors are untyped
            raise AgreementError(
                f"not every one of {len(live)} processes reached {what} (round {k}) "
                f"within {self.timeout_s:g} s: one is gone or not making the same call "
                f"({e})") from e


def _through_json(value: Any) -> Any:
    """The value as every process receives it: through JSON."""
    return json.loads(json.dumps(value))
