"""The elastic loop on 8 real CPU devices, with simulated device loss.

Meshes, shardings, resharding, compiles and checkpoints are all real; the one
simulated part is the fault: `resilient_ckpt.testing.faults` raises
JaxRuntimeError("DATA_LOSS: ...") at a chosen step and deletes the "lost"
devices' buffers, and those devices fail health checks until repaired.

The training step works on unsigned integers (wrapping arithmetic plus a
cross-device sum), so its result does not depend on the mesh it runs on, and a
numpy model of it (`reference`) says exactly what every step's state must be.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools
import json
import threading
import time

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointError, RecoveryFailedError, elastic
from resilient_ckpt.elastic import (
    Elastic,
    HealthCheck,
    RecoveryPolicy,
    failures,
    format_timeline,
    shrink_data_axis,
)
from resilient_ckpt.testing.faults import DeviceFault, FaultInjector, delete_buffers_on
from tests.support import effort
from tests.support.tiers import manager

SHAPE = (16, 8)


# ------------------------------------------------------------------ the model

def init_host() -> dict:
    return {"w": np.arange(np.prod(SHAPE), dtype=np.uint32).reshape(SHAPE),
            "b": (np.arange(SHAPE[1], dtype=np.uint32) * np.uint32(7)),
            "n": np.uint32(0)}


def reference(steps: int) -> list[dict]:
    """Host states after 0..steps steps, computed with numpy."""
    out = [init_host()]
    for _ in range(steps):
        s = out[-1]
        total = s["w"].sum(dtype=np.uint32)
        out.append({"w": s["w"] * np.uint32(1664525) + np.uint32(1013904223) + total
                    + s["b"][None, :] + s["n"],
                    "b": s["b"] ^ (total >> np.uint32(3)),
                    "n": s["n"] + np.uint32(1)})
    return out


def shardings(mesh: Mesh) -> dict:
    return {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model")),
            "n": NamedSharding(mesh, P())}


def _step(s):
    total = jnp.sum(s["w"], dtype=jnp.uint32)
    return {"w": s["w"] * np.uint32(1664525) + np.uint32(1013904223) + total
            + s["b"][None, :] + s["n"],
            "b": s["b"] ^ (total >> np.uint32(3)), "n": s["n"] + np.uint32(1)}


def build(mesh: Mesh, aot: bool = False):
    """(step fn, abstract state, init) for `mesh`; with aot, the step is compiled here."""
    sh = shardings(mesh)
    abstract = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=sh[k])
                for k, v in init_host().items()}
    step = jax.jit(_step, donate_argnums=0, out_shardings=sh)
    if aot:
        step = step.lower(abstract).compile()
    return step, abstract, lambda: jax.device_put(init_host(), sh)


def host(state: dict) -> dict:
    return {k: np.asarray(v) for k, v in state.items()}


def assert_state(got: dict, want: dict, what: str) -> None:
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k], err_msg=f"{what}: leaf {k}")


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def devices():
    return jax.devices()[:8]


@pytest.fixture(scope="module")
def mesh(devices):
    return Mesh(np.array(devices).reshape(4, 2), ("data", "model"))


@pytest.fixture(scope="module")
def check(devices):
    """One real health check for the module, compiled once for every device."""
    hc = HealthCheck()
    hc.prepare(devices)
    return hc


def trainer(el: Elastic, faults: FaultInjector | None, total: int, seen: dict,
            hook=None, programs: bool = False):
    """The user's function: restore, then a plain loop. Records the state each
    (re)entry starts from in seen[step] (host copies)."""
    @el.run
    def train(mesh):
        step_fn, abstract, init = el.program(mesh) if programs else build(mesh)
        if faults is not None:
            step_fn = faults.wrap(step_fn)
        state, start = el.restore(abstract, init)
        seen.setdefault(start, []).append(host(state))
        for step in range(start + 1, total + 1):
            state = step_fn(step, state) if faults is not None else step_fn(state)
            if hook is not None:
                hook(step)
            el.save(step, state)
        return host(state)
    return train


def saved_steps(ram_every: int, local_every: int, upto: int) -> set[int]:
    """Steps the manager saves when every step is offered: the first save goes
    to every tier, then each tier's multiples."""
    return {1} | {s for s in range(1, upto + 1) if s % ram_every == 0 or s % local_every == 0}


