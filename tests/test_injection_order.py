"""The order of a block's injections: its gated x0 and n-gram terms join the residual after its attention, before its
MLP, as in ANVIL2 (the public record #92) and the public line since record #73 (PR 230). ANVIL2's train_gpt.py (printed
at the start of records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-*.txt, @fd1b14a5) starts the stream as x0
plus layer 0's bigram term ("pre-layer-0 bigram injection", ~140k characters in), and in each attention layer adds
`_xa = _rf_smul(resid_lambdas_attn[i], x) + attn_out`, then `x0 * x0_gates[i]` and the bigram (~148k), so the
attention reads the residual without them. A block without attention, and the removed block 7, take them before their
MLP; the blocks after backout_layer read the shared attention input (attn_in). The only order since the field
inject_after_attn was deleted (9851fef); a checkpoint of the old one (the field false) is refused."""
import dataclasses
from collections import defaultdict

import pytest
import torch

import train_gpt as tg
from test_injection_sites import FULL, model_of
from test_parallel_mlp import W3
from test_skip_layers import batch


def recorded(model: tg.GPT, x0_noise: dict | None = None, ngram_noise: dict | None = None) -> dict:
    """One forward: each block's arguments and output, and its attention's input and output, by block; with
    x0_noise {block: tensor}, the x0 that block receives is perturbed (only there); with ngram_noise, its weighted
    n-gram term (BlockWeights.bigram)."""
    seen, hooks = {}, []
    for i, block in enumerate(model.blocks):
        if x0_noise and i in x0_noise:
            hooks.append(block.register_forward_pre_hook(
                lambda m, args, n=x0_noise[i]: (args[0], args[1] + n.to(args[1].dtype), *args[2:])))
        if ngram_noise and i in ngram_noise:
            hooks.append(block.register_forward_pre_hook(
                lambda m, args, n=ngram_noise[i]: (*args[:3], args[3]._replace(bigram=args[3].bigram + n), *args[4:])))
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


def noise(seed: int) -> torch.Tensor:
    return torch.randn(128, FULL["model_dim"], generator=torch.Generator().manual_seed(seed))


