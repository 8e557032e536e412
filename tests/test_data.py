"""Training and validation batches: BOS-aligned varlen micro-batches over pre-indexed shards, cut the
way the public 2025-09-03 record cuts them (tails of cut documents dropped; validation as one stream)."""
import dataclasses

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import BOS, write_corpus

CPU = torch.device("cpu")


def stream_batches(files, spec, steps, rank=0, world_size=1, max_num_docs=64):
    """Each step's micro-batches straight from the producer (no thread); specs without num_docs get max_num_docs."""
    producer = tg.BatchProducer(files, rank, world_size, BOS, log=lambda m: None)
    slots = lambda sp: sp if sp.num_docs else dataclasses.replace(sp, num_docs=max_num_docs)
    return [producer.step(slots(spec(s) if callable(spec) else spec)) for s in range(steps)]


def sequences(x, cu):
    ends = [int(c) for c in cu]
    return [x[a:b] for a, b in zip(ends[:-1], ends[1:]) if b > a]


def public_bos_finder_slots(tokens, num_tokens, max_doc_len, count):
    """Slots cut by the rules of the public record's BOS finder (one rank), written out here from its
    description: from the next unused document start, whole documents cut at max_doc_len, the buffer
    num_tokens + 1 long (inputs and the last target), the last document cut to fit; the next buffer
    starts at the first document not yet touched. Returns (inputs, targets, sequence lengths)."""
    bos = np.flatnonzero(tokens == BOS)
    idx, out = 0, []
    for _ in range(count):
        parts, lengths, cur = [], [], 0
        while cur <= num_tokens:
            a = bos[idx]
            end = min(bos[idx + 1] if idx + 1 < bos.size else tokens.size, a + max_doc_len, a + num_tokens - cur + 1)
            parts.append(tokens[a:end])
            lengths.append(end - a)
            cur += end - a
            idx += 1
        buf = np.concatenate(parts)
        lengths[-1] -= 1
        out.append((buf[:-1], buf[1:], [n for n in lengths if n > 0]))
    return out


@pytest.fixture
def files(corpus):
    return tg.shard_files(corpus[0], "training")


def test_micro_batches_are_whole_document_starts_bounded_and_padded(files):
    spec = tg.BatchSpec(batch_size=4 * 512, seq_len=512, max_doc_len=100)
    for step in stream_batches(files, spec, steps=10):
        for x, y, cu in step:
            assert x.shape == y.shape == (512,) and cu.shape == (65,)
            assert cu[0] == 0 and cu[-1] == 512 and np.all(np.diff(cu) >= 0)
            n = int(np.argmax(cu == 512))  # first padding entry: the rest are padding too
            assert np.all(cu[n:] == 512)
            seqs = sequences(x, cu)
            assert len(seqs) == n
            assert all(s[0] == BOS for s in seqs), "every sequence is a document from its BOS"
            assert max(len(s) for s in seqs) <= 100, "no sequence longer than max_doc_len"
            assert all(np.all(s[1:] != BOS) for s in seqs), "attention never crosses a document start"
            np.testing.assert_array_equal(x[1:], np.where(np.isin(np.arange(1, 512), cu), x[1:], y[:-1]))


def test_slots_match_the_public_bos_finder_except_the_label_after_a_cut(files):
    """Token for token the public record's batches; the one difference: after a document cut at
    max_doc_len, the public buffer's next token (the next document's BOS) is the last target, ours is
    the document's true next token."""
    shard = tg.load_shard(files[0])
    ref = public_bos_finder_slots(shard, 300, 64, count=20)
    ours = [m for step in stream_batches(files[:1], tg.BatchSpec(300, 300, 64), steps=20) for m in step]
    relabelled = 0
    for (rx, ry, rlen), (x, y, cu) in zip(ref, ours):
        np.testing.assert_array_equal(x, rx)
        assert [len(s) for s in sequences(x, cu)] == rlen
        differ = np.flatnonzero(y != ry)
        for i in differ:  # the last position of a sequence cut at max_doc_len
            assert i + 1 in cu and ry[i] == BOS and y[i] != BOS
        relabelled += differ.size
    assert relabelled > 0  # the corpus has documents longer than 64 tokens


