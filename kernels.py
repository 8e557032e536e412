"""The kernels and custom ops of train_gpt.py, each with a PyTorch reference that runs where its kernel cannot
(the CPU, a machine without Triton or FlashAttention):
- the ReLU² MLP with its activation in the matmul epilogues (--fused_mlp, Triton, a custom op);
- the FP8 LM head: its matmul (mm_fp8) and its soft-capped cross-entropy fused with it (fp8_head_ce, --fused_ce;
  the loss in Triton), custom ops with their backward;
- varlen attention: the backends (FlashAttention-3 and -4 as custom ops, PyTorch's varlen, the reference), their
  registry and the start-up check that picks one;
- CPLM's pointer (copy_pointer) and DC attention's correction (dc_attention, --fused_dc): flash-style Triton kernels
  whose scores stay in registers, custom ops with their backward;
- the attention's QK-norm, rotary and key offset (qk_norm_rope, --fused_qk_rope): one Triton kernel each way;
- a tiled 2-D transpose (transpose, --fp8_transpose) for the FP8 MLP's transposed operands;
  these two are triton_ops (torch.library): Inductor traces into them and launches their kernels itself.
train_gpt.py logs this file's source with its own.

Set TRITON_INTERPRET=1 before the first import of triton to run the kernels on the CPU (slowly, in
Triton's interpreter): that is how the CPU tests check them against the references.
"""
from __future__ import annotations

