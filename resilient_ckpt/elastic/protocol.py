"""What the elastic loop needs of a checkpoint manager, as a `typing.Protocol`.

This module owns that contract and nothing else: `CheckpointManager` meets it
(the loop calls only these public members), and so can a test double.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class RestoreRecordLike(Protocol):
    """The parts of a `RestoreRecord` the loop reads."""

    @property
    def step(self) -> int: ...

    @property
    def bytes_by_tier(self) -> Mapping[str, int]: ...


class ManagerLike(Protocol):
    """The members of `CheckpointManager` that `Elastic` calls. In a job of
    several processes, after a process is lost, the loop also calls
    `set_live_processes(processes)` (`survivors.tell_manager`); a manager
    without it cannot go on among the survivors."""

    @property
    def directory(self) -> Any:
        """Where the checkpoints are (named in the give-up message)."""

    @property
    def last_restore(self) -> RestoreRecordLike | None:
        """The record of the latest restore: its step and bytes per tier."""

    def latest_step(self) -> int | None:
        """The newest viable step, or None."""

    def save(self, step: int, *args: Any, **kwargs: Any) -> bool:
        """Saves `step` when a tier is due (called with args= and the user's
        keywords); returns whether it saved."""

    def restore(self, step: int | None, *args: Any, **kwargs: Any) -> Any:
        """Restores `step` (None: the newest viable one), called with args=."""
