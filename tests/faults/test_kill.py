"""SIGKILL at random points of every phase of a save never loses a committed step.

A child process (tests/support/saver.py) saves deterministic steps to a RamTier, a
LocalTier and a GcsTier (the bundled fake-gcs-server), all with small `keep`
so that retention deletes at every save. Each trial kills one child with
SIGKILL, in one of these ways, in turn:

  time       the parent kills it (only its pid) any time after it opened its
             manager, up to several saves in;
  save_call  the parent kills it within a few ms of one of its save calls;
  snapshot, chunk, manifest, retention, upload
             the child kills itself at a random point of that phase: on a
             random call of the library function the phase runs (snapshot.take,
             a chunk put, the manifest's create-only put, tier_steps.delete_step, a
             GCS upload), before, during or after it (tests/support/saver.py says
             where exactly). This self-kill hook is the one simulated part: a
             kill from outside cannot be aimed at a phase that lasts a
             millisecond; the kill itself is a real SIGKILL.

After each kill the parent opens a fresh manager on the same directories and
bucket, and a fresh GCS-only manager, and checks that
  * a step is selected whenever one was ever reported committed, and it is no
    older than the newest reported one (for the GCS-only manager: the newest
    reported committed to GCS);
  * the oldest and newest viable steps, and restore() of the latest, are
    bit-exact equal to those steps' deterministic states, with no chunk
    falling back to another copy (a torn copy would);
  * the fresh manager's background cleanup (joined) removes the dead child's
    temporaries and in-progress markers, empties uncommitted step directories
    (on GCS: removes their objects, orphan age set near zero), and never
    removes a file of a step directory that holds a manifest.
One set of directories is reused across all trials, so later children start
on top of older steps and of whatever the previous kill left behind; every
other trial skips the parent's cleanup so the next child's own cleanup has to
deal with the leftovers while it saves.

Two sizes (options of tests/conftest.py): [smoke], in the default run, makes
exactly `--kill-trials` kills (default 14, two of each kind); [campaign],
marked slow, makes exactly `--kill-campaign-trials` kills, or by default at
least MIN_TRIALS and more while BUDGET_S lasts. The long run:

    python -m pytest -q -m slow tests/faults/test_kill.py \
        --kill-campaign-trials=500 --kill-report=PATH

`--kill-report=PATH` writes the per-kind outcomes as JSON there
(bench/reliability.py reads it); `--seed` changes every trial's choices.

The parent tells each child where to kill itself through RC_KILL_PHASE,
RC_KILL_COUNT, RC_KILL_POINT and RC_KILL_SEED in the child's environment
(tests/support/saver.py): a protocol between the two, not a setting.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import collections
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import jax
import numpy as np
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout
from resilient_ckpt.storage.gcs import GcsStorage
from resilient_ckpt.testing.fake_gcs import FakeGcs
from tests.support import saver as _saver  # the child's script: what each step holds, its hooks

SAVER = _saver.__file__  # run as a script: `python tests/support/saver.py ...`

KINDS = ("time", "save_call") + _saver.PHASES
# A campaign's size when --kill-campaign-trials is 0: MAX_TRIALS kills, fewer
# (never under MIN_TRIALS) when the machine is slow.
MAX_TRIALS, MIN_TRIALS = 100, 50
BUDGET_S = 100.0  # no trial starts after this, past MIN_TRIALS
HOOK_WAIT_S = 30.0  # a child whose hook never fired is killed from outside after this
CATEGORIES = ("torn", "wrong", "lost", "dirty")


@pytest.fixture
def where():
    ram = tempfile.mkdtemp(prefix="rc-kill-", dir="/dev/shm")
    local = tempfile.mkdtemp(prefix="rc-kill-")
    with FakeGcs() as gcs:
        bucket = "kill-" + uuid.uuid4().hex[:8]
        gcs.create_bucket(bucket)
        yield ram, local, f"gs://{bucket}/run", gcs.endpoint
    shutil.rmtree(ram, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)


def plan_trial(trial: int, seed: int = 0) -> dict:
    """What trial `trial` does: its kind and, for a phase, the child's hook."""
    rng = random.Random((20240229 * 1000 + trial) ^ (seed << 40))
    kind = KINDS[trial % len(KINDS)]
    spec = {"kind": kind, "rng": rng}
    if kind in _saver.PHASES:
        spec["env"] = {"RC_KILL_PHASE": kind,
                       "RC_KILL_COUNT": str(rng.randint(1, _saver.COUNTS[kind])),
                       "RC_KILL_POINT": rng.choice(_saver.POINTS[kind]),
                       "RC_KILL_SEED": str(rng.randrange(2**31))}
    return spec


