"""Pair runs from tables that side_by_side.py wrote in different jobs: a baseline run once, its variants later.
Reads the validation-loss table (and the training-time table) of each file, groups the runs by label ("LABEL seed N"
columns; the public code's "public master seed N" too), and prints each group's final loss with its 95% interval and,
for every group after the base, the mean paired difference to the base over the seeds both ran; with --target, the
step at which each run's validation loss first reached the target, linear between validations, and that step as a
fraction of the run's own steps; with --tie (labels of one recipe at several step counts, repeatable), side_by_side's
tie table across the files: each seed's trained tokens at its public run's final loss, from each table's "Data:"
line of tokens trained. A run whose last validation comes before its label's steps on that line (a stopped run) is
left out, with a warning.

    python bench/pair_tables.py results/a_table.md results/b_table.md [...] --base record [--target 2.6709] \
        [--tie n760,n840 --tie b16n760,b16] [--public_finals 0:2.6704,1:2.6700,2:2.6677 --public_tokens 21176320] \
        [--finals n720@17694720=0:2.6509,1:2.6452]

--public_finals stands in for the public code's runs where a page quotes their finals but no table of them is kept:
each seed's final loss, at --public_tokens trained tokens (the public schedule's under the harness's rule). --finals
does the same for a label of ours (repeatable): LABEL@TOKENS=SEED:LOSS,..., e.g. p680@16711680=0:2.6671,1:2.6621.

The base defaults to the first label found. Runs of one name in two files must agree (the same run): otherwise the
later file's runs of that name are left out, with a warning."""
import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import finals_table, tie_table  # noqa: E402

COLUMN = re.compile(r"^(?P<label>.+) seed (?P<seed>\d+)$")
TRAINED = re.compile(r"(?:^|; )(?P<label>[^:;]+): (?P<steps>\d+) steps, (?P<tokens>[\d,]+) tokens trained")
FINALS = re.compile(r"^(?P<label>[^@=]+)@(?P<tokens>\d+)=(?P<pairs>.+)$")


def seed_losses(text: str) -> dict[int, float]:
    """{seed: final loss} from SEED:LOSS pairs, e.g. 0:2.6704,1:2.6700 (ValueError if malformed)."""
    return {int(seed): float(loss) for seed, loss in (item.split(":") for item in text.split(","))}


def data_line(path: Path) -> dict[str, tuple[int, int]]:
    """{label: (steps, tokens trained)} from a side_by_side.py table's "Data:" line (none without it)."""
    line = next((line for line in path.read_text().splitlines() if line.startswith("Data: ")), "")
    return {m["label"]: (int(m["steps"]), int(m["tokens"].replace(",", "")))
            for m in TRAINED.finditer(line[len("Data: "):])}


def trained_tokens(path: Path) -> dict[str, int]:
    """{label: tokens trained} from a table's "Data:" line."""
    return {label: tokens for label, (_, tokens) in data_line(path).items()}


def read_table(lines: list[str], start: int) -> tuple[list[str], dict[int, list[str]], int]:
    """The markdown table whose header is lines[start]: its column names and {step: cells}, and the next line."""
    names = [c.strip() for c in lines[start].strip().strip("|").split("|")][1:]
    rows, i = {}, start + 2  # past the header and the --- row
    while i < len(lines) and lines[i].startswith("|"):
        cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
        rows[int(cells[0])] = cells[1:]
        i += 1
    return names, rows, i


