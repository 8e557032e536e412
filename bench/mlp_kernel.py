"""Time one ReLU² MLP, forward and backward, at the record's micro-batch shape on one GPU: the
unfused MLP as torch.compile builds it (cuBLAS matmuls, ReLU² as separate fused elementwise kernels)
against kernels.py's relu2_mlp (ReLU² in Triton matmul epilogues) with each tile configuration
given, and the FP8 MLP (relu2_mlp_all_fp8, forward and backward, with its operands quantized as train_gpt.py's
MLP does, in one compiled function; Hopper only) with each FP8 tile configuration; each with its relative error
against the unfused MLP. Seconds per run, not minutes of model compile: the way to choose kernels.RELU2_TILES and
RELU2_FP8_TILES before timing whole steps (bench/step_time.py --fused_mlp true [--fp8_mlp true]).

    python bench/mlp_kernel.py [--tokens 49152] [--tiles 128,128,64,8,3 ...] [--fp8_tiles 128,256,128,8,3 ...]
        [--pointer_kernel]

A tile configuration is BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages (GROUP_M stays 8)."""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402  (fp8_mlp_operands)


def unfused(x, fc_w, proj_w):
    return F.linear(F.relu(x @ fc_w).square(), proj_w)  # as train_gpt.py's MLP.forward


def fused(x, fc_w, proj_w):
    return torch.ops.speedrun.relu2_mlp(x, fc_w, proj_w)[0]


@torch.compile(fullgraph=True)
def fp8(x, fc_w, proj_w):
    return torch.ops.speedrun.relu2_mlp_all_fp8(x, *tg.fp8_mlp_operands(x, fc_w, proj_w))[0]


def parse_tiles(text: str) -> dict:
    """"BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages" as kernels.RELU2_TILES holds it (GROUP_M 8)."""
    m, n, k, warps, stages = map(int, text.split(","))
    return dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=warps, num_stages=stages)


def time_fwd_bwd(fn, inputs, grad, iters: int) -> float:
    """Median ms of forward + backward over iters runs, after three untimed ones."""
    def no_grads():
        for t in inputs:
            t.grad = None
    return timing.median_ms(lambda: fn(*inputs).backward(grad), iters, before=no_grads)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152, help="rows of the micro-batch")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--tiles", nargs="+", default=["128,128,64,8,3", "128,256,64,8,3", "128,128,32,4,4"],
                        help="BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages per configuration")
    parser.add_argument("--fp8_tiles", nargs="*", default=["128,256,128,8,3", "128,128,128,8,4", "128,256,64,8,4"],
                        help="the same for the FP8 kernel, forward and backward (none: no FP8 timing)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--pointer_kernel", action="store_true",
                        help="on Hopper too, the pointer-based _matmul_relu2_kernel, not _matmul_relu2_tma_kernel")
    args = parser.parse_args()
    if args.pointer_kernel:
        kernels.relu2_tma_programs = lambda device: 0
    if not torch.cuda.is_available():
        sys.exit("mlp_kernel.py: needs a CUDA GPU (the Triton kernels and CUDA-event timing)")
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape, s=1.0: (s * torch.randn(*shape, device="cuda", generator=g)).bfloat16().requires_grad_()
    inputs = [make(args.tokens, args.dim), make(args.dim, args.hidden, s=args.dim ** -0.5),
              make(args.dim, args.hidden, s=args.hidden ** -0.5)]
    with torch.no_grad():  # the MLP's input is RMS-normed (the FP8 scale of x relies on it)
        inputs[0].copy_(F.rms_norm(inputs[0], (args.dim,)))
    grad = torch.randn(args.tokens, args.dim, device="cuda", generator=g).bfloat16()
    kernel = "_matmul_relu2_tma_kernel" if kernels.relu2_tma_programs(torch.device("cuda")) else "_matmul_relu2_kernel"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; MLP {args.tokens} x {args.dim} "
          f"-> {args.hidden} -> {args.dim}, bf16, forward + backward, median of {args.iters}; fused: {kernel}")
    compiled = torch.compile(unfused, fullgraph=True)
    base = time_fwd_bwd(compiled, inputs, grad, args.iters)
    for t in inputs:
        t.grad = None
    reference = compiled(*inputs)
    reference.backward(grad)
    reference, ref_grads = reference.detach(), [t.grad.float() for t in inputs]
    print(f"unfused (torch.compile): {base:.3f} ms")
    bf16_tiles = dict(kernels.RELU2_TILES)
    for name, fn, all_tiles in [("fused", fused, args.tiles), ("fp8", fp8, args.fp8_tiles)]:
        for tiles in all_tiles:
            chosen = parse_tiles(tiles)
            if name == "fused":
                kernels.RELU2_TILES = chosen
            elif not kernels.relu2_tma_programs(torch.device("cuda")):
                print("fp8: runs in Hopper's TMA kernel only (sm90+)")
                break
            else:
                kernels.RELU2_TILES, kernels.RELU2_FP8_TILES = bf16_tiles, chosen
            try:
                ms = time_fwd_bwd(fn, inputs, grad, args.iters)
            except Exception as e:  # a configuration the GPU cannot hold (shared memory, registers): say so, go on
                print(f"{name} {tiles}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            for t in inputs:
                t.grad = None
            out = fn(*inputs)
            out.backward(grad)
            out = out.detach()
            rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
            err = max([rel(out, reference)] + [rel(t.grad, r) for t, r in zip(inputs, ref_grads)])
            print(f"{name} {tiles}: {ms:.3f} ms ({ms / base:.3f} x unfused); largest relative error {err:.1e}")


if __name__ == "__main__":
    main()