class Child:
    """One _saver.py process, started early; its stdout is read by a thread."""

    def __init__(self, where: tuple, env: dict | None = None):
        self.err = tempfile.TemporaryFile("w+")
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
                   JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, SAVER, *where],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
            text=True, env=env)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.strip())
                self.cond.notify_all()
        with self.cond:
            self.lines.append("<eof>")
            self.cond.notify_all()

    def wait_for(self, prefix: str, timeout: float = 60, exact: bool = False) -> str:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                hit = [ln for ln in self.lines
                       if (ln == prefix if exact else ln.startswith(prefix))]
                if hit:
                    return hit[0]
                if "<eof>" in self.lines:
                    raise AssertionError(f"child exited before {prefix!r}: "
                                         f"{self._stderr()}")
                left = deadline - time.monotonic()
                assert left > 0, f"child did not print {prefix!r} in {timeout} s"
                self.cond.wait(left)

    def _stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()[-3000:]

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def hooked(self, timeout: float) -> str | None:
        """Waits for the child to kill itself; the point where its hook did it
        (None: it did not)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.reader.join(10)
        assert self.proc.returncode == -signal.SIGKILL, \
            f"child exited with {self.proc.returncode}: {self._stderr()}"
        return next((ln.split()[2] for ln in self.lines if ln.startswith("hook ")), None)

    def kill(self) -> dict[int, set[str]]:
        """SIGKILLs this child (only its pid) unless it is gone, reaps it, and
        returns the steps it reported committed, each with its tiers."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()  # reaped: a zombie would still look alive to cleaners
        self.reader.join(10)
        self.proc.stdin.close()
        self.err.close()
        out = {}
        for ln in self.lines:
            if ln.startswith("committed "):
                parts = ln.split()
                out[int(parts[1])] = set(parts[2].split(",")) if len(parts) > 2 else set()
        return out


# ---------------------------------------------------------------- what storage holds

def _leftovers(root: str) -> list[str]:
    """Temporaries and in-progress markers anywhere in a file tier."""
    out = []
    for dirpath, _, files in os.walk(root):
        for n in files:
            if layout.parse_tmp_name(n) or layout.parse_marker_name(n):
                out.append(os.path.join(dirpath, n))
    return out


def _step_dirs(root: str) -> dict[int, set[str]]:
    """Step -> names of its committed files (chunks and manifests), for the step
    directories that hold a manifest."""
    out = {}
    for name in os.listdir(root):
        if not name.isdigit():
            continue
        files = set(os.listdir(os.path.join(root, name)))
        if any(layout.parse_manifest_name(n) for n in files):
            out[int(name)] = {n for n in files
                              if not (layout.parse_tmp_name(n) or layout.parse_marker_name(n))}
    return out


def _gcs_dirs(st: GcsStorage) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """(committed, uncommitted): step -> object names, of the step prefixes
    that hold a manifest and of those that do not."""
    committed, uncommitted = {}, {}
    for name in st.list(""):
        if name.isdigit():
            names = set(st.object_ages(name) or ())
            has = any(layout.parse_manifest_name(n) for n in names)
            (committed if has else uncommitted)[int(name)] = names
    return committed, uncommitted


def _check_exact(restored: dict, step: int) -> None:
    want = _saver.make_state(step)
    assert restored["n"] == step
    for k in ("w", "v", "b"):
        got = np.asarray(restored[k])
        assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
        assert got.tobytes() == want[k].tobytes(), f"step {step}, leaf {k} differs"


def _abstract():
    sh = _saver.shardings()
    out = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sh[k])
           for k, (shape, dtype) in _saver.SHAPES.items()}
    out["n"] = 0
    return out


# ---------------------------------------------------------------- checks of one trial

class Findings:
    """Problems seen, per trial kind and category; the test fails on any."""

    def __init__(self):
        self.counts = {k: collections.Counter() for k in KINDS}
        self.problems: list[str] = []

    def add(self, kind: str, category: str, msg: str) -> None:
        self.counts[kind][category] += 1
        self.problems.append(f"[{kind}/{category}] {msg}")


