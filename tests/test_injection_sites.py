"""no_x0_blocks, no_ngram_blocks, no_resid_scale_blocks: the per-block injections ANVIL2 (the public record #92) goes
without. Its train_gpt.py (printed at the start of records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-*.txt,
@fd1b14a5) injects x0 on layers {0,1,2,4,5,7} and the hashed bigram on {0,1,4,5,9} (`_NOINJ_X0 = (3, 8, 9)`,
`_NOINJ_BG = (2, 3, 7, 8)`, ~102k characters in), and its skip target, layer 6, only adds the skip before its MLP:
no residual lambda, no x0, no bigram (`elif i == 6:`, ~143k). A listed block has no MUDD-gate output for what it goes
without (not drawn, not counted, no gradient); its residual weight, where it is unscaled, is a scalar it no longer
reads. Off (all three empty), the model is the one built before the fields (tests/test_golden.py pins it)."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from conftest import FAST, compiled_matches_eager
from test_parallel_mlp import LAYOUT, W3
from test_skip_layers import ANVIL2, batch, count

# ANVIL2's injection sites on the 11-block TINY layout (the record's block indices), its second MLP in block 8 and an
# MLP narrower than 4 x model_dim (176 of 64; ANVIL2 has 2816 of 768): its whole architecture, as flags, scaled down
SITES = dict(no_x0_blocks=(3, 6, 8, 9), no_ngram_blocks=(2, 3, 6, 8), no_resid_scale_blocks=(6,))
WHOLE = dict(LAYOUT, parallel_mlp_blocks=(8,), mlp_hidden=176)
FULL = dict(WHOLE, **SITES)
# f64ee35's flags for ANVIL2, then these: its architecture as flags, the record's own values since ff18072
RECORD_FLAGS = [*ANVIL2, "--parallel_mlp_blocks", "8", "--mlp_hidden", "2816"]
SITE_FLAGS = ["--no_x0_blocks", "3,6,8,9", "--no_ngram_blocks", "2,3,6,8", "--no_resid_scale_blocks", "6"]


def model_of(config: dict, randomize: bool = False, **overrides) -> tg.GPT:
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters(**{**config, **overrides})))
    if randomize:  # the gates' second layers and the n-gram table start at zero: give every weight signal
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
    return model


def sites(model: tg.GPT, what: str) -> list[int]:
    """The blocks with a MUDD-gate output `what` (x0 or bigram), in block order."""
    return sorted(b for part in model.gate_layout() for w, b, _, _ in part if w == what)


def test_the_fields_parse_are_anvil2s_in_the_record_and_bad_blocks_are_refused_naming_them():
    default = tg.parse_args([])
    assert (default.no_x0_blocks, default.no_ngram_blocks, default.no_resid_scale_blocks) == \
        ((3, 6, 8, 9), (2, 3, 6, 8), (6,))
    assert tg.parse_args(RECORD_FLAGS + SITE_FLAGS) == default
    args = tg.parse_args(["--no_x0_blocks", "", "--no_ngram_blocks", "", "--no_resid_scale_blocks", ""])
    assert (args.no_x0_blocks, args.no_ngram_blocks, args.no_resid_scale_blocks) == ((), (), ())
    helps = tg.field_help()
    assert "no x0 injection" in helps["no_x0_blocks"] and "n-gram" in helps["no_ngram_blocks"]
    assert "unscaled" in helps["no_resid_scale_blocks"]
    for name in SITES:
        for bad in ((10,), (-1,), (3, 3), (11,)):  # the last block's weights are MUDD's
            with pytest.raises(ValueError, match=rf"{name}=\(.*\): distinct blocks 0-9, below the last"):
                tg.Hyperparameters(**{**LAYOUT, name: bad})
    with pytest.raises(ValueError, match=r"no_ngram_blocks=\(2, 7\): block\(s\) \[7\] removed \(skip_layers=\(7,\)\) "
                                         r"take no n-gram injection already"):
        tg.Hyperparameters(**{**LAYOUT, "no_ngram_blocks": (2, 7)})
    # a removed block keeps its x0 injection and residual weight unless told: both can go
    tg.Hyperparameters(**{**LAYOUT, "no_x0_blocks": (7,), "no_resid_scale_blocks": (7,)})


def test_on_the_record_the_injection_sites_are_anvil2s():
    """ANVIL2's comment over _NOINJ_X0 / _NOINJ_BG: "x0 residual injection on layers {0,1,2,4,5,7}, hashed-bigram
    injection on {0 (pre-loop), 1, 4, 5, 9} plus layer 10 riding mu[11]" (our last block's from MUDD, as before).
    The MUDD gates lose 8 outputs; their tensors keep 32 rows per gate (padded to a multiple of 8), so the
    parameter count of ANVIL2's architecture is unchanged by the fields."""
    before = tg.parse_args([*RECORD_FLAGS, "--no_x0_blocks", "", "--no_ngram_blocks", "",
                            "--no_resid_scale_blocks", ""])
    after = tg.parse_args([])  # the record's: ANVIL2's sites
    with torch.device("meta"):
        whole, model = (tg.GPT(tg.ModelConfig.from_args(a)) for a in (before, after))
    assert sites(whole, "x0") == list(range(10)) and sites(whole, "bigram") == [i for i in range(10) if i != 7]
    assert sites(model, "x0") == [0, 1, 2, 4, 5, 7] and sites(model, "bigram") == [0, 1, 4, 5, 9]
    live = [sum(n for part in m.gate_layout() for _, _, n, _ in part) for m in (whole, model)]
    assert live[0] - live[1] == 8
    assert whole.gate_width == model.gate_width == 32
    assert count(whole.parameters()) == count(model.parameters())


