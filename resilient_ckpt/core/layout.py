"""Names on storage: step directories, manifests, chunk objects, temporaries.

Pure string functions, shared by every storage backend. A tier's root holds
one directory (or prefix) per step, named as Orbax names them (`<step>`, or
`<prefix>_<step>`, optionally zero-padded); inside it, packs of chunks (or one
object per chunk, in format 2 and for chunks as large as a pack) and
one manifest per writing process, `manifest.<i>-of-<n>.json`, the commit record.
Temporaries and in-progress markers carry the writer's host, pid and process
start time, so a cleaner can tell a dead writer's leftovers from a live save.
A step's claim, `claim.<i>-of-<n>.json` (claim.py), says which save may commit
it; `.rc-writer.lock` in a file tier's root is the writer lock (writer_lock.py).
What a step number may be is `check_step`'s, the one check every entry point
that takes a step from a user (save, restore, delete, the CLI) makes. What a
name read from storage must be before it becomes part of a path (an item's
name, an array's, a step directory's) is `check_name`'s: one path component
(`is_name`); an item name the caller gives a save passes the same rule
(`check_item_name`).
"""
from __future__ import annotations

import dataclasses
import operator
import os
import re
import socket
import uuid

from ..errors import CorruptCheckpointError
from ..native import crc32c
from .strictjson import MAX_INT, short

MAX_STEP = MAX_INT  # a manifest's step field is bounded so
MAX_NAME_BYTES = 255  # one path component, as every file system we write takes it
MANIFEST_PREFIX = "manifest."  # every manifest's name starts so (for listing them)
WRITER_LOCK = ".rc-writer.lock"  # in a file tier's root: flocked by the live writer
_CLAIM_RE = re.compile(r"^claim\.(\d+)-of-(\d+)\.json$")
_MANIFEST_RE = re.compile(r"^manifest\.(\d+)-of-(\d+)\.json$")
_TMP_RE = re.compile(r"\.tmp\.(?P<host>[^.]+)\.(?P<pid>\d+)\.(?P<start>\d+)\.[0-9a-f]+$")
_CHUNK_RE = re.compile(r"^[0-9a-f]{8}\.(c\d+\.\d+\.(s|\d+(_\d+)*)|p\d+\.[0-9a-f]{8})$")
_MARKER_RE = re.compile(r"^\.writing\.(?P<host>[^.]+)\.(?P<pid>\d+)\.(?P<start>\d+)$")


def check_step(step: object, what: str = "this call") -> int:
    """`step` as an int when it is a step number: a whole number (an int or a
    numpy integer, never a bool) in [0, MAX_STEP], the range every manifest
    and every reader accepts; otherwise ValueError naming it and the range.
    A larger step would be written but never listed again (silent loss)."""
    try:
        n = None if isinstance(step, bool) else operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or not 0 <= n <= MAX_STEP:
        raise ValueError(f"step {short(step)} ({type(step).__name__}) given to {what} is not "
                         f"a step number: steps are whole numbers in [0, {MAX_STEP}]")
    return n


def is_name(name: object) -> bool:
    """Whether `name` can be ONE path component: a non-empty string, not `.`
    or `..`, without `/`, `\\` or NUL, at most MAX_NAME_BYTES bytes as a file
    name. The one rule for every name that may become part of a path."""
    try:
        size = len(os.fsencode(name)) if isinstance(name, str) else 0
    except UnicodeEncodeError:  # a surrogate no file name holds
        size = 0
    return 0 < size <= MAX_NAME_BYTES and name not in (".", "..") \
        and not any(c in name for c in "/\\\0")  # type: ignore[operator]


_RULE = (f"a non-empty name, not '.' or '..', without '/', '\\' or NUL, at most "
         f"{MAX_NAME_BYTES} bytes")


def check_name(name: object, what: str) -> str:
    """`name` when it is one path component (`is_name`); otherwise
    CorruptCheckpointError naming it and `what` (where it was read). Every
    name read from storage passes here before it is joined to a directory, so
    no such name can make a path reach outside it."""
    if not is_name(name):
        raise CorruptCheckpointError(
            f"{what} {short(name)} is not one path component ({_RULE}); it was not used "
            "as a path: the checkpoint is damaged or hostile")
    return name  # type: ignore[return-value]