def parse(path: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{run: {step: (val loss, training ms)}} from one side_by_side.py table (ms 0 where no time table follows)."""
    lines = path.read_text().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("| step |")]
    if not headers:
        raise ValueError(f"{path}: no '| step |' table: not a side_by_side.py table")
    names, losses, after = read_table(lines, headers[0])
    times = {}
    timed = [i for i in headers if i >= after and any("Training time" in line for line in lines[after:i])]
    if timed:
        time_names, time_rows, _ = read_table(lines, timed[0])
        times = {(n, s): float(cells[k]) for s, cells in time_rows.items() for k, n in enumerate(time_names)
                 if cells[k] != "-"}
    runs = {}
    for k, name in enumerate(names):
        if not COLUMN.match(name):
            continue  # the "mean - mean" columns
        by_step = {s: (float(cells[k]), 1000 * times.get((name, s), 0.0)) for s, cells in losses.items()
                   if cells[k] != "-"}
        if by_step:  # a column of dashes: a run that never validated (it failed)
            runs[name] = by_step
    return runs


def crossing(by_step: dict[int, tuple], target: float) -> float | None:
    """The step at which the validation loss first reached the target, linear between validations."""
    steps = sorted(by_step)
    for a, b in zip(steps, steps[1:]):
        la, lb = by_step[a][0], by_step[b][0]
        if lb <= target:
            return float(a) if la <= target else a + (la - target) / (la - lb) * (b - a)
    return float(steps[0]) if steps and by_step[steps[0]][0] <= target else None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tables", nargs="+", type=Path, help="side_by_side.py tables (--out files)")
    parser.add_argument("--base", help="the label the others are paired with (default: the first label found)")
    parser.add_argument("--target", type=float, help="also the step each run first reached this validation loss")
    parser.add_argument("--tie", action="append", default=[], metavar="LABEL,LABEL[,...]",
                        help="labels of one recipe at several step counts: the tokens at which each seed's finals "
                             "reach its public run's final (repeatable; needs the public code's runs)")
    parser.add_argument("--public_finals", metavar="SEED:LOSS,...",
                        help="the public code's final losses by seed, from a page, where no table holds its runs")
    parser.add_argument("--public_tokens", type=int, help="with --public_finals: the tokens those runs trained")
    parser.add_argument("--finals", action="append", default=[], metavar="LABEL@TOKENS=SEED:LOSS,...",
                        help="a label of ours whose finals a page quotes, where no table holds its runs: their "
                             "trained tokens and each seed's final loss (repeatable)")
    a = parser.parse_args()
    results: dict[str, dict[int, tuple]] = {}
    tokens: dict[str, int] = {}

    def add_finals(label: str, finals: dict[int, float], trained: int):
        """Runs a page quotes: one validation each, the final one, at an arbitrary step (a table would say which)."""
        results.update({f"{label} seed {seed}": {1: (loss, 0.0)} for seed, loss in finals.items()})
        tokens[label] = trained

    if a.public_finals:
        if not a.public_tokens:
            parser.error("--public_finals needs --public_tokens (the public runs' trained tokens)")
        try:
            finals = seed_losses(a.public_finals)
        except ValueError:
            parser.error(f"--public_finals {a.public_finals}: expected SEED:LOSS pairs, e.g. 0:2.6704,1:2.6700")
        add_finals("public master", finals, a.public_tokens)
    quoted = set()  # the labels --finals gives
    for item in a.finals:
        m = FINALS.match(item)
        try:
            finals = seed_losses(m["pairs"]) if m else None
        except ValueError:
            finals = None
        if not finals or m["label"].startswith("public") or m["label"] in quoted:
            parser.error(f"--finals {item}: expected LABEL@TOKENS=SEED:LOSS,... once per label of ours, e.g. "
                         "p680@16711680=0:2.6671,1:2.6621")
        quoted.add(m["label"])
        add_finals(m["label"], finals, int(m["tokens"]))
    for path in a.tables:
        planned = data_line(path)
        for label, (_, n) in planned.items():
            tokens.setdefault(label, n)
        for name, by_step in parse(path).items():
            steps = planned.get(COLUMN.match(name)["label"], (0, 0))[0]
            if max(by_step) < steps:  # its last validation is not a final loss
                print(f"warning: {path}: {name!r} stopped at step {max(by_step)} of {steps}; left out",
                      file=sys.stderr)
                continue
            if a.public_finals and name.startswith("public"):
                parser.error(f"{path} holds the public code's runs ({name}): leave out --public_finals")
            if COLUMN.match(name)["label"] in quoted:
                parser.error(f"{path} holds runs of {name}: leave its label out of --finals")
            if name in results and results[name] != by_step:
                print(f"warning: {path}: {name!r} differs from the run of that name read before; left out",
                      file=sys.stderr)
                continue
            results[name] = by_step
    groups: dict[str, list[str]] = {}
    seeds = {}
    for name in results:
        m = COLUMN.match(name)
        groups.setdefault(m["label"], []).append(name)
        seeds[name] = int(m["seed"])
    base = a.base or next(iter(groups), None)
    if base not in groups:
        parser.error(f"--base {base}: no runs of that label; labels: {', '.join(groups) or 'none'}")
    groups = {base: groups[base], **{g: n for g, n in groups.items() if g != base}}
    print("\n".join(finals_table(results, groups, seeds)))
    if a.target is not None:
        print(f"\nFirst reached val loss <= {a.target} (linear between validations):\n")
        print("| run | step | of its steps |\n| --- | --- | --- |")
        for name in (n for members in groups.values() for n in members):
            hit, last = crossing(results[name], a.target), max(results[name])
            print(f"| {name} | {'not reached' if hit is None else f'{hit:.1f}'} | "
                  f"{'-' if hit is None else f'{hit / last:.3f}'} |")
    if a.tie:
        public = [g for g in groups if g.startswith("public")]
        recipes = {label: i for i, labels in enumerate(a.tie) for label in labels.split(",")}
        missing = [label for label in [*recipes, *public] if label not in tokens or label not in groups]
        if not public or missing:
            parser.error(f"--tie needs the public code's runs and each label's runs and tokens trained (a table's "
                         f"Data: line): missing {', '.join(missing) or 'the public runs'}")
        with_tokens = {name: {s: (*v, tokens[label]) for s, v in results[name].items()}
                       for label in [*recipes, *public] for name in groups[label]}
        print("\n" + "\n".join(tie_table(with_tokens, {**groups, "public": groups[public[0]]}, seeds, recipes)))


if __name__ == "__main__":
    main()
