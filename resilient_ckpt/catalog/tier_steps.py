"""What a tier holds of each step, as read from storage: manifests listed and
parsed (each damaged copy kept with its reason, never raised), chunk sizes
asked only of the objects manifests name (a chunk in a pack has the part of
its range the pack covers), or taken from the manifests where asking costs
requests, and the deletion of a step, manifests first.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Collection

from ..core import layout, manifest as mf
from ..core.selection import TierStep
from ..errors import CorruptCheckpointError
from ..storage.base import Storage

log = logging.getLogger("resilient_ckpt")


# Manifests of one step read at once from a remote store: a step of a job of
# N hosts has N of them there, and a restore onto another layout reads them all.
MANIFEST_READS = 16

# What reading or parsing one manifest copy may raise when its file is damaged
# or hostile (deep nesting, a huge size, bad bytes). Each makes that copy
# unusable, with the reason kept: one bad file never stops a manager from
# opening, nor hides another step or another tier's copy.
_UNREADABLE = (CorruptCheckpointError, OSError, RecursionError, MemoryError, UnicodeError,
               ValueError)


def read_manifests(storage: Storage, d: str, names: list[str],
                   known: mf.Manifest | None = None) -> tuple:
    """The manifests among `names` in step directory `d`, each parsed, or the
    CorruptCheckpointError saying why that copy cannot be used (logged once as
    a warning, never raised). `known`, a manifest this process just committed
    there, stands for its own name as it is, not read back."""
    mine = layout.manifest_name(known.process_index, known.process_count) if known else None
    names = [n for n in sorted(names) if layout.parse_manifest_name(n) is not None]
    others = [n for n in names if n != mine]
    if storage.remote and len(others) > 1:  # a request each: many at once (N writers' on GCS)
        with cf.ThreadPoolExecutor(min(MANIFEST_READS, len(others)),
                                   thread_name_prefix="rc-manifests") as ex:
            read = dict(zip(others, ex.map(lambda n: _read_manifest(storage, d, n), others),
                            strict=True))
    else:
        read = {n: _read_manifest(storage, d, n) for n in others}
    return tuple(known if name == mine else read[name] for name in names)


def _read_manifest(storage: Storage, d: str, name: str) -> mf.Manifest | CorruptCheckpointError:
    where = f"{storage.url}/{d}/{name}"
    try:
        m = mf.parse(storage.read(f"{d}/{name}", max_bytes=mf.MAX_MANIFEST_BYTES), where)
        if layout.parse_manifest_name(name) != (m.process_index, m.process_count):
            raise CorruptCheckpointError(
                f"{where}: holds process {m.process_index} of {m.process_count}, "
                "which its name contradicts")
        return m
    except _UNREADABLE as e:
        err = e if isinstance(e, CorruptCheckpointError) else CorruptCheckpointError(
            f"{where}: unreadable ({type(e).__name__}: {e})")
        if err is not e:
            err.__cause__ = e
        log.warning("ignoring the manifest %s; its step is read from other copies, if "
                    "any: %s", where, err)
        return err


def tier_step(tier: str, manifests: tuple) -> TierStep:
    """A view of one step in a tier whose chunk sizes are taken from the
    manifests (checked when read), as for GCS, where asking costs requests."""
    sizes = {k: n for m in manifests if isinstance(m, mf.Manifest)
             for k, n in _recorded_sizes(m)}
    return TierStep(tier, tuple(manifests), sizes)


def _recorded_sizes(m: mf.Manifest):
    """(chunk key, stored size) as the manifest records them."""
    return ((c.key, c.stored_nbytes) for _, _, c in m.chunks())


def manifest_names(storage: Storage, d: str) -> list[str]:
    """The manifests in step directory `d` (listed by name prefix, which a
    remote store filters on its side)."""
    names = storage.list(d, starts_with=layout.MANIFEST_PREFIX)
    return sorted(n for n in names if layout.parse_manifest_name(n))


def labelled(storage: Storage, d: str, labels: Collection[int]) -> list[str]:
    """The manifests in step directory `d` written by the processes `labels`
    (their index in the writing job): one listing by name prefix per label,
    which a remote store filters on its side, so the cost does not grow with
    the number of writers."""
    return sorted({n for i in labels
                   for n in storage.list(d, starts_with=f"{layout.MANIFEST_PREFIX}{i}-of-")
                   if layout.parse_manifest_name(n) is not None})


PART_PREFIXES = 16  # a part's listings by name prefix, beyond which one listing of all


def parted(storage: Storage, d: str, labels: Collection[int], part: tuple[int, int]
           ) -> list[str]:
    """The manifests in step directory `d` of the writers `labels` and of those
    whose label is `rank` modulo `size` (`part`): the job's processes read a
    step's manifests between them, each about count / size of them, one in a
    job of the save's size. The save's writer count comes from the names the
    first listings found (`manifest.<i>-of-<n>.json`); where they found none,
    one listing of every manifest's name, filtered."""
    rank, size = part
    mine = set(labels) | {rank}
    names = labelled(storage, d, mine)
    counts = {n for i, n in filter(None, map(layout.parse_manifest_name, names))}
    if counts and max(-(-(n - rank) // size) for n in counts) <= PART_PREFIXES:
        more = {q for n in counts for q in range(rank, n, size)} - mine
        return sorted(set(names) | set(labelled(storage, d, more))) if more else names
    # (a count far above the job's, as a name can claim, costs one listing, never more)
    labelled_all = [(n, layout.parse_manifest_name(n)) for n in manifest_names(storage, d)]
    return [n for n, w in labelled_all if w is not None and (w[0] in mine or w[0] % size == rank)]


def observe_step(storage: Storage, tier: str, naming: layout.StepNaming, step: int,
                 known: mf.Manifest | None = None,
                 labels: Collection[int] | None = None,
                 part: tuple[int, int] | None = None) -> TierStep | None:
    """What `tier` holds of `step` (None: no manifest). A step directory that
    cannot be listed shows as one unusable copy, with the reason, never an error.

    `known` is a manifest this process just committed there (after its chunks
    were written and flushed): it is taken as written, its chunks' sizes as it
    stored them, so a commit neither parses its own manifest back nor asks the
    size of every chunk it wrote; only other processes' manifests are read.
    `labels`: read only the manifests of those writers (`labelled`), and with
    `part` (rank, size) those of the writers of rank's part too (`parted`);
    the view then holds their shares only."""
    d = naming.name(step)
    try:
        if labels is not None:
            names = (labelled(storage, d, labels) if part is None else
                     parted(storage, d, labels, part))
        elif storage.sizes_from_manifest or known is not None:
            names = manifest_names(storage, d)
        else:
            names = storage.list(d)
        if storage.sizes_from_manifest:
            manifests = read_manifests(storage, d, names, known)
            return tier_step(tier, manifests) if manifests else None
    except OSError as e:
        err = CorruptCheckpointError(f"{storage.url}/{d}: cannot be listed ({e}); its "
                                     "step is read from other tiers, if any")
        log.warning("%s", err)
        return TierStep(tier, (err,), {})
    manifests = read_manifests(storage, d, names, known)
    if not manifests:
        return None
    # Else only manifests were listed: each object (pack or chunk) is asked for.
    present = set(names) if known is None and labels is None else None
    sizes: dict[str, int | None] = {}
    objects: dict[str, int | None] = {}
    for m in manifests:
        if m is known:
            sizes.update(_recorded_sizes(known))
        elif isinstance(m, mf.Manifest):
            for _, _, c in m.chunks():
                if c.object not in objects:
                    objects[c.object] = (_size(storage, d, c.object)
                                         if present is None or c.object in present else None)
                sizes[c.key] = c.observed(objects[c.object])
    return TierStep(tier, manifests, sizes)


def _size(storage: Storage, d: str, key: str) -> int | None:
    """The object's size, or None (no usable copy) where it cannot be asked."""
    try:
        return storage.size(f"{d}/{key}")
    except OSError as e:
        log.warning("%s/%s/%s: cannot be read (%s); another copy is used", storage.url, d,
                    key, e)
        return None


def listed_steps(storage: Storage, naming: layout.StepNaming) -> list[int]:
    """The steps a tier has a directory of (one listing of its root)."""
    return sorted(s for s in map(naming.parse, storage.list("")) if s is not None)


def observe(storage: Storage, tier: str, naming: layout.StepNaming,
            labels: Collection[int] | None = None,
            steps: list[int] | None = None,
            part: tuple[int, int] | None = None) -> dict[int, TierStep]:
    """Every step of a tier that has at least one manifest (valid or not).

    A remote tier is observed with one listing of its step directories and,
    per step, one listing of that step's manifests and a read of each, several
    steps at once: never a listing of every object. A damaged step (a manifest
    that does not read or parse, a directory that does not list) shows with
    its reasons and is never raised; only a tier root that cannot be listed is.
    `labels`, `part`: only those writers' manifests (`observe_step`); `steps`:
    the steps `listed_steps` gave, if the caller has listed them already.
    """
    steps = listed_steps(storage, naming) if steps is None else steps

    def one(s: int) -> TierStep | None:
        return observe_step(storage, tier, naming, s, labels=labels, part=part)
    if storage.shared and len(steps) > 1:
        with cf.ThreadPoolExecutor(min(8, len(steps)), thread_name_prefix="rc-observe") as ex:
            views = list(ex.map(one, steps))
    else:
        views = [one(s) for s in steps]
    return {s: ts for s, ts in zip(steps, views, strict=True) if ts is not None}


def delete_step(storage: Storage, naming: layout.StepNaming, step: int,
                part: tuple[int, int] | None = None,
                known: Collection[mf.Manifest] = ()) -> None:
    """Deletes manifests first, so a crash part-way never leaves a step that
    looks committed and is not; the rest is removed after (or by `cleanup`).

    `part` (rank, size): on a tier every process of a job sees, this process
    deletes only the shares of the writers whose index is `rank` modulo
    `size`: their manifests, then the chunks those list and their claims; the
    directory goes with whichever process empties it. Each process's work is
    then a share's, whatever the number of hosts (process 0 deleting every
    share was N manifests and all their chunks per step). `known`: manifests
    of the step this process holds already (its own), not read again."""
    d = naming.name(step)
    if part is None:
        for name in manifest_names(storage, d):
            storage.delete(f"{d}/{name}")
        storage.flush(d)
        storage.delete_dir(d)
        return
    rank, size = part
    mine = {layout.manifest_name(m.process_index, m.process_count): m for m in known}
    counts = {m.process_count for m in known}
    if len(counts) == 1:  # the writers are known: no listing of every manifest
        (count,) = counts
        names = sorted({x for x in mine if _label(x) % size == rank} | set(labelled(
            storage, d, [i for i in range(rank, count, size)
                         if layout.manifest_name(i, count) not in mine])))
    else:
        names = [x for x in manifest_names(storage, d) if _label(x) % size == rank]
    doomed = [mine.get(x) or _read_manifest(storage, d, x) for x in names]
    for x in names:
        storage.delete(f"{d}/{x}")
    storage.flush(d)
    for x, m in zip(names, doomed, strict=True):
        if isinstance(m, mf.Manifest):  # else its chunks are left to `cleanup`
            _delete_all(storage, [f"{d}/{o}" for o in m.objects()])
        storage.delete(f"{d}/{layout.claim_name(*(layout.parse_manifest_name(x) or (0, 1)))}")
    storage.remove_empty_dir(d)


def _label(manifest_name: str) -> int:
    """The writer index in a manifest's name (one `manifest_names` listed)."""
    return (layout.parse_manifest_name(manifest_name) or (0, 1))[0]


def _delete_all(storage: Storage, keys: list[str]) -> None:
    """Deletes `keys`; on a remote store several at once (a request each)."""
    if not storage.remote or len(keys) < 2:
        for k in keys:
            storage.delete(k)
        return
    with cf.ThreadPoolExecutor(min(8, len(keys)), thread_name_prefix="rc-delete") as ex:
        list(ex.map(storage.delete, keys))
