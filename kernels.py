"""Triton kernels of train_gpt.py, each a torch custom op with a PyTorch reference that runs where
Triton cannot (the CPU, a machine without Triton). train_gpt.py logs this file's source with its own.

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
# Fused soft-capped cross-entropy (the public record line's "fused softcapped cross-entropy").
#
#   z = cap * sigmoid((logit + shift) / temp),   lse = log sum_j exp(z_j),
#   loss = sum_k w_k (lse - z[t_k])              (k = 0: the next token, w = 1; k > 0: multi-token
#                                                 prediction's later tokens, w = 0 where not kept)
#
# One pass over a row's logits forward (z lies in (0, cap), so exp(z) needs no running maximum), one
# backward that writes d loss / d logit = g (W softmax(z) - sum_k w_k [j = t_k]) dz/dlogit, with
# W = sum_k w_k and dz/dlogit = z (1 - z / cap) / temp, straight into a bf16 tensor shaped like the
# logits: neither z, nor softmax(z), nor a float32 copy of the logits is ever stored.

def softcap_ce_reference(logits: Tensor, targets: Tensor, weights: Tensor, cap: float, shift: float,
                         temp: float) -> tuple[Tensor, Tensor]:
    """(losses, lse) per row, in float32 PyTorch ops: the kernels' specification."""
    z = cap * torch.sigmoid((logits.float() + shift) / temp)
    lse = z.exp().sum(-1).log()
    picked = z.gather(1, targets.long())  # (N, K)
    return (weights * (lse[:, None] - picked)).sum(-1), lse


def softcap_ce_backward_reference(grad: Tensor, logits: Tensor, targets: Tensor, weights: Tensor, lse: Tensor,
                                  cap: float, shift: float, temp: float) -> Tensor:
    z = cap * torch.sigmoid((logits.float() + shift) / temp)
    d = weights.sum(-1, keepdim=True) * (z - lse[:, None]).exp()
    d = d.scatter_add(1, targets.long(), -weights)
    return (grad[:, None] * d * z * (1 - z / cap) / temp).to(logits.dtype)


if triton is not None:
    @triton.jit
    def _softcap_ce_forward_kernel(logits_ptr, row_stride, targets_ptr, weights_ptr, losses_ptr, lse_ptr, V,
                                   cap, shift, inv_temp, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            z = cap * tl.sigmoid((tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) + shift) * inv_temp)
            acc += tl.where(inside, tl.exp(z), 0.0)
        lse = tl.log(tl.sum(acc, axis=0))
        loss = 0.0
        for k in tl.static_range(K):
            t = tl.load(targets_ptr + row * K + k)
            w = tl.load(weights_ptr + row * K + k)
            zt = cap * tl.sigmoid((tl.load(base + t).to(tl.float32) + shift) * inv_temp)
            loss += w * (lse - zt)
        tl.store(losses_ptr + row, loss)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _softcap_ce_backward_kernel(grad_ptr, logits_ptr, row_stride, targets_ptr, weights_ptr, lse_ptr, out_ptr,
                                    out_stride, V, cap, shift, inv_temp, K: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_ptr + row)
        wsum = 0.0
        for k in tl.static_range(K):
            wsum += tl.load(weights_ptr + row * K + k)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            z = cap * tl.sigmoid((tl.load(base + cols, mask=inside, other=0.0).to(tl.float32) + shift) * inv_temp)
            d = wsum * tl.exp(z - lse)
            for k in tl.static_range(K):
                t = tl.load(targets_ptr + row * K + k)
                d -= tl.where(cols == t, tl.load(weights_ptr + row * K + k), 0.0)
            dz = g * d * z * (1.0 - z / cap) * inv_temp
            tl.store(out_ptr + row * out_stride + cols, dz.to(out_ptr.dtype.element_ty), mask=inside)

SOFTCAP_CE_BLOCK = 4096  # vocabulary columns per loop iteration of a row's program


def _check_softcap_ce_inputs(logits: Tensor, targets: Tensor, weights: Tensor):
    if logits.dim() != 2 or targets.shape != weights.shape or targets.dim() != 2 or targets.size(0) != logits.size(0):
        raise ValueError(f"softcap_ce: logits (N, V), targets and weights (N, K); got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(weights.shape)}")


@torch.library.custom_op("speedrun::softcap_ce", mutates_args=())
def softcap_ce(logits: Tensor, targets: Tensor, weights: Tensor, cap: float, shift: float,
               temp: float) -> tuple[Tensor, Tensor]:
    """Per-row soft-capped cross-entropy summed over K weighted targets, and each row's lse (saved for
    the backward). logits (N, V) any float dtype, targets (N, K) integer in [0, V), weights (N, K) float32."""
    _check_softcap_ce_inputs(logits, targets, weights)
    if not triton_runs_on(logits):
        return softcap_ce_reference(logits, targets, weights, cap, shift, temp)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    N, V = logits.shape
    losses = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(losses)
    _softcap_ce_forward_kernel[(N,)](logits, logits.stride(0), targets.contiguous(), weights.float().contiguous(),
                                     losses, lse, V, cap, shift, 1.0 / temp, K=targets.size(1),
                                     BLOCK=SOFTCAP_CE_BLOCK, num_warps=8)
    return losses, lse


@softcap_ce.register_fake
def _(logits, targets, weights, cap, shift, temp):
    _check_softcap_ce_inputs(logits, targets, weights)
    return logits.new_empty(logits.size(0), dtype=torch.float32), logits.new_empty(logits.size(0), dtype=torch.float32)


@torch.library.custom_op("speedrun::softcap_ce_backward", mutates_args=())
def softcap_ce_backward(grad: Tensor, logits: Tensor, targets: Tensor, weights: Tensor, lse: Tensor, cap: float,
                        shift: float, temp: float) -> Tensor:
    """d (sum_n grad_n loss_n) / d logits, in the logits' dtype."""
    if not triton_runs_on(logits):
        return softcap_ce_backward_reference(grad, logits, targets, weights, lse, cap, shift, temp)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    N, V = logits.shape
    out = torch.empty_like(logits)
    _softcap_ce_backward_kernel[(N,)](grad.float().contiguous(), logits, logits.stride(0), targets.contiguous(),
                                      weights.float().contiguous(), lse, out, out.stride(0), V, cap, shift,
                                      1.0 / temp, K=targets.size(1), BLOCK=SOFTCAP_CE_BLOCK, num_warps=8)
    return out


@softcap_ce_backward.register_fake
def _(grad, logits, targets, weights, lse, cap, shift, temp):
    return torch.empty_like(logits)


def _softcap_ce_setup_context(ctx, inputs, output):
    logits, targets, weights, cap, shift, temp = inputs
    ctx.save_for_backward(logits, targets, weights, output[1])
    ctx.softcap = (cap, shift, temp)


def _softcap_ce_autograd(ctx, grad_losses, _grad_lse):
    logits, targets, weights, lse = ctx.saved_tensors
    grad = softcap_ce_backward(grad_losses, logits, targets, weights, lse, *ctx.softcap)
    return grad, None, None, None, None, None


softcap_ce.register_autograd(_softcap_ce_autograd, setup_context=_softcap_ce_setup_context)
