"""The catalog: what each tier holds, and which steps are viable, as this
process knows it.

It keeps one view per tier (step -> `TierStep`, from `tier_steps.observe` at open
and on `reload`, then updated after each of this process's own commits and
deletes; on a tier the whole job sees, a process other than the first live
one knows only its own manifests of a step until it restores that step, and
then those of the writers its devices' boxes come from, or all), the
(tier, chunk) copies known to fail their checksums, the steps Orbax itself
wrote in the manager's directory, the metrics of steps still in
flight, and a cache of `selection.viable` over all of it. Retention's choice of
what a tier may delete is made here, from the same views.

With several processes, a process's views are only its own part of the
picture (its per-host tiers hold only its shares), so the answers every
process must give alike (which steps exist and are in flight, which a tier
keeps) come from a `JobView`: the shares every process reported at the last
`agree`, a collective made at open, `reload`, each started save, each
restore and `wait_until_finished`. Between two of them the answers do not
change, whatever the background writes do, so no process can branch on a
view the others do not share.

Locking, in one place: a single lock guards every field above. It is held only
for reads and updates of those fields and for the pure selection over them,
never across storage I/O (`reload` lists the tiers first, then swaps the views
in), and nothing is called out of the catalog while it is held, so callers may
hold locks of their own when they call in (the save machinery does).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

from ..compat import orbax_steps as legacy
from ..core import retention, selection, shares, writers
from ..core.layout import StepNaming
from ..core.manifest import Manifest
from ..core.retention import Retention
from ..multihost.agree import Peers, Round
from ..storage.base import Storage
from . import tier_steps


class JobView:
    """What the job decided at one agreement, the same on every process: the
    agreed saves, the steps in flight anywhere, background failures (by
    position in `peers.live`), the Orbax steps every process sees, the saves
    a second round asks about (`unsettled`), a save's id and writer-lock
    refusals, and at the open the kind of each file tier (`tier_kinds`).
    `decided` makes it from every process's view (the rule of
    `Peers.decide`), `to_json`/`from_json` carry it to the others."""

    def __init__(self, steps: dict[int, shares.AgreedStep], pending: set[int],
                 errors: list[tuple[int, str]], orbax: set[int], unsettled: list,
                 save_id: str | None = None, refusals: list[tuple[int, str]] | None = None,
                 tiers: dict[str, str] | None = None):
        self.steps, self.pending, self.errors = steps, pending, errors
        self.orbax, self.unsettled = orbax, unsettled
        self.save_id, self.refusals = save_id, refusals or []
        self.tiers = tiers or {}
        self._reports: list[list[shares.Share]] = []  # on the deciding process only
        self._orbax_all: set[int] = set()

    @classmethod
    def decided(cls, views: Sequence[dict]) -> JobView:
        reports = [[shares.Share.from_json(v) for v in x["shares"]] for x in views]
        steps = shares.agree(reports)
        pending: set[int] = set().union(*(set(x["pending"]) for x in views))
        orbax = set.intersection(*(set(x["orbax"]) for x in views))
        job = cls(steps, pending, [(q, e) for q, x in enumerate(views) for e in x["errors"]],
                  orbax - set(steps), shares.unsettled(reports, steps, pending),
                  views[0].get("save_id"),
                  [(q, str(x["in_use"])) for q, x in enumerate(views) if x.get("in_use")],
                  tier_kinds(views))
        job._reports, job._orbax_all = reports, orbax
        return job

    def cover(self, views: Sequence[dict]) -> JobView:
        """Adds the unsettled saves that the boxes every process can read
        (`shares.box_report`, exchanged in a second round) tile together.
        Only on the process that made this view with `decided`."""
        boxes = [x["boxes"] for x in views]
        for step, a in shares.covered(self._reports, self.unsettled, boxes).items():
            self.steps.setdefault(step, a)  # unsettled steps are newer than every agreed one
        self.orbax = self._orbax_all - set(self.steps)
        return self

    def to_json(self) -> dict:
        return {"steps": [[a.step, a.save_id, a.created, a.count, sorted(a.complete_in)]
                          for a in self.steps.values()],
                "pending": sorted(self.pending), "errors": self.errors,
                "orbax": sorted(self.orbax), "unsettled": [list(u) for u in self.unsettled],
                "save_id": self.save_id, "refusals": self.refusals,
                **({"tiers": self.tiers} if self.tiers else {})}  # (at an open only)

    @classmethod
    def from_json(cls, d: dict) -> JobView:
        steps = {int(v[0]): shares.AgreedStep(int(v[0]), str(v[1]), float(v[2]), int(v[3]),
                                              frozenset(v[4])) for v in d["steps"]}
        return cls(steps, set(d["pending"]), [(int(q), str(e)) for q, e in d["errors"]],
                   set(d["orbax"]), [(int(a), str(b), int(c)) for a, b, c in d["unsettled"]],
                   d["save_id"], [(int(q), str(m)) for q, m in d["refusals"]],
                   {str(n): str(k) for n, k in d.get("tiers", {}).items()})

    def complete_in(self, tier: str) -> list[int]:
        """Steps that `tier` holds every process's share of, oldest first."""
        return sorted(s for s, a in self.steps.items() if tier in a.complete_in)

    def doomed(self, tier: str, own: set[int], keep: int | None, rule: Retention,
               metrics: dict[int, Any], pinned: frozenset[int],
               times: dict[int, float] | None = None) -> list[int]:
        """Retention from the agreed view, so every host keeps the same steps:
        only steps the tier holds every share of take slots; the newest such
        step and the newest viable one are kept (unless `rule.keep_newest`
        is False). Leftovers this host holds of
        steps older than every kept one (a save a peer never finished) go too,
        which bounds a per-host tier. `own`: the steps this host's copy of the
        tier holds; `pinned`: steps an upload here still reads; `times`: when
        each step's save started (for a preservation policy)."""
        complete = self.complete_in(tier)
        protected = frozenset((({max(self.steps)} if self.steps else set())
                               | ({complete[-1]} if complete else set()))
                              if rule.keep_newest else ())
        doomed = set(_to_delete(tier, complete, keep, rule, metrics, protected, times))
        kept = [s for s in complete if s not in doomed]
        if keep is not None and kept:
            doomed |= {s for s in own if s < kept[0] and s not in self.steps
                       and s not in self.pending}
        return sorted((doomed & own) - pinned)


