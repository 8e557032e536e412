"""Triton kernels of train_gpt.py, each a torch custom op with a PyTorch reference that runs where
Triton cannot (the CPU, a machine without Triton): the ReLU² MLP with its activation in the matmul
epilogues (--fused_mlp). train_gpt.py logs this file's source with its own.

Set TRITON_INTERPRET=1 before the first import of triton to run the kernels on the CPU (slowly, in
Triton's interpreter): that is how the CPU tests check them against the references.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # e.g. macOS: only the references run
    triton = None

# Triton's interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors.
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(t: Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


# -----------------------------------------------------------------------------------------------
# ReLU² MLP with its activation fused into the matmuls (the public record line's "fused
# linear + ReLU² kernel"): the up-projection's epilogue writes both the pre-activation h = x W_fc and
# relu(h)², and in the backward the epilogue of (grad_out W_proj) multiplies by relu(h)' = 2 relu(h).
# The two elementwise passes over the (tokens x 4 dim) activations that they replace cost about as
# much memory traffic as the matmul takes time. The other three matmuls stay on cuBLAS.

def relu2_mlp_reference(x: Tensor, fc_w: Tensor, proj_w: Tensor) -> Tensor:
    """F.linear(relu(x @ fc_w)², proj_w): x (T, dim), fc_w and proj_w (dim, hidden)."""
    return torch.relu(x @ fc_w).square() @ proj_w.mT


if triton is not None:
    @triton.jit
    def _matmul_relu2_kernel(a_ptr, b_ptr, out_ptr, aux_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             stride_om, stride_on, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """acc = A @ B (M x N, float32). Forward: aux = acc (the pre-activation), out = relu(acc)².
        Backward: out = acc * 2 relu(aux) (aux: the saved pre-activation)."""
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
            pre = tl.load(aux_ptr + at, mask=inside, other=0.0).to(tl.float32)
            acc = acc * 2 * tl.maximum(pre, 0.0)
        else:
            tl.store(aux_ptr + at, acc.to(aux_ptr.dtype.element_ty), mask=inside)
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=inside)

# Tile sizes of the fused matmul: the fastest of five on an H100 (bench/mlp_kernel.py, bench/README.md);
# the interpreter tests shrink them.
RELU2_TILES = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def relu2_tiles_shared_memory(tiles: dict = RELU2_TILES, itemsize: int = 2) -> int:
    """Bytes of shared memory one program of the fused matmul needs: an A and a B tile per pipeline stage."""
    return tiles["num_stages"] * (tiles["BLOCK_M"] + tiles["BLOCK_N"]) * tiles["BLOCK_K"] * itemsize


def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on this CUDA device (the limit Triton checks at launch)."""
    return triton.runtime.driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"]


def relu2_mlp_fits(device: torch.device) -> bool:
    """Whether --fused_mlp can run its kernel here: on a CUDA GPU with the shared memory for RELU2_TILES
    (144 KiB: H100, H200 and A100 have it, most desktop GPUs do not); elsewhere the op's PyTorch
    reference runs, which always fits."""
    if device.type != "cuda" or triton is None:
        return True
    return max_shared_memory(device) >= relu2_tiles_shared_memory()


def _matmul_relu2(a: Tensor, b: Tensor, aux: Tensor | None) -> tuple[Tensor, Tensor]:
    """Forward (aux None): (relu(a @ b)², a @ b). Backward: ((a @ b) * 2 relu(aux), aux)."""
    M, K = a.shape
    N = b.size(1)
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    backward = aux is not None
    aux = torch.empty_like(out) if aux is None else aux.contiguous()
    t = RELU2_TILES
    grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
    _matmul_relu2_kernel[grid](a, b, out, aux, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                               out.stride(0), out.stride(1), BACKWARD=backward, **t)
    return out, aux


@torch.library.custom_op("speedrun::relu2_mlp", mutates_args=())
def relu2_mlp(x: Tensor, fc_w: Tensor, proj_w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(out, pre, post): out = relu(pre)² @ proj_w.T with pre = x @ fc_w; pre and post are kept for the
    backward. x (T, dim), fc_w and proj_w (dim, hidden), one dtype."""
    if not triton_runs_on(x):
        pre = x @ fc_w
        post = torch.relu(pre).square()
    else:
        post, pre = _matmul_relu2(x, fc_w, None)
    return post @ proj_w.mT, pre, post


@relu2_mlp.register_fake
def _(x, fc_w, proj_w):
    T, H = x.size(0), fc_w.size(1)
    return x.new_empty(T, proj_w.size(0)), x.new_empty(T, H), x.new_empty(T, H)


@torch.library.custom_op("speedrun::relu2_mlp_backward", mutates_args=())
def relu2_mlp_backward(grad: Tensor, x: Tensor, fc_w: Tensor, proj_w: Tensor, pre: Tensor,
                       post: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of x, fc_w and proj_w."""
    if not triton_runs_on(x):
        grad_pre = (grad @ proj_w) * 2 * torch.relu(pre)
    else:
        grad_pre = _matmul_relu2(grad, proj_w, pre)[0]
    return grad_pre @ fc_w.mT, x.mT @ grad_pre, grad.mT @ post


@relu2_mlp_backward.register_fake
def _(grad, x, fc_w, proj_w, pre, post):
    return torch.empty_like(x), torch.empty_like(fc_w), torch.empty_like(proj_w)


def _relu2_mlp_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1], output[2])


def _relu2_mlp_autograd(ctx, grad_out, _grad_pre, _grad_post):
    return relu2_mlp_backward(grad_out.contiguous(), *ctx.saved_tensors)


relu2_mlp.register_autograd(_relu2_mlp_autograd, setup_context=_relu2_mlp_setup_context)
