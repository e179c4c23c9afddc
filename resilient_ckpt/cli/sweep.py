"""Finding and removing dead writers' leftovers in a directory's tiers, for `gc`.

What counts as a leftover is exactly what the manager's own cleanup removes
(`cleanup.cleanup` on a file tier: temporaries and markers of dead writers on
this host, chunks and claims of uncommitted steps nobody live is writing;
`cleanup.collect_orphans` on GCS: chunks of uncommitted steps older than an
age). A dry run runs that same code over a storage that records deletes
instead of doing them, so the listing and the removal never disagree. A file
tier whose writer lock (`.rc-writer.lock`) a live manager holds
(`writer_lock.holder`) is skipped whole; while removing, the lock is held
here, so no manager starts writing
that tier meanwhile (one that tries gets `DirectoryInUseError` for that
moment).
"""
from __future__ import annotations

import dataclasses

from ..core import layout
from ..errors import DirectoryInUseError
from ..save import cleanup, writer_lock
from ..storage.base import Storage
from ..storage.wrapper import StorageWrapper


@dataclasses.dataclass(frozen=True)
class Leftover:
    tier: str
    path: str  # relative to the tier's root: "<step dir>/<name>", or a step dir
    bytes: int


@dataclasses.dataclass(frozen=True)
class TierSweep:
    tier: str
    where: str
    skipped: str | None  # why the tier was left alone
    leftovers: tuple[Leftover, ...]


class _Recording(StorageWrapper):
    """Records deletes instead of making them; a directory counts as removed
    when every entry in it was."""

    def __init__(self, inner: Storage):
        super().__init__(inner)
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)

    def remove_empty_dir(self, prefix: str) -> bool:
        gone = {k.rsplit("/", 1)[-1] for k in self.deleted if k.startswith(prefix + "/")}
        return set(self.inner.list(prefix)) <= gone


def _collect(st: Storage, naming: layout.StepNaming, orphan_age_s: float) -> list[str]:
    if st.remote:
        return cleanup.collect_orphans(st, naming, orphan_age_s)
    return cleanup.cleanup(st, naming)


def _sized(st: Storage, tier: str, keys: list[str]) -> tuple[Leftover, ...]:
    out = []
    for k in keys:
        try:
            n = (st.size(k) or 0) if "/" in k else 0  # a step directory itself: 0
        except OSError:
            n = 0
        out.append(Leftover(tier, k, n))
    return tuple(out)


def sweep_tier(name: str, st: Storage, naming: layout.StepNaming, apply: bool,
               orphan_age_s: float = 3600.0) -> TierSweep:
    """What `gc` would remove from one tier (and, with `apply`, removes)."""
    try:
        held = writer_lock.holder(st)
    except DirectoryInUseError as e:  # its lock is not a regular file
        return TierSweep(name, st.url, str(e), ())
    if held is not None:
        return TierSweep(name, st.url, f"a live writer holds its lock ({held})", ())
    rec = _Recording(st)
    planned = _sized(st, name, _collect(rec, naming, orphan_age_s))
    if not apply or not planned:
        return TierSweep(name, st.url, None, planned)
    lock = writer_lock.WriterLock(st.url)
    try:
        lock.hold([(name, st)], 0)
    except DirectoryInUseError as e:
        return TierSweep(name, st.url, f"a live writer took its lock ({e})", ())
    try:
        done = set(_collect(st, naming, orphan_age_s))
    finally:
        lock.release()
    return TierSweep(name, st.url, None, tuple(x for x in planned if x.path in done))
