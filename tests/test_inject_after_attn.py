"""inject_after_attn: a block's gated x0 and n-gram injections join the residual after its attention, before its MLP,
as in ANVIL2 (the public record #92) and the public line since record #73 (PR 230). ANVIL2's train_gpt.py (printed at
the start of records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-*.txt, @fd1b14a5) starts the stream as x0 plus
layer 0's bigram term ("pre-layer-0 bigram injection", ~140k characters in), and in each attention layer adds
`_xa = _rf_smul(resid_lambdas_attn[i], x) + attn_out`, then `x0 * x0_gates[i]` and the bigram (~148k), so the
attention reads the residual without them. A block without attention, and the removed block 7, take them before their
MLP either way; the blocks after backout_layer read the shared attention input (attn_in) either way. On in the record
and every preset since wt80; off, the model is the one built before the field."""
import pytest
import torch

import train_gpt as tg
from conftest import FAST, TINY_RECORD
from test_injection_sites import FULL, RECORD_FLAGS, SITE_FLAGS, model_of
from test_parallel_mlp import W3
from test_skip_layers import batch

AFTER = dict(FULL, inject_after_attn=True)  # ANVIL2's architecture whole (FULL takes the field from TINY: on)
BEFORE = dict(FULL, inject_after_attn=False)  # the same with the old order


def old_block_forward(self, x, x0, ve, w, attn_in, cu_seqlens, max_seqlen, window, rope):
    """Block.forward as it was before inject_after_attn (wt74, efe3480), written out: the reference of the default."""
    x = tg.residual_in(x, x0, w)
    if w.bigram is not None:
        x = x + w.bigram
    if self.attn is not None:
        y = self.attn(tg.norm(x) if attn_in is None else attn_in, ve, w, cu_seqlens, max_seqlen, window, rope)
        x = x + w.attn_out * y
    if self.parallel_mlp is None:
        return w.mlp_resid * x + w.mlp_out * self.mlp(tg.norm(x))
    h = tg.norm(x)
    return w.mlp_resid * x + w.mlp_out * (self.mlp(h) + self.parallel_mlp(h))


def loss_and_grads(model: tg.GPT) -> tuple[torch.Tensor, dict]:
    x, y, cu = batch()
    model.zero_grad(set_to_none=True)
    loss = model(x, y, cu, 128, W3)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def recorded(model: tg.GPT, x0_noise: dict | None = None) -> dict:
    """One forward: each block's arguments and output, and its attention's input and output, by block; with
    x0_noise {block: tensor}, the x0 that block receives is perturbed (only there)."""
    seen, hooks = {}, []
    for i, block in enumerate(model.blocks):
        if x0_noise and i in x0_noise:
            hooks.append(block.register_forward_pre_hook(
                lambda m, args, n=x0_noise[i]: (args[0], args[1] + n.to(args[1].dtype), *args[2:])))
        hooks.append(block.register_forward_hook(
            lambda m, args, out, i=i: seen.setdefault(i, {}).update(args=args, out=out)))
        if block.attn is not None:
            hooks.append(block.attn.register_forward_hook(
                lambda m, args, out, i=i: seen.setdefault(i, {}).update(attn_in=args[0], attn_out=out)))
    x, y, cu = batch()
    with torch.no_grad():
        model(x, y, cu, 128, W3)
    for h in hooks:
        h.remove()
    return seen


def test_the_field_parses_is_on_in_every_preset_and_in_the_model_fields():
    assert tg.parse_args([]).inject_after_attn is True
    assert all(tg.parse_args(["--preset", name]).inject_after_attn is True for name in tg.PRESETS)
    assert tg.parse_args(["--inject_after_attn", "false"]).inject_after_attn is False
    assert tg.parse_args(["--inject_after_attn", "false", "--inject_after_attn"]).inject_after_attn is True
    args = tg.parse_args([*RECORD_FLAGS, *SITE_FLAGS, "--inject_after_attn", "true"])
    assert args.inject_after_attn is True and tg.ModelConfig.from_args(args).inject_after_attn is True
    assert "after its attention" in tg.field_help()["inject_after_attn"]
    # a model field: a checkpoint of the other order is a different model
    assert "inject_after_attn" in tg.MODEL_FIELDS


