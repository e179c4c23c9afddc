"""Multi-host save and restore: 2 processes x 4 CPU devices forming one JAX job.

Each process is a simulated host (resilient_ckpt/testing/multiprocess.py starts the job: local
processes joined by jax.distributed on 127.0.0.1). The mesh is (replica=2,
data=2, model=2), one replica per process, so that Orbax's emergency manager,
which needs data-parallel replicas, runs on the very same state: leaves
sharded P("data", "model"), P(None, "model") and P("data", None) inside a
replica, replicated across the two hosts; a scalar step and a typed PRNG key.
Every restore runs in a fresh job and is checked bit for bit.

Systems, interleaved within each repeat (a fresh directory set each):

- resilient_ckpt: a RamTier per host (/dev/shm/.../ram<pid>, every step, keep 2)
  and a shared LocalTier (every 3rd step, keep 2);
- orbax: orbax.checkpoint.CheckpointManager on the shared directory (every
  step, keep 2);
- orbax_emergency: Orbax's emergency CheckpointManager, a local directory per
  host under /dev/shm (every step, keep 2) and the shared directory as the
  persistent one (every 3rd step, keep 2).

Cases (times are the slowest process's, after a barrier):

- save_blocking: steps 1-4 are saved, each followed by wait_until_finished
  (not timed); a run is the mean time save() blocked over steps 2-4;
- restore_latest: a fresh job restores the newest step (ours: step 4 is on the
  RAM tiers only; emergency: its local copy, broadcast to the other replica;
  orbax: the shared directory, warm page cache);
- restore_lost_host (ours, emergency): in the same fresh job, host 1 then
  loses its host-local directory (RAM tier / emergency local directory), a new
  manager is opened and the newest viable step restored again. For ours the
  line gives the bytes read from the shared local tier and host 1's share (the
  bytes of its own addressable shards: what it must get from somewhere);
- restore_onto4 (ours, orbax): a fresh job of 2 processes x 2 devices restores
  the newest step onto a (data=2, model=2) mesh, each process half of the
  data axis. Ours gives the bytes each process read (every tier and its
  peers) over its share of the new target.

Each line's peak_extra_bytes is the worst of every process's peak resident
memory over each save (with its writes) or restore (to the restored state's
check), above its level before (_common.PeakRss); peak_extra_vs_state is over
the bytes one process holds (one replica: the whole state here).

Summary (a key ends in the size, e.g. _64mb):

- restore_ram_speedup_vs_orbax_emergency: emergency's restore_latest time over
  ours (> 1: we are faster); goal >= 4;
- save_blocking_vs_orbax: ours over Orbax's (< 1: we block less); goal <= 1;
- lost_host_shared_bytes_vs_lost_share: bytes ours read from the shared tier
  after host 1 lost its RAM tier, over host 1's share; 1 is "host 1 read its
  share from the shared tier", 0 "its share came from host 0's RAM, moved
  device to device" (the state is replicated across the hosts here, so the
  goal is 0; without replicas it would be <= 1.05);
- lost_host_peer_bytes_vs_lost_share: the bytes host 1 got from its peer, over
  its share (1: all of it);
- onto4_read_bytes_vs_share: the most any process read in restore_onto4 over
  its share of the new target (the median over the repeats); goal <= 1.05
  (once 1.65: a process read the chunks its peers needed too);
- restore_onto4_speedup_vs_orbax: Orbax's restore_onto4 time over ours;
- peak_save_vs_budget, peak_restore_vs_budget (orbax_ for Orbax's manager):
  the worst peak over a process's share + 256 MiB; goal <= 1;
  peak_restore_vs_budget_onto4_<size> (orbax_ too) the same in restore_onto4,
  over a process's share of its target.

Where a system fails, its line carries "error" and the remaining runs go on.

Output (docs/bench_contract.md): JSON lines on stdout, the summary last; logs on stderr.

    python bench/multihost.py             # 1 GB state, 3 repeats
    python bench/multihost.py --quick     # 64 MB, 2 repeats
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile

from _common import (
    bench_parser,
    emit,
    emit_summary,
    parse_options,
    peaks_vs_budget,
    size_label,
    worst_peak,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from resilient_ckpt.testing.multiprocess import describe, run_job  # noqa: E402

BENCH = "multihost"
NPROCS, DEVICES = 2, 4
MESH = "2,2,2"
ONTO4, ONTO4_DEVICES, ONTO4_MESH = "restore_onto4", 2, "2,2"  # (data, model), 2 per process
SYSTEMS = ("resilient_ckpt", "orbax", "orbax_emergency")
GOALS = {
    "restore_ram_speedup_vs_orbax_emergency": (">=", 4.0),
    "save_blocking_vs_orbax": ("<=", 1.0),
    "lost_host_shared_bytes_vs_lost_share": ("<=", 0.0),
    "onto4_read_bytes_vs_share": ("<=", 1.05),
    "peak_save_vs_budget": ("<=", 1.0),
    "peak_restore_vs_budget": ("<=", 1.0),
}

WORKER = r'''
import argparse, collections, os, shutil, sys, time
import mh
ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--system", required=True)
p.add_argument("--phase", required=True, choices=["save", "restore"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--lose", action="store_true")
p.add_argument("--bench", required=True)  # bench/, for _common.PeakRss
o = p.parse_args(ctx.extra)
sys.path.insert(0, o.bench)
from _common import PeakRss


def manager(abstract):
    if o.system == "resilient_ckpt":
        return mh.ours(ctx, ram_every=1, ram_keep=2, local_every=3, local_keep=2)
    if o.system == "orbax":
        return mh.orbax(ctx, every=1, keep=2)
    return mh.orbax_emergency(ctx, ctx.ram, ctx.dir, abstract, local_every=1, local_keep=2,
                              persistent_every=3, persistent_keep=2)


def save_args(state):
    import orbax.checkpoint as ocp
    if o.system == "resilient_ckpt":
        return ocp.args.StandardSave(state)
    if o.system == "orbax":
        return ocp.args.StandardSave(mh.orbax_state(state))
    return ocp.args.Composite(state=ocp.args.PyTreeSave(mh.orbax_state(state)))


def restore(mngr, abstract):
    import orbax.checkpoint as ocp
    out = {"latest": mngr.latest_step()}
    mh.barrier("restore-start")
    peak = PeakRss().__enter__()  # to the restored state's check: it is alive then
    t = time.perf_counter()
    if o.system == "resilient_ckpt":
        state = mngr.restore(None, args=ocp.args.StandardRestore(abstract))
        rec = mngr.last_restore
        out["step"] = rec.step
        out["bytes_by_tier"] = {k: int(v) for k, v in rec.bytes_by_tier.items()}
    elif o.system == "orbax":
        state = mh.from_orbax(mngr.restore(
            out["latest"], args=ocp.args.StandardRestore(mh.orbax_abstract(abstract))))
        out["step"] = out["latest"]
    else:
        state = mh.from_orbax(mngr.restore(out["latest"]).state)
        out["step"] = out["latest"]
    import jax
    jax.block_until_ready(state)
    out["seconds"] = time.perf_counter() - t
    peak.__exit__(None, None, None)
    out["peak_extra_bytes"] = peak.extra
    out["mismatches"] = len(ctx.check_exact(state, out["step"]))
    del state
    return out


def run(ctx):
    import jax
    abstract = ctx.abstract()
    out = {"pid": ctx.pid, "target_bytes": ctx.target_bytes(abstract)}
    if o.phase == "save":
        mngr = manager(abstract)
        state = ctx.initial_state()
        times, peaks = [], []
        for k in range(1, o.steps + 1):
            state = jax.block_until_ready(ctx.train_step(state, k))
            mh.barrier(f"save-{k}")
            with PeakRss() as peak:  # the save and its writes, the state alive before
                t = time.perf_counter()
                mngr.save(k, args=save_args(state))
                times.append(time.perf_counter() - t)
                mngr.wait_until_finished()
            peaks.append(peak.extra)
        mh.barrier("saved")
        out["save_s"], out["save_peak_extra_bytes"] = times, peaks
        mngr.close()
        mh.report(out)
        return
    mngr = manager(abstract)
    out["restore"] = restore(mngr, abstract)
    if o.lose:
        mngr.close()
        mh.barrier("lose")
        if ctx.pid == 1:  # host 1 lost what it held locally
            shutil.rmtree(ctx.ram, ignore_errors=True)
            if o.system == "orbax_emergency":
                os.makedirs(ctx.ram)  # its manager wants the directory to exist
        mh.barrier("lost")
        mngr = manager(abstract)
        out["lost"] = restore(mngr, abstract)
    mngr.close()
    mh.report(out)


mh.main(run, ctx)
'''


def log(msg: str) -> None:
    sys.stderr.write(f"multihost: {msg}\n")
    sys.stderr.flush()


def job(workdir: str, shm: str, system: str, phase: str, nbytes: int, lose: bool = False,
        devices: int = DEVICES, mesh: str = MESH):
    """One 2-process job; returns (reports per process, error or None)."""
    args = ["--dir", os.path.join(workdir, "shared"), "--ram", os.path.join(shm, "ram{pid}"),
            "--mesh", mesh, "--state-bytes", str(nbytes), "--system", system,
            "--phase", phase, "--bench", os.path.dirname(os.path.abspath(__file__))
            ] + (["--lose"] if lose else [])
    timeout = 120 + nbytes / 5e6  # a generous bound: 1 GB gets 5+ minutes
    try:
        res = run_job(WORKER, NPROCS, devices, args, timeout_s=timeout, fail_fast_s=15)
    except AssertionError as e:  # the harness's hard timeout
        return None, f"timeout: {str(e)[:1500]}"
    reports = [r.last("pid") for r in res]
    errors = [r.last("error") for r in res if r.last("error")]
    if errors:
        return reports, errors[0]["error"][-1500:]
    if not all(r.ok for r in res) or not all(reports):
        return reports, describe(res, 1200)[-2500:]
    return reports, None


def restore_run(system: str, reports: list, key: str) -> tuple[dict, float, list]:
    """One restore of a job's processes (`key` in their reports): its record
    (the steps, whether they agree and every value is exact; for ours the bytes
    by tier, from the shared tier and from peers, host 1's share, and the most a
    process read over its share), the slowest process's seconds and every
    process's peak."""
    rs = [r[key] for r in reports]
    steps = [r["step"] for r in rs]
    info = {"steps": steps, "agree": len(set(steps)) == 1,
            "exact": all(r["mismatches"] == 0 for r in rs)}
    if system == "resilient_ckpt":
        tiers = [r.get("bytes_by_tier", {}) for r in rs]
        info["bytes_by_tier"] = tiers
        info["shared_bytes"] = sum(t.get("local", 0) for t in tiers)
        info["peer_bytes"] = sum(t.get("peers", 0) for t in tiers)
        info["lost_share"] = reports[1]["target_bytes"]
        info["read_vs_share"] = round(max(
            sum(t.values()) / p["target_bytes"]
            for t, p in zip(tiers, reports, strict=True) if p["target_bytes"]), 4)
    return info, max(r["seconds"] for r in rs), [r["peak_extra_bytes"] for r in rs]


