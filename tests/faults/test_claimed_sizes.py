"""Sizes a manifest claims: a checksum-valid manifest whose leaf claims far
more bytes than its stored chunk can hold (a buggy or hostile writer) is a
corrupt copy, refused before anything is allocated for it.

Steps 1 and 2 of a small numpy state are saved by a real manager to a
LocalTier; step 2's manifest is rewritten (with a valid checksum) so that its
leaf claims `n` one-byte elements in one zstd chunk that is the stored 4 KiB
object. A fresh manager must restore step 1 (`restore()`), refuse step 2
(`restore(2)`) with a CheckpointError, and allocate nothing of the claim (the
process's peak RSS stays put).
"""
from __future__ import annotations

import json
import os
import resource

import google_crc32c
import numpy as np
import orbax.checkpoint as ocp
import pytest

import resilient_ckpt as rc
from resilient_ckpt.core import layout

TRAILER = b',"manifest_crc32c":'


def _state(step: int) -> dict:
    return {"w": np.full(4096, step, np.uint8)}


def _forge(path: str, elements: int) -> None:
    """Rewrites the manifest at `path`: leaf w claims `elements` uint8 in one
    zstd chunk, its stored size the real object's; the checksum is valid."""
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    doc.pop("manifest_crc32c")
    (leaf,) = doc["items"][0]["leaves"]
    (chunk,) = leaf["chunks"]
    leaf["shape"] = [elements]
    chunk.update(sizes=[elements], nbytes=elements, codec="zstd", block_bytes=0,
                 block_crc32c=[])
    body = json.dumps(doc, separators=(",", ":")).encode()[:-1]
    with open(path, "wb") as f:
        f.write(body + TRAILER + b"%d}" % google_crc32c.value(body))


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("elements", [2**45, 2**31], ids=["32TiB", "2GiB"])
def test_a_leaf_claiming_more_than_its_chunk_holds_is_corrupt(tmp_path, elements):
    d = str(tmp_path / "ckpt")
    options = rc.CheckpointManagerOptions(tiers=(rc.LocalTier(),))
    with rc.CheckpointManager(d, options=options) as m:
        for s in (1, 2):
            m.save(s, args=ocp.args.StandardSave(_state(s)))
        m.wait_until_finished()
    _forge(os.path.join(d, "2", layout.manifest_name(0, 1)), elements)
    before = _max_rss()
    with rc.CheckpointManager(d, options=options) as m:
        out = m.restore()  # as saved: no target shape to refuse the claim first
        assert out["w"].tobytes() == _state(1)["w"].tobytes()
        with pytest.raises(rc.CheckpointError, match="step 2|/2/") as e:
            m.restore(2)
        assert not isinstance(e.value, MemoryError)
    assert _max_rss() - before < 256 << 20, "the claimed bytes were allocated"
