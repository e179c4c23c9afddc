"""Two writers on one directory: never two different states under one step.

- The writer lock: a second live manager in another process gets
  DirectoryInUseError, naming the directory, at its first save, and writes
  nothing; once the first closes (or is collected) it can save. In this
  process a newer manager takes over, and the older one refuses to save.
- The step claim: a manager whose view is stale (opened before the other
  saved the step) is refused in every tier and what it wrote is removed;
  claims taken at once by two saves' tier workers go to one save; a dead
  writer's claim is cleaned up or taken over. (Two GCS writers, which no
  flock holds apart, racing to one save: tests/storage/test_gcs_manager.py.)
- Restore beside a writer whose retention (keep=1) deletes steps: every
  restore of the latest step returns some step's exact state.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc
import subprocess
import sys
import threading
import uuid

import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.save import claim, cleanup
from resilient_ckpt.storage import FileStorage
from tests.support import writer as _writer

WRITER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "support", "writer.py")  # the child's script
NAMING = layout.StepNaming()


@pytest.fixture
def dirs(ram_path, tmp_path):
    """A RAM-tier directory (conftest's, under /dev/shm) and a local one."""
    return ram_path, str(tmp_path / "local")


def save(m: rc.CheckpointManager, step: int, seed: int) -> None:
    assert m.save(step, args=ocp.args.StandardSave(_writer.state(seed)))


def restored(ram: str, local: str, step: int | None = None) -> dict:
    with _writer.open_manager(ram, local) as m:
        return m.restore(step, args=ocp.args.StandardRestore(_writer.abstract()))


def each_tier_restores(ram: str, local: str, step: int, seed: int) -> None:
    """Every tier alone restores `step` as the state of `seed`."""
    for tier in (rc.RamTier(path=ram), rc.LocalTier(path=local)):
        with rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
                read_only=True, tiers=(tier,))) as m:
            out = m.restore(step, args=ocp.args.StandardRestore(_writer.abstract()))
            assert _writer.exact(out, seed), f"the {tier.kind} tier's step {step}"


def save_ids(ram: str, local: str, step: int) -> dict[str, set[str]]:
    """Each tier's save ids of `step` (from its manifests), and every save-id
    prefix its chunk files carry."""
    out = {}
    for tier, root in (("ram", ram), ("local", local)):
        d = os.path.join(root, str(step))
        names = os.listdir(d) if os.path.isdir(d) else []
        ids = {mf.parse(open(os.path.join(d, n), "rb").read()).save_id
               for n in names if layout.parse_manifest_name(n)}
        out[tier] = ids
        out[tier + " chunks"] = {n.split(".")[0] for n in names if layout.is_chunk_name(n)}
    return out


# ------------------------------------------------------------ the writer lock

def test_a_newer_manager_in_this_process_takes_over(dirs):
    """In one process the newer manager writes (as Orbax allows); the older one
    finishes its save in flight first, then refuses to save: one writer still."""
    ram, local = dirs
    a = _writer.open_manager(ram, local)
    save(a, 1, 1)  # perhaps still in flight when b takes over
    b = _writer.open_manager(ram, local)
    save(b, 2, 2)
    assert {1, 2} <= set(b.all_steps())
    with pytest.raises(rc.DirectoryInUseError) as e:
        save(a, 3, 3)
    msg = str(e.value)
    assert local in msg and "newer CheckpointManager" in msg, msg
    assert not os.path.exists(os.path.join(ram, "3"))
    assert not os.path.exists(os.path.join(local, "3"))
    # Readers take no lock: a read-only manager restores meanwhile.
    with rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
            read_only=True, tiers=(rc.RamTier(path=ram), rc.LocalTier(path=local)))) as r:
        assert _writer.exact(r.restore(1, args=ocp.args.StandardRestore(_writer.abstract())), 1)
    a.close()  # leaves b's lock alone
    save(b, 4, 4)
    b.close()
    assert _writer.exact(restored(ram, local), 4)


def test_lock_goes_with_a_collected_manager(dirs):
    ram, local = dirs
    a = _writer.open_manager(ram, local)
    save(a, 1, 1)
    a.wait_until_finished()
    del a
    gc.collect()
    with _writer.open_manager(ram, local) as b:
        save(b, 2, 2)


