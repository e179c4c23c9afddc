"""Orbax's own tests of its CheckpointManager, run against ours.

Orbax keeps the tests of its manager's public API in its source repository
(`checkpoint/orbax/checkpoint/checkpoint_manager_test.py`); neither its wheel
nor its sdist ships the file, so this script takes its path. Take the file from
the Orbax release that is installed (`pip show orbax-checkpoint`), from a
checkout of github.com/google/orbax at that release's tag, e.g.

    git clone --depth 1 --branch v0.12.8 https://github.com/google/orbax
    python bench/orbax_manager_tests.py \\
        --orbax-test orbax/checkpoint/orbax/checkpoint/checkpoint_manager_test.py

The file imports flax and optax (`pip install -e '.[bench]'`) and Orbax's
multi-process test base, which the wheel lacks; a stand-in for one process is
provided here. The file's `CheckpointManager` is replaced by ours (with
`--against orbax`, it runs on Orbax's own class: the control), and the cases
in NOT_OURS are skipped with their reason: they test Orbax's internals, or a
difference docs/orbax_differences.md documents. One process, 8 CPU devices.

Output (docs/bench_contract.md): one JSON line per case (its outcome, and for
a failure the last line of the error), then a summary: how many of the cases
that test the public API passed. Without --orbax-test the script says how to
get the file and prints an empty summary (run_all.py runs every script).

With `--processes N` the file runs as Orbax's CI runs it: N cooperating
jax.distributed processes on 127.0.0.1, the 8 CPU devices split among them,
every process running the same cases in the same order (the job is started by
resilient_ckpt/testing/multiprocess.py). A case that outlives
`--case-timeout` is reported as a hang on every process it holds, the job is
ended (its processes killed by pid) and a new job goes on from the next case.
Each line then names its process, and there is one summary per process.
"""
from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import types
import unittest

from harness.options import at_least, bench_parser, parse_options, prepare

prepare(devices=8)

import jax  # noqa: E402
from absl import flags  # noqa: E402
from absl.testing import absltest  # noqa: E402
from harness.report import emit, emit_summary  # noqa: E402

import resilient_ckpt as rc  # noqa: E402

log = logging.getLogger("bench.orbax_manager_tests")
BENCH = "orbax_manager_tests"
_MULTIPROCESS = "orbax.checkpoint._src.testing.multiprocess_test"

# Cases of Orbax's file that are not a test of the public API ours matches:
# each names why. A name is a test method (every parameterized case of it is
# skipped) or one case of it (the method's name and the case's number).
_PRIVATE = "reads Orbax's manager's private attributes"
_FORMAT = "reads Orbax's on-disk step format; ours writes its own (format.md)"
_CLOCK = "mocks datetime.now; our step times come from time.time"
_GCS = "mocks Orbax's gs:// detection to test its temporary directories on GCS"
NOT_OURS: dict[str, str] = {
    "test_save_restore2": _PRIVATE + " (_checkpointer)",
    "test_legacy_api_timeout": _PRIVATE + " (_checkpointer)",
    "test_lightweight_intialize_loads_without_metadata_read": _PRIVATE + " (_checkpoints)",
    "test_default_init_default_item": _PRIVATE + " (_default_item)",
    "test_default_item_metadata_with_new_checkpoint_manager": _PRIVATE + " (_default_item)",
    "test_legacy_handler_default_item": _PRIVATE + " (_default_item)",
    "test_save_default_item": _PRIVATE + " (_default_item)",
    "test_save_restore_default_item_legacy_init": _PRIVATE + " (_default_item)",
    "test_metadata": _PRIVATE + " (_root_metadata_file_path)",
    "test_empty_metadata": _PRIVATE + " (_root_metadata_file_path)",
    "test_metadata_save_skipped_when_always_read_only": _PRIVATE + " (_root_metadata_file_path)",
    "test_metadata_save_skipped_with_write_and_read_only": _PRIVATE + " (_root_metadata_file_path)",
    "test_metadata_save_preemption_checkpointer": _PRIVATE + " (_checkpointer)",
    "test_metadata_save_preemption_async_checkpointer": _PRIVATE + " (_checkpointer)",
    "test_metadata_finalize_preemption_checkpointer": "mocks Orbax's atomicity module",
    "test_metadata_finalize_preemption_async_checkpointer": "mocks Orbax's atomicity module",
    "test_save_preempted_gcs": _PRIVATE + " (_maybe_await_cleanup_tmp_directory)",
    "test_save_preempted_mock_checkpointer_prefix": "mocks Orbax's atomicity module",
    "test_save_preempted_mock_checkpointer_no_prefix": "mocks Orbax's atomicity module",
    "test_save_preempted_mock_async_checkpointer_prefix": "mocks Orbax's atomicity module",
    "test_save_preempted_mock_async_checkpointer_no_prefix": "mocks Orbax's atomicity module",
    "test_save_preempted_mock_checkpointer_prefix_gcs": _GCS,
    "test_save_preempted_mock_checkpointer_no_prefix_gcs": _GCS,
    "test_save_preempted_mock_async_checkpointer_prefix_gcs": _GCS,
    "test_save_preempted_mock_async_checkpointer_no_prefix_gcs": _GCS,
    "test_save_restore_gcs": _GCS,
    "test_save_gcs_with_unfinalized_checkpoints": _GCS,
    "test_configure_atomicity": "Orbax's temporary-path classes (atomicity options)",
    "test_file_format": _FORMAT,
    "test_save_step_metadata": _FORMAT + " (the step's _CHECKPOINT_METADATA)",
    "test_max_to_keep_zero_other_conditions": _CLOCK,
    "test_removes_old_saves_time_interval": _CLOCK,
    "test_removes_old_saves_time_interval_metrics": _CLOCK,
    "test_save_and_restore_composite_logger": "Orbax's step-statistics loggers",
    "test_save_and_restore_standard_logger": "Orbax's step-statistics loggers",
    "test_init_telemetry_continuous_checkpointing": "Orbax's jax.monitoring telemetry",
    "test_slow_save_logs_warning": "mocks Orbax's AsyncCheckpointer",
    "test_async_error_subsequent_save": "an Orbax handler that fails in Orbax's async "
                                        "machinery; ours does not run Orbax's handlers",
    "test_async_error_wait_until_finished": "as test_async_error_subsequent_save",
    "test_async_error_multiple_steps": "as test_async_error_subsequent_save",
    "test_checkpoint_args_mismatch_item_handlers": "checks args against Orbax's handler "
                                                   "registry; ours saves with its own writer",
    "test_item_names_with_single_item_handler": "as test_checkpoint_args_mismatch_item_handlers",
    "test_single_host_load_and_broadcast": "mocks Orbax's multihost broadcast (and names "
                                           "steps with Orbax's step_name_format object)",
    "test_delete": "the directory keeps our writer lock and tier record after its last "
                   "step is deleted (orbax_differences.md)",
}


