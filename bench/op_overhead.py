"""Host time per call of the custom ops a training step launches, at shapes so small that the GPU finishes each
call before the host has issued the next: what a micro-batch pays on the CPU for each op, whatever its size.

    python bench/op_overhead.py [--calls 2000] [--tokens 256]

Also kernels.transpose and kernels.qk_norm_rope (triton_ops) beside the same kernels behind a custom_op and
Inductor's own form of the work, and FlashAttention-3's and -4's ops where they are installed.

Each op is called --calls times in a row without a synchronize (then one), eagerly and from inside a compiled
function (the way the model's compiled graph calls it: Inductor's generated code calling the op), and the wall time
per call is reported. At 16K-token micro-batches a step's GPU work is about 32 ms per micro-batch on an H100 and the
compiled forward and backward launch ~865 kernels (bench/results/record776_h100x2_20261127.md): an op that costs the
host a few hundred microseconds per call is what leaves the GPU idle there."""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    """Wall time per call of fn() over `calls` calls issued back to back, after 20 untimed ones."""
    return timing.back_to_back_ms(fn, calls, warmup=20, wall=True) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=256, help="rows of each op's input (small: host-bound)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("op_overhead.py: needs a CUDA GPU (the ops' Triton kernels and CUDA timing)")
    g = torch.Generator(device="cuda").manual_seed(0)
    T, dim, hidden = args.tokens, 768, 3072
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g).bfloat16()
    x = F.rms_norm(make(T, dim), (dim,))
    fc_w, proj_w = make(dim, hidden) * dim ** -0.5, make(dim, hidden) * hidden ** -0.5
    operands = tg.fp8_mlp_operands(x, fc_w, proj_w)
    post = torch.relu(x @ fc_w).square()
    grad = make(T, dim)
    f8 = lambda t: (t.float() / t.float().abs().max() * 200).to(torch.float8_e4m3fn)
    g_f8, proj_f8_t, post_f8 = f8(make(T, dim)), f8(proj_w.T.contiguous()), f8(post)
    rows = kernels.fp8_scale_rows(*(torch.ones(1, device="cuda") for _ in range(4)))
    ops = {
        "relu2_mlp_all_fp8 (forward)": lambda: torch.ops.speedrun.relu2_mlp_all_fp8(x, *operands),
        "relu2_fp8_grad_pre (its bwd)": lambda: torch.ops.speedrun.relu2_fp8_grad_pre(g_f8, proj_f8_t, post_f8, rows),
        "relu2_mlp_backward": lambda: torch.ops.speedrun.relu2_mlp_backward(grad, x, fc_w, proj_w, post),
        "a bare matmul (aten::mm)": lambda: x @ fc_w,
    }
    # kernels.transpose and kernels.qk_norm_rope are triton_ops (Inductor launches their kernels); the same kernels
    # behind a custom_op (how they first ran) and Inductor's own form of the work, for comparison
    x_f8 = (x.float() * 8).to(torch.float8_e4m3fn)
    H, D = 6, 128
    qkv = make(T, 3 * H * D)
    cos, sin = (make(T, D // 2).float() for _ in range(2))
    ops.update({
        "transpose (triton_op)": lambda: torch.ops.speedrun.transpose(x_f8),
        "transpose (custom_op)": lambda: torch.ops.op_overhead.transpose(x_f8),
        "transpose (Inductor's)": lambda: x_f8.T.contiguous(),
        "qk_norm_rope (triton_op)": lambda: torch.ops.speedrun.qk_norm_rope(qkv, cos, sin, None, H, D, D, False),
        "qk_norm_rope (custom_op)": lambda: torch.ops.op_overhead.qk_norm_rope(qkv, cos, sin, H, D),
        "qk_norm_rope (Inductor's)": lambda: kernels.qk_norm_rope_reference(qkv, cos, sin, None, H, D, D, False),
    })
    q = make(T, 6, 128)  # FlashAttention's operands: two documents
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32, device="cuda")
    if kernels._load_fa3():
        fa3 = kernels.flash_attention_op("fa3_overhead", kernels._fa3_forward, kernels._fa3_backward)
        ops["fa3 (forward)"] = lambda: fa3(q, q, q, cu, T, 128, 0.1)
    if "fa4" in kernels.available_attention_backends(torch.device("cuda")):  # its CuTe DSL front end, per call
        out, lse = torch.ops.speedrun.fa4(q, q, q, cu, T, 128, 0.1)
        ops["fa4 (forward)"] = lambda: torch.ops.speedrun.fa4(q, q, q, cu, T, 128, 0.1)
        ops["fa4_backward"] = lambda: torch.ops.speedrun.fa4_backward(out, q, q, q, out, lse, cu, T, 128, 0.1)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {T} tokens a call, "
          f"{args.calls} calls; microseconds per call, host-bound")
    # entering a compiled function (guards, wrappers) and one small kernel of Inductor's, taken off each op's figure
    entry = per_call_us(torch.compile(lambda: x + 1, fullgraph=True, dynamic=False), args.calls)
    print(f"{'entry + one Inductor kernel':28s} {entry:7.1f}")
    for name, op in ops.items():
        eager = per_call_us(op, args.calls)
        torch._dynamo.reset()  # each op's lambda compiles afresh (they share one code object)
        inside = per_call_us(torch.compile(lambda op=op: op(), fullgraph=True, dynamic=False), args.calls)
        print(f"{name:28s} eager {eager:7.1f}   inside a compiled function {inside - entry:7.1f} (+ entry)", flush=True)


@torch.library.custom_op("op_overhead::transpose", mutates_args=())
def transpose_custom(x: torch.Tensor) -> torch.Tensor:
    """kernels.transpose's kernel behind a custom_op (the op's first form), for x of 1-byte elements."""
    M, N = x.shape
    out = torch.empty(N, M, device=x.device, dtype=torch.uint8)
    t = kernels.TRANSPOSE_TILES
    kernels._transpose_kernel[(kernels.triton.cdiv(M, t["BM"]), kernels.triton.cdiv(N, t["BN"]))](
        x.view(torch.uint8), out, M, N, BM=t["BM"], BN=t["BN"], num_warps=t["num_warps"])
    return out.view(x.dtype)


transpose_custom.register_fake(lambda x: x.new_empty(x.size(1), x.size(0)))


@torch.library.custom_op("op_overhead::qk_norm_rope", mutates_args=())
def qk_custom(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.qk_norm_rope's forward kernel behind a custom_op (the op's first form): no key offset, not paired."""
    T = qkv.size(0)
    grid, meta = kernels._qk_rope_launch(qkv, cos, heads, dim, dim, False, None)
    q, k, v = (qkv.new_empty(T, heads, dim) for _ in range(3))
    kernels._qk_norm_rope_fwd_kernel[grid](qkv, cos, sin, qkv, q, k, v, T, **meta)
    return q, k, v


qk_custom.register_fake(lambda qkv, cos, sin, heads, dim: tuple(qkv.new_empty(qkv.size(0), heads, dim)
                                                                 for _ in range(3)))


if __name__ == "__main__":
    main()
