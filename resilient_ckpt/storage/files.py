"""File-system storage: the RAM tier (tmpfs) and the local-disk tier.

Every object is written to a temporary name carrying the writer's identity,
fsynced, and renamed into place; `flush` fsyncs the directory so the renames
are durable before a manifest is committed after them. The commit
itself uses `put_if_absent`: the temporary is hard-linked to the final name,
which fails if the name exists, so two writers can never both commit a step.
With `zero_copy` (the RAM tier, on tmpfs) `map` and `place` hand out private,
copy-on-write mappings of objects instead of copies.
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil

import numpy as np

from ..errors import StorageError
from ..layout import Writer
from .base import Storage


class FileStorage(Storage):
    """Objects as files under `root`; `kind` names it in records ("ram",
    "local"); `zero_copy` maps objects (tmpfs only); `fsync` off on tmpfs."""

    def __init__(self, root: str, kind: str = "local", *, fsync: bool = True,
                 create: bool = True, zero_copy: bool = False):
        self.root = os.path.abspath(root)
        self.kind = kind
        self.zero_copy = zero_copy  # only on tmpfs: see map()
        self.url = self.root
        self._fsync = fsync
        self._writer = Writer.me()
        if create:
            os.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _err(self, what: str, key: str, e: OSError) -> StorageError:
        return StorageError(e.errno, f"{self.kind} tier: {what} {self._path(key)} "
                                     f"failed: {e.strerror or e}")

    def _write_tmp(self, key: str, data) -> str:
        path = self._path(key)
        d, name = os.path.split(path)
        tmp = os.path.join(d, self._writer.tmp_name(name))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view):]
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        return tmp

    def put(self, key: str, data) -> None:
        try:
            os.makedirs(os.path.dirname(self._path(key)), exist_ok=True)
            tmp = self._write_tmp(key, data)
            os.replace(tmp, self._path(key))
        except OSError as e:
            raise self._err("write of", key, e) from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = self._write_tmp(key, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                _unlink(tmp)
            self._sync_dir(os.path.dirname(path))
            return True
        except OSError as e:
            raise self._err("commit of", key, e) from e

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError as e:
            raise self._err("open of", key, e) from e
        try:
            view = memoryview(out).cast("B")
            pos = offset
            while view:
                n = os.preadv(fd, [view], pos)
                if n == 0:
                    raise StorageError(errno.EIO, f"{self._path(key)}: short read "
                                       f"at byte {pos}; the object is truncated")
                view, pos = view[n:], pos + n
        except OSError as e:
            raise self._err("read of", key, e) from e
        finally:
            os.close(fd)

    def _with_fd(self, key: str, need: int, fn):
        """fn(fd) on the object opened read-only, or None if it is shorter than
        `need` bytes (a truncated object is a missing copy, not an error)."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except OSError as e:
            raise self._err("open of", key, e) from e
        try:
            return fn(fd) if os.fstat(fd).st_size >= need else None
        finally:
            os.close(fd)

    def map(self, key: str, nbytes: int) -> np.ndarray | None:
        # Only with zero_copy (the RAM tier): its pages are memory already, and
        # since objects are replaced by rename and never written in place, a
        # private mapping keeps seeing the bytes it was opened on. A disk file
        # mapped this way would pin deleted blocks and page the state in from
        # disk, so it is copied.
        if not self.zero_copy or nbytes == 0:
            return None
        m = self._with_fd(key, nbytes, lambda fd: mmap.mmap(
            fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE))
        return None if m is None else np.frombuffer(m, dtype=np.uint8)

    def place(self, key: str, region, file_offset: int, dest_offset: int,
              length: int) -> bool:
        if not self.zero_copy:  # see map(): disk files are copied, not mapped
            return False
        return bool(self._with_fd(key, file_offset + length, lambda fd: region.place(
            fd, file_offset, dest_offset, length)))

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._path(key)).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._err("stat of", key, e) from e

    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        try:
            names = os.listdir(self._path(prefix) if prefix else self.root)
            return [n for n in names if n.startswith(starts_with)]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise self._err("listing of", prefix, e) from e

    def delete(self, key: str) -> None:
        try:
            _unlink(self._path(key))
        except OSError as e:
            raise self._err("delete of", key, e) from e

    def delete_dir(self, prefix: str) -> None:
        path = self._path(prefix)
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("delete of", prefix, e) from e
        self._sync_dir(os.path.dirname(path))

    def remove_empty_dir(self, prefix: str) -> bool:
        try:
            os.rmdir(self._path(prefix))
            return True
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                return False  # gone already, or a save started writing in it
            raise self._err("removal of", prefix, e) from e

    def begin_write(self, prefix: str) -> None:
        marker = os.path.join(self._path(prefix), self._writer.marker_name())
        for _attempt in range(3):  # a cleaner may remove the empty directory between
            try:
                os.makedirs(self._path(prefix), exist_ok=True)
                open(marker, "wb").close()
                return
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._err("start of a save in", prefix, e) from e
        raise StorageError(errno.EIO, f"{self._path(prefix)}: could not start a save")

    def flush(self, prefix: str) -> None:
        self._sync_dir(self._path(prefix))

    def end_write(self, prefix: str) -> None:
        _unlink(os.path.join(self._path(prefix), self._writer.marker_name()))

    def _sync_dir(self, path: str) -> None:
        if not self._fsync:
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
