"""What a checkpoint directory holds, as the command-line tool reports it.

It finds the directory's tiers (the tiers record at its root, tierrecord.py,
as a hint: a recorded tier is used only inside the directory, or as a RAM
tier under /dev/shm that passes the manager's checks, never at a URL, and a
record that is not valid is ignored, each with a warning; a tier it uses is
read through a storage pinned to the directory it checked, never through
the place's name again; else the directory itself and the default RAM
tier; `--tier NAME=PATH` overrides either),
observes every tier with the manager's own reading code
(`tier_steps.observe`, manifest parsing), judges each step with `selection`
(`viable`, and `why_not` for the reason), and adds what the manager does not
need to see: step directories with no manifest and who was writing them
(claims, markers, temporaries), steps Orbax wrote, and each copy's size and
age. `verify_chunk` reads one chunk back and checks its checksum. It writes
nothing.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Sequence

import numpy as np

from ..catalog import tier_steps
from ..compat import orbax_steps as legacy
from ..core import codec, layout, selection
from ..core.manifest import ChunkRecord, Manifest
from ..errors import CorruptCheckpointError, UnsafeDirectoryError
from ..native import crc32c
from ..save import claim, tierrecord
from ..save.tierrecord import TierEntry
from ..storage import FileStorage, Storage, files
from ..tiers import SHM, RamTier, check_private

log = logging.getLogger("resilient_ckpt")

_RANK = {"ram": 0, "local": 1, "gcs": 2}


@dataclasses.dataclass(frozen=True)
class Directory:
    """A directory's tiers, opened read-only, fastest first."""

    path: str
    tiers: tuple[tuple[TierEntry, Storage], ...]
    naming: layout.StepNaming
    recorded: bool  # the tiers came from the directory's tiers record
    ignored: tuple[tuple[TierEntry, str], ...] = ()  # recorded, not used: why

    @property
    def names(self) -> list[str]:
        return [e.name for e, _ in self.tiers]

    def storage(self, name: str) -> Storage:
        return next(s for e, s in self.tiers if e.name == name)


def _open(e: TierEntry) -> Storage:
    if e.where.startswith("gs://"):
        from ..storage.gcs import GcsStorage
        return GcsStorage(e.where)
    if "://" in e.where:  # an FsspecTier's store (s3://, az://, file://)
        from ..storage.fsspec_store import open_url
        return open_url(e.where, create=False)
    return FileStorage(e.where, e.kind, fsync=False, create=False)


def _override(spec: str) -> TierEntry:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise ValueError(f"--tier {spec!r}: expected NAME=PATH (e.g. ram=/dev/shm/x, "
                         "local=/ckpt, gcs=gs://bucket/prefix)")
    kind = "gcs" if where.startswith("gs://") else "remote" if "://" in where \
        else "ram" if name.startswith("ram") else "local"
    return TierEntry(name, kind, where if "://" in where else os.path.abspath(where))


def _inside(path: str, home: str) -> bool:
    """`path` is `home` or in it, links resolved."""
    p, h = os.path.realpath(path), os.path.realpath(home)
    return p == h or p.startswith(h.rstrip("/") + "/")


def _checked(e: TierEntry, path: str, rec: tierrecord.TiersRecord
             ) -> tuple[TierEntry, Storage | None, str | None]:
    """A recorded tier of local directory `path`, where it may be used: a
    path in the directory, or a RAM tier's in /dev/shm, recorded for this
    directory (not for the one it was moved or copied from), that passes the
    manager's own checks (ours, not a link, not writable by others); else no
    storage and why it is not used. A URL is never followed. The storage is
    pinned to the directory that was checked (`_pin`), so whatever takes the
    place's name afterwards (a link to elsewhere) is never used."""
    where = tierrecord.place(e, path)
    entry = TierEntry(e.name, e.kind, where)
    if "://" in where:
        return entry, None, ("not followed: the record names a network place, which this "
                             f"tool reaches only when given it (--tier {e.name}=URL)")
    if e.kind not in ("ram", "local"):
        return entry, None, f"kind {e.kind!r} is not a local tier's (ram, local)"
    inside = _inside(where, path)
    if not inside and not (e.kind == "ram" and _inside(where, SHM)):
        return entry, None, (f"{where} is outside {path}"
                             + (f" and {SHM}" if e.kind == "ram" else "")
                             + " (a moved or copied directory's record, or a hostile one); "
                             f"pass --tier {e.name}=PATH to use it")
    try:
        if not inside and not (rec.directory is not None and _inside(rec.directory, path)
                               and _inside(path, rec.directory)) \
                and where != RamTier().open(path, create=False).root:
            return entry, None, (f"recorded for {rec.directory or 'another directory'}, not "
                                 f"{path} (moved or copied?); pass --tier {e.name}=PATH to "
                                 "use it")
        return entry, _pin(entry, path if inside else SHM), None
    except UnsafeDirectoryError as x:
        return entry, None, str(x)
    except OSError as x:
        return entry, None, (f"{where} is {_why_unusable(x)}, so it is not used; pass "
                             f"--tier {e.name}=PATH to use it")


