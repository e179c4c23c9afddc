"""The writer lock: one live manager writes a directory's file tiers at a time.

A manager takes it at its first save and keeps it until `close()` (or until
it is garbage collected): an exclusive, non-blocking `flock` on
`.rc-writer.lock` in the root of each file tier, the file holding the
holder's host and pid for the message a second writer gets
(`DirectoryInUseError`). With several processes, each locks its per-host
tiers and process 0 the tiers every process sees. Read-only managers never
save, so never lock. GCS cannot be flocked: there the step claim (claim.py)
and the create-only manifests keep a second writer from splitting a step.
The lock file stays in place when released: unlinking it would let two
writers lock two different files of one name. It is opened through the
tier's storage, relative to its root's descriptor (`FileStorage.open_in_root`:
for a pinned root, the directory that was checked, whatever has taken its
name since), with O_NOFOLLOW and O_NONBLOCK, and must be a regular file:
anything else at its name (a link, a FIFO, a directory, a socket) could
stand for a lock nobody shares, or hang the open, so the save is refused
(`DirectoryInUseError` naming it) and nothing is created, truncated or
written through a link.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Sequence

from ..core import layout
from ..errors import DirectoryInUseError
from ..storage.base import Storage
from ..storage.files import FileStorage
from ..storage.wrapper import StorageWrapper

log = logging.getLogger("resilient_ckpt")


class WriterLock:
    """The flocks a writing manager holds on its file tiers."""

    def __init__(self, directory: str):
        self._directory = directory
        self._fds: list[int] = []
        self.held = False

    def hold(self, tiers: Sequence[tuple[str, Storage]], process_index: int) -> None:
        """Locks every file tier this process writes for the job (a shared one
        on process 0 only); DirectoryInUseError if another manager holds one.
        Does nothing once held."""
        if self.held:
            return
        fds: list[int] = []
        try:
            for name, st in tiers:
                files = _files(st)
                if files is not None and not (st.shared and process_index != 0):
                    fd = self._lock(name, files)
                    if fd is not None:
                        fds.append(fd)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._fds, self.held = fds, True

    def try_hold(self, tiers: Sequence[tuple[str, Storage]], process_index: int
                 ) -> DirectoryInUseError | None:
        """`hold`, returning the refusal instead of raising it: with several
        processes it is handed to every process at the save's agreement, so
        all raise it together instead of waiting for the one that stopped."""
        try:
            self.hold(tiers, process_index)
        except DirectoryInUseError as e:
            return e
        return None

    def _lock(self, tier: str, files: FileStorage) -> int | None:
        root, path = files.root, os.path.join(files.root, layout.WRITER_LOCK)
        try:
            fd = _open(files, os.O_RDWR | os.O_CREAT, f"{self._directory}: the {tier} tier")
        except OSError as e:
            log.warning("cannot lock the %s tier (%s) against a second writer: %s", tier,
                        path, e)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                log.warning("cannot lock the %s tier (%s) against a second writer: %s",
                            tier, path, e)
                return None
            raise DirectoryInUseError(
                f"{self._directory} is being written by another live manager: the {tier} "
                f"tier ({root}) is locked by {_holder(holder)} ({path}). Only one manager "
                "may write a directory at a time: close the other manager (or end its "
                "process) first, open this one with read_only=True to only restore, or "
                "save to another directory") from None
        me = layout.Writer.me()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {me.host} pid {me.pid}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Drops every lock held (close, or garbage collection); idempotent."""
        fds, self._fds, self.held = self._fds, [], False
        for fd in fds:
            os.close(fd)


def holder(storage: Storage) -> str | None:
    """Who holds the writer lock of a file tier now, in words; None when
    nobody live does (or the tier is not a file tier). Probes with a shared,
    non-blocking flock, so it never takes the lock from a writer.
    DirectoryInUseError when the lock's name holds no regular file."""
    files = _files(storage)
    if files is None:
        return None
    try:
        fd = _open(files, os.O_RDONLY, storage.url)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        return _holder(os.pread(fd, 256, 0).decode(errors="replace").strip())
    finally:
        os.close(fd)
    return None


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))


def _open(files: FileStorage, flags: int, whose: str) -> int:
    """The lock file in the root of `files`, opened with `flags` without
    following a link or blocking on a FIFO; DirectoryInUseError when
    something other than a regular file is there (`whose`: the tier, for the
    message)."""
    path = os.path.join(files.root, layout.WRITER_LOCK)
    try:
        fd = files.open_in_root(layout.WRITER_LOCK, flags)
    except OSError as e:
        # ELOOP: a link (O_NOFOLLOW); EISDIR: a directory; ENXIO: a socket
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        raise _not_a_file(path, whose) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_file(path, whose)
    return fd


def _not_a_file(path: str, whose: str) -> DirectoryInUseError:
    try:
        mode = os.lstat(path).st_mode
        what = next((w for test, w in _KINDS if test(mode)), "a special file")
    except OSError:
        what = "something that changed while it was opened"
    return DirectoryInUseError(
        f"{whose}: its writer lock {path} is {what}, not a regular file, so it cannot "
        "lock the directory against a second writer (and is never followed or opened "
        "as one); nothing was written. Look at what put it there, remove it (a new lock "
        "file is made at the next save), then save again")


def _holder(text: str) -> str:
    if not text:
        return "a manager that is taking the lock now"
    if text.endswith(f" pid {os.getpid()}"):
        return f"another manager in this process ({text})"
    return text


def _files(storage: Storage) -> FileStorage | None:
    """The file storage of a file tier (through wrappers); None for others."""
    while isinstance(storage, StorageWrapper):
        storage = storage.inner
    return storage if isinstance(storage, FileStorage) else None