def test_a_listed_block_has_no_gate_output_and_the_gates_lose_exactly_those_rows():
    """The gates' layout is the one without the fields less (x0, i) and (bigram, i) of the listed blocks, in order;
    each gate tensor shrinks by its padded width (TINY: 24 -> 16 rows per gate), every other parameter the same."""
    whole, model = model_of(WHOLE), model_of(FULL)
    gone = {("x0", i) for i in SITES["no_x0_blocks"]} | {("bigram", i) for i in SITES["no_ngram_blocks"]}
    assert [e for part in model.gate_layout() for e in part] == [
        e for part in whole.gate_layout() for e in part if e[:2] not in gone]
    assert all(e[:2] in {(w, b) for w, b, _, _ in p} for p in whole.gate_layout() for e in p if e[:2] in gone)
    live = [sum(n for part in m.gate_layout() for _, _, n, _ in part) for m in (whole, model)]
    assert live[0] - live[1] == len(gone) == 8
    assert (whole.gate_width, model.gate_width) == (24, 16)
    rows = 2 * (whole.gate_width - model.gate_width)  # both gates' w2 rows and b2 entries
    assert count(whole.parameters()) - count(model.parameters()) == rows * (tg.MUDD_DIM + 1) == 1040
    a, b = tg.param_groups_by_role(whole), tg.param_groups_by_role(model)
    assert count(a["MUDD gates"]) - count(b["MUDD gates"]) == 1040
    assert all(count(a[name]) == count(b[name]) for name in a if name != "MUDD gates")
    sa, sb = whole.state_dict(), model.state_dict()
    assert sa.keys() == sb.keys()
    assert [k for k in sa if sa[k].shape != sb[k].shape] == ["mudd_gate_w2", "mudd_gate_b2"]
    # the scalars keep their layout: block 6's residual weight is a scalar it no longer reads
    assert model.scalar_layout() == whole.scalar_layout() and model.scalars.numel() == whole.scalars.numel()


def perturbed_x0_loss(model: tg.GPT, i: int) -> tuple[float, float]:
    """The loss, and the loss with x0 as block i receives it perturbed (only there: the gates and MUDD read the
    unperturbed x0)."""
    x, y, cu = batch()
    noise = torch.randn(128, model.cfg.model_dim, generator=torch.Generator().manual_seed(9))
    hook = model.blocks[i].register_forward_pre_hook(
        lambda m, args: (args[0], args[1] + noise.to(args[1].dtype), *args[2:]))
    with torch.no_grad():
        base = model(x, y, cu, 128, W3).item()
        hook.remove()
        return base, model(x, y, cu, 128, W3).item()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_block_without_x0_ignores_it_and_one_with_it_does_not(training):
    model = model_of(FULL, randomize=True).train(training)
    for i in range(10):
        with_noise, without = perturbed_x0_loss(model, i)
        if i in SITES["no_x0_blocks"]:
            assert with_noise == without, i
        else:  # the removed block 7 included: it keeps its x0 injection, as ANVIL2's
            assert with_noise != without, i


