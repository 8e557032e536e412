"""Time the attention's QK-norm and rotary, forward and backward, at the record's micro-batch shape on one GPU, as
Inductor compiles them in train_gpt.py, and set that beside the bytes such a pass must move: the headroom a
hand-written kernel could take (public pull request #344 fuses QK-norm, rotary and padding in one Triton kernel).

The pass is CausalSelfAttention.forward's between its QKV matmul and the attention: q and k of the (T, 3H, D)
projection through train_gpt.norm and train_gpt.rotate, and v scaled by its lambda, so that the backward writes the
projection's whole gradient as the model's does. The copy row times a compiled copy of the projection's bytes: the
bandwidth one pass over memory reaches on this GPU. "at copy speed" is the pass's least bytes at that bandwidth;
the last line scales the difference to a record step (the attention blocks x the micro-batches of one step).
Then the same lines for kernels.qk_norm_rope, the pass as one Triton kernel each way (v copied, not scaled: the same
bytes), and, with --key_offset, the compiled form with offset_keys and the kernels with theirs.

    python bench/qk_rope.py [--tokens 49152] [--heads 6] [--head_dim 128] [--iters 50] [--blocks 10 --micro 8]
                            [--key_offset]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402


def qk_rope(qkv, lam, cos, sin):
    """q and k normed and rotated, v scaled: CausalSelfAttention.forward's work between the QKV matmul and the
    attention (without the value embedding and the gates, which depend on the block)."""
    q, k, v = qkv.chunk(3, dim=1)
    rope = (cos, sin, 1.0)
    return tg.rotate(tg.norm(q), rope), tg.rotate(tg.norm(k), rope), lam * v


def least_bytes(tokens: int, heads: int, head_dim: int, qkv_bytes: int = 2, table_bytes: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes that any implementation of qk_rope must read and write once: the forward reads the
    projection and the rotary tables and writes q, k and v; the backward reads their three gradients, q and k as
    projected (to redo the norm) and the tables, and writes the projection's gradient."""
    one = tokens * heads * head_dim * qkv_bytes  # one (T, H, D) tensor
    tables = 2 * tokens * (head_dim // 2) * table_bytes  # cos and sin, (T, D / 2) each
    return 3 * one + tables + 3 * one, 3 * one + 2 * one + tables + 3 * one


def kernel_ms(fn, iters: int) -> float:
    """GPU kernel time of one fn() in ms, from torch.profiler's kernel records over iters runs after three untimed
    ones: at a few hundred µs a call the wall time between events varies with the host's launches, the kernels'
    own time does not."""
    from torch.profiler import ProfilerActivity, profile
    timing.warm_up(fn, 3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / iters / 1e3  # µs in total -> ms per call


def report(ms_fwd: float, ms_all: float, ms_copy: float, copy_bytes: int, least: tuple[int, int],
           calls: int) -> list[str]:
    """The lines main prints: the copy's bandwidth; forward, backward and both against their least bytes at that
    bandwidth; and the difference over `calls` passes (one step's)."""
    gbs = copy_bytes / ms_copy / 1e6  # bytes per ms / 1e6 = GB/s
    lines = [f"copy of the projection ({copy_bytes / 1e6:.0f} MB read + written): {ms_copy * 1e3:.1f} us, "
             f"{gbs:.0f} GB/s"]
    for name, ms, nbytes in (("forward", ms_fwd, least[0]), ("backward", ms_all - ms_fwd, least[1]),
                             ("both", ms_all, sum(least))):
        floor = nbytes / gbs / 1e6  # ms at the copy's bandwidth
        lines.append(f"{name:<9} {ms * 1e3:7.1f} us; least bytes {nbytes / 1e6:5.0f} MB -> {nbytes / ms / 1e6:5.0f} "
                     f"GB/s ({nbytes / ms / 1e6 / gbs:.0%} of the copy's); at copy speed {floor * 1e3:6.1f} us")
    spare = (ms_all - sum(least) / gbs / 1e6) * calls
    lines.append(f"a step of {calls} passes: {ms_all * calls:.1f} ms in this pass, {spare:.1f} ms above copy speed")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=49152, help="tokens of one micro-batch")
    h = tg.Hyperparameters()  # the record's model by default
    p.add_argument("--heads", type=int, default=h.num_heads)
    p.add_argument("--head_dim", type=int, default=h.head_dim)
    p.add_argument("--min_freq", type=float, default=h.rotary_min_freq,
                   help="Rotary's lowest frequency (the tables' values)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--blocks", type=int, default=10, help="blocks with attention (the record: 11 blocks, one without)")
    p.add_argument("--micro", type=int, default=8, help="micro-batches a step (the record on one GPU: 8)")
    p.add_argument("--key_offset", action="store_true", help="keys offset (the long-window blocks'), documents of "
                   "2,048 tokens")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("qk_rope.py: error: needs a CUDA GPU (it times kernels)")
    T, H, D = a.tokens, a.heads, a.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(T, 3 * H, D, device="cuda", generator=g).bfloat16().requires_grad_()
    lam = torch.tensor(0.5, device="cuda", requires_grad=True)
    cos, sin, _ = tg.Rotary(D, T, a.min_freq).cuda().at(0)
    grads = [torch.randn(T, H, D, device="cuda", generator=g).bfloat16() for _ in range(3)]
    cu = torch.arange(0, T + 1, 2048, device="cuda", dtype=torch.int32)
    starts = tg.document_starts(cu, T) if a.key_offset else None

    def written(qkv, lam, cos, sin):
        q, k, v = qk_rope(qkv, lam, cos, sin)
        return q, tg.offset_keys(k, cu) if a.key_offset else k, v
    compiled = torch.compile(written, fullgraph=True, dynamic=False)
    flat = qkv.detach().view(T, 3 * H * D).requires_grad_()

    def fwd():
        return compiled(qkv, lam, cos, sin)

    def fwd_bwd():
        qkv.grad = lam.grad = None
        torch.autograd.backward(compiled(qkv, lam, cos, sin), grads)

    def op():
        return kernels.qk_norm_rope(flat, cos, sin, starts, H, D, D, False)

    def op_bwd():
        flat.grad = None
        torch.autograd.backward(op(), grads)

    copy = torch.compile(lambda t: t.clone())
    src = qkv.detach().clone()
    ms_copy = kernel_ms(lambda: copy(src), a.iters)
    ms_fwd = kernel_ms(fwd, a.iters)  # the training forward (saving what the backward needs)
    ms_all = kernel_ms(fwd_bwd, a.iters)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; q, k, v of {T} tokens x {H} heads x "
          f"{D}, bf16{', keys offset' if a.key_offset else ''}, GPU kernel time per call over {a.iters} calls "
          "(torch.profiler)")
    print("compiled by Inductor:")
    print(*report(ms_fwd, ms_all, ms_copy, 2 * src.numel() * src.element_size(), least_bytes(T, H, D),
                  a.blocks * a.micro), sep="\n")
    print("kernels.qk_norm_rope:")
    print(*report(kernel_ms(op, a.iters), kernel_ms(op_bwd, a.iters), ms_copy, 2 * src.numel() * src.element_size(),
                  least_bytes(T, H, D), a.blocks * a.micro), sep="\n")


if __name__ == "__main__":
    main()