import functools
import glob
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op, wrap_triton

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # e.g. macOS: only the references run
    triton = None

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors.
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(t: Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


# -----------------------------------------------------------------------------------------------
# ReLU² MLP with its activation fused into the matmuls (the public record line's "fused
# linear + ReLU² kernel"): the up-projection's epilogue writes post = relu(h)² of h = x W_fc, and in the
# backward the epilogue of (grad_out W_proj) multiplies by the derivative 2 relu(h) = 2 sqrt(post), so h
# is never written (the public line's commit 75d6867a, after record #89). The two
# elementwise passes over the (tokens x hidden width) activations that the epilogues replace cost about as
# much memory traffic as the matmul takes time. The other matmuls stay on cuBLAS.
#
# --fp8_mlp (the public line's FP8 MLP forward: the up projection of the 2026-05-19 record, the down
# projection of 2026-07-17, #89): in the forward the same kernel multiplies e4m3 operands and also writes
# post in e4m3 for the down projection (torch._scaled_mm). The scales come from bounds, not from the data
# (train_gpt.py's MLP): the public line scales post by the previous step's maximum instead, state that a
# checkpoint would have to carry. The backward is the bf16 one, from bf16 post.

E4M3_MAX = 448.0  # the largest float8_e4m3fn value
# One FP8 scale per row of 4 float32 (16 bytes): cuBLASLt (CUDA 13) refuses FP8 scale pointers that are not
# 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED on an H100), so a scale is never a view 4 bytes into another.
FP8_SCALE_ROW = 4


def relu2_mlp_reference(x: Tensor, fc_w: Tensor, proj_w: Tensor) -> Tensor:
    """F.linear(relu(x @ fc_w)², proj_w): x (T, dim), fc_w and proj_w (dim, hidden)."""
    return torch.relu(x @ fc_w).square() @ proj_w.mT


def relu2_mlp_fp8_reference(x_f8: Tensor, fc_f8_t: Tensor, proj_f8: Tensor, scales: Tensor,
                            dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 forward in float32 arithmetic: (out, post, post_f8). x_f8 (T, dim), fc_f8_t (hidden, dim) and
    proj_f8 (dim, hidden) in e4m3; scales (3, 4) float32, a 16-byte row each (FP8_SCALE_ROW): x's times
    W_fc's, W_proj's, and post's (post above 448 times its scale saturates)."""
    x_fc_s, proj_s, post_s = scales[:, 0]
    post = torch.relu((x_f8.float() @ fc_f8_t.float().T) * x_fc_s).square().to(dtype)
    post_f8 = (post.float() * post_s.reciprocal()).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)  # as the kernels
    out = (post_f8.float() @ proj_f8.float().T) * (post_s * proj_s)
    return out.to(dtype), post, post_f8


if triton is not None:
    @triton.jit
    def _matmul_relu2_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             stride_om, stride_on, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """acc = A @ B (M x N, float32). Forward: out = relu(acc)² (post). Backward: out = acc * 2 sqrt(aux)
        (aux: the saved post). The bf16 MLP's kernel where Hopper's TMA kernel does not run (A100)."""
        pid = tl.program_id(0)
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = GROUP_M * grid_n  # tiles in groups of GROUP_M rows: neighbouring programs share B in L2
        first_m = (pid // group) * GROUP_M
        rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % rows_in_group
        pid_n = (pid % group) // rows_in_group
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = tl.load(a_ptr + rm[:, None] * stride_am + (k + rk)[None, :] * stride_ak,
                        mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
            b = tl.load(b_ptr + (k + rk)[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=((k + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        at = rm[:, None] * stride_om + rn[None, :] * stride_on
        if BACKWARD:
            post = tl.load(aux_ptr + at, mask=inside, other=0.0).to(tl.float32)
            acc = acc * 2 * tl.sqrt(post)
        else:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)

    # Hopper's form of the same kernel (sm_90+; the public line's linear_relu_square is built this way): one
    # program per SM walks the output tiles (persistent), the tensor memory accelerator moves the operands and
    # results (TMA descriptors: edge tiles are zero-filled on load and clipped on store), and the epilogue runs
    # on two halves of BLOCK_N / 2 columns so that its staging buffers fit in shared memory beside the operand
    # pipeline. On one H100 at 49,152 x 768 -> 3,072: FP8 forward 375-379 -> 307-313 us, backward 536-542 -> 480-481
    # us per call; the record's step at window 11 12-13 ms shorter (bench/results/mlp_tma_tables_h100_20261127.md).
    @triton.jit
    def _matmul_relu2_tma_kernel(a_desc, b_desc, out_desc, side_desc, side_t_desc, scale_ptr, amax_ptr, M, N, K,
                                 BACKWARD: tl.constexpr, FP8: tl.constexpr, B_NK: tl.constexpr,
                                 Q_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                                 STORE_T: tl.constexpr):
        """_matmul_relu2_kernel's arithmetic: a (M, K); b (K, N), or (N, K) if B_NK; out (M, N); side: the
        backward's aux (post) or the FP8 forward's e4m3 post (M, N); descriptors of (BLOCK_M, BLOCK_N / 2) blocks
        for out and side. FP8: the FP8 result is also stored transposed, side_t (N, M) in (BLOCK_N / 2, BLOCK_M)
        blocks, what the weight gradients' FP8 matmuls read. The FP8 forward: a and b in e4m3, acc *= scale[0, 0],
        post / scale[2, 0] in e4m3 into side (no bf16 post stored: the FP8 backward reads the e4m3 one), and the
        largest post of its tiles at amax_ptr[program]. The FP8 backward (BACKWARD and FP8): a and b in FP8, acc *=
        scale[0, 0], post = side * scale[1, 0], and out = the gradient / scale[2, 0] in FP8 (at most Q_MAX), with
        the largest |gradient| of its tiles at amax_ptr[program]. A slot a program (plain stores, no atomics), so
        the slots need no zeroing before the launch. STORE_T False leaves side_t unwritten: bench/relu2_kernels.py
        times what the transposed store costs."""
        grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group = GROUP_M * grid_n  # tiles in groups of GROUP_M rows, as in _matmul_relu2_kernel
        run_max = tl.full((1,), 0.0, tl.float32)  # the amax slot's value (FP8)
        for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=True):
            first_m = (tile // group) * GROUP_M
            rows_in_group = tl.minimum(grid_m - first_m, GROUP_M)
            m0 = (first_m + (tile % group) % rows_in_group) * BLOCK_M
            n0 = ((tile % group) // rows_in_group) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(tl.cdiv(K, BLOCK_K)):
                a = a_desc.load([m0, ki * BLOCK_K])
                if B_NK:
                    acc = tl.dot(a, b_desc.load([n0, ki * BLOCK_K]).T, acc)
                else:
                    acc = tl.dot(a, b_desc.load([ki * BLOCK_K, n0]), acc)
            if FP8:
                acc = acc * tl.load(scale_ptr)  # row 0 of the (3, FP8_SCALE_ROW) scales
                inv_q_s = 1.0 / tl.load(scale_ptr + 8)  # row 2: a multiply per entry, not a division (-3% a call)
            halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            for h in tl.static_range(2):
                c = halves[0] if h == 0 else halves[1]
                n = n0 + h * (BLOCK_N // 2)
                if BACKWARD:
                    post = side_desc.load([m0, n]).to(tl.float32)
                    if FP8:
                        post = post * tl.load(scale_ptr + 4)  # row 1: the e4m3 post's scale
                    c = c * 2 * tl.sqrt(post)
                    if FP8:
                        run_max = tl.maximum(run_max, tl.max(tl.max(tl.abs(c), 1), 0))
                        q = tl.minimum(tl.maximum(c * inv_q_s, -Q_MAX), Q_MAX).to(out_desc.dtype)
                        out_desc.store([m0, n], q)
                        if STORE_T:
                            side_t_desc.store([n, m0], tl.trans(q))
                    else:
                        out_desc.store([m0, n], c.to(out_desc.dtype))
                else:
                    c = tl.maximum(c, 0.0)
                    c = c * c
                    if FP8:
                        c = c.to(out_desc.dtype).to(tl.float32)  # post as stored: what bf16 matmuls see
                        q = tl.minimum(c * inv_q_s, Q_MAX).to(side_desc.dtype)
                        side_desc.store([m0, n], q)
                        if STORE_T:
                            side_t_desc.store([n, m0], tl.trans(q))
                        run_max = tl.maximum(run_max, tl.max(tl.max(c, 1), 0))
                    else:
                        out_desc.store([m0, n], c.to(out_desc.dtype))
        if FP8:
            tl.store(amax_ptr + tl.program_id(0) + tl.arange(0, 1), run_max)

# Tile sizes of the fused matmul: the fastest of five on an H100 (bench/mlp_kernel.py, bench/README.md);
# the interpreter tests shrink them. FP8 tiles take twice the K per byte of shared memory. The FP8 forward and
# backward have their own. PER_SM: persistent programs of the TMA kernel on each SM; two whose shared memory (88 KiB
# each here) and registers (127 a thread at 8 warps) fit side by side overlap one's epilogue, which reads post, with
# the other's matmul. One H200 at the record's 49,152 x 768 -> 2,816 (bench/relu2_kernels.py): the backward 333.4
# against 360.4 us a call at 128x256x128, 3 stages, one program an SM; no tile of twelve beat the forward's 254.1
# (bench/results/graphs_tiles_h200_20261130h.md).
RELU2_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
RELU2_FP8_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3, PER_SM=1)
RELU2_FP8_BACKWARD_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=2,
                                PER_SM=2)


def relu2_tiles_shared_memory(tiles: dict = RELU2_TILES) -> int:
    """Bytes of shared memory one program of the bf16 fused matmul needs: an A and a B tile per pipeline stage."""
    return tiles["num_stages"] * (tiles["BLOCK_M"] + tiles["BLOCK_N"]) * tiles["BLOCK_K"] * 2


def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on this CUDA device (the limit Triton checks at launch)."""
    return triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"]


def relu2_mlp_fits(device: torch.device) -> bool:
    """Whether --fused_mlp can run its kernel here: on a CUDA GPU with the shared memory for RELU2_TILES
    (144 KiB: H100, H200 and A100 have it, most desktop GPUs do not); elsewhere
    the op's PyTorch reference runs, which always fits."""
    if device.type != "cuda" or triton is None:
        return True
    return max_shared_memory(device) >= relu2_tiles_shared_memory()


RELU2_TMA_SHARED_MEMORY = 216 * 1024  # the TMA kernel's operand pipeline and epilogue buffers at RELU2_TILES
RELU2_TMA_INTERPRET = False  # the CPU tests set this to run _matmul_relu2_tma_kernel in Triton's interpreter


def relu2_tma_programs(device: torch.device) -> int:
    """How many persistent programs _matmul_relu2_tma_kernel runs with (one per SM), or 0 where the fused MLP's
    matmuls take _matmul_relu2_kernel instead: GPUs without TMA (before sm_90: A100, desktop GPUs) or without
    its shared memory; the CPU unless the tests ask for the interpreter."""
    if device.type != "cuda":
        return 4 if INTERPRET and RELU2_TMA_INTERPRET else 0
    return _cuda_tma_programs(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_tma_programs(index: int) -> int:  # cached: the op runs this on every call
    hopper = torch.cuda.get_device_capability(index) >= (9, 0)
    fits = max_shared_memory(torch.device("cuda", index)) >= RELU2_TMA_SHARED_MEMORY
    return torch.cuda.get_device_properties(index).multi_processor_count if hopper and fits else 0


def relu2_tiles(fp8: bool, backward: bool) -> dict:
    """The tile table _matmul_relu2 launches with."""
    return (RELU2_FP8_BACKWARD_TILES if backward else RELU2_FP8_TILES) if fp8 else RELU2_TILES


def relu2_amax_slots(device: torch.device, backward: bool) -> int:
    """How many amax slots the FP8 TMA kernel writes, one a program: SMs x the tiles' PER_SM."""
    return relu2_tma_programs(device) * relu2_tiles(True, backward).get("PER_SM", 1)


def tma_ready(*tensors: Tensor) -> bool:
    """TMA's layout rules: 2-D, rows contiguous, the start and each row's stride a multiple of 16 bytes."""
    return all(t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in tensors)


def _matmul_relu2(a: Tensor, b: Tensor, aux: Tensor | None, out_dtype: torch.dtype, scales: Tensor | None = None,
                  store_t: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Forward (aux None): relu(a @ b)². Backward: (a @ b) * 2 sqrt(aux). With scales (Hopper's kernel only), FP8:
    the forward from e4m3 a and b writes post in e4m3 (and no bf16 post: out is left unwritten); the backward from
    FP8 a and b and the e4m3 post (aux) writes the gradient in out_dtype (FP8).
    Returns (out, the forward's e4m3 post or None, the FP8 result transposed (N, M) or None, amax or None); amax,
    FP8 only: float32 slots, one a program (relu2_amax_slots), whose maximum is the largest post or |gradient|."""
    M, K = a.shape
    N = b.size(1)
    fp8 = scales is not None
    fp8_backward = fp8 and aux is not None
    # Triton's interpreter (3.9) rounds float32 -> e4m3 wrongly at binade edges: there the kernel writes
    # float32 and PyTorch casts, the same values as the compiled kernel's store
    stored = lambda dtype: torch.float32 if INTERPRET else dtype
    out = torch.empty(M, N, device=a.device, dtype=stored(out_dtype) if fp8_backward else out_dtype)
    post_f8 = None
    if fp8 and not fp8_backward:
        post_f8 = torch.empty(M, N, device=a.device, dtype=stored(torch.float8_e4m3fn))
    q_dtype = out_dtype if fp8_backward else torch.float8_e4m3fn  # what the FP8 result is stored as
    side_t = torch.empty(N, M, device=a.device, dtype=stored(q_dtype)) if fp8 else None
    t = relu2_tiles(fp8, aux is not None)
    per_sm = t.get("PER_SM", 1)
    t = {k: v for k, v in t.items() if k != "PER_SM"}
    tiles = triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"])
    side = post_f8 if post_f8 is not None else aux  # the epilogue's second tensor: the e4m3 post it writes, or reads
    b_nk = b.stride(0) == 1 and b.stride(1) != 1  # b as the transpose of a contiguous (N, K): the FP8 W_fc
    programs = relu2_tma_programs(a.device) * per_sm
    amax = None
    if programs and tma_ready(a, b.T if b_nk else b, out, *([side] if side is not None else []),
                              *([side_t] if side_t is not None else [])):
        BM, BN, BK = t["BLOCK_M"], t["BLOCK_N"], t["BLOCK_K"]
        half = lambda x: TensorDescriptor.from_tensor(x, [BM, BN // 2])
        # with amax slots every program runs (one with no tile writes 0), so that every slot is written
        amax = torch.empty(programs, device=a.device) if fp8 else None
        _matmul_relu2_tma_kernel[(programs if fp8 else min(programs, tiles),)](
            TensorDescriptor.from_tensor(a, [BM, BK]),
            TensorDescriptor.from_tensor(b.T, [BN, BK]) if b_nk else TensorDescriptor.from_tensor(b, [BK, BN]),
            half(out), half(side if side is not None else out),
            TensorDescriptor.from_tensor(side_t, [BN // 2, BM]) if side_t is not None else half(out),
            scales if fp8 else out, amax if fp8 else out, M, N, K,
            BACKWARD=aux is not None, FP8=fp8, B_NK=b_nk, Q_MAX=torch.finfo(q_dtype).max, NUM_SMS=programs,
            STORE_T=store_t, **t)
    elif fp8:  # train_gpt.check_fp8_mlp_shapes refuses a width that breaks TMA's rule before a run starts
        raise RuntimeError(f"the FP8 MLP's matmuls run in Hopper's TMA kernel only: here none, or operands a "
                           f"{tuple(a.shape)}, b {tuple(b.shape)} not in TMA's layout (rows of 16-byte multiples: the "
                           "MLP's hidden width, train_gpt.py's mlp_hidden or mlp_ratio x model_dim, and model_dim "
                           "divisible by 16)")
    else:
        _matmul_relu2_kernel[(tiles,)](a, b, out, side, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                       out.stride(0), out.stride(1), BACKWARD=aux is not None, **t)
    if INTERPRET:
        out = out.to(out_dtype)
        post_f8 = None if post_f8 is None else post_f8.to(torch.float8_e4m3fn)
        side_t = None if side_t is None else side_t.to(q_dtype)
    return out, post_f8, side_t, amax


@torch.library.custom_op("speedrun::relu2_mlp", mutates_args=())
def relu2_mlp(x: Tensor, fc_w: Tensor, proj_w: Tensor) -> tuple[Tensor, Tensor]:
    """(out, post): out = post @ proj_w.T with post = relu(x @ fc_w)², kept for the backward. x (T, dim),
    fc_w and proj_w (dim, hidden), one dtype."""
    if not triton_runs_on(x):
        post = torch.relu(x @ fc_w).square()
    else:
        post = _matmul_relu2(x, fc_w, None, x.dtype)[0]
    return post @ proj_w.mT, post


@relu2_mlp.register_fake
def _(x, fc_w, proj_w):
    return x.new_empty(x.size(0), proj_w.size(0)), x.new_empty(x.size(0), fc_w.size(1))


@torch.library.custom_op("speedrun::relu2_mlp_backward", mutates_args=())
def relu2_mlp_backward(grad: Tensor, x: Tensor, fc_w: Tensor, proj_w: Tensor,
                       post: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x, fc_w and proj_w."""
    if not triton_runs_on(x):
        grad_pre = (grad @ proj_w) * 2 * post.sqrt()
    else:
        grad_pre = _matmul_relu2(grad, proj_w, post, grad.dtype)[0]
    return grad_pre @ fc_w.mT, x.mT @ grad_pre, grad.mT @ post


@relu2_mlp_backward.register_fake
def _(grad, x, fc_w, proj_w, post):
    return torch.empty_like(x), torch.empty_like(fc_w), torch.empty_like(proj_w)


def _relu2_mlp_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _relu2_mlp_autograd(ctx, grad_out, _grad_post):
    return relu2_mlp_backward(grad_out.contiguous(), *ctx.saved_tensors)


relu2_mlp.register_autograd(_relu2_mlp_autograd, setup_context=_relu2_mlp_setup_context)


# The MLP's backward in FP8 (Hopper), the form public pull request #344 takes (issue 33): the gradient of the
# output in e4m3 (its own amax, both layouts); the fused kernel's FP8 backward gives grad_pre in e4m3 in both
# layouts, read from the forward's e4m3 post (no bf16 post kept); then the three matmuls in FP8: grad_x from
# grad_pre and W_fc, grad_W_fc from xᵀ (e4m3, transposed) and grad_preᵀ, grad_W_proj from gradᵀ and postᵀ (the
# forward's transposed e4m3 post). grad_pre's scale is a bound (pre_grad_scale), so nothing waits for its amax.
# Scales are float32 tensors of one entry (on the device: no host copies). Only the fused kernel is an opaque op
# (relu2_fp8_grad_pre): the rest is PyTorch that torch.compile traces into the backward graph, so the scales,
# casts and transposes fuse into its kernels and cost no Python a call (as one op, the backward's host time
# left the GPU idle ~20 ms a step at window 11, bench/results/fp8_mlp_backward_h100_20261127.md).


# The FP8 operands' transposed copies (the weight gradients' matmuls read x and the output's gradient T-major) as a
# kernel of their own, tiles of 128 x 128 read along rows and written along columns. Traced as `t.T.contiguous()`,
# Inductor writes them inside the RMS norm's (or the row norms') reduction kernel that quantizes them, a few tokens'
# bytes at a time into rows 49,152 bytes apart: those kernels ran at 1.5-2.6 TB/s against a 4.1 TB/s copy on an
# H200, ~1.5 ms over their bytes per 49,152-token micro-batch (bench/results/dc_kernels_2gpu_h200_20261130.md).
TRANSPOSE_TILES = dict(BM=128, BN=128, num_warps=4)

if triton is not None:
    @triton.jit
    def _transpose_kernel(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        tile = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=inside)
        tl.store(out_ptr + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=tl.trans(inside))


# A `triton_op`, not a `custom_op`: Inductor traces into it and launches the kernel from its own generated code, as
# it launches its kernels (a custom op's call costs the host far more: bench/results/host_overhead_h100_20261127.md)
@triton_op("speedrun::transpose", mutates_args=())
def transpose(x: Tensor) -> Tensor:
    """x.T.contiguous() of a 2-D x of 1- or 2-byte elements (FP8, bf16), as one tiled kernel where Triton runs."""
    if not triton_runs_on(x) or x.element_size() not in (1, 2):
        return x.T.contiguous()
    M, N = x.shape
    raw = torch.uint8 if x.element_size() == 1 else torch.int16  # moved as bytes, whatever they encode
    out = torch.empty(N, M, device=x.device, dtype=raw)
    t = TRANSPOSE_TILES
    wrap_triton(_transpose_kernel)[(triton.cdiv(M, t["BM"]), triton.cdiv(N, t["BN"]))](
        x.contiguous().view(raw), out, M, N, BM=t["BM"], BN=t["BN"], num_warps=t["num_warps"])
    return out.view(x.dtype)


def transposed(t: Tensor, kernel: bool) -> Tensor:
    """t's transpose, contiguous: by the transpose op (kernel) or as traced PyTorch."""
    return torch.ops.speedrun.transpose(t) if kernel else t.T.contiguous()


def _mm_f8(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
           fast_accum: bool = False) -> Tensor:
    """a @ b * scale_a * scale_b from FP8 operands (a row-major, b column-major): _scaled_mm on a GPU, float32
    arithmetic in the interpreter's CPU tests. The backward's sums over 49K tokens keep cuBLAS's exact
    accumulation (fast_accum off, as PR 344); the forward's down projection takes the fast one."""
    if not a.is_cuda:
        return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


PRE_GRAD_MARGIN = 1.2  # pre_grad_scale's bound over the FP8 operands' rounding (g, W_proj: 1/16 each; post 1/16)


def pre_grad_scale(g_row_norm: Tensor, proj_col_norm: Tensor, post_amax: Tensor) -> Tensor:
    """grad_pre's e4m3 scale from a bound, no pass over grad_pre: |grad_pre_tj| = |g_t . w_j| 2 sqrt(post_tj) <=
    max_t |g_t| max_j |w_j| 2 sqrt(max post) (Cauchy-Schwarz) over W_proj's columns w_j, times PRE_GRAD_MARGIN.
    On random operands it is 12-16 times the true maximum: e4m3's 18 binades absorb that (grad_x 2.65% from
    float64 against 2.64% at the exact scale; e5m2 at an exact scale 5.3%)."""
    # at least 1e-30: W_proj starts at zero, and 0 / 0 would make grad_pre's zeros NaN
    return (PRE_GRAD_MARGIN * g_row_norm * proj_col_norm * 2 * post_amax.sqrt() / E4M3_MAX).clamp_min(1e-30)


def _grad_operands(grad: Tensor, transpose_kernel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(scale, largest row norm, e4m3 copy, its transpose) of the output's gradient: reductions and casts that the
    compiled backward fuses into two passes over grad (the transpose in a third with transpose_kernel)."""
    g = grad.float()
    g_s = (g.abs().amax() / E4M3_MAX).clamp_min(1e-30).reshape(1)
    g_f8 = (g / g_s).to(torch.float8_e4m3fn)
    return g_s, g.square().sum(1).amax().sqrt().reshape(1), g_f8, transposed(g_f8, transpose_kernel)


def fp8_scale_rows(*scales: Tensor) -> Tensor:
    """One-entry float32 scales as the kernels read them: (len(scales), FP8_SCALE_ROW), a 16-byte row each."""
    return torch.cat(scales).float()[:, None].repeat(1, FP8_SCALE_ROW)


@torch.library.custom_op("speedrun::relu2_fp8_grad_pre", mutates_args=())
def relu2_fp8_grad_pre(g_f8: Tensor, proj_f8_t: Tensor, post_f8: Tensor,
                       scales: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_pre, grad_preᵀ, amax slots) in e4m3 from Hopper's kernel: grad_pre = (g W_proj) * 2 sqrt(post) / scale,
    g_f8 (T, dim), proj_f8_t (hidden, dim) and post_f8 (T, hidden) in e4m3; scales rows: g's times W_proj's, post's,
    grad_pre's (fp8_scale_rows). The slots' maximum is grad_pre's largest |value| (tests read it)."""
    pre_f8, _, pre_f8_t, amax = _matmul_relu2(g_f8, proj_f8_t.T, post_f8, torch.float8_e4m3fn, scales)
    return pre_f8, pre_f8_t, amax


@relu2_fp8_grad_pre.register_fake
def _(g_f8, proj_f8_t, post_f8, scales):
    T, hidden = post_f8.shape
    return (torch.empty_like(post_f8), post_f8.new_empty(hidden, T), g_f8.new_empty(
        relu2_amax_slots(g_f8.device, backward=True), dtype=torch.float32))


def relu2_mlp_fp8_backward(grad: Tensor, x_f8_t: Tensor, x_s: Tensor, fc_f8: Tensor, fc_s: Tensor, proj_f8_t: Tensor,
                           proj_s: Tensor, proj_col_norm: Tensor, post_f8: Tensor, post_f8_t: Tensor, post_s: Tensor,
                           post_amax: Tensor, weight_grad_dtype: torch.dtype = torch.float32,
                           transpose_kernel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_x, grad_W_fc, grad_W_proj, grad_pre's amax slots) of out = relu(x W_fc)² W_projᵀ from FP8 operands:
    grad (T, dim) bf16; x_f8_t (dim, T), fc_f8 (dim, hidden) and proj_f8_t (hidden, dim) in e4m3; post_f8
    (T, hidden) and post_f8_t (hidden, T) in e4m3; each with its scale (x_s, fc_s, proj_s, post_s);
    proj_col_norm and post_amax (the forward's largest post) for pre_grad_scale. Scales: float32, one entry."""
    g_s, g_row_norm, g_f8, g_f8_t = _grad_operands(grad, transpose_kernel)
    rows = fp8_scale_rows(g_s * proj_s, post_s, pre_grad_scale(g_row_norm, proj_col_norm, post_amax), g_s)
    pre_f8, pre_f8_t, amax = torch.ops.speedrun.relu2_fp8_grad_pre(g_f8, proj_f8_t, post_f8, rows)
    # the matmuls' scales read from the 16-byte rows: cuBLAS refuses a scale that is not 16-byte aligned, and
    # Inductor may place one computed alone inside another buffer (CUBLAS_STATUS_NOT_SUPPORTED on an H100)
    pre_grad_s, g_s = rows[2, :1], rows[3, :1]
    grad_x = _mm_f8(pre_f8, fc_f8.T, pre_grad_s, fc_s, grad.dtype)
    grad_fc = _mm_f8(x_f8_t, pre_f8_t.T, x_s, pre_grad_s, weight_grad_dtype)
    grad_proj = _mm_f8(g_f8_t, post_f8_t.T, g_s, post_s, weight_grad_dtype)
    return grad_x, grad_fc, grad_proj, amax


def relu2_mlp_fp8_backward_reference(grad: Tensor, x_f8_t: Tensor, x_s: Tensor, fc_f8: Tensor, fc_s: Tensor,
                                     proj_f8_t: Tensor, proj_s: Tensor, proj_col_norm: Tensor, post_f8: Tensor,
                                     post_s: Tensor, post_amax: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """relu2_mlp_fp8_backward in float32 arithmetic from the same FP8 operands: (grad_x, grad_W_fc, grad_W_proj,
    grad_pre before its quantization)."""
    g_s, g_row_norm, g_f8, _ = _grad_operands(grad)
    pre_grad_s = pre_grad_scale(g_row_norm, proj_col_norm, post_amax)
    g = g_f8.float() * g_s
    post = post_f8.float() * post_s
    pre = (g @ (proj_f8_t.float().T * proj_s)) * 2 * post.sqrt()
    pre_q = (pre / pre_grad_s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * pre_grad_s
    return (pre_q @ (fc_f8.float() * fc_s).T, (x_f8_t.float() * x_s) @ pre_q, g.T @ post, pre)


def _fp8_mlp_runs_on(t: Tensor) -> bool:
    """Whether relu2_mlp_all_fp8 takes Hopper's kernel for t (else its float32 references)."""
    return triton_runs_on(t) and relu2_tma_programs(t.device) > 0


@torch.library.custom_op("speedrun::relu2_mlp_all_fp8", mutates_args=())
def relu2_mlp_all_fp8(x: Tensor, x_f8: Tensor, x_f8_t: Tensor, fc_w: Tensor, fc_f8: Tensor, fc_f8_t: Tensor,
                      proj_w: Tensor, proj_f8: Tensor, proj_f8_t: Tensor, scales: Tensor, parts: Tensor,
                      transpose_kernel: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, post_f8, post_f8_t, post_amax): the MLP's forward with FP8 matmuls, keeping its e4m3 post in both
    layouts (no bf16 post) and post's largest value (as amax slots, whose maximum it is), for
    relu2_mlp_fp8_backward. Operands (train_gpt.fp8_mlp_operands): x_f8 (T, dim) and x_f8_t (dim, T), fc_f8 (dim,
    hidden) and fc_f8_t (hidden, dim), proj_f8 (dim, hidden) and proj_f8_t (hidden, dim), in e4m3; scales (3,
    FP8_SCALE_ROW): x's times W_fc's, W_proj's, post's (relu2_mlp_fp8_reference); parts (3, FP8_SCALE_ROW): x's
    scale, W_fc's, W_proj's largest column norm. x, fc_w and proj_w are there for their gradients' shapes and
    dtypes. transpose_kernel: the backward transposes the output's gradient by the transpose op. Where Hopper's
    kernel does not run (the CPU tests), the float32 references."""
    if not _fp8_mlp_runs_on(x):
        out, post, post_f8 = relu2_mlp_fp8_reference(x_f8, fc_f8_t, proj_f8, scales, x.dtype)
        return out, post_f8, post_f8.T.contiguous(), post.float().amax().reshape(1)
    _, post_f8, post_f8_t, post_amax = _matmul_relu2(x_f8, fc_f8_t.T, None, x.dtype, scales)
    out = _mm_f8(post_f8, proj_f8.T, scales[2, :1], scales[1, :1], x.dtype, fast_accum=True)
    return out, post_f8, post_f8_t, post_amax


@relu2_mlp_all_fp8.register_fake
def _(x, x_f8, x_f8_t, fc_w, fc_f8, fc_f8_t, proj_w, proj_f8, proj_f8_t, scales, parts, transpose_kernel=False):
    T, hidden = x.size(0), fc_w.size(1)
    post = x.new_empty(T, hidden, dtype=torch.float8_e4m3fn)
    slots = relu2_amax_slots(x.device, backward=False) if _fp8_mlp_runs_on(x) else 1
    return (x.new_empty(T, proj_w.size(0)), post, x.new_empty(hidden, T, dtype=torch.float8_e4m3fn),
            x.new_empty(slots, dtype=torch.float32))


def _relu2_mlp_all_fp8_setup_context(ctx, inputs, output):
    x, _, x_f8_t, fc_w, fc_f8, _, _, _, proj_f8_t, scales, parts, transpose_kernel = inputs
    ctx.save_for_backward(x_f8_t, fc_f8, proj_f8_t, output[1], output[2], output[3], scales, parts)
    ctx.weight_dtype, ctx.transpose_kernel = fc_w.dtype, transpose_kernel


def _relu2_mlp_all_fp8_autograd(ctx, grad_out, _grad_post, _grad_post_t, _grad_post_amax):
    """relu2_mlp_fp8_backward, traced by torch.compile into the backward graph (or its float32 reference where
    Hopper's kernel does not run)."""
    x_f8_t, fc_f8, proj_f8_t, post_f8, post_f8_t, post_amax, scales, parts = ctx.saved_tensors
    grad = grad_out.contiguous()
    args = (x_f8_t, parts[0, :1], fc_f8, parts[1, :1], proj_f8_t, scales[1, :1], parts[2, :1], post_f8)
    if _fp8_mlp_runs_on(grad):
        grad_x, grad_fc, grad_proj, _ = relu2_mlp_fp8_backward(grad, *args, post_f8_t, scales[2, :1],
                                                               post_amax.amax().reshape(1), ctx.weight_dtype,
                                                               ctx.transpose_kernel)
    else:
        grad_x, grad_fc, grad_proj, _ = relu2_mlp_fp8_backward_reference(grad, *args, scales[2, :1], post_amax)
    return (grad_x.to(grad.dtype), None, None, grad_fc.to(ctx.weight_dtype), None, None,
            grad_proj.to(ctx.weight_dtype), None, None, None, None, None)


relu2_mlp_all_fp8.register_autograd(_relu2_mlp_all_fp8_autograd, setup_context=_relu2_mlp_all_fp8_setup_context)


# -----------------------------------------------------------------------------------------------
# Soft-capped cross-entropy of the FP8 LM head (the public record line's "fused softcapped
# cross-entropy"): z = cap * sigmoid((logit + shift) / temp) per (token, vocab) entry, and for each
# token t with K targets y_tk of weights w_tk, loss_t = sum_k w_tk * (lse(z_t) - z_t[y_tk]): the
# next-token loss alone (K = 1, weight 1), or with multi-token prediction's extra targets and their
# weights, all from the same logits. A negative target is no target (its weight counts as 0). The
# forward reads the bf16 logits once per token row, then the targets' own logits; the backward recomputes
# z from them and writes the logits' gradient directly in FP8 (e5m2, divided by grad_scale) in both
# layouts the FP8 matmuls of the head's backward need: (T, V) for the input's gradient and (V, T) for the
# weight's, then rewrites the T x K targets' entries with their one-hot terms. Compiled
# PyTorch fuses the same work into a reduction and a pointwise pass too, but on an H100 they took 3.3
# and 7.6 ms per 49,152-token micro-batch, where reading the logits and writing the two copies takes
# about 4.4 ms in all (bench/ce_kernel.py times both ways). z lies in (0, cap), so exp(z) needs no
# running maximum.

def _targets_and_weights(targets: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """(T, K) targets and their (T, K) float32 weights, 0 where a target is negative; a (T,) target
    vector is K = 1, and no weights means weight 1."""
    targets = targets.reshape(targets.size(0), -1)
    weights = torch.ones(targets.shape, device=targets.device) if weights is None else weights.float()
    if weights.shape != targets.shape:
        raise ValueError(f"softcap_ce: weights {tuple(weights.shape)} do not match targets {tuple(targets.shape)}")
    return targets.contiguous(), torch.where(targets >= 0, weights, 0.0).contiguous()


def softcap_ce_reference(logits: Tensor, targets: Tensor, cap: float, shift: float, temp: float,
                         weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(losses, lse), float32, one per row of logits (T, V)."""
    targets, weights = _targets_and_weights(targets, weights)
    z = cap * torch.sigmoid((logits.float() + shift) / temp)
    lse = z.exp().sum(-1).log()
    picked = z.gather(1, targets.long().clamp(min=0))
    return (weights * (lse[:, None] - picked)).sum(1), lse


def softcap_ce_grad_reference(grad_losses: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, cap: float,
                              shift: float, temp: float, grad_scale: float,
                              weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The logits' gradient / grad_scale in float8_e5m2, (T, V) and transposed (V, T)."""
    targets, weights = _targets_and_weights(targets, weights)
    z = cap * torch.sigmoid((logits.float() + shift) / temp)
    dz = weights.sum(1, keepdim=True) * (z - lse[:, None]).exp()
    dz.scatter_add_(1, targets.long().clamp(min=0), -weights)
    g = dz * z * (1 - z / cap) / temp * grad_losses[:, None].float() / grad_scale
    g_f8 = g.to(torch.float8_e5m2)
    return g_f8, g_f8.T.contiguous()


if triton is not None:
    # The sigmoid as 1/(1 + exp(-u)) takes two special-function-unit instructions per (token, vocab) entry (ex2 and
    # a reciprocal), as (1 + tanh(u / 2)) / 2 with PTX's tanh.approx.f32 one: with the softmax's exp, two per entry
    # in each loss kernel instead of three (the public line's CE kernel writes its sigmoid so, `__tanhf`).
    # tanh.approx's relative error is below 2^-10.9 (PTX ISA), so z = cap * sigmoid(u) is off by at most
    # cap * 2^-11.9 (0.006 at cap 23), far below the e5m2 gradient's 2^-3 steps. The interpreter (CPU tests) has no
    # PTX: there the same formula takes the exact tanh.
    _TANH_APPROX = tl.constexpr(not INTERPRET)

    @triton.jit
    def _tanh(x):
        if _TANH_APPROX:
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    # z = cap * sigmoid(u), u = (logit + shift) / temp as one multiply-add with reciprocals from the host
    @triton.jit
    def _softcap(logit, cap, inv_temp, shift_over_temp):
        half_cap = 0.5 * cap
        return half_cap + half_cap * _tanh(0.5 * (logit * inv_temp + shift_over_temp))

    @triton.jit
    def _softcap_ce_fwd_kernel(logits_ptr, targets_ptr, weights_ptr, losses_ptr, lse_ptr, V, cap, inv_temp,
                               shift_over_temp, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
        """One program per token row: sum of exp(z) over the vocabulary in BLOCK_V chunks, then the
        weighted z of the row's K targets, read directly (BLOCK_K: K rounded up to a power of two)."""
        t = tl.program_id(0)
        row = logits_ptr + t.to(tl.int64) * V
        total = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = _softcap(tl.load(row + cols, mask=cols < V, other=0.0).to(tl.float32), cap, inv_temp, shift_over_temp)
            total += tl.where(cols < V, tl.exp(z), 0.0)
        lse = tl.log(tl.sum(total, axis=0))
        k = tl.arange(0, BLOCK_K)
        targets = tl.load(targets_ptr + t * K + k, mask=k < K, other=-1)
        weights = tl.load(weights_ptr + t * K + k, mask=k < K, other=0.0)  # 0 where a target is absent
        z_y = _softcap(tl.load(row + targets, mask=targets >= 0, other=0.0).to(tl.float32), cap, inv_temp,
                       shift_over_temp)
        tl.store(lse_ptr + t, lse)
        tl.store(losses_ptr + t, tl.sum(weights, axis=0) * lse - tl.sum(weights * z_y, axis=0))

    @triton.jit
    def _softcap_ce_bwd_kernel(logits_ptr, targets_ptr, weights_ptr, lse_ptr, grad_ptr, g_ptr, g_t_ptr, T, V, cap,
                               inv_cap, inv_temp, shift_over_temp, inv_grad_scale, K: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
        """One program per (BLOCK_T x BLOCK_V) tile: dloss/dlogit = grad_t W_t softmax(z) dz/dlogit, with
        W_t = sum_k w_tk and dz/dlogit = z (1 - z / cap) / temp; stored / grad_scale in e5m2, row-major and
        transposed. The targets' one-hot terms are left to _softcap_ce_bwd_targets_kernel, which rewrites
        those T x K entries afterwards (comparing every entry with the K targets here took the backward
        from 10.8 to 12.4 ms per 49,152-token micro-batch at K = 3 on an H100, bench/ce_kernel.py)."""
        pid = tl.program_id(0)
        tiles_v = tl.cdiv(V, BLOCK_V)
        t0, v0 = (pid // tiles_v) * BLOCK_T, (pid % tiles_v) * BLOCK_V
        it, iv = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_V)
        rt, rv = t0 + it, v0 + iv
        in_t = rt < T
        inside = in_t[:, None] & (rv[None, :] < V)
        # 64-bit tile origins, 32-bit offsets inside the tile (BLOCK_T * V and BLOCK_V * T stay below 2^31)
        tile, tile_t = t0.to(tl.int64) * V + v0, v0.to(tl.int64) * T + t0
        tv = it[:, None] * V + iv[None, :]
        logit = tl.load(logits_ptr + tile + tv, mask=inside, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rt, mask=in_t, other=0.0)
        scale = tl.load(grad_ptr + rt, mask=in_t, other=0.0) * inv_temp * inv_grad_scale
        total_weight = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k in tl.static_range(K):
            total_weight += tl.load(weights_ptr + rt * K + k, mask=in_t, other=0.0)
        z = _softcap(logit, cap, inv_temp, shift_over_temp)
        dz = total_weight[:, None] * tl.exp(z - lse[:, None])
        g = (dz * z * (1.0 - z * inv_cap) * scale[:, None]).to(g_ptr.dtype.element_ty)
        tl.store(g_ptr + tile + tv, g, mask=inside)
        # The transposed copy: this program reads its own e5m2 tile back (from L2) and stores it transposed.
        # Computed once and transposed in registers instead, Triton 3.6 moves the bf16 input tile into the
        # transposed layout and does every operation above twice (two divisions per entry in its PTX).
        tl.debug_barrier()  # every thread's stores of the tile are visible to the whole program
        g = tl.load(g_ptr + tile + tv, mask=inside)
        tl.store(g_t_ptr + tile_t + (iv[None, :] * T + it[:, None]), g, mask=inside)

    @triton.jit
    def _softcap_ce_bwd_targets_kernel(logits_ptr, targets_ptr, weights_ptr, lse_ptr, grad_ptr, g_ptr, g_t_ptr, T, V,
                                       cap, inv_cap, inv_temp, shift_over_temp, inv_grad_scale, K: tl.constexpr,
                                       BLOCK_R: tl.constexpr):
        """After _softcap_ce_bwd_kernel: each existing target's entry (t, y_tk) rewritten in both layouts
        with the one-hot terms of every target of row t equal to y_tk (a repeated target writes the same
        value twice), the arithmetic otherwise as in the tile kernel."""
        rt = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_t = rt < T
        lse = tl.load(lse_ptr + rt, mask=in_t, other=0.0)
        scale = tl.load(grad_ptr + rt, mask=in_t, other=0.0) * inv_temp * inv_grad_scale
        total_weight = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for j in tl.static_range(K):
            total_weight += tl.load(weights_ptr + rt * K + j, mask=in_t, other=0.0)
        for k in tl.static_range(K):
            y = tl.load(targets_ptr + rt * K + k, mask=in_t, other=-1)
            hits = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for j in tl.static_range(K):
                y_j = tl.load(targets_ptr + rt * K + j, mask=in_t, other=-1)
                hits += tl.where(y_j == y, tl.load(weights_ptr + rt * K + j, mask=in_t, other=0.0), 0.0)
            has = in_t & (y >= 0)
            at, at_t = rt.to(tl.int64) * V + y, y.to(tl.int64) * T + rt
            z = _softcap(tl.load(logits_ptr + at, mask=has, other=0.0).to(tl.float32), cap, inv_temp,
                         shift_over_temp)
            dz = total_weight * tl.exp(z - lse) - hits
            g = (dz * z * (1.0 - z * inv_cap) * scale).to(g_ptr.dtype.element_ty)
            tl.store(g_ptr + at, g, mask=has)
            tl.store(g_t_ptr + at_t, g, mask=has)

# Chunk and tile sizes; the interpreter tests shrink them.
SOFTCAP_CE_TILES = dict(fwd=dict(BLOCK_V=2048, num_warps=8), bwd=dict(BLOCK_T=64, BLOCK_V=64, num_warps=4),
                        targets=dict(BLOCK_R=128, num_warps=4))


def softcap_ce(logits: Tensor, targets: Tensor, cap: float, shift: float, temp: float,
               weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(losses, lse) of contiguous logits (T, V) against targets (T,) or (T, K) with weights (T, K);
    the Triton kernel where it runs, else the reference."""
    if not triton_runs_on(logits):
        return softcap_ce_reference(logits, targets, cap, shift, temp, weights)
    T, V = logits.shape  # logits come contiguous from the head's matmul
    targets, weights = _targets_and_weights(targets, weights)
    K = targets.size(1)
    losses = torch.empty(T, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(losses)
    _softcap_ce_fwd_kernel[(T,)](logits, targets, weights, losses, lse, V, cap, 1 / temp, shift / temp, K=K,
                                 BLOCK_K=triton.next_power_of_2(K), **SOFTCAP_CE_TILES["fwd"])
    return losses, lse


def softcap_ce_grad(grad_losses: Tensor, logits: Tensor, targets: Tensor, lse: Tensor, cap: float, shift: float,
                    temp: float, grad_scale: float, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The logits' gradient / grad_scale in e5m2, (T, V) and (V, T); the Triton kernel where it runs."""
    if not triton_runs_on(logits):
        return softcap_ce_grad_reference(grad_losses, logits, targets, lse, cap, shift, temp, grad_scale, weights)
    T, V = logits.shape
    targets, weights = _targets_and_weights(targets, weights)
    g = torch.empty(T, V, device=logits.device, dtype=torch.float8_e5m2)
    g_t = torch.empty(V, T, device=logits.device, dtype=torch.float8_e5m2)
    _softcap_ce_grad_into(g, g_t, grad_losses, logits, targets, weights, lse, cap, shift, temp, grad_scale)
    return g, g_t


def _softcap_ce_grad_into(g: Tensor, g_t: Tensor, grad_losses: Tensor, logits: Tensor, targets: Tensor,
                          weights: Tensor, lse: Tensor, cap: float, shift: float, temp: float, grad_scale: float):
    """The two backward launches into g (T, V) and g_t (V, T), of e5m2 or (for tests) float32: every tile,
    then the targets' entries."""
    T, V = logits.shape
    t = SOFTCAP_CE_TILES["bwd"]
    if max(t["BLOCK_T"] * V, t["BLOCK_V"] * T) >= 2**31:
        raise ValueError(f"softcap_ce_grad: {T} x {V} logits overflow the kernel's 32-bit offsets inside a tile")
    numbers = (T, V, cap, 1 / cap, 1 / temp, shift / temp, 1 / grad_scale)
    grid = (triton.cdiv(T, t["BLOCK_T"]) * triton.cdiv(V, t["BLOCK_V"]),)
    _softcap_ce_bwd_kernel[grid](logits, targets, weights, lse, grad_losses, g, g_t, *numbers, K=targets.size(1), **t)
    r = SOFTCAP_CE_TILES["targets"]
    _softcap_ce_bwd_targets_kernel[(triton.cdiv(T, r["BLOCK_R"]),)](logits, targets, weights, lse, grad_losses, g,
                                                                   g_t, *numbers, K=targets.size(1), **r)


# -----------------------------------------------------------------------------------------------
# The FP8 LM head (matmul and fused loss as custom ops) and the attention backends


def _quantize(t: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """t / scale in an FP8 dtype, both row-major and transposed: FP8 matmuls (_scaled_mm) accept only
    a row-major first and a column-major second operand, so each operand is needed both ways."""
    t_f8 = t.div(scale).to(dtype)
    return t_f8, t_f8.T.contiguous()


# Compiled, the scale, cast and transpose are one pass; eager PyTorch takes three, its transpose
# uncoalesced (~6x slower on an H100). Used for the forward operands inside the op; the gradient's
# quantization is traced into the compiled backward instead (_mm_fp8_backward).
_quantize_fused = torch.compile(_quantize, dynamic=False, fullgraph=True)


def quantize(t: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return (_quantize_fused if t.is_cuda else _quantize)(t, scale, dtype)


@functools.cache
def scale_tensor(value: float, device: torch.device) -> Tensor:
    """A fixed FP8 scale as a float32 scalar on the device, made once. Made anew at every call (x.new_tensor(v)),
    it is a blocking copy from the host, which on CUDA waits for the whole stream: six waits per micro-batch in
    the FP8 head, after each of which the GPU idles until the host has queued work again."""
    return torch.tensor(value, dtype=torch.float32, device=device)


# FP8 LM head (@YouJiacheng). Forward in e4m3 with fixed scales, backward grads in e5m2. A
# custom op is opaque to torch.compile, which keeps the FP8 operands in the layouts _scaled_mm needs.
def _fp8_logits(x: Tensor, w: Tensor, x_s: float, w_s: float,
                out_dtype: torch.dtype = torch.bfloat16) -> tuple[Tensor, Tensor, Tensor]:
    x_f8, x_f8_t = quantize(x, x_s, torch.float8_e4m3fn)
    w_f8, w_f8_t = quantize(w, w_s, torch.float8_e4m3fn)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=out_dtype, use_fast_accum=True,
                           scale_a=scale_tensor(x_s, x.device), scale_b=scale_tensor(w_s, x.device))
    return out, x_f8_t, w_f8_t  # the transposed operands are what the backward needs


def _fp8_grads(g_f8: Tensor, g_f8_t: Tensor, x_f8_t: Tensor, w_f8_t: Tensor, x_s: float, w_s: float,
               grad_s: float) -> tuple[Tensor, Tensor]:
    scale = lambda v: scale_tensor(v, g_f8.device)
    grad_x = torch._scaled_mm(g_f8, w_f8_t.T, out_dtype=torch.bfloat16, scale_a=scale(grad_s), scale_b=scale(w_s))
    grad_w = torch._scaled_mm(g_f8_t, x_f8_t.T, out_dtype=torch.float32, scale_a=scale(grad_s), scale_b=scale(x_s))
    return grad_x, grad_w


@torch.library.custom_op("speedrun::mm_fp8", mutates_args=())
def mm_fp8(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    return _fp8_logits(x, w, x_s, w_s)


@mm_fp8.register_fake
def _(x, w, x_s, w_s, grad_s):
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16),
            x.new_empty(x.size(1), x.size(0), dtype=torch.float8_e4m3fn),
            w.new_empty(w.size(1), w.size(0), dtype=torch.float8_e4m3fn))


@torch.library.custom_op("speedrun::mm_fp8_backward", mutates_args=())
def mm_fp8_backward(g_f8: Tensor, g_f8_t: Tensor, x_f8_t: Tensor, w_f8_t: Tensor, x_s: float, w_s: float,
                    grad_s: float) -> tuple[Tensor, Tensor]:
    return _fp8_grads(g_f8, g_f8_t, x_f8_t, w_f8_t, x_s, w_s, grad_s)


@mm_fp8_backward.register_fake
def _(g_f8, g_f8_t, x_f8_t, w_f8_t, x_s, w_s, grad_s):
    return (g_f8.new_empty(g_f8.size(0), w_f8_t.size(0), dtype=torch.bfloat16),
            g_f8.new_empty(g_f8.size(1), x_f8_t.size(0), dtype=torch.float32))


def _mm_fp8_setup_context(ctx, inputs, output):
    _, _, x_s, w_s, grad_s = inputs
    _, x_f8_t, w_f8_t = output
    ctx.save_for_backward(x_f8_t, w_f8_t)
    ctx.scales = (x_s, w_s, grad_s)


def _mm_fp8_backward(ctx, grad_out, *_):
    x_f8_t, w_f8_t = ctx.saved_tensors
    # The (tokens x vocab) gradient is quantized here, in the traced graph rather than inside the opaque
    # op, so torch.compile fuses scale and cast into the kernel that computes it (the cross-entropy
    # backward): it is written once, in FP8, instead of in bf16 and then read back to quantize.
    g_f8, g_f8_t = _quantize(grad_out, ctx.scales[2], torch.float8_e5m2)
    grad_x, grad_w = torch.ops.speedrun.mm_fp8_backward(g_f8, g_f8_t, x_f8_t, w_f8_t, *ctx.scales)
    return grad_x, grad_w, None, None, None


mm_fp8.register_autograd(_mm_fp8_backward, setup_context=_mm_fp8_setup_context)


# FP8 head and its soft-capped cross-entropy in one op (--fused_ce; the public record line's "fused
# softcapped cross-entropy"): the loss comes from softcap_ce, and the backward's logit
# gradient from softcap_ce_grad, written once, in FP8, in both layouts the two matmuls need.
# Each token has K targets (T, K) with weights (T, K): the next token (weight 1) and, with multi-token
# prediction, the tokens after it at their weights, 0 where a target lies past the token's document. The op also
# gives each target's own cross-entropy term, lse - z (T, K), for losses that are not a weighted sum of them
# (CPLM's mixture): their gradients join the weights in the backward, whose kernel takes any per-target weights.
HEAD_LOGITS_DTYPE = torch.float8_e4m3fn  # the fused head's logits between its matmul and its loss kernels


@torch.library.custom_op("speedrun::fp8_head_ce", mutates_args=())
def fp8_head_ce(x: Tensor, w: Tensor, targets: Tensor, weights: Tensor, x_s: float, w_s: float, grad_s: float,
                cap: float, shift: float, temp: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(losses, lse, logits, x_f8_t, w_f8_t, terms): each token's weighted loss, the rest kept for the backward,
    and each target's term lse - z (T, K)."""
    # the raw logits in e4m3 (ANVIL2, the public line's 2026-08-30 record): half the bytes of bf16 written by the
    # matmul and read by the loss' forward and backward kernels, at 3 mantissa bits (|logit| < 448, e4m3's largest)
    logits, x_f8_t, w_f8_t = _fp8_logits(x, w, x_s, w_s, HEAD_LOGITS_DTYPE)
    losses, lse = softcap_ce(logits, targets, cap, shift, temp, weights)
    picked = logits.view(torch.uint8).gather(1, targets.long()).view(logits.dtype)  # gather has no FP8 kernels
    z = cap * torch.sigmoid((picked.float() + shift) / temp)  # the soft-capped targets
    return losses, lse, logits, x_f8_t, w_f8_t, lse[:, None] - z


@fp8_head_ce.register_fake
def _(x, w, targets, weights, x_s, w_s, grad_s, cap, shift, temp):
    (T, D), V = x.shape, w.size(0)
    return (x.new_empty(T, dtype=torch.float32), x.new_empty(T, dtype=torch.float32),
            x.new_empty(T, V, dtype=HEAD_LOGITS_DTYPE), x.new_empty(D, T, dtype=torch.float8_e4m3fn),
            w.new_empty(D, V, dtype=torch.float8_e4m3fn), x.new_empty(T, targets.size(1), dtype=torch.float32))


@torch.library.custom_op("speedrun::fp8_head_ce_backward", mutates_args=())
def fp8_head_ce_backward(grad_losses: Tensor, logits: Tensor, targets: Tensor, weights: Tensor, lse: Tensor,
                         x_f8_t: Tensor, w_f8_t: Tensor, x_s: float, w_s: float, grad_s: float, cap: float,
                         shift: float, temp: float) -> tuple[Tensor, Tensor]:
    g_f8, g_f8_t = softcap_ce_grad(grad_losses, logits, targets, lse, cap, shift, temp, grad_s, weights)
    return _fp8_grads(g_f8, g_f8_t, x_f8_t, w_f8_t, x_s, w_s, grad_s)


@fp8_head_ce_backward.register_fake
def _(grad_losses, logits, targets, weights, lse, x_f8_t, w_f8_t, x_s, w_s, grad_s, cap, shift, temp):
    return (logits.new_empty(logits.size(0), x_f8_t.size(0), dtype=torch.bfloat16),
            logits.new_empty(logits.size(1), x_f8_t.size(0), dtype=torch.float32))


def _fp8_head_ce_setup_context(ctx, inputs, output):
    _, _, targets, weights, *ctx.scalars = inputs  # x_s, w_s, grad_s, cap, shift, temp
    _, lse, logits, x_f8_t, w_f8_t, _ = output
    ctx.save_for_backward(logits, targets, weights, lse, x_f8_t, w_f8_t)


def _fp8_head_ce_autograd(ctx, grad_losses, _lse, _logits, _x_f8_t, _w_f8_t, grad_terms):
    logits, targets, weights, lse, x_f8_t, w_f8_t = ctx.saved_tensors
    # every target's weight in the gradient: the weighted losses' and the terms' own, one backward for both
    weights = weights * (0 if grad_losses is None else grad_losses.float()[:, None])
    if grad_terms is not None:
        weights = weights + grad_terms.float()
    grad_x, grad_w = torch.ops.speedrun.fp8_head_ce_backward(torch.ones_like(lse), logits, targets, weights.contiguous(),
                                                             lse, x_f8_t, w_f8_t, *ctx.scalars)
    return grad_x, grad_w, None, None, None, None, None, None, None, None


fp8_head_ce.register_autograd(_fp8_head_ce_autograd, setup_context=_fp8_head_ce_setup_context)


# The LM head's fixed FP8 scales (the 09/03 record's): activations are RMS-normed, so |x| <= sqrt(dim)
# fits e4m3 at sqrt(dim)/448; weights at 2^-9; the gradient of the summed loss at 1/448.
HEAD_W_SCALE = 2**-9
HEAD_GRAD_SCALE = 1 / E4M3_MAX


def head_x_scale(model_dim: int) -> float:
    return math.sqrt(model_dim) / E4M3_MAX


def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls need Hopper/Ada (sm89+) tensor cores; _scaled_mm also runs on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def document_ids(cu_seqlens: Tensor, T: int) -> Tensor:
    """(T,) each position's document: how many of cu_seqlens' offsets lie at or before it."""
    return torch.searchsorted(cu_seqlens, torch.arange(T, device=cu_seqlens.device), right=True)


# Varlen attention: q, k, v are (tokens, heads, head_dim) for a whole micro-batch; cu_seqlens marks
# the documents (padded with repeats of the buffer length); each query sees itself and the `window`
# tokens before it in its own document. Every backend below computes exactly this.

def attention_reference(q, k, v, cu_seqlens, max_seqlen, window, scale):
    """Plain PyTorch: an explicit (T, T) mask and SDPA. O(T^2) memory, for CPUs and tests."""
    pos = torch.arange(q.size(0), device=q.device)
    doc = document_ids(cu_seqlens, q.size(0))
    delta = pos[:, None] - pos[None, :]
    mask = (doc[:, None] == doc[None, :]) & (delta >= 0) & (delta <= window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _attention_varlen(q, k, v, cu_seqlens, max_seqlen, window, scale):
    """PyTorch's built-in varlen attention (FlashAttention-2 kernels), any recent CUDA GPU."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, window_size=(window, 0))


# FlashAttention-3 and -4 as opaque custom ops: torch.compile(fullgraph=True) cannot trace their
# Python front ends (flash-attn-4's autograd.Function runs a fake-mode check), so each library's own
# forward and backward kernels become a pair of ops, with output shapes for the compiler's fake
# tensors and the backward attached by register_autograd.
def flash_attention_op(name: str, forward, backward):
    """The attention function of backend `name`, built on two ops `speedrun::{name}` and
    `speedrun::{name}_backward`. `forward(q, k, v, cu_seqlens, max_seqlen, window, scale)` returns
    (out (T, H, D), lse (H, T) float32); `backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen,
    window, scale)` returns the gradients of q, k and v. Outputs are contiguous, as the fakes say."""

    @torch.library.custom_op(f"speedrun::{name}", mutates_args=())
    def attend(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window: int,
               scale: float) -> tuple[Tensor, Tensor]:
        out, lse = forward(q, k, v, cu_seqlens, max_seqlen, window, scale)
        return out.contiguous(), lse.contiguous()

    @attend.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, window, scale):  # (T, H, V's width): Q/K may be narrower (MIXED_WIDTHS)
        return q.new_empty(*q.shape[:-1], v.size(-1)), q.new_empty(q.size(1), q.size(0), dtype=torch.float32)

    @torch.library.custom_op(f"speedrun::{name}_backward", mutates_args=())
    def attend_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        cu_seqlens: Tensor, max_seqlen: int, window: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        grads = backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale)
        return tuple(g.contiguous() for g in grads)

    @attend_backward.register_fake
    def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_seqlens, max_seqlen, window, scale = inputs
        ctx.save_for_backward(q, k, v, cu_seqlens, *output)
        ctx.static = (max_seqlen, window, scale)

    def grad(ctx, grad_out, grad_lse):  # lse is an internal output: nothing flows back through it
        q, k, v, cu_seqlens, out, lse = ctx.saved_tensors
        return *attend_backward(grad_out, q, k, v, out, lse, cu_seqlens, *ctx.static), None, None, None, None

    attend.register_autograd(grad, setup_context=setup_context)

    def attention(q, k, v, cu_seqlens, max_seqlen, window, scale):
        return attend(q, k, v, cu_seqlens, max_seqlen, window, scale)[0]
    attention.__doc__ = forward.__doc__
    return attention


def _fa3_forward(q, k, v, cu_seqlens, max_seqlen, window, scale):
    """FlashAttention-3 (Hopper kernels, torch.ops.flash_attn_3): what the public records use. One split
    (num_splits=1, the default of FA3's Python interface; the op's own default 0 picks split-KV plus a
    combine kernel): 0.94 -> 0.82 ms forward + backward per 49,152-token micro-batch on one H100, the same
    output (bench/fa3_num_splits.py)."""
    out, lse, *_ = torch.ops.flash_attn_3.fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, is_causal=True, window_size_left=window, window_size_right=0,
        num_splits=1)
    return out, lse


def _fa3_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    torch.ops.flash_attn_3.bwd(
        grad_out, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale, is_causal=True,
        window_size_left=window, window_size_right=0)
    return dq, dk, dv


def _fa4_forward(q, k, v, cu_seqlens, max_seqlen, window, scale):
    """FlashAttention-4 (CuTe DSL kernels, pip flash-attn-4), sm90+."""
    from flash_attn.cute.interface import _flash_attn_fwd  # the kernels under its autograd.Function
    out, lse, *_ = _flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, window_size_left=window, window_size_right=0,
        return_lse=True)
    return out, lse


def _fa4_sm90_tiles_by_wider_width():
    """FA4 (4.0.0b36) picks its SM90 backward tile by Q's head width alone. For Q/K at 64 with V at 128 that is the
    128 x 128 tile of d = 64, whose 248,832 bytes of shared memory exceed an H100/H200's 232,448: the launch fails
    (seen on an H200). Choose the tile by the wider of the two widths, the tile FA4 uses for (128, 128)."""
    from flash_attn.cute import interface
    pick = getattr(interface, "_tile_size_bwd_sm90", None)  # absent in a later FA4: it then chooses on its own
    if pick is not None and not getattr(pick, "by_wider_width", False):
        def by_wider(head_dim, head_dim_v, *args, **kwargs):
            return pick(max(head_dim, head_dim_v), head_dim_v, *args, **kwargs)
        by_wider.by_wider_width = True
        interface._tile_size_bwd_sm90 = by_wider


def _fa4_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale):
    from flash_attn.cute.interface import _flash_attn_bwd
    if q.shape[-1] < v.shape[-1]:
        _fa4_sm90_tiles_by_wider_width()
    dq, dk, dv = _flash_attn_bwd(
        q, k, v, out, grad_out, lse, softmax_scale=scale, causal=True, window_size_left=window,
        window_size_right=0, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


def _load_fa3() -> bool:
    """Register torch.ops.flash_attn_3: from the flash_attn_3 wheel if installed, else from the FA3
    build that xformers==0.0.34 bundles (CUDA 12, stable ABI; under a CUDA-13 torch it needs
    libcudart.so.12, from pip's nvidia-cuda-runtime-cu12)."""
    if hasattr(torch.ops.flash_attn_3, "fwd"):
        return True
    if _importable("flash_attn_3._C"):
        return hasattr(torch.ops.flash_attn_3, "fwd")
    import ctypes
    import importlib.util
    spec = importlib.util.find_spec("xformers")  # locates the package without importing it
    so = Path(spec.origin).parent / "flash_attn_3" / "_C.so" if spec and spec.origin else None
    if so is None or not so.exists():
        return False
    try:
        ctypes.CDLL("libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        found = [p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia/cuda_runtime/lib/libcudart.so.12"))]
        if not found:
            return False
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    try:
        torch.ops.load_library(str(so))
    except OSError:
        return False
    return hasattr(torch.ops.flash_attn_3, "fwd")


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


ATTENTION_BACKENDS = {"fa3": flash_attention_op("fa3", _fa3_forward, _fa3_backward),
                      "fa4": flash_attention_op("fa4", _fa4_forward, _fa4_backward), "varlen": _attention_varlen,
                      "reference": attention_reference}
# Backends that take Q/K heads narrower than V's as they are (the model pads Q/K to V's width for the others): FA4
# tiles d_qk and d_v apart on sm90 (bench/results/attention_head_widths.md; its (64,128) untested upstream, checked
# against the reference by tests/test_narrow_heads.py where it is installed), SDPA's math path does the reference's.
# PyTorch's varlen wants equal widths; the FA3 build of xformers 0.0.34 has no (64,128) kernel (it would run (64,256))
MIXED_WIDTHS = {"fa4", "reference"}


def available_attention_backends(device: torch.device) -> list[str]:
    """Backends that can run on `device`, best first."""
    if device.type != "cuda":
        return ["reference"]
    names = []
    hopper = torch.cuda.get_device_capability(device) >= (9, 0)
    if hopper and _importable("flash_attn.cute"):  # fa4 before fa3: 704 vs 715 ms per step on one H100
        names.append("fa4")
    if hopper and _load_fa3():
        names.append("fa3")
    if _importable("torch.nn.attention.varlen"):
        names.append("varlen")
    return names + ["reference"]


# Where each backend comes from, for the error when one is asked for and missing or failing.
ATTENTION_INSTALL = {
    "fa3": "a Hopper GPU (H100/H200) and "
           "`pip install --no-deps xformers==0.0.34 nvidia-cuda-runtime-cu12==12.8.90` (README: Hopper attention)",
    "fa4": "a Hopper GPU (H100/H200) and `pip install -r requirements-hopper.txt` (README: Hopper attention)",
    "varlen": "PyTorch >= 2.11", "reference": "PyTorch"}


def check_attention(name: str, device: torch.device, compiled: bool) -> str | None:
    """Why backend `name` cannot be used here, or None: a tiny varlen forward and backward (two
    documents and padding, a sliding window), traced with fullgraph as the model is when `compiled`,
    must match the reference path. Run once at start-up, it keeps a backend that is installed but
    breaks (e.g. one torch.compile cannot trace) from being chosen."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(256, 2, 128, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        cu = torch.tensor([0, 100, 256, 256], dtype=torch.int32, device=device)
        fn = lambda q, k, v: ATTENTION_BACKENDS[name](q, k, v, cu, 256, 64, 0.12)
        if compiled:  # AOT autograd with fake tensors, as the model's compile will trace it (no codegen)
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
        out = fn(q, k, v)
        out.float().square().sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_reference(qr, kr, vr, cu, 256, 64, 0.12)
    ref.square().sum().backward()
    err = max(float((a.detach().float() - b.detach()).norm() / b.detach().norm()) for a, b in
              [(out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)])
    # bf16 kernels land near 1e-2 against the float32 reference; a wrong mask or window near 1
    return None if err < 5e-2 else f"differs from the reference path (relative error {err:.1e})"


def select_attention(name: str, device: torch.device, compiled: bool = False, log=print) -> str:
    """The backend to run: `name`, or for "auto" the fastest one installed here that passes its
    check (the log says why each faster one was skipped). A requested backend that is missing or
    fails its check is an error naming where it comes from."""
    available = available_attention_backends(device)
    if name != "auto" and name not in available:
        raise ValueError(f"attention backend {name!r} is not available on {device} (available: {available}); "
                         f"it needs {ATTENTION_INSTALL[name]}")
    skipped = []
    for candidate in ([name] if name != "auto" else available):
        if candidate == "reference" and (name == "reference" or device.type != "cuda" or not skipped):
            return candidate  # the definition the others are checked against
        if candidate == "reference":  # O(T^2) memory: never a silent fallback for a GPU run
            raise ValueError(f"no attention backend passed its start-up check on {device}: " + "; ".join(skipped))
        reason = check_attention(candidate, device, compiled)
        if reason is None:
            return candidate
        if name != "auto":
            raise ValueError(f"attention backend {name!r} failed its start-up check on {device}: {reason} "
                             f"(it needs {ATTENTION_INSTALL[name]})")
        skipped.append(f"{candidate}: {reason}")
        log(f"attention: skipping {skipped[-1]}")
    return "reference"


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a model runs, chosen once for its device (choose_kernels); the defaults are PyTorch's own, which
    run anywhere (the CPU, tests, sampling)."""
    attention: str = "reference"  # an ATTENTION_BACKENDS name
    fp8_head: bool = False  # the LM head's matmul in FP8 in training (mm_fp8)
    fused_ce: bool = False  # with fp8_head: the soft-capped cross-entropy in Triton (fp8_head_ce)
    fused_mlp: bool = False  # ReLU² in the MLP's matmul epilogues (relu2_mlp)
    fp8_mlp: bool = False  # with fused_mlp: its matmuls in FP8, forward and backward (relu2_mlp_all_fp8)
    pointer: bool = False  # CPLM's pointer as Triton kernels (copy_pointer), else written out in PyTorch
    dc: bool = False  # DC attention's correction as Triton kernels (dc_attention), else written out in PyTorch
    qk_rope: bool = False  # QK-norm, rotary and the key offset as Triton kernels (qk_norm_rope), else Inductor's
    transpose: bool = False  # with fp8_mlp: its operands' transposed copies by the transpose op, else Inductor's

    @property
    def attn_fn(self):
        return ATTENTION_BACKENDS[self.attention]


def choose_kernels(device: torch.device, attention: str = "auto", compiled: bool = False, fp8_head: bool = True,
                   fused_ce: bool = True, fused_mlp: bool = True, fp8_mlp: bool = True, fused_dc: bool = True,
                   fused_qk_rope: bool = True, fp8_transpose: bool = True, log=print) -> ModelKernels:
    """The whole model's kernels on `device`: each one asked for where it runs here (the log says why one is off)."""
    fp8 = fp8_head and device.type == "cuda" and fp8_supported(device)  # elsewhere the head is a plain matmul
    if fused_ce and not fp8:
        log("fused cross-entropy off: it is the FP8 head's, and the LM head runs in bf16 here (same results)")
    fits = fused_mlp and relu2_mlp_fits(device)
    if fused_mlp and not fits:
        log(f"fused MLP off: its kernel needs {relu2_tiles_shared_memory() // 1024} KiB of shared memory, this "
            f"GPU has {max_shared_memory(device) // 1024} KiB; the MLP runs unfused (same results)")
    # the FP8 MLP is the fused kernel's in Hopper's TMA form (sm90+), on a GPU with FP8 matmuls
    mlp8 = fp8_mlp and fp8 and fits and relu2_tma_programs(device) > 0
    if fp8_mlp and not mlp8:
        log("FP8 MLP off: it needs FP8 matmuls and the fused MLP's kernel in Hopper's TMA form (an sm90+ GPU with its "
            "shared memory); the MLP runs in bf16")
    triton_here = triton is not None and (device.type == "cuda" or INTERPRET)
    return ModelKernels(select_attention(attention, device, compiled, log), fp8, fused_ce and fp8, fits, mlp8,
                        pointer=triton_here, dc=fused_dc and triton_here, qk_rope=fused_qk_rope and triton_here,
                        transpose=fp8_transpose and mlp8)


# -----------------------------------------------------------------------------------------------
# CPLM's pointer (train_gpt.py's GPT.copy_pointer) as flash-style Triton kernels: query i's softmax over its keys j
# (start_i <= j < i, j in i's band of `band` tokens or the one before) and a sink score, never written out. Per query:
# lse (log of the softmax's normalizer), p_copy (its mass on keys whose token is i's target) and a_sink (the sink's
# share). With w_ij the softmax and m_ij = [token_j = target_i], for upstream gradients gP, gS and
# D_i = gP_i p_copy_i + gS_i a_sink_i: dL/ds_ij = w_ij (gP_i m_ij - D_i), dL/dsink_i = a_sink_i (gS_i - D_i).

def copy_pointer_reference(q: Tensor, k: Tensor, sink: Tensor, start: Tensor, tokens: Tensor, targets: Tensor,
                           band: int) -> tuple[Tensor, Tensor]:
    """Plain PyTorch with a (T, T) mask, for CPUs and tests: (p_copy, a_sink)."""
    i, j = torch.arange(q.size(0), device=q.device)[:, None], torch.arange(q.size(0), device=q.device)[None, :]
    allowed = (j < i) & (j >= start[:, None]) & (j >= (i // band - 1) * band)
    scores = torch.where(allowed, q @ k.T, float("-inf"))
    lse = torch.logsumexp(torch.cat([scores, sink[:, None]], 1), 1)
    w = (scores - lse[:, None]).exp()
    return torch.where(tokens[None, :] == targets[:, None], w, 0).sum(1), (sink - lse).exp()


if triton is not None:
    @triton.jit
    def _pointer_queries(q_ptr, start_ptr, tgt_ptr, i0, T, band, D: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr):
        """A block of BM queries from i0: offsets, feature offsets, which exist, q, the first key each may
        see (its document's start, at most a band before its own band), its target, and where the block's
        first key block of BN starts."""
        offs_m, offs_d = i0 + tl.arange(0, BM), tl.arange(0, D)
        row = offs_m < T
        q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :], mask=row[:, None], other=0.0)
        low = tl.maximum(tl.load(start_ptr + offs_m, mask=row, other=0), (i0 // band - 1) * band)
        j_first = tl.maximum((tl.min(tl.where(row, low, T)) // BN) * BN, 0)
        return offs_m, offs_d, row, q, low, tl.load(tgt_ptr + offs_m, mask=row, other=-1), j_first

    @triton.jit
    def _pointer_scores(q, k_ptr, tok_ptr, j0, offs_m, low, offs_d, T, D: tl.constexpr, BN: tl.constexpr):
        """The block of BN keys from j0 for the queries offs_m: scores (-inf where a key is not strictly before
        the query or before its first key `low`), key offsets and the keys' tokens."""
        offs_n = j0 + tl.arange(0, BN)
        kt = tl.load(k_ptr + offs_n[None, :] * D + offs_d[:, None], mask=offs_n[None, :] < T, other=0.0)
        s = tl.dot(q, kt, input_precision="tf32")
        ok = (offs_n[None, :] < offs_m[:, None]) & (offs_n[None, :] >= low[:, None])
        return tl.where(ok, s, float("-inf")), offs_n, tl.load(tok_ptr + offs_n, mask=offs_n < T, other=-2)

    @triton.jit
    def _pointer_fwd_kernel(q_ptr, k_ptr, sink_ptr, start_ptr, tok_ptr, tgt_ptr, lse_ptr, p_ptr, s_ptr, T, band,
                            D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        i0 = tl.program_id(0) * BM
        offs_m, offs_d, row, q, low, y, j_first = _pointer_queries(q_ptr, start_ptr, tgt_ptr, i0, T, band, D, BM, BN)
        t = tl.load(sink_ptr + offs_m, mask=row, other=0.0)
        m, l, c = t, tl.full([BM], 1.0, tl.float32), tl.zeros([BM], tl.float32)
        for j0 in range(j_first, i0 + BM, BN):
            s, offs_n, tok = _pointer_scores(q, k_ptr, tok_ptr, j0, offs_m, low, offs_d, T, D, BN)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])  # exp(-inf) = 0 where masked
            l = l * alpha + tl.sum(p, 1)
            c = c * alpha + tl.sum(tl.where(tok[None, :] == y[:, None], p, 0.0), 1)
            m = m_new
        lse = m + tl.log(l)
        tl.store(lse_ptr + offs_m, lse, mask=row)
        tl.store(p_ptr + offs_m, c / l, mask=row)
        tl.store(s_ptr + offs_m, tl.exp(t - lse), mask=row)

    @triton.jit
    def _pointer_dq_kernel(q_ptr, k_ptr, start_ptr, tok_ptr, tgt_ptr, lse_ptr, gp_ptr, dd_ptr, dq_ptr, T, band,
                           D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        i0 = tl.program_id(0) * BM
        offs_m, offs_d, row, q, low, y, j_first = _pointer_queries(q_ptr, start_ptr, tgt_ptr, i0, T, band, D, BM, BN)
        lse = tl.load(lse_ptr + offs_m, mask=row, other=0.0)
        gp = tl.load(gp_ptr + offs_m, mask=row, other=0.0)
        dd = tl.load(dd_ptr + offs_m, mask=row, other=0.0)
        dq = tl.zeros([BM, D], tl.float32)
        for j0 in range(j_first, i0 + BM, BN):
            s, offs_n, tok = _pointer_scores(q, k_ptr, tok_ptr, j0, offs_m, low, offs_d, T, D, BN)
            w = tl.exp(s - lse[:, None])  # 0 where masked
            gs = w * (tl.where(tok[None, :] == y[:, None], gp[:, None], 0.0) - dd[:, None])
            k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=offs_n[:, None] < T, other=0.0)
            dq += tl.dot(gs, k, input_precision="tf32")
        tl.store(dq_ptr + offs_m[:, None] * D + offs_d[None, :], dq, mask=row[:, None])

    @triton.jit
    def _pointer_dk_kernel(q_ptr, k_ptr, start_ptr, end_ptr, tok_ptr, tgt_ptr, lse_ptr, gp_ptr, dd_ptr, dk_ptr, T,
                           band, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        j0 = tl.program_id(0) * BN
        offs_n, offs_d = j0 + tl.arange(0, BN), tl.arange(0, D)
        col = offs_n < T
        k = tl.load(k_ptr + offs_n[:, None] * D + offs_d[None, :], mask=col[:, None], other=0.0)
        tok = tl.load(tok_ptr + offs_n, mask=col, other=-2)
        dk = tl.zeros([BN, D], tl.float32)
        # queries of this band and the next see these keys, and only up to the end of the last key's document
        # (documents end in order): without that bound, 3,072 queries a key on average at band 2048 instead of
        # the rest of its document; 685 of the pointer's 1,290 us a micro-batch (one H100, 2026-11-27)
        i_end = tl.minimum(tl.minimum((j0 // band + 2) * band, T), tl.load(end_ptr + tl.minimum(j0 + BN, T) - 1))
        for i0 in range((j0 // BM) * BM, i_end, BM):
            offs_m = i0 + tl.arange(0, BM)
            row = offs_m < T
            q = tl.load(q_ptr + offs_m[:, None] * D + offs_d[None, :], mask=row[:, None], other=0.0)
            low = tl.maximum(tl.load(start_ptr + offs_m, mask=row, other=T), (offs_m // band - 1) * band)
            y = tl.load(tgt_ptr + offs_m, mask=row, other=-1)
            lse = tl.load(lse_ptr + offs_m, mask=row, other=0.0)
            gp = tl.load(gp_ptr + offs_m, mask=row, other=0.0)
            dd = tl.load(dd_ptr + offs_m, mask=row, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="tf32")
            ok = (offs_n[None, :] < offs_m[:, None]) & (offs_n[None, :] >= low[:, None]) & row[:, None]
            w = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            gs = w * (tl.where(tok[None, :] == y[:, None], gp[:, None], 0.0) - dd[:, None])
            dk += tl.dot(tl.trans(gs), q, input_precision="tf32")
        tl.store(dk_ptr + offs_n[:, None] * D + offs_d[None, :], dk, mask=col[:, None])


# The pointer kernels' tiles: query rows BM and key rows BN per program (each at most the band, which they divide),
# warps per program and pipeline stages (3 stages of float32 tiles take 225 KiB of shared memory in the dq kernel
# for sm_90, at the limit; 2 take 160); bench/pointer_kernel.py times the choices: on one H100 at band 2048, 49,152
# tokens, forward + backward, BN=32 1.65 ms, BN=64 2.18 ms, the compiled written-out pointer 4.96 ms (2026-11-26).
POINTER_TILES = dict(BM=64, BN=32, num_warps=4, num_stages=2)


def _pointer_tiles(band: int) -> dict:
    tiles = dict(POINTER_TILES, BM=min(POINTER_TILES["BM"], band), BN=min(POINTER_TILES["BN"], band))
    if band % tiles["BM"] or band % tiles["BN"] or min(tiles["BM"], tiles["BN"]) < 16:
        raise ValueError(f"the pointer kernels need a band that is a multiple of their tiles "
                         f"({tiles['BM']}, {tiles['BN']}; at least 16), not {band}")
    return tiles


@torch.library.custom_op("speedrun::copy_pointer", mutates_args=())
def copy_pointer(q: Tensor, k: Tensor, sink: Tensor, start: Tensor, tokens: Tensor, targets: Tensor,
                 band: int) -> tuple[Tensor, Tensor, Tensor]:
    """(p_copy, a_sink, lse) of CPLM's pointer; q, k (T, D) float32, sink (T,), start/tokens/targets (T,) int32."""
    T, D = q.shape
    tiles = _pointer_tiles(band)
    lse, p, s = (torch.empty(T, device=q.device, dtype=torch.float32) for _ in range(3))
    _pointer_fwd_kernel[(triton.cdiv(T, tiles["BM"]),)](q, k, sink, start, tokens, targets, lse, p, s, T, band, D=D,
                                                        **tiles)
    return p, s, lse


@copy_pointer.register_fake
def _(q, k, sink, start, tokens, targets, band):
    return tuple(q.new_empty(q.size(0)) for _ in range(3))


@torch.library.custom_op("speedrun::copy_pointer_backward", mutates_args=())
def copy_pointer_backward(q: Tensor, k: Tensor, start: Tensor, tokens: Tensor, targets: Tensor, lse: Tensor,
                          g_copy: Tensor, dd: Tensor, band: int) -> tuple[Tensor, Tensor]:
    T, D = q.shape
    tiles = _pointer_tiles(band)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    end = torch.searchsorted(start, start, right=True).int()  # each position's document end (starts are sorted)
    _pointer_dq_kernel[(triton.cdiv(T, tiles["BM"]),)](q, k, start, tokens, targets, lse, g_copy, dd, dq, T, band,
                                                       D=D, **tiles)
    _pointer_dk_kernel[(triton.cdiv(T, tiles["BN"]),)](q, k, start, end, tokens, targets, lse, g_copy, dd, dk, T,
                                                       band, D=D, **tiles)
    return dq, dk


@copy_pointer_backward.register_fake
def _(q, k, start, tokens, targets, lse, g_copy, dd, band):
    return torch.empty_like(q), torch.empty_like(k)


def _copy_pointer_setup_context(ctx, inputs, output):
    q, k, _, start, tokens, targets, band = inputs
    p, s, lse = output
    ctx.save_for_backward(q, k, start, tokens, targets, lse, p, s)
    ctx.band = band


def _copy_pointer_autograd(ctx, g_copy, g_sink, _g_lse):
    q, k, start, tokens, targets, lse, p, s = ctx.saved_tensors
    g_copy = torch.zeros_like(p) if g_copy is None else g_copy.float().contiguous()
    g_sink = torch.zeros_like(s) if g_sink is None else g_sink.float()
    dd = (g_copy * p + g_sink * s).contiguous()
    dq, dk = copy_pointer_backward(q, k, start, tokens, targets, lse, g_copy, dd, ctx.band)
    return dq, dk, s * (g_sink - dd), None, None, None, None


copy_pointer.register_autograd(_copy_pointer_autograd, setup_context=_copy_pointer_setup_context)


# -----------------------------------------------------------------------------------------------
# DC attention's correction (train_gpt.py's dc_correction: DCMHA's post-composition at rank 1, arXiv 2405.08553) as
# flash-style Triton kernels. Query i's softmax over the `window` latest keys of its document, per head g: P_g(i, j);
# one map per query mixes the heads, A(i, j) = sum_g w_g(i) P_g(i, j); each head reads its values through it:
# o_h(i) = sum_j A(i, j) v_h(j). Written out in PyTorch (float32 scores and probabilities of every head, their
# blocks padded and unfolded) it took 5-7.5% of a record step on an H200 (bench/results/dc_narrow_2gpu_h200_20261129k.md);
# here the scores stay in registers and only A, one float32 map a query, goes to memory (a band of LOOK + BM keys,
# LOOK the least multiple of BM that covers window - 1), for the output and the backward. A program takes one head of
# a block of BM queries (or, for dk and dv, of BM keys); the heads' shares of A and of dA are added into the band.
# Backward, with do_h the gradient of o_h, dA(i, j) = sum_h do_h(i).v_h(j) and dw_g(i) = sum_j P_g(i, j) dA(i, j):
# dL/dv_h(j) = sum_i A(i, j) do_h(i), dL/dw_g(i) = dw_g(i), dL/ds_g(i, j) = w_g(i) P_g(i, j) (dA(i, j) - dw_g(i)).

def dc_attention_reference(q: Tensor, k: Tensor, v: Tensor, doc: Tensor, w: Tensor, scale: float,
                           window: int) -> Tensor:
    """Plain PyTorch with a (T, T) mask, for tests: o (T, H, D) of q, k, v (T, H, D), doc (T,) and w (T, H)."""
    i, j = torch.arange(q.size(0), device=q.device)[:, None], torch.arange(q.size(0), device=q.device)[None, :]
    allowed = (j <= i) & (j > i - window) & (doc[:, None] == doc[None, :])
    scores = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (H, T, T)
    mixed = torch.einsum("ih,hij->ij", w.float(), probs)
    return torch.einsum("ij,jhd->ihd", mixed, v.float()).to(v.dtype)


if triton is not None:
    @triton.jit
    def _dc_scores(q, k_ptr, doc_ptr, j0, offs_m, doc_q, T, scale, window, g, H: tl.constexpr, D: tl.constexpr,
                   BN: tl.constexpr):
        """Head g's scores of the queries offs_m (q: their (BM, D) rows) against the BN keys from j0, and which
        of them a query may see: its own document's, itself and the window - 1 keys before it."""
        offs_n, offs_d = j0 + tl.arange(0, BN), tl.arange(0, D)
        inside = (offs_n >= 0) & (offs_n < T)
        kt = tl.load(k_ptr + offs_n[None, :] * (H * D) + g * D + offs_d[:, None], mask=inside[None, :], other=0.0)
        s = tl.dot(q, kt) * scale
        doc_k = tl.load(doc_ptr + offs_n, mask=inside, other=-2)
        ok = ((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] > offs_m[:, None] - window)
              & (doc_k[None, :] == doc_q[:, None]))
        return s, ok

    @triton.jit
    def _dc_block(T, BM: tl.constexpr, D: tl.constexpr):
        """This program's first row, its head, the offsets of its rows, of a head's features and of a block within
        the band, and which of its rows exist."""
        i0 = tl.program_id(0) * BM
        offs_m = i0 + tl.arange(0, BM)
        return i0, tl.program_id(1), offs_m, tl.arange(0, D), tl.arange(0, BM), offs_m < T

    @triton.jit
    def _dc_fwd_mix_kernel(q_ptr, k_ptr, doc_ptr, w_ptr, lse_ptr, a_ptr, T, scale, window, H: tl.constexpr,
                           D: tl.constexpr, BM: tl.constexpr, LOOK: tl.constexpr):
        """Head g's log-normalizer (online over the key blocks), then its share w_g P_g of the mix A, added to the
        band (zeroed before: each head adds its own)."""
        i0, g, offs_m, offs_d, offs_b, row = _dc_block(T, BM, D)
        doc_q = tl.load(doc_ptr + offs_m, mask=row, other=-1)
        q = tl.load(q_ptr + offs_m[:, None] * (H * D) + g * D + offs_d[None, :], mask=row[:, None], other=0.0)
        m, l = tl.full([BM], -1e30, tl.float32), tl.zeros([BM], tl.float32)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            s, ok = _dc_scores(q, k_ptr, doc_ptr, j0, offs_m, doc_q, T, scale, window, g, H, D, BM)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m = m_new
        lse = tl.where(row, m + tl.log(l), 0.0)
        tl.store(lse_ptr + offs_m * H + g, lse, mask=row)
        w = tl.load(w_ptr + offs_m * H + g, mask=row, other=0.0)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            s, ok = _dc_scores(q, k_ptr, doc_ptr, j0, offs_m, doc_q, T, scale, window, g, H, D, BM)
            tl.atomic_add(a_ptr + offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :],
                          w[:, None] * tl.where(ok, tl.exp(s - lse[:, None]), 0.0), mask=row[:, None])

    @triton.jit
    def _dc_fwd_out_kernel(v_ptr, a_ptr, o_ptr, T, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                           LOOK: tl.constexpr):
        """Head h's output through the mix (A in the values' dtype, as the written-out form)."""
        i0, h, offs_m, offs_d, offs_b, row = _dc_block(T, BM, D)
        acc = tl.zeros([BM, D], tl.float32)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            offs_n = j0 + offs_b
            a = tl.load(a_ptr + offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :], mask=row[:, None],
                        other=0.0)
            vv = tl.load(v_ptr + offs_n[:, None] * (H * D) + h * D + offs_d[None, :],
                         mask=((offs_n >= 0) & (offs_n < T))[:, None], other=0.0)
            acc += tl.dot(a.to(vv.dtype), vv)
        tl.store(o_ptr + offs_m[:, None] * (H * D) + h * D + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=row[:, None])

    @triton.jit
    def _dc_bwd_mix_kernel(do_ptr, v_ptr, da_ptr, T, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                           LOOK: tl.constexpr):
        """Head h's share do_h.v_h of dA, added to its band (zeroed before)."""
        i0, h, offs_m, offs_d, offs_b, row = _dc_block(T, BM, D)
        do = tl.load(do_ptr + offs_m[:, None] * (H * D) + h * D + offs_d[None, :], mask=row[:, None], other=0.0)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            offs_n = j0 + offs_b
            vt = tl.load(v_ptr + offs_n[None, :] * (H * D) + h * D + offs_d[:, None],
                         mask=((offs_n >= 0) & (offs_n < T))[None, :], other=0.0)
            tl.atomic_add(da_ptr + offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :],
                          tl.dot(do, vt), mask=row[:, None])

    @triton.jit
    def _dc_bwd_query_kernel(q_ptr, k_ptr, doc_ptr, w_ptr, lse_ptr, da_ptr, dq_ptr, dw_ptr, T, scale, window,
                             H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, LOOK: tl.constexpr):
        """Head g's dw and dq for one block of queries."""
        i0, g, offs_m, offs_d, offs_b, row = _dc_block(T, BM, D)
        doc_q = tl.load(doc_ptr + offs_m, mask=row, other=-1)
        q = tl.load(q_ptr + offs_m[:, None] * (H * D) + g * D + offs_d[None, :], mask=row[:, None], other=0.0)
        lse = tl.load(lse_ptr + offs_m * H + g, mask=row, other=0.0)
        w = tl.load(w_ptr + offs_m * H + g, mask=row, other=0.0)
        dw = tl.zeros([BM], tl.float32)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            s, ok = _dc_scores(q, k_ptr, doc_ptr, j0, offs_m, doc_q, T, scale, window, g, H, D, BM)
            da = tl.load(da_ptr + offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :],
                         mask=row[:, None], other=0.0)
            dw += tl.sum(tl.where(ok, tl.exp(s - lse[:, None]), 0.0) * da, 1)
        tl.store(dw_ptr + offs_m * H + g, dw, mask=row)
        dq = tl.zeros([BM, D], tl.float32)
        for j0 in range(i0 - LOOK, i0 + BM, BM):
            offs_n = j0 + offs_b
            s, ok = _dc_scores(q, k_ptr, doc_ptr, j0, offs_m, doc_q, T, scale, window, g, H, D, BM)
            da = tl.load(da_ptr + offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :],
                         mask=row[:, None], other=0.0)
            ds = w[:, None] * tl.where(ok, tl.exp(s - lse[:, None]), 0.0) * (da - dw[:, None])
            kk = tl.load(k_ptr + offs_n[:, None] * (H * D) + g * D + offs_d[None, :],
                         mask=((offs_n >= 0) & (offs_n < T))[:, None], other=0.0)
            dq += tl.dot(ds.to(kk.dtype), kk)  # ds in the inputs' dtype, as FlashAttention's backward
        tl.store(dq_ptr + offs_m[:, None] * (H * D) + g * D + offs_d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
                 mask=row[:, None])

    @triton.jit
    def _dc_bwd_key_kernel(do_ptr, q_ptr, k_ptr, doc_ptr, w_ptr, lse_ptr, a_ptr, da_ptr, dw_ptr, dk_ptr, dv_ptr, T,
                           scale, window, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, LOOK: tl.constexpr):
        """Head h's dv and dk of one block of BM keys, over the query blocks whose bands hold it (the one it starts and
        the LOOK / BM after)."""
        j0, h, offs_n, offs_d, offs_b, col = _dc_block(T, BM, D)  # a block of keys
        doc_k = tl.load(doc_ptr + offs_n, mask=col, other=-2)
        kk = tl.load(k_ptr + offs_n[:, None] * (H * D) + h * D + offs_d[None, :], mask=col[:, None], other=0.0)
        dv = tl.zeros([BM, D], tl.float32)
        dk = tl.zeros([BM, D], tl.float32)
        for i0 in range(j0, j0 + LOOK + BM, BM):
            offs_m = i0 + offs_b
            row = offs_m < T
            band = offs_m[:, None] * (LOOK + BM) + (j0 - i0 + LOOK) + offs_b[None, :]
            a = tl.load(a_ptr + band, mask=row[:, None], other=0.0)
            do = tl.load(do_ptr + offs_m[:, None] * (H * D) + h * D + offs_d[None, :], mask=row[:, None], other=0.0)
            dv += tl.dot(tl.trans(a.to(do.dtype)), do)
            q = tl.load(q_ptr + offs_m[:, None] * (H * D) + h * D + offs_d[None, :], mask=row[:, None], other=0.0)
            lse = tl.load(lse_ptr + offs_m * H + h, mask=row, other=0.0)
            w = tl.load(w_ptr + offs_m * H + h, mask=row, other=0.0)
            dw = tl.load(dw_ptr + offs_m * H + h, mask=row, other=0.0)
            doc_q = tl.load(doc_ptr + offs_m, mask=row, other=-1)
            s = tl.dot(q, tl.trans(kk)) * scale
            ok = ((offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] > offs_m[:, None] - window)
                  & (doc_k[None, :] == doc_q[:, None]) & col[None, :])
            da = tl.load(da_ptr + band, mask=row[:, None], other=0.0)
            ds = w[:, None] * tl.where(ok, tl.exp(s - lse[:, None]), 0.0) * (da - dw[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(dv_ptr + offs_n[:, None] * (H * D) + h * D + offs_d[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=col[:, None])
        tl.store(dk_ptr + offs_n[:, None] * (H * D) + h * D + offs_d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty),
                 mask=col[:, None])


# The DC kernels' tiles: BM queries (and keys) a block, warps and pipeline stages per program. One H200, 49,152 tokens
# x 6 heads of 128 (bench/dc_kernel.py, 2026-11-30): 2.342 ms forward + backward with these, 2.606 at two stages,
# 2.314 at BM 32 with two warps, against 3.418 written out and compiled.
DC_TILES = dict(BM=64, num_warps=4, num_stages=1)


def _dc_geometry(window: int) -> tuple[int, int, int]:
    """(BM, LOOK, band): LOOK, the keys before a query block that its band holds, the least multiple of BM that
    covers window - 1."""
    BM = DC_TILES["BM"]
    look = -(-(window - 1) // BM) * BM
    return BM, look, look + BM


def _dc_launch(q: Tensor, window: int) -> tuple[int, tuple[int, int], dict]:
    """The band's width, the grid (a program per block and head) and the kernels' shared arguments for q (T, H, D)."""
    T, H, D = q.shape
    BM, look, band = _dc_geometry(window)
    return band, (triton.cdiv(T, BM), H), dict(H=H, D=D, BM=BM, LOOK=look, num_warps=DC_TILES["num_warps"],
                                                num_stages=DC_TILES["num_stages"])


@torch.library.custom_op("speedrun::dc_attention", mutates_args=())
def dc_attention(q: Tensor, k: Tensor, v: Tensor, doc: Tensor, w: Tensor, scale: float,
                 window: int) -> tuple[Tensor, Tensor, Tensor]:
    """(o, lse, A's band) of DC attention's correction before its output weights: q, k, v (T, H, D) contiguous, doc
    (T,) int32 document ids, w (T, H) float32 (the heads' mix, RMS-normed over heads by the caller)."""
    T, H, _ = q.shape
    band, grid, meta = _dc_launch(q, window)
    o = torch.empty_like(v)
    lse = torch.empty(T, H, device=q.device, dtype=torch.float32)
    a = torch.zeros(T, band, device=q.device, dtype=torch.float32)  # each head adds its share
    _dc_fwd_mix_kernel[grid](q, k, doc, w, lse, a, T, scale, window, **meta)
    _dc_fwd_out_kernel[grid](v, a, o, T, **meta)
    return o, lse, a


@dc_attention.register_fake
def _(q, k, v, doc, w, scale, window):
    T, H, _ = q.shape
    return torch.empty_like(v), q.new_empty(T, H, dtype=torch.float32), q.new_empty(
        T, _dc_geometry(window)[2], dtype=torch.float32)


@torch.library.custom_op("speedrun::dc_attention_backward", mutates_args=())
def dc_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, doc: Tensor, w: Tensor, lse: Tensor,
                          a: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dw) of dc_attention from its output's gradient do."""
    T, H, _ = q.shape
    band, grid, meta = _dc_launch(q, window)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dw = torch.empty(T, H, device=q.device, dtype=torch.float32)
    da = torch.zeros(T, band, device=q.device, dtype=torch.float32)  # each head adds its share
    _dc_bwd_mix_kernel[grid](do, v, da, T, **meta)
    _dc_bwd_query_kernel[grid](q, k, doc, w, lse, da, dq, dw, T, scale, window, **meta)
    _dc_bwd_key_kernel[grid](do, q, k, doc, w, lse, a, da, dw, dk, dv, T, scale, window, **meta)
    return dq, dk, dv, dw


@dc_attention_backward.register_fake
def _(do, q, k, v, doc, w, lse, a, scale, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)


def _dc_attention_setup_context(ctx, inputs, output):
    q, k, v, doc, w, scale, window = inputs
    _, lse, a = output
    ctx.save_for_backward(q, k, v, doc, w, lse, a)
    ctx.scale, ctx.window = scale, window


def _dc_attention_autograd(ctx, do, _lse, _a):
    q, k, v, doc, w, lse, a = ctx.saved_tensors
    dq, dk, dv, dw = dc_attention_backward(do.contiguous(), q, k, v, doc, w, lse, a, ctx.scale, ctx.window)
    return dq, dk, dv, None, dw, None, None


dc_attention.register_autograd(_dc_attention_autograd, setup_context=_dc_attention_setup_context)


# -----------------------------------------------------------------------------------------------
# The attention's QK-norm and rotary (train_gpt.py's CausalSelfAttention: rotate(norm(q)), the same for k, then the
# long-window blocks' partial key offset) as one Triton kernel each way, reading the QKV projection's output as it
# is and writing the whole projection's gradient in one pass (ANVIL2, record #92, fuses these with its FP8 QKV;
# bench/qk_rope.py measured Inductor's form of this pass at ~63% of a copy's bandwidth on an H100). A program
# takes BT tokens of one head of q, of k or of v (v is copied, so no output aliases the input). Per head vector x
# of width D: n = x / sqrt(mean(x²) + eps) (F.rms_norm's eps for bf16 input: float32's), then halves (n1, n2)
# rotate by the token's table row, y1 = n1 cos + n2 sin, y2 = n2 cos - n1 sin. Backward: dn1 = g1 cos - g2 sin,
# dn2 = g1 sin + g2 cos, dx = (dn - n mean(dn n)) / sqrt(mean(x²) + eps). Paired heads (pair_heads) read table row
# 2t + (h >= H/2), the output's memory being the (2T, H/2, D) view. Key offset (offset_keys): a key's unrotated dims
# (the second quarter of each half) are the previous token's, but at a document's start; its backward hands those
# dims' gradient to the token before.

RMS_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default for bf16 and float32 input (float32's epsilon)
QK_ROPE_TILES = dict(BT=64, num_warps=4)


def qk_norm_rope_reference(qkv: Tensor, cos: Tensor, sin: Tensor, starts: Tensor | None, heads: int, qk_dim: int,
                           v_dim: int, paired: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) of qk_norm_rope in PyTorch, float32 arithmetic, rounded once: qkv (T, 2 H qk_dim + H v_dim);
    cos, sin (rows, qk_dim / 2) with a row per token (two with paired); starts (T,) bool or None (no key offset)."""
    if paired and starts is not None:
        raise ValueError("qk_norm_rope: the key offset of paired heads is not written (no preset has both)")
    T, H, D = qkv.size(0), heads, qk_dim
    q, k, v = qkv.float().split((H * D, H * D, H * v_dim), dim=-1)
    rows = torch.arange(T, device=qkv.device)[:, None] * (2 if paired else 1) + (
        torch.arange(H, device=qkv.device) // (H // 2) if paired else 0)  # (T, H) or (T, 1): each head's table row
    c, s = cos.float()[rows], sin.float()[rows]

    def one(x):
        x = x.view(T, H, D)
        n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + RMS_EPS)
        n1, n2 = n.chunk(2, dim=-1)
        return torch.cat((n1 * c + n2 * s, n2 * c - n1 * s), dim=-1)

    q, k = one(q), one(k)
    if starts is not None:
        unrotated = torch.arange(D, device=qkv.device) % (D // 2) >= D // 4
        prev = torch.where(starts[:, None, None], k, k.roll(1, dims=0))
        k = torch.where(unrotated, prev, k)
    return q.to(qkv.dtype), k.to(qkv.dtype), v.reshape(T, H, v_dim).to(qkv.dtype).clone()


if triton is not None:
    @triton.jit
    def _rms_halves(x_ptr, rows, live, half, stride_x, D: tl.constexpr, eps):
        """(n1, n2, r): the RMS-normed halves of the head vectors at x_ptr + rows * stride_x and 1/rms, float32."""
        x1 = tl.load(x_ptr + rows[:, None] * stride_x + half[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + rows[:, None] * stride_x + D // 2 + half[None, :], mask=live[:, None],
                     other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
        return x1 * r[:, None], x2 * r[:, None], r

    @triton.jit
    def _table_rows(cos_ptr, sin_ptr, tab, live, half, stride_tab):
        """(cos, sin) at the table rows tab, float32."""
        c = tl.load(cos_ptr + tab[:, None] * stride_tab + half[None, :], mask=live[:, None], other=1.0)
        s = tl.load(sin_ptr + tab[:, None] * stride_tab + half[None, :], mask=live[:, None], other=0.0)
        return c, s

    @triton.jit
    def _qk_program(T, H: tl.constexpr, D: tl.constexpr, PAIRED: tl.constexpr, BT: tl.constexpr):
        """(j, rows, live, h, half, tab): this program's head among q's, k's then v's, its tokens and which of them
        exist, the head's index within its tensor, half a q/k head's columns, and each token's table row."""
        j = tl.program_id(1)
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        h = j % H
        if PAIRED:
            tab = rows * 2 + h // (H // 2)
        else:
            tab = rows
        return j, rows, rows < T, h, tl.arange(0, D // 2), tab

    @triton.jit
    def _qk_norm_rope_fwd_kernel(qkv_ptr, cos_ptr, sin_ptr, start_ptr, q_ptr, k_ptr, v_ptr, T, stride_qkv,
                                 stride_tab, eps, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                                 PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr, BT: tl.constexpr):
        j, rows, live, h, half, tab = _qk_program(T, H, D, PAIRED, BT)
        if j < 2 * H:
            n1, n2, _ = _rms_halves(qkv_ptr + j * D, rows, live, half, stride_qkv, D, eps)
            c, s = _table_rows(cos_ptr, sin_ptr, tab, live, half, stride_tab)
            y1, y2 = n1 * c + n2 * s, n2 * c - n1 * s
            out = rows[:, None] * (H * D) + h * D + half[None, :]
            if j < H:
                tl.store(q_ptr + out, y1.to(q_ptr.dtype.element_ty), mask=live[:, None])
                tl.store(q_ptr + out + D // 2, y2.to(q_ptr.dtype.element_ty), mask=live[:, None])
            else:
                if KEY_OFFSET:  # the unrotated dims from the token before, but at a document's start
                    prev = tl.maximum(rows - 1, 0)
                    p1, p2, _ = _rms_halves(qkv_ptr + j * D, prev, live, half, stride_qkv, D, eps)
                    pc, ps = _table_rows(cos_ptr, sin_ptr, prev, live, half, stride_tab)
                    start = tl.load(start_ptr + rows, mask=live, other=1) != 0
                    take = (half[None, :] >= D // 4) & ~start[:, None]
                    y1 = tl.where(take, p1 * pc + p2 * ps, y1)
                    y2 = tl.where(take, p2 * pc - p1 * ps, y2)
                tl.store(k_ptr + out, y1.to(k_ptr.dtype.element_ty), mask=live[:, None])
                tl.store(k_ptr + out + D // 2, y2.to(k_ptr.dtype.element_ty), mask=live[:, None])
        else:
            d = tl.arange(0, DV)
            x = tl.load(qkv_ptr + rows[:, None] * stride_qkv + 2 * H * D + h * DV + d[None, :], mask=live[:, None])
            tl.store(v_ptr + rows[:, None] * (H * DV) + h * DV + d[None, :], x, mask=live[:, None])

    @triton.jit
    def _qk_norm_rope_bwd_kernel(qkv_ptr, cos_ptr, sin_ptr, start_ptr, dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, T,
                                 stride_qkv, stride_tab, eps, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                                 PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr, BT: tl.constexpr):
        j, rows, live, h, half, tab = _qk_program(T, H, D, PAIRED, BT)
        if j < 2 * H:
            at = rows[:, None] * (H * D) + h * D + half[None, :]
            if j < H:
                g1 = tl.load(dq_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                g2 = tl.load(dq_ptr + at + D // 2, mask=live[:, None], other=0.0).to(tl.float32)
            else:
                g1 = tl.load(dk_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                g2 = tl.load(dk_ptr + at + D // 2, mask=live[:, None], other=0.0).to(tl.float32)
                if KEY_OFFSET:  # unrotated dims: the own gradient at a document's start, plus the next token's
                    unrotated = half[None, :] >= D // 4
                    start = tl.load(start_ptr + rows, mask=live, other=1) != 0
                    nxt = live & (rows + 1 < T)
                    start_next = tl.load(start_ptr + rows + 1, mask=nxt, other=1) != 0
                    own = ~unrotated | start[:, None]
                    handed = unrotated & ~start_next[:, None]
                    f1 = tl.load(dk_ptr + at + H * D, mask=nxt[:, None], other=0.0).to(tl.float32)
                    f2 = tl.load(dk_ptr + at + H * D + D // 2, mask=nxt[:, None], other=0.0).to(tl.float32)
                    g1 = tl.where(own, g1, 0.0) + tl.where(handed, f1, 0.0)
                    g2 = tl.where(own, g2, 0.0) + tl.where(handed, f2, 0.0)
            n1, n2, r = _rms_halves(qkv_ptr + j * D, rows, live, half, stride_qkv, D, eps)
            c, s = _table_rows(cos_ptr, sin_ptr, tab, live, half, stride_tab)
            d1, d2 = g1 * c - g2 * s, g1 * s + g2 * c
            dot = (tl.sum(d1 * n1, 1) + tl.sum(d2 * n2, 1)) / D
            out = dqkv_ptr + rows[:, None] * stride_qkv + j * D + half[None, :]
            tl.store(out, ((d1 - n1 * dot[:, None]) * r[:, None]).to(dqkv_ptr.dtype.element_ty), mask=live[:, None])
            tl.store(out + D // 2, ((d2 - n2 * dot[:, None]) * r[:, None]).to(dqkv_ptr.dtype.element_ty),
                     mask=live[:, None])
        else:
            d = tl.arange(0, DV)
            g = tl.load(dv_ptr + rows[:, None] * (H * DV) + h * DV + d[None, :], mask=live[:, None])
            tl.store(dqkv_ptr + rows[:, None] * stride_qkv + 2 * H * D + h * DV + d[None, :], g, mask=live[:, None])


def _qk_rope_launch(qkv: Tensor, cos: Tensor, heads: int, qk_dim: int, v_dim: int, paired: bool,
                    starts: Tensor | None) -> tuple[tuple[int, int], dict]:
    """The grid (a program per BT tokens and head of q, k and v) and the kernels' shared arguments."""
    if qkv.stride(1) != 1 or cos.stride(1) != 1 or qkv.size(1) != heads * (2 * qk_dim + v_dim):
        raise ValueError(f"qk_norm_rope: qkv (T, {heads * (2 * qk_dim + v_dim)}) and tables with unit column stride")
    if paired and starts is not None:
        raise ValueError("qk_norm_rope: the key offset of paired heads is not written (no preset has both)")
    BT = QK_ROPE_TILES["BT"]
    return (triton.cdiv(qkv.size(0), BT), 3 * heads), dict(
        stride_qkv=qkv.stride(0), stride_tab=cos.stride(0), eps=RMS_EPS, H=heads, D=qk_dim, DV=v_dim, PAIRED=paired,
        KEY_OFFSET=starts is not None, BT=BT, num_warps=QK_ROPE_TILES["num_warps"])


@triton_op("speedrun::qk_norm_rope", mutates_args=())  # a triton_op, as transpose is: Inductor launches its kernels
def qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, starts: Tensor | None, heads: int, qk_dim: int,
                 v_dim: int, paired: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v), (T, H, qk_dim) twice and (T, H, v_dim), from the QKV projection qkv (T, H (2 qk_dim + v_dim)): q
    and k RMS-normed and rotated by the tables cos, sin (a row per token, two with paired; qk_dim / 2 columns),
    k's unrotated dims offset by a token where starts (T,) bool is given; v a copy. qk_norm_rope_reference where
    Triton does not run."""
    if not triton_runs_on(qkv):
        return qk_norm_rope_reference(qkv, cos, sin, starts, heads, qk_dim, v_dim, paired)
    T = qkv.size(0)
    grid, meta = _qk_rope_launch(qkv, cos, heads, qk_dim, v_dim, paired, starts)
    q, k = (qkv.new_empty(T, heads, qk_dim) for _ in range(2))
    v = qkv.new_empty(T, heads, v_dim)
    wrap_triton(_qk_norm_rope_fwd_kernel)[grid](qkv, cos, sin, qkv if starts is None else starts.to(torch.uint8),
                                                q, k, v, T, **meta)
    return q, k, v


@triton_op("speedrun::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_backward(dq: Tensor, dk: Tensor, dv: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor,
                          starts: Tensor | None, heads: int, qk_dim: int, v_dim: int, paired: bool) -> Tensor:
    """The projection's gradient (T, H (2 qk_dim + v_dim)) from those of q, k, v (contiguous)."""
    T = qkv.size(0)
    grid, meta = _qk_rope_launch(qkv, cos, heads, qk_dim, v_dim, paired, starts)
    dqkv = torch.empty_like(qkv)
    wrap_triton(_qk_norm_rope_bwd_kernel)[grid](qkv, cos, sin, qkv if starts is None else starts.to(torch.uint8),
                                                dq, dk, dv, dqkv, T, **meta)
    return dqkv


def _qk_norm_rope_setup_context(ctx, inputs, output):
    qkv, cos, sin, starts, heads, qk_dim, v_dim, paired = inputs
    ctx.save_for_backward(qkv, cos, sin, starts)
    ctx.shape = heads, qk_dim, v_dim, paired


def _qk_norm_rope_autograd(ctx, dq, dk, dv):
    qkv, cos, sin, starts = ctx.saved_tensors
    if triton_runs_on(qkv):
        dqkv = qk_norm_rope_backward(dq.contiguous(), dk.contiguous(), dv.contiguous(), qkv, cos, sin, starts,
                                     *ctx.shape)
    else:  # the reference's gradient, by autograd through it
        with torch.enable_grad():
            leaf = qkv.detach().requires_grad_()
            dqkv, = torch.autograd.grad(qk_norm_rope_reference(leaf, cos, sin, starts, *ctx.shape), leaf,
                                        (dq, dk, dv))
    return dqkv, None, None, None, None, None, None, None


qk_norm_rope.register_autograd(_qk_norm_rope_autograd, setup_context=_qk_norm_rope_setup_context)
