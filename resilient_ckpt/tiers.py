"""Tier configurations: where a tier lives, how often it saves, how many it keeps.

Tiers are small frozen records composed into the manager's options, listed
fastest first. `RamTier` is a directory under /dev/shm, so a restarted process on
the same host still restores from memory; `LocalTier` is a directory on disk (a
plain Orbax-style directory is one LocalTier).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os

from .storage import FileStorage, Storage

SHM = "/dev/shm"


@dataclasses.dataclass(frozen=True)
class RamTier:
    """Host RAM (tmpfs). `every`: save interval in steps; `keep`: steps kept."""

    every: int = 1
    keep: int | None = 2
    path: str | None = None  # default: /dev/shm/resilient_ckpt/<hash of the directory>
    kind = "ram"

    def open(self, directory: str, create: bool) -> Storage:
        path = self.path
        if path is None:
            base = SHM if os.path.isdir(SHM) else os.path.join(os.path.abspath(directory), ".ram")
            digest = hashlib.sha256(os.path.abspath(directory).encode()).hexdigest()[:16]
            path = os.path.join(base, "resilient_ckpt", digest)
        # tmpfs has no durability to gain from fsync; a host crash loses it anyway.
        return FileStorage(path, "ram", fsync=False, create=create)


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A local-disk directory; None fields take the manager's options
    (`save_interval_steps`, `max_to_keep`) and directory."""

    path: str | None = None
    every: int | None = None
    keep: int | None = None
    fsync: bool = True
    kind = "local"

    def open(self, directory: str, create: bool) -> Storage:
        return FileStorage(self.path or directory, "local", fsync=self.fsync, create=create)
