"""Orbax's and our managers driven in lock step under Orbax's policy objects
(tests/compat/test_parity_policies.py, test_parity_modes.py)."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

import resilient_ckpt as rc

IMPLS = (("orbax", ocp.CheckpointManager, ocp.CheckpointManagerOptions),
         ("ours", rc.CheckpointManager, rc.CheckpointManagerOptions),
         ("ours+ocp_options", rc.CheckpointManager, ocp.CheckpointManagerOptions))


def lockstep(tmp_path, options: Callable[[type], Any], steps: Sequence[int], *,
             metrics: Callable[[int], Any] = lambda s: None,
             pause: dict[int, float] | None = None,
             preempt: frozenset[int] = frozenset(), impls=IMPLS) -> dict[str, list[tuple]]:
    """Runs the same calls on each manager, step by step; per manager, a row
    per step: (step, should_save, save's result, all_steps after the save),
    then a last row: the steps a fresh read-only manager lists."""
    managers = {n: mgr(str(tmp_path / n), options=options(opts)) for n, mgr, opts in impls}
    traces: dict[str, list[tuple]] = {n: [] for n in managers}
    for m in managers.values():
        m.reached_preemption = lambda step: step in preempt  # as a preemption signal would
    try:
        for s in steps:
            time.sleep((pause or {}).get(s, 0.0))
            for n, m in managers.items():
                asked = m.should_save(s)
                saved = m.save(s, args=ocp.args.StandardSave({"x": np.arange(3) + s}),
                               metrics=metrics(s))
                m.wait_until_finished()
                traces[n].append((s, asked, saved, list(m.all_steps())))
    finally:
        for m in managers.values():
            m.close()
    for n, mgr, opts in impls:
        with mgr(str(tmp_path / n), options=opts(read_only=True)) as m:
            traces[n].append(("reopened", list(m.all_steps())))
    return traces


def _loss(s: int) -> dict:
    return {"loss": [5, 3, 4, 1, 2, 0.5, 6, 0.7][s]}
