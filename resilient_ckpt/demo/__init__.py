"""The demos, as a sub-package: `python -m resilient_ckpt.demo [--elastic | --hosts 2]`.

This package owns the three demos, which use the public API as a user would:

- `cli`: the entry point (`main`), choosing the demo and asking for 8 host devices;
- `crash`: the crash-and-resume demo (train, SIGKILL, resume, restore from GCS alone);
- `elastic_demo`: the in-process recovery demo (`--elastic`: lose 4 devices, grow back);
- `hosts_demo`: the relaunch demo (`--hosts 2`: two processes, one lost, relaunched);
- `model`: the MLP they train, and the (data=4, model=2) CPU mesh;
- `options`: the arguments they share, and the host-device flag.

Importing it changes nothing in the environment; `main` does, before any device is used.
"""
from .cli import main

__all__ = ["main"]
