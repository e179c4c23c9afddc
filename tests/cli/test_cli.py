"""The `resilient-ckpt` command on directories a real CheckpointManager
wrote, with real defects: through its `main` in this process (no interpreter
and jax start per command), and as the installed console script in a
subprocess where a test says so (`installed=True`, or an environment)."""
import json
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, GcsTier, LocalTier, RamTier
from resilient_ckpt.core import layout
from resilient_ckpt.save.tierrecord import RECORD_NAME
from tests.support import packs
from tests.support.cli import js, run


def state(mesh, seed):
    rng = np.random.default_rng(seed)
    return {"w": jax.device_put(rng.standard_normal((16, 8)).astype(np.float32),
                                NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P())),
            "step": seed}


@pytest.fixture
def ckpt(tmp_path, ram_path, mesh):
    """Steps 1, 2, 3 in a RAM and a local tier; returns (dir, ram path)."""
    d = tmp_path / "ckpt"
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path, keep=None), LocalTier()])
    with CheckpointManager(d, options=opts) as m:
        for s in (1, 2, 3):
            m.save(s, args=ocp.args.StandardSave(state(mesh, s)), metrics={"loss": s / 10})
        m.wait_until_finished()
    return d, pathlib.Path(ram_path)


def chunks(step_dir):
    return sorted(n for n in os.listdir(step_dir) if layout.is_chunk_name(n))


def test_the_tiers_are_recorded_at_the_root(ckpt):
    d, ram = ckpt
    rec = json.loads((d / RECORD_NAME).read_text())
    assert [(t["name"], t["kind"], t["where"]) for t in rec["tiers"]] == \
        [("ram", "ram", str(ram)), ("local", "local", ".")]  # its own place: relative
    out = js("ls", d)
    assert out["recorded"] and [t["name"] for t in out["tiers"]] == ["ram", "local"]


def test_ls_shows_every_step_in_every_tier(ckpt):
    d, _ = ckpt
    out = js("ls", d, installed=True)  # the console script, as installed, in a process of its own
    assert [s["step"] for s in out["steps"]] == [3, 2, 1]
    for s in out["steps"]:
        assert s["viable"] and s["reason"] is None
        assert [(c["tier"], c["state"], c["processes"], c["problem"]) for c in s["copies"]] \
            == [("ram", "committed", "1/1", None), ("local", "committed", "1/1", None)]
        assert all(c["stored_bytes"] == 16 * 8 * 4 + 8 * 4 for c in s["copies"])
        assert all(0 <= c["age_s"] < 600 for c in s["copies"])
    text = run("ls", d).stdout
    assert "step 3: viable" in text and "ram" in text and "local" in text


def test_ls_says_why_a_step_is_not_viable(ckpt):
    d, ram = ckpt
    # step 3: a pack (or a chunk's own file) gone from both tiers
    victim = chunks(d / "3")[0]
    first = packs.at_start(str(d / "3"), victim)  # the first chunk found missing
    os.remove(d / "3" / victim)
    os.remove(ram / "3" / victim)
    # step 2: the manifest gone from the local tier only (RAM still whole)
    os.remove(d / "2" / layout.manifest_name(0, 1))
    # step 1: a torn manifest in RAM, none on disk
    (ram / "1" / layout.manifest_name(0, 1)).write_bytes(b'{"format": "resilient_ckpt", "ver')
    os.remove(d / "1" / layout.manifest_name(0, 1))
    steps = {s["step"]: s for s in js("ls", d)["steps"]}
    s3 = steps[3]
    missing = f"chunk {first} (in pack {victim}) is missing"
    assert not s3["viable"] and f"{missing} (ram, local)" in s3["reason"]
    assert all(missing in c["problem"] for c in s3["copies"])
    s2 = {c["tier"]: c for c in steps[2]["copies"]}
    assert steps[2]["viable"] and s2["ram"]["problem"] is None
    assert s2["local"]["state"] == "uncommitted" and "no manifest" in s2["local"]["problem"]
    assert not steps[1]["viable"] and "torn or damaged" in steps[1]["reason"]
    text = run("ls", d).stdout
    assert "step 3: NOT viable: save" in text and "is missing" in text


