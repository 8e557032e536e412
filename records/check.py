#!/usr/bin/env python3
"""Check speedrun logs for a record: final validation loss, training time, significance.

    python records/check.py LOG_OR_DIR... [--target 3.28] [--time-claim SECONDS]
    python records/check.py CANDIDATE_LOG_OR_DIR... --baseline LOG_OR_DIR... [--markdown]
    python records/check.py RECORD_FOLDER        # holding baseline/ and one candidate folder

Reads run logs written by train_gpt.py (logs/<run_id>.txt) or by the public modded-nanogpt
speedrun, whose record folders hold one .txt log per run. A directory stands for every .txt and
.log file below it. For each run it takes the validation line of the last step,

    step:1670/1670 val_loss:3.2771 train_time:163812ms step_avg:98.09ms

and prints one row per run, then the mean and standard deviation of the final losses and times
and the one-sided one-sample t-test p-value that the mean loss is below the target. With
--time-claim S it also gives the one-sided p-value that the mean time is below S seconds.

With --baseline (or a folder holding one subfolder named like *baseline* and one other) it
prints both sets and the candidate minus the baseline: time delta with its 99% Welch confidence
interval, relative time, speedup, Welch t-tests on time and loss, and each set's p-value against
the target; the candidate is a record when its loss passes at p < 0.01 and the interval lies below
zero. Runs of different code or GPU count are never pooled: each such set is judged alone and the
whole refused (exit 2); a folder of several other subfolders is judged per subfolder and refused
with a line naming them. --markdown prints the public speedrun's statistics.md instead.

Only record runs count: a log whose hyperparameter lines say another preset than `record`, a
vocab_size other than 50304, or a validation set other than the record's (val_tokens 10485760 of
data/fineweb10B/fineweb_val_*.bin) is listed under "not counted" with the reason, so a smoke run
never passes against 3.28. Logs without hyperparameter lines (the public speedrun's) count. A log
holding more than one run (train_gpt.py's header more than once) is listed there too. Runs whose
log shows a CPU device are reported as on the CPU.

Exit status: 0 when p < 0.01 (and, with --time-claim, the time claim holds at p < 0.01 too);
1 when not, or when fewer than 2 runs count; 2 on a usage error (e.g. a path that does not exist,
reported as one line `check.py: error: ...`) or when no run counts. SPEEDRUN_DEBUG=1 shows the
Python traceback of an error instead.

A log is "the source code, a line of 100 '=', versions and nvidia-smi, a line of 100 '=', then
the hyperparameters as `name: value` lines, then the run": step lines are only read after the
first such line (when there is one), so that example lines inside the code are never taken for
results. parse_log() is the importable parser of whole runs (plot.py and new.py use it); the lines
themselves are read by logparse.py, which bench/ uses too.
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
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import logparse  # noqa: E402  (records/logparse.py: the lines of a log)

LOG_SUFFIXES = (".txt", ".log")
DEFAULT_TARGET = 3.28
ALPHA = 0.01

# nvidia-smi's first line, e.g. "Wed Sep  3 19:58:00 2025": the date of a GPU run
_SMI_DATE_RE = re.compile(r"^(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,2}) [\d:]{8} (\d{4})\s*$")
# nvidia-smi's GPU row "|   0  NVIDIA H100 80GB HBM3          On  |" and process row
# "|    0   N/A  N/A         1039695      C   .../bin/python       1512MiB |" (the GPU a rank ran on)
_SMI_GPU_RE = re.compile(r"^\|\s+\d+\s+(\S.*?)\s+(?:On|Off)\s+\|")
_SMI_PROC_RE = re.compile(r"^\|\s+(\d+)\s+(?:N/A|\d+)\s+(?:N/A|\d+)\s+\d+\s+[A-Z+]+\s+\S")
_DEVICE_RE = re.compile(r"^device: (\S+) x (\d+)\b")  # train_gpt.py's run report: "device: cuda:0 x 8, ..."
# the versions at the top of the environment report: ours ("PyTorch 2.11.0+cu130", "CUDA 13.0", "Triton 3.6.0")
# and the public speedrun's ("Running PyTorch 2.10.0+cu128 compiled for CUDA 12.8", "Running Triton version 3.6.0")
_VERSION_RES = {
    "Python": re.compile(r"^(?:Running )?Python (\S+)"),
    "PyTorch": re.compile(r"^(?:Running )?PyTorch (\S+)"),
    "CUDA": re.compile(r"^(?:Running PyTorch \S+ compiled for )?CUDA (\S+)$"),
    "Triton": re.compile(r"^(?:Running )?Triton(?: version)? (\S+)$"),
}

# What makes a run a record run (records/README.md, rule 1): the record preset, GPT-2's padded vocabulary,
# and the first 10,485,760 tokens of the FineWeb 10B validation shard.
RECORD_PRESETS = ("record",)
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
    code_sha256: str | None = None   # of the code section: runs with different ones are never pooled
    gpus: int | None = None          # ranks of the run: train_gpt.py's device line, else nvidia-smi's processes
    cpu: bool = False                # train_gpt.py's device line says cpu: the ranks are CPU processes
    gpu_name: str | None = None      # e.g. "NVIDIA H100 80GB HBM3", from nvidia-smi
    versions: dict[str, str] = dataclasses.field(default_factory=dict)  # Python, PyTorch, CUDA, Triton
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


def _environment(run: RunLog, env: list[str]) -> None:
    """The run's date, GPU model, GPU count (distinct GPUs in nvidia-smi's process table) and
    versions, from the environment report."""
    in_processes, proc_gpus = False, set()
    for line in env:
        text = line.strip()
        m = _SMI_DATE_RE.match(text)
        if m and run.date is None:
            try:
                run.date = datetime.datetime.strptime(" ".join(m.groups()), "%b %d %Y").date().isoformat()
            except ValueError:
                pass
        for name, pattern in _VERSION_RES.items():
            v = pattern.match(text)
            if v and name not in run.versions:
                run.versions[name] = v.group(1)
        if "Processes:" in text:
            in_processes = True
        elif in_processes and (p := _SMI_PROC_RE.match(text)):
            proc_gpus.add(int(p.group(1)))
        elif run.gpu_name is None and (g := _SMI_GPU_RE.match(text)):
            run.gpu_name = g.group(1)
    if proc_gpus:
        run.gpus = len(proc_gpus)


def parse_text(text: str, path: Path | str = "<text>") -> RunLog:
    """Parse the text of one log; see parse_log."""
    run = RunLog(path=Path(path))
    run.sha256 = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    run.code, body = logparse.split_code(text)
    if run.code is not None:
        run.code_sha256 = hashlib.sha256(run.code.encode("utf-8", "surrogateescape")).hexdigest()
        run.params, env = logparse.header(body)
        _environment(run, env)
    _read_steps(run, body)
    # train_gpt.py starts each run's log with its source and settings, between two lines of 100 '=' (a resumed
    # run adds no header): more means runs appended to one log (a --run_id used again, before the trainer
    # refused that). Public speedrun logs (no hyperparameter lines) print a varying number of such lines.
    starts = sum(line.rstrip("\r") == logparse.SEPARATOR for line in text.splitlines()) // 2
    if run.params and starts > 1:
        run.error = (f"holds {starts} runs, not one (the source and settings appear {starts} times: runs "
                     "appended to one log under one run id); check each run from a log of its own")
    return run


def _read_steps(run: RunLog, body: str) -> None:
    """The step and validation lines of the log's body into run: steps, validations, the final loss and
    time, or the reason there are none (run.error)."""
    totals: collections.Counter[int] = collections.Counter()
    last_step = None
    final: tuple[float, float] | None = None
    bad_val = None
    for line in body.splitlines():
        s = logparse.step_line(line)
        if s is None:
            if (d := _DEVICE_RE.match(line)) is not None:
                run.gpus = int(d.group(2))  # our own report wins over nvidia-smi's process count
                run.cpu = d.group(1) == "cpu"
            continue
        step, total = s.step, s.total
        totals[total] += 1
        last_step = step if last_step is None else max(last_step, step)
        if s.val_loss is None:
            continue
        try:
            loss = float(s.val_loss)
        except ValueError:
            bad_val = f"unreadable val_loss {s.val_loss!r} at step {step}"
            continue
        time_ms = s.time_ms if s.time_ms is not None else math.nan
        run.val.append((step, loss, time_ms))
        if step == total:
            final = (loss, time_ms)

    if not totals:
        run.error = "no step lines (step:N/T ...) found"
        return
    if len(totals) > 1:
        run.error = "step lines disagree on the total step count: " + ", ".join(
            f"T={t} ({c} lines)" for t, c in totals.most_common())
        return
    run.total_steps = next(iter(totals))
    run.last_step = last_step
    if final is None:
        if last_step is not None and last_step < run.total_steps:
            run.error = f"truncated: last step line is step {last_step} of {run.total_steps}"
        elif bad_val:
            run.error = f"no readable final validation line ({bad_val})"
        else:
            run.error = f"no final validation line (step:{run.total_steps}/{run.total_steps} val_loss:...)"
        return
    loss, time_ms = final
    if not math.isfinite(loss):
        run.error = f"final val_loss is {loss}"
        return
    if not math.isfinite(time_ms):
        run.error = "final validation line has no train_time:...ms"
        return
    run.final_loss, run.final_time_s = loss, time_ms / 1000.0


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
    # runs of different code or GPU counts: each set judged alone, none pooled (runs is then empty)
    unpooled: list[tuple[str, CheckResult]] = dataclasses.field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def exit_code(self) -> int:
        if not self.runs:
            return 2
        return 0 if self.passed else 1

    @property
    def losses(self) -> list[float]:
        return [r.final_loss for r in self.runs]

    @property
    def times(self) -> list[float]:
        return [r.final_time_s for r in self.runs]

    @property
    def median_time(self) -> float | None:
        return statistics.median(self.times) if self.runs else None

    @property
    def gpus(self) -> int | None:
        """The runs' GPU count when the logs say it (one count: sets of several are never pooled)."""
        known = {r.gpus for r in self.runs if r.gpus is not None}
        return known.pop() if len(known) == 1 else None

    @property
    def where(self) -> str:
        """' on 8 GPU(s)', ' on the CPU' (CPU runs: their logs' device line), or '' when the logs do not say."""
        if self.runs and all(r.cpu for r in self.runs):
            return " on the CPU" + (f" ({self.gpus} processes)" if self.gpus and self.gpus > 1 else "")
        return f" on {self.gpus} GPU(s)" if self.gpus else ""


