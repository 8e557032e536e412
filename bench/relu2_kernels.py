"""Time the fused ReLU² matmul's kernels alone, one call at a time, at the record's micro-batch shape on one GPU:
kernels.py's pointer kernel (_matmul_relu2_kernel) and Hopper's TMA kernel (_matmul_relu2_tma_kernel), for the
FP8 forward (relu(x W_fc)² in e4m3, both layouts) and the backward's (grad W_projᵀ) * 2 sqrt(post); optionally the
public line's linear_relu_square (from its triton_kernels.py, given by path, run as it is) on the same operands.
Each row: median µs per call (triton.testing.do_bench), TFLOP/s, and the largest error against float32 torch
relative to the largest reference value. Then, on Hopper, the FP8 forward's parts apart: the kernel without its
transposed store, cuBLAS's matmul alone and the transposed copy of its e4m3 post by kernels.transpose (the TFLOP/s
column counts the matmul's FLOPs for each). bench/mlp_kernel.py times the whole op (with its cuBLAS matmuls) instead.

    python bench/relu2_kernels.py [--tokens 49152] [--public_kernels PATH/triton_kernels.py]
        [--fp8_tiles 128,256,64,8,7 ...] [--tiles 128,256,64,8,3 ...] [--input_grad]

--fp8_tiles / --tiles: more tile configurations to time for the FP8 forward and backward / the bf16 backward,
each BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages[,programs per SM] (GROUP_M 8), after kernels.py's own
(RELU2_FP8_TILES, RELU2_TILES). Programs per SM (default 1) sets how many persistent programs the TMA kernel runs
on each SM: two whose shared memory and registers fit beside each other let one's epilogue run while the other's
matmul does (the overlap cuBLAS gets from its two "ping-pong" warp groups).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import mlp_kernel  # noqa: E402


def parse_tiles(text: str) -> dict:
    """"BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages[,programs per SM]" as kernels.py's tile tables hold it."""
    fields = text.split(",")
    return dict(mlp_kernel.parse_tiles(",".join(fields[:5])), PER_SM=int(fields[5]) if len(fields) > 5 else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152, help="rows of the micro-batch")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--public_kernels", default="", help="the public line's triton_kernels.py (optional)")
    parser.add_argument("--fp8_tiles", nargs="*", default=[], help="more FP8 forward tile configurations")
    parser.add_argument("--tiles", nargs="*", default=[], help="more backward tile configurations")
    parser.add_argument("--input_grad", action="store_true",
                        help="also the up projection's input gradient (grad_pre W_fcᵀ) as the bf16 matmul it is and "
                             "as an FP8 one (_scaled_mm, grad_pre in e4m3 or e5m2): what an FP8 input gradient "
                             "could save, the quantization not counted (public pull request #363 does this)")
    parser.add_argument("--fp8_backward", action="store_true",
                        help="also the whole MLP backward: as train_gpt.py runs it (the fused kernel in bf16, then "
                             "three bf16 matmuls) against kernels.relu2_mlp_fp8_backward (every matmul in FP8, "
                             "grad_pre in e4m3 from the e4m3 post), and what its FP8 forward adds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("relu2_kernels.py: needs a CUDA GPU")
    from triton.testing import do_bench
    M, K, N = args.tokens, args.dim, args.hidden
    g = torch.Generator(device="cuda").manual_seed(0)
    x = F.rms_norm(torch.randn(M, K, device="cuda", generator=g), (K,)).bfloat16()
    fc_w = (torch.randn(K, N, device="cuda", generator=g) * K ** -0.5).bfloat16()  # (dim, hidden), as train_gpt.py
    proj_w = (torch.randn(K, N, device="cuda", generator=g) * N ** -0.5).bfloat16()
    grad = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    # FP8 operands scaled by their maxima (train_gpt.py scales by bounds; the kernels do not care)
    x_s, w_s = x.float().abs().max() / kernels.E4M3_MAX, fc_w.float().abs().max() / kernels.E4M3_MAX
    x_f8 = (x.float() / x_s).to(torch.float8_e4m3fn)
    fc_f8_t = (fc_w.float().T / w_s).to(torch.float8_e4m3fn).contiguous()  # (hidden, dim)
    post_ref = torch.relu((x_f8.float() @ fc_f8_t.float().T) * (x_s * w_s)).square()
    post_s = post_ref.max() * 1.25 / kernels.E4M3_MAX
    scales = torch.zeros(3, kernels.FP8_SCALE_ROW, device="cuda")
    scales[0, 0], scales[1, 0], scales[2, 0] = x_s * w_s, 1.0, post_s
    post = post_ref.bfloat16()
    grad_pre_ref = (grad.float() @ proj_w.float()) * 2 * post.float().sqrt()
    # the FP8 backward's operands as relu2_fp8_grad_pre takes them: the output's gradient and W_proj in e4m3, post
    # in e4m3 from the forward's scale; its result, grad_pre, in e4m3 at a scale of its largest value x 1.25
    g_s, p_s = grad.float().abs().max() / kernels.E4M3_MAX, proj_w.float().abs().max() / kernels.E4M3_MAX
    g_f8 = (grad.float() / g_s).to(torch.float8_e4m3fn)
    proj_f8_t = (proj_w.float().T / p_s).to(torch.float8_e4m3fn).contiguous()  # (hidden, dim)
    post_f8 = (post_ref / post_s).clamp(max=kernels.E4M3_MAX).to(torch.float8_e4m3fn)
    pre_f8_ref = (g_f8.float() @ proj_f8_t.float().T) * (g_s * p_s) * 2 * (post_f8.float() * post_s).sqrt()
    pre_s = pre_f8_ref.abs().max() * 1.25 / kernels.E4M3_MAX
    bwd_scales = torch.zeros(3, kernels.FP8_SCALE_ROW, device="cuda")
    bwd_scales[0, 0], bwd_scales[1, 0], bwd_scales[2, 0] = g_s * p_s, post_s, pre_s
    flops = 2 * M * K * N
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {M} x {K} -> {N}, {flops / 1e9:.0f} "
          f"GFLOP a call; median of do_bench")

    def row(name, fn, reference):
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        err = ((out.float() - reference).abs().max() / reference.abs().max()).item()
        us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{name:<56} {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s  error {err:.1e}", flush=True)

    tma = kernels.relu2_tma_programs(x.device)
    # the FP8 forward writes post in e4m3 (both layouts) and no bf16 post: compared in e4m3 units; Hopper only
    calls = [("FP8 forward", "RELU2_FP8_TILES", args.fp8_tiles, post_ref / post_s,
              lambda: kernels._matmul_relu2(x_f8, fc_f8_t.T, None, torch.bfloat16, scales)[1]),
             ("FP8 backward", "RELU2_FP8_BACKWARD_TILES", args.fp8_tiles, pre_f8_ref / pre_s,
              lambda: kernels._matmul_relu2(g_f8, proj_f8_t.T, post_f8, torch.float8_e4m3fn, bwd_scales)[0]),
             ("backward", "RELU2_TILES", args.tiles, grad_pre_ref,
              lambda: kernels._matmul_relu2(grad, proj_w, post, torch.bfloat16))]
    for kernel in ["_matmul_relu2_kernel"] + (["_matmul_relu2_tma_kernel"] if tma else []):
        kernels.relu2_tma_programs = (lambda device: 0) if kernel == "_matmul_relu2_kernel" else (lambda device: tma)
        for what, table, extra, reference, fn in calls:
            if what.startswith("FP8") and kernel == "_matmul_relu2_kernel":
                continue
            own = getattr(kernels, table)
            for tiles in [own] + [parse_tiles(t) for t in extra]:
                setattr(kernels, table, tiles)
                label = "" if tiles is own else " " + ",".join(
                    [str(v) for k, v in tiles.items() if k not in ("GROUP_M", "PER_SM")]) + f" {tiles['PER_SM']}/SM"
                try:
                    row(f"{kernel}: {what}{label}", fn, reference)
                except Exception as e:  # e.g. more shared memory than the GPU has: say so, go on
                    print(f"{kernel}: {what}{label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            setattr(kernels, table, own)
    if not tma:
        print("(no TMA kernel here: it runs on sm_90+ GPUs)")
    else:  # the FP8 forward's parts apart: cuBLAS's matmul alone (no epilogue), and the transposed copy of its e4m3
        # post as the transpose kernel makes it (what the epilogue's second, transposed store costs at most)
        pre_ref = (x_f8.float() @ fc_f8_t.float().T) * (x_s * w_s)
        one = lambda v: v.reshape(()).float()
        row("cuBLAS _scaled_mm: the FP8 forward's matmul alone, bf16 out", lambda: torch._scaled_mm(
            x_f8, fc_f8_t.T, scale_a=one(x_s), scale_b=one(w_s), out_dtype=torch.bfloat16, use_fast_accum=True),
            pre_ref)
        row("_matmul_relu2_tma_kernel: FP8 forward without its transposed store", lambda: kernels._matmul_relu2(
            x_f8, fc_f8_t.T, None, torch.bfloat16, scales, store_t=False)[1], post_ref / post_s)
        post_f8 = kernels._matmul_relu2(x_f8, fc_f8_t.T, None, torch.bfloat16, scales)[1]
        row("kernels.transpose: the e4m3 post's transposed copy", lambda: torch.ops.speedrun.transpose(post_f8),
            post_f8.float().T)
    if args.input_grad:
        grad_pre = grad_pre_ref.bfloat16()
        dx_ref = grad_pre.float() @ fc_w.float().T
        row("input gradient, bf16 matmul", lambda: grad_pre @ fc_w.T, dx_ref)
        w_col = fc_f8_t.T.contiguous().T  # W_fcᵀ (hidden, dim) column-major: _scaled_mm's second operand
        for dtype, top in ((torch.float8_e4m3fn, kernels.E4M3_MAX), (torch.float8_e5m2, 57344.0)):
            g_s = grad_pre.float().abs().max() / top
            g_f8 = (grad_pre.float() / g_s).to(dtype)
            scale_a, scale_b = g_s.reshape(()).float(), w_s.reshape(()).float()
            row(f"input gradient, FP8 matmul ({str(dtype).split('_')[1]} x e4m3)",
                lambda: torch._scaled_mm(g_f8, w_col, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                         use_fast_accum=True), dx_ref)
    if args.fp8_backward:
        fp8_backward_rows(x, fc_w, proj_w, grad, post, x_f8, x_s, w_s, fc_f8_t, scales, grad_pre_ref, do_bench)
    if args.public_kernels:
        spec = importlib.util.spec_from_file_location("public_triton_kernels", args.public_kernels)
        public = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(public)
        deq, act_s = (x_s * w_s).reshape(1).float(), post_s.reshape(1).float()
        amax = torch.zeros(torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")
        fc_nk, proj_nk = fc_w.T.contiguous(), proj_w.T.contiguous()  # its weights are (hidden, dim)
        # its FP8 forward also writes post in e4m3 and per-SM maxima
        row("public linear_relu_square: FP8 forward", lambda: public.linear_relu_square(
            x, fc_nk, a_f8=x_f8, b_f8=fc_f8_t, dequant_scale_ptr=deq, activation_scale=act_s, partial_amax=amax),
            post_ref)
        row("public linear_relu_square: backward", lambda: public.linear_relu_square(grad, proj_nk, aux=post),
            grad_pre_ref)


def fp8_backward_rows(x, fc_w, proj_w, grad, post, x_f8, x_s, w_s, fc_f8_t, scales, grad_pre_ref, do_bench):
    """The MLP's whole backward, bf16 (as train_gpt.py) and FP8 (kernels.relu2_mlp_fp8_backward): µs per call and
    each gradient's largest error against float32 arithmetic on the bf16 operands, relative to its largest value;
    then the FP8 forward kernel alone, and x's e4m3 copy in both layouts."""
    one = lambda v: v.reshape(1).float()
    x_s1, fc_s1 = one(x_s), one(w_s)
    proj_s = one(proj_w.float().abs().max() / kernels.E4M3_MAX)
    fc_f8 = (fc_w.float() / fc_s1).to(torch.float8_e4m3fn)  # (dim, hidden): grad_x's second operand, transposed
    proj_f8_t = (proj_w.float().T / proj_s).to(torch.float8_e4m3fn).contiguous()
    post_f8, post_f8_t, slots = kernels._matmul_relu2(x_f8, fc_f8_t.T, None, torch.bfloat16, scales)[1:]
    post_amax = slots.amax().reshape(1)
    x_f8_t = x_f8.T.contiguous()
    col = one(proj_w.float().norm(dim=0).max())  # for grad_pre's scale, a bound (kernels.pre_grad_scale)
    truth = (grad_pre_ref @ fc_w.float().T, x.float().T @ grad_pre_ref, grad.float().T @ post.float())

    def bf16_backward():
        grad_pre = kernels._matmul_relu2(grad, proj_w, post, torch.bfloat16)[0]
        return grad_pre @ fc_w.T, x.T @ grad_pre, grad.T @ post

    fp8_backward_compiled = torch.compile(kernels.relu2_mlp_fp8_backward, dynamic=False, fullgraph=True)

    def fp8_backward():  # compiled, as in the model's backward graph: the scales and casts fused
        return fp8_backward_compiled(grad, x_f8_t, x_s1, fc_f8, fc_s1, proj_f8_t, proj_s, col, post_f8, post_f8_t,
                                     one(scales[2, 0]), post_amax)[:3]
    for name, fn in (("MLP backward, bf16 (fused kernel + 3 cuBLAS matmuls)", bf16_backward),
                     ("MLP backward, FP8 (relu2_mlp_fp8_backward)", fp8_backward)):
        errors = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(fn(), truth)]
        us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{name:<56} {us:8.1f} us  errors dx {errors[0]:.1e} dW_fc {errors[1]:.1e} dW_proj {errors[2]:.1e}",
              flush=True)
    us = do_bench(lambda: kernels._matmul_relu2(x_f8, fc_f8_t.T, None, torch.bfloat16, scales),
                  warmup=25, rep=200, return_mode="median") * 1e3
    print(f"{'FP8 forward kernel (e4m3 post both ways)':<56} {us:8.1f} us", flush=True)
    us = do_bench(lambda: kernels.quantize(x, x_s1, torch.float8_e4m3fn), warmup=25, rep=200, return_mode="median")
    print(f"{'x in e4m3, both layouts (kernels.quantize)':<56} {us * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
