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
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import socket
import sys
import types
import unittest

from harness.options import bench_parser, parse_options, prepare

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
    """Orbax's multi-process test base is not in its wheel: a one-process
    stand-in with the two things the file uses (tempdirs that every process
    shares, and main)."""
    try:
        importlib.import_module(_MULTIPROCESS)
        return
    except ImportError:
        pass

    class MultiProcessTest(absltest.TestCase):
        def multiprocess_create_tempdir(self, name: str | None = None) -> str:
            return self.create_tempdir(name).full_path

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

    def __init__(self, against: str, only: str | None):
        super().__init__()
        self.system = "orbax" if against == "orbax" else "resilient_ckpt"
        self.counts = {"pass": 0, "fail": 0, "skip": 0}
        self.failed: list[str] = []
        self.subtest_failed: set[str] = set()

    def _emit(self, test, outcome: str, detail: str | None = None) -> None:
        name = test.id().split(" ")[0].rsplit(".", 1)[-1]
        self.counts["skip" if outcome == "skip" else outcome] += 1
        if outcome == "fail":
            self.failed.append(name)
        line = {"bench": BENCH, "system": self.system, "case": name, "outcome": outcome}
        if detail:
            line["detail"] = detail
        emit(line)

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


def run(path: str, against: str, only: str | None) -> _Outcomes:
    _results_only_on_stdout()
    _one_process_job()
    module = load(path, against)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # absltest's tempdirs read a flag
    suite = unittest.TestLoader().loadTestsFromTestCase(module.CheckpointManagerTest)
    result = _Outcomes(against, only)
    for test in _flatten(suite):
        if only is None or only in test.id():
            test(result)
    return result


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
    a = parse_options(p, argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if a.orbax_test is None:
        sys.stderr.write(f"{p.prog}: no --orbax-test given: nothing to run. "
                         "See --help for where Orbax's test file comes from.\n")
        emit_summary(BENCH, {"ran": 0})
        return 0
    r = run(a.orbax_test, a.against, a.only)
    ran = r.counts["pass"] + r.counts["fail"]
    emit_summary(BENCH, {"system": "orbax" if a.against == "orbax" else "resilient_ckpt",
                         "passed": r.counts["pass"], "of": ran,
                         "skipped": r.counts["skip"], "failed": r.failed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