def test_a_block_without_the_ngram_embedding_ignores_the_table():
    """Every block below the last listed and the last block's n-gram weight (MUDD's) zero: the table changes nothing,
    bit for bit; with one block unlisted, the same change to the table moves the loss. In ANVIL2's layout the listed
    blocks receive no n-gram term and the others a weighted one that follows the table."""
    x, y, cu = batch()
    every = tuple(i for i in range(10) if i != 7)
    slot = list(tg.MUDD_BEFORE_LAST).index("bigram")
    losses = {}
    for listed in (every, tuple(i for i in every if i != 5)):
        model = model_of(LAYOUT, randomize=True, no_ngram_blocks=listed)
        with torch.no_grad():
            model.mudd_w2[slot].zero_()
            model.mudd_b2[slot].zero_()
            base = model(x, y, cu, 128, W3).item()
            model.bigram_embed.weight.add_(torch.randn(model.bigram_embed.weight.shape,
                                                       generator=torch.Generator().manual_seed(3)).bfloat16())
            losses[len(listed)] = (base, model(x, y, cu, 128, W3).item())
    assert losses[len(every)][0] == losses[len(every)][1]
    assert losses[len(every) - 1][0] != losses[len(every) - 1][1]
    model = model_of(FULL, randomize=True)
    seen = {}
    # Block(x, x0, ve, w, ...), SkippedBlock(x, x0, w): each block's weights as GPT.hidden gives them
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[3 if len(args) > 3 else 2]))
             for i, b in enumerate(model.blocks) if i < 10]
    with torch.no_grad():
        model(x, y, cu, 128, W3)
    for h in hooks:
        h.remove()
    for i in range(10):
        w = seen[i]
        # 7: removed, none; 0: its term starts the stream, before its attention (ANVIL2's)
        assert (w.bigram is None) == (i in SITES["no_ngram_blocks"] or i in (0, 7)), i
        assert (w.x0 is None) == (i in SITES["no_x0_blocks"]) and (w.resid is None) == (i == 6), i


def test_block_6_only_adds_the_skip_then_runs_its_mlp():
    """ANVIL2's layer 6: `x = x + skip_gate_out * cache[3]`, then the MLP with its residual weights. Block 6's output
    is mlp_resid x + mlp_out MLP(norm x) of its input x (the residual with the skip added), exactly; its residual
    weight (a scalar it no longer reads) takes no gradient and changing it changes nothing, while block 5's does."""
    model = model_of(FULL, randomize=True)
    x, y, cu = batch()
    seen = []
    hook = model.blocks[6].register_forward_hook(lambda m, args, out: seen.append((args, out)))
    loss = model(x, y, cu, 128, W3)
    hook.remove()
    (h, _, _, w, *_), out = seen[0]
    assert model.blocks[6].attn is None and w.resid is None and w.x0 is None and w.bigram is None
    with torch.no_grad():
        torch.testing.assert_close(out, w.mlp_resid * h + w.mlp_out * model.blocks[6].mlp(tg.norm(h)), rtol=0, atol=0)
    loss.backward()
    own = model.scalars.grad[model.scalar_layout()["blocks"]].view(11, 4)
    assert own[6, 0] == 0 and own[5, 0] != 0 and own[7, 0] != 0
    at = model.scalar_layout()["blocks"].start
    with torch.no_grad():
        model.scalars[at + 4 * 6] += 1.0
        assert model(x, y, cu, 128, W3).item() == loss.item()
        model.scalars[at + 4 * 5] += 1.0
        assert model(x, y, cu, 128, W3).item() != loss.item()


def test_the_residual_into_a_block_is_each_combination_of_scale_and_x0():
    """residual_in: resid x + x0_w x0, x0_w x0 left out where w.x0 is None, x unscaled where w.resid is None, in a
    Block and a removed block alike (a removed block in no_resid_scale_blocks: mlp_resid (x + x0_w x0))."""
    g = torch.Generator().manual_seed(2)
    x, x0 = (torch.randn(16, 8, generator=g) for _ in range(2))
    x0_w, resid = torch.randn(16, 1, generator=g), torch.tensor(1.3)
    rest = (torch.tensor(0.7), torch.tensor(0.9), torch.tensor(0.4), torch.tensor([0.5, 0.5]))
    for r, w0, want in ((resid, x0_w, 1.3 * x + x0_w * x0), (None, x0_w, x + x0_w * x0), (resid, None, 1.3 * x),
                        (None, None, x)):
        w = tg.BlockWeights(r, w0, *rest)
        torch.testing.assert_close(tg.residual_in(x, x0, w), want, rtol=0, atol=0)
        torch.testing.assert_close(tg.SkippedBlock()(x, x0, w), 0.9 * want, rtol=0, atol=0)
    model = model_of(LAYOUT, randomize=True, no_resid_scale_blocks=(5, 7))
    for i in (5, 7):  # unscaled, but still given x0
        with_noise, without = perturbed_x0_loss(model, i)
        assert with_noise != without, i


