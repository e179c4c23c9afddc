"""Damaged checkpoints: flipped bytes, truncated or deleted chunks, garbage,
torn and future-format manifests.

Each test saves steps 1-3 to a RamTier and a LocalTier, damages files of step 3
on disk the way a fault would, and opens a NEW manager (as a restarted job
does). The rules checked: a damaged copy is never used and restores fall back
to the other tier's copy bit-exact; a step with no intact copy is not selected
(or, when only reading finds out, `restore()` falls back to the next older
step with a warning while `restore(step)` raises); and damage to one step
never deletes or alters any other committed step.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile

import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from tests.support.corruption import abstract, assert_exact, device_state, host_state
from tests.support.tiers import flip as flip_file


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Where one chunk's copy lies in a tier: a range of a pack (or a file of its own)."""

    path: str
    offset: int
    size: int
    key: str

STEPS = (1, 2, 3)


class Dirs:
    def __init__(self, ram: str, local: str):
        self.ram, self.local = ram, local
        self.roots = {"ram": ram, "local": local}

    def open(self, keep=None, **kw) -> rc.CheckpointManager:
        return rc.CheckpointManager(self.local, options=rc.CheckpointManagerOptions(
            tiers=(rc.RamTier(path=self.ram, keep=keep), rc.LocalTier(path=self.local, keep=keep)),
            **kw))

    def step_dir(self, tier: str, step: int) -> str:
        return os.path.join(self.roots[tier], str(step))

    def chunk(self, tier: str, step: int, n: int = 0) -> Chunk:
        """The n-th chunk (sorted by key) of the big leaf `w`."""
        with open(self.manifest(tier, step), "rb") as f:
            m = mf.parse(f.read())
        (w,) = [lf for lf in m.items[0].leaves if lf.path == (("key", "w"),)]
        assert len(w.chunks) == 8  # one per device
        c = sorted(w.chunks, key=lambda c: c.key)[n]
        return Chunk(os.path.join(self.step_dir(tier, step), c.object), c.pack_offset,
                     c.stored_nbytes, c.key)

    def manifest(self, tier: str, step: int) -> str:
        return os.path.join(self.step_dir(tier, step), layout.manifest_name(0, 1))

    def digest(self, steps=STEPS) -> dict:
        """Every file of `steps` in both tiers -> sha256 of its bytes."""
        out = {}
        for tier, root in self.roots.items():
            for s in steps:
                d = os.path.join(root, str(s))
                for n in sorted(os.listdir(d)) if os.path.isdir(d) else ():
                    with open(os.path.join(d, n), "rb") as f:
                        out[(tier, s, n)] = hashlib.sha256(f.read()).hexdigest()
        return out


@pytest.fixture
def dirs(tmp_path):
    ram = tempfile.mkdtemp(prefix="rc-corrupt-", dir="/dev/shm")
    d = Dirs(ram, str(tmp_path / "local"))
    try:
        with d.open() as m:
            for s in STEPS:
                m.save(s, args=ocp.args.StandardSave(device_state(s)))
            m.wait_until_finished()
        yield d
    finally:
        shutil.rmtree(ram, ignore_errors=True)


