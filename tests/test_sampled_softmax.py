"""The sampled softmax in training (ANVIL2's, issue 63): the candidates (every target of the loss, then a sweep over
the vocabulary), the loss and gradients over them, the stage column and the switch to the full softmax as the
schedule resolves them, validation on the full softmax, and --plan's column."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from conftest import BOS, TINY
from test_mtp import two_documents

W3 = tg.window_tokens(3, TINY["window_block"])
V = TINY["vocab_size"]  # 72: the corpus' 64 tokens (BOS 63), CPLM's copy column 64, padding rows up to 71
# The model tests: the GPU's kernels where there is one (the fused loss' Triton kernels on the gathered rows), and a
# vocabulary of 80, as FP8 matmuls need multiples of 16 (so do the candidates there: 48 of 80)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VM = 80
KERNELS = {"bf16_head": tg.ModelKernels(), "fp8_head": tg.ModelKernels(fp8_head=True),
           "fused_ce": tg.ModelKernels(fp8_head=True, fused_ce=True)}


def tiny_model(kernels=tg.ModelKernels(), **overrides):
    if kernels.fp8_head and not tg.kernels.fp8_supported(DEVICE):
        pytest.skip(f"_scaled_mm FP8 does not run on {DEVICE}")
    torch.manual_seed(0)
    args = tg.Hyperparameters(**{**TINY, "vocab_size": VM, **overrides})
    model = tg.GPT(tg.ModelConfig.from_args(args), kernels).to(DEVICE)
    with torch.no_grad():  # every weight away from its initial zeros, so that every path carries signal
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
    # a prefix table over the tiny vocabulary: token i's prefix is i // 2 for even i, none for odd ones
    model.prefix_ids = torch.tensor([i // 2 if i % 2 == 0 and i else -1 for i in range(VM)], device=DEVICE)
    return model


def batch():
    """test_mtp's two documents, on the tests' device."""
    return tuple(t.to(DEVICE) for t in two_documents())


def sweep(offset: int, vocab: int = V) -> list[int]:
    """The rows in sweep order from offset: k * stride mod vocab for k = offset, offset + 1, ..."""
    stride = pow(tg.sweep_inverse(vocab), -1, vocab)
    return [(k * stride) % vocab for k in range(offset, offset + vocab)]


def test_candidates_are_every_target_then_the_next_rows_of_the_sweep_ascending():
    ids = torch.tensor([5, 5, 0, 71, 30, 12, 30])
    rows, positions = tg.candidate_rows(ids, 40, V, torch.tensor(9), tg.sweep_inverse(V))
    assert rows.tolist() == sorted(set(rows.tolist())) and rows.numel() == 40  # distinct, ascending
    targets = set(ids.tolist())
    negatives = [v for v in sweep(9) if v not in targets][:40 - len(targets)]
    assert set(rows.tolist()) == targets | set(negatives)
    assert torch.equal(positions[rows], torch.arange(40)) and int((positions >= 0).sum()) == 40
    # GPT-2's vocabulary sweeps with ANVIL2's own stride, a permutation of its rows
    assert tg.sweep_inverse(50304) == pow(20011, -1, 50304) and sorted(sweep(0, 50304)) == list(range(50304))


def test_the_sweep_moves_on_so_that_every_row_is_a_candidate_within_a_few_micro_batches():
    ids, seen = torch.tensor([1, 2, 3]), set()
    for offset in tg.sweep_offsets(step=0, micro=4, count=24, vocab=V) + tg.sweep_offsets(1, 4, 24, V):
        rows, _ = tg.candidate_rows(ids, 24, V, torch.tensor(offset), tg.sweep_inverse(V))
        seen |= set(rows.tolist())
    assert seen == set(range(V))  # 8 micro-batches of 21 negatives each over 69 rows: every one of them
    # a function of the step alone, each micro-batch 25 places after the one before (24 up to one coprime to 72)
    assert tg.sweep_offsets(3, 4, 24, V) == [(3 * 4 + m) * 25 % V for m in range(4)]


def test_each_rank_starts_its_sweep_a_world_share_of_the_vocabulary_later(monkeypatch):
    monkeypatch.setattr(tg.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(tg.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(tg.dist, "get_world_size", lambda: 8)
    assert tg.sweep_offsets(5, 1, 10240, 50304) == [(5 * 10241 + 50304 * 3 // 8) % 50304]


def test_more_distinct_targets_than_candidates_is_an_error_not_a_lost_target():
    with pytest.raises(RuntimeError, match="more distinct targets than candidates"):
        tg.candidate_rows(torch.arange(41), 40, V, torch.tensor(0), tg.sweep_inverse(V))


def test_every_target_and_the_copy_column_are_among_the_candidates_with_their_own_rows():
    head = torch.randn(V, 8)
    y = torch.randint(0, 20, (30,), dtype=torch.int32)  # with the extras and the copy column: 22 ids at most
    extra = [(torch.roll(y, -1), torch.rand(30)), (torch.tensor([i // 2 for i in range(30)]), torch.rand(30))]
    rows, targets, remapped, column = tg.sampled_head(head, y, extra, BOS + 1, 32, torch.tensor(7),
                                                      tg.sweep_inverse(V))
    assert rows.shape == (32, 8)
    assert torch.equal(rows[targets], head[y.long()]) and torch.equal(rows[column], head[BOS + 1].expand(30, 8))
    for (a, w), (b, w2) in zip(extra, remapped):
        assert torch.equal(rows[b], head[a.long()]) and w2 is w
    _, _, _, none = tg.sampled_head(head, y, [], None, 32, torch.tensor(7), tg.sweep_inverse(V))
    assert none is None  # without CPLM no copy column


def losses_and_grads(model, x, y, cu, sampled):
    kw = dict(reduction="none", mtp_weights=torch.tensor([0.5, 0.25], device=DEVICE),
              prefix_weight=torch.tensor([0.25], device=DEVICE))
    model.zero_grad()
    losses = model(x, y, cu, 24, W3, sampled=sampled, **kw)
    losses.sum().backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(KERNELS))
def test_all_rows_as_candidates_give_the_full_softmax_losses_and_gradients(name):
    """Multi-token prediction, the prefix-token loss and CPLM together, through each head: the written-out loss,
    the FP8 head's, and the fused FP8 loss op (on a GPU its Triton kernels, on the gathered rows): bit for bit on
    the CPU, within float rounding on a GPU."""
    model = tiny_model(KERNELS[name])
    x, y, cu = batch()
    full, full_grads = losses_and_grads(model, x, y, cu, None)
    sampled, grads = losses_and_grads(model, x, y, cu, (VM, torch.tensor(5, device=DEVICE)))
    same = torch.equal if DEVICE.type == "cpu" else lambda a, b: torch.allclose(a.float(), b.float(), 1e-5, 1e-6)
    assert same(sampled, full)
    assert set(grads) == set(full_grads) and all(same(grads[n], full_grads[n]) for n in grads)


@pytest.mark.parametrize("name", list(KERNELS))
def test_the_sampled_loss_is_the_softmax_over_the_candidates_and_only_their_rows_learn(name):
    """head_losses over 48 of the 80 rows against autograd of the softmax restricted to those rows, in float64;
    the head's other rows get no gradient."""
    model = tiny_model(KERNELS[name], logit_softcap=23.0, softcap_shift=5.0)
    g = torch.Generator().manual_seed(0)
    T, dim = 96, TINY["model_dim"]
    with torch.no_grad():  # |w| < 0.8 fits e4m3 at the head's weight scale
        model.lm_head_w.copy_(0.8 * (2 * torch.rand(VM, dim, generator=g) - 1))
    h = F.rms_norm(torch.randn(T, dim, generator=g), (dim,)).to(DEVICE).requires_grad_(True)
    y = torch.randint(0, 30, (T,), generator=g).to(DEVICE)  # 30 distinct targets at most: 18 or more negatives
    offset = torch.tensor(11, device=DEVICE)
    losses = model.head_losses(h, y, sampled=(48, offset))
    losses.sum().backward()
    rows, positions = tg.candidate_rows(y, 48, VM, offset, tg.sweep_inverse(VM))
    hr, wr = h.detach().double().requires_grad_(True), model.lm_head_w.detach().double().requires_grad_(True)
    z = 23 * torch.sigmoid((hr @ wr[rows].T + 5) / 7.5)
    ref = torch.logsumexp(z, 1) - z.gather(1, positions[y][:, None])[:, 0]
    ref.sum().backward()

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    tol = (0.05, 0.1) if name != "bf16_head" else (1e-5, 1e-5) if DEVICE.type == "cpu" else (2e-3, 2e-3)  # TF32
    assert rel(losses, ref.detach()) < tol[0] and rel(h.grad, hr.grad) < tol[1]
    assert rel(model.lm_head_w.grad[rows], wr.grad[rows]) < tol[1]
    others = torch.ones(VM, dtype=torch.bool, device=DEVICE).index_fill_(0, rows, False)
    assert model.lm_head_w.grad[others].abs().max() == 0 and wr.grad[others].abs().max() == 0
    full = model.head_losses(h.detach(), y)  # fewer rows in the softmax: a lower loss than the full softmax's
    assert (full - losses.detach()).min() > 0


