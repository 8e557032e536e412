"""The model: shapes, initial loss, causality and document isolation, configuration errors."""
import dataclasses
import math

import pytest
import torch

import train_gpt as tg
from conftest import BOS, CASE_FOLDING_VOCAB, TINY, compiled_matches_eager

W3, W1 = tg.window_tokens(3, TINY["window_block"]), tg.window_tokens(1, TINY["window_block"])  # (48, 16), (16, 0)


def tiny_model(randomize=False, kernels=tg.ModelKernels(), **overrides):
    """TINY's record model (every technique on), PyTorch's kernels unless told."""
    args = tg.Hyperparameters(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args), kernels)
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
    """An untied model's head starts at zero: uniform over the vocabulary; with CPLM, the head's softmax gives the
    copy column (64, no token) its 1/72, which the mixture hands back to the tokens through the pointer."""
    model = tiny_model(tied_embed_stages=0, cplm_bands=())
    x, y, cu = batch()
    loss = model(x, y, cu, 128, W3)
    assert loss.shape == () and loss.dtype == torch.float32
    assert math.isclose(loss.item() / 128, math.log(TINY["vocab_size"]), rel_tol=1e-4)
    per_token = model(x, y, cu, 128, W3, reduction="none")
    assert per_token.shape == (128,)
    assert torch.allclose(per_token.sum(), loss)
    # with CPLM: -log(p_lm (1 - alpha (1 - a_sink)) / (1 - alpha) + alpha p_copy), p_lm = alpha = 1/72
    model = tiny_model(tied_embed_stages=0)
    with torch.no_grad():
        p_copy, a_sink = model.copy_pointer(model.hidden(x, cu, 128, W3), x, y, cu)
        per_token = model(x, y, cu, 128, W3, reduction="none")
    alpha, V = 1 / TINY["vocab_size"], TINY["vocab_size"]
    torch.testing.assert_close(per_token, -torch.log(alpha * (1 - alpha * (1 - a_sink)) / (1 - alpha) + alpha * p_copy),
                               rtol=1e-5, atol=1e-5)
    assert abs(per_token.mean().item() - math.log(V - 1)) < 0.02 and (p_copy > 0).any()
    tied = tiny_model()  # the record's: tied, the head drawn N(0, 0.005): near uniform
    assert abs(tied(x, y, cu, 128, W3).item() / 128 - per_token.mean().item()) < 0.01


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])  # CPLM's bands: 16 in training, 32 after
def test_loss_at_a_position_depends_only_on_earlier_tokens_of_its_document(training):
    model = tiny_model(randomize=True).train(training)
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


def test_the_number_of_empty_sequences_in_cu_seqlens_changes_no_loss_and_no_gradient():
    """cu_seqlens' length (max_num_docs, sized from the data by doc_slots) is a shape only: the smear, bigram,
    key offset, paired heads, DC attention and CPLM's pointer read the same documents from any padding."""
    model = tiny_model(randomize=True)
    x, y, cu = batch(doc_starts=(0, 37, 60, 101))
    results = []
    for empty in (0, 1, 12):  # exactly the documents, one empty sequence, twelve
        model.zero_grad(set_to_none=True)
        loss = model(x, y, torch.cat([cu[:5], torch.full((empty,), 128, dtype=torch.int32)]), 128, W3)
        loss.backward()
        model.flush_table_grads()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert grads.keys() == results[0][1].keys() and all(torch.equal(grads[n], results[0][1][n]) for n in grads)


def test_window_limits_how_far_back_attention_reaches():
    # one document, all blocks long-window (so no paired heads); window (ws=1) * 16 = 16 tokens back. Blocks stack:
    # the smear and the bigram carry token 10 to position 11, and each of the 3 attention blocks reaches 16 positions
    # further, plus one for its keys' offset (the long-window blocks' partial key offset), so up to 11 + 3 * 17 = 62,
    # no further. DC attention (its own window of DC_WINDOW tokens, in the last block) is off: its gate's w2 at zero;
    # CPLM's pointer (its own bands) is off. Block 1's change at its edge, ~1e-4 against a residual of ~5, is rounded
    # away in bf16 when x0 and the bigram join after its attention, and the reach ends at 61 (the old order, x0 and
    # the bigram before the attention, reached 62 here: the edge is rounding's, the bound is the windows'). The copy
    # feature (doc_copy) is off too: it brings an earlier token of the document from any distance
    edge = 11 + 3 * 17 - 1
    model = tiny_model(randomize=True, window_pattern="LLLL", paired_head_blocks=(), cplm_bands=(), doc_copy=False)
    with torch.no_grad():
        start = model.gate_width + sum(n for what, _, n, _ in model.gate_parts[1][:-1])
        assert model.gate_parts[1][-1][0] == "dc2"
        model.mudd_gate_w2[start: start + 2].zero_(), model.mudd_gate_b2[start: start + 2].zero_()
    x, y, cu = batch(doc_starts=(0,))
    with torch.no_grad():
        base = model(x, y, cu, 128, W1, reduction="none")
        x2 = x.clone()
        x2[10] = (x2[10] + 1) % BOS
        delta = (model(x2, y, cu, 128, W1, reduction="none") - base).abs()
    assert delta[11 + 3 * 17 + 1:].max() == 0
    assert delta[edge] > 0 and delta[edge + 1:].max() == 0
    assert delta[10 + 3 * 16 + 1:].max() > 0  # the key offsets do reach further


def test_value_embeddings_and_window_pattern_follow_the_record_layout():
    args = tg.Hyperparameters()
    cfg = tg.ModelConfig.from_args(args)
    with torch.device("meta"):
        model = tg.GPT(cfg)
    # ANVIL2's layout (record #92): value tables in 1, 2, 8, 10; no attention in 4, 6, 9 and the removed block 7
    assert model.value_embed_layers() == [None, 0, 1, None, None, None, None, None, 2, None, 3]
    assert model.block_windows((384, 128)) == [128, 128, 128, 384, 128, 128, 128, 128, 128, 128, 384]
    assert [i for i, b in enumerate(model.blocks) if b.attn is None] == [4, 6, 7, 9]
    assert model.embed.weight.dtype == torch.bfloat16 and model.lm_head_w.dtype == torch.float32
    # the n-gram table: 377,280 bigram rows, then the trigram channel's 20,773,440 (whole here: one GPU)
    assert model.bigram_embed.weight.shape == (377_280 + 20_773_440, 768) and model.bigram_signs.shape == (8192, 768)
    n_params = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.blocks.parameters())
    # 11 MLPs of 768 x 2816 (10 blocks' and block 8's second) and 7 attention sublayers: 47.6M + 16.5M
    # 7 attention blocks in 768 x 768 units: 3 and 10 wide (4 each), 0, 2 and 5 with Q and K half wide (3 each), 1 and
    # 8 with V and O too (2 each): 21; and the value-embedding gates of 1, 2, 8
    assert blocks == 11 * 2 * 768 * 2816 + 21 * 768 * 768 + 3 * 6 * 12
    # ~60M in blocks, 6 tables of 38.6M (token embedding, LM head, 4 value tables), the bigram rows' 290M; and the
    # trigram rows' 16.0G
    assert 580e6 < n_params - 20_773_440 * 768 < 584e6


