"""The fsspec backend: a durable tier on any fsspec filesystem named by URL.

`open_url` picks the storage for a URL: `s3://` (s3fs), `gs://` (gcsfs, an
alternative to storage/gcs.py), `az://` / `abfs://` (adlfs) and other
fsspec protocols get a `FsspecStorage`; `file://` (a file system every host
mounts) gets `SharedFiles`, the file backend marked shared and remote. The
fsspec packages are imported here only, when such a tier is opened.

The commit is create-only where the store can express it (docs/object_stores.md):
S3 `PutObject` with `If-None-Match: *`, GCS `ifGenerationMatch=0`, Azure
`If-None-Match: *`, and on a shared file system a link(2) of a written
temporary onto the final name. Elsewhere `create_only_commit` is False and
the tier refuses to be written (tiers.FsspecTier). A create-only put that
finds the object there reads it back: the same bytes mean an earlier attempt
of ours landed and only its answer was lost.

Every request goes through storage/retry.py; the clients' own retries are
turned off where they can be, so the two never compound. Failures leave as
StorageError naming the URL.
"""
from __future__ import annotations

import concurrent.futures as cf
import datetime
import errno
import io
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError, StorageError
from .base import Storage, check_size, ours_already, read_in_ranges
from .files import FileStorage
from .retry import Attempts, RetryPolicy, Transient

# How each protocol writes an object only if absent, atomically on the server.
_CREATE_ONLY: dict[str, dict[str, Any]] = {
    "s3": {"mode": "create"}, "s3a": {"mode": "create"},
    "gs": {"mode": "create"}, "gcs": {"mode": "create"},
    "az": {"overwrite": False}, "abfs": {"overwrite": False}, "abfss": {"overwrite": False},
}
_KIND = {"s3a": "s3", "gs": "gcs", "abfs": "az", "abfss": "az"}


def split_url(url: str) -> tuple[str, str]:
    """(protocol, path after it) of `proto://path`; ValueError when malformed."""
    proto, sep, path = url.partition("://")
    if not sep or not proto or not path.strip("/"):
        raise ValueError(f"{url!r} is not a URL of a store (expected e.g. "
                         "s3://bucket/prefix, az://container/prefix, file:///mnt/shared)")
    return proto.lower(), path.rstrip("/")


def open_url(url: str, storage_options: dict | None = None, *,
             retry: RetryPolicy = RetryPolicy(), concurrency: int = 8,
             piece_bytes: int = 64 * 2**20, create: bool = True) -> Storage:
    """The storage of `url` (see the module's docstring)."""
    proto, path = split_url(url)
    if proto in ("file", "local"):
        return SharedFiles(path if path.startswith("/") else "/" + path, create=create)
    return FsspecStorage(url, storage_options, retry=retry, concurrency=concurrency,
                         piece_bytes=piece_bytes)


def client_options(proto: str, given: dict | None, retry: RetryPolicy) -> dict:
    """fsspec options for `proto`: the user's, with the client's own retries
    off and our attempt timeout, unless the user set them."""
    opts = dict(given or {})
    opts.setdefault("skip_instance_cache", True)  # our own client, our own settings
    opts.setdefault("use_listings_cache", False)  # other hosts change what is there
    if proto in ("s3", "s3a"):
        cfg = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("retries", {"total_max_attempts": 1})
        cfg.setdefault("connect_timeout", min(10.0, retry.attempt_timeout_s))
        cfg.setdefault("read_timeout", retry.attempt_timeout_s)
        opts["config_kwargs"] = cfg
    return opts


