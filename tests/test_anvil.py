"""ANVIL, Muon's update rule, the public record ANVIL2's: its maps, its two momentum rails, its decay gated on the
slow rail, finite in bf16 on degenerate gradients, on one process and two, through a run and a
resume. The references here are written from the formulas, in float64."""
import functools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from conftest import FAST, TINY
from distributed import spawn

SLOW_BETA, FAST_WEIGHT, FAST_BETA, _ = tg.Hyperparameters().anvil_rails


def compose(s, maps=tg.ANVIL_MAPS):
    """The maps on singular values (float64): s <- a s + b s^3 + c s^5, in turn."""
    for a, b, c in maps:
        s = a * s + b * s**3 + c * s**5
    return s


def test_the_maps_are_anvil2s_by_the_figures_its_readme_gives():
    """Tail gain 643.13 and, on singular values in [3e-3, 1/1.05], an envelope of [0.9951, 1.00041] (ANVIL2's README)."""
    assert len(tg.ANVIL_MAPS) == 6
    assert math.isclose(math.prod(a for a, _, _ in tg.ANVIL_MAPS), 643.13, rel_tol=1e-5)
    out = compose(torch.linspace(3e-3, 1 / 1.05, 100_001, dtype=torch.float64))
    assert 0.9950 < out.min() < 0.9951 and 1.0004 < out.max() < 1.00041
    # the edge the safety keeps away from: just past 1/1.05 the maps run away from 1, by 1.0005/1.05 to 1e9; at
    # 1/(1.05 x 1.03), where a rank-1 matrix lands, they are inside the envelope, as 3% above it
    assert compose(torch.tensor(1.0001 / 1.05, dtype=torch.float64)) > 2
    assert compose(torch.tensor(1.0005 / 1.05, dtype=torch.float64)) > 1e9
    edge = 1 / (1 + tg.ANVIL_SAFETY)
    assert 0.9950 < compose(torch.tensor(edge, dtype=torch.float64)) < 1.0004
    assert 0.995 < compose(torch.tensor(edge * 1.03, dtype=torch.float64)) < 1.0005


def reference_orthogonalize(G: torch.Tensor) -> torch.Tensor:
    """float64: the matrix (its transpose if tall) over 1.05 x 1.03 x sqrt(tr X X^T) + 1e-6, then the six maps."""
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    trace = (X @ X.mT).diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
    X = X / (1.05 * 1.03 * trace.sqrt() + 1e-6)
    for a, b, c in tg.ANVIL_MAPS:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 96, 32)])
def test_anvil_orthogonalize_is_the_float64_reference_and_near_orthogonal(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    out = tg.anvil_orthogonalize(G)
    torch.testing.assert_close(out.double(), reference_orthogonalize(G), rtol=0, atol=2e-5)
    s = torch.linalg.svdvals(out.double())
    assert 0.99 < s.min() and s.max() < 1.001, (s.min().item(), s.max().item())
    assert tg.Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=0.9).orthogonalize is tg.anvil_orthogonalize