def check_selection(mngr, newest: int | None, label: str, add) -> int:
    """Whether `mngr` selects a step no older than `newest` and restores its
    oldest, newest and latest steps exactly; returns how many it restored."""
    import orbax.checkpoint as ocp
    latest = mngr.latest_step()
    if newest is not None and (latest is None or latest < newest):
        add("lost", f"{label}: latest {latest}, newest committed {newest}")
    steps = mngr.all_steps()
    targets = [(s, True) for s in sorted({steps[0], steps[-1]} if steps else ())]
    targets += [(latest, False)] if latest is not None else []
    for step, explicit in targets:
        try:
            out = (mngr.restore(step, args=ocp.args.StandardRestore(_abstract()))
                   if explicit else mngr.restore())
        except Exception as e:  # noqa: BLE001 - a listed step that cannot be read is torn
            add("torn", f"{label}: step {step} is listed but its restore failed: {e!r}")
            continue
        if mngr.last_restore.fallbacks:
            add("torn", f"{label}: step {step} needed fallbacks "
                        f"{mngr.last_restore.fallbacks}")
        try:
            _check_exact(out, step)
        except AssertionError as e:
            add("wrong", f"{label}: {e}")
    return len(targets)


def check_cleanup(roots: tuple, before: dict, gcs_before: dict, direct: GcsStorage,
                  cleaned: bool, add) -> None:
    """Leftovers gone (when the checking manager cleaned), committed files kept."""
    if cleaned:
        for root in roots:
            if _leftovers(root):
                add("dirty", f"dead leftovers remain: {_leftovers(root)[:3]}")
            for name in os.listdir(root):  # uncommitted step dirs are emptied
                if name.isdigit() and int(name) not in before[root]:
                    left = os.listdir(os.path.join(root, name))
                    if left:
                        add("dirty", f"{root}/{name} keeps {left[:3]}")
        _, orphans = _gcs_dirs(direct)
        chunks = {s: [n for n in names if layout.is_chunk_name(n.split(".part", 1)[0])]
                  for s, names in orphans.items()}
        if any(chunks.values()):
            add("dirty", f"GCS orphans remain: {dict(list(chunks.items())[:2])}")
    for root in roots:  # cleanup never removes committed files
        after = _step_dirs(root)
        for step, files in before[root].items():
            if step not in after or not files <= after[step]:
                add("dirty", f"committed step {step} in {root} was altered")
    after, _ = _gcs_dirs(direct)
    for step, names in gcs_before.items():
        if step not in after or not names <= after[step]:
            add("dirty", f"committed step {step} on GCS was altered")


def check_trial(where: tuple, newest: int | None, newest_gcs: int | None,
                cleanup: bool, add) -> tuple[bool, int]:
    """Opens the checking managers after a kill and runs every check; returns
    whether the kill left temporaries or markers, and how many restores it checked."""
    ram, local, url, endpoint = where
    direct = GcsStorage(url, endpoint=endpoint)
    before = {root: _step_dirs(root) for root in (ram, local)}
    gcs_before, _ = _gcs_dirs(direct)
    had_leftovers = any(_leftovers(root) for root in (ram, local))
    mngr = rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=_saver.tiers(ram, local, url, endpoint, orphan_age_s=1e-6),
        cleanup_tmp_directories=cleanup))
    try:
        if cleanup:
            mngr._cleanup.join(60)
            assert not mngr._cleanup.is_alive(), "cleanup did not finish in 60 s"
        check_cleanup((ram, local), before, gcs_before, direct, cleanup, add)
        restored = check_selection(mngr, newest, "all tiers", add)
    finally:
        mngr.close()
    gcs_only = rc.CheckpointManager(url, options=rc.CheckpointManagerOptions(
        tiers=[rc.GcsTier(url, endpoint=endpoint)], read_only=True))
    try:
        restored += check_selection(gcs_only, newest_gcs, "GCS alone", add)
    finally:
        gcs_only.close()
        direct.close()
    return had_leftovers, restored


def kill_trial(child: Child, spec: dict) -> str | None:
    """Lets `child` save, then kills it as `spec` says; returns where the kill
    landed: the self-kill hook's point, or the parent's own kind (None: the
    hook never fired, and the parent kills the child after HOOK_WAIT_S)."""
    rng = spec["rng"]
    child.wait_for("imported")
    child.go()
    if spec["kind"] not in ("time", "save_call"):
        return child.hooked(HOOK_WAIT_S)
    first = int(child.wait_for("ready").split()[1]) + 1
    if spec["kind"] == "time":  # anywhere from opening the manager to several saves in
        time.sleep(rng.choice([0.0, 0.02, rng.uniform(0, 0.15), rng.uniform(0, 1.2)]))
        return "time"
    # save_call: within a few ms of a save call
    child.wait_for(f"saving {first + rng.randrange(4)}", exact=True)
    time.sleep(rng.uniform(0, 0.03))
    return "save_call"