def _one_sided_p(values: Sequence[float], bound: float) -> tuple[float, str | None]:
    """p-value of a one-sample t-test that the mean of values is below bound."""
    from scipy import stats  # imported here: parse_log needs no scipy

    if len(set(values)) == 1:  # zero variance: the t statistic is +-inf or undefined
        return (0.0 if values[0] < bound else 1.0), "all values are equal: p taken as 0 or 1"
    return float(stats.ttest_1samp(values, bound, alternative="less").pvalue), None


def _read_runs(paths: Iterable[Path | str]) -> tuple[list[RunLog], list[tuple[Path, str]], list[str]]:
    """(readable record runs, (path, why) of the rest, notes): each file and each content once."""
    files, skipped = expand_paths(paths)
    notes: list[str] = []
    seen_path: set[Path] = set()
    seen_hash: dict[str, Path] = {}
    good: list[RunLog] = []
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
        if not run.ok:
            skipped.append((run.path, run.error))
        elif problems := record_problems(run):
            skipped.append((run.path, "not a record run: " + "; ".join(problems)))
        else:
            good.append(run)
    return good, skipped, notes


def pool_sets(runs: Sequence[RunLog]) -> list[tuple[str, list[RunLog]]]:
    """The runs split by code section and GPU count, in order of first appearance, each set named
    by what sets it apart ("code 1a2b3c4d5e6f, 8 GPUs"). One set means they may be pooled. A run
    whose log names no GPU count joins the others unless they disagree among themselves."""
    counts = {r.gpus for r in runs if r.gpus is not None}
    codes = {r.code_sha256 for r in runs}
    sets: dict[tuple, list[RunLog]] = {}
    for r in runs:
        sets.setdefault((r.code_sha256, r.gpus if len(counts) > 1 else None), []).append(r)
    named = []
    for (code, gpus), members in sets.items():
        parts = []
        if len(codes) > 1:
            parts.append(f"code {code[:12]}" if code else "no code section")
        if len(counts) > 1:
            parts.append(f"{gpus} GPUs" if gpus is not None else "GPU count not in the log")
        named.append((", ".join(parts), members))
    return named