def degenerate_matrices():
    """Rank-1 gradients (the smear gate's 1 x n matrix always is one), nearly rank-1 ones, zeros and tiny ones, at
    scales from 1e-30 to 1e19, by name."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for shape in [(1, 12), (6, 12), (12, 6), (16, 768)]:
        for seed in range(12):
            u, v = torch.randn(shape[0], 1, generator=g), torch.randn(1, shape[1], generator=g)
            scale = 10.0 ** [-30, -12, -3, 0, 3, 19][seed % 6]
            out[f"rank1 {shape} #{seed} x{scale:g}"] = u @ v * scale
            out[f"near-rank1 {shape} #{seed}"] = u @ v + 1e-3 * torch.randn(shape, generator=g)
        out[f"zeros {shape}"] = torch.zeros(shape)
        out[f"tiny {shape}"] = torch.randn(shape, generator=g) * 1e-38  # its squares underflow even float32
    out["batch of rank-1"] = torch.randn(4, 6, 1, generator=g) @ torch.randn(4, 1, 12, generator=g)
    return out


def test_degenerate_gradients_orthogonalize_to_finite_matrices_in_bf16_where_anvil2s_bare_scale_blows_up():
    """In the GPU's bf16: every rank-1, nearly rank-1, zero and tiny matrix comes out finite with spectral norm
    about 1 or less (zeros: zeros). The same rank-1 matrices scaled by ANVIL2's 1.05 alone (no 3% headroom) blow
    up: bf16 rounding lifts their one singular value past where the maps diverge (the NaN at step 4-5 of an earlier
    version of this rule on a GPU)."""
    bare = functools.partial(tg.quintic_orthogonalize, coefficients=tg.ANVIL_MAPS, safety=0.05, dtype=torch.bfloat16)
    blown = 0
    for name, G in degenerate_matrices().items():
        out = tg.anvil_orthogonalize(G, dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all(), name
        assert torch.linalg.matrix_norm(out.double(), ord=2).max() < 1.02, name
        if name.startswith("zeros"):
            assert not out.any(), name
        if name.startswith("rank1"):
            b = bare(G)
            blown += not (torch.isfinite(b).all() and b.double().abs().max() < 2)
    assert blown >= 5, blown  # of the 48 rank-1 matrices: the hazard is real, and the test can see it


def anvil_muon(params, **kw):
    kw = {"lr": 0.1, "momentum": 0.9, "slow_beta": SLOW_BETA, **kw}
    return tg.Muon(params, **kw)


def set_rails(muon, momentum, fast_beta, fast_weight):
    """As train_step sets them each step."""
    for group in muon.param_groups:
        group.update(momentum=momentum, fast_beta=fast_beta, fast_weight=fast_weight)


# (Nesterov momentum, fast beta, fast weight) per step: two before the rails engage (the fast rail at the momentum,
# weight 1), two after (ANVIL2's fixed 0.85 and 0.4385)
RAILS = [(0.85, 0.85, 1.0), (0.9, 0.9, 1.0), (0.93, FAST_BETA, FAST_WEIGHT), (0.93, FAST_BETA, FAST_WEIGHT)]


def gradients(shape, n):
    """A steady part plus noise, the noise larger: the slow rail's sign and the update's then differ on many entries."""
    steady = torch.randn(*shape, generator=torch.Generator().manual_seed(99))
    return [0.3 * steady + torch.randn(*shape, generator=torch.Generator().manual_seed(t)) for t in range(n)]


def reference_anvil(p, grads, lr, wd, beta2, scale, gate="slow"):
    """ANVIL in float64, from the formulas: rails f <- f + (1 - beta_f)(g - f), s <- s + (1 - 0.98)(g - s) from
    zero; Nesterov n = g + mu (w f + (1 - w) s - g); u = the maps on n; NorMuon (one mean square per index of the
    longer side, its EMA at beta2 from zero, u over its root, rescaled to u's norm); p <- p - lr scale (u + lr wd p
    [gate x p >= 0]), the gate the slow rail (gate="update": the update u, NorMuon's). Returns p, the rails, and the
    gates' masks."""
    p, f, s, ema = p.double(), 0, 0, 0
    side = -1 if p.size(-2) >= p.size(-1) else -2
    masks = []
    for g, (mu, beta_f, w) in zip(grads, RAILS):
        g = g.double()
        f, s = f + (1 - beta_f) * (g - f), s + (1 - SLOW_BETA) * (g - s)
        u = reference_orthogonalize(g + mu * (w * f + (1 - w) * s - g))
        ema = beta2 * ema + (1 - beta2) * u.square().mean(dim=side, keepdim=True)
        v = u / ema.sqrt()
        u = v * u.norm() / v.norm()
        masks.append((s if gate == "slow" else u) * p >= 0)
        p = p - lr * scale * (u + lr * wd * p * masks[-1])
    return p, f, s, masks


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)], ids=["tall", "wide"])
def test_an_anvil_step_is_the_float64_reference_rails_blend_maps_normuon_and_decay_gated_on_the_slow_rail(shape):
    lr, wd, beta2, scale = 0.05, 2.25, 0.9, max(1, shape[0] / shape[1]) ** 0.5
    p0 = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    p = torch.nn.Parameter(p0.clone())
    muon = anvil_muon([p], lr=lr, beta2=beta2, weight_decay=wd)
    grads = gradients(shape, len(RAILS))
    for g, rails in zip(grads, RAILS):
        set_rails(muon, *rails)
        p.grad = g.clone()
        muon.step()
    expected, fast, slow, masks = reference_anvil(p0, grads, lr, wd, beta2, scale)
    torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-5)
    state = muon.state[p]
    torch.testing.assert_close(state["momentum_buffer"].double(), fast, rtol=0, atol=1e-6)  # the fast rail
    torch.testing.assert_close(state["slow_rail"].double(), slow, rtol=0, atol=1e-6)
    # the last step's gate: the slow rail's sign, not the update's; decayed and undecayed entries both
    _, _, _, update_masks = reference_anvil(p0, grads, lr, wd, beta2, scale, gate="update")
    assert 0.2 < masks[-1].double().mean() < 0.8
    assert (masks[-1] != update_masks[-1]).double().mean() > 0.1
    gated_on_update, *_ = reference_anvil(p0, grads, lr, wd, beta2, scale, gate="update")
    assert (p.detach().double() - gated_on_update).abs().max() > 1e-3  # the test tells the two gates apart