@pytest.mark.parametrize("config", [dict(TINY_RECORD, inject_after_attn=False), BEFORE],
                         ids=["tiny_record", "anvil2_layout"])
def test_off_the_model_computes_what_it_did_before_bit_for_bit(config, monkeypatch):
    """The loss and every gradient with the field off equal those of Block.forward as it was (old_block_forward),
    bit for bit, on the record's tiny model and on ANVIL2's whole layout (tests/test_golden.py pinned its losses at
    ba25215 until wt80, and they reproduced to the end: now it pins the record's order)."""
    model = model_of(config, randomize=True)
    assert not any(getattr(b, "inject_after_attn", False) for b in model.blocks)
    now = loss_and_grads(model)
    monkeypatch.setattr(tg.Block, "forward", old_block_forward)
    before = loss_and_grads(model)
    assert now[0].item() == before[0].item() and now[1].keys() == before[1].keys()
    for name in now[1]:
        torch.testing.assert_close(now[1][name], before[1][name], rtol=0, atol=0, msg=name)


def test_on_each_attention_reads_the_residual_before_its_blocks_injections_and_the_mlp_reads_them():
    """ANVIL2's layout with the field: every block with attention of its own input (0, 1, 2, 3, 5) attends over
    norm(resid x), x0 and the n-gram term left out; its output is mlp_resid h + mlp_out MLP(norm h), h = resid x +
    attn_out y + x0_w x0 + bigram, exactly. Blocks 0, 1, 2 and 5 take an injection, so the old order's attention input
    differs there (the check can fail)."""
    model = model_of(AFTER, randomize=True)
    seen = recorded(model)
    differs = []
    for i in (0, 1, 2, 3, 5):
        x, x0, _, w, attn_in, *_ = seen[i]["args"]
        assert attn_in is None and model.blocks[i].inject_after_attn, i
        scaled = x if w.resid is None else w.resid * x
        torch.testing.assert_close(seen[i]["attn_in"], tg.norm(scaled), rtol=0, atol=0, msg=str(i))
        injected = tg.residual_in(x, x0, w) + (0 if w.bigram is None else w.bigram)
        differs.append(not torch.equal(seen[i]["attn_in"], tg.norm(injected)))
        h = scaled + w.attn_out * seen[i]["attn_out"]
        h = h if w.x0 is None else h + w.x0 * x0
        h = h if w.bigram is None else h + w.bigram
        torch.testing.assert_close(seen[i]["out"], w.mlp_resid * h + w.mlp_out * model.blocks[i].mlp(tg.norm(h)),
                                   rtol=0, atol=0, msg=str(i))
    assert differs == [True, True, True, False, True]  # 3: no x0 and no n-gram term (no_x0_blocks, no_ngram_blocks)


def test_on_block_0s_ngram_term_enters_before_it_and_its_x0_after():
    """ANVIL2: `x = x0.clone()`, x += x0_bigram * bigram_gates[0] before the loop, then layer 0's attention reads it and
    x0 * x0_gates[0] joins after. Block 0 receives x0 + its weighted n-gram term (the one the field off gives it, the
    same bits) and no n-gram term of its own; the x0 it receives reaches its output but not its attention."""
    off, on = model_of(BEFORE, randomize=True), model_of(AFTER, randomize=True)
    assert all(torch.equal(a, b) for a, b in zip(off.state_dict().values(), on.state_dict().values()))
    w_off = recorded(off)[0]["args"][3]
    x, x0, _, w, *_ = recorded(on)[0]["args"]
    assert w.bigram is None and w_off.bigram is not None and w.x0 is not None
    torch.testing.assert_close(x, x0 + w_off.bigram, rtol=0, atol=0)
    noise = {0: torch.randn(128, FULL["model_dim"], generator=torch.Generator().manual_seed(4))}
    clean, noisy = recorded(on)[0], recorded(on, noise)[0]
    assert torch.equal(noisy["attn_in"], clean["attn_in"]) and not torch.equal(noisy["out"], clean["out"])


