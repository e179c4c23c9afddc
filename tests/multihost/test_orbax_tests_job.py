"""bench/orbax_manager_tests.py --processes: a test file run as a job.

A stand-in for Orbax's test file (the same class name and base, which the
bench provides) has a case that passes only where every process shares its
temporary directory, a case that hangs, one that fails and one after them.
Run as two processes, every process reports each case, the hang as a hang
(the job is ended and a new one goes on from the next case), and each process
has its own summary.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FILE = r'''
import os
import time

import jax
from orbax.checkpoint._src.testing import multiprocess_test
from jax.experimental import multihost_utils

CheckpointManager = None


class CheckpointManagerTest(multiprocess_test.MultiProcessTest):
    def test_a_shared_tempdir(self):
        self.assertEqual(jax.process_count(), 2)
        d = self.multiprocess_create_tempdir(name="shared")
        with open(os.path.join(d, f"p{jax.process_index()}"), "w"):
            pass
        multihost_utils.sync_global_devices("written")
        self.assertEqual(sorted(os.listdir(d)), ["p0", "p1"])

    def test_b_hangs(self):
        time.sleep(3600)

    def test_c_fails(self):
        self.assertEqual(1, 2)

    def test_d_after(self):
        self.assertEqual(len(jax.devices()), 8)
        self.assertEqual(len(jax.local_devices()), 4)
'''


def test_a_job_of_two_processes_reports_each_case_on_each_process(tmp_path):
    path = tmp_path / "checkpoint_manager_test.py"
    path.write_text(FILE)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "orbax_manager_tests.py"),
         "--orbax-test", str(path), "--processes", "2", "--case-timeout", "5",
         "--logs", str(tmp_path / "logs")],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    cases = {(x["process"], x["case"]): x["outcome"] for x in lines if "case" in x}
    want = {"test_a_shared_tempdir": "pass", "test_b_hangs": "hang",
            "test_c_fails": "fail", "test_d_after": "pass"}
    assert cases == {(p, c): o for p in (0, 1) for c, o in want.items()}, out.stderr[-3000:]
    summaries = [x["summary"] for x in lines if "summary" in x]
    assert [(s["process"], s["passed"], s["of"], s["hangs"], s["failed"])
            for s in summaries] == [(p, 2, 4, ["test_b_hangs"], ["test_c_fails"])
                                    for p in (0, 1)]
    # Two jobs: the second went on from the case after the hang.
    assert sorted(os.listdir(tmp_path / "logs")) == [
        f"job{j}-process{p}.log" for j in (0, 1) for p in (0, 1)]
    assert "test_b_hangs" in (tmp_path / "logs" / "job0-process1.log").read_text()
