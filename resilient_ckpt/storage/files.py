"""File-system storage: the RAM tier (tmpfs) and the local-disk tier.

Every object is written to a temporary name carrying the writer's identity,
fsynced, and renamed into place; `flush` fsyncs the directory so the renames
are durable before a manifest is committed after them. A save, from
`begin_write(d)` to `flush(d)`, holds a descriptor of `d` (a durable.Batch),
and its new chunks are written in place, under their final names, through
it: no reader opens a chunk before a committed manifest names it, a chunk's
name carries its save's id, and a writer's torn chunk is removed by its
save's failure path or, if it died, by cleanup (an uncommitted step's
chunks). A name already there (a copy of the same save resumed) is replaced
by a temporary and a rename, as outside a save. Where syncfs reports
write-back errors, on local block-device file systems, a save's chunks are
not fsynced one by one but synced together with syncfs, during the puts and
at `flush`; elsewhere every put is fsynced and `flush` fsyncs `d`
(durable.py). The commit itself uses `put_if_absent`: the temporary is
hard-linked to the final name, which fails if the name exists, so two
writers can never both commit a step.
With `zero_copy` (the RAM tier, on tmpfs) `map` and `place` hand out private,
copy-on-write mappings of objects instead of copies; with `maps_cached` (the
local tier) they do so for objects whose every page is in the page cache
(`resident`), which would otherwise be copied out of memory into new memory.
With `direct` (the local tier) a snapshot's chunks are written with O_DIRECT
(storage/direct.py).

Nothing below the root is ever followed. Every key is walked from the root
one directory descriptor at a time with O_NOFOLLOW (`*at` calls on that
descriptor do the rest), objects are opened only as regular files, with
O_NONBLOCK so that a FIFO cannot block the open, and deletes unlink entries,
never what a link points to. So a symbolic link, FIFO, directory or device
found where an object or a step should be (planted by another user of a
shared /dev/shm, or left by a stray `ln -s`) can neither make the tier read,
write or delete outside its root nor hang it: `list` and `size` see it as
absent, and every other access raises StorageError naming it. The root itself
may be a link the user chose: it is resolved once, when the storage opens.
Or it is pinned (`root_fd`): a descriptor of it that the caller opened and
checked (the tool's recorded tiers, cli/survey.py); then every walk starts
from that descriptor and the root's path is never resolved again, so what
was checked is what is used, even if a link takes the root's name meanwhile.
The writer lock's file is opened the same way (`open_in_root`).
Within `holding(step)` (a restore) objects of that step are opened relative
to its directory, walked to once at the start of the block.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import stat
import threading
import time
import weakref

import numpy as np

from ..core import layout
from ..core.layout import Writer
from ..errors import StorageError
from ..native import hostmem
from . import direct as odirect, durable
from .base import Storage, check_size

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Failures of a walk that `list` and `size` take for "nothing there": missing,
# something other than a directory on the way, or a link on the way (a link
# opened as a directory with O_NOFOLLOW fails with ENOTDIR, as a file ELOOP).
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


class _Walker:
    """Keys under a root resolved once, walked without following links; the
    errors that name what is in the way."""

    root: str   # as the user gave it: for messages and identity
    kind: str
    _real: str  # the root with the user's links resolved
    _pin: int | None  # a descriptor of the root, checked by the caller: walks start there
    # Directories kept open by `holding`, by their parts (several holders each).
    _held: dict[tuple[str, ...], list[int]]
    _hold_lock: threading.Lock
    # Whole objects mapped once while their directory is held, by its parts
    # then key (`FileStorage.map`): a pack's chunks are views of one mapping;
    # `_mapped` holds the same by key alone (thousands of look-ups a restore).
    _whole: dict[tuple[str, ...], dict[str, np.ndarray | None]]
    _mapped: dict[str, np.ndarray | None]
    # Of those, the disk objects the page cache did not hold whole when mapped:
    # the windows of each already asked for (`_Advisor`).
    _cold: dict[str, set[int]]

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _err(self, what: str, key: str, e: OSError) -> StorageError:
        hint = self._in_the_way(key) if e.errno in (errno.ELOOP, errno.ENOTDIR) else ""
        return StorageError(e.errno, f"{self.kind} tier: {what} {self._path(key)} "
                                     f"failed: {e.strerror or e}{hint}")

    def _in_the_way(self, key: str) -> str:
        """What blocked a walk to `key`, for the message (looked up only then)."""
        parts = key.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            try:
                mode = (os.stat(sub, dir_fd=self._pin, follow_symlinks=False)
                        if self._pin is not None
                        else os.lstat(os.path.join(self._real, sub))).st_mode
            except OSError:
                return ""
            if stat.S_ISLNK(mode):
                return (f"; {self._path(sub)} is a symbolic link, and the file tiers never "
                        "follow links below their root: remove it")
            if i < len(parts) and not stat.S_ISDIR(mode):
                return f"; {self._path(sub)} is not a directory: remove it"
        return ""

    @contextlib.contextmanager
    def _failing(self, what: str, key: str):
        """Turns an OSError of the block into StorageError naming `key`."""
        try:
            yield
        except StorageError:
            raise
        except OSError as e:
            raise self._err(what, key, e) from e

    def _parts(self, key: str) -> list[str]:
        parts = key.split("/") if key else []
        if any(p in ("", ".", "..") for p in parts):
            raise StorageError(errno.EINVAL, f"{self.kind} tier: key {key!r} under "
                                             f"{self.root} is not a plain relative name")
        return parts

    def _split(self, key: str) -> tuple[list[str], str]:
        """(directories, name) of an object's key."""
        parts = self._parts(key)
        if not parts:
            raise StorageError(errno.EINVAL, f"{self.kind} tier: an empty key names no "
                                             f"object under {self.root}")
        return parts[:-1], parts[-1]

    def _root_fd(self, create: bool) -> int:
        if self._pin is not None:  # never made again: a pinned root is the caller's
            return os.open(".", _DIR, dir_fd=self._pin)
        try:
            return os.open(self._real, _DIR)
        except FileNotFoundError:
            if not create:
                raise
        os.makedirs(self._real, exist_ok=True)  # removed meanwhile: make it again
        return os.open(self._real, _DIR)

    def _open_dir(self, parts: list[str], create: bool = False) -> int:
        """A descriptor of directory root/parts, walked without following any
        link or passing through a non-directory (ENOTDIR); missing directories
        are made on the way when `create`."""
        if len(parts) <= 1:
            # The root or a step directory: the one component below the resolved
            # root is the last, which O_NOFOLLOW checks, so one open will do.
            try:
                if self._pin is not None:
                    return os.open(parts[0] if parts else ".", _DIR, dir_fd=self._pin)
                return os.open(os.path.join(self._real, *parts), _DIR)
            except FileNotFoundError:
                if not create:
                    raise
        return _walk(self._root_fd(create), parts, create)

    def _open_in(self, dirs: list[str], name: str) -> int:
        """Opens object root/dirs/name for reading: relative to the directory
        `holding` keeps open where it does (no walk, no descriptor of the
        directory opened and closed again), else walked to."""
        with self._hold_lock:  # held across the open: the holder cannot close it meanwhile
            held = self._held.get(tuple(dirs))
            if held:
                return os.open(name, _READ, dir_fd=held[-1])
        d = self._open_dir(dirs)
        try:
            return os.open(name, _READ, dir_fd=d)
        finally:
            os.close(d)

    @contextlib.contextmanager
    def holding(self, prefix: str):
        # A restore opens a step's chunks one after another: walked to, each
        # took 6 system calls (a GIL hand-off each on the pool's threads), 4
        # relative to a held directory: a RAM-tier restore of many small
        # chunks spent a visible share of its time walking (docs/benchmarks.md).
        parts = tuple(self._parts(prefix))
        try:
            fd = self._open_dir(list(parts))
        except OSError:
            fd = None  # not there: every read walks, and says what is missing
        if fd is None:
            yield
            return
        with self._hold_lock:
            self._held.setdefault(parts, []).append(fd)
        try:
            yield
        finally:
            with self._hold_lock:
                self._held[parts].remove(fd)
                if not self._held[parts]:
                    del self._held[parts]
                    for key in self._whole.pop(parts, {}):  # the restored arrays keep their views
                        self._mapped.pop(key, None)
                        self._cold.pop(key, None)
            os.close(fd)

    @contextlib.contextmanager
    def _dir(self, parts: list[str], create: bool = False):
        fd = self._open_dir(parts, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_object(self, key: str) -> tuple[int, int]:
        """(descriptor, size) of the object opened read-only; only a regular
        file: a link is ELOOP, anything else a StorageError naming it."""
        dirs, name = self._split(key)
        try:
            fd = self._open_in(dirs, name)
        except OSError as e:
            raise self._err("open of", key, e) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StorageError(errno.EINVAL, f"{self.kind} tier: {self._path(key)} is "
                                                 f"not a regular file ({_what(st.st_mode)});"
                                                 " the file tiers read only regular files "
                                                 "there: remove it")
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size


class FileStorage(_Walker, Storage):
    """Objects as files under `root`; `kind` names it in records ("ram",
    "local"); `zero_copy` maps objects (tmpfs only); `maps_cached` maps those
    the page cache holds whole; `fsync` off on tmpfs; `direct` writes big
    objects with O_DIRECT, and reads big uncached ones into aligned buffers
    with it (disks only)."""

    def __init__(self, root: str, kind: str = "local", *, fsync: bool = True,
                 create: bool = True, zero_copy: bool = False, direct: bool = False,
                 maps_cached: bool = False, root_fd: int | None = None):
        self.root = os.path.abspath(root)  # as given: for messages and identity
        self.kind = kind
        self.zero_copy = zero_copy  # only on tmpfs: see map()
        self.maps_cached = maps_cached
        self._direct = direct  # off once the file system refuses O_DIRECT
        self.url = self.root
        self._fsync = fsync
        self._writer = Writer.me()
        self._pin = None
        if root_fd is not None:  # the caller's checked root: kept open, walked from
            self._pin = os.dup(root_fd)
            self._unpin = weakref.finalize(self, os.close, self._pin)
        elif create:
            os.makedirs(self.root, exist_ok=True)
        self._real = os.path.realpath(self.root)  # the user's links, resolved once
        self._held, self._hold_lock, self._whole, self._mapped = {}, threading.Lock(), {}, {}
        self._cold = {}
        self._advisor = _Advisor()  # reads ahead in them
        # Saves in progress (their batches: durable.py), by step directory.
        self._batches: dict[str, durable.Batch] = {}
        self._batch_lock = threading.Lock()
        self._batch_fs: bool | None = None  # whether syncfs serves here; at first save
        # Staging for O_DIRECT writes of unaligned buffers (direct.py): one per
        # writing thread at a time, reused through a save (a fresh stage per
        # chunk faulted in new memory for every chunk: kept, writes run as
        # from an aligned slab); dropped at its end.
        self._stages = hostmem.BufferPool(8 * odirect.STAGE_BYTES)

    def close(self) -> None:
        if self._pin is not None:
            self._unpin()
            self._pin = -1  # closed: every walk fails (EBADF), never falls back to the path

    def open_in_root(self, name: str, flags: int) -> int:
        """A descriptor of entry `name` of the root itself (the writer lock's
        file), opened with `flags` relative to the root's descriptor, never
        through a link (O_NOFOLLOW), never blocking (O_NONBLOCK); made with
        mode 0644 when `flags` hold O_CREAT. OSError as `os.open` raises it."""
        with self._dir([]) as d:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                           0o644, dir_fd=d)

    def _sync_fd(self, fd: int) -> None:
        if self._fsync:
            os.fsync(fd)

    @contextlib.contextmanager
    def _held_batch(self, key: str):
        """The batch of the save writing `key`'s directory, held for the block
        (None outside a save, or one just ended)."""
        with self._batch_lock:
            batch = self._batches.get(key.rpartition("/")[0])
        if batch is None or not batch.hold():
            yield None
            return
        try:
            yield batch
        finally:
            batch.release()

    def _start_batch(self, prefix: str, d: int) -> None:
        if self._fsync and self._batch_fs is None:
            self._batch_fs = durable.usable(d)
        mode = None if not self._fsync else "syncfs" if self._batch_fs else "fsync"
        with self._batch_lock:
            if prefix not in self._batches:  # the first descriptor sees the most errors
                self._batches[prefix] = durable.Batch(os.dup(d), mode)

    def _end_batch(self, prefix: str) -> durable.Batch | None:
        """The save's batch, no longer used by puts (the caller closes it)."""
        with self._batch_lock:
            return self._batches.pop(prefix, None)

    # ------------------------------------------------------------ writes

    def _write_tmp(self, d: int, name: str, parts: list, size: int,
                   sync: bool = True) -> str:
        """A temporary beside `name` in directory `d`, written (and fsynced
        when `sync`; a batch's chunks are synced by their batch instead)."""
        tmp = self._writer.tmp_name(name)
        self._write_new(d, tmp, parts, size, sync)
        return tmp

    def _write_new(self, d: int, name: str, parts: list, size: int, sync: bool) -> None:
        """File `name`, created in directory `d` (FileExistsError if there),
        of `size` bytes holding each (offset, bytes) of `parts` (offset order);
        fsynced when `sync`; removed again if the write fails. With O_DIRECT
        every part goes past the cache (offsets of parts after the first are
        on a block: a pack's are)."""
        views = [(at, memoryview(v).cast("B")) for at, v in parts]
        fd, direct = self._create(d, name, self._direct and size >= odirect.MIN_BYTES
                                  and all(at % odirect.BLOCK == 0 for at, _ in views))
        try:
            if direct and not all(self._write_direct(fd, v, at) for at, v in views):
                self._direct = False  # an alignment this file system refuses
                direct = False
            if not direct:
                for at, view in views:
                    os.lseek(fd, at, os.SEEK_SET)
                    while view:
                        view = view[os.write(fd, view):]
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)
            if sync and self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(d, name)
            raise
        os.close(fd)

    def _write_direct(self, fd: int, view: memoryview, at: int) -> bool:
        if odirect.aligned(view):
            return odirect.write(fd, view, at=at)
        stage = self._stages.take(odirect.STAGE_BYTES)
        try:
            return odirect.write(fd, view, stage, at)
        finally:
            self._stages.give(stage)

    def _create(self, d: int, name: str, direct: bool) -> tuple[int, bool]:
        """File `name`, created; whether it is open with O_DIRECT."""
        if direct:
            try:
                return os.open(name, _CREATE | odirect.FLAG, 0o644, dir_fd=d), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False  # this file system takes no O_DIRECT (FUSE, ...)
                _unlink_quietly(d, name)  # created before the flag was refused
        return os.open(name, _CREATE, 0o644, dir_fd=d), False

    def put(self, key: str, data) -> None:
        view = memoryview(data).cast("B")
        self.put_parts(key, [(0, view)], len(view))

    def put_parts(self, key: str, parts, size: int) -> None:
        dirs, name = self._split(key)
        with self._failing("write of", key), self._held_batch(key) as batch:
            sync = batch is None or batch.mode != "syncfs"  # else synced by its batch
            if (batch is not None and layout.is_chunk_name(name)
                    and self._put_in_place(batch.fd, name, parts, size, sync)):
                batch.wrote(size)
                return
            with self._dir(dirs, create=True) as d:
                tmp = self._write_tmp(d, name, parts, size, sync)
                try:
                    os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
                except BaseException:
                    _unlink_quietly(d, tmp)
                    raise
            if batch is not None:
                batch.wrote(size)

    def _put_in_place(self, d: int, name: str, parts: list, size: int, sync: bool) -> bool:
        """A save's new chunk or pack written under its final name; False, with
        nothing written, where the name exists already."""
        try:
            self._write_new(d, name, parts, size, sync)
        except FileExistsError:
            return False
        return True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        dirs, name = self._split(key)
        linked = False
        try:
            with self._dir(dirs, create=True) as d:
                tmp = self._write_tmp(d, name, [(0, data)], len(data))
                try:
                    os.link(tmp, name, src_dir_fd=d, dst_dir_fd=d, follow_symlinks=False)
                    linked = True
                except FileExistsError:
                    return False
                finally:
                    _unlink_quietly(d, tmp)
                self._sync_fd(d)
            return True
        except OSError as e:
            err = self._err("commit of", key, e)
            err.nothing_written = not linked  # the final name was never created
            raise err from e

    # ------------------------------------------------------------ reads

    def read_into(self, key: str, out: memoryview, offset: int = 0) -> None:
        # With `direct`, a big read into a page-aligned buffer of a range the
        # page cache does not hold whole goes past the cache: a buffered cold
        # read takes a fresh page-cache page for every 4 KiB as well as the
        # caller's buffer, twice the new memory (a direct cold restore runs as
        # fast as a plain cold read into one reused buffer; docs/benchmarks.md).
        # A cached range is read from the cache (or mapped whole: map()).
        fd, _ = self._open_object(key)
        try:
            with self._failing("read of", key):
                view = memoryview(out).cast("B")
                if self._direct and odirect.readable(view, offset) and not hostmem.cached(
                        fd, len(view), offset):
                    done = odirect.read(fd, view, offset)
                    if done is None:
                        self._direct = False  # this file system takes no O_DIRECT
                    else:
                        view, offset = view[done:], offset + done
                self._pread(fd, key, view, offset)
        finally:
            os.close(fd)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        fd, n = self._open_object(key)
        try:
            check_size(self._path(key), n, max_bytes)
            try:
                buf = bytearray(n)
            except MemoryError:
                raise StorageError(errno.ENOMEM, f"{self.kind} tier: {self._path(key)} is "
                                                 f"{n} bytes, more than this process can "
                                                 "hold; it was not read") from None
            with self._failing("read of", key):
                self._pread(fd, key, memoryview(buf), 0)
        finally:
            os.close(fd)
        return bytes(buf)

    def _pread(self, fd: int, key: str, view: memoryview, pos: int) -> None:
        while view:
            n = os.preadv(fd, [view], pos)
            if n == 0:
                raise StorageError(errno.EIO, f"{self._path(key)}: short read at byte "
                                              f"{pos}; the object is truncated")
            view, pos = view[n:], pos + n

    def _with_fd(self, key: str, need: int, fn):
        """fn(fd) on the object opened read-only, or None if it is shorter than
        `need` bytes (a truncated object is a missing copy, not an error)."""
        fd, n = self._open_object(key)
        try:
            return fn(fd) if n >= need else None
        except OSError as e:
            raise self._err("mapping of", key, e) from e
        finally:
            os.close(fd)

    def resident(self, key: str, nbytes: int, offset: int = 0) -> bool:
        if self.zero_copy:
            return nbytes > 0
        if not self.maps_cached or nbytes <= 0:
            return False
        try:
            held, whole = self._held_whole(key)
            if held:  # mapped whole (what the page cache lacks is read ahead: map())
                return isinstance(whole, np.ndarray) and len(whole) >= offset + nbytes
            return bool(self._with_fd(key, offset + nbytes,
                                      lambda fd: hostmem.cached(fd, nbytes, offset)))
        except StorageError:
            return False  # missing or not a file: the read that follows says so

    def map(self, key: str, nbytes: int, offset: int = 0) -> np.ndarray | None:
        # A private mapping keeps seeing the bytes it was opened on: objects
        # are replaced by rename and never written in place, and a deleted
        # file lives on while mapped. On tmpfs (zero_copy) the pages are memory
        # already. A disk file (maps_cached) is mapped where the page cache
        # holds the range, and, while a restore holds its step, mapped whole
        # even where it does not: the ranges asked for are then read into the
        # page cache ahead of their first use (`_Advisor`). Either way the
        # restored state shares the page cache's pages: no new memory is
        # touched for it (touching fresh memory is the dearest part of a
        # restore on VMs, docs/environment.md) and no second copy of the state
        # is held. The price: a deleted step's blocks stay allocated while its
        # restored arrays live, and a pack cut short in place while mapped
        # faults its reader (SIGBUS), as on the RAM tier: the tiers' files are
        # written by rename, never in place (docs/reliability.md).
        if nbytes == 0 or not (self.zero_copy or self.maps_cached) or \
                offset % mmap.ALLOCATIONGRANULARITY:
            return None

        held, whole = self._held_whole(key)
        if held:  # a view of the object mapped whole; none where it is too short
            if not isinstance(whole, np.ndarray) or len(whole) < offset + nbytes:
                return None
            advised = self._cold.get(key)
            if advised is not None:
                self._advisor.ask(whole, advised, offset, nbytes)
            return whole[offset:offset + nbytes]

        def open_map(fd: int):
            if not (self.zero_copy or hostmem.cached(fd, nbytes, offset)):
                return False
            return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        m = self._with_fd(key, offset + nbytes, open_map)
        return np.frombuffer(m, dtype=np.uint8) if isinstance(m, mmap.mmap) else None

    def _held_whole(self, key: str) -> tuple[bool, np.ndarray | None]:
        """An object mapped whole, once while `holding` keeps its directory open
        (a step of packs is a few objects holding thousands of chunks: a
        mapping per chunk cost an open, a stat and an mmap each, and on a disk
        tier two page-cache questions): (whether its directory is held, the
        mapping, or None where the object is empty). A disk object the page
        cache does not hold whole is mapped too, and noted in `_cold`: the
        ranges `map` hands out of it are read ahead (`_Advisor`)."""
        if key in self._mapped:  # (read without the lock: entries go only with the hold)
            return True, self._mapped[key]
        dirs, _ = self._split(key)
        parts = tuple(dirs)
        with self._hold_lock:
            if parts not in self._held:
                return False, None
            maps = self._whole.get(parts, {})
            if key in maps:
                return True, maps[key]

        def whole_map(fd: int) -> tuple[mmap.mmap, bool]:
            cold = not (self.zero_copy or hostmem.cached(fd, os.fstat(fd).st_size))
            return mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE), cold
        got = self._with_fd(key, 1, whole_map)
        whole = None if got is None else np.frombuffer(got[0], dtype=np.uint8)
        with self._hold_lock:  # kept only while still held (the holder may have ended)
            if parts in self._held:
                maps = self._whole.setdefault(parts, {})
                if key not in maps and got is not None and got[1]:
                    self._cold[key] = set()
                whole = maps.setdefault(key, whole)
                self._mapped[key] = whole
        return True, whole

    def place(self, key: str, region, file_offset: int, dest_offset: int,
              length: int) -> bool:
        if not (self.zero_copy or self.maps_cached):  # see map()
            return False
        return bool(self._with_fd(key, file_offset + length, lambda fd: (
            self.zero_copy or hostmem.cached(fd, length, file_offset))
            and region.place(fd, file_offset, dest_offset, length)))

    def size(self, key: str) -> int | None:
        dirs, name = self._split(key)
        try:
            d = self._open_dir(dirs)
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            finally:
                os.close(d)
        except OSError as e:
            if e.errno in _ABSENT:
                return None
            raise self._err("stat of", key, e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a link, FIFO, ...: absent

    def list(self, prefix: str = "", starts_with: str = "") -> list[str]:
        parts = self._parts(prefix)
        try:
            with self._dir(parts) as d:
                names = os.listdir(d)
        except OSError as e:
            if e.errno in _ABSENT:
                return []  # nothing there, an object, or a link: no directory of ours
            raise self._err("listing of", prefix, e) from e
        return [n for n in names if n.startswith(starts_with)]

    def object_ages(self, prefix: str) -> dict[str, float]:
        now, ages = time.time(), {}
        try:
            with self._dir(self._parts(prefix)) as d:
                for n in os.listdir(d):
                    with contextlib.suppress(FileNotFoundError):  # removed meanwhile
                        ages[n] = now - os.stat(n, dir_fd=d, follow_symlinks=False).st_mtime
        except OSError as e:
            if e.errno in _ABSENT:
                return {}
            raise self._err("listing of", prefix, e) from e
        return ages

    # ------------------------------------------------------------ deletes and hooks

    def delete(self, key: str) -> None:
        dirs, name = self._split(key)
        try:
            with self._dir(dirs) as d:
                os.unlink(name, dir_fd=d)  # a link is removed itself, never followed
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("delete of", key, e) from e

    def delete_dir(self, prefix: str) -> None:
        dirs, name = self._split(prefix)
        try:
            with self._dir(dirs) as d:
                _remove_tree(d, name)
                self._sync_fd(d)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("delete of", prefix, e) from e

    def remove_empty_dir(self, prefix: str) -> bool:
        dirs, name = self._split(prefix)
        try:
            with self._dir(dirs) as d:
                os.rmdir(name, dir_fd=d)
            return True
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                return False  # gone already, a save started writing in it, or not a directory
            raise self._err("removal of", prefix, e) from e

    def begin_write(self, prefix: str) -> None:
        parts, marker = self._parts(prefix), self._writer.marker_name()
        for _attempt in range(3):  # a cleaner may remove the empty directory between
            try:
                with self._dir(parts, create=True) as d:
                    os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                                     | os.O_CLOEXEC, 0o644, dir_fd=d))
                    self._start_batch(prefix, d)
                return
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._err("start of a save in", prefix, e) from e
        raise StorageError(errno.EIO, f"{self._path(prefix)}: could not start a save")

    def flush(self, prefix: str) -> None:
        batch = self._end_batch(prefix)
        if batch is not None:  # a save's chunks: the batch's last sync
            try:
                batch.sync()
            except OSError as e:
                raise self._err("flush of", prefix, e) from e
            finally:
                batch.close()
            return
        if not self._fsync:
            return
        try:
            with self._dir(self._parts(prefix)) as d:
                os.fsync(d)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("flush of", prefix, e) from e

    def end_write(self, prefix: str) -> None:
        batch = self._end_batch(prefix)  # a save that failed before its flush
        if batch is not None:
            batch.close()
        self._stages.clear()  # idle ones: a save still writing takes new ones
        try:
            with self._dir(self._parts(prefix)) as d:
                os.unlink(self._writer.marker_name(), dir_fd=d)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._err("end of the save in", prefix, e) from e