@pytest.mark.parametrize("field,value,needle", [
    ("window_pattern", "LSL", "one L or S per layer"),
    ("batch_size", 1000, "multiple of seq_len"),
    ("bos_id", 99, "the copy column bos_id \\+ 1 = 100 below vocab_size=72"),
    ("attention", "magic", "choose one of auto, fa3, fa4, varlen, reference"),
    ("logit_softcap", 90.0, "too large"),
    ("softcap_shift", float("inf"), "finite"),
    ("bigram_rows", 1, "at least 2"),
    ("bigram_rows", 0, "at least 2"),  # no longer a switch: the MUDD gates weigh it per block
    ("bigram_sign_rows", -1, "0 \\(no signs\\) or a positive count"),
    ("backout_layer", 3, "backout_layer=3: a block below the last \\(3\\)"),
    ("backout_layer", -1, "a block below the last"),  # no longer "off"
    ("paired_head_blocks", (0,), "paired_head_blocks=\\(0,\\): distinct blocks with attention and a short window"),
    ("paired_head_blocks", (2,), "a short window"),  # block 2 of TINY has no attention
    ("paired_head_blocks", (1, 1), "distinct blocks"),
    ("paired_head_blocks", (4,), "distinct blocks"),
    ("tied_embed_stages", 4, "tied_embed_stages=4: 0 \\(untied\\) up to the number of stages \\(3"),
    ("value_embed_blocks", (), "value_embed_blocks=\\(\\): one or more distinct blocks with attention"),
    ("window_pattern", "SSLL", "the MUDD gates need a long-window block \\(L\\) before the last two"),
    ("xsa_blocks", (2,), "xsa_blocks=\\(2,\\): blocks with attention"),  # block 2 of TINY has no attention
    ("xsa_blocks", (4,), "xsa_blocks=\\(4,\\): blocks with attention"),
    ("paired_head_blocks", (3,), "distinct blocks with attention and a short window"),
    ("no_attn_layers", (3,), "value_embed_blocks=\\(1, 3\\): one or more distinct blocks with attention"),
])
def test_bad_hyperparameters_are_refused_with_a_reason(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        tg.Hyperparameters(**{**TINY, field: value})


def test_refusals_that_need_more_than_one_field():
    with pytest.raises(ValueError, match="bos_id=99 must be < vocab_size=72"):  # without CPLM's check before it
        tg.Hyperparameters(**{**TINY, "bos_id": 99, "cplm_bands": ()})
    # DC attention needs attention without paired heads in the last block
    for bad in (dict(no_attn_layers=(2, 3), value_embed_blocks=(1,)),
                dict(window_pattern="LSSS", paired_head_blocks=(3,))):
        with pytest.raises(ValueError, match="DC attention runs in the last block"):
            tg.Hyperparameters(**{**TINY, **bad})


def test_the_switches_of_the_deleted_0903_model_are_no_fields():
    """One model: the techniques these turned off are always on; an old command line that sets one is refused."""
    fields = {f.name for cls in (tg.Hyperparameters, tg.ModelConfig) for f in dataclasses.fields(cls)}
    for field in ("num_value_embeds", "yarn", "smear", "ve_gate", "key_offset", "mudd", "mudd_gates", "dc",
                  "parallel_attn", "uniform_out_init", "sublayer_lambdas", "orthogonalizer", "ns_steps"):
        assert field not in fields, field
        with pytest.raises(SystemExit):
            tg.parse_args([f"--{field}", "1"])


def test_command_line_overrides_every_kind_of_field():
    args = tg.parse_args(["--preset", "single", "--num_iterations", "100", "--compile", "false",
                          "--window_schedule", "1,2", "--muon_lr", "0.1", "--window_pattern", "SLSSSSSSSSL",
                          "--narrow_qk_blocks", "0,2,5,8", "--narrow_v_blocks", "8",
                          "--run_id", "abc", "--lr_schedule", "1,1.5", "--xsa_blocks", "1,3"])
    assert (args.num_iterations, args.compile, args.stages, args.muon_lr, args.run_id) == \
        (100, False, (tg.Stage(1, lr=1.0), tg.Stage(2, lr=1.5)), 0.1, "abc")  # a new length: new rows
    assert (args.window_pattern, args.xsa_blocks, args.seq_len, args.preset) == ("SLSSSSSSSSL", (1, 3), 12288, "single")
    assert (args.narrow_qk_blocks, args.narrow_v_blocks) == ((0, 2, 5, 8), (8,))
    table = tg.parse_args(["--stages", "window=3,batch=131072,doc_len=896,mtp=0.5/0.25;window=7,lr=1.52,mtp=0/0,share=2"])
    assert table.stages == (tg.Stage(3, batch=131072, doc_len=896, mtp=(0.5, 0.25)), tg.Stage(7, lr=1.52, mtp=(0, 0), share=2))
    assert tg.parse_args(["--stages", tg.format_stages(table.stages)]).stages == table.stages  # the text round-trips
    assert tg.parse_args(["--preset", "medium"]) == tg.Hyperparameters(preset="medium", **tg.PRESETS["medium"][1])
    assert tg.parse_args([]) == tg.Hyperparameters()  # no preset: the record, the dataclass defaults
    with pytest.raises(SystemExit):  # the 2025-09-03 record's preset is gone
        tg.parse_args(["--preset", "record-0903"])


def test_attention_backend_choice_on_cpu_is_the_reference_and_others_are_refused():
    cpu = torch.device("cpu")
    assert tg.kernels.select_attention("auto", cpu) == "reference"
    with pytest.raises(ValueError, match="not available"):
        tg.kernels.select_attention("fa3", cpu)
    kernels = tg.choose_kernels(cpu, log=lambda msg: None)  # the whole model's, chosen once
    assert (kernels.attention, kernels.fp8_head, kernels.fused_ce, kernels.fp8_mlp) == \
        ("reference", False, False, False)
    model = tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters(**TINY)), kernels)
    assert model.kernels is kernels and all(b.attn.attn_fn is tg.attention_reference for b in model.blocks if b.attn)
    assert all(b.mlp.fused == kernels.fused_mlp and not b.mlp.fp8 for b in model.blocks)


def test_evaluation_in_head_slices_gives_the_same_losses_as_one_pass(monkeypatch):
    model = tiny_model(randomize=True)
    x, y, cu = batch()
    model.eval()  # (CPLM's pointer has another band in training)
    with torch.no_grad():
        whole = model(x, y, cu, 128, W3, reduction="none")  # 128 positions: one slice of eval_slice
        monkeypatch.setattr(tg.GPT, "eval_slice", 48)  # slices of 48, 48 and 32
        sliced = model(x, y, cu, 128, W3, reduction="none")
    assert sliced.shape == (128,)
    torch.testing.assert_close(sliced, whole, rtol=0, atol=0)


def test_mlp_matrices_share_one_shape_so_muon_scales_them_alike():
    """The 2025-09-03 record stores both MLP matrices (dim, 4 dim): Muon's max(1, rows/cols)^0.5
    is then 1 for both, where storing the input matrix (4 dim, dim) doubled its learning rate."""
    model = tiny_model()
    mlp = model.blocks[0].mlp
    assert mlp.fc_w.shape == mlp.proj_w.shape == (TINY["model_dim"], 4 * TINY["model_dim"])
    muon = tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[1]
    # (and the smear gate's (1, gate_channels), block 1's value-embedding gate's (heads, gate_channels))
    assert {tuple(g["params"][0].shape) for g in muon.param_groups} == {(4, 64, 64), (64, 256), (1, 8), (2, 8)}


def test_mlp_hidden_sets_the_width_exactly_and_its_0_keeps_mlp_ratio_x_model_dim():
    """--mlp_hidden (ANVIL2's 2816 at model_dim 768, 08/30/26) at TINY's size: 176 = 2.75 x 64 (11 x 16, as 2816 is
    11 x 256), over any mlp_ratio. Every block's two matrices have that width, initialized as at 4x (W_fc uniform at
    fan-in model_dim, W_proj zero), one shape in Muon at the MLP's two rates (its shape scale 1), and a Muon step
    keeps NorMuon's statistic per hidden unit. 0 is mlp_ratio x model_dim, as before the field."""
    assert tiny_model().cfg.mlp_hidden == 256 and tiny_model(mlp_ratio=3).blocks[3].mlp.proj_w.shape == (64, 192)
    args = tg.Hyperparameters(**{**TINY, "mlp_hidden": 176, "mlp_ratio": 3})
    model = tiny_model(mlp_hidden=176, mlp_ratio=3)
    bound = math.sqrt(3) * 0.5 / math.sqrt(TINY["model_dim"])
    for block in model.blocks:
        assert block.mlp.fc_w.shape == block.mlp.proj_w.shape == (64, 176)
        assert bound * 0.98 < block.mlp.fc_w.abs().max() <= bound and not block.mlp.proj_w.any()
    adam, muon = tg.build_optimizers(model, args, 0, 1)
    mlp = [(len(g["params"]), g["lr_mult"]) for g in muon.param_groups if g["params"][0].shape == (64, 176)]
    assert sorted(mlp) == [(4, 2.0), (4, 4.0)]  # mlp_muon_lr_mults: W_fc x 2, W_proj x 4, in four blocks each
    assert not any(g["params"][0].shape == (64, 256) for g in muon.param_groups)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = model.blocks[0].mlp.proj_w.detach().clone()
    muon.step()
    assert muon.state[model.blocks[0].mlp.proj_w]["neuron_second_moment"].shape == (1, 176)
    assert not torch.equal(model.blocks[0].mlp.proj_w, before)
    for bad in (dict(mlp_hidden=-1), dict(mlp_ratio=0)):
        with pytest.raises(ValueError, match="the MLP's hidden width is mlp_hidden, or where that is 0 mlp_ratio"):
            tg.Hyperparameters(**{**TINY, **bad})


# -- techniques of records after 2025-09-03 (issue 12): bigram hash embedding, backout, asymmetric softcap

