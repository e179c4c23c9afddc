"""codec.decode: a zstd chunk decodes straight into the caller's buffer, and
every frame that does not decode to exactly the manifest's size is refused."""
import numpy as np
import pytest

from resilient_ckpt.core import codec
from resilient_ckpt.errors import CorruptCheckpointError


def _data(n: int = 300_000) -> np.ndarray:
    rng = np.random.default_rng(1)
    return (rng.standard_normal(n // 4, dtype=np.float32) * 0.02).view(np.uint8)


def _packed(raw: np.ndarray) -> np.ndarray:
    return np.frombuffer(codec.compress(raw), np.uint8)


def test_decodes_into_the_given_buffer():
    raw = _data()
    out = np.full(raw.nbytes, 7, np.uint8)
    got = codec.decode("zstd", _packed(raw), raw.nbytes, out)
    assert np.shares_memory(got, out)
    assert np.array_equal(got, raw)


def test_decodes_without_a_buffer():
    raw = _data()
    assert np.array_equal(codec.decode("zstd", _packed(raw), raw.nbytes), raw)


def test_empty_chunk():
    empty = np.zeros(0, np.uint8)
    assert codec.decode("zstd", _packed(empty), 0).nbytes == 0


@pytest.mark.parametrize("what,nbytes,stored", [
    ("decodes to fewer bytes", lambda n: n + 1, lambda p: p),
    ("decodes to more bytes", lambda n: n - 1, lambda p: p),
    ("truncated frame", lambda n: n, lambda p: p[:len(p) // 2]),
    ("not a frame", lambda n: n, lambda p: np.full(len(p), 0x55, np.uint8)),
])
def test_refuses_a_frame_of_the_wrong_size_or_shape(what, nbytes, stored):
    raw = _data()
    n = nbytes(raw.nbytes)
    with pytest.raises(CorruptCheckpointError, match="zstd frame"):
        codec.decode("zstd", stored(_packed(raw)), n, np.empty(max(n, 0), np.uint8))
