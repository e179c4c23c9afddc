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


MIXED = r'''
import os
import sys
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import resilient_ckpt as rc
    # Processes 0 and 1 share a directory; 2 and 3 each have one of their own.
    path = os.path.join(ctx.dir, "ab" if ctx.pid < 2 else str(ctx.pid))
    os.makedirs(path, exist_ok=True)
    options = rc.CheckpointManagerOptions(agreement_timeout_s=15)
    try:
        rc.CheckpointManager(path, options=options).close()
        mh.report({"pid": ctx.pid, "error": None})
    except ValueError as e:
        mh.report({"pid": ctx.pid, "error": str(e)})
    mh.barrier("opened")  # every process is past its open: its probes are gone
    mh.report({"pid": ctx.pid, "left": sorted(os.listdir(path))})


mh.main(run, ctx)
'''


def test_a_directory_some_processes_share_and_others_do_not_is_refused_on_every_process(
        hosts):
    """A tier of a job is one directory for all or one per process: one that
    two of four processes share (a mount on some hosts only) is refused at
    the open, on every process alike, naming who sees whose probes; nothing
    is left behind in either directory."""
    res = run_job(MIXED, 4, 1, ["--dir", hosts["dir"]], timeout_s=120)
    assert all(r.ok for r in res), describe(res)
    errors = [r.last("error")["error"] for r in res]
    for e in errors:
        assert e is not None and "seen by some processes but not all" in e, errors
        assert "process 0 sees the probes of [0, 1]" in e, e
    assert len({e.split("(", 2)[2] for e in errors}) == 1  # one decision, each its own path
    for r in res:
        assert not [f for f in r.last("left")["left"] if f.startswith(".rc-probe")], r.last("left")