class Catalog:
    """Tier views, bad copies and Orbax steps; `viable()` merges them."""

    def __init__(self, tiers: Sequence[tuple[str, Storage]], naming: StepNaming,
                 directory: str, home: Storage | None, peers: Peers,
                 devices: dict[int, int] | None = None):
        """`devices`: device id -> process index of every device of the job
        (default: jax.devices()'s)."""
        self._tiers = list(tiers)  # (name, storage), fastest first
        self.naming = self._naming = naming  # step directory names
        self._directory, self._home = directory, home
        self.peers = peers
        self._job = JobView.decided([_empty_view()])
        self._whole: dict[tuple[int, str, int], shares.Share | None] = {}
        self._intact: dict[tuple[str, int], tuple] = {}  # `_reported`'s, per (tier, step)
        self._lock = threading.Lock()
        self._views: dict[str, dict[int, selection.TierStep]] = {}
        self._partial: set[tuple[str, int]] = set()  # (tier, step): own manifest only, so far
        # (tier, step) -> save id: a partial view that holds every manifest of
        # that save this process's devices need (`_narrow`)
        self._narrowed: dict[tuple[str, int], str] = {}
        self._devices = devices
        self._orbax: set[int] = set()
        self._bad: set[tuple[str, str]] = set()
        self._cache: dict[int, selection.Choice] | None = None
        self._memo: dict = {}  # selection.viable's, per step: unchanged steps not judged again
        self._in_flight: dict[int, tuple[float, Any]] = {}  # step -> (created, metrics)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._tiers]

    def storages(self) -> dict[str, Storage]:
        return dict(self._tiers)

    @property
    def home(self) -> Storage | None:
        """The local tier at the manager's directory, where Orbax steps may be."""
        return self._home

    # ------------------------------------------------------------ reading tiers

    def reload(self) -> None:
        """Re-reads every tier (steps written by other processes appear).

        On a tier every process of a job sees, each process reads its own
        shares' manifests and those of its part of the writers (`_part`:
        the labels that are its rank modulo the job's size), and reports
        them (`_reported`): between them the job reads each manifest once,
        and a process reads the rest of a step only if it restores it
        (`choice`). A reload costs a process the same at any number of
        hosts: one manifest of a step in a job of the save's size (the first
        process read all N, 3.3 GB at 4,096 hosts of a 1,000-leaf state)."""
        views, partial = {}, set()
        for n, st in self._tiers:
            labels = self._own_labels(st)
            steps = tier_steps.listed_steps(st, self._naming)
            views[n] = tier_steps.observe(st, n, self._naming, labels, steps,
                                          self._part() if labels is not None else None)
            if labels is not None:
                partial |= {(n, s) for s in steps}
        orbax = legacy.orbax_steps(self._home, self._naming) if self._home else set()
        with self._lock:
            self._views, self._partial, self._narrowed = views, partial, {}
            self._orbax = orbax - {s for v in views.values() for s in v}
            self._cache = None

    def committed(self, tier: str, storage: Storage, m: Manifest) -> None:
        """Updates `tier`'s view with a manifest this process just committed.

        On a tier every process of a job sees, each process takes its own
        manifest alone (each reports its own share there at the next
        agreement), so a save costs a process the same at any number of
        hosts; it reads the others' only if it restores that step (`choice`),
        and every one at `reload` (a lost process's share included)."""
        job_wide = storage.shared and m.process_count > 1
        if storage.sizes_from_manifest or job_wide:
            # Our own manifest is all we need to know: reading every process's
            # back after every commit would cost hosts x hosts requests per step.
            with self._lock:
                old = self._views.get(tier, {}).get(m.step)
            others = tuple(x for x in (old.manifests if old else ())
                           if not (getattr(x, "process_index", None) == m.process_index
                                   and getattr(x, "save_id", None) == m.save_id))
            ts: selection.TierStep | None = tier_steps.tier_step(tier, others + (m,))
            if job_wide and not storage.sizes_from_manifest:
                with self._lock:
                    self._partial.add((tier, m.step))
        else:  # a file tier of this host: its other manifests (a save by
            # another job, or replicas) are read, ours taken as written
            ts = tier_steps.observe_step(storage, tier, self._naming, m.step, known=m)
        with self._lock:
            if ts is not None:
                self._views.setdefault(tier, {})[m.step] = ts
            self._narrowed.pop((tier, m.step), None)  # it may be another save's now
            self._cache = None

    def _own_labels(self, storage: Storage) -> set[int] | None:
        """The writer labels of this process's own shares on `storage` (its
        index, and its rank after a loss; its part besides, `_part`), or
        None: it reads all of them (a tier of its own, or a job of one)."""
        if storage.shared and self.peers.many:
            return {self.peers.index, self.peers.rank}
        return None

    def _part(self) -> tuple[int, int]:
        """(rank, size): this process reads and reports, on a tier the job
        shares, the shares of the writers whose label is its rank modulo
        the number of live processes; the live processes' parts cover every
        label of a save by any number of writers."""
        return self.peers.rank, self.peers.size

    def delete(self, tier: str, storage: Storage, step: int) -> None:
        """Forgets `step` in `tier` and deletes it there (on a tier the whole
        job sees, each live process its part of the shares,
        `tier_steps.delete_step`); a failed delete puts it back (it may be
        whole). Every process of a job deletes the same steps (retention is
        decided from the agreed view)."""
        with self._lock:
            views, self._cache = self._views, None
            old = views.get(tier, {}).pop(step, None)
            self._narrowed.pop((tier, step), None)
        part = (self.peers.rank, self.peers.size) if storage.shared and self.peers.many \
            else None
        known = [m for m in (old.manifests if old else ()) if isinstance(m, Manifest)
                 and m.process_index in {self.peers.index, self.peers.rank}]
        try:
            tier_steps.delete_step(storage, self._naming, step, part, known)
        except BaseException:
            with self._lock:
                if old is not None and self._views is views:  # no reload meanwhile
                    views.setdefault(tier, {}).setdefault(step, old)
                    self._cache = None
            raise

    def add_bad(self, pairs: Iterable[tuple[str, str]]) -> None:
        """(tier, chunk key) copies that failed a read: never selected again."""
        with self._lock:
            new = set(pairs) - self._bad
            if new:
                self._bad |= new
                self._cache = None

    def forget_bad(self) -> None:
        """Forgets the copies that failed a read, so the next selection sees
        the tiers as a reader opening them now would (a copy put right since,
        by a tool or by hand, counts again; one still damaged fails its read
        again and is marked again). The user's reload does this; the
        package's own reloads (a restore choosing again) keep the marks."""
        with self._lock:
            self._bad, self._cache = set(), None
            self._whole, self._intact = {}, {}

    def bad(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._bad)

    def invalidate(self) -> None:
        with self._lock:
            self._cache = None

    # ------------------------------------------------------------ what is viable

    def _observations(self) -> dict[int, list[selection.TierStep]]:
        merged: dict[int, list[selection.TierStep]] = collections.defaultdict(list)
        for name, _ in self._tiers:
            for step, ts in self._views.get(name, {}).items():
                merged[step].append(ts)
        return merged

    def viable(self) -> dict[int, selection.Choice]:
        """Every viable step of ours, with where to read each chunk (cached)."""
        with self._lock:
            if self._cache is None:
                self._cache = selection.viable(self._observations(), self.names,
                                               frozenset(self._bad), self._memo)
            return self._cache

    def viable_if_intact(self) -> dict[int, selection.Choice]:
        """What would be viable if no copy had failed its checksum."""
        with self._lock:
            return selection.viable(self._observations(), self.names)

    def why_not(self, step: int) -> str | None:
        """Why `step` is not viable here, in words (None: it is), naming the
        chunk (and its pack) or manifest at fault."""
        with self._lock:
            return selection.why_not(step, self._observations().get(step, []), self.names,
                                     frozenset(self._bad))

    def view(self, tier: str) -> dict[int, selection.TierStep]:
        with self._lock:
            return dict(self._views.get(tier, {}))

    def orbax_steps(self) -> set[int]:
        """Steps Orbax wrote in the directory (read-only to us); with several
        processes, those every process sees."""
        with self._lock:
            return set(self._job.orbax if self.peers.many else self._orbax)

    def delete_orbax(self, step: int) -> None:
        """Deletes a step Orbax wrote (they are only ever found in the home tier)."""
        assert self._home is not None
        self._home.delete_dir(self._naming.name(step))
        with self._lock:
            self._orbax.discard(step)

    # ------------------------------------------------------------ many processes

    def steps(self) -> set[int]:
        """The viable steps: this process's own answer with one process, the
        agreed one (the same on every process) with several."""
        if self.peers.many:
            with self._lock:
                return set(self._job.steps)
        return set(self.viable())

    def pending_anywhere(self) -> set[int]:
        """Steps some process was still writing at the last agreement."""
        with self._lock:
            return set(self._job.pending)

    def choice(self, step: int, own_only: bool = False, complete: bool = False,
               wants: writers.Wants | None = None) -> selection.Choice | None:
        """Where this process reads `step` from (None: not viable, or, with
        several processes, nothing of it readable here). `own_only`: from
        this host's own tiers only, not from those the whole job sees.

        On a tier the whole job sees, a process that knows only its own
        manifests of the step reads now those of the writers that hold the
        boxes its devices held when the step was saved (`_narrow`: a restore
        onto the same shape needs no other; a job of another shape reads
        none yet), and the choice is `partial`; with `wants` (a restore's
        target boxes, `restore.assemble.Uncovered`), those of the writers
        whose saved boxes the targets overlap too; where that cannot be told
        or `complete` is asked for, every writer's."""
        if not self.peers.many:
            return self.viable().get(step)
        shared = {n for n, st in self._tiers if st.shared} if own_only else set()
        with self._lock:
            agreed = self._job.steps.get(step)
            partial = {t for t, s in self._partial if s == step and t not in shared}
            if agreed is not None:  # a view read before every writer there committed
                narrowed = {t for (t, s), sid in self._narrowed.items()
                            if s == step and sid == agreed.save_id}
                partial |= {t for t, st in self._tiers if st.shared and t not in shared
                            and t in agreed.complete_in and t not in narrowed
                            and _writers(self._views.get(t, {}).get(step), agreed)
                            < agreed.count}
                partial = partial | narrowed if complete or wants else partial - narrowed
        for tier in sorted(partial):  # the other processes' manifests, read now
            self._read_others(tier, step, None if complete else agreed, wants)
        with self._lock:
            agreed = self._job.steps.get(step)
            views = [v[step] for t, v in self._views.items() if step in v and t not in shared]
            bad = frozenset(self._bad)
        if agreed is None:
            return None
        got = shares.readable(views, self.names, bad, step, agreed.save_id)
        if got is not None and self.narrowed(step, own_only):
            got = dataclasses.replace(got, partial=True)
        return got

    def narrowed(self, step: int, own_only: bool = False) -> bool:
        """Whether `choice(step, own_only)` holds only the writers this
        process's devices need of a tier (a restore onto another shape may
        need more: `choice(..., complete=True)`)."""
        shared = {n for n, st in self._tiers if st.shared}
        with self._lock:
            agreed = self._job.steps.get(step)
            return agreed is not None and any(
                s == step and sid == agreed.save_id and not (own_only and t in shared)
                for (t, s), sid in self._narrowed.items())

    def _read_others(self, tier: str, step: int, agreed: shares.AgreedStep | None,
                     wants: writers.Wants | None = None) -> None:
        """Reads other writers' manifests of `step` in `tier` into its view:
        those `_narrow` picks for the `agreed` save, else every one."""
        storage = self.storages()[tier]
        ts = self._narrow(tier, storage, step, agreed, wants) if agreed is not None else None
        narrow = ts is not None
        if ts is None:
            ts = tier_steps.observe_step(storage, tier, self._naming, step)
        with self._lock:
            if narrow and agreed is not None:
                self._narrowed[(tier, step)] = agreed.save_id
            else:
                self._partial.discard((tier, step))
                self._narrowed.pop((tier, step), None)
            if ts is not None:
                self._views.setdefault(tier, {})[step] = ts
            self._cache = None

    def _narrow(self, tier: str, storage: Storage, step: int, agreed: shares.AgreedStep,
                wants: writers.Wants | None) -> selection.TierStep | None:
        """`tier`'s view of `step` with the manifests of some writers of the
        `agreed` save read in beside the ones it holds (one writer's first,
        where it holds none): with `wants`, of the writers whose saved boxes
        those target boxes overlap (`writers.covering`); else of those that
        wrote the boxes this process's devices hold under the save's
        shardings (`writers.needed`, from this job's devices), or, in a job
        of another shape, none yet (the restore's targets will say,
        `restore.assemble.Uncovered`). None where that cannot be told or the
        manifests read do not list the boxes predicted: the caller reads
        every manifest."""
        with self._lock:
            old = self._views.get(tier, {}).get(step)

        def ours(ms: Any) -> dict[int, Manifest]:
            return {m.process_index: m for m in ms if isinstance(m, Manifest)
                    and m.save_id == agreed.save_id and m.process_count == agreed.count}
        have = ours(old.manifests if old else ())
        if not have:  # none of this save here yet: one writer's, for the records
            first = tier_steps.observe_step(storage, tier, self._naming, step,
                                            labels=[self.peers.rank % agreed.count])
            if first is None or not ours(first.manifests):
                return None
            old = first if old is None else selection.TierStep(
                tier, old.manifests + first.manifests, {**old.sizes, **first.sizes})
            have = ours(old.manifests)
        assert old is not None  # `have` came from it
        held = {m.process_index for m in old.manifests if isinstance(m, Manifest)}
        some = next(iter(have.values()))
        owners = self._owners(agreed.count)
        if wants is not None:
            wanted = writers.covering(some, wants)
        elif owners is not None:
            wanted = writers.needed(some, *owners)
        else:  # another shape: its targets tell which writers it needs
            wanted = {} if some.writers else None
        if wanted is None:
            return None
        labels = sorted(set(wanted) - held)
        more = tier_steps.observe_step(storage, tier, self._naming, step, labels=labels) \
            if labels else None
        got = more.manifests if more is not None else ()
        have.update(ours(got))
        if not writers.confirmed(wanted, have):
            return None
        return selection.TierStep(tier, old.manifests + got,
                                  {**old.sizes, **(more.sizes if more is not None else {})})

    def _owners(self, count: int) -> tuple[dict[int, int], set[int]] | None:
        """(device id -> writer label, this process's devices) for a save of
        `count` writers by this job: labelled by process index when the whole
        job wrote it, by rank among the live processes after a loss; None for
        a save by a job of another size."""
        if self._devices is None:
            self._devices = {int(d.id): int(d.process_index) for d in jax.devices()}
        live = self.peers.live
        if count == self.peers.count:
            label = {q: q for q in range(count)}
        elif count == len(live):
            label = {q: r for r, q in enumerate(live)}
        else:
            return None
        return ({d: label[q] for d, q in self._devices.items() if q in label},
                {d for d, q in self._devices.items() if q == self.peers.index})

    def agree(self, what: str, pending: set[int], errors: Sequence[str],
              extra: dict | None = None, at: Round | None = None) -> JobView:
        """Sends this process's view to the job's decision (a collective,
        `Peers.decide`) and keeps what the job decided; returns it. `extra`:
        `save_id` (the first process's is the save's) and `in_use` (a
        writer-lock refusal here). `at`: a round reserved on the training
        thread for an agreement in the background: one round only (no second
        round for `unsettled` saves), and what it decided is returned, not
        kept (`install`)."""
        view = self.report(pending, errors, extra)
        kept: list[JobView] = []  # the whole view, on the process that decides

        def first(views: list) -> dict:
            kept.append(JobView.decided(views))
            return kept[-1].to_json()
        job = JobView.from_json(self.peers.decide(what, view, first, at))
        if at is not None:
            return job
        if job.unsettled:  # decided from exchanged data: every process asks, or none
            with self._lock:
                obs, bad = self._observations(), frozenset(self._bad)
            report = shares.box_report(obs, self.names, bad, job.unsettled)
            job = JobView.from_json(self.peers.decide(
                f"{what} (boxes of saves no share makes whole)", {"boxes": report},
                lambda views: kept[-1].cover(views).to_json()))
        self.install(job)
        return job

    def report(self, pending: set[int], errors: Sequence[str],
               extra: dict | None = None) -> dict:
        """This process's view for an agreement (`agree`'s arguments): the
        shares it reports, the steps it is writing, its failures, its Orbax
        steps."""
        shared = {n for n, st in self._tiers if st.shared}
        with self._lock:
            obs, bad = self._observations(), frozenset(self._bad)
            orbax = sorted(self._orbax)
        self._whole = {k: v for k, v in self._whole.items() if k[0] in obs}
        self._intact = {k: v for k, v in self._intact.items() if k[1] in obs}
        mine = _reported(obs, bad, shared, self.peers, (self._whole, self._intact), self.names)
        return dict(_empty_view(), shares=[s.to_json() for s in mine], pending=sorted(pending),
                    errors=list(errors), orbax=orbax, **(extra or {}))

    def agreed_saves(self) -> list[shares.Save]:
        """The saves the last agreement counted or left unsettled:
        (step, save id, writer count), the same on every process."""
        with self._lock:
            job = self._job
        return sorted({(a.step, a.save_id, a.count) for a in job.steps.values()}
                      | set(job.unsettled))

    def install(self, job: JobView) -> None:
        """From now on, answer from `job` (what an agreement decided)."""
        with self._lock:
            self._job = job

    def forget(self, step: int) -> None:
        """Drops a deleted step from the agreed view too (delete is collective)."""
        with self._lock:
            self._job.steps.pop(step, None)

    # ------------------------------------------------------------ metrics

    def note_in_flight(self, step: int, created: float, metrics: Any) -> None:
        with self._lock:
            self._in_flight[step] = (created, metrics)

    def forget_in_flight(self, step: int) -> None:
        with self._lock:
            self._in_flight.pop(step, None)

    def metrics_of(self, step: int) -> Any:
        if step in self.orbax_steps():
            return legacy.metrics(self._directory, self._naming, step)
        c = self.choice(step)
        if c is not None:
            return c.manifest.metrics
        with self._lock:
            return self._in_flight.get(step, (0.0, None))[1]

    def created(self, step: int) -> float | None:
        """When `step`'s save started (seconds since the epoch); for a step Orbax
        wrote, when its commit file was written; None when unknown."""
        if step in self.orbax_steps():
            path = os.path.join(self._directory, self.naming.name(step),
                                legacy.ORBAX_COMMIT_FILE)
            return os.path.getmtime(path) if os.path.exists(path) else None
        c = self.choice(step)
        if c is not None:
            return c.created
        with self._lock:
            return self._in_flight[step][0] if step in self._in_flight else None

    # ------------------------------------------------------------ retention

    def doomed(self, tier: str, keep: int | None, rule: Retention,
               pinned: frozenset[int]) -> list[int]:
        """The steps `tier` should delete now under `rule` and its `keep`."""
        if self.peers.many:
            return self._doomed_agreed(tier, keep, rule, pinned)
        with self._lock:
            own = dict(self._views.get(tier, {}))
            bad = frozenset(self._bad)
        viable = self.viable()
        # Only restorable steps take retention slots: a damaged step (bad manifest,
        # missing chunk) must not push a good older step out; it is left alone.
        steps = [s for s in sorted(own) if s in viable]
        # Kept besides: the newest step restorable at all, the newest restorable
        # from this tier alone (so GCS never loses its last complete step to one
        # that only the RAM tier can complete), and steps an upload is reading
        # (only the last with `keep_newest=False`, which asks for Orbax's rule alone).
        alone = selection.viable({s: [ts] for s, ts in own.items()}, [tier], bad)
        newest = ({max(viable)} if viable else set()) | ({max(alone)} if alone else set())
        protected = frozenset(set(pinned) | (newest if rule.keep_newest else set()))
        metrics = {s: c.manifest.metrics for s, c in viable.items()}
        return _to_delete(tier, steps, keep, rule, metrics, protected,
                          {s: c.created for s, c in viable.items()})

    def _doomed_agreed(self, tier: str, keep: int | None, rule: Retention,
                       pinned: frozenset[int]) -> list[int]:
        with self._lock:
            job, own = self._job, set(self._views.get(tier, {}))
        metrics, times = {}, {}
        # Reading each step's manifests back: only for a best_fn or a preservation policy.
        for s in job.complete_in(tier) if rule.best_fn or tier in rule.policy_tiers else ():
            c = self.choice(s)
            if c is not None:
                times[s], metrics[s] = c.created, c.manifest.metrics
        return job.doomed(tier, own, keep, rule, metrics, pinned, times)