def _newest(old: int | None, steps) -> int | None:
    return max([*steps, *([] if old is None else [old])], default=None)


def write_report(path: str, findings: Findings, stats: dict) -> None:
    kinds = {}
    for k in KINDS:
        s = stats[k]
        kinds[k] = {"trials": s["trials"], "kills_landed": s["fired"],
                    "left_leftovers": s["leftovers"], "restores_checked": s["restores"],
                    "points": dict(sorted(stats["_points"][k].items())),
                    **{c: findings.counts[k][c] for c in CATEGORIES}}
    with open(path, "w") as f:
        json.dump({"kinds": kinds, "trials": sum(stats[k]["trials"] for k in KINDS),
                   "elapsed_s": stats["_elapsed"], "problems": findings.problems[:50],
                   "newest_committed": stats["_newest"]}, f, indent=1)


def _size(config, size: str) -> tuple[int, int, float]:
    """(most kills, fewest kills, time budget) of the [smoke] or [campaign] run."""
    asked = config.getoption("kill_trials" if size == "smoke" else "kill_campaign_trials")
    if asked:
        return asked, asked, float("inf")
    return MAX_TRIALS, MIN_TRIALS, BUDGET_S


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [
    pytest.param("smoke", marks=pytest.mark.trials("kill_trials", 15)),
    pytest.param("campaign", marks=[pytest.mark.slow,
                                    pytest.mark.trials("kill_campaign_trials", 15)])])
def test_sigkill_at_random_points_of_every_phase_never_loses_a_committed_step(
        where, request, seed, size):
    trials, min_trials, budget_s = _size(request.config, size)
    report = request.config.getoption("kill_report")
    findings = Findings()
    stats: dict = {k: collections.Counter() for k in KINDS}
    stats["_points"] = {k: collections.Counter() for k in KINDS}  # where kills landed
    newest = newest_gcs = None
    cleaned = 0
    t0 = time.monotonic()
    # Children are started two trials ahead: they import jax while earlier
    # trials run and are checked, and only open the manager when told "go".
    specs = [plan_trial(i, seed) for i in range(min(2, trials))]
    ahead = collections.deque(Child(where, s.get("env")) for s in specs)
    child = ahead[0]
    trial = 0
    try:
        for trial in range(trials):
            child, spec = ahead.popleft(), specs[trial]
            last = trial == trials - 1 or (trial + 1 >= min_trials
                                           and time.monotonic() - t0 > budget_s)
            if trial + len(ahead) + 1 < trials and not last:
                specs.append(plan_trial(len(specs), seed))
                ahead.append(Child(where, specs[-1].get("env")))
            kind = spec["kind"]
            fired = kill_trial(child, spec)
            committed = child.kill()
            newest = _newest(newest, committed)
            newest_gcs = _newest(newest_gcs, [s for s, t in committed.items() if "gcs" in t])
            cleanup = trial % 2 == 0 or last

            def add(category, msg, kind=kind, trial=trial):
                findings.add(kind, category, f"trial {trial}: {msg}")
            had_leftovers, restored = check_trial(where, newest, newest_gcs, cleanup, add)
            cleaned += had_leftovers and cleanup
            s = stats[kind]
            s["trials"] += 1
            s["fired"] += fired is not None
            stats["_points"][kind][fired or "not reached"] += 1
            s["leftovers"] += had_leftovers
            s["restores"] += restored
            if last:
                break
    finally:  # a failed trial leaves no child running (each killed by its own pid)
        for c in list(ahead) + [child]:
            if c.proc.poll() is None:
                c.kill()
        stats["_elapsed"], stats["_newest"] = round(time.monotonic() - t0, 1), newest
        if report:  # also when a trial failed outright
            write_report(report, findings, stats)
    print(f"{trial + 1} kills in {stats['_elapsed']} s; newest committed step {newest} "
          f"(on GCS {newest_gcs}); per kind: "
          + "; ".join(f"{k} {stats[k]['trials']} ({stats[k]['fired']} landed, "
                      f"{stats[k]['leftovers']} left leftovers)" for k in KINDS))
    assert not findings.problems, "\n".join(findings.problems[:20])
    assert newest is not None and newest >= min(10, trial // 2)
    assert newest_gcs is not None
    assert cleaned > 0, "no kill landed inside a write; tune the delays"
    for k in _saver.PHASES:
        assert stats[k]["fired"] > 0, f"no {k} hook fired in {stats[k]['trials']} trials"
