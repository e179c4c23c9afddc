"""Tier configurations: where a tier lives, how often it saves, how many it keeps.

Tiers are small frozen records composed into the manager's options, listed
fastest first. `RamTier` is a directory under /dev/shm, so a restarted process on
the same host still restores from memory; `LocalTier` is a directory on disk (a
plain Orbax-style directory is one LocalTier); `GcsTier` is a gs://bucket/prefix
(a gs:// directory given to the manager is one GcsTier); `FsspecTier` is any
fsspec URL (s3://, az://, gs:// through gcsfs, file:// on a shared file
system), always named by its own `url`. The RAM tier's
directories are made 0700, and refused when another user could control them.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import stat
import tempfile

from .core.codec import Codec, check as check_codec
from .errors import UnsafeDirectoryError
from .storage import FileStorage, Storage
from .storage.retry import RetryPolicy

SHM = "/dev/shm"


@dataclasses.dataclass(frozen=True)
class RamTier:
    """Host RAM (tmpfs). `every`: save interval in steps; `keep`: steps kept.

    `replicas`: with several processes, each host keeps every shard its devices
    hold, data-parallel replicas included, not only the ones it writes for the
    job: its own RAM then restores its part of the state alone, and a lost
    host's replicated shards still exist in its peers' RAM. It costs host
    memory for each replica a host holds; one process holds no replica it
    does not also write, so there it changes nothing.
    """

    every: int = 1
    keep: int | None = 2
    path: str | None = None  # default: /dev/shm/resilient_ckpt/<hash of the directory>
    replicas: bool = True
    kind = "ram"
    rank = 0  # tier order: fastest first

    def open(self, directory: str, create: bool) -> FileStorage:
        # /dev/shm is writable by every local user, so the directories we use
        # there are made 0700 by us, or refused when someone else could have
        # made or could change them (a link to elsewhere, another user's).
        path = self.path
        if path is None:
            remote = directory.startswith("gs://")
            where = directory if remote else os.path.abspath(directory)
            base = SHM if os.path.isdir(SHM) else os.path.join(
                tempfile.gettempdir() if remote else where, ".ram")
            digest = hashlib.sha256(where.encode()).hexdigest()[:16]
            path = os.path.join(base, "resilient_ckpt", digest)
            if create:
                os.makedirs(base, exist_ok=True)
            _private_dir(os.path.dirname(path), create)
        elif create:  # the user's own place: only the directory itself is ours to check
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _private_dir(path, create)
        # tmpfs has no durability to gain from fsync; a host crash loses it anyway.
        return FileStorage(path, "ram", fsync=False, create=create, zero_copy=True)


def _private_dir(path: str, create: bool) -> None:
    """Makes `path` a directory of ours with mode 0700 (when `create`), or
    checks the one already there: a directory, not a link, ours, and not
    writable by group or others; else UnsafeDirectoryError. Nothing is
    chmodded: an existing directory is the user's to change."""
    if create:
        try:
            os.mkdir(path, 0o700)
            return
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # not there, and not to be made: nothing is read or written in it
    check_private(path, st)


def check_private(path: str, st: os.stat_result) -> None:
    """UnsafeDirectoryError unless `st` (of `path`, not followed) is a
    directory of ours that no group or other user can write: the check a
    RAM tier's directory passes (`_private_dir`; the tool makes it on the
    descriptor it then reads through)."""
    mode, me = stat.S_IMODE(st.st_mode), os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != me:
        problem = f"belongs to another user (uid {st.st_uid}; we are uid {me})"
    elif mode & 0o022:
        problem = "is writable by group or others"
    else:
        return
    raise UnsafeDirectoryError(
        errno.EPERM, f"RAM tier directory {path} {problem} (owner uid {st.st_uid}, mode "
                     f"{mode:04o}), so another local user could control what is saved "
                     "there; it is not used. Remove it if it is yours, or pass "
                     "RamTier(path=...) a directory of your own that only you can write "
                     "(mode 0700)")


@dataclasses.dataclass(frozen=True)
class LocalTier:
    """A local-disk directory; None fields take the manager's options
    (`save_interval_steps`, `max_to_keep`) and directory.

    `direct_io`: chunk files are written with O_DIRECT, past the page cache
    (faster, and no host memory taken by cached checkpoint bytes), and a
    restore's big reads of ranges the cache does not hold go the same way
    (with map_cached, only the parts of chunks read into place); False
    writes and reads them through the cache, so a restore soon after a save
    reads memory.
    `map_cached`: a restore maps the step's packs (copy-on-write, as the
    RAM tier's) instead of copying them into new memory, the ranges the
    page cache lacks read ahead into it; the restored arrays are the
    cache's pages, and their disk blocks stay allocated while they live.
    """

    path: str | None = None
    every: int | None = None
    keep: int | None = None
    fsync: bool = True
    direct_io: bool = True
    map_cached: bool = True
    kind = "local"
    rank = 1  # tier order: fastest first

    def open(self, directory: str, create: bool) -> FileStorage:
        if self.path is None and directory.startswith("gs://"):
            raise ValueError(f"LocalTier() needs path= when the manager's directory is "
                             f"a gs:// URL ({directory})")
        return FileStorage(self.path or directory, "local", fsync=self.fsync, create=create,
                           direct=self.direct_io, maps_cached=self.map_cached)


