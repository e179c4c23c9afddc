"""Agreement at scale: what one agreement between N processes costs the
coordinator and each process, simulated for N far beyond the processes this
machine can start, and a real job of up to 32 processes beside Orbax.

Part 1, the coordination service of this machine (`measure_service`): a
two-process jax.distributed job in subprocesses; process 1 makes timed
key_value_set + blocking_key_value_get pairs of a small and of a large value
while process 0, which hosts the service, only waits. Process 0's CPU time
over the requests is the coordinator's time per request and per byte
(`service_s`, `per_byte_s`); process 1's round trip beyond it is `rtt_s`.

Part 2, the simulator: N threads each run the real agreement code
(`multihost.agree.Peers.decide` with the job's rule, `catalog.JobView`)
against `resilient_ckpt.testing.kvservice`, an in-process stand-in for the
coordination service that counts every request and byte and serves requests
one at a time at the measured costs (one coordinator core: an upper bound,
since the real service's gRPC server serves requests on several threads).
Both protocols run on the same views in the same run: "all-to-all" (the
reference) and "gather" (the default). Each process's view is sized like a
real one (`catalog._reported`): `--keep` steps in a RAM tier and a local tier
of its own and a shared GCS tier (process 0 reports every process's share it
sees there). Per N (threads up to --simulate-max): requests and bytes per
agreement, the wall time of one agreement, each process's CPU in it (mean,
and the deciding leader's), and whether every process decided the same.
Beyond that N, requests and bytes follow the counted growth (all-to-all:
N(N+2) requests, bytes by N^2; gather: requests and bytes by N, from the
largest simulated N) and the latency the model

    requests x service_s + bytes x per_byte_s       (the coordinator, serial)
    + sequential requests on the critical path x rtt_s
    + the deciding CPU (per view, from the largest simulated N, x N)

which the simulated lines also print (`model_s`) to check it against their
measured wall. A save adds one agreement (its views); a restore three (one
with views, two of a few bytes: who reads the step, then each process's
outcome), in a job that votes three votes.

Part 3, a writer's manifest (`manifests`): one writer's manifest of a save
of the 876-leaf decoder (every matrix FSDP over all devices, norms
replicated) by 64, 1,024 and 4,096 hosts of 4 devices: its bytes and the CPU
of writing and parsing it, beside the same manifest as format 3 wrote it
(every leaf's sharding listing every device id).

Part 4, the real job (`--job`, default 2,4,8,16,32 processes; --quick 2,4,8):
N jax.distributed processes of one CPU device each on a tiny sharded state
(harness/scale_worker.py): a RAM tier per process and a shared local tier,
every step due, 10 saves and wait_until_finished; opening a manager (the
median of 5 opens on each process: one open is a few noisy ms); a restore
of the newest step in a fresh manager. Beside it, the same job
with votes forced on (`agreement_vote=True`; by default a job of fewer than
64 processes agrees through the store), and with Orbax's CheckpointManager
on the shared directory (every step, keep 2).
Each phase is the slowest process's time from a barrier to its own end;
beside it, the longest mean time one save blocked a process, and the CPU
one save costs a process (every thread, mean over the processes and the
most): with N processes on this machine's 2 cores, a phase's wall time
grows with N times that CPU, while on a cluster each host has its own.

    python bench/scale.py                 # everything
    python bench/scale.py --quick         # N = 8, 16, 32 simulated; jobs of 2, 4, 8
    python bench/scale.py --job none      # the simulator only
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
from harness.options import at_least, bench_parser, parse_options, prepare
from harness.report import emit, emit_summary

prepare(1)

from resilient_ckpt.catalog.catalog import JobView  # noqa: E402
from resilient_ckpt.core import manifest as mf, summary as vote_rule, writers  # noqa: E402
from resilient_ckpt.multihost.agree import _FAN_IN, PROTOCOLS, Peers  # noqa: E402
from resilient_ckpt.native import crc32c  # noqa: E402
from resilient_ckpt.testing import formats  # noqa: E402
from resilient_ckpt.testing.kvservice import KeyValueService  # noqa: E402
from resilient_ckpt.testing.multiprocess import describe, free_port, run_job  # noqa: E402

BENCH = "scale"
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "harness", "scale_worker.py")
log = logging.getLogger("bench.scale")

PROBE = r"""
import json, resource, sys, time
import jax
pid, port = int(sys.argv[1]), int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
from jax._src import distributed
c = distributed.global_state.client
out = {}
for name, size, n in (("small", 200, 3000), ("large", 200_000, 300)):
    c.wait_at_barrier(f"go/{name}", 60_000)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if pid == 1:
        v = "x" * size
        for i in range(n):
            c.key_value_set(f"probe/{name}/{i}", v)
            c.blocking_key_value_get(f"probe/{name}/{i}", 10_000)
    c.wait_at_barrier(f"done/{name}", 600_000)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    out[name] = {"cpu": cpu / (2 * n), "wall": (t1 - t0) / (2 * n)}