def test_two_processes_one_wins_the_directory(dirs, tmp_path):
    ram, local = dirs
    sync = str(tmp_path)
    kids = [subprocess.Popen([sys.executable, WRITER, "race", ram,
                              local, sync, str(i)], stdout=subprocess.PIPE, text=True)
            for i in (0, 1)]
    try:
        _wait_files([os.path.join(sync, f"ready.{i}") for i in (0, 1)], kids)
        open(os.path.join(sync, "go"), "w").close()
        outs = [k.communicate(timeout=300)[0] for k in kids]
    finally:
        for k in kids:
            k.kill()
    assert [k.returncode for k in kids] == [0, 0], outs
    winner = next(i for i, o in enumerate(outs) if o.startswith("won"))
    loser = 1 - winner
    assert outs[loser].startswith("in use") and local in outs[loser], outs
    assert "saved 2" in outs[loser], outs
    ids = save_ids(ram, local, 1)
    assert len(ids["ram"]) == 1 and ids["ram"] == ids["local"], ids
    each_tier_restores(ram, local, 1, winner)
    assert _writer.exact(restored(ram, local, 2), 10 + loser)


def _wait_files(paths: list[str], kids: list[subprocess.Popen]) -> None:
    while not all(os.path.exists(p) for p in paths):
        if any(k.poll() is not None for k in kids):
            raise AssertionError(f"a child exited early: {[k.returncode for k in kids]}")
        threading.Event().wait(0.05)


# ------------------------------------------------------------ the step claim

def test_stale_second_manager_is_refused_by_the_claim_in_every_tier(dirs):
    """a commits step 5 to the RAM tier only (the local tier saves every 10
    steps); b, opened before, then saves step 5 to both tiers. Without the
    claim b would lose the RAM tier's commit race and win the local tier's:
    two states under step 5."""
    ram, local = dirs

    def manager() -> rc.CheckpointManager:
        return rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(tiers=(
            rc.RamTier(path=ram, keep=None), rc.LocalTier(path=local, every=10))))
    a, b = manager(), manager()  # b's view lacks what a saves next
    save(a, 1, 1)
    save(a, 5, 5)
    a.close()
    assert os.path.isdir(os.path.join(ram, "5")) and not os.path.exists(os.path.join(local, "5"))
    save(b, 5, 50)  # b's first save: due on every tier
    with pytest.raises(rc.SaveFailedError) as e:
        b.wait_until_finished()
    msg = str(e.value)
    assert "step 5" in msg and "claimed by another writer" in msg and ram in msg, msg
    b.close()
    ids = save_ids(ram, local, 5)
    assert len(ids["ram"]) == 1 and ids["local"] == set(), ids
    (sid,) = ids["ram"]
    assert ids["ram chunks"] == {sid[:8]} and ids["local chunks"] == set(), ids  # b's removed
    assert _writer.exact(restored(ram, local, 5), 5)


def test_claims_race_to_one_save_across_tiers(tmp_path):
    """Two saves of one step take its claim from many threads at once (as
    tier workers of two writers would): one save holds it in every tier."""
    ram = FileStorage(str(tmp_path / "ram"), "ram", fsync=False)
    local = FileStorage(str(tmp_path / "local"), "local")
    tiers = [("ram", ram), ("local", local)]
    for step in range(20):
        claims = [claim.StepClaim(step, uuid.uuid4().hex, 0, 1, NAMING, tiers)
                  for _ in range(2)]
        won: list[list[str]] = [[], []]
        start = threading.Barrier(4)
        threads = [threading.Thread(target=_take, args=(start, c, n, st, won[i]))
                   for i, c in enumerate(claims) for n, st in tiers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i in (0, 1) if won[i]]
        assert len(winners) == 1 and sorted(won[winners[0]]) == ["local", "ram"], won
        sid = claims[winners[0]]._save_id
        for _, st in tiers:
            held = claim.read(st, f"{step}/{layout.claim_name(0, 1)}")
            assert held is not None and held[0] == sid