def _pin(e: TierEntry, base: str) -> Storage:
    """The storage of recorded place `e.where` inside `base` (the directory,
    or /dev/shm for a RAM tier outside it), pinned to the directory reached
    by walking there from `base` without following a link; a RAM tier's must
    also be private (`tiers.check_private`, on that same directory)."""
    rel = os.path.relpath(os.path.realpath(e.where), os.path.realpath(base))
    fd = files.open_below(base, rel)
    try:
        if e.kind == "ram":
            check_private(e.where, os.fstat(fd))
        return FileStorage(e.where, e.kind, fsync=False, create=False, root_fd=fd)
    finally:
        os.close(fd)


def _why_unusable(x: OSError) -> str:
    if x.errno == errno.ENOENT:
        return "missing (nothing to read there)"
    if x.errno in (errno.ELOOP, errno.ENOTDIR):
        return "reached through a link or something that is not a directory (never followed)"
    return f"not readable ({x.strerror or x})"


def _recorded(path: str) -> tuple[tierrecord.TiersRecord | None,
                                  dict[str, tuple[TierEntry, Storage]],
                                  list[tuple[TierEntry, str]]]:
    """The record of local directory `path` (None when it has none or it is
    not valid, with a warning), its tiers that may be used (each with its
    storage, pinned where it was checked), and the others with why not (each
    warned of)."""
    try:
        rec = tierrecord.read(path)
    except (CorruptCheckpointError, OSError) as x:
        log.warning("tiers record ignored (%s); reading the directory itself and its "
                    "default RAM tier", x)
        return None, {}, []
    if rec is None:
        return None, {}, []
    used: dict[str, tuple[TierEntry, Storage]] = {}
    ignored: list[tuple[TierEntry, str]] = []
    for e in rec.tiers:
        entry, st, why = _checked(e, path, rec)
        if st is None:
            log.warning("%s/%s: tier %s (%s) ignored: %s", path, tierrecord.RECORD_NAME,
                        e.name, e.where, why)
            ignored.append((e, why or ""))
        else:
            used[e.name] = (entry, st)
    return rec, used, ignored


def open_directory(path: str, overrides: Sequence[str] = ()) -> Directory:
    """The tiers of `path`: those of its tiers record that may be used
    (`_checked`, each read through the storage built when it was checked),
    else (none recorded, or none usable) the directory itself and its
    default RAM tier when that exists, then `overrides` (NAME=PATH)
    replacing or adding tiers by name. ValueError when the directory is none
    of ours and no tier was given. A gs:// directory has no record (a
    manager writes none there): its defaults are used."""
    remote = path.startswith("gs://")
    home: Storage = _open(TierEntry("local", "gcs" if remote else "local", path))
    rec, tiers, ignored = _recorded(path) if not remote and os.path.isdir(path) \
        else (None, {}, [])
    if not tiers and (remote or os.path.isdir(path)):
        ram = RamTier().open(path, create=False).root
        if os.path.isdir(ram):
            tiers["ram"] = _opened(TierEntry("ram", "ram", ram))
        name = "gcs" if remote else "local"
        tiers[name] = (TierEntry(name, name, home.url), home)
    for spec in overrides:
        e = _override(spec)
        tiers[e.name] = _opened(e)
    if not tiers:
        raise ValueError(f"{path}: no such directory, and no --tier NAME=PATH given")
    order = sorted(tiers.values(), key=lambda t: _RANK.get(t[0].kind, 1))
    return Directory(path, tuple(order),
                     rec.naming if rec else layout.StepNaming(), rec is not None,
                     tuple((e, why) for e, why in ignored if e.name not in tiers))


def _opened(e: TierEntry) -> tuple[TierEntry, Storage]:
    return e, _open(e)


@dataclasses.dataclass(frozen=True)
class Copy:
    """One step directory in one tier."""

    tier: str
    state: str  # "committed", "uncommitted" (no manifest), "orbax"
    save_id: str | None
    processes: str  # "1/1": manifests present / process count
    stored_bytes: int  # of the objects present that its manifests name (or all)
    age_s: float | None
    problem: str | None  # why this copy alone cannot be restored; None: whole
    writers: tuple[str, ...] = ()  # claims, markers, temporaries: who wrote, alive?


@dataclasses.dataclass(frozen=True)
class Step:
    step: int
    viable: bool
    reason: str | None  # why not, when not viable
    copies: tuple[Copy, ...]
    choice: selection.Choice | None


def _writer(w: layout.Writer, what: str) -> str:
    alive = {True: "alive", False: "dead", None: "on another host"}[w.alive()]
    return f"{what} of host {w.host} pid {w.pid} ({alive})"