def test_cut_documents_lose_their_rest_and_targets_are_the_true_next_tokens(tmp_path):
    doc_a = np.concatenate([[BOS], 1 + np.arange(500) % 60])
    doc_b = np.concatenate([[BOS], 1 + np.arange(30) % 60])
    doc_c = np.concatenate([[BOS], 1 + np.arange(40) % 60])
    shard = np.concatenate([doc_a, doc_b, doc_c, doc_b])
    tg.write_shard(tmp_path / "t_000001.bin", shard)
    stream = tg.TokenStream([str(tmp_path / "t_000001.bin")], BOS, wrap=False)
    first = stream.take(100, 48)  # doc_a cut at 48 (rest dropped), doc_b whole (31), doc_c cut to fill
    assert [(a, b) for _, a, b in first] == [(0, 48), (501, 532), (532, 553)]
    x, y, cu = tg.assemble(first, 100, 8)
    np.testing.assert_array_equal(y[:48], shard[1:49])  # after the cut: the true next token
    assert list(cu[:3]) == [0, 48, 79]
    second = stream.take(16, 48)  # starts at the first document after the last target: the last doc_b
    assert second[0][1] == doc_a.size + doc_b.size + doc_c.size


def test_a_slot_the_shard_cannot_complete_is_dropped_and_the_next_shard_starts_at_its_first_document(tmp_path):
    one = np.concatenate([[BOS], np.arange(1, 40), [BOS], np.arange(1, 30)])
    two = np.concatenate([[7, 8, 9], [BOS], np.arange(1, 50), [BOS], np.arange(1, 60)])
    for i, t in enumerate((one, two), start=1):
        tg.write_shard(tmp_path / f"t_{i:06d}.bin", t)
    stream = tg.TokenStream(tg.shard_files(str(tmp_path / "t_*.bin"), "training"), BOS, wrap=False)
    assert [(a, b) for _, a, b in stream.take(30, 100)] == [(0, 30)]
    got = stream.take(50, 100)  # shard one holds only 29 more inputs from its next BOS: dropped
    assert stream.shard == 1 and [(a, b) for _, a, b in got] == [(3, 53)]
    with pytest.raises(EOFError):
        stream.take(100, 100)


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
    assert max(len(q) for x, _, cu in steps[0] for q in sequences(x, cu)) <= 32
    assert max(len(q) for x, _, cu in steps[2] for q in sequences(x, cu)) > 32


def test_background_loader_yields_the_producer_batches(files):
    spec = tg.BatchSpec(batch_size=4 * 256, seq_len=256, max_doc_len=80)
    direct = stream_batches(files, spec, steps=5, rank=1, world_size=2)
    loader = tg.BatchLoader(tg.BatchProducer(files, 1, 2, BOS), lambda s: dataclasses.replace(spec, num_docs=64), CPU)
    try:
        for step in direct:
            _, micro = loader.next()
            for m_direct, m_loader in zip(step, micro):
                for a, b in zip(m_direct, m_loader):
                    np.testing.assert_array_equal(a, b.numpy())
    finally:
        loader.close()



def test_the_loader_shows_the_next_steps_batches_without_taking_them(files):
    """peek: the micro-batches next hands out next (ngram_plan_ahead plans from them), on the host; peeking twice
    takes nothing more, and the loader's stream state moves only with next."""
    spec = tg.BatchSpec(batch_size=2 * 256, seq_len=256, max_doc_len=80)
    direct = stream_batches(files, spec, steps=3)
    loader = tg.BatchLoader(tg.BatchProducer(files, 0, 1, BOS), lambda s: dataclasses.replace(spec, num_docs=64), CPU)
    try:
        loader.next()
        state = loader.state
        seen = loader.peek()
        assert loader.peek() is seen and loader.state == state
        for got, want in zip(seen, direct[1]):
            np.testing.assert_array_equal(got[0].numpy(), want[0])
        for step in direct[1:]:
            _, micro = loader.next()
            for m_direct, m_loader in zip(step, micro):
                for a, b in zip(m_direct, m_loader):
                    np.testing.assert_array_equal(a, b.numpy())
        assert loader.state != state
    finally:
        loader.close()

