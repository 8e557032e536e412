"""Optimizers: Muon (its rule, ANVIL's, in tests/test_anvil.py) and the sharded Adam, on one process and on two gloo
processes."""
import math

import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from conftest import DECAYED_TABLES, FAST, TINY
from distributed import spawn


def test_muon_step_is_orthogonalized_nesterov_momentum_scaled_by_aspect_ratio():
    p = torch.nn.Parameter(torch.randn(96, 32))
    p0 = p.detach().clone()
    muon = tg.Muon([p], lr=0.1, momentum=0.9)
    g = torch.randn(96, 32)
    p.grad = g.clone()
    muon.step()
    buf = 0.1 * g  # momentum buffer after one step: lerp(0, g, 1 - 0.9)
    expected = p0 - 0.1 * 3**0.5 * tg.anvil_orthogonalize(g.lerp(buf, 0.9)).float()
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6)


def test_muon_cautious_weight_decay_adds_lr_wd_p_where_the_slow_rail_has_ps_sign():
    """Two Muons on the same parameter and gradient, one with weight_decay: the difference is
    lr x scale x (lr x wd x p0) on exactly the entries where the slow rail (after one step: (1 - 0.98) g) has p0's
    sign (tests/test_anvil.py: after a history, where it and the update differ)."""
    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    p0 = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    lr, wd, scale = 0.05, 0.4, 3**0.5
    after = []
    for decay in (0.0, wd):
        p = torch.nn.Parameter(p0.clone())
        muon = tg.Muon([p], lr=lr, momentum=0.9, weight_decay=decay)
        p.grad = g.clone()
        muon.step()
        after.append(p.detach())
    plain, decayed = after
    same_sign = g * p0 >= 0
    assert 0.3 < same_sign.float().mean() < 0.7  # both kinds of entries are tested
    torch.testing.assert_close(decayed, plain - lr * scale * lr * wd * p0 * same_sign, rtol=0, atol=1e-6)
    assert ((decayed - plain) * p0 <= 0).all()  # the decay always pulls toward zero
    assert torch.equal(decayed[~same_sign], plain[~same_sign])


def test_adam_leaves_a_parameter_without_gradient_alone_and_copy_state_hands_on_the_moments():
    a, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    b0 = b.detach().clone()
    adam = tg.DistAdam([dict(params=[a, b])], lr=0.1, betas=(0.8, 0.95), eps=1e-10)
    for _ in range(2):
        a.grad = torch.randn(8, 4)
        adam.step()
    assert torch.equal(b.detach(), b0) and b not in adam.state  # no gradient: no step, no moments
    adam.copy_state(a, b)
    assert adam.state[b]["step"] == 2 and torch.equal(adam.state[b]["exp_avg"], adam.state[a]["exp_avg"])
    assert adam.state[b]["exp_avg"] is not adam.state[a]["exp_avg"]  # a copy, not shared


def test_untying_copies_the_head_and_its_moments_into_the_token_embedding(tiny_args):
    args = tiny_args(tied_embed_stages=1)
    model = tg.GPT(tg.ModelConfig.from_args(args))
    adam, muon = tg.build_optimizers(model, args, 0, 1)
    lrs = [g["lr"] for g in adam.param_groups]
    assert lrs[0] == lrs[2] == args.adam_lr * args.head_lr_mult  # the token embedding learns at the head's rate
    x = torch.randint(0, 63, (128,), dtype=torch.int32)
    model(x, x, torch.tensor([0, 128], dtype=torch.int32), 128, tg.window_tokens(1, 16)).backward()
    assert model.embed.weight.grad is None and model.lm_head_w.grad is not None
    adam.step()
    tg.untie_embedding(model, adam)
    assert model.tied_embed  # until the loop's next step reads it (tie_embedding_at)
    tg.tie_embedding_at(model, 1, 1)
    assert not model.tied_embed and torch.equal(model.embed.weight, model.lm_head_w.detach().bfloat16())
    assert torch.equal(adam.state[model.embed.weight]["exp_avg_sq"], adam.state[model.lm_head_w]["exp_avg_sq"])


def test_muon_bf16_comm_keeps_the_float32_matrices_in_its_state_and_their_bf16_values_in_the_parameters():
    """One process: with bf16_comm, Muon's float32 trajectory (state "exact") is the one without it, bit for bit, when
    the gradients are bf16 values (the cast it adds is then exact), with the cautious decay and NorMuon on; the
    parameters hold its bf16 rounding; and the field builds it."""
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(4, 4))]
    rounded = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    a = tg.Muon(plain, lr=0.02, momentum=0.9, weight_decay=1.0, beta2=0.9)
    b = tg.Muon(rounded, lr=0.02, momentum=0.9, weight_decay=1.0, beta2=0.9, bf16_comm=True)
    for _ in range(4):
        for p, q in zip(plain, rounded):
            p.grad = torch.randn_like(p).bfloat16().float()
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(plain, rounded):
        assert torch.equal(b.state[q]["exact"], p.detach()) and torch.equal(q.detach(), p.detach().bfloat16().float())
    assert not torch.equal(rounded[0].detach(), plain[0].detach()), "the parameters are rounded"
    model = tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters(**TINY)))
    _, muon = tg.build_optimizers(model, tg.Hyperparameters(**TINY, muon_bf16_comm=True), 0, 1)
    assert muon.bf16_comm and not tg.build_optimizers(model, tg.Hyperparameters(**TINY), 0, 1)[1].bf16_comm


