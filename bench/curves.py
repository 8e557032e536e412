"""Two or more train_gpt.py logs side by side, step for step: the per-step train loss (every rank's
tokens: the `train_loss per step` line a finished run writes) and the validation losses, with each
log's difference from the first.

    python bench/curves.py logs/one.txt logs/two.txt [--every 5]
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "records"))
import logparse  # noqa: E402  (records/logparse.py: the log's lines)


def read(path: str) -> tuple[dict[int, float], dict[int, float]]:
    text = open(path).read()
    train = logparse.train_curve(text)
    if train is None:
        sys.exit(f"curves.py: error: {path} has no 'train_loss per step' line (an unfinished run, or a log "
                 "written before train_gpt.py logged it)")
    val = {s: v for s, (v, _, _) in logparse.val_losses(text).items() if not math.isnan(v)}  # a nan is no point
    return train, val


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--every", type=int, default=5, help="print every N-th step of the train curve")
    args = parser.parse_args()
    if len(args.logs) < 2:
        sys.exit("curves.py: error: give two logs or more")
    runs = [read(p) for p in args.logs]
    names = [p.rsplit("/", 1)[-1].removesuffix(".txt") for p in args.logs]
    steps = sorted(set.intersection(*(set(train) for train, _ in runs)))
    head = " | ".join(names[:1] + [f"{n} | diff" for n in names[1:]])
    print(f"| step | {head} |\n|" + " --- |" * (2 * len(names)))
    for s in steps:
        if s % args.every == 0 or s == steps[0]:
            base = runs[0][0][s]
            cells = [f"{base:.4f}"] + [f"{r[0][s]:.4f} | {r[0][s] - base:+.4f}" for r in runs[1:]]
            print(f"| {s} | {' | '.join(cells)} |")
    for name, (train, val) in zip(names[1:], runs[1:]):
        diffs = [abs(train[s] - runs[0][0][s]) for s in steps]
        print(f"{name} - {names[0]}, train loss over steps {steps[0]}-{steps[-1]}: max |diff| {max(diffs):.4f}, "
              f"mean |diff| {sum(diffs) / len(diffs):.4f}")
        shared = sorted(set(val) & set(runs[0][1]))
        print(f"{name} - {names[0]}, val loss: " + ", ".join(f"step {s} {val[s] - runs[0][1][s]:+.4f}" for s in shared))


if __name__ == "__main__":
    main()
