"""parallel_mlp_blocks: a second MLP beside a block's own (the public record ANVIL2, #92, runs one in block 8 from its
MLP bank's slot 11). Both read the same normed input, the second's output projection starts at zero, and their outputs
are summed under the block's MLP output weight: x <- mlp_resid x + mlp_out (MLP(norm x) + MLP'(norm x)). It is an MLP
of the block's kind (fused ReLU², FP8), learned by Muon in the MLP matrices' groups, drawn after every other weight."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from conftest import FAST, TINY, compiled_matches_eager
from test_skip_layers import ANVIL2, batch, count

# ANVIL2's layout on an 11-block TINY (the record's block indices): block 7 removed, no attention in 4, 6, 9, the skip
# from 3 into 6, backout at the removed block 7, XSA, paired heads and value tables where ANVIL2 has them
LAYOUT = dict(TINY, num_layers=11, window_pattern="SSSLSSSSSSL", skip_layers=(7,), no_attn_layers=(4, 6, 9),
              skip_into=6, skip_from=3, backout_layer=7, xsa_blocks=(1, 3), paired_head_blocks=(0, 2, 5),
              value_embed_blocks=(1, 2, 8, 10))
PARALLEL = dict(LAYOUT, parallel_mlp_blocks=(8,))
W3 = tg.window_tokens(3, TINY["window_block"])
KERNELS = {"unfused": tg.ModelKernels(), "fused": tg.ModelKernels(fused_mlp=True),
           "fp8": tg.ModelKernels(fused_mlp=True, fp8_mlp=True)}  # the CPU runs the ops' float32 references


def model_of(config: dict, kernels=tg.ModelKernels(), **overrides) -> tg.GPT:
    torch.manual_seed(0)
    return tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters(**{**config, **overrides})), kernels)


def randomized_pair(kernels=tg.ModelKernels(), config=LAYOUT, block=8):
    """(without, with): the model without a second MLP and with one in `block`, every weight they share the same and
    given signal (zero-initialised weights would hide paths); the second MLP as drawn (its projection zero)."""
    without, with_ = model_of(config, kernels), model_of(config, kernels, parallel_mlp_blocks=(block,))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in without.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g).to(p.dtype))
    missing, unexpected = with_.load_state_dict(without.state_dict(), strict=False)
    assert sorted(missing) == [f"blocks.{block}.parallel_mlp.fc_w", f"blocks.{block}.parallel_mlp.proj_w"]
    assert unexpected == []
    return without, with_


def test_the_field_parses_and_invalid_blocks_are_refused_naming_it():
    assert tg.parse_args([]).parallel_mlp_blocks == (8,)  # the record's, ANVIL2's
    assert tg.parse_args(ANVIL2 + ["--parallel_mlp_blocks", ""]).parallel_mlp_blocks == ()
    assert "second MLP" in tg.field_help()["parallel_mlp_blocks"]  # its --help
    with pytest.raises(ValueError, match=r"skip_layers=\(7,\): block\(s\) \[7\] also in parallel_mlp_blocks=\(7,\)"):
        tg.Hyperparameters(**{**LAYOUT, "parallel_mlp_blocks": (7,)})  # a removed block has no MLP to sit beside
    for bad in ((11,), (-1,), (8, 8)):
        with pytest.raises(ValueError, match=r"parallel_mlp_blocks=.*: distinct blocks 0-10"):
            tg.Hyperparameters(**{**LAYOUT, "parallel_mlp_blocks": bad})


def test_it_is_one_more_mlp_of_the_blocks_kind_drawn_after_every_other_weight():
    """The same seed draws every other weight as without it; the second MLP adds exactly one MLP's parameters (the
    block matrices), its FLOPs and its activations, its input matrix drawn as an MLP's and its projection zero."""
    without, with_ = model_of(LAYOUT), model_of(PARALLEL)
    a, b = without.state_dict(), with_.state_dict()
    new = {"blocks.8.parallel_mlp.fc_w", "blocks.8.parallel_mlp.proj_w"}
    assert set(b) - set(a) == new and set(a) <= set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    mlp, extra = with_.blocks[8].mlp, with_.blocks[8].parallel_mlp
    assert type(extra) is tg.MLP and extra.fc_w.shape == mlp.fc_w.shape and extra.proj_w.shape == mlp.proj_w.shape
    assert torch.count_nonzero(extra.proj_w) == 0
    bound = 3 ** 0.5 * 0.5 / TINY["model_dim"] ** 0.5  # uniform_init_'s, as the block's own input matrix
    assert extra.fc_w.abs().max() <= bound and extra.fc_w.std() > 0.5 * mlp.fc_w.std()
    assert not torch.equal(extra.fc_w, mlp.fc_w)  # a draw of its own
    assert all(b.parallel_mlp is None for i, b in enumerate(with_.blocks) if i != 8)
    one = count(mlp.parameters())
    assert one == 2 * 64 * 4 * 64
    assert count(with_.parameters()) - count(without.parameters()) == one
    before, after = tg.param_groups_by_role(without), tg.param_groups_by_role(with_)
    assert count(after["block matrices"]) - count(before["block matrices"]) == one
    assert all(count(after[name]) == count(before[name]) for name in before if name != "block matrices")
    windows, cut = W3, 64
    assert tg.flops_per_token(with_, windows, cut) - tg.flops_per_token(without, windows, cut) == 6 * one
    args_a, args_b = (tg.Hyperparameters(**c) for c in (LAYOUT, PARALLEL))
    est_a, est_b = tg.memory_estimate(without, args_a, 1), tg.memory_estimate(with_, args_b, 1)
    assert est_b["activations"] - est_a["activations"] == 16 * args_a.seq_len * args_a.model_dim
    assert est_b["weights + grads"] - est_a["weights + grads"] == 2 * 4 * one  # float32 here
    for name, kernels in KERNELS.items():  # the block's kernels
        block = model_of(PARALLEL, kernels).blocks[8]
        assert (block.parallel_mlp.fused, block.parallel_mlp.fp8) == (block.mlp.fused, block.mlp.fp8), name


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kernels", list(KERNELS))
def test_at_the_start_the_model_computes_what_it_did_without_it(kernels, training):
    """Its projection zero, the second MLP adds nothing, bit for bit, on every MLP path (the fused ReLU², the FP8
    one in training); given a projection, the same model's loss moves."""
    without, with_ = randomized_pair(KERNELS[kernels])
    x, y, cu = batch()
    without.train(training), with_.train(training)
    with torch.no_grad():
        assert torch.equal(with_(x, y, cu, 128, W3), without(x, y, cu, 128, W3))
        with_.blocks[8].parallel_mlp.proj_w.normal_(0, 0.1, generator=torch.Generator().manual_seed(6))
        assert with_(x, y, cu, 128, W3).item() != without(x, y, cu, 128, W3).item()