def test_exhausted_training_data_wraps_around_and_says_so_once_per_pass(tmp_path):
    train, _ = write_corpus(tmp_path, train_sizes=(3000,), val_size=100)
    messages = []
    stream = tg.TokenStream(tg.shard_files(train, "training"), BOS, wrap=True, log=messages.append)
    first = stream.take(500, 100)
    for _ in range(11):
        stream.take(500, 100)
    assert stream.epoch >= 2
    for p in range(2, stream.epoch + 2):
        assert len([m for m in messages if f"pass {p} " in m]) == 1
    assert first[0][1] == 0


def test_missing_shards_error_names_the_pattern_and_the_download_command(tmp_path):
    pattern = str(tmp_path / "nothing_*.bin")
    with pytest.raises(FileNotFoundError) as e:
        tg.shard_files(pattern, "training")
    assert pattern in str(e.value) and "cached_fineweb10B.py" in str(e.value)


def test_too_many_documents_for_max_num_docs_is_an_error(files):
    with pytest.raises(ValueError, match="max_num_docs"):
        stream_batches(files, tg.BatchSpec(1024, 1024, 8), steps=1, max_num_docs=16)


def test_a_spec_without_its_cu_seqlens_length_is_refused(files):
    producer = tg.BatchProducer(files, 0, 1, BOS, log=lambda m: None)
    with pytest.raises(ValueError, match="num_docs not set; doc_slots"):
        producer.step(tg.BatchSpec(1024, 1024, 8))


def test_doc_slots_fit_every_micro_batch_of_the_run_and_no_more(tiny_args, files):
    """--max_num_docs 0: cu_seqlens' length per micro-batch shape is the most documents any micro-batch of the run
    holds (the warm-up's and the loaders' read-ahead included), rounded up to DOC_SLOT_MULTIPLE."""
    args = tiny_args(max_num_docs=0, warmup_steps=2, num_iterations=12,
                     stages=(tg.Stage(1, doc_len=24), tg.Stage(2), tg.Stage(3, doc_len=24)))
    schedule, lines = tg.Schedule(args), []
    slots = tg.doc_slots(schedule, files, lines.append)
    assert set(slots) == {(128, 24), (128, args.max_doc_len)}
    seen = {}
    for plan in schedule.loader_plans():  # every micro-batch the warm-up's and the run's loaders cut
        producer = tg.BatchProducer(files, 0, 1, BOS, log=lambda m: None)
        for spec in plan:
            spec = dataclasses.replace(spec, num_docs=slots[spec.seq_len, spec.max_doc_len])
            for x, _, cu in producer.step(spec):  # raises if a micro-batch held more than its slots
                key = (spec.seq_len, spec.max_doc_len)
                seen[key] = max(seen.get(key, 0), int((cu[1:] > cu[:-1]).sum()))
    for key, n in slots.items():
        assert n % tg.DOC_SLOT_MULTIPLE == 0 and n - tg.DOC_SLOT_MULTIPLE < seen[key] <= n, (key, n, seen)
    assert seen[128, 24] > seen[128, args.max_doc_len]  # shorter cuts, more pieces: sized apart
    assert lines[0].startswith("data: cu_seqlens sized") and f"at most {seen[128, 24]} documents" in lines[0]
    sized = schedule.with_slots(slots)
    assert [st.spec.num_docs for st in sized.stages] == [slots[128, 24], slots[128, args.max_doc_len], slots[128, 24]]
    # a set --max_num_docs is taken as it is, for every shape, without reading the data
    assert set(tg.doc_slots(tg.Schedule(dataclasses.replace(args, max_num_docs=40)), []).values()) == {40}


