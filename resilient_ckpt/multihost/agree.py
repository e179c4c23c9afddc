"""Agreement between the processes of a job: one exchange of small views.

Every decision that must be the same on every process (which steps exist,
which one to restore, whether a restore worked, whether a save failed
anywhere) is made from the same exchanged data: each process puts its own
small JSON view in the `jax.distributed` key-value store under a key of this
round, then reads every other process's, with a timeout. A process that does
not answer in time raises `AgreementError` naming it, on every process that
waited, instead of a hang or a divergent branch.

Rounds are numbered per manager; the managers of one directory are told apart
by the order in which processes opened them (an atomic counter in the store),
so every process must open managers and call their collective methods in the
same order, as with Orbax. A round ends with a barrier, after which every
process has read every key: each deletes its own, and none is left reading
when another ends its program.
With one process there is nothing to exchange and no store is used.

After a process of the job is lost (its host is gone and the survivors go on
in-process, `elastic.survivors`), `set_live` names the processes still
running: every exchange and barrier from then on is among them only, in the
order of their jax process indices, which stay those of jax. A process's
`rank` among them labels the shares it writes from then on (`rank` of
`size`), so a save by the survivors reads like a save by a smaller job.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import jax

from ..errors import AgreementError

_ROOT = "resilient_ckpt"


class Peers:
    """This process's place in the job, and `exchange` among all of it."""

    def __init__(self, directory: str, timeout_s: float = 600.0, *,
                 job: tuple[Any, int, int] | None = None):
        """`job`: (client, index, count) of a simulated job (a
        `testing.kvservice` client); default: jax.distributed's."""
        if job is None:
            self.index, self.count = jax.process_index(), jax.process_count()
        else:
            self.index, self.count = job[1], job[2]
            if not 0 <= self.index < self.count:
                raise ValueError(f"simulated process {self.index} is not in a job of "
                                 f"{self.count}")
        self.live: tuple[int, ...] = tuple(range(self.count))  # jax indices, ascending
        self.timeout_s = timeout_s
        self._client: Any = None
        self._round = 0
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
            digest = hashlib.sha256(directory.encode()).hexdigest()[:16]
            opened = self._client.key_value_increment(f"{_ROOT}/open/{digest}", 1)
            self.token = f"{digest}.{(int(opened) - 1) // self.count}"

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
        """From now on, exchange among `processes` (jax process indices) only.
        Every live process must call it with the same set at the same point."""
        live = tuple(sorted({int(q) for q in processes}))
        if self.index not in live or not set(live) <= set(range(self.count)):
            raise ValueError(f"live processes {list(live)} must include this process "
                             f"({self.index}) and lie in 0..{self.count - 1}")
        self.live = live

    def exchange(self, what: str, view: Any) -> list[Any]:
        """Every live process's `view` (JSON-able), in the order of `live`
        (the order of process indices); a collective."""
        if len(self.live) == 1:
            return [view]
        k = self._round
        self._round += 1
        prefix = f"{_ROOT}/x/{self.token}/{k}/"
        self._client.key_value_set(prefix + str(self.index), json.dumps(view))
        out: list[Any] = []
        for q in self.live:
            if q == self.index:
                out.append(view)
                continue
            try:
                raw = self._client.blocking_key_value_get(prefix + str(q),
                                                          int(self.timeout_s * 1000))
            except Exception as e:  # noqa: BLE001 - the client's errors are untyped
                raise AgreementError(
                    f"process {q} of {self.count} did not answer within {self.timeout_s:g} s "
                    f"at {what} (round {k}): it is gone, or it did not make the same call; "
                    "every process must call save, restore, reload and "
                    "wait_until_finished in the same order") from e
            out.append(json.loads(raw))
        # Everyone has read everything before anyone goes on: a process that
        # finishes its program (process 0 ends the key-value service with it)
        # never leaves a peer reading, and each key can go at once.
        self._wait(f"{_ROOT}/b/{self.token}/{k}", what, k)
        self._client.key_value_delete(prefix + str(self.index))
        return out

    def _wait(self, barrier: str, what: str, k: int) -> None:
        some = list(self.live) if len(self.live) < self.count else None
        try:
            self._client.wait_at_barrier(barrier, int(self.timeout_s * 1000), process_ids=some)
        except Exception as e:  # noqa: BLE001 - the client's errors are untyped
            raise AgreementError(
                f"not every one of {len(self.live)} processes finished {what} (round {k}) "
                f"within {self.timeout_s:g} s: one is gone") from e
