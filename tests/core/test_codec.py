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


def test_every_frame_written_records_its_decoded_size():
    """The restore checks a large zstd chunk's claim against this before
    allocating (`ChunkReader.vouch`), so every way a frame is written records it."""
    import io
    data = np.arange(100_000, dtype=np.uint8)
    out = np.empty(200_000, np.uint8)
    n = codec.compress_into(data, out)
    stream = codec.compress_stream(io.BytesIO(data.tobytes()), 1, data.nbytes, 4096).read()
    for frame in (codec.compress(data), out[:n].tobytes(), stream):
        assert codec.frame_content_size(frame[:codec.FRAME_HEADER_MAX]) == data.nbytes
    for junk in (b"", b"abc", b"\0" * 18):
        assert codec.frame_content_size(junk) is None
