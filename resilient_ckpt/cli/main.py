"""`resilient-ckpt`: the command line for the operator of a job.

It owns the commands and what they print: `ls DIR` (every step in every
tier, committed or not, viable or why not, sizes, ages), `inspect DIR STEP`
(a step's tree: paths, shapes, dtypes, shardings, bytes per tier, metrics)
`verify DIR [STEP]` (every chunk of every copy read back and checked, a
progress bar on stderr, exit status 1 on any defect), `gc DIR` (dead
writers' leftovers, with sizes; removed only with `--apply`), `export DIR
STEP DEST` (a step as an Orbax checkpoint) and `import SRC DEST` (an Orbax
checkpoint as a step of ours); `--json` on each prints one JSON document
instead. What a directory holds is survey.py's, what gc removes sweep.py's,
the conversions interop.py's; only gc --apply, export and import write.
Everything printed for a person goes through `safe` (`_say`, and the
package's warnings while a command runs, `_logged_safely`): names and
strings read from the directory (file names, claims, the tiers record,
manifests) may hold terminal escapes, and reach the terminal escaped; --json
output is escaped by JSON itself.
Exit status: 0 fine, 1 a defect or no such step, 2 a usage error or a
directory that cannot be read.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from ..catalog import tier_steps
from ..core import layout
from ..core.manifest import DTYPES, LeafRecord, Manifest, decode_scalar, path_str
from ..core.selection import TierStep
from ..errors import CorruptCheckpointError, StepNotFoundError
from . import survey, sweep

# C0 and C1 controls and DEL, the Unicode line separators and bidi controls
# (which reorder what a line seems to say), and lone surrogates (bytes of a
# name that is not UTF-8, which would not even print).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                     "\u2066-\u2069\ud800-\udfff]")


def safe(text: object) -> str:
    """`text` for a terminal: every control character escaped (`\\x1b`,
    `\\u202e`), everything else as it is."""
    def esc(m: re.Match) -> str:
        c = ord(m.group())
        return {9: "\\t", 10: "\\n", 13: "\\r"}.get(c) or (
            f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")
    return _UNSAFE.sub(esc, str(text))


def _say(text: str = "", file: Any = None) -> None:
    """Prints one line for a person, through `safe`."""
    print(safe(text), file=file or sys.stdout)


class _Safe(logging.Formatter):
    """The package's log records, for a person: through `safe`."""

    def format(self, record: logging.LogRecord) -> str:
        return safe(super().format(record))


