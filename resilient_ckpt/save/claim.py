"""A step's claim: which save may commit a step, across a manager's tiers.

Each tier's manifest is created only if absent, per (step, process), but on
its own that lets two writers each win a different tier: two states under one
step. So just before a tier commits its manifest, the tier job takes the
save's claim: a create-only object `claim.<i>-of-<n>.json` in the step's
directory holding the save id and the writer, first in the save's claim tier
(the fastest non-remote tier the save writes the step to, or the next one if
that put fails), then in the committing tier itself. A save's tier jobs share
one `StepClaim`, so they see their own id; another writer sees a foreign one
and is refused (`StepAlreadyExistsError`) before its manifest.

A claim goes with its step (retention and delete remove the whole directory).
A save that committed the step in no tier lets go of its claims when its last
tier job ends (`StepClaim.settle`), so the step can be saved again at once
and a full disk keeps no claim; one that stays (a crash, a save whose writes
were cancelled) is a leftover that `cleanup.cleanup` removes once its
writer is dead (by age on GCS). A new save of the step takes over a claim
whose writer is on this host and dead, with that writer's manifest of the
same process index if it committed one: the manager starts a save only of a
step that is not restorable, so that copy is a piece of a save that serves
no restore (a lost host's peers keep their shares of a step it never
finished), and must not block the step being saved again. Only the writer lock
(writer_lock.py) holder of a file tier saves there, so two such takeovers
never race.

A claim's bytes are untrusted (anyone who can write the tier): `parse` takes
only a small object of the four fields with bounded values and otherwise
raises CorruptCheckpointError naming the file; `read` makes that, like a
missing claim, None.
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence

from ..core import layout
from ..core.strictjson import Reader, short
from ..errors import CorruptCheckpointError, StepAlreadyExistsError, StorageError
from ..storage.base import Storage

log = logging.getLogger("resilient_ckpt")


def encode(save_id: str, writer: layout.Writer) -> bytes:
    return json.dumps({"save_id": save_id, "host": writer.host, "pid": writer.pid,
                       "start": writer.start}, separators=(",", ":")).encode()


# A claim is a few dozen bytes; anything at its name is read at most this far.
MAX_CLAIM_BYTES = 4096


def parse(data: bytes, where: str) -> tuple[str, layout.Writer]:
    """(save id, writer) of the claim bytes `data` read from `where`; raises
    CorruptCheckpointError naming `where` for anything else: over
    MAX_CLAIM_BYTES, not UTF-8 JSON, nested too deeply, not an object of
    those fields (more are let by, for a newer writer), pid and start not
    integers in [0, 2**63 - 1]."""
    r = Reader(where)
    if len(data) > MAX_CLAIM_BYTES:
        raise r.fail(f"{len(data)} bytes is more than a claim's {MAX_CLAIM_BYTES}")
    doc = r.load(bytes(data))
    if not isinstance(doc, dict) or not _FIELDS <= doc.keys():
        raise r.fail(f"not a claim (an object with the fields {sorted(_FIELDS)}), "
                     f"got {short(doc)}")
    return r.str_(doc["save_id"], "save_id"), layout.Writer(
        r.str_(doc["host"], "host"), r.int_(doc["pid"], "pid"), r.int_(doc["start"], "start"))


_FIELDS = {"save_id", "host", "pid", "start"}


def read(storage: Storage, key: str) -> tuple[str, layout.Writer] | None:
    """The claim at `key`; None if it is gone, too large or does not parse."""
    try:
        return parse(storage.read(key, max_bytes=MAX_CLAIM_BYTES), f"{storage.url}/{key}")
    except (StorageError, CorruptCheckpointError):
        return None


def take(storage: Storage, tier: str, d: str, step: int, index: int, count: int,
         save_id: str, writer: layout.Writer) -> None:
    """Claims step directory `d` of `storage` for `save_id` (process `index`
    of `count`); raises StepAlreadyExistsError if another save holds it."""
    key = f"{d}/{layout.claim_name(index, count)}"
    for _attempt in range(3):
        if storage.put_if_absent(key, encode(save_id, writer)):
            return
        held = read(storage, key)
        if held is not None and held[0] == save_id:
            return
        if held is not None and held[1].alive() is False:
            # A dead writer's claim: of a step it never committed, or of one whose
            # copy here is part of no restorable step (a save is refused for a
            # viable step, so a new save of it means the dead save's copy serves
            # no restore; e.g. a lost host's peers kept their shares of a step
            # it never finished). Its manifest goes first, as in a delete.
            log.info("taking over step %d in the %s tier (%s/%s) from a dead writer's "
                     "claim (save %s)", step, tier, storage.url, d, held[0])
            storage.delete(f"{d}/{layout.manifest_name(index, count)}")
            storage.flush(d)
            storage.delete(key)
            continue
        if held is None and storage.size(key) is None:
            continue  # deleted with its step meanwhile
        who = (f"save {held[0]} by {held[1].host} pid {held[1].pid}" if held
               else "an unreadable claim")
        raise StepAlreadyExistsError(
            f"step {step} in the {tier} tier ({storage.url}/{d}) is claimed by another "
            f"writer ({who}); this save of it was refused so that the step holds one "
            "state in every tier. Only one manager may write a directory: stop the "
            "other writer, or save another step")
    # Present (put_if_absent failed) yet unreadable and of no size, three times:
    # not a regular file (a link, a FIFO, a directory: never followed or
    # opened), or a claim that kept changing.
    raise StepAlreadyExistsError(
        f"step {step} in the {tier} tier: its claim {storage.url}/{key} is not a regular "
        "file (a link, a FIFO, a directory) or kept changing; this save of it was "
        "refused. If no writer is saving this step, remove it and save again, or save "
        "another step")


class StepClaim:
    """One save's claim of its step, shared by that save's tier jobs.

    `tiers`: the (name, storage) the save writes the step to, fastest first.
    Thread-safe: the first job to commit takes the claim in the claim tier,
    the others wait for that outcome.
    """

    def __init__(self, step: int, save_id: str, index: int, count: int,
                 naming: layout.StepNaming, tiers: Sequence[tuple[str, Storage]]):
        self._step, self._save_id, self._index, self._count = step, save_id, index, count
        self._d = naming.name(step)
        near = [t for t in tiers if not t[1].remote]
        self._candidates = near or list(tiers)
        self._writer = layout.Writer.me()
        self._lock = threading.Lock()
        self._home: str | None = None  # the claim tier, once claimed ("" if none could be)
        self._refused: str | None = None
        self._taken: dict[str, Storage] = {}  # the tiers this save holds the claim in
        self._open = {name for name, _ in tiers}  # tier jobs not yet settled
        self._committed = False

    def take(self, tier: str, storage: Storage) -> None:
        """Claims the step for this save before `tier` commits it; raises
        StepAlreadyExistsError when another save holds it."""
        with self._lock:
            if self._refused is None and self._home is None:
                self._take_home()
            if self._refused is not None:
                raise StepAlreadyExistsError(self._refused)
            home = self._home
        if tier != home:
            self._one(tier, storage)

    def _take_home(self) -> None:
        """Claims the step in the first candidate tier whose put works. Holds the lock."""
        for name, st in self._candidates:
            try:
                self._one(name, st)
                self._home = name
                return
            except StepAlreadyExistsError as e:
                self._refused = str(e)
                return
            except StorageError as e:
                log.warning("could not claim step %d in the %s tier (%s): %s; claiming it "
                            "in the next tier", self._step, name, st.url, e)
        self._home = ""

    def _one(self, tier: str, storage: Storage) -> None:
        take(storage, tier, self._d, self._step, self._index, self._count, self._save_id,
             self._writer)
        # No lock: `_take_home` holds it already, and `settle` reads this only
        # once every tier job is over.
        self._taken[tier] = storage

    def settle(self, tier: str, committed: bool) -> None:
        """`tier`'s job is over (`committed` it or not). When the last one is
        and none committed, the claims this save took go (`_let_go`)."""
        with self._lock:
            self._open.discard(tier)
            self._committed |= committed
            last = not self._open and not self._committed
            taken, self._taken = (dict(self._taken), {}) if last else ({}, self._taken)
        if taken:
            self._let_go(taken)

    def _let_go(self, taken: dict[str, Storage]) -> None:
        """Deletes this save's claims in `taken`, unless a manifest of this
        process is in the step in one of them: a commit whose outcome was
        unknown may have landed, and its step keeps its claim. Never raises:
        a claim left behind is cleanup's."""
        manifest = f"{self._d}/{layout.manifest_name(self._index, self._count)}"
        key = f"{self._d}/{layout.claim_name(self._index, self._count)}"
        try:
            if any(st.size(manifest) is not None for st in taken.values()):
                return
            for st in taken.values():
                held = read(st, key)
                if held is not None and held[0] == self._save_id:
                    st.delete(key)
                    st.remove_empty_dir(self._d)
        except OSError as e:
            log.warning("could not remove the claim of step %d after its save failed "
                        "(%s); cleanup removes it once this writer is gone", self._step, e)
