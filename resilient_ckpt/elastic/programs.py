"""Ahead-of-time programs: what `build(mesh)` returns, built before it is needed.

This module owns the per-mesh cache of the user's `build(mesh)` results, the
background thread that fills it for the meshes the loop is likely to need
(each one data row lost; a larger mesh once lost devices are back), so that a
compile leaves the recovery path, and the answer to "is that mesh's program
ready?" (`built`).

Threads: `rc-precompile` (`Programs.start`) builds one mesh's program after
the other. It is not a daemon: interpreter exit waits for the build in
flight (a thread killed inside XLA aborts the process) and builds no more
once the main thread has ended.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .failures import describe_error
from .mesh import ChooseMesh, mesh_key

log = logging.getLogger("resilient_ckpt.elastic")


def likely_meshes(choose: ChooseMesh, full_mesh: Mesh, data_axis: str, n: int,
                  current: Mesh | None = None) -> list[Mesh]:
    """The meshes `choose` would pick after losing one data row of `current`
    (default `full_mesh`), last rows first, distinct, up to n. In a job of
    several processes, only meshes with a device of this process: the others
    are programs this process would never run."""
    current = current if current is not None else full_mesh
    rows = np.moveaxis(current.devices, current.axis_names.index(data_axis), 0)
    every = set(current.devices.flat)
    me = jax.process_index()
    out: dict[tuple, Mesh] = {}
    for r in reversed(range(rows.shape[0])):
        m = choose(every - set(rows[r].flat), full_mesh)
        if (m is not None and m.size < current.size
                and any(d.process_index == me for d in m.devices.flat)):
            out.setdefault(mesh_key(m), m)
    return list(out.values())[:n]


class Programs:
    """What `build(mesh)` returned, per mesh; built ahead of time in a
    background thread where asked, so the compile leaves the recovery path.
    `precompile`: how many likely smaller meshes `start_likely` builds."""

    def __init__(self, build: Callable[[Mesh], Any], precompile: int = 1):
        self._build = build
        self._lock = threading.Lock()
        self._futures: dict[tuple, cf.Future] = {}
        self._precompile = precompile
        self._likely_from: set[tuple] = set()  # the meshes start_likely ran for

    def start_likely(self, choose: ChooseMesh, full_mesh: Mesh, data_axis: str,
                     current: Mesh | None = None) -> None:
        """Once per mesh trained on (after its first completed step): builds
        in the background the programs of the `precompile` likeliest meshes
        left after one more data row of it is lost."""
        current = current if current is not None else full_mesh
        if self._precompile <= 0 or mesh_key(current) in self._likely_from:
            return
        self._likely_from.add(mesh_key(current))
        self.start(likely_meshes(choose, full_mesh, data_axis, self._precompile, current))

    def start(self, meshes: Sequence[Mesh]) -> None:
        """Builds, one after the other in a background thread, those not yet
        built. Not a daemon: interpreter exit waits for the build in flight
        rather than killing it inside XLA; once the main thread has ended, the
        rest are not built (their futures fail)."""
        todo = []
        with self._lock:
            for m in meshes:
                if mesh_key(m) not in self._futures:
                    fut: cf.Future = cf.Future()
                    self._futures[mesh_key(m)] = fut
                    todo.append((m, fut))
        if not todo:
            return

        def work() -> None:
            for m, fut in todo:
                if not threading.main_thread().is_alive():
                    fut.set_exception(RuntimeError("not built: the interpreter is exiting"))
                    continue
                t0 = time.perf_counter()
                try:
                    fut.set_result(self._build(m))
                    log.info("elastic: built the program for mesh %s ahead of time in %.2f s",
                             dict(m.shape), time.perf_counter() - t0)
                except BaseException as e:  # noqa: BLE001 - handed to whoever asks for it
                    fut.set_exception(e)
        threading.Thread(target=work, name="rc-precompile", daemon=False).start()

    def done(self, mesh: Mesh) -> bool:
        """Not being built: built, failed (then `get` builds again, and raises,
        in the caller's thread), or never asked for."""
        with self._lock:
            fut = self._futures.get(mesh_key(mesh))
        return fut is None or fut.done()

    def built(self, mesh: Mesh) -> bool:
        """`build(mesh)` has returned, and its result is held: `get` will not
        wait or build. False while building, after a failed build, or never asked."""
        with self._lock:
            fut = self._futures.get(mesh_key(mesh))
        return fut is not None and fut.done() and fut.exception() is None

    def get(self, mesh: Mesh) -> Any:
        """The program for `mesh`: waits for one being built, else builds it now."""
        key = mesh_key(mesh)
        with self._lock:
            fut = self._futures.get(key)
        if fut is not None:
            try:
                return fut.result()
            except Exception as e:  # noqa: BLE001 - build again in this thread, and raise here
                log.warning("elastic: building ahead for mesh %s failed (%s); building again",
                            dict(mesh.shape), describe_error(e))
        program = self._build(mesh)
        done: cf.Future = cf.Future()
        done.set_result(program)
        with self._lock:
            self._futures[key] = done
        return program

    def drop(self, lost_ids: Iterable[int]) -> None:
        """Forgets the programs of meshes with a lost device (their executables
        name it), as jax.clear_caches() does for jit's own cache; each mesh's
        likely next ones are planned again (one of them may be among those)."""
        lost = set(lost_ids)
        with self._lock:
            for key in [k for k in self._futures if lost.intersection(k[2])]:
                del self._futures[key]
            self._likely_from.clear()