@dataclasses.dataclass(frozen=True)
class GcsTier:
    """A GCS prefix, `gs://bucket/prefix` (None: the manager's directory, when it
    is a gs:// URL). None `every`/`keep` take the manager's options.

    It uploads in the background a step that a faster tier of the same manager
    has committed, reading that tier's copy (never the devices again; a step
    due only here is also written to the fastest tier, which it is read from);
    without a faster tier it uploads from the host snapshot. An upload still
    queued when the next one is due is dropped: only the newest step needs to
    reach GCS. `concurrency` chunks are in flight at once. A chunk of up to
    `piece_bytes` goes in one request (straight from the RAM tier's mapping or
    the snapshot, without a copy); a larger one in parts of `piece_bytes`,
    composed on GCS, so an upload holds at most two pieces of memory.
    `codec`: "raw" (the default: faster for float32 and bfloat16 alike in
    our measurements, docs/gcs.md) or "zstd" (at `level`, only for chunks it shrinks by 3%
    or more; worth it where a host's upload is slow and it has cores to spare,
    mostly for bfloat16 states). `endpoint`: an emulator's URL (default: the
    STORAGE_EMULATOR_HOST variable, else Google's). `retry`: backoff and
    deadlines of every request. Objects of uncommitted steps older than
    `orphan_age_s` are removed when a manager opens the tier.
    """

    url: str | None = None
    every: int | None = None
    keep: int | None = None
    codec: Codec = "raw"
    level: int = 1
    endpoint: str | None = None
    concurrency: int = 8
    piece_bytes: int = 64 * 2**20
    retry: RetryPolicy = RetryPolicy()
    orphan_age_s: float = 3600.0
    kind = "gcs"
    rank = 2  # tier order: fastest first

    def __post_init__(self):
        check_codec(self.codec, "GcsTier.codec")
        if self.concurrency < 1:
            raise ValueError(f"GcsTier.concurrency must be >= 1, got {self.concurrency}")

    def open(self, directory: str, create: bool) -> Storage:
        del create  # a bucket is made by its owner, not by a training job
        from .storage.gcs import GcsStorage
        url = self.url or directory
        if not url.startswith("gs://"):
            raise ValueError(f"GcsTier() needs a gs://bucket/prefix URL (got directory "
                             f"{directory!r} and url={self.url!r})")
        return GcsStorage(url, endpoint=self.endpoint, retry=self.retry,
                          concurrency=self.concurrency, piece_bytes=self.piece_bytes)


@dataclasses.dataclass(frozen=True)
class FsspecTier:
    """A durable tier on an fsspec filesystem: `s3://bucket/prefix` (s3fs),
    `az://container/prefix` (adlfs), `gs://bucket/prefix` (gcsfs, instead of
    GcsTier's client) or `file:///mnt/shared/run` (a file system every host
    mounts). The manager's directory stays a local path: `url` is required.

    It runs as GcsTier does: uploads in the background from a faster tier's
    committed copy, its own `every`/`keep` (None: the manager's options),
    restores from it alone, `retry` for every request (the clients' own
    retries off), `concurrency` objects in flight. `storage_options` go to the
    filesystem as given (credentials, `client_kwargs={"endpoint_url": ...}`
    for MinIO or a local server; docs/object_stores.md). Only a store with a
    create-only write can commit steps; another is opened read-only or refused.
    """

    url: str = ""
    every: int | None = None
    keep: int | None = None
    storage_options: dict | None = dataclasses.field(default=None, hash=False, compare=False)
    codec: Codec = "raw"
    level: int = 1
    concurrency: int = 8
    piece_bytes: int = 64 * 2**20
    retry: RetryPolicy = RetryPolicy()
    orphan_age_s: float = 3600.0
    rank = 2  # tier order: fastest first

    def __post_init__(self):
        check_codec(self.codec, "FsspecTier.codec")
        from .storage.fsspec_store import split_url
        split_url(self.url)
        if self.concurrency < 1:
            raise ValueError(f"FsspecTier.concurrency must be >= 1, got {self.concurrency}")

    @property
    def kind(self) -> str:
        """The tier's name: the store's (s3, az, gcs, file, or the protocol)."""
        proto = self.url.partition("://")[0].lower()
        return {"s3a": "s3", "gs": "gcs", "abfs": "az", "abfss": "az",
                "local": "file"}.get(proto, proto)

    def open(self, directory: str, create: bool) -> Storage:
        del directory  # always its own url
        from .storage.fsspec_store import open_url
        st = open_url(self.url, self.storage_options, retry=self.retry,
                      concurrency=self.concurrency, piece_bytes=self.piece_bytes,
                      create=create)
        if create and not st.create_only_commit:
            st.close()
            raise ValueError(f"FsspecTier({self.url!r}): this store has no create-only write, "
                             "so two writers could commit one step; only s3://, gs://, az:// "
                             "and file:// can be written (docs/object_stores.md). Open it "
                             "with read_only=True to restore from it")
        return st