def check_item_name(name: object, what: str) -> str:
    """`name`, an item name the caller gives (a Composite's key), when it is one
    path component (`is_name`): an item is a directory of an Orbax step (export
    writes one), so any other name would write outside it or not export at
    all. Otherwise ValueError naming it and `what`."""
    if not is_name(name):
        raise ValueError(f"{what}: item name {short(name)} is not one path component "
                         f"({_RULE}); an item becomes a directory of the step when "
                         "exported: name it with one component, e.g. 'params'")
    return name  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class StepNaming:
    """Orbax's step directory naming: `step_prefix` and `step_format_fixed_length`."""

    prefix: str | None = None
    fixed_length: int | None = None

    def name(self, step: int) -> str:
        s = str(step).zfill(self.fixed_length) if self.fixed_length else str(step)
        return f"{self.prefix}_{s}" if self.prefix else s

    def parse(self, name: str) -> int | None:
        """The step a directory name stands for, or None if it is not a step."""
        if self.prefix:
            head, sep, s = name.rpartition("_")
            if not sep or head != self.prefix:
                return None
        else:
            s = name
        if not s.isdigit() or not s.isascii():
            return None
        if self.fixed_length and len(s) < self.fixed_length:
            return None
        step = int(s)
        return step if self.name(step) == name else None


def manifest_name(process_index: int, process_count: int) -> str:
    return f"{MANIFEST_PREFIX}{process_index}-of-{process_count}.json"


def parse_manifest_name(name: str) -> tuple[int, int] | None:
    m = _MANIFEST_RE.match(name)
    if not m:
        return None
    i, n = int(m.group(1)), int(m.group(2))
    return (i, n) if i < n else None


def claim_name(process_index: int, process_count: int) -> str:
    return f"claim.{process_index}-of-{process_count}.json"


def is_claim_name(name: str) -> bool:
    return bool(_CLAIM_RE.match(name))


def chunk_key(item_index: int, leaf_index: int, offsets: tuple[int, ...]) -> str:
    return f"c{item_index}.{leaf_index}." + ("_".join(map(str, offsets)) or "s")


def pack_name(save_id: str, process_index: int, keys: list[str]) -> str:
    """The name of the pack holding the chunks `keys` (in order) of one
    process's save: `<save>.p<process>.<crc32c of the keys, 8 hex>`. A name
    says what is in the pack, so a resumed write of the same save never
    replaces a committed pack with other contents."""
    return f"{save_id[:8]}.p{process_index}.{crc32c.value(chr(10).join(keys).encode()):08x}"


def is_chunk_name(name: str) -> bool:
    """True for an object name this package writes for chunks or packs of
    chunks (save-id prefixed)."""
    return bool(_CHUNK_RE.match(name))


@dataclasses.dataclass(frozen=True)
class Writer:
    """Who writes: enough to decide later whether that writer still lives."""

    host: str
    pid: int
    start: int  # process start time in clock ticks since boot (/proc/PID/stat)

    @staticmethod
    def me() -> Writer:
        return Writer(_host(), os.getpid(), process_start_time(os.getpid()) or 0)

    def tmp_name(self, final: str) -> str:
        return f".{final}.tmp.{self.host}.{self.pid}.{self.start}.{uuid.uuid4().hex[:8]}"

    def marker_name(self) -> str:
        return f".writing.{self.host}.{self.pid}.{self.start}"

    def alive(self) -> bool | None:
        """True/False for a writer on this host; None when it is elsewhere."""
        if self.host != _host():
            return None
        return process_start_time(self.pid) == self.start


def parse_tmp_name(name: str) -> Writer | None:
    m = _TMP_RE.search(name)
    return Writer(m["host"], int(m["pid"]), int(m["start"])) if m else None


def parse_marker_name(name: str) -> Writer | None:
    m = _MARKER_RE.match(name)
    return Writer(m["host"], int(m["pid"]), int(m["start"])) if m else None


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def process_start_time(pid: int) -> int | None:
    """Start time of a live process, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 22; the command name (field 2) may hold spaces, so split after ')'.
    return int(stat.rsplit(b")", 1)[1].split()[19])