def test_the_block_sums_both_mlps_of_the_same_normed_input_under_its_mlp_output_weight():
    """x <- mlp_resid x + mlp_out (MLP(norm x) + MLP'(norm x)), x the residual after the attention and the injections
    that join after it (ANVIL2's order; ANVIL2: both read `normed`, both outputs times
    post_lambdas_mlp[8]), against the two MLPs called on their own."""
    model = randomized_pair(config=TINY, block=1)[1]
    block, T, dim = model.blocks[1], 128, TINY["model_dim"]
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g)
    with torch.no_grad():
        block.parallel_mlp.proj_w.copy_(0.1 * r(*block.parallel_mlp.proj_w.shape))
    h, x0, ve, bigram = r(T, dim), r(T, dim), r(T, dim), r(T, dim)
    w = tg.BlockWeights(torch.tensor(0.9), r(T, 1), torch.tensor(0.7), torch.tensor(1.2), torch.tensor(0.4),
                        torch.tensor([0.6, 0.3]), bigram, r(T, TINY["num_heads"]))
    cu, rope = torch.tensor([0, 60, T, T], dtype=torch.int32), model.rotary.at(W3[0])
    with torch.no_grad():
        out = block(h, x0, ve, w, None, cu, T, W3[1], rope)
        mixed = 0.9 * h
        mixed = mixed + 0.7 * block.attn(tg.norm(mixed), ve, w, cu, T, W3[1], rope) + w.x0 * x0 + bigram
        n = tg.norm(mixed)
        torch.testing.assert_close(out, 1.2 * mixed + 0.4 * (block.mlp(n) + block.parallel_mlp(n)), rtol=0, atol=0)
        assert (block.parallel_mlp(n).norm() > 0.1 * block.mlp(n).norm()).item()  # the second MLP did count


