#!/usr/bin/env python3
"""Side-by-side harness: the public 2025-09-03 record's own code against ours, same shards, same GPU.

    python bench/fidelity_0903.py --public PATH/TO/modded-nanogpt \\
        --train_files "DIR/fineweb_train_*.bin" --val_files "DIR/fineweb_val_*.bin" \\
        [--steps 400] [--val_every 50] [--batch_size 131072] \\
        [--val_tokens 983040] [--val_seq_len 40960] [--seeds 0 1] [--public_seeds 0 1] [--parallel] [--out table.md]
        [--ours_args "FLAGS"] [--variant NAME "FLAGS" ...]

The public script is the source embedded at the top of the record's logs in a checkout of
KellerJordan/modded-nanogpt (records/track_1_short/2025-09-03_FA3/*.txt). It is staged in a work
folder outside this project, with only these overrides: number of steps, validation cadence, batch
and validation sizes, and the shard paths. Where `flash_attn_interface` (FlashAttention-3) is not
installed, the staging folder gets a stand-in module of that name that calls PyTorch's built-in
varlen attention (FlashAttention-2 kernels, the same ones our `--attention varlen` uses), so both
codes run the same attention kernels. Ours runs the same algorithm (`--preset record-0903`) with the
same overrides, on the same kernels: `--attention varlen` beside the stand-in, `--attention fa3`
beside a real FA3.

Both codes get one GPU (torchrun, 1 process), so each step accumulates 8 micro-batches of
batch_size / 8 tokens (the public code always splits a step into 8). The public data loader does not wrap around, so it is given enough numbered links to
the training shards; ours wraps around by itself, over the same shards in the same order.
Validation uses the public definition in both: the first val_tokens tokens of the val shard in
buffers of val_seq_len (the public val_batch_size is set to 8 x val_seq_len, since its buffer is
val_batch_size / 8 on any number of GPUs).

Runs go one after the other, so ms/step compares the codes; with --parallel they all start at once
and share the GPU: val losses are unchanged, step times then mean nothing (the table says so).
Prints and writes a markdown table: val loss at each validation step, the training time there (to
compare at equal wall-clock), and ms/step.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_gpt as tg  # noqa: E402  (shard headers)

RECORD_GLOB = "records/track_1_short/2025-09-03_FA3/*.txt"
SEPARATOR = "=" * 100
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:([0-9.]+|nan) train_time:(\d+)ms(?:.* tokens:([\d,]+))?")

# The stand-in for FlashAttention-3's varlen entry point, written into the staging folder only when
# the real module is missing: the keyword call of the public script, on PyTorch's varlen kernels.
STAND_IN = '''"""Stand-in for FlashAttention-3's flash_attn_varlen_func on PyTorch's varlen attention (FA2 kernels)."""
from torch.nn.attention.varlen import varlen_attn


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, window_size=(-1, -1)):
    left = window_size[0] if window_size[0] is not None else -1
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                       window_size=(left, 0 if causal else -1))
'''


def public_source(checkout: Path) -> tuple[str, str]:
    """The record's script (the part of its first log before the 100-'=' line) and its md5."""
    logs = sorted(checkout.glob(RECORD_GLOB))
    if not logs:
        raise SystemExit(f"fidelity_0903.py: error: no {RECORD_GLOB} under {checkout}: point --public at a "
                         "checkout of KellerJordan/modded-nanogpt")
    text = logs[0].read_text()
    if SEPARATOR not in text:
        raise SystemExit(f"fidelity_0903.py: error: {logs[0]} holds no line of 100 '=' after its source")
    source = text[: text.index(SEPARATOR)]
    return source, hashlib.md5(source.encode()).hexdigest()


def override(source: str, field: str, value: str) -> str:
    """Replace the default of one Hyperparameters field (`name: type = default  # comment`)."""
    pattern = re.compile(rf"^(\s+{field}: \w+ = )([^#\n]+?)(\s*#.*)?$", re.M)
    if len(pattern.findall(source)) != 1:
        raise SystemExit(f"fidelity_0903.py: error: the public script has no single field {field!r} to override")
    return pattern.sub(lambda m: m.group(1) + value + (m.group(3) or ""), source)