def test_validation_reads_the_full_softmax_whatever_the_training_samples():
    model = tiny_model()
    x, y, cu = batch()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x, y, cu, 24, W3, sampled=(48, torch.tensor(3, device=DEVICE))),
                           model(x, y, cu, 24, W3))


def sampled_args(**overrides):
    rows = tuple(dataclasses.replace(row, candidates=c) for row, c in zip(TINY["stages"], (16, 32, 48)))
    return tg.Hyperparameters(**{**TINY, "stages": rows, "extension_steps": 10, "extension_window": 4,
                                 **overrides})


@pytest.mark.parametrize("n", [100, 300])
def test_the_candidates_follow_the_stages_and_the_switch_to_the_full_softmax_follows_num_iterations(n):
    schedule = tg.Schedule(sampled_args(num_iterations=n))
    switch = round(0.922 * n)
    assert schedule.full_softmax == switch
    counts = [schedule.candidates_at(s, schedule.stage_at(s)) for s in range(n)]
    for st, c in zip(schedule.stages, (16, 32, 48, 48)):  # the extension holds the last row's count
        assert counts[st.start: min(st.end, switch)] == [c] * (min(st.end, switch) - st.start)
    assert counts[switch:] == [0] * (n - switch) and counts[switch - 1] == 48
    # the warm-up compiles the stage holding the switch twice: with its candidates and with the full softmax
    shapes = [(st.start, st.candidates) for st in schedule.warmup_shapes()]
    expected = [(st.start, c) for st in schedule.stages for c in
                ([st.candidates] if st.end <= switch else [0] if st.start >= switch else [st.candidates, 0])]
    assert shapes == expected and len(shapes) == len(schedule.stages) + 1  # one stage holds the switch
    # ANVIL2's own: steps 1,101 of 1,194 (its README)
    assert tg.Schedule(sampled_args(num_iterations=1194, full_softmax_from=1101 / 1194)).full_softmax == 1101