def muon_of(model: tg.GPT, config: dict) -> tg.Muon:
    return tg.build_optimizers(model, tg.Hyperparameters(**config), 0, 1)[1]


def test_muon_learns_it_in_the_mlp_groups_at_the_mlp_rates():
    """Its two matrices are in the Muon groups of the MLP matrices (lr x 2 on the input, x 4 on the output, the
    record's mlp_muon_lr_mults; one weight decay and momentum): given the block's own MLP's weights and gradients,
    each moves exactly as the block's."""
    model = model_of(PARALLEL)
    muon = muon_of(model, PARALLEL)
    mlp, extra = model.blocks[8].mlp, model.blocks[8].parallel_mlp
    group = {id(p): grp for grp in muon.param_groups for p in grp["params"]}
    assert group[id(extra.fc_w)] is group[id(mlp.fc_w)] and group[id(extra.proj_w)] is group[id(mlp.proj_w)]
    assert (group[id(extra.fc_w)]["lr_mult"], group[id(extra.proj_w)]["lr_mult"]) == (2.0, 4.0)
    assert group[id(extra.fc_w)]["weight_decay"] == tg.Hyperparameters().muon_weight_decay > 0
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for own, twin in ((mlp.fc_w, extra.fc_w), (mlp.proj_w, extra.proj_w)):
            own.copy_(0.05 * torch.randn(own.shape, generator=g))
            twin.copy_(own)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for own, twin in ((mlp.fc_w, extra.fc_w), (mlp.proj_w, extra.proj_w)):
        own.grad = torch.randn(own.shape, generator=g)
        twin.grad = own.grad.clone()
    for step in range(2):  # the second step with momentum and NorMuon's second moments
        before = extra.proj_w.detach().clone()
        muon.step()
        for own, twin in ((mlp.fc_w, extra.fc_w), (mlp.proj_w, extra.proj_w)):
            torch.testing.assert_close(twin, own, rtol=0, atol=0)
        assert not torch.equal(extra.proj_w, before)


def test_a_training_step_trains_it_and_then_it_changes_the_output():
    """Step 1: its projection (zero) takes a gradient and Muon's update, its input matrix none (the projection is
    zero, as for every MLP at the start); then the model differs from itself without the second MLP. Step 2: both
    matrices take gradients and move."""
    _, model = randomized_pair()
    extra = model.blocks[8].parallel_mlp
    muon = muon_of(model, PARALLEL)
    x, y, cu = batch()
    start = {n: p.detach().clone() for n, p in extra.named_parameters()}
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(x, y, cu, 128, W3).backward()
        assert extra.proj_w.grad.abs().sum() > 0
        assert (extra.fc_w.grad.abs().sum() > 0) == (step == 1)
        muon.step()
        if step == 0:
            assert not torch.equal(extra.proj_w, start["proj_w"])
            with torch.no_grad():
                trained = model(x, y, cu, 128, W3)
                model.blocks[8].parallel_mlp = None  # the same weights without it
                assert model(x, y, cu, 128, W3).item() != trained.item()
                model.blocks[8].parallel_mlp = extra
    assert not torch.equal(extra.fc_w, start["fc_w"]) and not torch.equal(extra.proj_w, start["proj_w"])