def test_bigram_rows_are_the_records_xor_hash_in_range_with_document_starts_on_the_reserved_row():
    rows, sign_rows, T = 377_280, 8192, 1000
    x = torch.randint(0, 50304, (T,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    starts = [0, 17, 18, 500, 999]  # a one-token document at 17
    cu = torch.tensor([*starts, T, T, T], dtype=torch.int32)
    row, sign = tg.bigram_indices(x, cu, rows, sign_rows)
    assert row.shape == sign.shape == (T,) and row.dtype == sign.dtype == torch.int64
    again = tg.bigram_indices(x.clone(), cu.clone(), rows, sign_rows)
    assert torch.equal(row, again[0]) and torch.equal(sign, again[1]), "deterministic"
    t = x.tolist()
    for i in range(T):
        if i in starts:
            assert (row[i], sign[i]) == (rows - 1, 0)
        else:
            assert row[i] == ((36313 * t[i]) ^ (27191 * t[i - 1])) % (rows - 1)
            assert sign[i] == (t[i] ^ t[i - 1]) % sign_rows
    assert 0 <= row.min() and row.max() == rows - 1 and (row == rows - 1).sum() == len(starts)
    assert 0 <= sign.min() and sign.max() < sign_rows
    assert row.unique().numel() > 0.99 * T - len(starts), "~1000 random bigrams land on ~1000 rows"


def test_bigram_rows_of_a_document_do_not_depend_on_the_document_before_it():
    x, _, cu = batch(doc_starts=(0, 60))
    row, sign = tg.bigram_indices(x, cu, 1000, 16)
    for j in (58, 59):  # the last tokens of the first document
        x2 = x.clone()
        x2[j] = (x2[j] + 1) % BOS
        row2, sign2 = tg.bigram_indices(x2, cu, 1000, 16)
        changed = ((row2 != row) | (sign2 != sign)).nonzero().flatten().tolist()
        assert changed == [j, j + 1] if j + 1 < 60 else changed == [j]
    # the second document's first position takes the reserved row, whatever precedes it
    assert row[60] == 999 and sign[60] == 0


def test_the_bigram_embedding_is_its_row_times_its_sign_row_and_block_0_adds_its_gated_share():
    """embeddings(): the bigram table's row (bigram_indices) times its sign row; before block 0 it joins the residual
    times the x0 gate's per-token bigram weight: the stream block 0 receives is x0 plus it (ANVIL2's order; block 0's
    own weights carry none). The table starts at zero, so at first nothing is added."""
    model = tiny_model(randomize=True)
    x, y, cu = batch(doc_starts=(0, 60))
    seen = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a))  # block 0's x, x0, ve and BlockWeights
    with torch.no_grad():
        x0, _, bigram, _ = model.embeddings(x, cu)
        row, sign = tg.bigram_indices(x, cu, TINY["bigram_rows"], TINY["bigram_sign_rows"])
        assert torch.equal(bigram, model.bigram_embed.weight[row] * model.bigram_signs[sign])
        g = {what: [None] * 4 for what in ("xsa", "out", "x0", "bigram", "skip", "dc1", "dc2")}
        model.gates(x0, 0, g)
        base = model(x, y, cu, 128, W3, reduction="none")
        assert seen[0][3].bigram is None and torch.equal(seen[0][1], x0)
        torch.testing.assert_close(seen[0][0], x0 + g["bigram"][0] * bigram, rtol=0, atol=0)
        model.bigram_embed.weight.zero_()  # the table as it starts: the model no longer sees the bigrams
        assert not torch.equal(model(x, y, cu, 128, W3, reduction="none"), base)
        assert torch.equal(seen[-1][0], x0)
    assert tiny_model().bigram_embed.weight.abs().max() == 0


def test_backout_subtracts_its_weight_times_the_backout_blocks_output_before_the_final_norm(monkeypatch):
    model = tiny_model(randomize=True).float()  # float32: the residual stream's differences exact to rounding
    x, y, cu = batch()
    at, out = model.scalar_layout(), {}
    model.blocks[TINY["backout_layer"]].register_forward_hook(lambda m, a, o: out.__setitem__("backout", o))
    norm, inputs = tg.norm, []
    monkeypatch.setattr(tg, "norm", lambda t: inputs.append(t) or norm(t))  # hidden()'s last norm: the head's input
    finals = []
    with torch.no_grad():
        for weight in (0.0, 0.5):
            model.scalars[at["backout"]] = weight
            finals.append((model.hidden(x, cu, 128, W3), inputs[-1]))
    (h0, pre0), (h1, pre1) = finals
    torch.testing.assert_close(pre1, pre0 - 0.5 * out["backout"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1, norm(pre0 - 0.5 * out["backout"]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(h0, h1)
    assert tiny_model().scalars[at["backout"]].item() == 0.5  # the 2025-10-04 record's start


def test_new_weights_get_gradients():
    model = tiny_model(randomize=True)
    x, y, cu = batch()
    model(x, y, cu, 128, W3).backward()
    at = model.scalar_layout()
    # the bigram weights are per token (the MUDD gates' and MUDD's): none among the scalars
    assert model.bigram_embed.weight.grad.abs().sum() > 0 and "bigram" not in at
    assert model.scalars.grad[at["backout"]].abs().min() > 0
    assert model.bigram_signs.abs().eq(1).all() and model.bigram_signs.shape == (16, TINY["model_dim"])
    assert {"bigram_embed.weight", "bigram_signs", "smear_w"} <= set(model.state_dict()), "saved in checkpoints"


def test_asymmetric_softcap_stays_in_0_23_and_its_gradient_is_the_formulas():
    model = tiny_model(logit_softcap=23.0, softcap_shift=5.0)
    z = torch.linspace(-60, 60, 1201, requires_grad=True)
    capped = model.softcap(z)
    assert capped.dtype == torch.float32 and 0 < capped.min() and capped.max() < 23
    assert model.softcap(torch.tensor([-1e4, 1e4])).tolist() == [0.0, 23.0]  # saturates at the bounds only
    s = torch.sigmoid((z.detach().double() + 5) / 7.5)
    torch.testing.assert_close(capped.double(), 23 * s, rtol=1e-6, atol=1e-6)
    capped.sum().backward()
    # float32 autograd of sigmoid: its gradient s * (1 - s) loses ~1e-7 to rounding as s nears 1
    torch.testing.assert_close(z.grad.double(), 23 / 7.5 * s * (1 - s), rtol=1e-5, atol=1e-6)
    zero = model.softcap(torch.zeros(1)).item()
    assert abs(zero - 23 * torch.sigmoid(torch.tensor(5 / 7.5)).item()) < 1e-5 and 23 - zero < zero - 0
    symmetric = tiny_model(logit_softcap=30.0, softcap_shift=0.0)  # the 09/03 cap, computed as before
    assert torch.equal(symmetric.softcap(z.detach()), 30 * torch.sigmoid(z.detach() / 7.5))


@pytest.mark.parametrize("fp8,training", [(False, True), (True, True), (True, False)],
                         ids=["bf16_train", "fp8_train", "fp8_model_eval"])
def test_head_loss_with_the_asymmetric_cap_equals_the_plain_formula_forward_and_backward(fp8, training):
    """The hand-written cross-entropy (no max subtraction, target picked by a compare) on the FP8
    head (training), or on the bf16 head (the CPU's, and evaluation's), against F.cross_entropy of
    23 * sigmoid((x W^T + 5) / 7.5) in float64."""
    if fp8 and not tg.kernels.fp8_supported(torch.device("cpu")):
        pytest.skip("_scaled_mm FP8 does not run on this CPU")
    model = tiny_model(logit_softcap=23.0, softcap_shift=5.0, kernels=tg.ModelKernels(fp8_head=fp8))
    model.train(training)
    g = torch.Generator().manual_seed(0)
    T, dim, V = 256, TINY["model_dim"], TINY["vocab_size"]
    with torch.no_grad():  # |w| < 0.8 stays inside e4m3 at the head's weight scale 2^-9; logits reach ~+-15
        model.lm_head_w.copy_(0.8 * (2 * torch.rand(V, dim, generator=g) - 1))
    x = torch.nn.functional.rms_norm(torch.randn(T, dim, generator=g), (dim,)).bfloat16().requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g)
    losses = model.head_losses(x, y)
    losses.sum().backward()
    xr, wr = x.detach().double().requires_grad_(True), model.lm_head_w.detach().double().requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(23 * torch.sigmoid((xr @ wr.T + 5) / 7.5), y, reduction="none")
    ref.sum().backward()

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()
    # bf16 logits (8 bits of mantissa) or e4m3 operands and e5m2 gradients (FP8: as in test_kernels)
    tol = (0.05, 0.1) if fp8 and training else (0.01, 0.02)
    assert losses.dtype == torch.float32 and rel(losses, ref) < tol[0]
    assert rel(x.grad, xr.grad) < tol[1] and rel(model.lm_head_w.grad, wr.grad) < tol[1]


@pytest.mark.slow
def test_all_three_trace_as_one_graph_and_match_eager_in_value_and_gradient():
    """torch.compile(fullgraph=True) takes the model with every technique on (no graph break, no
    data-dependent Python branch); aot_eager keeps the check fast on the CPU."""
    model = tiny_model(randomize=True)
    x, y, cu = batch()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    for tied in (True, False):  # the compiled model follows the tied flag (a recompile, not a stale graph)
        model.tied_embed = tied
        results = []
        for fn in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = fn(x, y, cu, 128, W3)
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        (l0, g0), (l1, g1) = results
        torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)
        assert g1.keys() == g0.keys() and ("embed.weight" in g0) == (not tied)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6)


def _grads_with_and_without_table_sums(tied: bool, compile_backend: str | None, T: int = 128):
    """Two micro-batches' gradients of the float32 model: plain autograd, and the token tables summed by their
    lookups (keep_table_grads) then flushed."""
    x, y, cu = batch(T)
    x2, y2, _ = batch(T)
    x2, y2 = x2.roll(7), y2.roll(3)
    out = []
    for sums in (False, True):
        model = tiny_model(randomize=True).float()
        model.tied_embed = tied
        if sums:
            model.keep_table_grads()
            model.note_token_lookups()  # (the trainer's step does this)
        fn = model if compile_backend is None else torch.compile(model, backend=compile_backend, fullgraph=True)
        for inputs, targets in ((x, y), (x2, y2)):
            fn(inputs, targets, cu, T, W3).backward()
        if sums:
            assert all(m.weight.grad is None for m in model.tables())  # the lookups left autograd no table gradient
            model.flush_table_grads()
            assert all(not s.any() for s in (model.lm_head_grad_sum, *(m.grad_sum for m in model.tables())))
        out.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_token_tables_summed_by_their_lookups_get_autograds_gradients(tied):
    plain, summed = _grads_with_and_without_table_sums(tied, None)
    assert summed.keys() == plain.keys() and ("embed.weight" in plain) == (not tied)
    assert "bigram_embed.weight" in plain and "lm_head_w" in plain
    for name in plain:
        # float32 sums in another order: entries that nearly cancel may differ by a few ulps of the tensor's largest
        # (torch 2.11 on the tied head: the plain gradient adds head and lookups per micro-batch, the sums at the end)
        scale = plain[name].abs().max().item()
        torch.testing.assert_close(summed[name], plain[name], rtol=1e-5, atol=1e-6 * scale, msg=name)


