"""Unit tests of the manifest: round trip, its checksum, version handling, and
strict parsing: each defect is rejected with a message naming the field."""
import dataclasses
import json

import google_crc32c
import pytest

from resilient_ckpt import CorruptCheckpointError, UnsupportedFormatError
from resilient_ckpt.core import manifest as mf
from resilient_ckpt.core.strictjson import MAX_VALUE_DEPTH
from resilient_ckpt.testing import formats

TRAILER = b',"manifest_crc32c":'
NAMED = {"type": "named", "axis_names": ["x", "y"], "mesh_shape": [2, 1],
         "device_ids": [0, 1], "spec": [["x", "y"]]}


def sample() -> mf.Manifest:
    chunks = (mf.ChunkRecord((0, 0), (2, 3), "ab.c0.0.0_0", 24, 24, 123),
              mf.ChunkRecord((2, 0), (2, 3), "ab.c0.0.2_0", 24, 24, 456))
    key = (mf.ChunkRecord((0,), (2,), "ab.c0.3.0", 8, 8, 9, "raw", 8, (9,)),)
    leaves = (
        mf.LeafRecord((("key", "params"), ("key", "w")), "array", (4, 3), "float32",
                      {"type": "single_device", "device_id": 0}, None, None, chunks),
        mf.LeafRecord((("key", "lr"),), "scalar", value=mf.encode_scalar(0.1)),
        mf.LeafRecord((("key", "opt"), ("index", 0)), "none"),
        mf.LeafRecord((("attr", "rng"),), "prng_key", (2,), "uint32", NAMED,
                      "threefry2x32", None, key),
        mf.LeafRecord((("key", "s"),), "numpy_scalar", (), "bfloat16",
                      chunks=(mf.ChunkRecord((), (), "ab.c0.4.s", 2, 2, 7),)),
    )
    return mf.Manifest(7, "ab" * 16, 1.5, 0, 1,
                       (mf.ItemRecord("default", "pytree", leaves),
                        mf.ItemRecord("meta", "json", (), {"epoch": 3})),
                       metrics={"loss": 0.5}, custom_metadata={"run": "x"})


def sign(body: bytes) -> bytes:
    """A version-2 manifest's bytes for `body` (everything before the trailer)."""
    return body + TRAILER + b"%d}" % google_crc32c.value(body)


def encode(d: dict) -> bytes:
    """`d` as a writer that computes the checksum right would write it."""
    d = {k: v for k, v in d.items() if k != "manifest_crc32c"}
    return sign(json.dumps(d, separators=(",", ":")).encode()[:-1])


def _doc():
    return json.loads(mf.to_json(sample()))


def _v3(d: dict) -> dict:
    """`d` (a version-5 document) as a version-3 writer wrote it."""
    return formats.as_version_3(d)


def _unpacked(d: dict, version: int) -> dict:
    """`d` (a version-5 document) as a version `version` (1 or 2) writer wrote
    it: no `pack` or `pack_offset` in its chunks."""
    d = _v3(d)
    for it in d["items"]:
        for lf in it["leaves"]:
            for c in lf["chunks"]:
                del c["pack"], c["pack_offset"]
    d["version"] = version
    return d


# --------------------------------------------------------------- round trip, checksum

def test_round_trip_is_exact():
    m = sample()
    assert mf.parse(mf.to_json(m)) == m
    assert m.nbytes == 58
    assert [c.key for _, _, c in m.chunks()] == ["ab.c0.0.0_0", "ab.c0.0.2_0", "ab.c0.3.0",
                                                "ab.c0.4.s"]


def test_the_checksum_covers_every_byte_before_the_trailer():
    data = mf.to_json(sample())
    body, _, tail = data.rpartition(TRAILER)
    assert int(tail[:-1]) == google_crc32c.value(body) and tail.endswith(b"}")
    assert json.loads(data)["version"] == mf.FORMAT_VERSION == 5
    assert encode(json.loads(data)) == data  # the spec's recipe gives the writer's bytes


@pytest.mark.parametrize("at", [0, 1, 30, 200, -40, -25, -12, -2, -1])
def test_any_flipped_bit_is_caught(at):
    data = bytearray(mf.to_json(sample()))
    data[at] ^= 0x04
    with pytest.raises(CorruptCheckpointError, match="where.json"):
        mf.parse(bytes(data), "where.json")