def _stand_in_multiprocess() -> None:
    """Orbax's multi-process test base is not in its wheel: a stand-in with
    the things the file uses (every process meets the others at the start of
    each case, tempdirs that every process shares, and main)."""
    try:
        importlib.import_module(_MULTIPROCESS)
        return
    except ImportError:
        pass
    from jax.experimental import multihost_utils

    class MultiProcessTest(absltest.TestCase):
        def setUp(self) -> None:
            super().setUp()
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"arrive {self.id()}")

        def multiprocess_create_tempdir(self, name: str | None = None) -> str:
            if jax.process_count() == 1:
                return self.create_tempdir(name).full_path
            # The same path on every process (the test's id under the
            # job's shared test_tmpdir); process 0 makes it.
            path = os.path.join(absltest.get_default_test_tmpdir(),
                                re.sub(r"[^\w.-]", "_", self.id()), name or "tmp")
            if jax.process_index() == 0:
                os.makedirs(path, exist_ok=True)
            multihost_utils.sync_global_devices(f"tempdir {self.id()} {name}")
            return path

    mod = types.ModuleType(_MULTIPROCESS)
    mod.MultiProcessTest = MultiProcessTest  # type: ignore[attr-defined]
    mod.main = absltest.main  # type: ignore[attr-defined]
    sys.modules[_MULTIPROCESS] = mod


