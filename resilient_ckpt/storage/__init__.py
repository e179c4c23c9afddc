"""Storage backends: a handful of blocking, thread-safe byte-object operations.

`base.Storage` is the interface; `files.FileStorage` serves the RAM tier (a
directory under /dev/shm) and the local-disk tier; `gcs.GcsStorage` the GCS
tier (imported where used, so google-cloud-storage loads only for GCS);
`fsspec_store` the fsspec tiers (s3://, az://, gs:// via gcsfs, file://), with
`retry` deciding what is retried and for how long. Backends raise the project's
own errors (StorageError, StepNotFoundError), never the backend's.
`wrapper.StorageWrapper` forwards the whole interface to another storage, the
base for layers over a backend (the restore's progress counter).
"""
from .base import Storage
from .files import FileStorage
from .wrapper import StorageWrapper

__all__ = ["Storage", "FileStorage", "StorageWrapper"]