@contextlib.contextmanager
def _logged_safely() -> Iterator[None]:
    """While a command runs, the package's warnings (which name paths and
    files of the directory) go to stderr through `safe`, and not on to
    handlers that would print them raw."""
    log = logging.getLogger("resilient_ckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_Safe("resilient-ckpt: %(levelname)s: %(message)s"))
    propagate, log.propagate = log.propagate, False
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, k in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= k:
            return f"{s / k:.1f}{unit}"
    return f"{max(s, 0):.0f}s"


def _tiers_json(dr: survey.Directory) -> list[dict]:
    return [{"name": e.name, "kind": e.kind, "where": e.where} for e, _ in dr.tiers]


# ---------------------------------------------------------------- ls

def cmd_ls(dr: survey.Directory, args: argparse.Namespace) -> int:
    steps = survey.survey(dr)
    if args.json:
        _print_json({"directory": dr.path, "tiers": _tiers_json(dr), "recorded": dr.recorded,
                     "ignored": [{"name": e.name, "kind": e.kind, "where": e.where, "why": why}
                                 for e, why in dr.ignored],
                     "steps": [{"step": s.step, "viable": s.viable, "reason": s.reason,
                                "copies": [vars(c) | {"writers": list(c.writers)}
                                           for c in s.copies]} for s in steps]})
        return 0
    src = "from its tiers record" if dr.recorded else "not recorded: defaults and --tier"
    _say(f"{dr.path}: tiers ({src})")
    for e, _ in dr.tiers:
        _say(f"  {e.name:<8} {e.kind:<6} {e.where}")
    for e, why in dr.ignored:
        _say(f"  {e.name:<8} {e.kind:<6} {e.where}  not used: {why}")
    if not steps:
        _say("no steps")
    for s in steps:
        _say(f"step {s.step}: " + ("viable" if s.viable else f"NOT viable: {s.reason}"))
        for c in s.copies:
            _say(f"  {c.tier:<8} {c.state:<11} {c.processes:>5} {_size(c.stored_bytes):>10} "
                  f"{_age(c.age_s):>6}  {c.problem or 'whole'}")
            for w in c.writers:
                _say(f"  {'':<8} {w}")
    return 0


# ---------------------------------------------------------------- inspect

def _sharding(s: dict | None) -> str:
    if s is None:
        return "-"
    if s["type"] == "named":
        mesh = ",".join(f"{a}={n}" for a, n in zip(s["axis_names"], s["mesh_shape"], strict=True))
        return f"P{tuple(s['spec'])} mesh({mesh})"
    if s["type"] == "single_device":
        return f"device {s['device_id']}"
    return str(s.get("repr", s["type"]))


def _leaf_bytes(lf: LeafRecord) -> int:
    return math.prod(lf.shape) * DTYPES.get(lf.dtype or "", 0) if lf.dtype else 0


def _leaf_json(lf: LeafRecord) -> dict:
    value = decode_scalar(lf.value) if lf.kind == "scalar" else None
    return {"path": path_str(lf.path), "kind": lf.kind, "shape": list(lf.shape), "value": value,
            "dtype": lf.dtype, "sharding": lf.sharding, "sharding_text": _sharding(lf.sharding),
            "nbytes": _leaf_bytes(lf), "chunks": len(lf.chunks)}


def _manifest_of(s: survey.Step, dr: survey.Directory) -> tuple[Manifest | None, dict]:
    """The step's records (merged over processes when viable), and the bytes
    of it each tier holds."""
    per_tier = {c.tier: c.stored_bytes for c in s.copies}
    if s.choice is not None:
        return s.choice.manifest, per_tier
    views: list[TierStep] = []
    for e, st in dr.tiers:
        ts = tier_steps.observe_step(st, e.name, dr.naming, s.step)
        views += [ts] if ts is not None else []
    ms = [m for ts in views for m in ts.manifests if isinstance(m, Manifest)]
    return (min(ms, key=lambda m: m.process_index) if ms else None), per_tier


def cmd_inspect(dr: survey.Directory, args: argparse.Namespace) -> int:
    s = next((x for x in survey.survey(dr) if x.step == args.step), None)
    if s is None:
        return _fail(f"{dr.path}: no step {args.step} in any tier ({', '.join(dr.names)})", 1)
    m, per_tier = _manifest_of(s, dr)
    doc: dict[str, Any] = {"step": s.step, "viable": s.viable, "reason": s.reason,
                           "bytes_per_tier": per_tier}
    if m is not None:
        doc |= {"save_id": m.save_id, "created": m.created, "processes": m.process_count,
                "metrics": m.metrics, "custom_metadata": m.custom_metadata,
                "items": [{"name": it.name, "kind": it.kind, "value": it.value,
                           "leaves": [_leaf_json(lf) for lf in it.leaves]} for it in m.items]}
    if args.json:
        _print_json(doc)
        return 0
    _say(f"step {s.step}: " + ("viable" if s.viable else f"NOT viable: {s.reason}"))
    if m is None:
        _say("  no readable manifest: nothing to show")
        return 0
    when = datetime.datetime.fromtimestamp(m.created, datetime.UTC).isoformat(timespec="seconds")
    _say(f"  save {m.save_id}, {m.process_count} process(es), created {when}")
    _say("  bytes per tier: " + ", ".join(f"{t} {_size(n)}" for t, n in per_tier.items()))
    _say(f"  metrics: {json.dumps(m.metrics)}")
    for it in doc["items"]:
        _say(f"  item {it['name']!r} ({it['kind']})"
              + (f": {json.dumps(it['value'])}" if it["kind"] == "json" else ""))
        for lf in it["leaves"]:
            _say(f"    {lf['path']:<30} {lf['kind']:<12} {str(tuple(lf['shape'])):<14} "
                  f"{lf['dtype'] or '-':<9} {_size(lf['nbytes']):>10}  {lf['sharding_text']}"
                  + (f" = {lf['value']!r}" if lf["kind"] == "scalar" else ""))
    return 0


# ---------------------------------------------------------------- verify

def _jobs(dr: survey.Directory, steps: list[survey.Step]) -> tuple[list, list[dict]]:
    """(step, tier, directory, chunk) to read back, and the defects found
    without reading: not viable, unreadable manifests, a tier's copy with no
    manifest that no live writer is still writing."""
    jobs, defects = [], []
    for s in steps:
        if not s.viable:
            defects.append({"step": s.step, "tier": None, "key": None, "problem": s.reason})
        defects += [{"step": s.step, "tier": c.tier, "key": None, "problem": c.problem}
                    for c in s.copies if c.state == "uncommitted"
                    and not (c.problem or "").startswith("no manifest: being written")]
        for e, st in dr.tiers:
            ts = tier_steps.observe_step(st, e.name, dr.naming, s.step)
            for m in ts.manifests if ts is not None else ():
                if not isinstance(m, Manifest):
                    defects.append({"step": s.step, "tier": e.name, "key": None,
                                    "problem": str(m)})
                    continue
                jobs += [(s.step, e.name, dr.naming.name(s.step), c) for _, _, c in m.chunks()]
    return jobs, defects


def cmd_verify(dr: survey.Directory, args: argparse.Namespace) -> int:
    steps = [s for s in survey.survey(dr) if args.step is None or s.step == args.step]
    if args.step is not None and not steps:
        return _fail(f"{dr.path}: no step {args.step} in any tier ({', '.join(dr.names)})", 1)
    steps = [s for s in steps if not any(c.state == "orbax" for c in s.copies)]
    jobs, defects = _jobs(dr, steps)
    from tqdm import tqdm
    total = sum(c.stored_nbytes for *_, c in jobs)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
              desc="verify", disable=args.quiet, mininterval=0.2) as bar:
        for step, tier, d, c in jobs:
            problem = survey.verify_chunk(dr.storage(tier), d, c)
            if problem is not None:
                defects.append({"step": step, "tier": tier, "key": c.key,
                                "problem": f"chunk {c.key} {problem}"})
            bar.update(c.stored_nbytes)
    ok = not defects
    if args.json:
        _print_json({"ok": ok, "steps": [s.step for s in steps], "chunks": len(jobs),
                     "bytes": total, "defects": defects})
    else:
        for x in defects:
            where = f"step {x['step']}" + (f" in {x['tier']}" if x["tier"] else "")
            _say(f"DEFECT {where}: {x['problem']}")
        _say(f"{'ok' if ok else 'FAILED'}: {len(jobs)} chunk copies ({_size(total)}) of "
              f"{len(steps)} step(s) read, {len(defects)} defect(s)")
    return 0 if ok else 1


