#!/usr/bin/env python3
"""Check speedrun logs for a record: final validation loss, training time, significance.

    python records/check.py LOG_OR_DIR... [--target 3.28] [--time-claim SECONDS]

Reads run logs written by train_gpt.py (logs/<run_id>.txt) or by the public modded-nanogpt
speedrun, whose record folders hold one .txt log per run. A directory stands for every .txt and
.log file below it. For each run it takes the validation line of the last step,

    step:1670/1670 val_loss:3.2771 train_time:163812ms step_avg:98.09ms

and prints one row per run, then the mean and standard deviation of the final losses and times
and the one-sided one-sample t-test p-value that the mean loss is below the target. With
--time-claim S it also gives the one-sided p-value that the mean time is below S seconds.

Only record runs count: a log whose hyperparameter lines say another preset than `record` or
`record-0903`, a vocab_size other than 50304, or a validation set other than the record's
(val_tokens 10485760 of data/fineweb10B/fineweb_val_*.bin) is listed under "not counted" with
the reason, so a smoke run never passes against 3.28. Logs without hyperparameter lines (the
public speedrun's) count.

Exit status: 0 when p < 0.01 (and, with --time-claim, the time claim holds at p < 0.01 too);
1 when not, or when fewer than 2 runs count; 2 on a usage error (e.g. a path that does not exist,
reported as one line `check.py: error: ...`) or when no run counts. SPEEDRUN_DEBUG=1 shows the
Python traceback of an error instead.

A log is "the source code, a line of 100 '=', versions and nvidia-smi, a line of 100 '=', then
the hyperparameters as `name: value` lines, then the run": step lines are only read after the
first such line (when there is one), so that example lines inside the code are never taken for
results. parse_log() is the importable parser (plot.py and new.py use it).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import hashlib
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

SEPARATOR = "=" * 100
LOG_SUFFIXES = (".txt", ".log")
DEFAULT_TARGET = 3.28
ALPHA = 0.01

_STEP_RE = re.compile(r"^step:(\d+)/(\d+)(?=\s|$)(.*)$")
_VAL_RE = re.compile(r"(?:^|\s)val_loss:(\S+)")
_TIME_RE = re.compile(r"(?:^|\s)train_time:([0-9]+(?:\.[0-9]*)?)ms")
_PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(?: (.*))?$")  # a hyperparameter line, `name: value`
# nvidia-smi's first line, e.g. "Wed Sep  3 19:58:00 2025": the date of a GPU run
_SMI_DATE_RE = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) [\d:]{8} (\d{4})\s*$")

# What makes a run a record run (records/README.md, rule 1): a record preset (today's, or the 09/03
# algorithm it grew from), GPT-2's padded vocabulary, and the first 10,485,760 tokens of the FineWeb
# 10B validation shard.
RECORD_PRESETS = ("record", "record-0903")
RECORD_VOCAB_SIZE = 50304
RECORD_VAL_TOKENS = 10_485_760
RECORD_VAL_SEQ_LEN = 262144  # the public validation buffer: context resets at its edges
RECORD_VAL_DIR = "fineweb10B"  # the folder data/cached_fineweb10B.py downloads into
_RECORD_VAL_NAME_RE = re.compile(r"fineweb_val_(?:\*|\d{6})\.bin")
DEBUG_ENV = "SPEEDRUN_DEBUG"  # set to 1: errors show their Python traceback (the same in every tool)


@dataclasses.dataclass
class RunLog:
    """What one log file says. `error` is None when the run finished with a final validation."""

    path: Path
    sha256: str = ""
    code: str | None = None          # text before the first 100-'=' line; None without one
    params: dict[str, str] = dataclasses.field(default_factory=dict)  # hyperparameter lines
    date: str | None = None          # YYYY-MM-DD of the run, from nvidia-smi's report if the log has one
    total_steps: int | None = None   # T of the step:N/T lines
    last_step: int | None = None     # largest N seen
    val: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)  # (step, loss, ms)
    final_loss: float | None = None
    final_time_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def preset(self) -> str | None:
        return self.params.get("preset")


def split_code(text: str) -> tuple[str | None, str]:
    """(code, rest): the code is everything before the first line of exactly 100 '='."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i]), "".join(lines[i + 1:])
    return None, text


