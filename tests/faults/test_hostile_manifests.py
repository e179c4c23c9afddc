"""Hostile manifests: a real step's manifest, damaged or rewritten to lie, in
one tier's copy (or both) of the newest step.

Steps 1-3 of a small sharded state are saved once to a RamTier and a LocalTier
on the 8-CPU-device mesh; each case works on a fresh copy of both tiers,
mutates step 3's manifest there, and opens a NEW manager. The rules: the
manager opens; the damaged copy is never used and its reason is kept in the
tier's view; the other tier's copy of step 3 restores bit-exact (or, with both
damaged, step 2 does, and step 3 is not viable); nothing else on storage
changes. Mutations are raw (bit flips, cuts, garbage, deep nesting, size:
the checksum or the limits catch them) or rewritten with a valid checksum, as
a buggy writer would (the field rules catch them).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import errno
import hashlib
import json
import logging
import shutil
import tempfile

import google_crc32c
import numpy as np
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import resilient_ckpt as rc
from resilient_ckpt.catalog import tier_steps
from resilient_ckpt.core import layout, manifest as mf, selection
from resilient_ckpt.errors import StorageError
from resilient_ckpt.storage.files import FileStorage
from resilient_ckpt.storage.wrapper import StorageWrapper
from tests.support import effort
from tests.support.corruption import abstract, assert_exact, device_state

TRAILER = b',"manifest_crc32c":'
OTHER = {"ram": "local", "local": "ram"}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """Both tiers with steps 1-3 committed, saved once for the module."""
    ram = tempfile.mkdtemp(prefix="rc-hostile-", dir="/dev/shm")
    local = str(tmp_path_factory.mktemp("hostile") / "local")
    with _open(ram, local) as m:
        for s in (1, 2, 3):
            m.save(s, args=ocp.args.StandardSave(device_state(s)))
        m.wait_until_finished()
    yield {"ram": ram, "local": local}
    shutil.rmtree(ram, ignore_errors=True)


def _open(ram: str, local: str) -> rc.CheckpointManager:
    return rc.CheckpointManager(local, options=rc.CheckpointManagerOptions(
        tiers=(rc.RamTier(path=ram), rc.LocalTier(path=local))))


class Copy:
    """A fresh copy of the template's tiers."""

    def __init__(self, template: dict, tmp: str):
        self.roots = {"ram": tempfile.mkdtemp(prefix="rc-hostile-", dir="/dev/shm"),
                      "local": os.path.join(tmp, "local")}
        shutil.rmtree(self.roots["ram"])
        for tier, root in self.roots.items():
            shutil.copytree(template[tier], root, symlinks=True)

    def manifest(self, tier: str, step: int = 3) -> str:
        return os.path.join(self.roots[tier], str(step), layout.manifest_name(0, 1))

    def digest(self, skip: set[str]) -> dict:
        """(path in tier, tier) -> sha256 of every file, but those in `skip`."""
        out = {}
        for tier, root in self.roots.items():
            for d, _, files in os.walk(root):
                for n in files:
                    p = os.path.join(d, n)
                    if os.path.isfile(p) and not n.startswith(".") and p not in skip:
                        with open(p, "rb") as f:
                            out[os.path.relpath(p, root), tier] = hashlib.sha256(
                                f.read()).hexdigest()
        return out

    def open(self) -> rc.CheckpointManager:
        return _open(self.roots["ram"], self.roots["local"])

    def close(self) -> None:
        shutil.rmtree(self.roots["ram"], ignore_errors=True)


@pytest.fixture
def copy(template, tmp_path):
    c = Copy(template, str(tmp_path))
    yield c
    c.close()


def sign(body: bytes) -> bytes:
    return body + TRAILER + b"%d}" % google_crc32c.value(body)


def resign(doc: dict) -> bytes:
    doc = {k: v for k, v in doc.items() if k != "manifest_crc32c"}
    return sign(json.dumps(doc, separators=(",", ":")).encode()[:-1])


