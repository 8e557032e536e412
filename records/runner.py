"""What records/interleave.py and records/calibrate.py share: training runs launched one after another,
each into a log whose name is known in advance, and a set of runs resumed where it stopped.

A run is the training script launched from its checkout's folder with `--run_id ID --log_dir DIR`,
so train_gpt.py writes its log to DIR/ID.txt. The log is complete when check.py reads its final
validation line (`step:T/T val_loss:...`) and the trainer's closing line `finished at step T/T: ...`
is there too; a run with a complete log is never run again. Any other log (a crash, or Ctrl-C:
`stopped at step N/T`) is partial: before the run is tried again, the partial log is moved to
<folder>/partial/ID.txt.partial, where check.py does not read it, and the new try gets the id
ID-try2 (then -try3, ...), because an interrupted run has saved a checkpoint under
checkpoints/ID/ and train_gpt.py refuses to start a new run in a folder of checkpoints.

Each run's console output goes to <folder>/console/ID.out. Nothing here parses a log itself:
check.parse_text and logparse.py do.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent  # the checkout these tools belong to: the default one to run
sys.path.insert(0, str(HERE))
import check  # noqa: E402
import logparse  # noqa: E402

FAILED = 3  # exit status of a tool whose run failed (0, 1 and 2 are check.py's)
PARTIAL_DIR = "partial"
CONSOLE_DIR = "console"
_TRY_RE = re.compile(r"-try(\d+)$")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in one line, `tool: error: ...` (exit 2), as every other error."""

    def error(self, message: str):
        raise check.UsageError(f"{message} (python records/{self.prog} --help lists the options)")


def tool_parser(prog: str, doc: str, usage: str, examples: str) -> ArgumentParser:
    """The command-line parser of a runner tool: its module docstring's third paragraph on as the
    description, its examples as the epilog, and the launch options every such tool takes."""
    ap = ArgumentParser(prog=prog, description=doc.split("\n\n", 2)[2], usage=usage, epilog=examples,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc_per_node", type=int, default=None, metavar="N",
                    help="processes (GPUs) per run for torchrun (default: every visible GPU)")
    ap.add_argument("--launch", default=None, metavar="CMD",
                    help="the command before the script instead of torchrun, e.g. 'python' for one process; "
                         "{nproc} in it becomes the process count")
    ap.add_argument("--dry_run", action="store_true", help="print the commands in order and run nothing")
    return ap


class RunFailed(Exception):
    """A run ended without a complete log: the tool stops, exit status FAILED."""


@dataclasses.dataclass
class Run:
    label: str          # what the progress lines call it, e.g. "pair 2 candidate (seed 1)"
    run_id: str         # the first try's id; later tries add -try2, -try3, ...
    cwd: Path           # the checkout it runs in
    script: str         # the training script, relative to cwd
    flags: list[str]    # everything after the script but --run_id and --log_dir
    log_dir: Path       # where its log goes (the folder of its set)


@dataclasses.dataclass
class Status:
    done: check.RunLog | None         # the complete log, if any
    partial: list[Path]               # partial logs still in the set's folder
    next_id: str                      # the id of the next try


def read_log(path: Path) -> check.RunLog:
    """check.py's reading of a log, with `error` also set when the trainer's closing line for the
    final step is missing: `ok` means the run is complete."""
    raw = path.read_bytes()
    text = raw.decode("utf-8", "surrogateescape")
    run = check.parse_text(text, path)
    if run.ok:
        t = run.total_steps
        if (t, t) not in logparse.closing_steps(text):
            run.error = f"no closing line 'finished at step {t}/{t}: ...' after the final validation"
    return run


def _try_number(name: str, run_id: str) -> int | None:
    """1 for RUN_ID, k for RUN_ID-tryk, None for another run's name (without suffix)."""
    if name == run_id:
        return 1
    m = _TRY_RE.search(name)
    if m and name[:m.start()] == run_id and int(m.group(1)) >= 2:
        return int(m.group(1))
    return None


def tries_in(folder: Path, run_id: str, suffix: str) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        if p.is_file() and p.name.endswith(suffix):
            k = _try_number(p.name[:-len(suffix)], run_id)
            if k is not None:
                found.append((k, p))
    return sorted(found)


def status(run: Run, partial_dir: Path) -> Status:
    here = tries_in(run.log_dir, run.run_id, ".txt")
    aside = tries_in(partial_dir, run.run_id, ".txt.partial")
    complete, partial = [], []
    for _, p in here:
        log = read_log(p)
        (complete if log.ok else partial).append(log)
    if len(complete) > 1:
        names = ", ".join(str(r.path) for r in complete)
        raise check.UsageError(f"{run.label}: {len(complete)} complete logs ({names}); "
                               f"keep one and move the others out of {run.log_dir}")
    k = max([n for n, _ in here + aside], default=0) + 1
    return Status(done=complete[0] if complete else None, partial=[r.path for r in partial],
                  next_id=run.run_id if k == 1 else f"{run.run_id}-try{k}")


