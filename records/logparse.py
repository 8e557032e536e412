"""Reading run logs: train_gpt.py's (logs/<run_id>.txt) and the public speedrun's. The one parser of records/
(check.py, runner.py, new.py) and bench/ (side_by_side.py, curves.py).

A log is the source code, a line of 100 '=', the environment report (versions, nvidia-smi), another line of
100 '=', the hyperparameters as `name: value` lines (ours; the public logs have none), then the run. The run's
lines read here, as the trainer writes them:

    step:1670/1670 val_loss:3.2771 train_time:163812ms step_avg:98.09ms tokens:...   a validation
    step:5/1670 train_time:1234ms step_avg:246.80ms                                  a training step
    train_loss per step 1-1670: 10.8258 9.9012 ...                                  every step's train loss
    finished at step 1670/1670: training time 163.8s (98.1 ms/step), ...            the closing line
    harness: stage boundaries [(0, 423), (423, 847), ...]                           bench/side_by_side.py's stages

Run lines are only read after the code (a line inside the code is an example, never a result). A step line's
fields are read wherever they stand after `step:N/T` (the public logs of every era differ in what follows).
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

SEPARATOR = "=" * 100

STEP_RE = re.compile(r"^step:(\d+)/(\d+)(?=\s|$)(.*)$")  # any step line: step, total steps, the rest
VAL_RE = re.compile(r"(?:^|\s)val_loss:(\S+)")
TIME_RE = re.compile(r"(?:^|\s)train_time:([0-9]+(?:\.[0-9]*)?)ms")
TOKENS_RE = re.compile(r"\stokens:([\d,]+)")  # ours: training tokens before this validation
PARAM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):(?: (.*))?$")  # a hyperparameter line, `name: value`
CURVE_RE = re.compile(r"^train_loss per step (\d+)-(\d+): (.*)$", re.M)
CLOSING_RE = re.compile(r"^finished at step (\d+)/(\d+):", re.M)
STAGES_RE = re.compile(r"^harness: stage boundaries (\[.*\])$")


def split_code(text: str) -> tuple[str | None, str]:
    """(code, rest): the code is everything before the first line of exactly 100 '='; None without one."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i]), "".join(lines[i + 1:])
    return None, text


def header(rest: str) -> tuple[dict[str, str], list[str]]:
    """(hyperparameters, environment report) from what follows the code: the report up to the
    second line of 100 '=', then the block of `name: value` lines right after it (the first value
    wins)."""
    env, params = [], {}
    lines = iter(rest.splitlines())
    for line in lines:
        if line.rstrip("\r") == SEPARATOR:
            break
        env.append(line.rstrip("\r"))
    else:
        return {}, []  # no second separator: no hyperparameter block
    for line in lines:
        m = PARAM_RE.match(line.rstrip("\r"))
        if m is None:
            break
        params.setdefault(m.group(1), (m.group(2) or "").strip())
    return params, env


@dataclass
class StepLine:
    step: int
    total: int
    val_loss: str | None  # as written ("3.2771", "nan"): a validation line; None: a training step's
    time_ms: float | None  # train_time, where the line says it
    tokens: int | None  # training tokens so far, where the line says them (ours)


def step_line(line: str) -> StepLine | None:
    """One `step:N/T ...` line's fields; None for any other line."""
    m = STEP_RE.match(line.strip())
    if m is None:
        return None
    rest = m.group(3)
    v, t, k = VAL_RE.search(rest), TIME_RE.search(rest), TOKENS_RE.search(rest)
    return StepLine(int(m.group(1)), int(m.group(2)), v and v.group(1), t and float(t.group(1)),
                    k and int(k.group(1).replace(",", "")))


def run_lines(text: str) -> list[str]:
    """The lines after the code (all of them in a log without a code section)."""
    return split_code(text)[1].splitlines()


def step_lines(text: str) -> list[StepLine]:
    return [s for s in map(step_line, run_lines(text)) if s is not None]


def val_losses(text: str) -> dict[int, tuple[float, int, int | None]]:
    """{step: (val loss, training ms, training tokens so far)} of the validation lines that give a loss and a
    time; the tokens are None where the line does not say them (the public code's lines)."""
    out = {}
    for s in step_lines(text):
        if s.val_loss is not None and s.time_ms is not None:
            try:
                out[s.step] = (float(s.val_loss), int(s.time_ms), s.tokens)
            except ValueError:  # an unreadable loss
                pass
    return out


def step_times(text: str) -> dict[int, int]:
    """{n: training ms after n steps} from the training steps' lines (not the validations')."""
    return {s.step: int(s.time_ms) for s in step_lines(text) if s.val_loss is None and s.time_ms is not None}


def train_curve(text: str) -> dict[int, float] | None:
    """{step: train loss} from the `train_loss per step` line a finished run of ours writes; None without one."""
    m = CURVE_RE.search(split_code(text)[1])
    return None if m is None else {int(m[1]) + i: float(x) for i, x in enumerate(m[3].split())}


def closing_steps(text: str) -> list[tuple[int, int]]:
    """(N, T) of each closing line `finished at step N/T: ...` after the code."""
    return [(int(m[1]), int(m[2])) for m in CLOSING_RE.finditer(split_code(text)[1])]


def stage_boundaries(text: str) -> list[tuple[int, int]] | None:
    """The [(start, end), ...] of the first `harness: stage boundaries` line; None without one."""
    for line in run_lines(text):
        m = STAGES_RE.match(line)
        if m:
            return [tuple(b) for b in ast.literal_eval(m[1])]
    return None
