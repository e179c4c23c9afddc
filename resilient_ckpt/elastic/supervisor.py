"""A small local supervisor: one jax.distributed job of N processes, relaunched whole on a failure.

This module owns the parent side of relaunch recovery on one machine: it
starts N processes of one job on 127.0.0.1 (a free coordinator port per
launch, the variables of `elastic.jobenv` per process), watches them, and
when one dies (a signal or a nonzero exit) ends the others it started, by
pid (SIGTERM, then SIGKILL after a grace period), and launches a fresh set,
up to `max_restarts` times: a restarted process cannot rejoin a running
jax.distributed job, a fresh set re-forms it. Each relaunch leaves a
`Relaunch` record (failure detected, processes ended, relaunched, the step
restored and the first step done after it, from the processes' progress
files), printed by `format_relaunches`. It restores nothing itself: each
fresh process opens its `CheckpointManager` and restores the newest step.

    python -m resilient_ckpt.elastic.supervisor --processes 2 -- python train.py ...

Under a real scheduler, the scheduler's restart policy takes this module's
place (docs/elastic.md, "Relaunch").

Threads: `Supervisor.start` watches the job in a daemon thread `supervisor`
(no jax: it waits on child processes and reads their reports), which `wait`
waits for.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from . import jobenv


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit {rc}"


@dataclasses.dataclass
class Relaunch:
    """One failure and the relaunch after it. Times are `time.time()`
    readings; the later ones stay None until the fresh processes report them
    (or for ever, if the relaunch failed too, or there was none)."""
    attempt: int                       # the launch that failed (0: the first)
    failed: dict[int, str]             # process -> how it ended ("SIGKILL", "exit 3")
    last_step: int | None              # newest step any process reported before it
    detected_t: float
    ended_t: float | None = None       # every other process of that launch gone
    forced: tuple[int, ...] = ()       # processes that needed SIGKILL after the grace
    relaunched_t: float | None = None  # the fresh set started (None: gave up)
    restored_step: int | None = None   # agreed by the fresh processes (the first's report)
    restored_t: float | None = None    # the slowest process's restore returned
    restored_from: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes by tier
    first_step: int | None = None
    first_step_t: float | None = None  # the slowest process finished it

    @property
    def steps_lost(self) -> int | None:
        if self.last_step is None or self.restored_step is None:
            return None
        return max(0, self.last_step - self.restored_step)

    def since(self, t: float | None) -> float | None:
        return None if t is None else t - self.detected_t

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["steps_lost"] = self.steps_lost
        out["total_s"] = self.since(self.first_step_t)
        return out


def format_relaunches(timeline: Sequence[Relaunch]) -> str:
    """A table per relaunch: each event, milliseconds after the failure was detected."""
    def ms(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:9.1f}"
    blocks = []
    for r in timeline:
        how = ", ".join(f"process {i} {h}" for i, h in sorted(r.failed.items()))
        forced = f" (SIGKILL after the grace: {list(r.forced)})" if r.forced else ""
        served = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in r.restored_from.items())
        rows = [("failure detected", 0.0, f"launch {r.attempt}: {how}; newest step "
                                          f"reported {r.last_step}"),
                ("other processes ended", r.since(r.ended_t), f"SIGTERM{forced}"),
                ("fresh processes started", r.since(r.relaunched_t), f"launch {r.attempt + 1}"),
                ("restore returned", r.since(r.restored_t),
                 f"step {r.restored_step}" + (f" from {served}" if served else "")),
                ("first step done", r.since(r.first_step_t),
                 f"step {r.first_step}; steps lost {r.steps_lost}")]
        blocks.append("\n".join(f"  {name:<24} {ms(t)} ms  {what}" for name, t, what in rows))
    return "\n\n".join(blocks) if blocks else "  (no failure)"


class _Launch:
    """The processes of one launch, and what they reported."""

    def __init__(self, attempt: int, procs: list[subprocess.Popen], status: list[str],
                 logs: list[IO[bytes] | None]):
        self.attempt, self.procs, self.status, self.logs = attempt, procs, status, logs
        self.reports: list[list[dict]] = [[] for _ in procs]
        self._offsets = [0] * len(procs)
        self._partial = [b""] * len(procs)

    def read_reports(self) -> None:
        """Reads the new complete lines of every progress file."""
        for i, path in enumerate(self.status):
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[i])
                    data = f.read()
            except FileNotFoundError:
                continue
            self._offsets[i] += len(data)
            *lines, self._partial[i] = (self._partial[i] + data).split(b"\n")
            for line in lines:
                try:
                    self.reports[i].append(json.loads(line))
                except ValueError:
                    continue  # not a progress line: ignore it rather than fail the job

    def newest_step(self) -> int | None:
        steps = [r["step"] for rs in self.reports for r in rs if r.get("event") == "step"]
        return max(steps) if steps else None

    def first(self, event: str) -> list[dict | None]:
        """Per process, its first report of `event` (None: none yet)."""
        return [next((r for r in rs if r.get("event") == event), None) for rs in self.reports]

    def close_logs(self) -> None:
        for f in self.logs:
            if f is not None:
                f.close()


class SupervisorError(RuntimeError):
    """The supervised job did not finish: restarts exhausted, or its deadline passed."""


class Supervisor:
    """Runs `argv` as processes 0..n-1 of one jax.distributed job on `host`,
    relaunching the whole set after a failure (at most `max_restarts` times).

    `env`: variables added to every process's environment (None removes one).
    `workdir`: where the processes' progress files go (default: `log_dir`,
    else a temporary directory, removed when the run ends).
    `log_dir`: each process's stdout and stderr go to
    <log_dir>/launch<k>.proc<i>.log (default: this process's own streams).
    `before_relaunch(failure)`: called after the failed launch's processes
    are all gone and before the fresh set starts (a test removes a lost host's
    RAM tier there). `deadline_s`: the whole run's limit; past it every
    process is killed and `wait` raises. Use `run()`, or `start()` then
    `wait()`, with `kill(i)`, `wait_for_step` and `pids()` meanwhile."""

    def __init__(self, argv: Sequence[str], processes: int, *, max_restarts: int = 3,
                 grace_s: float = 5.0, host: str = "127.0.0.1",
                 env: Mapping[str, str | None] | None = None, cwd: str | None = None,
                 workdir: str | None = None, log_dir: str | None = None,
                 before_relaunch: Callable[[Relaunch], None] | None = None,
                 deadline_s: float | None = None, poll_s: float = 0.02):
        if processes < 1:
            raise ValueError(f"processes must be at least 1, not {processes}")
        if not argv:
            raise ValueError("no command to supervise")
        self.argv, self.processes, self.max_restarts = list(argv), processes, max_restarts
        self.grace_s, self.host, self.cwd, self.poll_s = grace_s, host, cwd, poll_s
        self.env = dict(env or {})
        self.log_dir = log_dir
        # A directory of its own (neither given) is removed at the end.
        self._own_workdir = not (workdir or log_dir)
        self.workdir = workdir or log_dir or _tempdir()
        self.before_relaunch = before_relaunch
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.timeline: list[Relaunch] = []
        self.launches: list[_Launch] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._result: int | None = None
        self._error: BaseException | None = None
        self._killed: set[int] = set()

    # ------------------------------------------------------------ launching

    def _environment(self, attempt: int, port: int, i: int, status: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in jobenv.NAMES}
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        env.update({jobenv.COORDINATOR: f"{self.host}:{port}",
                    jobenv.NUM_PROCESSES: str(self.processes), jobenv.PROCESS_ID: str(i),
                    jobenv.ATTEMPT: str(attempt), jobenv.STATUS: status})
        return env

    def _launch(self, attempt: int) -> _Launch:
        port = free_port(self.host)
        procs: list[subprocess.Popen] = []
        status: list[str] = []
        logs: list[IO[bytes] | None] = []
        try:
            for i in range(self.processes):
                path = os.path.join(self.workdir, f"launch{attempt}.proc{i}.status")
                log = (open(os.path.join(self.log_dir, f"launch{attempt}.proc{i}.log"), "wb")
                       if self.log_dir else None)
                status.append(path)
                logs.append(log)
                procs.append(subprocess.Popen(
                    self.argv, env=self._environment(attempt, port, i, path), cwd=self.cwd,
                    stdout=log, stderr=subprocess.STDOUT if log else None))
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            for f in logs:
                if f is not None:
                    f.close()
            raise
        return _Launch(attempt, procs, status, logs)

    def _end(self, launch: _Launch) -> tuple[int, ...]:
        """Ends every process of `launch` still running: SIGTERM, then SIGKILL
        for those still there after the grace period. Returns those."""
        alive = [p for p in launch.procs if p.poll() is None]
        for p in alive:
            _signal(p, signal.SIGTERM)
        end = time.monotonic() + self.grace_s
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(self.poll_s)
        forced = tuple(launch.procs.index(p) for p in alive if p.poll() is None)
        for i in forced:
            _signal(launch.procs[i], signal.SIGKILL)
        for p in launch.procs:
            p.wait()
        self._read(launch)
        launch.close_logs()
        return forced

    def _read(self, launch: _Launch) -> None:
        with self._cond:
            launch.read_reports()
            self._fill(launch)

    # ------------------------------------------------------------ watching

    def _watch(self) -> int:
        launch = self._start_launch(0)
        while True:
            if self.deadline is not None and time.monotonic() > self.deadline:
                self._end(launch)
                raise SupervisorError(f"the job ran past its deadline (launch "
                                      f"{launch.attempt}); every process was ended")
            self._read(launch)
            rcs = [p.poll() for p in launch.procs]
            failed = {i: describe_exit(rc) for i, rc in enumerate(rcs) if rc not in (None, 0)}
            if not failed and all(rc == 0 for rc in rcs):
                self._end(launch)
                return 0
            if failed:
                nxt = self._recover(launch, failed)
                if nxt is None:
                    return next(rc for rc in rcs if rc not in (None, 0)) or 1
                launch = nxt
            with self._cond:
                self._cond.notify_all()
                self._cond.wait(self.poll_s)

    def _start_launch(self, attempt: int) -> _Launch:
        launch = self._launch(attempt)
        with self._cond:
            self.launches.append(launch)
            self._cond.notify_all()
        return launch

    def _recover(self, launch: _Launch, failed: dict[int, str]) -> _Launch | None:
        """Records the failure, ends the launch, and starts the next (None: no restarts left)."""
        rec = Relaunch(launch.attempt, failed, launch.newest_step(), time.time())
        self.timeline.append(rec)
        rec.forced = self._end(launch)
        rec.ended_t = time.time()
        rec.last_step = launch.newest_step()
        if launch.attempt >= self.max_restarts:
            return None
        if self.before_relaunch is not None:
            self.before_relaunch(rec)
        nxt = self._start_launch(launch.attempt + 1)
        rec.relaunched_t = time.time()
        return nxt

    def _fill(self, launch: _Launch) -> None:
        """Completes the record of the failure that `launch` recovers from."""
        rec = next((r for r in self.timeline if r.attempt == launch.attempt - 1), None)
        if rec is None or rec.first_step_t is not None:
            return
        restored = launch.first("restored")
        if rec.restored_t is None and all(restored):
            rec.restored_step = restored[0]["step"]  # type: ignore[index]
            rec.restored_t = max(r["t"] for r in restored if r)
            tiers: dict[str, int] = {}
            for r in restored:
                for k, v in (r or {}).get("bytes_by_tier", {}).items():
                    tiers[k] = tiers.get(k, 0) + int(v)
            rec.restored_from = tiers
        steps = launch.first("step")
        if all(steps):
            rec.first_step = min(r["step"] for r in steps if r)
            rec.first_step_t = max(r["t"] for r in steps if r)

    # ------------------------------------------------------------ the caller's side

    def start(self) -> Supervisor:
        os.makedirs(self.workdir, exist_ok=True)
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._main, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def _main(self) -> None:
        try:
            rc = self._watch()
        except BaseException as e:  # handed to wait()
            self._error, rc = e, 1
        if self._own_workdir:  # every report is read by now
            shutil.rmtree(self.workdir, ignore_errors=True)
        with self._cond:
            self._result = rc
            self._cond.notify_all()

    def wait(self) -> int:
        """Waits for the end; returns 0, or the failing exit code once the
        restarts ran out (a negative signal number for a signal). Raises
        SupervisorError past the deadline."""
        assert self._thread is not None, "start() first"
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def run(self) -> int:
        return self.start().wait()

    def pids(self) -> list[int]:
        """The pids of the current launch's processes, in process order."""
        with self._cond:
            return [p.pid for p in self.launches[-1].procs] if self.launches else []

    def kill(self, i: int) -> float:
        """SIGKILLs process i of the current launch (a lost host); returns the time.time() of it."""
        with self._cond:
            p = self.launches[-1].procs[i]
            t = time.time()
            _signal(p, signal.SIGKILL)
            return t

    def wait_for_step(self, step: int, process: int | None = None, attempt: int = 0,
                      timeout: float = 120.0) -> bool:
        """Waits until a process (or the given one) of launch `attempt` reported
        step >= `step`; False if the launch ended first or `timeout` passed."""
        end = time.monotonic() + timeout
        with self._cond:
            while time.monotonic() < end and self._result is None:
                if len(self.launches) > attempt:
                    launch = self.launches[attempt]
                    if any(r.get("event") == "step" and r["step"] >= step
                           for i, rs in enumerate(launch.reports)
                           if process in (None, i) for r in rs):
                        return True
                    if len(self.launches) > attempt + 1:
                        return False
                self._cond.wait(0.1)
        return False

    def reports(self) -> list[list[list[dict]]]:
        """Per launch, per process, the progress lines it wrote."""
        with self._cond:
            return [[list(rs) for rs in launch.reports] for launch in self.launches]


def _signal(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


def _tempdir() -> str:
    import tempfile
    return tempfile.mkdtemp(prefix="rc-supervisor-")


def main(argv: list[str] | None = None) -> int:
    """`python -m resilient_ckpt.elastic.supervisor --processes N -- COMMAND ...`"""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m resilient_ckpt.elastic.supervisor [options] -- COMMAND ...",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m resilient_ckpt.elastic.supervisor",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, required=True, help="processes in the job")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches at most (default 3)")
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when ending a launch (default 5)")
    p.add_argument("--log-dir", help="one log file per process and launch (default: inherit)")
    p.add_argument("--timeline", help="also write the relaunch records to this JSON file")
    a = p.parse_args(argv[:cut])
    sup = Supervisor(argv[cut + 1:], a.processes, max_restarts=a.max_restarts,
                     grace_s=a.grace_s, log_dir=a.log_dir)
    rc = sup.run()
    print(f"supervisor: exit {rc} after {len(sup.timeline)} failure(s)\n"
          f"{format_relaunches(sup.timeline)}", file=sys.stderr)
    if a.timeline:
        with open(a.timeline, "w") as f:
            json.dump([r.to_dict() for r in sup.timeline], f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