def test_a_changed_value_that_is_still_json_is_caught_by_the_checksum():
    data = mf.to_json(sample())
    bad = data.replace(b'"epoch":3', b'"epoch":7')
    assert bad != data and json.loads(bad)["items"][1]["value"] == {"epoch": 7}
    with pytest.raises(CorruptCheckpointError, match="m.json: manifest_crc32c does not match"):
        mf.parse(bad, "m.json")


def test_version_2_without_its_checksum_is_corrupt():
    d = _doc()
    del d["manifest_crc32c"]
    with pytest.raises(CorruptCheckpointError, match="without a valid trailing manifest_crc32c"):
        mf.parse(json.dumps(d).encode(), "m.json")
    spaced = mf.to_json(sample())[:-1] + b" }"  # no longer ends as the spec says
    with pytest.raises(CorruptCheckpointError, match="without a valid"):
        mf.parse(spaced)


def test_version_1_is_read_without_a_checksum_and_rewritten_in_the_current_format():
    d = _unpacked(_doc(), 1)
    del d["manifest_crc32c"]
    m = mf.parse(json.dumps(d, indent=2).encode())  # any JSON layout parses in version 1
    assert m.version == 1 and m == sample()
    again = mf.to_json(m)  # a copy to another tier is written in the current format
    assert mf.parse(again).version == mf.FORMAT_VERSION
    with pytest.raises(CorruptCheckpointError, match="version 1 manifest cannot carry"):
        mf.parse(encode(dict(d)))


def test_future_version_says_upgrade():
    d = _doc()
    d["version"] = mf.FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match=f"version {mf.FORMAT_VERSION + 1}.*upgrade"):
        mf.parse(encode(d), "tier/7/manifest.0-of-1.json")


def test_unknown_field_is_an_error_not_skipped():
    d = _doc()
    d["items"][0]["leaves"][0]["chunks"][0]["shiny"] = 1
    with pytest.raises(UnsupportedFormatError, match="shiny"):
        mf.parse(encode(d))


@pytest.mark.parametrize("cut", [1, 10, 100, -1])
def test_torn_manifest_is_corrupt(cut):
    data = mf.to_json(sample())
    with pytest.raises(CorruptCheckpointError, match="where.json"):
        mf.parse(data[:cut], "where.json")


def test_not_a_manifest():
    with pytest.raises(CorruptCheckpointError, match="not a resilient_ckpt manifest"):
        mf.parse(b'{"hello": 1}')
    with pytest.raises(CorruptCheckpointError, match="UTF-8"):
        mf.parse(b"\xff\xfe garbage")


# --------------------------------------------------------------- limits

def test_oversize_input_is_refused_before_it_is_parsed(monkeypatch):
    data = mf.to_json(sample())
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(CorruptCheckpointError, match=f"m.json: {len(data)} bytes is over"):
        mf.parse(data, "m.json")
    with pytest.raises(ValueError, match="over the .*-byte limit"):
        mf.to_json(sample())  # the writer refuses what readers would


def test_deep_nesting_is_corrupt_not_a_recursion_error():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(CorruptCheckpointError, match="m.json: nested too deeply"):
        mf.parse(deep, "m.json")
    body = mf.to_json(sample()).rpartition(TRAILER)[0]
    signed = sign(body.replace(b'"metrics":{"loss":0.5}', b'"metrics":' + deep))
    with pytest.raises(CorruptCheckpointError, match="nested too deeply"):
        mf.parse(signed, "m.json")


@pytest.mark.parametrize("field", ["metrics", "custom_metadata"])
def test_free_json_nests_at_most_max_value_depth(field):
    def nested(n):
        v: object = 1
        for _ in range(n):
            v = [v]
        return v
    d = _doc()
    d[field] = nested(MAX_VALUE_DEPTH)
    assert getattr(mf.parse(encode(d)), field) == nested(MAX_VALUE_DEPTH)
    d[field] = {"a": nested(MAX_VALUE_DEPTH)}
    with pytest.raises(CorruptCheckpointError, match=f"{field} nests deeper than 100"):
        mf.parse(encode(d))
    m = mf.Manifest(1, "ab" * 16, 1.0, 0, 1, (), **{field: d[field]})
    with pytest.raises(ValueError, match="nests deeper"):
        mf.to_json(m)


