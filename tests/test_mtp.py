"""Multi-token prediction (mtp_weights) and the prefix-token loss (prefix_weight): the losses, their gradients,
schedules, and runs that learn."""
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import BOS, FAST, TINY, stages as table

W3 = tg.window_tokens(3, TINY["window_block"])
RECORD = (0.5, 0.25, 0.5, 0.0, 0.0, 0.0)  # the 2025-12-22 record's [1, .5, .25->0], [1, .5->0], [1]


def tiny_model(kernels=tg.ModelKernels(), **overrides):
    args = tg.Hyperparameters(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args), kernels)
    with torch.no_grad():  # zero-initialised weights would hide paths: give every weight signal
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
    return model


def two_documents(T=24, second=10):
    """A buffer of two documents, [0, second) and [second, T), padded cu_seqlens; random tokens."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, BOS, (T,), generator=g, dtype=torch.int32)
    y = torch.randint(0, BOS, (T,), generator=g, dtype=torch.int32)
    x[[0, second]] = BOS
    y[second - 1] = BOS  # the first document's last target is the BOS that starts the second
    return x, y, torch.tensor([0, second, T, T], dtype=torch.int32)


def direct_loss(z, y, doc_ends, weights):
    """sum_k w_k * CE(z_t, token t+k) per position t, written out in float64: the token at t + k is
    y[t + k - 1], a term only where t + k - 1 is still in t's document (t + k - 1 < its end)."""
    z = z.double()
    out = torch.zeros(z.size(0), dtype=torch.float64)
    for t in range(z.size(0)):
        for k, w in enumerate([1.0, *weights], start=1):
            if t + k - 1 < doc_ends[t]:
                out[t] += w * F.cross_entropy(z[t], y[t + k - 1].long())
    return out


def logits(model, x):
    return model.softcap(F.linear(x, model.lm_head_w.type_as(x)))


def test_zero_extra_weights_give_exactly_the_next_token_loss_and_evaluation_ignores_the_weights():
    model = tiny_model()
    x, y, cu = two_documents()
    plain = model(x, y, cu, 24, W3, reduction="none")
    zero = model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.zeros(2))
    assert torch.equal(zero, plain)
    on = model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.tensor([0.5, 0.25]))
    assert (on - plain).abs().min() == 0 and (on - plain).max() > 0.5  # last positions: nothing to add
    model.eval()
    assert torch.equal(model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.tensor([0.5, 0.25])),
                       model(x, y, cu, 24, W3, reduction="none"))


def test_extra_targets_stop_at_the_document_end_and_the_buffer_end():
    y = torch.arange(100, 112)
    cu = torch.tensor([0, 5, 12, 12], dtype=torch.int32)  # documents [0, 5) and [5, 12)
    (y2, keep2), (y3, keep3) = tg.mtp_targets(y, cu, 2)
    assert y2[:11].tolist() == list(range(101, 112)) and y3[:10].tolist() == list(range(102, 112))
    assert keep2.tolist() == [True] * 4 + [False] + [True] * 6 + [False]
    assert keep3.tolist() == [True] * 3 + [False] * 2 + [True] * 5 + [False] * 2


@pytest.mark.parametrize("cplm", [False, True], ids=["plain", "cplm"])
def test_loss_on_two_documents_is_the_direct_sum_over_positions_and_offsets(cplm):
    """Without CPLM, the whole loss against the formula; with it (the record's), the next-token term is the copy
    mixture's and the extra terms add the same cross-entropies of the head's logits to it."""
    model = tiny_model(**({} if cplm else dict(cplm_bands=())))
    x, y, cu = two_documents(T=24, second=10)
    w = [0.5, 0.25, 0.125]
    got = model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.tensor(w))
    with torch.no_grad():
        z = logits(model, model.hidden(x, cu, 24, W3))
    doc_ends = [10] * 10 + [24] * 14
    direct = lambda ends: direct_loss(z, y, ends, w) + (
        model(x, y, cu, 24, W3, reduction="none").detach().double() - direct_loss(z, y, ends, []) if cplm else 0)
    torch.testing.assert_close(got.double(), direct(doc_ends), rtol=1e-5, atol=1e-5)
    crossing = direct([24] * 24)  # what the loss would be if targets crossed into document 2
    assert (crossing[7:10] - got[7:10].double()).abs().min() > 0.1
    torch.testing.assert_close(got.sum(), model(x, y, cu, 24, W3, mtp_weights=torch.tensor(w)))


@pytest.mark.parametrize("fp8, fused", [(False, False), (True, False), (True, True)],
                         ids=["bf16_head", "fp8_head", "fused_ce"])