# ---------------------------------------------------------------- gc

def cmd_gc(dr: survey.Directory, args: argparse.Namespace) -> int:
    done = [sweep.sweep_tier(e.name, st, dr.naming, args.apply, args.orphan_age)
            for e, st in dr.tiers]
    found = [x for t in done for x in t.leftovers]
    total = sum(x.bytes for x in found)
    if args.json:
        _print_json({"directory": dr.path, "applied": args.apply, "bytes": total,
                     "tiers": [{"name": t.tier, "where": t.where, "skipped": t.skipped}
                               for t in done],
                     "leftovers": [vars(x) for x in found]})
        return 0
    for t in done:
        if t.skipped:
            _say(f"{t.tier}: skipped, {t.skipped}")
    for x in found:
        _say(f"{'removed' if args.apply else 'would remove'} {x.tier}:{x.path} "
              f"{_size(x.bytes)}")
    verb = "removed" if args.apply else "to remove (run with --apply to remove them)"
    _say(f"{len(found)} leftover(s), {_size(total)}, {verb}" if found else "nothing to remove")
    return 0


# ---------------------------------------------------------------- export, import

def _moved(m: Any, args: argparse.Namespace, what: str) -> int:
    if args.json:
        _print_json(vars(m))
    else:
        _say(f"{what} step {m.step} ({', '.join(m.items)}: {m.leaves} leaves, "
              f"{_size(m.bytes)}) to {m.path} in {m.seconds:.1f}s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from . import interop
    names = [t for t in args.tier if "=" not in t]
    if len(names) > 1:
        return _fail(f"export reads from one tier; got --tier {' --tier '.join(names)}", 2)
    try:
        m = interop.export_step(args.directory, args.step, args.dest,
                                tier=names[0] if names else None,
                                tier_overrides=[t for t in args.tier if "=" in t])
    except (StepNotFoundError, CorruptCheckpointError) as e:
        return _fail(str(e), 1)
    return _moved(m, args, "exported")


def cmd_import(args: argparse.Namespace) -> int:
    from . import interop
    try:
        m = interop.import_step(args.directory, args.dest, step=args.step,
                                max_item_bytes=args.max_item_bytes)
    except (StepNotFoundError, CorruptCheckpointError) as e:
        return _fail(str(e), 1)
    return _moved(m, args, "imported")


# ---------------------------------------------------------------- entry point

def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def _fail(msg: str, code: int) -> int:
    _say(f"resilient-ckpt: {msg}", file=sys.stderr)
    return code


def _step(text: str) -> int:
    """A step argument: a whole number in the range every step is in
    (`layout.check_step`); anything else is a usage error."""
    try:
        return layout.check_step(int(text), "resilient-ckpt")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a step number: steps are whole numbers in "
            f"[0, {layout.MAX_STEP}]") from None