def _to_delete(tier: str, steps: Sequence[int], keep: int | None, rule: Retention,
               metrics: dict[int, Any], protected: frozenset[int],
               times: dict[int, float] | None) -> list[int]:
    """`retention.to_delete` under `rule` for `tier` (its policy, if it governs the tier)."""
    return retention.to_delete(
        steps, keep, keep_period=rule.keep_period, best_fn=rule.best_fn,
        best_mode=rule.best_mode, metrics=metrics,
        keep_checkpoints_without_metrics=rule.keep_without_metrics, protected=protected,
        policy=rule.policy if tier in rule.policy_tiers else None, times=times,
        keep_newest=rule.keep_newest)


def _writers(ts: selection.TierStep | None, agreed: shares.AgreedStep) -> int:
    """How many writers of the agreed save `ts` holds a manifest of."""
    return len({m.process_index for m in (ts.manifests if ts else ())
                if isinstance(m, Manifest) and m.save_id == agreed.save_id})


def _reported(obs: dict, bad: frozenset, shared: set[str], peers: Peers,
              caches: tuple[dict, dict], names: list[str]) -> list[shares.Share]:
    """The shares this process reports at an agreement. On a tier every
    process sees, each reports its own share (it knows its own commits;
    another's view of it may be older than the commit), labelled by its
    index, or by its rank for a save made after a loss (`Peers.set_live`),
    and those of its part of the writers (`Catalog._part`: a save by a job
    of another size, a lost process's share). `caches`: the whole copies'
    and the intact shares' (`_own_shares`)."""
    me = {peers.index, peers.rank}
    mine = _own_shares(caches[1], obs, bad, (peers.index, peers.rank, peers.size), lambda t, q: (
        t not in shared or q in me or q % peers.size == peers.rank))
    return mine + _whole_copies(caches[0], obs, names, bad, {(s.step, s.save_id) for s in mine})