# ------------------------------------------------------------------ classification

def _jre(text: str) -> Exception:
    return jax.errors.JaxRuntimeError(text)


def _process_failure() -> Exception:
    from jax.experimental.multihost_utils import ProcessFailureError
    return ProcessFailureError({jax.devices()[3]})


def _injected() -> Exception:
    faults = FaultInjector([DeviceFault(1, (7,))], check=HealthCheck())
    try:
        faults.before_step(1)
    except jax.errors.JaxRuntimeError as e:
        return e
    raise AssertionError("the injector did not raise")


def _named(exc: Exception, devices) -> Exception:
    exc.failed_devices = devices
    return exc


# (exception, recoverable, family): "pathways" rows must agree with pathwaysutils;
# the others ("multi-controller", "named": an exception naming its lost devices)
# are ours alone (pathwaysutils says False).
TABLE = [
    (lambda: _jre("DATA_LOSS: slice 1 is down"), True, "pathways"),
    (lambda: _jre("DEADLINE_EXCEEDED: barrier timed out"), True, "pathways"),
    (lambda: _jre("NOT_FOUND: buffer not found on device"), True, "pathways"),
    (lambda: _jre("INTERNAL: stream did not block host until done"), True, "pathways"),
    (lambda: _jre("INVALID_ARGUMENT: Executable expected shape f32[8] but got f32[4]"),
     False, "pathways"),
    (lambda: _jre("RESOURCE_EXHAUSTED: Out of memory allocating 4GiB"), False, "pathways"),
    (lambda: _jre("UNKNOWN: unrelated failure"), False, "pathways"),
    (lambda: _jre("UNIMPLEMENTED: no such op"), False, "pathways"),
    (_injected, True, "pathways"),
    (lambda: _jre("UNKNOWN: Gloo all-reduce failed: [../gloo/transport/tcp/pair.cc:534] "
                  "Connection closed by peer [127.0.0.1]:40183"), True, "multi-controller"),
    (lambda: _jre("UNKNOWN: Gloo all-gather failed: Read error [127.0.0.1]:5000: "
                  "Connection reset by peer"), True, "multi-controller"),
    (lambda: ValueError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
                        "pair.cc:538] Read error [127.0.0.1]:9101: Connection reset by peer"),
     # as jax 0.10.2 raised it (tests/elastic/test_elastic_multiprocess.py)
     True, "multi-controller"),
    (_process_failure, True, "multi-controller"),
    (lambda: failures.DeviceLossError([3, 4], "host 2 is gone"), True, "pathways"),
    (lambda: _named(RuntimeError("host 2 is gone"), [3, 4]), True, "named"),
    (lambda: _named(RuntimeError("a bug"), []), False, "pathways"),
    (lambda: _named(RuntimeError("a bug"), "not devices"), False, "pathways"),
    (lambda: _jre("UNKNOWN: Gloo context initialization failed: ALREADY_EXISTS"),
     False, "pathways"),
    (lambda: RuntimeError("DATA_LOSS: text alone is not enough"), False, "pathways"),
    (lambda: ValueError("shapes (8, 4) and (5,) do not broadcast"), False, "pathways"),
    (lambda: TypeError("unsupported operand"), False, "pathways"),
    (lambda: FileNotFoundError("no such file"), False, "pathways"),
    (lambda: RecoveryFailedError("gave up"), False, "pathways"),
    (lambda: KeyboardInterrupt(), False, "pathways"),
]


@pytest.mark.parametrize("make,recoverable,family", TABLE,
                         ids=[f"{i}-{r[2]}-{r[1]}" for i, r in enumerate(TABLE)])
