"""What the padded entries of cu_seqlens cost FlashAttention-3 at the record's micro-batch. cu_seqlens is padded
to max_num_docs + 1 entries (empty sequences at the end) so shapes stay static; FA3's backward launches thread
blocks for every sequence slot, empty or not (its forward schedules only the real ones). This times forward and
backward of the record's attention layers (long and short windows, paired heads) at several paddings, on
micro-batches whose documents come from real shards (--train_files) or from a long-tailed synthetic
distribution, and prints how many documents the shards' micro-batches hold (the smallest safe max_num_docs).

    python bench/fa3_padding.py [--train_files "data/fineweb10B/fineweb_train_*.bin"] [--seq_len 49152]

Needs a Hopper GPU and torch.ops.flash_attn_3 (README: Hopper attention); --count_only runs on the CPU."""
import argparse
import glob
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402  (the FA3 loader)
import train_gpt as tg  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)


def doc_counts(files: list[str], seq_len: int, max_doc_len: int, slots: int,
               bos_id: int = tg.BOS_ID) -> list[list[int]]:
    """The lengths of the pieces (documents cut at max_doc_len) of the first `slots` micro-batches of seq_len
    tokens the training loader would cut from these shards."""
    stream = tg.TokenStream(files, bos_id, wrap=True, log=lambda *a: None)
    return [[b - a for _, a, b in stream.take(seq_len, max_doc_len)] for _ in range(slots)]


def synthetic(seq_len: int, max_doc_len: int, mean: int = 1000, seed: int = 0) -> list[int]:
    """Document lengths of one micro-batch: exponential (about FineWeb's mean), cut at max_doc_len."""
    rng, out = np.random.default_rng(seed), []
    while sum(out) < seq_len:
        out.append(min(int(rng.exponential(mean)) + 1, max_doc_len, seq_len - sum(out)))
    return out


def cu_seqlens(lengths: list[int], slots: int, device) -> torch.Tensor:
    """cu_seqlens of these documents padded with empty sequences to `slots` sequences (as train_gpt.assemble)."""
    cu = np.full(slots + 1, sum(lengths), dtype=np.int32)
    cu[: len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
    return torch.tensor(cu, device=device)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train_files", default="", help="token shards to take document lengths from (default: synthetic)")
    p.add_argument("--seq_len", type=int, default=49152, help="tokens per micro-batch")
    p.add_argument("--max_doc_len", type=int, default=2048)
    p.add_argument("--windows", type=int, nargs=2, default=[1408, 640], help="long and short window, in tokens")
    p.add_argument("--paddings", type=int, nargs="+", default=[0, 64, 96, 128, 256],
                   help="sequence slots (max_num_docs); 0: exactly the documents of the micro-batch")
    p.add_argument("--slots", type=int, default=2000, help="micro-batches counted for the document statistics")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--bos_id", type=int, default=tg.BOS_ID, help="the token that starts every document")
    p.add_argument("--count_only", action="store_true", help="only the document statistics (no GPU needed)")
    a = p.parse_args()
    if a.train_files:
        files = sorted(glob.glob(a.train_files))
        if not files:
            raise SystemExit(f"fa3_padding.py: error: no shard matches --train_files {a.train_files!r}")
        counts = doc_counts(files, a.seq_len, a.max_doc_len, a.slots, a.bos_id)
        n = np.array([len(c) for c in counts])
        print(f"documents per micro-batch of {a.seq_len:,} tokens (cut at {a.max_doc_len}) over {len(n)} micro-batches "
              f"of {len(files)} shard(s): mean {n.mean():.1f}, p99 {np.percentile(n, 99):.0f}, "
              f"p99.9 {np.percentile(n, 99.9):.0f}, max {n.max()}")
        lengths = counts[int(np.argsort(n)[len(n) // 2])]  # a median micro-batch
    else:
        lengths = synthetic(a.seq_len, a.max_doc_len)
        print(f"synthetic documents (exponential, mean 1000, cut at {a.max_doc_len}): "
              f"{len(lengths)} in the micro-batch")
    if a.count_only:
        return
    if not kernels._load_fa3():
        raise SystemExit("fa3_padding.py: error: torch.ops.flash_attn_3 is not installed (README: Hopper attention)")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"timed micro-batch: {len(lengths)} documents")
    dev, H, D = "cuda", 6, 128
    # the record's attention layers (train_gpt.Hyperparameters: window_pattern, paired_head_blocks, no_attn_layers,
    # skip_layers): long-window ones, short-window ones, short-window ones with paired heads (tokens x 2, heads / 2);
    # 2, 4 and 4 before ANVIL2's layout, 2, 2 and 3 in it
    h = tg.Hyperparameters()
    attn = [i for i in range(h.num_layers) if i not in h.no_attn_layers + h.skip_layers]
    n_long, n_paired = sum(h.window_pattern[i] == "L" for i in attn), len(h.paired_head_blocks)
    layers = [("long", a.windows[0], False, n_long), ("short", a.windows[1], False, len(attn) - n_long - n_paired),
              ("short, paired", a.windows[1], True, n_paired)]

    def run(cu, max_len, window, dout, q, k, v, backward=True):
        out, lse = torch.ops.flash_attn_3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                              max_seqlen_k=max_len, softmax_scale=0.12, is_causal=True,
                                              window_size_left=window, window_size_right=0)[:2]
        if backward:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=max_len, max_seqlen_k=max_len, softmax_scale=0.12,
                                       is_causal=True, window_size_left=window, window_size_right=0)
        return out

    header = " | ".join(f"{name} fwd / fwd+bwd (ms)" for name, *_ in layers)
    print(f"| sequence slots | {header} | all layers, ms per micro-batch | vs exact |")
    print("|" + " --- |" * (len(layers) + 3))
    exact = None
    for slots in a.paddings:
        slots = slots or len(lengths)
        if slots < len(lengths):
            print(f"| {slots} | (fewer slots than the micro-batch's {len(lengths)} documents) |")
            continue
        cells, total = [], 0.0
        for name, window, paired, count in layers:
            T, heads, scale = (2 * a.seq_len, H // 2, 2) if paired else (a.seq_len, H, 1)
            q, k, v, dout = (torch.randn(T, heads, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
            cu = cu_seqlens([scale * n for n in lengths], slots, dev)
            f = timing.median_ms(lambda: run(cu, scale * a.max_doc_len, window, dout, q, k, v, backward=False), a.reps)
            fb = timing.median_ms(lambda: run(cu, scale * a.max_doc_len, window, dout, q, k, v), a.reps)
            cells.append(f"{f:.3f} / {fb:.3f}")
            total += count * fb
        exact = exact or total
        print(f"| {slots} | {' | '.join(cells)} | {total:.2f} | {total - exact:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