def _header(rest: str) -> tuple[dict[str, str], str | None]:
    """(hyperparameters, date) from what follows the code: the environment report up to the second
    line of 100 '=', then the block of `name: value` lines right after it (the first value wins)."""
    env, params = [], {}
    lines = iter(rest.splitlines())
    for line in lines:
        if line.rstrip("\r") == SEPARATOR:
            break
        env.append(line)
    else:
        return {}, None  # no second separator: no hyperparameter block
    for line in lines:
        m = _PARAM_RE.match(line.rstrip("\r"))
        if m is None:
            break
        params.setdefault(m.group(1), (m.group(2) or "").strip())
    date = None
    for line in env:
        m = _SMI_DATE_RE.match(line.strip())
        if m:
            try:
                date = datetime.datetime.strptime(" ".join(m.groups()), "%b %d %Y").date().isoformat()
            except ValueError:
                continue
            break
    return params, date


def parse_text(text: str, path: Path | str = "<text>") -> RunLog:
    """Parse the text of one log; see parse_log."""
    run = RunLog(path=Path(path))
    run.sha256 = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    run.code, body = split_code(text)
    if run.code is not None:
        run.params, run.date = _header(body)

    totals: collections.Counter[int] = collections.Counter()
    last_step = None
    final: tuple[float, float] | None = None
    bad_val = None
    for line in body.splitlines():
        m = _STEP_RE.match(line.strip())
        if not m:
            continue
        step, total, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        totals[total] += 1
        last_step = step if last_step is None else max(last_step, step)
        v = _VAL_RE.search(rest)
        if v is None:
            continue
        t = _TIME_RE.search(rest)
        try:
            loss = float(v.group(1))
        except ValueError:
            bad_val = f"unreadable val_loss {v.group(1)!r} at step {step}"
            continue
        time_ms = float(t.group(1)) if t else math.nan
        run.val.append((step, loss, time_ms))
        if step == total:
            final = (loss, time_ms)

    if not totals:
        run.error = "no step lines (step:N/T ...) found"
        return run
    if len(totals) > 1:
        run.error = "step lines disagree on the total step count: " + ", ".join(
            f"T={t} ({c} lines)" for t, c in totals.most_common())
        return run
    run.total_steps = next(iter(totals))
    run.last_step = last_step
    if final is None:
        if last_step is not None and last_step < run.total_steps:
            run.error = f"truncated: last step line is step {last_step} of {run.total_steps}"
        elif bad_val:
            run.error = f"no readable final validation line ({bad_val})"
        else:
            run.error = f"no final validation line (step:{run.total_steps}/{run.total_steps} val_loss:...)"
        return run
    loss, time_ms = final
    if not math.isfinite(loss):
        run.error = f"final val_loss is {loss}"
        return run
    if not math.isfinite(time_ms):
        run.error = "final validation line has no train_time:...ms"
        return run
    run.final_loss, run.final_time_s = loss, time_ms / 1000.0
    return run


