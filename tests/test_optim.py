"""Optimizers: Newton-Schulz, Muon and the sharded Adam, on one process and on two gloo processes."""
import os

import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from conftest import TINY
from distributed import spawn


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (3, 96, 32), (768, 3072)])
def test_newton_schulz_puts_singular_values_in_a_band(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(tg.newton_schulz(G, 5).float())
    assert s.min() > 0.6 and s.max() < 1.25, (s.min().item(), s.max().item())


def test_muon_step_is_orthogonalized_nesterov_momentum_scaled_by_aspect_ratio():
    p = torch.nn.Parameter(torch.randn(96, 32))
    p0 = p.detach().clone()
    muon = tg.Muon([p], lr=0.1, momentum=0.9, ns_steps=5)
    g = torch.randn(96, 32)
    p.grad = g.clone()
    muon.step()
    buf = 0.1 * g  # momentum buffer after one step: lerp(0, g, 1 - 0.9)
    expected = p0 - 0.1 * 3**0.5 * tg.newton_schulz(g.lerp(buf, 0.9), 5).float()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def _model_and_grads(seed_offset):
    args = tg.Hyperparameters(**TINY)
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args))
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * seed_offset + step)
        grads.append([torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()])
    return args, model, grads


def _optimizer_worker(rank, world_size, out):
    dist.init_process_group("gloo")
    args, model, grads = _model_and_grads(rank)
    optimizers = tg.build_optimizers(model, args, rank, world_size)
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g
        for opt in optimizers:
            opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out)
    dist.destroy_process_group()


def test_distributed_muon_and_adam_on_two_processes_equal_one_process_with_summed_grads(tmp_path):
    out = str(tmp_path / "two.pt")
    spawn(_optimizer_worker, 2, out)
    two = torch.load(out)
    args, model, grads0 = _model_and_grads(0)
    _, _, grads1 = _model_and_grads(1)
    optimizers = tg.build_optimizers(model, args, 0, 1)
    for g0, g1 in zip(grads0, grads1):
        for p, a, b in zip(model.parameters(), g0, g1):
            p.grad = a + b
        for opt in optimizers:
            opt.step()
    one = model.state_dict()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=0, msg=k)
    assert any((one[k] != tg.GPT(tg.ModelConfig.from_args(args)).state_dict()[k]).any() for k in one)


def test_dist_adam_refuses_a_parameter_that_does_not_shard():
    with pytest.raises(ValueError, match="does not split"):
        tg.DistAdam([torch.nn.Parameter(torch.zeros(5, 3))], lr=1e-3, betas=(0.8, 0.95), eps=1e-10,
                    rank=0, world_size=2)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_orthogonalization_work_of_the_record_model_is_spread_evenly_over_ranks(world_size):
    """Newton-Schulz costs ~m^2 n per m x n matrix (m <= n). With both MLP matrices in one group of 24
    (stored alike, as in the 09/03 record), 8 ranks each get 3 MLP and at most 2 attention matrices:
    the busiest rank does 5 of the 35 equal units of work, the fewest any split allows."""
    with torch.device("meta"):
        model = tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters()))
    params = tg.param_groups_by_role(model)["block matrices"]
    loads = []
    for rank in range(world_size):
        muon = tg.Muon(params, lr=0.05, momentum=0.95, ns_steps=5, rank=rank, world_size=world_size)
        work = 0
        for group in muon.param_groups:
            per_rank, first = muon._owned(group)
            for p in group["params"][first: first + per_rank]:
                m, n = sorted(p.shape[-2:])
                work += p.numel() // (m * n) * m * m * n
        loads.append(work)
    unit = 768 * 768 * 3072  # one MLP matrix = one of the 4 stacked attention matrices' 4 x 768^3
    assert sum(loads) // unit == 35 and max(loads) <= -(-35 // world_size) * unit + 11 * 6 * 6 * 12
