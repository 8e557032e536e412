"""The shard format: train_gpt.py's reader/writer and data/shards.py's (the data tools', without torch) each
validate the same way, and each reads what the other writes."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from data import shards

ROOT = Path(__file__).resolve().parents[1]
BOTH = pytest.mark.parametrize("fmt", [tg, shards], ids=["train_gpt", "data.shards"])


@BOTH
def test_write_then_read_round_trips(tmp_path, fmt):
    toks = np.random.default_rng(0).integers(0, 50257, size=1000)
    p = tmp_path / "s.bin"
    fmt.write_shard(p, toks)
    assert fmt.read_shard_header(p) == 1000
    np.testing.assert_array_equal(fmt.load_shard(p), toks)


@pytest.mark.parametrize("writer,reader", [(tg, shards), (shards, tg)], ids=["trainer->tools", "tools->trainer"])
def test_each_reads_what_the_other_writes_byte_for_byte(tmp_path, writer, reader):
    toks = np.random.default_rng(1).integers(0, 2**16, size=777)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    writer.write_shard(a, toks)
    reader.write_shard(b, toks)
    assert a.read_bytes() == b.read_bytes()
    np.testing.assert_array_equal(reader.load_shard(a), toks)
    assert (tg.SHARD_MAGIC, tg.SHARD_VERSION, tg.HEADER_BYTES, tg.BOS_ID) == \
        (shards.SHARD_MAGIC, shards.SHARD_VERSION, shards.HEADER_BYTES, shards.BOS_ID)


def _corrupt(p, index, value):
    raw = bytearray(p.read_bytes())
    raw[4 * index:4 * index + 4] = np.int32(value).tobytes()
    p.write_bytes(bytes(raw))


@BOTH
@pytest.mark.parametrize("index,value,needle", [(0, 1234, "magic"), (1, 7, "version")])
def test_reader_rejects_bad_header_naming_the_file(tmp_path, fmt, index, value, needle):
    p = tmp_path / "bad_header.bin"
    fmt.write_shard(p, np.arange(10))
    _corrupt(p, index, value)
    with pytest.raises(fmt.ShardError, match=needle) as e:
        fmt.read_shard_header(p)
    assert "bad_header.bin" in str(e.value)


@BOTH
def test_reader_rejects_truncated_file_naming_the_file(tmp_path, fmt):
    p = tmp_path / "short.bin"
    fmt.write_shard(p, np.arange(100))
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(fmt.ShardError, match="truncated") as e:
        fmt.load_shard(p)
    assert "short.bin" in str(e.value)


@BOTH
def test_reader_rejects_file_shorter_than_header(tmp_path, fmt):
    p = tmp_path / "tiny.bin"
    p.write_bytes(b"abc")
    with pytest.raises(fmt.ShardError, match="tiny.bin"):
        fmt.read_shard_header(p)


@BOTH
def test_writer_refuses_ids_beyond_uint16(tmp_path, fmt):
    with pytest.raises(ValueError, match="uint16"):
        fmt.write_shard(tmp_path / "x.bin", np.array([70000]))


@pytest.mark.parametrize("tool", ["data/tokenize_corpus.py", "data/cached_fineweb10B.py"])
def test_data_tools_run_without_importing_torch(tool):
    code = (f"import runpy, sys\nsys.argv = [{tool!r}, '--help']\n"
            f"try:\n    runpy.run_path({tool!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "no torch", out.stderr[-2000:]
