"""Time the FP8 LM head with its soft-capped cross-entropy, forward and backward, at the record's
micro-batch shape on one GPU: the unfused head and loss as torch.compile builds them in train_gpt.py
(the mm_fp8 op, then the loss in compiled PyTorch, whose backward quantizes the logits' gradient) against
kernels.py's fp8_head_ce op (its Triton loss and gradient kernels) with each tile
configuration given; the fused op's relative error against the unfused one. With --extra_targets N,
each token also has multi-token prediction's next N tokens as targets, at weights 0.5, 0.25, ... (0 for
one token in eight, as past a document's end). Seconds per run, not minutes of model compile: the way to
choose kernels.SOFTCAP_CE_TILES before timing whole steps (bench/step_time.py --fused_ce true).

    python bench/ce_kernel.py [--tokens 49152] [--extra_targets 2] [--tiles 2048,8,64,64,4 2048,8,32,128,4 ...]

A tile configuration is fwd BLOCK_V, fwd num_warps, bwd BLOCK_T, bwd BLOCK_V, bwd num_warps."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402

CAP, SHIFT, TEMP = 23.0, 5.0, 7.5  # the record preset's asymmetric softcap


def unfused(x, w, targets, weights):
    """train_gpt.py's head_losses with the FP8 head: each of a token's K targets (T, K) at its weight."""
    logits = torch.ops.speedrun.mm_fp8(x, w, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE, tg.HEAD_GRAD_SCALE)[0]
    z = CAP * torch.sigmoid((logits.float() + SHIFT) / TEMP)
    vocab = torch.arange(z.size(-1), device=z.device)
    lse = z.exp().sum(-1).log()
    losses = lse - torch.where(vocab == targets[:, :1], z, 0).sum(-1)
    for k in range(1, targets.size(1)):
        losses = losses + weights[:, k] * (lse - torch.where(vocab == targets[:, k: k + 1], z, 0).sum(-1))
    return losses.sum()


def fused(x, w, targets, weights):
    return torch.ops.speedrun.fp8_head_ce(x, w, targets, weights, tg.head_x_scale(x.size(1)), tg.HEAD_W_SCALE,
                                          tg.HEAD_GRAD_SCALE, CAP, SHIFT, TEMP)[0].sum()


def time_fwd_bwd(fn, x, w, targets, weights, iters: int) -> tuple[float, float, float]:
    """Median ms of forward + backward, of the forward and of the backward, over iters runs after three
    untimed ones (one event between the two halves)."""
    def no_grads():
        x.grad = w.grad = None
    times = timing.phase_times([lambda: fn(x, w, targets, weights), lambda loss: loss.backward()], iters,
                               before=no_grads)
    return tuple(timing.median(ms) for ms in ([f + b for f, b in times], *zip(*times)))


def loss_and_grads(fn, x, w, targets, weights):
    x.grad = w.grad = None
    loss = fn(x, w, targets, weights)
    loss.backward()
    return loss.detach(), x.grad.float(), w.grad.float()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152, help="rows of the micro-batch")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--tiles", nargs="+", default=["2048,8,64,64,4", "2048,8,32,128,4", "2048,8,128,128,8"],
                        help="fwd BLOCK_V,num_warps,bwd BLOCK_T,BLOCK_V,num_warps per configuration")
    parser.add_argument("--extra_targets", type=int, default=0, help="multi-token prediction's targets per token")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ce_kernel.py: needs a CUDA GPU (the Triton kernels, FP8 matmuls and CUDA-event timing)")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.nn.functional.rms_norm(torch.randn(args.tokens, args.dim, device="cuda", generator=g), (args.dim,))
    x = x.bfloat16().requires_grad_()
    w = (0.02 * torch.randn(args.vocab, args.dim, device="cuda", generator=g)).requires_grad_()
    K = 1 + args.extra_targets
    targets = torch.randint(0, args.vocab, (args.tokens, K), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.tensor([1.0] + [0.5 ** k for k in range(1, K)], device="cuda").repeat(args.tokens, 1)
    weights[::8, 1:] = 0.0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; FP8 head {args.tokens} x {args.dim} "
          f"-> {args.vocab} with the soft-capped cross-entropy, {K} target(s) per token, forward + backward, "
          f"median of {args.iters}")
    compiled = torch.compile(unfused, fullgraph=True)
    base, base_fwd, base_bwd = time_fwd_bwd(compiled, x, w, targets, weights, args.iters)
    reference = loss_and_grads(compiled, x, w, targets, weights)
    print(f"unfused (torch.compile): {base:.3f} ms (forward {base_fwd:.3f}, backward {base_bwd:.3f})")
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    for tiles in args.tiles:
        fwd_v, fwd_warps, bwd_t, bwd_v, bwd_warps = map(int, tiles.split(","))
        kernels.SOFTCAP_CE_TILES = dict(kernels.SOFTCAP_CE_TILES, fwd=dict(BLOCK_V=fwd_v, num_warps=fwd_warps),
                                        bwd=dict(BLOCK_T=bwd_t, BLOCK_V=bwd_v, num_warps=bwd_warps))
        try:
            ms, fwd, bwd = time_fwd_bwd(fused, x, w, targets, weights, args.iters)
        except Exception as e:  # a configuration the GPU cannot hold (shared memory, registers): say so, go on
            print(f"fused {tiles}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        got = loss_and_grads(fused, x, w, targets, weights)
        err = [rel(a, b) for a, b in zip(got, reference)]
        print(f"fused {tiles}: {ms:.3f} ms ({ms / base:.3f} x unfused; forward {fwd:.3f}, backward {bwd:.3f}); "
              f"relative error of the loss {err[0]:.1e}, of the gradients {err[1]:.1e} (x), {err[2]:.1e} (w)")


if __name__ == "__main__":
    main()