def test_muon_weight_decay_is_built_from_its_field_and_checked(tiny_args):
    model = tg.GPT(tg.ModelConfig.from_args(tiny_args()))
    _, muon = tg.build_optimizers(model, tiny_args(muon_weight_decay=1.2), 0, 1)
    assert all(group["weight_decay"] == 1.2 for group in muon.param_groups)
    with pytest.raises(ValueError, match="muon_weight_decay=-1.0 must be a finite number >= 0"):
        tiny_args(muon_weight_decay=-1.0)


@pytest.mark.parametrize("shape", [(96, 32), (32, 96)], ids=["tall", "wide"])
def test_normuon_divides_each_neurons_update_by_its_rms_ema_and_keeps_the_norm(shape):
    """Two NorMuon steps against a float64 reference written out here: one mean square per index of
    the longer side (rows of a tall matrix, columns of a wide one), EMA'd with beta2 from zero, the
    update divided by its root, then rescaled to the orthogonalized update's Frobenius norm."""
    lr, beta1, beta2, scale = 0.1, 0.9, 0.8, max(1, shape[0] / shape[1]) ** 0.5
    p = torch.nn.Parameter(torch.randn(*shape))
    muon = tg.Muon([p], lr=lr, momentum=beta1, beta2=beta2)
    side = -1 if shape[0] >= shape[1] else -2
    ref, buf, ema = p.detach().double().clone(), torch.zeros(shape), torch.zeros(0)
    steps = []
    for step in range(2):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        p.grad = g.clone()
        before = p.detach().clone()
        muon.step()
        buf = buf.lerp(g, 1 - beta1)
        u = tg.anvil_orthogonalize(g.lerp(buf, beta1)).double()
        ms = u.square().mean(dim=side, keepdim=True)
        ema = (1 - beta2) * ms if step == 0 else beta2 * ema + (1 - beta2) * ms
        v = u / ema.sqrt()
        v = v * u.norm() / v.norm()
        ref = ref - lr * scale * v
        torch.testing.assert_close(p.detach().double(), ref, rtol=0, atol=1e-5)
        steps.append((before - p.detach()).double() / (lr * scale))
        assert math.isclose(steps[-1].norm().item(), u.norm().item(), rel_tol=1e-4)  # the norm is kept
    assert muon.state[p]["neuron_second_moment"].shape == ms.shape
    first = steps[0].square().mean(dim=side)  # from zero state: every neuron's step has the same RMS
    assert first.max() / first.min() < 1 + 1e-4
    plain = tg.anvil_orthogonalize(torch.randn(*shape, generator=torch.Generator().manual_seed(0))).float()
    assert plain.square().mean(dim=side).max() / plain.square().mean(dim=side).min() > 1.05  # Muon's are not equal



def test_normuon_in_the_orthogonalizations_function_steps_as_the_two_apart():
    """muon_fused_normuon hands Muon normuon_orthogonalize (compiled by build): uncompiled it is the same ops as the
    orthogonalization followed by neuron_normalize, so two steps of two groups (tall and wide) agree to the bit, the
    second moments too."""
    def run(normalized):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*shape)) for shape in ((96, 32), (96, 32), (32, 96))]
        muon = tg.Muon(params, lr=0.1, momentum=0.9, beta2=0.8, weight_decay=0.5, normalized=normalized)
        for step in range(2):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
            muon.step()
        return [p.detach() for p in params], [muon.state[p]["neuron_second_moment"] for p in params]
    (apart, moments), (fused, fused_moments) = run(None), run(tg.normuon_orthogonalize)
    assert all(torch.equal(a, b) for a, b in zip(apart + moments, fused + fused_moments))
    assert moments[2].shape == (1, 96) and moments[0].shape == (96, 1)


@pytest.mark.slow
def test_normuon_orthogonalize_compiled_is_the_eager_arithmetic_to_float32_rounding():
    """What build compiles for muon_fused_normuon (Inductor, on the CPU here): the update and the moments within
    float32 rounding of the eager functions' (a fused graph sums in its own order)."""
    g = torch.Generator().manual_seed(0)
    G, ema = torch.randn(3, 96, 32, generator=g), torch.rand(3, 96, 1, generator=g)
    compiled = torch.compile(tg.normuon_orthogonalize, dynamic=False, fullgraph=True)
    for got, want in zip(compiled(G, ema, 0.8), tg.normuon_orthogonalize(G, ema, 0.8)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)