def test_a_run_of_anvil2s_layout_with_it_learns_and_starts_as_the_run_without(tiny_args):
    """The layout's flags plus parallel_mlp_blocks 8 on an 11-block TINY: the run learns; its first step's loss is
    the run without it, bit for bit (every other weight drawn the same), and its later losses differ; the log dumps
    the field and counts the MLP's parameters in the block matrices."""
    runs = [tg.train(tiny_args(**{**config, **FAST, "num_iterations": 16, "val_every": 8}))
            for config in (PARALLEL, LAYOUT)]
    run, plain = runs
    assert len(run.train_losses) == 16 and all(torch.isfinite(torch.tensor(run.train_losses)))
    val = [v for _, v in run.val_losses]
    assert val[-1] < val[0] - 0.3 and val[-1] < val[1]
    assert sum(run.train_losses[-4:]) < sum(run.train_losses[:4]) - 4 * 0.3
    assert run.train_losses[0] == plain.train_losses[0] and run.train_losses[-1] != plain.train_losses[-1]
    log, plain_log = (open(r.log_path).read() for r in runs)
    assert "parallel_mlp_blocks: (8,)\n" in log and "parallel_mlp_blocks: ()\n" in plain_log
    matrices = [int(text.split("parameters: block matrices ")[1].split("\n")[0].replace(",", ""))
                for text in (log, plain_log)]
    assert matrices[0] - matrices[1] == 2 * 64 * 4 * 64


def test_with_mlp_hidden_it_is_built_counted_and_learned_at_that_width(tiny_args):
    """ANVIL2's layout with its second MLP in block 8 and an MLP width set by mlp_hidden (176 on TINY's model_dim 64,
    not 4 x 64 = 256; ANVIL2 has 2816 at 768): the second MLP's two matrices have that width, as the block's own, and
    the estimates count one more MLP of it (parameters, FLOPs, activations); Muon gives its matrices the block's MLP
    rates. A run's first loss is the run without it, and its log counts exactly one more MLP of that width."""
    hidden, dim = 176, TINY["model_dim"]
    wide, plain = dict(PARALLEL, mlp_hidden=hidden), dict(LAYOUT, mlp_hidden=hidden)
    with_, without = model_of(wide), model_of(plain)
    mlp, extra = with_.blocks[8].mlp, with_.blocks[8].parallel_mlp
    assert with_.cfg.mlp_hidden == hidden and hidden != 4 * dim
    assert extra.fc_w.shape == extra.proj_w.shape == mlp.fc_w.shape == mlp.proj_w.shape == (dim, hidden)
    assert torch.count_nonzero(extra.proj_w) == 0
    one = 2 * dim * hidden
    assert count(with_.parameters()) - count(without.parameters()) == one
    groups = [tg.param_groups_by_role(m)["block matrices"] for m in (with_, without)]
    assert count(groups[0]) - count(groups[1]) == one
    assert tg.flops_per_token(with_, W3, 64) - tg.flops_per_token(without, W3, 64) == 6 * one
    args_with, args_without = tg.Hyperparameters(**wide), tg.Hyperparameters(**plain)
    est = [tg.memory_estimate(m, a, 1) for m, a in ((with_, args_with), (without, args_without))]
    assert est[0]["activations"] - est[1]["activations"] == 2 * args_with.seq_len * 2 * hidden  # bf16 pre and post
    group = {id(p): g for g in muon_of(with_, wide).param_groups for p in g["params"]}
    assert group[id(extra.fc_w)] is group[id(mlp.fc_w)] and group[id(extra.proj_w)] is group[id(mlp.proj_w)]
    assert (group[id(extra.fc_w)]["lr_mult"], group[id(extra.proj_w)]["lr_mult"]) == (2.0, 4.0)
    runs = [tg.train(tiny_args(**{**config, **FAST, "num_iterations": 3, "val_every": 0})) for config in (wide, plain)]
    assert runs[0].train_losses[0] == runs[1].train_losses[0]
    assert runs[0].train_losses[-1] != runs[1].train_losses[-1]
    logs = [open(r.log_path).read() for r in runs]
    assert all("mlp_hidden: 176\n" in log for log in logs)
    total = [int(log.split(", parameters: ")[1].split("\n")[0].replace(",", "")) for log in logs]
    assert total[0] == total[1] + one == count(with_.parameters())