print("PROBE " + json.dumps(out), flush=True)
jax.distributed.shutdown()
"""


def measure_service() -> dict:
    """This machine's coordination service: seconds of its CPU per request and
    per byte, and the rest of a client's round trip (see the docstring)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, str(i), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"the coordination-service probe failed: {err[-2000:]}")
        outs.append(json.loads(out.split("PROBE ", 1)[1].splitlines()[0]))
    server, client = outs
    size = 200_000 - 200
    per_byte = max(0.0, (server["large"]["cpu"] - server["small"]["cpu"]) / size)
    service = max(0.0, server["small"]["cpu"] - 200 * per_byte)
    wire = max(0.0, (client["large"]["wall"] - client["small"]["wall"]) / size - per_byte)
    return {"service_s": service, "per_byte_s": per_byte,
            "rtt_s": max(0.0, client["small"]["wall"] - service - 200 * (per_byte + wire)),
            "client_round_trip_s": client["small"]["wall"]}


VOTE_PROBE = r"""
import sys, time
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import jax
    import numpy as np
    from resilient_ckpt.core import summary
    from resilient_ckpt.multihost.vote import DeviceVote
    vote = DeviceVote(range(jax.process_count()), summary.WIDTH)
    row = np.zeros(summary.WIDTH, np.int64)
    DeviceVote.wait(vote.start(row), "probe", 60)  # joins the devices once
    times = []
    for _ in range(300):
        t = time.perf_counter()
        DeviceVote.wait(vote.start(row), "probe", 60)
        times.append(time.perf_counter() - t)
    mh.report({"vote_s": sorted(times)[len(times) // 2]})


mh.main(run, ctx)
"""


def measure_vote() -> float:
    """One vote (`multihost.vote.DeviceVote`: dispatch, one all-reduce of a
    save's vector between two processes of one CPU device each, the result
    read back) on this machine: the median of 300, in seconds."""
    results = run_job(VOTE_PROBE, 2, 1, timeout_s=180)
    got = [r.last("vote_s") for r in results]
    if any(g is None for g in got):
        raise RuntimeError(f"the vote probe failed: {describe(results)}")
    return max(g["vote_s"] for g in got)


def view_of(index: int, n: int, keep: int) -> dict:
    """One process's view at a save: its own shares in its RAM and local
    tiers and in the shared GCS tier (process 0: every process's share
    there), for `keep` steps."""
    shares = []
    for step in range(100, 100 + keep):
        sid = f"{step:032x}"
        shares += [[step, sid, index, n, "ram", 1.7e9], [step, sid, index, n, "local", 1.7e9]]
        shares += [[step, sid, q, n, "gcs", 1.7e9] for q in (range(n) if index == 0 else [index])]
    return {"shares": shares, "pending": [], "errors": [], "orbax": [],
            "save_id": f"{index:032x}", "in_use": None}


