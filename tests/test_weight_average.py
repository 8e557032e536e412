"""WeightAverage (--weight_average): the endgame weight averaging of the public record ANVIL2 (modded-nanogpt #92).
The averages are EMAs of the weights, computed by hand here. The ship is lerp(base, EMA, blend), then renormed. A run
with the mechanism off is untouched. A resume inside the window continues the averages, on one process or on two."""
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import FAST, TINY  # noqa: F401 (conftest puts the repository on sys.path)
import train_gpt as tg
from distributed import spawn

QUIET = dict(log=lambda *_: None)


def hyper(values, num_iterations=10) -> tg.Hyperparameters:
    return tg.Hyperparameters(weight_average=values, num_iterations=num_iterations, extension_steps=0,
                              extension_window=0)


def toy_params(seed=0) -> list[nn.Parameter]:
    """A toy module's weights: two float32 matrices and a bf16 table (the embeddings' dtype on a GPU)."""
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(3, 5, generator=g)), nn.Parameter(torch.randn(37, generator=g)),
            nn.Parameter(torch.randn(4, 6, generator=g).bfloat16())]


def set_weights(params, step: int):
    """The weights after `step` steps of a pretend run: a fixed function of the step."""
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g))
    return [p.detach().double().clone() for p in params]


def run_ticks(avg, params, steps) -> list:
    """Each step's weights set, then ticked; returns the weights of every step (float64)."""
    seen = []
    for step in steps:
        seen.append(set_weights(params, step))
        avg.tick(step)
    return seen


def test_window_and_tail_are_fractions_of_the_run_and_parse_from_the_command_line():
    avg = tg.WeightAverage(nn.Linear(2, 2), hyper((0.25, 0.55, 0.085), 776), params=[], **QUIET)
    assert avg.first == 776 - 194 + 1 and avg.rates == {"ema": 2 / 195, "tail": 2 / 67}  # 194 = 0.25 x 776, 66 = 0.085 x 776
    short = tg.WeightAverage(nn.Linear(2, 2), hyper((0.25, 0.55), 20), params=[], **QUIET)
    assert short.first == 16 and set(short.rates) == {"ema"} and short.renorm  # 5 steps; no tail; renorm by default
    assert tg.parse_args(["--weight_average", "0.25,0.55,0.085,1"]).weight_average == (0.25, 0.55, 0.085, 1.0)
    assert tg.parse_args(["--preset", "record"]).weight_average == (0.25, 0.65)  # the record's: ANVIL2's TailEMA
    assert tg.parse_args(["--weight_average", ""]).weight_average == ()  # off from the command line
    for bad in ((0.25,), (0.0, 0.5), (1.5, 0.5), (0.25, 1.2), (0.25, 0.5, -0.1), (0.25, 0.5, 0.1, 0.5),
                (0.25, 0.5, 0.1, 1, 3)):
        with pytest.raises(ValueError, match=r"^--weight_average "):
            tg.WeightAverage(nn.Linear(2, 2), hyper(bad), params=[], **QUIET)


def test_the_averages_are_hand_computed_emas_over_the_window_and_ticks_never_write_the_weights():
    params = toy_params()
    avg = tg.WeightAverage(nn.Module(), hyper((0.5, 0.5, 0.3)), params=params, **QUIET)  # W = 5, T = 3
    assert avg.first == 6 and avg.rates == {"ema": 2 / 6, "tail": 2 / 4}
    seen = run_ticks(avg, params, range(1, 11))
    for key, rate in avg.rates.items():
        for i, p in enumerate(params):
            hand = seen[5][i]  # the weights after step 6 seed it: steps 1-5 are before the window
            for later in seen[6:]:
                hand = hand + rate * (later[i] - hand)
            assert avg.avgs[key][i].dtype == torch.float32
            torch.testing.assert_close(avg.avgs[key][i].double(), hand.view(-1), rtol=0, atol=1e-6)
    assert all(torch.equal(p.detach().double(), w) for p, w in zip(params, seen[-1]))
    avg.tick(11)  # past the run's end: nothing
    assert len(avg.avgs["ema"]) == len(params)