def test_the_decay_is_lr_squared_wd_p_exactly_where_the_slow_rail_has_ps_sign():
    """Two ANVIL optimizers on the same gradients, one with weight decay, one step after a history that made the
    slow rail: the difference is lr x scale x lr x wd x p on the entries where slow rail x p >= 0, nothing elsewhere."""
    shape, lr, wd, scale = (96, 32), 0.05, 2.25, 3**0.5
    p0 = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    grads = gradients(shape, 3)
    after, slows = [], []
    for decay in (0.0, wd):
        p = torch.nn.Parameter(p0.clone())
        muon = anvil_muon([p], lr=0.0, weight_decay=decay)  # lr 0: the history moves the rails, not p
        for g, rails in zip(grads[:2], RAILS):
            set_rails(muon, *rails)
            p.grad = g.clone()
            muon.step()
        assert torch.equal(p.detach(), p0)
        muon.param_groups[0]["lr"] = lr
        set_rails(muon, *RAILS[2])
        p.grad = grads[2].clone()
        muon.step()
        after.append(p.detach())
        slows.append(muon.state[p]["slow_rail"])
    plain, decayed = after
    assert torch.equal(slows[0], slows[1])
    gate = slows[1] * p0 >= 0
    update_gate = (p0 - plain) * p0 >= 0  # where the plain step's update has p's sign: NorMuon's gate
    assert 0.3 < gate.double().mean() < 0.7 and (gate != update_gate).any()
    torch.testing.assert_close(decayed, plain - lr * scale * lr * wd * p0 * gate, rtol=0, atol=1e-6)
    assert torch.equal(decayed[~gate], plain[~gate])


def test_before_the_rails_engage_the_step_is_nesterov_momentum_and_after_it_is_not():
    """With fast weight 1 and the fast beta at the momentum, the blend is the fast rail: through an identity
    orthogonalizer the step is Muon's Nesterov momentum, g lerped toward buf <- lerp(buf, g, 1 - mu) by mu, to the
    last bits (the slow rail accumulates, unread); engaged, the steps differ from it."""
    shape, scale = (48, 16), 3**0.5
    grads = gradients(shape, 4)
    p0 = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    p = torch.nn.Parameter(p0.clone())
    muon = anvil_muon([p], lr=1.0, orthogonalize=lambda g: g)
    buf, plain = torch.zeros(shape), p0.clone()
    for step, (g, rails) in enumerate(zip(grads, RAILS)):
        set_rails(muon, *rails)
        p.grad = g.clone()
        muon.step()
        buf = buf.lerp(g, 1 - rails[0])
        plain = plain - scale * g.lerp(buf, rails[0])
        if step < 2:
            torch.testing.assert_close(p.detach(), plain, rtol=0, atol=1e-6)
    assert (p.detach() - plain).abs().max() > 1e-2
    assert muon.state[p]["slow_rail"].abs().sum() > 0