def test_the_writer_refuses_a_dtype_readers_refuse():
    leaf = mf.LeafRecord((("key", "t"),), "numpy", (2,), "datetime64[s]",
                         chunks=(mf.ChunkRecord((0,), (2,), "k", 16, 16, 1),))
    m = mf.Manifest(1, "ab" * 16, 1.0, 0, 1, (mf.ItemRecord("default", "pytree", (leaf,)),))
    with pytest.raises(ValueError, match=r"\['t'\].*datetime64\[s\].*cannot save"):
        mf.to_json(m)


# --------------------------------------------------------------- field rules

W = "items[0].leaves[0]"  # the float32 array leaf
C0 = W + ".chunks[0]"
KEY = "items[0].leaves[3]"  # the prng_key leaf, named sharding


def _leaf(d, i=0):
    return d["items"][0]["leaves"][i]


def _chunk(d, i=0):
    return _leaf(d)["chunks"][i]


DEFECTS = {
    # dtypes: an allow-list, names only (no byte order), no object/str/void/bytes
    **{f"dtype {v}": (lambda d, v=v: _leaf(d).update(dtype=v), W + ".dtype")
       for v in ["float33", "object", ">f4", "<f4", "U4", "V4", "str", "bytes", "float128",
                 "datetime64[s]", 4, None]},
    "prng_key not uint32": (lambda d: _leaf(d, 3).update(dtype="float32"), KEY),
    "prng_key of rank 0": (lambda d: _leaf(d, 3).update(shape=[]), KEY),
    # byte counts
    "nbytes too small": (lambda d: _chunk(d).update(nbytes=23, stored_nbytes=23),
                         C0 + ".nbytes is 23, but sizes"),
    "chunk claims a huge box": (lambda d: (_leaf(d).update(shape=[10**12, 64]),
                                           _chunk(d).update(sizes=[10**12, 64])),
                                C0 + ".nbytes is 24"),
    "raw stored != nbytes": (lambda d: _chunk(d).update(stored_nbytes=25),
                             C0 + ".stored_nbytes 25 != nbytes"),
    "zstd stored too large": (lambda d: _chunk(d).update(codec="zstd", stored_nbytes=10**9),
                              C0 + ".stored_nbytes 1000000000 is more than"),
    "zstd stored too small": (lambda d: _chunk(d).update(codec="zstd", stored_nbytes=0),
                              C0 + ".stored_nbytes 0 cannot hold the 24 bytes"),
    "negative nbytes": (lambda d: _chunk(d).update(nbytes=-1), C0 + ".nbytes must be"),
    "block count": (lambda d: _chunk(d).update(block_bytes=8), C0 + ".block_crc32c has 0"),
    "block_crc32c not a list": (lambda d: _chunk(d).update(block_crc32c=5),
                                C0 + ".block_crc32c must be a list"),
    "crc32c over 32 bits": (lambda d: _chunk(d).update(crc32c=2**32), C0 + ".crc32c"),
    # shapes and boxes
    "shape overflows int64": (lambda d: _leaf(d).update(shape=[2**64, 3]), W + ".shape[0]"),
    "shape too many bytes": (lambda d: _leaf(d).update(shape=[2**40, 2**40]),
                             W + ".shape [1099511627776, 1099511627776] of float32 is more"),
    "rank over 64": (lambda d: _leaf(d).update(shape=[1] * 65), W + ".shape has 65 entries"),
    "negative shape": (lambda d: _leaf(d).update(shape=[-4, 3]), W + ".shape[0]"),
    "box outside shape": (lambda d: _chunk(d).update(offsets=[3, 0]), C0 + " (box at"),
    "box of other rank": (lambda d: _chunk(d).update(offsets=[0]), C0 + " has offsets/sizes"),
    "offsets not a list": (lambda d: _chunk(d).update(offsets="0,0"),
                           C0 + ".offsets must be a list"),
    "numpy_scalar with a shape": (lambda d: _leaf(d, 4).update(shape=[1]),
                                  "items[0].leaves[4].shape must be"),
    "scalar with a shape": (lambda d: _leaf(d, 1).update(shape=[2]),
                            "items[0].leaves[1].shape must be"),
    # keys and paths
    "key escapes": (lambda d: _chunk(d).update(key="../x"), C0 + ".key '../x' is not a relative"),
    "two chunks, one key": (lambda d: _chunk(d, 1).update(key="ab.c0.0.0_0"), "share"),
    "duplicate leaf path": (lambda d: _leaf(d, 2).update(path=_leaf(d)["path"]),
                            "items[0].leaves[2].path ['params']['w'] is also the "
                            "path of items[0].leaves[0]"),
    "attr named by a number": (lambda d: _leaf(d, 3).update(path=[["attr", 3]]),
                               KEY + ".path[0] ['attr', 3] has a bad name"),
    "negative index": (lambda d: _leaf(d, 2).update(path=[["index", -1]]),
                       "items[0].leaves[2].path[0][1]"),
    "duplicate item name": (lambda d: d["items"][1].update(name="default"), "repeat a name"),
    # sharding records
    "single_device without device_id": (lambda d: _leaf(d)["sharding"].pop("device_id"),
                                        W + ".sharding lacks fields ['device_id']"),
    "sharding without type": (lambda d: _leaf(d)["sharding"].pop("type"), W + ".sharding.type"),
    "sharding of unknown type": (lambda d: _leaf(d)["sharding"].update(type="pmap"),
                                 W + ".sharding.type"),
    "sharding not an object": (lambda d: _leaf(d).update(sharding=[]), W + ".sharding is not"),
    "device_id not an int": (lambda d: _leaf(d)["sharding"].update(device_id="0"),
                             W + ".sharding.device_id"),
    "named without spec": (lambda d: _leaf(d, 3)["sharding"].pop("spec"),
                           KEY + ".sharding lacks fields ['spec']"),
    "mesh, devices do not fill it": (
        lambda d: d["meshes"][0].update(device_ids=[[0, 1]]), "meshes[0]: mesh_shape [2, 1]"),
    "mesh, device twice": (lambda d: d["meshes"][0].update(device_ids=[[1, 1], [1, 1]]),
                           "meshes[0].device_ids names a device twice"),
    "mesh, a run past the mesh": (lambda d: d["meshes"][0].update(device_ids=[[0, 3]]),
                                  "meshes[0].device_ids[0]: its 3 devices from 0 overrun"),
    "mesh, an empty run": (lambda d: d["meshes"][0].update(device_ids=[[0, 0], [0, 2]]),
                           "meshes[0].device_ids[0] must be a run [first, count]"),
    "mesh, a run of three": (lambda d: d["meshes"][0].update(device_ids=[[0, 1, 1]]),
                             "meshes[0].device_ids[0] has 3 entries"),
    "mesh, a run not a list": (lambda d: d["meshes"][0].update(device_ids=[0, 1]),
                               "meshes[0].device_ids[0] must be a list"),
    "mesh, a negative id": (lambda d: d["meshes"][0].update(device_ids=[[-1, 2]]),
                            "meshes[0].device_ids[0][0] must be an integer"),
    "mesh, past the largest id": (lambda d: d["meshes"][0].update(device_ids=[[2**63 - 1, 2]]),
                                  "overrun the mesh of 2 devices (or the largest id)"),
    # a mesh of 2**40 devices in one run: refused before a single id is made
    "mesh, too many devices": (lambda d: d["meshes"][0].update(
        mesh_shape=[2**40, 1], device_ids=[[0, 2**40]]), "more than the 1048576 a mesh may"),
    "mesh, an unknown field": (lambda d: d["meshes"][0].update(hosts=[0]),
                               "meshes[0] has unknown fields ['hosts']"),
    "meshes not a list": (lambda d: d.update(meshes={}), "meshes must be a list"),
    "mesh index out of range": (lambda d: _leaf(d, 3)["sharding"].update(mesh=1),
                                KEY + ".sharding.mesh must be an integer in [0, 0]"),
    "mesh index of no mesh": (lambda d: d.update(meshes=[]),
                              KEY + ".sharding.mesh names a mesh, and the manifest's meshes"),
    "named with its devices inline": (lambda d: _leaf(d, 3)["sharding"].update(device_ids=[0]),
                                      KEY + ".sharding has unknown fields ['device_ids']"),
    "named, unknown axis in spec": (lambda d: _leaf(d, 3)["sharding"].update(spec=["z"]),
                                    KEY + ".sharding.spec[0] must be one of"),
    "named, spec longer than rank": (lambda d: _leaf(d, 3)["sharding"].update(spec=[None, None]),
                                     KEY + ".sharding.spec has 2 entries"),
    "named, axis used twice": (lambda d: _leaf(d, 3)["sharding"].update(spec=[["x", "x"]]),
                               KEY + ".sharding.spec uses a mesh axis twice"),
    "mesh, axes and shape disagree": (lambda d: d["meshes"][0].update(mesh_shape=[2]),
                                      "meshes[0]: axis_names"),
    "other, repr too long": (lambda d: _leaf(d).update(sharding={
        "type": "other", "device_ids": [0], "repr": "x" * 201}), W + ".sharding.repr"),
    "other, ids unsorted": (lambda d: _leaf(d).update(sharding={
        "type": "other", "device_ids": [1, 0], "repr": ""}), W + ".sharding.device_ids are not"),
    "sharding on a scalar": (lambda d: _leaf(d, 1).update(sharding={"type": "single_device",
                                                                    "device_id": 0}),
                             "items[0].leaves[1].sharding must be null"),
    # other fields of leaves and items
    "key_impl missing on prng_key": (lambda d: _leaf(d, 3).update(key_impl=None),
                                     KEY + ".key_impl must be a string"),
    "key_impl on an array": (lambda d: _leaf(d).update(key_impl="rbg"), W + ".key_impl"),
    "value on an array": (lambda d: _leaf(d).update(value={"type": "int", "value": 1}),
                          W + ".value must be null"),
    "bad scalar": (lambda d: _leaf(d, 1).update(value={"type": "float", "value": "zz"}),
                   "items[0].leaves[1].value is not a valid scalar"),
    "float scalar overflows": (lambda d: _leaf(d, 1).update(value={"type": "float",
                                                                   "value": "0x1p99999"}),
                               "items[0].leaves[1].value is not a valid scalar"),
    "chunks on a none leaf": (lambda d: _leaf(d, 2).update(chunks=[_chunk(d)]),
                              "a none leaf cannot have chunks"),
    "json item with leaves": (lambda d: d["items"][1].update(leaves=[_leaf(d, 2)]),
                              "items[1].leaves must be empty"),
    "pytree item with a value": (lambda d: d["items"][0].update(value=1),
                                 "items[0].value must be null"),
    "leaves not a list": (lambda d: d["items"][0].update(leaves={}),
                          "items[0].leaves must be a list"),
    # top level
    "process.index": (lambda d: d["process"].update(index=1), "process.index 1 >= "),
    "no step": (lambda d: d.pop("step"), "lacks fields ['step']"),
    "step a bool": (lambda d: d.update(step=True), "step must be an integer"),
    "created huge": (lambda d: d.update(created=10**400), "created must be a finite number"),
    "created a string": (lambda d: d.update(created="now"), "created must be a finite number"),
    "save_id not a string": (lambda d: d.update(save_id=7), "save_id must be a string"),
}


