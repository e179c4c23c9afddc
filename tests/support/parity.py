"""The parity tests' harness (tests/compat/): the same calls on Orbax's manager
and on ours, each in its own directory, and comparisons of what they return or
raise."""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc

P = jax.sharding.PartitionSpec


NS = jax.sharding.NamedSharding


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    manager: type
    options: type  # the options class this side is configured with


ORBAX = Impl("orbax", ocp.CheckpointManager, ocp.CheckpointManagerOptions)


OURS = Impl("ours", rc.CheckpointManager, rc.CheckpointManagerOptions)


# Ours, configured with Orbax's own options dataclass (drop-in use).
OURS_OCP = Impl("ours+ocp_options", rc.CheckpointManager, ocp.CheckpointManagerOptions)


OURS_BOTH = (OURS, OURS_OCP)


def _mesh(shape, names):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (host) devices: set XLA_FLAGS before jax is imported")
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _run(impl: Impl, directory, fn: Callable) -> tuple[str, Any]:
    try:
        return "ok", fn(impl, str(directory))
    except Exception as e:  # noqa: BLE001 - compared below
        return "err", e


def _builtin_base(e: BaseException) -> type:
    return next(c for c in type(e).__mro__ if c.__module__ == "builtins")


def run_both(tmp_path, fn: Callable, ours=OURS_BOTH, expect_ok: bool = True
             ) -> tuple[Any, list]:
    """Runs fn(impl, directory) on Orbax and on each of ours; asserts that all
    return normally or all raise (ours an instance of the builtin class Orbax
    raised). Returns (orbax result, [our results])."""
    kind, ref = _run(ORBAX, tmp_path / ORBAX.name, fn)
    if expect_ok and kind == "err":
        raise AssertionError("the scenario failed on Orbax itself") from ref
    results = []
    for impl in ours:
        k, got = _run(impl, tmp_path / impl.name, fn)
        if kind == "err":
            assert k == "err", f"{impl.name}: Orbax raised {ref!r}, ours returned {got!r}"
            base = _builtin_base(ref)
            assert isinstance(got, base), (f"{impl.name}: Orbax raised {type(ref).__name__} "
                                           f"({base.__name__}), ours {type(got).__mro__}: {got}")
        else:
            if k == "err":
                raise AssertionError(f"{impl.name} raised where Orbax did not") from got
        results.append(got)
    return ref, results


def _leaf_sig(x: Any) -> tuple:
    if isinstance(x, jax.Array):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return ("key", str(jax.random.key_impl(x)), x.shape, x.sharding,
                    np.asarray(jax.random.key_data(x)))
        return ("jax", x.shape, x.dtype, x.sharding, np.asarray(x))
    if isinstance(x, np.ndarray):
        return ("numpy", x.shape, x.dtype, None, x)
    return ("py", type(x), x)


def assert_same_tree(got: Any, ref: Any, *, check_sharding: bool = True) -> None:
    """Same structure, leaf kinds, shapes, dtypes, shardings and bytes."""
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    g_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    r_leaves = jax.tree.leaves(ref)
    for (path, g), r in zip(g_leaves, r_leaves, strict=False):
        where = jax.tree_util.keystr(path)
        gs, rs = _leaf_sig(g), _leaf_sig(r)
        assert gs[0] == rs[0], f"{where}: {gs[0]} vs {rs[0]}"
        if gs[0] == "py":
            assert gs == rs, where
            continue
        assert gs[1:3] == rs[1:3], f"{where}: {gs[1:3]} vs {rs[1:3]}"
        if check_sharding:
            assert gs[3] == rs[3], f"{where}: sharding {gs[3]} vs {rs[3]}"
        assert np.array_equal(gs[4], rs[4]), where
        assert gs[4].tobytes() == rs[4].tobytes(), f"{where}: not bit-exact"


def make_state(i: int) -> dict:
    mesh = _mesh((4, 2), ("x", "y"))
    return {
        "w": jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 7 + i,
                            NS(mesh, P("x", "y"))),
        "row": jax.device_put(jnp.arange(16, dtype=jnp.int32) * (i + 1), NS(mesh, P("x"))),
        "rep": jax.device_put(jnp.full((4,), i, jnp.float32), NS(mesh, P())),
        "bf16": (jnp.arange(6, dtype=jnp.bfloat16) + i) / 3,
        "scalar_arr": jnp.float32(0.25) + i,
        "np": np.arange(5, dtype=np.int64) * (i + 2),
        "np0d": np.array(1.5 + i),
        "opt": {"count": i, "lr": 1e-3, "nesterov": True, "mu": [np.ones(2, np.float32) * i]},
        "rng": jax.random.key(i),
        "rng_threefry": jax.random.key(i + 7, impl="threefry2x32"),
        "rng_raw": jax.random.PRNGKey(i),
    }


