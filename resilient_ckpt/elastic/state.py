"""The training state on a new mesh: resharding the live state, checking targets.

This module owns what the loop does with the user's state itself: moving the
live state of a save step onto a larger mesh's shardings (through host
memory), the check that a restore target lies on the current mesh, the
Orbax standard args the loop uses when the user passes none, and the
`StateReserve`: touched, XLA-owned buffers for the state on the likeliest
smaller mesh (CPU backend), which a restore onto that mesh is read into.

Why the reserve: on the CPU backend a RAM-tier restore aliases the tier's
file mappings, and XLA cannot donate memory it does not own, so the first
step after such a restore writes the whole state into fresh buffers. Fresh
memory is slow under a hypervisor (page faults; an order of magnitude slower
than a copy into touched memory, docs/environment.md), and that step paid for
it. So the restore onto that mesh reads the chunks straight into buffers
allocated and touched ahead of time (`restore.Into` leaves): XLA owns them
(the next step donates them), nothing is mapped (whose unmap the first step's
dispatch would pay for) and no second copy is made; the price is one more
copy of the state in host memory.

Threads: `rc-reserve` (`StateReserve.start`) allocates and touches the
reserve's buffers. It is not a daemon: interpreter exit waits for the
allocation in flight (a thread killed inside jax aborts the process) and
makes no more once the main thread has ended.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..core.ambient import apart
from ..restore.assemble import Into
from .mesh import mesh_ids, mesh_key
from .protocol import ManagerLike

log = logging.getLogger("resilient_ckpt.elastic")


def reshard_live(manager: ManagerLike, live: Any, abstract: Any, args: Any,
                 step: int) -> tuple[Any, dict]:
    """The live state of the save step, moved onto the new shardings; the
    manager's copy of that step if the live tree does not fit `abstract`.
    Returns the state and the bytes per source ("live", or the tiers)."""
    if abstract is not None:
        try:
            state = jax.tree.map(_put_like, live, abstract)
            jax.block_until_ready(state)
            nbytes = sum(x.nbytes for x in jax.tree.leaves(state) if isinstance(x, jax.Array))
            return state, {"live": nbytes}
        except (ValueError, TypeError) as e:
            log.warning("scale-up: the live state does not match the restore target "
                        "(%s); restoring step %d from the manager", e, step)
    state = manager.restore(step, args=args if args is not None
                            else standard_restore(abstract))
    rec = manager.last_restore
    assert rec is not None  # the restore just made
    return state, dict(rec.bytes_by_tier)


def restore_latest(manager: ManagerLike, abstract: Any, args: Any) -> tuple[Any, int, dict]:
    """The newest viable step restored by the manager onto `abstract` (or
    with `args`): the state, its step and the bytes per tier."""
    state = manager.restore(None, args=args if args is not None else standard_restore(abstract))
    rec = manager.last_restore
    assert rec is not None  # the restore just made
    return state, rec.step, dict(rec.bytes_by_tier)


def check_on_mesh(abstract: Any, mesh: Mesh) -> None:
    """Raises ValueError when a leaf of `abstract` is sharded outside `mesh`."""
    allowed = set(mesh.devices.flat)
    for leaf in jax.tree.leaves(abstract):
        s = getattr(leaf, "sharding", None)
        if s is not None and not set(s.device_set) <= allowed:
            raise ValueError(
                f"the restore target has a leaf sharded over devices "
                f"{sorted(d.id for d in s.device_set)}, outside the current mesh "
                f"{mesh_ids(mesh)}; build its shardings from the mesh your "
                "function was called with")


def _put_like(x: Any, target: Any) -> Any:
    """`x` on `target`'s sharding. Through host memory: a device-to-device
    reshard onto another device set compiles a copy program first (and again
    after each jax.clear_caches()), which costs more than the host path
    (docs/benchmarks.md)."""
    sharding = getattr(target, "sharding", None)
    if not isinstance(x, jax.Array) or sharding is None:
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.device_put(x, sharding)  # typed keys have no host form; they are small
    return jax.device_put(np.asarray(x), sharding)


def standard_save(state: Any) -> Any:
    """`ocp.args.StandardSave(state)`, Orbax imported on first use."""
    import orbax.checkpoint as ocp
    return ocp.args.StandardSave(state)


def standard_restore(abstract: Any) -> Any:
    """`ocp.args.StandardRestore(abstract)`, Orbax imported on first use."""
    import orbax.checkpoint as ocp
    return ocp.args.StandardRestore(abstract)


_MIN_RESERVED = 1 << 20  # smaller leaves are left as restored: their first write is cheap


class _Spare:
    """The touched buffers for one abstract state."""

    @apart()
    def __init__(self, abstract: Any):
        leaves, self.treedef = jax.tree.flatten(abstract)
        self.index = [i for i, x in enumerate(leaves) if _reservable(x)]
        self.targets = [leaves[i] for i in self.index]
        zeros = jax.jit(lambda: [jnp.zeros(x.shape, x.dtype) for x in self.targets],
                        out_shardings=[x.sharding for x in self.targets])
        self.buffers: list | None = zeros()
        jax.block_until_ready(self.buffers)

    def matches(self, leaves: list, treedef: Any) -> bool:
        return treedef == self.treedef and all(
            isinstance(leaves[i], (jax.ShapeDtypeStruct, jax.Array))
            and leaves[i].shape == t.shape
            and leaves[i].dtype == t.dtype and leaves[i].sharding == t.sharding
            for i, t in zip(self.index, self.targets, strict=True))


def _reservable(x: Any) -> bool:
    s = getattr(x, "sharding", None)
    return (isinstance(s, NamedSharding) and x.ndim > 0
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            and x.size * np.dtype(x.dtype).itemsize >= _MIN_RESERVED)


def _gone(spare: _Spare | None) -> bool:
    return spare is None or spare.buffers is None or any(b.is_deleted() for b in spare.buffers)


def retarget(abstract: Any, mesh: Mesh) -> Any | None:
    """`abstract` with every NamedSharding moved onto `mesh` (same axis names
    and specs); None if a leaf has another kind of sharding or an axis is missing."""
    def move(x: Any) -> Any:
        s = getattr(x, "sharding", None)
        if s is None:
            return x
        if not isinstance(s, NamedSharding) or set(s.mesh.axis_names) != set(mesh.axis_names):
            raise ValueError(s)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s.spec))
    try:
        return jax.tree.map(move, abstract)
    except ValueError:
        return None


class StateReserve:
    """Touched, XLA-owned buffers for the state on the likeliest smaller mesh,
    built in the background, that a restore onto it reads into (`target`;
    once: a new reserve is built when training is back on the full mesh).

    Only for the CPU backend, and only while enabled: it holds one more copy
    of the state's large leaves in host memory. `note` records the restore
    target on the full mesh (the reserve's is the same specs on the smaller
    mesh); `start` builds what is missing; `wait` waits for a build in flight.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._abstract: Any = None
        self._lock = threading.Lock()
        self._spares: dict[tuple, cf.Future] = {}

    def note(self, abstract: Any, on_full_mesh: bool) -> None:
        if self.enabled and on_full_mesh and abstract is not None and all(
                d.platform == "cpu" for x in jax.tree.leaves(abstract)
                for d in getattr(getattr(x, "sharding", None), "device_set", ())):
            self._abstract = abstract

    def start(self, meshes: Callable[[], Sequence[Mesh]]) -> None:
        """Builds, in a background thread, the reserve for each of `meshes()`
        not held yet (called at save points on the full mesh)."""
        if self._abstract is None:
            return
        with self._lock:
            for k in [k for k, f in self._spares.items() if f.done() and _gone(f.result())]:
                del self._spares[k]  # failed, or its buffers were on lost devices
            if self._spares:
                return
            todo: list[tuple[Mesh, Any, cf.Future]] = [
                (m, retarget(self._abstract, m), cf.Future()) for m in meshes()]
            todo = [t for t in todo if t[1] is not None]
            for m, _, fut in todo:
                self._spares[mesh_key(m)] = fut
        if todo:
            threading.Thread(target=self._build, args=(todo,), name="rc-reserve",
                             daemon=False).start()

    def _build(self, todo: list) -> None:
        """Background (not a daemon: a daemon killed while jax allocates aborts
        the process at exit; interpreter exit waits for the reserve in flight,
        and none is built once the main thread has ended)."""
        for m, abstract, fut in todo:
            if not threading.main_thread().is_alive():
                fut.set_result(None)
                continue
            try:
                fut.set_result(_Spare(abstract))
            except Exception as e:  # noqa: BLE001 - a reserve is an optimisation
                log.warning("elastic: no state reserve for mesh %s (%s)", dict(m.shape), e)
                fut.set_result(None)

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the builds in flight; whether a reserve is ready."""
        with self._lock:
            futs = list(self._spares.values())
        done, _ = cf.wait(futs, timeout)
        return any(f.result() is not None for f in done)

    def target(self, abstract: Any, mesh: Mesh) -> Any:
        """`abstract` (the restore target on `mesh`) with its large leaves
        replaced by `restore.Into` the reserve's buffers, if a reserve for
        `mesh` is ready and fits it (the reserve is then used up); else
        `abstract` as it is."""
        with self._lock:
            fut = self._spares.get(mesh_key(mesh))
            if fut is None or not fut.done():
                return abstract
            del self._spares[mesh_key(mesh)]
        spare = fut.result()
        leaves, treedef = jax.tree.flatten(abstract)
        if _gone(spare) or not spare.matches(leaves, treedef):
            return abstract
        buffers, spare.buffers = spare.buffers, None
        for i, x in zip(spare.index, buffers, strict=True):
            leaves[i] = Into(x)
        return jax.tree.unflatten(treedef, leaves)