@pytest.mark.parametrize("name", sorted(DEFECTS))
def test_each_defect_is_rejected_naming_the_field(name):
    mutate, msg = DEFECTS[name]
    d = _doc()
    mutate(d)
    with pytest.raises(CorruptCheckpointError) as ei:
        mf.parse(encode(d), "tier/7/manifest.0-of-1.json")
    assert str(ei.value).startswith("tier/7/manifest.0-of-1.json: ")
    assert msg in str(ei.value)


def test_every_listed_dtype_parses_and_sizes_its_chunks():
    for name, itemsize in mf.DTYPES.items():
        d = _doc()
        _leaf(d).update(dtype=name)
        for c in _leaf(d)["chunks"]:
            c.update(nbytes=6 * itemsize, stored_nbytes=6 * itemsize)
        assert mf.parse(encode(d)).items[0].leaves[0].dtype == name


def test_the_dtype_table_matches_numpy():
    import jax.numpy as jnp
    for name, itemsize in mf.DTYPES.items():
        dt = jnp.dtype(name)
        assert (dt.name, dt.itemsize) == (name, itemsize)
        assert dt.byteorder in "=|" and dt.kind in "biufcV"


def test_path_str_reads_like_keystr():
    assert mf.path_str((("key", "params"), ("index", 0), ("attr", "w"))) == "['params'][0].w"