def test_head_loss_and_gradients_match_the_direct_formula_in_float64(fp8, fused):
    """head_losses on a float32 hidden state (the FP8 head: e4m3 operands, e5m2 gradients; fused: all
    targets of a token in the fused loss op) against autograd of the direct formula in float64; the
    extra terms' own gradient (weights minus none) is checked too, so a loss whose extra terms did not
    reach the gradient would fail."""
    if fp8 and not tg.kernels.fp8_supported(torch.device("cpu")):
        pytest.skip("_scaled_mm FP8 does not run on this CPU")
    model = tiny_model(logit_softcap=23.0, softcap_shift=5.0, kernels=tg.ModelKernels(fp8_head=fp8, fused_ce=fused))
    g = torch.Generator().manual_seed(0)
    T, dim, V = 96, TINY["model_dim"], TINY["vocab_size"]
    with torch.no_grad():  # |w| < 0.8 fits e4m3 at the head's weight scale
        model.lm_head_w.copy_(0.8 * (2 * torch.rand(V, dim, generator=g) - 1))
    h = F.rms_norm(torch.randn(T, dim, generator=g), (dim,))
    y = torch.randint(0, V, (T,), generator=g)
    cu = torch.tensor([0, 30, 31, 70, T, T], dtype=torch.int32)  # a one-token document included
    doc_ends = [30] * 30 + [31] + [70] * 39 + [T] * 26
    grads = {}
    for w in ([0.5, 0.25], [0.0, 0.0]):
        model.zero_grad()
        x = h.clone().requires_grad_(True)
        losses = model.head_losses(x, y, torch.tensor(w), cu)
        losses.sum().backward()
        xr, wr = h.double().requires_grad_(True), model.lm_head_w.detach().double().requires_grad_(True)
        ref = direct_loss(23 * torch.sigmoid((xr @ wr.T + 5) / 7.5), y, doc_ends, w)
        ref.sum().backward()
        grads[tuple(w)] = (losses.detach(), ref.detach(), x.grad, xr.grad, model.lm_head_w.grad.clone(), wr.grad)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    tol = (0.05, 0.1) if fp8 else (1e-5, 1e-5)
    on, off = grads[(0.5, 0.25)], grads[(0.0, 0.0)]
    assert rel(on[0], on[1]) < tol[0] and rel(on[2], on[3]) < tol[1] and rel(on[4], on[5]) < tol[1]
    assert rel(on[2] - off[2], on[3] - off[3]) < 2 * tol[1] and rel(on[4] - off[4], on[5] - off[5]) < 2 * tol[1]
    assert (on[3] - off[3]).norm() > 0.2 * off[3].norm()  # the extra terms' gradient is not negligible


def test_extra_terms_reach_the_embeddings_as_autograd_of_the_direct_formula_does():
    x, y, cu = two_documents(T=24, second=10)
    doc_ends = [10] * 10 + [24] * 14
    w = [0.5, 0.25]
    model = tiny_model(tied_embed_stages=0, cplm_bands=())  # the token embedding its own; the plain next-token term
    model(x, y, cu, 24, W3, mtp_weights=torch.tensor(w)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    direct_loss(logits(model, model.hidden(x, cu, 24, W3)), y, doc_ends, w).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x, y, cu, 24, W3).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name in ("embed.weight", "value_embeds.0.weight", "lm_head_w", "blocks.0.mlp.fc_w"):
        a, b, c = got[name].double(), ref[name].double(), plain[name].double()
        assert (a - b).norm() < 0.02 * b.norm(), name  # bf16 embeddings: their gradients are bf16
        assert (a - c).norm() > 0.1 * c.norm(), name  # and the extra terms do change them


