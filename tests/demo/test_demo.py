"""The demo end to end, small: a child trains, SIGKILLs itself, another resumes."""
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # 12 s; the README's first command runs the demo in full
@pytest.mark.multiprocess
def test_demo_crash_and_resume():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "resilient_ckpt.demo", "--mb", "1", "--steps", "12",
         "--crash-at", "7"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ("save, blocking", "save, ram tier write", "restore of step",
                "steps lost", "loss after resume", "identical to before the crash",
                "save, gcs tier write", "restore from gcs alone",
                "bit-identical to the local copy"):
        assert row in out.stdout, out.stdout
    assert "from ram 100%" in out.stdout, out.stdout
    assert "restore step" in out.stderr, out.stderr  # the progress bar of the GCS restore


def test_importing_the_demos_leaves_the_environment_alone():
    """Only the entry point asks for 8 host devices; importing a demo module does not."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    code = ("import os; import resilient_ckpt.demo, resilient_ckpt.demo.crash, "
            "resilient_ckpt.demo.elastic_demo, resilient_ckpt.demo.hosts_demo; "
            "print(os.environ.get('XLA_FLAGS'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None", out.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_demo_two_hosts_one_killed_the_job_goes_on():
    """`--hosts 2`: two processes under the supervisor, process 1 SIGKILLed and its
    RAM tier removed, a fresh pair restores (host 1 from its peer) and finishes."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "resilient_ckpt.demo", "--hosts", "2", "--mb", "1",
         "--steps", "12", "--kill-at", "5"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ("relaunch timeline", "failure detected", "fresh processes started",
                "restore returned", "first step done", "SIGKILL to process 1",
                "identical to before the kill"):
        assert row in out.stdout, out.stdout
    assert "peers" in out.stdout, out.stdout  # host 1's share came from host 0's replica
