"""Options are resolved once, by a pure function, into the per-tier plan."""
from __future__ import annotations

import os

import orbax.checkpoint as ocp
from hypothesis import given, strategies as st

from resilient_ckpt import CheckpointManagerOptions, GcsTier, LocalTier, RamTier
from resilient_ckpt.options import resolve

opt_int = st.one_of(st.none(), st.integers(0, 50))
tiers = st.lists(st.one_of(
    st.builds(RamTier, every=st.integers(1, 50), keep=opt_int),
    st.builds(LocalTier, path=st.just("/tmp/x"), every=opt_int, keep=opt_int),
    st.builds(GcsTier, url=st.just("gs://b/p"), every=opt_int, keep=opt_int)), max_size=5)


@given(tiers, st.integers(1, 20), opt_int, st.booleans(), st.booleans())
def test_plan_follows_the_options(configs, interval, max_to_keep, read_only, create):
    o = CheckpointManagerOptions(tiers=configs, save_interval_steps=interval,
                                 max_to_keep=max_to_keep, read_only=read_only, create=create)
    plan = resolve(o, "/data/ckpt")
    given_tiers = configs or [LocalTier()]
    assert len(plan.tiers) == len(given_tiers)
    assert [t.config.rank for t in plan.tiers] == sorted(t.rank for t in given_tiers)
    names = [t.name for t in plan.tiers]
    assert len(set(names)) == len(names)
    assert all(t.name.startswith(t.config.kind) for t in plan.tiers)
    for t in plan.tiers:
        c = t.config
        assert t.every == (c.every if c.every is not None else interval)
        if isinstance(c, RamTier) or c.keep is not None:
            assert t.keep == c.keep  # a RAM tier's own keep, None included
        else:
            assert t.keep == max_to_keep
        assert (t.own_io is not None) == isinstance(c, (GcsTier, RamTier))
        if isinstance(c, RamTier):  # memory copies: a pool of its own, no wider than the cores
            assert 1 <= t.own_io <= min(o.io_threads, os.cpu_count() or 1)
        assert t.encoding.codec == getattr(c, "codec", "raw")
    assert plan.writable == (create and not read_only)


def test_a_gs_directory_is_one_gcs_tier_and_a_path_one_local_tier():
    assert [t.name for t in resolve(CheckpointManagerOptions(), "gs://b/run").tiers] == ["gcs"]
    assert [t.name for t in resolve(CheckpointManagerOptions(), "/d").tiers] == ["local"]


def test_orbax_options_and_latest_n_map_field_by_field():
    oo = ocp.CheckpointManagerOptions(save_interval_steps=3, step_prefix="ckpt",
                                      step_format_fixed_length=4, keep_period=10)
    plan = resolve(CheckpointManagerOptions.from_any(oo), "/d")
    assert plan.tiers[0].every == 3
    assert plan.naming.name(7) == "ckpt_0007"
    assert plan.retention.keep_period == 10
    pp = ocp.checkpoint_managers.LatestN(2)
    oo = ocp.CheckpointManagerOptions(preservation_policy=pp)
    assert resolve(CheckpointManagerOptions.from_any(oo), "/d").tiers[0].keep == 2
