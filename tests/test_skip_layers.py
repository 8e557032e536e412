"""skip_layers: blocks removed (the public record ANVIL2, #92, removes block 7 of 11). A removed block keeps its index,
its rows of scalars and its x0 gate output; it has no attention, no MLP, no parameters of its own and no bigram
injection: x <- mlp_resid (resid x + x0_w x0), ANVIL2's "residual structure intact"."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from conftest import FAST, TINY, compiled_matches_eager
from test_model import batch, tiny_model  # noqa: F401 (batch: for the files that import it from here)

# TINY on five blocks, so that one between the attention-less block (2) and the last can go: block 3 (short window,
# no XSA, paired heads or value table), which is also the backout block
FIVE = dict(TINY, num_layers=5, window_pattern="LSSSL", value_embed_blocks=(1, 4), backout_layer=3)
SKIP3 = dict(FIVE, skip_layers=(3,))
# ANVIL2's layout on the record: block 7 removed, no attention in 4 and 9 (and 6), and what referenced them gone
ANVIL2 = ["--skip_layers", "7", "--no_attn_layers", "4,6,9", "--skip_into", "6", "--xsa_blocks", "1,3",
          "--paired_head_blocks", "0,2,5", "--value_embed_blocks", "1,2,8,10"]
# the record's layout before ANVIL2's (--plan's BEFORE_ANVIL2), and the rest of ANVIL2's architecture off: its
# second MLP, MLP width, injection sites and narrow heads
BEFORE = ["--skip_layers", "", "--no_attn_layers", "6", "--skip_into", "0", "--xsa_blocks", "1,3,4,7",
          "--paired_head_blocks", "0,2,5,9", "--value_embed_blocks", "1,2,8,9,10"]
REST_OFF = ["--parallel_mlp_blocks", "", "--mlp_hidden", "0", "--no_x0_blocks", "", "--no_ngram_blocks", "",
            "--no_resid_scale_blocks", "", "--narrow_qk_blocks", "", "--narrow_v_blocks", ""]
W3 = tg.window_tokens(3, TINY["window_block"])


def model_of(config: dict, randomize: bool = False, **overrides) -> tg.GPT:
    """test_model's tiny model on this config (TINY and its variants), every weight given signal if randomize."""
    return tiny_model(randomize, **{**config, **overrides})


def count(params) -> int:
    return sum(p.numel() for p in params)


def test_a_removed_block_has_no_parameters_and_the_model_loses_exactly_that_block():
    whole, skipped = model_of(FIVE), model_of(SKIP3)
    assert isinstance(skipped.blocks[3], tg.SkippedBlock) and list(skipped.blocks[3].parameters()) == []
    assert [type(b) for i, b in enumerate(skipped.blocks) if i != 3] == [tg.Block] * 4
    # the other blocks keep their index and checkpoint keys; only block 3's are gone
    assert set(skipped.state_dict()) == {k for k in whole.state_dict() if not k.startswith("blocks.3.")}
    block = count(whole.blocks[3].parameters())
    assert block == 4 * (2 * 32) * 64 + 2 * 64 * (4 * 64)  # Q, K, V, O of 2 heads of 32; the MLP's two matrices
    groups, before = tg.param_groups_by_role(skipped), tg.param_groups_by_role(whole)
    assert count(before["block matrices"]) - count(groups["block matrices"]) == block
    # its rows of scalars stay (ANVIL2 keeps block 7's residual weights), and its x0 gate output, not the bigram's
    assert skipped.scalar_layout() == whole.scalar_layout() and skipped.scalars.numel() == whole.scalars.numel()
    assert [e[0] for part in skipped.gate_layout() for e in part if e[1] == 3] == ["x0"]
    assert ([e for part in skipped.gate_layout() for e in part]
            == [e for part in whole.gate_layout() for e in part if e[:2] != ("bigram", 3)])
    # so the model loses one block's parameters and the MUDD gates' rows of its bigram output (its weight), which the
    # gates' padding to a multiple of 8 may absorb
    gate_rows = 2 * (whole.gate_width - skipped.gate_width) * (tg.MUDD_DIM + 1)
    assert count(whole.parameters()) - count(skipped.parameters()) == block + gate_rows
    for name in groups:
        if name not in ("block matrices", "MUDD gates"):
            assert count(groups[name]) == count(before[name]), name


