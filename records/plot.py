#!/usr/bin/env python3
"""Plot validation loss of speedrun logs against training time and against step.

    python records/plot.py LOG_OR_DIR... -o runs.png [--ymin 3.2] [--ymax 4.5] [--linear]

A file argument is one run (one line). A directory argument is one group, e.g. a record folder:
the mean of its runs at each validation step, with the min-max band around it. The target loss
is drawn as a dashed horizontal line; the loss axis is logarithmic and zoomed on the tail: it
spans the validation losses after step 0 (the untrained model's ~ln(vocab) would squash the rest),
and the target when it lies near them; --ymin/--ymax fix either end.

The legend names each run by its run id (the log's file name), preset, final validation loss and
date. The preset comes from the log's hyperparameter lines, the date from nvidia-smi's report in
the log, else from a date in the path (records/2025-09-03_X/, the public speedrun's 090325_X/),
else from the file's modification time; what a log does not say is left out (the public
speedrun's logs name no preset). Works headless: the figure is drawn with matplotlib's Agg
canvas, no display needed.
"""
from __future__ import annotations

import argparse
import datetime
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check  # noqa: E402  (records/check.py: the log parser)

import numpy as np  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter  # noqa: E402

RUN_GID = "run"  # gid of the one line each run or group gets (tests count these)
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_ISO_DATE_RE = re.compile(r"^(\d{4}-\d{2}-\d{2})(?:_|$)")  # records/2025-09-03_Name (new.py)
_MMDDYY_RE = re.compile(r"^(\d{2})(\d{2})(\d{2})_")  # modded-nanogpt's records/090325_FA3


@dataclass
class Series:
    label: str
    steps: np.ndarray
    time_s: np.ndarray
    loss: np.ndarray                 # mean for a group
    lo: np.ndarray | None = None     # min-max band of a group
    hi: np.ndarray | None = None


def _points(run: check.RunLog) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # one point per step (the last line wins), in step order
    by_step = {s: (loss, ms) for s, loss, ms in run.val}
    steps = np.array(sorted(by_step), dtype=float)
    loss = np.array([by_step[s][0] for s in sorted(by_step)], dtype=float)
    time_s = np.array([by_step[s][1] for s in sorted(by_step)], dtype=float) / 1000.0
    return steps, time_s, loss


def run_id(path: Path) -> str:
    """The run id a log is named after; a uuid shortened to its first 8 characters."""
    return path.stem[:8] if _UUID_RE.fullmatch(path.stem) else path.stem


def _path_date(path: Path) -> str | None:
    for part in reversed(path.resolve().parts[:-1]):
        m = _ISO_DATE_RE.match(part)
        if m:
            text = m.group(1)
        else:
            m = _MMDDYY_RE.match(part)
            if not m:
                continue
            text = f"20{m.group(3)}-{m.group(1)}-{m.group(2)}"
        try:
            return datetime.date.fromisoformat(text).isoformat()
        except ValueError:
            continue
    return None


def run_date(run: check.RunLog) -> str | None:
    """YYYY-MM-DD: from the log (nvidia-smi), else a date in its path, else its modification time."""
    if run.date:
        return run.date
    date = _path_date(run.path)
    if date:
        return date
    try:
        return datetime.date.fromtimestamp(run.path.stat().st_mtime).isoformat()
    except OSError:
        return None


def _final(run: check.RunLog) -> str:
    if run.final_loss is not None:
        return f"val {run.final_loss:.4f}"
    step, loss, _ = max(run.val)  # unfinished: the last validation it made
    return f"val {loss:.4f} at step {step}/{run.total_steps}" if run.total_steps else f"val {loss:.4f}"


def run_label(run: check.RunLog) -> str:
    """e.g. 'uxsmoke: smoke, val 1.7276, 2025-11-23'; a public log: '44fc1276: val 3.2783, 2025-09-03'."""
    parts = [run.preset, _final(run), run_date(run)]
    return f"{run_id(run.path)}: " + ", ".join(p for p in parts if p)


