"""The collective points of a job of several processes: who decides, who waits.

With one process every method here is a thin pass-through. With several,
each is a collective every process makes at the same point of its program,
and every branch after it is taken from the same exchanged data:
- `open`: which file tiers every process sees (one directory for all, so
  only process 0 deletes and cleans there, and only the job's shards are
  written there) and which each has its own of (RAM, a local SSD);
- `start_save`: the save id (process 0's), background failures anywhere
  (raised on every process once the save has started, by `raise_failures`:
  an old failure never costs a new save), the views retention decides from;
- `finish` (`wait_until_finished`): failures anywhere, raised everywhere;
- `restore`: the candidate steps, and after each attempt whether every
  process restored its part; if any could not, all move to the next older
  step together (or all raise, for an explicit step or a bug);
- `set_live`: after a loss, the survivors go on among themselves: every
  collective above is among them from then on (`agree.Peers.set_live`).
Exchanged views come in the order of the live processes (`peers.live`).
"""
from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any

from .catalog.catalog import Catalog
from .core import manifest
from .core.selection import Choice
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DirectoryInUseError,
    SaveFailedError,
    StepNotFoundError,
    StorageError,
    TargetMismatchError,
)
from .multihost import peer_fill
from .multihost.agree import Peers
from .restore.assemble import Hole
from .restore.loop import restore_alone
from .save import tierrecord
from .save.saver import Saver

log = logging.getLogger("resilient_ckpt")


class Coordinator:
    """The manager's collective points (see the module docstring)."""

    def __init__(self, catalog: Catalog, saver: Saver, directory: str):
        self._catalog, self._saver, self._directory = catalog, saver, directory
        self.peers = catalog.peers
        self._started: set[int] = set()  # steps saved since the last agreement
        self._held: list[SaveFailedError] = []  # agreed failures raised after a save started

    def in_flight(self) -> set[int]:
        """Steps being written: this process's, or with several processes the
        ones any process was writing at the last agreement or started since."""
        if not self.peers.many:
            return self._saver.pending()
        return self._catalog.pending_anywhere() | self._started

    def _agree(self, what: str, extra: dict | None = None, failures: bool = True,
               hold: bool = False) -> list[dict]:
        """One agreement; with `failures`, background failures anywhere are
        handed over and raised on every process (`hold`: by `raise_failures`)."""
        errors = self._saver.take_errors() if failures else []
        views = self._catalog.agree(what, self._saver.pending(), [str(e) for e in errors],
                                    extra)
        self._started.clear()
        failed = [(self.peers.live[q], m) for q, m in self._catalog.agreed_errors()]
        if failed:
            err = _agreed_failure(errors, failed, self.peers.index, self.peers.size,
                                  self._directory)
            if not hold:
                raise err
            self._held.append(err)
        return views

    # ------------------------------------------------------------ collectives

    def open(self, writable: bool) -> None:
        """Tells shared tiers from per-host ones, then agrees on what exists."""
        if self.peers.many:
            if writable:
                _classify_tiers(self._catalog, self.peers)
            self._agree("open", failures=False)

    def refresh(self, what: str) -> None:
        """Agrees on what exists again (reload, restore)."""
        if self.peers.many:
            self._agree(what, failures=False)

    def set_live(self, processes: Any) -> None:
        """After a loss: every collective from now on among `processes` (jax
        process indices; every one of them calls this at the same point),
        from the tiers observed again; then they agree on what exists."""
        self.peers.set_live(processes)
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
        views = self._agree(f"save of step {step}", {"save_id": uuid.uuid4().hex,
                                                     "in_use": in_use and str(in_use)},
                            hold=True)
        refused = [(self.peers.live[q], v["in_use"]) for q, v in enumerate(views)
                   if v.get("in_use")]
        if refused:
            if in_use is not None:
                raise in_use
            q, msg = refused[0]
            raise DirectoryInUseError(f"process {q} of the job could not lock "
                                      f"{self._directory} for writing: {msg}")
        self._saver.run_retention()
        self._started.add(step)
        return str(views[0]["save_id"])

    def finish(self) -> None:
        """Waits for every background write here, then (with several processes)
        raises on every process a failure any of them had."""
        self._saver.wait_all()
        if self.peers.many:
            self._agree("wait_until_finished")
            futures.wait(self._saver.run_retention())
            self._agree("wait_until_finished (after retention)", failures=False)
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
        for s in candidates:
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
        raise StepNotFoundError(f"no step of {self._directory} is restorable on every "
                                f"process (tried {candidates})")

    def _try_step(self, step: int, attempt: Callable[..., Any]
                  ) -> tuple[Any, list, BaseException | None]:
        """This process's part of restoring `step`, and every process's
        failures, (kind, message) by process: empty when all worked."""
        choice = self._skeleton_if_none(step, self._catalog.choice(step))
        reported = []

        def settle(holes: dict[str, Hole]) -> dict[str, Any]:
            reported.append(True)
            return self._settle(step, holes)
        error: BaseException | None = None
        try:
            if choice is None:
                raise CorruptCheckpointError(f"process {self.peers.index} can read no copy "
                                             f"of step {step}")
            return attempt(choice, settle), [], None
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
        views = self.peers.exchange(f"restore of step {step}", {"failure": failure, "holes": []})
        return None, [(self.peers.live[q], v["failure"]) for q, v in enumerate(views)
                      if v["failure"]], error

    def _skeleton_if_none(self, step: int, choice: Choice | None) -> Choice | None:
        """Where this process can read nothing of `step` but a peer holds all of
        it, the step's records without chunks, from the first peer that has
        them: then every shard here is filled from the peers."""
        have = self.peers.exchange(f"restore of step {step} (who reads it)",
                                   {"has": choice is not None})
        if all(v["has"] for v in have) or not any(v["has"] for v in have):
            return choice
        first = next(q for q, v in enumerate(have) if v["has"])  # a position in peers.live
        doc = None
        if self.peers.rank == first and choice is not None:
            bare = dataclasses.replace(choice.manifest, items=tuple(
                dataclasses.replace(it, leaves=tuple(dataclasses.replace(lf, chunks=())
                                                     for lf in it.leaves))
                for it in choice.manifest.items))
            doc = manifest.to_json(bare).decode()
        doc = self.peers.exchange(f"restore of step {step} (its records)", doc)[first]
        if choice is not None:
            return choice
        m = manifest.parse(doc.encode(),
                           f"step {step}'s records from process {self.peers.live[first]}")
        return Choice(step, m.save_id, m.created, m, {})

    def _settle(self, step: int, holes: dict[str, Hole]) -> dict[str, Any]:
        """After this process read its part: every process's outcome, then the
        fill from peers of the shards some process could not read."""
        mine = sorted(w for w, h in holes.items() if not all(h.have.values()))
        views = self.peers.exchange(f"restore of step {step}", {"failure": None, "holes": mine})
        failures = [(self.peers.live[q], v["failure"]) for q, v in enumerate(views)
                    if v["failure"]]
        if failures:
            raise _Abandoned(failures)
        wanted = sorted(set().union(*(set(v["holes"]) for v in views)))
        if not wanted:
            return {}
        if not all(w in holes and peer_fill.can_fill(holes[w].array.sharding) for w in wanted):
            # The same on every process: the targets are the same.
            raise _Abandoned([(-1, ["fallback", f"{wanted} have shards no process read, "
                                                "and no replica axis to fill them from"])])
        arrays, ok = peer_fill.fill_all([(holes[w].array, holes[w].have) for w in wanted])
        filled = dict(zip(wanted, arrays, strict=True))
        views = self.peers.exchange(f"restore of step {step} (filled from peers)", {"ok": ok})
        short = [self.peers.live[q] for q, v in enumerate(views) if not v["ok"]]
        if short:
            raise _Abandoned([(q, ["fallback", "some of its shards are held by no process"])
                              for q in short])
        return filled

