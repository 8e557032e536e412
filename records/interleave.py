#!/usr/bin/env python3
"""Time two versions of the training script on one node, alternately, into a record folder.

    python records/interleave.py OUT --pairs N [--baseline_dir DIR] [--candidate_dir DIR]
        [--baseline_flags "FLAGS"] [--candidate_flags "FLAGS"] [--nproc_per_node N | --launch CMD]
        [--first_seed 0] [--target 3.28] [--any_config] [--dry_run] [-- FLAGS FOR BOTH...]

The baseline (the current record's code) and the candidate (yours) are two checkouts
(--baseline_dir, --candidate_dir; each defaults to this repository) or one checkout with two flag
sets (--baseline_flags, --candidate_flags), or both. They run alternately, A B B A A B ..., N pairs,
so that a node that warms up or slows down over the session weighs on both alike. Every run gets the
flags after `--` (the data flags, so both read the same files: a relative path is taken from each
checkout's folder, so give absolute ones when there are two) and pair i's seed, --seed FIRST_SEED+i,
the same for both versions; each is launched from its checkout's folder with
`torchrun --standalone --nproc_per_node=N` (N: --nproc_per_node, default every visible GPU) or with
--launch, and with --run_id and --log_dir so its log lands in OUT/baseline/ or OUT/candidate/, the
layout check.py compares. The runs' console output goes to OUT/console/.

Resumable: run the same command again and runs whose logs are complete (check.py reads the final
validation line, and the trainer's closing line `finished at step T/T` follows) are not run again;
a partial log (a crash, Ctrl-C) is moved to OUT/partial/ and that run is run again under a new id
(ID-try2). OUT/interleave.json keeps the settings: a resume with other versions, flags or launch is
refused, and so is a folder holding logs that are not runs of this plan; --pairs may grow.

At the end it runs check.py's comparison on OUT and exits with its status: 0 when the candidate is
a record (its mean loss below the target at p < 0.01, and the 99% interval of its time minus the
baseline's below zero), 1 when not, 2 when the runs cannot be compared or on a usage error; 3 when
a run failed (its output is in OUT/console/); 130 on Ctrl-C. --dry_run prints the commands in
order and runs nothing.
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import check  # noqa: E402
import runner  # noqa: E402

SETTINGS = "interleave.json"
SIDES = ("baseline", "candidate")  # new.py's and check.py's names for the two sets
SET_BY_US = ("run_id", "log_dir", "seed")


@contextlib.contextmanager
def any_config(enabled: bool):
    """With --any_config, check.py counts runs of any configuration (a rehearsal on the smoke preset,
    say): its record_problems is replaced for the comparison's duration."""
    if not enabled:
        yield
        return
    saved = check.record_problems
    check.record_problems = lambda run: []
    try:
        yield
    finally:
        check.record_problems = saved