def test_classifier_table(make, recoverable, family):
    exc = make()
    assert elastic.is_recoverable(exc) is recoverable
    try:
        from pathwaysutils.elastic import elastic as pathways
    except ImportError:
        pytest.skip("pathwaysutils is not installed (pip install -e '.[test]')")
    theirs = bool(pathways.is_error_due_to_slice_down(exc, log_traceback=False)) \
        if isinstance(exc, Exception) else False
    if family == "pathways":
        assert theirs is recoverable, "disagrees with pathwaysutils' is_error_due_to_slice_down"
    else:
        assert theirs is False and recoverable is True


@pytest.mark.parametrize("make,recoverable,family", TABLE,
                         ids=[f"{i}-{r[2]}-{r[1]}" for i, r in enumerate(TABLE)])
def test_classifier_without_pathwaysutils(monkeypatch, make, recoverable, family):
    """The built-in rule, used where pathwaysutils is absent, gives the same answers."""
    monkeypatch.setattr(failures, "_pathways_rule", lambda: None)
    assert elastic.is_recoverable(make()) is recoverable


def test_the_classifier_calls_pathwaysutils(monkeypatch):
    pytest.importorskip("pathwaysutils.elastic.elastic")
    calls = []
    rule = failures._pathways_rule()
    monkeypatch.setattr(failures, "_pathways_rule",
                        lambda: lambda e, **kw: calls.append(e) or rule(e, **kw))
    exc = _jre("DATA_LOSS: x")
    assert elastic.is_recoverable(exc) and calls == [exc]


def test_what_a_failure_says(devices):
    """failed_devices (devices or ids) and fault_time (a perf_counter reading
    not in the future) are read; anything else is ignored."""
    assert failures.named_lost(_named(RuntimeError(), {devices[2], devices[5]})) == {2, 5}
    assert failures.named_lost(_named(RuntimeError(), (7, 1))) == {1, 7}
    assert failures.named_lost(_named(RuntimeError(), [object()])) == frozenset()
    assert failures.named_lost(_process_failure()) == {3}
    assert failures.named_lost(_jre("DATA_LOSS: slice 1 is down")) == frozenset()
    now = time.perf_counter()
    e = failures.DeviceLossError([devices[6], 7], fault_time=now - 2.0)
    assert e.failed_devices == {6, 7} and "DATA_LOSS" in str(e) and "[6, 7]" in str(e)
    assert failures.fault_time(e, now) == now - 2.0
    e.fault_time = now + 60.0          # later than the loop saw it: not a perf_counter reading
    assert failures.fault_time(e, now) is None
    for bad in ("yesterday", True, float("nan")):
        e.fault_time = bad
        assert failures.fault_time(e, now) is None
    assert failures.fault_time(_jre("DATA_LOSS: x"), now) is None


# ------------------------------------------------------------------ parts

def test_shrink_data_axis(mesh, devices):
    d = devices
    assert shrink_data_axis(set(d), mesh) is not None
    assert shrink_data_axis(set(d), mesh).devices.tolist() == mesh.devices.tolist()
    m = shrink_data_axis(set(d[:4]), mesh)          # rows 2, 3 lost
    assert m.devices.tolist() == [[d[0], d[1]], [d[2], d[3]]] and m.axis_names == mesh.axis_names
    m = shrink_data_axis(set(d) - {d[5]}, mesh)     # 3 whole rows: 2 kept (divides 4)
    assert m.devices.tolist() == [[d[0], d[1]], [d[2], d[3]]]
    m = shrink_data_axis(set(d) - {d[0], d[3]}, mesh)  # rows 0 and 1 broken
    assert m.devices.tolist() == [[d[4], d[5]], [d[6], d[7]]]
    m = shrink_data_axis(set(d) - {d[0], d[3], d[4]}, mesh)
    assert m.devices.tolist() == [[d[6], d[7]]]
    assert shrink_data_axis({d[0], d[2], d[4], d[6]}, mesh) is None  # no whole row
    transposed = Mesh(mesh.devices.T, ("model", "data"))
    m = shrink_data_axis(set(d[:4]), transposed)
    assert m.axis_names == ("model", "data") and m.devices.T.tolist() == [[d[0], d[1]],
                                                                         [d[2], d[3]]]


