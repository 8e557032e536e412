"""The shard format (data/shards.py): one module for the trainer and the data tools, without torch; written and
read back, validated with errors that name the file; the trainer uses this module's functions, and its log and
checkpoints carry the module's source and hash."""
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from data import shards

ROOT = Path(__file__).resolve().parents[1]


def test_write_then_read_round_trips(tmp_path):
    toks = np.random.default_rng(0).integers(0, 50257, size=1000)
    p = tmp_path / "s.bin"
    shards.write_shard(p, toks)
    assert shards.read_shard_header(p) == 1000
    np.testing.assert_array_equal(shards.load_shard(p), toks)


def test_the_layout_is_llm_c_s_header_then_uint16_tokens(tmp_path):
    toks = np.random.default_rng(1).integers(0, 2**16, size=777)
    p = tmp_path / "a.bin"
    shards.write_shard(p, toks)
    raw = p.read_bytes()
    assert len(raw) == 1024 + 2 * 777
    assert np.frombuffer(raw[:1024], "<i4").tolist() == [20240520, 1, 777] + [0] * 253
    np.testing.assert_array_equal(np.frombuffer(raw[1024:], "<u2"), toks)


def test_the_trainer_uses_this_module_and_its_code_hash_covers_it(tmp_path, monkeypatch):
    for name in ("ShardError", "load_shard", "read_shard_header", "write_shard"):
        assert getattr(tg, name) is getattr(shards, name)
    assert tg.BOS_ID == shards.BOS_ID  # the trainer's default --bos_id is the one the tokenizer writes
    assert Path(tg.shard_format.__file__).resolve() == ROOT / "data" / "shards.py"
    before = tg.code_hash()
    edited = tmp_path / "shards.py"
    edited.write_text(Path(shards.__file__).read_text() + "# edited\n")
    monkeypatch.setattr(tg, "shard_format", types.SimpleNamespace(__file__=str(edited)))
    assert tg.code_hash() != before  # a checkpoint of other shard code is noted on resume


def _corrupt(p, index, value):
    raw = bytearray(p.read_bytes())
    raw[4 * index:4 * index + 4] = np.int32(value).tobytes()
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("index,value,needle", [(0, 1234, "magic"), (1, 7, "version")])
def test_reader_rejects_bad_header_naming_the_file(tmp_path, index, value, needle):
    p = tmp_path / "bad_header.bin"
    shards.write_shard(p, np.arange(10))
    _corrupt(p, index, value)
    with pytest.raises(shards.ShardError, match=needle) as e:
        shards.read_shard_header(p)
    assert "bad_header.bin" in str(e.value)


def test_reader_rejects_truncated_file_naming_the_file(tmp_path):
    p = tmp_path / "short.bin"
    shards.write_shard(p, np.arange(100))
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(shards.ShardError, match="truncated") as e:
        shards.load_shard(p)
    assert "short.bin" in str(e.value)


def test_reader_rejects_file_shorter_than_header(tmp_path):
    p = tmp_path / "tiny.bin"
    p.write_bytes(b"abc")
    with pytest.raises(shards.ShardError, match="tiny.bin"):
        shards.read_shard_header(p)


def test_writer_refuses_ids_beyond_uint16(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        shards.write_shard(tmp_path / "x.bin", np.array([70000]))


@pytest.mark.parametrize("tool", ["data/tokenize_corpus.py", "data/cached_fineweb10B.py"])
def test_data_tools_run_without_importing_torch(tool):
    code = (f"import runpy, sys\nsys.argv = [{tool!r}, '--help']\n"
            f"try:\n    runpy.run_path({tool!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "no torch", out.stderr[-2000:]