def _own_shares(cache: dict, obs: dict, bad: frozenset, who: tuple[int, int, int],
                reports: Callable[[str, int], bool]) -> list[shares.Share]:
    """`shares.local_shares`, cached per (tier, step) while that tier's view
    of the step (replaced, never changed, on every commit and reload), the
    bad copies (which only grow) and this process's labels and part (`who`)
    stay the same: checking every chunk of every manifest it holds at every
    agreement would cost it chunks x steps per agreement."""
    out: set[shares.Share] = set()
    for step, views in obs.items():
        for ts in views:
            hit = cache.get((ts.tier, step))
            if hit is None or hit[0] is not ts or hit[1:3] != (len(bad), who):
                hit = (ts, len(bad), who, shares.local_shares({step: [ts]}, bad, reports))
                cache[(ts.tier, step)] = hit
            out.update(hit[3])
    return sorted(out)


def _whole_copies(cache: dict, obs: dict, names: list[str], bad: frozenset,
                  saves: set[tuple[int, str]]) -> list[shares.Share]:
    """The saves this process can read all of alone. Cached by (step, save,
    bad copies): committed chunks do not change, and a copy deleted since only
    makes a later restore fall back, on every process alike."""
    out = []
    for step, sid in sorted(saves):
        key = (step, sid, len(bad))
        if key not in cache:
            cache[key] = shares.whole_copy(obs[step], names, bad, step, sid)
        if cache[key] is not None:
            out.append(cache[key])
    return out