def test_a_zstd_chunk_claims_at_most_32768_bytes_per_stored_byte():
    """A zstd block decodes to at most 128 KiB and takes at least 4 bytes."""
    assert mf.min_stored_nbytes("zstd", 2**45) == 2**30
    assert mf.min_stored_nbytes("zstd", 32769) == 2
    assert mf.min_stored_nbytes("zstd", 0) == 0
    assert mf.min_stored_nbytes("raw", 7) == 7


# --------------------------------------------------------------- version 2, version 3's packs

def test_version_2_is_read_and_its_chunks_are_their_own_objects():
    d = _unpacked(_doc(), 2)
    m = mf.parse(encode(d), "m.json")
    assert m.version == 2 and m == sample()
    assert all(c.pack is None and c.object == c.key for _, _, c in m.chunks())
    d["items"][0]["leaves"][0]["chunks"][0]["pack"] = None  # a version-3 field
    with pytest.raises(UnsupportedFormatError, match="pack"):
        mf.parse(encode(d), "m.json")


def _packed(offsets: list[int], pack: str = "abababab.p0.0000beef") -> dict:
    """The sample's document with its chunks in one pack at `offsets`."""
    d = _doc()
    chunks = [c for lf in d["items"][0]["leaves"] for c in lf["chunks"]]
    for c, at in zip(chunks, offsets, strict=True):
        c["pack"], c["pack_offset"] = pack, at
    return d


