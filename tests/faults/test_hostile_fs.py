"""Hostile entries in the file tiers: symbolic links, FIFOs, huge sparse files,
directories where objects should be, and RAM-tier directories someone else
could control (/dev/shm is writable by every local user).

The rules checked, with real files through the real manager: nothing outside a
tier's root is ever read, written or deleted through a link below it; an odd
entry is refused with an error naming it (or seen as absent) and never hangs
or exhausts the process; saves that committed are never reported failed; and
restores fall back to another tier's intact copy, bit-exact.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import errno
import hashlib
import logging
import shutil
import stat
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.save import cleanup
from resilient_ckpt.storage import FileStorage

MANIFEST = layout.manifest_name(0, 1)


def host_state(step: int) -> dict:
    r = np.random.default_rng(step)
    return {"w": r.standard_normal((64, 32), dtype=np.float32), "n": step}


def _sharding() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))


def device_state(step: int) -> dict:
    h = host_state(step)
    return {"w": jax.device_put(h["w"], _sharding()), "n": h["n"]}


def restore(m: rc.CheckpointManager, step: int) -> dict:
    target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=_sharding()), "n": 0}
    return m.restore(step, args=ocp.args.StandardRestore(target))


def assert_exact(out: dict, step: int) -> None:
    assert out["n"] == step
    assert np.asarray(out["w"]).tobytes() == host_state(step)["w"].tobytes(), step


def open_manager(ram: str, local: str, keep: int | None = None) -> rc.CheckpointManager:
    return rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=(rc.RamTier(path=ram, keep=keep), rc.LocalTier(path=local, keep=keep))))


def save(m: rc.CheckpointManager, *steps: int) -> None:
    for s in steps:
        m.save(s, args=ocp.args.StandardSave(device_state(s)))
    m.wait_until_finished()


def digest(root: str) -> dict:
    """Every file under `root` (links not followed) -> sha256 of its bytes."""
    out = {}
    for d, _, files in os.walk(root):
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def chunk_objects(step_dir: str) -> dict[str, list[str]]:
    """The step's chunk objects (packs, or chunks of their own) -> the keys
    of the chunks each holds."""
    with open(os.path.join(step_dir, MANIFEST), "rb") as f:
        m = mf.parse(f.read())
    out: dict[str, list[str]] = {}
    for _, _, c in m.chunks():
        out.setdefault(c.object, []).append(c.key)
    return out


@pytest.fixture
def tiers(ram_path, tmp_path):
    """A RAM-tier directory (conftest's, under /dev/shm) and a local one."""
    return ram_path, str(tmp_path / "local")


# --------------------------------------------------------------- links

def test_step_named_links_lead_cleanup_and_retention_nowhere(tiers, tmp_path):
    ram, local = tiers
    # Outside the roots: a directory of chunk-named files (what cleanup removes
    # from an uncommitted step) and a complete committed step 5 of another run.
    orphans = tmp_path / "outside" / "orphans"
    orphans.mkdir(parents=True)
    for i in range(3):
        (orphans / f"0123abcd.c0.0.{i}").write_bytes(b"not yours")
    donor = (str(tmp_path / "donor_ram"), str(tmp_path / "donor_local"))
    with open_manager(*donor) as m:
        save(m, 5)
    committed = str(tmp_path / "outside" / "step5")
    shutil.copytree(os.path.join(donor[0], "5"), committed)
    for root in (ram, local):
        os.makedirs(root, exist_ok=True)
        os.symlink(orphans, os.path.join(root, "7"))
        os.symlink(committed, os.path.join(root, "5"))
    before = digest(str(tmp_path / "outside"))
    assert {f"step5/{k}" for k in [MANIFEST, *chunk_objects(committed)]} < set(before)

    with open_manager(ram, local, keep=2) as m:
        m._cleanup.join(30)
        assert m.all_steps() == []  # linked steps are not steps of these tiers
        save(m, 1, 2, 3, 4, 6, 8)  # retention runs after each, keeping 2
        assert m.all_steps() == [6, 8]
        assert all(tw.ok for rec in m.save_records for tw in rec.tiers.values())
        assert_exact(restore(m, 8), 8)
        m.save(9, args=ocp.args.StandardSave(device_state(9)))
        m.wait_until_finished()
    with open_manager(ram, local, keep=2) as m:  # a restart cleans up again
        m._cleanup.join(30)
        assert m.all_steps() == [8, 9]
    assert digest(str(tmp_path / "outside")) == before
    for root in (ram, local):
        assert os.path.islink(os.path.join(root, "7")) and os.path.islink(os.path.join(root, "5"))


def test_a_save_into_a_linked_step_directory_is_refused(tiers, tmp_path):
    ram, local = tiers
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(ram, "4"))
    with open_manager(ram, local) as m:
        save(m, 1)
        m.save(4, args=ocp.args.StandardSave(device_state(4)))
        with pytest.raises(rc.SaveFailedError) as ei:
            m.wait_until_finished()
        text = f"{ei.value} {ei.value.__cause__}"
        assert "symbolic link" in text and os.path.join(ram, "4") in text
        assert m.all_steps() == [1, 4]  # the local tier committed it
        assert_exact(restore(m, 4), 4)
        assert set(m.last_restore.served.values()) == {"local"}
    assert os.listdir(outside) == []