@pytest.mark.slow
def test_token_tables_summed_by_their_lookups_inside_inductors_graph():
    """The lookups' backward adds into a buffer from inside the compiled backward (a mutation Inductor keeps).
    256 tokens, two of DC attention's query blocks: where a padded sequence is one block, Inductor's CPU code (torch
    2.13) corrupts memory with or without the sums, in the backward of DC's key blocks (blocks_with_lookback)."""
    plain, summed = _grads_with_and_without_table_sums(False, "inductor", T=256)
    assert summed.keys() == plain.keys() and "embed.weight" in plain
    for name in plain:
        torch.testing.assert_close(summed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_yarn_slows_only_the_frequencies_that_turn_few_times_across_the_old_window():
    old, new = 384, 896
    turns = torch.tensor([0.0, 0.5, 1.0, 8.0, 16.5, 32.0, 100.0])  # turns across the old window
    freqs = turns * 2 * math.pi / old
    out = tg.yarn_frequencies(freqs, old, new)
    ratio = old / new
    expected = freqs * torch.tensor([ratio, ratio, ratio, ratio + 7 / 31 * (1 - ratio),
                                     ratio + 15.5 / 31 * (1 - ratio), 1.0, 1.0])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    assert out[0] == 0 and (out[1:] / freqs[1:]).diff().ge(0).all()  # the fewer turns, the more it slows


def test_yarn_gives_each_long_window_of_the_schedule_its_tables_and_attention_scale():
    args = tg.Hyperparameters(**dict(TINY, extension_steps=2, extension_window=4))
    cfg = tg.ModelConfig.from_args(args)
    assert cfg.yarn_windows == (16, 32, 48, 64)  # the stages' windows (1, 2, 3) then the extension's 4, x 16 tokens
    rotary = tg.Rotary(32, 256, 1 / 64, cfg.yarn_windows)
    plain = tg.Rotary(32, 256, 1 / 64)
    c0, s0, m0 = rotary.at(16)
    assert torch.equal(c0, plain.at(16)[0]) and torch.equal(s0, plain.at(99)[1]) and m0 == 1.0 == plain.at(16)[2]
    freqs, scale = (1 / 64) ** torch.linspace(0, 1, 8), 1.0
    freqs = torch.cat([freqs, torch.zeros(8)])
    for old, new in zip(cfg.yarn_windows, cfg.yarn_windows[1:]):
        freqs, scale = tg.yarn_frequencies(freqs, old, new), scale * (1 + 0.2 * math.log(new / old))
        cos, sin, mult = rotary.at(new)
        theta = torch.outer(torch.arange(256.0), freqs)
        torch.testing.assert_close(cos, theta.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin, theta.sin(), rtol=0, atol=1e-6)
        assert math.isclose(mult, scale, rel_tol=1e-12) and mult > 1
    assert not torch.equal(rotary.at(64)[0], c0) and torch.equal(rotary.at(64)[0][:, 8:], c0[:, 8:])  # unrotated half
    with pytest.raises(ValueError, match="tables for the long windows \\[16, 32, 48, 64\\], not 80"):
        rotary.at(80)


def test_yarn_leaves_the_first_stage_alone_and_changes_the_later_ones():
    on = tiny_model(randomize=True)
    off = tiny_model(randomize=True)
    cfg = off.cfg
    off.rotary = tg.Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rotary_min_freq)  # one table for every window
    x, y, cu = batch()
    with torch.no_grad():
        W2 = tg.window_tokens(2, TINY["window_block"])
        assert torch.equal(on(x, y, cu, 128, W1, reduction="none"), off(x, y, cu, 128, W1, reduction="none"))
        assert not torch.equal(on(x, y, cu, 128, W2, reduction="none"), off(x, y, cu, 128, W2, reduction="none"))


def test_smear_adds_the_gated_previous_embedding_within_a_document_only():
    g = torch.Generator().manual_seed(0)
    x, gate_w = torch.randn(10, 16, generator=g), torch.randn(1, 4, generator=g)
    cu = torch.tensor([0, 6, 10, 10], dtype=torch.int32)  # documents [0, 6) and [6, 10), then padding
    out = tg.smear(x, cu, torch.tensor(0.7), gate_w)
    for t in range(10):
        expected = x[t] if t in (0, 6) else x[t] + 0.7 * torch.sigmoid(x[t, :4] @ gate_w[0]) * x[t - 1]
        torch.testing.assert_close(out[t], expected, rtol=1e-6, atol=1e-6)
    bf16 = tg.smear(x.bfloat16(), cu, torch.tensor(0.7), gate_w)
    assert bf16.dtype == torch.bfloat16  # a float32 weight does not promote the embedding


def test_smear_starts_as_a_no_op_and_then_learns_both_its_weights():
    model = tiny_model(randomize=True, doc_copy=False)  # the copy feature adds to x0 too (its own test below)
    at = model.scalar_layout()
    assert at["smear"].stop - at["smear"].start == 1
    fresh = tiny_model()
    assert fresh.smear_w.abs().sum() == 0 and fresh.scalars[at["smear"]].item() == 0
    x, y, cu = batch()
    with torch.no_grad():
        model.scalars[at["smear"]] = 0.0  # the smear's start: x0 is the normed embedding as it is
        x0 = model.embeddings(x, cu)[0]
        torch.testing.assert_close(x0, tg.norm(model.lm_head_w[x.long()].type_as(x0)), rtol=0, atol=0)  # tied
        base = model(x, y, cu, 128, W3, reduction="none")
    model(x, y, cu, 128, W3).backward()
    assert model.scalars.grad[at["smear"]].abs().item() > 0  # the weight learns first
    assert model.smear_w.grad.abs().sum() == 0  # the gate's gradient is 0 at weight 0
    with torch.no_grad():
        model.scalars[at["smear"]] = 0.5
        assert not torch.equal(model(x, y, cu, 128, W3, reduction="none"), base)
    model.zero_grad()
    model(x, y, cu, 128, W3).backward()
    assert model.smear_w.grad.abs().sum() > 0
    assert any(p is model.smear_w for p in tg.param_groups_by_role(model)["block matrices"])  # Muon's


def test_value_embedding_gate_scales_each_heads_value_embedding_by_context():
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**TINY))
    g = torch.Generator().manual_seed(0)
    seen = []
    attn = tg.CausalSelfAttention(cfg, lambda q, k, v, *a: seen.append(v) or v, ve_gate=True, key_offset=False,
                                  paired=False)
    with torch.no_grad():
        attn.ve_gate_w.copy_(torch.randn(attn.ve_gate_w.shape, generator=g))
    T, H, D = 20, cfg.num_heads, cfg.head_dim
    x, ve = torch.randn(T, cfg.model_dim, generator=g), torch.randn(T, H * D, generator=g)
    lambdas = torch.tensor([0.3, 0.9])
    rope = tg.Rotary(D, T, cfg.rotary_min_freq).at(0)
    one = torch.tensor(1.0)
    w = tg.BlockWeights(one, one, one, one, one, lambdas)
    cu = torch.tensor([0, T], dtype=torch.int32)
    attn(x, ve, w, cu, T, 16, rope)
    v = torch.nn.functional.linear(x, attn.qkvo_w[2]).view(T, H, D)
    gate = 2 * torch.sigmoid(x[:, : cfg.gate_channels] @ attn.ve_gate_w.T)  # (T, H)
    torch.testing.assert_close(seen[0], 0.3 * v + 0.9 * gate[..., None] * ve.view(T, H, D), rtol=1e-5, atol=1e-5)
    # the last block's gate comes from MUDD (BlockWeights.ve_gate), per token and head, in place of the block's own
    given = torch.rand(T, H, generator=g)
    attn(x, ve, w._replace(ve_gate=given), cu, T, 16, rope)
    torch.testing.assert_close(seen[1], 0.3 * v + 0.9 * given[..., None] * ve.view(T, H, D), rtol=1e-5, atol=1e-5)


def test_value_embedding_gates_sit_where_value_embeddings_are_start_at_one_and_learn():
    """Block 1 (a value table, not the last block) has its own gate; block 3, the last, takes MUDD's; block 0 (no
    table) and block 2 (no attention) none. The gate's zero weights give 2 sigmoid(0) = 1: the ungated model."""
    model = tiny_model(randomize=True)
    assert model.value_embed_layers() == [None, 0, None, 1]
    assert [b.attn.ve_gate_w is not None if b.attn else None for b in model.blocks] == [False, True, None, False]
    assert "blocks.1.attn.ve_gate_w" in model.state_dict()
    x, y, cu = batch()
    with torch.no_grad():
        model.blocks[1].attn.ve_gate_w.zero_()  # the start
        gated = model(x, y, cu, 128, W3, reduction="none")
        weight, model.blocks[1].attn.ve_gate_w = model.blocks[1].attn.ve_gate_w, None  # no gate at all
        torch.testing.assert_close(gated, model(x, y, cu, 128, W3, reduction="none"), rtol=0, atol=0)
        model.blocks[1].attn.ve_gate_w = weight
    model(x, y, cu, 128, W3).backward()
    assert model.blocks[1].attn.ve_gate_w.grad.abs().sum() > 0
    assert sum(p is model.blocks[1].attn.ve_gate_w for p in tg.param_groups_by_role(model)["block matrices"]) == 1


