"""Root metadata: what `CheckpointManager(..., metadata=...)` keeps for every step.

It lives where Orbax keeps it, `<directory>/metadata/_ROOT_METADATA` (JSON with
`internal_metadata` and `custom_metadata`), so either manager reads what the
other wrote; where only older Orbax's `<directory>/metadata/metadata` (the
custom metadata alone) is there, that is read. As in Orbax: written once,
create-only, by process 0 of a manager that may write; a later manager
given other metadata keeps the stored one; a read-only manager never writes
and, when none is stored, reports what it was given. A gs:// directory is
written through the tier whose storage is the directory; with no such tier,
nothing is written there (a warning says so).
docs/format.md, section 14, specifies the file.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..core import strictjson
from ..errors import CorruptCheckpointError
from ..storage import FileStorage, Storage
from .metadata import RootMetadata, jsonable

log = logging.getLogger("resilient_ckpt")

KEY = "metadata/_ROOT_METADATA"
# Older Orbax kept only the custom metadata, as a JSON item of its own.
LEGACY_KEY = "metadata/metadata"
_MAX_BYTES = 16 << 20


def _storage(directory: str, storages: Mapping[str, Storage], create: bool) -> Storage | None:
    """The storage that holds the directory's root: a tier's when one is the
    directory, else (local only) a plain one; None when there is none."""
    where = directory.rstrip("/") if directory.startswith("gs://") \
        else os.path.abspath(directory)
    found = next((s for s in storages.values() if s.url == where), None)
    if found is not None or where.startswith("gs://"):
        return found
    if not create and not os.path.isdir(where):
        return None
    return FileStorage(where, "local", create=create)


def encode(custom: Any) -> bytes:
    if not isinstance(custom, Mapping) or not all(isinstance(k, str) for k in custom):
        raise TypeError(f"metadata must be a dict with str keys, not {type(custom).__name__}")
    doc = {"internal_metadata": {}, "custom_metadata": jsonable(dict(custom))}
    return json.dumps(doc).encode()


def decode(data: bytes, where: str) -> RootMetadata:
    try:
        doc = strictjson.Reader(where).load(data)  # bounded: too deep is corrupt
        if not isinstance(doc, dict):
            raise ValueError(f"an object is expected, got {strictjson.short(doc)}")
        custom, internal = doc.get("custom_metadata") or {}, doc.get("internal_metadata") or {}
        if not isinstance(custom, dict) or not isinstance(internal, dict):
            raise ValueError("custom_metadata and internal_metadata must be objects")
    except (ValueError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(
            f"{where}: not valid root metadata ({e}); fix or remove the file (a manager "
            "given metadata= then writes it again)") from None
    return RootMetadata(custom_metadata=custom, internal_metadata=internal)


def decode_legacy(data: bytes, where: str) -> RootMetadata:
    """Older Orbax's root metadata: the custom metadata alone, a JSON object."""
    try:
        doc = strictjson.Reader(where).load(data)
        if not isinstance(doc, dict):
            raise ValueError(f"an object is expected, got {strictjson.short(doc)}")
    except (ValueError, CorruptCheckpointError) as e:
        raise CorruptCheckpointError(
            f"{where}: not valid root metadata ({e}); fix or remove the file") from None
    return RootMetadata(custom_metadata=doc)


def for_manager(directory: str, storages: Mapping[str, Storage], given: Any, options: Any,
                read_only: bool, process_index: int) -> RootMetadataFile:
    """The root metadata as a manager reads its `metadata=`: with Orbax's
    `save_root_metadata=False` (in Orbax's options), a manager that may write
    neither writes it nor reports it (a read-only one still reports it)."""
    save = getattr(options, "save_root_metadata", True)
    return RootMetadataFile(directory, storages, given if save or read_only else None,
                            save and not read_only, process_index)


class RootMetadataFile:
    """The root metadata of one manager's directory, read once (as Orbax reads it)."""

    def __init__(self, directory: str, storages: Mapping[str, Storage], given: Any,
                 may_write: bool, process_index: int):
        self._directory, self._storages = directory, storages
        self._given = None if given is None else dict(given)
        self._cached: RootMetadata | None = None
        if given is None or not may_write or process_index != 0:
            return
        data = encode(given)
        st = _storage(directory, storages, create=True)
        if st is None:
            log.warning("root metadata of %s not written: no tier's storage is that "
                        "directory; metadata() reports what this manager was given",
                        directory)
        elif st.size(KEY) is None:
            st.put_if_absent(KEY, data)  # a racing writer's copy wins, as a stored one does

    def get(self) -> RootMetadata:
        if self._cached is None:
            st = _storage(self._directory, self._storages, create=False)
            if st is not None and st.size(KEY) is not None:
                self._cached = decode(st.read(KEY, max_bytes=_MAX_BYTES), f"{st.url}/{KEY}")
            elif st is not None and st.size(LEGACY_KEY) is not None:
                self._cached = decode_legacy(st.read(LEGACY_KEY, max_bytes=_MAX_BYTES),
                                             f"{st.url}/{LEGACY_KEY}")
            else:
                self._cached = RootMetadata(custom_metadata=dict(self._given or {}))
        return copy.deepcopy(self._cached)  # Orbax's type is mutable: each caller its own