def test_normuon_is_built_from_muon_beta2_and_checked(tiny_args):
    model = tg.GPT(tg.ModelConfig.from_args(tiny_args(muon_beta2=0.9)))
    _, muon = tg.build_optimizers(model, tiny_args(muon_beta2=0.9), 0, 1)
    assert all(group["beta2"] == 0.9 for group in muon.param_groups)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="0 \\(plain Muon\\) or an EMA factor"):
            tiny_args(muon_beta2=bad)


def _model_and_grads(seed_offset, features=None):
    args = tg.Hyperparameters(**{**TINY, **(features or {})})
    torch.manual_seed(0)
    model = tg.GPT(tg.ModelConfig.from_args(args))
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * seed_offset + step)
        grads.append([torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()])
    return args, model, grads


def _optimizer_worker(rank, world_size, out, features):
    dist.init_process_group("gloo")
    args, model, grads = _model_and_grads(rank, features)
    optimizers = tg.build_optimizers(model, args, rank, world_size)
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g
        for opt in optimizers:
            opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("features", [{}, DECAYED_TABLES], ids=["0903", "decayed_tables"])
def test_distributed_muon_and_adam_on_two_processes_equal_one_process_with_summed_grads(tmp_path, features):
    out = str(tmp_path / "two.pt")
    spawn(_optimizer_worker, 2, out, features)
    two = torch.load(out)
    args, model, grads0 = _model_and_grads(0, features)
    _, _, grads1 = _model_and_grads(1, features)
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


