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

Within one process, managers of one directory do not exclude each other, as
in Orbax (a notebook cell that makes a manager runs again; code reopens a
manager to reload): a manager's lock whose flock is held by an older
manager of this process takes it over. The older one first finishes what it
has in flight (its `drain`), then gives up its locks and refuses every
later save (`DirectoryInUseError` saying a newer manager took over). So one
manager writes at a time still, and two processes never both do. Other
holders (the tool's `gc`) are never taken over, and take over nothing.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import weakref
from collections.abc import Callable, Sequence

from ..core import layout
from ..errors import DirectoryInUseError
from ..storage.base import Storage
from ..storage.files import FileStorage
from ..storage.wrapper import StorageWrapper

log = logging.getLogger("resilient_ckpt")


class WriterLock:
    """The flocks a writing manager holds on its file tiers.

    `drain` (a manager's: waits for its saves in flight, raising nothing)
    makes the lock one a newer manager of this process may take over, and
    lets it take over an older one's."""

    # Which lock of this process holds each lock file's flock, by the file's
    # (device, inode): the flock itself is per open file, so only this
    # process's own table can tell that the holder is a manager beside us.
    _holders: dict[tuple[int, int], weakref.ref[WriterLock]] = {}
    _holders_lock = threading.Lock()

    def __init__(self, directory: str, drain: Callable[[], None] | None = None):
        self._directory = directory
        self._drain = drain
        self.takeable = drain is not None  # a manager's: a newer one may take it over
        self._fds: list[int] = []
        self._keys: list[tuple[int, int]] = []
        self._state = threading.Lock()
        self.held = False
        self.superseded = False
        self.took_over = False  # this lock's last hold took another manager's over

    def hold(self, tiers: Sequence[tuple[str, Storage]], process_index: int) -> None:
        """Locks every file tier this process writes for the job (a shared one
        on process 0 only), taking over an older manager's lock in this
        process; DirectoryInUseError if another process (or the tool) holds
        one, or if a newer manager took this one over. Does nothing once held."""
        if self.superseded:
            raise DirectoryInUseError(
                f"{self._directory}: a newer CheckpointManager in this process took over "
                "this directory, so this manager saves no more (its earlier saves "
                "finished first). Save through the newer manager, or close it and open "
                "a new one")
        if self.held:
            return
        self.took_over = False
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
        with self._state:
            self._fds, self.held = fds, True
        with WriterLock._holders_lock:
            self._keys = [_key(fd) for fd in fds]
            WriterLock._holders.update({k: weakref.ref(self) for k in self._keys})

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
            self._flock(fd)
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

    def _flock(self, fd: int) -> None:
        """The exclusive flock of `fd`, taken over from an older manager of
        this process that holds it, when both are managers' locks."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            with WriterLock._holders_lock:
                ref = WriterLock._holders.get(_key(fd))
            older = ref() if ref is not None else None
            if not self.takeable or older is None or older is self or not older.takeable:
                raise
        older.hand_over()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.took_over = True

    def hand_over(self) -> None:
        """A newer manager of this process takes this lock over: every save
        after this one is refused, the saves in flight finish, then every
        lock is dropped."""
        with self._state:
            self.superseded = True
        if self._drain is not None:
            self._drain()
        log.info("%s: a newer manager in this process takes over writing", self._directory)
        self.release()

    def release(self) -> None:
        """Drops every lock held (close, or garbage collection); idempotent."""
        with self._state:
            fds, self._fds, self.held = self._fds, [], False
        with WriterLock._holders_lock:
            for k in self._keys:
                if (ref := WriterLock._holders.get(k)) is not None and ref() in (self, None):
                    del WriterLock._holders[k]
            self._keys = []
        for fd in fds:
            os.close(fd)


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


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
