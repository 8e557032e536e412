"""Data pipeline speed on this machine: BOS indexing of a 100M-token shard, and the rate at which one
rank's micro-batches are produced (the work of the loader's background thread).

    python bench/data_loader.py [--tokens 100000000] [--mean_doc_len 1000]

The shard is synthetic: documents with exponentially distributed lengths (mean ~1000 tokens, about
FineWeb's), written with train_gpt.write_shard into a temporary folder."""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000_000)
    parser.add_argument("--mean_doc_len", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50000, size=args.tokens, dtype=np.uint16)
    starts = np.cumsum(rng.exponential(args.mean_doc_len, size=2 * args.tokens // args.mean_doc_len).astype(np.int64) + 1)
    tokens[starts[starts < args.tokens]] = tg.BOS_ID
    tokens[0] = tg.BOS_ID
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fineweb_train_000001.bin"
        tg.write_shard(path, tokens)
        del tokens
        times = []
        for _ in range(3):
            t = time.perf_counter()
            stream = tg.TokenStream([str(path)], tg.BOS_ID, wrap=True)  # load + validate + index BOS
            times.append(time.perf_counter() - t)
        print(f"load + BOS index of a {args.tokens / 1e6:.0f}M-token shard: median {statistics.median(times):.3f} s "
              f"({stream.bos.size:,} documents)")
        spec = tg.BatchSpec(batch_size=8 * 49152, seq_len=49152, max_doc_len=2048, num_docs=256)
        print("| world size | micro-batches per rank per step | step production (ms) | tokens/s per rank |")
        print("| --- | --- | --- | --- |")
        for world_size in (1, 8):
            producer = tg.BatchProducer([str(path)], 0, world_size, tg.BOS_ID)
            step_times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                micro = producer.step(spec)
                step_times.append(time.perf_counter() - t)
            per_rank_tokens = sum(m[0].size for m in micro)
            med = statistics.median(step_times)
            print(f"| {world_size} | {len(micro)} | {med * 1e3:.2f} | {per_rank_tokens / med / 1e6:.1f}M |")


if __name__ == "__main__":
    main()