def _set_keys(runs: Sequence[RunLog]) -> set[tuple]:
    counts = {r.gpus for r in runs if r.gpus is not None}
    return {(r.code_sha256, r.gpus if len(counts) > 1 else None) for r in runs}


def check(paths: Iterable[Path | str], target: float = DEFAULT_TARGET,
          time_claim: float | None = None, alpha: float = ALPHA) -> CheckResult:
    """Judge the runs in paths as one set. Runs of different code or GPU counts are never pooled:
    then each such set is judged alone (result.unpooled) and the result fails with no run counted."""
    good, skipped, notes = _read_runs(paths)
    sets = pool_sets(good)
    if len(sets) <= 1:
        return _judge(good, skipped, notes, target, time_claim, alpha, parsed=bool(good or skipped))
    result = CheckResult(runs=[], skipped=skipped, notes=notes, target=target, time_claim=time_claim,
                         alpha=alpha)
    result.unpooled = [(name, _judge(members, [], [], target, time_claim, alpha, parsed=True))
                       for name, members in sets]
    differ = " and ".join(what for what, i in (("code", 0), ("GPU count", 1))
                          if len({key[i] for key in _set_keys(good)}) > 1)
    result.verdict = (f"FAIL: the runs differ in {differ} ({len(sets)} sets, each judged alone above); "
                      "such runs are never pooled: give one set's logs alone")
    return result


