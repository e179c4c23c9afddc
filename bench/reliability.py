"""Reliability: the project's fault campaigns in one run, and docs/reliability.md.

(a) The SIGKILL campaign: test_kill.py (found under tests/) run by pytest with
    `-m slow --kill-campaign-trials=N` (kills at random times and at random
    points of every phase: snapshot, chunk write, manifest commit, retention,
    GCS upload) and `--kill-report=PATH`, whose per-kind outcomes it reads back.
(b) The GCS fault matrix: fake-gcs-server behind the project's FaultProxy
    (429/503, connection resets before and after the server acted, truncated
    bodies) at 0% (each system's no-fault time), 5%, 20% and 50% of requests.
    Three configurations save `--repeats` steps each per rate, one after
    another within each rate (interleaved), each in its own worker process:
    resilient_ckpt with a GcsTier alone ("gcs") and with RamTier + GcsTier
    ("ram+gcs"), and orbax.checkpoint.CheckpointManager on gs:// ("orbax").
    Per save: committed, failed cleanly (raised once, naming its step), or
    hung (no answer in `--hang-s`; the worker is killed, by its pid, and
    restarted); save() blocking time on the training thread; the time to
    commit over that configuration's own median no-fault time (goal: within
    3x, or a clean failure). Then a fresh manager reading through the same
    faults restores every step it lists, compared bit for bit.
(c) The other fault test files (hostile manifests and file systems, disk
    full, the state machine, two writers, failure reporting, the GCS faults),
    each by pytest (JUnit XML counts); a file not written yet is noted.
Finally it writes docs/reliability.md (a full run; with --quick only when
--doc is given): one table row per trial kind, Orbax beside ours where the
same trial runs on it, with the command, the date and the load average.

    python bench/reliability.py                 # 500 kills, 5 saves per rate (~45 min)
    python bench/reliability.py --quick --doc docs/reliability.md   # 30 kills, 2 saves
"""
from __future__ import annotations

import faulthandler
import glob
import json
import logging
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET

from harness.options import ROOT, bench_parser, parse_options, prepare, size_label

prepare(devices=8)

from harness.report import emit, emit_summary  # noqa: E402
from harness.state import abstract_of, build_state, make_mesh, same_values  # noqa: E402
from harness.systems import Orbax, Ours  # noqa: E402

log = logging.getLogger("bench.reliability")
BENCH = "reliability"
RATES = (0.0, 0.05, 0.2, 0.5)
CONFIGS = ("gcs", "ram+gcs", "orbax")
FAULT_FILES = ("test_hostile_manifests.py", "test_hostile_fs.py", "test_disk_full.py",
               "test_state_machine.py", "test_two_writers.py", "test_failure_reporting.py",
               "test_gcs_fault_matrix.py", "test_gcs_faults.py")
KILL_KINDS = {
    "time": "SIGKILL from the parent at a random time (0 to 1.2 s after open)",
    "save_call": "SIGKILL from the parent within 30 ms of a save call",
    "snapshot": "self-SIGKILL in snapshot.take (before, during, after)",
    "chunk": "self-SIGKILL at a chunk put to RAM or disk (before, temporary written, "
             "during, after)",
    "manifest": "self-SIGKILL at the manifest's create-only put (before, temporary "
                "written, during, after)",
    "retention": "self-SIGKILL in retention's delete_step (before, manifests gone, "
                 "during, after)",
    "upload": "self-SIGKILL at a GCS chunk or manifest upload (before, during, after)",
}


# ---------------------------------------------------------------- the worker process

def state_for(step: int, nbytes: int, mesh):
    """8 float32 leaves of about nbytes/8, sharded over (data, model); a
    function of the step only, so a restore is compared with a rebuilt state."""
    return build_state("rows", nbytes, mesh, leaves=8, std=1.0, seed=(step,), prefix="w{}")


def open_manager(config: str, url: str, endpoint: str, ram: str, reader: bool = False):
    """The manager of `config` (gcs, ram+gcs or orbax) at `url`: an Ours or an Orbax."""
    import resilient_ckpt as rc
    if config == "orbax":
        return Orbax(url) if reader else Orbax(url, max_to_keep=None)
    retry = rc.RetryPolicy(deadline_s=60, attempt_timeout_s=20, initial_s=0.05, max_delay_s=2)
    gcs = rc.GcsTier(url, endpoint=endpoint, keep=100, retry=retry)
    tiers = [rc.RamTier(path=ram, keep=100), gcs] if config == "ram+gcs" and not reader \
        else [gcs]
    return Ours(url, tiers, read_only=reader)


