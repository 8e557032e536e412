"""Per-rank optimizer time of the record model, with random gradients (no training):

    torchrun --standalone --nproc_per_node=N bench/optimizer_time.py [--splits 2,4,8] [train_gpt.py flags]

For each of the N ranks, median milliseconds over --reps steps of
  - adam: DistAdam.step (reduce-scatter, update of this rank's rows, all-gather);
  - muon: Muon.step (reduce-scatter, this rank's orthogonalizations, all-gather);
  - own share: this rank's orthogonalizations alone, no communication;
so muon - own share is what the communication and bookkeeping add. Then, on rank 0 alone, the
orthogonalization time of every rank's share as it would be on each world size in --splits, one
share after another on this GPU: how evenly Muon's work would spread over that many GPUs."""
import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402


def timed(fn, reps: int, world_size: int) -> float:
    """Median ms of fn() after two untimed calls (compile, allocation), every rank starting together."""
    return timing.median(timing.wall_times(fn, reps, warmup=2, world_size=world_size))


def share_orthogonalizations(muon: tg.Muon):
    """The orthogonalizations of the matrices `muon`'s rank owns, as Muon.step runs them (batched per
    shape group)."""
    stacks = []
    for group in muon.param_groups:
        per_rank, first = muon._owned(group)
        owned = group["params"][first: first + per_rank]
        if owned:
            stacks.append(torch.stack([p.grad for p in owned]))
    return lambda: [muon.orthogonalize(g) for g in stacks]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--splits", default="2,4,8", help="world sizes to split the orthogonalizations for (on rank 0)")
    ours, rest = parser.parse_known_args()
    args = tg.parse_args(rest)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch._dynamo.config.recompile_limit = 64  # one compiled orthogonalizer per share shape of every split
    device = torch.device("cpu")  # the CPU (gloo) only to try the script out
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    model = tg.GPT(tg.ModelConfig.from_args(args)).to(device)
    orthogonalize = torch.compile(tg.anvil_orthogonalize, dynamic=False, fullgraph=True)
    adam, muon = tg.build_optimizers(model, args, rank, world_size, orthogonalize)
    torch.manual_seed(rank)  # each rank its own gradients, as after a real backward
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    mine = [timed(adam.step, ours.reps, world_size), timed(muon.step, ours.reps, world_size),
            timed(share_orthogonalizations(muon), ours.reps, world_size)]
    rows = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(rows, mine)
    else:
        rows = [mine]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"{name} x {world_size}, torch {torch.__version__}, "
              f"median of {ours.reps} steps after 2 untimed")
        print("| rank | adam step ms | muon step ms | own share's orthogonalizations ms |")
        print("| --- | --- | --- | --- |")
        for r, (a, m, o) in enumerate(rows):
            print(f"| {r} | {a:.2f} | {m:.2f} | {o:.2f} |")
        params = tg.param_groups_by_role(model)["block matrices"]
        for split in [int(w) for w in ours.splits.split(",") if w]:
            shares = [timed(share_orthogonalizations(tg.Muon(params, lr=0.0, momentum=0.0, rank=r, world_size=split, orthogonalize=orthogonalize)),
                            ours.reps, 1) for r in range(split)]
            print(f"split over {split} ranks: orthogonalization ms per rank "
                  f"{' '.join(f'{t:.2f}' for t in shares)}; busiest {max(shares):.2f}, mean {statistics.mean(shares):.2f}")
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
