"""resilient_ckpt: multi-tier, validity-checked checkpoints for JAX training.

The public namespace: the Orbax-compatible manager and its options, the tier
configurations, the records it keeps, the elastic loop, and the error hierarchy.
"""
from .elastic import Elastic, RecoveryEvent, RecoveryPolicy, format_timeline, shrink_data_axis
from .errors import (CheckpointError, CorruptCheckpointError, RecoveryFailedError,
                     SaveFailedError, StepAlreadyExistsError, StepNotFoundError,
                     StorageError, TargetMismatchError, UnsupportedFormatError)
from .failures import HealthCheck, is_recoverable
from .manager import CheckpointManager, CheckpointManagerOptions, SaveRecord
from .restore import RestoreRecord
from .storage.retry import RetryPolicy
from .tiers import GcsTier, LocalTier, RamTier

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager", "CheckpointManagerOptions", "RamTier", "LocalTier", "GcsTier",
    "RetryPolicy",
    "SaveRecord", "RestoreRecord", "CheckpointError", "CorruptCheckpointError",
    "SaveFailedError", "StepAlreadyExistsError", "StepNotFoundError", "StorageError",
    "TargetMismatchError", "UnsupportedFormatError",
    "Elastic", "RecoveryPolicy", "RecoveryEvent", "HealthCheck", "is_recoverable",
    "shrink_data_axis", "format_timeline", "RecoveryFailedError",
]