class FsspecStorage(Storage):
    """The objects under one fsspec URL (see the module's docstring)."""

    shared = True
    remote = True
    sizes_from_manifest = True

    def __init__(self, url: str, storage_options: dict | None = None, *,
                 retry: RetryPolicy = RetryPolicy(), concurrency: int = 8,
                 piece_bytes: int = 64 * 2**20):
        import fsspec

        proto, path = split_url(url)
        self.protocol = proto
        self.kind = _KIND.get(proto, proto)
        self.url = f"{proto}://{path.strip('/')}"
        self.retry = retry
        self.piece_bytes = max(5 << 20, piece_bytes)  # S3's smallest multipart part
        self.create_only_commit = proto in _CREATE_ONLY
        opts = client_options(proto, storage_options, retry)
        try:
            if proto in ("gs", "gcs"):
                # gcsfs's plain HTTP client: its default "extended" one first asks
                # each bucket's type over gRPC, which an emulator never answers.
                from gcsfs.core import GCSFileSystem
                self._fs = GCSFileSystem(**opts)
            else:
                self._fs = fsspec.filesystem(proto, **opts)
        except (ImportError, ValueError) as e:
            raise StorageError(errno.ENOPKG, f"{self.url}: no fsspec filesystem for {proto}:// "
                                             f"({e}); install the extra, e.g. "
                                             "pip install 'resilient_ckpt[s3]'") from e
        if hasattr(self._fs, "retries"):
            self._fs.retries = 1  # s3fs's own loop: ours decides
        self._root = fsspec.core.strip_protocol(self.url).rstrip("/")
        self._pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="rc-fsspec")
        self._closed = False
        self._attempts = Attempts()

    # ------------------------------------------------------------ helpers

    def _path(self, key: str) -> str:
        return f"{self._root}/{key}" if key else self._root

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    @property
    def requests(self) -> int:
        """Attempts made so far (for tests and records)."""
        return self._attempts.count

    def _call(self, fn: Callable, what: str, key: str):
        return self._attempts.call(fn, self.retry, f"{what} {self._where(key)}",
                                   lambda e: _final(e, what, self._where(key)))

    # ------------------------------------------------------------ writes

    def put(self, key: str, data) -> None:
        # One PUT (multipart past 2 x 50 MiB in s3fs, finished atomically). The
        # clients take bytes only, so a chunk is copied once on its way out.
        body = data if isinstance(data, bytes) else memoryview(data).cast("B").tobytes()
        self._call(lambda: self._fs.pipe_file(self._path(key), body), "write of", key)

    def put_stream(self, key: str, opener: Callable[[], io.RawIOBase], size: int | None) -> None:
        """Up to `piece_bytes` in one request; larger (or unsized) through the
        filesystem's own writer, a multipart upload of `piece_bytes` parts that
        becomes visible only when finished. A failure retries the whole stream."""
        if size is not None and size <= self.piece_bytes:
            with opener() as f:
                data = f.read()
            self.put(key, data)
            return

        def attempt():
            dst = self._fs.open(self._path(key), "wb", block_size=self.piece_bytes)
            try:
                with opener() as src:
                    while piece := src.read(self.piece_bytes):
                        dst.write(piece)
            except BaseException:
                # fsspec's writers commit what they hold when closed, also on an
                # error: abort the upload and mark it closed, so nothing is written.
                dst.discard()
                dst.closed = True
                raise
            dst.close()
        self._call(attempt, "write of", key)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if not self.create_only_commit:
            raise StorageError(errno.ENOTSUP, f"commit of {self._where(key)}: {self.protocol}:// "
                                              "has no create-only write, so this store cannot "
                                              "commit a step (docs/object_stores.md)")
        kw = _CREATE_ONLY[self.protocol]
        sent = [False]

        def attempt() -> bool:
            try:
                sent[0] = True
                self._fs.pipe_file(self._path(key), data, **kw)
                return True
            except FileExistsError:
                return False
            except Exception as e:
                if type(e).__name__ == "ResourceExistsError":  # adlfs passes Azure's 409 on
                    return False
                raise
        try:
            if self._call(attempt, "commit of", key):
                return True
        except StorageError as e:
            e.nothing_written = not sent[0]
            raise
        return ours_already(self, key, data)

    # ------------------------------------------------------------ reads

    def _range(self, key: str, view: memoryview, offset: int) -> None:
        end = offset + len(view)
        got = self._fs.cat_file(self._path(key), start=offset, end=end)
        if len(got) < len(view):
            n = self.size(key)
            if n is not None and n < end:
                raise StorageError(errno.EIO, f"{self._where(key)}: {n} bytes, fewer than the "
                                              f"{end} expected; the object is truncated")
            raise Transient(f"body cut short at {len(got)} of {len(view)} bytes")
        view[:] = got[:len(view)]

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        read_in_ranges(self._pool, lambda v, at: self._call(
            lambda: self._range(key, v, at), "read of", key), out, offset)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        n = self.size(key)
        if n is None:
            raise StorageError(errno.ENOENT, f"{self._where(key)}: no such object")
        check_size(self._where(key), n, max_bytes)
        data = self._call(lambda: self._fs.cat_file(self._path(key)), "read of", key)
        check_size(self._where(key), len(data), max_bytes)
        return data

    def size(self, key: str) -> int | None:
        def attempt() -> int | None:
            try:
                info = self._fs.info(self._path(key))
            except FileNotFoundError:
                return None
            return int(info["size"]) if info.get("type") == "file" else None
        return self._call(attempt, "size of", key)

    # ------------------------------------------------------------ listing

    def _entries(self, prefix: str, recursive: bool) -> list[dict]:
        """Entries strictly under `prefix` (one level, or all objects)."""
        path = self._path(prefix)

        def attempt() -> list[dict]:
            try:
                if recursive:
                    return list(self._fs.find(path, detail=True).values())
                return self._fs.ls(path, detail=True)
            except FileNotFoundError:
                return []
        entries = self._call(attempt, "listing of", prefix)
        base = path.rstrip("/") + "/" if path else ""
        return [e for e in entries if e["name"].startswith(base) and e["name"] != base]

    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        cut = len(self._path(prefix).rstrip("/")) + 1
        names = {e["name"][cut:].rstrip("/") for e in self._entries(prefix, False)}
        return sorted(n for n in names if n and n.startswith(starts_with))

    def object_ages(self, prefix: str) -> dict[str, float]:
        cut, now = len(self._path(prefix)) + 1, time.time()
        return {e["name"][cut:]: now - _mtime(e, now)
                for e in self._entries(prefix, True) if e.get("type") == "file"}

    # ------------------------------------------------------------ deleting

    def delete(self, key: str) -> None:
        def attempt():
            try:
                self._fs.rm_file(self._path(key))
            except FileNotFoundError:
                pass  # gone already, maybe by our own earlier attempt
        self._call(attempt, "delete of", key)

    def delete_dir(self, prefix: str) -> None:
        cut = len(self._root) + 1
        keys = [e["name"][cut:] for e in self._entries(prefix, True) if e.get("type") == "file"]
        for f in [self._pool.submit(self.delete, k) for k in keys]:
            f.result()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)


