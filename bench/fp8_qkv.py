"""The record's QKV projections alone, bf16 against FP8 (--fp8_qkv, kernels.FP8Linear), forward and backward, each as
the model compiles it (torch.compile, the input RMS-normed inside, so the casts fuse as they do in the step) and timed
as a replayed CUDA graph (the step replays them so: what counts is GPU time). One row per attention block's QKV width
at the record's micro-batch (49,152 tokens, dim 768), then the sum over a step (the blocks x 8 micro-batches), and the
FP8 result's error against float32 arithmetic relative to the bf16 one's.

    python bench/fp8_qkv.py [--tokens 49152] [--micro_batches 8] [--replays 20]
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402


def graph_ms(fn, replays: int) -> float:
    """Median ms of fn() captured once as a CUDA graph and replayed (three eager calls first: the compile)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--micro_batches", type=int, default=8, help="micro-batches a step (the sum's factor)")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not kernels.fp8_supported(torch.device("cuda")):
        sys.exit("fp8_qkv.py: needs a GPU with FP8 matmuls (sm_89+)")
    record = tg.parse_args(["--preset", "record"])
    cfg = tg.ModelConfig.from_args(record)
    blocks = [i for i in range(cfg.num_layers) if i not in record.no_attn_layers and i not in record.skip_layers]
    T, dim = args.tokens, cfg.model_dim
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {T:,} tokens x {dim}; "
          f"blocks {blocks}; ms a call (forward + backward), a replayed CUDA graph's median")

    def projection(fp8: bool):
        def fn(x_raw, w):
            x = F.rms_norm(x_raw, (dim,))
            return kernels.FP8Linear.apply(x, w) if fp8 else F.linear(x, w.type_as(x))
        return torch.compile(fn, fullgraph=True, dynamic=False)

    totals = {False: 0.0, True: 0.0}
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in blocks:
        dq, dv = cfg.head_widths(i)
        N = cfg.num_heads * (2 * dq + dv)
        x_raw = torch.randn(T, dim, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(N, dim, device="cuda", generator=g) * dim ** -0.5).requires_grad_()
        grad = torch.randn(T, N, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            x = F.rms_norm(x_raw.float(), (dim,))
            exact = x @ w.T
            exact_dx = torch.autograd.functional.vjp(lambda t: F.rms_norm(t, (dim,)) @ w.T, x_raw.float(),
                                                     grad.float())[1]
        row = [f"block {i:2d} (d_qk {dq:3d}, d_v {dv:3d}, N {N:5,})"]
        errors = {}
        for fp8 in (False, True):
            fn = projection(fp8)

            def step():
                x_raw.grad = w.grad = None
                fn(x_raw, w).backward(grad)
            ms = graph_ms(step, args.replays)
            totals[fp8] += ms
            out = fn(x_raw, w)
            x_raw.grad = None
            out.backward(grad)
            rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
            errors[fp8] = (rel(out, exact), rel(x_raw.grad, exact_dx))
            row.append(f"{'fp8' if fp8 else 'bf16'} {ms:.3f}")
        ratio = [errors[True][k] / max(errors[False][k], 1e-12) for k in range(2)]
        row.append(f"FP8 error / bf16's: output {ratio[0]:.1f}x, input gradient {ratio[1]:.1f}x "
                   f"(FP8 {errors[True][0]:.1e}, {errors[True][1]:.1e})")
        print("  ".join(row), flush=True)
    n = args.micro_batches
    print(f"a step ({len(blocks)} blocks x {n} micro-batches): bf16 {totals[False] * n:.2f} ms, FP8 "
          f"{totals[True] * n:.2f} ms ({totals[True] / totals[False]:.3f}x)", flush=True)


if __name__ == "__main__":
    main()
