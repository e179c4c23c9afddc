"""Moving a step between our format and Orbax's own: `export_step`, `import_step`.

`export_step` writes one committed step of ours (read from any tier, or only
the one named) as a step of an Orbax `CheckpointManager` directory:
`<dest>/<step>/<item>/` per item (`default` for a plain StandardSave) and
the step's `_CHECKPOINT_METADATA`, so `ocp.CheckpointManager(dest).restore`
and `ocp.StandardCheckpointer().restore(<dest>/<step>/default, target)`
restore it bit for bit. Each array leaf is rebuilt on its saved sharding
(the saved devices must exist; else it is written as one host array), so
Orbax writes one chunk per saved shard, as the training job laid it out.
The leaves go through Orbax's public partial-save API
(`orbax.checkpoint.experimental.v1.partial`) in groups of at most
`group_bytes`, then one `finalize` merges them. Memory bound: at most one
group is in host memory at a time, `max(group_bytes, largest leaf)` bytes
(a list or tuple node and everything under it go in one group, since
Orbax's partial save adds leaves by key), plus Orbax's own copy of that group
while it writes and the reader's staging budget. Everything is built in a
temporary directory inside `dest` (each item's partial saves beside the step,
not in it) and the step renamed into place last, so the step holds exactly
what Orbax writes and a failed export leaves nothing at `<dest>/<step>`, nor
a `dest` it created. Every item name and the step's name (read from storage)
must be one path component (`layout.check_name`) before anything is written.

`import_step` reads an Orbax checkpoint (a step directory an Orbax
CheckpointManager wrote, such a manager's root with `step`, or a directory a
StandardCheckpointer wrote) and saves it through our CheckpointManager as a
committed step. Nothing of that directory is trusted: compat/foreign.py
checks every file before Orbax reads it (no link or special file, strict
JSON, array names that stay inside the item, and every item's arrays
together at most `max_item_bytes`, by default a quarter of this host's
memory, judged from the metadata before anything is allocated), and a step
named past the step range is no step. Memory bound: the whole step, once,
in host memory (Orbax restores each item whole, and our save takes the
step in one call), so at most `max_item_bytes` per item.
Both run in one process (a single-host job's directory).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from ..catalog import tier_steps
from ..compat import args as args_lib, foreign
from ..core import layout, selection
from ..core.manifest import DTYPES, ItemRecord, LeafRecord, Manifest, path_str
from ..core.pytree import build_nested
from ..core.sharding import rebuild
from ..core.strictjson import short
from ..errors import CheckpointError, StepNotFoundError
from ..restore.assemble import LeafTarget, restore_leaves
from ..restore.reader import ChunkReader, RestoreRecord
from . import survey

GROUP_BYTES = 1 << 30  # default: leaves written per Orbax partial save
_PYTREE_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler." \
    "StandardCheckpointHandler"
_JSON_HANDLER = "orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler"
_META = "_CHECKPOINT_METADATA"
_COMMIT = "commit_success.txt"


class ExportError(CheckpointError, ValueError):
    """An export or import that could not be done; nothing was left at its destination."""


@dataclasses.dataclass(frozen=True)
class Moved:
    """What an export or import wrote."""

    step: int
    path: str  # the step directory written
    items: tuple[str, ...]
    leaves: int
    bytes: int
    groups: int  # Orbax partial saves (export), 0 for an import
    seconds: float


# ---------------------------------------------------------------- export

def _choice(dr: survey.Directory, step: int, tier: str | None) -> selection.Choice:
    names = dr.names if tier is None else [tier]
    if tier is not None and tier not in dr.names:
        raise ExportError(f"{dr.path}: no tier {tier!r} (tiers: {', '.join(dr.names)})")
    views = [ts for n in names
             if (ts := tier_steps.observe_step(dr.storage(n), n, dr.naming, step)) is not None]
    choice = selection.viable({step: views}, names).get(step)
    if choice is not None:
        return choice
    where = f"the {tier} tier" if tier else f"any tier ({', '.join(names)})"
    if not views:
        raise StepNotFoundError(f"{dr.path}: step {step} is not committed in {where}")
    reason = selection.why_not(step, views, names) or "not viable"
    raise StepNotFoundError(f"{dr.path}: step {step} cannot be exported from {where}: "
                            f"{reason}{_leaves_named(views, reason)}")


def _leaves_named(views: Sequence[selection.TierStep], reason: str) -> str:
    """The leaves whose chunks `reason` names, as ' (item ..., leaf ...)'."""
    hits = {f"item {name!r}, leaf {path_str(m.item(name).leaves[i].path)}"
            for ts in views for m in ts.manifests if isinstance(m, Manifest)
            for name, i, c in m.chunks() if c.key in reason}
    return f" ({'; '.join(sorted(hits))})" if hits else ""


def _nbytes(lf: LeafRecord) -> int:
    return math.prod(lf.shape) * DTYPES.get(lf.dtype or "", 0)


def _groups(leaves: Sequence[LeafRecord], budget: int) -> list[list[int]]:
    """Leaf indices in groups of at most `budget` bytes (or one unit larger),
    a unit being the leaves under one list or tuple node (or one leaf)."""
    units: dict[tuple, list[int]] = {}
    for i, lf in enumerate(leaves):
        cut = next((k for k, (kind, _) in enumerate(lf.path) if kind == "index"), None)
        units.setdefault(tuple(lf.path[:cut]) if cut is not None else ("leaf", i), []).append(i)
    out: list[list[int]] = []
    size = 0
    for idx in units.values():
        n = sum(_nbytes(leaves[i]) for i in idx)
        if not out or size + n > budget:
            out.append([])
            size = 0
        out[-1] += idx
        size += n
    return out


def _target(lf: LeafRecord) -> LeafTarget:
    if lf.kind in ("array", "prng_key") and rebuild(lf.sharding) is None:
        return LeafTarget("numpy")  # the saved devices are gone here: one host array
    return LeafTarget("value")


def _orbax_leaf(v: Any) -> Any:
    return np.asarray(v) if isinstance(v, np.generic) else v  # Orbax v1 has no numpy scalars


def _export_item(item: ItemRecord, reader: ChunkReader, out: str, build: str,
                 budget: int) -> int:
    """Writes one item's Orbax directory at `out`, built at `build` (outside
    the step, so nothing of the build is left in it); returns the partial
    saves made."""
    import orbax.checkpoint as ocp
    if item.kind == "json":
        os.makedirs(out)
        ocp.JsonCheckpointHandler().save(epath.Path(out), args=ocp.args.JsonSave(item.value))
        return 0
    from orbax.checkpoint.experimental.v1 import partial
    if not item.leaves or not item.leaves[0].path:
        raise ExportError(f"item {item.name!r} is {'empty' if not item.leaves else 'one bare leaf'}"
                          "; Orbax's partial save needs a tree of named leaves")
    groups = _groups(item.leaves, budget)
    for idx in groups:
        recs = [item.leaves[i] for i in idx]
        values = restore_leaves(recs, [_target(lf) for lf in recs], reader, item.name)
        partial.save(build, build_nested([(lf.path, _orbax_leaf(v))
                                          for lf, v in zip(recs, values, strict=True)]))
        del values
    partial.finalize(build)
    os.rename(os.path.join(build, "state"), out)
    _commit_marker(out, out)
    return len(groups)


def _commit_marker(path: str, final: str) -> None:
    """The commit file Orbax's own save leaves in a step and in each pytree item."""
    with open(os.path.join(path, _COMMIT), "w") as f:
        f.write(f"Checkpoint commit was successful to {final}")