def _judge(good: list[RunLog], skipped: list[tuple[Path, str]], notes: list[str], target: float,
           time_claim: float | None, alpha: float, parsed: bool) -> CheckResult:
    """Statistics and verdict of runs that may be pooled (one code, one GPU count)."""
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

    losses, times = result.losses, result.times
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


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> list[str]:
    """Left-aligned first column, right-aligned others, two spaces apart."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(["{:<%d}" % widths[0]] + ["{:>%d}" % w for w in widths[1:]])
    return [fmt.format(*header).rstrip()] + [fmt.format(*row) for row in rows]


def format_report(result: CheckResult, label: Callable[[Path], str] = str, verdict: bool = True) -> str:
    """The table and summary that check.py prints (new.py puts it into a record's README);
    verdict=False leaves out the last line (a comparison gives its own)."""
    out: list[str] = []
    if result.unpooled:
        out.append("sets not pooled (runs of different code or GPU counts), each judged alone:")
        out.extend(_sets_table(result.unpooled))
        for name, sub in result.unpooled:
            out.append(f"  {name}:")
            out.extend(f"    {label(path)}" for path in [r.path for r in sub.runs] + [p for p, _ in sub.skipped])
    else:
        out.extend(_table([(label(r.path), str(r.total_steps), f"{r.final_loss:.4f}", f"{r.final_time_s:.3f}")
                           for r in result.runs], ("file", "steps", "val_loss", "time_s")))
    if result.skipped:
        out.append("")
        out.append("not counted:")
        out.extend(f"  {label(p)}: {why}" for p, why in result.skipped)
    if result.notes:
        out.append("")
        out.append("notes:")
        out.extend(f"  {n}" for n in result.notes)
    if not result.unpooled:
        out.append("")
        out.append(f"runs: {result.n}" + (f" of {result.total_steps} steps" if result.total_steps else "")
                   + result.where)
    if result.n >= 2:
        out.append(f"val_loss: mean {result.mean_loss:.4f}  std {result.std_loss:.4f}  "
                   f"(target {result.target:g})")
        out.append(f"p(mean val_loss < {result.target:g}) = {_fmt_p(result.p_loss)}"
                   "  (one-sided one-sample t-test)")
        out.append(f"time_s: mean {result.mean_time:.3f}  std {result.std_time:.3f}  "
                   f"median {result.median_time:.3f}  range {min(result.times):.3f}-{max(result.times):.3f}")
        if result.time_claim is not None:
            out.append(f"p(mean time < {result.time_claim:g} s) = {_fmt_p(result.p_time)}")
    elif result.n == 1:
        out.append(f"val_loss: {result.mean_loss:.4f}  time_s: {result.mean_time:.3f}")
        out.append("a p-value needs at least 2 runs")
    if verdict:
        out.append(result.verdict)
    return "\n".join(out)


def _sets_table(sets: Sequence[tuple[str, CheckResult]]) -> list[str]:
    """One row per set of runs: its name, runs, steps, mean loss, p, mean time, PASS/FAIL."""
    rows = []
    for name, r in sets:
        if r.unpooled:  # the set itself mixes code or GPU counts
            n = sum(sub.n for _, sub in r.unpooled)
            rows.append((name, str(n), "-", "-", "n/a", "-", f"FAIL ({len(r.unpooled)} codes/GPU counts, not pooled)"))
            continue
        rows.append((name, str(r.n), str(r.total_steps or "-"),
                     f"{r.mean_loss:.4f}" if r.mean_loss is not None else "-", _fmt_p(r.p_loss),
                     f"{r.mean_time:.3f}" if r.mean_time is not None else "-",
                     "PASS" if r.passed else "FAIL"))
    return ["  " + line for line in _table(rows, ("set", "runs", "steps", "val_loss", "p", "time_s", "verdict"))]


# --- two sets: a baseline and a candidate -----------------------------------------------------

@dataclasses.dataclass
class Comparison:
    """A candidate's runs against a baseline's from the same node. The candidate is a record when
    its mean loss is below the target at p < alpha and the (1 - alpha) confidence interval of its
    mean time minus the baseline's lies below zero."""

    baseline: CheckResult
    candidate: CheckResult
    alpha: float = ALPHA
    problems: list[str] = dataclasses.field(default_factory=list)  # why the two cannot be compared
    delta_time: float | None = None          # candidate - baseline, seconds
    ci_time: tuple[float, float] | None = None
    relative_time: float | None = None       # delta_time / baseline mean
    speedup: float | None = None             # baseline mean / candidate mean
    delta_loss: float | None = None
    welch_time: tuple[float, float, float] | None = None  # (t, df, two-sided p) of candidate - baseline
    welch_loss: tuple[float, float, float] | None = None
    passed: bool = False
    verdict: str = ""

    @property
    def exit_code(self) -> int:
        if not self.baseline.runs or not self.candidate.runs:
            return 2
        return 0 if self.passed else 1


def welch(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float, float]:
    """(mean(a) - mean(b), t, Welch-Satterthwaite degrees of freedom, two-sided p): the unequal-
    variance t-test, the same numbers as scipy.stats.ttest_ind(a, b, equal_var=False)."""
    from scipy import stats

    diff = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se2 = va + vb
    if se2 == 0:  # both sets constant: the difference is exact
        return diff, math.copysign(math.inf, diff) if diff else 0.0, math.inf, 0.0 if diff else 1.0
    df = se2 ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    t = diff / math.sqrt(se2)
    return diff, t, df, float(2 * stats.t.sf(abs(t), df))


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float) -> tuple[float, float]:
    """Two-sided confidence interval of mean(a) - mean(b) with Welch's standard error and degrees
    of freedom (what scipy's ttest_ind(..., equal_var=False).confidence_interval gives)."""
    from scipy import stats

    diff, _, df, _ = welch(a, b)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    if se == 0:
        return diff, diff
    half = float(stats.t.ppf(0.5 + confidence / 2, df)) * se
    return diff - half, diff + half


