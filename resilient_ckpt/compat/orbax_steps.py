"""Steps that Orbax's own CheckpointManager wrote in the manager's directory.

Changing one import must move an existing training loop over, and that loop's
directory already holds Orbax checkpoints. They are listed beside ours (a step
directory with Orbax's `_CHECKPOINT_METADATA` commit file and no manifest of
ours), restored and described through Orbax itself, read-only, and never
deleted by our retention. New steps are written in our format. Orbax trusts
its directories; we do not: a local step is checked (compat/foreign.py) before
Orbax reads it, so its metadata cannot make Orbax read outside it, hang on a
FIFO or allocate more than this host holds.
"""
from __future__ import annotations

import os
from typing import Any

from ..core import layout
from ..storage.base import Storage
from . import foreign

ORBAX_COMMIT_FILE = "_CHECKPOINT_METADATA"


def orbax_steps(storage: Storage, naming: layout.StepNaming) -> set[int]:
    out = set()
    for name in storage.list(""):
        step = naming.parse(name)
        if step is None:
            continue
        try:
            names = storage.list(name)
        except OSError:  # an unlistable directory is no step; it must not stop an open
            continue
        if ORBAX_COMMIT_FILE in names and not any(layout.parse_manifest_name(n) for n in names):
            out.add(step)
    return out


def _checked(directory: str, naming: layout.StepNaming, step: int, items: bool = True) -> None:
    """The step's files checked before Orbax reads them (its items' too, unless
    only the step's own metadata is read)."""
    if "://" in directory:  # a remote step is read by Orbax's own clients
        return
    foreign.check_step(os.path.join(directory, naming.name(step)), items)
    # Orbax's manager, opened to read it, reads every step's commit file too
    foreign.check_files([os.path.join(directory, "metadata", "_ROOT_METADATA")] + [
        os.path.join(directory, n, ORBAX_COMMIT_FILE)
        for n in os.listdir(directory) if naming.parse(n) is not None])


def _manager(directory: str, naming: layout.StepNaming):
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, step_prefix=naming.prefix,
        step_format_fixed_length=naming.fixed_length))


def restore(directory: str, naming: layout.StepNaming, step: int, args: Any) -> Any:
    _checked(directory, naming, step)
    with _manager(directory, naming) as m:
        return m.restore(step, args=args)


def metrics(directory: str, naming: layout.StepNaming, step: int) -> Any:
    _checked(directory, naming, step, items=False)
    with _manager(directory, naming) as m:
        return m.metrics(step)


def metadata(directory: str, naming: layout.StepNaming, step: int) -> Any:
    _checked(directory, naming, step)
    with _manager(directory, naming) as m:
        return m.metadata(step)
