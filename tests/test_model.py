"""The model: shapes, initial loss, causality and document isolation, configuration errors."""
import math

import pytest
import torch

import train_gpt as tg
from conftest import BOS, TINY

W3, W1 = tg.window_tokens(3, TINY["window_block"]), tg.window_tokens(1, TINY["window_block"])  # (48, 16), (16, 0)


def tiny_model(randomize=False, **overrides):
    args = tg.Hyperparameters(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args))
    if randomize:  # zero-initialised weights would hide paths: give every weight signal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p.float()).to(p.dtype))
    return model


def batch(T=128, doc_starts=(0, 60)):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, BOS, (T,), generator=g, dtype=torch.int32)
    y = torch.randint(0, BOS, (T,), generator=g, dtype=torch.int32)
    x[list(doc_starts)] = BOS
    cu = torch.tensor([*doc_starts, T, T, T], dtype=torch.int32)  # padded with empty sequences
    return x, y, cu


def test_fresh_model_predicts_uniformly_so_its_loss_is_log_vocab():
    model = tiny_model()
    x, y, cu = batch()
    loss = model(x, y, cu, 128, W3)
    assert loss.shape == () and loss.dtype == torch.float32
    assert math.isclose(loss.item() / 128, math.log(TINY["vocab_size"]), rel_tol=1e-4)
    per_token = model(x, y, cu, 128, W3, reduction="none")
    assert per_token.shape == (128,)
    assert torch.allclose(per_token.sum(), loss)


def test_loss_at_a_position_depends_only_on_earlier_tokens_of_its_document():
    model = tiny_model(randomize=True)
    x, y, cu = batch(doc_starts=(0, 60))
    base = model(x, y, cu, 128, W3, reduction="none")
    for j in (10, 59, 70, 127):
        x2 = x.clone()
        x2[j] = (x2[j] + 1) % BOS
        delta = (model(x2, y, cu, 128, W3, reduction="none") - base).abs()
        doc_end = 60 if j < 60 else 128
        assert delta[:j].max() == 0, "no position sees a later token"
        assert delta[doc_end:].max() == 0 if doc_end < 128 else True, "nothing crosses a document boundary"
        assert delta[j] > 0, "a token does influence its own prediction"


def test_window_limits_how_far_back_attention_reaches():
    # one document, all blocks long-window; window (ws=1) * 16 = 16 tokens back. Blocks stack, so
    # with 3 attention layers a token can influence positions up to 3 * 16 ahead, no further.
    model = tiny_model(randomize=True, window_pattern="LLLL")
    x, y, cu = batch(doc_starts=(0,))
    base = model(x, y, cu, 128, W1, reduction="none")
    x2 = x.clone()
    x2[10] = (x2[10] + 1) % BOS
    delta = (model(x2, y, cu, 128, W1, reduction="none") - base).abs()
    assert delta[10 + 3 * 16 + 1:].max() == 0
    assert delta[10 + 16] > 0


def test_value_embeddings_and_window_pattern_follow_the_record_layout():
    args = tg.Hyperparameters()
    cfg = tg.ModelConfig.from_args(args)
    with torch.device("meta"):
        model = tg.GPT(cfg)
    assert model.value_embed_layers() == [0, 1, 2, None, None, None, None, None, None, 0, 1, 2]
    assert model.block_windows((384, 128)) == [384, 128, 128, 128, 384, 128, 128, 384, 128, 128, 128, 384]
    assert model.blocks[7].attn is None and all(b.attn is not None for i, b in enumerate(model.blocks) if i != 7)
    assert model.embed.weight.dtype == torch.bfloat16 and model.lm_head_w.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 270e6 < n_params < 280e6  # ~124M in blocks + head, plus 4 embedding tables of 38.6M


@pytest.mark.parametrize("field,value,needle", [
    ("window_pattern", "LSL", "one L or S per layer"),
    ("batch_size", 1000, "multiple of seq_len"),
    ("bos_id", 99, "must be < vocab_size"),
    ("attention", "magic", "choose one of auto, fa3, fa4, varlen, reference"),
    ("logit_softcap", 90.0, "too large"),
])
def test_bad_hyperparameters_are_refused_with_a_reason(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        tg.Hyperparameters(**{**TINY, field: value})


def test_command_line_overrides_every_kind_of_field():
    args = tg.parse_args(["--num_iterations", "100", "--compile", "false", "--window_schedule", "1,2",
                          "--muon_lr", "0.1", "--window_pattern", "LSSSLSSLSSSL", "--run_id", "abc"])
    assert (args.num_iterations, args.compile, args.window_schedule, args.muon_lr, args.run_id) == \
        (100, False, (1, 2), 0.1, "abc")
    assert tg.parse_args([]) == tg.Hyperparameters()


def test_attention_backend_choice_on_cpu_is_the_reference_and_others_are_refused():
    cpu = torch.device("cpu")
    assert tg.select_attention("auto", cpu) == "reference"
    with pytest.raises(ValueError, match="not available"):
        tg.select_attention("fa3", cpu)


def test_evaluation_in_head_slices_gives_the_same_losses_as_one_pass(monkeypatch):
    model = tiny_model(randomize=True)
    x, y, cu = batch()
    with torch.no_grad():
        whole = model.train()(x, y, cu, 128, W3, reduction="none")  # training mode: never sliced
        monkeypatch.setattr(tg.GPT, "eval_slice", 48)  # 128 positions: slices of 48, 48 and 32
        sliced = model.eval()(x, y, cu, 128, W3, reduction="none")
    assert sliced.shape == (128,)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=0)


def test_mlp_matrices_share_one_shape_so_muon_scales_them_alike():
    """The 2025-09-03 record stores both MLP matrices (dim, 4 dim): Muon's max(1, rows/cols)^0.5
    is then 1 for both, where storing the input matrix (4 dim, dim) doubled its learning rate."""
    model = tiny_model()
    mlp = model.blocks[0].mlp
    assert mlp.fc_w.shape == mlp.proj_w.shape == (TINY["model_dim"], 4 * TINY["model_dim"])
    muon = tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[1]
    assert {tuple(g["params"][0].shape) for g in muon.param_groups} == {(4, 64, 64), (64, 256), (2, 8)}
