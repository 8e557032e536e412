"""Training and validation batches: BOS-aligned varlen micro-batches over pre-indexed shards."""
import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import BOS, write_corpus

CPU = torch.device("cpu")


def stream_batches(files, spec, steps, rank=0, world_size=1, max_num_docs=64):
    """(step, micro-batch) pairs straight from the batch producer, without the thread."""
    loader = tg.BatchLoader.__new__(tg.BatchLoader)  # the producer logic only
    loader.rank, loader.world_size, loader.max_num_docs, loader.bos_id = rank, world_size, max_num_docs, BOS
    loader.stream = tg.TokenStream(files, BOS, wrap=True, log=lambda m: None)
    return [loader.cpu_step(spec(s) if callable(spec) else spec) for s in range(steps)]


def sequences(x, cu):
    ends = [int(c) for c in cu]
    return [x[a:b] for a, b in zip(ends[:-1], ends[1:]) if b > a]


@pytest.fixture
def files(corpus):
    return tg.shard_files(corpus[0], "training")


def test_micro_batches_are_bos_aligned_bounded_and_padded(files):
    spec = tg.BatchSpec(batch_size=4 * 512, seq_len=512, max_doc_len=100)
    for step in stream_batches(files, spec, steps=10):
        for x, y, cu in step:
            assert x.shape == y.shape == (512,) and cu.shape == (65,)
            assert cu[0] == 0 and cu[-1] == 512 and np.all(np.diff(cu) >= 0)
            n = int(np.argmax(cu == 512))  # first padding entry: the rest are padding too
            assert np.all(cu[n:] == 512)
            seqs = sequences(x, cu)
            assert len(seqs) == n
            assert all(s[0] == BOS for s in seqs), "every sequence starts with BOS"
            assert max(len(s) for s in seqs) <= 100, "no sequence longer than max_doc_len"
            # no BOS inside a sequence: attention never crosses a document start
            assert all(np.all(s[1:] != BOS) for s in seqs)


