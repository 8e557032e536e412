"""Failure drill on GPUs: train_gpt.py under torchrun, with the last rank alone meeting a failure
before its step number STEP (1-based, as the log counts):

    torchrun --standalone --nproc_per_node=2 bench/failure_drill.py {nan,hang,exit} STEP [train_gpt.py flags]

  nan:  that rank's loss of step STEP becomes NaN (the others stay finite): every rank must stop
        after step STEP with one message naming the rank, the last good checkpoint kept.
  hang: that rank sleeps for an hour instead of step STEP: the others must fail within about
        twice --collective_timeout_s (NCCL's watchdog, then its heartbeat monitor), not wait.
  exit: that rank's process dies instead of step STEP: the others must fail, not wait.
Each rank's stderr goes to the console; exit status is main()'s (torchrun reports the first failure)."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_gpt as tg  # noqa: E402


def main() -> int:
    failure, at, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if failure not in ("nan", "hang", "exit"):
        sys.exit(f"failure_drill.py: error: {failure!r}: choose nan, hang or exit")
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if rank == world_size - 1:
        train_step = tg.train_step

        def failing(model, compiled, optimizers, micro, step, stage, args):
            if step + 1 == at:
                print(f"failure_drill: rank {rank}: {failure} at step {at}", file=sys.stderr, flush=True)
                if failure == "exit":
                    os._exit(3)
                if failure == "hang":
                    time.sleep(3600)
            loss = train_step(model, compiled, optimizers, micro, step, stage, args)
            return loss * float("nan") if step + 1 == at else loss
        tg.train_step = failing
    return tg.main(argv)


if __name__ == "__main__":
    sys.exit(main())