def worker_round(config: str, url: str, endpoint: str, steps: int, nbytes: int, mesh) -> None:
    """Saves `steps` steps to `url`, then restores what a fresh manager lists;
    one JSON line per save and per restore on stdout, then {"done": true}."""
    import jax
    import orbax.checkpoint as ocp
    ram = tempfile.mkdtemp(prefix="rc-rel-", dir="/dev/shm")
    m = open_manager(config, url, endpoint, ram).mngr
    for step in range(steps):
        state = state_for(step, nbytes, mesh)
        out = {"event": "save", "step": step, "ok": True, "error": None}
        t0 = time.perf_counter()
        try:
            started = m.save(step, args=ocp.args.StandardSave(state))
            out["blocking_s"] = time.perf_counter() - t0
            if not started:
                raise RuntimeError(f"save of step {step} did not start")
            m.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - a failed save is a result here
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}",
                       names_step=f"step {step}" in str(e) or f"{url}/{step}" in str(e))
            try:
                m.check_for_errors()
                out["raised_again"] = False
            except Exception:  # noqa: BLE001
                out["raised_again"] = True
        out["total_s"] = time.perf_counter() - t0
        if config != "orbax" and out["ok"]:
            out["ok"] = bool(m.save_records[-1].tiers["gcs"].ok)
        print(json.dumps(out), flush=True)
    m.close()
    reader = open_manager(config, url, endpoint, ram, reader=True).mngr
    listed = list(reader.all_steps())
    print(json.dumps({"event": "listed", "steps": listed}), flush=True)
    for step in listed:
        want = state_for(step, nbytes, mesh)
        try:
            got = reader.restore(step, args=ocp.args.StandardRestore(abstract_of(want)))
            exact = same_values(jax.block_until_ready(got), want)
            print(json.dumps({"event": "restore", "step": step, "exact": exact}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"event": "restore", "step": step, "exact": False,
                              "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
    reader.close()
    print(json.dumps({"done": True}), flush=True)


def worker(config: str, endpoint: str, nbytes: int) -> int:
    """Reads 'URL STEPS' lines on stdin, runs a round for each."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    for name in ("absl", "jax", "orbax", "resilient_ckpt"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    mesh = make_mesh(4, 2)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        url, steps = line.split()
        worker_round(config, url, endpoint, int(steps), nbytes, mesh)
    return 0


# ---------------------------------------------------------------- (b) the GCS matrix

class Worker:
    """One worker process, driven line by line, with a hang timeout per line."""

    def __init__(self, config: str, endpoint: str, nbytes: int, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", config, endpoint,
             str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, **env), bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for text in self.proc.stdout:
            if text.strip():
                self.lines.put(json.loads(text))
        self.lines.put(None)  # it exited

    def line(self, timeout: float) -> dict | None:
        """The next JSON line, or None when none came in `timeout` s (or it died)."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def kill(self, stacks: bool = False) -> None:
        """Kills the worker (its pid only); `stacks`: first has it print its
        threads' stacks to stderr (faulthandler on SIGUSR1), to see a hang."""
        if stacks and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(2)
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def run_round(w: Worker, url: str, steps: int, hang_s: float) -> tuple[list, list, bool]:
    """(saves, restores, hung) of one round; hung: the worker gave no line in time."""
    w.proc.stdin.write(f"{url} {steps}\n")
    w.proc.stdin.flush()
    saves, restores = [], []
    while True:
        out = w.line(hang_s)
        if out is None:
            if w.proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {w.proc.returncode}; see stderr")
            return saves, restores, True
        if out.get("done"):
            return saves, restores, False
        if out["event"] == "save":
            saves.append(out)
        elif out["event"] == "restore":
            restores.append(out)


def gcs_matrix(steps: int, nbytes: int, hang_s: float) -> dict:
    """Runs every (rate, config) round; returns {(config, rate): result}."""
    from resilient_ckpt.testing.fake_gcs import FakeGcs
    from resilient_ckpt.testing.gcs_proxy import FaultProxy
    results: dict = {}
    with FakeGcs() as gcs, FaultProxy(gcs.endpoint, seed=11) as proxy:
        bucket = "rel-" + uuid.uuid4().hex[:8]
        gcs.create_bucket(bucket)
        # Every client (ours, and Orbax's gcsfs and tensorstore) goes through the proxy.
        env = {k: v.replace(gcs.endpoint, proxy.endpoint) for k, v in gcs.env().items()}
        workers: dict = {}
        try:
            for rate in RATES:
                for config in CONFIGS:
                    w = workers.get(config)
                    if w is None:
                        w = workers[config] = Worker(config, proxy.endpoint, nbytes, env)
                        assert w.line(300) == {"ready": True}, f"{config} worker did not start"
                    proxy.set(fraction=rate)
                    before = sum(proxy.faulted.values())
                    url = (f"gs://{bucket}/{config.replace('+', '_')}/{int(rate * 100)}-"
                           + uuid.uuid4().hex[:6])
                    saves, restores, hung = run_round(w, url, steps, hang_s)
                    proxy.set(fraction=0.0)
                    if hung:
                        log.warning("%s at %d%%: no answer in %.0f s; its stacks follow",
                                    config, rate * 100, hang_s)
                        w.kill(stacks=True)
                        workers.pop(config)
                    results[(config, rate)] = {"saves": saves, "restores": restores,
                                               "hung": hung, "faults": sum(
                                                   proxy.faulted.values()) - before}
                    log.info("%s at %d%%: %d saves, %d ok, %d restores, hung %s", config,
                             rate * 100, len(saves), sum(s["ok"] for s in saves),
                             len(restores), hung)
        finally:
            for w in workers.values():
                w.proc.stdin.close()
                w.kill()
    return results


def matrix_lines(results: dict, steps: int, nbytes: int) -> dict:
    """Emits one line per (config, rate); returns the rows for the doc."""
    rows = {}
    for config in CONFIGS:
        base = [s["total_s"] for s in results[(config, 0.0)]["saves"] if s["ok"]]
        base_s = statistics.median(base) if base else None
        for rate in RATES:
            r = results[(config, rate)]
            saves, ok = r["saves"], [s for s in r["saves"] if s["ok"]]
            clean = [s for s in saves if not s["ok"] and s.get("error") is not None
                     and s.get("names_step") and not s.get("raised_again")]
            ratios = [s["total_s"] / base_s for s in ok] if base_s else []
            row = {"saves": steps, "committed": len(ok),
                   "failed_cleanly": len(clean),
                   "failed_other": len(saves) - len(ok) - len(clean),
                   "hung": steps - len(saves),
                   "restore_hung": r["hung"] and len(saves) == steps,
                   "within_3x": sum(x <= 3 for x in ratios),
                   "ratio_max": round(max(ratios), 2) if ratios else None,
                   "ratio_median": round(statistics.median(ratios), 2) if ratios else None,
                   "blocking_median_s": round(statistics.median(
                       [s["blocking_s"] for s in saves if "blocking_s" in s]), 4)
                   if any("blocking_s" in s for s in saves) else None,
                   "restores": len(r["restores"]),
                   "restores_exact": sum(x["exact"] for x in r["restores"]),
                   "faults_injected": r["faults"],
                   "errors": sorted({s["error"][:120] for s in saves if s.get("error")})[:3]}
            rows[(config, rate)] = row
            runs = [s["total_s"] for s in ok]
            emit({"bench": BENCH, "system": "orbax" if config == "orbax" else "resilient_ckpt",
                  "case": f"gcs_faults_{config}_{int(rate * 100)}pct", "bytes": nbytes,
                  "devices": 8, "runs_s": runs,
                  "median_s": statistics.median(runs) if runs else None, **row})
    return rows


# ---------------------------------------------------------------- (a) and (c): pytest

def pytest_file(path: str, env: dict, timeout: float, args: tuple[str, ...] = ()) -> dict:
    """Runs one test file (with pytest options `args`); counts from its JUnit
    XML, and the time it took."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
               f"--junitxml={xml}", *args]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **env), timeout=timeout,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail, rc = proc.stdout[-2000:], proc.returncode
        except subprocess.TimeoutExpired as e:  # run() kills the child it started
            tail, rc = f"timed out after {timeout} s: {str(e.stdout or '')[-1500:]}", -1
        out = {"file": os.path.relpath(path, ROOT), "rc": rc,
               "seconds": round(time.monotonic() - t0, 1)}
        if os.path.exists(xml):
            suite = ET.parse(xml).getroot()
            suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
            n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            out.update(n, passed=n["tests"] - n["failures"] - n["errors"] - n["skipped"])
        if rc not in (0, 5):
            out["tail"] = tail
            log.warning("%s failed (rc %s):\n%s", path, rc, tail)
    return out


def find_test(name: str) -> str | None:
    """The test file `name` wherever tests/ keeps it (tests/ or a folder under
    it; the first by path), or None: the campaign runs it, never imports it."""
    found = sorted(glob.glob(os.path.join(ROOT, "tests", "**", name), recursive=True))
    return found[0] if found else None


def kill_campaign(trials: int) -> dict:
    path = find_test("test_kill.py")
    if path is None:
        log.warning("no test_kill.py under tests/: the kill campaign is skipped")
        return {"file": "test_kill.py", "missing": True}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "kill.json")
        run = pytest_file(path, {}, timeout=max(600.0, trials * 15.0),
                          args=("-m", "slow", f"--kill-campaign-trials={trials}",
                                f"--kill-report={report}"))
        if os.path.exists(report):
            with open(report) as f:
                run["report"] = json.load(f)
    for kind, k in run.get("report", {}).get("kinds", {}).items():
        emit({"bench": BENCH, "system": "resilient_ckpt", "case": f"kill_{kind}", **k})
    return run


def fault_files(timeout: float, long: bool) -> list[dict]:
    """Runs the other fault test files, their slow cases included; `long`: at
    their long-run sizes (the `thorough` Hypothesis profile)."""
    out = []
    for name in FAULT_FILES:
        path = find_test(name)
        if path is None:
            out.append({"file": f"tests/{name}", "missing": True})
            log.warning("tests/%s does not exist (yet); skipped", name)
            continue
        r = pytest_file(path, {}, timeout,
                        args=("-m", "", *(["--hypothesis-profile=thorough"] if long else [])))
        out.append(r)
        emit({"bench": BENCH, "system": "resilient_ckpt", "case": f"tests_{name[:-3]}",
              **{k: v for k, v in r.items() if k != "tail"}})
    return out


# ---------------------------------------------------------------- the summary and the doc

def summarize(kill: dict, rows: dict, files: list[dict], nbytes: int) -> dict:
    kinds = kill.get("report", {}).get("kinds", {})
    s = {"kill_trials": sum(k["trials"] for k in kinds.values()),
         **{f"kill_{c}": sum(k[c] for k in kinds.values())
            for c in ("torn", "wrong", "lost", "dirty")},
         "fault_tests_failed": sum(f.get("failures", 0) + f.get("errors", 0)
                                   + (f.get("rc", 0) not in (0, 5)) for f in files)}
    for (config, rate), r in rows.items():
        if rate == 0:
            continue
        who = {"gcs": "gcs", "ram+gcs": "ram_gcs", "orbax": "orbax"}[config]
        key = f"{who}_{int(rate * 100)}pct_{size_label(nbytes)}"
        good = r["within_3x"] + r["failed_cleanly"]
        s[f"clean_or_within_3x_fraction_{key}"] = round(good / r["saves"], 3)
        s[f"save_vs_no_fault_max_{key}"] = r["ratio_max"]
        s[f"restores_exact_fraction_{key}"] = (round(r["restores_exact"] / r["restores"], 3)
                                               if r["restores"] else None)
    return s


def _outcome(kind: str, k: dict) -> str:
    bad = ", ".join(f"{k[c]} {c}" for c in ("torn", "wrong", "lost", "dirty"))
    landed = "" if kind in ("time", "save_call") else f" ({_points(k['points'])})"
    return (f"{bad}; {k['kills_landed']} kills landed{landed}; "
            f"{k['left_leftovers']} left temporaries or markers; "
            f"{k['restores_checked']} restores checked bit-exact")


def _points(points: dict) -> str:
    return ", ".join(f"{n} {p}" for p, n in points.items())


def _gcs_cell(r: dict) -> str:
    most = f", max {r['ratio_max']}x" if r["ratio_max"] is not None else ""
    hung = r["hung"] + bool(r["restore_hung"])
    return (f"{r['committed']} committed ({r['within_3x']} within 3x{most}), "
            f"{r['failed_cleanly']} failed cleanly, {r['failed_other']} failed otherwise, "
            f"{hung} hung; of the steps a fresh manager lists, {r['restores_exact']} of "
            f"{r['restores']} restore exact; save() blocked {r['blocking_median_s']} s "
            "(median)")


def write_doc(path: str, command: str, quick: bool, kill: dict, rows: dict,
              files: list[dict], nbytes: int, steps: int, hang_s: float) -> None:
    kinds = kill.get("report", {}).get("kinds", {})
    lines = ["# Reliability", ""]
    if quick:
        lines += ["**A --quick run (a check that the script works, not the long run's "
                  "figures): the long run replaces this page.**", ""]
    lines += [f"Produced by `{command}`, load "
              f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end, "
              f"{os.cpu_count()} cores. Each row is one kind of trial; where the same "
              "trial runs on Orbax its figures are beside ours. See bench/reliability.py "
              "for what each trial does and tests/faults/test_kill.py for the checks after each "
              "kill.", "",
              "| trial | how many | resilient_ckpt | Orbax |", "| --- | --- | --- | --- |"]
    for kind, k in kinds.items():
        lines.append(f"| kill: {KILL_KINDS.get(kind, kind)} | {k['trials']} | "
                     f"{_outcome(kind, k)} | not run (our child saver only) |")
    if not kinds:
        lines.append(f"| kill campaign | - | did not report (rc {kill.get('rc')}) | |")
    for rate in RATES:
        if rate == 0:
            what = "GCS, no faults (each system's own baseline time)"
        else:
            what = f"GCS, {int(rate * 100)}% of requests faulted (429/503/reset/truncate)"
        ours = "; ".join(f"**{c}**: {_gcs_cell(rows[(c, rate)])}" for c in ("gcs", "ram+gcs"))
        lines.append(f"| {what} | {steps} saves of {nbytes / 1e6:.0f} MB per system | "
                     f"{ours} | {_gcs_cell(rows[('orbax', rate)])} |")
    for f in files:
        if f.get("missing"):
            lines.append(f"| {f['file']} | - | not written yet | |")
        else:
            lines.append(f"| {f['file']} | {f.get('tests', '?')} tests | {f.get('passed', 0)} "
                         f"passed, {f.get('failures', 0)} failed, {f.get('errors', 0)} "
                         f"errors, {f.get('skipped', 0)} skipped ({f['seconds']} s) | |")
    lines += ["", "Terms: *torn*: a step was listed that could not be read whole or needed "
              "another copy; *wrong*: a restore differed from what was saved; *lost*: the "
              "newest step reported committed (or a newer one) was not selected; *dirty*: "
              "cleanup left a dead writer's files, or touched a committed step. A GCS save "
              "*fails cleanly* when it raises once, naming its step; a listed step that does "
              "not restore exact is a torn step shown to the user; *within 3x*: the time "
              "from save() to committed is at most 3 times that system's median no-fault "
              f"time; *hung*: no answer in {hang_s:.0f} s (the worker is then killed).", ""]
    errs = {c: rows[(c, r)]["errors"] for c in CONFIGS for r in RATES if rows[(c, r)]["errors"]}
    if errs:
        lines += ["Examples of the errors raised:", ""]
        lines += [f"- {c}: `{e[0]}`" for c, e in errs.items()]
        lines.append("")
    lines += ["Goals met or not: the `goals_met` of the summary line the script prints "
              "last.", ""]
    kept = kept_sections(path)  # read before the page is rewritten
    with open(path, "w") as f:
        f.write("\n".join(lines) + kept)


KEPT = "\n## Threat model"  # written by hand below the measured part; a run keeps it


def kept_sections(path: str) -> str:
    """What of the page `path` a run does not write: from its threat model on."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    at = text.find(KEPT)
    return text[at:] if at >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2], int(argv[3]))
    p = bench_parser(__doc__, sizes="32MB", quick_sizes="8MB", repeats=5, quick_repeats=2,
                     quick_help="30 kills, 8 MB, 2 saves per fault rate")
    p.add_argument("--trials", type=int, default=None, help="kills (default 500; --quick 30)")
    p.add_argument("--hang-s", type=float, default=120.0, help="a save or restore with no "
                   "answer in this many seconds counts as hung (default 120)")
    p.add_argument("--doc", default=None, help="write the table here (default: "
                   "docs/reliability.md in a full run, nowhere with --quick)")
    p.add_argument("--skip", default="", help="parts to skip, comma-separated: kill,gcs,tests")
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    trials = a.trials or (30 if a.quick else 500)
    nbytes, skip = a.sizes[0], set(a.skip.split(","))
    t0 = time.monotonic()
    kill = kill_campaign(trials) if "kill" not in skip else {}
    results = gcs_matrix(a.repeats, nbytes, a.hang_s) if "gcs" not in skip else {}
    rows = matrix_lines(results, a.repeats, nbytes) if results else {}
    files = fault_files(1800.0, not a.quick) if "tests" not in skip else []
    goals = {f"clean_or_within_3x_fraction_{who}_{int(r * 100)}pct": (">=", 1.0)
             for who in ("gcs", "ram_gcs") for r in RATES[1:]}
    goals.update({f"kill_{c}": ("<=", 0) for c in ("torn", "wrong", "lost", "dirty")})
    emit_summary(BENCH, summarize(kill, rows, files, nbytes), goals=goals)
    doc = a.doc or (None if a.quick else os.path.join(ROOT, "docs", "reliability.md"))
    if doc and rows:
        command = "python bench/reliability.py " + " ".join(shlex.quote(x) for x in argv)
        write_doc(doc, command.strip(), a.quick, kill, rows, files, nbytes, a.repeats,
                  a.hang_s)
        log.info("wrote %s (%.0f s in all)", doc, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
