"""The demos, as a sub-package: `python -m resilient_ckpt.demo [--elastic]`.

This package owns the two demos, which use the public API as a user would:

- `cli`: the entry point (`main`), choosing the demo and asking for 8 host devices;
- `crash`: the crash-and-resume demo (train, SIGKILL, resume, restore from GCS alone);
- `elastic_demo`: the in-process recovery demo (`--elastic`: lose 4 devices, grow back);
- `model`: the MLP both train, and their (data=4, model=2) CPU mesh;
- `options`: the arguments both take, and the host-device flag.

Importing it changes nothing in the environment; `main` does, before any device is used.
"""
from .cli import main

__all__ = ["main"]
