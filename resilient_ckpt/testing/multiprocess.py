"""A harness for multi-process JAX jobs on one machine (simulated hosts), for
tests and benchmarks of code that runs on many hosts.

Each job is N local processes that form one JAX job through
`jax.distributed.initialize` on 127.0.0.1 (docs/environment.md, "Many devices,
many hosts, on one machine"). The harness writes the worker script and the
worker-side helper module `mh.py` (`WORKER_LIB`) into a job directory, picks a
free port, starts

    python worker.py --port P --pid i --nprocs N --devices D ARGS...

and enforces a hard timeout: when it passes, every process it started is
SIGKILLed (by pid, never by name) and `collect` raises `JobTimeout`, an
AssertionError, so a stuck job fails the test that ran it (pytest-timeout is
not installed). When a process exits non-zero on its own, the others are
killed after `fail_fast_s` (they would block in a collective or in the
distributed shutdown barrier otherwise).

API (parent side, standard library only: nothing here imports jax):

- `run_job(script, nprocs, devices_per_proc, args=(), timeout_s=120, env=None)`
  -> list[ProcResult], one per process, in process order;
- `start_job(...)` -> `Job`, to act while it runs: `wait_for(i, marker)`,
  `kill(i)` (SIGKILL: a lost host), `kill_after(i, delay_s, after=marker)`,
  `lines(i)`, then `collect()` -> list[ProcResult];
- `ProcResult`: `index`, `rc`, `stdout`, `stderr`, `results` (the JSON objects
  printed on lines "RESULT <json>"), `markers`, `killed` (by the test),
  `reaped` (killed by the harness after a peer failed), `timed_out`; `last()`.
- Workers import the package from the tree this module belongs to, or from
  the directory given as `src=` (to run the same tests against another tree).

Worker side (`mh.py`, importable by the worker script as `import mh`):

- `ctx = mh.init(sys.argv)`: parses --port/--pid/--nprocs/--devices/--dir/--ram
  (and --state-bytes, --seed, --mesh); sets XLA_FLAGS and JAX_PLATFORMS before
  importing jax; calls `jax.distributed.initialize` when nprocs > 1 (heartbeat
  timeout: start_job's `heartbeat_timeout_s`, 20 s by default); builds
  `Mesh(np.array(jax.devices()).reshape(-1, 2), ("data", "model"))`. Unknown
  options are left in `ctx.extra` (a list) for the script's own parser.
- `mh.report(obj)` prints `RESULT <json>`; `mh.mark(text)` prints a marker line.
- `ctx.initial_state()`, `ctx.train_step(state, step)` (jitted), `ctx.abstract()`,
  `mh.expected(step, shapes)` (host numpy values after `step` steps),
  `ctx.check_exact(state, step)` (mismatches of this process's addressable
  shards against expected(step); [] when exact), `ctx.matching_steps(state, n)`
  (per leaf, which step 0..n its local shards equal), `ctx.target_bytes(abstract)`
  (bytes of this process's unique addressable target boxes).
- `mh.main(fn)`: runs fn(ctx)-style code, reports a traceback as
  {"error": ...} and exits at once (os._exit) on an exception.

The state (a dict): "w" float32 P("data", "model"); "b" float32 P(None, "model")
(replicated over data: a data-parallel replica); "emb" int32 P("data", None);
"step" int32 scalar P(); "key" a typed PRNG key `jax.random.key(0)`. A step is
w*0.5+s, b+1, emb+s, step+1, fold_in(key, s): every value exact in float32, so
a restored step's values are known bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

# The directory that holds the resilient_ckpt package (a checkout, or site-packages):
# workers import the package from it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobTimeout(AssertionError):
    """The job ran past its hard timeout; every process was SIGKILLed."""


@dataclasses.dataclass
class ProcResult:
    index: int
    rc: int | None
    stdout: str
    stderr: str
    results: list[dict]
    markers: list[str]
    killed: bool = False     # SIGKILLed at the test's request (a lost host)
    reaped: bool = False     # killed by the harness after a peer failed
    timed_out: bool = False  # killed by the harness's hard timeout

    def last(self, key: str | None = None, value=None) -> dict | None:
        """The last RESULT object (with `key`, and key == value if given)."""
        for r in reversed(self.results):
            if key is None or (key in r and (value is None or r[key] == value)):
                return r
        return None

    def tail(self, n: int = 3000) -> str:
        return (f"--- process {self.index} rc={self.rc} killed={self.killed} "
                f"reaped={self.reaped} timed_out={self.timed_out}\n"
                f"stdout: ...{self.stdout[-n // 3:]}\nstderr: ...{_quiet(self.stderr)[-n:]}")

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not (self.killed or self.reaped or self.timed_out)


def _quiet(text: str) -> str:
    """stderr without the C++ log lines gloo and XLA print at start-up."""
    keep = [ln for ln in text.splitlines()
            if not (len(ln) > 1 and ln[0] in "IW" and ln[1:5].isdigit())]
    return "\n".join(keep)


def describe(results: Sequence[ProcResult], n: int = 2500) -> str:
    return "\n".join(r.tail(n) for r in results)


class Job:
    """A running job: its processes, their output so far, and a watchdog."""

    def __init__(self, procs: list[subprocess.Popen], timeout_s: float, workdir: str,
                 port: int, remove_workdir: bool, fail_fast_s: float):
        self.procs, self.workdir, self.port = procs, workdir, port
        self.timeout_s, self.fail_fast_s = timeout_s, fail_fast_s
        self._remove = remove_workdir
        self._out: list[list[str]] = [[] for _ in procs]
        self._err: list[list[str]] = [[] for _ in procs]
        self._killed = [False] * len(procs)
        self._reaped = [False] * len(procs)
        self._timed_out = False
        self._cond = threading.Condition()
        self._done = threading.Event()
        self._readers = []
        for i, p in enumerate(procs):
            for stream, sink in ((p.stdout, self._out[i]), (p.stderr, self._err[i])):
                t = threading.Thread(target=self._read, args=(stream, sink), daemon=True)
                t.start()
                self._readers.append(t)
        self._deadline = time.monotonic() + timeout_s
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()
        self._timers: list[threading.Thread] = []

    # ------------------------------------------------------------ output

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cond:
                sink.append(line.rstrip("\n"))
                self._cond.notify_all()
        stream.close()
        with self._cond:
            self._cond.notify_all()

    def lines(self, i: int) -> list[str]:
        """Process i's stdout lines so far."""
        with self._cond:
            return list(self._out[i])

    def wait_for(self, i: int, marker: str, timeout: float | None = None) -> bool:
        """Waits until process i printed a line starting with `marker`; False if
        it exited first or `timeout` (default: the job's deadline) passed."""
        end = min(self._deadline, time.monotonic() + timeout) if timeout else self._deadline
        with self._cond:
            while True:
                if any(ln.startswith(marker) for ln in self._out[i]):
                    return True
                left = end - time.monotonic()
                if left <= 0 or (self.procs[i].poll() is not None
                                 and not self._readers[2 * i].is_alive()):
                    return False
                self._cond.wait(min(left, 0.2))

    def wait_all(self, marker: str, timeout: float | None = None) -> bool:
        return all(self.wait_for(i, marker, timeout) for i in range(len(self.procs)))

    # ------------------------------------------------------------ killing

    def kill(self, i: int) -> None:
        """SIGKILL process i (by its pid): a lost host."""
        p = self.procs[i]
        if p.poll() is None:
            self._killed[i] = True
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

    def kill_after(self, i: int, delay_s: float, after: str | None = None) -> None:
        """In the background: SIGKILL process i `delay_s` seconds after it
        printed a line starting with `after` (or from now, with after=None)."""
        def go():
            if after is not None and not self.wait_for(i, after):
                return
            if not self._done.wait(delay_s):
                self.kill(i)
        t = threading.Thread(target=go, daemon=True)
        t.start()
        self._timers.append(t)

    def _reap(self, i: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            self._reaped[i] = True
            try:
                p.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _watch(self) -> None:
        failed_at = None
        while not self._done.is_set():
            if time.monotonic() >= self._deadline:
                self._timed_out = True
                for i in range(len(self.procs)):
                    self._reap(i)
                return
            rcs = [p.poll() for p in self.procs]
            if all(rc is not None for rc in rcs):
                return
            if failed_at is None and any(
                    rc not in (None, 0) and not self._killed[i] for i, rc in enumerate(rcs)):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= self.fail_fast_s:
                for i in range(len(self.procs)):
                    self._reap(i)
            self._done.wait(0.1)

    # ------------------------------------------------------------ the end

    def collect(self, raise_on_timeout: bool = True) -> list[ProcResult]:
        """Waits for every process (the watchdog bounds the wait), then returns
        their results; raises JobTimeout if the hard timeout killed the job."""
        for p in self.procs:
            p.wait()
        for t in self._readers:
            t.join(10)
        self._done.set()
        self._watchdog.join(5)
        out = []
        for i, p in enumerate(self.procs):
            stdout = "\n".join(self._out[i])
            results, markers = [], []
            for ln in self._out[i]:
                if ln.startswith("RESULT "):
                    try:
                        results.append(json.loads(ln[len("RESULT "):]))
                    except ValueError:
                        markers.append(ln)
                else:
                    markers.append(ln)
            out.append(ProcResult(i, p.returncode, stdout, "\n".join(self._err[i]), results,
                                  markers, self._killed[i], self._reaped[i], self._timed_out))
        if self._remove:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._timed_out and raise_on_timeout:
            raise JobTimeout(f"job ran past its {self.timeout_s:.0f} s timeout; every "
                             f"process was killed\n{describe(out)}")
        return out

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        if not self._done.is_set():
            for i in range(len(self.procs)):
                self._reap(i)
            for p in self.procs:
                p.wait()
            self._done.set()
            if self._remove:
                shutil.rmtree(self.workdir, ignore_errors=True)


def _script_path(script: str | os.PathLike, workdir: str) -> str:
    s = os.fspath(script)
    if "\n" not in s and s.endswith(".py") and os.path.isfile(s):
        return os.path.abspath(s)
    path = os.path.join(workdir, "worker.py")
    with open(path, "w") as f:
        f.write(s)
    return path


def start_job(script: str | os.PathLike, nprocs: int, devices_per_proc: int,
              args: Sequence[str] | Callable[[int], Sequence[str]] = (),
              timeout_s: float = 120, env: dict | None = None, workdir: str | None = None,
              fail_fast_s: float = 10.0, *, heartbeat_timeout_s: int = 20,
              src: str | None = None) -> Job:
    """Starts the job and returns at once. `script`: the worker's text, or the
    path of a .py file. `args`: extra arguments for every process, or a
    function of the process index giving them. `env`: variables added to (or,
    with value None, removed from) this process's environment.
    `heartbeat_timeout_s`: jax.distributed's, after which the coordinator
    declares a silent process lost. `src`: the directory the workers import
    the package from (default: the tree of this module)."""
    if heartbeat_timeout_s < 1:
        raise ValueError(f"heartbeat_timeout_s must be at least 1 (seconds, whole), "
                         f"not {heartbeat_timeout_s}")
    remove = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="rc-mh-")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "mh.py"), "w") as f:
        f.write(WORKER_LIB)
    path = _script_path(script, workdir)
    port = free_port()
    base = {k: v for k, v in os.environ.items()
            if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "PYTEST_CURRENT_TEST")}
    src = src or REPO  # or another checkout of the package to run (e.g. a baseline)
    base["PYTHONPATH"] = os.pathsep.join(
        [workdir, src] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    base["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_proc}"
    base["JAX_PLATFORMS"] = "cpu"
    base.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base["PYTHONUNBUFFERED"] = "1"
    for k, v in (env or {}).items():
        if v is None:
            base.pop(k, None)
        else:
            base[k] = str(v)
    procs = []
    try:
        for i in range(nprocs):
            extra = list(args(i) if callable(args) else args)
            cmd = [sys.executable, path, "--port", str(port), "--pid", str(i),
                   "--nprocs", str(nprocs), "--devices", str(devices_per_proc),
                   "--heartbeat-timeout-s", str(heartbeat_timeout_s), *extra]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, env=base, cwd=workdir))
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return Job(procs, timeout_s, workdir, port, remove, fail_fast_s)