def seed_public(source: str, seed: int) -> str:
    """The public script with `torch.manual_seed(seed)` just before it builds the model: as published it
    sets no seed, so every run starts from the same weights (torch's default seed) and two runs
    differ only by kernel nondeterminism, which understates the spread between seeds."""
    anchor = re.compile(r"^model: nn\.Module = GPT\(", re.M)
    if len(anchor.findall(source)) != 1:
        raise SystemExit("fidelity_0903.py: error: the public script has no single `model: nn.Module = GPT(` line "
                         "to seed before")
    return anchor.sub(lambda m: f"torch.manual_seed({seed})  # inserted by the harness\n" + m.group(0), source)


def stage_public(a, work: Path, source: str) -> Path:
    stage = work / "public"
    (stage / "train").mkdir(parents=True, exist_ok=True)
    # Enough numbered links to the training shards that the public loader (no wrap-around) never runs
    # out: it drops the rest of every cut document, so allow three times the tokens it trains on.
    files = tg.shard_files(a.train_files, "training")
    total = sum(tg.read_shard_header(f) for f in files)
    needed = 3 * (a.steps + 30) * a.batch_size  # + its 30 warm-up steps
    for old in (stage / "train").glob("*.bin"):
        old.unlink()
    for i in range(math.ceil(needed / total) * len(files)):
        os.symlink(os.path.abspath(files[i % len(files)]), stage / "train" / f"fineweb_train_{i + 1:06d}.bin")
    val = tg.shard_files(a.val_files, "validation")[0]
    for field, value in [("train_files", repr(str(stage / "train" / "fineweb_train_*.bin"))),
                         ("val_files", repr(os.path.abspath(val))), ("val_tokens", str(a.val_tokens)),
                         ("train_batch_size", str(a.batch_size)), ("val_batch_size", str(8 * a.val_seq_len)),
                         ("num_iterations", str(a.steps)), ("val_loss_every", str(a.val_every))]:
        source = override(source, field, value)
    (stage / "train_gpt.py").write_text(source)
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        (stage / "flash_attn_interface.py").write_text(STAND_IN)
    return stage


# GPU memory one run of this protocol takes at its peak (one H100, batch 131,072 = 8 x 16,384): the public
# code 17.5 GiB, ours 14 GiB (bench/results/fidelity_0903_h100.md); six at once ran out of 80 GB.
RUN_GIB = 18


