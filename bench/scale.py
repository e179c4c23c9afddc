"""Agreement at scale: what one agreement between N processes costs the
coordinator and each process, simulated for N far beyond the processes this
machine can start.

N threads each run the real agreement code (`multihost.agree.Peers.exchange`,
then the decision every process takes from the views, `catalog.JobView`)
against `resilient_ckpt.testing.kvservice`, an in-process stand-in for
jax.distributed's coordination service that counts every request and byte and
serves requests one at a time with a per-request and a per-byte cost. Those
two costs are measured first on the real coordination service of this
machine (a one-process jax.distributed job, in a subprocess: timed
key_value_set + blocking_key_value_get pairs of a small and of a large value).
That is one client's round trip, served one at a time: an upper bound on the
coordinator's time per request when many clients ask at once (its gRPC
server overlaps them), so the modeled latencies are upper bounds too.

Each process's view is sized like a real one (`catalog._reported`): `--keep`
steps in a RAM tier and a local tier of its own (its own share of each) and a
shared GCS tier (its own share; process 0 reports every process's share it
sees there).

Per N (simulated with threads up to --simulate-max): the coordinator's
requests and bytes per agreement, the wall time of one agreement under the
service model, and each process's CPU in it (exchange + decision). Beyond
that N, requests and bytes follow from the counted formula (requests
n*(n+2) per agreement, bytes per N^2 from the largest simulated N) and the
latency from the service model; those lines say `"modeled": true`.

    python bench/scale.py                 # N = 16 ... 256 simulated, to 4,096 modeled
    python bench/scale.py --quick         # N = 8, 16, 32 simulated
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from harness.options import at_least, bench_parser, parse_options, prepare
from harness.report import emit, emit_summary

prepare(1)

from resilient_ckpt.catalog.catalog import JobView  # noqa: E402
from resilient_ckpt.multihost.agree import Peers  # noqa: E402
from resilient_ckpt.testing.kvservice import KeyValueService  # noqa: E402
from resilient_ckpt.testing.multiprocess import free_port  # noqa: E402

BENCH = "scale"
log = logging.getLogger("bench.scale")

PROBE = r"""
import json, sys, time
import jax
jax.distributed.initialize(coordinator_address="127.0.0.1:%d", num_processes=1, process_id=0)
from jax._src import distributed
c = distributed.global_state.client
out = {}
for name, size, n in (("small", 200, 2000), ("large", 200_000, 200)):
    v = "x" * size
    t0 = time.perf_counter()
    for i in range(n):
        c.key_value_set(f"probe/{name}/{i}", v)
        c.blocking_key_value_get(f"probe/{name}/{i}", 10_000)
    out[name] = (time.perf_counter() - t0) / (2 * n)
print(json.dumps(out))
jax.distributed.shutdown()
"""


def measure_service() -> tuple[float, float]:
    """(seconds per request, seconds per byte) of this machine's real
    coordination service, over loopback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", PROBE % free_port()], capture_output=True,
                       text=True, timeout=300, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"the coordination-service probe failed: {p.stderr[-2000:]}")
    t = json.loads(p.stdout.strip().splitlines()[-1])
    per_byte = max(0.0, (t["large"] - t["small"]) / (200_000 - 200))
    return t["small"] - 200 * per_byte, per_byte


def view_of(index: int, n: int, keep: int) -> dict:
    """One process's view at a save: its own shares in its RAM and local
    tiers and in the shared GCS tier (process 0: every process's share
    there), for `keep` steps."""
    shares = []
    for step in range(100, 100 + keep):
        sid = f"{step:032x}"
        shares += [[step, sid, index, n, "ram", 1.7e9], [step, sid, index, n, "local", 1.7e9]]
        shares += [[step, sid, q, n, "gcs", 1.7e9] for q in (range(n) if index == 0 else [index])]
    return {"shares": shares, "pending": [], "errors": [], "orbax": []}


def one_job(n: int, keep: int, service_s: float, per_byte_s: float) -> dict:
    """Opens n simulated processes, then one agreement; its costs."""
    service = KeyValueService(n)
    peers = [Peers("/ckpt", 600.0, job=(service.client(i), i, n)) for i in range(n)]
    service.service_s, service.per_byte_s = service_s, per_byte_s
    service.reset_counts()
    cpu = [0.0] * n
    decided: list = [None] * n
    start = threading.Barrier(n + 1)

    def agree(i: int) -> None:
        view = view_of(i, n, keep)
        start.wait()
        c0 = time.thread_time()
        views = peers[i].exchange("save", view)
        decided[i] = sorted(JobView(views).steps)
        cpu[i] = time.thread_time() - c0

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if any(d != decided[0] for d in decided):
        raise AssertionError(f"the processes of a job of {n} decided differently")
    requests, nbytes = service.totals()
    return {"requests": requests, "bytes": nbytes, "wall_s": wall,
            "cpu_per_process_s": sum(cpu) / n, "view_bytes": len(json.dumps(view_of(0, n, keep)))}


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, sizes=None)
    p.add_argument("--keep", type=at_least(1), default=3, help="steps each tier keeps")
    p.add_argument("--simulate-max", type=at_least(8), default=None,
                   help="the largest N simulated with threads (default 256; --quick 32)")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    top = a.simulate_max or (32 if a.quick else 256)
    service_s, per_byte_s = measure_service()
    emit({"bench": BENCH, "system": "limit", "case": "coordination_service",
          "request_s": service_s, "per_byte_s": per_byte_s})
    simulated = [n for n in (8, 16, 32, 64, 128, 256, 512) if n <= top and (n >= 16 or a.quick)]
    fit = []
    for n in simulated:
        r = one_job(n, a.keep, service_s, per_byte_s)
        assert r["requests"] == n * (n + 2), r
        fit.append(r["bytes"] / n ** 2)
        emit({"bench": BENCH, "system": "resilient_ckpt", "case": "all_to_all", "processes": n,
              "modeled": False, **r})
    per_n2 = fit[-1]  # every view is read by every process: N^2 reads of O(1) views
    summary = {}
    for n in (1024, 4096):
        requests, nbytes = n * (n + 2), per_n2 * n ** 2
        latency = requests * service_s + nbytes * per_byte_s  # one coordinator, serial
        emit({"bench": BENCH, "system": "resilient_ckpt", "case": "all_to_all",
              "processes": n, "modeled": True, "requests": requests, "bytes": int(nbytes),
              "wall_s": latency})
        summary[f"requests_per_agreement_over_3n_at_{n}"] = requests / (3 * n)
        summary[f"modeled_agreement_latency_s_at_{n}"] = latency
    emit_summary(BENCH, summary, goals={"requests_per_agreement_over_3n_at_4096": ("<=", 1.0),
                                        "modeled_agreement_latency_s_at_4096": ("<=", 0.05)})


if __name__ == "__main__":
    main()