def test_health_check_reports_errors_and_timeouts(devices):
    release = threading.Event()

    class Flaky(HealthCheck):
        def probe(self, device):
            if device.id == 2:
                raise jax.errors.JaxRuntimeError("DATA_LOSS: device 2 is gone")
            if device.id == 3:
                release.wait(30)  # a device that does not answer
            super().probe(device)

    hc = Flaky()
    try:
        healthy = hc(devices, timeout_s=1.0)
    finally:
        release.set()
    assert {d.id for d in healthy} == {0, 1, 4, 5, 6, 7}
    assert "DATA_LOSS" in hc.last_errors[2] and "no answer" in hc.last_errors[3]


def test_injector_deletes_lost_buffers_and_fails_their_health_checks(mesh, devices, check):
    faults = FaultInjector([DeviceFault(3, (4, 5, 6, 7), repair_step=6)], check=check)
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("data", "model")))
    safe = jax.device_put(np.ones(4), devices[1])
    faults.before_step(2, x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS") as info:
        faults.before_step(3, x)
    assert elastic.is_recoverable(info.value) and info.value.devices == (4, 5, 6, 7)
    with pytest.raises(jax.errors.JaxRuntimeError, match="deleted"):  # shards on 4-7 are gone
        np.asarray(x)
    assert np.asarray(safe).sum() == 4.0  # untouched: not on a lost device
    assert {d.id for d in faults.health_check(devices, 5.0)} == {0, 1, 2, 3}
    with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
        faults.before_step(4, jax.device_put(np.ones(2), devices[6]))  # computing on a lost one
    faults.before_step(6)
    assert faults.lost == frozenset()
    assert {d.id for d in faults.health_check(devices, 5.0)} == set(range(8))


def test_restore_target_must_be_on_the_current_mesh(mesh, devices, check):
    with manager() as mngr:
        el = Elastic(mngr, mesh, health_check=check)
        el.mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))
        with pytest.raises(ValueError, match="outside the current mesh"):
            el.restore(build(mesh)[1], init=lambda: None)


# ------------------------------------------------------------------ recovery

