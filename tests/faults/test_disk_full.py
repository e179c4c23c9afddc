"""A full disk, for real: during a step's chunk writes, and exactly at its
manifest. The save fails cleanly and is reported once for its step and tier,
nothing of the failed step (chunk or temporary) is left on the disk, the
older step still restores bit-exact, and once space is freed the next save
commits.

The disk is a 4 MiB tmpfs the test mounts (as root), filled with a filler
file so that precisely what goes before the manifest fits, or a quarter of it. Where mounting is not
allowed the same scenario runs in a child process under RLIMIT_FSIZE (SIGXFSZ
ignored, so writes fail with EFBIG), the limit set between the chunks' size
and the manifest's, or below the chunks'. The child variant runs everywhere.
"""
import errno
import os
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from resilient_ckpt import CheckpointManager, CheckpointManagerOptions, LocalTier, SaveFailedError
from resilient_ckpt.core import layout
from tests.support.disk import abstract, assert_exact, free_bytes, host, leftovers

PAGE = 4096


def make_state(mesh, seed, many=False):
    r = np.random.default_rng(seed)
    # Small chunks (1 KiB each), so the manifest is larger than any of them.
    state = {"w": jax.device_put(r.standard_normal((64, 32)).astype(np.float32),
                                 NamedSharding(mesh, P("data", "model"))),
             "b": jax.device_put(r.standard_normal(16).astype(np.float32),
                                 NamedSharding(mesh, P())),
             "np": np.arange(5.0) + seed, "step": seed}
    if many:  # 200 more chunks: the I/O pool gets them in runs (commit._groups)
        state["many"] = [jax.device_put(r.standard_normal((8, 4)).astype(np.float32),
                                        NamedSharding(mesh, P("data", "model")))
                         for _ in range(25)]
    return state


def footprint(ckpt: str, step: int) -> tuple[list[int], int]:
    """(sizes of the files a save of the step writes before its manifest:
    chunks, and its claim where there is one; size of its manifest)."""
    d = os.path.join(ckpt, str(step))
    sizes = {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)
             if os.path.isfile(os.path.join(d, n))}
    manifest = [v for n, v in sizes.items() if layout.parse_manifest_name(n)]
    before = [v for n, v in sizes.items() if not layout.parse_manifest_name(n)]
    assert any(layout.is_chunk_name(n) for n in sizes) and len(manifest) == 1
    return before, manifest[0]


def scenario(ckpt: str, case: str, fill, unfill) -> None:
    """The whole case against a disk that `fill(case, chunk sizes, manifest
    size)` makes full and `unfill()` frees again."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    opts = CheckpointManagerOptions(tiers=[LocalTier(keep=3)])
    with CheckpointManager(ckpt, options=opts) as m:
        states = {s: make_state(mesh, s, many=case == "many chunks") for s in (1, 2, 3)}
        want = {s: host(x) for s, x in states.items()}
        m.save(1, args=ocp.args.StandardSave(states[1]))
        m.wait_until_finished()
        fill(case, *footprint(ckpt, 1))  # step 2 has the same shapes as step 1

        with pytest.raises(SaveFailedError) as ei:
            m.save(2, args=ocp.args.StandardSave(states[2]))  # may already raise it
            m.wait_until_finished()
        err = ei.value
        assert [(e.step, e.tier) for e in (err.failures or (err,))] == [(2, "local")]
        cause = err.__cause__
        assert isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EFBIG)
        # Where it failed: a chunk's write, or the manifest's (the commit).
        if case == "manifest":
            assert "commit of" in str(cause) and "/2/manifest." in str(cause), cause
        else:
            assert "write of" in str(cause), cause
        assert "out of space" in str(err) and str(ckpt) in str(err)
        m.wait_until_finished()  # reported once: nothing left to raise
        m.check_for_errors()
        # Nothing of step 2 is left on the disk, without reopening the manager.
        assert leftovers(ckpt, 2) == []
        # Nor its claim: a save that committed nowhere lets go of its step.
        assert not os.path.exists(os.path.join(ckpt, "2")), os.listdir(os.path.join(ckpt, "2"))
        assert m.all_steps() == [1]
        assert_exact(m.restore(1, args=ocp.args.StandardRestore(abstract(states[1]))), want[1])

        unfill()
        assert m.save(3, args=ocp.args.StandardSave(states[3]))
        m.wait_until_finished()
        assert m.all_steps() == [1, 3]
        assert_exact(m.restore(3, args=ocp.args.StandardRestore(abstract(states[3]))), want[3])
    assert all(leftovers(ckpt, int(n)) == [] for n in os.listdir(ckpt)
               if n not in ("1", "3") and n.isdigit())
    temporaries = [n for _, _, files in os.walk(ckpt) for n in files
                   if layout.parse_tmp_name(n)]
    assert temporaries == []


# ------------------------------------------------------------ a small tmpfs


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); "
                    "the RLIMIT_FSIZE variant covers it")
    try:
        yield str(disk)
    finally:
        # a file still open under it (a manager's worker, a mapping) makes a
        # plain umount fail: detach it lazily then, never leave it mounted
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.parametrize("case", ["chunks", "many chunks", "manifest"])
def test_disk_full_on_a_small_tmpfs(small_disk, case):
    filler = os.path.join(small_disk, "filler")

    def fill(case, chunks, manifest):
        need = sum(-(-c // PAGE) * PAGE for c in chunks)  # tmpfs charges whole pages
        room = need if case == "manifest" else (need // 4) // PAGE * PAGE
        with open(filler, "wb") as f:
            f.write(b"\0" * (free_bytes(small_disk) - room))
        assert free_bytes(small_disk) == room  # the chunks fit (or half), the manifest not

    scenario(os.path.join(small_disk, "ckpt"), case, fill, lambda: os.remove(filler))


# ------------------------------------------------------------ RLIMIT_FSIZE


def _child(ckpt: str, case: str) -> None:
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if case == "manifest":
        # A limit per file fails the manifest alone only where it is the
        # largest file: so here every chunk is a file of its own (no packs).
        from resilient_ckpt.save import packing
        packing.PACK_BYTES = 1

    def fill(case, chunks, manifest):
        biggest = max(chunks)
        limit = (biggest + manifest) // 2 if case == "manifest" else biggest // 2
        assert case != "manifest" or biggest < limit < manifest - 64
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

    def unfill():
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))

    scenario(ckpt, case, fill, unfill)


@pytest.mark.parametrize("case", ["chunks", "many chunks", "manifest"])
def test_disk_full_under_rlimit_fsize(tmp_path, case):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (f"import sys; sys.path.insert(0, {root!r}); "
            "from tests.faults import test_disk_full as t; "
            f"t._child({str(tmp_path / 'ckpt')!r}, {case!r})")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
