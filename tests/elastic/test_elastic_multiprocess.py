"""A real lost host in a real multi-controller job is classified as recoverable.

Two local processes form one JAX job (jax.distributed on 127.0.0.1, gloo
collectives, one CPU device each) and run a cross-process reduction in a loop;
the parent SIGKILLs process 1 (how a lost host is simulated here, per
docs/environment.md) and process 0 reports what it caught and what
`is_recoverable` says about it, then exits at once (before the coordination
service's heartbeat timeout would abort it).
"""
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

CHILD = r'''
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
port, pid = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid, initialization_timeout=60)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from resilient_ckpt.elastic import is_recoverable
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("d")),
                                 lambda idx: np.ones(1, np.float32))
total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
assert float(total(x)) == 2.0
print("ready", flush=True)
try:
    while True:
        float(total(x))
except Exception as e:
    print("caught", type(e).__name__, is_recoverable(e), "|", str(e).splitlines()[0],
          flush=True)
    os._exit(0)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_ready(p: subprocess.Popen) -> bool:
    """Reads p's stdout up to its "ready" line (gloo prints its own lines first)."""
    for line in p.stdout:
        if line.strip() == "ready":
            return True
    return False


@pytest.mark.multiprocess
def test_a_killed_peer_is_recoverable(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(2)]
    # Whatever happens, nothing outlives two minutes (a stuck job would block reads).
    watchdog = threading.Timer(120, lambda: [p.kill() for p in procs])
    watchdog.start()
    try:
        started = [wait_for_ready(p) for p in procs]
        if not all(started):
            for p in procs:
                p.kill()
            pytest.fail(f"the job did not start: {[p.communicate()[1][-1500:] for p in procs]}")
        procs[1].send_signal(signal.SIGKILL)
        out, err = procs[0].communicate(timeout=100)
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    caught = [ln for ln in out.splitlines() if ln.startswith("caught")]
    assert caught, f"process 0 caught nothing: {out!r} {err[-2000:]}"
    _, kind, recoverable, text = caught[0].split(" ", 3)
    assert "Gloo" in text, text
    assert recoverable == "True", f"{kind} not classified recoverable: {text}"