@hypothesis.settings(max_examples=effort.examples(10), deadline=None, derandomize=False,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(
    ram_every=st.integers(1, 4),
    fail_at=st.integers(2, 12),
    lost=st.sets(st.integers(0, 7), min_size=1, max_size=6).filter(
        lambda s: any(not {2 * r, 2 * r + 1} & s for r in range(4))),
    repair_after=st.one_of(st.none(), st.integers(1, 5)))
def test_recovery_at_random_steps_continues_exactly(mesh, devices, check, ram_every, fail_at,
                                                    lost, repair_after):
    total, local_every = fail_at + 10, 5
    want = reference(total)
    repair = None if repair_after is None else fail_at + repair_after
    faults = FaultInjector([DeviceFault(fail_at, tuple(lost), repair)], check=check)
    with manager(ram_every, local_every, keep=None) as mngr:
        el = Elastic(mngr, mesh, health_check=faults.health_check, rescale_every_s=0)
        seen: dict = {}
        final = trainer(el, faults, total, seen)()
        mngr.wait_until_finished()

        saved = saved_steps(ram_every, local_every, total)
        restored = max(s for s in saved if s <= fail_at - 1)
        fail = el.timeline[0]
        assert (fail.kind, fail.step, fail.outcome) == ("failure", fail_at, "resumed")
        assert set(fail.lost_devices) == lost
        expect_mesh = shrink_data_axis({d for d in devices if d.id not in lost}, mesh)
        assert fail.devices_after == tuple(sorted(d.id for d in expect_mesh.devices.flat))
        assert fail.restored_step == restored and fail.first_step == restored + 1
        assert fail.steps_lost == fail_at - 1 - restored <= ram_every - 1  # one RAM interval
        if restored % ram_every == 0 or restored == 1:
            assert set(fail.restored_from) == {"ram"}  # RAM tier first
        # The state the loop went on from is the one saved at that step...
        assert_state(seen[restored][-1], want[restored], f"state restored at step {restored}")
        step_fn, abstract, _ = build(mesh)
        saved_state = host(mngr.restore(restored, args=ocp.args.StandardRestore(abstract)))
        assert_state(seen[restored][-1], saved_state, f"state saved at step {restored}")
        # ...and training on reproduces an uninterrupted run, exactly.
        assert_state(final, want[total], "final state")
        # An uninterrupted run restored from that step (plain manager, full mesh) agrees.
        state = mngr.restore(restored, args=ocp.args.StandardRestore(abstract))
        for _ in range(restored + 1, total + 1):
            state = step_fn(state)
        assert_state(host(state), final, "uninterrupted run from the restored step")

        ups = [e for e in el.timeline if e.kind == "scale_up"]
        if repair is None:
            assert len(el.timeline) == 1 and el.mesh.size < 8
        else:
            grow = min(s for s in saved if s >= max(repair, restored + 1))
            if grow <= total:
                assert len(ups) == 1 and ups[0].step == grow and ups[0].steps_lost == 0
                assert ups[0].devices_after == tuple(range(8)) and el.mesh.size == 8
                assert ups[0].restored_from.keys() == {"live"}
                assert_state(seen[grow][-1], want[grow], "state after the scale-up")
        json.dumps(el.events)  # loggable as is


def test_scale_up_on_request_and_ahead_of_time_builds(mesh, devices, check):
    """With build=, the likely smaller mesh is built in the background before
    any failure, and a scale-up waits for request_rescale(), then for the first
    save point at which the larger mesh's program (built in the background) is ready."""
    builders: list[tuple[tuple, str]] = []
    full_built = threading.Event()

    def build_aot(m):
        builders.append((tuple(d.id for d in m.devices.flat), threading.current_thread().name))
        out = build(m, aot=True)
        if m.size == 8 and threading.current_thread().name == "rc-precompile":
            full_built.set()
        return out

    def hook(step):
        if step == 13:
            el.request_rescale()
        if step == 14:  # these steps are much faster than a compile: let it finish
            assert full_built.wait(120)

    faults = FaultInjector([DeviceFault(6, (6, 7), repair_step=8)], check=check)
    with manager(ram_every=3, local_every=100) as mngr:
        el = Elastic(mngr, mesh, health_check=faults.health_check, rescale_every_s=3600,
                     build=build_aot)
        seen: dict = {}
        final = trainer(el, faults, 40, seen,
                        hook=hook, programs=True)()
    small = (0, 1, 2, 3)
    assert (small, "rc-precompile") in builders  # built ahead, in the background
    assert [ids for ids, _ in builders].count(small) == 1
    assert [e.kind for e in el.timeline] == ["failure", "scale_up"]
    up = el.timeline[1]
    assert up.step >= 15 and up.step % 3 == 0 and up.steps_lost == 0  # a save point after 13
    assert ((0, 1, 2, 3, 4, 5, 6, 7), "rc-precompile") in builders
    assert_state(seen[up.step][-1], reference(up.step)[up.step], "state after the scale-up")
    assert el.timeline[0].restored_step == 3 and el.timeline[0].steps_lost == 2
    assert_state(final, reference(40)[40], "final state")


def test_non_recoverable_errors_are_raised_at_once(mesh, check):
    checks = []

    def spy(devs, timeout_s):
        checks.append(devs)
        return check(devs, timeout_s)

    for err in (ValueError("a shape bug"),
                jax.errors.JaxRuntimeError("INVALID_ARGUMENT: wrong shape")):
        with manager() as mngr:
            el = Elastic(mngr, mesh, health_check=spy)

            def hook(step, err=err):
                if step == 3:
                    raise err

            with pytest.raises(type(err)) as info:
                trainer(el, None, 10, {}, hook=hook)()
            assert info.value is err
            assert el.timeline == [] and checks == [] and len(mngr.restore_records) == 0


def test_gives_up_after_the_attempt_budget(mesh, check):
    faults = FaultInjector([DeviceFault(5, (6, 7)), DeviceFault(5, (4, 5)),
                            DeviceFault(5, (2, 3))], check=check)
    with manager(ram_every=1) as mngr:
        el = Elastic(mngr, mesh, health_check=faults.health_check,
                     retry=RecoveryPolicy(max_attempts=2))
        with pytest.raises(RecoveryFailedError) as info:
            trainer(el, faults, 10, {})()
    msg = str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, RuntimeError)
    assert "2 attempts without progress past step 4" in msg and "relaunch" in msg
    assert "No device was lost" not in msg  # each attempt lost two devices
    for n in (1, 2, 3):
        assert f"attempt {n}, step 5 failed" in msg
    assert "restored step 4 from ram" in msg and "newest viable checkpoint is step 4" in msg
    assert isinstance(info.value.__context__, jax.errors.JaxRuntimeError)
    assert [e.outcome.split(":")[0] for e in el.timeline] == ["failed again", "failed again",
                                                              "gave up"]


