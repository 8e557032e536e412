"""Shared fixtures: a synthetic corpus written as real shards, and a tiny model configuration."""
import functools
import gc
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# One intra-op thread, here and in the processes the tests start, unless OMP_NUM_THREADS says otherwise: the tiny
# models' operations gain nothing from a second thread, and on a 2-core CPU two threads beside the batch loader's
# thread (or another process) wait on each other. With another process busy on the CPU, TINY's steps took 680-810 ms
# on two threads against 240-280 ms on one (the same losses), the quick set 575 s against 410 s (load ~3).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles the tests' small graphs in this process, not in a pool of worker processes it starts at the first
# compile (each imports torch): the quick set's compiling tests took 8 s less of a 2-core CPU.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import train_gpt as tg  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    # README's first test command leaves these out (-m "not slow"), its second runs only them (-m slow); CI runs both
    config.addinivalue_line("markers", "slow: end to end, several seconds or more on a 2-core CPU: several "
                                       "processes, subprocess command lines, whole presets, compiled graphs, "
                                       "the Triton interpreter")


@pytest.fixture(autouse=True, scope="session")
def many_shapes_per_compiled_helper():
    """kernels.py's compiled helpers (the FP8 head's quantize, fullgraph) see far more shapes over the test files
    than in one run, where build() raises dynamo's recompile limit to the run's graph count: at the default 8 the
    GPU tests failed late in test_kernels.py ("recompile limit exceeded", an H100, 2026-11-27). A test that checks
    the limit sets its own (test_train.py)."""
    import torch
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(before, 64)
    yield
    torch._dynamo.config.recompile_limit = before


@pytest.fixture(autouse=True, scope="session")
def long_lived_objects_left_out_of_garbage_collection():
    """train() collects garbage before its timed steps: over torch's, dynamo's and pytest's ~340,000 objects that took
    0.15-0.3 s a run on a 2-core CPU, some 60 runs in the quick set. The objects alive at the start of each test file
    are frozen (below), left out of every later collection (the tests' own garbage is still collected); unfrozen at
    the end, so that the interpreter's exit still frees them (nanobind reports Triton's objects as leaked otherwise)."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True, scope="module")
def objects_alive_before_a_test_file_frozen(long_lived_objects_left_out_of_garbage_collection):
    gc.collect()  # only what was made since the last file's freeze; the garbage among it is freed, not frozen
    gc.freeze()


@pytest.fixture(autouse=True)
def torch_config_left_whole():
    """No test may leave an option missing from torch's compiler configs: pytest 9.2's monkeypatch.undo() deletes
    an option it set on them (they are modules whose options are not attributes), and a later build() then fails
    on it (fourth newcomer pass: the quick set failed on a fresh install). Tests patch them with config.patch."""
    import torch._dynamo.config
    import torch._inductor.config
    configs = (torch._inductor.config, torch._dynamo.config)
    import warnings

    def readable(config) -> set[str]:
        with warnings.catch_warnings():  # reading a deprecated option warns
            warnings.simplefilter("ignore")
            return {name for name in config.get_config_copy() if hasattr(config, name)}
    # what the test before left readable, read once per test (twice took ~4 s of the quick set on a 2-core CPU)
    before = list(_CONFIG_OPTIONS) or [readable(c) for c in configs]
    yield
    _CONFIG_OPTIONS[:] = after = [readable(c) for c in configs]
    lost = [sorted(b - a) for b, a in zip(before, after)]
    assert not any(lost), f"options deleted from torch's configs (inductor, dynamo): {lost}"


_CONFIG_OPTIONS: list[set[str]] = []  # the options readable after the last test, inductor's and dynamo's


VOCAB, BOS = 64, 63  # tiny vocabulary; the last id plays <|endoftext|>
CASE_FOLDING_VOCAB = [bytes([65 + i % 26 + 32 * (i % 2)]) for i in range(BOS)]  # one-letter texts in two cases:
# ngram_normalize folds ids that differ only in case (a vocabulary the tiny models can read as GPT-2's)


def markov_documents(rng, n_tokens, min_len=5, max_len=300, vocab=VOCAB, bos=BOS):
    """Documents from a fixed sparse Markov chain (learnable structure), each preceded by BOS."""
    trans = np.random.default_rng(1234).dirichlet(np.full(vocab - 1, 0.1), size=vocab - 1)
    out = []
    while len(out) < n_tokens:
        state = rng.integers(vocab - 1)
        out.append(bos)
        for _ in range(rng.integers(min_len, max_len)):
            out.append(state)
            state = rng.choice(vocab - 1, p=trans[state])
    return np.array(out[:n_tokens])


@functools.lru_cache(maxsize=None)
def corpus_tokens(train_sizes, val_size, seed, doc_kw) -> tuple[np.ndarray, ...]:
    """The val shard's and the training shards' tokens, made once per session (sampling them token by token
    takes ~1.4 s a corpus on a 2-core CPU, and most tests use the same one)."""
    rng = np.random.default_rng(seed)
    return tuple(markov_documents(rng, n, **dict(doc_kw)) for n in (val_size, *train_sizes))


def write_corpus(directory, train_sizes=(20_000, 20_000), val_size=10_000, seed=0, **doc_kw):
    """val shard + training shards named like the FineWeb ones; returns (train pattern, val pattern)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    val, *train = corpus_tokens(tuple(train_sizes), val_size, seed, tuple(sorted(doc_kw.items())))
    tg.write_shard(directory / "syn_val_000000.bin", val)
    for i, tokens in enumerate(train, start=1):
        tg.write_shard(directory / f"syn_train_{i:06d}.bin", tokens)
    return str(directory / "syn_train_*.bin"), str(directory / "syn_val_*.bin")