def _take(start: threading.Barrier, c: claim.StepClaim, tier: str, st: FileStorage,
          won: list[str]) -> None:
    start.wait()
    try:
        c.take(tier, st)
        won.append(tier)
    except rc.StepAlreadyExistsError:
        pass


def test_dead_writers_claim_is_cleaned_or_taken_over(tmp_path):
    st = FileStorage(str(tmp_path / "local"), "local")
    dead = layout.Writer(layout.Writer.me().host, os.getpid(), 1)  # pid alive, start differs
    live = layout.Writer.me()
    key = layout.claim_name(0, 1)
    for step, who in ((1, dead), (2, live), (3, dead)):
        st.put_if_absent(f"{step}/{key}", claim.encode("old", who))
    st.put_if_absent(f"3/{layout.manifest_name(0, 1)}", b"{}")  # step 3 is committed
    removed = cleanup.cleanup(st, NAMING)
    assert f"1/{key}" in removed and not os.path.exists(str(tmp_path / "local" / "1"))
    assert claim.read(st, f"2/{key}") is not None  # a live writer's claim stays
    assert claim.read(st, f"3/{key}") is not None  # a committed step keeps its claim
    # A new save takes over a dead writer's claim of a step it never committed...
    st.put_if_absent(f"4/{key}", claim.encode("old", dead))
    claim.take(st, "local", "4", 4, 0, 1, "new", live)
    assert claim.read(st, f"4/{key}") == ("new", live)
    # ...but never a live writer's.
    with pytest.raises(rc.StepAlreadyExistsError, match="step 2 in the local tier"):
        claim.take(st, "local", "2", 2, 0, 1, "new", live)


# ------------------------------------------------------------ restore beside a writer

def test_restore_latest_beside_a_writer_that_deletes(dirs, tmp_path):
    ram, local = dirs
    stop = str(tmp_path / "stop")
    kid = subprocess.Popen([sys.executable, WRITER, "loop", ram, local,
                            stop], stdout=subprocess.PIPE, text=True)
    try:
        first = kid.stdout.readline()
        assert first.startswith("saved"), first
        opts = rc.CheckpointManagerOptions(read_only=True, tiers=(
            rc.RamTier(path=ram, keep=1), rc.LocalTier(path=local, keep=1)))
        seen = []
        with rc.CheckpointManager(local, options=opts) as reader:
            for _ in range(60):
                out = reader.restore(args=ocp.args.StandardRestore(_writer.abstract()))
                assert _writer.exact(out, out["n"]), f"step {out['n']} restored wrong"
                seen.append(out["n"])
        open(stop, "w").close()
        rest = kid.communicate(timeout=300)[0]
    finally:
        kid.kill()
    assert kid.returncode == 0, rest
    assert len(set(seen)) >= 2, seen  # the writer moved on (and deleted) meanwhile


def test_a_dead_writers_unrestorable_step_is_saved_again(dirs, tmp_path):
    """A dead writer's committed copy of a step that is not restorable (here:
    one chunk cut short in both tiers) does not block a new save of
    that step: the new save takes over its claim and manifest in every tier,
    and the step then restores the new state."""
    ram, local = dirs
    stop = str(tmp_path / "stop")
    kid = subprocess.Popen([sys.executable, WRITER, "loop", ram, local,
                            stop], stdout=subprocess.PIPE, text=True)
    try:
        while not kid.stdout.readline().startswith("saved 2"):
            pass
        open(stop, "w").close()
        kid.communicate(timeout=300)
    finally:
        kid.kill()
    step = max(int(n) for n in os.listdir(local) if n.isdigit())  # it keeps one
    for root in (ram, local):  # the dead save of `step` serves no restore now
        d = os.path.join(root, str(step))
        victim = os.path.join(d, sorted(n for n in os.listdir(d) if layout.is_chunk_name(n))[0])
        os.truncate(victim, os.path.getsize(victim) - 1)
    with _writer.open_manager(ram, local) as m:
        assert step not in m.all_steps()
        save(m, step, 7)
    ids = save_ids(ram, local, step)
    assert len(ids["ram"]) == 1 and ids["local"] == ids["ram"], ids  # one save, both tiers
    each_tier_restores(ram, local, step, 7)

