"""sample.py: generation from a checkpoint on the CPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample
import train_gpt as tg
from conftest import BOS, CASE_FOLDING_VOCAB, FAST, TINY, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def _sample(*args, env=None):
    return subprocess.run([sys.executable, str(ROOT / "sample.py"), *args], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny model: a 64-token vocabulary with BOS 63, not GPT-2's (like --preset smoke)."""
    tmp = tmp_path_factory.mktemp("sample")
    train, val = write_corpus(tmp / "data")
    args = tg.Hyperparameters(**{**TINY, **FAST, "train_files": train, "val_files": val, "log_dir": str(tmp / "logs"),
                                 "num_iterations": 2, "val_every": 0, "save_every": 2,
                                 "checkpoint_dir": str(tmp / "ck")})
    return tg.train(args).checkpoint


@pytest.mark.slow
def test_sample_generates_the_requested_number_of_tokens_from_a_tiny_checkpoint(tiny_args, tmp_path):
    run = tg.train(tiny_args(num_iterations=3, val_every=0, save_every=3, adam_every=1, checkpoint_dir=str(tmp_path / "ck")))
    out = _sample(run.checkpoint, "--tokens", "12", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    ids = [int(t) for t in out.stdout.split()]
    assert len(ids) == 12 and all(0 <= t < 72 for t in ids)
    again = _sample("latest", "--checkpoint_dir", str(tmp_path / "ck"), "--tokens", "12", "--device", "cpu")
    assert again.stdout == out.stdout  # same seed, same tokens
    greedy = _sample(run.checkpoint, "--tokens", "5", "--temperature", "0", "--device", "cpu")
    assert len(greedy.stdout.split()) == 5


@pytest.mark.slow
def test_sample_refuses_a_missing_checkpoint_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_DEBUG", raising=False)
    out = _sample(str(tmp_path / "nope"))  # through the command line, as a user runs it
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        f"sample.py: error: {tmp_path / 'nope'}: no checkpoint there (expected {tmp_path / 'nope' / 'model.pt'})"]
    assert sample.cli(["latest", "--checkpoint_dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"sample.py: error: no checkpoint under {tmp_path}/: a run saves them with --save_every N, "
        "e.g. python train_gpt.py --preset smoke --save_every 50"]
    monkeypatch.setenv("SPEEDRUN_DEBUG", "1")  # the debug switch: the exception itself, with its traceback
    with pytest.raises(sample.UsageError, match="no checkpoint under"):
        sample.cli(["latest", "--checkpoint_dir", str(tmp_path)])


def test_sample_names_a_corrupt_checkpoint_in_one_line(tmp_path, capsys):
    (tmp_path / "step_000001").mkdir()
    (tmp_path / "step_000001" / "model.pt").write_bytes(b"not a checkpoint")
    assert sample.cli([str(tmp_path / "step_000001")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith(f"sample.py: error: {tmp_path / 'step_000001' / 'model.pt'}: cannot read the checkpoint")


def test_sample_readme_command_on_a_non_gpt2_vocabulary_samples_from_bos_with_a_note(tiny_checkpoint, capsys):
    # README: python sample.py latest --prompt "The" --tokens 100 --temperature 0.8 --top_k 50, here on a
    # checkpoint whose vocabulary cannot encode "The" (as --preset smoke's)
    assert sample.cli([tiny_checkpoint, "--prompt", "The", "--tokens", "10", "--temperature", "0.8",
                       "--top_k", "50", "--device", "cpu"]) == 0
    out = capsys.readouterr()
    ids = [int(t) for t in out.out.split()]
    assert len(ids) == 10 and all(0 <= t < 72 for t in ids)
    note = [line for line in out.err.splitlines() if line.startswith("sample.py: note:")]
    assert len(note) == 1 and "not GPT-2's (72 tokens, BOS 63)" in note[0] and "--prompt \"1 2 3\"" in note[0]


def test_sample_takes_token_ids_as_the_prompt_of_a_non_gpt2_vocabulary(tiny_checkpoint, capsys):
    assert sample.cli([tiny_checkpoint, "--prompt", "5 17 42", "--tokens", "4", "--temperature", "0",
                       "--device", "cpu"]) == 0
    out = capsys.readouterr()
    ids = [int(t) for t in out.out.split()]
    assert ids[:3] == [5, 17, 42] and len(ids) == 7 and "note:" not in out.err
    assert sample.cli([tiny_checkpoint, "--prompt", "5 72", "--tokens", "4", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "sample.py: error: --prompt: token id 72 is out of this checkpoint's vocabulary (ids 0 to 71)"]


@pytest.mark.slow
def test_sample_decodes_text_with_the_gpt2_vocabulary(tiny_args, tmp_path):
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or str(ROOT.parent / "shared/data/gpt2/tiktoken_cache")
    if not Path(cache).is_dir():
        pytest.skip("GPT-2 BPE files not available offline (set TIKTOKEN_CACHE_DIR)")
    # a tiny model with GPT-2's vocabulary: documents open with GPT-2's BOS, other token ids lie below 64
    train, val = write_corpus(tmp_path / "gpt2ids", bos=50256)
    run = tg.train(tiny_args(vocab_size=50304, bos_id=50256, num_iterations=1, val_every=0, save_every=1, adam_every=1,
                             checkpoint_dir=str(tmp_path / "ck"), max_num_docs=64, train_files=train, val_files=val))
    out = _sample(run.checkpoint, "--prompt", "Hello world", "--tokens", "4", "--device", "cpu",
                  env={**os.environ, "TIKTOKEN_CACHE_DIR": cache})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Hello world")


def test_a_model_loaded_for_sampling_reads_its_embedding_where_training_would_have(tiny_args, tmp_path):
    """Tied for the first stage of 6 steps (stages start at 0, 3, 5): tied at step 2, untied from step 3."""
    tg.train(tiny_args(**FAST, num_iterations=6, val_every=0, save_every=1, adam_every=1, keep_checkpoints=10,
                       tied_embed_stages=1, run_id="t", checkpoint_dir=str(tmp_path / "ck")))
    for step, tied in ((2, True), (3, False), (6, False)):
        model, _ = sample.load_model(tmp_path / "ck" / "t" / f"step_{step:06d}", torch.device("cpu"), 64)
        assert model.tied_embed is tied, step


def test_a_model_loaded_for_sampling_hashes_its_ngrams_from_normalized_ids_as_training_did(tiny_args, tmp_path,
                                                                                             monkeypatch):
    """With ngram_normalize the checkpoint's model gets the normalized-id table from the vocabulary, as the trainer
    set it (the table is not saved; a forward without it refuses)."""
    monkeypatch.setattr(tg, "gpt2_token_bytes", lambda: CASE_FOLDING_VOCAB)  # letters in two cases: ids fold
    tg.train(tiny_args(**FAST, num_iterations=2, val_every=0, save_every=2, adam_every=1, ngram_normalize=True,
                       run_id="n", checkpoint_dir=str(tmp_path / "ck")))
    model, _ = sample.load_model(tmp_path / "ck" / "n" / "step_000002", torch.device("cpu"), 64)
    assert model.ngram_ids is not None
    assert torch.equal(model.ngram_ids, tg.normalized_token_table(CASE_FOLDING_VOCAB, TINY["vocab_size"]))
