"""resilient_ckpt: multi-tier, validity-checked checkpoints for JAX training.

The public namespace: the Orbax-compatible manager and its options, the tier
configurations, every record and type it returns, the elastic loop, and the
error hierarchy; `training.Checkpointer`, Orbax's v1 training API over the
same manager. Helpers for users' own tests are in `resilient_ckpt.testing`.
"""
from . import training  # Orbax's v1 face: resilient_ckpt.training.Checkpointer
from .compat.metadata import RootMetadata, StepMetadata
from .core.retention import Retention
from .elastic import (
    Elastic,
    HealthCheck,
    HostSnapshotTier,
    ManagerLike,
    RecoveryEvent,
    RecoveryPolicy,
    format_timeline,
    is_recoverable,
    shrink_data_axis,
)
from .errors import (
    AgreementError,
    CheckpointError,
    CorruptCheckpointError,
    DirectoryInUseError,
    ItemNotFoundError,
    MissingDependencyError,
    RecoveryFailedError,
    SaveFailedError,
    StepAlreadyExistsError,
    StepNotFoundError,
    StorageError,
    TargetMismatchError,
    UnsafeDirectoryError,
    UnsupportedArgsError,
    UnsupportedFormatError,
)
from .manager import CheckpointManager
from .options import CheckpointManagerOptions, Plan, TierPlan
from .restore.assemble import RestoreRecord
from .save.commit import TierWrite
from .save.saver import SaveRecord, Tier
from .storage import Storage, StorageWrapper
from .storage.retry import RetryPolicy
from .tiers import FsspecTier, GcsTier, LocalTier, RamTier

__version__ = "0.1.0"

__all__ = [
    # the manager and its configuration
    "CheckpointManager", "training", "CheckpointManagerOptions", "RamTier", "LocalTier", "GcsTier",
    "FsspecTier",
    "RetryPolicy", "Plan", "TierPlan", "Retention", "Tier",
    # what it returns
    "SaveRecord", "TierWrite", "RestoreRecord", "StepMetadata", "RootMetadata",
    # the storage interface, for backends of one's own
    "Storage", "StorageWrapper",
    # errors
    "CheckpointError", "CorruptCheckpointError", "ItemNotFoundError", "SaveFailedError",
    "StepAlreadyExistsError", "StepNotFoundError", "StorageError", "TargetMismatchError",
    "UnsupportedArgsError", "UnsupportedFormatError", "RecoveryFailedError", "AgreementError",
    "DirectoryInUseError", "MissingDependencyError",
    "UnsafeDirectoryError",
    # the elastic loop
    "Elastic", "ManagerLike", "RecoveryPolicy", "RecoveryEvent", "HealthCheck", "HostSnapshotTier",
    "is_recoverable", "shrink_data_axis", "format_timeline",
]
