#!/usr/bin/env python3
"""Create a record folder from run logs: records/<YYYY-MM-DD>_<NAME>/.

    python records/new.py NAME LOG_OR_DIR... [--time-claim SECONDS] [--force]

Copies the logs into the folder, draws val_loss.png (plot.py) and writes README.md with the
check.py table and a link to the plot. Refuses, creating nothing (exit 1), when

  * the folder already exists (--force does not change this),
  * the logs were not made by the same code (the part of each log before its first line of
    100 '='), or a log has no code section,
  * check.py does not pass: fewer than 2 readable runs, p >= 0.01 that the mean loss is below
    the target, or (with --time-claim) that the mean time is below the claim,

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
import plot  # noqa: E402

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PLOT_NAME = "val_loss.png"


def code_problems(files: Sequence[Path], label=str) -> list[str]:
    """Why these logs do not share one code section; [] when they do."""
    problems = []
    groups: dict[str, list[Path]] = {}
    for f in files:
        code, _ = check.split_code(f.read_bytes().decode("utf-8", "surrogateescape"))
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
        while name in used or name in ("README.md", PLOT_NAME):
            i += 1
            name = f"{f.stem}_{i}{f.suffix}"
        used.add(name)
        names[f] = name
    return names


def render_readme(name: str, date: str, folder: str, result: check.CheckResult, report: str,
                  logs: Sequence[str], warnings: Sequence[str]) -> str:
    lines = [f"# {name} ({date})", ""]
    if warnings:
        lines += ["> **WARNING: created with --force; this folder does not meet the record rules:**"]
        lines += [f">   - {w.strip()}" if w.startswith("  ") else f"> - {w}" for w in warnings]
        lines += [""]
    if result.n >= 2:
        summary = (f"{result.n} runs of {result.total_steps} steps: mean validation loss "
                   f"{result.mean_loss:.4f} (p = {check._fmt_p(result.p_loss)} that it is below "
                   f"{result.target:g}), mean training time {result.mean_time:.2f} s")
        if result.time_claim is not None:
            summary += f" (p = {check._fmt_p(result.p_time)} that it is below {result.time_claim:g} s)"
        lines += [summary + ".", ""]
    lines += [
        "## What changed",
        "",
        "_Describe the change against the previous record, and link its commit._",
        "",
        "## Check",
        "",
        f"`python records/check.py records/{folder}"
        + (f" --target {result.target:g}" if result.target != check.DEFAULT_TARGET else "")
        + (f" --time-claim {result.time_claim:g}" if result.time_claim is not None else "")
        + "` prints:",
        "",
        "```text",
        report,
        "```",
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


def main(argv: Sequence[str] | None = None) -> int:
    return check.run_cli("new.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="new.py", description=__doc__.split("\n\n")[0],
                                 epilog="example: python records/new.py FA3 logs/*.txt")
    ap.add_argument("name", metavar="NAME", help="short name: letters, digits, '.', '_', '-'")
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR", help="the run logs")
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

    check.require_paths(args.logs)
    files = _distinct(check.expand_paths(args.logs)[0])

    names = _dest_names(files)  # file -> its name in the record folder
    result = check.check(files, target=args.target, time_claim=args.time_claim)
    check_problems = [] if result.passed else [f"check.py: {result.verdict}"]
    problems = code_problems(files) + check_problems
    if problems and not args.force:
        print(check.format_report(result))
        print("")
        print(f"refusing to create {dest}:")
        print("\n".join(f"  {p}" for p in problems))
        headlines = [p for p in problems if not p.startswith("  ")]
        print(f"new.py: error: refusing to create {dest}: " + "; ".join(h.rstrip(":") for h in headlines)
              + " (--force creates it anyway, with the problems in its README.md)", file=sys.stderr)
        return 1

    readme_problems = code_problems(files, label=names.__getitem__) + check_problems
    tmp = args.records_dir / f".{folder}.tmp{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        for f, name in names.items():
            shutil.copy2(f, tmp / name)
        copied = [tmp / names[f] for f in files]
        fig = plot.plot_runs(copied, tmp / PLOT_NAME, target=args.target, title=folder)
        del fig
        report = check.format_report(result, label=lambda p: names.get(Path(p), str(p)))
        readme = render_readme(args.name, date, folder, result, report,
                               [names[f] for f in files], readme_problems)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(check.format_report(result, label=lambda p: names.get(Path(p), str(p))))
    print("")
    if problems:
        print("created with --force despite:")
        print("\n".join(f"  {p}" for p in problems))
        print(f"new.py: warning: {dest} does not meet the record rules (created with --force)",
              file=sys.stderr)
    print(f"created {dest}/ (README.md, {PLOT_NAME}, {len(names)} log(s)); fill in 'What changed' "
          "and add a row to records/README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