def one_agreement(n: int, keep: int, protocol: str, costs: dict) -> dict:
    """Opens n simulated processes, then one save's agreement; its costs."""
    service = KeyValueService(n)
    peers = [Peers(600.0, job=(service.client(i), i, n), protocol=protocol)
             for i in range(n)]
    service.service_s, service.per_byte_s = costs["service_s"], costs["per_byte_s"]
    service.rtt_s = costs["rtt_s"]
    service.reset_counts()
    cpu = [0.0] * n
    decided: list = [None] * n
    views = [view_of(i, n, keep) for i in range(n)]
    start = threading.Barrier(n + 1)

    def agree(i: int) -> None:
        start.wait()
        c0 = time.thread_time()
        d = peers[i].decide("save", views[i], lambda vs: JobView.decided(vs).to_json())
        decided[i] = JobView.from_json(d).to_json()
        cpu[i] = time.thread_time() - c0

    threads = [threading.Thread(target=agree, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    requests, nbytes = service.totals()
    return {"requests": requests, "bytes": nbytes, "wall_s": wall,
            "cpu_per_process_s": sum(cpu) / n, "cpu_max_s": max(cpu),
            "view_bytes": len(json.dumps(views[1])),
            "same_everywhere": all(d == decided[0] for d in decided), "decision": decided[0]}


def vote_views(n: int, keep: int) -> list[dict]:
    """The views of a save after a manager's first (`view_of`'s, without the
    save id and lock refusal only a first save's views carry): the saves a
    vote decides."""
    return [{k: v for k, v in view_of(i, n, keep).items() if k not in ("save_id", "in_use")}
            for i in range(n)]


def one_vote(n: int, keep: int) -> dict:
    """The vote (`core.summary`) of n simulated processes on the same views
    as `one_agreement`: each encodes its view, the rows are reduced by max
    (what the all-reduce computes), each decides; CPU per process, and
    whether every process decided the same."""
    views = vote_views(n, keep)
    candidates = sorted({(s[0], s[1], n) for s in views[0]["shares"]})
    tiers = ["ram", "local", "gcs"]
    rows, encode_s = [], []
    # The simulator's own heap (n views) is not a process's: no collection
    # of it is charged to one process's encode or decide.
    gc.collect()
    gc.disable()
    for i, v in enumerate(views):
        c0 = time.thread_time()
        rows.append(vote_rule.encode(v, candidates, tiers, i, n))
        encode_s.append(time.thread_time() - c0)
    reduced = np.max(rows, axis=0)
    decided, decide_s = [], []
    for v in views:
        c0 = time.thread_time()
        d = vote_rule.decide(reduced, candidates, tiers, v["orbax"])
        decided.append(None if d is None else JobView.from_json(d).to_json())
        decide_s.append(time.thread_time() - c0)
    gc.enable()
    return {"requests": 0, "bytes": 0, "vote_bytes": int(reduced.nbytes),
            "encode_s_mean": sum(encode_s) / n, "encode_s_max": max(encode_s),
            "decide_s": max(decide_s), "same_everywhere": all(d == decided[0] for d in decided),
            "decision": decided[0]}


def vote_model_s(n: int, vote_s: float, cpu_s: float) -> float:
    """A vote's latency at n processes: the measured two-process vote per
    step of a logarithmic all-reduce (tree or recursive doubling, as NCCL's
    tree and TPU interconnects do for small messages), plus the encode and
    decide CPU of the slowest process."""
    return math.ceil(math.log2(max(n, 2))) * vote_s + cpu_s


def critical_requests(protocol: str, n: int) -> int:
    """Requests one after another on the slowest path of one agreement."""
    if protocol == "all-to-all":
        return n + 2  # set, n - 1 gets, barrier, delete
    return 3 + math.ceil((n - 1) / _FAN_IN)  # set, (leader) waits, decision, get


def model_s(protocol: str, n: int, requests: float, nbytes: float, cpu_per_view: float,
            costs: dict) -> float:
    return (requests * costs["service_s"] + nbytes * costs["per_byte_s"]
            + critical_requests(protocol, n) * costs["rtt_s"] + cpu_per_view * n)


def simulate(a, costs: dict) -> dict:
    top = a.simulate_max or (32 if a.quick else 256)
    simulated = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024) if n <= top
                 and (n >= 16 or a.quick)]
    summary: dict = {}
    decided: dict = {}  # (protocol, n) -> the decision every process took
    for protocol in PROTOCOLS:
        fit: dict = {}
        for n in simulated:
            r = one_agreement(n, a.keep, protocol, costs)
            same = r.pop("same_everywhere")
            decided[protocol, n] = r.pop("decision")
            per_view = r["cpu_max_s"] / n
            fit = {"requests": r["requests"], "bytes": r["bytes"], "n": n, "per_view": per_view}
            emit({"bench": BENCH, "system": "resilient_ckpt", "case": protocol, "processes": n,
                  "modeled": False, "same_everywhere": same, **r,
                  "model_s": model_s(protocol, n, r["requests"], r["bytes"], per_view, costs)})
        for n in (1024, 4096):
            grow = (n / fit["n"]) ** (2 if protocol == "all-to-all" else 1)
            requests, nbytes = fit["requests"] * grow, fit["bytes"] * grow
            save = model_s(protocol, n, requests, nbytes, fit["per_view"], costs)
            # A restore: one agreement with views, two of a few bytes each.
            tiny = model_s(protocol, n, requests, 64 * requests, 0.0, costs)
            emit({"bench": BENCH, "system": "resilient_ckpt", "case": protocol,
                  "processes": n, "modeled": True, "requests": int(requests),
                  "bytes": int(nbytes), "save_agreement_s": save,
                  "restore_agreements_s": save + 2 * tiny})
            key = "all_to_all" if protocol == "all-to-all" else protocol
            summary[f"{key}_requests_over_3n_at_{n}"] = requests / (3 * n)
            summary[f"{key}_bytes_per_process_at_{n}"] = nbytes / n
            summary[f"{key}_save_agreement_s_at_{n}"] = save
            summary[f"{key}_restore_agreements_s_at_{n}"] = save + 2 * tiny
    for n in sorted(set(simulated) | {64, 1024, 4096}):
        r = one_vote(n, a.keep)
        same = r.pop("same_everywhere")
        got = r.pop("decision")
        # The reference: the job's rule over every view, as the all-to-all applies it.
        want = JobView.from_json(json.loads(json.dumps(JobView.decided(
            vote_views(n, a.keep)).to_json()))).to_json()
        decided["vote", n] = got if got == want else ("differs", got)
        cpu = r["encode_s_max"] + r["decide_s"]
        latency = vote_model_s(n, costs["vote_s"], cpu)
        # A restore in a job that votes: that vote (what exists), then two of a
        # few numbers each (who reads the step, each process's outcome).
        restore = latency + 2 * vote_model_s(n, costs["vote_s"], 0.0)
        emit({"bench": BENCH, "system": "resilient_ckpt", "case": "vote", "processes": n,
              "modeled": True, "same_everywhere": same, "same_as_all_views": got == want, **r,
              "save_agreement_s": latency, "restore_agreements_s": restore,
              "ring_s": 2 * (n - 1) * costs["vote_s"] + cpu})
        if n in (1024, 4096):
            summary[f"vote_requests_at_{n}"] = 0
            summary[f"vote_save_agreement_s_at_{n}"] = latency
            summary[f"vote_restore_agreements_s_at_{n}"] = restore
    summary["decisions_differ"] = (
        any(decided["gather", n] != decided["all-to-all", n] for n in simulated)
        or any(isinstance(d, tuple) for k, d in decided.items() if k[0] == "vote"))
    return summary