# Validation: the public definition, one stream of val_tokens + 1 tokens in buffers of val_seq_len.

def test_validation_scores_every_target_once_with_context_back_to_the_buffer_start(tmp_path):
    docs = [[BOS, 1, 2, 3, 4], [BOS, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [BOS, 17], [BOS, 18, 19, 20, 21, 22]]
    stream = np.array(sum(docs, []) * 2)
    tg.write_shard(tmp_path / "v_000000.bin", stream)
    batches = list(tg.validation_batches(str(tmp_path / "v_*.bin"), 32, 8, BOS, 0, 1))
    assert len(batches) == 4
    np.testing.assert_array_equal(torch.cat([y for _, y, _ in batches]).numpy(), stream[1:33])
    np.testing.assert_array_equal(torch.cat([x for x, _, _ in batches]).numpy(), stream[:32])
    # sequences: the buffer start, then every BOS inside it; never cut at any document length
    starts = [[int(c) for c in cu if c < 8] for _, _, cu in batches]
    assert starts == [[0, 5], [0], [0, 2, 4], [0, 2, 7]]  # BOS at 0, 5, 18, 20, 26, 31
    assert all(cu.shape == (129,) and cu[-1] == 8 for _, _, cu in batches)


def test_validation_context_equals_running_each_document_alone(tmp_path):
    """What the model sees: a token's loss in a validation buffer equals its loss when its document
    (from its BOS, or from the buffer start for the first one) runs on its own."""
    from conftest import TINY
    # without CPLM: its pointer's bands start at multiples of the band in the buffer (PR 379's), so a document's
    # pointer scores depend on where in the buffer it starts
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**{**TINY, "cplm_bands": ()}))
    torch.manual_seed(0)
    # float64 weights: at float32 these random weights amplify rotary's rounding at other absolute positions to 1.3e-3
    # of a loss under torch 2.13's CPU kernels (1e-4 seen before); float64 leaves the float32 rotary angles and
    # attention scores inside the model, 1.2e-5 seen
    model = tg.GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    train, val = write_corpus(tmp_path, train_sizes=(100,), val_size=2000, min_len=3, max_len=60)
    for x, y, cu in tg.validation_batches(val, 512, 256, BOS, 0, 1):
        with torch.no_grad():
            together = model(x, y, cu, 256, (48, 16), reduction="none")
            bounds = sorted(set(int(c) for c in cu))
            for a, b in zip(bounds[:-1], bounds[1:]):
                alone = model(x[a:b], y[a:b], torch.tensor([0, b - a], dtype=torch.int32), b - a, (48, 16), reduction="none")
                # a leak across documents moves a loss by tenths (CPLM's bands above: 0.22)
                torch.testing.assert_close(together[a:b], alone, atol=1e-4, rtol=1e-5)


def test_validation_shard_smaller_than_val_tokens_is_an_error(corpus):
    with pytest.raises(ValueError, match="fewer than val_tokens"):
        next(tg.validation_batches(corpus[1], 1_048_576, 256, BOS, 0, 1))


def test_val_tokens_must_fill_whole_buffers(corpus):
    with pytest.raises(ValueError, match="--val_tokens 3840"):
        next(tg.validation_batches(corpus[1], 4000, 256, BOS, 0, 1))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_validation_set_is_the_same_on_any_world_size(corpus, world_size):
    args = (corpus[1], 4096, 256, BOS)
    single = list(tg.validation_batches(*args, 0, 1))
    shares = [list(tg.validation_batches(*args, r, world_size)) for r in range(world_size)]
    assert sum(len(s) for s in shares) == len(single) == 16
    for i, batch in enumerate(single):
        for a, b in zip(batch, shares[i % world_size][i // world_size]):
            assert torch.equal(a, b)