def refuse_foreign_logs(runs: Sequence[Run], folders: Sequence[Path], hint: str) -> None:
    """Every .txt/.log file in the sets' folders must be a try of a planned run; check.py would
    count any other file with them."""
    for folder in folders:
        for f in check.expand_paths([folder])[0] if folder.is_dir() else []:
            if not any(f.parent == r.log_dir and f.suffix == ".txt"
                       and _try_number(f.stem, r.run_id) is not None for r in runs):
                raise check.UsageError(f"{f}: not a run of this plan ({hint}); check.py would count it with the "
                                       f"others: move it out of {folder}")


def visible_gpus() -> int:
    """NVIDIA GPUs that `nvidia-smi -L` lists, no more than CUDA_VISIBLE_DEVICES names (as run.sh counts)."""
    count = 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        if listing.returncode == 0:
            count = sum(1 for line in listing.stdout.splitlines() if re.match(r"GPU \d+", line))
    except (OSError, subprocess.SubprocessError):
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([x for x in visible.split(",") if x.strip()]))
    return count


def launch_prefix(launch: str | None, nproc: int | None) -> list[str]:
    """The command before the script: `torchrun --standalone --nproc_per_node=N` by default (N: every
    visible GPU), or --launch with {nproc} replaced."""
    if nproc is not None and nproc < 1:
        raise check.UsageError(f"--nproc_per_node {nproc}: give 1 or more")
    if launch is not None and "{nproc}" not in launch:
        if nproc is not None:
            raise check.UsageError("--nproc_per_node is used by the default torchrun launch or by {nproc} in "
                                   "--launch: put {nproc} in --launch, or drop --nproc_per_node")
    elif nproc is None:
        nproc = visible_gpus()
        if nproc == 0:
            raise check.UsageError("no NVIDIA GPU visible (nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES hides "
                                   "them): give --nproc_per_node N, or --launch python to run each run as one process")
    if launch is None:
        return ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    prefix = shlex.split(launch.replace("{nproc}", str(nproc)))
    if not prefix:
        raise check.UsageError("--launch is empty: give a command such as 'torchrun --standalone "
                               "--nproc_per_node={nproc}' or 'python'")
    return prefix


def require_launcher(prefix: Sequence[str]) -> None:
    """Before anything is made: the launch command is there (a bare name: on PATH)."""
    if "/" not in prefix[0] and shutil.which(prefix[0]) is None:
        raise check.UsageError(f"{prefix[0]}: command not found: install PyTorch (pip install -r requirements.txt) "
                               "for torchrun, or give --launch")


def refuse_flags(flags: Sequence[str], names: Sequence[str], where: str, tool: str) -> None:
    """Flags the tool sets itself may not be given: one line naming the flag and where it was."""
    for f in flags:
        if f.startswith("--") and f[2:].split("=", 1)[0] in names:
            ours = ", ".join("--" + n for n in names)
            raise check.UsageError(f"{where}: {f.split('=', 1)[0]} is set by {tool} for each run ({ours}); "
                                   "leave it out")


