"""How many of the head's rows the sampled softmax must hold per micro-batch (train_gpt.py's Stage.candidates):
the distinct ids its loss reads (targets, multi-token prediction's, the prefix tokens, CPLM's copy column), counted
as train_gpt.sampled_head gathers them, over the first --steps steps of the training stream at each stage's
micro-batch shape. More distinct ids than candidates stops a run (a device assert), so a stage's count needs
headroom over the largest seen. CPU only, seconds; reads the shards as the run's loader cuts them.

    python bench/candidate_headroom.py [--steps 50] [train_gpt.py flags, e.g. --preset record
        --candidates_schedule 10240,14336,24576 --train_files "DATA/fineweb_train_*.bin"]
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402


def distinct_ids(y: np.ndarray, mtp: int, prefix: np.ndarray | None, column: int | None) -> int:
    """The ids sampled_head would make candidates for one micro-batch's targets y."""
    ids = [y] + ([np.zeros(1, y.dtype)] if mtp else [])  # multi-token prediction's padding reads row 0
    if prefix is not None:
        ids.append(np.maximum(prefix[y], 0))  # an absent prefix reads row 0 at weight 0
    if column is not None:
        ids.append(np.array([column]))
    return len(np.unique(np.concatenate(ids)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps of each stage's shape counted (from the start)")
    own, rest = parser.parse_known_args(argv)
    args = tg.parse_args([*rest, "--max_num_docs", "4096"])  # cu_seqlens' padding: no data scan needed
    schedule, files = tg.Schedule(args), tg.shard_files(args.train_files, "training")
    prefix = None
    if any(any(st.prefix_ramp) for st in schedule.stages):
        prefix = tg.prefix_table(tg.gpt2_token_bytes(), args.vocab_size).numpy()
    column = args.bos_id + 1 if args.cplm_bands else None
    print(f"--preset {args.preset}: distinct ids per micro-batch over {own.steps} steps of each stage's shape")
    print(f"{'stage':>5}  {'micro tokens':>12}  {'doc cut':>7}  {'mean':>7}  {'p99':>7}  {'max':>7}  "
          f"{'candidates':>10}  {'headroom':>8}")
    for i, st in enumerate(schedule.stages, start=1):
        spec = tg.dataclasses.replace(st.spec, num_docs=args.max_num_docs)
        producer = tg.BatchProducer(files, 0, 1, args.bos_id, log=lambda msg: None)
        counts = [distinct_ids(y, len(st.mtp_ramp), prefix if any(st.prefix_ramp) else None, column)
                  for _ in range(own.steps) for _, y, _ in producer.step(spec)]
        top, cand = max(counts), st.candidates
        room = f"{(cand - top) / cand:.0%}" if cand else "-"
        print(f"{i:>5}  {spec.seq_len:>12,}  {spec.max_doc_len:>7,}  {np.mean(counts):>7.0f}  "
              f"{np.percentile(counts, 99):>7.0f}  {top:>7,}  {cand or 'full':>10}  {room:>8}")


if __name__ == "__main__":
    main()
