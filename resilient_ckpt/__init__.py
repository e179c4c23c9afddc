"""resilient_ckpt: multi-tier, validity-checked checkpoints for JAX training.

The public namespace: the Orbax-compatible manager and its options, the tier
configurations, the records it keeps, and the error hierarchy.
"""
from .errors import (CheckpointError, CorruptCheckpointError, SaveFailedError,
                     StepAlreadyExistsError, StepNotFoundError, StorageError,
                     TargetMismatchError, UnsupportedFormatError)
from .manager import CheckpointManager, CheckpointManagerOptions, SaveRecord
from .restore import RestoreRecord
from .tiers import LocalTier, RamTier

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "CheckpointManagerOptions", "RamTier", "LocalTier",
    "SaveRecord", "RestoreRecord", "CheckpointError", "CorruptCheckpointError",
    "SaveFailedError", "StepAlreadyExistsError", "StepNotFoundError", "StorageError",
    "TargetMismatchError", "UnsupportedFormatError",
]