def load(path: str, against: str) -> types.ModuleType:
    """Orbax's test module from `path`, its CheckpointManager ours unless
    `against` is "orbax"."""
    _stand_in_multiprocess()
    spec = importlib.util.spec_from_file_location("orbax_checkpoint_manager_test", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if against == "ours":
        module.CheckpointManager = rc.CheckpointManager
        cls = module.CheckpointManagerTest
        for name in NOT_OURS:
            if not any(re.fullmatch(re.escape(name) + r"\d*", n) for n in dir(cls)):
                log.warning("NOT_OURS names %s, which this file does not have", name)
        for name in dir(cls):
            base = next((n for n in NOT_OURS if re.fullmatch(re.escape(n) + r"\d*", name)),
                        None)
            if name.startswith("test") and base is not None:
                setattr(cls, name, unittest.skip(NOT_OURS[base])(lambda self: None))
    return module


class _Outcomes(unittest.TestResult):
    """Each case's outcome, emitted as it ends."""

    def __init__(self, against: str, only: str | None, out=emit):
        super().__init__()
        self.system = "orbax" if against == "orbax" else "resilient_ckpt"
        self.out = out
        self.extra: dict = {}  # added to each line (a worker's process and case index)
        self.counts = {"pass": 0, "fail": 0, "skip": 0, "hang": 0}
        self.failed: list[str] = []
        self.subtest_failed: set[str] = set()

    def _emit(self, test, outcome: str, detail: str | None = None) -> None:
        name = test.id().split(" ")[0].rsplit(".", 1)[-1]
        self.counts[outcome] += 1
        if outcome == "fail":
            self.failed.append(name)
        line = {"bench": BENCH, "system": self.system, "case": name, "outcome": outcome}
        if detail:
            line["detail"] = detail
        self.out({**line, **self.extra})

    def addSuccess(self, test):  # noqa: N802 - unittest's name
        self._emit(test, "pass")

    def addFailure(self, test, err):  # noqa: N802
        self._emit(test, "fail", _last_line(self._exc_info_to_string(err, test)))

    def addError(self, test, err):  # noqa: N802
        self._emit(test, "fail", _last_line(self._exc_info_to_string(err, test)))

    def addSubTest(self, test, subtest, err):  # noqa: N802
        # A failing subTest fails its case (once); unittest then adds no success.
        if err is not None and test.id() not in self.subtest_failed:
            self.subtest_failed.add(test.id())
            self._emit(test, "fail", f"{subtest.id().split(' ', 1)[-1]}: "
                       + _last_line(self._exc_info_to_string(err, test)))

    def addSkip(self, test, reason):  # noqa: N802
        self._emit(test, "skip", reason)

    def addExpectedFailure(self, test, err):  # noqa: N802
        self._emit(test, "pass")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        self._emit(test, "fail", "unexpected success")


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


def _one_process_job() -> None:
    """Orbax's file runs as a job of jax.distributed (its setUp reads the
    distributed client): a job of one process, its coordinator on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1,
                               process_id=0)


def _results_only_on_stdout() -> None:
    """The collectives' C++ logs write to file descriptor 1: send it to stderr
    and keep the original stdout for the result lines alone."""
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w", buffering=1)


def _cases(path: str, against: str, only: str | None) -> list[unittest.TestCase]:
    """The file's cases, in the order every process runs them."""
    module = load(path, against)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # absltest's tempdirs read a flag
    suite = unittest.TestLoader().loadTestsFromTestCase(module.CheckpointManagerTest)
    return [t for t in _flatten(suite) if only is None or only in t.id()]


def run(path: str, against: str, only: str | None) -> _Outcomes:
    _results_only_on_stdout()
    _one_process_job()
    result = _Outcomes(against, only)
    for test in _cases(path, against, only):
        test(result)
    return result


def _worker(a) -> None:
    """One process of a --processes job (started by `_run_job`): runs the
    cases from index a.start on, each as a line "RESULT <json>" on stdout;
    a case that outlives a.case_timeout is reported as a hang and the process
    exits (its peers are then ended by the job)."""
    import json
    _results_only_on_stdout()
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                               num_processes=a.nprocs, process_id=a.pid,
                               initialization_timeout=60,
                               heartbeat_timeout_seconds=a.heartbeat_timeout_s)
    lock = threading.Lock()

    def out(line: dict) -> None:
        with lock:
            sys.stdout.write("RESULT " + json.dumps(line) + "\n")
            sys.stdout.flush()

    cases = _cases(a.orbax_test, a.against, a.only)
    result = _Outcomes(a.against, a.only, out)
    current: list = [None, 0.0]

    # Process 0 holds the job's coordinator: it waits 5 s more, so that the
    # others have reported (and shown their stacks) before it ends the job.
    limit = a.case_timeout + (5 if a.pid == 0 else 0)

    def watchdog() -> None:
        while True:
            time.sleep(1)
            test, t0 = current
            if test is not None and time.monotonic() - t0 > limit:
                result.extra["detail"] = f"still running after {a.case_timeout:g} s"
                result._emit(test, "hang")  # noqa: SLF001 - this module's class
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    for i in range(a.start, len(cases)):
        result.extra = {"process": a.pid, "index": i}
        current[:] = [cases[i], time.monotonic()]
        cases[i](result)
        current[0] = None
    out({"done": len(cases), "process": a.pid})
    sys.stdout.flush()
    os._exit(0)  # jax.distributed's shutdown barrier would wait on hung peers


