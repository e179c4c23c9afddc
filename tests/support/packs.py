"""Where a step directory's chunks lie (format 3: ranges of packs), for tests
that damage one chunk's bytes in one tier."""
from __future__ import annotations

import os

from resilient_ckpt.core import layout, manifest as mf


def places(step_dir: str) -> dict[str, tuple[str, int, int]]:
    """chunk key -> (the file holding it, its offset there, its stored size),
    from every manifest in `step_dir`."""
    out = {}
    for n in os.listdir(step_dir):
        if layout.parse_manifest_name(n):
            with open(os.path.join(step_dir, n), "rb") as f:
                m = mf.parse(f.read())
            for _, _, c in m.chunks():
                out[c.key] = (os.path.join(step_dir, c.object), c.pack_offset, c.stored_nbytes)
    return out


def overwrite(step_dir: str, key: str, at: int, data: bytes) -> None:
    """Writes `data` over chunk `key`'s bytes from its byte `at` on."""
    path, start, n = places(step_dir)[key]
    assert at + len(data) <= n
    with open(path, "r+b") as f:
        f.seek(start + at)
        f.write(data)