def test_gives_up_waiting_for_devices(mesh, check):
    faults = FaultInjector([DeviceFault(3, tuple(range(8)))], check=check)
    with manager(ram_every=1) as mngr:
        el = Elastic(mngr, mesh, health_check=faults.health_check,
                     retry=RecoveryPolicy(max_wait_s=0.3, poll_s=0.1))
        with pytest.raises(RecoveryFailedError, match=r"waited .* for a mesh of at least 1 "
                                                      r"devices; healthy: \[\]") as info:
            trainer(el, faults, 10, {})()
    assert "DATA_LOSS" in str(info.value)  # the health check's reason per device


def failing_at(schedule: dict[int, int], make, limit: int = 12):
    """A hook that raises make() when step s runs, schedule[s] times. Past
    `limit` failures in all it raises AssertionError (not recoverable), so a
    loop that never gives up fails the test instead of hanging it."""
    count = {"all": 0}

    def hook(step):
        if schedule.get(step, 0) > 0:
            schedule[step] -= 1
            count["all"] += 1
            if count["all"] > limit:
                raise AssertionError(f"still retrying after {limit} failures")
            raise make()
    return hook


@pytest.mark.parametrize("text", ["DATA_LOSS: slice 2 is down",
                                  "INTERNAL: a deterministic bug in the step"])
def test_a_failure_at_the_same_step_after_each_restore_ends(mesh, check, text):
    """Restore 6, step 7 completes again, step 8 fails again: replayed steps
    are not progress, so the attempts run out (they used to reset at step 7)."""
    hook = failing_at({8: 100}, lambda: jax.errors.JaxRuntimeError(text))
    seen: dict = {}
    with manager(ram_every=2, local_every=100) as mngr:
        el = Elastic(mngr, mesh, health_check=check, rescale_every_s=3600,
                     retry=RecoveryPolicy(max_attempts=3))
        with pytest.raises(RecoveryFailedError) as info:
            trainer(el, None, 12, seen, hook=hook)()
    msg = str(info.value)
    assert "3 attempts without progress past step 7" in msg
    for n in (1, 2, 3, 4):
        assert f"attempt {n}, step 8 failed (JaxRuntimeError: {text})" in msg
    assert msg.count("restored step 6 from ram") == 3
    assert msg.count("lost devices [] (by the health check)") == 3
    assert "No device was lost in any attempt, and step 8 failed again" in msg
    assert "newest viable checkpoint is step 6" in msg
    assert info.value.__cause__ is not None and str(info.value.__cause__) == text
    assert [e.step for e in el.timeline] == [8, 8, 8, 8]
    assert [e.outcome.split(":")[0] for e in el.timeline] == [
        "resumed at step 7, then step 8 failed before any progress"] * 3 + ["gave up"]
    assert len(seen[6]) == 3  # re-entered from step 6 three times, replaying step 7 each time