def writers(st: Storage, d: str, save_id: str | None) -> tuple[str, ...]:
    """Who the claims, markers and temporaries in `d` name (claims of saves
    other than `save_id`, the save committed there, if any)."""
    out = []
    for n in sorted(st.list(d)):
        if layout.is_claim_name(n):
            c = claim.read(st, f"{d}/{n}")
            if c is not None and c[0] != save_id:  # the save's own claim says nothing
                other = "another save " if save_id is not None else "save "
                out.append(_writer(c[1], f"claim {n} of {other}{c[0][:8]}"))
        elif (w := layout.parse_marker_name(n)) is not None:
            out.append(_writer(w, "write marker"))
        elif (w := layout.parse_tmp_name(n)) is not None:
            out.append(_writer(w, f"temporary {n}"))
    return tuple(out)


def _age(st: Storage, d: str) -> float | None:
    try:
        ages = st.object_ages(d)
    except OSError:
        return None
    return min(ages.values()) if ages else None


def _committed(st: Storage, ts: selection.TierStep, step: int, d: str) -> Copy:
    ms = [m for m in ts.manifests if isinstance(m, Manifest)]
    newest = max(ms, key=lambda m: m.created) if ms else None
    sid = newest.save_id if newest else None
    same = [m for m in ms if m.save_id == sid]
    procs = f"{len(same)}/{newest.process_count}" if newest else "0/?"
    size = sum(s for s in ts.sizes.values() if s is not None)
    age = time.time() - newest.created if newest else None
    problem = selection.why_not(step, [ts], [ts.tier])
    claims = writers(st, d, sid) if not st.sizes_from_manifest else ()
    return Copy(ts.tier, "committed", sid, procs, size, age, problem, claims)


def _uncommitted(st: Storage, tier: str, d: str) -> Copy:
    try:
        names = st.list(d)
        who = writers(st, d, None)
        size = sum(st.size(f"{d}/{n}") or 0 for n in names)
    except OSError as e:
        return Copy(tier, "uncommitted", None, "0/?", 0, None, f"cannot be listed: {e}")
    # A claim outlives its save's commit; a write in progress on a file tier
    # shows as a marker or temporary. GCS has neither: there a claim is all.
    busy = [w for w in who if not w.startswith("claim") or st.remote]
    live = any("(alive)" in w or "another host" in w for w in busy)
    problem = ("no manifest: being written now (or by a live process)" if live else
               "no manifest: a save that never committed (or a torn delete); "
               "a writable manager's cleanup removes it")
    return Copy(tier, "uncommitted", None, "0/?", size, _age(st, d), problem, who)


def survey(dr: Directory) -> list[Step]:
    """Every step in every tier, newest first, each judged as the manager would."""
    views = {e.name: tier_steps.observe(st, e.name, dr.naming) for e, st in dr.tiers}
    obs: dict[int, list[selection.TierStep]] = {}
    for name in dr.names:
        for k, ts in views[name].items():
            obs.setdefault(k, []).append(ts)
    choices = selection.viable(obs, dr.names)
    copies: dict[int, list[Copy]] = {s: [] for s in obs}
    for e, st in dr.tiers:
        for name in st.list(""):
            n = dr.naming.parse(name)
            if n is None:
                continue
            seen = views[e.name].get(n)
            copies.setdefault(n, []).append(_committed(st, seen, n, name) if seen is not None
                                            else _uncommitted(st, e.name, name))
    orbax: set[int] = set()
    for e, st in dr.tiers:
        if e.kind == "local":
            orbax |= legacy.orbax_steps(st, dr.naming) - set(obs)
    out = []
    for s in sorted(copies, reverse=True):
        cs = copies[s]
        if s in orbax:
            cs = [dataclasses.replace(c, state="orbax", problem="written by Orbax: "
                                      "restored through Orbax, read-only") for c in cs]
            reason: str | None = "written by Orbax (a CheckpointManager restores it through Orbax)"
        else:
            reason = selection.why_not(s, obs.get(s, []), dr.names)
        out.append(Step(s, s in choices, reason, tuple(cs), choices.get(s)))
    return out


def verify_chunk(st: Storage, d: str, c: ChunkRecord) -> str | None:
    """None when the copy of `c` in step directory `d` of `st` reads back whole
    and matches its checksum; else what is wrong with it."""
    try:
        size = c.observed(st.size(f"{d}/{c.object}"))
        if size is None:
            return "missing" + (f" (its pack {c.pack})" if c.pack else "")
        if size != c.stored_nbytes:
            return (f"is {size} bytes" + (f" in its pack {c.pack}" if c.pack else "")
                    + f", its manifest says {c.stored_nbytes}")
        buf = bytearray(c.stored_nbytes)
        st.read_into(f"{d}/{c.object}", memoryview(buf), c.pack_offset)
        data = bytes(buf)
        raw = data if c.codec == "raw" else \
            codec.decode(c.codec, np.frombuffer(data, np.uint8), c.nbytes).tobytes()
    except (OSError, CorruptCheckpointError) as e:
        return f"cannot be read: {e}"
    crc = crc32c.value(raw)
    if crc != c.crc32c:
        return f"fails its checksum (crc32c {crc}, its manifest says {c.crc32c})"
    return None
