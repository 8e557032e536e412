"""Attention at ANVIL2's head widths, kernel by kernel: forward and forward + backward of one attention layer at the
record's micro-batch (49,152 tokens, 6 heads; paired layers: twice the tokens, half the heads), for each installed
backend and window, at (d_qk, d_v) = (128, 128), (64, 128) with Q/K zero-padded to 128 (the model's route for a
kernel of one head width), (64, 128) as it is (backends in kernels.MIXED_WIDTHS: FA4), and (64, 64). The native
route's output is checked against the padded route's on the same inputs (their relative difference is printed: bf16
rounding gives ~1e-3, a kernel that mishandles the widths far more).

    python bench/attention_widths.py [--seq_len 49152] [--windows 640 1408] [--backends fa4 fa3 varlen] [--paired]

Needs a CUDA GPU for the fast backends (README: Hopper attention); --device cpu runs the reference path on a small
--seq_len, to try the script."""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
from fa3_padding import cu_seqlens, synthetic  # noqa: E402  (bench/fa3_padding.py: the loader's padded cu_seqlens)

# (name, d_qk, d_v, Q/K padded to d_v for the kernel)
CASES = (("128/128", 128, 128, False), ("64/128 padded", 64, 128, True), ("64/128 native", 64, 128, False),
         ("64/64", 64, 64, False))


def layer(backend: str, q, k, v, cu, max_len: int, window: int, scale: float, pad: bool, backward: bool):
    """One attention layer as the model calls it (the padding inside, as its cost is the route's), and its backward
    into q, k and v."""
    def run():
        qq, kk = (F.pad(q, (0, v.size(-1) - q.size(-1))), F.pad(k, (0, v.size(-1) - k.size(-1)))) if pad else (q, k)
        out = kernels.ATTENTION_BACKENDS[backend](qq, kk, v, cu, max_len, window, scale)
        if backward:
            torch.autograd.grad(out, (q, k, v), out)  # grad_out = out: any tensor of its shape
        return out
    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=49152, help="tokens per micro-batch")
    p.add_argument("--max_doc_len", type=int, default=2048)
    p.add_argument("--windows", type=int, nargs="+", default=[640, 1408], help="left windows in tokens")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--paired", action="store_true", help="the paired-head layout: 2 x seq_len tokens, heads / 2")
    p.add_argument("--backends", nargs="*", help="default: every installed one but the reference (on the CPU: it)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    installed = kernels.available_attention_backends(device)
    backends = a.backends or [b for b in installed if b != "reference" or device.type == "cpu"]
    missing = [b for b in backends if b not in installed]
    if missing:
        raise SystemExit(f"attention_widths.py: error: backend(s) {missing} not installed here (installed: "
                         f"{installed}; README: Hopper attention)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths = synthetic(a.seq_len, a.max_doc_len)
    T, H, factor = (2 * a.seq_len, a.heads // 2, 2) if a.paired else (a.seq_len, a.heads, 1)
    cu = cu_seqlens([factor * n for n in lengths], len(lengths) + 8, device)
    max_len = factor * max(lengths)
    clock = (lambda fn: timing.median_ms(fn, a.reps)) if device.type == "cuda" else \
        (lambda fn: timing.median(timing.wall_times(fn, a.reps)))
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch "
          f"{torch.__version__}; {T:,} tokens x {H} heads{' (paired)' if a.paired else ''}, {len(lengths)} "
          f"documents (cut at {a.max_doc_len}), {dtype}")
    print("| backend | window | d_qk/d_v | forward ms | forward + backward ms | vs 128/128 | native vs padded |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    g = torch.Generator(device=device).manual_seed(0)
    for backend in backends:
        for window in a.windows:
            base, padded_out = None, None
            for name, dq, dv, pad in CASES:
                if name.endswith("native") and backend not in kernels.MIXED_WIDTHS:
                    continue
                if name.endswith("native"):  # the padded case's inputs, for the check
                    q, k, v = inputs
                else:
                    q, k = (torch.randn(T, H, dq, device=device, generator=g, dtype=dtype).requires_grad_()
                            for _ in range(2))
                    v = torch.randn(T, H, dv, device=device, generator=g, dtype=dtype).requires_grad_()
                fwd = clock(layer(backend, q, k, v, cu, max_len, window, 0.13, pad, backward=False))
                both = clock(layer(backend, q, k, v, cu, max_len, window, 0.13, pad, backward=True))
                base = base or both
                check = "-"
                with torch.no_grad():
                    out = layer(backend, q, k, v, cu, max_len, window, 0.13, pad, backward=False)()
                if name.endswith("padded"):
                    inputs, padded_out = (q, k, v), out.float()
                elif name.endswith("native"):
                    check = f"{float((out.float() - padded_out).norm() / padded_out.norm()):.1e}"
                print(f"| {backend} | {window} | {name} | {fwd:.3f} | {both:.3f} | {both / base:.3f}x | {check} |",
                      flush=True)


if __name__ == "__main__":
    main()