@pytest.mark.parametrize("tail,renorm", [(0.0, 0), (0.0, 1), (0.3, 0), (0.3, 1)])
def test_the_ship_is_the_blend_of_base_and_ema_then_the_norm_before_it(tail, renorm):
    params = toy_params()
    avg = tg.WeightAverage(nn.Module(), hyper((0.5, 0.55, tail, renorm)), params=params, **QUIET)
    live = [w.float() for w in run_ticks(avg, params, range(1, 11))[-1]]
    ema = [a.view(p.shape).clone() for a, p in zip(avg.avgs["ema"], params)]
    base = [a.view(p.shape).clone() for a, p in zip(avg.avgs["tail"], params)] if tail else live
    avg.ship()
    for p, b, e, w in zip(params, base, ema, live):
        want = torch.lerp(b, e, 0.55)
        if renorm:
            want = want * (w.norm() / want.to(p.dtype).float().norm())
        tol = dict(rtol=2e-2, atol=2e-2) if p.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach().float(), want, **tol)
        if renorm:
            torch.testing.assert_close(p.detach().float().norm(), w.norm(), rtol=1e-2 if p.dtype == torch.bfloat16
                                       else 1e-6, atol=0)
    assert avg.avgs == {key: [] for key in avg.rates}  # dropped: the next checkpoint holds the shipped weights


def test_blend_zero_without_tail_or_renorm_ships_the_live_weights_bit_for_bit():
    params = toy_params()
    avg = tg.WeightAverage(nn.Module(), hyper((0.5, 0.0, 0.0, 0)), params=params, **QUIET)
    live = run_ticks(avg, params, range(1, 11))[-1]
    avg.ship()
    assert all(torch.equal(p.detach().double(), w) for p, w in zip(params, live))


def identity_index(items, x) -> int:
    return next(i for i, y in enumerate(items) if y is x)


def test_the_record_models_averaged_weights_and_the_tied_embedding():
    """ANVIL2's set: embedding, value tables, LM head, attention and MLP matrices. While tied, the token embedding's
    averages follow the head's rows (in ANVIL2 the embedding is a copy of the head until the split). A run that
    ends tied leaves the unused embedding alone."""
    args = tg.Hyperparameters(**{**TINY, "weight_average": (0.5, 0.5, 0.0, 1)})  # 20 steps: ticks 11-20
    model = tg.GPT(tg.ModelConfig.from_args(args))
    avg = tg.WeightAverage(model, args, **QUIET)
    blocks = [p for name, p in model.blocks.named_parameters() if name.endswith(("qkvo_w", "fc_w", "proj_w"))]
    assert [id(p) for p in avg.params] == [id(p) for p in [model.embed.weight, *(m.weight for m in model.value_embeds),
                                                             model.lm_head_w, *blocks]]
    assert model.tied_embed
    embed_before = model.embed.weight.detach().clone()
    for step in range(11, 21):
        with torch.no_grad():
            model.lm_head_w.add_(0.01 * step)
        avg.tick(step)
    e, h = identity_index(avg.params, model.embed.weight), identity_index(avg.params, model.lm_head_w)
    assert torch.equal(avg.avgs["ema"][e], avg.avgs["ema"][h])
    avg.ship()
    assert torch.equal(model.embed.weight, embed_before)


def val_live(run) -> list[float]:
    """The run's val_loss_live lines (its log opens with this file's source, which names the line too)."""
    return [float(m[1]) for m in re.finditer(r"^step:\d+/\d+ val_loss_live:(\S+)", Path(run.log_path).read_text(), re.M)]


def test_off_runs_as_before_and_a_zero_blend_ship_logs_the_same_loss_live_and_shipped(tiny_args, tmp_path):
    """Off: no line of it in the log, two optimizer states in a checkpoint. On, with a ship that changes nothing
    (blend 0, no tail, no renorm): every loss as off, and val_loss_live equals the final val_loss."""
    off = tg.train(tiny_args(**FAST, num_iterations=8, val_every=4, save_every=4, run_id="off", weight_average=()))
    same = tg.train(tiny_args(**FAST, num_iterations=8, val_every=4, save_every=4, run_id="same",
                              weight_average=(1.0, 0.0, 0.0, 0)))
    assert val_live(off) == [] and not re.search(r"^weight_average: EMA", Path(off.log_path).read_text(), re.M)
    assert re.search(r"^weight_average: EMA of the last 8 steps", Path(same.log_path).read_text(), re.M)
    assert len(torch.load(Path(off.checkpoint) / "rank0.pt", weights_only=True)["optimizers"]) == 2
    assert same.train_losses == off.train_losses and same.val_losses == off.val_losses
    assert val_live(same) == [float(f"{off.val_losses[-1][1]:.4f}")]
    assert len(torch.load(Path(same.checkpoint) / "rank0.pt", weights_only=True)["optimizers"]) == 3