# A held disk object the page cache did not hold whole is read ahead in windows
# of this many bytes, each the first time a range in it is mapped: the kernel
# reads them while the restore maps and places the chunks before it.
COLD_WINDOW = 8 << 20


class _Advisor:
    """Asks the kernel for the windows of cold mappings that `map` handed out
    (`hostmem.read_ahead`), on a thread of its own: queueing a window's reads
    waits while the disk's queue is full, which on the restoring thread took
    longer than the reads saved (a 1 GB restore: 0.5-0.7 s in the advice).
    The thread starts with the first window asked for and ends once nothing
    is asked for a moment: it outlives a restore by at most that moment
    plus the windows still queued, and so ends before the interpreter exits."""

    IDLE_S = 0.2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._todo: collections.deque = collections.deque()
        self._wake = threading.Condition(self._lock)
        self._running = False

    def ask(self, whole: np.ndarray, advised: set[int], offset: int, nbytes: int) -> None:
        """Queues the windows of mapping `whole` holding [offset, offset +
        nbytes) not in `advised` (those asked for already) and adds them."""
        windows = [w for w in range(offset // COLD_WINDOW,
                                    (offset + nbytes - 1) // COLD_WINDOW + 1)
                   if w not in advised]
        if not windows:
            return
        with self._lock:
            for w in windows:
                if w not in advised:
                    advised.add(w)
                    self._todo.append((whole, w * COLD_WINDOW))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="rc-readahead").start()
            else:
                self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    self._wake.wait(self.IDLE_S)
                if not self._todo:
                    self._running = False
                    return
                whole, start = self._todo.popleft()
            hostmem.read_ahead(whole, start, COLD_WINDOW)


