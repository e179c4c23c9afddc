"""The command lines of the bench scripts added for real model shapes and
Orbax's own tests: a bad value is a usage error (exit 2) naming the option,
before anything is measured or started."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script, args, says", [
    ("save_restore.py", ["--state", "bogus"], "argument --state: invalid choice"),
    ("gcs.py", ["--state", "train"], "argument --state: invalid choice"),
    ("orbax_manager_tests.py", ["--case-timeout", "-1"], "--case-timeout: must be at least 1"),
    ("orbax_manager_tests.py", ["--case-timeout", "0.5"], "--case-timeout: takes a whole"),
    ("orbax_manager_tests.py", ["--processes", "3"], "argument --processes: invalid choice"),
])
def test_a_bad_option_is_a_usage_error(script, args, says):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    assert says in run.stderr and not run.stdout
