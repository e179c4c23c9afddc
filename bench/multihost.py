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
check), above its level before (harness.measure.PeakRss); peak_extra_vs_state is over
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

from harness.options import bench_parser, parse_options, prepare, size_label

prepare()

from harness.multiprocess import DEVICES, NPROCS, job, record  # noqa: E402
from harness.report import emit, emit_summary, peaks_vs_budget, worst_peak  # noqa: E402

BENCH = "multihost"
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


def log(msg: str) -> None:
    sys.stderr.write(f"multihost: {msg}\n")
    sys.stderr.flush()


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