# ------------------------------------------------------------ a writer's manifest

DEVICES_PER_HOST = 4
LAYERS = 32  # the decoder of bench/harness/state.py: 876 leaves with Adam's moments


def decoder_manifest(hosts: int, writer: int = 1) -> mf.Manifest:
    """One writer's manifest of a save of the 876-leaf decoder by `hosts`
    hosts of DEVICES_PER_HOST devices: every matrix FSDP over all devices (the
    writer's chunks: one per device of its own), the norms replicated (writer
    0 writes them), each leaf's description made as `describe` makes it."""
    n = hosts * DEVICES_PER_HOST
    axes, mesh_shape, ids = ["fsdp"], [n], list(range(n))
    fsdp = {"type": "named", "axis_names": axes, "mesh_shape": mesh_shape,
            "device_ids": ids, "spec": ["fsdp", None]}
    norm = dict(fsdp, spec=[None])
    names = [f"layer_{i:02d}.{t}" for i in range(LAYERS)
             for t in ("q", "k", "v", "o", "gate", "up", "down", "norm1", "norm2")]
    names += ["embed", "head", "final_norm"]
    leaves, offset = [], 0
    for part in ("params", "mu", "nu"):
        for name in names:
            replicated = "norm" in name
            shape = (256,) if replicated else (n * 8, 256)
            chunks = []
            for d in ([0] if replicated else range(writer * DEVICES_PER_HOST,
                                                  (writer + 1) * DEVICES_PER_HOST)):
                if replicated and writer != 0:
                    break
                box = ((0,), (256,)) if replicated else ((d * 8, 0), (8, 256))
                nbytes = 4 * math.prod(box[1])
                chunks.append(mf.ChunkRecord(
                    box[0], box[1], f"9a26b129.c0.{len(leaves)}.{d * 8}_0", nbytes, nbytes,
                    2340049308, "raw", 261888, (2340049308,), "9a26b129.p1.51edb9a2", offset))
                offset += 4096 * math.ceil(nbytes / 4096)
            leaves.append(mf.LeafRecord((("key", part), ("key", name)), "array", shape,
                                        "float32", norm if replicated else fsdp, None, None,
                                        tuple(chunks)))
    for extra in ("count", "step", "rng"):  # small numpy leaves, written by writer 0
        leaves.append(mf.LeafRecord((("key", extra),), "numpy_scalar", (), "int32"))
    return mf.Manifest(7, "9a26b129" * 4, 1.5, writer, hosts,
                       (mf.ItemRecord("default", "pytree", tuple(leaves)),),
                       writers=tuple((h * DEVICES_PER_HOST, DEVICES_PER_HOST, h)
                                     for h in range(hosts)))