def test_ls_names_a_live_writer_and_a_wrong_size(ckpt):
    d, ram = ckpt
    os.remove(d / "3" / layout.manifest_name(0, 1))
    (d / "3" / layout.Writer.me().marker_name()).write_bytes(b"")
    victim = chunks(ram / "2")[0]
    os.truncate(ram / "2" / victim, os.path.getsize(ram / "2" / victim) - 1)  # its last chunk
    os.remove(d / "2" / victim)
    steps = {s["step"]: s for s in js("ls", d)["steps"]}
    local3 = next(c for c in steps[3]["copies"] if c["tier"] == "local")
    assert "being written" in local3["problem"]
    assert any("write marker" in w and "(alive)" in w for w in local3["writers"])
    assert not steps[2]["viable"] and "bytes in ram, its manifest says" in steps[2]["reason"]


def test_ls_finds_the_tiers_without_a_record_with_tier(ckpt):
    d, ram = ckpt
    os.remove(d / RECORD_NAME)
    plain = js("ls", d)
    assert not plain["recorded"] and [t["name"] for t in plain["tiers"]] == ["local"]
    out = js("ls", d, "--tier", f"ram={ram}")
    assert [t["name"] for t in out["tiers"]] == ["ram", "local"]
    assert [c["tier"] for c in out["steps"][0]["copies"]] == ["ram", "local"]
    run("ls", d / "nowhere", code=2)
    run("ls", d, "--tier", "nonsense", code=2)


def test_inspect_shows_the_tree(ckpt):
    d, _ = ckpt
    out = js("inspect", d, 2)
    assert out["viable"] and out["metrics"] == {"loss": 0.2} and out["processes"] == 1
    assert out["bytes_per_tier"] == {"ram": 544, "local": 544}
    leaves = {lf["path"]: lf for lf in out["items"][0]["leaves"]}
    w = leaves["['w']"]
    assert (w["kind"], w["shape"], w["dtype"], w["nbytes"]) == ("array", [16, 8], "float32", 512)
    assert w["sharding"]["spec"] == ["data", "model"] and w["chunks"] == 8
    assert "mesh(data=4,model=2)" in w["sharding_text"]
    assert (leaves["['step']"]["kind"], leaves["['step']"]["value"]) == ("scalar", 2)
    text = run("inspect", d, 2).stdout
    assert "['w']" in text and "float32" in text and "(16, 8)" in text and "loss" in text
    assert "ram 544 B" in text
    run("inspect", d, 7, code=1)


def test_verify_passes_then_finds_each_defect(ckpt):
    d, ram = ckpt
    p = run("verify", d)
    assert "ok: 54 chunk copies" in p.stdout and "verify" in p.stderr  # the bar
    assert js("verify", d, 3, "-q")["ok"]
    # a flipped byte in RAM's copy: the step stays viable (disk holds it), but verify fails
    victim = sorted(packs.places(str(ram / "3")))[0]
    packs.flip(str(ram / "3"), victim)
    out = js("verify", d, 3, "-q", code=1)
    assert not out["ok"] and out["chunks"] == 18
    assert [(x["tier"], x["key"]) for x in out["defects"]] == [("ram", victim)]
    assert "fails its checksum" in out["defects"][0]["problem"]
    assert js("verify", d, 2, "-q")["ok"]  # other steps are not touched
    # a deleted chunk and a removed manifest
    os.remove(d / "2" / chunks(d / "2")[0])
    os.remove(ram / "1" / layout.manifest_name(0, 1))
    out = js("verify", d, "-q", code=1)
    problems = [(x["step"], x["tier"], x["problem"]) for x in out["defects"]]
    assert any(s == 2 and t == "local" and "missing" in p for s, t, p in problems)
    assert any(s == 3 and t == "ram" and "checksum" in p for s, t, p in problems)
    out = js("verify", d, 1, "-q", code=1)  # the disk copy of step 1 is whole, RAM's not
    assert [(x["tier"], x["key"]) for x in out["defects"]] == [("ram", None)]
    assert "no manifest" in out["defects"][0]["problem"]
    text = run("verify", d, 2, "-q", code=1).stdout
    assert "DEFECT step 2 in local: chunk" in text and "FAILED" in text
    run("verify", d, 9, code=1)


