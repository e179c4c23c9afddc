"""A job of 4 processes restores a step from the tier they all share (a
directory, as GCS): each process reads the manifests of the writers whose
boxes its devices hold, not all 4, when the target is the save's layout
(as a relaunch of the same job restores); onto another layout each process
that lacks boxes reads every manifest, once, and the restore is exact both
ways. Reads are counted by a spy on the file backend's reads."""
import pytest

from resilient_ckpt.testing.multiprocess import describe, run_job

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = r'''
import sys
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import orbax.checkpoint as ocp
    from resilient_ckpt.storage.files import FileStorage
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
    with mh.ours(ctx, ram=False, local_every=1) as m:  # as a relaunched job opens it
        # The open tells the directory is shared before it reads it.
        out["open"], reads[:] = sorted(reads), []
        got = m.restore(1, args=ocp.args.StandardRestore(ctx.abstract()))
        out["same"], reads[:] = sorted(reads), []
        out["same_bad"] = ctx.check_exact(got, 1)[:5]
        target = ctx.abstract(mh.make_mesh("2,4"), mh.RESHARD_SPECS)
        got = m.restore(1, args=ocp.args.StandardRestore(target))
        out["reshard"] = sorted(reads)
        out["reshard_bad"] = ctx.check_exact(got, 1)[:5]
    mh.report(out)


mh.main(run, ctx)
'''


def _names(*writers):
    return [f"manifest.{i}-of-4.json" for i in writers]


def test_a_restore_reads_the_manifests_its_devices_need_and_all_for_another_layout(hosts):
    res = run_job(WORKER, 4, 2, ["--dir", hosts["dir"]], timeout_s=150)
    got = [r.last("pid") for r in res]
    assert all(r.ok for r in res) and all(g and "reshard" in g for g in got), describe(res)
    for q, g in enumerate(got):
        assert g["same_bad"] == [] and g["reshard_bad"] == [], (q, g)
        # at the open each process reads its own (its part in a job of the save's size)
        assert g["open"] == _names(q), (q, g)
        # the same layout: the replicated leaves' replica 0 is on process 0's devices
        assert g["same"] == ([] if q == 0 else _names(0)), (q, g)
        # a (2, 4) mesh, "w" split by rows 4 ways: every other process lacks
        # boxes of writers it did not read, and reads them all, once
        assert g["reshard"] == _names(0, 1, 2, 3), (q, g)