def test_without_candidates_the_warm_up_shapes_are_as_before():
    schedule = tg.Schedule(tg.parse_args(["--candidates_schedule", "0,0,0"]))
    before = list({(st.spec, st.windows, len(st.mtp_ramp), any(st.prefix_ramp), st.start < schedule.untie): st
                   for st in schedule.stages}.values())
    assert schedule.warmup_shapes() == before
    assert all(schedule.candidates_at(s, schedule.stage_at(s)) == 0 for s in range(776))


@pytest.mark.slow
def test_a_run_samples_before_the_switch_and_validates_on_the_full_softmax(tiny_args, monkeypatch):
    """Every forward of a tiny run: training ones carry their stage's count and an offset until full_softmax_from,
    none after; validation ones never."""
    seen, forward = [], tg.GPT.forward

    def recording(self, *a, sampled=None, **kw):
        seen.append((self.training, None if sampled is None else sampled[0]))
        return forward(self, *a, sampled=sampled, **kw)
    monkeypatch.setattr(tg.GPT, "forward", recording)
    # the corpus' 64 tokens and the copy column: at most 65 distinct targets, so 66 or more rows never overflow
    rows = tuple(dataclasses.replace(row, candidates=c) for row, c in zip(TINY["stages"], (66, 68, 70)))
    args = tiny_args(stages=rows, num_iterations=20, val_every=10, full_softmax_from=0.75, device="cpu")
    run = tg.train(args)
    assert all(math.isfinite(v) for _, v in run.val_losses)
    schedule = tg.Schedule(args)
    training = [c for train, c in seen if train]
    assert len(training) == 20 * 8  # 8 micro-batches a step
    expected = [schedule.candidates_at(s, schedule.stage_at(s)) or None for s in range(20) for _ in range(8)]
    assert training == expected and expected[14 * 8] == 70 and expected[15 * 8] is None
    assert [c for train, c in seen if not train] and all(c is None for train, c in seen if not train)


