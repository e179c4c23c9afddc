"""One process of bench/scale.py's real job: open a manager (`--opens` times,
all but the last closed again; the median), save the tiny state `--saves`
times (every step due) and wait, then open a fresh manager and restore the
newest step; each phase's time on this process, from a barrier to its own
end, and whether the restored state is exact.

    python scale_worker.py (mh's options) --system resilient_ckpt|vote|orbax --saves 10

("vote": resilient_ckpt with `agreement_vote=True`, whatever the job's size.)
"""
import argparse
import statistics
import sys
import time

import mh

ctx = mh.init(sys.argv)
p = argparse.ArgumentParser()
p.add_argument("--system", choices=("resilient_ckpt", "vote", "orbax"), required=True)
p.add_argument("--saves", type=int, default=10)
p.add_argument("--opens", type=int, default=5, help="opens timed; open_s is their median")
o = p.parse_args(ctx.extra)


def main(_ctx):
    import jax
    import orbax.checkpoint as ocp

    import resilient_ckpt  # noqa: F401 - imported before any timing, as Orbax is
    ours = o.system != "orbax"
    state = ctx.initial_state()
    abstract = ctx.abstract()
    out = {}

    def phase(name, fn):
        mh.barrier(name)
        t = time.perf_counter()
        value = fn()
        out[name] = time.perf_counter() - t
        return value

    def open_manager():
        return (mh.ours(ctx, ram_every=1, ram_keep=2, local_every=1, local_keep=2,
                        vote=True if o.system == "vote" else None) if ours
                else mh.orbax(ctx, every=1, keep=2))
    opens = []
    for i in range(o.opens - 1):  # each closed again, as a job that reopens would
        phase(f"open_{i}", open_manager).close()
        opens.append(out.pop(f"open_{i}"))
    mngr = phase("open_s", open_manager)
    out["open_s"] = statistics.median(opens + [out["open_s"]])  # one is a noisy few ms
    saved = state if ours else mh.orbax_state(state)

    def saves():
        cpu, blocked = time.process_time(), 0.0
        for s in range(o.saves):
            t = time.perf_counter()
            mngr.save(s, args=ocp.args.StandardSave(saved))
            blocked += time.perf_counter() - t
        mngr.wait_until_finished()
        out["save_blocking_s"] = blocked / o.saves
        out["cpu_per_save_s"] = (time.process_time() - cpu) / o.saves  # every thread's
    phase("saves_s", saves)
    mngr.close()
    again = phase("reopen_s", open_manager)
    step = again.latest_step()

    def restore():
        if ours:
            got = again.restore(step, args=ocp.args.StandardRestore(abstract))
        else:
            got = mh.from_orbax(again.restore(step, args=ocp.args.StandardRestore(
                mh.orbax_abstract(abstract))))
        return jax.block_until_ready(got)
    restored = phase("restore_s", restore)
    out["step"] = step
    out["mismatches"] = len(ctx.check_exact(restored, 0))
    again.close()
    mh.barrier("end")
    mh.report(out)


mh.main(main, ctx)