class SharedFiles(FileStorage):
    """file://: a directory every host mounts (NFS, Lustre, a FUSE bucket).

    The file backend's atomic puts (a temporary, fsync, rename) and its commit
    (link(2) of a written temporary onto the final name, which fails if the
    name exists, atomically on the server also over NFS). Shared and remote:
    one process cleans it, by age, since a writer marker cannot tell a dead
    writer on another host from a live one.
    """

    shared = True
    remote = True

    def __init__(self, root: str, create: bool = True):
        super().__init__(root, "file", fsync=True, create=create)
        self.url = f"file://{self.root}"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if super().put_if_absent(key, data):
            return True
        # A retransmitted LINK whose first reply was lost fails with EEXIST on NFS
        # although it was ours: the same bytes say so.
        try:
            return self.read(key, max_bytes=len(data)) == bytes(data)
        except StorageError:
            return False

    def object_ages(self, prefix: str) -> dict[str, float]:
        top, now, out = os.path.join(self.root, prefix), time.time(), {}
        for d, _, files in os.walk(top):
            for n in files:
                p = os.path.join(d, n)
                try:
                    out[os.path.relpath(p, top)] = now - os.stat(p).st_mtime
                except FileNotFoundError:
                    pass
        return out


def _mtime(entry: dict, default: float) -> float:
    """Seconds since the epoch an entry was written, whatever the filesystem calls it."""
    for field in ("LastModified", "last_modified", "updated", "mtime", "timeCreated"):
        v = entry.get(field)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return default


def _final(e: BaseException, what: str, where: str) -> BaseException:
    """Our error for a final failure of a request."""
    if isinstance(e, CheckpointError):
        return e
    if isinstance(e, FileNotFoundError):
        return StorageError(errno.ENOENT, f"{what} {where}: not found; does the bucket exist?")
    if isinstance(e, PermissionError):
        return StorageError(errno.EACCES, f"{what} {where}: permission denied; check the "
                                          "credentials in storage_options and the store's "
                                          "access policy")
    return StorageError(errno.EIO, f"{what} {where} failed: {type(e).__name__}: {str(e)[:300]}")