def compare(baseline: Iterable[Path | str], candidate: Iterable[Path | str], target: float = DEFAULT_TARGET,
            alpha: float = ALPHA) -> Comparison:
    base = check(baseline, target=target, alpha=alpha)
    cand = check(candidate, target=target, alpha=alpha)
    result = Comparison(baseline=base, candidate=cand, alpha=alpha)
    shared = {r.sha256 for r in base.runs} & {r.sha256 for r in cand.runs}
    if shared:
        result.problems.append(f"{len(shared)} log(s) are in both the baseline and the candidate")
    for name, side in (("baseline", base), ("candidate", cand)):
        if side.n < 2:
            result.problems.append(f"the {name} has {side.n} run(s) that count; a comparison needs at least 2"
                                   + (" (its runs differ in code or GPU count)" if side.unpooled else ""))
    if base.gpus and cand.gpus and base.gpus != cand.gpus:
        result.problems.append(f"the baseline ran on {base.gpus} GPU(s), the candidate on {cand.gpus}: "
                               "compare runs on the same node")
    if base.n >= 2 and cand.n >= 2:
        result.delta_time, t, df, p = welch(cand.times, base.times)
        result.welch_time = (t, df, p)
        result.ci_time = welch_interval(cand.times, base.times, 1 - alpha)
        result.relative_time = result.delta_time / base.mean_time
        result.speedup = base.mean_time / cand.mean_time
        result.delta_loss, t, df, p = welch(cand.losses, base.losses)
        result.welch_loss = (t, df, p)
    if result.problems:
        result.verdict = "FAIL: cannot compare: " + "; ".join(result.problems)
        return result
    loss_ok = cand.p_loss < alpha
    faster = result.ci_time[1] < 0
    result.passed = loss_ok and faster
    level = f"{100 * (1 - alpha):g}%"
    why = [f"candidate mean val_loss < {target:g} {'holds' if loss_ok else 'is not shown'} "
           f"(p = {_fmt_p(cand.p_loss)} {'<' if loss_ok else '>='} {alpha:g})"]
    lo, hi = result.ci_time
    if faster:
        why.append(f"faster by {-result.delta_time:.3f} s ({level} CI {-hi:.3f} to {-lo:.3f} s, above zero)")
    elif result.delta_time < 0:
        why.append(f"faster by {-result.delta_time:.3f} s but not significantly ({level} CI of the time "
                   f"difference {lo:+.3f} to {hi:+.3f} s reaches zero)")
    else:
        why.append(f"not faster (time difference {result.delta_time:+.3f} s, {level} CI {lo:+.3f} to {hi:+.3f} s)")
    result.verdict = ("PASS: a record: " if result.passed else "FAIL: not a record: ") + "; ".join(why)
    return result


