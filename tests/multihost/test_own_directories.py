"""A job whose processes each open the manager on a directory of their own.

Orbax lets each process save on its own local filesystem
(`MultiprocessingOptions(primary_host=None)`, each process its own path). The
processes of a job agree through the coordination service: they must meet
there whatever path each gave its manager. Each directory is then a tier of
its own process (it sees only its own files), and each process restores from
it the shards it holds. The agreement timeout is short, so that processes
that never meet fail the test at once instead of waiting out the default.
"""
import os

import pytest

from resilient_ckpt.testing.multiprocess import describe, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = r'''
import os
import sys
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.asarray(jax.devices()), ("x",))

    def put(x, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda i: x[i])
    tree = {"a": put(np.arange(16.0), P("x")), "b": put(np.arange(8), P(None))}
    own = os.path.join(ctx.dir, str(ctx.pid))
    os.makedirs(own)
    options = rc.CheckpointManagerOptions(agreement_timeout_s=15)
    with rc.CheckpointManager(own, options=options) as m:
        m.save(0, args=ocp.args.StandardSave(tree))
        m.wait_until_finished()
        steps = m.all_steps()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        got = m.restore(0, args=ocp.args.StandardRestore(abstract))
    exact = {k: all(np.array_equal(np.asarray(s.data), np.asarray(t.data))
                    for s, t in zip(got[k].addressable_shards, tree[k].addressable_shards))
             for k in tree}
    mh.report({"pid": ctx.pid, "steps": steps, "exact": exact,
               "files": sorted(os.listdir(ctx.dir))})


mh.main(run, ctx)
'''


def test_each_process_saves_and_restores_in_its_own_directory(hosts):
    res = run_job(WORKER, 2, 4, ["--dir", hosts["dir"]], timeout_s=120)
    got = [r.last("pid") for r in res]
    assert all(r.ok for r in res) and all(g and "exact" in g for g in got), describe(res)
    for g in got:
        assert g["steps"] == [0] and g["exact"] == {"a": True, "b": True}, got
    assert sorted(os.listdir(hosts["dir"])) == ["0", "1"]
