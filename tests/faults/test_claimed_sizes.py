"""Sizes a manifest claims: a checksum-valid manifest whose leaf claims far
more bytes than its stored chunk can hold (a buggy or hostile writer) is a
corrupt copy, refused before anything is allocated for it.

Steps 1 and 2 of a small numpy state are saved by a real manager to a
LocalTier; step 2's manifest is rewritten (with a valid checksum) so that its
leaf claims `n` one-byte elements in one chunk that is the stored 4 KiB
object: a zstd chunk on the local tier (whose sizes selection observes), a
raw chunk of the claimed size on an fsspec `memory://` tier holding a copy
(whose sizes, as on GCS, come from the manifests). A fresh manager must
restore step 1 (`restore()`), refuse step 2 (`restore(2)`) with a
CheckpointError, and allocate nothing of the claim (the process's peak RSS
stays put).
"""
from __future__ import annotations

import json
import os
import uuid

import fsspec
import google_crc32c
import numpy as np
import orbax.checkpoint as ocp
import pytest
import zstandard

import resilient_ckpt as rc
from resilient_ckpt.core import layout

TRAILER = b',"manifest_crc32c":'


def _state(step: int) -> dict:
    return {"w": np.full(4096, step, np.uint8)}


def _forge(path: str, elements: int, codec: str) -> None:
    """Rewrites the manifest at `path`: leaf w claims `elements` uint8 in one
    chunk of `codec` (zstd: its stored size the real object's; raw: the
    claim), with a valid checksum."""
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("manifest_crc32c")
    (leaf,) = doc["items"][0]["leaves"]
    (chunk,) = leaf["chunks"]
    leaf["shape"] = [elements]
    chunk.update(sizes=[elements], nbytes=elements, codec=codec, block_bytes=0,
                 block_crc32c=[])
    if codec == "raw":
        chunk["stored_nbytes"] = elements
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    with open(path, "wb") as f:
        f.write(body + TRAILER + b"%d}" % google_crc32c.value(body))


def _restamp(path: str, stored_nbytes: int) -> None:
    """Sets the one chunk's stored size in the manifest at `path`, re-signed."""
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("manifest_crc32c")
    doc["items"][0]["leaves"][0]["chunks"][0]["stored_nbytes"] = stored_nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    with open(path, "wb") as f:
        f.write(body + TRAILER + b"%d}" % google_crc32c.value(body))


def _reset_peak_rss() -> None:
    """Resets this process's peak RSS (VmHWM), so that an earlier test's peak
    does not hide this one's (ru_maxrss cannot be reset)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _saved(d: str) -> None:
    options = rc.CheckpointManagerOptions(tiers=(rc.LocalTier(),))
    with rc.CheckpointManager(d, options=options) as m:
        for s in (1, 2):
            m.save(s, args=ocp.args.StandardSave(_state(s)))
        m.wait_until_finished()


def _check_falls_back(m: rc.CheckpointManager) -> None:
    _reset_peak_rss()
    before = _peak_rss()
    out = m.restore()  # as saved: no target shape to refuse the claim first
    assert out["w"].tobytes() == _state(1)["w"].tobytes()
    with pytest.raises(rc.CheckpointError, match="step 2|/2/"):
        m.restore(2)
    assert _peak_rss() - before < 256 << 20, "the claimed bytes were allocated"


@pytest.mark.parametrize("elements", [2**45, 2**31], ids=["32TiB", "2GiB"])
def test_a_zstd_chunk_claiming_more_than_its_object_holds_is_corrupt(tmp_path, elements):
    d = str(tmp_path / "ckpt")
    _saved(d)
    _forge(os.path.join(d, "2", layout.manifest_name(0, 1)), elements, "zstd")
    with rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
            tiers=(rc.LocalTier(),))) as m:
        _check_falls_back(m)


@pytest.mark.parametrize("elements", [2**31, 2**33], ids=["2GiB", "8GiB"])
def test_a_zstd_claim_within_the_ratio_cap_is_checked_against_its_frame(tmp_path, elements):
    """A real zstd frame of 256 KiB (random bytes: it does not shrink) that a
    manifest claims decodes to `elements` bytes, within MAX_ZSTD_RATIO of its
    stored size, so the parser takes it: the restore reads the frame's header
    (the size it records) before allocating, finds it is not the claim and
    treats the copy as corrupt (before, the claim was allocated and filled in
    before the decode failed)."""
    d = str(tmp_path / "ckpt")
    _saved(d)
    path = os.path.join(d, "2", layout.manifest_name(0, 1))
    _forge(path, elements, "zstd")
    with open(path, "rb") as f:
        (chunk,) = json.loads(f.read())["items"][0]["leaves"][0]["chunks"]
    frame = zstandard.ZstdCompressor().compress(np.random.default_rng(0).bytes(256 << 10))
    assert chunk["pack_offset"] == 0  # the step's one chunk: its pack is that chunk
    with open(os.path.join(d, "2", chunk["pack"] or chunk["key"]), "wb") as f:
        f.write(frame)
    _restamp(path, len(frame))
    with rc.CheckpointManager(d, options=rc.CheckpointManagerOptions(
            tiers=(rc.LocalTier(),))) as m:
        assert m.all_steps() == [1, 2]  # the claim passes the parser's ratio cap
        _check_falls_back(m)


@pytest.mark.parametrize("elements", [2**45, 2**31], ids=["32TiB", "2GiB"])
def test_a_claim_a_remote_tier_does_not_hold_is_refused_before_allocating(
        tmp_path, elements):
    """On a tier whose chunk sizes come from the manifests (fsspec, GCS) the
    restore asks the store for the size before it allocates."""
    d = str(tmp_path / "ckpt")
    _saved(d)
    _forge(os.path.join(d, "2", layout.manifest_name(0, 1)), elements, "raw")
    fs, root = fsspec.filesystem("memory"), f"/rc-claims-{uuid.uuid4().hex}"
    for s in ("1", "2"):
        for name in os.listdir(os.path.join(d, s)):
            if not name.startswith("."):
                with open(os.path.join(d, s, name), "rb") as f:
                    fs.pipe(f"{root}/{s}/{name}", f.read())
    try:
        with rc.CheckpointManager(str(tmp_path / "reader"), options=rc.CheckpointManagerOptions(
                tiers=(rc.FsspecTier(url=f"memory:/{root}"),), read_only=True)) as m:
            assert m.all_steps() == [1, 2]  # the claim is not checked at selection there
            _check_falls_back(m)
    finally:
        fs.rm(root, recursive=True)
