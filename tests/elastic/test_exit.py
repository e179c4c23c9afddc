"""A script that trains with a manager ends with exit code 0 and a clean stderr.

Each test runs a real script in a subprocess (`tests/support/exits.py`, or a
job of two jax.distributed processes through `testing.multiprocess`) and
checks how the interpreter ended: exit 0, no traceback, no fatal error from a
thread killed inside XLA at interpreter exit, no crash when devices vanish
under a host snapshot still being copied.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from resilient_ckpt.testing.multiprocess import describe, run_job

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "exits.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIRTY = ("Traceback", "Fatal Python error", "terminate called", "FATAL", "Segmentation",
         "Aborted", "core dumped")


def run_script(mode: str, directory: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, SCRIPT, mode, directory], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    what = f"exit code {out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n" \
           f"--- stderr\n{out.stderr[-6000:]}"
    assert out.returncode == 0, what
    for text in DIRTY:
        assert text not in out.stderr, what
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("done "), what
    return json.loads(last[len("done "):]), out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["manager", "elastic", "host_snapshot"])
def test_a_short_training_exits_cleanly(tmp_path, mode):
    """With the host snapshot the commit thread starts the restore programs'
    compile thread at the last step: exit waits for it instead of killing it
    inside XLA (before, the process ended with SIGABRT after printing done)."""
    got, _ = run_script(mode, str(tmp_path))
    if mode == "host_snapshot":
        assert got["snapshots"] == [7, 8]   # the last one committed before exit


@pytest.mark.slow
def test_devices_lost_under_a_snapshot_in_flight(tmp_path):
    """Devices 4-7 vanish (their buffers deleted) while the snapshot taken at
    the step before is still being copied, eight times: the commit thread is
    never left waiting on deleted copies (before: SIGSEGV, or an abort, in it),
    the snapshot in flight is discarded, and each recovery restores an older
    step; the run ends with the replayed state and exit 0."""
    got, err = run_script("loss", str(tmp_path))
    failures = [e for e in got["events"] if e[0] == "failure"]
    assert len(failures) == 8 and all(e[2] == "resumed" and e[3] for e in failures), got
    assert "were lost while it was being copied" in err   # one at least was in flight


WORKER = r'''
import sys
import mh
ctx = mh.init(sys.argv)
import jax
from resilient_ckpt.elastic import Elastic


def build(mesh):
    return ctx.train_step, ctx.abstract(mesh)


def run(ctx):
    mngr = mh.ours(ctx, ram_every=1, local_every=2)
    el = Elastic(mngr, ctx.mesh, build=build, rescale_every_s=1e9)

    @el.run
    def train(mesh):
        step_fn, abstract = el.program(mesh)
        state, start = el.restore(abstract, ctx.initial_state)
        for s in range(start + 1, 7):
            state = el.step(step_fn, state, s)
            el.save(s, state)
        return state

    state = train()
    mngr.wait_until_finished()
    mh.report({"exact": ctx.check_exact(state, 6), "steps": mngr.all_steps()})
    mngr.close()


mh.main(run, ctx)
'''


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_process_of_a_job_exits_cleanly(hosts):
    """Two jax.distributed processes train under the elastic loop (with its
    ahead-of-time compile thread) and a manager, and both end with exit 0."""
    res = run_job(WORKER, 2, 4, args=["--dir", hosts["dir"], "--ram", hosts["ram"]],
                  timeout_s=180)
    for r in res:
        assert r.rc == 0, describe(res)
        for text in DIRTY:
            assert text not in r.stderr, describe(res)
        assert r.last() == {"exact": [], "steps": [4, 5, 6]}, describe(res)
