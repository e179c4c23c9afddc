"""Format 3: a process's chunks of a step are ranges of a few pack objects in
each tier. How many objects a step takes (the decoder state, in RAM, on disk
and on the fake GCS server), and what a damaged or hostile pack does: the
chunk it holds comes from another tier, or the error names step, chunk and
pack; nothing outside the step directory is read."""
from __future__ import annotations

import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout, manifest as mf
from resilient_ckpt.save import packing
from resilient_ckpt.storage.gcs import GcsStorage
from tests.support import packs
from tests.support.corruption import abstract, assert_exact, device_state


def _tiers(root, ram, *more):
    return rc.CheckpointManagerOptions(tiers=[rc.RamTier(path=ram, every=1),
                                              rc.LocalTier(every=1), *more])


def _saved(root, ram, step: int = 1):
    with rc.CheckpointManager(root, options=_tiers(root, ram)) as m:
        assert m.save(step, args=ocp.args.StandardSave(device_state(step)))
        m.wait_until_finished()


def _restore(root, tiers, step: int = 1):
    target = abstract()
    m = rc.CheckpointManager(root, options=rc.CheckpointManagerOptions(tiers=tiers))
    try:
        got = m.restore(step, args=ocp.args.StandardRestore(target))
        return got, m.last_restore
    finally:
        m.close()


def _rewrite(step_dir: str, edit) -> None:
    """Re-signs the step's manifest after `edit(doc)` (a valid checksum: only
    the new rules can refuse it)."""
    path = os.path.join(step_dir, layout.manifest_name(0, 1))
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    edit(doc)
    del doc["manifest_crc32c"]
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    from resilient_ckpt.native import crc32c
    with open(path, "wb") as f:
        f.write(body + b',"manifest_crc32c":%d}' % crc32c.value(body))


def _chunk_docs(doc):
    return [c for it in doc["items"] for lf in it["leaves"] for c in lf["chunks"]]


# ---------------------------------------------------------------- objects per step