def test_an_anvil_muon_stays_finite_on_degenerate_gradients_in_bf16():
    """Ten steps of ANVIL with its bf16 orthogonalization, NorMuon and decay on: a 1 x 12 gate, a 6 x 12 one and
    a square matrix, fed rank-1, zero and tiny gradients by turns, through the rails' engagement."""
    shapes = [(1, 12), (6, 12), (32, 32)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=torch.Generator().manual_seed(i)))
              for i, s in enumerate(shapes)]
    muon = anvil_muon(params, beta2=0.9, weight_decay=2.25,
                      orthogonalize=functools.partial(tg.anvil_orthogonalize, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        set_rails(muon, *RAILS[min(step, 3)])
        for p in params:
            kind = step % 3
            rank1 = torch.randn(p.shape[0], 1, generator=g) @ torch.randn(1, p.shape[1], generator=g)
            p.grad = rank1 if kind == 0 else torch.zeros_like(p) if kind == 1 else rank1 * 1e-38
        muon.step()
        assert all(torch.isfinite(p).all() for p in params), step
        assert all(torch.isfinite(t).all() for s in muon.state.values() for t in s.values())


def test_the_rails_schedule_engages_at_its_fraction_of_the_run(tiny_args):
    args = tiny_args(num_iterations=20)  # engaged from 0.43 x 20 = 8.6: step 9
    schedule = tg.Schedule(args)
    assert [schedule.anvil_rails(s) for s in (0, 8)] == [(schedule.momentum(0), 1.0), (schedule.momentum(8), 1.0)]
    assert schedule.anvil_rails(9) == schedule.anvil_rails(19) == (FAST_BETA, FAST_WEIGHT) == (0.85, 0.4385)
    assert SLOW_BETA == 0.98


def test_the_rails_are_a_field_with_a_cli_flag_built_into_muon_and_checked(tiny_args, tmp_path):
    args = tg.parse_args(["--muon_weight_decay", "2.25", "--anvil_rails", "0.97,0.5,0.8,0.4"])
    assert (args.muon_weight_decay, args.anvil_rails) == (2.25, (0.97, 0.5, 0.8, 0.4))
    model = tg.GPT(tg.ModelConfig.from_args(tiny_args()))
    _, muon = tg.build_optimizers(model, tiny_args(), 0, 1)
    assert muon.orthogonalize is tg.anvil_orthogonalize
    assert all(g["slow_beta"] == 0.98 and g["fast_weight"] == 1.0 for g in muon.param_groups)
    _, muon = tg.build_optimizers(model, tiny_args(anvil_rails=(0.97, 0.5, 0.8, 0.4)), 0, 1)
    assert all(g["slow_beta"] == 0.97 for g in muon.param_groups)
    for bad in [(0.98, 0.4385, 0.85), (1.0, 0.4, 0.85, 0.4), (0.98, 1.5, 0.85, 0.4), (0.98, 0.4, 0.85, -0.1)]:
        with pytest.raises(ValueError, match="anvil_rails=.*four numbers"):
            tiny_args(anvil_rails=bad)
    with pytest.raises(ValueError, match="slow_beta=0.0: the slow rail needs a beta in"):
        tg.Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=0.9, slow_beta=0.0)
    # the public master's rule (muon_rule normuon, deleted): its checkpoints have no slow rail to resume
    run = tg.train(tiny_args(**FAST, num_iterations=2, val_every=0, save_every=2, run_id="m",
                             checkpoint_dir=str(tmp_path)))
    meta = torch.load(Path(run.checkpoint) / "model.pt", weights_only=True)
    assert "muon_rule" not in meta["args"]
    meta["args"]["muon_rule"] = "normuon"
    torch.save(meta, Path(run.checkpoint) / "model.pt")
    with pytest.raises(ValueError, match="muon_rule: checkpoint 'normuon' .* now always ANVIL's"):
        tg.load_checkpoint(Path(run.checkpoint), None, [], tiny_args(), 0, 1, print)


def test_a_tiny_model_learns_with_anvil_and_the_loop_engages_the_rails(tiny_args, monkeypatch):
    """20 steps of the tiny record model: the loss falls, train_step hands the rails their schedule (weight 1, then
    engaged from step 9), and the engaged rails change the run: with them never engaging (fraction 1), the losses
    are the same up to step 9 and differ after."""
    seen, rails = [], tg.Muon.anvil_rails

    def spy(self, group, owned, fast, grads):
        seen.append((group["fast_beta"], group["fast_weight"]))
        return rails(self, group, owned, fast, grads)
    monkeypatch.setattr(tg.Muon, "anvil_rails", spy)
    run = tg.train(tiny_args(**FAST, muon_weight_decay=2.25, val_every=0))
    assert all(math.isfinite(x) for x in run.train_losses) and len(run.train_losses) == 20
    assert run.val_losses[-1][1] < run.train_losses[0] - 0.4, (run.train_losses[0], run.val_losses)
    weights = sorted({w for _, w in seen})
    assert weights == [FAST_WEIGHT, 1.0] and seen[-1] == (FAST_BETA, FAST_WEIGHT)
    never = tg.train(tiny_args(**FAST, muon_weight_decay=2.25, val_every=0, run_id="never",
                               anvil_rails=(SLOW_BETA, FAST_WEIGHT, FAST_BETA, 1.0)))
    assert never.train_losses[:10] == run.train_losses[:10] and never.train_losses[10:] != run.train_losses[10:]


def test_a_resumed_anvil_run_matches_an_uninterrupted_one_and_its_checkpoint_holds_both_rails(tiny_args, tmp_path):
    """Checkpoint at step 4, the rails engaged from step 4 (0.43 x 8 = 3.44): the resumed run continues step for
    step, which it can only with the slow rail restored."""
    kw = dict(FAST, num_iterations=8, val_every=4, muon_weight_decay=2.25)
    full = tg.train(tiny_args(**kw, save_every=4, run_id="full", checkpoint_dir=str(tmp_path / "ck")))
    step4 = tmp_path / "ck" / "full" / "step_000004"
    states = torch.load(step4 / "rank0.pt", weights_only=True)["optimizers"][1]["state"]
    assert states and all({"momentum_buffer", "slow_rail", "neuron_second_moment"} <= set(s) for s in states.values())
    assert all(s["slow_rail"].abs().sum() > 0 for s in states.values() if s["momentum_buffer"].abs().sum() > 0)
    resumed = tg.train(tiny_args(**kw, resume=str(step4), run_id="again", checkpoint_dir=str(tmp_path / "ck2")))
    assert resumed.first_step == 4 and resumed.train_losses == full.train_losses[4:]
    assert dict(full.val_losses)[8] == dict(resumed.val_losses)[8]


def _two_rank_worker(rank, world_size, out):
    dist.init_process_group("gloo")
    params = _anvil_steps(rank, world_size)
    if rank == 0:
        torch.save(params, out)
    dist.destroy_process_group()


def _anvil_steps(rank, world_size):
    """Four ANVIL steps (two engaged) on the tiny model's block matrices, every rank its own gradients (one process:
    their sum, as the reduce-scatter sums them); returns the parameters."""
    args = tg.Hyperparameters(**TINY, muon_weight_decay=2.25)
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args))
    _, muon = tg.build_optimizers(model, args, rank, world_size)
    params = [p for group in muon.param_groups for p in group["params"]]
    sources = range(2) if world_size == 1 else [rank]
    for step, rails in enumerate(RAILS):
        set_rails(muon, *rails)
        for i, p in enumerate(params):
            p.grad = sum(torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * r + 10 * step + i))
                         for r in sources)
        muon.step()
    return [p.detach().clone() for p in params]


@pytest.mark.slow
def test_anvil_on_two_processes_equals_one_process_with_summed_grads(tmp_path):
    """The rails live with the rank that owns a matrix, as Muon's momentum does: two gloo ranks, each updating its
    share and all-gathering, give one process' parameters bit for bit."""
    spawn(_two_rank_worker, 2, str(tmp_path / "two.pt"))
    two, one = torch.load(tmp_path / "two.pt"), _anvil_steps(0, 1)
    assert len(two) == len(one) > 4
    for a, b in zip(two, one):
        assert torch.equal(a, b)
