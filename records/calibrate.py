#!/usr/bin/env python3
"""Pick a record's step count: seeds at a ladder of step counts, and the fewest steps predicted to pass.

    python records/calibrate.py OUT --steps S [S ...] --seeds N [--dir DIR] [--nproc_per_node N | --launch CMD]
        [--first_seed 0] [--target 3.28] [--plan_runs N] [--dry_run] [-- TRAINER FLAGS...]

Runs the training script (this repository's, or --dir's) N times, with --seed FIRST_SEED..FIRST_SEED+N-1,
at each step count (--num_iterations S), seed by seed so that an interrupted calibration is balanced;
each run is launched from the checkout with `torchrun --standalone --nproc_per_node=N` (default every
visible GPU) or --launch, and with --run_id and --log_dir so its log lands in OUT/steps_S/. Then it
reads the final validation losses (check.py's parser) and reports, per step count, the runs, mean,
sample standard deviation and the one-sided one-sample t-test p-value that the mean is below the
target (check.py's test), and from a fit of loss against steps the fewest steps predicted to pass
p < 0.01. The report is printed and written to OUT/calibration.md.

The fit: mean final loss = a + b * ln(steps), least squares over every run's final loss (the same
line as through the step counts' means weighted by their runs), with the run-to-run standard
deviation taken as the same at every step count: the pooled sample std s of the step counts with 2
or more runs. With n runs (--plan_runs, default N) a mean loss m passes p < 0.01 on average when
(target - m) / (s / sqrt(n)) reaches t, the 99% quantile of Student's t with n - 1 degrees of
freedom; the predicted step count is the fewest steps whose fitted mean is at or below
target - t * s / sqrt(n). There the t statistic's noncentrality sits at the threshold, so a new
set of n runs passes a little more than half the time (0.59 with 4 runs, 0.53 with 10; the report
gives it); the report also gives the step count where it passes 9 times in 10 (the noncentral t
distribution). Assumed: the line holds between and a little beyond the step counts run (keep the
ladder close to the answer), the std does not change with steps, and losses are normal. One step
count gives no fit: run two or more.

Resumable as interleave.py is: complete logs are not run again, a partial log is moved to
OUT/partial/ and its run run again; OUT/calibrate.json keeps the checkout, flags and launch, and a
resume with others is refused; --steps and --seeds may change. Exit status: 0 when the report is
written, 2 on a usage error, 3 when a run failed (its output is in OUT/console/), 130 on Ctrl-C.
--dry_run prints the commands in order and runs nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import check  # noqa: E402
import runner  # noqa: E402

SETTINGS = "calibrate.json"
SUMMARY = "calibration.md"
SET_BY_US = ("run_id", "log_dir", "seed", "num_iterations")
POWER = 0.9  # the second prediction: the step count where a new set passes this often


@dataclasses.dataclass
class StepStats:
    steps: int
    losses: list[float]
    mean: float
    std: float | None = None    # sample std, with 2 or more runs
    p: float | None = None      # one-sided p that the mean is below the target

    @property
    def n(self) -> int:
        return len(self.losses)


@dataclasses.dataclass
class Fit:
    a: float                    # mean loss = a + b * ln(steps)
    b: float
    sigma: float                # pooled sample std
    df: int                     # its degrees of freedom
    runs: int                   # the n of the prediction
    t_crit: float               # Student's t quantile 1 - alpha, n - 1 degrees of freedom
    loss_pass: float            # mean loss at which n runs pass on average
    loss_power: float           # mean loss at which n runs pass with probability POWER
    chance_pass: float          # the probability that n runs pass at loss_pass (a little over 1/2)
    steps_pass: int | None      # None when the loss does not fall with steps
    steps_power: int | None
    notes: list[str] = dataclasses.field(default_factory=list)

    def mean_at(self, steps: float) -> float:
        return self.a + self.b * math.log(steps)


def step_stats(by_steps: dict[int, list[float]], target: float) -> list[StepStats]:
    out = []
    for steps in sorted(by_steps):
        losses = list(by_steps[steps])
        s = StepStats(steps, losses, sum(losses) / len(losses))
        if len(losses) >= 2:
            s.std = check._sample_std(losses)
            s.p = check._one_sided_p(losses, target)[0]
        out.append(s)
    return out


def _steps_for(loss: float, a: float, b: float) -> int | None:
    """The fewest whole steps whose fitted mean a + b ln(steps) is at or below loss (b < 0)."""
    if b >= 0:
        return None
    x = (loss - a) / b
    if x > 700:  # beyond any float: no step count in reach
        return None
    steps = max(1, math.ceil(math.exp(x)))
    if steps > 1 and a + b * math.log(steps - 1) <= loss:  # exp's rounding at a whole number
        steps -= 1
    return steps


def fit_ladder(by_steps: dict[int, list[float]], target: float, runs: int,
               alpha: float = check.ALPHA) -> Fit | str:
    """The fit and the predicted step counts; a string saying why there is none."""
    from scipy import optimize, stats

    if len(by_steps) < 2:
        return "a fit needs runs at 2 or more step counts"
    if runs < 2:
        return f"a p-value needs 2 or more runs, not {runs}"
    points = [(math.log(s), y) for s, ys in by_steps.items() for y in ys]
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    a = my - b * mx
    df = sum(len(ys) - 1 for ys in by_steps.values() if len(ys) >= 2)
    if df == 0:
        return "the pooled std needs 2 or more runs at some step count"
    ss = sum((len(ys) - 1) * check._sample_std(ys) ** 2 for ys in by_steps.values() if len(ys) >= 2)
    sigma = math.sqrt(ss / df)
    t_crit = float(stats.t.ppf(1 - alpha, runs - 1))
    # noncentrality (target - mean) / (sigma / sqrt(n)) at which the test passes with probability POWER
    nc = optimize.brentq(lambda d: stats.nct.sf(t_crit, runs - 1, d) - POWER, 0.0, t_crit + 100.0, xtol=1e-10)
    se = sigma / math.sqrt(runs)
    fit = Fit(a=a, b=b, sigma=sigma, df=df, runs=runs, t_crit=t_crit, loss_pass=target - t_crit * se,
              loss_power=target - nc * se, chance_pass=float(stats.nct.sf(t_crit, runs - 1, t_crit)),
              steps_pass=_steps_for(target - t_crit * se, a, b),
              steps_power=_steps_for(target - nc * se, a, b))
    lo, hi = min(by_steps), max(by_steps)
    if b >= 0:
        fit.notes.append("the mean loss does not fall with steps over this ladder: no prediction")
    elif fit.steps_pass is None or fit.steps_power is None:
        fit.notes.append("the predicted step count is out of reach of this line: no prediction")
    elif not lo <= fit.steps_pass <= hi or not lo <= fit.steps_power <= hi:
        fit.notes.append(f"a prediction outside the ladder ({lo} to {hi} steps) is an extrapolation: run it to see")
    return fit


def _p(p: float | None) -> str:
    return check._fmt_p(p) if p is not None else "n/a"


def report(stats_: list[StepStats], fit: Fit | str, target: float, runs: Sequence[check.RunLog],
           command: str, alpha: float = check.ALPHA) -> str:
    """calibration.md: the table per step count, the fit and its predictions, the assumptions, the logs."""
    out = ["# Calibration: final validation loss against steps", "",
           f"`{command}`", "",
           f"Target: mean validation loss below {target:g} at p < {alpha:g} (one-sided one-sample t-test, as "
           "`records/check.py` tests it).", ""]
    problems = sorted({p for r in runs for p in check.record_problems(r)})
    if problems:
        out += [f"These runs are not of the record's configuration ({'; '.join(problems)}): the numbers calibrate "
                "that configuration, and check.py would not count its runs.", ""]
    out += ["| steps | runs | mean val_loss | std | p(mean < target) | passes |",
            "| ---: | ---: | ---: | ---: | ---: | --- |"]
    for s in stats_:
        passes = "n/a" if s.p is None else ("yes" if s.p < alpha else "no")
        out.append(f"| {s.steps} | {s.n} | {s.mean:.4f} | {'n/a' if s.std is None else f'{s.std:.4f}'} | "
                   f"{_p(s.p)} | {passes} |")
    out += ["", "## Fewest steps predicted to pass", ""]
    if isinstance(fit, str):
        out += [f"No prediction: {fit}.", ""]
    else:
        sign = "+" if fit.b >= 0 else "-"
        out += [f"Fit: mean val_loss = {fit.a:.5f} {sign} {abs(fit.b):.5f} * ln(steps), least squares over every run's "
                f"final loss; pooled run-to-run std s = {fit.sigma:.5f} ({fit.df} degrees of freedom).", ""]
        n = fit.runs
        if fit.steps_pass is not None and fit.steps_power is not None:
            out += [f"- **{fit.steps_pass} steps** for p < {alpha:g} with {n} runs: there the fitted mean "
                    f"({fit.mean_at(fit.steps_pass):.5f}) is at or below {target:g} - t * s / sqrt({n}) = "
                    f"{fit.loss_pass:.5f}, t = {fit.t_crit:.4f} (Student's t, {n - 1} degrees of freedom, "
                    f"{100 * (1 - alpha):g}% quantile); a new set of {n} runs passes with probability "
                    f"{fit.chance_pass:.2f} (the noncentral t distribution).",
                    f"- **{fit.steps_power} steps** for a {100 * POWER:g}% chance that a new set of {n} runs passes: "
                    f"fitted mean {fit.mean_at(fit.steps_power):.5f} at or below {fit.loss_power:.5f} "
                    "(the noncentral t distribution)."]
        out += [f"- {note}" for note in fit.notes]
        out += ["", "Assumed: the mean loss is linear in ln(steps) between and a little beyond the step counts run, "
                "the run-to-run std is the same at every step count (the pooled s), and the losses are normal; "
                "the prediction is only as good as the ladder is close to it."]
    out += ["", "## Runs", "", "| steps | seed | val_loss | train_time_s | log |",
            "| ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        out.append(f"| {r.total_steps} | {r.params.get('seed', '?')} | {r.final_loss:.4f} | {r.final_time_s:.3f} | "
                   f"{r.path.parent.name}/{r.path.name} |")
    return "\n".join(out) + "\n"


def plan(out: Path, steps: Sequence[int], seeds: Sequence[int], folder: Path, script: str,
         shared: list[str]) -> list[runner.Run]:
    """Seed by seed, each seed at every step count."""
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", out.resolve().name) or "calibrate"
    return [runner.Run(label=f"{s} steps, seed {seed}", run_id=f"{tag}-steps{s}-seed{seed}", cwd=folder,
                       script=script, flags=[*shared, "--num_iterations", str(s), "--seed", str(seed)],
                       log_dir=out / f"steps_{s}")
            for seed in seeds for s in steps]


def _steps(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step counts such as 1500 or 1500,1600, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive step counts, not {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    return check.run_cli("calibrate.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ours, shared = runner.split_trainer_flags(argv)
    ap = runner.tool_parser(
        "calibrate.py", __doc__,
        "python records/calibrate.py OUT --steps S [S ...] --seeds N [options] [-- TRAINER FLAGS...]",
        "examples:\n"
        "  python records/calibrate.py logs/cal --steps 740 760 780 --seeds 4 --dry_run\n"
        "  python records/calibrate.py logs/cal --steps 740,760,780 --seeds 4 --plan_runs 10\n"
        "  python records/calibrate.py logs/cal-smoke --steps 100 150 --seeds 2 --nproc_per_node 1 "
        "-- --preset smoke")
    ap.add_argument("out", metavar="OUT", type=Path,
                    help="the folder of the runs: OUT/steps_S/ get the logs, OUT/calibration.md the report (created)")
    ap.add_argument("--steps", type=_steps, nargs="+", required=True, metavar="S",
                    help="step counts (--num_iterations), space- or comma-separated")
    ap.add_argument("--seeds", type=int, required=True, metavar="N", help="runs per step count")
    ap.add_argument("--first_seed", type=int, default=0, help="seeds FIRST_SEED.. (default %(default)s)")
    ap.add_argument("--dir", type=Path, default=runner.REPO, metavar="DIR",
                    help="the checkout to run (default: this repository)")
    ap.add_argument("--script", default="train_gpt.py", help="the training script in it (default %(default)s)")
    ap.add_argument("--target", type=float, default=check.DEFAULT_TARGET,
                    help="validation loss to pass (default %(default)s)")
    ap.add_argument("--plan_runs", type=int, default=None, metavar="N",
                    help="runs the record will have, for the prediction (default: --seeds)")
    args = ap.parse_args(ours)

    steps = sorted({s for group in args.steps for s in group})
    if args.seeds < 1:
        raise check.UsageError(f"--seeds {args.seeds}: give 1 or more (2 or more for a p-value)")
    plan_runs = args.plan_runs if args.plan_runs is not None else args.seeds
    if plan_runs < 2:
        raise check.UsageError(f"--plan_runs {plan_runs}: a p-value needs 2 or more runs (give --plan_runs or "
                               "--seeds of 2 or more)")
    runner.refuse_flags(shared, SET_BY_US, "the flags after --", "calibrate.py")
    if not (args.dir / args.script).is_file():
        raise check.UsageError(f"{args.dir / args.script}: no such file: --dir must be a checkout holding "
                               f"{args.script} (or name the script with --script)")
    prefix = runner.launch_prefix(args.launch, args.nproc_per_node)
    if not args.dry_run:
        runner.require_launcher(prefix)
    out: Path = args.out
    folder = args.dir.resolve()
    runner.check_settings(out, SETTINGS, dict(tool="calibrate.py", dir=str(folder), script=args.script,
                                              shared_flags=shared, launch=prefix, steps=steps, seeds=args.seeds,
                                              first_seed=args.first_seed),
                          ("dir", "script", "shared_flags", "launch"), "calibrate.py", args.dry_run)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs = plan(out, steps, seeds, folder, args.script, shared)
    runner.refuse_foreign_logs(runs, sorted({r.log_dir for r in runs} | set(out.glob("steps_*"))),
                               "other --steps or --seeds than given now?")
    print(f"calibrate.py: {args.seeds} seed(s) at {len(steps)} step count(s) ({', '.join(map(str, steps))}), "
          f"{len(runs)} runs into {out}" + (" (dry run: the commands, in order)" if args.dry_run else ""))
    try:
        logs = runner.execute(runs, prefix, out, args.dry_run)
    except runner.RunFailed as e:
        print(f"calibrate.py: error: {e}", file=sys.stderr)
        return runner.FAILED
    if args.dry_run:
        return 0

    sets = check.pool_sets(logs)
    if len(sets) > 1:
        versions = "; ".join(name for name, _ in sets)
        raise check.UsageError(f"the logs in {out} are of {len(sets)} versions ({versions}), "
                               "never pooled: calibrate one version of the code on one GPU count per folder")
    for log in logs:
        want = int(log.path.parent.name.removeprefix("steps_"))
        if log.total_steps != want:
            raise check.UsageError(f"{log.path}: ran {log.total_steps} steps, not {want}: does {args.script} take "
                                   "--num_iterations? (move the log out and run again)")
    by_steps: dict[int, list[float]] = {}
    for log in logs:
        by_steps.setdefault(log.total_steps, []).append(log.final_loss)
    text = report(step_stats(by_steps, args.target), fit_ladder(by_steps, args.target, plan_runs), args.target,
                  logs, runner.command_line("calibrate.py", argv if argv is not None else sys.argv[1:]))
    (out / SUMMARY).write_text(text)
    print("")
    print(text, end="")
    print(f"(written to {out / SUMMARY})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
