"""The collective points of a job of several processes: who decides, who waits.

With one process every method here is a thin pass-through. With several,
each is a collective every process makes at the same point of its program,
and every branch after it is taken from the same exchanged data:
- `open`: what exists, and which file tiers every process sees (one directory for all, so
  only process 0 cleans there, each process deletes its part of a step's
  shares, and only the job's shards are
  written there) and which each has its own of (RAM, a local SSD);
- `start_save`: background failures anywhere (raised on every process once
  the save has started, by `raise_failures`: an old failure never costs a new
  save), the views retention decides from, a writer-lock refusal anywhere.
  The first save of a manager agrees before it starts (a refusal raises on
  every process, and the job's first save id is process 0's); once every
  process holds the lock, a save's agreement runs off the training thread
  (one background round at a time, `_pending`) and the save goes on with an
  id derived from the first one: its blocking time does not grow with the
  job. Every collective below first waits for that round and takes in what
  it decided, so the rounds keep one order on every process and every answer
  changes at the same point of every process's program (failures it found
  are raised by the next save, or by `finish`);
- `finish` (`wait_until_finished`): failures anywhere, raised everywhere;
- `restore`: the candidate steps, and after each attempt whether every
  process restored its part; if any could not, all move to the next older
  step together (or all raise, for an explicit step or a bug). Where the
  job has both tiers of its own per host and tiers it shares, each step is
  tried first from the hosts' own tiers, what a host lacks filled from its
  peers, and only then with the shared tiers too;
- `set_live`: after a loss, the survivors go on among themselves: every
  collective above is among them from then on (`agree.Peers.set_live`).
Exchanged views come in the order of the live processes (`peers.live`).

How a round travels: in a job that votes (`options.agreement_vote`; by
default from `vote.AUTO_FROM` processes on; after a loss, among the
survivors' devices), the rounds of saves after the first, of `finish`
and of reloads and restores are first put to the job's vote
(`_start_vote`, `_voted`): each process's view as a fixed vector
(`core.summary`), one all-reduce over the devices (`multihost.vote`),
dispatched where every process dispatches its training
programs, so in the same order everywhere. A restore's own rounds are
votes of a few numbers (`_small_vote`): whether some process lacks the step
and the first that has it; whether some process failed or left holes. What
a vote cannot decide (an irregular view, a failure or a hole anywhere,
which every process sees alike) and a vote that failed go through the
key-value store (`agree.Peers.decide`), which names a process that does
not answer. The open and a manager's first save always use the store; so
do, after a loss, the rounds whose views still speak of saves of the whole
job (irregular to a vote among the survivors) until retention drops them.
"""
from __future__ import annotations

import collections
import concurrent.futures as futures
import dataclasses
import hashlib
import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from .catalog.catalog import BESIDE_FIRST, Catalog, JobView, probe_view
from .core import manifest, summary
from .core.selection import Choice
from .errors import (
    AgreementError,
    CheckpointError,
    CorruptCheckpointError,
    DirectoryInUseError,
    SaveFailedError,
    StepNotFoundError,
    StorageError,
    TargetMismatchError,
)
from .multihost import peer_fill
from .multihost.agree import Round
from .multihost.vote import AUTO_FROM, DeviceVote
from .restore.assemble import Hole, Uncovered
from .restore.loop import restore_alone
from .save import tierrecord
from .save.saver import Saver
from .storage.base import Storage

log = logging.getLogger("resilient_ckpt")