def test_verify_fails_a_step_with_no_intact_manifest(ckpt):
    d, ram = ckpt
    os.remove(ram / "1" / layout.manifest_name(0, 1))
    (d / "1" / layout.manifest_name(0, 1)).write_bytes(b"not json")
    out = js("verify", d, 1, "-q", code=1)
    assert any(x["tier"] is None and "torn or damaged" in x["problem"] for x in out["defects"])
    assert any(x["tier"] == "local" and x["key"] is None for x in out["defects"])


def test_ls_names_orbax_steps_and_another_writers_claim(ckpt):
    d, ram = ckpt
    with ocp.CheckpointManager(d) as theirs:
        theirs.save(9, args=ocp.args.StandardSave({"a": np.arange(4)}))
        theirs.wait_until_finished()
    claim = ram / "3" / layout.claim_name(0, 1)
    doc = json.loads(claim.read_text())
    claim.write_text(json.dumps(dict(doc, save_id="f" * 32)))
    steps = {s["step"]: s for s in js("ls", d)["steps"]}
    assert not steps[9]["viable"] and "written by Orbax" in steps[9]["reason"]
    assert [c["state"] for c in steps[9]["copies"]] == ["orbax"]
    ram3 = next(c for c in steps[3]["copies"] if c["tier"] == "ram")
    assert any("another save ffffffff" in w for w in ram3["writers"])
    assert "written by Orbax" in run("ls", d).stdout


def test_a_manager_that_never_saves_records_nothing(tmp_path, mesh):
    d = tmp_path / "ro"
    with CheckpointManager(d, options=CheckpointManagerOptions(tiers=[LocalTier()])) as m:
        m.save(1, args=ocp.args.StandardSave(state(mesh, 1)))
    os.remove(d / RECORD_NAME)
    with CheckpointManager(d, options=CheckpointManagerOptions(read_only=True)) as m:
        assert m.all_steps() == [1]
    with CheckpointManager(d) as m:  # writable, but it only restores
        m.restore(1)
    assert not (d / RECORD_NAME).exists()


@pytest.mark.slow  # 11 s: three runs of the tool; GCS storage itself is the default run's elsewhere
def test_a_gcs_tier_is_listed_and_verified(gcs, url, tmp_path, ram_path, mesh):
    from resilient_ckpt.storage.gcs import GcsStorage
    d = tmp_path / "g"
    opts = CheckpointManagerOptions(tiers=[RamTier(path=ram_path),
                                           GcsTier(url, endpoint=gcs.endpoint)])
    with CheckpointManager(d, options=opts) as m:
        m.save(1, args=ocp.args.StandardSave(state(mesh, 1)))
        m.wait_until_finished()
    env = {"STORAGE_EMULATOR_HOST": gcs.endpoint}
    out = js("ls", d, env=env)  # a URL in the record is listed, never followed
    assert [(t["name"], t["where"]) for t in out["tiers"]] == [("ram", ram_path)]
    assert [(t["name"], t["where"]) for t in out["ignored"]] == [("gcs", url)]
    assert "not followed" in out["ignored"][0]["why"]
    out = js("ls", d, "--tier", f"gcs={url}", env=env)
    assert [(t["name"], t["where"]) for t in out["tiers"]] == [("ram", ram_path), ("gcs", url)]
    assert [(c["tier"], c["problem"]) for c in out["steps"][0]["copies"]] == \
        [("ram", None), ("gcs", None)]
    assert js("verify", d, "--tier", f"gcs={url}", "-q", env=env)["chunks"] == 18
    bare = js("ls", url, env=env)  # a gs:// directory alone: its one GCS tier
    assert [t["name"] for t in bare["tiers"]] == ["gcs"] and bare["steps"][0]["viable"]
    ram1 = str(pathlib.Path(ram_path) / "1")
    victim = chunks(ram1)[0]  # a pack: every chunk in it goes missing from GCS, RAM keeps them
    inside = sorted(k for k, (p, _, _) in packs.places(ram1).items()
                    if os.path.basename(p) == victim)
    GcsStorage(url, endpoint=gcs.endpoint).delete(f"1/{victim}")
    out = js("verify", d, 1, "-q", "--tier", f"gcs={url}", code=1, env=env)
    assert sorted((x["tier"], x["key"]) for x in out["defects"]) == [("gcs", k) for k in inside]
    assert all(f"missing (its pack {victim})" in x["problem"] for x in out["defects"])


