"""ANVIL2's hashed n-gram table (issue 64 item 2): the trigram channel, the row-sparse Adam with exact replay and its
exchange between ranks, the memory table and the start-up refusal."""
import pytest
import torch

import train_gpt as tg
from conftest import BOS, TINY


def tiny_model(randomize=False, **overrides):
    args = tg.Hyperparameters(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args), tg.ModelKernels())
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
    return model


def stream(T=200, starts=(0, 17, 18, 100, 199)):
    x = torch.randint(0, BOS, (T,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    x[list(starts)] = BOS
    return x, torch.tensor([*starts, T, T], dtype=torch.int32)


# -- 1. the trigram channel

def test_trigram_rows_are_anvil2s_hash_in_their_range_and_short_contexts_take_the_reserved_row():
    bigram_rows, rows, sign_rows = 1000, 500, 64
    starts = (0, 17, 18, 100, 199)  # a one-token document at 17
    x, cu = stream(starts=starts)
    row, sign = tg.trigram_indices(x, cu, bigram_rows, rows, sign_rows)
    t = x.tolist()
    short = set(starts) | {s + 1 for s in starts}
    for i in range(len(t)):
        if i in short:  # fewer than two earlier positions in the document
            assert (row[i], sign[i]) == (bigram_rows + rows - 1, 0)
        else:
            assert row[i] == bigram_rows + ((17351 * t[i]) ^ (60961 * t[i - 1]) ^ (45259 * t[i - 2])) % (rows - 1)
            assert sign[i] == ((26801 * t[i - 2]) ^ (39779 * t[i - 1]) ^ (58699 * t[i])) % sign_rows
    assert bigram_rows <= row.min() and row.max() == bigram_rows + rows - 1
    brow, _ = tg.bigram_indices(x, cu, bigram_rows, sign_rows)
    assert brow.max() < bigram_rows, "the channels' row ranges do not overlap"


def test_trigram_rows_of_a_document_do_not_depend_on_the_document_before_it():
    x, cu = stream(starts=(0, 100))
    row, sign = tg.trigram_indices(x, cu, 10, 1000, 16)
    for j in (97, 98, 99):  # the first document's last tokens
        x2 = x.clone()
        x2[j] = (x2[j] + 1) % BOS
        row2, sign2 = tg.trigram_indices(x2, cu, 10, 1000, 16)
        changed = ((row2 != row) | (sign2 != sign)).nonzero().flatten().tolist()
        assert changed == [k for k in (j, j + 1, j + 2) if k < 100]


def test_the_ngram_embedding_sums_the_signed_bigram_and_trigram_rows_of_one_table():
    model = tiny_model(randomize=True, trigram_rows=128)
    cfg = model.cfg
    assert model.bigram_embed.weight.shape[0] == TINY["bigram_rows"] + 128
    x, cu = stream(T=128, starts=(0, 60))
    with torch.no_grad():
        got = model.ngram_embedding(x, cu)
        r2, s2 = tg.bigram_indices(x, cu, cfg.bigram_rows, cfg.bigram_sign_rows)
        r3, s3 = tg.trigram_indices(x, cu, cfg.bigram_rows, 128, cfg.bigram_sign_rows)
        w, signs = model.bigram_embed.weight, model.bigram_signs
        torch.testing.assert_close(got, w[r2] * signs[s2] + w[r3] * signs[s3], rtol=0, atol=0)


def test_trigram_rows_zero_leaves_the_model_as_it_was():
    a, b = tiny_model(randomize=True), tiny_model(randomize=True, trigram_rows=0)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="trigram_rows=1"):
        tg.Hyperparameters(**{**TINY, "trigram_rows": 1})