def truncate(where: str | Chunk) -> None:
    """Cuts a file, or the file holding a chunk, half way through (the chunk)."""
    if isinstance(where, Chunk):
        os.truncate(where.path, where.offset + where.size // 2)
    else:
        os.truncate(where, os.path.getsize(where) // 2)


def delete(c: Chunk) -> None:
    """The chunk's copy gone: its pack cut where it starts (what follows it in
    the pack goes too), or its own file removed."""
    if c.offset:
        os.truncate(c.path, c.offset)
    else:
        os.remove(c.path)


def flip(c: Chunk, at: int | None = None) -> None:
    """Flips a byte of the chunk (its middle one, or byte `at`) in place."""
    flip_file(c.path, c.offset + (c.size // 2 if at is None else at))


def key_of(c: Chunk) -> str:
    return c.key


def restore(m: rc.CheckpointManager, step=None) -> dict:
    return m.restore(step, args=ocp.args.StandardRestore(abstract()))


# --------------------------------------------------------------- chunk bytes

def test_a_copy_put_right_counts_again_after_reload(dirs):
    """Both copies of a chunk of step 3 damaged: restore(3) raises and the
    manager marks them bad (step 3 is no longer listed); one put right by
    hand and reload(): the same manager lists and restores step 3 again,
    bit-exact, as a manager opened now would. Until the reload the marks hold."""
    in_ram, on_disk = dirs.chunk("ram", 3), dirs.chunk("local", 3)
    flip(in_ram)
    flip(on_disk)
    with dirs.open() as m:
        with pytest.raises(rc.CheckpointError):
            restore(m, 3)
        assert 3 not in m.all_steps()
        flip(on_disk)  # undone: the same bits flipped back
        assert 3 not in m.all_steps()
        m.reload()
        assert m.latest_step() == 3
        assert_exact(restore(m, 3), 3)
        assert m.last_restore.served[key_of(on_disk)] == "local"


def test_flipped_byte_in_ram_copy_falls_back_to_local_copy(dirs):
    bad = dirs.chunk("ram", 3)
    flip(bad)
    others = dirs.digest((1, 2))
    with dirs.open() as m:
        assert m.latest_step() == 3  # sizes match: only reading can tell
        assert_exact(restore(m, 3), 3)
        rec = m.last_restore
        assert rec.step == 3
        assert rec.served[key_of(bad)] == "local"
        assert len(rec.fallbacks) == 1 and key_of(bad) in rec.fallbacks[0]
        assert "ram" in rec.fallbacks[0] and "crc32c" in rec.fallbacks[0]
        assert rec.chunks_by_tier["local"] == 1
        assert all(t == "ram" for k, t in rec.served.items() if k != key_of(bad))
        # The bad copy is remembered: the next restore goes to local directly.
        assert_exact(restore(m), 3)
        assert m.last_restore.fallbacks == [] and m.last_restore.served[key_of(bad)] == "local"
    assert dirs.digest((1, 2)) == others


def test_flipped_byte_in_local_copy_is_never_read(dirs):
    bad = dirs.chunk("local", 3, n=3)
    flip(bad, at=0)
    with dirs.open() as m:
        assert_exact(restore(m, 3), 3)
        assert set(m.last_restore.served.values()) == {"ram"}
        assert m.last_restore.fallbacks == []


def test_no_intact_copy_restore_step_raises(dirs):
    for tier in ("ram", "local"):
        flip(dirs.chunk(tier, 3, n=2))
    others = dirs.digest((1, 2))
    with dirs.open() as m:
        assert m.latest_step() == 3
        with pytest.raises(rc.CorruptCheckpointError) as ei:
            restore(m, 3)
        assert isinstance(ei.value, ValueError)
        assert "no intact copy" in str(ei.value)
        assert len(m.restore_records) == 0 or m.last_restore.step != 3
        assert m.latest_step() == 2  # the manager now knows step 3 is not restorable
        assert_exact(restore(m), 2)
    assert dirs.digest((1, 2)) == others
    assert os.path.exists(dirs.step_dir("ram", 3))  # a failed read deletes nothing


def test_no_intact_copy_latest_falls_back_to_older_step_with_warning(dirs, caplog):
    for tier in ("ram", "local"):
        flip(dirs.chunk(tier, 3, n=5))
    others = dirs.digest((1, 2))
    with dirs.open() as m, caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
        assert m.latest_step() == 3
        out = restore(m)  # step=None: the newest restorable step
        assert_exact(out, 2)
        assert m.last_restore.step == 2 and m.last_restore.fallbacks == []
        assert m.latest_step() == 2
        # Without a target as well.
        out = m.restore()
        assert out["n"] == 2 and np.asarray(out["w"]).tobytes() == host_state(2)["w"].tobytes()
    text = caplog.text
    assert "step 3 is not restorable" in text and "falling back" in text
    assert dirs.digest((1, 2)) == others


# --------------------------------------------------------------- chunk presence

@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_short_or_missing_chunk_in_one_tier_is_skipped_by_selection(dirs, damage):
    bad = dirs.chunk("ram", 3, n=1)
    (truncate if damage == "truncate" else delete)(bad)
    others = dirs.digest((1, 2))
    with dirs.open() as m:
        assert m.latest_step() == 3
        assert m.catalog.viable()[3].sources[key_of(bad)] == ("local",)
        assert_exact(restore(m, 3), 3)
        rec = m.last_restore
        assert rec.served[key_of(bad)] == "local"
        assert rec.fallbacks == []  # selection skipped the bad copy: no read failed
    assert dirs.digest((1, 2)) == others


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_short_or_missing_chunk_in_every_tier_makes_step_not_viable(dirs, damage):
    for tier in ("ram", "local"):
        bad = dirs.chunk(tier, 3, n=6)
        (truncate if damage == "truncate" else delete)(bad)
    others = dirs.digest((1, 2))
    with dirs.open() as m:
        assert m.all_steps() == [1, 2]
        assert m.latest_step() == 2
        assert_exact(restore(m), 2)
        assert m.last_restore.fallbacks == []
        with pytest.raises(rc.StepNotFoundError):
            restore(m, 3)
        m._cleanup.join(30)
    assert dirs.digest((1, 2)) == others
    for tier in ("ram", "local"):  # committed (if damaged) steps are left alone
        assert os.path.exists(dirs.manifest(tier, 3))


# --------------------------------------------------------------- manifests

def _garbage(path: str) -> None:
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(300))


def _torn(path: str) -> None:
    truncate(path)


def _future(path: str) -> None:
    with open(path) as f:
        doc = json.load(f)
    doc["version"] = mf.FORMAT_VERSION + 1
    doc["new_field"] = {"something": "newer"}
    with open(path, "w") as f:
        json.dump(doc, f)


MANIFEST_DAMAGE = {"garbage": _garbage, "torn": _torn, "future": _future}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_bad_manifest_in_one_tier_uses_the_other(dirs, damage):
    MANIFEST_DAMAGE[damage](dirs.manifest("ram", 3))
    with dirs.open() as m:
        assert m.latest_step() == 3
        assert_exact(restore(m, 3), 3)
        assert set(m.last_restore.served.values()) == {"local"}


@pytest.mark.parametrize("damage", sorted(MANIFEST_DAMAGE))
def test_bad_manifest_in_every_tier_step_not_selected(dirs, damage, caplog):
    for tier in ("ram", "local"):
        MANIFEST_DAMAGE[damage](dirs.manifest(tier, 3))
    others = dirs.digest((1, 2))
    step3 = dirs.digest((3,))
    with caplog.at_level(logging.WARNING, logger="resilient_ckpt"), dirs.open() as m:
        m._cleanup.join(30)
        assert m.all_steps() == [1, 2]
        assert m.latest_step() == 2
        assert_exact(restore(m), 2)
        with pytest.raises(rc.StepNotFoundError):
            restore(m, 3)
        # What the manager saw for step 3, per tier: the parse error.
        errors = [e for t in m.tier_names for e in m.catalog.view(t)[3].manifests]
        assert len(errors) == 2
        assert all(isinstance(e, rc.CorruptCheckpointError) for e in errors)
        if damage == "future":
            assert all(isinstance(e, rc.UnsupportedFormatError) for e in errors)
            assert all(f"version {mf.FORMAT_VERSION + 1}" in str(e) for e in errors)
        else:
            assert not any(isinstance(e, rc.UnsupportedFormatError) for e in errors)
    assert "manifest.0-of-1.json" in caplog.text  # the warning names the file
    # Nothing else is lost, and the damaged step is not "repaired" or removed.
    assert dirs.digest((1, 2)) == others
    assert dirs.digest((3,)) == step3


def test_future_version_manifest_error_mentions_version(dirs):
    path = dirs.manifest("local", 3)
    _future(path)
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(rc.UnsupportedFormatError,
                       match=rf"version {mf.FORMAT_VERSION + 1} .*upgrade") as ei:
        mf.parse(data, path)
    assert isinstance(ei.value, rc.CorruptCheckpointError) and isinstance(ei.value, ValueError)
    assert path in str(ei.value)
    # A version-1 manifest (no checksum) with a field this reader does not know
    # is also "newer".
    doc = json.loads(data)
    doc["version"] = 1
    del doc["manifest_crc32c"]
    with pytest.raises(rc.UnsupportedFormatError, match="new_field"):
        mf.parse(json.dumps(doc).encode(), path)


# --------------------------------------------------------------- other steps survive

def test_corrupt_step_never_deletes_or_alters_other_committed_steps(dirs):
    """Step 3 is damaged every way at once (garbage manifest in RAM, flipped
    chunk and torn manifest on disk). Restoring, cleaning up and saving more
    steps, with retention keeping 2 per tier, must keep steps 1-2 byte for byte
    until newer good steps push them out, and must keep 2 restorable steps."""
    _garbage(dirs.manifest("ram", 3))
    flip(dirs.chunk("local", 3))
    _torn(dirs.manifest("local", 3))
    others = dirs.digest((1, 2))
    with dirs.open(keep=2) as m:
        m._cleanup.join(30)
        assert m.latest_step() == 2
        assert_exact(restore(m), 2)
        assert dirs.digest((1, 2)) == others
        m.save(4, args=ocp.args.StandardSave(device_state(4)))
        m.wait_until_finished()
        # keep=2 counts restorable steps: 2 and 4 (the damaged 3 takes no slot).
        assert m.all_steps() == [2, 4]
        assert dirs.digest((2,)) == {k: v for k, v in others.items() if k[1] == 2}
        for s in (2, 4):
            assert_exact(restore(m, s), s)
    with dirs.open(keep=2) as m:  # and a restarted job sees the same
        m._cleanup.join(30)
        assert m.all_steps() == [2, 4]
        assert_exact(restore(m), 4)