def with_block_reduced_to_its_residual(skipped: tg.GPT, config: dict, i: int) -> tg.GPT:
    """The reference: the same model without skip_layers (block i built, with its scalars and gate outputs), every
    weight copied from `skipped`, and block i's attention and MLP outputs left out: mlp_resid (resid x + x0_w x0).
    Its own matrices and its bigram weight are then unused."""
    whole = model_of(config)
    state = whole.state_dict()
    for name, value in skipped.state_dict().items():
        if name not in ("mudd_gate_w2", "mudd_gate_b2"):
            state[name] = value.clone()
    w2, b2 = state["mudd_gate_w2"].clone(), state["mudd_gate_b2"].clone()
    for j in range(2):  # each gate output's rows, where the reference has them
        starts = {}
        for src, width, out in ((skipped, skipped.gate_width, starts), (whole, whole.gate_width, None)):
            start = j * width
            for what, b, n, _ in src.gate_parts[j]:
                if out is not None:
                    out[what, b] = (start, n)
                elif (what, b) in starts:
                    s, _ = starts[what, b]
                    w2[start: start + n] = skipped.mudd_gate_w2.detach()[s: s + n]
                    b2[start: start + n] = skipped.mudd_gate_b2.detach()[s: s + n]
                start += n
    b2[-8:] = skipped.mudd_gate_b2.detach()[-8:]  # the gates' common scale
    state.update(mudd_gate_w2=w2, mudd_gate_b2=b2)
    whole.load_state_dict(state)
    whole.blocks[i].forward = lambda x, x0, ve, w, *rest: w.mlp_resid * (w.resid * x + w.x0 * x0)
    return whole


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_forward_equals_the_whole_model_with_that_block_reduced_to_its_residual(training):
    skipped = model_of(SKIP3, randomize=True)
    reference = with_block_reduced_to_its_residual(skipped, FIVE, 3)
    x, y, cu = batch()
    skipped.train(training), reference.train(training)
    loss, expected = skipped(x, y, cu, 128, W3), reference(x, y, cu, 128, W3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert loss.item() != model_of(FIVE, randomize=True)(x, y, cu, 128, W3).item()  # block 3's sublayers did matter


def test_at_the_start_a_removed_block_scales_the_residual_by_1_1():
    """At initialisation (x0's gate output 0, both residual weights sqrt(1.1)) the removed block multiplies the
    residual by 1.1, as ANVIL2's block 7 does with its two residual lambdas; a pass-through would leave it."""
    model = model_of(SKIP3)
    x, y, cu = batch()
    seen = []
    hook = model.blocks[3].register_forward_hook(lambda m, args, out: seen.append((args[0], out)))
    model(x, y, cu, 128, W3)
    hook.remove()
    assert len(seen) == 1 and seen[0][0].abs().max() > 0
    # two bf16 roundings (x sqrt(1.1), twice) apart; a pass-through would be 10% off
    torch.testing.assert_close(seen[0][1].float(), 1.1 * seen[0][0].float(), rtol=2e-2, atol=1e-2)


def test_the_removed_block_learns_its_residual_weights_and_x0_gate_but_no_bigram_weight():
    """The removed block's scalars (the residual's weight, the residual's weight around the MLP) and its x0 gate rows
    take gradients; its attention-output and MLP-output weights, which it does not read, take none."""
    model = model_of(SKIP3, randomize=True)
    x, y, cu = batch()
    model(x, y, cu, 128, W3).backward()
    at, grad = model.scalar_layout(), model.scalars.grad
    own, sub = grad[at["blocks"]].view(5, 4), grad[at["sublayer"]].view(5, 3)
    assert own[3, 0] != 0 and sub[3, 1] != 0  # read: resid, mlp_resid
    assert own[3, 2:].abs().sum() == 0 and sub[3, 0] == 0 and sub[3, 2] == 0  # unread: value mix, attn_out, mlp_out
    rows = {}
    for j in range(2):
        start = j * model.gate_width
        for what, b, n, _ in model.gate_parts[j]:
            rows[what, b] = slice(start, start + n)
            start += n
    assert model.mudd_gate_w2.grad[rows["x0", 3]].abs().sum() > 0 and ("bigram", 3) not in rows


def test_a_few_training_steps_learn_and_log_the_field(tiny_args):
    run = tg.train(tiny_args(**{**SKIP3, **FAST, "num_iterations": 4, "val_every": 0}))
    assert len(run.train_losses) == 4 and all(torch.isfinite(torch.tensor(run.train_losses)))
    assert run.val_losses and torch.isfinite(torch.tensor(run.val_losses[-1][1]))
    log = open(run.log_path).read()
    assert "skip_layers: (3,)\n" in log and "skip_into: 0\n" in log  # the hyperparameter dump


@pytest.mark.parametrize("overrides, needle", [
    (dict(skip_layers=(0,)), r"skip_layers=\(0,\): distinct blocks between the first and the last \(4"),
    (dict(skip_layers=(4,)), r"skip_layers=\(4,\): distinct blocks between the first and the last"),
    (dict(skip_layers=(9,)), r"skip_layers=\(9,\): distinct blocks"),
    (dict(skip_layers=(3, 3)), r"skip_layers=\(3, 3\): distinct blocks"),
    (dict(skip_layers=(2,)), r"skip_layers=\(2,\): block\(s\) \[2\] also in no_attn_layers=\(2,\).*take it out of "
                             "no_attn_layers"),
    (dict(skip_layers=(3,), xsa_blocks=(1, 3)), r"block\(s\) \[3\] also in xsa_blocks=\(1, 3\)"),
    (dict(skip_layers=(3,), paired_head_blocks=(1, 3)), r"block\(s\) \[3\] also in paired_head_blocks=\(1, 3\)"),
    (dict(skip_layers=(3,), value_embed_blocks=(1, 3, 4)), r"block\(s\) \[3\] also in value_embed_blocks"),
    (dict(skip_layers=(1,)), r"skip_layers=\(1,\): block\(s\) \[1\] also in xsa_blocks"),
    (dict(skip_layers=(3,), window_pattern="LSSLL"), r"skip_layers=\(3,\): a removed block has no attention "
                                                     r"window, but window_pattern='LSSLL'.*mark it S"),
    (dict(skip_into=3), r"skip_into=3: the attention-less block the skip goes into, one of no_attn_layers=\(2,\)"),
    (dict(no_attn_layers=(2, 3), skip_into=3, skip_from=3), r"skip_from=3: a block before the attention-less one "
                                                            r"the skip goes into \(skip_into=3"),
    (dict(window_pattern="SLSSL", no_attn_layers=(1, 2), skip_into=1, value_embed_blocks=(3, 4),
          paired_head_blocks=(3,), xsa_blocks=(3,), skip_from=0),
     r"window_pattern='SLSSL': the MUDD gates need a long-window block \(L\) .* goes into \(1\)"),
])
def test_invalid_layouts_are_refused_naming_the_field(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        tg.Hyperparameters(**{**FIVE, **overrides})


def test_the_layout_before_refuses_block_7_alone_and_the_record_takes_anvil2s_layout():
    """On the layout before ANVIL2's, --skip_layers 7 alone: refused, naming xsa_blocks (its XSA was on 1,3,4,7);
    ANVIL2's layout, the record's, has seven attention sublayers {0,1,2,3,5,8,10}, ten MLPs and the skip still into
    block 6 (--skip_into 6: the first attention-less block is now 4, right after the skip's source 3)."""
    with pytest.raises(ValueError, match=r"skip_layers=\(7,\): block\(s\) \[7\] also in xsa_blocks=\(1, 3, 4, 7\)"):
        tg.parse_args([*BEFORE, "--skip_layers", "7"])
    record, args = tg.parse_args([*BEFORE, *REST_OFF]), tg.parse_args([*ANVIL2, *REST_OFF])
    assert all(getattr(tg.parse_args([]), k) == getattr(args, k) for k in ("skip_layers", "no_attn_layers", "skip_into",
                                                                          "xsa_blocks", "paired_head_blocks",
                                                                          "value_embed_blocks"))
    with torch.device("meta"):
        whole, model = (tg.GPT(tg.ModelConfig.from_args(a)) for a in (record, args))
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None] == [0, 1, 2, 3, 5, 8, 10]
    assert [i for i, b in enumerate(model.blocks) if b.mlp is not None] == [i for i in range(11) if i != 7]
    assert model.cfg.skip_target == 6 and whole.cfg.skip_target == 6
    assert tg.ModelConfig.from_args(tg.parse_args([*ANVIL2, "--skip_into", "0"])).skip_target == 4  # the first one
    # one block, two attention sublayers (4, 9) and block 9's value-embedding gate fewer in the block matrices
    attn = count(whole.blocks[4].attn.parameters())
    gate = whole.blocks[9].attn.ve_gate_w.numel()
    before, after = tg.param_groups_by_role(whole), tg.param_groups_by_role(model)
    assert count(before["block matrices"]) - count(after["block matrices"]) == (
        count(whole.blocks[7].parameters()) + 2 * attn + gate)
    assert count(before["value embeddings"]) - count(after["value embeddings"]) == record.vocab_size * 768
    estimate, was = tg.memory_estimate(model, args, 8), tg.memory_estimate(whole, record, 8)
    assert estimate["activations"] * 11 == was["activations"] * 10
    assert estimate["weights + grads"] < was["weights + grads"]


def test_a_checkpoint_from_before_the_field_is_refused_naming_it(tiny_args, tmp_path):
    """skip_layers is a model field: a checkpoint whose stored hyperparameters lack it is refused, as for every model
    field added after a checkpoint was written (load_checkpoint), and so is one of another layout."""
    args = tiny_args(**SKIP3)
    folder = tmp_path / "step_000002"
    folder.mkdir()
    stored = dataclasses.asdict(args)

    def save(**changes):
        saved = {**stored, **changes}
        for k in [k for k, v in changes.items() if v is None]:
            del saved[k]
        torch.save(dict(model={}, step=2, args=saved, world_size=1, code_hash=tg.code_hash(), training_time_ms=1.0,
                        format=tg.CHECKPOINT_FORMAT), folder / "model.pt")
    save(skip_layers=None)
    with pytest.raises(ValueError, match=r"different model: skip_layers: not a field when the checkpoint was written, "
                                         r"now \(3,\)"):
        tg.load_checkpoint(folder, None, [], args, 0, 1, print)
    save(skip_layers=[])  # written by a run without it
    with pytest.raises(ValueError, match=r"different model: skip_layers: checkpoint \(\), now \(3,\)"):
        tg.load_checkpoint(folder, None, [], args, 0, 1, print)


def test_without_skip_layers_the_model_is_built_as_before():
    """skip_layers=() (the default): every block a Block with its four + three scalars and its gate outputs, the
    skip into the first attention-less block; skip_into 0 and skip_into naming that block build the same weights
    and give the same loss, bit for bit."""
    model = model_of(FIVE, randomize=True)
    cfg = model.cfg
    assert cfg.skip_layers == () and cfg.skip_target == 2
    assert all(type(b) is tg.Block for b in model.blocks)
    at = model.scalar_layout()
    assert (at["blocks"].stop - at["blocks"].start, at["sublayer"].stop - at["sublayer"].start) == (4 * 5, 3 * 5)
    assert {b for part in model.gate_layout() for what, b, _, _ in part if what == "x0"} == {0, 1, 2, 3}
    named = model_of(FIVE, randomize=True, skip_into=2)
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), named.state_dict().values()))
    x, y, cu = batch()
    assert torch.equal(model(x, y, cu, 128, W3), named(x, y, cu, 128, W3))


@pytest.mark.slow
def test_the_model_with_a_removed_block_compiles_whole_and_computes_the_same():
    """torch.compile(fullgraph=True) takes the removed block (no graph break), with the eager model's arithmetic."""
    compiled_matches_eager(model_of(SKIP3, randomize=True), *batch(), 128, W3)