def test_packed_chunks_round_trip_and_name_their_pack():
    m = mf.parse(encode(_packed([0, 4096, 8192, 12288])))
    assert m.version == mf.FORMAT_VERSION and m.objects() == ["abababab.p0.0000beef"]
    assert mf.parse(mf.to_json(m)) == m
    c = next(c for _, _, c in m.chunks())
    assert c.object == "abababab.p0.0000beef" and c.observed(4096 + 1) == c.stored_nbytes
    assert c.observed(c.stored_nbytes - 1) == c.stored_nbytes - 1 and c.observed(None) is None


@pytest.mark.parametrize("offsets, pack, why", [
    ([0, 0, 8192, 12288], "abababab.p0.0000beef", "overlap in pack"),
    ([0, 100, 8192, 12288], "abababab.p0.0000beef", "not a multiple of 4096"),
    ([0, 4096, 8192, 12288], "../../etc/passwd", "not one path component"),
    ([0, 4096, 8192, 12288], "a/b", "not one path component"),
    ([0, 4096, 8192, 12288], "..", "not one path component"),
])
def test_pack_rules_are_enforced_naming_step_chunk_and_pack(offsets, pack, why):
    with pytest.raises(CorruptCheckpointError, match=f"m.json: step 7: chunk.*{why}"):
        mf.parse(encode(_packed(offsets, pack)), "m.json")


def test_a_negative_pack_offset_and_an_offset_without_a_pack_are_corrupt():
    with pytest.raises(CorruptCheckpointError, match="pack_offset"):
        mf.parse(encode(_packed([0, -4096, 8192, 12288])), "m.json")
    d = _doc()
    d["items"][0]["leaves"][0]["chunks"][0]["pack_offset"] = 4096
    with pytest.raises(CorruptCheckpointError, match="in no pack but has pack_offset 4096"):
        mf.parse(encode(d), "m.json")


def test_a_pack_named_as_an_unpacked_chunk_is_corrupt():
    d = _doc()
    c0, c1 = d["items"][0]["leaves"][0]["chunks"][:2]
    c1["pack"] = c0["key"]
    with pytest.raises(CorruptCheckpointError, match="an unpacked chunk's"):
        mf.parse(encode(d), "m.json")


# --------------------------------------------------------------- meshes (version 4)

V3_DEFECTS = {
    "devices do not fill the mesh": (dict(device_ids=[0]), KEY + ".sharding: mesh_shape"),
    "device twice": (dict(device_ids=[1, 1]), KEY + ".sharding.device_ids names a device twice"),
    "axes and mesh disagree": (dict(mesh_shape=[2]), KEY + ".sharding: axis_names"),
}


def test_version_3_is_read_with_each_mesh_written_out():
    d = _v3(_doc())
    m = mf.parse(encode(d), "m.json")
    assert m.version == 3 and m == sample()
    assert mf.parse(mf.to_json(m)).version == mf.FORMAT_VERSION
    d["meshes"] = []  # a version-4 field
    with pytest.raises(UnsupportedFormatError, match="meshes"):
        mf.parse(encode(d), "m.json")


@pytest.mark.parametrize("name", sorted(V3_DEFECTS))
def test_a_version_3_named_sharding_is_checked_in_place(name):
    change, msg = V3_DEFECTS[name]
    d = _v3(_doc())
    _leaf(d, 3)["sharding"].update(change)
    with pytest.raises(CorruptCheckpointError, match="tier/7/m.json: ") as ei:
        mf.parse(encode(d), "tier/7/m.json")
    assert msg in str(ei.value)