def test_a_chunk_replaced_by_a_link_is_not_read(tiers, tmp_path):
    ram, local = tiers
    with open_manager(ram, local) as m:
        save(m, 1, 2)
    name, keys = sorted(chunk_objects(os.path.join(ram, "2")).items())[0]
    chunk = os.path.join(ram, "2", name)  # a pack (or a chunk of its own)
    outside = tmp_path / "outside-chunk"
    shutil.copyfile(chunk, outside)  # the right bytes, behind a link
    os.unlink(chunk)
    os.symlink(outside, chunk)
    with open_manager(ram, local) as m:
        assert m.latest_step() == 2
        assert_exact(restore(m, 2), 2)
        served = m.last_restore.served
        assert all(served[k] == "local" for k in keys)
        assert all(t == "ram" for k, t in served.items() if k not in keys)
    assert os.path.islink(chunk)


# --------------------------------------------------------------- FIFOs and huge files

def test_fifo_and_huge_sparse_manifests_neither_hang_nor_exhaust(tiers, caplog):
    ram, local = tiers
    with open_manager(ram, local) as m:
        save(m, 1, 2, 3)
    fifo = os.path.join(ram, "3", MANIFEST)
    os.unlink(fifo)
    os.mkfifo(fifo)
    huge = os.path.join(local, "2", MANIFEST)
    os.truncate(huge, 8 << 40)  # 8 TiB, sparse
    assert os.path.getsize(huge) == 8 << 40
    got: list = []

    def opening():
        try:
            got.append(open_manager(ram, local))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            got.append(e)
    with caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
        t = threading.Thread(target=opening, daemon=True)
        t.start()
        t.join(120)  # hang detection only: an open takes well under a second
        if t.is_alive():  # blocked opening the FIFO: let it go, then fail
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            pytest.fail("opening the manager hung on a FIFO named like a manifest")
    (m,) = got
    assert not isinstance(m, BaseException), m
    with m:
        assert m.all_steps() == [1, 2, 3]  # each step still has one good manifest
        assert_exact(restore(m, 3), 3)
        assert set(m.last_restore.served.values()) == {"local"}
        assert_exact(restore(m, 2), 2)
        assert set(m.last_restore.served.values()) == {"ram"}
    assert fifo in caplog.text and huge in caplog.text
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# --------------------------------------------------------------- the storage itself

def test_file_storage_refuses_links_and_odd_entries(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"outside")
    (outside / "sub").mkdir()
    st = FileStorage(str(tmp_path / "root"), "ram", zero_copy=True)  # map() maps
    st.put("1/a", b"inside")
    os.symlink(outside / "victim", tmp_path / "root" / "1" / "link")
    os.symlink(outside, tmp_path / "root" / "2")
    os.mkdir(tmp_path / "root" / "1" / "dir")
    os.mkfifo(tmp_path / "root" / "1" / "fifo")
    for key in ("1/link", "2/victim"):
        assert st.size(key) is None
        for read in (lambda k=key: st.read(k), lambda k=key: st.map(k, 7),
                     lambda k=key: st.read_into(k, memoryview(bytearray(7)))):
            with pytest.raises(rc.StorageError, match="symbolic link") as ei:
                read()
            assert str(tmp_path / "root" / key) in str(ei.value)
    for key, what in (("1/dir", "a directory"), ("1/fifo", "a FIFO")):
        assert st.size(key) is None
        with pytest.raises(rc.StorageError, match=f"not a regular file \\({what}\\)"):
            st.read(key)
    assert st.list("2") == [] and sorted(st.list("1")) == ["a", "dir", "fifo", "link"]
    with pytest.raises(rc.StorageError, match="symbolic link"):
        st.put("2/new", b"x")
    with pytest.raises(rc.StorageError, match="symbolic link") as ei:
        st.put_if_absent(f"2/{MANIFEST}", b"{}")
    assert ei.value.nothing_written
    with pytest.raises(rc.StorageError, match="symbolic link"):
        st.delete("2/victim")
    with pytest.raises(rc.StorageError, match="symbolic link"):
        st.begin_write("2")
    st.delete("1/link")  # the link goes, never what it points to
    os.symlink(outside, tmp_path / "root" / "1" / "dirlink")
    st.delete_dir("1")  # a directory holding a link to one: the link goes
    st.delete_dir("2")  # a linked step: the link goes
    assert st.list("") == []
    assert sorted(os.listdir(outside)) == ["sub", "victim"]
    assert (outside / "victim").read_bytes() == b"outside"