def as_format_3(data: bytes) -> bytes:
    """A manifest's bytes as format 3 wrote them, signed again."""
    doc = formats.as_version_3(json.loads(data))
    del doc["manifest_crc32c"]
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    return body + b',"manifest_crc32c":%d}' % crc32c.value(body)


def manifests(counts: list[int]) -> dict:
    """A writer's manifest of the decoder at each number of hosts: its bytes,
    and the CPU of writing and of parsing it (the median of 3), in this format
    and as format 3 wrote it. At open and reload each process reads its own
    and its part of the others (one, in a job of the save's size). And a
    restore by a job of half as many hosts (FSDP over half the devices):
    the writers' manifests one of its hosts reads, `writers.covering` from
    the one it holds, and the CPU of working them out, where it read every
    writer's without the `writers` table."""
    summary: dict = {}
    for hosts in counts:
        m = decoder_manifest(hosts)
        t0 = time.process_time()
        data = mf.to_json(m)
        write_s = time.process_time() - t0
        old = as_format_3(data)
        line = {"bench": BENCH, "system": "resilient_ckpt", "case": "manifest", "hosts": hosts,
                "devices": hosts * DEVICES_PER_HOST, "leaves": len(m.items[0].leaves),
                "chunks": sum(1 for _ in m.chunks()), "bytes": len(data),
                "to_json_s": write_s, "format_3_bytes": len(old)}
        for key, raw in (("parse_s", data), ("format_3_parse_s", old)):
            took = []
            for _ in range(3):  # the median of 3: one parse is a few noisy tens of ms
                t0 = time.process_time()
                back = mf.parse(raw)
                took.append(time.process_time() - t0)
                if back != m:
                    raise RuntimeError(f"the manifest of {hosts} hosts does not parse back")
            line[key] = sorted(took)[1]
        # host 1 of a job of hosts / 2: its devices' rows of every matrix
        mine = range(DEVICES_PER_HOST, 2 * DEVICES_PER_HOST)
        n = hosts * DEVICES_PER_HOST // 2
        wants = {(0, li): [((d * 16, 0), (16, 256)) for d in mine] if len(lf.shape) == 2
                 else [(tuple(0 for _ in lf.shape), tuple(lf.shape))]
                 for li, lf in enumerate(m.items[0].leaves)}
        assert n * 16 == m.items[0].leaves[0].shape[0]
        t0 = time.process_time()
        wanted = writers.covering(m, wants)
        line["covering_s"] = time.process_time() - t0
        if wanted is None:
            raise RuntimeError(f"no writers worked out at {hosts} hosts")
        line["reshard_manifests"] = len(wanted)
        line["reshard_manifest_bytes"] = len(wanted) * len(data)
        line["reshard_manifest_bytes_without_table"] = hosts * len(data)
        emit(line)
        summary[f"reshard_manifests_at_{hosts}"] = len(wanted)
        summary[f"manifest_bytes_at_{hosts}"] = len(data)
        summary[f"manifest_format_3_bytes_at_{hosts}"] = len(old)
    summary["manifest_bytes_growth"] = (summary[f"manifest_bytes_at_{counts[-1]}"]
                                        / summary[f"manifest_bytes_at_{counts[0]}"])
    return summary


# ------------------------------------------------------------ the real job