def group_label(name: str, runs: Sequence[check.RunLog]) -> str:
    presets = sorted({r.preset for r in runs if r.preset})
    finals = [r.final_loss for r in runs if r.final_loss is not None]
    dates = sorted({d for d in map(run_date, runs) if d})
    parts = [", ".join(presets) or None,
             f"{'mean val' if len(finals) > 1 else 'val'} {sum(finals) / len(finals):.4f}" if finals else None,
             (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") if dates else None]
    what = f"mean of {len(runs)} runs, min-max band" if len(runs) > 1 else "1 run"
    return f"{name}: " + ", ".join(p for p in parts if p) + f" ({what})"


def load_series(args: Iterable[Path | str]) -> tuple[list[Series], list[str]]:
    """One Series per file argument, one per directory argument; plus warnings."""
    series: list[Series] = []
    warnings: list[str] = []
    for arg in args:
        p = Path(arg)
        seen: set[str] = set()  # duplicates are dropped within one argument (a group)
        files, problems = check.expand_paths([p])
        warnings += [f"{q}: {why}" for q, why in problems]
        runs = []
        for f in files:
            run = check.parse_log(f)
            if run.sha256 in seen:
                warnings.append(f"{f}: same contents as another log of {p}, skipped")
                continue
            seen.add(run.sha256)
            if not run.val:
                warnings.append(f"{f}: no validation lines ({run.error or 'nothing to plot'})")
                continue
            if run.error:
                warnings.append(f"{f}: plotted, but {run.error}")
            runs.append(run)
        if not runs:
            continue
        if not p.is_dir():
            steps, time_s, loss = _points(runs[0])
            series.append(Series(run_label(runs[0]), steps, time_s, loss))
            continue
        pts = [_points(r) for r in runs]
        common = sorted(set.intersection(*(set(s.tolist()) for s, _, _ in pts)))
        if not common:
            warnings.append(f"{p}: its runs share no validation step, not plotted")
            continue
        idx = [np.searchsorted(s, common) for s, _, _ in pts]
        loss = np.stack([l[i] for (_, _, l), i in zip(pts, idx)])
        time_s = np.stack([t[i] for (_, t, _), i in zip(pts, idx)])
        label = group_label(p.resolve().name or str(p), runs)
        if len(runs) == 1:
            series.append(Series(label, np.array(common), time_s[0], loss[0]))
        else:
            series.append(Series(label, np.array(common), time_s.mean(0), loss.mean(0),
                                 loss.min(0), loss.max(0)))
    return series, warnings


_TICK_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def _tick_step(ymin: float, ymax: float) -> float:
    return next((s for s in _TICK_STEPS if (ymax - ymin) / s <= 10), _TICK_STEPS[-1])


def _loss_ticks(ymin: float, ymax: float) -> list[float]:
    step = _tick_step(ymin, ymax)
    first = np.ceil(ymin / step - 1e-9) * step
    return [round(float(v), 6) for v in np.arange(first, ymax + 1e-9, step)]


def auto_ylim(series: Sequence[Series], target: float | None, log_y: bool = True) -> tuple[float, float]:
    """The loss axis range: the validation losses after step 0 (all of them if there are no
    others), widened to the target when it lies within 10% of them, with a 5% margin."""
    def values(after_start: bool) -> np.ndarray:
        parts = []
        for s in series:
            keep = s.steps > 0 if after_start else np.ones_like(s.steps, dtype=bool)
            parts += [s.loss[keep]] + ([s.lo[keep], s.hi[keep]] if s.lo is not None else [])
        v = np.concatenate(parts) if parts else np.zeros(0)
        return v[np.isfinite(v) & (v > 0 if log_y else True)]

    v = values(after_start=True)
    v = v if v.size else values(after_start=False)
    if not v.size:
        return (3.2, 4.5)  # nothing to fit: the record's tail
    lo, hi = float(v.min()), float(v.max())
    if target is not None and lo / 1.1 <= target <= hi * 1.1:
        lo, hi = min(lo, target), max(hi, target)
    if log_y:
        pad = (hi / lo) ** 0.05 if hi > lo else 1.02
        return lo / pad, hi * pad
    pad = 0.05 * (hi - lo) if hi > lo else 0.02 * abs(hi) or 0.1
    return lo - pad, hi + pad


def plot_runs(args: Iterable[Path | str], out: Path | str | None = None, *,
              ymin: float | None = None, ymax: float | None = None,
              target: float = check.DEFAULT_TARGET, log_y: bool = True,
              title: str | None = None) -> Figure:
    """Draw the two panels; save to `out` when given; return the Figure. ymin/ymax: the loss axis
    ends (None: fitted to the data, auto_ylim). Raises check.UsageError when nothing can be
    plotted, naming why."""
    series, warnings = load_series(args)
    if not series:
        raise check.UsageError("nothing to plot" + (f" ({'; '.join(warnings)})" if warnings else ""))
    for w in warnings:
        print(f"plot.py: warning: {w}", file=sys.stderr)
    auto = auto_ylim(series, target, log_y)
    ymin = auto[0] if ymin is None else ymin
    ymax = auto[1] if ymax is None else ymax
    if not ymin < ymax or (log_y and ymin <= 0):
        raise check.UsageError(f"loss axis {ymin:g} to {ymax:g}: need 0 < --ymin < --ymax "
                               "(or --linear)")
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_step = fig.subplots(1, 2, sharey=True)
    for ax, use_time in ((ax_time, True), (ax_step, False)):
        for s in series:
            x = s.time_s if use_time else s.steps
            (line,) = ax.plot(x, s.loss, marker=".", markersize=4, linewidth=1.4, label=s.label)
            line.set_gid(RUN_GID)
            if s.lo is not None:
                ax.fill_between(x, s.lo, s.hi, color=line.get_color(), alpha=0.2, linewidth=0)
        off = "" if ymin <= target <= ymax else " (off the axis)"
        ax.axhline(target, color="crimson", linestyle="--", linewidth=1.2, label=f"target {target:g}{off}")
        ax.set_xlabel("training time (s)" if use_time else "step")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlim(left=0)
    if log_y:
        ax_time.set_yscale("log")
    ax_time.set_ylim(ymin, ymax)
    ax_time.yaxis.set_major_locator(FixedLocator(_loss_ticks(ymin, ymax)))
    decimals = max(2, -int(np.floor(np.log10(_tick_step(ymin, ymax)) + 1e-9)))
    ax_time.yaxis.set_major_formatter(FormatStrFormatter(f"%.{decimals}f"))
    ax_time.yaxis.set_minor_formatter(NullFormatter())
    ax_time.set_ylabel("validation loss" + (" (log scale)" if log_y else ""))
    ax_time.set_title("against training time")
    ax_step.set_title("against step")
    ax_time.legend(loc="best", fontsize=8)
    if title:
        fig.suptitle(title)
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    return check.run_cli("plot.py", _main, argv)


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plot.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR",
                    help="a log file (one line) or a directory (one group: mean and min-max band)")
    ap.add_argument("-o", "--out", default="runs.png", help="PNG to write (default %(default)s)")
    ap.add_argument("--ymin", type=float, default=None,
                    help="loss axis bottom (default: fitted to the data)")
    ap.add_argument("--ymax", type=float, default=None,
                    help="loss axis top (default: fitted to the data)")
    ap.add_argument("--target", type=float, default=check.DEFAULT_TARGET,
                    help="horizontal target line (default %(default)s)")
    ap.add_argument("--linear", action="store_true", help="linear loss axis instead of log")
    ap.add_argument("--title", default=None, help="figure title")
    args = ap.parse_args(argv)
    check.require_paths(args.logs)
    fig = plot_runs(args.logs, args.out, ymin=args.ymin, ymax=args.ymax, target=args.target,
                    log_y=not args.linear, title=args.title)
    n = sum(1 for ax in fig.axes[:1] for line in ax.get_lines() if line.get_gid() == RUN_GID)
    print(f"wrote {args.out} ({n} line(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