def record(sink: tuple, system: str, case: str, reports: list, key: str) -> bool:
    """Adds one restore run of `case` to `sink` (runs, extra, errors, peaks,
    each by (system, case)); whether it was right."""
    runs, extra, errors, peaks = sink
    info, seconds, run_peaks = restore_run(system, reports, key)
    extra[(system, case)].append(info)
    if not (info["agree"] and info["exact"]):
        errors[(system, case)].append(
            f"processes restored steps {info['steps']}, exact: {info['exact']}")
        return False
    runs[(system, case)].append(seconds)
    peaks[(system, case)] += run_peaks
    return True


def _median(xs):
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    ap = bench_parser(__doc__, sizes="1GB", quick_sizes="64MB", repeats=3, quick_repeats=2)
    a = parse_options(ap, argv)
    summary: dict = {}
    for nbytes in a.sizes:
        label = size_label(nbytes)
        runs = {(s, c): [] for s in SYSTEMS
                for c in ("save_blocking", "restore_latest", "restore_lost_host", ONTO4)}
        extra = {k: [] for k in runs}
        errors = {k: [] for k in runs}
        peaks = {k: [] for k in runs}  # every process's, every run's
        share = 0  # the bytes a process holds (its addressable shards)
        onto4_share = 0  # the same on the onto4 target

        sink = (runs, extra, errors, peaks)
        for rep in range(a.repeats):
            for system in SYSTEMS:
                workdir = tempfile.mkdtemp(prefix=f"rc-bench-mh-{system}-")
                shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                                       prefix="rc-bench-mh-")
                os.makedirs(os.path.join(workdir, "shared"))
                try:
                    log(f"{label} repeat {rep + 1}/{a.repeats}: {system} save")
                    reports, err = job(workdir, shm, system, "save", nbytes)
                    if err:
                        errors[(system, "save_blocking")].append(err)
                        for c in ("restore_latest", "restore_lost_host"):
                            errors[(system, c)].append("no checkpoint: the save job failed")
                        continue
                    share = max(r["target_bytes"] for r in reports)
                    peaks[(system, "save_blocking")] += [
                        x for r in reports for x in r["save_peak_extra_bytes"]]
                    blocked = [statistics.mean(r["save_s"][1:]) for r in reports]
                    runs[(system, "save_blocking")].append(max(blocked))
                    extra[(system, "save_blocking")].append(
                        {"per_save_s": [round(max(x), 4) for x in
                                        zip(*(r["save_s"] for r in reports), strict=True)]})
                    if system != "orbax_emergency":  # it restores onto its own mesh only
                        log(f"{label} repeat {rep + 1}/{a.repeats}: {system} {ONTO4}")
                        reports, err = job(workdir, shm, system, "restore", nbytes,
                                           devices=ONTO4_DEVICES, mesh=ONTO4_MESH)
                        if err:
                            errors[(system, ONTO4)].append(err)
                        elif record(sink, system, ONTO4, reports, "restore"):
                            onto4_share = max(r["target_bytes"] for r in reports)
                    lose = system != "orbax"
                    log(f"{label} repeat {rep + 1}/{a.repeats}: {system} restore")
                    reports, err = job(workdir, shm, system, "restore", nbytes, lose=lose)
                    if err:
                        errors[(system, "restore_latest")].append(err)
                        if lose:
                            errors[(system, "restore_lost_host")].append(err)
                        continue
                    for case, key in (("restore_latest", "restore"),
                                      ("restore_lost_host", "lost")):
                        if key in reports[0]:
                            record(sink, system, case, reports, key)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                    shutil.rmtree(shm, ignore_errors=True)
        medians, worst, worst4 = {}, {}, {}  # worst4: the onto4 cases'
        for (system, case), xs in runs.items():
            if (system, case) in (("orbax", "restore_lost_host"), ("orbax_emergency", ONTO4)):
                continue  # nothing host-local to lose; no other mesh
            onto4 = case == ONTO4
            line = {"bench": BENCH, "system": system, "case": case, "bytes": nbytes,
                    "size": label, "processes": NPROCS,
                    "devices": NPROCS * (ONTO4_DEVICES if onto4 else DEVICES),
                    "mesh": "data=2,model=2" if onto4 else "replica=2,data=2,model=2",
                    "runs_s": [round(x, 4) for x in xs], "median_s": _median(xs)}
            held = onto4_share if onto4 else share
            if peaks[(system, case)] and held:
                line.update(worst_peak(peaks[(system, case)], held))
                if line["peak_extra_bytes"] is not None:
                    (worst4 if onto4 else worst)[(system, case)] = line["peak_extra_bytes"]
            if extra[(system, case)]:
                line["runs"] = extra[(system, case)]
            if errors[(system, case)]:
                line["error"] = errors[(system, case)][0]
                line["errors"] = len(errors[(system, case)])
            medians[(system, case)] = line["median_s"]
            emit(line)
        ours_r = medians.get(("resilient_ckpt", "restore_latest"))
        em_r = medians.get(("orbax_emergency", "restore_latest"))
        summary[f"restore_ram_speedup_vs_orbax_emergency_{label}"] = (
            round(em_r / ours_r, 3) if ours_r and em_r else None)
        ours_s = medians.get(("resilient_ckpt", "save_blocking"))
        ob_s = medians.get(("orbax", "save_blocking"))
        summary[f"save_blocking_vs_orbax_{label}"] = (
            round(ours_s / ob_s, 3) if ours_s and ob_s else None)
        lost = [i for i in extra[("resilient_ckpt", "restore_lost_host")]
                if i["agree"] and i["exact"]]
        ratios = [i["shared_bytes"] / i["lost_share"] for i in lost if i["lost_share"]]
        summary[f"lost_host_shared_bytes_vs_lost_share_{label}"] = (
            round(statistics.median(ratios), 4) if ratios else None)
        peers = [i["peer_bytes"] / i["lost_share"] for i in lost if i["lost_share"]]
        summary[f"lost_host_peer_bytes_vs_lost_share_{label}"] = (
            round(statistics.median(peers), 4) if peers else None)
        reads = [i["read_vs_share"] for i in extra[("resilient_ckpt", ONTO4)]
                 if i["agree"] and i["exact"]]
        summary[f"onto4_read_bytes_vs_share_{label}"] = (
            round(statistics.median(reads), 4) if reads else None)
        ours_o, ob_o = medians.get(("resilient_ckpt", ONTO4)), medians.get(("orbax", ONTO4))
        summary[f"restore_onto4_speedup_vs_orbax_{label}"] = (
            round(ob_o / ours_o, 3) if ours_o and ob_o else None)
        summary.update(peaks_vs_budget(worst, share, label))
        summary.update(peaks_vs_budget(worst4, onto4_share, f"onto4_{label}"))
    emit_summary(BENCH, summary, GOALS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