def test_at_the_start_x0_and_ngram_sites_change_nothing_and_the_residual_scale_does():
    """Their gate outputs start at zero (x0's) and the table at zero, so the model without the x0 and n-gram sites
    computes at initialisation what the model with them does, bit for bit (every weight drawn the same); an unscaled
    residual in block 6 (sqrt(1.1) at the start) changes it."""
    x, y, cu = batch()
    with torch.no_grad():
        whole = model_of(WHOLE)(x, y, cu, 128, W3).item()
        injections = model_of(WHOLE, no_x0_blocks=SITES["no_x0_blocks"],
                              no_ngram_blocks=SITES["no_ngram_blocks"])(x, y, cu, 128, W3).item()
        full = model_of(FULL)(x, y, cu, 128, W3).item()
    assert injections == whole and full != whole


def test_a_tiny_run_of_anvil2s_whole_architecture_learns_and_logs_the_fields(tiny_args):
    run = tg.train(tiny_args(**{**FULL, **FAST, "num_iterations": 16, "val_every": 8}))
    assert len(run.train_losses) == 16 and all(torch.isfinite(torch.tensor(run.train_losses)))
    val = [v for _, v in run.val_losses]
    assert val[-1] < val[0] - 0.3 and val[-1] < val[1]
    assert sum(run.train_losses[-4:]) < sum(run.train_losses[:4]) - 4 * 0.3
    log = open(run.log_path).read()
    for line in ("no_x0_blocks: (3, 6, 8, 9)", "no_ngram_blocks: (2, 3, 6, 8)", "no_resid_scale_blocks: (6,)",
                 "parallel_mlp_blocks: (8,)", "mlp_hidden: 176", "skip_layers: (7,)"):
        assert line + "\n" in log, line
    total = int(log.split(", parameters: ")[1].split("\n")[0].replace(",", ""))
    assert total == count(model_of(FULL).parameters()) == count(model_of(WHOLE).parameters()) - 1040


def test_checkpoints_hold_the_fields_a_resumed_run_continues_exactly_and_others_are_refused(tiny_args, tmp_path):
    every = 2 * tiny_args().adam_every
    run = {**FULL, **FAST, "num_iterations": 6, "val_every": 0}
    full = tg.train(tiny_args(**run, save_every=every, run_id="full", checkpoint_dir=str(tmp_path / "ck")))
    folder = tmp_path / "ck" / "full" / f"step_{every:06d}"
    saved = torch.load(folder / "model.pt", weights_only=True)
    for name, value in SITES.items():
        assert tuple(saved["args"][name]) == value
    assert saved["model"]["mudd_gate_w2"].shape[0] == 2 * 16
    resumed = tg.train(tiny_args(**run, run_id="again", resume=str(folder), checkpoint_dir=str(tmp_path / "ck2")))
    assert resumed.first_step == every and resumed.train_losses == full.train_losses[every:]
    # a checkpoint without a field, or of the architecture without these sites: a different model, named
    args = tiny_args(**FULL)
    old = tmp_path / "old" / "step_000002"
    old.mkdir(parents=True)
    stored = dataclasses.asdict(args)
    for name in SITES:
        for value, needle in ((None, rf"{name}: not a field when the checkpoint was written, now \("),
                              ([], rf"{name}: checkpoint \(\), now \(")):
            fields = {k: v for k, v in stored.items() if k != name}
            if value is not None:
                fields[name] = value
            torch.save(dict(model={}, step=2, args=fields, world_size=1, code_hash=tg.code_hash(),
                            training_time_ms=1.0, format=tg.CHECKPOINT_FORMAT), old / "model.pt")
            with pytest.raises(ValueError, match="different model: " + needle):
                tg.load_checkpoint(old, None, [], args, 0, 1, print)


def test_without_the_fields_every_block_takes_both_injections_and_its_residual_weight():
    model = model_of(LAYOUT)
    assert sites(model, "x0") == list(range(10)) and sites(model, "bigram") == [i for i in range(10) if i != 7]
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**LAYOUT))
    assert (cfg.no_x0_blocks, cfg.no_ngram_blocks, cfg.no_resid_scale_blocks) == ((), (), ())


@pytest.mark.slow
def test_the_model_with_the_fields_compiles_whole_and_computes_the_same():
    """torch.compile(fullgraph=True) takes the listed blocks (no graph break), with the eager model's arithmetic."""
    compiled_matches_eager(model_of(FULL, randomize=True), *batch(), 128, W3)