def abstract(tree: Any) -> Any:
    def f(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x
    return jax.tree.map(f, tree)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    options: dict
    steps: tuple
    metrics: tuple | None = None  # per step: a dict or None
    force: frozenset = frozenset()
    # Ours never deletes the newest step (docs/orbax_differences.md): compare
    # our steps with Orbax's plus the newest saved step.
    newest_kept: bool = False


def _acc(*v):
    return tuple(None if x is None else {"acc": x} for x in v)


def _loss(*v):
    return tuple(None if x is None else {"loss": x, "aux": [1, 2]} for x in v)


def _by_acc(m):
    return m["acc"]


def _by_loss(m):
    return m["loss"]


SCENARIOS = [
    Scenario("defaults", {}, tuple(range(4))),
    Scenario("interval", dict(save_interval_steps=3), tuple(range(8))),
    Scenario("interval_keep", dict(save_interval_steps=2, max_to_keep=2), tuple(range(9))),
    Scenario("keep_more_than_saved", dict(max_to_keep=4), tuple(range(6))),
    Scenario("save_on_steps", dict(save_interval_steps=4, save_on_steps={1, 5, 6}),
             tuple(range(9))),
    Scenario("keep_period", dict(max_to_keep=2, keep_period=3), tuple(range(8))),
    Scenario("force_off_interval", dict(save_interval_steps=5), tuple(range(8)),
             force=frozenset({3})),
    Scenario("should_save_fn", dict(should_save_fn=lambda s, last: s % 3 == 1),
             tuple(range(7))),
    Scenario("prefix_fixed_length",
             dict(step_prefix="ckpt", step_format_fixed_length=6, max_to_keep=2),
             tuple(range(4))),
    Scenario("sync", dict(enable_async_checkpointing=False, max_to_keep=3,
                          save_interval_steps=2), tuple(range(9))),
    Scenario("best_min", dict(max_to_keep=2, best_fn=_by_loss, best_mode="min"),
             tuple(range(6)), _loss(5, 3, 4, 1, 2, 0.5)),
    Scenario("best_max", dict(max_to_keep=2, best_fn=_by_acc, best_mode="max"),
             tuple(range(6)), _acc(0.1, 0.5, 0.3, 0.9, 0.2, 0.95), newest_kept=True),
    Scenario("best_min_ties", dict(max_to_keep=2, best_fn=_by_loss, best_mode="min"),
             tuple(range(5)), _loss(3, 1, 1, 2, 1), newest_kept=True),
    Scenario("best_max_ties_sync", dict(max_to_keep=2, best_fn=_by_acc, best_mode="max",
                                        enable_async_checkpointing=False),
             tuple(range(5)), _acc(3, 1, 3, 2, 3), newest_kept=True),
    Scenario("best_without_metrics_dropped",
             dict(max_to_keep=2, best_fn=_by_acc, keep_checkpoints_without_metrics=False),
             tuple(range(4)), _acc(None, 1, None, 3), newest_kept=True),
    Scenario("best_no_limit_without_metrics",
             dict(best_fn=_by_acc, keep_checkpoints_without_metrics=False),
             tuple(range(4)), _acc(None, 1, None, 3)),
    Scenario("best_keep_without_metrics", dict(max_to_keep=1, best_fn=_by_acc),
             tuple(range(4)), _acc(None, 1, None, 3)),
    Scenario("best_with_keep_period",
             dict(max_to_keep=1, keep_period=2, best_fn=_by_loss, best_mode="min"),
             tuple(range(6)), _loss(6, 5, 4, 3, 2, 1)),
    Scenario("max_to_keep_0", dict(max_to_keep=0), tuple(range(3)), newest_kept=True),
]


def _step_dirs(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def _drive(sc: Scenario) -> Callable:
    def fn(impl: Impl, d: str):
        sync = sc.options.get("enable_async_checkpointing") is False
        trace = []
        m = impl.manager(d, options=impl.options(**sc.options))
        try:
            for s in sc.steps:
                row = {"step": s, "should_save": m.should_save(s)}
                metrics = sc.metrics[s] if sc.metrics else None
                row["saved"] = m.save(s, args=ocp.args.StandardSave({"x": np.arange(3) + s}),
                                      metrics=metrics, force=s in sc.force)
                # Before waiting: the step in flight already counts as latest.
                row["latest_in_flight"] = m.latest_step()
                row["should_save_again"] = m.should_save(s)
                if not sync:  # sync saves have already applied retention
                    m.wait_until_finished()
                row["all_steps"] = list(m.all_steps())
                row["latest"] = m.latest_step()
                row["best"] = m.best_step()
                row["metrics"] = {t: m.metrics(t) for t in m.all_steps()}
                trace.append(row)
            assert not m.is_saving_in_progress()
        finally:
            m.close()
        with impl.manager(d, options=impl.options(**sc.options)) as m2:
            reopened = {"all_steps": list(m2.all_steps()), "latest": m2.latest_step(),
                        "best": m2.best_step(), "dirs": _step_dirs(d),
                        "restored": (None if m2.latest_step() is None
                                     else np.asarray(m2.restore(None)["x"]))}
        return trace, reopened
    return fn


def _saved(impl: Impl, d: str, **opts):
    m = impl.manager(d, options=impl.options(**opts))
    m.save(0, args=ocp.args.StandardSave({"a": np.arange(4)}))
    m.wait_until_finished()
    return m


def _force_existing(impl, d):
    _saved(impl, d).save(0, args=ocp.args.StandardSave({"a": np.arange(4)}), force=True)