def _many_leaves(ids: list[int], leaves: int = 1000) -> mf.Manifest:
    """A manifest of `leaves` FSDP leaves on one mesh of the devices `ids`,
    each leaf with its own description (as a parsed version-3 manifest has)."""
    recs = tuple(
        mf.LeafRecord((("key", f"w{i}"),), "array", (16384, 4), "float32",
                      {"type": "named", "axis_names": ["data", "model"],
                       "mesh_shape": [len(ids), 1], "device_ids": list(ids),
                       "spec": ["data", None]}, None, None,
                      (mf.ChunkRecord((0, 0), (1, 4), f"ab.c0.{i}.0_0", 16, 16, 1),))
        for i in range(leaves))
    return mf.Manifest(7, "ab" * 16, 1.5, 0, 4096, (mf.ItemRecord("default", "pytree", recs),))


def test_a_mesh_of_thousands_of_hosts_is_written_once_not_per_leaf():
    """1,000 leaves on 16,384 devices (4,096 hosts of 4): each leaf's sharding
    names the mesh by index, its ids one run; in any order, the ids once."""
    in_order = _many_leaves(list(range(16384)))
    small = _many_leaves(list(range(8)))
    data = mf.to_json(in_order)
    assert len(data) - len(mf.to_json(small)) < 200, len(data)  # the ids' one run
    assert json.loads(data)["meshes"] == [{"axis_names": ["data", "model"],
                                           "mesh_shape": [16384, 1],
                                           "device_ids": [[0, 16384]]}]
    back = mf.parse(data)
    assert back == in_order
    shared = {id(lf.sharding["device_ids"]) for lf in back.items[0].leaves}
    assert len(shared) == 1  # every leaf's description holds the one list of the mesh
    shuffled = list(range(16384))
    shuffled[::2], shuffled[1::2] = shuffled[1::2], shuffled[::2]  # no two in a row
    data = mf.to_json(_many_leaves(shuffled))
    assert len(data) < len(mf.to_json(small)) + 16384 * 12, len(data)  # each id once
    assert mf.parse(data) == _many_leaves(shuffled)


# --------------------------------------------------------------- writers (version 5)

RUNS = ((0, 2, 0), (2, 2, 1), (4, 2, 2), (6, 2, 3))  # 4 writers of 2 devices each


def _writers_doc() -> dict:
    """The sample's document as writer 0 of a 4-writer save writes it."""
    d = _doc()
    d["process"]["count"] = 4
    d["writers"] = [list(w) for w in RUNS]
    return d


WRITERS_DEFECTS = {
    "a run of count 0": ([[0, 0, 0]], "writers[0] must be a run [first device id, count >= 1"),
    "a negative device id": ([[-1, 2, 0]], "writers[0][0] must be an integer"),
    "a label of no writer": ([[0, 2, 0], [2, 2, 4]], "writers[1] must be a run [first device "
                             "id, count >= 1, writer label below process.count 4]"),
    "a negative label": ([[0, 2, -1]], "writers[0][2] must be an integer"),
    "a label not an int": ([[0, 2, "0"]], "writers[0][2] must be an integer"),
    "a count that is a bool": ([[0, True, 0]], "writers[0][1] must be an integer"),
    "overlapping runs": ([[0, 2, 0], [1, 2, 1]], "writers[1]: runs must name ascending, "
                         "disjoint device ids"),
    "the same run twice": ([[0, 2, 0], [0, 2, 0]], "writers[1]: runs must name ascending"),
    "descending runs": ([[4, 2, 2], [0, 2, 0]], "writers[1]: runs must name ascending"),
    "a run of two": ([[0, 2]], "writers[0] must be a run [first device id"),
    "a run of four": ([[0, 2, 0, 0]], "writers[0] has 4 entries, more than 3"),
    "a run not a list": ([0, 2, 0], "writers[0] must be a list"),
    "a run that is an object": ([{"first": 0, "count": 2, "label": 0}],
                                "writers[0] must be a list"),
    "writers not a list": ({"0": 0}, "writers must be a list"),
    "writers null": (None, "writers must be a list"),
    # one run of 2**20 + 1 devices: refused from its count, no id made
    "more than MAX_DEVICES in one run": ([[0, mf.MAX_DEVICES + 1, 0]],
                                         "writers[0]: runs must name ascending, disjoint "
                                         "device ids, at most 1048576 devices in all"),
    "more than MAX_DEVICES in all": ([[0, mf.MAX_DEVICES, 0], [2**40, 1, 1]],
                                     "writers[1]: runs must name ascending, disjoint device "
                                     "ids, at most 1048576 devices in all"),
    "a run past the largest id": ([[2**63 - 1, 2, 0]], "writers[0]: runs must name"),
    "an id past MAX_INT": ([[2**63, 1, 0]], "writers[0][0] must be an integer in [0, "
                           "9223372036854775807]"),
    "a count past MAX_INT": ([[0, 2**64, 0]], "writers[0][1] must be an integer"),
}


