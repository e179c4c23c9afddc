"""A job that saves and restores inside its own mesh context.

The caller sets a mesh of process 0's devices as its thread's mesh
(`jax.set_mesh(mesh)`, as Orbax's test of a global mesh does) and saves and
restores arrays that span every process. Nothing the package runs for itself
may pick that mesh up: the first save's probe of this jax's buffers ran a
jitted program on process 1's device, and the fill from peers (each host
restores from its own RAM tier first, and process 1's RAM lacks the shards
of the replicated leaf that process 0 wrote) a program over all devices;
jax refused both ("incompatible devices ... jit's context mesh"). The job's
votes (`multihost.vote`) run over every device too.
"""
import pytest

from resilient_ckpt.testing.multiprocess import describe, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = r'''
import sys
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devs = np.asarray(jax.devices())
    flat, grid = Mesh(devs, ("x",)), Mesh(devs.reshape(2, -1), ("x", "y"))

    def put(x, mesh, spec):
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                            lambda i: x[i])
    tree = {"a": put(np.arange(8.0), flat, P(None)), "b": put(np.arange(16), flat, P("x")),
            "c": put(np.arange(32.0).reshape(4, 8), grid, P("x", "y")),
            "k": jax.random.key(7)}
    jax.set_mesh(Mesh(devs[:len(devs) // jax.process_count()], ("x",)))
    # Without replicas, each host's RAM holds only the shards it wrote.
    tiers = [rc.RamTier(path=ctx.ram, every=1, keep=2, replicas=False),
             rc.LocalTier(path=ctx.dir)]
    with rc.CheckpointManager(ctx.dir, item_names=("params",), options=(
            rc.CheckpointManagerOptions(tiers=tiers, agreement_vote=True))) as m:
        m.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(tree)))
        m.wait_until_finished()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        got = m.restore(0, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract))).params
        peers = dict(m.last_restore.bytes_by_tier).get("peers", 0)
        votes = m._coord.votes
    assert jax.sharding.get_mesh().devices.size == len(devs) // jax.process_count()
    out = {}
    for name, x in got.items():
        if name == "k":
            x = jax.random.key_data(x)
        out[name] = {str(s.index): np.asarray(s.data).tolist() for s in x.addressable_shards}
        want = {str(s.index): np.asarray(s.data).tolist() for s in
                (jax.random.key_data(tree[name]) if name == "k" else tree[name]).addressable_shards}
        out[name] = out[name] == want and x.sharding == (
            jax.random.key_data(tree[name]) if name == "k" else tree[name]).sharding
    mh.report({"pid": ctx.pid, "exact": out, "peers": int(peers), "votes": votes})


mh.main(run, ctx)
'''


def test_a_job_saves_and_restores_inside_its_own_mesh_context(hosts):
    res = run_job(WORKER, 2, 4, ["--dir", hosts["dir"], "--ram", hosts["ram"]], timeout_s=90)
    got = [r.last("pid") for r in res]
    assert all(r.ok for r in res) and all(g and "exact" in g for g in got), describe(res)
    assert all(all(g["exact"].values()) for g in got), got
    assert got[1]["peers"] > 0, got  # the fill from peers ran (inside the caller's context)
    assert got[0]["votes"] >= 2, got  # so did the job's votes (wait_until_finished, restore)