def _make_dirs(path: str) -> list[str]:
    """Creates `path` and its missing parents; returns those it created, deepest first."""
    made = []
    p = path
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        made.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    return made


def _remove_dirs(made: list[str]) -> None:
    """Removes the directories `_make_dirs` created, where they are still empty."""
    for p in made:
        try:
            os.rmdir(p)
        except OSError:
            return  # something else put a file there since: it stays


def _step_metadata(m: Manifest) -> bytes:
    now = time.time_ns()
    doc = {"item_handlers": {it.name: _JSON_HANDLER if it.kind == "json" else _PYTREE_HANDLER
                             for it in m.items},
           "metrics": m.metrics or {}, "performance_metrics": {},
           "init_timestamp_nsecs": int(m.created * 1e9), "commit_timestamp_nsecs": now,
           "custom_metadata": m.custom_metadata or {}}
    return json.dumps(doc).encode()


def export_step(directory: str, step: int, dest: str, tier: str | None = None,
                group_bytes: int = GROUP_BYTES, tier_overrides: Sequence[str] = (),
                budget: int = 256 << 20) -> Moved:
    """Writes committed `step` of our `directory` (from `tier` only, when
    given) as step `step` of an Orbax CheckpointManager directory `dest`.
    StepNotFoundError when the step has no intact copy there, ExportError when
    `<dest>/<step>` exists; nothing is left at `dest` on any failure."""
    step = layout.check_step(step, "export")
    import jax
    if jax.process_count() > 1:
        raise ExportError("export runs in one process; run it on one host that reads "
                          "every tier of the step")
    t0 = time.perf_counter()
    dr = survey.open_directory(str(directory), tier_overrides)
    choice = _choice(dr, step, tier)
    m, where = choice.manifest, f"step {step} of {directory}"
    for it in m.items:  # every name from storage is one path component, before any write
        layout.check_name(it.name, f"item name in {where}:")
    final = os.path.join(os.path.abspath(dest),
                         layout.check_name(dr.naming.name(step), f"step name of {where}:"))
    if os.path.lexists(final):
        raise ExportError(f"{final} already exists; export step {step} elsewhere or remove it")
    made = _make_dirs(os.path.dirname(final))
    tmp = os.path.join(os.path.dirname(final), f".rc-export.{step}.{uuid.uuid4().hex[:8]}")
    storages = {e.name: st for e, st in dr.tiers}
    reader = ChunkReader(storages, dr.naming, choice, set(), RestoreRecord(step), budget)
    groups, done = 0, False
    try:
        os.makedirs(os.path.join(tmp, "step"))
        for i, it in enumerate(m.items):
            groups += _export_item(it, reader, os.path.join(tmp, "step", it.name),
                                   os.path.join(tmp, f"build.{i}"), group_bytes)
        with open(os.path.join(tmp, "step", _META), "wb") as f:
            f.write(_step_metadata(m))
        _commit_marker(os.path.join(tmp, "step"), final)
        os.rename(os.path.join(tmp, "step"), final)
        done = True
    except CheckpointError as e:
        raise type(e)(f"export of step {step} from {directory} failed, nothing was left "
                      f"at {final}: {e}") from e
    finally:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            _remove_dirs(made)
    leaves = sum(len(it.leaves) for it in m.items)
    return Moved(step, final, tuple(it.name for it in m.items), leaves, m.nbytes, groups,
                 time.perf_counter() - t0)


