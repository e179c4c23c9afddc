"""One process's restore loop: choose the step, read it, and fall back.

A step that vanished while being read (a concurrent writer's retention
deleted it) makes the loop observe the tiers again and choose again; a step
that is there but damaged falls back to the next older viable one (when no
step was asked for) or raises. With several processes the same decisions are
taken together by `coordination`.
"""
from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

from ..catalog.catalog import Catalog
from ..core.selection import Choice
from ..errors import CorruptCheckpointError, StepNotFoundError, StorageError

log = logging.getLogger("resilient_ckpt")

_RELOADS = 8  # re-observations of the tiers one restore may make


def _gone(e: BaseException) -> bool:
    """Whether a failed read may mean files that vanished: a missing chunk
    reads as one with no intact copy."""
    if isinstance(e, StorageError):
        return e.errno == errno.ENOENT
    return isinstance(e, (CorruptCheckpointError, StepNotFoundError))


def restore_alone(catalog: Catalog, directory: Any, step: int | None,
                  attempt: Callable[[Choice], Any]) -> Any:
    """Restores `step` (None: the newest that works) through `attempt`, one
    process alone. When the chosen step vanished while being read (a
    concurrent writer's retention deleted it), the tiers are observed again
    and the choice made again, at most `_RELOADS` times; a step that is there
    but damaged falls back to the next older one (step=None) or raises."""
    reloads = 0
    while True:
        try:
            chosen = _choose(catalog, step, directory)
        except StepNotFoundError:
            # A reload can fall between a writer's deletes and its next
            # commit: with step=None, look again.
            if step is not None or not 0 < reloads < _RELOADS:
                raise
            reloads += 1
            catalog.reload()
            continue
        try:
            return attempt(chosen)
        except (CorruptCheckpointError, StorageError, StepNotFoundError) as e:
            if reloads < _RELOADS and _gone(e) and _vanished(catalog, chosen):
                reloads += 1
                log.info("step %d of %s vanished while being restored (deleted by "
                         "another writer?); choosing again", chosen.step, directory)
                continue
            if step is not None or not isinstance(e, CorruptCheckpointError):
                raise
            log.warning("step %d is not restorable (%s); falling back to the next "
                        "older viable step", chosen.step, e)

def _vanished(catalog: Catalog, chosen: Choice) -> bool:
    """Observes the tiers again; True if a copy `chosen` relied on is gone
    from them (the whole step, or one tier's copy), not merely damaged."""
    catalog.reload()
    again = catalog.viable_if_intact().get(chosen.step)
    if again is None or again.save_id != chosen.save_id:
        return True
    return any(set(tiers) - set(again.sources.get(key, ()))
               for key, tiers in chosen.sources.items())


def _choose(catalog: Catalog, step: int | None, directory: Any) -> Choice:
    """The choice for `step` (None: the newest viable), or the error that says why not."""
    choices = catalog.viable()
    if step is None:
        if not choices:
            raise StepNotFoundError(f"no viable step in {directory} "
                                    f"(tiers: {catalog.names})")
        return choices[max(choices)]
    if step not in choices:
        if step in catalog.viable_if_intact():
            raise CorruptCheckpointError(
                f"step {step} in {directory} failed checksum verification "
                f"in every tier; restore an older step (viable: {sorted(choices)})")
        why = catalog.why_not(step)
        raise StepNotFoundError(
            f"step {step} has no viable copy in any tier of {directory}"
            + (f" ({why})" if why else "") + f"; viable steps: {sorted(choices)}")
    return choices[step]
