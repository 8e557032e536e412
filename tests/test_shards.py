"""The shard format: the one reader/writer that train_gpt.py, data/ and the tests share."""
import numpy as np
import pytest

import train_gpt as tg


def test_write_then_read_round_trips(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, size=1000)
    p = tmp_path / "s.bin"
    tg.write_shard(p, toks)
    assert tg.read_shard_header(p) == 1000
    np.testing.assert_array_equal(tg.load_shard(p), toks)


def _corrupt(p, index, value):
    raw = bytearray(p.read_bytes())
    raw[4 * index:4 * index + 4] = np.int32(value).tobytes()
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("index,value,needle", [(0, 1234, "magic"), (1, 7, "version")])
def test_reader_rejects_bad_header_naming_the_file(tmp_path, index, value, needle):
    p = tmp_path / "bad_header.bin"
    tg.write_shard(p, np.arange(10))
    _corrupt(p, index, value)
    with pytest.raises(tg.ShardError, match=needle) as e:
        tg.read_shard_header(p)
    assert "bad_header.bin" in str(e.value)


def test_reader_rejects_truncated_file_naming_the_file(tmp_path):
    p = tmp_path / "short.bin"
    tg.write_shard(p, np.arange(100))
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(tg.ShardError, match="truncated") as e:
        tg.load_shard(p)
    assert "short.bin" in str(e.value)


def test_reader_rejects_file_shorter_than_header(tmp_path):
    p = tmp_path / "tiny.bin"
    p.write_bytes(b"abc")
    with pytest.raises(tg.ShardError, match="tiny.bin"):
        tg.read_shard_header(p)


def test_writer_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        tg.write_shard(tmp_path / "x.bin", np.array([70000]))