def _bf16_comm_worker(rank, world_size, out, bf16_comm):
    """Both ranks with the same gradients (bf16 values: their bf16 sum over two ranks is exact), recording the dtype of
    every stack of matrices (Muon's: 3-d) the optimizers put on the wire."""
    dist.init_process_group("gloo")
    args, model, grads = _model_and_grads(0, {"muon_bf16_comm": bf16_comm})
    optimizers = tg.build_optimizers(model, args, rank, world_size)
    wire = set()
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        def spy(output, tensor, *a, real=getattr(dist, name), name=name, **k):
            if tensor.dim() == 3:
                wire.add((name, tensor.dtype))
            return real(output, tensor, *a, **k)
        setattr(dist, name, spy)
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.bfloat16().to(p.dtype)
        for opt in optimizers:
            opt.step()
    torch.save((model.state_dict(), wire), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_muon_bf16_comm_sends_bf16_and_every_rank_holds_the_owners_rounding(tmp_path):
    """--muon_bf16_comm on two processes: Muon's reduce-scatters and all-gathers carry bf16 (without it, none does);
    both ranks end with the same parameters, the block matrices at bf16 values; and they equal one process with the
    summed gradients, whose Muon keeps the float32 matrices (state "exact") that the parameters round."""
    runs = {}
    for bf16_comm in (False, True):
        out = str(tmp_path / f"{bf16_comm}.pt")
        spawn(_bf16_comm_worker, 2, out, bf16_comm)
        runs[bf16_comm] = [torch.load(f"{out}.{rank}") for rank in range(2)]
    (state0, wire0), (state1, wire1) = runs[True]
    assert wire0 == {("reduce_scatter_tensor", torch.bfloat16), ("all_gather_into_tensor", torch.bfloat16)}
    assert runs[False][0][1] == {("reduce_scatter_tensor", torch.float32), ("all_gather_into_tensor", torch.float32)}
    args, model, grads = _model_and_grads(0, {"muon_bf16_comm": True})
    adam, muon = tg.build_optimizers(model, args, 0, 1)
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = 2 * g.bfloat16().to(p.dtype)
        adam.step()
        muon.step()
    one = model.state_dict()
    matrices = {id(p) for group in muon.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        torch.testing.assert_close(state0[name], one[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(state1[name], one[name], rtol=0, atol=0, msg=name)
        if id(p) in matrices:
            assert torch.equal(p, p.bfloat16().float()) and torch.equal(p, muon.state[p]["exact"].bfloat16().float())


def _adam_reference(p, grads, lrs, betas, eps, wd):
    """Adam with cautious weight decay by hand, in float64: p -= u + lr^2 wd p where u * p > 0."""
    (b1, b2), p = betas, p.double()
    m, v, masks = torch.zeros_like(p), torch.zeros_like(p), []
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        g = g.double()
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        u = lr * (1 - b2**t) ** 0.5 / (1 - b1**t) * m / (v.sqrt() + eps)
        masks.append(u * p > 0)
        p = p - u - lr**2 * wd * p * masks[-1]
    return p, masks


def test_cautious_weight_decay_is_lr_t_squared_times_p_only_where_the_update_has_the_params_sign():
    p0 = torch.tensor([[0.8, -0.6, 0.5, -0.9], [0.3, -0.2, -0.7, 0.4]])
    grads = [torch.tensor([[1.0, -2.0, -0.5, 0.3], [-1.5, 0.7, -0.4, -0.8]]),
             torch.tensor([[0.2, 0.9, -1.1, -0.6], [0.5, -0.3, 1.2, 0.1]])]
    factors = [1.0, 0.3]  # the schedule: the second step at 0.3 x the initial lr
    betas, eps, wd = (0.75, 0.95), 1e-10, 0.8

    def run(weight_decay):
        p = torch.nn.Parameter(p0.clone())
        adam = tg.DistAdam([dict(params=[p], weight_decay=weight_decay)], lr=0.5, betas=betas, eps=eps)
        group = adam.param_groups[0]
        group["initial_lr"] = group["lr"]
        for g, f in zip(grads, factors):
            group["lr"] = group["initial_lr"] * f  # as train_step sets it
            p.grad = g.clone()
            adam.step()
        return p.detach()

    expected, masks = _adam_reference(p0, grads, [0.5 * f for f in factors], betas, eps, wd)
    assert all(0 < m.sum() < m.numel() for m in masks), "entries of both kinds at every step"
    decayed = run(wd)
    torch.testing.assert_close(decayed, expected.float(), rtol=0, atol=1e-6)
    plain = run(0.0)
    torch.testing.assert_close(plain, _adam_reference(p0, grads, [0.5 * f for f in factors], betas, eps, 0.0)[0].float(),
                               rtol=0, atol=1e-6)
    # decay at the initial lr on the second step would differ by (0.25 - 0.0225) x 0.8 x |p| there
    wrong, _ = _adam_reference(p0, grads, [0.5, 0.5], betas, eps, wd)
    assert (decayed - wrong.float()).abs().max() > 1e-2


def test_compiled_adam_update_equals_eager_with_new_step_sizes_and_shapes_without_recompiling():
    """build() gives DistAdam the compiled adam_update: the same numbers as eager (the formula test above
    runs eager), for bf16 and fp32 parameters, with and without decay; one graph per dtype serves every
    step size, shape, decay rate and beta (dynamo's limit is 8 graphs per function, and fullgraph turns
    hitting it into a failure)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()  # graphs other tests compiled of adam_update count toward the same recompile limit
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(tg.adam_update, backend=counter, dynamic=True, fullgraph=True)  # as build() does
    gen, graphs = torch.Generator().manual_seed(0), []
    for dtype in (torch.float32, torch.bfloat16):
        for decay, beta1 in ((0.0, 0.8), (0.3, 0.75)):  # the record's betas: the tables' and the others'
            for step, rows in enumerate([16, 16, 24, 16, 40]):
                p = torch.randn(rows, 8, generator=gen).to(dtype)
                g = torch.randn(rows, 8, generator=gen).to(dtype)
                m, v = torch.randn(rows, 8, generator=gen), torch.rand(rows, 8, generator=gen)
                eager, comp = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
                size = 0.01 / (step + 1)  # a new step size every step
                tg.adam_update(eager[0], g, eager[1], eager[2], size, decay * size, beta1, 0.95, 1e-10)
                compiled(comp[0], g, comp[1], comp[2], size, decay * size, beta1, 0.95, 1e-10)
                tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: a last-bit rounding apart at most
                for a, b in zip(eager, comp):
                    torch.testing.assert_close(b, a, rtol=tol, atol=tol)
                assert not torch.equal(eager[0], p)
            graphs.append(counter.frame_count)
    assert graphs == [1, 1, 2, 2], graphs
    # through DistAdam, as in training: row slices of parameters, updated in place under no_grad
    params = {}
    for update in (tg.adam_update, torch.compile(tg.adam_update, dynamic=True, fullgraph=True)):
        torch.manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(12, 8).to(dtype)) for dtype in (torch.float32, torch.bfloat16)]
        adam = tg.DistAdam([dict(params=ps[:1]), dict(params=ps[1:], weight_decay=0.5)], lr=0.05,
                           betas=(0.8, 0.95), eps=1e-10, update=update)
        for _ in range(3):
            for q in ps:
                q.grad = torch.randn_like(q)
            adam.step()
        params[update] = [q.detach().float() for q in ps]
    for a, b, tol in zip(*params.values(), (1e-6, 1e-2)):  # fp32, bf16
        torch.testing.assert_close(b, a, rtol=tol, atol=tol)


def test_value_embedding_and_bigram_tables_are_an_adam_group_of_their_own_at_the_embedding_lr():
    args = tg.Hyperparameters(**{**TINY, **DECAYED_TABLES})
    model = tg.GPT(tg.ModelConfig.from_args(args))
    adam, _ = tg.build_optimizers(model, args, 0, 1)
    # MUDD's MLPs, its gates', CPLM's pointer, the copy feature's tables last
    token, tables, head, scalars, mudd, gates, copy, doc_copy = adam.param_groups
    assert [id(p) for p in copy["params"]] == [id(model.copy_qk), id(model.copy_sink)]
    assert [id(p) for p in doc_copy["params"]] == [id(model.doc_copy_embed), id(model.doc_copy_gains)]
    assert [id(p) for p in mudd["params"]] == [id(model.mudd_w1), id(model.mudd_w2), id(model.mudd_b2)]
    assert [id(p) for p in gates["params"]] == [id(model.mudd_gate_w1), id(model.mudd_gate_w2), id(model.mudd_gate_b2)]
    assert [id(p) for p in token["params"]] == [id(model.embed.weight)]
    assert [id(p) for p in tables["params"]] == [id(m.weight) for m in model.value_embeds] + [id(model.bigram_embed.weight)]
    assert tables["lr"] == args.adam_lr * args.embed_lr_mult
    assert token["lr"] == head["lr"]  # a token embedding tied at first (as in these features) learns at the head's rate
    assert (tables["weight_decay"], tables["betas"]) == (0.5, (0.75, 0.95))
    assert all(g["weight_decay"] == 0.75 and g["betas"] == (0.5, 0.95) for g in (token, head))  # the head's own
    assert scalars["betas"] == (0.9, 0.99)  # DECAYED_TABLES gives the scalars their own
    bare = tg.Hyperparameters(**{**TINY, "cplm_bands": (), "doc_copy": False})  # no pointer, no copy: no empty group
    assert len(tg.build_optimizers(tg.GPT(tg.ModelConfig.from_args(bare)), bare, 0, 1)[0].param_groups) == 6


def test_the_tables_own_group_changes_nothing_at_the_defaults_and_decay_changes_the_run(tiny_args, monkeypatch):
    """Bit-identical to the layout before (one group for all embeddings) with the decay off (and the token
    embedding untied: tied, it learns at the head's rate, so it could not share the tables' group)."""
    # Adam on all 10 steps: decay shows; the tables' settings the token embedding's (the record's are their own). 10
    # steps of FAST's two micro-batches learn about as 8 of TINY's batch (decayed: 4.26 -> 3.58, and 3.53 in 8 of TINY's)
    untied = {"tied_embed_stages": 0, "adam_every": 1, "embed_weight_decay": 0.0, "embed_adam_betas": ()}
    args = tiny_args(**FAST, num_iterations=10, val_every=5, **untied)
    split = tg.train(args)
    build = tg.build_optimizers

    def one_embedding_group(model, args, rank, world_size, orthogonalize=tg.anvil_orthogonalize, update=tg.adam_update,
                            *row_ops):
        adam, muon = build(model, args, rank, world_size, orthogonalize, update, *row_ops)
        token, tables, *rest = adam.param_groups
        merged = {**token, "params": token["params"] + tables["params"]}
        return tg.DistAdam([merged, *rest], lr=args.adam_lr, betas=token["betas"], eps=args.adam_eps,
                           update=update), muon

    monkeypatch.setattr(tg, "build_optimizers", one_embedding_group)
    merged = tg.train(args)
    monkeypatch.undo()
    assert split.train_losses == merged.train_losses and split.val_losses == merged.val_losses
    decayed = tg.train(tiny_args(**FAST, num_iterations=10, val_every=5, **{**untied, "embed_weight_decay": 0.5}))
    assert decayed.train_losses[0] == split.train_losses[0] and decayed.train_losses[-1] != split.train_losses[-1]
    assert decayed.val_losses[-1][1] < decayed.val_losses[0][1] - 0.5


def test_embed_decay_fields_are_checked():
    for kind in ("embed", "head"):
        with pytest.raises(ValueError, match=f"{kind}_weight_decay"):
            tg.Hyperparameters(**{f"{kind}_weight_decay": -0.1})
        with pytest.raises(ValueError, match=f"{kind}_adam_betas"):
            tg.Hyperparameters(**{f"{kind}_adam_betas": (0.75,)})
        assert getattr(tg.parse_args([f"--{kind}_adam_betas", "0.5,0.95"]), f"{kind}_adam_betas") == (0.5, 0.95)


def test_the_lm_head_takes_its_own_betas_and_decay_and_they_change_the_run(tiny_args):
    """The head's Adam group (as the 2026 records' head: betas 0.5/0.95, cautious decay); the other groups
    keep theirs. Off (the defaults), the run is the one before the fields existed (the test above)."""
    plain_groups = dict(embed_weight_decay=0.0, embed_adam_betas=(), scalar_adam_betas=(), tied_embed_stages=0)
    args = tg.Hyperparameters(**{**TINY, **plain_groups, "head_adam_betas": (0.5, 0.95), "head_weight_decay": 0.375})
    adam, _ = tg.build_optimizers(tg.GPT(tg.ModelConfig.from_args(args)), args, 0, 1)
    token, tables, head, scalars, *_ = adam.param_groups  # then MUDD's, its gates', the pointer's
    assert (head["betas"], head["weight_decay"]) == ((0.5, 0.95), 0.375)
    assert all(g["betas"] == (0.8, 0.95) and g["weight_decay"] == 0 for g in (token, tables, scalars))
    tied = tg.Hyperparameters(**{**TINY, "head_adam_betas": (0.5, 0.95), "head_weight_decay": 0.375, "tied_embed_stages": 1})
    token, _, head, *_ = tg.build_optimizers(tg.GPT(tg.ModelConfig.from_args(tied)), tied, 0, 1)[0].param_groups
    assert (token["lr"], token["betas"], token["weight_decay"]) == (head["lr"], (0.5, 0.95), 0.375)  # untied: the head's
    kw = dict(FAST, num_iterations=10, val_every=5, logit_softcap=23.0, softcap_shift=5.0)
    plain = tg.train(tiny_args(head_adam_betas=(), head_weight_decay=0.0, **kw))  # Adam's betas, no decay
    betas = tg.train(tiny_args(head_adam_betas=(0.5, 0.95), head_weight_decay=0.0, **kw))
    decayed = tg.train(tiny_args(head_adam_betas=(), head_weight_decay=50.0, **kw))  # strong: it shows in 10 steps
    for run in (betas, decayed):
        assert run.train_losses[0] == plain.train_losses[0] and run.train_losses[-1] != plain.train_losses[-1]
        # the record model: 4.26 -> 3.92 in 8 steps of TINY's batch, in 10 of FAST's two micro-batches
        assert run.val_losses[-1][1] < run.val_losses[0][1] - 0.25


@pytest.mark.parametrize("every", [1, 2, 3])
def test_adam_steps_every_nth_step_on_the_gradient_summed_since_its_last_step_and_muon_every_step(
        tiny_args, monkeypatch, every):
    """Every micro-batch's gradient reaching the LM head is recorded as it arrives: at each Adam step the
    head's gradient is the sum of those since the previous Adam step; Muon steps after every step."""
    arrived, at_adam, muon_steps, built = [], [], [], {}
    build, adam_launch, muon_launch = tg.build, tg.DistAdam.launch_reduce, tg.Muon.launch_reduce

    def capturing(*a, **k):
        out = build(*a, **k)
        built["head"] = out[0].lm_head_w
        built["head"].register_hook(lambda g: arrived.append(g.detach().clone()))
        return out

    def adam_recording(self):  # train_step runs the optimizers in phases; the first one of Adam's step
        at_adam.append((len(arrived), built["head"].grad.clone()))
        return adam_launch(self)
    monkeypatch.setattr(tg, "build", capturing)
    monkeypatch.setattr(tg.DistAdam, "launch_reduce", adam_recording)
    monkeypatch.setattr(tg.Muon, "launch_reduce", lambda self: (muon_steps.append(1), muon_launch(self))[1])
    # untied: a tied head's token lookups reach it through the table-gradient sums, not its hook
    run = tg.train(tiny_args(**FAST, num_iterations=6, val_every=6, adam_every=every, tied_embed_stages=0))
    micro = FAST["batch_size"] // TINY["seq_len"]
    assert len(muon_steps) == 6 and [n for n, _ in at_adam] == [micro * s for s in range(every, 7, every)]
    start = 0
    for n, grad in at_adam:
        torch.testing.assert_close(grad, torch.stack(arrived[start:n]).sum(0), rtol=1e-5, atol=1e-6)
        start = n
    assert run.val_losses[-1][1] < run.val_losses[0][1]


def test_adam_every_is_checked_against_the_checkpoint_cadence(tiny_args):
    assert tiny_args(adam_every=2, save_every=4).adam_every == 2
    for bad in (dict(adam_every=0), dict(adam_every=2, save_every=3)):
        with pytest.raises(ValueError, match="save_every must be a multiple of it"):
            tiny_args(**bad)


def test_the_tables_adam_period_starts_at_its_fraction_with_betas_and_decay_per_update(tiny_args):
    """table_adam_every (4, 0.5) at 16 steps, Adam every second step: the tables step with Adam (steps 1, 3, 5, 7)
    until step 8, then every fourth step (11, 15), their betas squared and decay doubled there; checkpoints wait for
    the tables' step. Bad settings are refused with the rule."""
    schedule = tg.Schedule(tiny_args(num_iterations=16, adam_every=2, table_adam_every=(4, 0.5)))
    assert [s for s in range(16) if schedule.adam_steps_at(s)] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert [s for s in range(16) if schedule.tables_step_at(s)] == [1, 3, 5, 7, 11, 15]
    group = dict(initial_betas=(0.75, 0.95), initial_weight_decay=0.025)
    assert schedule.table_adam_settings(7, group) == ((0.75, 0.95), 0.025)
    assert schedule.table_adam_settings(8, group) == ((0.75 ** 2, 0.95 ** 2), 0.05)
    # a stop after `step` steps waits while a sum is pending: after 10 steps the tables' is (their last step was 7)
    pending = [step for step in range(1, 16) if step % tg.table_adam_period(schedule.args, step - 1)]
    assert pending == [1, 3, 5, 7, 9, 10, 11, 13, 14, 15]
    assert tg.Schedule(tiny_args(num_iterations=16)).tables_step_at(9)  # off: with Adam
    for bad in (dict(table_adam_every=(3, 0.5)), dict(table_adam_every=(4,)), dict(table_adam_every=(4, 1.0)),
                dict(table_adam_every=(4.5, 0.5)), dict(table_adam_every=(4, 0.5), save_every=2)):
        with pytest.raises(ValueError, match="a multiple of adam_every=2"):
            tiny_args(adam_every=2, **bad)


def test_with_a_longer_table_period_the_tables_sums_keep_summing_over_adams_other_steps(tiny_args, monkeypatch):
    """table_adam_every (4, 0.5) over 8 steps: at Adam's step 5 the value-embedding tables get no gradient and their
    sums go on; at step 7 their gradient is the sum over steps 4-7 and their group's betas are squared. The n-gram
    table's log (row-sparse Adam) flushes on the tables' steps only. At (2, 0) the run equals the default's exactly."""
    seen, build, flush = {}, tg.build, tg.GPT.flush_table_grads

    def capturing(*a, **k):
        out = build(*a, **k)
        seen["model"], seen["adam"] = out[0], out[2][0]
        return out

    def recording(self, tables=True):
        ve = self.value_embeds[0]
        before, logged = ve.grad_sum.clone(), self.ngram_logged
        flush(self, tables)
        group = next(g for g in seen["adam"].param_groups if g.get("tables") and not g.get("sparse_rows"))
        seen.setdefault("flushes", []).append(dict(
            tables=tables, before=before.to(ve.weight.dtype), grad=None if ve.weight.grad is None else ve.weight.grad.clone(),
            after=ve.grad_sum.clone(), logged=logged, sparse=self.bigram_embed.weight.sparse_grad is not None,
            betas=group["betas"]))
    monkeypatch.setattr(tg, "build", capturing)
    monkeypatch.setattr(tg.GPT, "flush_table_grads", recording)
    kw = dict(FAST, num_iterations=8, val_every=8, adam_every=2, trigram_rows=256, ngram_sparse_adam=True)
    run = tg.train(tiny_args(**kw, table_adam_every=(4, 0.5)))
    flushes = seen["flushes"]  # Adam's steps 1, 3, 5, 7
    assert [f["tables"] for f in flushes] == [True, True, False, True]
    assert [f["sparse"] for f in flushes] == [True, True, False, True]
    step5, step7 = flushes[2], flushes[3]
    assert step5["grad"] is None and torch.equal(step5["after"].to(step5["before"].dtype), step5["before"])
    assert step5["before"].abs().sum() > 0
    assert step7["logged"] == 2 * step5["logged"]  # the n-gram log held four steps' lookups, not two
    assert torch.equal(step7["grad"], step7["before"])  # the sum since step 4, in the table's dtype
    assert not step7["after"].any()
    assert flushes[1]["betas"] == (0.75, 0.95) and step7["betas"] == (0.75 ** 2, 0.95 ** 2)
    assert run.val_losses[-1][1] < run.val_losses[0][1]
    seen.clear()
    monkeypatch.setattr(tg.GPT, "flush_table_grads", flush)
    same = tg.train(tiny_args(**kw, table_adam_every=(2, 0.0)))
    plain = tg.train(tiny_args(**kw))
    assert same.train_losses == plain.train_losses and same.val_losses == plain.val_losses


def test_muon_lr_mults_scale_a_matrix_update_as_the_shape_factor_does_and_split_its_group():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    a, b, c = (torch.nn.Parameter(torch.zeros(64, 32)) for _ in range(3))
    muon = tg.Muon([a, b, c], lr=0.1, momentum=0.9, lr_mults={b: 2.0, c: 4.0})
    assert sorted(grp["lr_mult"] for grp in muon.param_groups) == [1.0, 2.0, 4.0]
    for p in (a, b, c):
        p.grad = g.clone()
    muon.step()
    torch.testing.assert_close(b.detach(), 2 * a.detach())
    torch.testing.assert_close(c.detach(), 4 * a.detach())


def test_the_mlp_muon_rates_and_the_scalars_betas_are_built_from_their_fields_and_checked():
    args = tg.Hyperparameters(**{**TINY, "mlp_muon_lr_mults": (2.0, 4.0), "scalar_adam_betas": (0.9, 0.99)})
    model = tg.GPT(tg.ModelConfig.from_args(args))
    adam, muon = tg.build_optimizers(model, args, 0, 1)
    mult = {id(p): grp["lr_mult"] for grp in muon.param_groups for p in grp["params"]}
    for block in model.blocks:
        assert (mult[id(block.mlp.fc_w)], mult[id(block.mlp.proj_w)]) == (2.0, 4.0)
        assert block.attn is None or mult[id(block.attn.qkvo_w)] == 1.0
    assert adam.param_groups[3]["params"] == [model.scalars] and adam.param_groups[3]["betas"] == (0.9, 0.99)
    plain = tg.build_optimizers(model, tg.Hyperparameters(**{**TINY, "mlp_muon_lr_mults": ()}), 0, 1)[1]  # () = 1, 1
    assert {grp["lr_mult"] for grp in plain.param_groups} == {1.0}
    for bad in (dict(mlp_muon_lr_mults=(2.0,)), dict(mlp_muon_lr_mults=(2.0, 0.0)), dict(scalar_adam_betas=(0.9,))):
        with pytest.raises(ValueError, match="empty, or two"):
            tg.Hyperparameters(**{**TINY, **bad})


def test_dist_adam_refuses_a_parameter_that_does_not_shard():
    with pytest.raises(ValueError, match="does not split"):
        tg.DistAdam([torch.nn.Parameter(torch.zeros(5, 3))], lr=1e-3, betas=(0.8, 0.95), eps=1e-10,
                    rank=0, world_size=2)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_orthogonalization_work_of_the_record_model_is_spread_over_ranks_group_by_group(world_size):
    """An orthogonalization costs ~m^2 n per m x n matrix (m <= n). The record's 11 blocks in ANVIL2's layout hold 22
    MLP matrices of 768 x 2816 (the MLPs of the 10 blocks left after block 7's removal and block 8's second one, stored
    alike: one group at equal rates) and 7 attention sublayers (none in blocks 4, 6, 7 and 9) in four shapes: stacks
    of 4 x 768^2 (the wide blocks 3, 10), 2 x 768^2 and 2 x 384 x 768 (V/O and Q/K of the narrow-Q/K blocks 0, 2, 5),
    4 x 384 x 768 (blocks 1, 8, narrow V too); each group is split over the ranks on its own, so the busiest rank
    does ceil(n/w) of each group's n, plus the smear gate's and value-embedding gates' tiny matrices."""
    with torch.device("meta"):
        model = tg.GPT(tg.ModelConfig.from_args(tg.Hyperparameters()))
    params = tg.param_groups_by_role(model)["block matrices"]
    loads = []
    for rank in range(world_size):
        muon = tg.Muon(params, lr=0.05, momentum=0.95, rank=rank, world_size=world_size)
        work = 0
        for group in muon.param_groups:
            per_rank, first = muon._owned(group)
            for p in group["params"][first: first + per_rank]:
                m, n = sorted(p.shape[-2:])
                work += p.numel() // (m * n) * m * m * n
        loads.append(work)
    mlp, wide, narrow = 768 * 768 * 2816, 768 ** 3, 384 * 384 * 768  # one matrix's work, by shape
    stacks = [(22, mlp), (2, 4 * wide), (3, 2 * wide), (3, 2 * narrow), (2, 4 * narrow)]  # (params, work of each)
    gates = 3 * 6 * 6 * 12 + 12  # the value-embedding gates of blocks 1, 2 and 8 (6 x 12 each), the smear gate (1 x 12)
    busiest = sum(-(-n // world_size) * work for n, work in stacks)
    assert sum(loads) == sum(n * work for n, work in stacks) + gates
    assert busiest <= max(loads) <= busiest + gates  # the bound is what happens


def test_train_step_launches_every_reduce_scatter_before_any_update(tiny_args, monkeypatch):
    """Communication overlaps the optimizers' math: on an Adam step both optimizers' reduce-scatters are
    launched first (Muon's, then Adam's), then the updates, and the all-gathers are waited on last."""
    calls = []
    for cls in (tg.Muon, tg.DistAdam):
        for phase in ("launch_reduce", "apply_updates", "finish"):
            def recording(self, *a, _phase=phase, _orig=getattr(cls, phase), _name=cls.__name__):
                calls.append((_name, _phase))
                return _orig(self, *a)
            monkeypatch.setattr(cls, phase, recording)
    tg.train(tiny_args(**FAST, num_iterations=2, val_every=2, adam_every=2))
    muon_only = [("Muon", "launch_reduce"), ("Muon", "apply_updates"), ("Muon", "finish")]
    both = [("Muon", "launch_reduce"), ("DistAdam", "launch_reduce"), ("Muon", "apply_updates"),
            ("DistAdam", "apply_updates"), ("Muon", "finish"), ("DistAdam", "finish")]
    assert calls == muon_only + both


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16])
def test_cautious_decay_in_foreach_ops_equals_the_per_matrix_expression_bit_for_bit(update_dtype):
    """Muon's cautious decay, u + decay p (s p >= 0), as a group's multi-tensor ops: equal bit for bit, where s p is
    negative, zero (a zero slow rail, a zero weight) and positive, for float32 and bf16 updates (float32 weights,
    as --muon_bf16_comm keeps them)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 5, generator=g) for _ in range(3)]
    slow = [torch.randn(6, 5, generator=g) for _ in range(3)]
    slow[0][0] = 0.0
    params[1][1] = 0.0
    params[2][2] = -0.0
    updates = [torch.randn(6, 5, generator=g).to(update_dtype) for _ in range(3)]
    want = [u + 0.037 * p * (s * p >= 0) for p, u, s in zip(params, updates, slow)]
    got = tg.cautious_decay(updates, params, slow, 0.037)
    for w, o in zip(want, got):
        assert o.dtype == w.dtype and torch.equal(o.view(torch.int32), w.view(torch.int32))
    assert any(((s * p) < 0).any() and ((s * p) > 0).any() for s, p in zip(slow, params))