def format_comparison(result: Comparison, names: tuple[str, str] = ("baseline", "candidate"),
                      label: Callable[[Path], str] = str) -> str:
    """Both sets' tables, then the difference: what check.py prints for a baseline and a candidate."""
    out = []
    for name, side in zip(names, (result.baseline, result.candidate)):
        out += [f"== {name} ==", format_report(side, label, verdict=False), ""]
    out.append(f"== {names[1]} - {names[0]} ==")
    if result.delta_time is not None:
        b, c = result.baseline, result.candidate
        t, df, p = result.welch_time
        lo, hi = result.ci_time
        out.append(f"time_s: {result.delta_time:+.3f} ({100 * result.relative_time:+.3f}%), "
                   f"{100 * (1 - result.alpha):g}% CI {lo:+.3f} to {hi:+.3f}; speedup {result.speedup:.4f}x")
        out.append(f"  Welch t-test on time: t = {t:.3f}, df = {df:.1f}, p = {_fmt_p(p)} (two-sided)")
        out.append(f"  slowest {names[1]} run {max(c.times):.3f} s, fastest {names[0]} run {min(b.times):.3f} s")
        t, df, p = result.welch_loss
        out.append(f"val_loss: {result.delta_loss:+.4f}; Welch t-test on loss: t = {t:.3f}, df = {df:.1f}, "
                   f"p = {_fmt_p(p)} (two-sided)")
        out.append(f"p(mean val_loss < {c.target:g}): {names[0]} {_fmt_p(b.p_loss)}, {names[1]} {_fmt_p(c.p_loss)}")
    out.append(result.verdict)
    return "\n".join(out)


# --- the public statistics.md ------------------------------------------------------------------

def _versions_lines(result: CheckResult) -> list[str]:
    runs = result.runs
    if not runs:
        return []
    name = collections.Counter(r.gpu_name for r in runs if r.gpu_name).most_common(1)
    gpus = result.gpus
    lines = []
    if gpus or name:
        lines.append(f"- GPUs: {f'{gpus}x ' if gpus else ''}{name[0][0] if name else 'GPU'}")
    for key in ("PyTorch", "Triton", "CUDA"):
        seen = sorted({r.versions[key] for r in runs if key in r.versions})
        if seen:
            lines.append(f"- {key}: " + ", ".join(f"`{v}`" for v in seen))
    lines.append(f"- runs: `{result.n}` of `{result.total_steps}` steps")
    return lines


def _statistics_table(result: CheckResult) -> list[str]:
    times = result.times
    return ["| metric | value |", "| --- | ---: |",
            f"| mean val loss | {result.mean_loss:.10f} |",
            f"| val loss sample std | {result.std_loss:.10f} |",
            f"| one-sided p vs {result.target:g} | {result.p_loss:.10f} |",
            f"| mean train time | {result.mean_time:.6f} s |",
            f"| train time sample std | {result.std_time:.6f} s |",
            f"| median train time | {result.median_time:.3f} s |",
            f"| train time range | {min(times):.3f}-{max(times):.3f} s |"]