def _classify_tiers(catalog: Catalog, peers: Peers) -> None:
    """Marks a file tier that every process sees as shared; one that each
    has its own of stays per-host; anything between is an error."""
    tiers = [(n, st) for n, st in catalog.storages().items() if not st.shared]
    if not tiers:
        return
    probe = f".rc-probe.{peers.token}."
    for _, st in tiers:
        st.put(probe + str(peers.index), memoryview(b""))
    try:
        peers.exchange("open (probes written)", {})
        seen = {n: sorted(int(x[len(probe):]) for x in st.list("", starts_with=probe))
                for n, st in tiers}
        views = peers.exchange("open (probes seen)", seen)
    finally:
        for _, st in tiers:
            st.delete(probe + str(peers.index))
    everyone = set(peers.live)
    for n, st in tiers:
        sets = [set(v[n]) for v in views]
        if all(s == everyone for s in sets):
            st.shared = True
        elif any(s != {q} for q, s in zip(peers.live, sets, strict=True)):
            raise ValueError(
                f"the {n} tier ({st.url}) is seen by some processes but not all "
                f"(processes see {[sorted(s) for s in sets]}): give each process a "
                "directory of its own (e.g. RamTier(path=...) per process) or one that "
                "every process sees")


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


class _Abandoned(Exception):
    """Every process gives up a restore attempt (carries each one's failure)."""

    def __init__(self, failures: list):
        super().__init__(str(failures))
        self.failures = failures
