"""kernels.transpose: the FP8 MLP's transposed operands (its input's e4m3 copy, its output gradient's) as a tiled
Triton kernel of their own (--fp8_transpose), instead of inside the reduction kernels Inductor fuses them into.
Bytes moved, nothing computed: the tests ask for equality, in Triton's CPU interpreter, compiled for an H100 without
one, and on a GPU inside the FP8 MLP's forward and backward."""
import pytest
import torch

import kernels
import train_gpt as tg
from test_kernels import run_in_triton_interpreter


def operands(T=200, dim=48, hidden=80, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(T, dim, generator=g)).bfloat16().to(device)
    fc_w, proj_w = ((0.2 * torch.randn(dim, hidden, generator=g)).to(device) for _ in range(2))
    grad = torch.randn(T, dim, generator=g).bfloat16().to(device)
    return x, fc_w, proj_w, grad


def check_equal(device="cpu") -> list[bool]:
    """The op against .T.contiguous() on e4m3 and bf16 matrices whose sides are no multiple of the 128-wide tiles,
    then fp8_mlp_operands' and the backward's gradient operands with and without it: each equal, bit for bit."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(300, 77, generator=g)
    same = [torch.equal(torch.ops.speedrun.transpose(t.to(device)).view(torch.uint8 if t.element_size() == 1
                                                                         else torch.int16),
                        t.to(device).T.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16))
            for t in (a.to(torch.float8_e4m3fn), a.bfloat16(), a[:5, :3].to(torch.float8_e4m3fn))]
    x, fc_w, proj_w, grad = operands(device=device)
    for got, want in ((tg.fp8_mlp_operands(x, fc_w, proj_w, True), tg.fp8_mlp_operands(x, fc_w, proj_w, False)),
                      (kernels._grad_operands(grad, True), kernels._grad_operands(grad, False))):
        same.append(all(torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                                    q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q)
                        for p, q in zip(got, want)))
    return same


TRANSPOSE_SCRIPT = """
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kernels, test_transpose_kernel as t
assert kernels.triton_runs_on(torch.zeros(1)), "the Triton interpreter is not in use"
print(json.dumps(t.check_equal()))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machines' check; the GPU test covers the compiled kernel")
def test_the_transpose_kernel_moves_every_byte_in_the_interpreter(tmp_path):
    assert run_in_triton_interpreter(TRANSPOSE_SCRIPT, tmp_path) == [True] * 5


def test_the_fp8_mlp_takes_it_where_chosen_and_nowhere_else(monkeypatch):
    """On by default (2026-11-30's GPU runs), off on a plain CPU; on with the FP8 MLP only; every MLP of the record's
    layout, the parallel one included, carries the choice into the op."""
    quiet = dict(log=lambda m: None)
    assert tg.parse_args([]).fp8_transpose and not tg.parse_args(["--fp8_transpose", "false"]).fp8_transpose
    assert not tg.choose_kernels(torch.device("cpu"), **quiet).transpose  # no FP8 MLP on a CPU
    from test_injection_sites import FULL
    cfg = tg.ModelConfig.from_args(tg.Hyperparameters(**FULL))  # its second MLP in block 8
    model = tg.GPT(cfg, tg.ModelKernels(fused_mlp=True, fp8_mlp=True, transpose=True))
    mlps = [m for m in model.modules() if isinstance(m, tg.MLP)]
    assert model.blocks[8].parallel_mlp in mlps and len(mlps) == 11 and all(m.fp8_transpose for m in mlps)
    assert not any(m.fp8_transpose for m in tg.GPT(cfg, tg.ModelKernels(fused_mlp=True, fp8_mlp=True)).modules()
                   if isinstance(m, tg.MLP))
    args, cpu = tg.Hyperparameters(**FULL), torch.device("cpu")  # the start-of-run line says so
    assert "MLP: fused fp8 (its transposes by kernel), " in tg.run_report(model, args, cpu, 1)[0]
    assert check_equal()[3:] == [True, True]  # plain CPU: both ways are PyTorch's transpose


def test_the_transpose_kernel_compiles_for_an_h100_without_one():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    t = kernels.TRANSPOSE_TILES
    for raw in ("*u8", "*i16"):
        signature = dict(x_ptr=raw, out_ptr=raw, M="i32", N="i32", BM="constexpr", BN="constexpr")
        compiled = triton.compile(ASTSource(fn=kernels._transpose_kernel, signature=signature,
                                            constexprs=dict(BM=t["BM"], BN=t["BN"])),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=t["num_warps"]))
        assert len(compiled.asm["cubin"]) > 1000 and compiled.metadata.shared <= 227 * 1024, raw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_fp8_mlp_computes_the_same_bits_with_the_transpose_kernel():
    assert check_equal("cuda") == [True] * 5
    if not kernels._fp8_mlp_runs_on(torch.zeros(1, device="cuda")):
        pytest.skip("the FP8 MLP needs Hopper's kernel")
    x, fc_w, proj_w, grad = operands(T=4096, dim=768, hidden=2816, device="cuda")
    results = []
    for kernel in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, fc_w, proj_w)]
        out = torch.ops.speedrun.relu2_mlp_all_fp8(leaves[0], *tg.fp8_mlp_operands(*leaves, kernel), kernel)[0]
        out.backward(grad)
        results.append([out, *(t.grad for t in leaves)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_transpose_kernel_inside_a_compiled_graph_gives_the_same_bits():
    """The op is a triton_op: inside torch.compile Inductor launches its kernel from its own code; the FP8 MLP's
    operands and gradient operands compiled with it equal those compiled without it, bit for bit."""
    x, fc_w, proj_w, grad = operands(T=4096, dim=768, hidden=2816, device="cuda")
    for fn, args in ((tg.fp8_mlp_operands, (x, fc_w, proj_w)), (kernels._grad_operands, (grad,))):
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        with_kernel, without = (compiled(*args, kernel) for kernel in (True, False))
        for p, q in zip(with_kernel, without):
            assert torch.equal(p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p,
                               q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q), fn.__name__