def _values(result: CheckResult) -> tuple[str, str]:
    return ("[" + ", ".join(f"{x:.4f}" for x in result.losses) + "]",
            "[" + ", ".join(f"{x:.3f}" for x in result.times) + "]")


def statistics_md(result: CheckResult | Comparison, title: str, summary: str = "") -> str:
    """statistics.md in the public speedrun's layout (its 2026-07-17 record's this_pr/statistics.md):
    summary with versions, the statistics table, losses, times, a snippet that recomputes them
    with scipy alone, and, given a Comparison, the candidate against the baseline."""
    comp = result if isinstance(result, Comparison) else None
    cand = comp.candidate if comp else result
    if cand.n < 2 or (comp and comp.baseline.n < 2):
        raise UsageError("statistics.md needs at least 2 runs that count in each set")
    losses, times = _values(cand)
    out = [f"# {title}", "", "## Summary", ""]
    if summary:
        out += [summary, ""]
    out += _versions_lines(cand) + ["", "## Statistics", ""] + _statistics_table(cand)
    out += ["", "Losses:", "", "```python", losses, "```", "", "Times:", "", "```python", times, "```"]
    snippet = ["import statistics", "", "from scipy import stats", "",
               f"losses = {losses}", f"times = {times}"]
    if comp:
        b_losses, b_times = _values(comp.baseline)
        snippet += [f"baseline_losses = {b_losses}", f"baseline_times = {b_times}"]
    snippet += ["", f'print("mean loss %.10f, std %.10f" % (statistics.mean(losses), statistics.stdev(losses)))',
                f'print("p(mean loss < {cand.target:g}) = %.10f" % '
                f'stats.ttest_1samp(losses, {cand.target:g}, alternative="less").pvalue)',
                'print("mean time %.6f s, std %.6f s" % (statistics.mean(times), statistics.stdev(times)))']
    if comp:
        snippet += [
            f'print("baseline p(mean loss < {cand.target:g}) = %.10f" % '
            f'stats.ttest_1samp(baseline_losses, {cand.target:g}, alternative="less").pvalue)',
            "# Welch (unequal-variance) t-tests, candidate - baseline; two-sided p",
            "time = stats.ttest_ind(times, baseline_times, equal_var=False)",
            "loss = stats.ttest_ind(losses, baseline_losses, equal_var=False)",
            f"ci = time.confidence_interval({1 - comp.alpha:g})",
            'print("time delta %.6f s, %g%% CI %.6f to %.6f s, speedup %.8fx" % (statistics.mean(times) - '
            f'statistics.mean(baseline_times), {100 * (1 - comp.alpha):g}, ci.low, ci.high, '
            'statistics.mean(baseline_times) / statistics.mean(times)))',
            'print("time: t %.3f, p %.2g; loss: t %.3f, p %.7f" % (time.statistic, time.pvalue, loss.statistic, '
            'loss.pvalue))']
    out += ["", "Calculation snippet:", "", "```python", *snippet, "```"]
    if comp:
        base = comp.baseline
        lo, hi = comp.ci_time
        t_time, df_time, p_time = comp.welch_time
        out += ["", "## Vs Baseline", "", "Baseline:", "",
                *_versions_lines(base), "",
                *_statistics_table(base), "",
                "Baseline losses and times:", "", "```python", *_values(base), "```", "",
                "Delta (candidate - baseline):", "",
                f"- train time: `{comp.delta_time:+.6f} s`",
                f"- {100 * (1 - comp.alpha):g}% confidence interval of the train time delta (Welch): "
                f"`{lo:+.6f} s` to `{hi:+.6f} s`",
                f"- relative train time: `{100 * comp.relative_time:+.6f}%`",
                f"- speedup: `{comp.speedup:.8f}x`",
                f"- val loss: `{comp.delta_loss:+.10f}`", "",
                "Statistical comparison:", "",
                f"- Welch p-value candidate loss vs baseline loss: `{comp.welch_loss[2]:.7f}`",
                f"- Welch t-statistic, baseline time minus candidate time: `{-t_time:.3f}` (df {df_time:.1f})",
                f"- Welch p-value candidate time vs baseline time: `{p_time:.2g}`",
                f"- slowest candidate run: `{max(cand.times):.3f} s`",
                f"- fastest baseline run: `{min(base.times):.3f} s`", "",
                f"Verdict: {comp.verdict}"]
    return "\n".join(out) + "\n"


