"""Unit tests of the manifest: round trip, strict parsing, version handling."""
import json

import pytest

from resilient_ckpt import CorruptCheckpointError, UnsupportedFormatError, manifest as mf


def sample() -> mf.Manifest:
    chunks = (mf.ChunkRecord((0, 0), (2, 3), "ab.c0.0.0_0", 24, 24, 123),
              mf.ChunkRecord((2, 0), (2, 3), "ab.c0.0.2_0", 24, 24, 456))
    leaves = (
        mf.LeafRecord((("key", "params"), ("key", "w")), "array", (4, 3), "float32",
                      {"type": "single_device", "device_id": 0}, None, None, chunks),
        mf.LeafRecord((("key", "lr"),), "scalar", value=mf.encode_scalar(0.1)),
        mf.LeafRecord((("key", "opt"), ("index", 0)), "none"),
    )
    return mf.Manifest(7, "ab" * 16, 1.5, 0, 1,
                       (mf.ItemRecord("default", "pytree", leaves),
                        mf.ItemRecord("meta", "json", (), {"epoch": 3})),
                       metrics={"loss": 0.5}, custom_metadata={"run": "x"})


def test_round_trip_is_exact():
    m = sample()
    assert mf.parse(mf.to_json(m)) == m
    assert m.nbytes == 48
    assert [c.key for _, _, c in m.chunks()] == ["ab.c0.0.0_0", "ab.c0.0.2_0"]


@pytest.mark.parametrize("v", [0.1, float("nan"), float("inf"), -0.0, 1e308, 5e-324])
def test_float_scalars_round_trip_bit_exact(v):
    out = mf.decode_scalar(json.loads(json.dumps(mf.encode_scalar(v))))
    assert repr(out) == repr(v)


def _doc():
    return json.loads(mf.to_json(sample()))


def test_future_version_says_upgrade():
    d = _doc()
    d["version"] = mf.FORMAT_VERSION + 1
    with pytest.raises(UnsupportedFormatError, match="version 2.*upgrade"):
        mf.parse(json.dumps(d).encode(), "tier/7/manifest.0-of-1.json")


def test_unknown_field_is_an_error_not_skipped():
    d = _doc()
    d["items"][0]["leaves"][0]["chunks"][0]["shiny"] = 1
    with pytest.raises(UnsupportedFormatError, match="shiny"):
        mf.parse(json.dumps(d).encode())


@pytest.mark.parametrize("cut", [1, 10, 100, -1])
def test_torn_manifest_is_corrupt(cut):
    data = mf.to_json(sample())
    with pytest.raises(CorruptCheckpointError, match="where.json"):
        mf.parse(data[:cut], "where.json")


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d["items"][0]["leaves"][0]["chunks"][0].update(offsets=[3, 0]), "outside"),
    (lambda d: d["items"][0]["leaves"][0]["chunks"][0].update(key="../x"), "relative"),
    (lambda d: d["items"][0]["leaves"][0]["chunks"][1].update(key="ab.c0.0.0_0"), "share"),
    (lambda d: d["items"][0]["leaves"][0]["chunks"][0].update(nbytes=-1), "nbytes"),
    (lambda d: d["items"][0]["leaves"][0]["chunks"][0].update(codec="lz4"), "codec"),
    (lambda d: d["process"].update(index=1), "process.index"),
    (lambda d: d.pop("step"), "step"),
    (lambda d: d["items"][0]["leaves"][1].update(value={"type": "float", "value": "zz"}),
     "scalar"),
])
def test_invalid_fields_are_named(mutate, msg):
    d = _doc()
    mutate(d)
    with pytest.raises(CorruptCheckpointError, match=msg):
        mf.parse(json.dumps(d).encode())


def test_not_a_manifest():
    with pytest.raises(CorruptCheckpointError, match="not a resilient_ckpt manifest"):
        mf.parse(b'{"hello": 1}')
    with pytest.raises(CorruptCheckpointError):
        mf.parse(b"\xff\xfe garbage")


def test_path_str_reads_like_keystr():
    assert mf.path_str((("key", "params"), ("index", 0), ("attr", "w"))) == "['params'][0].w"