def test_a_failed_commit_says_whether_it_wrote_anything(tmp_path):
    st = FileStorage(str(tmp_path / "root"), "local")
    (tmp_path / "root" / "3").write_bytes(b"a file where a step should be")
    with pytest.raises(rc.StorageError) as ei:
        st.put_if_absent(f"3/{MANIFEST}", b"{}")
    assert ei.value.nothing_written and ei.value.errno == errno.ENOTDIR
    assert "3" in str(ei.value) and MANIFEST in str(ei.value)
    assert st.put_if_absent(f"4/{MANIFEST}", b"{}")
    assert not st.put_if_absent(f"4/{MANIFEST}", b"{}")
    assert st.list("4") == [MANIFEST]  # no temporary left behind
    assert rc.StorageError(errno.EIO, "x").nothing_written is False


def test_a_root_the_user_linked_is_followed_once(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    st = FileStorage(str(tmp_path / "link"), "local")
    st.put("1/a", b"x")
    assert st.read("1/a") == b"x" and st.root == str(tmp_path / "link")
    assert (real / "1" / "a").read_bytes() == b"x"


def test_cleanup_goes_on_past_an_entry_it_cannot_remove(tmp_path, caplog):
    st = FileStorage(str(tmp_path), "local")
    for step in ("1", "2"):  # uncommitted, no live writer: their chunks are orphans
        st.put(f"{step}/0123abcd.c0.0.1", b"x")
    os.mkdir(tmp_path / "1" / "0123abcd.c0.0.0")  # a directory named like a chunk
    (tmp_path / "1" / "0123abcd.c0.0.0" / "keep").write_bytes(b"y")
    with caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
        removed = cleanup.cleanup(st, layout.StepNaming())
    assert "1/0123abcd.c0.0.1" in removed and "2" in removed
    assert os.listdir(tmp_path / "1") == ["0123abcd.c0.0.0"]
    assert "0123abcd.c0.0.0" in caplog.text


# --------------------------------------------------------------- the RAM tier's directory

def _refused(path: str, *words: str) -> None:
    with pytest.raises(rc.UnsafeDirectoryError) as ei:
        rc.RamTier(path=path).open("/unused", True)
    text = str(ei.value)
    assert isinstance(ei.value, PermissionError)
    assert path in text and "RamTier(path=" in text and "uid" in text, text
    assert all(w in text for w in words), text


def test_ram_tier_refuses_directories_others_could_control(ram_path):
    real = os.path.join(ram_path, "real")
    os.mkdir(real, 0o700)
    os.symlink(real, os.path.join(ram_path, "link"))
    _refused(os.path.join(ram_path, "link"), "symbolic link")
    open(os.path.join(ram_path, "file"), "w").close()
    _refused(os.path.join(ram_path, "file"), "not a directory")
    wide = os.path.join(ram_path, "wide")
    os.mkdir(wide)
    os.chmod(wide, 0o777)
    _refused(wide, "writable by group or others", "0777")
    assert stat.S_IMODE(os.stat(wide).st_mode) == 0o777  # never changed for the user
    with pytest.raises(rc.UnsafeDirectoryError):  # and the manager does not open
        open_manager(wide, os.path.join(ram_path, "local"))
    # Ours, 0700 (as mkdtemp makes them), and one we make: accepted.
    assert rc.RamTier(path=ram_path).open("/unused", True).root == ram_path
    made = os.path.join(ram_path, "new")
    rc.RamTier(path=made).open("/unused", True)
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_ram_tier_refuses_another_users_directory(ram_path):
    theirs = os.path.join(ram_path, "theirs")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 12345, 12345)
    _refused(theirs, "another user", "uid 12345")


def test_ram_tier_default_directory_is_made_private_and_checked(tmp_path):
    directory = str(tmp_path / "run")
    st = rc.RamTier().open(directory, True)
    try:
        assert stat.S_IMODE(os.stat(st.root).st_mode) == 0o700
        assert os.stat(st.root).st_uid == os.geteuid()
        parent = os.lstat(os.path.dirname(st.root))
        assert stat.S_ISDIR(parent.st_mode) and not parent.st_mode & 0o022
    finally:
        shutil.rmtree(st.root)
    os.symlink(tmp_path, st.root)  # someone was first, with a link to elsewhere
    try:
        with pytest.raises(rc.UnsafeDirectoryError, match="symbolic link"):
            rc.RamTier().open(directory, True)
    finally:
        os.unlink(st.root)