def test_targets_cover_every_token_of_the_stream_exactly_once(files):
    """Inputs shifted by one, across cuts at max_doc_len, buffer ends and shard ends: the targets of
    one pass over the data are each shard's tokens 1..n-1, in order (nothing dropped or repeated)."""
    shards = [tg.load_shard(f) for f in files]
    expected = np.concatenate([s[1:] for s in shards])
    spec = tg.BatchSpec(batch_size=2 * 1000, seq_len=1000, max_doc_len=64)
    got = np.concatenate([y for step in stream_batches(files, spec, steps=len(expected) // 2000) for _, y, _ in step])
    np.testing.assert_array_equal(got, expected[: got.size])
    # and each input is the true previous token, except at a sequence start, which is a BOS
    x_all = np.concatenate([x for step in stream_batches(files, spec, steps=3) for x, _, _ in step])
    prev = np.concatenate([s[:-1] for s in shards])[: x_all.size]
    differs = x_all != prev
    assert np.all(x_all[differs] == BOS)


def test_document_longer_than_the_buffer_is_split_not_dropped(tmp_path):
    long_doc = np.concatenate([[BOS], np.arange(5000) % 60, [BOS], np.arange(10) % 60])
    tg.write_shard(tmp_path / "t_000001.bin", long_doc)
    spec = tg.BatchSpec(batch_size=1024, seq_len=1024, max_doc_len=4096)
    steps = stream_batches([str(tmp_path / "t_000001.bin")], spec, steps=5)
    ys = np.concatenate([y for step in steps for _, y, _ in step])
    np.testing.assert_array_equal(ys[:5010], long_doc[1:5011])


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ranks_are_disjoint_and_together_equal_the_single_rank_stream(files, world_size):
    spec = tg.BatchSpec(batch_size=8 * 256, seq_len=256, max_doc_len=80)
    single = stream_batches(files, spec, steps=4)
    per_rank = [stream_batches(files, spec, steps=4, rank=r, world_size=world_size) for r in range(world_size)]
    for step in range(4):
        accum = 8 // world_size
        assert all(len(per_rank[r][step]) == accum for r in range(world_size))
        for m in range(accum):
            for r in range(world_size):
                slot = m * world_size + r  # rank r's micro-step m
                for a, b in zip(per_rank[r][step][m], single[step][slot]):
                    np.testing.assert_array_equal(a, b)


def test_same_files_give_the_same_batches(files):
    spec = tg.BatchSpec(batch_size=2 * 256, seq_len=256, max_doc_len=80)
    a, b = stream_batches(files, spec, 6), stream_batches(files, spec, 6)
    for sa, sb in zip(a, b):
        for ma, mb in zip(sa, sb):
            for ta, tb in zip(ma, mb):
                np.testing.assert_array_equal(ta, tb)


def test_batch_size_and_max_doc_len_may_change_between_steps(files):
    plan = lambda s: tg.BatchSpec(batch_size=(2 + 2 * (s % 2)) * 256, seq_len=256, max_doc_len=32 if s < 2 else 200)
    steps = stream_batches(files, plan, steps=4)
    assert [len(s) for s in steps] == [2, 4, 2, 4]
    lens = [max(len(q) for q in sequences(x, cu)) for x, _, cu in steps[0]]
    assert max(lens) <= 32
    # the stream continues seamlessly: step 1 starts where step 0 ended
    flat = np.concatenate([y for st in steps for _, y, _ in st])
    shards = np.concatenate([tg.load_shard(f)[1:] for f in files])
    np.testing.assert_array_equal(flat, shards[: flat.size])


def test_background_loader_yields_the_producer_batches(files):
    spec = tg.BatchSpec(batch_size=4 * 256, seq_len=256, max_doc_len=80)
    direct = stream_batches(files, spec, steps=5, rank=1, world_size=2)
    loader = tg.BatchLoader(files, lambda s: spec, rank=1, world_size=2, max_num_docs=64, bos_id=BOS, device=CPU)
    try:
        for step in direct:
            _, micro = loader.next()
            for m_direct, m_loader in zip(step, micro):
                for a, b in zip(m_direct, m_loader):
                    np.testing.assert_array_equal(a, b.numpy())
    finally:
        loader.close()


def test_exhausted_training_data_wraps_around_and_says_so_once_per_pass(tmp_path):
    train, _ = write_corpus(tmp_path, train_sizes=(3000,), val_size=100)
    messages = []
    stream = tg.TokenStream(tg.shard_files(train, "training"), BOS, wrap=True, log=messages.append)
    first = stream.take(1000, 100)
    for _ in range(5):
        stream.take(1000, 100)  # 6000 tokens from 2 x 2999 usable ones: two wrap-arounds
    assert stream.epoch == 2 and len([m for m in messages if "pass 2" in m]) == 1
    assert any("pass 3" in m for m in messages)
    assert first[0][1] == 0


def test_missing_shards_error_names_the_pattern_and_the_download_command(tmp_path):
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(FileNotFoundError) as e:
        tg.shard_files(pattern, "training")
    assert pattern in str(e.value) and "cached_fineweb10B.py" in str(e.value)


def test_validation_shard_smaller_than_val_tokens_is_an_error(corpus):
    with pytest.raises(ValueError, match="fewer than val_tokens"):
        next(tg.validation_batches(corpus[1], 1_000_000, 256, 64, 32, BOS, 0, 1))


def test_too_many_documents_for_max_num_docs_is_an_error(files):
    with pytest.raises(ValueError, match="max_num_docs"):
        stream_batches(files, tg.BatchSpec(1024, 1024, 8), steps=1, max_num_docs=16)


@pytest.mark.parametrize("world_size", [2, 4])
def test_validation_set_is_the_same_on_any_world_size(corpus, world_size):
    args = (corpus[1], 4096, 256, 64, 32, BOS)
    single = list(tg.validation_batches(*args, 0, 1))
    shares = [list(tg.validation_batches(*args, r, world_size)) for r in range(world_size)]
    assert sum(len(s) for s in shares) == len(single) == 16
    for i, batch in enumerate(single):
        for a, b in zip(batch, shares[i % world_size][i // world_size]):
            assert torch.equal(a, b)