def runs_that_fit() -> int:
    import torch
    return max(1, torch.cuda.get_device_properties(0).total_memory // (RUN_GIB << 30)) if torch.cuda.is_available() else 1


def launch(cmd: list[str], cwd: Path, log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def val_losses(path: Path) -> dict[int, tuple[float, int, int | None]]:
    """{step: (val loss, training ms, training tokens so far)} from a log (lines after the source code's
    separator); the tokens are None where the line does not say them (the public code's lines)."""
    text = path.read_text() if path.exists() else ""
    text = text[text.index(SEPARATOR):] if SEPARATOR in text else text
    return {int(m[1]): (float(m[3]), int(m[4]), m[5] and int(m[5].replace(",", ""))) for m in map(VAL_LINE.match, text.splitlines()) if m}


def target_table(results: dict[str, dict[int, tuple]], target: float, batch_size: int) -> list[str]:
    """Markdown table: for each run, the first validation at or below the target loss, with the training
    tokens and time spent to get there (a run whose log does not count tokens: steps x batch_size)."""
    lines = [f"To val loss <= {target}: the first validation that reached it", "",
             "| run | step | training tokens | training time (s) |", "| --- | --- | --- | --- |"]
    for name, by_step in results.items():
        hit = next((s for s in sorted(by_step) if by_step[s][0] <= target), None)
        if hit is None:
            lines.append(f"| {name} | not reached | - | - |")
            continue
        loss, ms, tokens = (*by_step[hit], None)[:3]
        lines.append(f"| {name} | {hit} | {tokens if tokens is not None else hit * batch_size:,} | {ms / 1000:.1f} |")
    return lines


def format_table(results: dict[str, dict[int, tuple[float, int]]], groups: dict[str, list[str]]) -> list[str]:
    """Markdown tables from each run's {step: (val loss, training ms)}: val loss per run and, per group
    after the first, its mean minus the first group's mean (the reference: the public code when it ran);
    then the training time at each validation step and ms/step."""
    names = [n for members in groups.values() for n in members]
    reference, *others = groups

    def mean(label, step):
        members = groups[label]
        if not members or any(step not in results[n] for n in members):
            return None
        return sum(results[n][step][0] for n in members) / len(members)
    steps = sorted({s for n in names for s in results[n]})
    lines = ["| step | " + " | ".join(names) + "".join(f" | {g} mean - {reference} mean" for g in others) + " |",
             "| --- |" + " --- |" * (len(names) + len(others))]
    for s in steps:
        cells = [f"{results[n][s][0]:.4f}" if s in results[n] else "-" for n in names]
        for g in others:
            m, r = mean(g, s), mean(reference, s)
            cells.append(f"{m - r:+.4f}" if m is not None and r is not None else "-")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Training time (s) at each validation step, to compare at equal wall-clock:", "",
              "| step | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for s in steps:
        lines.append(f"| {s} | " + " | ".join(f"{results[n][s][1] / 1000:.1f}" if s in results[n] else "-"
                                            for n in names) + " |")
    last = max(steps) if steps else 0
    lines += ["", "ms/step: " + ", ".join(f"{n} {results[n][last][1] / last:.1f}" if last and last in results[n]
                                         else f"{n} -" for n in names)]
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--public", required=True, type=Path, help="a checkout of KellerJordan/modded-nanogpt")
    p.add_argument("--train_files", required=True)
    p.add_argument("--val_files", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--val_every", type=int, default=50)
    p.add_argument("--batch_size", type=int, default=8 * 16384)
    p.add_argument("--val_tokens", type=int, default=983040)
    p.add_argument("--val_seq_len", type=int, default=40960)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1], help="one run of ours per seed")
    p.add_argument("--public_seeds", type=int, nargs="*", help="one public run per seed, seeded before its model "
                   "is built (default: one run as published, unseeded; no values: no public run)")
    p.add_argument("--ours", type=Path, default=ROOT / "train_gpt.py", help="our trainer file")
    p.add_argument("--ours_args", default="", help="extra `--field value` flags for every run of ours")
    p.add_argument("--label", default="ours", help="column name for our runs")
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "ARGS"),
                   help="one more variant of ours: --ours_args plus these flags (repeatable); --seeds runs of each, "
                        "compared with the public code, or without public runs with the first variant")
    p.add_argument("--parallel", action="store_true", help="start every run at once (curves only)")
    p.add_argument("--max_parallel", type=int, default=0, help="with --parallel: at most this many runs at once "
                   f"(0: as many as fit, one per {RUN_GIB} GiB of GPU memory)")
    p.add_argument("--work", type=Path, default=Path("/tmp/fidelity_0903"), help="staging and log folder")
    p.add_argument("--target", type=float, help="also tabulate the tokens and time each run took to reach this val loss")
    p.add_argument("--out", type=Path, help="also write the table here")
    a = p.parse_args()
    if a.batch_size % 128:
        raise SystemExit("fidelity_0903.py: error: --batch_size must be a multiple of 8 x 16")
    a.seq_len = a.batch_size // 8
    if a.val_tokens % (8 * a.val_seq_len):
        raise SystemExit(f"fidelity_0903.py: error: the public code needs --val_tokens to be a multiple of "
                         f"8 x --val_seq_len = {8 * a.val_seq_len}")

    variants = [(a.label, ""), *a.variant]  # each variant: ours with --ours_args and its own flags
    if (len({name for name, _ in variants}) < len(variants) or any(n.startswith("public") for n, _ in variants)
            or not all(re.fullmatch(r"[\w.-]+", n) for n, _ in variants)):
        raise SystemExit("fidelity_0903.py: error: --label and the --variant names must differ, be made of letters, "
                         "digits, '_', '.' or '-', and not start with 'public'")

    source, md5 = public_source(a.public)
    stage = stage_public(a, a.work, source)
    max_num_docs = -(-(a.seq_len // 300) // 128) * 128  # the public formula for its cu_seqlens length
    attention = "varlen" if (stage / "flash_attn_interface.py").exists() else "fa3"  # the kernels public runs
    ours_common = ["--preset", "record-0903", "--attention", attention, "--train_files", a.train_files,
                   "--val_files", a.val_files, "--batch_size", str(a.batch_size),
                   "--seq_len", str(a.seq_len), "--max_num_docs", str(max_num_docs), "--val_tokens",
                   str(a.val_tokens), "--val_seq_len", str(a.val_seq_len), "--num_iterations", str(a.steps),
                   "--val_every", str(a.val_every), "--log_dir", str(a.work / "logs"), *a.ours_args.split()]
    stamp = time.strftime("%Y%m%d_%H%M%S")
    runs = []  # (column, log path, command, cwd, env)
    for seed in [None] if a.public_seeds is None else a.public_seeds:
        rid = f"public_{stamp}_" + ("unseeded" if seed is None else f"seed{seed}")
        source_i = override((stage / "train_gpt.py").read_text(), "run_id", repr(rid))
        (stage / f"{rid}.py").write_text(source_i if seed is None else seed_public(source_i, seed))
        runs.append(("public 09/03" + ("" if seed is None else f" seed {seed}"), stage / "logs" / f"{rid}.txt",
                     ["torchrun", "--standalone", "--nproc_per_node=1", f"{rid}.py"], stage,
                     {"PYTHONPATH": str(stage), "TORCHINDUCTOR_CACHE_DIR": str(a.work / "cache_public")}))
    for label, extra in variants:
        for seed in a.seeds:
            rid = f"{label}_{stamp}_seed{seed}"
            runs.append((f"{label} seed {seed}", a.work / "logs" / f"{rid}.txt",
                         ["torchrun", "--standalone", "--nproc_per_node=1", str(a.ours.resolve()), *ours_common,
                          *extra.split(), "--seed", str(seed), "--run_id", rid], ROOT,
                         {"TORCHINDUCTOR_CACHE_DIR": str(a.work / f"cache_{label}")}))

    print(f"public script: {RECORD_GLOB} (md5 {md5}), staged in {stage}", flush=True)
    procs = []
    at_once = (a.max_parallel or runs_that_fit()) if a.parallel else 1
    for name, log, cmd, cwd, env in runs:
        while sum(proc.poll() is None for proc in procs) >= at_once:
            time.sleep(2)
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd)}", flush=True)
        procs.append(launch(cmd, cwd, log.with_suffix(".out"), env))
    for (name, log, *_), proc in zip(runs, procs):
        if proc.wait() != 0:
            print(f"{name} exited with {proc.returncode}; its output: {log.with_suffix('.out')}", flush=True)

    results = {name: val_losses(log) for name, log, *_ in runs}
    groups = {label: [n for n, *_ in runs if n.startswith(f"{label} seed ")] for label, _ in variants}
    pub_names = [n for n, *_ in runs if n.startswith("public")]
    if pub_names:
        groups = {"public": pub_names, **groups}
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    lines = [f"Device: {device}; PyTorch {torch.__version__}; public script md5 {md5}; "
             f"{a.steps} steps x {a.batch_size:,} tokens, validation {a.val_tokens:,} tokens in buffers of "
             f"{a.val_seq_len:,}" + ("; runs shared the GPU (--parallel): step times are not comparable" if a.parallel else ""),
             f"Command: python bench/fidelity_0903.py {' '.join(sys.argv[1:])}", "", *format_table(results, groups)]
    if a.target is not None:
        lines += ["", *target_table(results, a.target, a.batch_size)]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