def test_key_offset_moves_the_unrotated_key_dims_one_position_forward_within_documents():
    D = 8  # rotary turns dims [0, 2) with [4, 6); [2, 4) and [6, 8) carry no position
    k = torch.randn(6, 2, D, generator=torch.Generator().manual_seed(0))
    out = tg.offset_keys(k, torch.tensor([0, 4, 6, 6], dtype=torch.int32))
    still = [2, 3, 6, 7]
    moved = [0, 1, 4, 5]
    assert torch.equal(out[..., moved], k[..., moved])
    for t in range(6):
        assert torch.equal(out[t][:, still], k[t if t in (0, 4) else t - 1][:, still])
    rotary = tg.Rotary(D, 16, 1 / 64)
    cos = rotary.at(0)[0]
    assert (cos[:, [2, 3]] == 1).all() and not (cos[:, [0, 1]] == 1).all()  # the unrotated dims are Rotary's zero frequencies


def test_key_offset_is_on_in_long_window_blocks_only_and_changes_the_model():
    on = tiny_model(randomize=True)
    assert [b.attn.key_offset if b.attn else None for b in on.blocks] == [True, False, None, True]  # "LSSL", no attn in 2
    x, y, cu = batch()
    with torch.no_grad():
        base = on(x, y, cu, 128, W3, reduction="none")
        for i in (0, 3):  # each long-window block's offset matters
            on.blocks[i].attn.key_offset = False
            assert not torch.equal(on(x, y, cu, 128, W3, reduction="none"), base), i
            on.blocks[i].attn.key_offset = True


def test_xsa_removes_tanh_alpha_of_each_heads_output_along_its_own_value():
    g = torch.Generator().manual_seed(0)
    y, v = torch.randn(7, 3, 8, generator=g), torch.randn(7, 3, 8, generator=g)
    alpha = torch.tensor([0.0, 0.4, 20.0])  # off, part, (tanh ~ 1) all
    out = tg.exclude_own_value(y, v, alpha)
    unit = v / v.norm(dim=-1, keepdim=True)
    along_before, along_after = (y * unit).sum(-1), (out * unit).sum(-1)
    torch.testing.assert_close(out[:, 0], y[:, 0], rtol=0, atol=0)  # alpha 0: unchanged
    torch.testing.assert_close(along_after[:, 1], (1 - math.tanh(0.4)) * along_before[:, 1])
    torch.testing.assert_close(along_after[:, 2], torch.zeros(7), rtol=0, atol=1e-5)  # orthogonal to v
    # what is orthogonal to v stays: only the component along v changes
    torch.testing.assert_close(out - (out * unit).sum(-1, keepdim=True) * unit,
                               y - (y * unit).sum(-1, keepdim=True) * unit)
    per_token = alpha.expand(7, 3).clone()  # a strength per token and head (the MUDD gates'): the same where equal
    per_token[3] = 0.0
    out2 = tg.exclude_own_value(y, v, per_token)
    torch.testing.assert_close(out2[:3], out[:3])
    torch.testing.assert_close(out2[3], y[3])


def test_pair_heads_puts_head_h_at_2t_and_head_h_plus_half_at_2t_plus_1():
    x = torch.randn(5, 6, 4)
    paired = tg.pair_heads(x)
    assert paired.shape == (10, 3, 4)
    for t in range(5):
        assert torch.equal(paired[2 * t], x[t, :3]) and torch.equal(paired[2 * t + 1], x[t, 3:])
    assert torch.equal(paired.reshape(5, 6, 4), x)  # what the attention output's reshape undoes


def test_paired_head_attention_is_one_softmax_over_both_heads_keys_at_interleaved_positions():
    """Head h of token t sits at position i = 2t + m (m = 0 for h < H/2, else 1) and attends, in one
    softmax, to the keys of both heads of its pair (h mod H/2, + H/2) at every position j = 2s + m'
    with j <= i, i - j <= window, s in t's document; rotary turns each by its own position. A loop
    over tokens and heads, against the block's batched computation."""
    args = tg.Hyperparameters(**{**TINY, "num_heads": 4, "head_dim": 16, "paired_head_blocks": (1,)})
    cfg = tg.ModelConfig.from_args(args)
    assert cfg.max_seq_len == 2 * max(args.seq_len, args.val_seq_len)  # rotary covers two positions per token
    torch.manual_seed(0)
    attn = tg.CausalSelfAttention(cfg, tg.attention_reference, ve_gate=False, key_offset=False, paired=True)
    with torch.no_grad():
        attn.qkvo_w.normal_(0, 0.3)
    rope = tg.Rotary(cfg.head_dim, 128, cfg.rotary_min_freq).at(0)
    T, H, D, window, half = 40, 4, 16, 12, 2
    cu = torch.tensor([0, 25, 40, 40], dtype=torch.int32)
    x, lambdas = torch.randn(T, cfg.model_dim), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        one = torch.tensor(1.0)
        out = attn(x, None, tg.BlockWeights(one, one, one, one, one, lambdas), cu, 25, window, rope)
        q, k, v = torch.nn.functional.linear(x, attn.qkvo_w[:3].flatten(0, 1)).view(T, 3 * H, D).chunk(3, dim=1)
        v = lambdas[0] * v

        def at(vec, pos):  # normed and rotated as if at position pos
            return tg.rotate(tg.norm(vec).expand(pos + 1, 1, D), rope)[pos, 0]

        y = torch.zeros(T, H, D)
        for t in range(T):
            doc = range(0, 25) if t < 25 else range(25, 40)
            for h in range(H):
                m, pair = divmod(h, half)
                i = 2 * t + m
                keys, vals = [], []
                for s in doc:
                    for m2 in (0, 1):
                        j = 2 * s + m2
                        if j <= i and i - j <= window:
                            keys.append(at(k[s, pair + m2 * half], j))
                            vals.append(v[s, pair + m2 * half])
                w = torch.softmax(cfg.attn_scale * torch.stack(keys) @ at(q[t, h], i), dim=0)
                y[t, h] = w @ torch.stack(vals)
        expected = y.reshape(T, H * D) @ attn.qkvo_w[3]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_paired_head_blocks_are_the_ones_named_and_change_the_model():
    on = tiny_model(randomize=True)
    off = tiny_model(randomize=True, paired_head_blocks=())
    assert off.state_dict().keys() == on.state_dict().keys()  # no new weights
    assert [b.attn.paired if b.attn else None for b in on.blocks] == [False, True, None, False]
    x, y, cu = batch()
    with torch.no_grad():
        assert not torch.equal(on(x, y, cu, 128, W3, reduction="none"), off(x, y, cu, 128, W3, reduction="none"))
        on.blocks[1].attn.paired = False  # block 1 unpaired: the same as the model without paired heads
        torch.testing.assert_close(on(x, y, cu, 128, W3, reduction="none"), off(x, y, cu, 128, W3, reduction="none"),
                                   rtol=0, atol=0)


