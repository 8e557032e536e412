"""kernels.qk_norm_rope: the attention's QK-norm, rotary and partial key offset as one Triton kernel each way (the
model's norm, rotate and offset_keys, train_gpt.py's CausalSelfAttention), reading the QKV projection as it is and
writing its whole gradient. Its reference against the model's functions; in Triton's CPU interpreter, the kernels
against the reference and the whole model (ANVIL2's layout: paired heads, key offsets, narrow heads) against its
compiled-by-Inductor form, gradients included; compiled for an H100 without one; on a GPU, the compiled kernels."""
import pytest
import torch

import kernels
import train_gpt as tg
from test_kernels import run_in_triton_interpreter


def qk_case(T=75, H=4, D=16, DV=16, key_offset=False, seed=0, dtype=torch.float32, device="cpu"):
    """qkv (T, H (2 D + DV)) with signal, tables cut from wider ones as the narrow heads' are (a column slice), four
    documents (starts) where key_offset, and upstream gradients of q, k, v."""
    g = torch.Generator().manual_seed(seed)
    qkv = 3 * torch.randn(T, H * (2 * D + DV), generator=g)
    wide = torch.randn(2 * T + 5, 2 * D, generator=g)
    cos, sin = wide[:, : D // 2], wide[:, D: D + D // 2]
    starts = None
    if key_offset:
        starts = torch.zeros(T, dtype=torch.bool)
        starts[[0, 7, 8, T // 2]] = True  # a one-token document among them
        starts = starts.to(device)
    ups = [torch.randn(T, H, w, generator=g).to(device, dtype) for w in (D, D, DV)]
    return qkv.to(device, dtype), cos.to(device), sin.to(device), starts, ups


def check_qk_op(T, H, D, DV, paired, key_offset, **kw) -> list[float]:
    """Max abs errors of the op's q, k, v and its gradient of qkv against the reference's (autograd through it)."""
    qkv, cos, sin, starts, ups = qk_case(T, H, D, DV, key_offset, **kw)
    results = []
    for fn in (kernels.qk_norm_rope, kernels.qk_norm_rope_reference):
        leaf = qkv.detach().clone().requires_grad_()
        outs = fn(leaf, cos, sin, starts, H, D, DV, paired)
        sum((o.float() * u.float()).sum() for o, u in zip(outs, ups)).backward()
        results.append([o.float() for o in outs] + [leaf.grad.float()])
    return [(a - b).abs().max().item() / max(b.abs().max().item(), 1e-30) for a, b in zip(*results)]


def check_model(fused_on_cpu: bool = True) -> tuple[float, float]:
    """ANVIL2's layout on the tiny model with narrow heads (paired heads in 0, 2, 5, key offsets in 3, 10, Q/K
    narrower than V in 0, 2, 5): the loss's and the largest gradient's differences (relative) with every
    attention block through the op against the same weights through norm/rotate/offset_keys."""
    from test_injection_sites import FULL, model_of
    from test_narrow_heads import loss_and_grads
    # in float32 throughout (the model's bf16 embeddings made float32): the op rounds its outputs once, the compiled
    # functions after the norm and again after rotary, which in bf16 differ by an ulp here and there
    model = model_of({**FULL, "narrow_qk_blocks": (0, 1, 2, 5, 8), "narrow_v_blocks": (1, 8)}, randomize=True).float()
    attn = [b.attn for b in model.blocks if getattr(b, "attn", None) is not None]
    assert {a.paired for a in attn} == {True, False} and any(a.key_offset for a in attn)
    assert any(a.qk_dim < a.v_dim for a in attn) and any(a.qk_dim == a.v_dim < a.head_dim for a in attn)
    results = []
    for fused in (fused_on_cpu, False):
        for a in attn:
            a.fused_qk_rope = fused
        results.append(loss_and_grads(model))
    (l0, g0), (l1, g1) = results
    assert g0.keys() == g1.keys()
    top = max(g.abs().max().item() for g in g1.values())
    return abs(l0.item() - l1.item()) / abs(l1.item()), max((g0[n] - g1[n]).abs().max().item() for n in g0) / top


def test_the_reference_is_the_models_norm_rotate_and_key_offset():
    """qk_norm_rope_reference against train_gpt's norm, rotate, offset_keys and pair_heads on the model's rotary
    tables: keys offset at documents of 9, 1, 15 and 15 tokens; paired heads at their doubled rows; narrow tables."""
    T, H, D = 40, 4, 16
    qkv = torch.randn(T, 3 * H * D, generator=torch.Generator().manual_seed(1))
    cos, sin, _ = tg.Rotary(2 * D, 2 * T, 1 / 64).at(0)
    cos, sin = cos[:, : D // 2], sin[:, : D // 2]  # a narrow head's tables, as CausalSelfAttention cuts them
    rope = (cos, sin, 1.0)
    cu = torch.tensor([0, 9, 10, 25, T], dtype=torch.int32)
    q, k, v = (t.contiguous() for t in qkv.view(T, 3 * H, D).split(H, dim=1))
    got = kernels.qk_norm_rope_reference(qkv, cos, sin, tg.document_starts(cu, T), H, D, D, False)
    want = (tg.rotate(tg.norm(q), rope), tg.offset_keys(tg.rotate(tg.norm(k), rope), cu), v)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    got = kernels.qk_norm_rope_reference(qkv, cos, sin, None, H, D, D, True)
    for x, y in zip(got[:2], (q, k)):
        torch.testing.assert_close(x.view(2 * T, H // 2, D), tg.rotate(tg.norm(tg.pair_heads(y)), rope),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="key offset of paired heads"):
        kernels.qk_norm_rope_reference(qkv, cos, sin, tg.document_starts(cu, T), H, D, D, True)


QK_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, test_qk_rope_kernels as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
# T not a multiple of the 64-token tiles; plain, paired (V wider than Q/K), key offset (two widths)
errors = t.check_qk_op(75, 4, 16, 16, False, False) + t.check_qk_op(75, 4, 16, 32, True, False)
errors += t.check_qk_op(75, 2, 32, 32, False, True) + t.check_qk_op(130, 6, 16, 8, False, True)
errors += list(t.check_model())
print(json.dumps(errors))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernels")
def test_qk_rope_kernels_match_the_reference_and_the_model_in_the_interpreter(tmp_path):
    errors = run_in_triton_interpreter(QK_SCRIPT, tmp_path)
    assert len(errors) == 18 and max(errors) < 1e-5, errors


def test_the_model_runs_the_kernels_where_triton_runs_and_says_so(monkeypatch):
    """choose_kernels turns them on where Triton runs (a CUDA GPU, the interpreter), off on a plain CPU and under
    fused_qk_rope=False (on by default since 2026-11-30's GPU runs); every attention block takes the choice but one with
    paired heads and a key offset (not written); the start-of-run line says which form runs. On a plain CPU the op is its reference, gradient included:
    the model through it equals the compiled functions' form."""
    quiet = dict(log=lambda m: None)
    assert tg.choose_kernels(torch.device("cpu"), **quiet).qk_rope == kernels.INTERPRET
    monkeypatch.setattr(kernels, "INTERPRET", True)
    assert tg.choose_kernels(torch.device("cpu"), **quiet).qk_rope
    assert not tg.choose_kernels(torch.device("cpu"), fused_qk_rope=False, **quiet).qk_rope
    assert tg.parse_args([]).fused_qk_rope and not tg.parse_args(["--fused_qk_rope", "false"]).fused_qk_rope
    monkeypatch.undo()
    from conftest import TINY
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**TINY))
    model = tg.GPT(cfg, tg.ModelKernels(qk_rope=True))
    assert all(b.attn.fused_qk_rope for b in model.blocks if b.attn is not None)
    assert not any(b.attn.fused_qk_rope for b in tg.GPT(cfg).blocks if b.attn is not None)
    both = tg.CausalSelfAttention(cfg, None, ve_gate=False, key_offset=True, paired=True, fused_qk_rope=True)
    assert not both.fused_qk_rope
    args, cpu = tg.Hyperparameters(**TINY), torch.device("cpu")
    assert "QK-norm and rotary: kernels, " in tg.run_report(model, args, cpu, 1)[0]
    assert "QK-norm and rotary: compiled, " in tg.run_report(tg.GPT(cfg), args, cpu, 1)[0]
    if not kernels.INTERPRET:  # the reference path of the op (its autograd through the reference)
        loss_gap, grad_gap = check_model()
        assert loss_gap < 1e-5 and grad_gap < 1e-5, (loss_gap, grad_gap)


def test_qk_rope_kernels_compile_for_an_h100_without_one():
    """Both kernels with kernels.QK_ROPE_TILES at the record's shapes (6 heads; Q/K 128 or 64 wide, V 128 or 64;
    paired or key offset; bf16), compiled for sm_90 down to a cubin (no GPU needed): what only the compiler rejects."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for fn in (kernels._qk_norm_rope_fwd_kernel, kernels._qk_norm_rope_bwd_kernel):
        for D, DV, paired, offset in ((128, 128, False, True), (64, 128, True, False), (64, 64, False, False)):
            constexprs = dict(H=6, D=D, DV=DV, PAIRED=paired, KEY_OFFSET=offset, BT=kernels.QK_ROPE_TILES["BT"])
            signature = {n: "constexpr" if n in constexprs else "fp32" if n == "eps" else
                         ("*fp32" if n in ("cos_ptr", "sin_ptr") else "*u8" if n == "start_ptr" else "*bf16")
                         if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=kernels.QK_ROPE_TILES["num_warps"]))
            assert len(compiled.asm["cubin"]) > 1000 and compiled.metadata.shared <= 227 * 1024, fn.__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D, DV, paired, key_offset", [(128, 128, False, True), (64, 128, True, False),
                                                      (64, 64, False, False)])
def test_qk_rope_kernels_on_the_gpu_match_the_reference_in_bf16(D, DV, paired, key_offset):
    """The record's widths, 6 heads, 3,000 tokens in bf16 against the float32 reference on the same inputs."""
    errors = check_qk_op(3000, 6, D, DV, paired, key_offset, dtype=torch.bfloat16, device="cuda")
    assert max(errors) < 0.01, errors  # bf16 outputs: one rounding (the reference's float32 rounded once too)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qk_rope_kernels_inside_a_compiled_graph_equal_their_eager_calls():
    """The op is a triton_op: inside torch.compile Inductor compiles and launches its kernels from its own code.
    Forward and backward there agree with the eager call (the same kernels on the same inputs) to bf16's last bit:
    Inductor's build of a kernel may contract other multiply-adds than Triton's own."""
    for key_offset in (False, True):
        qkv, cos, sin, starts, ups = qk_case(3000, 6, 128, 128, key_offset, dtype=torch.bfloat16, device="cuda")

        def f(x):
            outs = kernels.qk_norm_rope(x, cos, sin, starts, 6, 128, 128, False)
            return list(outs), sum((o.float() * u.float()).sum() for o, u in zip(outs, ups))
        results = []
        for fn in (f, torch.compile(f, fullgraph=True, dynamic=False)):
            leaf = qkv.detach().clone().requires_grad_()
            outs, loss = fn(leaf)
            loss.backward()
            results.append(outs + [leaf.grad])
        errors = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*results)]
        assert max(errors) <= 2 ** -8, (key_offset, errors)