# ---------------------------------------------------------------- import

def _number(name: str, listed: bool) -> int | None:
    """The step a directory's name ends in (a listed one: `<n>` or
    `<prefix>_<n>`), when it is a step number; a name past the range is no step."""
    m = re.fullmatch(r"(?:.*_)?([0-9]+)", name) if listed else re.search(r"([0-9]+)$", name)
    return int(m.group(1)) if m and int(m.group(1)) <= layout.MAX_STEP else None


def _orbax_step_dir(src: str, step: int | None) -> tuple[str, int | None]:
    """The Orbax step (or StandardCheckpointer) directory `src` means, and its step."""
    if os.path.lexists(os.path.join(src, "_METADATA")) or \
            os.path.lexists(os.path.join(src, _META)):
        name = os.path.basename(os.path.normpath(src))
        if step is None and re.search(r"[0-9]$", name) and _number(name, False) is None:
            raise ExportError(f"{src}: {short(name)} is not a step number (steps are whole "
                              f"numbers in [0, {layout.MAX_STEP}]); give one (--step N)")
        return src, step if step is not None else _number(name, False)
    found = {}
    for name in os.listdir(src) if os.path.isdir(src) else ():
        n = _number(name, True)
        if n is not None and os.path.lexists(os.path.join(src, name, _META)):
            found[n] = name
    if not found:
        raise StepNotFoundError(f"{src}: not an Orbax checkpoint (no {_META} or _METADATA, "
                                "and no step directories holding one)")
    pick = max(found) if step is None else step
    if pick not in found:
        raise StepNotFoundError(f"{src}: no Orbax step {pick} (steps: {sorted(found)})")
    return os.path.join(src, found[pick]), pick