def _empty_view() -> dict:
    return {"shares": [], "pending": [], "errors": [], "orbax": []}


# ------------------------------------------------------------ which tiers are shared

# A process other than the first live one that finds the first one's probe in
# a tier is in its directory, and says only that: the first one's listing
# tells the rest. (Listing a shared directory of N probes on every host
# would read N^2 names from one file server.)
BESIDE_FIRST = "beside the first"


def probe_view(seen: Iterable[int], live: Sequence[int], me: int) -> str | list[int]:
    """What one process reports of a file tier from the probes it listed
    there (the job's process indices): "shared" when it sees every live
    process's probe, "own" when only its own, else the first few it saw (a
    few bytes whatever the job's size, so a round of them stays O(N))."""
    got = sorted(set(seen) & set(live))
    if got == sorted(live):
        return "shared"
    if got == [me]:
        return "own"
    return got[:8] + (["..."] if len(got) > 8 else [])  # type: ignore[list-item]


def tier_kinds(views: Sequence[dict]) -> dict[str, str]:
    """Per probed tier, from every process's sight of it (a view's
    "probes": {"process": its index, "tiers": tier -> `probe_view`, or
    `BESIDE_FIRST` from a process but the first}; the first view is the
    first live process's): "shared" (the first process sees every probe and
    every other process sees its probe), "own" (each sees its own only), or
    what is wrong (a few processes' sights, for the error every process
    raises)."""
    probed = [x.get("probes") for x in views]
    names = sorted({n for p in probed if p is not None for n in p["tiers"]})
    out = {}
    for n in names:
        sights = [(q, None) if p is None else (p["process"], p["tiers"].get(n))
                  for q, p in enumerate(probed)]
        rest = {s if isinstance(s, str) else "odd" for _, s in sights[1:]}
        if sights[0][1] == "shared" and rest <= {"shared", BESIDE_FIRST}:
            out[n] = "shared"
            continue
        if sights[0][1] == "own" and rest <= {"own"}:
            out[n] = "own"
            continue
        odd = [(q, s) for q, s in sights if not isinstance(s, str)] \
            or [(q, s) for q, s in sights if s != "shared"]
        out[n] = "; ".join(
            f"process {q} " + ("did not probe it" if s is None else
                               "sees only its own probe" if s == "own" else
                               "sees the first process's probe" if s == BESIDE_FIRST else
                               f"sees the probes of {s}")
            for q, s in odd[:4]) + (" ..." if len(odd) > 4 else "")
    return out
