"""The n-gram table's per-row gradient sums and row-sparse Adam step, eager against compiled (build()'s twins), at the
record's one-GPU size: an Adam step every 2 steps of 393,216 tokens x 2 channels = 1,572,864 logged lookups into a
5,000,000-row table, ~600K distinct rows.

    python bench/ngram_row_ops.py

Prints the milliseconds per call (CUDA events, mean of 5 after one warm call) and the largest differences."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402

DIM, ROWS, LOOKUPS, DISTINCT = 768, 5_000_000, 1_572_864, 600_000


def timed(fn, reps: int = 5):
    """(ms per call, the last output) after one untimed call (the compile)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        out = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, out


def main():
    if not torch.cuda.is_available():
        sys.exit("bench/ngram_row_ops.py times CUDA kernels: run it on a GPU machine")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    table = (torch.randn(ROWS, DIM, device=dev, generator=g) * 0.01).bfloat16()
    rows = torch.randint(0, ROWS, (DISTINCT,), device=dev, generator=g).unique()
    inverse = torch.randint(0, rows.numel(), (LOOKUPS,), device=dev, generator=g)
    logged = torch.randn(LOOKUPS, DIM, device=dev, generator=g).bfloat16()
    segment = torch.compile(tg.segment_sum, dynamic=True, fullgraph=True)  # as build() does
    row_update = torch.compile(tg.row_adam_update, dynamic=True, fullgraph=True)
    t0 = time.time()
    ms_eager, sums = timed(lambda: tg.segment_sum(inverse, logged, rows.numel()))
    ms_comp, sums_c = timed(lambda: segment(inverse, logged, rows.numel()))
    print(f"segment_sum: eager {ms_eager:.2f} ms, compiled {ms_comp:.2f} ms, max |diff| "
          f"{(sums - sums_c).abs().max().item():.2e} (compile + runs {time.time() - t0:.0f}s)", flush=True)
    eager_p, comp_p, eager_s, comp_s = table.clone(), table.clone(), {}, {}
    t0 = time.time()
    ms_eager, _ = timed(lambda: tg.row_sparse_adam(eager_p, rows, sums, eager_s, 0.01, 0.95, 1e-10, 5.0))
    ms_comp, _ = timed(lambda: tg.row_sparse_adam(comp_p, rows, sums, comp_s, 0.01, 0.95, 1e-10, 5.0,
                                                  update=row_update))
    dp = (eager_p.float() - comp_p.float()).abs().max().item()
    dv = (eager_s["exp_avg_sq"] - comp_s["exp_avg_sq"]).abs().max().item()
    print(f"row_sparse_adam: eager {ms_eager:.2f} ms, compiled {ms_comp:.2f} ms, max |dp| {dp:.2e}, max |dv| {dv:.2e} "
          f"(compile + runs {time.time() - t0:.0f}s); peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