def _bytes(text: str) -> int:
    """A size argument: a whole number of bytes, at least 1, or one with a
    binary suffix (16M is 16 MiB); anything else is a usage error."""
    m = re.fullmatch(r"([0-9]{1,20})([KMGT]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    n = int(m.group(1)) << 10 * "_KMGT".index(m.group(2).upper() or "_") if m else 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a whole number of bytes, at least 1, optionally "
            "with K, M, G or T (binary: 16M is 16 MiB)")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilient-ckpt", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("directory", help="the manager's directory (a path or gs://...)")
    common.add_argument("--tier", action="append", default=[], metavar="NAME=PATH",
                        help="a tier's place, replacing or adding to the recorded ones")
    common.add_argument("--json", action="store_true", help="print one JSON document")
    sub.add_parser("ls", parents=[common], help="every step in every tier, viable or why not")
    ins = sub.add_parser("inspect", parents=[common], help="a step's tree and metrics")
    ins.add_argument("step", type=_step)
    ver = sub.add_parser("verify", parents=[common], help="read and check every chunk")
    ver.add_argument("step", type=_step, nargs="?", help="only this step (default: all)")
    ver.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    gc = sub.add_parser("gc", parents=[common], help="dead writers' leftovers (dry run)")
    gc.add_argument("--apply", "--delete", action="store_true", help="remove them")
    gc.add_argument("--orphan-age", type=float, default=3600.0, metavar="S",
                    help="on GCS: uncommitted objects older than this are leftovers")
    exp = sub.add_parser("export", parents=[common], help="a step as an Orbax checkpoint; "
                         "--tier NAME (no '=') reads it from that tier only")
    exp.add_argument("step", type=_step)
    exp.add_argument("dest", help="an Orbax CheckpointManager directory")
    imp = sub.add_parser("import", help="an Orbax checkpoint as a step of ours")
    imp.add_argument("directory", help="an Orbax step, manager or StandardCheckpointer dir")
    imp.add_argument("dest", help="our CheckpointManager directory (its default tiers)")
    imp.add_argument("--step", type=_step, help="which Orbax step / the step to save it as")
    imp.add_argument("--max-item-bytes", type=_bytes, metavar="N",
                     help="refuse an item whose arrays hold more (a number, or with K, M, "
                     "G or T for KiB ... TiB; default: a quarter of this host's memory)")
    imp.add_argument("--json", action="store_true", help="print one JSON document")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with _logged_safely():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command in ("export", "import"):
            return {"export": cmd_export, "import": cmd_import}[args.command](args)
        dr = survey.open_directory(args.directory, args.tier)
        cmd = {"ls": cmd_ls, "inspect": cmd_inspect, "verify": cmd_verify,
               "gc": cmd_gc}[args.command]
        return cmd(dr, args)
    except (ValueError, OSError) as e:
        return _fail(str(e), 2)


if __name__ == "__main__":
    sys.exit(main())