def test_the_stages_text_and_the_column_flag_carry_the_candidates():
    args = tg.parse_args(["--stages", "window=3,candidates=10240;window=7;window=11,candidates=24576"])
    assert [row.candidates for row in args.stages] == [10240, 0, 24576]
    assert tg.format_stages(args.stages) == "window=3,candidates=10240;window=7;window=11,candidates=24576"
    flagged = tg.parse_args(["--candidates_schedule", "10240,14336,24576"])
    assert [row.candidates for row in flagged.stages] == [10240, 14336, 24576]
    assert [row.window for row in flagged.stages] == [row.window for row in tg.parse_args([]).stages]


def test_plan_prints_the_softmax_column_and_the_switch(monkeypatch):
    def softmax_column(argv):
        lines = tg.schedule_plan(tg.Schedule(tg.parse_args(argv)))
        rows = [line.split() for line in lines if line.split() and line.split()[0] in ("1", "2", "3", "ext")]
        return [r[11] for r in rows], lines
    assert "softmax" in tg.schedule_plan(tg.Schedule(tg.parse_args([])))[1].split()
    column, lines = softmax_column(["--candidates_schedule", "0,0,0"])
    assert column == ["full"] * 4 and not any(line.startswith("softmax:") for line in lines)
    column, lines = softmax_column([])  # the record preset's
    assert column == ["16,384", "14,336", "12,288*", "full"]
    column, lines = softmax_column(["--candidates_schedule", "10240,14336,24576"])
    assert column == ["10,240", "14,336", "24,576*", "full"]
    full_from = round(0.922 * tg.Hyperparameters().num_iterations)  # 664 of the record's 720 steps
    assert any(line.startswith("softmax:") and f"full softmax from step {full_from} " in line for line in lines)
    column, lines = softmax_column(["--candidates_schedule", "10240,14336,24576", "--num_iterations", "1552"])
    assert any(f"full softmax from step {round(0.922 * 1552)} " in line for line in lines)


def test_counts_the_head_cannot_take_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="candidates=80: 0 .* up to vocab_size=72"):
        tg.Hyperparameters(**{**TINY, "stages": (tg.Stage(1), tg.Stage(2), tg.Stage(3, candidates=80))})
    with pytest.raises(ValueError, match="full_softmax_from=1.5"):
        tg.Hyperparameters(**{**TINY, "full_softmax_from": 1.5})
    with pytest.raises(ValueError, match="multiples of 16"):
        tg.check_fp8_head_shapes(50304, 768, (10240, 10250))
    tg.check_fp8_head_shapes(50304, 768, (0, 10240, 14336, 24576))