def test_a_resume_inside_the_window_continues_the_averages_exactly(tiny_args, tmp_path):
    """The checkpoint at step 4 is inside the window (steps 3-8): resumed from it, the run ships what the
    uninterrupted run shipped. Resumed from a checkpoint without averages (the same weights, from a run with it off),
    the averages start again at step 4 and the shipped weights differ: the checkpoint is what carried them."""
    on = dict(FAST, num_iterations=8, val_every=4, weight_average=(0.75, 0.5, 0.25))
    full = tg.train(tiny_args(save_every=4, run_id="full", checkpoint_dir=str(tmp_path / "ck"), **on))
    off = tg.train(tiny_args(**FAST, num_iterations=8, val_every=4, save_every=4, run_id="off", weight_average=(),
                             checkpoint_dir=str(tmp_path / "ck")))
    resumed = tg.train(tiny_args(resume=str(tmp_path / "ck" / "full" / "step_000004"), run_id="again",
                                 checkpoint_dir=str(tmp_path / "ck2"), **on))
    restarted = tg.train(tiny_args(resume=str(tmp_path / "ck" / "off" / "step_000004"), run_id="restarted",
                                   checkpoint_dir=str(tmp_path / "ck3"), **on))
    assert resumed.first_step == 4 and resumed.train_losses == full.train_losses[4:]
    assert resumed.val_losses[-1] == full.val_losses[-1] and val_live(resumed) == val_live(full)
    assert full.train_losses == off.train_losses  # averaging never changes training itself
    assert val_live(full) == [float(f"{off.val_losses[-1][1]:.4f}")]  # the live weights are the off run's
    assert full.val_losses[-1][1] != off.val_losses[-1][1]  # the ship changed the weights
    assert restarted.val_losses[-1][1] != full.val_losses[-1][1]


def _sharded_worker(rank, world_size, out):
    dist.init_process_group("gloo")
    params = toy_params()
    avg = tg.WeightAverage(nn.Module(), hyper((0.5, 0.55, 0.3)), rank=rank, world_size=world_size, params=params,
                           **QUIET)
    run_ticks(avg, params, range(1, 11))
    state = avg.state_dict()
    avg.ship()
    torch.save((state, [p.detach().clone() for p in params]), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_average_their_shares_ship_the_same_weights_and_reshard_both_ways(tmp_path):
    spawn(_sharded_worker, 2, str(tmp_path / "out"))
    (s0, w0), (s1, w1) = (torch.load(tmp_path / f"out.{r}") for r in (0, 1))
    params = toy_params()
    one = tg.WeightAverage(nn.Module(), hyper((0.5, 0.55, 0.3)), params=params, **QUIET)
    run_ticks(one, params, range(1, 11))
    whole = one.state_dict()
    for key in whole:
        assert all(torch.equal(torch.cat([a, b]), c) for a, b, c in zip(s0[key], s1[key], whole[key]))
        assert [a.numel() for a in s0[key]] == [15, 32, 16]  # rank 0's shares: chunks of 16 elements, cut at the end
    assert all(torch.equal(a, b) for a, b in zip(one.reshard([s0, s1])["ema"], whole["ema"]))  # 2 -> 1
    second = tg.WeightAverage(nn.Module(), hyper((0.5, 0.55, 0.3)), rank=1, world_size=2, params=params, **QUIET)
    assert all(torch.equal(a, b) for a, b in zip(second.reshard([whole])["tail"], s1["tail"]))  # 1 -> 2
    one.ship()
    assert all(torch.equal(p.detach(), a) and torch.equal(a, b) for p, a, b in zip(params, w0, w1))