def test_packing_plan_bounds_the_objects_of_any_step():
    """Every pack but the last holds its target, so a process's step takes at
    most `packing.share` packs plus one, or one more than its bytes in
    PACK_BYTES; chunks of a pack's size stand alone. With the manifest and
    the claim: at most 8 objects plus one per PACK_BYTES."""
    big = packing.PACK_BYTES
    for sizes in ([10] * 5000, [big // 3] * 40, [big - 1] * 9, [big, 5, big * 2, 7],
                  [0] * 3, [big // 2 + 1] * 20, [], [big // 40] * 41, [big // 100] * 250,
                  [big // 100] * 520, [big // 100] * 800):
        groups = packing.plan(sizes)
        assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
        small = sum(packing.align(n) for n in sizes if n < big)  # whole pages each
        n_packs = sum(packing.packed(g, sizes) for g in groups)
        assert n_packs <= max(packing.share(small) + 1, small // big + 1), sizes[:3]
        assert len(groups) - n_packs == sum(n >= big for n in sizes)
        stored = small + sum(n for n in sizes if n >= big)
        assert len(groups) + 2 <= 8 + -(-stored // big), sizes[:3]
        for g in groups:
            at, size = packing.offsets([sizes[i] for i in g])
            assert all(a % mf.PACK_ALIGN == 0 for a in at)


def test_a_small_step_is_a_few_files_in_each_file_tier(tmp_path, ram_path):
    root = str(tmp_path / "ckpt")
    _saved(root, ram_path)
    for d in (os.path.join(ram_path, "1"), os.path.join(root, "1")):
        names = os.listdir(d)
        assert len(names) <= 8, names
        assert sum(layout.is_chunk_name(n) for n in names) == len(names) - 2  # manifest, claim


@pytest.mark.slow
def test_the_decoder_state_takes_a_few_objects_per_step_in_every_tier(tmp_path, ram_path,
                                                                       gcs, url, s3):
    """The decoder state (876 leaves, about 5,600 chunks on 8 devices; about
    22 MB at its smallest): at most 8 objects plus one per 256 MB in each of
    the RAM, local, GCS and S3 tiers (packs, the manifest, the claim)."""
    from bench.harness.state import build_state, make_mesh, same_values, tree_bytes
    from resilient_ckpt.storage.fsspec_store import FsspecStorage
    state = build_state("decoder", 1 << 20, make_mesh(4, 2))
    nbytes = tree_bytes(state)
    bound = 8 + -(-nbytes // 256_000_000)
    root = str(tmp_path / "ckpt")
    s3_url = f"s3://{s3.bucket()}/run"
    gcs_tier = rc.GcsTier(url, endpoint=gcs.endpoint, every=1)
    s3_tier = rc.FsspecTier(s3_url, storage_options=s3.options(), every=1)
    with rc.CheckpointManager(root, options=_tiers(root, ram_path, gcs_tier, s3_tier)) as m:
        assert m.save(1, args=ocp.args.StandardSave(state))
        m.wait_until_finished()
        n_chunks = len(list(m.catalog.viable()[1].manifest.chunks()))
    assert n_chunks > 5000
    counts = {"ram": len(os.listdir(os.path.join(ram_path, "1"))),
              "local": len(os.listdir(os.path.join(root, "1"))),
              "gcs": len(GcsStorage(url, endpoint=gcs.endpoint).list("1")),
              "s3": len(FsspecStorage(s3_url, s3.options()).list("1"))}
    assert all(n <= bound for n in counts.values()), (counts, bound)
    for tier in ("ram", "local", "gcs", "s3"):
        tiers = {"ram": [rc.RamTier(path=ram_path)], "local": [rc.LocalTier()],
                 "gcs": [rc.GcsTier(url, endpoint=gcs.endpoint)],
                 "s3": [rc.FsspecTier(s3_url, storage_options=s3.options())]}[tier]
        with rc.CheckpointManager(root, options=rc.CheckpointManagerOptions(
                tiers=tiers)) as m:
            got = m.restore(1, args=ocp.args.StandardRestore(state))
            assert set(m.last_restore.bytes_by_tier) == {tier}
        assert same_values(got, state), tier


# ---------------------------------------------------------------- damaged and hostile packs


def test_a_pack_truncated_under_a_chunk_falls_back_or_names_step_chunk_and_pack(tmp_path,
                                                                                ram_path):
    root = str(tmp_path / "ckpt")
    _saved(root, ram_path)
    ram_dir = os.path.join(ram_path, "1")
    where = packs.places(ram_dir)
    victim = max(where, key=lambda k: (where[k][1], k))  # the last chunk of a pack
    pack = packs.pack_of(ram_dir, victim)
    path, at, n = where[victim]
    os.truncate(path, at + n - 1)  # one byte short: this chunk only
    got, rec = _restore(root, [rc.RamTier(path=ram_path), rc.LocalTier()])
    assert_exact(got, 1)
    assert rec.served[victim] == "local"
    assert all(t == "ram" for k, t in rec.served.items() if k != victim)
    with pytest.raises(rc.StepNotFoundError) as ei:
        _restore(root, [rc.RamTier(path=ram_path)])
    msg = str(ei.value)
    assert "step 1" in msg and victim in msg and pack in msg, msg


def test_a_manifest_placing_a_chunk_past_its_pack_or_at_a_huge_offset(tmp_path, ram_path):
    """The manifest's word is checked against the pack's size: a chunk whose
    range runs past its pack has no copy in that tier (selection), whatever
    the offset claims, so the other tier serves it."""
    root = str(tmp_path / "ckpt")
    _saved(root, ram_path, 1)
    _saved(root, ram_path, 2)

    def past(doc):
        c = _chunk_docs(doc)[0]
        end = os.path.getsize(os.path.join(ram_path, "1", c["pack"]))
        c["pack_offset"] = -(-end // mf.PACK_ALIGN) * mf.PACK_ALIGN

    def huge(doc):
        _chunk_docs(doc)[0]["pack_offset"] = 2**62

    for step, edit in ((1, past), (2, huge)):
        _rewrite(os.path.join(ram_path, str(step)), edit)
        got, rec = _restore(root, [rc.RamTier(path=ram_path), rc.LocalTier()], step)
        assert_exact(got, step)
        assert "local" in rec.served.values()
        with pytest.raises(rc.StepNotFoundError, match=f"step {step}.*in pack "):
            _restore(root, [rc.RamTier(path=ram_path)], step)


@pytest.mark.parametrize("edit, why", [
    (lambda cs: cs[1].update(pack_offset=-4096), "pack_offset"),
    (lambda cs: cs[1].update(pack_offset=cs[0]["pack_offset"], pack=cs[0]["pack"]), "overlap"),
    (lambda cs: cs[0].update(pack="../../precious"), "not one path component"),
    (lambda cs: cs[0].update(pack="sub/" + cs[0]["pack"]), "not one path component"),
    (lambda cs: cs[0].update(pack=".."), "not one path component"),
])
def test_a_hostile_pack_record_makes_that_copy_absent(tmp_path, ram_path, edit, why):
    """A negative offset, two chunks overlapping in a pack, a pack name with a
    path separator or `..`: the RAM tier's manifest is refused (naming why),
    nothing outside the step directory is read, and the local copy serves."""
    root = str(tmp_path / "ckpt")
    _saved(root, ram_path)
    (tmp_path / "precious").write_bytes(b"\0" * (1 << 20))
    _rewrite(os.path.join(ram_path, "1"), lambda doc: edit(_chunk_docs(doc)))
    with open(os.path.join(ram_path, "1", layout.manifest_name(0, 1)), "rb") as f:
        with pytest.raises(rc.CorruptCheckpointError, match=why):
            mf.parse(f.read(), "m.json")
    got, rec = _restore(root, [rc.RamTier(path=ram_path), rc.LocalTier()])
    assert_exact(got, 1)
    assert set(rec.served.values()) == {"local"}


def test_a_pack_that_is_a_link_is_never_followed(tmp_path, ram_path):
    """A link at a pack's name in the local tier (to a copy of the very bytes
    it should hold) is a missing pack, as a link at a chunk's name was."""
    root = str(tmp_path / "ckpt")
    _saved(root, ram_path)
    local_dir = os.path.join(root, "1")
    pack = sorted(n for n in os.listdir(local_dir) if layout.is_chunk_name(n))[0]
    outside = tmp_path / "outside"
    os.replace(os.path.join(local_dir, pack), outside)
    os.symlink(outside, os.path.join(local_dir, pack))
    got, rec = _restore(root, [rc.RamTier(path=ram_path), rc.LocalTier()])
    assert_exact(got, 1)
    assert "local" not in {t for k, t in rec.served.items()
                           if packs.pack_of(os.path.join(ram_path, "1"), k) == pack}
    with pytest.raises(rc.StepNotFoundError, match=f"step 1.*in pack {pack}.*missing"):
        _restore(root, [rc.LocalTier()])


def test_a_short_pack_on_gcs_is_found_at_read_and_named(gcs, url):
    """On GCS sizes come from the manifest (no request per object at
    selection): a pack cut short fails the read of the chunk past its end,
    which names the step, the chunk and the pack."""
    tier = rc.GcsTier(url, endpoint=gcs.endpoint, every=1)
    with rc.CheckpointManager(url, options=rc.CheckpointManagerOptions(tiers=[tier])) as m:
        assert m.save(1, args=ocp.args.StandardSave(device_state(1)))
        m.wait_until_finished()
        chunks = [c for _, _, c in m.catalog.viable()[1].manifest.chunks() if c.pack]
    last = max(chunks, key=lambda c: (c.pack, c.pack_offset))
    st = GcsStorage(url, endpoint=gcs.endpoint)
    whole = st.read(f"1/{last.pack}")
    st.put(f"1/{last.pack}", memoryview(whole[:last.pack_offset + 1]))
    with rc.CheckpointManager(url, options=rc.CheckpointManagerOptions(
            tiers=[rc.GcsTier(url, endpoint=gcs.endpoint)])) as m:
        with pytest.raises(rc.CorruptCheckpointError) as ei:
            m.restore(1, args=ocp.args.StandardRestore(abstract()))
    msg = str(ei.value)
    assert "step 1" in msg and last.key in msg and last.pack in msg, msg