# --- folders of sets -----------------------------------------------------------------------------

def is_baseline(name: str) -> bool:
    """A set named like a baseline: baseline/, baseline_pr299/, 12-19-Baseline/ (public folders)."""
    return "baseline" in name.lower()


def log_sets(folder: Path) -> dict[str, list[Path]]:
    """The sets of runs a folder holds: each subfolder with logs below it, by name, and '.' for
    logs directly in the folder (only when there are subfolders with logs too)."""
    files = expand_paths([folder])[0]
    sets: dict[str, list[Path]] = {}
    for f in files:
        rel = f.relative_to(folder).parts
        sets.setdefault(rel[0] if len(rel) > 1 else ".", []).append(f)
    if list(sets) == ["."]:
        return {}
    return dict(sorted(sets.items()))


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
                    "t-test that their mean loss is below the target; with --baseline (or a record "
                    "folder holding baseline/ and one candidate folder), the candidate against the "
                    "baseline: time difference with its 99%% confidence interval, speedup, Welch tests. "
                    "Exit 0 only when p < 0.01 (and the --time-claim holds, or the candidate is faster "
                    "with the interval below zero); 1 otherwise; 2 when no run counts or the runs "
                    "cannot be judged as one set. Runs of different code or GPU counts are never "
                    "pooled; runs of another preset, vocabulary or validation set than the record's "
                    "are listed as not counted.",
        epilog="examples: python records/check.py logs/a.txt logs/b.txt logs/c.txt --time-claim 170; "
               "python records/check.py records/<folder>  (holding baseline/ and candidate/); "
               "python records/check.py new/ --baseline old/ --markdown")
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR",
                    help="run logs; a directory means every .txt/.log file below it (a directory whose "
                         "subfolders hold logs: each subfolder is a set, see the description)")
    ap.add_argument("--baseline", nargs="+", action="extend", default=[], metavar="LOG_OR_DIR",
                    help="the baseline's runs (same node): compare LOG_OR_DIR... against them")
    ap.add_argument("--target", type=float, default=DEFAULT_TARGET,
                    help="validation loss to beat (default %(default)s)")
    ap.add_argument("--time-claim", type=float, default=None, metavar="SECONDS",
                    help="also test that the mean training time is below SECONDS (one set only)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the statistics.md of the public record folders instead of the table")
    args = ap.parse_args(argv)
    require_paths(args.logs + args.baseline)
    if args.baseline and args.time_claim is not None:
        raise UsageError("--time-claim is for one set of runs; with --baseline the claim is the "
                         "comparison (drop --time-claim)")

    names = ("baseline", "candidate")
    baseline, candidate = args.baseline, args.logs
    if not baseline and len(args.logs) == 1 and Path(args.logs[0]).is_dir():
        folder = Path(args.logs[0])
        sets = log_sets(folder)
        bases = [n for n in sets if is_baseline(n)]
        if len(sets) == 2 and len(bases) == 1:
            (other,) = [n for n in sets if n != bases[0]]
            baseline, candidate, names = [folder / bases[0]], [folder / other], (bases[0], other)
            if not args.markdown:
                print(f"{folder}: comparing {other}/ against {bases[0]}/")
        elif len(sets) == 1:
            candidate = [folder / next(iter(sets))]
        elif len(sets) > 1:
            judged = [(name, check(files if name == "." else [folder / name], target=args.target,
                                   time_claim=args.time_claim)) for name, files in sets.items()]
            print(f"{folder} holds {len(sets)} sets of runs, judged one by one (never pooled):")
            print("\n".join(_sets_table(judged)))
            others = [n for n in sets if n not in bases]
            hint = (f"python records/check.py {folder / others[0]} --baseline {folder / bases[0]}"
                    if bases and others else f"python records/check.py {folder / next(iter(sets))}")
            raise UsageError(f"{folder} holds {len(sets)} sets of runs ({', '.join(sets)}), not one "
                             f"baseline and one candidate: name the set(s) to judge, e.g. {hint}")
    if baseline:
        result = compare(baseline, candidate, target=args.target)
        print(statistics_md(result, "Statistics") if args.markdown else format_comparison(result, names))
        return result.exit_code
    result = check(candidate, target=args.target, time_claim=args.time_claim)
    print(statistics_md(result, "Statistics") if args.markdown else format_report(result))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
