"""The project's one error hierarchy.

Every error raised on purpose by resilient_ckpt derives from `CheckpointError`,
and each subclass is also the builtin a caller would catch without knowing us:
a missing step is a FileNotFoundError, a corrupt or mismatched one a ValueError,
a storage failure an OSError. Messages say what failed, where, and what to do.
"""
from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error resilient_ckpt raises on purpose."""


class StepNotFoundError(CheckpointError, FileNotFoundError):
    """The requested step has no committed, viable copy in any tier."""


class StepAlreadyExistsError(CheckpointError, ValueError):
    """A save was asked for a step that is already committed (as in Orbax)."""


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


class SaveFailedError(CheckpointError, RuntimeError):
    """A background save failed; the step was not committed to that tier."""


class RecoveryFailedError(CheckpointError, RuntimeError):
    """The elastic loop gave up: its retry policy ran out of attempts or of time
    waiting for healthy devices. The message lists every attempt."""


class AgreementError(CheckpointError, TimeoutError):
    """The processes of a job could not agree: a peer did not answer in time
    (it is gone, or it did not make the same collective call). The message
    names the process and the call."""