class Coordinator:
    """The manager's collective points (see the module docstring)."""

    def __init__(self, catalog: Catalog, saver: Saver, directory: str,
                 vote: bool | None = None):
        self._catalog, self._saver, self._directory = catalog, saver, directory
        self.peers = catalog.peers
        self._started: set[int] = set()  # steps saved since the last agreement
        self._held: list[SaveFailedError] = []  # agreed failures raised after a save started
        self._first_id: str | None = None  # the job's first save id, once every lock is held
        self._saves = 0  # saves started by this manager (the same count on every process)
        # A save's agreement in the background, and the round it runs in.
        self._pending: tuple[futures.Future, Round] | None = None
        self._pool: futures.ThreadPoolExecutor | None = None
        # A save's agreement as one all-reduce on the devices (`_vote`, made at
        # first use), while every process of the job is live; the saves it speaks of.
        self._voting = vote if vote is not None else self.peers.count >= AUTO_FROM
        self._vote: DeviceVote | None = None
        self._recent: collections.deque = collections.deque(maxlen=8)  # (step, save id)
        self._cancel = threading.Event()  # set when the round under way is given up
        self.votes = 0  # agreements a vote decided (the rest went through the store)

    def in_flight(self) -> set[int]:
        """Steps being written: this process's, or with several processes the
        ones any process was writing at the last agreement or started since."""
        if not self.peers.many:
            return self._saver.pending()
        return self._catalog.pending_anywhere() | self._started

    def _agree(self, what: str, extra: dict | None = None, failures: bool = True,
               hold: bool = False, vote: bool = False) -> JobView:
        """One agreement; with `failures`, background failures anywhere are
        handed over and raised on every process (`hold`: by `raise_failures`).
        `vote`: by the job's vote where it can decide (`_voted`)."""
        self.settle()
        errors = self._saver.take_errors() if failures else []
        job = None
        if vote and extra is None and self._can_vote():
            job = self._voted(self._start_vote(what, errors))
            if job is not None and job.unsettled:  # its second round is the store's
                job = None
            if job is not None:
                self._catalog.install(job)
        if job is None:
            job = self._catalog.agree(what, self._saver.pending(), [str(e) for e in errors],
                                      extra)
        self._started.clear()
        self._take(job, errors, hold)
        return job

    def _take(self, job: JobView, errors: list[SaveFailedError], hold: bool) -> None:
        """Raises (or with `hold`, keeps for `raise_failures`) the failures `job` found."""
        failed = [(self.peers.live[q], m) for q, m in job.errors]
        if failed:
            err = _agreed_failure(errors, failed, self.peers.index, self.peers.size,
                                  self._directory)
            if not hold:
                raise err
            self._held.append(err)

    def settle(self) -> None:
        """Waits for the save agreement running in the background, if any, and
        takes in what it decided: the agreed view, its failures, retention
        from it (before every collective, and before a delete, which it must
        not undo)."""
        if self._pending is None:
            return
        (pending, _), self._pending = self._pending, None
        job, errors, step = pending.result()  # an AgreementError raises here, on every process
        self._catalog.install(job)
        self._started = {step}  # its views may predate this save's start
        self._take(job, errors, hold=True)
        if job.unsettled:  # saves spread over peers: the second round, here
            self._agree(f"save of step {step} (saves no share makes whole)", failures=False)
            self._started.add(step)
        self._saver.run_retention()

    def _in_background(self, step: int, at: Round, vote: tuple | None
                       ) -> tuple[JobView, list[SaveFailedError], int]:
        errors = self._saver.take_errors() if vote is None else vote[2]
        job = None if vote is None else self._voted(vote)
        if job is None:  # the store: no vote, an irregular view, or a failed vote
            job = self._catalog.agree(f"save of step {step}", self._saver.pending(),
                                      [str(e) for e in errors], at=at)
        return job, errors, step

    def _can_vote(self) -> bool:
        """Whether the job votes (the option is on and more than one process
        is live: the same answer on every process). After a loss the vote is
        among the survivors' devices (`set_live` drops the old one); views
        that still speak of saves by the job before the loss are irregular
        (`summary.encode`), so those rounds go through the store until
        retention has dropped those saves."""
        return self._voting and self.peers.many

    def _start_vote(self, what: str, errors: list[SaveFailedError]) -> tuple:
        """On the calling thread, at a point every process reaches (a save,
        `wait_until_finished`, a reload): this process's vector dispatched to
        the job's all-reduce (`core.summary`, `multihost.vote`), with what
        `_voted` decides from."""
        candidates = sorted(set(self._catalog.agreed_saves())
                            | {(s, sid, self.peers.size) for s, sid in self._recent})
        view = self._catalog.report(self._saver.pending(), [str(e) for e in errors])
        row = summary.encode(view, candidates, self._catalog.names, self.peers.rank,
                             self.peers.size)
        return self._dispatch(what, row), candidates, errors, view["orbax"], what

    def _dispatch(self, what: str, row: np.ndarray) -> Any:
        """`row` sent to the job's all-reduce: its future result, or the
        AgreementError of a vote that could not start."""
        if self._vote is None:
            self._vote = DeviceVote(self.peers.live, summary.WIDTH)
        try:  # the first vote of a job also joins every process's devices: it waits for them
            return self._vote.start(row)
        except Exception as e:  # noqa: BLE001 - jax's runtime errors are untyped
            return AgreementError(f"{what}: the job's vote could not start: {e}")

    def _reduced(self, result: Any, what: str) -> np.ndarray | None:
        """The job's maximum of every process's row; None where the vote failed
        here (the store's round then names a process that does not answer). A
        vote given up after a loss (`set_live`) raises."""
        cancel = self._cancel
        try:
            if isinstance(result, Exception):
                raise result
            return DeviceVote.wait(result, what, self.peers.timeout_s, cancel)
        except AgreementError as e:
            if cancel.is_set():
                raise
            log.warning("%s; agreeing through the store instead", e)
            return None

    def _voted(self, vote: tuple) -> JobView | None:
        """What the job's vote decided; None where the job agrees through the
        store instead: some view was irregular (every process sees that), or
        the vote failed here."""
        result, candidates, _, orbax, what = vote
        reduced = self._reduced(result, what)
        decided = None if reduced is None else summary.decide(reduced, candidates,
                                                              self._catalog.names, orbax)
        if decided is None:
            return None
        self.votes += 1
        return JobView.from_json(decided)

    def _small_vote(self, what: str, row: np.ndarray) -> np.ndarray | None:
        """A restore's round of a few numbers from each process
        (`summary.reader_row`, `outcome_row`) by the job's vote where the job
        votes: their maximum over every process; None where the round goes
        through the store instead."""
        return self._reduced(self._dispatch(what, row), what) if self._can_vote() else None

    def close(self) -> None:
        """Ends the background agreement thread (after `finish`)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.peers.close()

    # ------------------------------------------------------------ collectives

    def open(self, writable: bool) -> None:
        """The catalog's first reading, and with several processes the
        agreement on what exists. A writable manager first tells shared file
        tiers from per-host ones, before the catalog reads them (on a shared
        tier a process reads only its own shares): each process puts a probe
        in each, and after a barrier reports what it finds (`_sight`) in the
        open's round, which refuses a tier some processes share and others
        do not, on every process."""
        tiers = [(n, st) for n, st in self._catalog.storages().items()
                 if not st.shared] if self.peers.many and writable else []
        if not tiers:
            self._catalog.reload()
            if self.peers.many:
                self._agree("open", failures=False)
            return
        probe = f".rc-probe.{self.peers.token}."
        for _, st in tiers:
            st.put(probe + str(self.peers.index), memoryview(b""))
        try:
            self.peers.barrier("open (probes written)")
            sights = {n: self._sight(st, probe) for n, st in tiers}
            for n, st in tiers:  # what every process will find, unless the open raises
                st.shared = sights[n] in ("shared", BESIDE_FIRST)
            self._catalog.reload()
            job = self._agree("open", {"probes": {"process": self.peers.index,
                                                  "tiers": sights}}, failures=False)
        finally:
            for _, st in tiers:
                st.delete(probe + str(self.peers.index))
        for n, st in tiers:
            if job.tiers.get(n) not in ("shared", "own"):
                raise ValueError(
                    f"the {n} tier ({st.url}) is seen by some processes but not all "
                    f"({job.tiers.get(n)}): give each process a directory of its own (e.g. "
                    "RamTier(path=...) per process) or one that every process sees; a "
                    f"{probe}* file there that no open of this job is using was left by "
                    "a killed one and may be deleted")

    def _sight(self, st: Storage, probe: str) -> str | list[int]:
        """What this process reports of a tier's probes (`catalog.tier_kinds`):
        beside the first live process's probe, or what it lists there."""
        first = self.peers.live[0]
        if self.peers.index != first and st.size(probe + str(first)) is not None:
            return BESIDE_FIRST
        return probe_view((int(x[len(probe):]) for x in st.list("", starts_with=probe)
                           if x[len(probe):].isdigit()), self.peers.live, self.peers.index)

    def refresh(self, what: str) -> None:
        """Agrees on what exists again (reload, restore)."""
        if self.peers.many:
            self._agree(what, failures=False, vote=True)

    def set_live(self, processes: Any) -> None:
        """After a loss: every collective from now on among `processes` (jax
        process indices; every one of them calls this at the same point),
        from the tiers observed again; then they agree on what exists."""
        lost = set(self.peers.live) - {int(q) for q in processes}
        pending, self._pending = self._pending, None
        if pending is not None:
            self._cancel.set()  # a vote under way ends at once
            self.peers.abandon(pending[1], lost)  # its round ends at once everywhere
            try:
                job, errors, _ = pending[0].result()
            except Exception as e:  # noqa: BLE001 - a round the lost processes left unfinished
                log.info("the save agreement under way when processes %s were lost is "
                         "dropped: %s", sorted(lost), e)
            else:  # it ended before the loss: its failures still count
                self._take(job, errors, hold=True)
            self._cancel = threading.Event()
        self.peers.set_live(processes)
        self._vote = None  # the next vote is among the survivors' devices
        self._catalog.reload()  # the lost processes' last commits included
        self._started.clear()
        self.refresh("a change of the live processes")

    def start_save(self, step: int, in_use: DirectoryInUseError | None = None) -> str:
        """The id of a save of `step`, the same on every process (earlier failures:
        `raise_failures`). `in_use`, a writer-lock refusal anywhere, raises everywhere."""
        tierrecord.record(self._directory, self._catalog, in_use is None)  # for tools
        if not self.peers.many:
            if in_use is not None:
                raise in_use
            return uuid.uuid4().hex
        self._saves += 1
        if self._first_id is not None:  # every lock held: in_use is None everywhere
            self.settle()
            if self._pool is None:
                self._pool = futures.ThreadPoolExecutor(1, thread_name_prefix="rc-agree")
            at = self.peers.reserve()
            sid = hashlib.sha256(f"{self._first_id}:{self._saves}:{step}".encode()
                                 ).hexdigest()[:32]
            self._recent.append((step, sid))
            vote = (self._start_vote(f"save of step {step}", self._saver.take_errors())
                    if self._can_vote() else None)
            self._pending = self._pool.submit(self._in_background, step, at, vote), at
            self._started.add(step)
            return sid
        job = self._agree(f"save of step {step}", {"save_id": uuid.uuid4().hex,
                                                   "in_use": in_use and str(in_use)},
                          hold=True)
        refused = [(self.peers.live[q], m) for q, m in job.refusals]
        if refused:
            if in_use is not None:
                raise in_use
            q, msg = refused[0]
            raise DirectoryInUseError(f"process {q} of the job could not lock "
                                      f"{self._directory} for writing: {msg}")
        self._first_id = str(job.save_id)  # every process holds its lock from now on
        self._recent.append((step, self._first_id))
        self._saver.run_retention()
        self._started.add(step)
        return self._first_id

    def finish(self) -> None:
        """Waits for every background write here, then (with several processes)
        raises on every process a failure any of them had."""
        self._saver.wait_all()
        if self.peers.many:
            self._agree("wait_until_finished", vote=True)
            futures.wait(self._saver.run_retention())
            self._agree("wait_until_finished (after retention)", failures=False, vote=True)
        self.raise_failures()
        self._saver.raise_errors()

    def raise_failures(self) -> None:
        """Raises, once, earlier saves' failures: with several processes those
        the last save's agreement found; with one, all not yet raised."""
        if self._held:
            held, self._held = self._held, []
            raise SaveFailedError.listing(held)
        if not self.peers.many:
            self._saver.raise_errors()

    def restore(self, step: int | None, attempt: Callable[[Choice], Any]) -> Any:
        """Restores `step` (None: the newest that works) through `attempt`;
        with several processes, every process on the same step."""
        if not self.peers.many:
            return restore_alone(self._catalog, self._directory, step, attempt)
        agreed = self._catalog.steps()
        if step is not None and step not in agreed:
            raise StepNotFoundError(f"step {step} has no viable copy in {self._directory} "
                                    f"on every process; viable steps: {sorted(agreed)}")
        candidates = [step] if step is not None else sorted(agreed, reverse=True)
        # With tiers of its own per host and tiers it shares, own ones first.
        mixed = {st.shared for st in self._catalog.storages().values()} == {True, False}
        newest = ""  # why the newest step failed, for the error if every one does
        for s in candidates:
            out, failures, error = self._try_step(s, attempt, own_only=mixed)
            if failures and all(f[0] == "fallback" for _, f in failures) and mixed:
                log.info("step %d is not restorable from the hosts' own tiers and their "
                         "peers alone (%s); again with the tiers the whole job sees", s,
                         "; ".join(f"process {q}: {f[1]}" for q, f in failures))
                out, failures, error = self._try_step(s, attempt)
            if not failures:
                return out
            fatal = [(q, f) for q, f in failures if f[0] == "error"]
            if fatal:
                if error is not None:
                    raise error
                raise CheckpointError(f"process {fatal[0][0]} failed to restore step {s} "
                                      f"of {self._directory}: {fatal[0][1][1]}")
            said = "; ".join(f"process {q}: {f[1]}" for q, f in failures)
            if step is not None:
                raise CorruptCheckpointError(f"step {s} of {self._directory} cannot be "
                                             f"restored on every process ({said})")
            log.warning("step %d is not restorable on every process (%s); all fall back to "
                        "the next older viable step", s, said)
            # The newest step's reasons go with the error: one cause (a
            # target the saved shape does not fit) fails every step alike.
            newest = newest or f"step {s}: {said[:2000]}"
        raise StepNotFoundError(f"no step of {self._directory} is restorable on every "
                                f"process (tried {candidates}; {newest or 'none'})")

    def _try_step(self, step: int, attempt: Callable[..., Any], own_only: bool = False
                  ) -> tuple[Any, list, BaseException | None]:
        """This process's part of restoring `step`, and every process's
        failures, (kind, message) by process: empty when all worked.
        `own_only`: each process reads from its own tiers only, and what it
        lacks comes from its peers (`_settle`), not from the tiers the whole
        job sees: a lost host's share comes from its peers' RAM, device to
        device, before a shared tier (GCS) is read for it."""
        choice = self._skeleton_if_none(step, self._catalog.choice(step, own_only))
        reported = []
        narrowed = [choice is not None and self._catalog.narrowed(step, own_only)]

        def settle(holes: dict[str, Hole]) -> dict[str, Any]:
            if narrowed[0] and any(not all(h.have.values()) for h in holes.values()):
                raise _Narrowed()  # before any other process hears of this attempt
            reported.append(True)
            return self._settle(step, holes)
        error: BaseException | None = None
        try:
            if choice is None:
                raise CorruptCheckpointError(f"process {self.peers.index} can read no copy "
                                             f"of step {step}")
            return self._attempt(step, choice, attempt, settle, narrowed, own_only), [], None
        except _Abandoned as a:
            return None, a.failures, None
        except TargetMismatchError as e:
            failure, error = ["error", str(e)], e
        except (CorruptCheckpointError, StorageError, ValueError) as e:
            # ValueError: the chunks this process can read do not cover its part
            failure = ["fallback", str(e)]
        except Exception as e:  # noqa: BLE001 - reported to every process, then raised
            failure, error = ["error", f"{type(e).__name__}: {e}"], e
        if reported:  # failed after telling the others it had read its part
            raise error or CheckpointError(f"restore of step {step} failed: {failure[1]}")
        out = self._outcome(step, {"failure": failure, "holes": []})
        return None, [(self.peers.live[q], f) for q, f in out["failures"]], error

    def _attempt(self, step: int, choice: Choice, attempt: Callable[..., Any],
                 settle: Callable[[dict[str, Hole]], dict[str, Any]], narrowed: list[bool],
                 own_only: bool) -> Any:
        """attempt(choice, settle). Where `choice` holds the manifests of only
        some writers (`narrowed[0]`, `Catalog.narrowed`: those whose boxes
        this process's devices held at the save, or in a job of another
        shape none but its own) and the target needs boxes of others (a
        layout other than the save's), once more with the manifests of the
        writers whose saved boxes the target's overlap read in (the restore
        says which before it reads anything, `Uncovered`), and where that
        does not do, with every writer's: here alone, before the attempt's
        first round, so the job's rounds stay the same on every process."""
        wants: Any = None
        while True:
            try:
                return attempt(choice, settle)
            except (_Narrowed, ValueError) as e:
                if not narrowed[0] or isinstance(e, (TargetMismatchError,
                                                     CorruptCheckpointError)):
                    raise
                wants = e.wants if isinstance(e, Uncovered) and wants is None else False
            if wants:
                log.info("step %d: the target's layout is not the save's; process %d reads "
                         "the manifests of the writers that hold its boxes", step,
                         self.peers.index)
                got = self._catalog.choice(step, own_only, wants=wants)
            else:
                log.info("step %d: the target's layout is not the save's; process %d reads "
                         "every writer's manifest of it", step, self.peers.index)
                narrowed[0] = False
                got = self._catalog.choice(step, own_only, complete=True)
            if got is None:
                raise CorruptCheckpointError(f"process {self.peers.index} can read no copy "
                                             f"of step {step}")
            choice = got
            narrowed[0] = narrowed[0] and self._catalog.narrowed(step, own_only)

    def _skeleton_if_none(self, step: int, choice: Choice | None) -> Choice | None:
        """Where this process can read nothing of `step` but a peer holds all of
        it, the step's records without chunks, from the first peer that has
        them: then every shard here is filled from the peers."""
        what = f"restore of step {step} (who reads it)"
        has = choice is not None
        reduced = self._small_vote(what, summary.reader_row(has, self.peers.rank,
                                                            self.peers.size))
        if reduced is not None:
            self.votes += 1
            first = summary.first_reader(reduced, self.peers.size)
        else:  # a position in peers.live, or None: nothing to share
            first = self.peers.decide(what, {"has": has}, summary.first_reader_of)
        if first is None:
            return choice
        doc = None
        if self.peers.rank == first and choice is not None:
            bare = dataclasses.replace(choice.manifest, items=tuple(
                dataclasses.replace(it, leaves=tuple(dataclasses.replace(lf, chunks=())
                                                     for lf in it.leaves))
                for it in choice.manifest.items))
            doc = manifest.to_json(bare).decode()
        doc = self.peers.decide(f"restore of step {step} (its records)", doc,
                                lambda views: views[first])
        if choice is not None:
            return choice
        m = manifest.parse(doc.encode(),
                           f"step {step}'s records from process {self.peers.live[first]}")
        return Choice(step, m.save_id, m.created, m, {})

    def _settle(self, step: int, holes: dict[str, Hole]) -> dict[str, Any]:
        """After this process read its part: every process's outcome, then the
        fill from peers of the shards some process could not read."""
        mine = sorted(w for w, h in holes.items() if not all(h.have.values()))
        out = self._outcome(step, {"failure": None, "holes": mine})
        failures = [(self.peers.live[q], f) for q, f in out["failures"]]
        if failures:
            raise _Abandoned(failures)
        wanted = out["holes"]
        if not wanted:
            return {}
        if not all(w in holes and peer_fill.can_fill(holes[w].array.sharding) for w in wanted):
            # The same on every process: the targets are the same.
            raise _Abandoned([(-1, ["fallback", f"{wanted} have shards no process read, "
                                                "and no replica axis to fill them from"])])
        arrays, ok = peer_fill.fill_all([(holes[w].array, holes[w].have) for w in wanted])
        filled = dict(zip(wanted, arrays, strict=True))
        short = [self.peers.live[q] for q in self.peers.decide(
            f"restore of step {step} (filled from peers)", {"ok": ok},
            lambda views: [q for q, v in enumerate(views) if not v["ok"]])]
        if short:
            raise _Abandoned([(q, ["fallback", "some of its shards are held by no process"])
                              for q in short])
        return filled

    def _outcome(self, step: int, view: dict) -> dict:
        """A restore attempt's round: every process's failure and the holes it
        left. By a vote where the job votes, which decides when every process
        read its part whole; a failure or a hole anywhere (every process sees
        the same maximum) and the round goes through the store with the views."""
        what = f"restore of step {step}"
        reduced = self._small_vote(what, summary.outcome_row(bool(view["failure"]),
                                                             bool(view["holes"])))
        if reduced is not None and not reduced[0]:
            self.votes += 1
            return {"failures": [], "holes": []}
        return self.peers.decide(what, view, _outcomes)