def restore(m: rc.CheckpointManager, step=None):
    return m.restore(step, args=ocp.args.StandardRestore(abstract()))


def check(copy: Copy, tiers: tuple[str, ...], write) -> None:
    """Damages step 3's manifest in `tiers` with write(path), then checks the rules."""
    for tier in tiers:
        write(copy.manifest(tier))
    skip = {copy.manifest(t) for t in tiers}
    before = copy.digest(skip)
    with copy.open() as m:
        for tier in tiers:  # the damaged copy's reason is kept, naming the file
            (err,) = m.catalog.view(tier)[3].manifests
            assert isinstance(err, rc.CorruptCheckpointError)
            assert copy.manifest(tier) in str(err)
        if len(tiers) == 1:
            assert m.latest_step() == 3
            assert_exact(restore(m, 3), 3)
            assert set(m.last_restore.served.values()) == {OTHER[tiers[0]]}
        else:
            assert m.all_steps() == [1, 2] and m.latest_step() == 2
            assert_exact(restore(m), 2)
            with pytest.raises(rc.StepNotFoundError):
                restore(m, 3)
        m._cleanup.join(30)
    assert copy.digest(skip) == before  # nothing committed changed, nothing went


# --------------------------------------------------------------- the cases reported

def _inline_scalar_3_to_7(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    old, new = b'"value":{"type":"int","value":3}', b'"value":{"type":"int","value":7}'
    assert data.count(old) == 1
    bad = data.replace(old, new)
    json.loads(bad)  # still valid JSON: only the checksum can tell
    with open(path, "wb") as f:
        f.write(bad)


def test_scalar_3_to_7_in_the_ram_copy_restores_3_from_local(copy):
    check(copy, ("ram",), _inline_scalar_3_to_7)


def _sparse_8tib(path: str) -> None:
    os.truncate(path, 8 * 2**40)


def _deep(path: str) -> None:
    with open(path, "wb") as f:
        f.write(b"[" * 100_000 + b"]" * 100_000)


def _deep_signed(path: str) -> None:
    with open(path, "rb") as f:
        body = f.read().rpartition(TRAILER)[0]
    deep = b'"metrics":' + b"[" * 100_000 + b"]" * 100_000
    with open(path, "wb") as f:
        f.write(sign(body.replace(b'"metrics":null', deep)))


def _fifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def _directory(path: str) -> None:
    os.remove(path)
    os.mkdir(path)


def _huge_chunk_claim(path: str) -> None:
    """The reported case: a 256-byte chunk claiming shape (1e12, 64) float32."""
    with open(path, "rb") as f:
        doc = json.load(f)
    (b,) = [lf for lf in doc["items"][0]["leaves"] if lf["path"] == [["key", "b"]]]
    b["shape"] = [10**12, 64]
    b["chunks"][0].update(sizes=[10**12, 64], offsets=[0, 0])
    with open(path, "wb") as f:
        f.write(resign(doc))


REPORTED = {"sparse 8 TiB": _sparse_8tib, "nested 100000 deep": _deep,
            "nested deep, valid checksum": _deep_signed, "a FIFO": _fifo,
            "a directory": _directory, "huge chunk claim": _huge_chunk_claim}


@pytest.mark.parametrize("tiers", [("ram",), ("local",), ("ram", "local")])
@pytest.mark.parametrize("name", sorted(REPORTED))
def test_reported_defects_never_block_the_manager(copy, name, tiers, caplog):
    with caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
        check(copy, tiers, REPORTED[name])
    assert layout.manifest_name(0, 1) in caplog.text  # the warning names the file


# --------------------------------------------------------------- generated

WRONG = ["7", 1.5, True, {}, None, -1, 2**64, [[]]]
CHUNK_FIELDS = ["offsets", "sizes", "key", "nbytes", "stored_nbytes", "crc32c", "codec",
                "block_bytes", "block_crc32c"]
LEAF_FIELDS = ["path", "kind", "shape", "dtype", "chunks"]  # where null is never valid
TOP_FIELDS = ["format", "version", "step", "save_id", "created", "process", "meshes", "items"]
BAD_DTYPES = ["float33", "object", ">f4", "<f4", "U4", "V4", "S3", "float128", "f4", ""]


def _leaf(doc: dict, which: str) -> dict:
    (lf,) = [x for x in doc["items"][0]["leaves"] if x["path"] == [["key", which]]]
    return lf


@st.composite
def rewrites(draw):
    """A function that makes a manifest doc invalid, and keeps its checksum valid."""
    kind = draw(st.sampled_from(["wrong type", "drop field", "unknown field", "dtype",
                                 "nbytes", "shape", "duplicate path", "sharding", "value"]))
    leaf = draw(st.sampled_from(["w", "b"]))
    chunk = draw(st.integers(0, 7)) if leaf == "w" else 0
    field_level = draw(st.sampled_from(["top", "leaf", "chunk"]))
    fields = {"top": TOP_FIELDS, "leaf": LEAF_FIELDS, "chunk": CHUNK_FIELDS}[field_level]
    field = draw(st.sampled_from(fields))
    # Only values that are wrong for the field: a number is a fine `created`,
    # "7" a fine save_id or key.
    wrong = draw(st.sampled_from([v for v in WRONG if not (
        (field == "created" and type(v) in (int, float) and abs(v) <= 2**63)
        or (field in ("save_id", "key") and isinstance(v, str)))]))
    # a leaf's named sharding, or the mesh it names in the manifest's table
    sfield = draw(st.sampled_from(["type", "mesh", "spec", "meshes.axis_names",
                                   "meshes.mesh_shape", "meshes.device_ids"]))
    bad_dtype = draw(st.sampled_from(BAD_DTYPES))
    delta = draw(st.sampled_from([-4, -1, 1, 2**20, 2**62]))
    huge = draw(st.sampled_from([[10**12, 64], [2**62, 2**62], [2**64], [1] * 65, [-1]]))

    def target(doc):
        lf = _leaf(doc, leaf)
        return {"top": doc, "leaf": lf, "chunk": lf["chunks"][chunk]}[field_level]

    def rewrite(doc):
        lf = _leaf(doc, leaf)
        c = lf["chunks"][chunk]
        if kind == "wrong type":
            target(doc)[field] = wrong
        elif kind == "drop field":
            del target(doc)[field]
        elif kind == "unknown field":
            target(doc)["shiny"] = 1
        elif kind == "dtype":
            lf["dtype"] = bad_dtype
        elif kind == "nbytes":
            c["nbytes"] += delta
            c["stored_nbytes"] = c["nbytes"]
        elif kind == "shape":
            lf["shape"] = huge
            c["sizes"], c["offsets"] = huge, [0] * len(huge)
        elif kind == "duplicate path":
            _leaf(doc, "n")["path"] = lf["path"]
        elif kind == "sharding" and sfield.startswith("meshes."):
            del doc["meshes"][lf["sharding"]["mesh"]][sfield.split(".")[1]]
        elif kind == "sharding":
            del lf["sharding"][sfield]
        else:  # a value where only null is valid
            lf["value"] = {"type": "int", "value": 3}
        return resign(doc)
    return f"{kind}: {leaf}[{chunk}] {field_level}.{field}", lambda data: rewrite(
        json.loads(data))


@st.composite
def damages(draw):
    """A function that damages manifest bytes (no valid checksum after it)."""
    kind = draw(st.sampled_from(["flip", "cut", "garbage", "append"]))
    at = draw(st.floats(0, 1, exclude_max=True))
    bit = draw(st.integers(0, 7))
    extra = draw(st.sampled_from([b" ", b"\n", b"{}", b"\x00"]))

    def damage(data: bytes) -> bytes:
        i = int(at * len(data))
        if kind == "flip":
            out = bytearray(data)
            out[i] ^= 1 << bit
            return bytes(out)
        if kind == "cut":
            return data[:i]
        if kind == "garbage":
            return np.random.default_rng(i).bytes(max(i, 1))
        return data + extra
    return f"{kind} at {at:.3f} bit {bit}", damage


@settings(max_examples=effort.examples(60), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(change=st.one_of(rewrites(), damages()),
       tiers=st.sampled_from([("ram",), ("local",), ("ram", "local")]))
def test_generated_hostile_manifests(template, tmp_path_factory, change, tiers):
    name, fn = change
    event(name.split(" at ")[0].split(":")[0])

    def write(path: str) -> None:
        with open(path, "rb") as f:
            data = f.read()
        out = fn(data)
        assert out != data, name
        with open(path, "wb") as f:
            f.write(out)
    c = Copy(template, str(tmp_path_factory.mktemp("case")))
    try:
        check(c, tiers, write)
    finally:
        c.close()


# --------------------------------------------------------------- unlistable, unaskable

class _Refusing(StorageWrapper):
    """A real file tier whose listing of step 3 and size of one chunk fail with
    EACCES. Injected (tests run as root, where permissions do not refuse)."""

    def __init__(self, inner, chunk: str | None = None):
        super().__init__(inner)
        self.chunk = chunk

    def list(self, prefix: str = "", starts_with: str = ""):
        if prefix == "3" and self.chunk is None:
            raise StorageError(errno.EACCES, f"{self.url}/3: listing refused")
        return super().list(prefix, starts_with)

    def size(self, key: str):
        if self.chunk is not None and key == f"3/{self.chunk}":
            raise StorageError(errno.EACCES, f"{self.url}/{key}: stat refused")
        return super().size(key)


def test_a_step_that_cannot_be_listed_or_asked_shows_its_reason(copy):
    naming = layout.StepNaming()

    def local(chunk=None):
        return _Refusing(FileStorage(copy.roots["local"], "local", create=False), chunk)
    views = tier_steps.observe(local(), "local", naming)
    assert sorted(views) == [1, 2, 3]
    (err,) = views[3].manifests
    assert isinstance(err, rc.CorruptCheckpointError) and "listing refused" in str(err)
    assert all(isinstance(m, mf.Manifest) for s in (1, 2) for m in views[s].manifests)
    assert selection.viable({s: [v] for s, v in views.items()}, ["local"]).keys() == {1, 2}
    copied = FileStorage(copy.roots["local"], "local", create=False)
    seen = tier_steps.observe(copied, "local", naming)[3]
    key = sorted(seen.sizes)[0]
    held_in = next(c.object for m in seen.manifests for _, _, c in m.chunks() if c.key == key)
    asked = tier_steps.observe(local(held_in), "local", naming)
    assert asked[3].sizes[key] is None  # no usable copy of that chunk here
    assert selection.viable({s: [v] for s, v in asked.items()}, ["local"]).keys() == {1, 2}


def test_processes_whose_records_disagree_are_not_one_save():
    """Process 1's manifest (valid on its own) says leaf w is int32, where
    process 0's says float32: its chunks would be read as another leaf."""
    def half(p: int, dtype: str) -> mf.Manifest:
        c = mf.ChunkRecord((2 * p,), (2,), f"k.{p}", 8, 8, p)
        leaf = mf.LeafRecord((("key", "w"),), "array", (4,), dtype, None, None, None, (c,))
        return mf.Manifest(5, "ab" * 16, 1.0, p, 2, (mf.ItemRecord("default", "pytree",
                                                                   (leaf,)),))
    sizes = {"k.0": 8, "k.1": 8}
    good = {5: [selection.TierStep("local", (half(0, "float32"), half(1, "float32")), sizes)]}
    assert selection.viable(good, ["local"]).keys() == {5}
    bad = {5: [selection.TierStep("local", (half(0, "float32"), half(1, "int32")), sizes)]}
    assert selection.viable(bad, ["local"]) == {}