def test_checkpoints_hold_it_a_resumed_run_continues_exactly_and_a_checkpoint_without_it_is_refused(
        tiny_args, tmp_path):
    every = 2 * tiny_args().adam_every
    run = {**PARALLEL, **FAST, "num_iterations": 6, "val_every": 0}
    full = tg.train(tiny_args(**run, save_every=every, run_id="full", checkpoint_dir=str(tmp_path / "ck")))
    saved = torch.load(tmp_path / "ck" / "full" / f"step_{every:06d}" / "model.pt", weights_only=True)
    weights = saved["model"]
    assert weights["blocks.8.parallel_mlp.proj_w"].abs().sum() > 0  # trained, and saved
    assert weights["blocks.8.parallel_mlp.fc_w"].shape == weights["blocks.8.mlp.fc_w"].shape
    assert tuple(saved["args"]["parallel_mlp_blocks"]) == (8,)
    resumed = tg.train(tiny_args(**run, run_id="again", resume=str(tmp_path / "ck" / "full" / f"step_{every:06d}"),
                                 checkpoint_dir=str(tmp_path / "ck2")))
    assert resumed.first_step == every and resumed.train_losses == full.train_losses[every:]
    # the layout's checkpoint without the field, or with it empty: a different model, named
    args = tiny_args(**PARALLEL)
    folder = tmp_path / "old" / "step_000002"
    folder.mkdir(parents=True)
    stored = dataclasses.asdict(args)
    for value, needle in ((None, r"parallel_mlp_blocks: not a field when the checkpoint was written, now \(8,\)"),
                          ([], r"parallel_mlp_blocks: checkpoint \(\), now \(8,\)")):
        fields = {k: v for k, v in stored.items() if k != "parallel_mlp_blocks"}
        if value is not None:
            fields["parallel_mlp_blocks"] = value
        torch.save(dict(model={}, step=2, args=fields, world_size=1, code_hash=tg.code_hash(), training_time_ms=1.0,
                        format=tg.CHECKPOINT_FORMAT), folder / "model.pt")
        with pytest.raises(ValueError, match="different model: " + needle):
            tg.load_checkpoint(folder, None, [], args, 0, 1, print)


def test_without_it_the_blocks_are_built_as_before():
    """parallel_mlp_blocks=() (the default): no block has a second MLP and the parameters are the ones drawn before
    the field existed (the golden losses, tests/test_golden.py, pin the arithmetic)."""
    model = model_of(TINY)
    assert all(b.parallel_mlp is None for b in model.blocks)
    assert not any("parallel_mlp" in name for name in model.state_dict())
    assert tg.ModelConfig.from_args(tg.Hyperparameters(**TINY)).parallel_mlp_blocks == ()


@pytest.mark.slow
def test_the_model_with_it_compiles_whole_and_computes_the_same():
    """torch.compile(fullgraph=True) takes the second MLP (no graph break), with the eager model's arithmetic,
    gradients included."""
    model = randomized_pair()[1]
    with torch.no_grad():
        model.blocks[8].parallel_mlp.proj_w.normal_(0, 0.1, generator=torch.Generator().manual_seed(6))
    assert "blocks.8.parallel_mlp.fc_w" in compiled_matches_eager(model, *batch(), 128, W3)


@pytest.mark.slow
def test_a_compiled_run_of_anvil2s_layout_with_it_learns(tiny_args, monkeypatch):
    """The trainer's compiled path (aot_eager for inductor: the same tracing and guards, compiled in seconds on the
    CPU) over the layout plus parallel_mlp_blocks 8: it runs and learns."""
    torch._dynamo.reset()
    compile = torch.compile
    monkeypatch.setattr(tg.torch, "compile", lambda fn, **kw: compile(fn, **{**kw, "backend": "aot_eager"}))
    try:
        run = tg.train(tiny_args(**{**PARALLEL, **FAST, "num_iterations": 12, "val_every": 6, "compile": True,
                                    "warmup_steps": 1}))
    finally:
        torch._dynamo.reset()
    val = [v for _, v in run.val_losses]
    assert [s for s, _ in run.val_losses] == [0, 6, 12] and val[-1] < val[0] - 0.3
