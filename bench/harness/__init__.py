"""The bench harness: what every script in bench/ shares (docs/bench_contract.md).

Entry scripts (`python bench/NAME.py`) have bench/ on their path and import
from here only (and from the package, jax, orbax ...), never from each other
nor from tests/. run_all.py runs every bench/*.py but itself and `_*.py`; this
package is no script and is not run.

- options: set-up before jax is imported (`prepare`), sizes, the parser every
  script takes (--quick, --sizes, --repeats, --plot);
- report: the JSON lines (`emit`), the summary and its goals, peak-memory
  fields and ratios, the reader of an earlier run's lines;
- measure: timing, peak resident memory (`PeakRss`), settling between cases,
  the page cache (read through, drop);
- state: the one state builder (`build_state`, a layout per bench), meshes,
  restore targets, value checks, unique shards;
- systems: one adapter per system under test: `Ours` (resilient_ckpt's
  CheckpointManager on its tiers), `Orbax` (orbax.checkpoint's), and the
  machine's limits (`Limit`: memory and disk; `GcsTransport` and `codec_limit`);
- multiprocess: the multi-process cases (multihost's jobs, recovery's
  relaunch, survivors and goodput_mc), on resilient_ckpt.testing.multiprocess
  and resilient_ckpt.testing.relaunch; `survivors_worker.py` is the worker
  script it launches;
- plot: plots of a bench's lines (rows in, a PNG out; no file reading).

Nothing here but `multiprocess` (through resilient_ckpt.testing) imports jax
at module level: `options.prepare` must run first, and bench/recovery.py
times jax's import in a child process (it imports `multiprocess` late).
"""