def dead_writer():
    me = layout.Writer.me()
    return layout.Writer(me.host, me.pid, me.start + 1)  # same pid, another start: dead


def test_gc_lists_dead_writers_leftovers_then_removes_them(ckpt):
    d, ram = ckpt
    dead, me = dead_writer(), layout.Writer.me()
    tmp = d / "3" / dead.tmp_name(chunks(d / "3")[0])
    tmp.write_bytes(b"x" * 100)
    (d / "7").mkdir()  # an uncommitted step of a dead save: a chunk and its claim
    (d / "7" / "0123abcd.c0.0.0_0").write_bytes(b"y" * 64)
    (d / "7" / layout.claim_name(0, 1)).write_text(json.dumps(
        {"save_id": "0" * 32, "host": dead.host, "pid": dead.pid, "start": dead.start}))
    (d / "8").mkdir()  # a live save in progress: left alone
    (d / "8" / "89abcdef.c0.0.0_0").write_bytes(b"z" * 64)
    (d / "8" / me.marker_name()).write_bytes(b"")
    claim = d / "7" / layout.claim_name(0, 1)
    out = js("gc", d)
    found = {(x["tier"], x["path"]): x["bytes"] for x in out["leftovers"]}
    assert not out["applied"] and found == {
        ("local", f"3/{tmp.name}"): 100, ("local", "7/0123abcd.c0.0.0_0"): 64,
        ("local", f"7/{claim.name}"): claim.stat().st_size, ("local", "7"): 0}
    assert tmp.exists() and (d / "7").exists()  # a dry run removes nothing
    assert "would remove local:7/0123abcd.c0.0.0_0 64 B" in run("gc", d).stdout
    out = js("gc", d, "--apply")
    assert out["applied"] and len(out["leftovers"]) == 4
    assert not tmp.exists() and not (d / "7").exists()
    assert sorted(os.listdir(d / "8")) == sorted(["89abcdef.c0.0.0_0", me.marker_name()])
    assert "nothing to remove" in run("gc", d).stdout
    assert all(s["viable"] for s in js("ls", d)["steps"] if s["step"] <= 3)


def test_gc_leaves_a_tier_a_live_writer_holds_alone(ckpt, mesh):
    d, ram = ckpt
    opts = CheckpointManagerOptions(tiers=[RamTier(path=str(ram), keep=None)])
    with CheckpointManager(d / "other", options=opts) as m:  # holds the RAM tier's lock
        m.save(4, args=ocp.args.StandardSave(state(mesh, 4)))
        m.wait_until_finished()
        (ram / "3" / dead_writer().tmp_name("x")).write_bytes(b"t")
        (d / "3" / dead_writer().tmp_name("x")).write_bytes(b"t")
        out = js("gc", d, "--apply")
        tiers = {t["name"]: t["skipped"] for t in out["tiers"]}
        assert "live writer" in tiers["ram"] and tiers["local"] is None
        assert [x["tier"] for x in out["leftovers"]] == ["local"]
        assert any(n.startswith(".x.tmp") for n in os.listdir(ram / "3"))


@pytest.mark.slow  # 4 commands, 13 s; export and import themselves: tests/cli/test_interop.py
def test_export_and_import_on_the_command_line(ckpt, tmp_path, mesh):
    d, ram = ckpt
    dest = tmp_path / "orbax"
    out = js("export", d, 2, dest, "--tier", "local")
    assert out["step"] == 2 and out["items"] == ["default"]
    want = state(mesh, 2)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                if isinstance(v, jax.Array) else v for k, v in want.items()}
    got = ocp.StandardCheckpointer().restore(dest / "2" / "default", abstract)
    assert got["step"] == 2
    for k in ("w", "b"):
        assert np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes()
    run("export", d, 2, dest, code=2)  # the step is there already
    run("export", d, 7, tmp_path / "o7", code=1)
    assert not (tmp_path / "o7").exists() or not os.listdir(tmp_path / "o7")
    back = tmp_path / "back"
    assert js("import", dest, back)["step"] == 2
    with CheckpointManager(back) as m:
        r = m.restore(2, args=ocp.args.StandardRestore(abstract))
    assert np.asarray(r["w"]).tobytes() == np.asarray(want["w"]).tobytes()
    assert "imported step 5" in run("import", dest / "2" / "default", tmp_path / "b5",
                                    "--step", 5).stdout