def run_job(script: str | os.PathLike, nprocs: int, devices_per_proc: int,
            args: Sequence[str] | Callable[[int], Sequence[str]] = (),
            timeout_s: float = 120, env: dict | None = None, workdir: str | None = None,
            fail_fast_s: float = 10.0, raise_on_timeout: bool = True, *,
            heartbeat_timeout_s: int = 20, src: str | None = None) -> list[ProcResult]:
    """Runs the job to its end (or its hard timeout) and returns each process's
    result, in process order."""
    job = start_job(script, nprocs, devices_per_proc, args, timeout_s, env, workdir,
                    fail_fast_s, heartbeat_timeout_s=heartbeat_timeout_s, src=src)
    return job.collect(raise_on_timeout)


def step_dirs(path: str) -> list[int]:
    """Step numbers of the directories named by digits under `path`."""
    if not os.path.isdir(path):
        return []
    return sorted(int(n) for n in os.listdir(path)
                  if n.isdigit() and os.path.isdir(os.path.join(path, n)))


# ====================================================================== worker side

WORKER_LIB = r'''
"""Worker-side helpers of resilient_ckpt.testing.multiprocess (written as mh.py)."""
import argparse
import json
import os
import sys
import time
import traceback


def report(obj):
    """One result line: RESULT <json>."""
    sys.stdout.write("RESULT " + json.dumps(obj, default=_jsonable) + "\n")
    sys.stdout.flush()


def mark(text):
    sys.stdout.write(str(text) + "\n")
    sys.stdout.flush()


def _jsonable(x):
    try:
        import numpy as np
        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    if isinstance(x, (set, frozenset, tuple)):
        return sorted(x) if isinstance(x, (set, frozenset)) else list(x)
    return repr(x)


def main(fn, ctx):
    """Runs fn(ctx); on an exception reports {"error": traceback} and exits at
    once (a clean exit would wait in the distributed shutdown barrier)."""
    try:
        fn(ctx)
    except BaseException:
        report({"error": traceback.format_exc()[-4000:], "pid": ctx.pid})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
    sys.stdout.flush()


# ------------------------------------------------------------------ the state

def state_shapes(nbytes=1 << 20):
    """Leaf name -> (shape, dtype name, spec) for about `nbytes` of state:
    w half of it, b and emb a quarter each; rows a multiple of 16."""
    def rows(share, row_bytes):
        return max(16, int(nbytes * share // row_bytes) // 16 * 16)
    return {
        "w": ((rows(0.5, 256 * 4), 256), "float32", ("data", "model")),
        "b": ((rows(0.25, 256 * 4), 256), "float32", (None, "model")),
        "emb": ((rows(0.25, 128 * 4), 128), "int32", ("data", None)),
        "step": ((), "int32", ()),
        "key": ((), "key", ()),
    }


# The restore target of a resharded restore: on a (2, 4) mesh, row splits that
# line up with the saved (4, 2) chunks (whole chunks or whole rows of them).
RESHARD_SPECS = {"w": ("model", None), "b": (None, None), "emb": ("model", None),
                 "step": (), "key": ()}


def _initial_host(name, shape, dtype):
    import numpy as np
    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.uint64)
    if name == "w":  # pseudo-random 20-bit values / 1024: exact in float32
        return (((i * 2654435761) % (1 << 20)).astype(np.float32) / 1024).reshape(shape)
    if name == "b":
        return (((i * 40503 + 7) % (1 << 18)).astype(np.float32) / 256).reshape(shape)
    if name == "emb":
        return ((i * 2246822519 + 3) % (1 << 30)).astype(np.int32).reshape(shape)
    if name == "step":
        return np.zeros((), np.int32)
    raise KeyError(name)


_EXPECTED = {}


def expected(step, shapes):
    """Host numpy values of every leaf after `step` steps (key: its key data)."""
    import numpy as np
    import jax
    sig = json.dumps({k: v[0] for k, v in shapes.items()})
    cache = _EXPECTED.setdefault(sig, {})
    if step in cache:
        return cache[step]
    done = max([s for s in cache if s <= step], default=None)
    if done is None:
        cur = {k: _initial_host(k, v[0], v[1]) for k, v in shapes.items() if k != "key"}
        cur["key"] = np.asarray(jax.random.key_data(jax.random.key(0)))
        done = 0
        cache[0] = cur
    cur = cache[done]
    for s in range(done + 1, step + 1):
        nxt = {"w": cur["w"] * np.float32(0.5) + np.float32(s),
               "b": cur["b"] + np.float32(1),
               "emb": cur["emb"] + np.int32(s),
               "step": np.asarray(cur["step"] + 1, np.int32)}
        k = jax.random.wrap_key_data(cur["key"])
        nxt["key"] = np.asarray(jax.random.key_data(jax.random.fold_in(k, s)))
        cache[s] = cur = nxt
        # Every step's state kept would be steps x the state (25 GB for 200
        # steps of 128 MB): above 256 MB in all, keep only the newest.
        if len(cache) * sum(v.nbytes for v in cur.values()) > 1 << 28:
            for old in [t for t in cache if t != s]:
                del cache[old]
    return cur


class Ctx:
    pass


def init(argv=None):
    argv = sys.argv if argv is None else argv
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--pid", type=int, default=0)
    p.add_argument("--nprocs", type=int, default=1)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--heartbeat-timeout-s", type=int, default=20,
                   help="jax.distributed's heartbeat timeout: a lost peer is noticed after it")
    p.add_argument("--dir", default=None, help="the shared directory")
    p.add_argument("--ram", default=None, help="this host's RAM-tier path ({pid} is replaced)")
    p.add_argument("--state-bytes", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None,
                   help="mesh shape: 2,4 (data, model; default -1,2) or 2,2,2 (replica, "
                        "data, model: the state is replicated over replica)")
    a, extra = p.parse_known_args(argv[1:])
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(
        flags + [f"--xla_force_host_platform_device_count={a.devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    t0 = time.time()
    import jax
    import numpy as np
    if a.nprocs > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}",
                                   num_processes=a.nprocs, process_id=a.pid,
                                   initialization_timeout=60,
                                   heartbeat_timeout_seconds=a.heartbeat_timeout_s,
                                   shutdown_timeout_seconds=30)
    ctx = Ctx()
    ctx.args, ctx.extra = a, extra
    ctx.pid, ctx.nprocs = a.pid, a.nprocs
    ctx.dir = a.dir
    ctx.ram = a.ram.replace("{pid}", str(a.pid)) if a.ram else None
    ctx.shapes = state_shapes(a.state_bytes)
    ctx.init_s = time.time() - t0
    ctx.mesh = make_mesh(a.mesh)
    bind(ctx)
    return ctx


def make_mesh(shape=None):
    import jax
    import numpy as np
    from jax.sharding import Mesh
    dims = tuple(int(x) for x in shape.split(",")) if shape else (-1, 2)
    names = ("data", "model") if len(dims) == 2 else ("replica", "data", "model")
    return Mesh(np.array(jax.devices()).reshape(dims), names)


def bind(ctx):
    """Binds to `ctx` the functions of its state on its mesh (`ctx.shapes`,
    `ctx.mesh`): `sharding`, `initial_state`, `train_step`, `step_fn`,
    `abstract`, `check_exact`, `matching_steps`, `target_bytes`, `state_bytes`,
    `expected`. Again after a change of mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    def sharding(name, mesh=None, specs=None):
        spec = (specs or {}).get(name, ctx.shapes[name][2])
        return NamedSharding(mesh or ctx.mesh, P(*spec))

    def initial_state():
        out = {}
        for name, (shape, dtype, _) in ctx.shapes.items():
            if name == "key":
                continue
            host = _initial_host(name, shape, dtype)
            out[name] = jax.make_array_from_callback(shape, sharding(name),
                                                     lambda idx, h=host: h[idx])
        out["key"] = jax.jit(lambda: jax.random.key(0), out_shardings=sharding("key"))()
        return out

    shard_tree = {n: sharding(n) for n in ctx.shapes}

    def _step(state, s):
        sf = s.astype(jnp.float32)
        return {"w": state["w"] * jnp.float32(0.5) + sf, "b": state["b"] + jnp.float32(1),
                "emb": state["emb"] + s.astype(jnp.int32), "step": state["step"] + 1,
                "key": jax.random.fold_in(state["key"], s)}

    step_fn = jax.jit(_step, out_shardings=shard_tree)

    def train_step(state, step):
        return step_fn(state, jnp.int32(step))

    def abstract(mesh=None, specs=None):
        out = {}
        for name, (shape, dtype, _) in ctx.shapes.items():
            dt = jax.random.key(0).dtype if name == "key" else np.dtype(dtype)
            out[name] = jax.ShapeDtypeStruct(shape, dt, sharding=sharding(name, mesh, specs))
        return out

    def _local(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return x

    def check_exact(state, step):
        """Mismatches of this process's addressable shards against expected(step)."""
        exp = expected(step, ctx.shapes)
        bad = []
        if sorted(state) != sorted(exp):
            return [f"leaves {sorted(state)} != {sorted(exp)}"]
        for name in sorted(exp):
            x = _local(state[name])
            want = exp[name]
            if tuple(x.shape) != tuple(want.shape) or np.dtype(x.dtype) != want.dtype:
                bad.append(f"{name}: {x.shape} {x.dtype} != {want.shape} {want.dtype}")
                continue
            for s in x.addressable_shards:
                got = np.asarray(s.data)
                if not np.array_equal(got, want[s.index]):
                    bad.append(f"{name}{s.index} on {s.device}")
        return bad

    def matching_steps(state, upto):
        """Per leaf: the step 0..upto whose expected values this process's shards
        equal (None: none), to tell a mixed step from a wrong one."""
        out = {}
        for name in sorted(ctx.shapes):
            x = _local(state[name])
            shards = [(s.index, np.asarray(s.data)) for s in x.addressable_shards]
            out[name] = None
            for k in range(upto, -1, -1):
                want = expected(k, ctx.shapes)[name]
                if tuple(want.shape) == tuple(x.shape) and all(
                        np.array_equal(d, want[i]) for i, d in shards):
                    out[name] = k
                    break
        return out

    def target_bytes(abstract_tree):
        """Bytes of this process's unique addressable target boxes."""
        total = 0
        for name, a in abstract_tree.items():
            itemsize = 8 if name == "key" else np.dtype(a.dtype).itemsize  # threefry: 2 x u32
            boxes = set()
            for d, idx in a.sharding.addressable_devices_indices_map(a.shape).items():
                boxes.add(tuple((sl.start or 0, sl.stop if sl.stop is not None else n)
                                for sl, n in zip(idx, a.shape)))
            for box in boxes:
                total += int(np.prod([hi - lo for lo, hi in box], dtype=np.int64)) * itemsize
        return total

    def state_bytes():
        return sum(int(np.prod(shape, dtype=np.int64)) * (8 if d == "key" else np.dtype(d).itemsize)
                   for shape, d, _ in ctx.shapes.values())

    ctx.sharding, ctx.initial_state, ctx.train_step = sharding, initial_state, train_step
    ctx.step_fn = step_fn  # jit of (state, int32 step), for ahead-of-time compiles
    ctx.abstract, ctx.check_exact, ctx.matching_steps = abstract, check_exact, matching_steps
    ctx.target_bytes, ctx.state_bytes = target_bytes, state_bytes
    ctx.expected = lambda step: expected(step, ctx.shapes)


# ------------------------------------------------------------------ managers

def ours(ctx, ram_every=1, ram_keep=2, local_every=3, local_keep=2, ram=None, local=None,
         vote=None):
    """resilient_ckpt's manager through its public API: this host's RAM tier
    (ctx.ram) and the shared local tier (ctx.dir); `vote`: its agreement_vote."""
    import resilient_ckpt as rc
    tiers = []
    if ram is not False and (ram or ctx.ram):
        tiers.append(rc.RamTier(path=ram or ctx.ram, every=ram_every, keep=ram_keep))
    tiers.append(rc.LocalTier(path=local or ctx.dir, every=local_every, keep=local_keep))
    return rc.CheckpointManager(local or ctx.dir, options=rc.CheckpointManagerOptions(
        tiers=tiers, agreement_vote=vote))




def orbax(ctx, every=1, keep=2, directory=None):
    """Orbax's own CheckpointManager on the shared directory."""
    import orbax.checkpoint as ocp
    return ocp.CheckpointManager(directory or ctx.dir, options=ocp.CheckpointManagerOptions(
        save_interval_steps=every, max_to_keep=keep))


def orbax_emergency(ctx, local_dir, persistent_dir, abstract_tree, local_every=1,
                    local_keep=2, persistent_every=3, persistent_keep=2):
    """Orbax's emergency CheckpointManager (this host's local directory and the
    shared persistent one), after the multihost set-up it needs. The mesh must
    have a replica axis first (--mesh N,..., one replica per process)."""
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["worker"])
    from orbax.checkpoint._src.multihost import multihost as omh
    if not omh.is_runtime_to_distributed_ids_initialized():
        omh.initialize_runtime_to_distributed_ids()
    if not omh.is_distributed_to_device_ids_initialized():
        omh.initialize_distributed_to_device_ids()
    from orbax.checkpoint.experimental.emergency import checkpoint_manager as em
    os.makedirs(local_dir, exist_ok=True)
    os.makedirs(persistent_dir, exist_ok=True)
    options = em.CheckpointManagerOptions(
        local=em.LocalCheckpointOptions(save_interval_steps=local_every,
                                        max_to_keep=local_keep),
        persistent=em.PersistentCheckpointOptions(save_interval_steps=persistent_every,
                                                  max_to_keep=persistent_keep))
    return em.CheckpointManager(local_directory=local_dir, persistent_directory=persistent_dir,
                                global_mesh=ctx.mesh, abstract_state=orbax_abstract(abstract_tree),
                                options=options)


def barrier(name):
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def orbax_state(state):
    """The state as Orbax's control saves it: the typed key as its key data."""
    import jax
    out = dict(state)
    if "key" in out:
        out["key"] = jax.random.key_data(out["key"])
    return out


def orbax_abstract(abstract_tree):
    import jax
    out = dict(abstract_tree)
    k = out.get("key")
    if k is not None:
        out["key"] = jax.eval_shape(jax.random.key_data, k)
        out["key"] = jax.ShapeDtypeStruct(out["key"].shape, out["key"].dtype,
                                          sharding=k.sharding)
    return out


def from_orbax(restored):
    import jax
    out = dict(restored)
    if "key" in out:
        out["key"] = jax.random.wrap_key_data(out["key"])
    return out
'''
