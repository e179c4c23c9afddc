"""The two-host demo: `python -m resilient_ckpt.demo --hosts 2 [--mb 16] [--steps 40]`.

This module owns the relaunch demo only; it uses the public API as a user
would. The parent runs `elastic.supervisor.Supervisor` over two processes of
one jax.distributed job on 127.0.0.1 (4 CPU devices each, one (data=4,
model=2) mesh over all 8), each a simulated host with its own RAM tier
under /dev/shm (every --ram-every steps, keep 2) and both sharing a local
tier (every --local-every). They train the crash demo's MLP (`model`: its
parameters replicated over the data axis, so each host's RAM holds a whole
copy). After step --kill-at the parent SIGKILLs process 1 and removes its
RAM tier, as a lost host loses its /dev/shm; the supervisor ends process 0,
starts a fresh pair, and each restores the newest step (process 0 from its
own RAM, process 1 from its peer's replica, device to device) and trains on
to --steps. The parent prints the relaunch timeline and the loss: the steps
replayed after the restore reproduce the losses logged before the kill.
Workers are this same command with `--hosts-worker`; their logs are in
<dir>/logs.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from ..elastic import jobenv
from ..elastic.supervisor import Supervisor, format_relaunches
from .options import add_run_args, parser

BATCH = 64
DEVICES_PER_HOST = 4


# ------------------------------------------------------------------ a worker (one host)

def worker(a) -> int:
    job = jobenv.initialize(initialization_timeout=60, heartbeat_timeout_seconds=20,
                            shutdown_timeout_seconds=30)
    import jax
    import orbax.checkpoint as ocp

    from ..manager import CheckpointManager, CheckpointManagerOptions
    from ..tiers import LocalTier, RamTier
    from .model import demo_mesh, model_on

    mesh = demo_mesh()
    shardings, init_fn, train_step = model_on(mesh, a.mb, BATCH)
    ram = os.path.join(a.ram, f"ram{jax.process_index()}")
    mngr = CheckpointManager(a.dir, options=CheckpointManagerOptions(tiers=[
        RamTier(path=ram, every=a.ram_every, keep=2),
        LocalTier(path=a.dir, every=a.local_every, keep=2)]))
    start = mngr.latest_step()
    if start is None:
        state, start = init_fn(), 0
    else:
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                jax.eval_shape(init_fn), shardings)
        state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
        rec = mngr.last_restore
        assert rec is not None  # set by the restore above
        jobenv.report(job, "restored", start,
                      bytes_by_tier={k: int(v) for k, v in rec.bytes_by_tier.items()})
    for step in range(start + 1, a.steps + 1):
        state, loss = train_step(state)
        mngr.save(step, args=ocp.args.StandardSave(state))
        jobenv.report(job, "step", step, loss=float(loss))
        time.sleep(a.step_sleep)
    mngr.wait_until_finished()
    mngr.close()
    return 0


# ------------------------------------------------------------------ the parent

def report(a, sup: Supervisor, killed_after: int) -> bool:
    """Prints the timeline and the loss; returns whether the run checks out."""
    print("\nrelaunch timeline (ms after the failure was detected):")
    print(format_relaunches(sup.timeline))
    runs = sup.reports()
    losses = [{r["step"]: r["loss"] for r in rs[0] if r["event"] == "step"} for rs in runs]
    rec = sup.timeline[0] if sup.timeline else None
    if rec is None or rec.restored_step is None or len(losses) < 2:
        return False
    before, after = losses[0], losses[-1]
    replayed = sorted(set(before) & set(after))
    same = all(abs(before[s] - after[s]) <= 1e-5 * max(1.0, abs(before[s])) for s in replayed)
    last = max(after)
    rows = [("job", f"2 processes x {DEVICES_PER_HOST} CPU devices, mesh (data=4, model=2), "
                    f"{a.mb:g} MiB of state, {a.steps} steps"),
            ("killed", f"process 1 (SIGKILL) after step {killed_after}; its RAM tier removed"),
            ("restored", f"step {rec.restored_step}, newest reported {rec.last_step}: "
                         f"{rec.steps_lost} step(s) lost (RAM interval {a.ram_every})"),
            ("detected to first step", f"{(rec.since(rec.first_step_t) or 0) * 1e3:.0f} ms"),
            ("loss", f"{before[1]:.4f} (step 1) -> {before[max(before)]:.4f} (step "
                     f"{max(before)}) | relaunch | {after[min(after)]:.4f} (step {min(after)}) "
                     f"-> {after[last]:.4f} (step {last})"),
            ("replayed steps", f"{len(replayed)}, losses "
                               f"{'identical to before the kill' if same else 'DIFFER'}")]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    lost_ok = rec.steps_lost is not None and rec.steps_lost <= a.ram_every
    return same and lost_ok and last == a.steps and after[last] < before[1]


def parent(a) -> int:
    own = a.dir is None
    a.dir = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="resilient_ckpt_hosts_"))
    ram = tempfile.mkdtemp(prefix="resilient_ckpt_hosts_",
                           dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    argv = [sys.executable, "-m", "resilient_ckpt.demo", "--hosts-worker", "--dir", a.dir,
            "--ram", ram, "--mb", str(a.mb), "--steps", str(a.steps),
            "--ram-every", str(a.ram_every), "--local-every", str(a.local_every),
            "--step-sleep", str(a.step_sleep)]
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}",
           "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}

    def lose_host(rec) -> None:
        for i in rec.failed:
            shutil.rmtree(os.path.join(ram, f"ram{i}"), ignore_errors=True)
        print(f"  supervisor: process 1 lost; RAM tier of host 1 removed; relaunching "
              f"both ({len(rec.failed)} failed, {len(rec.forced)} ended by SIGKILL)", flush=True)

    logs = os.path.join(a.dir, "logs")
    sup = Supervisor(argv, 2, max_restarts=1, grace_s=1.0, env=env, log_dir=logs,
                     before_relaunch=lose_host, deadline_s=600)
    print(f"supervisor: 2 processes, logs in {logs}", flush=True)
    try:
        sup.start()
        ok = sup.wait_for_step(a.kill_at, process=1, timeout=300)
        if ok:
            newest = max(r["step"] for r in sup.reports()[0][1] if r["event"] == "step")
            sup.kill(1)
            print(f"  SIGKILL to process 1 (pid {sup.pids()[1]}) after step {newest}",
                  flush=True)
        rc = sup.wait()
        if ok and rc == 0 and report(a, sup, newest):
            return 0
        print(f"the two-host run does not check out (exit {rc}); logs in {logs}",
              file=sys.stderr)
        own = False  # keep the logs
        return 1
    finally:
        shutil.rmtree(ram, ignore_errors=True)
        if own:
            shutil.rmtree(a.dir, ignore_errors=True)


def main(argv: list[str]) -> int:
    """The two-host demo (`--hosts 2` and its options), or one of its workers."""
    p = parser("python -m resilient_ckpt.demo --hosts 2", __doc__)
    add_run_args(p, mb=16, steps=40)
    p.add_argument("--kill-at", type=int, default=17,
                   help="SIGKILL process 1 once it reports this step (default 17)")
    p.add_argument("--ram-every", type=int, default=2, help="RAM tier interval (default 2)")
    p.add_argument("--local-every", type=int, default=10,
                   help="local tier interval (default 10)")
    p.add_argument("--step-sleep", type=float, default=0.05,
                   help="seconds between steps, so the kill lands mid-run (default 0.05)")
    p.add_argument("--hosts", type=int, choices=[2], default=2, help="simulated hosts (2)")
    p.add_argument("--hosts-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ram", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.hosts_worker:
        return worker(a)
    if not 1 <= a.kill_at < a.steps - 2:
        p.error("need 1 <= --kill-at < --steps - 2")
    return parent(a)

