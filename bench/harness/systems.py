"""The systems under test, one adapter each, and the machine's limits.

- `Ours`: resilient_ckpt's CheckpointManager on the tiers a bench gives it;
- `Orbax`: orbax.checkpoint.CheckpointManager, the peer;
- `Limit`: the machine's own references on the state's bytes (memory copies,
  a disk write with fsync, reads from a cold and a warm page cache);
  `GcsTransport` and `codec_limit`: those of a GCS emulator and of zstd.

`Ours` and `Orbax` answer the same calls: `save(step, state)` -> `Saved`
(save() blocking, save + wait_until_finished, the peak resident memory over
both; ours also the SaveRecord), `restore(step, abstract)` -> `Restored`
(seconds, the restored tree, the peak; ours also the RestoreRecord),
`drop()` (every step deleted), `close()`; both are context managers.
`timed_open_restore` times a fresh manager's opening and restore together
(a new machine's restore). Nothing here imports jax at module level.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import http.client
import mmap
import os
import threading
import time
import urllib.parse

from .measure import PeakRss, drop_caches, read_through, set_aside, timed


@dataclasses.dataclass
class Saved:
    blocking_s: float
    total_s: float
    peak: int | None
    record: object = None  # ours: the manager's SaveRecord


@dataclasses.dataclass
class Restored:
    seconds: float
    out: object
    peak: int | None
    record: object = None  # ours: the manager's RestoreRecord


def timed_save(mngr, step: int, state) -> Saved:
    """`save` of `step` then `wait_until_finished`, inside a PeakRss: the
    blocking seconds, the total and the peak above the level before."""
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        started = mngr.save(step, args=ocp.args.StandardSave(state))
        blocking = time.perf_counter() - t0
        mngr.wait_until_finished()
        total = time.perf_counter() - t0
    assert started, f"step {step} was not saved"
    return Saved(blocking, total, peak.extra)


def timed_restore(mngr, step: int | None, abstract, block: bool = False) -> Restored:
    """`restore` of `step` (None: the latest) onto `abstract`, inside a
    PeakRss (the restored state is alive at its end); with `block`, until
    the arrays are ready."""
    import jax
    import orbax.checkpoint as ocp
    step = mngr.latest_step() if step is None else step
    with PeakRss() as peak:
        t0 = time.perf_counter()
        out = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
        if block:
            jax.block_until_ready(out)
        dt = time.perf_counter() - t0
    return Restored(dt, out, peak.extra)


def timed_open_restore(open_system, abstract) -> Restored:
    """A new machine's restore: from opening a fresh manager (`open_system()`,
    an Ours or an Orbax) to its latest step restored and ready, with the peak
    memory meanwhile; the manager is closed after the clock stops."""
    import jax
    import orbax.checkpoint as ocp
    with PeakRss() as peak:
        t0 = time.perf_counter()
        with open_system() as m:
            mngr = m.mngr
            out = mngr.restore(mngr.latest_step(), args=ocp.args.StandardRestore(abstract))
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
    return Restored(dt, out, peak.extra)


class _System:
    system = ""
    mngr = None

    def save(self, step: int, state) -> Saved:
        return timed_save(self.mngr, step, state)

    def restore(self, step: int | None, abstract, block: bool = False) -> Restored:
        return timed_restore(self.mngr, step, abstract, block)

    def drop(self) -> None:
        """Deletes every step the manager holds."""
        for s in self.mngr.all_steps():
            self.mngr.delete(s)

    def close(self) -> None:
        self.mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Ours(_System):
    """resilient_ckpt's CheckpointManager in `directory` on `tiers` (None:
    the manager's default); `options` are CheckpointManagerOptions' other
    fields (read_only, cleanup_tmp_directories ...)."""

    system = "resilient_ckpt"

    def __init__(self, directory: str, tiers: list | None = None, **options):
        from resilient_ckpt import CheckpointManager, CheckpointManagerOptions
        if tiers is not None:
            options["tiers"] = tiers
        self.mngr = CheckpointManager(directory, options=CheckpointManagerOptions(**options))

    def save(self, step: int, state) -> Saved:
        out = super().save(step, state)
        out.record = self.mngr.save_records[-1]
        return out

    def restore(self, step: int | None, abstract, block: bool = False) -> Restored:
        out = super().restore(step, abstract, block)
        out.record = self.mngr.last_restore
        return out


class Orbax(_System):
    """orbax.checkpoint.CheckpointManager at `directory` (a path or gs://...);
    `options` are its CheckpointManagerOptions' fields (none: Orbax's default
    options)."""

    system = "orbax"

    def __init__(self, directory: str, **options):
        import orbax.checkpoint as ocp
        self.mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
            **options) if options else None)


def tier_seconds(record, name: str, step: int) -> float:
    """A SaveRecord's write seconds of tier `name`; raises if that tier did
    not save `step`."""
    tw = record.tiers[name]
    if isinstance(tw, str) or not tw.ok:
        raise RuntimeError(f"tier {name} did not save step {step}: {tw}")
    return tw.seconds


# ---------------------------------------------------------------- the limits

def write_files(d: str, shards: list, threads: int, fsync: bool = True) -> list[str]:
    """One file per unique shard in directory `d`, buffered write + fsync each,
    in a pool of `threads` (as wide as resilient_ckpt's I/O pool); then the
    directory is fsynced. With `fsync` False, no fsync at all (a RAM tier's
    writes into tmpfs). Returns the paths."""
    import numpy as np
    paths = [os.path.join(d, f"shard.{i:05d}") for i in range(len(shards))]

    def put(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(shards[i].reshape(-1).view(np.uint8))
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(put, range(len(paths))))
    if not fsync:
        return paths
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    return paths


class Limit:
    """The physical references on the bytes of the state (its unique shards)."""

    system = "limit"

    def __init__(self, workdir: str, write_threads: int):
        self.dir = os.path.join(workdir, "limit")
        self.write_threads = write_threads
        self.cold_method = None

    def host_copy(self, shards: list) -> float:
        import numpy as np
        t, copies = timed(lambda: [np.array(v) for v in shards])
        del copies
        return t

    def fresh_and_pretouched(self, shards: list, nbytes: int) -> tuple[float, float]:
        """First touch of fresh memory (np.empty + fill), then a copy of every
        shard into that now-touched memory (what a reused buffer pool costs)."""
        import numpy as np
        t0 = time.perf_counter()
        pool = np.empty(nbytes, np.uint8)
        pool.fill(0)
        touch = time.perf_counter() - t0
        t0 = time.perf_counter()
        off = 0
        for v in shards:
            n = v.nbytes
            np.copyto(pool[off:off + n], v.reshape(-1).view(np.uint8))
            off += n
        copy = time.perf_counter() - t0
        del pool
        return touch, copy

    def mapped_checksum(self, shards: list, nbytes: int) -> tuple[float, float]:
        """The state's bytes as one file in /dev/shm, mapped as a RAM-tier
        restore maps a pack (private, writable: copy on write) and read
        once: (the page faults of a first touch, one byte a page; a CRC-32C
        of every byte over the mapping, touched). What a restore that
        checks every byte and hands out the RAM tier's pages as the arrays
        pays at least, whatever its code: on one thread, their sum."""
        import numpy as np

        from resilient_ckpt.native import crc32c
        path = os.path.join("/dev/shm", f"rc-limit-{os.getpid()}")
        with open(path, "wb") as f:
            for v in shards:
                f.write(memoryview(v.reshape(-1).view(np.uint8)))
        fd = os.open(path, os.O_RDONLY)
        try:
            m = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
            a = np.frombuffer(m, np.uint8)
            t0 = time.perf_counter()
            int(a[::mmap.PAGESIZE].sum(dtype=np.uint64))
            faults = time.perf_counter() - t0
            t0 = time.perf_counter()
            crc32c.value(a)
            check = time.perf_counter() - t0
            del a
            m.close()
        finally:
            os.close(fd)
            os.unlink(path)
        return faults, check

    def write(self, shards: list) -> tuple[float, list[str]]:
        """`write_files` into a fresh directory (its time only)."""
        set_aside(self.dir)
        os.makedirs(self.dir)
        t0 = time.perf_counter()
        paths = write_files(self.dir, shards, self.write_threads)
        return time.perf_counter() - t0, paths

    def reads(self, paths: list[str], buf) -> dict[str, float]:
        import numpy as np
        out = {}
        self.cold_method = drop_caches(paths)
        out["read_cold"], _ = timed(read_through, paths, buf)
        out["read_warm"], _ = timed(read_through, paths, buf)
        self.cold_method = drop_caches(paths)
        t0 = time.perf_counter()
        fresh = []
        for p in paths:  # into fresh memory, as a restore must (its arrays are new)
            m = mmap.mmap(-1, max(os.path.getsize(p), 1))
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
            read_through([p], np.frombuffer(m, np.uint8))
            fresh.append(m)
        out["read_cold_fresh_memory"] = time.perf_counter() - t0
        for m in fresh:
            m.close()
        del fresh
        self.cold_method = drop_caches(paths)
        bufs = np.split(buf[:buf.size // 4 * 4], 4)
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda i: read_through(paths[i::4], bufs[i]), range(4)))
        out["read_cold_4threads"] = time.perf_counter() - t0
        return out

    def clean(self) -> None:
        set_aside(self.dir)


class GcsTransport:
    """A GCS emulator's own bound: the state's unique shards as objects in
    `bucket`, each POSTed in one media upload and read back whole, on 8
    threads with one http.client connection each (no client library, no
    checksum)."""

    def __init__(self, endpoint: str, bucket: str, shards: list):
        import numpy as np
        u = urllib.parse.urlparse(endpoint)
        self.host, self.port, self.bucket = u.hostname, u.port, bucket
        self.shards = [x.reshape(-1).view(np.uint8) for x in shards]
        self.local = threading.local()
        self.pool = cf.ThreadPoolExecutor(8)
        self.touched = [np.ones(x.nbytes, np.uint8) for x in self.shards]

    def _conn(self) -> http.client.HTTPConnection:
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return self.local.conn

    def _post(self, name: str, data) -> None:
        c = self._conn()
        c.request("POST", f"/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name="
                  + urllib.parse.quote(name, safe=""), body=data.data,
                  headers={"Content-Type": "application/octet-stream"})
        r = c.getresponse()
        r.read()
        assert r.status == 200, f"upload of {name}: HTTP {r.status}"

    def _get(self, name: str, out) -> None:
        c = self._conn()
        c.request("GET", f"/download/storage/v1/b/{self.bucket}/o/"
                  + urllib.parse.quote(name, safe="") + "?alt=media")
        r = c.getresponse()
        view, got = out.data, 0
        while got < len(view) and (n := r.readinto(view[got:])):
            got += n
        r.read()
        assert r.status == 200 and got == len(view), f"read of {name}: HTTP {r.status}"

    def put(self, prefix: str) -> None:
        list(self.pool.map(lambda i: self._post(f"{prefix}/{i}", self.shards[i]),
                           range(len(self.shards))))

    def get(self, prefix: str, fresh: bool) -> None:
        import numpy as np

        from resilient_ckpt.native.hostmem import host_buffer
        outs = [host_buffer(x.nbytes) for x in self.shards] if fresh else self.touched
        list(self.pool.map(lambda i: self._get(f"{prefix}/{i}", outs[i]),
                           range(len(self.shards))))
        assert all(np.array_equal(o, x) for o, x in zip(outs, self.shards, strict=True))

    def close(self) -> None:
        self.pool.shutdown()


def codec_limit(shards: list, level: int = 1) -> dict:
    """zstd on one thread over every shard: ratio, compress and decompress GB/s."""
    import zstandard
    raw = sum(x.nbytes for x in shards)
    t0 = time.perf_counter()
    packed = [zstandard.ZstdCompressor(level=level).compress(x) for x in shards]
    tc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, x in zip(packed, shards, strict=True):
        zstandard.ZstdDecompressor().decompress(p, max_output_size=x.nbytes)
    td = time.perf_counter() - t0
    return {"ratio": raw / sum(len(p) for p in packed), "compress_gb_s": raw / tc / 1e9,
            "decompress_gb_s": raw / td / 1e9}