def test_only_a_step_past_the_failure_renews_the_attempt_budget(mesh, check):
    """With one attempt: failing at 8, then at 9 goes on (step 8 completed in
    between: progress); failing at 8 twice ends (step 7 again is no progress)."""
    bug = lambda: jax.errors.JaxRuntimeError("INTERNAL: flaky")  # noqa: E731
    with manager(ram_every=2, local_every=100) as mngr:
        el = Elastic(mngr, mesh, health_check=check, rescale_every_s=3600,
                     retry=RecoveryPolicy(max_attempts=1))
        final = trainer(el, None, 12, {}, hook=failing_at({8: 1, 9: 1}, bug))()
    assert [(e.step, e.restored_step, e.outcome) for e in el.timeline] == [
        (8, 6, "resumed"), (9, 8, "resumed")]
    assert_state(final, reference(12)[12], "final state")
    with manager(ram_every=2, local_every=100) as mngr:
        el = Elastic(mngr, mesh, health_check=check, rescale_every_s=3600,
                     retry=RecoveryPolicy(max_attempts=1))
        with pytest.raises(RecoveryFailedError, match="1 attempts without progress past step 7"):
            trainer(el, None, 12, {}, hook=failing_at({8: 2}, bug))()


@pytest.mark.parametrize("kind", ["DeviceLossError", "ProcessFailureError"])
def test_the_devices_a_failure_names_are_dropped_without_a_health_check(mesh, devices, kind):
    """No health_check hook: the real check would find all 8 CPU devices
    healthy, so going on with 4 shows the loop took the failure's word; its
    fault_time is where the detection time starts."""
    lost = (4, 5, 6, 7) if kind == "DeviceLossError" else (0, 1)
    fault_time = time.perf_counter() - 1000.0  # far enough back that nothing else explains it

    def hook(step):
        if step == 5 and not el.timeline:
            delete_buffers_on(lost)  # as a real loss would: the step's output is gone
            if kind == "DeviceLossError":
                raise failures.DeviceLossError([devices[i] for i in lost], "host lost",
                                               fault_time=fault_time)
            from jax.experimental.multihost_utils import ProcessFailureError
            raise ProcessFailureError({devices[i] for i in lost})

    with manager(ram_every=2, local_every=100) as mngr:
        el = Elastic(mngr, mesh, rescale_every_s=3600)
        final = trainer(el, None, 8, {}, hook=hook)()
    (ev,) = el.timeline
    assert (ev.step, ev.lost_devices, ev.lost_from, ev.outcome) == (5, lost, "failure",
                                                                    "resumed")
    keep = (0, 1, 2, 3) if kind == "DeviceLossError" else (2, 3, 4, 5)
    assert ev.devices_after == keep and mesh_ids_of(el.mesh) == keep
    if kind == "DeviceLossError":
        assert ev.detect_s >= 1000.0 and ev.total_s >= 1000.0
    else:
        assert ev.detect_s < 1000.0  # no fault_time: from the last completed step
    assert ev.restored_step == 4
    assert_state(final, reference(8)[8], "final state")


def mesh_ids_of(m: Mesh) -> tuple:
    return tuple(sorted(d.id for d in m.devices.flat))


def test_compiled_says_whether_a_meshs_program_is_ready(mesh, devices, check):
    gate = threading.Event()

    def build_gated(m):
        if m.size < 8:
            assert gate.wait(120), "the test never released the build"
        return build(m, aot=True)

    with manager() as mngr:
        assert not Elastic(mngr, mesh, health_check=check).compiled(mesh)  # no build=
        el = Elastic(mngr, mesh, health_check=check, build=build_gated, rescale_every_s=3600)
        try:
            assert not el.compiled(mesh)
            step_fn, _, init = el.program(mesh)
            assert el.compiled(mesh) and el.compiled(devices)   # devices: the mesh they make
            el.save(1, step_fn(init()))        # starts building the likely smaller mesh
            assert not el.compiled(devices[:6])              # being built (held at the gate)
            assert not el.compiled([devices[0], devices[2]])  # no whole row: no mesh
        finally:
            gate.set()
        small = shrink_data_axis(set(devices[:6]), mesh)
        el.program(small)                      # waits for the background build
        assert el.compiled(small) and el.compiled(devices[:6]) and el.compiled(devices[:4])


