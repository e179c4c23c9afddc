"""Internal jax work kept apart from the caller's mesh context.

A caller may save or restore inside a mesh context of its own
(`jax.set_mesh(mesh)`, as a context or as the thread's setting): jax then
builds every program run on that thread against that mesh, and refuses one
whose arrays lie on other devices (a mesh of some of the devices; a job's
arrays spread over every process). What the package runs for itself depends
only on the shardings it names, never on that context: every jitted program
or jax operation it runs on the caller's thread runs under `apart()`, which
clears the thread's mesh context while it runs and puts it back after. (The
legacy `with mesh:` context only resolves bare PartitionSpecs; the package
names every sharding in full, so that context does not reach it.)
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def apart() -> Iterator[None]:
    """Runs the block (or, as a decorator, the function) with no mesh
    context on this thread, whatever the caller set; nests freely."""
    with jax.set_mesh(None):
        yield
