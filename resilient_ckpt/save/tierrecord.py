"""The tiers record: a small JSON file at a directory's root naming its tiers.

A manager that saves in a directory records there (process 0, as each
save starts, when the record differs) the name, kind and place of each of
its tiers and its step naming, so tools
(`resilient-ckpt`) find a per-host RAM tier under /dev/shm, or a GCS prefix,
without the user typing the configuration again. It holds no secrets (no
credentials, no endpoints). It is written atomically, only when it changes,
and a failure to write it is logged, never raised: it is an aid, not part of
any commit. A place inside the directory is recorded relative to it (`.`
for the directory itself), so a moved or copied directory names its own
tiers. Reading is strict (`decode`: every field typed and bounded), and what
it reads is a hint: whoever uses a place (the tool, cli/survey.py) checks it
first. docs/format.md, section 13, specifies it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from ..core import layout, strictjson
from ..core.layout import StepNaming
from ..errors import CorruptCheckpointError, UnsupportedFormatError
from ..storage import FileStorage, Storage

log = logging.getLogger("resilient_ckpt")

RECORD_NAME = ".rc-tiers.json"
RECORD_FORMAT = "resilient_ckpt.tiers"
RECORD_VERSION = 2  # 2: places relative to the directory, and the directory itself
_MAX_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class TierEntry:
    """One tier: its name in manifests and messages, kind, and place (a
    directory, or a gs://bucket/prefix URL)."""

    name: str
    kind: str
    where: str


@dataclasses.dataclass(frozen=True)
class TiersRecord:
    tiers: tuple[TierEntry, ...]
    naming: StepNaming
    directory: str | None  # the absolute path it was written for (None: version 1)


MAX_TIERS = 16
_MAX_NAME = 200  # a tier's name and kind
_MAX_WHERE = 4096  # PATH_MAX
_MAX_FIXED_LENGTH = 20  # digits of a step (layout.MAX_STEP has 19)
_ADVICE = ("pass the tiers with --tier NAME=PATH, or open the directory once with a "
           "writable CheckpointManager to write it again")


def encode(storages: Mapping[str, Storage], naming: StepNaming, home: str) -> bytes:
    """The record of a manager's tiers in local directory `home`: a place in
    `home` relative to it (`.` for `home` itself), any other as it is."""
    def where(url: str) -> str:
        if "://" in url or not _within(url, home):
            return url
        return os.path.relpath(url, home)
    doc = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "directory": home,
           "step_prefix": naming.prefix, "step_format_fixed_length": naming.fixed_length,
           "tiers": [{"name": n, "kind": s.kind, "where": where(s.url)}
                     for n, s in storages.items()]}
    return json.dumps(doc, indent=1).encode() + b"\n"


def _within(path: str, home: str) -> bool:
    return path == home or path.startswith(home.rstrip("/") + "/")


def decode(data: bytes, where: str) -> TiersRecord:
    """The record in `data`: every field typed and bounded; else
    CorruptCheckpointError (UnsupportedFormatError for a newer one) naming
    `where` and the field."""
    r = strictjson.Reader(where)
    try:
        doc = r.load(data)
        if not isinstance(doc, dict):
            raise r.fail(f"the tiers record is not an object, got {strictjson.short(doc)}")
        version = r.int_(doc.get("version"), "version", 1)
        if version > RECORD_VERSION:
            raise UnsupportedFormatError(f"{where}: version {version} is newer than this "
                                         f"reader's ({RECORD_VERSION}): upgrade to read it")
        d = r.obj(doc, "the tiers record", {"format", "version", "step_prefix",
                                            "step_format_fixed_length", "tiers"}
                  | ({"directory"} if version >= 2 else set()))
        r.str_(d["format"], "format", {RECORD_FORMAT})
        home = _text(r, d["directory"], "directory", _MAX_WHERE) if version >= 2 else None
        if home is not None and not home.startswith("/"):
            raise r.fail(f"directory must be an absolute path, got {strictjson.short(home)}")
        prefix, fixed = d["step_prefix"], d["step_format_fixed_length"]
        if prefix is not None:
            _text(r, prefix, "step_prefix", _MAX_NAME)
        if fixed is not None:
            r.int_(fixed, "step_format_fixed_length", 0, _MAX_FIXED_LENGTH)
        tiers = []
        for i, t in enumerate(r.list_(d["tiers"], "tiers", MAX_TIERS)):
            t = r.obj(t, f"tiers[{i}]", {"name", "kind", "where"})
            tiers.append(TierEntry(_text(r, t["name"], f"tiers[{i}].name", _MAX_NAME),
                                   _text(r, t["kind"], f"tiers[{i}].kind", _MAX_NAME),
                                   _text(r, t["where"], f"tiers[{i}].where", _MAX_WHERE)))
        naming = StepNaming(prefix, fixed)  # its names become paths: one component each
        layout.check_name(naming.name(0), f"{where}: with step_prefix "
                          f"{strictjson.short(prefix)}, a step's name")
        return TiersRecord(tuple(tiers), naming, home)
    except CorruptCheckpointError as e:
        raise type(e)(f"{e}; {_ADVICE}") from None


