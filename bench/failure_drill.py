"""Failure drill on GPUs: train_gpt.py under torchrun, with the last rank alone meeting a failure
before its step number STEP (1-based, as the log counts):

    torchrun --standalone --nproc_per_node=2 bench/failure_drill.py {nan,hang,exit} STEP [train_gpt.py flags]

  nan:  that rank's loss of step STEP becomes NaN (the others stay finite): every rank must stop
        after step STEP with one message naming the rank, the last good checkpoint kept.
  hang: that rank sleeps for an hour instead of step STEP: the others must fail within about
        twice --collective_timeout_s (NCCL's watchdog, then its heartbeat monitor), not wait.
  exit: that rank's process dies instead of step STEP: the others must fail, not wait.
Each rank's stderr goes to the console; exit status is main()'s (torchrun reports the first failure)."""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("failure", choices=("nan", "hang", "exit"))
    parser.add_argument("at", type=int, metavar="STEP")
    parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="train_gpt.py flags")
    cli = parser.parse_args()
    failure, at, argv = cli.failure, cli.at, cli.argv
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == world_size - 1:
        train_step = tg.train_step

        def failing(model, compiled, optimizers, micro, step, stage, schedule, ahead=None):
            if step + 1 == at:
                print(f"failure_drill: rank {rank}: {failure} at step {at}", file=sys.stderr, flush=True)
                if failure == "exit":
                    os._exit(3)
                if failure == "hang":
                    time.sleep(3600)
            loss = train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead)
            return loss * float("nan") if step + 1 == at else loss
        tg.train_step = failing
    return tg.main(argv)


if __name__ == "__main__":
    sys.exit(main())