def _is_json(meta: dict, item: str) -> bool:
    return "Json" in str((meta.get("item_handlers") or {}).get(item, ""))


def _json_item(path: str) -> Any:
    """A JSON item's value, when a JSON item of ours can hold it."""
    value = foreign.read_json_item(path)
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ExportError(f"{path}: this JSON item holds NaN or Infinity, which Orbax's JSON "
                          "allows and a JSON item of ours does not; nothing was imported: "
                          "import it without this item, or replace those values") from None
    return value


def _orbax_items(path: str, limit: int) -> tuple[dict[str, Any], dict]:
    """Each item of an Orbax step directory restored (`default` for a bare
    StandardCheckpointer directory), and the step's metadata; every file
    checked first, and each item's arrays against `limit` bytes
    (compat/foreign.py)."""
    foreign.check_entries(path)
    if os.path.lexists(os.path.join(path, "_METADATA")):
        return {args_lib.DEFAULT_ITEM: foreign.read_pytree(path, limit)}, {}
    meta = foreign.step_metadata(path)
    out: dict[str, Any] = {}
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if foreign.is_item(sub):
            out[layout.check_name(name, f"item name in {path}:")] = \
                foreign.read_pytree(sub, limit)
        elif os.path.isdir(sub) and _is_json(meta, name):
            out[layout.check_name(name, f"item name in {path}:")] = _json_item(sub)
    if not out:
        raise ExportError(f"{path}: an Orbax step with no item this import can read "
                          "(pytree or JSON)")
    return out, meta


def import_step(src: str, dest: str, step: int | None = None, options: Any = None,
                max_item_bytes: int | None = None) -> Moved:
    """Saves the Orbax checkpoint at `src` as committed `step` (default: the
    step Orbax gave it) of our CheckpointManager directory `dest` (with
    `options`, default: its default tiers). An item whose arrays together
    claim more than `max_item_bytes` (default: a quarter of this host's
    memory) is refused before anything is allocated or written."""
    import orbax.checkpoint as ocp

    from ..manager import CheckpointManager
    step = None if step is None else layout.check_step(step, "import")
    limit = foreign.default_item_bytes() if max_item_bytes is None else max_item_bytes
    if type(limit) is not int or limit < 1:
        raise ValueError(f"import: max_item_bytes must be a whole number of bytes, at "
                         f"least 1, got {max_item_bytes!r}")
    t0 = time.perf_counter()
    path, n = _orbax_step_dir(os.path.abspath(src), step)  # Orbax's steps: see foreign.py
    if n is None:
        raise ExportError(f"{src}: a StandardCheckpointer directory has no step number; "
                          "give one (--step N)")
    items, meta = _orbax_items(path, limit)
    kinds = {k: ocp.args.JsonSave if _is_json(meta, k) else ocp.args.StandardSave
             for k in items}
    save = ocp.args.StandardSave(items[args_lib.DEFAULT_ITEM]) \
        if list(kinds.items()) == [(args_lib.DEFAULT_ITEM, ocp.args.StandardSave)] \
        else ocp.args.Composite(**{k: kinds[k](v) for k, v in items.items()})
    with CheckpointManager(dest, options=options) as m:
        m.save(n, args=save, metrics=meta.get("metrics") or None, force=True,
               custom_metadata=meta.get("custom_metadata") or None)
        m.wait_until_finished()
        where = os.path.join(str(m.directory), m.naming.name(n))
    import jax
    leaves = jax.tree_util.tree_leaves(items)
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
    return Moved(n, where, tuple(items), len(leaves), nbytes, 0, time.perf_counter() - t0)