def parse_log(path: Path | str) -> RunLog:
    """Parse one log file. Never raises for a bad log: the reason is in RunLog.error."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        return RunLog(path=path, error=f"cannot read ({e.strerror or e})")
    run = parse_text(raw.decode("utf-8", "surrogateescape"), path)
    run.sha256 = hashlib.sha256(raw).hexdigest()
    return run


def expand_paths(args: Iterable[Path | str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """Files given, with directories replaced by the .txt/.log files below them (sorted)."""
    files: list[Path] = []
    problems: list[tuple[Path, str]] = []
    for arg in args:
        p = Path(arg)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
            if not found:
                problems.append((p, "directory holds no .txt or .log file"))
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            problems.append((p, "no such file or directory"))
    return files, problems


def _is_record_val_files(pattern: str) -> bool:
    path = Path(pattern)
    return path.parent.name == RECORD_VAL_DIR and _RECORD_VAL_NAME_RE.fullmatch(path.name) is not None


def record_problems(run: RunLog) -> list[str]:
    """Why a run is not on the record's preset, vocabulary and validation set; [] when it is. Only
    the hyperparameter lines present are checked, so a log without them (the public speedrun's)
    passes."""
    p = run.params
    problems = []
    if "preset" in p and p["preset"] not in RECORD_PRESETS:
        problems.append(f"preset {p['preset']}, not {' or '.join(RECORD_PRESETS)}")
    if p.get("markov_corpus", "False") not in ("False", "false", "0"):
        problems.append(f"markov_corpus {p['markov_corpus']} (synthetic data)")
    for name, want in (("vocab_size", RECORD_VOCAB_SIZE), ("val_tokens", RECORD_VAL_TOKENS),
                       ("val_seq_len", RECORD_VAL_SEQ_LEN)):
        if name in p and p[name].replace("_", "") != str(want):
            problems.append(f"{name} {p[name]}, not {want}")
    if "val_files" in p and not _is_record_val_files(p["val_files"]):
        problems.append(f"val_files {p['val_files']}, not {RECORD_VAL_DIR}/fineweb_val_*.bin")
    return problems


@dataclasses.dataclass
class CheckResult:
    runs: list[RunLog]                       # the runs that count, in the order given
    skipped: list[tuple[Path, str]]          # (path, why it does not count)
    notes: list[str]                         # duplicates and other remarks
    target: float = DEFAULT_TARGET
    time_claim: float | None = None
    alpha: float = ALPHA
    total_steps: int | None = None           # the majority T
    mean_loss: float | None = None
    std_loss: float | None = None
    p_loss: float | None = None
    mean_time: float | None = None
    std_time: float | None = None
    p_time: float | None = None
    passed: bool = False
    verdict: str = ""

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def exit_code(self) -> int:
        if not self.runs:
            return 2
        return 0 if self.passed else 1


def _one_sided_p(values: Sequence[float], bound: float) -> tuple[float, str | None]:
    """p-value of a one-sample t-test that the mean of values is below bound."""
    from scipy import stats  # imported here: parse_log needs no scipy

    if len(set(values)) == 1:  # zero variance: the t statistic is +-inf or undefined
        return (0.0 if values[0] < bound else 1.0), "all values are equal: p taken as 0 or 1"
    return float(stats.ttest_1samp(values, bound, alternative="less").pvalue), None


def check(paths: Iterable[Path | str], target: float = DEFAULT_TARGET,
          time_claim: float | None = None, alpha: float = ALPHA) -> CheckResult:
    files, skipped = expand_paths(paths)
    notes: list[str] = []
    seen_path: set[Path] = set()
    seen_hash: dict[str, Path] = {}
    parsed: list[RunLog] = []
    for f in files:
        key = f.resolve()
        if key in seen_path:
            notes.append(f"{f}: given more than once, counted once")
            continue
        seen_path.add(key)
        run = parse_log(f)
        if run.sha256 and run.sha256 in seen_hash:
            notes.append(f"{f}: same contents as {seen_hash[run.sha256]}, counted once")
            continue
        if run.sha256:
            seen_hash[run.sha256] = f
        parsed.append(run)

    good = []
    for r in parsed:
        if not r.ok:
            skipped.append((r.path, r.error))
        elif problems := record_problems(r):
            skipped.append((r.path, "not a record run: " + "; ".join(problems)))
        else:
            good.append(r)
    result = CheckResult(runs=[], skipped=skipped, notes=notes, target=target,
                         time_claim=time_claim, alpha=alpha)
    if good:
        counts = collections.Counter(r.total_steps for r in good)
        # the most common T; on a tie, the larger one
        majority = max(counts, key=lambda t: (counts[t], t))
        result.total_steps = majority
        for r in good:
            if r.total_steps == majority:
                result.runs.append(r)
            else:
                skipped.append((r.path, f"ran {r.total_steps} steps, not the majority's {majority}"))
        if len(counts) > 1:
            notes.append("runs disagree on the step count: " + ", ".join(
                f"T={t}: {c} run(s)" for t, c in counts.most_common()) + f"; only T={majority} counts")

    losses = [r.final_loss for r in result.runs]
    times = [r.final_time_s for r in result.runs]
    if losses:
        result.mean_loss = sum(losses) / len(losses)
        result.mean_time = sum(times) / len(times)
    if len(losses) >= 2:
        result.std_loss = _sample_std(losses)
        result.std_time = _sample_std(times)
        result.p_loss, note = _one_sided_p(losses, target)
        if note:
            notes.append(f"val_loss: {note}")
        if time_claim is not None:
            result.p_time, note = _one_sided_p(times, time_claim)
            if note:
                notes.append(f"time: {note}")

    if not result.runs:
        result.verdict = ("FAIL: no run counts (see 'not counted' above)" if parsed else
                          "FAIL: no run could be read")
    elif len(result.runs) < 2:
        result.verdict = "FAIL: a p-value needs at least 2 runs"
    else:
        loss_ok = result.p_loss < alpha
        time_ok = time_claim is None or result.p_time < alpha
        result.passed = loss_ok and time_ok
        why = []
        why.append(f"mean val_loss < {target:g} {'holds' if loss_ok else 'is not shown'}"
                   f" (p = {_fmt_p(result.p_loss)} {'<' if loss_ok else '>='} {alpha:g})")
        if time_claim is not None:
            why.append(f"mean time < {time_claim:g} s {'holds' if time_ok else 'is not shown'}"
                       f" (p = {_fmt_p(result.p_time)} {'<' if time_ok else '>='} {alpha:g})")
        result.verdict = ("PASS: " if result.passed else "FAIL: ") + "; ".join(why)
    return result


def _sample_std(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _fmt_p(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def format_report(result: CheckResult, label: Callable[[Path], str] = str) -> str:
    """The table and summary that check.py prints (new.py puts it into a record's README)."""
    out: list[str] = []
    rows = [(label(r.path), str(r.total_steps), f"{r.final_loss:.4f}", f"{r.final_time_s:.3f}")
            for r in result.runs]
    header = ("file", "steps", "val_loss", "time_s")
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(["{:<%d}" % widths[0]] + ["{:>%d}" % w for w in widths[1:]])
    out.append(fmt.format(*header))
    out.extend(fmt.format(*row) for row in rows)
    if result.skipped:
        out.append("")
        out.append("not counted:")
        out.extend(f"  {label(p)}: {why}" for p, why in result.skipped)
    if result.notes:
        out.append("")
        out.append("notes:")
        out.extend(f"  {n}" for n in result.notes)
    out.append("")
    out.append(f"runs: {result.n}" + (f" of {result.total_steps} steps" if result.total_steps else ""))
    if result.n >= 2:
        out.append(f"val_loss: mean {result.mean_loss:.4f}  std {result.std_loss:.4f}  "
                   f"(target {result.target:g})")
        out.append(f"p(mean val_loss < {result.target:g}) = {_fmt_p(result.p_loss)}"
                   "  (one-sided one-sample t-test)")
        out.append(f"time_s: mean {result.mean_time:.3f}  std {result.std_time:.3f}")
        if result.time_claim is not None:
            out.append(f"p(mean time < {result.time_claim:g} s) = {_fmt_p(result.p_time)}")
    elif result.n == 1:
        out.append(f"val_loss: {result.mean_loss:.4f}  time_s: {result.mean_time:.3f}")
        out.append("a p-value needs at least 2 runs")
    out.append(result.verdict)
    return "\n".join(out)


class UsageError(Exception):
    """A mistake in what the tool was given: reported as one line, `<tool>: error: <message>`."""


def _one_line(error: BaseException) -> str:
    if isinstance(error, UsageError):
        text = str(error)
    elif isinstance(error, OSError) and error.strerror:
        text = f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    elif isinstance(error, ImportError):
        text = f"{error} (pip install -r requirements.txt)"
    else:  # not foreseen: say what it was and how to see where
        text = f"{type(error).__name__}: {error} ({DEBUG_ENV}=1 shows the traceback)"
    return " ".join(text.split())


def run_cli(prog: str, main: Callable[[Sequence[str] | None], int],
            argv: Sequence[str] | None = None) -> int:
    """main(argv), with any error reported as one line on stderr, `prog: error: ...` (exit 2 for a
    UsageError, 1 otherwise), unless SPEEDRUN_DEBUG=1 asks for the traceback. plot.py and new.py
    use it too."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 -- every error becomes one line unless debugging
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, UsageError) else 1


def require_paths(paths: Iterable[Path | str]) -> None:
    """Raise UsageError naming every argument that is neither a file nor a directory with logs."""
    problems = expand_paths(paths)[1]
    if problems:
        raise UsageError("; ".join(f"{p}: {why}" for p, why in problems))


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("check.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="check.py",
        description="Final validation loss and training time of speedrun logs, with the one-sided "
                    "t-test that their mean loss is below the target. Exit 0 only when p < 0.01 "
                    "(and the --time-claim holds at p < 0.01); 1 otherwise; 2 when no run counts. "
                    "Runs of another preset, vocabulary or validation set than the record's are "
                    "listed as not counted.",
        epilog="example: python records/check.py logs/a.txt logs/b.txt logs/c.txt --time-claim 170")
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR",
                    help="run logs; a directory means every .txt/.log file below it")
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET,
                    help="validation loss to beat (default %(default)s)")
    ap.add_argument("--time-claim", type=float, default=None, metavar="SECONDS",
                    help="also test that the mean training time is below SECONDS")
    args = ap.parse_args(argv)
    require_paths(args.logs)
    result = check(args.logs, target=args.target, time_claim=args.time_claim)
    print(format_report(result))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
