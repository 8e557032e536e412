"""FlashAttention-3's forward with its split-KV heuristic (num_splits=0, what torch.ops.flash_attn_3.fwd does
when the argument is left out) against one split (num_splits=1, the default of FA3's own Python
interface), at the record's micro-batch: forward and forward + backward times and the largest output
difference.

    python bench/fa3_num_splits.py [--tokens 49152] [--windows 640 1408] [--max_doc_len 2048]

Needs a Hopper GPU and torch.ops.flash_attn_3 (README: Hopper attention)."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402  (the FA3 loader)
import timing  # noqa: E402  (bench/timing.py)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--windows", type=int, nargs="+", default=[640, 1408])
    p.add_argument("--max_doc_len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    if not kernels._load_fa3():
        raise SystemExit("fa3_num_splits.py: error: torch.ops.flash_attn_3 is not installed (README: Hopper attention)")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    g = torch.Generator().manual_seed(0)
    lengths, total = [], 0  # document lengths as in training: long-tailed, cut at max_doc_len
    while total < a.tokens:
        n = min(int(torch.empty(1).exponential_(1 / 600, generator=g)) + 1, a.max_doc_len, a.tokens - total)
        lengths.append(n)
        total += n
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(a.tokens, a.heads, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(a.tokens, a.heads, 128, device="cuda", dtype=torch.bfloat16)

    def fwd(window, splits):
        return torch.ops.flash_attn_3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=a.max_doc_len,
                                          max_seqlen_k=a.max_doc_len, softmax_scale=0.12, is_causal=True,
                                          window_size_left=window, window_size_right=0,
                                          **({} if splits is None else dict(num_splits=splits)))[:2]

    def both(window, splits):
        out, lse = fwd(window, splits)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=a.max_doc_len, max_seqlen_k=a.max_doc_len, softmax_scale=0.12,
                                   is_causal=True, window_size_left=window, window_size_right=0)

    print(f"{len(lengths)} documents in {a.tokens:,} tokens, {a.heads} heads of 128")
    print("| window | num_splits | forward (ms) | forward + backward (ms) | max |out - out(num_splits=1)| |")
    print("| --- | --- | --- | --- | --- |")
    for w in a.windows:
        ref = fwd(w, 1)[0].float()
        for splits in (None, 0, 1):
            diff = (fwd(w, splits)[0].float() - ref).abs().max().item()
            name = "left out" if splits is None else str(splits)
            f, fb = timing.median_ms(lambda: fwd(w, splits), a.reps), timing.median_ms(lambda: both(w, splits), a.reps)
            print(f"| {w} | {name} | {f:.3f} | {fb:.3f} | "
                  f"{diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