@pytest.mark.parametrize("block", [1, 5])
def test_the_x0_a_block_receives_moves_its_attention_input_only_with_the_field_off(block):
    """The x0 that one block receives perturbed: off, its attention input moves; on, its attention input and output
    are the same bits and only what follows the attention (the MLP, the block's output) moves."""
    noise = {block: torch.randn(128, FULL["model_dim"], generator=torch.Generator().manual_seed(6))}
    for config, attention_moves in ((BEFORE, True), (AFTER, False)):
        model = model_of(config, randomize=True)
        clean, noisy = recorded(model)[block], recorded(model, noise)[block]
        assert (not torch.equal(noisy["attn_in"], clean["attn_in"])) == attention_moves, config
        assert (not torch.equal(noisy["attn_out"], clean["attn_out"])) == attention_moves, config
        assert not torch.equal(noisy["out"], clean["out"])


def test_on_it_composes_with_blocks_without_attention_the_removed_block_and_the_shared_attention_input():
    """ANVIL2's layout with the field: the attention-less blocks 4, 6, 9 and the removed block 7 compute what they did
    (their injections before the MLP, the old formula exactly; 7: mlp_resid (resid x + x0_w x0)), and still take
    their x0; the blocks after backout_layer 7 (8, 10) attend over the shared input attn_in, whatever the order. The
    field changes the model (the loss) and adds no parameter."""
    model = model_of(AFTER, randomize=True)
    assert [i for i, b in enumerate(model.blocks) if getattr(b, "inject_after_attn", False)] == [0, 1, 2, 3, 5, 8, 10]
    seen = recorded(model)
    for i in (4, 6, 9):
        x, x0, _, w, *_ = seen[i]["args"]
        torch.testing.assert_close(seen[i]["out"], old_block_forward(model.blocks[i], *seen[i]["args"]),
                                   rtol=0, atol=0, msg=str(i))
    x, x0, w = seen[7]["args"]
    assert isinstance(model.blocks[7], tg.SkippedBlock)
    torch.testing.assert_close(seen[7]["out"], w.mlp_resid * tg.residual_in(x, x0, w), rtol=0, atol=0)
    for i in (8, 10):
        attn_in = seen[i]["args"][4]
        assert attn_in is not None and torch.equal(seen[i]["attn_in"], attn_in), i
    noise = lambda i: {i: torch.randn(128, FULL["model_dim"], generator=torch.Generator().manual_seed(8))}
    for i in (4, 7):  # x0 still reaches an attention-less and the removed block
        assert not torch.equal(recorded(model, noise(i))[i]["out"], seen[i]["out"]), i
    off = model_of(BEFORE, randomize=True)
    assert sum(p.numel() for p in off.parameters()) == sum(p.numel() for p in model.parameters())
    x, y, cu = batch()
    with torch.no_grad():
        assert model(x, y, cu, 128, W3).item() != off(x, y, cu, 128, W3).item()


def test_a_tiny_run_with_the_field_learns_and_logs_it(tiny_args):
    run = tg.train(tiny_args(**{**AFTER, **FAST, "num_iterations": 16, "val_every": 8}))
    assert len(run.train_losses) == 16 and all(torch.isfinite(torch.tensor(run.train_losses)))
    val = [v for _, v in run.val_losses]
    assert val[-1] < val[0] - 0.3
    assert "inject_after_attn: True\n" in open(run.log_path).read()


@pytest.mark.slow
def test_the_model_with_the_field_compiles_whole_and_computes_the_same():
    """torch.compile(fullgraph=True) takes the new order (no graph break); AOT's eager backend, so the same arithmetic
    as the eager model, gradients included."""
    model = model_of(AFTER, randomize=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    x, y, cu = batch()
    results = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        loss = fn(x, y, cu, 128, W3)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)