def test_schedule_is_the_records_at_stage_starts_and_ends_and_linear_inside():
    args = tg.Hyperparameters(**dict(TINY, stages=table(mtp_weights=RECORD), num_iterations=30))
    schedule = tg.Schedule(args)
    stages = schedule.stages
    assert [(st.start, st.end) for st in stages] == [(0, 11), (11, 21), (21, 31)]
    assert [st.mtp_ramp for st in stages] == [((0.5, 0.5), (0.25, 0.0)), ((0.5, 0.0),), ()]  # 2, 1, 0 extra targets
    at = lambda s: schedule.stage_at(s).loss_weights(s)
    assert at(0) == (0.5, 0.25) and at(11) == (0.5,) and at(21) == () and at(30) == ()
    assert at(10) == pytest.approx((0.5, 0.25 / 11)) and at(20) == pytest.approx((0.5 / 10,))  # 1 step short of 0
    for st in stages[:2]:  # linear: equal steps between consecutive steps of a stage
        w = torch.tensor([at(s)[-1] for s in range(st.start, st.end)], dtype=torch.float64)
        torch.testing.assert_close(w.diff(), torch.full((st.end - st.start - 1,), -w[0].item() / (st.end - st.start),
                                                        dtype=torch.float64))
    # the last stage and the extension hold the last stage's weights; off: no stage has any
    args = tg.Hyperparameters(stages=table(mtp_weights=(0.4, 0.2, 0.1)), num_iterations=33, extension_steps=3,
                              extension_window=13)
    stages = tg.Schedule(args).stages
    assert [st.mtp_ramp for st in stages] == [((0.4, 0.2),), ((0.2, 0.1),), ((0.1, 0.1),), ((0.1, 0.1),)]
    assert stages[1].loss_weights(16) == pytest.approx((0.15,)) and stages[3].loss_weights(31) == (0.1,)
    off = tg.Hyperparameters(**dict(TINY, extension_steps=10, extension_window=13))
    assert all(st.mtp_ramp == () for st in tg.Schedule(off).stages)
    assert tg.parse_args(["--stages", "window=1;window=2;window=3", "--mtp_weights", "0.5,0.25,0.5,0,0,0"]).stages == \
        table(mtp_weights=RECORD)  # the column over the rows --stages gave
    fused = tg.parse_args(["--mtp_weights", "0.5,0.25,0.5,0,0,0"])  # the record preset's fused loss takes them
    assert fused.fused_ce and [row.mtp for row in fused.stages] == [(0.5, 0.25), (0.5, 0.0), (0.0, 0.0)]
    assert [row.doc_len for row in fused.stages] == [896, 2048, 4096]  # the preset's other columns kept


@pytest.mark.parametrize("weights", [((0.5,), (0.25,), (0.1, 0.2)), ((0.5,), (-0.1,), (0.0,)), ((math.nan,), (0.0,), (0.0,)),
                                     ((math.inf,), (0.0,), (0.0,))])
def test_bad_weights_are_refused_naming_the_field(weights):
    with pytest.raises(ValueError, match=r"every stage needs the same number of finite mtp weights >= 0"):
        tg.Hyperparameters(stages=tuple(tg.Stage(w, mtp=m) for w, m in zip((3, 7, 11), weights)))
    with pytest.raises(SystemExit):  # on the command line, a count that does not split by stage
        tg.parse_args(["--mtp_weights", "0.5,0.25"])


def test_a_run_with_multi_token_prediction_trains_on_the_scheduled_weights_and_learns(tiny_args, monkeypatch):
    seen, forward = [], tg.GPT.forward

    def recording(self, *a, mtp_weights=None, **kw):
        if self.training:
            seen.append(None if mtp_weights is None else mtp_weights.clone())
        return forward(self, *a, mtp_weights=mtp_weights, **kw)
    monkeypatch.setattr(tg.GPT, "forward", recording)
    run = tg.train(tiny_args(**FAST, num_iterations=20, val_every=10, stages=table(TINY["stages"], mtp_weights=RECORD)))
    losses = [v for _, v in run.val_losses]
    # validation is next-token only: at step 0 the tied head (N(0, 0.005)) is near uniform over the 72 columns, and
    # CPLM's mixture hands the copy column's share back to the tokens: ~log 71, where an extra term would add ~log 72
    V = TINY["vocab_size"]
    assert abs(losses[0] - math.log(V - 1)) < 0.02
    # (the record model's optimizer, Adam every second step, the embedding tied: 4.26 -> 3.56 at TINY's 8 micro-batches,
    # measured at 4717366; 3.68 at FAST's 2)
    assert losses[-1] < losses[0] - 0.5 and losses[-1] < losses[1]
    # step 0: every term is ~log V, weighted 1 + 0.5 + 0.25 where the targets are in the document
    assert 1.6 * math.log(V) < run.train_losses[0] < 1.75 * math.log(V)
    schedule = tg.Schedule(tiny_args(stages=table(TINY["stages"], mtp_weights=RECORD), num_iterations=20))
    assert [(st.end, len(st.mtp_ramp)) for st in schedule.stages] == [(7, 2), (14, 1), (21, 0)]
    micro = FAST["batch_size"] // TINY["seq_len"]
    assert len(seen) == 20 * micro  # 2 micro-batches a step
    for step in range(20):
        w = seen[micro * step]
        expected = schedule.stage_at(step).loss_weights(step)
        assert (w is None and expected == ()) or (w.dtype == torch.float32 and w.tolist() == pytest.approx(expected))


def test_warmup_compiles_each_stage_whose_number_of_extra_targets_differs(tiny_args, monkeypatch):
    seen, train_step = [], tg.train_step

    def recording(model, compiled, optimizers, micro, step, stage, schedule, ahead=None):
        seen.append(len(stage.mtp_ramp))
        return train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead)
    monkeypatch.setattr(tg, "train_step", recording)
    tg.train(tiny_args(**FAST, num_iterations=6, val_every=0, warmup_steps=1,
                       stages=table(window_schedule=(2, 2, 2), mtp_weights=RECORD)))
    assert seen[:3] == [2, 1, 0]  # one warm-up step per shape, though the windows are the same