def test_the_field_is_gone_and_a_checkpoint_of_the_old_order_is_refused(tiny_args, tmp_path):
    """No inject_after_attn: not a field, not a flag, not a model field. A checkpoint that stored it false (x0 and the
    n-gram term before the attention, the same weights) is refused naming it."""
    assert "inject_after_attn" not in {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    assert "inject_after_attn" not in tg.MODEL_FIELDS
    with pytest.raises(SystemExit):
        tg.parse_args(["--inject_after_attn", "true"])
    args = tiny_args(**FULL)
    folder = tmp_path / "step_000002"
    folder.mkdir()
    stored = dataclasses.asdict(args)
    torch.save(dict(model={}, step=2, args={**stored, "inject_after_attn": False}, world_size=1,
                    code_hash=tg.code_hash(), training_time_ms=1.0, format=tg.CHECKPOINT_FORMAT), folder / "model.pt")
    with pytest.raises(ValueError, match=r"different model: inject_after_attn: checkpoint False \(x0 and the n-gram "
                                         r"term before a block's attention\), now always after it"):
        tg.load_checkpoint(folder, None, [], args, 0, 1, print)


def test_each_attention_reads_the_residual_before_its_blocks_injections_and_the_mlp_reads_them():
    """ANVIL2's layout: every block with attention of its own input (0, 1, 2, 3, 5) attends over norm(resid x), x0 and
    the n-gram term left out; its output is mlp_resid h + mlp_out MLP(norm h), h = resid x + attn_out y + x0_w x0 +
    bigram, exactly. Blocks 0, 1, 2 and 5 take an injection, so the old order's attention input differs there (the
    check can fail)."""
    model = model_of(FULL, randomize=True)
    seen = recorded(model)
    differs = []
    for i in (0, 1, 2, 3, 5):
        x, x0, _, w, attn_in, *_ = seen[i]["args"]
        assert attn_in is None, i
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


def test_block_0s_ngram_term_enters_before_it_and_its_x0_after():
    """ANVIL2: `x = x0.clone()`, x += x0_bigram * bigram_gates[0] before the loop, then layer 0's attention reads it and
    x0 * x0_gates[0] joins after. Block 0 receives x0 + its gated n-gram term (from the model's own embeddings and
    first gate MLP), exactly, and no n-gram term of its own; the x0 it receives reaches its output but not its
    attention."""
    model = model_of(FULL, randomize=True)
    x, x0, _, w, *_ = recorded(model)[0]["args"]
    assert w.bigram is None and w.x0 is not None
    inputs, _, cu = batch()
    g = defaultdict(lambda: [None] * len(model.blocks))
    with torch.no_grad():
        x0_now, _, bigram, _ = model.embeddings(inputs, cu)
        model.gates(x0_now, 0, g)
    term = g["bigram"][0] * bigram
    assert torch.equal(x0, x0_now) and term.abs().max() > 0
    torch.testing.assert_close(x, x0 + term, rtol=0, atol=0)
    clean, noisy = recorded(model)[0], recorded(model, {0: noise(4)})[0]
    assert torch.equal(noisy["attn_in"], clean["attn_in"]) and not torch.equal(noisy["out"], clean["out"])


@pytest.mark.parametrize("block", [1, 5])
def test_the_x0_and_ngram_terms_a_block_receives_move_what_follows_its_attention_only(block):
    """The x0 that one block receives, or its weighted n-gram term, perturbed: its attention input and output are the
    same bits, and its output (the MLP's input and the residual) moves. In the old order both moved the attention."""
    model = model_of(FULL, randomize=True)
    clean = recorded(model)[block]
    for noisy in (recorded(model, x0_noise={block: noise(6)})[block],
                  recorded(model, ngram_noise={block: noise(9)})[block]):
        assert torch.equal(noisy["attn_in"], clean["attn_in"]) and torch.equal(noisy["attn_out"], clean["attn_out"])
        assert not torch.equal(noisy["out"], clean["out"])


def test_blocks_without_attention_take_their_injections_before_the_mlp_and_later_blocks_read_the_shared_input():
    """The attention-less blocks 4, 6, 9: h = resid x + x0_w x0 + bigram (what each of them has), out = mlp_resid h +
    mlp_out MLP(norm h), exactly; the removed block 7: mlp_resid (resid x + x0_w x0); x0 still reaches 4 and 7. The
    blocks after backout_layer 7 (8, 10) attend over the shared input attn_in."""
    model = model_of(FULL, randomize=True)
    seen = recorded(model)
    for i in (4, 6, 9):
        x, x0, _, w, *_ = seen[i]["args"]
        assert model.blocks[i].attn is None and model.blocks[i].parallel_mlp is None, i
        h = tg.residual_in(x, x0, w)
        h = h if w.bigram is None else h + w.bigram
        torch.testing.assert_close(seen[i]["out"], w.mlp_resid * h + w.mlp_out * model.blocks[i].mlp(tg.norm(h)),
                                   rtol=0, atol=0, msg=str(i))
    assert seen[4]["args"][3].bigram is not None and seen[9]["args"][3].bigram is not None  # n-gram sites 4 and 9
    x, x0, w = seen[7]["args"]
    assert isinstance(model.blocks[7], tg.SkippedBlock)
    torch.testing.assert_close(seen[7]["out"], w.mlp_resid * tg.residual_in(x, x0, w), rtol=0, atol=0)
    for i in (8, 10):
        attn_in = seen[i]["args"][4]
        assert attn_in is not None and torch.equal(seen[i]["attn_in"], attn_in), i
    for i in (4, 7):  # x0 still reaches an attention-less and the removed block
        assert not torch.equal(recorded(model, {i: noise(8)})[i]["out"], seen[i]["out"]), i
