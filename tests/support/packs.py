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


def flip(step_dir: str, key: str, at: int = 0) -> None:
    """Flips the bits of chunk `key`'s byte `at` (its size stays: only a
    checksum can tell)."""
    path, start, _ = places(step_dir)[key]
    with open(path, "r+b") as f:
        f.seek(start + at)
        b = f.read(1)
        f.seek(start + at)
        f.write(bytes([b[0] ^ 0xFF]))


def cut(step_dir: str, key: str) -> str:
    """Truncates the file holding chunk `key` where the chunk starts: that chunk
    and those after it in its pack are missing; returns the file's name."""
    path, start, _ = places(step_dir)[key]
    os.truncate(path, start)
    return os.path.basename(path)


def pack_of(step_dir: str, key: str) -> str:
    return os.path.basename(places(step_dir)[key][0])


def at_start(step_dir: str, name: str) -> str:
    """The chunk that starts file `name` (a pack, or a chunk of its own)."""
    return next(k for k, (p, at, _) in places(step_dir).items()
                if os.path.basename(p) == name and at == 0)
