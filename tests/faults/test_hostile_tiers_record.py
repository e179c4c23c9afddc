"""A hostile or stale tiers record (`.rc-tiers.json`): a hint, never an authority.

Someone with write access to a checkpoint directory can write its tiers
record. Before, `gc --apply` cleaned wherever the record pointed (a foreign
directory, the directory the tool runs from, another user's RAM directory),
`ls` followed a network URL in it, a copied directory's `verify` read the
original's chunks (and passed over a corrupt copy), `gc --apply` on a copy
cleaned the original, and a deep, huge or mistyped record (or a manifest's
`created` past the calendar) ended in a traceback. Now the record's paths are
relative to its directory, a recorded tier is used only inside the directory
(or, for a RAM tier, under /dev/shm and passing the manager's own RAM-tier
checks), a URL is never followed, and a bad record is ignored with a warning.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import tempfile

import google_crc32c
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings, strategies as hst

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, RamTier
from resilient_ckpt.core import layout
from resilient_ckpt.errors import CheckpointError
from resilient_ckpt.save import tierrecord, writer_lock
from resilient_ckpt.save.tierrecord import RECORD_NAME
from resilient_ckpt.storage import FileStorage
from tests.support import packs
from tests.support.cli import js, run


@pytest.fixture
def ckpt(tmp_path) -> pathlib.Path:
    """Step 1 committed in one local tier, its tiers record as a manager writes it."""
    d = tmp_path / "ckpt"
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=(LocalTier(),))) as m:
        m.save(1, args=ocp.args.StandardSave({"a": np.arange(64, dtype=np.float32)}))
    return d


def leftover(root: pathlib.Path, step: int = 7) -> pathlib.Path:
    """An uncommitted step (7) of a dead save in `root`: what gc removes."""
    me = layout.Writer.me()
    (root / str(step)).mkdir(parents=True)
    (root / str(step) / "0123abcd.c0.0.0_0").write_bytes(b"y" * 64)
    (root / str(step) / layout.claim_name(0, 1)).write_text(json.dumps(
        {"save_id": "0" * 32, "host": me.host, "pid": me.pid, "start": me.start + 1}))
    return root / str(step) / "0123abcd.c0.0.0_0"


def write_record(d: pathlib.Path, tiers: object, **top: object) -> None:
    doc = {"format": tierrecord.RECORD_FORMAT, "version": tierrecord.RECORD_VERSION,
           "directory": str(d), "step_prefix": None, "step_format_fixed_length": None,
           "tiers": tiers} | top
    if doc["version"] == 1:
        del doc["directory"]
    (d / RECORD_NAME).write_text(json.dumps(doc))


def chunk_of(step_dir: pathlib.Path) -> pathlib.Path:
    return next(p for p in sorted(step_dir.iterdir()) if layout.is_chunk_name(p.name))


def test_the_record_names_the_directory_relatively(ckpt):
    rec = json.loads((ckpt / RECORD_NAME).read_text())
    assert [(t["name"], t["kind"], t["where"]) for t in rec["tiers"]] == [("local", "local", ".")]


@pytest.mark.parametrize("where", ["abs", "", ".", None, "..", "../victim", "link",
                                   "cwd"])
def test_gc_apply_cleans_nothing_outside_the_directory(ckpt, tmp_path, monkeypatch, where):
    victim = tmp_path / "victim"
    kept = leftover(victim)
    os.symlink(victim, ckpt / "link")
    monkeypatch.chdir(victim)  # the directory the command runs from
    w = {"abs": str(victim), "cwd": os.getcwd()}.get(where, where)  # type: ignore[arg-type]
    write_record(ckpt, [{"name": "local", "kind": "local", "where": w}])
    run("gc", ckpt, "--apply")
    assert kept.exists() and (victim / "7" / layout.claim_name(0, 1)).exists()
    assert js("ls", ckpt)["steps"][0]["step"] == 1  # the directory itself still read


@pytest.mark.parametrize("unsafe", ["world-writable", "another user's"])
def test_gc_apply_never_cleans_an_unsafe_ram_directory(ckpt, tmp_path, unsafe):
    if unsafe == "another user's" and os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    shared = pathlib.Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        kept = leftover(shared)
        if unsafe == "world-writable":  # anyone's to change: the manager refuses it
            os.chmod(shared, 0o777)
        else:  # mode 0700, but nobody's (uid 65534): the manager refuses it
            os.chown(shared, 65534, 65534)
        elsewhere = tmp_path / "notram"
        kept2 = leftover(elsewhere)
        write_record(ckpt, [{"name": "ram", "kind": "ram", "where": str(shared)},
                            {"name": "ram2", "kind": "ram", "where": str(elsewhere)},
                            {"name": "local", "kind": "local", "where": "."}])
        p = run("gc", ckpt, "--apply")
        assert kept.exists() and kept2.exists()
        why = "writable by group or others" if unsafe == "world-writable" else "another user"
        assert why in p.stderr and str(shared) in p.stderr
        out = js("ls", ckpt)
        assert [t["name"] for t in out["tiers"]] == ["local"]
        assert sorted(t["name"] for t in out["ignored"]) == ["ram", "ram2"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_safe_ram_tier_under_dev_shm_is_used(ckpt, ram_path):
    write_record(ckpt, [{"name": "ram", "kind": "ram", "where": ram_path},
                        {"name": "local", "kind": "local", "where": "."}])
    assert [t["name"] for t in js("ls", ckpt)["tiers"]] == ["ram", "local"]


def test_a_url_in_the_record_is_never_followed(ckpt):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    try:
        url = f"http://127.0.0.1:{srv.getsockname()[1]}/x"
        write_record(ckpt, [{"name": "web", "kind": "http", "where": url},
                            {"name": "gcs", "kind": "gcs", "where": "gs://bucket/run"},
                            {"name": "local", "kind": "local", "where": "."}])
        out = js("ls", ckpt)
        text = run("ls", ckpt).stdout
        run("gc", ckpt, "--apply")
        with pytest.raises(BlockingIOError):
            srv.accept()  # no connection was ever made
    finally:
        srv.close()
    assert [t["name"] for t in out["tiers"]] == ["local"]
    assert {t["name"]: t["where"] for t in out["ignored"]} == {"web": url,
                                                                "gcs": "gs://bucket/run"}
    assert all("not followed" in t["why"] for t in out["ignored"])
    assert "not followed" in text and url in text


@pytest.mark.parametrize("record", ["relative", "absolute"])
def test_a_copied_directory_verifies_its_own_chunks(ckpt, tmp_path, record):
    if record == "absolute":  # as a manager before relative paths wrote it
        write_record(ckpt, [{"name": "local", "kind": "local", "where": str(ckpt)}])
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    victim = chunk_of(copy / "1")
    held = {k for k, (p, _, _) in packs.places(str(copy / "1")).items()
            if os.path.basename(p) == victim.name}  # the chunks in that pack
    victim.write_bytes(b"\0" * victim.stat().st_size)
    out = js("verify", copy, "-q", code=1)
    assert {x["key"] for x in out["defects"]} == held and len(out["defects"]) == len(held)
    assert js("verify", ckpt, "-q")["ok"]


def test_gc_apply_on_a_copy_leaves_the_original(ckpt, tmp_path):
    write_record(ckpt, [{"name": "local", "kind": "local", "where": str(ckpt)}],
                 version=1)  # as a manager before relative paths wrote it
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    kept = leftover(ckpt)
    gone = leftover(copy)
    p = run("gc", copy, "--apply")
    assert kept.exists() and not gone.exists()
    assert str(ckpt) in p.stderr and "outside" in p.stderr


def test_a_copy_leaves_the_originals_ram_tier_alone(tmp_path, ram_path):
    d = tmp_path / "ckpt"
    opts = CheckpointManagerOptions(tiers=(RamTier(path=ram_path), LocalTier()))
    with CheckpointManager(d, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave({"a": np.arange(64, dtype=np.float32)}))
    assert [t["name"] for t in js("ls", d)["tiers"]] == ["ram", "local"]
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    kept = leftover(pathlib.Path(ram_path))
    p = run("gc", copy, "--apply")
    assert kept.exists()
    assert ram_path in p.stderr and str(d) in p.stderr
    assert [t["name"] for t in js("ls", copy)["tiers"]] == ["local"]


DEEP = b'{"tiers": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HOSTILE = {
    "deep": DEEP,
    "huge_int": b'{"format": "resilient_ckpt.tiers", "version": ' + b"9" * 50_000 + b"}",
    "huge_fixed_length": None,  # step_format_fixed_length 10**15
    "huge_prefix": None,
    "tiers_not_a_list": None,
    "tier_not_an_object": None,
    "name_not_a_string": None,
    "where_a_list": None,
    "too_many_tiers": None,
    "not_json": b"\xff\xfe{",
    "a_number": b"3",
}


def hostile_doc(case: str) -> dict:
    ok = [{"name": "local", "kind": "local", "where": "."}]
    doc = {"format": tierrecord.RECORD_FORMAT, "version": tierrecord.RECORD_VERSION,
           "directory": "/ckpt", "step_prefix": None, "step_format_fixed_length": None,
           "tiers": ok}
    return doc | {
        "huge_fixed_length": {"step_format_fixed_length": 10**15},
        "huge_prefix": {"step_prefix": "p" * 60_000},
        "tiers_not_a_list": {"tiers": {"local": "."}},
        "tier_not_an_object": {"tiers": [3]},
        "name_not_a_string": {"tiers": [{"name": 1, "kind": "local", "where": "."}]},
        "where_a_list": {"tiers": [{"name": "local", "kind": "local", "where": ["."]}]},
        "too_many_tiers": {"tiers": [{"name": f"t{i}", "kind": "local", "where": "."}
                                     for i in range(1000)]},
    }[case]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_record_is_ignored_with_a_warning(ckpt, case):
    data = HOSTILE[case]
    (ckpt / RECORD_NAME).write_bytes(data if data is not None
                                     else json.dumps(hostile_doc(case)).encode())
    with pytest.raises(CheckpointError):
        tierrecord.decode((ckpt / RECORD_NAME).read_bytes(), str(ckpt / RECORD_NAME))
    for argv in (["ls"], ["inspect", "1"], ["verify", "-q"], ["gc", "--apply"]):
        p = run(argv[0], ckpt, *argv[1:])
        assert RECORD_NAME in p.stderr and "ignored" in p.stderr, p.stderr
    out = js("ls", ckpt)
    assert not out["recorded"] and [s["step"] for s in out["steps"]] == [1]


@pytest.mark.parametrize("created", [1e300, -1e300, 2.0**62, -1.0])
def test_a_created_past_the_calendar_is_refused_cleanly(ckpt, created):
    """A manifest (checksum made good) whose `created` no date can hold: the
    copy is corrupt, named so, and no command ends in a traceback."""
    (m,) = (ckpt / "1").glob("manifest*")
    doc = {k: v for k, v in json.loads(m.read_text()).items() if k != "manifest_crc32c"}
    doc["created"] = created
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    m.write_bytes(body + b',"manifest_crc32c":%d}' % google_crc32c.value(body))
    out = js("inspect", ckpt, 1)
    assert not out["viable"] and "created" in out["reason"], out
    for argv in (["inspect", "1"], ["ls"]):
        run(argv[0], ckpt, *argv[1:])
    run("verify", ckpt, "-q", code=1)


VALID = json.dumps(hostile_doc("huge_prefix") | {"step_prefix": "run",
                                                  "step_format_fixed_length": 4}).encode()


def outcome(data: bytes) -> None:
    try:
        rec = tierrecord.decode(data, "fuzz/" + RECORD_NAME)
    except CheckpointError as e:
        assert "fuzz/" + RECORD_NAME in str(e)
        return
    assert rec is None or isinstance(rec, tierrecord.TiersRecord)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.binary(max_size=300))
def test_fuzz_random_bytes_decode_cleanly(data):
    outcome(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.lists(hst.tuples(hst.integers(0, len(VALID) - 1), hst.integers(0, 255),
                            hst.sampled_from(["set", "insert", "delete"])), max_size=6))
def test_fuzz_mutated_records_decode_cleanly(edits):
    data = bytearray(VALID)
    for i, b, op in edits:
        i %= max(len(data), 1)
        if op == "set" and data:
            data[i] = b
        elif op == "insert":
            data.insert(i, b)
        elif data:
            del data[i]
    outcome(bytes(data))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hst.recursive(hst.none() | hst.booleans() | hst.integers() | hst.floats() | hst.text(),
                     lambda c: hst.lists(c, max_size=4) | hst.dictionaries(hst.text(), c,
                                                                           max_size=4)),
       hst.sampled_from(["format", "version", "step_prefix", "step_format_fixed_length",
                         "directory", "tiers", "extra"]))
def test_fuzz_any_json_value_in_any_field_decodes_cleanly(value, field):
    doc = json.loads(VALID) | {field: value}
    outcome(json.dumps(doc).encode())


@pytest.mark.parametrize("what", ["too large", "fifo", "link to /dev/zero", "directory"])
def test_a_record_that_is_no_small_regular_file_is_ignored(ckpt, what):
    rec = ckpt / RECORD_NAME
    rec.unlink()
    if what == "too large":
        rec.write_bytes(b" " * (1 << 20))
    elif what == "fifo":
        os.mkfifo(rec)  # opened without O_NONBLOCK, a read would hang
    elif what == "link to /dev/zero":
        os.symlink("/dev/zero", rec)
    else:
        rec.mkdir()
    p = run("ls", ckpt, "--json")
    assert json.loads(p.stdout)["steps"][0]["step"] == 1
    assert RECORD_NAME in p.stderr and "ignored" in p.stderr, p.stderr


def tree_of(root: pathlib.Path) -> list:
    """Every entry under `root`: name, kind and size (what a delete or a
    create there would change)."""
    return sorted((str(p.relative_to(root)), p.is_symlink(), p.is_dir(), p.lstat().st_size)
                  for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["local", "ram"])
@pytest.mark.parametrize("when", ["storage", "lock", "cleanup"])
def test_a_place_swapped_for_a_link_after_its_check_leads_nowhere(
        ckpt, tmp_path, ram_path, monkeypatch, kind, when):
    """The tool checks each recorded place, then uses it. Here, after the
    check, the checked directory is moved aside and a link to another
    directory takes its name, as anyone who can write there could do at any
    moment. The moment is set by wrapping a point of the code the tool passes
    (a hook for timing only; everything else is real): `storage`, as the
    tool builds the storage for the checked place; `lock`, as `gc --apply`
    takes the writer lock after its dry run; `cleanup`, as it judges the
    first entry it may remove, after listing the steps. The other directory
    holds a dead save's leftovers of the same names as the checked one's:
    nothing of it is read as the tier's, removed or created."""
    place = ckpt / "sub" if kind == "local" else pathlib.Path(ram_path) / "ram"
    place.mkdir(mode=0o700)
    leftover(place)
    victim = tmp_path / "victim"
    leftover(victim)
    leftover(victim, 9)  # a step only the other directory holds
    before = tree_of(victim)
    where = "sub" if kind == "local" else str(place)
    write_record(ckpt, [{"name": "extra", "kind": kind, "where": where},
                        {"name": "local", "kind": "local", "where": "."}])
    swapped: list = []

    def swap() -> None:
        if not swapped:
            os.rename(place, place.with_name("moved"))  # still where it was checked
            os.symlink(victim, place)
            swapped.append(True)

    armed = {"storage": True, "lock": False, "cleanup": False}[when]
    init, hold, alive = FileStorage.__init__, writer_lock.WriterLock.hold, layout.Writer.alive

    def at_init(self, root, *a, **kw):
        if when == "storage" and os.path.abspath(root) == str(place):
            swap()
        init(self, root, *a, **kw)

    def at_hold(self, *a, **kw):
        if when == "lock":
            swap()
        nonlocal armed
        armed = when == "cleanup"
        return hold(self, *a, **kw)

    def at_alive(self):
        if when == "cleanup" and armed:
            swap()
        return alive(self)

    monkeypatch.setattr(FileStorage, "__init__", at_init)
    monkeypatch.setattr(writer_lock.WriterLock, "hold", at_hold)
    monkeypatch.setattr(layout.Writer, "alive", at_alive)
    out = js("ls", ckpt) if when == "storage" else None
    swapped.clear()
    if os.path.islink(place):  # the place as it was for the next command
        os.unlink(place)
        os.rename(place.with_name("moved"), place)
    armed = when == "storage"
    run("gc", ckpt, "--apply")
    assert swapped, "the place was never swapped: the hook missed the tool's use of it"
    assert tree_of(victim) == before  # nothing removed, nothing created there
    moved = place.with_name("moved")  # the directory that was checked: cleaned, through its pin
    assert moved.is_dir() and not (moved / "7" / "0123abcd.c0.0.0_0").exists()
    if out is not None:
        steps = {s["step"]: [c["tier"] for c in s["copies"]] for s in out["steps"]}
        assert 9 not in steps, out  # the other directory's step was never read as the tier's


def test_a_recorded_place_that_is_missing_is_left_out(ckpt):
    """Nothing to pin there: a directory made at its name later (a link,
    say) is never used by a command that started before it."""
    write_record(ckpt, [{"name": "extra", "kind": "local", "where": "gone"},
                        {"name": "local", "kind": "local", "where": "."}])
    out = js("ls", ckpt)
    assert [t["name"] for t in out["tiers"]] == ["local"]
    assert [(t["name"], "missing" in t["why"]) for t in out["ignored"]] == [("extra", True)]