def test_progress_renews_the_attempt_budget(mesh, check):
    faults = FaultInjector([DeviceFault(4, (6, 7), repair_step=6), DeviceFault(12, (0, 1))],
                           check=check)
    with manager(ram_every=2) as mngr:
        el = Elastic(mngr, mesh, health_check=faults.health_check, rescale_every_s=0,
                     retry=RecoveryPolicy(max_attempts=1))
        final = trainer(el, faults, 16, {})()
    assert [(e.kind, e.step, e.outcome) for e in el.timeline] == [
        ("failure", 4, "resumed"), ("scale_up", 6, "resumed"), ("failure", 12, "resumed")]
    assert el.timeline[2].devices_after == (2, 3, 4, 5)  # rows 1 and 2: the first whole ones
    assert_state(final, reference(16)[16], "final state")
    table = format_timeline(el.timeline)
    assert len(table.splitlines()) == 4 and "scale_up" in table and "ram 100%" in table


@pytest.mark.slow  # 8 s: a subprocess; the timeline tests above cover the loop
def test_elastic_demo_end_to_end():
    """`python -m resilient_ckpt.demo --elastic`, small: fail, go on with 4, grow back to 8."""
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "resilient_ckpt.demo", "--elastic", "--mb", "4", "--steps", "24",
         "--fail-at", "8", "--repair-at", "14", "--grow-wait-s", "0"],
        capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "-- 4 devices, mesh {'data': 2, 'model': 2}, from step 6" in out.stdout, out.stdout
    assert "-- 8 devices, mesh {'data': 4, 'model': 2}, from step 15" in out.stdout, out.stdout
    for text in ("recovery timeline", "failure   8", "6 (ram 100%)", "scale_up  15",
                 "15 (live 100%)", "loss at the end"):
        assert text in out.stdout, out.stdout


def test_programs_are_built_ahead_for_the_mesh_after_the_next_loss(mesh, devices):
    """After a loss the likely next mesh is one more row lost from the mesh
    trained on now, not from the full one; each mesh's likely next is built
    once, in the background."""
    from resilient_ckpt.elastic.programs import Programs, likely_meshes
    choose = functools.partial(shrink_data_axis, divisor=False)
    small = choose(set(devices[:6]), mesh)               # devices 6 and 7 were lost
    assert mesh_ids_of(small) == tuple(range(6))
    [after_full] = likely_meshes(choose, mesh, "data", 1)
    [after_small] = likely_meshes(choose, mesh, "data", 1, current=small)
    assert mesh_ids_of(after_full) == tuple(range(6))
    assert mesh_ids_of(after_small) == tuple(range(4))   # its last row (4, 5) lost too
    built: list[tuple] = []
    done = threading.Semaphore(0)

    def build_ids(m):
        built.append(mesh_ids_of(m))
        done.release()
        return m
    programs = Programs(build_ids, precompile=1)
    for current in (mesh, mesh, small, small):
        programs.start_likely(choose, mesh, "data", current)
    assert done.acquire(timeout=60) and done.acquire(timeout=60)
    assert not done.acquire(timeout=0.5)                 # each mesh's next built once
    assert sorted(built) == [tuple(range(4)), tuple(range(6))]
    assert programs.built(after_small) and programs.built(after_full)
    programs.drop([5])                                   # a loss drops (0..5)'s program
    programs.start_likely(choose, mesh, "data", mesh)    # back on the full mesh: again
    assert done.acquire(timeout=60) and built[-1] == tuple(range(6))
    assert programs.built(after_full) and programs.built(after_small)
