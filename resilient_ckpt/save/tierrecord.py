"""The tiers record: a small JSON file at a directory's root naming its tiers.

A manager that saves in a directory records there (process 0, as each
save starts, when the record differs) the name, kind and place of each of
its tiers and its step naming, so tools
(`resilient-ckpt`) find a per-host RAM tier under /dev/shm, or a GCS prefix,
without the user typing the configuration again. It holds no secrets (no
credentials, no endpoints). It is written atomically, only when it changes,
and a failure to write it is logged, never raised: it is an aid, not part of
any commit. docs/format.md, section 13, specifies it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Protocol

from ..core import layout
from ..core.layout import StepNaming
from ..core.strictjson import short
from ..storage import FileStorage, Storage

log = logging.getLogger("resilient_ckpt")

RECORD_NAME = ".rc-tiers.json"
RECORD_FORMAT = "resilient_ckpt.tiers"
RECORD_VERSION = 1
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


def encode(storages: Mapping[str, Storage], naming: StepNaming) -> bytes:
    doc = {"format": RECORD_FORMAT, "version": RECORD_VERSION,
           "step_prefix": naming.prefix, "step_format_fixed_length": naming.fixed_length,
           "tiers": [{"name": n, "kind": s.kind, "where": s.url} for n, s in storages.items()]}
    return json.dumps(doc, indent=1).encode() + b"\n"


def decode(data: bytes, where: str) -> TiersRecord:
    """The record in `data`; ValueError naming `where` and the field otherwise."""
    try:
        doc = json.loads(data)
        if doc["format"] != RECORD_FORMAT or doc["version"] != RECORD_VERSION:
            raise ValueError(f"format {doc['format']!r} version {doc['version']!r} is not "
                             f"{RECORD_FORMAT!r} version {RECORD_VERSION}")
        tiers = tuple(TierEntry(str(t["name"]), str(t["kind"]), str(t["where"]))
                      for t in doc["tiers"])
        prefix, fixed = doc["step_prefix"], doc["step_format_fixed_length"]
        if not (prefix is None or isinstance(prefix, str)) or \
                not (fixed is None or type(fixed) is int):
            raise ValueError("step_prefix or step_format_fixed_length has the wrong type")
        if fixed is not None and not 0 <= fixed <= layout.MAX_NAME_BYTES:
            raise ValueError(f"step_format_fixed_length {short(fixed)} is not in "
                             f"[0, {layout.MAX_NAME_BYTES}]")
        naming = StepNaming(prefix, fixed)  # its names become paths: one component each
        layout.check_name(naming.name(0), "with step_prefix "
                          f"{short(prefix)}, a step's name")
        return TiersRecord(tiers, naming)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a valid tiers record ({type(e).__name__}: {e}); "
                         "pass the tiers with --tier NAME=PATH, or open the directory "
                         "once with a writable CheckpointManager to write it again") from None


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
    data = encode(storages, naming)
    home = os.path.abspath(directory)
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


def read(directory: str, storage: Storage | None = None) -> TiersRecord | None:
    """The record at `directory` (through `storage`, needed for gs://), or None
    when there is none."""
    st = storage or FileStorage(directory, "local", create=False)
    if st.size(RECORD_NAME) is None:
        return None
    return decode(st.read(RECORD_NAME, max_bytes=_MAX_BYTES), f"{st.url}/{RECORD_NAME}")
