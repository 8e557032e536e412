#!/usr/bin/env python3
"""Create a record folder from run logs: records/<YYYY-MM-DD>_<NAME>/.

    python records/new.py NAME LOG_OR_DIR... [--baseline LOG_OR_DIR...] [--time-claim SECONDS] [--force]

Copies the logs into the folder, draws val_loss.png (plot.py), writes statistics.md in the public
speedrun's format (losses, times, the calculation as a scipy snippet, and with --baseline the
comparison) and README.md with the check.py table and a link to the plot. With --baseline (the
previous record's code run on the same node) the logs go to baseline/ and candidate/, and the
check is the comparison: the candidate's loss at p < 0.01 and its time below the baseline's with
the 99% interval below zero. Refuses, creating nothing (exit 1), when

  * the folder already exists (--force does not change this),
  * the logs (of each set) were not made by the same code (the part of each log before its
    first line of 100 '='), or a log has no code section, or they ran on different GPU counts,
  * check.py does not pass: fewer than 2 readable runs, p >= 0.01 that the mean loss is below
    the target, (with --time-claim) that the mean time is below the claim, or (with --baseline)
    a candidate that is not faster with the interval below zero,

unless --force is given, which creates the folder anyway with a warning at the top of README.md.
Logs with identical contents are copied once. A refusal prints the check.py table and the problems
on stdout and one line `new.py: error: ...` on stderr; SPEEDRUN_DEBUG=1 shows the traceback of an
unexpected error.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import check  # noqa: E402
import logparse  # noqa: E402
import plot  # noqa: E402

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PLOT_NAME = "val_loss.png"
STATS_NAME = "statistics.md"
SETS = ("baseline", "candidate")  # the subfolders of a record made with --baseline


def code_problems(files: Sequence[Path], label=str) -> list[str]:
    """Why these logs do not share one code section; [] when they do."""
    problems = []
    groups: dict[str, list[Path]] = {}
    for f in files:
        code, _ = logparse.split_code(f.read_bytes().decode("utf-8", "surrogateescape"))
        if code is None:
            problems.append(f"{label(f)}: no code section (no line of 100 '=')")
            continue
        digest = hashlib.sha256(code.encode("utf-8", "surrogateescape")).hexdigest()
        groups.setdefault(digest, []).append(f)
    if len(groups) > 1:
        problems.append(f"the logs hold {len(groups)} different versions of the code:")
        for i, (digest, members) in enumerate(groups.items(), 1):
            problems.append(f"  code {i} (sha256 {digest[:12]}): " + ", ".join(map(label, members)))
    return problems


def _distinct(files: Sequence[Path]) -> list[Path]:
    out, seen = [], set()
    for f in files:
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            out.append(f)
    return out


def _dest_names(files: Sequence[Path]) -> dict[Path, str]:
    names: dict[Path, str] = {}
    used: set[str] = set()
    for f in files:
        name, i = f.name, 1
        while name in used or name in ("README.md", PLOT_NAME, STATS_NAME):
            i += 1
            name = f"{f.stem}_{i}{f.suffix}"
        used.add(name)
        names[f] = name
    return names


def render_readme(name: str, date: str, folder: str, summary: str, report: str, check_args: str,
                  logs: Sequence[str], warnings: Sequence[str]) -> str:
    lines = [f"# {name} ({date})", ""]
    if warnings:
        lines += ["> **WARNING: created with --force; this folder does not meet the record rules:**"]
        lines += [f">   - {w.strip()}" if w.startswith("  ") else f"> - {w}" for w in warnings]
        lines += [""]
    if summary:
        lines += [summary, ""]
    lines += [
        "## What changed",
        "",
        "_Describe the change against the previous record, and link its commit._",
        "",
        "## Check",
        "",
        f"`python records/check.py records/{folder}{check_args}` prints:",
        "",
        "```text",
        report,
        "```",
        "",
        f"The numbers, with the calculation: [{STATS_NAME}]({STATS_NAME}).",
        "",
        "## Curves",
        "",
        f"![validation loss against training time and step]({PLOT_NAME})",
        "",
        "## Logs",
        "",
    ]
    lines += [f"- [{log}]({log})" for log in logs]
    return "\n".join(lines) + "\n"


def _summary(result: check.CheckResult | check.Comparison) -> str:
    if isinstance(result, check.Comparison):
        b, c = result.baseline, result.candidate
        if result.delta_time is None:
            return ""
        lo, hi = result.ci_time
        return (f"{c.n} runs of {c.total_steps} steps against {b.n} runs of the baseline ({b.total_steps} steps) "
                f"on the same node: mean validation loss {c.mean_loss:.4f} (p = {check._fmt_p(c.p_loss)} that "
                f"it is below {c.target:g}), mean training time {c.mean_time:.2f} s against {b.mean_time:.2f} s "
                f"({result.delta_time:+.3f} s, {100 * (1 - result.alpha):g}% interval {lo:+.3f} to {hi:+.3f} s; "
                f"speedup {result.speedup:.4f}x).")
    if result.n < 2:
        return ""
    summary = (f"{result.n} runs of {result.total_steps} steps: mean validation loss "
               f"{result.mean_loss:.4f} (p = {check._fmt_p(result.p_loss)} that it is below "
               f"{result.target:g}), mean training time {result.mean_time:.2f} s")
    if result.time_claim is not None:
        summary += f" (p = {check._fmt_p(result.p_time)} that it is below {result.time_claim:g} s)"
    return summary + "."


def main(argv: Sequence[str] | None = None) -> int:
    return check.run_cli("new.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="new.py", description=__doc__.split("\n\n")[0],
                                 epilog="example: python records/new.py FA3 logs/*.txt")
    ap.add_argument("name", metavar="NAME", help="short name: letters, digits, '.', '_', '-'")
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="the run logs")
    ap.add_argument("--baseline", nargs="+", action="extend", default=[], metavar="LOG_OR_DIR",
                    help="the baseline's run logs (the previous record's code on the same node): the record "
                         "folder then holds baseline/ and candidate/ and the check is the comparison")
    ap.add_argument("--force", action="store_true",
                    help="create the folder even when the checks fail, with a warning in README.md")
    ap.add_argument("--target", type=float, default=check.DEFAULT_TARGET,
                    help="validation loss to beat (default %(default)s)")
    ap.add_argument("--time-claim", type=float, default=None, metavar="SECONDS",
                    help="also require p < 0.01 that the mean time is below SECONDS")
    ap.add_argument("--date", default=None, help="YYYY-MM-DD for the folder name (default today)")
    ap.add_argument("--records-dir", type=Path, default=HERE,
                    help="where record folders go (default: the folder of this script)")
    args = ap.parse_args(argv)

    if not NAME_RE.match(args.name):
        ap.error(f"NAME {args.name!r}: use letters, digits, '.', '_' and '-' only")
    date = args.date or datetime.date.today().isoformat()
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        ap.error(f"--date {date!r} is not YYYY-MM-DD")
    folder = f"{date}_{args.name}"
    dest = args.records_dir / folder
    if dest.exists():
        print(f"new.py: error: {dest} already exists; refusing to overwrite it", file=sys.stderr)
        return 1

    check.require_paths(args.logs + args.baseline)
    if args.baseline and args.time_claim is not None:
        ap.error("--time-claim is for one set of runs; with --baseline the claim is the comparison")
    files = _distinct(check.expand_paths(args.logs)[0])
    base_files = [f for f in _distinct(check.expand_paths(args.baseline)[0]) if f not in files]
    sets = {"baseline": base_files, "candidate": files} if args.baseline else {"": files}

    names: dict[Path, str] = {}  # file -> its path in the record folder
    for sub, members in sets.items():
        names.update({f: f"{sub}/{n}" if sub else n for f, n in _dest_names(members).items()})
    label = lambda p: names.get(Path(p), str(p))  # noqa: E731
    if args.baseline:
        result = check.compare(base_files, files, target=args.target)
        report = check.format_comparison(result, label=label)
    else:
        result = check.check(files, target=args.target, time_claim=args.time_claim)
        report = check.format_report(result, label=label)
    check_problems = [] if result.passed else [f"check.py: {result.verdict}"]

    def problems_of(lab) -> list[str]:
        out = []
        for sub, members in sets.items():
            out += [f"{sub}: {p}" if sub and not p.startswith("  ") else p for p in code_problems(members, label=lab)]
        return out + check_problems

    problems = problems_of(str)
    if problems and not args.force:
        print(report)
        print("")
        print(f"refusing to create {dest}:")
        print("\n".join(f"  {p}" for p in problems))
        headlines = [p for p in problems if not p.startswith("  ")]
        print(f"new.py: error: refusing to create {dest}: " + "; ".join(h.rstrip(":") for h in headlines)
              + " (--force creates it anyway, with the problems in its README.md)", file=sys.stderr)
        return 1

    readme_problems = problems_of(label)
    tmp = args.records_dir / f".{folder}.tmp{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        for f, name in names.items():
            (tmp / name).parent.mkdir(exist_ok=True)
            shutil.copy2(f, tmp / name)
        plotted = [tmp / sub for sub in sets] if args.baseline else [tmp / names[f] for f in files]
        fig = plot.plot_runs(plotted, tmp / PLOT_NAME, target=args.target, title=folder)
        del fig
        try:
            stats_md = check.statistics_md(result, f"{args.name} statistics", _summary(result))
        except check.UsageError as e:  # too few runs: only with --force
            readme_problems.append(f"no {STATS_NAME}: {e}")
            stats_md = None
        if stats_md is not None:
            (tmp / STATS_NAME).write_text(stats_md, encoding="utf-8")
        check_args = ((f" --target {args.target:g}" if args.target != check.DEFAULT_TARGET else "")
                      + (f" --time-claim {args.time_claim:g}" if args.time_claim is not None else ""))
        readme = render_readme(args.name, date, folder, _summary(result), report, check_args,
                               list(names.values()), readme_problems)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(report)
    print("")
    if problems:
        print("created with --force despite:")
        print("\n".join(f"  {p}" for p in problems))
        print(f"new.py: warning: {dest} does not meet the record rules (created with --force)",
              file=sys.stderr)
    print(f"created {dest}/ (README.md, {STATS_NAME}, {PLOT_NAME}, {len(names)} log(s)"
          + (" in baseline/ and candidate/" if args.baseline else "") +
          "); fill in 'What changed' and add a row to records/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