def plan(out: Path, pairs: int, versions: dict[str, dict], shared: list[str], first_seed: int) -> list[runner.Run]:
    """The runs in order: pair i runs baseline then candidate when i is even, the other way when odd."""
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", out.resolve().name) or "interleave"
    runs = []
    for i in range(pairs):
        seed = first_seed + i
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            v = versions[side]
            runs.append(runner.Run(label=f"pair {i + 1} {side} (seed {seed})", run_id=f"{tag}-{side}-{i + 1:02d}",
                                   cwd=Path(v["dir"]), script=v["script"],
                                   flags=[*shared, *v["flags"], "--seed", str(seed)], log_dir=out / side))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    return check.run_cli("interleave.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ours, shared = runner.split_trainer_flags(argv)
    ap = runner.tool_parser(
        "interleave.py", __doc__,
        "python records/interleave.py OUT --pairs N [options] [-- FLAGS FOR BOTH VERSIONS...]",
        "examples:\n"
        "  python records/interleave.py logs/ab --pairs 10 --baseline_dir ../speedrun-record "
        "--dry_run\n"
        "  python records/interleave.py logs/flag --pairs 5 --candidate_flags '--fused_mlp false' "
        "-- --train_files \"$PWD/data/fineweb10B/fineweb_train_*.bin\"\n"
        "  python records/interleave.py logs/rehearsal --pairs 2 --nproc_per_node 1 --any_config --target 6 "
        "--baseline_flags '--num_iterations 150' --candidate_flags '--num_iterations 140' -- --preset smoke\n"
        "then: python records/new.py NAME OUT/candidate --baseline OUT/baseline")
    ap.add_argument("out", metavar="OUT", type=Path,
                    help="the folder of the runs: OUT/baseline/ and OUT/candidate/ get the logs (created)")
    ap.add_argument("--pairs", type=int, required=True, metavar="N",
                    help="runs of each version (10 or more for a record)")
    ap.add_argument("--baseline_dir", type=Path, default=runner.REPO, metavar="DIR",
                    help="checkout of the baseline (default: this repository)")
    ap.add_argument("--candidate_dir", type=Path, default=runner.REPO, metavar="DIR",
                    help="checkout of the candidate (default: this repository)")
    ap.add_argument("--baseline_flags", default="", metavar="FLAGS",
                    help="trainer flags for the baseline only, one quoted string")
    ap.add_argument("--candidate_flags", default="", metavar="FLAGS",
                    help="trainer flags for the candidate only, one quoted string")
    ap.add_argument("--script", default="train_gpt.py",
                    help="the training script in each checkout (default %(default)s)")
    ap.add_argument("--first_seed", type=int, default=0,
                    help="pair i runs with --seed FIRST_SEED+i in both versions (default %(default)s)")
    ap.add_argument("--target", type=float, default=check.DEFAULT_TARGET,
                    help="validation loss the comparison tests against (default %(default)s)")
    ap.add_argument("--any_config", action="store_true",
                    help="compare runs of any configuration (e.g. a rehearsal on --preset smoke), which check.py "
                         "otherwise leaves out; such a comparison is no record")
    args = ap.parse_args(ours)

    if args.pairs < 1:
        raise check.UsageError(f"--pairs {args.pairs}: give 1 or more (10 or more for a record)")
    runner.refuse_flags(shared, SET_BY_US, "the flags after --", "interleave.py")
    versions = {}
    for side in SIDES:
        folder, flags = getattr(args, f"{side}_dir"), shlex.split(getattr(args, f"{side}_flags"))
        runner.refuse_flags(flags, SET_BY_US, f"--{side}_flags", "interleave.py")
        if not (folder / args.script).is_file():
            raise check.UsageError(f"{folder / args.script}: no such file: --{side}_dir must be a checkout holding "
                                   f"{args.script} (or name the script with --script)")
        versions[side] = dict(dir=str(folder.resolve()), script=args.script, flags=flags)
    if versions["baseline"] == versions["candidate"]:
        raise check.UsageError("the baseline and the candidate are the same checkout with the same flags: give "
                               "--baseline_dir/--candidate_dir or --baseline_flags/--candidate_flags")
    prefix = runner.launch_prefix(args.launch, args.nproc_per_node)
    if not args.dry_run:
        runner.require_launcher(prefix)

    out: Path = args.out
    runner.check_settings(out, SETTINGS, dict(tool="interleave.py", **versions, shared_flags=shared, launch=prefix,
                                              first_seed=args.first_seed, pairs=args.pairs),
                          ("baseline", "candidate", "shared_flags", "launch", "first_seed"), "interleave.py",
                          args.dry_run)
    runs = plan(out, args.pairs, versions, shared, args.first_seed)
    runner.refuse_foreign_logs(runs, [out / side for side in SIDES], f"--pairs {args.pairs}: a run of a later pair?")
    print(f"interleave.py: {args.pairs} pair(s), {len(runs)} runs into {out}/baseline and {out}/candidate"
          + (" (dry run: the commands, in order)" if args.dry_run else ""))
    try:
        runner.execute(runs, prefix, out, args.dry_run)
    except runner.RunFailed as e:
        print(f"interleave.py: error: {e}", file=sys.stderr)
        return runner.FAILED

    compare = [str(out), "--target", f"{args.target:g}"]
    if args.dry_run:
        shown = os.path.relpath(HERE / "check.py")
        print(f"python {shown if not shown.startswith('..') else HERE / 'check.py'} {shlex.join(compare)}"
              + ("  # with --any_config: runs of any configuration counted" if args.any_config else ""))
        return 0
    print("")
    if args.any_config:
        print("--any_config: runs of any configuration are compared (a rehearsal: no record)")
    with any_config(args.any_config):
        code = check.main(compare)
    if code == 0 and not args.any_config:
        print(f"next: python records/new.py NAME {out / 'candidate'} --baseline {out / 'baseline'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
