"""sample.py: generation from a checkpoint on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train_gpt as tg
from conftest import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _sample(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "sample.py"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_sample_generates_the_requested_number_of_tokens_from_a_tiny_checkpoint(tiny_args, tmp_path):
    run = tg.train(tiny_args(num_iterations=3, val_every=0, save_every=3, checkpoint_dir=str(tmp_path / "ck")))
    out = _sample(run.checkpoint, "--tokens", "12", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    ids = [int(t) for t in out.stdout.split()]
    assert len(ids) == 12 and all(0 <= t < 64 for t in ids)
    again = _sample("latest", "--checkpoint_dir", str(tmp_path / "ck"), "--tokens", "12", "--device", "cpu")
    assert again.stdout == out.stdout  # same seed, same tokens
    greedy = _sample(run.checkpoint, "--tokens", "5", "--temperature", "0", "--device", "cpu")
    assert len(greedy.stdout.split()) == 5


def test_sample_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    out = _sample(str(tmp_path / "nope"))
    assert out.returncode != 0 and "no checkpoint" in out.stderr and "Traceback" not in out.stderr


def test_sample_decodes_text_with_the_gpt2_vocabulary(tiny_args, tmp_path):
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or str(ROOT.parent / "shared/data/gpt2/tiktoken_cache")
    if not Path(cache).is_dir():
        pytest.skip("GPT-2 BPE files not available offline (set TIKTOKEN_CACHE_DIR)")
    # a tiny model with GPT-2's vocabulary: documents open with GPT-2's BOS, other token ids lie below 64
    train, val = write_corpus(tmp_path / "gpt2ids", bos=50256)
    run = tg.train(tiny_args(vocab_size=50304, bos_id=50256, num_iterations=1, val_every=0, save_every=1,
                             checkpoint_dir=str(tmp_path / "ck"), max_num_docs=64, train_files=train, val_files=val))
    out = _sample(run.checkpoint, "--prompt", "Hello world", "--tokens", "4", "--device", "cpu",
                  env={**os.environ, "TIKTOKEN_CACHE_DIR": cache})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Hello world")