def open_below(base: str, rel: str) -> int:
    """A descriptor of directory `rel` (relative, normalised; "." for `base`
    itself) under directory `base`, walked from `base` (the caller's own
    path: its links are followed) one component at a time without following
    any link: whatever `rel` names, it is reached inside `base`, and the
    descriptor is the directory a pinned storage then uses (`root_fd`).
    OSError: missing (ENOENT), or a link or a non-directory in the way
    (ELOOP, ENOTDIR)."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(errno.EINVAL, f"{rel!r} leaves {base}")
    return _walk(os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), parts, False)


def _walk(fd: int, parts: list[str], create: bool) -> int:
    """The directory `parts` below directory `fd`, one `_subdir` at a time;
    takes `fd` over (closed on the way, and on an error)."""
    try:
        for p in parts:
            sub = _subdir(fd, p, create)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _subdir(fd: int, name: str, create: bool) -> int:
    """A descriptor of directory `name` in directory `fd`, never through a link."""
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o777, dir_fd=fd)
    except FileExistsError:
        pass  # another thread made it meanwhile
    return os.open(name, _DIR, dir_fd=fd)


def _remove_tree(parent: int, name: str) -> None:
    """Removes entry `name` of directory `parent` and, when it is a directory
    (not a link to one), all in it; links are unlinked, never followed."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        with os.scandir(fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        for n, is_dir in entries:
            if is_dir:
                _remove_tree(fd, n)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(n, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent)


def _unlink_quietly(d: int, name: str) -> None:
    # Only our own temporaries: one left behind by a failure here carries our
    # identity, so cleanup removes it once this process is gone.
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=d)


def _what(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return f"mode {mode:o}"