def _text(r: strictjson.Reader, v: Any, ctx: str, max_len: int) -> str:
    """A non-empty string of at most `max_len` characters, without NUL or `/`
    in a name (a `where` may hold `/`)."""
    s = r.str_(v, ctx)
    path = ctx.endswith(("where", "directory"))
    if not 0 < len(s) <= max_len or "\0" in s or (not path and "/" in s):
        raise r.fail(f"{ctx} must be 1 to {max_len} characters without NUL"
                     + ("" if path else " or '/'")
                     + f", got {strictjson.short(s)}")
    return s


def place(e: TierEntry, directory: str) -> str:
    """Where a recorded tier is, for a record in local `directory`: a
    relative path joined to it (normalised), an absolute one or a URL as it is."""
    if "://" in e.where:
        return e.where
    return os.path.normpath(os.path.join(os.path.abspath(directory), e.where))


class _Opened(Protocol):
    """What `record` needs of the manager's catalog."""

    naming: StepNaming
    peers: Any  # agree.Peers: `.index`

    def storages(self) -> dict[str, Storage]: ...


def record(directory: str, catalog: _Opened, writing: bool) -> None:
    """Writes the record at the root of a local `directory` when the
    catalog's process is `writing` there as process 0 and the record there
    differs (atomically: a reader sees the old one or the new one). Called as
    each save starts: a small read when nothing changed."""
    if not writing or catalog.peers.index != 0:
        return
    storages, naming = catalog.storages(), catalog.naming
    if directory.startswith("gs://"):
        # Not written to GCS: it would cost requests (and retries) at every open,
        # and the default tiers of a gs:// directory are found without it.
        return
    home = os.path.abspath(directory)
    data = encode(storages, naming, home)
    try:
        st = next((s for s in storages.values() if s.url == home), None) or \
            FileStorage(home, "local", create=True)
        if st.size(RECORD_NAME) is not None and \
                st.read(RECORD_NAME, max_bytes=_MAX_BYTES) == data:
            return
        st.put(RECORD_NAME, memoryview(data))
    except OSError as e:
        log.warning("could not record the tiers at %s/%s (%s); tools then need them "
                    "given (resilient-ckpt --tier NAME=PATH)", home, RECORD_NAME, e)


def read(directory: str) -> TiersRecord | None:
    """The record at local `directory`, or None when there is none;
    CorruptCheckpointError when it is not a valid one. Its places are hints
    (`place`): a reader checks each before it uses it."""
    st = FileStorage(directory, "local", create=False)
    if st.size(RECORD_NAME) is None:  # none, or not a regular file (never followed)
        if os.path.lexists(os.path.join(st.root, RECORD_NAME)):
            raise CorruptCheckpointError(f"{st.url}/{RECORD_NAME}: not a regular file (a "
                                         f"link, FIFO or directory), not read; {_ADVICE}")
        return None
    return decode(st.read(RECORD_NAME, max_bytes=_MAX_BYTES), f"{st.url}/{RECORD_NAME}")