@pytest.mark.parametrize("name", sorted(WRITERS_DEFECTS))
def test_each_defect_of_the_writers_table_is_rejected_naming_the_run(name):
    table, msg = WRITERS_DEFECTS[name]
    d = _writers_doc()
    d["writers"] = table
    with pytest.raises(CorruptCheckpointError) as ei:
        mf.parse(encode(d), "tier/7/manifest.0-of-4.json")
    assert str(ei.value).startswith("tier/7/manifest.0-of-4.json: ")
    assert msg in str(ei.value)
    assert not isinstance(ei.value, UnsupportedFormatError)  # damaged, not newer


def test_the_writers_table_holds_at_most_max_devices_runs_and_devices(monkeypatch):
    monkeypatch.setattr(mf, "MAX_DEVICES", 4)
    d = _writers_doc()
    d["writers"] = [[0, 1, 0], [2, 1, 1], [4, 1, 2], [6, 1, 3]]
    assert mf.parse(encode(d)).writers == ((0, 1, 0), (2, 1, 1), (4, 1, 2), (6, 1, 3))
    d["writers"] = [[i, 1, 0] for i in range(5)]
    with pytest.raises(CorruptCheckpointError, match=r"writers has 5 entries, more than 4"):
        mf.parse(encode(d))
    d["writers"] = [[0, 2, 0], [4, 3, 1]]
    with pytest.raises(CorruptCheckpointError, match=r"writers\[1\]: .*at most 4 devices"):
        mf.parse(encode(d))


def test_the_writers_table_at_its_limits_parses():
    d = _writers_doc()
    for table in ([[0, mf.MAX_DEVICES, 0]],                        # every device a run holds
                  [[2**63 - mf.MAX_DEVICES, mf.MAX_DEVICES, 3]],   # up to the largest id
                  [[0, 1, 0], [1, 1, 0], [5, 3, 2]],               # adjacent runs, a gap
                  []):                                             # a table that says nothing
        d["writers"] = table
        assert mf.parse(encode(d)).writers == tuple(tuple(w) for w in table)


def test_the_writers_runs_round_trip():
    m = dataclasses.replace(sample(), process_count=4, writers=RUNS)
    data = mf.to_json(m)
    assert json.loads(data)["writers"] == [list(w) for w in RUNS]
    assert list(json.loads(data)) == ["format", "version", "step", "save_id", "created",
                                      "process", "meshes", "writers", "items", "metrics",
                                      "custom_metadata", "manifest_crc32c"]
    back = mf.parse(data)
    assert back.writers == RUNS and back.version == 5 and back == m
    assert mf.to_json(back) == data
    assert mf.parse(mf.to_json(sample())).writers == ()


def test_a_version_4_manifest_with_writers_is_a_newer_format():
    d = _writers_doc()
    d["version"] = 4
    with pytest.raises(UnsupportedFormatError, match=r"unknown fields \['writers'\]"):
        mf.parse(encode(d), "m.json")


def test_a_version_5_manifest_without_writers_is_corrupt():
    d = _writers_doc()
    del d["writers"]
    with pytest.raises(CorruptCheckpointError, match=r"m.json: .*lacks fields \['writers'\]"):
        mf.parse(encode(d), "m.json")


def test_version_4_is_read_with_no_writers_and_rewritten_in_the_current_format():
    d = _doc()
    del d["writers"]
    d["version"] = 4
    m = mf.parse(encode(d), "m.json")
    assert m.version == 4 and m.writers == () and m == sample()
    again = json.loads(mf.to_json(m))  # a copy to another tier: version 5, an empty table
    assert again["version"] == mf.FORMAT_VERSION and again["writers"] == []
    assert mf.parse(encode(_v3(_doc()))).writers == ()
