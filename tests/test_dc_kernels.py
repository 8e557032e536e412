"""kernels.dc_attention: DC attention's correction (train_gpt.dc_correction, in the record's last block) as Triton
kernels, in Triton's CPU interpreter against a (T, T)-mask reference and against the model's written-out form,
gradients included; compiled for an H100 without one; on a GPU, the compiled kernels."""
import dataclasses

import pytest
import torch

import kernels
import train_gpt as tg
from test_kernels import run_in_triton_interpreter


def dc_case(T=150, H=3, D=32, seed=0, cu=(0, 30, 31, 70), dtype=torch.float32, device="cpu"):
    """q, k, v (T, H, D), documents (a one-token one among them, the last one ending past T's padding), the
    heads' mix w (T, H) and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, up = (torch.randn(T, H, D, generator=g) for _ in range(4))
    w = torch.randn(T, H, generator=g)
    cu = torch.tensor([*cu, T], dtype=torch.int32)
    return ([t.to(device, dtype) for t in (q, k, v)], kernels.document_ids(cu, T).int().to(device),
            w.to(device), up.to(device, dtype), cu.to(device))


def check_dc_op(tiles_bm: int, window: int, **case) -> list[float]:
    """Max abs errors of the op's output and its gradients of q, k, v, w against the reference, in float32."""
    kernels.DC_TILES["BM"] = tiles_bm
    (q, k, v), doc, w, up, _ = dc_case(**case)
    got, want = [], []
    for fn, out in ((lambda *a: kernels.dc_attention(*a)[0], got), (kernels.dc_attention_reference, want)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, w)]
        o = fn(*leaves[:3], doc, leaves[3], 0.3, window)
        (o * up).sum().backward()
        out += [o, *(t.grad for t in leaves)]
    return [(x - y).abs().max().item() for x, y in zip(got, want)]


def check_dc_correction(window: int) -> list[float]:
    """train_gpt.dc_correction through the kernels against its written-out form (chunks of 128 queries), output and
    gradients, w1 and w2 included."""
    kernels.DC_TILES["BM"] = 64
    (q, k, v), _, w1, up, cu = dc_case(T=300, H=6, D=16, cu=(0, 100, 101, 140))
    w2 = torch.randn(300, 6, generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, w1, w2)]
        o = tg.dc_correction(*leaves[:3], cu, leaves[3], leaves[4], 0.2, window=window, fused=fused)
        (o * up).sum().backward()
        results.append([o, *(t.grad for t in leaves)])
    return [(x - y).abs().max().item() for x, y in zip(*results)]


DC_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, test_dc_kernels as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
# blocks of 16 queries, a window of 20 (two key blocks a band); blocks of 64, the record's window 112 (three), T not a
# multiple of either; and the model's function both ways at the record's window
errors = t.check_dc_op(16, 20, T=75, H=3, D=16) + t.check_dc_op(64, 112, T=150, H=2, D=32)
errors += t.check_dc_correction(112)
print(json.dumps(errors))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernels")
def test_dc_kernels_match_the_reference_and_the_written_out_correction_in_the_interpreter(tmp_path):
    errors = run_in_triton_interpreter(DC_SCRIPT, tmp_path)
    assert len(errors) == 16 and max(errors) < 2e-5, errors


def test_the_model_runs_dc_through_the_kernels_where_triton_runs(monkeypatch):
    """choose_kernels turns the kernels on where Triton runs (a CUDA GPU, the interpreter), off on a plain CPU and
    under --fused_dc false; the last block's attention carries the choice, which its other blocks never use (no DC
    weights there)."""
    quiet = dict(log=lambda m: None)
    assert tg.choose_kernels(torch.device("cpu"), **quiet).dc == kernels.INTERPRET
    monkeypatch.setattr(kernels, "INTERPRET", True)  # as in Triton's interpreter
    assert tg.choose_kernels(torch.device("cpu"), **quiet).dc
    assert not tg.choose_kernels(torch.device("cpu"), fused_dc=False, **quiet).dc
    assert not tg.parse_args(["--fused_dc", "false"]).fused_dc and tg.parse_args([]).fused_dc
    monkeypatch.undo()
    from conftest import TINY
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**TINY))
    model = tg.GPT(cfg, tg.ModelKernels(dc=True))
    assert all(b.attn.fused_dc for b in model.blocks if b.attn is not None)
    assert not any(b.attn.fused_dc for b in tg.GPT(cfg).blocks if b.attn is not None)
    args, cpu = tg.Hyperparameters(**TINY), torch.device("cpu")  # the start-of-run line says which form runs
    assert "DC attention: kernels, " in tg.run_report(model, args, cpu, 1)[0]
    assert "DC attention: written out, " in tg.run_report(tg.GPT(cfg), args, cpu, 1)[0]
    assert "DC attention: off, " in tg.run_report(tg.GPT(cfg), dataclasses.replace(args, dc_attention=False), cpu, 1)[0]


def test_dc_kernels_compile_for_an_h100_without_one():
    """The five kernels with kernels.DC_TILES at the record's shape (6 heads of 128, bf16, window 112), compiled
    for sm_90 down to a cubin (no GPU needed): what only the compiler rejects, shared memory over 227 KiB included."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    BM, look, _ = kernels._dc_geometry(tg.DC_WINDOW)
    constexprs = dict(H=6, D=128, BM=BM, LOOK=look)
    f32 = ("w_ptr", "lse_ptr", "a_ptr", "da_ptr", "dw_ptr")
    for fn in (kernels._dc_fwd_mix_kernel, kernels._dc_fwd_out_kernel, kernels._dc_bwd_mix_kernel,
               kernels._dc_bwd_query_kernel, kernels._dc_bwd_key_kernel):
        signature = {n: "constexpr" if n in constexprs else "fp32" if n == "scale" else
                     ("*i32" if n == "doc_ptr" else "*fp32" if n in f32 else "*bf16") if n.endswith("_ptr") else "i32"
                     for n in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=kernels.DC_TILES["num_warps"],
                                               num_stages=kernels.DC_TILES["num_stages"]))
        assert len(compiled.asm["cubin"]) > 1000 and compiled.metadata.shared <= 227 * 1024, fn.__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dc_kernels_on_the_gpu_match_the_reference_in_bf16():
    """The record's shape but shorter: 6 heads of 128 in bf16, window 112, documents of a few hundred tokens; against
    the float32 reference on the same bf16 inputs (the mix A in bf16 for the values, as the written-out form)."""
    (q, k, v), doc, w, up, cu = dc_case(T=3000, H=6, D=128, cu=(0, 700, 701, 1900), dtype=torch.bfloat16,
                                        device="cuda")
    got, want = [], []
    for fn, out in ((lambda *a: kernels.dc_attention(*a)[0], got), (kernels.dc_attention_reference, want)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, w)]
        o = fn(*leaves[:3], doc, leaves[3], 0.12, 112)
        (o.float() * up.float()).sum().backward()
        out += [o.float(), *(t.grad.float() for t in leaves)]
    for name, x, y in zip(("o", "dq", "dk", "dv", "dw"), got, want):
        assert (x - y).abs().max() <= 0.02 * y.abs().max(), name  # bf16 operands and outputs
