#!/usr/bin/env python3
"""Plot validation loss of speedrun logs against training time and against step.

    python records/plot.py LOG_OR_DIR... -o runs.png [--ymin 3.2] [--ymax 4.5] [--linear]

A file argument is one run (one line). A directory argument is one group, e.g. a record folder:
the mean of its runs at each validation step, with the min-max band around it. The target loss
is drawn as a dashed horizontal line; the loss axis is logarithmic and zoomed on the tail.
Works headless: the figure is drawn with matplotlib's Agg canvas, no display needed.
"""
from __future__ import annotations

import argparse
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
            series.append(Series(p.stem, steps, time_s, loss))
            continue
        pts = [_points(r) for r in runs]
        common = sorted(set.intersection(*(set(s.tolist()) for s, _, _ in pts)))
        if not common:
            warnings.append(f"{p}: its runs share no validation step, not plotted")
            continue
        idx = [np.searchsorted(s, common) for s, _, _ in pts]
        loss = np.stack([l[i] for (_, _, l), i in zip(pts, idx)])
        time_s = np.stack([t[i] for (_, t, _), i in zip(pts, idx)])
        name = p.resolve().name or str(p)
        if len(runs) == 1:
            series.append(Series(f"{name} (1 run)", np.array(common), time_s[0], loss[0]))
        else:
            series.append(Series(f"{name} (mean of {len(runs)} runs, min-max band)",
                                 np.array(common), time_s.mean(0), loss.mean(0),
                                 loss.min(0), loss.max(0)))
    return series, warnings


def _loss_ticks(ymin: float, ymax: float) -> list[float]:
    span = ymax - ymin
    step = next(s for s in (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0) if span / s <= 10)
    first = np.ceil(ymin / step - 1e-9) * step
    return [round(float(v), 6) for v in np.arange(first, ymax + 1e-9, step)]


def plot_runs(args: Iterable[Path | str], out: Path | str | None = None, *, ymin: float = 3.2,
              ymax: float = 4.5, target: float = check.DEFAULT_TARGET, log_y: bool = True,
              title: str | None = None) -> Figure:
    """Draw the two panels; save to `out` when given; return the Figure."""
    series, warnings = load_series(args)
    for w in warnings:
        print(f"plot.py: {w}", file=sys.stderr)
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
        ax.axhline(target, color="crimson", linestyle="--", linewidth=1.2, label=f"target {target:g}")
        ax.set_xlabel("training time (s)" if use_time else "step")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlim(left=0)
    if log_y:
        ax_time.set_yscale("log")
    ax_time.set_ylim(ymin, ymax)
    ax_time.yaxis.set_major_locator(FixedLocator(_loss_ticks(ymin, ymax)))
    ax_time.yaxis.set_major_formatter(FormatStrFormatter("%.2f"))
    ax_time.yaxis.set_minor_formatter(NullFormatter())
    ax_time.set_ylabel("validation loss" + (" (log scale)" if log_y else ""))
    ax_time.set_title("against training time")
    ax_step.set_title("against step")
    ax_time.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="plot.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", metavar="LOG_OR_DIR",
                    help="a log file (one line) or a directory (one group: mean and min-max band)")
    ap.add_argument("-o", "--out", default="runs.png", help="PNG to write (default %(default)s)")
    ap.add_argument("--ymin", type=float, default=3.2, help="loss axis bottom (default %(default)s)")
    ap.add_argument("--ymax", type=float, default=4.5, help="loss axis top (default %(default)s)")
    ap.add_argument("--target", type=float, default=check.DEFAULT_TARGET,
                    help="horizontal target line (default %(default)s)")
    ap.add_argument("--linear", action="store_true", help="linear loss axis instead of log")
    ap.add_argument("--title", default=None, help="figure title")
    args = ap.parse_args(argv)
    if not args.ymin < args.ymax or (not args.linear and args.ymin <= 0):
        ap.error("need 0 < --ymin < --ymax (or --linear)")
    fig = plot_runs(args.logs, args.out, ymin=args.ymin, ymax=args.ymax, target=args.target,
                    log_y=not args.linear, title=args.title)
    n = sum(1 for ax in fig.axes[:1] for line in ax.get_lines() if line.get_gid() == RUN_GID)
    if n == 0:
        print("plot.py: nothing to plot", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({n} line(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