def job_phases(system: str, n: int, saves: int, root: str) -> dict:
    """The slowest process's time in each phase of one real job of n processes."""
    shared = os.path.join(root, f"{system}-{n}")
    ram = os.path.join("/dev/shm", f"rc-scale-{os.getpid()}-{n}", "ram{pid}")
    try:
        results = run_job(WORKER, n, 1, args=["--dir", shared, "--ram", ram, "--system", system,
                                              "--saves", str(saves), "--state-bytes", "65536"],
                          timeout_s=120 + 20 * n, heartbeat_timeout_s=60)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(os.path.dirname(ram), ignore_errors=True)
    reports = [r.last() for r in results]
    if not all(r is not None and "error" not in r for r in reports):
        raise RuntimeError(f"the {system} job of {n} failed: {describe(results)}")
    out = {k: max(r[k] for r in reports) for k in ("open_s", "saves_s", "reopen_s", "restore_s",
                                                   "save_blocking_s")}
    out["cpu_per_save_s"] = sum(r["cpu_per_save_s"] for r in reports) / n
    out["cpu_per_save_max_s"] = max(r["cpu_per_save_s"] for r in reports)
    out["mismatches"] = sum(r["mismatches"] for r in reports)
    return out


def real_jobs(a, counts: list[int]) -> dict:
    summary: dict = {}
    root = tempfile.mkdtemp(prefix="rc-scale-")
    try:
        for n in counts:
            got = {}
            for system in ("resilient_ckpt", "vote", "orbax"):
                log.info("a real job of %d processes, %s", n, system)
                got[system] = job_phases(system, n, a.saves, root)
                emit({"bench": BENCH, "system": "orbax" if system == "orbax" else
                      "resilient_ckpt", "case": "job_vote" if system == "vote" else "job",
                      "processes": n, "saves": a.saves, **got[system]})
            ours, orbax = got["resilient_ckpt"], got["orbax"]
            # Votes at every size (below AUTO_FROM the job agrees through the store).
            summary[f"vote_saves_vs_orbax_{n}"] = got["vote"]["saves_s"] / orbax["saves_s"]
            summary[f"vote_mismatches_{n}"] = got["vote"]["mismatches"]
            summary[f"saves_vs_orbax_{n}"] = ours["saves_s"] / orbax["saves_s"]
            summary[f"save_blocking_vs_orbax_{n}"] = (ours["save_blocking_s"]
                                                      / orbax["save_blocking_s"])
            summary[f"cpu_per_save_ms_{n}"] = 1000 * ours["cpu_per_save_s"]
            summary[f"open_vs_orbax_{n}"] = ours["open_s"] / orbax["open_s"]
            summary[f"restore_vs_orbax_{n}"] = ((ours["reopen_s"] + ours["restore_s"])
                                                / (orbax["reopen_s"] + orbax["restore_s"]))
            summary[f"mismatches_{n}"] = ours["mismatches"] + orbax["mismatches"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return summary


def _counts(text: str) -> list[int]:
    if text == "none":
        return []
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = [0]
    if not out or any(n < 2 or n > 64 for n in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give process counts from 2 to 64, "
                                         "separated by commas (2,4,8), or none")
    return out


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, sizes=None)
    p.add_argument("--keep", type=at_least(1), default=3, help="steps each tier keeps")
    p.add_argument("--simulate-max", type=at_least(8), default=None,
                   help="the largest N simulated with threads (default 256; --quick 32)")
    p.add_argument("--job", type=_counts, default=None, metavar="N,N,...",
                   help="process counts of the real job (default 2,4,8,16,32; --quick "
                        "2,4,8; none: skip it)")
    p.add_argument("--saves", type=at_least(1), default=10, help="saves in the real job")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    costs = measure_service()
    costs["vote_s"] = measure_vote()
    emit({"bench": BENCH, "system": "limit", "case": "coordination_service", **costs})
    summary = simulate(a, costs)
    summary.update(manifests([64, 1024] if a.quick else [64, 1024, 4096]))
    counts = a.job if a.job is not None else ([2, 4, 8] if a.quick else [2, 4, 8, 16, 32])
    summary.update(real_jobs(a, counts))
    goals = {"gather_requests_over_3n_at_4096": ("<=", 1.0),
             "vote_save_agreement_s_at_4096": ("<=", 0.05),
             "decisions_differ": ("<=", 0), "saves_vs_orbax": ("<=", 0.15),
             "manifest_bytes_growth": ("<=", 1.1),
             "open_vs_orbax": ("<=", 1.0), "restore_vs_orbax": ("<=", 1.0),
             "mismatches": ("<=", 0)}
    emit_summary(BENCH, summary, goals=goals)


if __name__ == "__main__":
    main()