def split_trainer_flags(argv: Sequence[str] | None) -> tuple[list[str], list[str]]:
    """(the tool's arguments, the trainer flags after the first `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def check_settings(out: Path, name: str, settings: dict, fixed: Sequence[str], tool: str, dry_run: bool) -> None:
    """out/name records the settings the folder's runs were made with. A resume with other values of
    the fixed keys is refused (its runs would be mixed with the old ones); a folder with files but
    no such record is refused too. Written unless dry_run."""
    path = out / name
    settings = json.loads(json.dumps(settings))  # as it reads back: tuples become lists
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise check.UsageError(f"{path}: unreadable ({e}); give a new folder") from None
        diffs = [f"{k}: {saved.get(k)!r} then, {settings[k]!r} now" for k in fixed if saved.get(k) != settings[k]]
        if diffs:
            raise check.UsageError(f"{path}: the runs in {out} were made with other settings ({'; '.join(diffs)}): "
                                   "rerun with the same settings, or give a new folder")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise check.UsageError(f"{out}: exists and has no {name}, so {tool} did not make it: give a new folder")
    if not dry_run:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings, indent=2) + "\n")


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(seconds)))


def _result(log: check.RunLog) -> str:
    return f"val_loss {log.final_loss:.4f}, train_time {log.final_time_s:.3f} s"


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def _wait(cmd: list[str], cwd: Path, console: Path) -> tuple[int, str | None]:
    """Run cmd with its output in console: (its exit status, what stopped this tool meanwhile: None,
    "Ctrl-C" or "SIGTERM"). Ctrl-C reaches the run too (it finishes its step and saves a checkpoint),
    so the run is waited for; a second Ctrl-C sends it SIGTERM, a third SIGKILL. A SIGTERM to this
    process is passed on to the run."""
    with open(console, "w") as f:
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        except FileNotFoundError:
            raise check.UsageError(f"{cmd[0]}: command not found: install PyTorch (pip install -r requirements.txt) "
                                   "for torchrun, or give --launch") from None
        stopped: list[str] = []

        def forward(signum, frame):
            stopped.append("SIGTERM")
            proc.send_signal(signum)
        try:
            previous = signal.signal(signal.SIGTERM, forward)
        except ValueError:  # not the main thread
            previous = None
        try:
            while True:
                try:
                    return proc.wait(), (stopped[0] if stopped else None)
                except KeyboardInterrupt:
                    stopped.insert(0, "Ctrl-C")
                    if stopped.count("Ctrl-C") == 1:
                        print("interrupted: waiting for the run to stop (Ctrl-C again sends it SIGTERM)",
                              file=sys.stderr, flush=True)
                    elif stopped.count("Ctrl-C") == 2:
                        proc.terminate()
                    else:
                        proc.kill()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _stop(signalled: str) -> None:
    """Leave as the signal asked: KeyboardInterrupt for Ctrl-C (exit 130), 128 + 15 for SIGTERM."""
    if signalled == "Ctrl-C":
        raise KeyboardInterrupt
    raise SystemExit(128 + signal.SIGTERM)


def execute(runs: Sequence[Run], prefix: Sequence[str], out: Path, dry_run: bool,
            say: Callable[[str], None] = print) -> list[check.RunLog]:
    """Run what is not done, in order; the complete logs, in the order of runs. With dry_run, print
    the commands instead (and what would be skipped or moved) and return the logs already complete.
    Raises RunFailed when a run ends without a complete log."""
    partial_dir, console_dir = out / PARTIAL_DIR, out / CONSOLE_DIR
    start = time.monotonic()
    done: list[check.RunLog] = []
    total = len(runs)
    for k, run in enumerate(runs, 1):
        tag = f"run {k}/{total}"
        st = status(run, partial_dir)
        if st.done is not None:
            say(f"{'# ' if dry_run else f'[{_clock(time.monotonic() - start)}] '}{tag} done before: {run.label}: "
                f"{_result(st.done)} ({st.done.path})")
            done.append(st.done)
            continue
        for p in st.partial:
            dest = partial_dir / (p.name + ".partial")
            if dry_run:
                say(f"# {tag}: the partial log {p} would be moved to {dest}")
            else:
                partial_dir.mkdir(parents=True, exist_ok=True)
                os.replace(p, dest)
                say(f"[{_clock(time.monotonic() - start)}] {tag}: moved the partial log {p} to {dest}")
        log_path = run.log_dir / f"{st.next_id}.txt"
        cmd = [*prefix, run.script, *run.flags, "--run_id", st.next_id, "--log_dir", str(run.log_dir.resolve())]
        if dry_run:
            say(f"# {tag}: {run.label} -> {log_path}")
            say(f"cd {shlex.quote(str(run.cwd))} && {shlex.join(cmd)}")
            continue
        run.log_dir.mkdir(parents=True, exist_ok=True)
        console_dir.mkdir(parents=True, exist_ok=True)
        console = console_dir / f"{st.next_id}.out"
        t0 = time.monotonic()
        say(f"[{_clock(t0 - start)}] {tag} started: {run.label} -> {log_path}")
        code, signalled = _wait(cmd, run.cwd, console)
        t1 = time.monotonic()
        log = read_log(log_path) if log_path.is_file() else None
        if log is None or not log.ok:
            what = (f"its log {log_path} is partial ({log.error})" if log is not None else
                    f"it wrote no log {log_path}" + (f" (does {run.script} take --run_id and --log_dir?)"
                                                     if code == 0 and not signalled else ""))
            if signalled:
                say(f"[{_clock(t1 - start)}] {tag} stopped by {signalled} after {t1 - t0:.1f} s: {run.label}: {what}; "
                    "the same command runs it again (a partial log is moved aside)")
                _stop(signalled)
            last = _last_line(console)
            raise RunFailed(f"{tag}, {run.label}, failed (exit {code}) after {t1 - t0:.1f} s: {what}; its output is "
                            f"in {console}" + (f", ending {last!r}" if last else "") +
                            "; run the same command again to retry it (a partial log is moved aside)")
        say(f"[{_clock(t1 - start)}] {tag} finished in {t1 - t0:.1f} s: {run.label}: {_result(log)}"
            + (f" (exit status {code}, but the log is complete)" if code else ""))
        if signalled:
            _stop(signalled)
        done.append(log)
    return done


def command_line(tool: str, argv: Sequence[str]) -> str:
    """The command that ran a tool, as run from the repository root, for a summary."""
    return shlex.join(["python", f"records/{tool}", *argv])
