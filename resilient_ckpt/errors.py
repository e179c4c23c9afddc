"""The project's one error hierarchy.

Every error raised on purpose by resilient_ckpt derives from `CheckpointError`,
and each subclass is also the builtin a caller would catch without knowing us:
a missing step is a FileNotFoundError, a corrupt or mismatched one a ValueError,
a storage failure an OSError. Where Orbax's CheckpointManager raises a class of
its own (`orbax.checkpoint.checkpoint_manager.StepAlreadyExistsError`, the only
one its public API raises in 0.12.8), ours also derives from it, so `except`
clauses written against Orbax keep working. Messages say what failed, where,
and what to do.
"""
from __future__ import annotations

from orbax.checkpoint.checkpoint_manager import (
    StepAlreadyExistsError as _OrbaxStepAlreadyExistsError,
)


class CheckpointError(Exception):
    """Root of every error resilient_ckpt raises on purpose."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step has no committed, viable copy in any tier."""


class StepAlreadyExistsError(CheckpointError, _OrbaxStepAlreadyExistsError):
    """A save was asked for a step that is already committed (as in Orbax).
    Also Orbax's own StepAlreadyExistsError, and so a ValueError."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes on storage do not match the manifest (checksum, size, parse)."""


class UnsupportedFormatError(CorruptCheckpointError):
    """The manifest is of a format version (or has fields) this reader does not know."""


class TargetMismatchError(CheckpointError, ValueError):
    """The restore target disagrees with the checkpoint (structure, shape, dtype)."""


class ItemNotFoundError(TargetMismatchError, KeyError):
    """A Composite restore names an item the step lacks (Orbax raises KeyError)."""


class UnsupportedArgsError(CheckpointError, TypeError, ValueError):
    """`args` is not a supported Orbax CheckpointArgs (Orbax raises ValueError)."""


class StorageError(CheckpointError, OSError):
    """A storage backend failed to read, write, list or delete."""

    # True when the failed operation certainly changed nothing on storage (e.g.
    # a commit whose temporary write failed before the link).
    nothing_written: bool = False


class UnsafeDirectoryError(CheckpointError, PermissionError):
    """A tier's directory is not safely ours (a link, not a directory, another
    user's, or writable by others), so it is not used. The message names it,
    its owner and mode, and what to do."""


class SaveFailedError(CheckpointError, RuntimeError):
    """A background save failed; the step was not committed to that tier.

    `step` and `tier` name the write it is about. One raise reports several
    failures at once as one SaveFailedError listing them, each in `failures`
    (otherwise empty)."""

    step: int | None = None
    tier: str | None = None
    failures: tuple[SaveFailedError, ...] = ()

    @classmethod
    def listing(cls, errors: list[SaveFailedError]) -> SaveFailedError:
        """One error for `errors` (not empty): the only one as it is, or one
        listing them all in order, each in `failures`, caused by what the
        first was caused by."""
        if len(errors) == 1:
            return errors[0]
        err = cls(f"{len(errors)} background saves failed: "
                  + "; ".join(f"[{i + 1}] {e}" for i, e in enumerate(errors)))
        err.failures = tuple(x for e in errors for x in (e.failures or (e,)))
        err.__cause__ = errors[0].__cause__ or errors[0]
        return err


class RecoveryFailedError(CheckpointError, RuntimeError):
    """The elastic loop gave up: its retry policy ran out of attempts or of time
    waiting for healthy devices. The message lists every attempt."""


class AgreementError(CheckpointError, TimeoutError):
    """The processes of a job could not agree: a peer did not answer in time
    (it is gone, or it did not make the same collective call). The message
    names the process and the call."""


class DirectoryInUseError(CheckpointError, RuntimeError):
    """Another live manager holds the writer lock of a tier of this directory,
    or the lock's name holds no regular file (a link, a FIFO, a directory), so
    it cannot be locked (raised by the first save). The message names the
    directory, the tier, the lock and the holder or what is there."""


class MissingDependencyError(CheckpointError, ImportError):
    """An option needs a package or a jax feature this environment lacks. The
    message names it, and how to install it or which option to turn off."""
