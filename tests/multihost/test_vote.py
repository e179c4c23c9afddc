"""A save's agreement as one all-reduce on the devices (`core.summary`,
`multihost.vote`), in real multi-process jobs: a job running normally
decides every save after the first by a vote, every process reads the same
answers after every save, and the job ends exactly where the same job that
agrees through the key-value store ends. A process that never sends its row
is named, through the store, after the vote's timeout."""
import time

import numpy as np
import pytest

from resilient_ckpt.errors import AgreementError
from resilient_ckpt.multihost.vote import DeviceVote
from resilient_ckpt.testing.multiprocess import describe, run_job

pytestmark = pytest.mark.multiprocess

BOTH = r'''
import os, sys
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    assert rc.CheckpointManagerOptions().agreement_vote is None  # votes from 64 processes
    for vote in (True, False):
        where = os.path.join(ctx.dir, f"vote-{vote}")
        ram = f"{ctx.ram}-{vote}"
        tiers = [rc.RamTier(path=ram, every=1, keep=2), rc.LocalTier(path=where, every=3, keep=2)]
        m = rc.CheckpointManager(where, options=rc.CheckpointManagerOptions(
            tiers=tiers, agreement_vote=vote, agreement_timeout_s=60))
        state = ctx.initial_state()
        seen = []
        for step in range(1, 9):
            state = ctx.train_step(state, step)
            m.save(step, args=ocp.args.StandardSave(state))
            seen.append([m.latest_step(), [int(s) for s in m.all_steps()]])
        m.wait_until_finished()
        mh.report({"vote": vote, "seen": seen, "votes": m._coord.votes,
                   "latest": m.latest_step(), "all": [int(s) for s in m.all_steps()],
                   "ram": sorted(n for n in os.listdir(ram) if n.isdigit()),
                   "local": sorted(n for n in os.listdir(where) if n.isdigit())})
        m.close()


mh.main(run, ctx)
'''

SILENT = r'''
import os, sys, time
import mh
ctx = mh.init(sys.argv)


def run(ctx):
    import orbax.checkpoint as ocp
    import resilient_ckpt as rc
    m = rc.CheckpointManager(ctx.dir, options=rc.CheckpointManagerOptions(
        tiers=[rc.LocalTier(path=ctx.dir, every=1, keep=2)], agreement_timeout_s=3,
        agreement_vote=True))
    state = ctx.initial_state()
    m.save(1, args=ocp.args.StandardSave(state))
    if ctx.pid == 1:  # skips the second save and everything after it
        mh.report({"pid": 1, "skipped": True})
        sys.stdout.flush()
        time.sleep(20)
        os._exit(0)
    m.save(2, args=ocp.args.StandardSave(state))
    t = time.monotonic()
    try:
        m.wait_until_finished()
    except rc.AgreementError as e:
        mh.report({"pid": 0, "error_type": "AgreementError", "message": str(e),
                   "waited_s": time.monotonic() - t})
        sys.stdout.flush()
        os._exit(0)
    mh.report({"pid": 0, "error_type": None})


mh.main(run, ctx)
'''


def test_a_normal_job_votes_and_ends_where_the_store_s_job_ends(hosts):
    res = run_job(BOTH, 2, 2, ["--dir", hosts["dir"], "--ram", hosts["ram"]], timeout_s=120)
    reports = [[x for x in r.results if "vote" in x] for r in res]
    assert all(r.ok for r in res) and [len(x) for x in reports] == [2, 2], describe(res)
    for a, b in zip(reports[0], reports[1], strict=True):  # both processes, after every save
        assert a["seen"] == b["seen"] and a["all"] == b["all"], (a, b)
    on, off = reports[0]
    # 7 saves after the first, and wait_until_finished's two rounds
    assert on["votes"] == 9 and off["votes"] == 0, (on["votes"], off["votes"])
    assert [x[0] for x in on["seen"]] == list(range(1, 9))  # latest_step() follows each save
    for key in ("latest", "all", "ram", "local"):
        assert on[key] == off[key], (key, on[key], off[key])
    assert on["all"] == [3, 6, 7, 8] and on["ram"] == ["7", "8"]


@pytest.mark.slow
def test_a_process_that_skips_a_save_is_named_through_the_store(hosts):
    res = run_job(SILENT, 2, 1, ["--dir", hosts["dir"]], timeout_s=90)
    got = res[0].last("pid")
    assert got is not None and got.get("error_type") == "AgreementError", describe(res)
    assert "process 1 of 2 did not send its view" in got["message"], got["message"]
    assert got["waited_s"] < 20, got  # the vote's timeout, then the store's: 3 s each


def test_a_vote_alone_reduces_to_its_own_row_and_refuses_a_wrong_shape():
    vote = DeviceVote([0], 4)
    row = np.array([1, -2, 1 << 40, 0], np.int64)  # int64, whatever jax's default width
    assert DeviceVote.wait(vote.start(row), "a test", 10).tolist() == row.tolist()
    with pytest.raises(ValueError, match="a vote is 4 int64 values"):
        vote.start(np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="a vote is 4 int64 values"):
        vote.start(np.zeros(4, np.int32))


class _NeverReady:
    """A vote whose other rows never come: a stand-in (a mock), since one
    process cannot make its own collective wait for a peer."""

    def is_ready(self):
        return False


def test_a_vote_that_never_completes_times_out_or_is_given_up():
    import threading
    t = time.monotonic()
    with pytest.raises(AgreementError, match="did not complete within 0.2 s"):
        DeviceVote.wait(_NeverReady(), "save of step 3", 0.2)
    assert time.monotonic() - t < 5
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(AgreementError, match="given up"):
        DeviceVote.wait(_NeverReady(), "save of step 3", 60, cancel)