def _run_job(a) -> list[dict[int, dict]]:
    """Runs the cases in jobs of a.processes processes, a new job from the
    case after each hang. Returns, per process, each case's line by index."""
    from resilient_ckpt.testing.multiprocess import start_job
    n = a.processes
    per: list[dict[int, dict]] = [{} for _ in range(n)]
    start, total = 0, None
    tmp = tempfile.mkdtemp(prefix="orbax-manager-tests-")
    args = ["--worker", "--orbax-test", os.path.abspath(a.orbax_test), "--against", a.against,
            "--case-timeout", str(a.case_timeout)] + (["-k", a.only] if a.only else [])
    for attempt in range(1000):
        log.warning("job %d: %d processes, from case %d", attempt, n, start)
        job = start_job(os.path.abspath(__file__), n, 8 // n,
                        args + ["--start", str(start)], timeout_s=10 ** 6,
                        env={"TEST_TMPDIR": os.path.join(tmp, f"job{attempt}")},
                        heartbeat_timeout_s=max(20, int(a.case_timeout)))
        procs = job.collect(raise_on_timeout=False)
        if a.logs:
            os.makedirs(a.logs, exist_ok=True)
            for p in procs:
                with open(os.path.join(a.logs, f"job{attempt}-process{p.index}.log"), "w") as f:
                    f.write(p.stdout + p.stderr)
        for p in procs:
            for line in p.results:
                if "done" in line:
                    total = line["done"]
                elif "index" in line:
                    per[p.index][line["index"]] = line
        if total is not None and all(p.rc == 0 for p in procs):
            break
        reached = [i for d in per for i in d if i >= start]
        frontier = max(reached) if reached else start - 1
        if not any(d.get(frontier, {}).get("outcome") == "hang" for d in per):
            frontier += 1  # a process died in the next case without a word
            if frontier >= len(per[0]) and total is not None and frontier >= total:
                break
        for i, d in enumerate(per):
            for k in range(start, frontier + 1):
                if k not in d:
                    why = procs[i].tail(300).strip().splitlines()[-1:] or ["no output"]
                    d[k] = {"bench": BENCH, "process": i, "index": k, "case": f"#{k}",
                            "outcome": "hang", "detail": "ended when the job ended: "
                            + why[0][:300]}
        start = frontier + 1
    shutil.rmtree(tmp, ignore_errors=True)
    return per


def _emit_job(a, per: list[dict[int, dict]]) -> None:
    system = "orbax" if a.against == "orbax" else "resilient_ckpt"
    names = {k: line["case"] for d in per for k, line in d.items() if "#" not in line["case"]}
    for d in per:
        for k in sorted(d):
            emit({**d[k], "system": system, "case": names.get(k, d[k]["case"])})
    for i, d in enumerate(per):
        lines = [{**d[k], "case": names.get(k, d[k]["case"])} for k in sorted(d)]
        count = {o: sum(x["outcome"] == o for x in lines) for o in ("pass", "fail", "hang",
                                                                   "skip")}
        emit_summary(BENCH, {"system": system, "processes": a.processes, "process": i,
                             "passed": count["pass"],
                             "of": count["pass"] + count["fail"] + count["hang"],
                             "hung": count["hang"], "skipped": count["skip"],
                             "failed": [x["case"] for x in lines if x["outcome"] == "fail"],
                             "hangs": [x["case"] for x in lines if x["outcome"] == "hang"]})


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, sizes=None, quick_help="the same run (it has no size)")
    p.add_argument("--orbax-test", metavar="PATH", default=None,
                   help="Orbax's checkpoint_manager_test.py (see above for where to get it)")
    p.add_argument("--against", choices=("ours", "orbax"), default="ours",
                   help="whose CheckpointManager the file tests (default ours)")
    p.add_argument("-k", dest="only", default=None,
                   help="only the cases whose name contains this")
    p.add_argument("--processes", type=int, default=1, choices=(1, 2, 4, 8),
                   help="run as this many cooperating jax.distributed processes "
                        "(8 CPU devices split among them; default 1)")
    p.add_argument("--case-timeout", type=at_least(1), default=90, metavar="S",
                   help="with --processes, a case still running after S seconds (a "
                        "whole number, at least 1) is a hang (default 90)")
    p.add_argument("--logs", metavar="DIR", default=None,
                   help="with --processes, write each process's output there (a hung "
                        "case's process adds the stacks of its threads)")
    # A worker of a --processes job (set by the job, not by hand).
    for opt, kind in (("--port", int), ("--pid", int), ("--nprocs", int), ("--devices", int),
                      ("--heartbeat-timeout-s", int), ("--start", int)):
        p.add_argument(opt, type=kind, default=0, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if a.worker:
        _worker(a)
    if a.orbax_test is None:
        sys.stderr.write(f"{p.prog}: no --orbax-test given: nothing to run. "
                         "See --help for where Orbax's test file comes from.\n")
        emit_summary(BENCH, {"ran": 0})
        return 0
    if a.processes > 1:
        _emit_job(a, _run_job(a))
        return 0
    r = run(a.orbax_test, a.against, a.only)
    ran = r.counts["pass"] + r.counts["fail"]
    emit_summary(BENCH, {"system": "orbax" if a.against == "orbax" else "resilient_ckpt",
                         "passed": r.counts["pass"], "of": ran,
                         "skipped": r.counts["skip"], "failed": r.failed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
