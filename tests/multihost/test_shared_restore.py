"""A job restores a step from the tier all its processes share (a
directory, as GCS) reading only the manifests of the writers that hold the
boxes it needs: a job of the save's 4 processes onto the save's layout
(as a relaunch of the same job restores) the writers whose boxes its
devices held; onto another layout, and a job of 2 processes (another
shape, on half the devices), the writers whose saved boxes its targets
overlap (format 5's `writers` table says which device was whose). Each
restore is exact, and each process reads exactly the manifests the
expectation names: worked out here from every writer's manifest on disk
(which boxes each wrote) and the target's shards on this process, not
from the code under test. Reads are counted by a spy on the file
backend's reads."""
import pytest

from resilient_ckpt.testing.multiprocess import describe, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = r'''
import glob, os, sys
import mh
ctx = mh.init(sys.argv)


def overlapping(got, held):
    """The writers (labels) whose saved boxes the shards of `got` on this
    process overlap, from their manifests on disk, less those in `held`."""
    import jax
    import numpy as np
    from resilient_ckpt.core import manifest as mf
    from resilient_ckpt.core.sharding import index_to_box
    out = set()
    for path in glob.glob(os.path.join(ctx.dir, "**", "manifest.*-of-4.json"), recursive=True):
        m = mf.parse(open(path, "rb").read())
        for lf in m.items[0].leaves:
            x = got[lf.path[0][1]]
            if lf.kind.startswith("numpy"):
                out.add(m.process_index)
                continue
            data = jax.random.key_data(x) if lf.kind == "prng_key" else x
            for s in data.addressable_shards:
                lo, n = index_to_box(s.index, data.shape)
                for c in lf.chunks:
                    if all(a < b + k and b < a + j for a, j, b, k
                           in zip(lo, n, c.offsets, c.sizes)) and np.prod(n) > 0:
                        out.add(m.process_index)
    return sorted(out - set(held))


def run(ctx):
    import orbax.checkpoint as ocp
    from resilient_ckpt.storage.files import FileStorage
    if ctx.extra == ["save"]:
        state = ctx.train_step(ctx.initial_state(), 1)
        with mh.ours(ctx, ram=False, local_every=1) as m:
            m.save(1, args=ocp.args.StandardSave(state))
            m.wait_until_finished()
    reads = []
    real = FileStorage.read

    def read(self, key, max_bytes=None):  # a spy: the real read, recorded
        name = key.rpartition("/")[2]
        if name.startswith("manifest."):
            reads.append(name)
        return real(self, key, max_bytes)
    FileStorage.read = read
    out = {"pid": ctx.pid}
    with mh.ours(ctx, ram=False, local_every=1) as m:
        # The open tells the directory is shared before it reads it.
        out["open"], reads[:] = sorted(reads), []
        held = set(int(n.split(".")[1].split("-")[0]) for n in out["open"])
        if ctx.extra == ["save"]:
            got = m.restore(1, args=ocp.args.StandardRestore(ctx.abstract()))
            out["same"], reads[:] = sorted(reads), []
            out["same_bad"] = ctx.check_exact(got, 1)[:5]
            out["same_need"] = overlapping(got, held)
            held |= set(int(n.split(".")[1].split("-")[0]) for n in out["same"])
            target = ctx.abstract(mh.make_mesh("2,4"), mh.RESHARD_SPECS)
        else:
            target = ctx.abstract()
        got = m.restore(1, args=ocp.args.StandardRestore(target))
        out["reshard"] = sorted(reads)
        out["reshard_bad"] = ctx.check_exact(got, 1)[:5]
        out["reshard_need"] = overlapping(got, held)
    mh.report(out)


mh.main(run, ctx)
'''


def _names(*writers):
    return [f"manifest.{i}-of-4.json" for i in writers]


def test_a_restore_reads_the_manifests_of_the_writers_its_targets_need(hosts):
    res = run_job(WORKER, 4, 2, ["--dir", hosts["dir"], "save"], timeout_s=150)
    got = [r.last("pid") for r in res]
    assert all(r.ok for r in res) and all(g and "reshard" in g for g in got), describe(res)
    for q, g in enumerate(got):
        assert g["same_bad"] == [] and g["reshard_bad"] == [], (q, g)
        # at the open each process reads its own (its part in a job of the save's size)
        assert g["open"] == _names(q), (q, g)
        # the same layout: the replicated leaves' replica 0 is on process 0's devices
        assert g["same"] == ([] if q == 0 else _names(0)) == _names(*g["same_need"]), (q, g)
        # a (2, 4) mesh, "w" split by rows 4 ways: the writers of the rows it needs
        assert g["reshard"] == _names(*g["reshard_need"]), (q, g)
    # and not every one of them: somebody needed fewer than the 3 others
    assert any(len(g["reshard"]) < 3 - (q != 0) for q, g in enumerate(got)), got

    # A job of another shape: 2 processes of 2 devices restore onto their
    # own mesh; each holds its part (writers of its rank modulo 2) at the open
    res = run_job(WORKER, 2, 2, ["--dir", hosts["dir"]], timeout_s=150)
    got = [r.last("pid") for r in res]
    assert all(r.ok for r in res) and all(g and "reshard" in g for g in got), describe(res)
    for q, g in enumerate(got):
        assert g["open"] == _names(q, q + 2), (q, g)
        assert g["reshard_bad"] == [], (q, g)
        assert g["reshard"] == _names(*g["reshard_need"]), (q, g)