def _outcomes(views: list[dict]) -> dict:
    """A restore round's rule: each failure by position, and the union of holes."""
    return {"failures": [(q, v["failure"]) for q, v in enumerate(views) if v["failure"]],
            "holes": sorted(set().union(*(set(v["holes"]) for v in views)))}


def _agreed_failure(errors: list[SaveFailedError], failed: list[tuple[int, str]],
                    index: int, count: int, directory: str) -> SaveFailedError:
    """One error for the failures a job agreed on: this process's own as they
    are, with every other process's listed beside them."""
    if errors and all(q == index for q, _ in failed):
        return SaveFailedError.listing(errors)
    err = SaveFailedError(f"background saves of {directory} failed on "
                          f"{len({q for q, _ in failed})} of {count} processes: "
                          + "; ".join(f"process {q}: {m}" for q, m in failed))
    if errors:
        mine = SaveFailedError.listing(errors)
        err.failures, err.__cause__ = mine.failures or (mine,), mine
    return err


class _Narrowed(Exception):
    """A restore attempt needs boxes of writers whose manifests this process
    did not read (`Coordinator._attempt`); never leaves this process."""


class _Abandoned(Exception):
    """Every process gives up a restore attempt (carries each one's failure)."""

    def __init__(self, failures: list):
        super().__init__(str(failures))
        self.failures = failures