def test_mudd_starts_at_its_init_then_each_of_its_weights_changes_the_output_and_learns():
    """MUDD's second layers start at zero and its biases at MUDD_INIT: every token gets the init values, by name; the
    last block's own weights start where the static weights of the others do. Each of the 14 + 5 weights, moved,
    changes the output; the zero layers learn first."""
    fresh = tiny_model()
    assert fresh.mudd_w2.abs().max() == 0 and fresh.mudd_w1.std() > 0
    h = torch.randn(128, TINY["model_dim"])
    for j, names in enumerate((tg.MUDD_BEFORE_LAST, tg.MUDD_BEFORE_HEAD)):
        coefs = fresh.mudd_coefs(h, j, names)
        assert list(coefs) == list(names)
        for name, value in names.items():
            torch.testing.assert_close(coefs[name], torch.full((128, 1), float(value)), msg=name)
    b2 = (fresh.mudd_b2 * tg.MUDD_SCALE).view(2, tg.MUDD_COEFS)
    assert b2[0, len(tg.MUDD_BEFORE_LAST):].abs().max() == 0 and b2[1, len(tg.MUDD_BEFORE_HEAD):].abs().max() == 0
    at, L, init = fresh.scalar_layout(), TINY["num_layers"], tg.MUDD_BEFORE_LAST
    own, sub = fresh.scalars[at["blocks"]].view(L, 4), fresh.scalars[at["sublayer"]].view(L, 3)
    torch.testing.assert_close(torch.stack([own[0, 0], *sub[0]]),
                               torch.tensor([init[n] for n in ("resid", "attn_out", "mlp_resid", "mlp_out")]))
    assert {(what, v) for what, _, _, v in fresh.gate_layout()[0] if what in ("x0", "bigram")} == \
        {("x0", init["block_x0"]), ("bigram", init["bigram"])}  # the gates' start for the other blocks
    # before the last block: the residual's and the value channel's mixes, the last block's weights and its gate
    model = tiny_model(randomize=True)
    x, x0, backout, bigram = (torch.randn(128, TINY["model_dim"]) for _ in range(4))
    g = {what: [None] * L for what in ("xsa", "out", "x0", "bigram", "skip", "dc1", "dc2")}
    model.gates(x, 1, g)
    with torch.no_grad():
        new, w = model.mudd_before_last(x, x0, backout, bigram, own[-1, 2:], g, L - 1)
        c = model.mudd_coefs(x, 0, tg.MUDD_BEFORE_LAST)
    torch.testing.assert_close(new, (1 + c["own"]) * x + c["x0"] * x0 + c["backout"] * backout)
    torch.testing.assert_close(w.value_extra, c["value_x0"] * x0 + c["value_backout"] * backout + c["value_x"] * x)
    for got, name in zip((w.resid, w.x0, w.attn_out, w.mlp_resid, w.mlp_out),
                         ("resid", "block_x0", "attn_out", "mlp_resid", "mlp_out")):
        assert torch.equal(got, c[name]), name
    torch.testing.assert_close(w.bigram, c["bigram"] * bigram)
    torch.testing.assert_close(w.ve_gate, torch.cat([c["ve_gate_first"], c["ve_gate_second"]], -1))  # H = 2
    assert w.head_out is g["out"][L - 1] and w.dc == (g["dc1"][L - 1], g["dc2"][L - 1])
    x, y, cu = batch()
    with torch.no_grad():
        base = model(x, y, cu, 128, W3, reduction="none")
        changed = {}
        for j, names in enumerate((tg.MUDD_BEFORE_LAST, tg.MUDD_BEFORE_HEAD)):
            for k, name in enumerate(names):
                model.mudd_b2[j * tg.MUDD_COEFS + k] += 3
                changed[j, name] = not torch.allclose(model(x, y, cu, 128, W3, reduction="none"), base)
                model.mudd_b2[j * tg.MUDD_COEFS + k] -= 3
    assert len(changed) == 19 and all(changed.values()), changed
    with torch.no_grad():  # MUDD as it starts, in a model whose other weights carry signal
        model.mudd_w2.zero_(), model.mudd_b2.copy_(fresh.mudd_b2)
    model(x, y, cu, 128, W3).backward()
    assert model.mudd_w2.grad.norm() > 0 and model.mudd_b2.grad.norm() > 0  # the zero layers learn first
    assert model.mudd_w1.grad.norm() == 0  # behind a zero second layer
    groups = {id(p): g for g in tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[0].param_groups
              for p in g["params"]}
    g = groups[id(model.mudd_w1)]
    assert g is groups[id(model.mudd_b2)] and g["betas"] == (0.9, 0.99) and g["lr"] == TINY.get("adam_lr", 0.008) * 0.25


def brute_force_doc_copy(x: list[int], cu: list[int]) -> tuple[list[int], list[int]]:
    """doc_copy's candidates and buckets by direct search: for each length from the longest, the earlier windows
    of t's document equal to t's last L tokens; the latest one's next token, and 1 + 3 (L's index) + min(count, 3) - 1."""
    cand, bucket = [-1] * len(x), [0] * len(x)
    for t in range(len(x)):
        start = max(c for c in cu if c <= t)
        for k in reversed(range(len(tg.DOC_COPY_LENGTHS))):
            L = tg.DOC_COPY_LENGTHS[k]
            twins = [u for u in range(start + L - 1, t) if x[u - L + 1: u + 1] == x[t - L + 1: t + 1]]
            if t - L + 1 >= start and twins:
                cand[t], bucket[t] = x[max(twins) + 1], 3 * k + min(len(twins), 3)
                break
    return cand, bucket