# The record model at a tiny size (the record preset's fields but these): 4 blocks with the attention-less block 2 (as
# the record's 6 of 11, in the middle), the skip from block 1 before it, backout at block 2 (the record's: the block
# after the attention-less one, here the last the rule allows, below the last block), value tables in block 1 and the
# last (the record's first two and last three, here the ones with attention), paired heads and XSA in block 1 (a
# short-window block with attention), long windows in blocks 0 and 3 (the MUDD gates need one before the last two);
# the record's multi-token weights over three stages and an extension; no prefix-token loss (it needs GPT-2's token
# bytes); a vocabulary of 72 leaves CPLM's copy column, 64, unused by the corpus' tokens. ANVIL2's layout names blocks
# of 11: here the layout before it (as the smoke preset's), none removed, the skip into block 2, MLPs 4 x 64, no second
# MLP, every block's injections (after a block's attention, the one order the model has), no narrow heads (the smoke
# preset has them; tests/test_narrow_heads.py turns them on).
# tests/test_golden.py's golden losses are this model's, written at ba25215 and again for the record's injection
# order (ff18072): keep this dict as it is. The n-gram table is ba25215's too: the bigram rows alone in the dense Adam's
# group (the record's 20.8M trigram rows would be 2.7 GB here; tests/test_ngram.py and the tests that ask for it turn
# the trigram channel and its row-sparse Adam on at a small size).
TINY_RECORD = dict(vocab_size=72, bos_id=BOS, num_layers=4, model_dim=64, num_heads=2, head_dim=32, gate_channels=8,
                   no_attn_layers=(2,), window_pattern="LSSL", value_embed_blocks=(1, 3), paired_head_blocks=(1,),
                   xsa_blocks=(1,), backout_layer=2, skip_from=1, bigram_rows=256, bigram_sign_rows=16,
                   skip_layers=(), skip_into=0, mlp_hidden=0, parallel_mlp_blocks=(), no_x0_blocks=(),
                   no_ngram_blocks=(), no_resid_scale_blocks=(), narrow_qk_blocks=(), narrow_v_blocks=(),
                   trigram_rows=0, ngram_sparse_adam=False,
                   ngram_normalize=False,  # over GPT-2's token texts (tests/test_ngram.py turns it on)
                   cplm_bands=(16, 32), window_block=16, batch_size=8 * 128, seq_len=128, val_seq_len=256,
                   val_tokens=4096, max_doc_len=96, max_num_docs=32,
                   stages=(tg.Stage(1, doc_len=64, mtp=(0.5, 0.25)), tg.Stage(2, mtp=(0.5, 0.0)),
                           tg.Stage(3, mtp=(0.0, 0.0))),
                   num_iterations=20, extension_steps=4, extension_window=4, final_val_window=5, val_every=10,
                   tied_embed_stages=2,  # the record's until 2026-12-02 (now 3): the golden losses' model
                   compile=False, warmup_steps=0, device="auto")
# Most tests: the same model and optimizer on a plain schedule: three stages of windows 1, 2, 3 blocks, no multi-token
# prediction, no extension, the last stage's window for the final validation, no endgame weight average (its second,
# live validation cost a run about a step; tests/test_weight_average.py turns it on).
TINY = dict(TINY_RECORD, stages=(tg.Stage(1), tg.Stage(2), tg.Stage(3)), extension_steps=0, extension_window=0,
            final_val_window=0, weight_average=())


# For runs whose test compares them with each other or reads their logs and checkpoints, not how far they learn: two
# micro-batches a step instead of TINY's 8, and a validation set of 4 buffers instead of 16 (one evaluation, 16
# forward passes of 256 tokens, took longer than a training step of TINY's batch): about a third of a run's time.
FAST = dict(batch_size=2 * 128, val_tokens=1024)


def first_stage(args):
    """(schedule, its first stage with cu_seqlens sized, a CPU loader of that stage's batches)."""
    files = tg.shard_files(args.train_files, "training")
    schedule = tg.Schedule(args)
    stage = schedule.stages[0].with_slots(tg.doc_slots(schedule, files))
    return schedule, stage, tg.BatchLoader(tg.BatchProducer(files, 0, 1, args.bos_id), lambda i: stage.spec,
                                           torch.device("cpu"))


def compiled_matches_eager(model, *args) -> dict:
    """The model's loss and gradients on args, eager and through torch.compile(fullgraph=True) with AOT's eager
    backend (the same arithmetic, so a graph break or a traced difference shows): asserts they agree (loss to 1e-6,
    gradients to 1e-5 relative, the same parameters given one) and returns the eager gradients by name."""
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    results = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        loss = fn(*args)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)
    return g0


def stages(base=None, **columns):
    """A stages table from the command line's single columns (window_schedule=..., batch_schedule=...,
    doc_len_schedule=..., lr_schedule=..., mtp_weights=...) over base (default: TINY's rows)."""
    return tg.set_stage_columns(TINY["stages"] if base is None else base, columns)


# With the value-embedding and bigram tables decayed (strongly, so that it shows) and their own Adam betas,
# and Muon's cautious weight decay, the public master's MLP rates in Muon and the scalars' betas.
DECAYED_TABLES = dict(embed_weight_decay=0.5, embed_adam_betas=(0.75, 0.95), muon_weight_decay=1.2,
                      mlp_muon_lr_mults=(2.0, 4.0), scalar_adam_betas=(0.9, 0.99))


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "data")


@pytest.fixture
def tiny_args(corpus, tmp_path):
    train, val = corpus

    def make(**overrides):
        return tg.Hyperparameters(**{**TINY, "train_files": train, "val_files": val, "log_dir": str(tmp_path / "logs"),
                                     "checkpoint_dir": str(tmp_path / "checkpoints"), **overrides})
    return make