# The prefix-token loss

def test_prefix_table_maps_each_token_to_its_longest_proper_prefix_that_is_a_token():
    vocab = [b"a", b"ab", b"abc", b"b", b"abd", None, b"xyz", b"abcd"]
    assert tg.prefix_table(vocab, 10).tolist() == [-1, 0, 1, -1, 1, -1, -1, 2, -1, -1]  # padding ids: -1


def synthetic_vocab(n=BOS):
    """Token i is letter i % 8 repeated 1 + i // 8 times: 'a'..'h', 'aa'..'hh', ...; BOS is special."""
    return [bytes([97 + i % 8]) * (1 + i // 8) for i in range(n)] + [None]


def test_the_prefix_term_adds_its_weight_times_the_cross_entropy_of_each_targets_prefix_token():
    model = tiny_model()
    model.prefix_ids = tg.prefix_table(synthetic_vocab(), TINY["vocab_size"])
    x, y, cu = two_documents()
    plain = model(x, y, cu, 24, W3, reduction="none")
    on = model(x, y, cu, 24, W3, reduction="none", prefix_weight=torch.tensor([0.25]))
    h = model.hidden(x, cu, 24, W3)
    z = logits(model, h).double()
    expected = plain.double().clone()
    for t in range(24):
        p = model.prefix_ids[y[t].long()].item()
        if p >= 0:
            expected[t] += 0.25 * F.cross_entropy(z[t], torch.tensor(p))
    torch.testing.assert_close(on.double(), expected, rtol=1e-5, atol=1e-5)
    assert (on - plain).abs().max() > 0.1 and any(model.prefix_ids[y.long()] < 0)  # one-letter targets: none
    # with multi-token prediction: the two terms add
    both = model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.tensor([0.5]), prefix_weight=torch.tensor([0.25]))
    mtp = model(x, y, cu, 24, W3, reduction="none", mtp_weights=torch.tensor([0.5]))
    torch.testing.assert_close(both - mtp, on - plain, rtol=1e-4, atol=1e-5)


def test_prefix_weights_follow_the_stage_rows_linearly_and_join_the_mtp_weights():
    args = tg.Hyperparameters(**{**TINY, "num_iterations": 30, "stages": tg._stages(
        "window=1,prefix=0.25,mtp=0.5;window=2,prefix=0.25,mtp=0;window=3,mtp=0")})
    stages = tg.Schedule(args).stages
    assert [st.prefix_ramp for st in stages] == [(0.25, 0.25), (0.25, 0.0), (0.0, 0.0)]
    s1 = stages[1]
    mid = (s1.start + s1.end) // 2
    w = s1.loss_weights(mid)
    assert len(w) == 1 and w[0] == pytest.approx(0.25 * (1 - (mid - s1.start) / (s1.end - s1.start)))  # mtp 0 dropped
    assert stages[0].loss_weights(0) == (0.5, 0.25) and stages[2].loss_weights(stages[2].start) == ()
    with pytest.raises(ValueError, match="prefix >= 0"):
        tg.Hyperparameters(**{**TINY, "stages": (tg.Stage(1, prefix=-0.1),)})


def test_a_run_with_the_prefix_loss_learns_and_differs_and_a_small_vocabulary_is_refused(tiny_args, monkeypatch):
    monkeypatch.setattr(tg, "gpt2_token_bytes", synthetic_vocab)
    kw = dict(FAST, num_iterations=8, val_every=8, warmup_steps=1)
    plain = tg.train(tiny_args(**kw))
    prefix = tg.train(tiny_args(stages=tuple(tg.Stage(w, prefix=p) for w, p in ((1, 0.25), (2, 0.25), (3, 0.0))),
                                **kw))
    assert prefix.train_losses[0] > plain.train_losses[0]  # the extra term counts in the training loss
    # 4.26 -> 4.01 in 6 steps of TINY's batch, measured at 4717366; 3.98 in 8 at FAST's two micro-batches a step
    assert prefix.val_losses[-1][1] < prefix.val_losses[0][1] - 0.15
    monkeypatch.setattr(tg, "gpt2_token_bytes", lambda: synthetic_vocab(100))
    with pytest.raises(ValueError, match="is for GPT-2 tokens: vocab_size=72"):
        tg.train(tiny_args(stages=(tg.Stage(1, prefix=0.25),), tied_embed_stages=1, **kw))  # (one stage: tied for it)