@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_doc_copy_candidates_are_the_latest_earlier_twin_s_next_token_in_the_document(vocab):
    """PR 378's matcher against a direct search, on documents with many repeats (a vocabulary of 2) and few; a
    window that would cross into the document before matches nothing there; nothing depends on later tokens."""
    g = torch.Generator().manual_seed(vocab)
    for _ in range(6):
        T = int(torch.randint(40, 160, (1,), generator=g))
        x = torch.randint(0, vocab, (T,), generator=g, dtype=torch.int32)
        cu = [0, *sorted(torch.randperm(T - 1, generator=g)[:2].add(1).tolist()), T, T]
        cand, bucket = tg.doc_copy_candidates(x, torch.tensor(cu, dtype=torch.int32))
        assert (cand.tolist(), bucket.tolist()) == brute_force_doc_copy(x.tolist(), cu)
        assert bucket.max() < tg.DOC_COPY_BUCKETS and ((bucket > 0) == (cand >= 0)).all()
        later = x.clone()
        later[T // 2:] = (later[T // 2:] + 1) % vocab
        cand2, bucket2 = tg.doc_copy_candidates(later, torch.tensor(cu, dtype=torch.int32))
        assert torch.equal(cand2[: T // 2], cand[: T // 2]) and torch.equal(bucket2[: T // 2], bucket[: T // 2])
    same = torch.tensor([7, 8, 9, 7, 8, 9], dtype=torch.int32)  # a second document repeating the first
    cand, bucket = tg.doc_copy_candidates(same, torch.tensor([0, 3, 6, 6], dtype=torch.int32))
    assert cand.tolist() == [-1] * 6 and bucket.tolist() == [0] * 6


def test_doc_copy_starts_as_the_model_without_it_then_its_tables_change_the_output_and_learn():
    """doc_copy's gains per bucket and embeddings per bucket start at zero: the same model as without it; each
    then moves the output; both learn, in their own Adam group at the base rate."""
    without = tiny_model(randomize=True, doc_copy=False)
    model = tiny_model(doc_copy=True)
    missing = model.load_state_dict(without.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["doc_copy_embed", "doc_copy_gains"]
    n = model.doc_copy_embed.size(0)
    assert n == 32 and model.doc_copy_gains[n:n + 2].tolist() == [0.5, 1.0]
    x, y, cu = batch()
    with torch.no_grad():
        base = model(x, y, cu, 128, W3, reduction="none")
        torch.testing.assert_close(base, without(x, y, cu, 128, W3, reduction="none"))
        bucket = tg.doc_copy_candidates(x, cu)[1]
        assert (bucket > 0).float().mean() > 0.3  # the tiny vocabulary repeats often
        model.doc_copy_gains[int(bucket.max())] += 1
        assert not torch.allclose(model(x, y, cu, 128, W3, reduction="none"), base)
        model.doc_copy_gains[int(bucket.max())] -= 1
        model.doc_copy_embed[int(bucket.max())] += 1
        assert not torch.allclose(model(x, y, cu, 128, W3, reduction="none"), base)
        model.doc_copy_embed.zero_()
    model(x, y, cu, 128, W3).backward()
    assert model.doc_copy_embed.grad.norm() > 0 and model.doc_copy_gains.grad[:n].norm() > 0
    assert model.doc_copy_embed.grad[0].abs().max() == 0  # bucket 0: no match, nothing added
    args = tg.Hyperparameters(**{**TINY, "doc_copy": True})
    groups = {id(p): g for g in tg.build_optimizers(model, args, 0, 1)[0].param_groups for p in g["params"]}
    group = groups[id(model.doc_copy_embed)]
    assert group is groups[id(model.doc_copy_gains)] and group["lr"] == args.adam_lr and group["betas"] == (0.9, 0.99)


def test_doc_copy_gains_gradient_sums_a_buckets_positions_in_float32():
    """The bucket gains' gradient sums every position of a bucket (thousands in a micro-batch): in the bf16 model it
    matches the float64 model's to 1%. Summed in bf16 it stalled at 512 (12% off here)."""
    def gains_grad(dtype):
        model = tiny_model(randomize=True, doc_copy=True)
        with torch.no_grad():
            model.doc_copy_gains[:32].uniform_(0.5, 1.5)
        model = model.to(dtype) if dtype is not None else model
        x = torch.randint(0, 8, (8192,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
        copy = model.embeddings(x, torch.tensor([0, 8192], dtype=torch.int32))[3]  # 8 tokens: long matches
        copy.float().sum().backward()
        return model.doc_copy_gains.grad[:32].double(), copy.dtype
    (got, dtype), (want, _) = gains_grad(None), gains_grad(torch.float64)
    assert dtype == torch.bfloat16 and want.abs().max() > 512
    assert (got - want).abs().max() < 0.01 * want.abs().max()


@pytest.mark.parametrize("flags", [dict(doc_copy=True), dict(ngram_normalize=True)],
                         ids=["doc_copy", "ngram_normalize"])
def test_the_copy_feature_and_normalized_hashing_compile_whole_with_the_eager_arithmetic(flags):
    """torch.compile(fullgraph=True) takes the model with each of these fields on (no graph break: the GPU runs
    compile so), loss and gradients as eager."""
    model = tiny_model(randomize=True, **flags)
    model.set_vocabulary(CASE_FOLDING_VOCAB)  # ngram_normalize's table
    compiled_matches_eager(model, *batch(), 128, W3)


def test_mudd_gates_give_per_token_weights_in_their_layout_and_replace_the_static_ones():
    """Tiny blocks L S S L, block 2 without attention: the gate from x0 serves block 0 (the first long-window
    block), the gate from block 1's input the rest; each weight does what gate_layout says it does."""
    model = tiny_model(randomize=True)
    pre, post = model.gate_layout()
    H = TINY["num_heads"]
    assert pre == [("out", 0, H, 0.25), ("x0", 0, 1, 0.0), ("bigram", 0, 1, 0.05)]
    assert post == [("xsa", 1, H, 0.0), ("x0", 1, 1, 0.0), ("bigram", 1, 1, 0.05), ("x0", 2, 1, 0.0),
                    ("bigram", 2, 1, 0.05), ("out", 3, H, 0.25), ("skip", 2, 1, 0.5), ("dc1", 3, H, 1.0),
                    ("dc2", 3, H, 0.0)]
    assert model.gate_width == 16 and model.mudd_gate_w2.shape == (32, tg.MUDD_DIM)  # rows shard over 8 ranks
    fresh = tiny_model()
    assert fresh.mudd_gate_w2.abs().max() == 0 and fresh.mudd_gate_b2[-8] == tg.MUDD_SCALE
    torch.testing.assert_close(fresh.mudd_gate_b2[:3] * tg.MUDD_SCALE, torch.tensor([0.25, 0.25, 0.0]))
    torch.testing.assert_close(fresh.mudd_gate_b2[16 + 8] * tg.MUDD_SCALE, torch.tensor(0.5))  # the skip's
    at_start = {what: [None] * 4 for what in ("xsa", "out", "x0", "bigram", "skip", "dc1", "dc2")}
    fresh.gates(torch.randn(128, TINY["model_dim"]), 1, at_start)
    # DC attention's correction starts at zero (w2 = 0; dc_correction then adds nothing), its head mix w1 at one
    assert at_start["dc2"][3].abs().max() == 0
    torch.testing.assert_close(at_start["dc1"][3], torch.ones(128, H))
    x, y, cu = batch()
    g = {what: [None] * 4 for what in ("xsa", "out", "x0", "bigram", "skip", "dc1", "dc2")}
    model.gates(torch.randn(128, TINY["model_dim"]), 1, g)
    assert g["xsa"][1].shape == (128, H) and g["skip"][2].shape == (128, 1) and g["x0"][0] is None
    assert g["x0"][1].std() > 0, "per token"

    def loss_with(change):
        m = tiny_model(randomize=True)
        with torch.no_grad():
            m.mudd_gate_w2.zero_()  # each gate output is its bias times the scale
            change(m)
            return m(x, y, cu, 128, W3, reduction="none")

    def bias(m, j, what, block, value):
        start = j * m.gate_width
        for w, i, n, _ in m.gate_layout()[j]:
            if (w, i) == (what, block):
                m.mudd_gate_b2[start: start + n] = value / m.mudd_gate_b2[-8]
            start += n

    def zero_gate_and(what, j, block, then):
        return lambda m: (bias(m, j, what, block, 0.0), then(m))

    def noop(m):
        pass
    # a zero output weight: block 0's and block 3's attention weights no longer matter; a non-zero one, they do
    for j, block in ((0, 0), (1, 3)):
        qkvo = lambda m, block=block: m.blocks[block].attn.qkvo_w.mul_(2)
        assert torch.equal(loss_with(zero_gate_and("out", j, block, noop)), loss_with(zero_gate_and("out", j, block, qkvo)))
        assert not torch.equal(loss_with(noop), loss_with(qkvo))
    # a zero skip weight: the skip's logit no longer matters
    logit = lambda m: m.scalars[m.scalar_layout()["skips"]].add_(1.0)
    assert torch.equal(loss_with(zero_gate_and("skip", 1, 2, noop)), loss_with(zero_gate_and("skip", 1, 2, logit)))
    assert not torch.equal(loss_with(noop), loss_with(logit))
    # the x0 weights of the gated blocks replace the static ones (b of each block's mix), which no longer matter
    at = model.scalar_layout()
    static = lambda m: m.scalars[at["blocks"]].view(4, 4)[:, 1].add_(1.0)
    assert torch.equal(loss_with(noop), loss_with(static))
    for j, what, block in ((0, "x0", 0), (0, "bigram", 0), (1, "x0", 2), (1, "bigram", 1), (1, "xsa", 1), (1, "dc2", 3)):
        assert not torch.equal(loss_with(noop), loss_with(lambda m: bias(m, j, what, block, 0.7))), (what, block)
    loss = model(x, y, cu, 128, W3)
    loss.backward()
    assert model.mudd_gate_w2.grad.norm() > 0 and model.mudd_gate_w1.grad.norm() > 0
    assert model.mudd_gate_b2.grad[-8] != 0, "the scale learns"
    groups = {id(p): g for g in tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[0].param_groups
              for p in g["params"]}
    g = groups[id(model.mudd_gate_w1)]
    assert g is groups[id(model.mudd_gate_b2)] and g["betas"] == (0.9, 0.99) and g["lr"] == TINY.get("adam_lr", 0.008) * 0.1


@pytest.mark.parametrize("window", [9, 12])  # key blocks of 24 keys; of 27 keys padded to 32 with masked ones
def test_dc_correction_is_the_per_token_loop_and_does_not_depend_on_the_query_blocks(window):
    torch.manual_seed(0)
    T, H, D, scale = 70, 3, 8, 0.3
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    cu, w1, w2 = torch.tensor([0, 20, 45, 70, 70]), torch.randn(T, H), torch.randn(T, H)
    out = tg.dc_correction(q, k, v, cu, w1, w2, scale, window=window, chunk=16)
    ref = torch.zeros_like(v)
    for t in range(T):
        first = max(int(cu[cu <= t].max()), t - window + 1)  # the window's keys within the document, itself included
        mix = w1[t] / torch.sqrt(w1[t].square().mean() + 1e-6)
        composed = sum(mix[g] * (scale * k[first: t + 1, g] @ q[t, g]).softmax(0) for g in range(H))
        for h in range(H):
            ref[t, h] = w2[t, h] * (composed[:, None] * v[first: t + 1, h]).sum(0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tg.dc_correction(q, k, v, cu, w1, w2, scale, window=window, chunk=32), out)
    assert tg.dc_correction(q, k, v, cu, w1, torch.zeros(T, H), scale).abs().max() == 0


@pytest.mark.parametrize("T", [64, 70, 24])  # a whole query block; a partial last one; a buffer shorter than one
def test_dc_correction_gradients_are_finite_and_do_not_depend_on_the_query_blocks(T):
    """The backward, where the query blocks pad the buffer (a micro-batch of any seq_len): the padded query rows have
    no key, and must not reach the gradients of the real ones."""
    torch.manual_seed(0)
    H, D, scale, window = 2, 8, 0.3, 9
    q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
    w1, w2 = (torch.randn(T, H, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, T // 3, T, T])
    grads = []
    for chunk in (16, 2 * T):  # blocked (with padding unless 16 divides T), and one block padded to twice T
        tg.dc_correction(q, k, v, cu, w1, w2, scale, window=window, chunk=chunk).square().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, w1, w2)])
        for t in (q, k, v, w1, w2):
            t.grad = None
    for name, a, b in zip("q k v w1 w2".split(), *grads):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_cplm_pointer_is_the_per_position_loop_and_the_mixture_is_a_distribution():
    """The pointer against a loop over positions (earlier positions of the document within the band, a sink);
    the mixture's probabilities over every token sum to one, and the loss is -log of the mixture."""
    model = tiny_model(randomize=True)
    x, y, cu = batch(doc_starts=(0, 40, 90))
    for training, band in ((True, 16), (False, 32)):
        model.train(training)
        with torch.no_grad():
            h = model.hidden(x, cu, 128, W3)
            p_copy, a_sink = model.copy_pointer(h, x, y, cu)
            d = tg.COPY_DIM
            gain = model.scalars[model.scalar_layout()["copy_gain"]][0]
            q = (tg.norm(h @ model.copy_qk[:d].type_as(h).T) * gain).float() / d ** 0.5
            k = tg.norm(h @ model.copy_qk[d:].type_as(h).T).float()
            for t in range(128):
                start = max(max(s for s in (0, 40, 90) if s <= t), (t // band - 1) * band)
                scores = torch.cat([(q[t] @ model.copy_sink)[None], k[start:t] @ q[t]]).softmax(0)
                torch.testing.assert_close(a_sink[t], scores[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(p_copy[t], scores[1:][x[start:t] == y[t]].sum(), rtol=1e-5, atol=1e-6)
    assert p_copy.max() > 0 and a_sink.min() < 1
    model.eval()
    with torch.no_grad():
        h = model.hidden(x, cu, 128, W3)
        total = torch.zeros(128)
        for token in set(range(TINY["vocab_size"])) - {TINY["bos_id"] + 1}:  # every column but the copy column
            target = torch.full_like(y, token)
            copy = model.copy_pointer(h, x, target, cu)
            total += (-model.head_losses(h, target, copy=copy)).exp()
        torch.testing.assert_close(total, torch.ones(128), rtol=1e-5, atol=1e-5)
    loss = model(x, y, cu, 128, W3)
    model.train()
    model(x, y, cu, 128, W3).backward()
    assert model.copy_qk.grad.norm() > 0 and model.copy_sink.grad.norm() > 0
    assert model.scalars.grad[model.scalar_layout()["copy_gain"]].abs().min() > 0
    assert model.next_token_logits(x, cu, 128, W3)[TINY["bos_id"] + 1] == float("-inf")
    groups = {id(p): g for g in tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[0].param_groups
              for p in g["params"]}
    assert groups[id(model.copy_qk)] is groups[id(model.copy_sink)] and groups[id(model.copy_qk)]["betas"] == (0.9, 0.99)
    assert torch.isfinite(loss)
    for bad in (dict(cplm_bands=(16,)), dict(cplm_bands=(0, 8)), dict(vocab_size=64)):
        with pytest.raises(ValueError, match="cplm_bands"):
            tg.Hyperparameters(**{**TINY, **bad})


@pytest.mark.parametrize("backout", [0, 2])
def test_every_attention_after_the_backout_block_reads_its_normed_output(backout):
    """Parallel attention inputs: the blocks after backout_layer (with attention: 1 and 3, or 3) attend over
    norm(block backout_layer's output), the blocks up to it over their own normed inputs."""
    model = tiny_model(randomize=True, backout_layer=backout)
    x, y, cu = batch()
    seen = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(("out", i), out))
        block.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("in", i), a[:4]))
        if block.attn is not None:
            block.attn.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(("attn", i), a[0]))
    with torch.no_grad():
        model(x, y, cu, 128, W3)
    for i in (0, 1, 3):
        if i > backout:
            assert torch.equal(seen["attn", i], tg.norm(seen["out", backout])), i
        else:  # its own input, weighted; x0 and the n-gram term join after the attention
            h, x0, _, w = seen["in", i]
            assert torch.equal(seen["attn", i], tg.norm(w.resid * h)), i
            assert not torch.allclose(seen["attn", i], tg.norm(seen["out", backout])), i


@pytest.mark.parametrize("blocks", [(1, 3), (3, 0, 1), (2,), (1, 1), (4,)])
def test_value_embed_blocks_give_each_named_block_a_small_table_of_its_own(blocks):
    kw = dict(value_embed_blocks=blocks)
    if blocks in ((2,), (1, 1), (4,)):  # block 2 of TINY has no attention; a repeat; past the last block
        with pytest.raises(ValueError, match="distinct blocks with attention"):
            tg.Hyperparameters(**{**TINY, **kw})
        return
    model = tiny_model(**kw)
    assert model.value_embed_layers() == [blocks.index(i) if i in blocks else None for i in range(4)]
    assert len(model.value_embeds) == len(blocks)
    assert all(abs(m.weight.float().std().item() - 0.01) < 0.001 for m in model.value_embeds)
    assert [b.attn.ve_gate_w is not None for b in model.blocks if b.attn] == \
        [i in blocks and i != 3 for i in (0, 1, 3)]  # the last block's gate is MUDD's
    x, y, cu = batch()
    model = tiny_model(randomize=True, **kw)  # a zero output projection would hide the value path
    model(x, y, cu, 128, W3).backward()
    assert all(m.weight.grad.norm() > 0 for m in model.value_embeds)  # every table reaches the loss


def test_a_tied_embedding_reads_the_lm_heads_rows_and_the_head_starts_small_not_zero():
    tied, untied = tiny_model(), tiny_model(tied_embed_stages=0)  # TINY's: tied for 2 stages
    assert tied.tied_embed and not untied.tied_embed
    # the head's draw comes after every weight but MUDD's and its gates' first layers and CPLM's pointer (drawn after
    # it, from the same generator): those differ, as draws, and every other weight is the same
    later = {"lm_head_w", "mudd_w1", "mudd_gate_w1", "copy_qk", "copy_sink"}
    for k, v in untied.state_dict().items():
        assert k in later or torch.equal(v, tied.state_dict()[k]), k
    assert untied.lm_head_w.abs().max() == 0 and 0.004 < tied.lm_head_w.std() < 0.006
    with torch.no_grad():
        tied.lm_head_w.add_(torch.randn_like(tied.lm_head_w))
        tied.embed.weight.normal_()  # unused while tied
        copy = tiny_model(tied_embed_stages=0)
        copy.load_state_dict(tied.state_dict())
        copy.embed.weight.copy_(tied.lm_head_w)  # what untying does
        x, y, cu = batch()
        torch.testing.assert_close(tied(x, y, cu, 128, W3, reduction="none"), copy(x, y, cu, 128, W3, reduction="none"),
                                   rtol=0, atol=0)
        tied.tied_embed = False  # now its own (random) table
        assert not torch.equal(tied(x, y, cu, 128, W3, reduction="none"), copy(x, y, cu, 128, W3, reduction="none"))


def test_untie_step_is_the_start_of_the_first_untied_stage():
    args = tg.Hyperparameters(**{**TINY, "num_iterations": 20})
    assert [st.start for st in tg.Schedule(args).stages] == [0, 7, 14]
    for n, step in ((0, 0), (1, 7), (2, 14), (3, math.inf)):
        assert tg.Schedule(tg.Hyperparameters(**{**TINY, "num_iterations": 20, "tied_embed_stages": n})).untie == step


def test_a_block_applies_its_weights_as_block_weights_says():
    """x <- resid x; x <- x + attn_out attention(norm(x), or attn_in when given) + x0_w x0 + bigram (ANVIL2's order);
    x <- mlp_resid x + mlp_out MLP(norm(x)), against the block's own attention and MLP called on their own."""
    model = tiny_model(randomize=True)
    block, T, dim = model.blocks[1], 128, TINY["model_dim"]  # attention, a value table, paired heads, XSA
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g)
    h, x0, ve, bigram, attn_in = r(T, dim), r(T, dim), r(T, dim), r(T, dim), tg.norm(r(T, dim))
    w = tg.BlockWeights(torch.tensor(0.9), r(T, 1), torch.tensor(0.7), torch.tensor(1.2), torch.tensor(0.4),
                        torch.tensor([0.6, 0.3]), bigram, r(T, TINY["num_heads"]))
    cu = torch.tensor([0, 60, T, T], dtype=torch.int32)
    rope = model.rotary.at(W3[0])
    with torch.no_grad():
        for given in (None, attn_in):
            out = block(h, x0, ve, w, given, cu, T, W3[1], rope)
            mixed = 0.9 * h
            mixed = (mixed + 0.7 * block.attn(tg.norm(mixed) if given is None else given, ve, w, cu, T, W3[1], rope)
                     + w.x0 * x0 + bigram)
            torch.testing.assert_close(out, 1.2 * mixed + 0.4 * block.mlp(tg.norm(mixed)), rtol=0, atol=0)
    # the model's per-block weights: the residual mix and value mix (4 each), the per-sublayer weights (3), one skip
    at, L = model.scalar_layout(), TINY["num_layers"]
    assert at["sublayer"].stop - at["sublayer"].start == 3 * L and at["skips"].stop - at["skips"].start == 1
    fresh = tiny_model()
    assert torch.allclose(fresh.scalars[at["sublayer"]].view(-1, 3), torch.tensor([1.0, 1.1 ** 0.5, 1.0]))
    assert torch.allclose(fresh.scalars[at["blocks"]].view(-1, 4), torch.tensor([1.1 ** 0.5, 0, 0.5, 0.5]))
    x, y, cu = batch()
    with torch.no_grad():
        base = model(x, y, cu, 128, W3)
        model.scalars[at["sublayer"].start + 2] = 0.5  # block 0's MLP output weight: the loss moves
        assert not torch.allclose(model(x, y, cu, 128, W3), base, rtol=1e-5)


def test_one_skip_carries_its_block_output_into_the_attention_less_block_and_learns():
    model = tiny_model(randomize=True)
    at = model.scalar_layout()
    x, y, cu = batch()
    model(x, y, cu, 128, W3).backward()
    assert model.scalars.grad[at["skips"]].abs().item() > 0
    with torch.no_grad():
        model.scalars[at["skips"]] = -30.0  # sigmoid ~ 0: no skip
        model.mudd_gate_w2.zero_()  # the MUDD gates' skip weight: 1 for every token
        parts = [what for what, _, _, _ in model.gate_parts[1]]
        start = model.gate_width + sum(n for _, _, n, _ in model.gate_parts[1][: parts.index("skip")])
        model.mudd_gate_b2[start] = 1 / model.mudd_gate_b2[-8]
    seen = []
    hook = model.blocks[2].register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    model(x, y, cu, 128, W3)
    with torch.no_grad():
        model.scalars[at["skips"]] = 0.0  # sigmoid = 0.5, times the MUDD gates' skip weight, 1 here
    after_1 = []
    h1 = model.blocks[1].register_forward_hook(lambda m, a, out: after_1.append(out.clone()))
    model(x, y, cu, 128, W3)
    hook.remove(), h1.remove()
    assert torch.allclose((seen[1] - seen[0]).float(), 0.5 * after_1[0].float(), rtol=2e-2, atol=2e-2)  # bf16 stream
    assert torch.equal(seen[0], after_1[0])  # without the skip, block 2 reads block 1's output as it is


def test_skip_from_must_come_before_the_attention_less_block():
    for bad in (2, 3, -1):  # -1: the U-net is gone
        with pytest.raises(ValueError, match="skip_from"):
            tg.Hyperparameters(**{**TINY, "skip_from": bad})

