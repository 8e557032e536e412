#!/usr/bin/env python3
"""Side-by-side harness: a public modded-nanogpt script and ours on one GPU, same shards, same validation.

    python bench/side_by_side.py --public PATH/TO/modded-nanogpt \\
        --train_files "DIR/fineweb_train_*.bin" --val_files "DIR/fineweb_val_*.bin" \\
        [--public_code master|89|mudd-base|mudd-v1] [--public_commit HASH] [--public_attention fa3|fa4|varlen] \\
        [--batch_div 16] [--step_div 1] [--accum N] [--val_every 125] [--seeds 0 1 2] [--public_seeds 0 1 2] \\
        [--nproc 1|2|4|8 (GPUs per run, one run at a time; at --batch_div 1 --accum defaults to 8 // nproc)] \\
        [--ours_args "FLAGS"] [--variant NAME "FLAGS" ...] [--parallel [--stagger] | --warm_first] [--alternate] \\
        [--target LOSS] [--out table.md] [--report STAMP]

Public codes (--public_code), all read from a checkout of KellerJordan/modded-nanogpt:
  master  the public line's current code: train_gpt.py and the kernel files it imports, at the commit
          --public_commit (default PUBLIC_MASTER below; no fallback to another commit or record)
  89      record #89 (2026-07-17, FP8 MLP down projection): the script embedded in its log
  mudd-base  the 2026-05-27 MUDD record folder's baseline (the 2026-05-07 XSA-gated record's code, 1375 + 10
          steps): the script embedded in one xsa-baseline-s1385 log
  mudd-v1 the same folder's v1: that baseline plus the MUDD gate and lightweight layer-10 DC attention (and
          the XSA / attention-gate paths they replace), 1315 + 20 steps: the script embedded in one this_pr_v1 log

The public files are staged in a work folder outside this project and run from there (so its imports
cannot meet our kernels.py), after the run-time patches listed in PATCHES, each of which must find its
anchor or the harness stops naming it. Nothing of the public code is kept in this repository.

The scaling rule: the public schedule trains 338.8M tokens (mudd-base 364.4M,
mudd-v1 352.6M); the proxy corpus has about 22M after the public loader's document cutting. Either every
stage's batch is divided by --batch_div (16; steps and step constants kept: 8K / 16K / 24K-token steps,
one micro-batch each) or the step counts and step constants by --step_div at the real batches (the
real-shape check, and the timing run). Every run is checked before it starts: the tokens its schedule
reads, simulated with each code's own document cutting, must fit in the shards once; a run that would
repeat data is refused with an error.

Validation is the same for both codes: the first --val_tokens tokens of the val shard in buffers of
--val_seq_len (the public val_batch_size becomes nproc x accum x val_seq_len: val_seq_len per rank).

Runs go one after the other (step times then compare; the per-stage table is printed; a run that fails leaves
the later ones unstarted), or with
--parallel all at once sharing the GPU (losses only; the tables say so; a run that runs out of the GPU's memory
starts again once, one run fewer at a time from then on). --warm_first runs each code's first run
once beforehand, all at the same time and untimed, so that the timed runs compile from warm caches; --alternate
takes the codes in turns (A B A B) instead of each code's runs together. Prints and
writes markdown: val loss at each validation, tokens and training time there, the tokens and time to --target, the
final losses per group with a 95% interval and the paired (same seed) difference, and ms/step and
us/token per stage; in a timing run (--step_div > 1, runs one after the other) also each run's time over the
public schedule's own step counts, from its stage medians, and each later run's us/token over the first's; and
the conditions each run met while its GPU was busy (nvidia-smi twice a second: SM clock, power, temperature,
clock limits, the other GPUs' use, the host's load), the samples in WORK/gpu_monitor_STAMP.csv as they come and
each run's start in WORK/runs_STAMP.tsv. A command stopped before its tables (a machine's time ran out) leaves these
and its logs in --work: the same command with --report STAMP (the stamp in the log names) prints the tables from
them, each cut-off run as far as its log goes."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "records"))

import logparse  # noqa: E402  (records/logparse.py: both codes' log lines)
import train_gpt as tg  # noqa: E402  (shard headers and loading, our schedule and document cutting)

PUBLIC_MASTER = "f411b3d346aa52d3504324ca93c230fd84c6c07f"  # master of 2026-08-01: record #89 and its follow-ups
MUDD_FOLDER = "records/track_1_short/2026-05-27-MuddGatedAndDC"
RECORD_LOGS = {"89": "records/track_1_short/2026-07-17_FP8DownProjection/this_pr/11cb620c-*.txt",
               "mudd-base": f"{MUDD_FOLDER}/xsa-baseline-s1385/0904ecd7-4d32-4773-9955-fa363c1f0dbe.txt",
               "mudd-v1": f"{MUDD_FOLDER}/this_pr_v1/xsaexp8_10_dc_muddgate_ag3710_s1315e20_mglr015_06e4090a.txt"}
# The md5 of the embedded source (the log text before its 100-'=' line) of the logs pinned by exact path: the
# harness refuses another text under that path. (All ten s1385 logs embed the same train_gpt.py, as do 8 of the
# 11 v1 logs; the other 3 differ from it only in run_id's label.)
RECORD_MD5 = {"mudd-base": "e500827cba49e877846e86c0e5804e6b", "mudd-v1": "f18b04287ac0d6dd04a1a4b6b5c0154d"}
KERNEL_FILES = ("triton_kernels.py", "dc_triton_kernels.py")  # imported by the public script when present
SEPARATOR = logparse.SEPARATOR
FILE_MARK = re.compile(r"\n\n-{40}\n# (\S+\.py)\n-{40}\n\n")  # between the files a public log embeds
BOS = tg.BOS_ID


def fail(msg: str):
    raise SystemExit(f"side_by_side.py: error: {msg}")


def check_vocabulary():
    """Both codes read the GPT-2 vocabulary at start (the public code on import, ours for the prefix-token loss):
    offline without tiktoken's files every run would stop there, one after another. Checked here, before any run."""
    try:
        tg.gpt2_token_bytes()
    except (OSError, ValueError) as e:
        fail(f"every run would stop at its start: {e} (the runs inherit this command's environment)")


# ------------------------------------------------------------------------------------------------
# The public source


@dataclass
class PublicCode:
    name: str  # "master", "89", "mudd-base", "mudd-v1"
    files: dict[str, str]  # file name -> source, train_gpt.py first
    origin: str  # the commit, or the log and its md5

    @property
    def script(self) -> str:
        return self.files["train_gpt.py"]


def split_logged_source(text: str) -> dict[str, str]:
    """The files a public log embeds before its 100-'=' line: train_gpt.py, then each kernel file under
    a '# name.py' heading between two lines of 40 '-'."""
    source = text[: text.index(SEPARATOR)]
    parts = FILE_MARK.split(source)
    return {"train_gpt.py": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def public_source(checkout: Path, code: str, commit: str = PUBLIC_MASTER) -> PublicCode:
    """The public code: from a record's log (89, mudd-*) or from a commit of the checkout (master)."""
    if code == "master":
        def show(path):
            return subprocess.run(["git", "-C", str(checkout), "show", f"{commit}:{path}"], capture_output=True,
                                  text=True)
        main = show("train_gpt.py")
        if main.returncode:
            fail(f"{checkout} has no train_gpt.py at commit {commit} ({main.stderr.strip()}): point --public at a "
                 "git checkout of KellerJordan/modded-nanogpt that holds the commit (git fetch origin)")
        files = {"train_gpt.py": main.stdout}
        for name in KERNEL_FILES:
            if f"from {name[:-3]} import" in main.stdout:
                got = show(name)
                if got.returncode:
                    fail(f"the public train_gpt.py imports {name}, missing at commit {commit}")
                files[name] = got.stdout
        return PublicCode(code, files, f"commit {commit}")
    logs = sorted(checkout.glob(RECORD_LOGS[code]))
    if not logs:
        fail(f"no {RECORD_LOGS[code]} under {checkout}: point --public at a checkout of KellerJordan/modded-nanogpt")
    text = logs[0].read_text()
    if SEPARATOR not in text:
        fail(f"{logs[0]} holds no line of 100 '=' after its source")
    files = split_logged_source(text)
    md5 = hashlib.md5(text[: text.index(SEPARATOR)].encode()).hexdigest()
    if code in RECORD_MD5 and md5 != RECORD_MD5[code]:
        fail(f"{logs[0]} embeds a source of md5 {md5}, not the pinned {RECORD_MD5[code]}")
    return PublicCode(code, files, f"{logs[0].relative_to(checkout)} (md5 {md5})")


def override(source: str, field: str, value: str) -> str:
    """Replace the default of one Hyperparameters field (`name: type = default  # comment`)."""
    pattern = re.compile(rf"^(\s+{field}: \w+ = )([^#\n]+?)(\s*#.*)?$", re.M)
    if len(pattern.findall(source)) != 1:
        fail(f"the public script has no single field {field!r} to override")
    return pattern.sub(lambda m: m.group(1) + value + (m.group(3) or ""), source)


def field_value(source: str, field: str) -> str:
    m = re.findall(rf"^\s+{field}: \w+ = ([^#\n]+?)\s*(?:#.*)?$", source, re.M)
    if len(m) != 1:
        fail(f"the public script has no single field {field!r}")
    return m[0]


def patch(source: str, name: str, old: str, new: str, count: int = 1) -> str:
    """Replace the exact text `old` (which must occur `count` times) by `new`; the patch is named in the
    error when the public code no longer has its anchor."""
    found = source.count(old)
    if found != count:
        fail(f"patch {name!r}: expected {count} occurrence(s) of {old!r} in the public script, found {found}")
    return source.replace(old, new)


def seed_public(source: str, seed: int) -> str:
    """The public script with `torch.manual_seed(seed)` just before it builds the model: as published it
    sets no seed, so every run starts from the same weights (torch's default seed) and two runs
    differ only by kernel nondeterminism, which understates the spread between seeds."""
    anchor = re.compile(r"^model: nn\.Module = GPT\(", re.M)
    if len(anchor.findall(source)) != 1:
        fail("the public script has no single `model: nn.Module = GPT(` line to seed before")
    return anchor.sub(lambda m: f"torch.manual_seed({seed})  # inserted by the harness\n" + m.group(0), source)


# ------------------------------------------------------------------------------------------------
# The public schedule: its stage table, scaled by the rule


@dataclass(frozen=True)
class Stage:
    start: int  # first training step (0-based) of the stage
    end: int  # one past its last step
    batch: int  # tokens per step
    max_seq_len: int  # documents are cut here
    windows: tuple[int, int]  # (short, long) in blocks of 128 tokens


def _arith(expr: str) -> float:
    if not re.fullmatch(r"[\d\s.*/+()-]+", expr):
        fail(f"cannot read {expr!r} in the public stage table")
    return eval(expr, {"__builtins__": {}})  # digits and operators only, checked above


def public_stages(source: str, batch_div: int = 1) -> list[Stage]:
    """The public TRAINING_STAGES table with the step boundaries its TrainingSchedule computes: the
    scheduled stages split num_scheduled_iterations by their durations (rounded cumulative fractions),
    the last (extension) stage has num_extension_iterations."""
    m = re.search(r"^TRAINING_STAGES = \[\n(.*?)^\]", source, re.M | re.S)
    if not m:
        fail("the public script has no `TRAINING_STAGES = [` table")
    rows = []
    for chunk in m.group(1).split("TrainingStage(")[1:]:
        get = {k: re.search(rf"\b{k}=([\d\s.*/+-]+)", chunk) for k in ("duration", "train_max_seq_len", "batch_size")}
        win = re.search(r"window_sizes=\((\d+),\s*(\d+)\)", chunk)
        if not (get["train_max_seq_len"] and get["batch_size"] and win):
            fail(f"cannot read a stage of the public TRAINING_STAGES table: {chunk[:120]!r}")
        rows.append((_arith(get["duration"].group(1)) if get["duration"] else None,
                     int(_arith(get["train_max_seq_len"].group(1))), int(_arith(get["batch_size"].group(1))),
                     (int(win.group(1)), int(win.group(2)))))
    S = int(field_value(source, "num_scheduled_iterations"))
    E = int(field_value(source, "num_extension_iterations"))
    ends, acc = [0], 0.0
    for duration, *_ in rows[:-1]:
        acc += duration
        ends.append(round(acc * S))
    if ends[-1] != S:
        fail(f"the public stage durations end at step {ends[-1]}, not at num_scheduled_iterations={S}")
    ends.append(S + E)
    return [Stage(a, b, batch // batch_div, msl, win) for (a, b), (_, msl, batch, win) in zip(zip(ends, ends[1:]), rows)]


def training_stages(schedule) -> list:
    """Our schedule's stages over its training steps only: the last one ends at num_iterations, not past the final
    validation's step as train_gpt.Stage's does (so a stage's end - start is the steps it trains)."""
    n = schedule.args.num_iterations
    return [dataclasses.replace(st, end=min(st.end, n)) for st in schedule.stages]


def step_plan(stages) -> list:
    """Each training step's stage (both codes' stage lists have start, end and a batch)."""
    plan = []
    for st in stages:
        plan += [st] * (st.end - st.start)
    return plan


class DataExhausted(Exception):
    pass


def simulate_public_loader(files: list[str], stages: list[Stage], accum: int, world_size: int = 1) -> dict:
    """Walk the public loader's document cutting over the shards for the whole schedule, without a GPU:
    each micro-batch of batch/accum tokens takes documents from a BOS on, each cut at max_seq_len
    tokens and the last one at the micro-batch's end, the rest of a cut document dropped; a shard whose
    documents cannot complete a micro-batch is left for the next, and the loader never wraps around.
    On world_size ranks, rank by rank as the public Shard.next_batch does it: every rank walks the same
    index, and one call cuts world_size pieces of batch/(accum x world_size) tokens in a row (rank 0's
    first); a shard that cannot complete every rank's piece is left for the next one whole (no rank keeps
    a piece of it for that call), so the walk is per-rank exact.
    Returns the trained tokens and how far into the shards the run reads; raises DataExhausted with
    the step where the public run would run out (it would crash there; we refuse to start it)."""
    def load(i):
        t = tg.load_shard(files[i])
        return t, np.flatnonzero(t == BOS)
    shard, idx, pos, trained = 0, 0, 0, 0  # idx: the next document; pos: the end of the last piece read
    tokens, bos = load(0)
    for step, st in enumerate(step_plan(stages)):
        n = st.batch // (accum * world_size)  # one rank's micro-batch
        for _ in range(accum):
            while True:  # one next_batch call: a piece per rank from this shard, or none
                j, ranks = idx, 0
                while ranks < world_size:
                    cur_len = 0
                    while cur_len <= n and j < bos.size:
                        cur = int(bos[j])
                        j += 1
                        end = min(int(bos[j]) if j < bos.size else tokens.size, cur + st.max_seq_len,
                                  cur + n - cur_len + 1)
                        cur_len += end - cur
                    if cur_len != n + 1:
                        break
                    ranks += 1
                if ranks == world_size:
                    idx, pos = j, end
                    break
                shard += 1
                if shard == len(files):
                    raise DataExhausted(f"the public loader runs out of documents at step {step} of "
                                        f"{len(step_plan(stages))} ({trained:,} tokens trained)")
                (tokens, bos), idx, pos = load(shard), 0, 0
            trained += n * world_size
    read = sum(tg.read_shard_header(f) for f in files[:shard]) + pos
    return dict(trained=trained, read=read, total=sum(tg.read_shard_header(f) for f in files))


def simulate_our_loader(files: list[str], args) -> dict:
    """The same check for ours, with our own loader code (TokenStream, no wrap-around). Exact on any number
    of GPUs: batch_size is a step's tokens over all ranks, and every rank reads the whole stream and keeps its
    own slots (train_gpt.py's BatchProducer), so the tokens a step reads do not depend on the GPU count."""
    stream = tg.TokenStream(files, args.bos_id, wrap=False, log=lambda *a: None)
    schedule = tg.Schedule(args)
    trained = 0
    for step in range(args.num_iterations):
        spec = schedule.spec_at(step)
        try:
            for _ in range(spec.batch_size // spec.seq_len):
                stream.take(spec.seq_len, spec.max_doc_len)
        except EOFError:
            raise DataExhausted(f"our loader would start a second pass over the shards at step {step} of "
                                f"{args.num_iterations} ({trained:,} tokens trained)") from None
        trained += spec.batch_size
    read = sum(tg.read_shard_header(f) for f in files[:stream.shard]) + stream.pos
    return dict(trained=trained, read=read, total=sum(tg.read_shard_header(f) for f in files))


# ------------------------------------------------------------------------------------------------
# Staging the public code


# The stand-in for the hub FlashAttention-3 loader of the public code (get_kernel('kernels-community/
# flash-attn3')): flash_attn_varlen_func as a custom op with a fake and a backward, so that the public
# model still compiles with fullgraph. BACKEND is filled in by the harness.
ATTENTION_MODULE = '''"""Harness stand-in for the public code's hub FlashAttention-3 loader (written by bench/side_by_side.py)."""
import ctypes, glob, importlib.util, os, sys
import torch
from torch import Tensor

BACKEND = {backend!r}


def _load_fa3():
    """torch.ops.flash_attn_3 from the flash_attn_3 wheel, or from the FA3 build inside xformers==0.0.34
    (CUDA 12; under a CUDA-13 torch it needs libcudart.so.12 from nvidia-cuda-runtime-cu12)."""
    if hasattr(torch.ops.flash_attn_3, "fwd"):
        return "flash_attn_3 (already loaded)"
    try:
        import flash_attn_3._C  # noqa: F401
        return "the flash_attn_3 wheel"
    except ImportError:
        pass
    spec = importlib.util.find_spec("xformers")
    so = os.path.join(os.path.dirname(spec.origin), "flash_attn_3", "_C.so") if spec and spec.origin else ""
    if not os.path.exists(so):
        raise SystemExit("harness attention fa3: neither the flash_attn_3 wheel nor xformers==0.0.34's FA3 build is "
                         "installed; pip install --no-deps xformers==0.0.34 nvidia-cuda-runtime-cu12==12.8.90, or run "
                         "the harness with --public_attention varlen")
    try:
        ctypes.CDLL("libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        found = [p for d in sys.path for p in glob.glob(os.path.join(d, "nvidia/cuda_runtime/lib/libcudart.so.12"))]
        if not found:
            raise SystemExit("harness attention fa3: libcudart.so.12 not found: pip install nvidia-cuda-runtime-cu12")
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    torch.ops.load_library(so)
    return so


if BACKEND == "fa3":
    print(f"harness attention: FlashAttention-3 from {{_load_fa3()}}", flush=True)

    def _forward(q, k, v, cu, max_seqlen, window, scale):
        out, lse, *_ = torch.ops.flash_attn_3.fwd(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
            softmax_scale=scale, is_causal=True, window_size_left=window, window_size_right=0, num_splits=1)
        return out, lse

    def _backward(g, q, k, v, out, lse, cu, max_seqlen, window, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        torch.ops.flash_attn_3.bwd(
            g, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen, softmax_scale=scale, is_causal=True, window_size_left=window,
            window_size_right=0)
        return dq, dk, dv
elif BACKEND == "fa4":
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except ImportError:
        raise SystemExit("harness attention fa4: flash-attn-4 is not installed; pip install -r "
                         "requirements-hopper.txt, or run the harness with --public_attention varlen")
    print("harness attention: FlashAttention-4 (flash-attn-4's kernels)", flush=True)

    def _forward(q, k, v, cu, max_seqlen, window, scale):
        out, lse, *_ = _flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
            softmax_scale=scale, causal=True, window_size_left=None if window < 0 else window, window_size_right=0,
            return_lse=True)
        return out, lse

    def _backward(g, q, k, v, out, lse, cu, max_seqlen, window, scale):
        return _flash_attn_bwd(
            q, k, v, out, g, lse, softmax_scale=scale, causal=True, window_size_left=None if window < 0 else window,
            window_size_right=0, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen)[:3]
else:
    print("harness attention: PyTorch varlen_attn (FlashAttention-2 kernels)", flush=True)

if BACKEND in ("fa3", "fa4"):  # the library's kernels as a custom op with a fake and a backward
    @torch.library.custom_op(f"harness_attention::{{BACKEND}}", mutates_args=())
    def _attend(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_seqlen: int, window: int,
                scale: float) -> tuple[Tensor, Tensor]:
        out, lse = _forward(q, k, v, cu, max_seqlen, window, scale)
        return out.contiguous(), lse.contiguous()

    @_attend.register_fake
    def _(q, k, v, cu, max_seqlen, window, scale):
        return q.new_empty(q.shape), q.new_empty(q.size(1), q.size(0), dtype=torch.float32)

    @torch.library.custom_op(f"harness_attention::{{BACKEND}}_backward", mutates_args=())
    def _attend_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: Tensor,
                         max_seqlen: int, window: int, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(x.contiguous() for x in _backward(g.contiguous(), q, k, v, out, lse, cu, max_seqlen, window,
                                                       scale))

    @_attend_backward.register_fake
    def _(g, q, k, v, out, lse, cu, max_seqlen, window, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def _setup(ctx, inputs, output):
        q, k, v, cu, max_seqlen, window, scale = inputs
        ctx.save_for_backward(q, k, v, cu, *output)
        ctx.static = (max_seqlen, window, scale)

    def _grad(ctx, g, g_lse):
        q, k, v, cu, out, lse = ctx.saved_tensors
        return *_attend_backward(g, q, k, v, out, lse, cu, *ctx.static), None, None, None, None

    _attend.register_autograd(_grad, setup_context=_setup)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           softmax_scale=None, window_size=(-1, -1)):
    """The keyword call of the public script: causal, one cu_seqlens for queries and keys, a left window."""
    assert causal and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
    left = -1 if window_size[0] is None else window_size[0]
    if BACKEND in ("fa3", "fa4"):
        return _attend(q, k, v, cu_seqlens_q, max_seqlen_q, left, softmax_scale)[0]
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                       window_size=(left, 0))
'''

# What the public scripts (master, 89, mudd-base, mudd-v1) need to run here, applied to the staged copy.
# (name, what and why)
PATCHES = [
    ("hub_fa3_loader", "the Hugging Face hub FlashAttention-3 loader (`from kernels import get_kernel`, "
     "`get_kernel('kernels-community/flash-attn3')`; in the MUDD folder's scripts the forms of MUDD_HUB_LOADERS) "
     "is replaced by harness_attention.py, a custom op over "
     "FA3 from xformers==0.0.34 (num_splits=1: the default of FA3's Python interface, whose flash_attn_varlen_func "
     "the public code calls; the raw op's default splits the keys and adds a combine kernel), FA4 (flash-attn-4) or "
     "PyTorch's varlen_attn (--public_attention); the hub is unreachable here"),
    ("fp8_scale_alignment", "the per-layer FP8 scales that reach torch._scaled_mm (`_mlp_down_proj_scales[i:i+1]`, "
     "`_mlp_down_act_scales[i:i+1]`) are gathered into fresh one-element tensors (`[[i]]`): cuBLASLt under CUDA 13 "
     "refuses a scale whose address is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED), which the slices "
     "of a 12-float buffer are unless i % 4 == 0 (a .clone() would not do: Inductor removes it as a no-op); "
     "master and 89 only (FP8_MLP_CODES): the MUDD scripts' FP8 matmuls take fresh scalar scales"),
    ("data_and_validation", "train_files, val_files, val_tokens, val_batch_size = nproc x accum x val_seq_len "
     "(each rank's validation micro-batch is val_seq_len), val_loss_every, run_id"),
    ("micro_batches", "grad_accum_steps = --accum on each of the --nproc GPUs (the public code hard-codes "
     "8 // world_size), and a check that the run has world_size = --nproc"),
    ("batch_div", "every stage's batch_size divided by --batch_div (a loop after TRAINING_STAGES)"),
    ("step_div", "num_scheduled_iterations, num_extension_iterations (at least 1), Muon momentum warm-up "
     "(300) and cool-down (50) steps and the FP8 down-projection bootstrap (step < 16; master and 89, the "
     "MUDD scripts have none) divided by --step_div"),
    ("log_dir", "the log goes to logs/RUN_ID.txt, where the harness reads it (mudd-v1 writes to logs0527/)"),
    ("stage_log", "one log line with the schedule's stage boundaries, checked against the harness's own"),
    ("seed", "torch.manual_seed(seed) before the model is built (the public script sets none)"),
    ("profile", "with --profile_step N: torch.profiler over training steps N and N+1, its top kernels printed"),
    ("start_after", "with --start_after PATH: after its untimed warm-up the run waits until PATH exists before "
     "its clock starts (a timing run compiles while other runs still use the GPU)"),
]

# With --profile_step: the top of the public training section profiles two steps (N, N+1) and prints the
# kernels by GPU time when step N+2 begins; their Chrome trace goes to harness_profile_stepN.json.gz in the run's
# folder (for bench/profile_compare.py).
PROFILE_HOOK = """    if step == {n}:  # harness: profile two training steps
        _harness_prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        _harness_prof.__enter__()
    if step == {n} + 2:
        torch.cuda.synchronize()
        _harness_prof.__exit__(None, None, None)
        print0(_harness_prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90), console=True)
        _harness_prof.export_chrome_trace("harness_profile_step{n}.json.gz")  # every kernel: bench/profile_compare.py
"""


STAND_IN_IMPORT = "import harness_attention as flash_attn_interface  # harness: stand-in for the hub FA3 loader"

# The hub FlashAttention-3 loader of the MUDD record folder's scripts (patch 'hub_fa3_loader'), each line
# replaced by the stand-in: the baseline loads varunneal's build on one line; v1 tries kernels-community's, falls
# back to varunneal's (that fallback now re-raises) and uses the module's flash_attn_interface attribute if it
# has one (the stand-in has none: the module itself is the interface).
MUDD_HUB_LOADERS = {
    "mudd-base": [("\nflash_attn_interface = get_kernel('varunneal/flash-attention-3').flash_attn_interface\n",
                   f"\n{STAND_IN_IMPORT}\n")],
    "mudd-v1": [('    _fa3_mod = get_kernel("kernels-community/flash-attn3")\n',
                 "    import harness_attention as _fa3_mod  # harness: stand-in for the hub FA3 loader\n"),
                ('    _fa3_mod = get_kernel("varunneal/flash-attention-3", trust_remote_code=True)\n',
                 "    raise  # harness: no second hub loader\n")],
}
# The codes whose FP8 MLP keeps per-layer scale buffers and a bootstrap step (record #89's line): they get the
# fp8_scale_alignment patch and step_div's bootstrap constant; a script of another code must have neither.
FP8_MLP_CODES = ("master", "89")
# The codes whose script writes its log elsewhere than logs/ (patch 'log_dir').
LOG_DIRS = {"mudd-v1": "logs0527"}


def patches_for(name: str) -> list[str]:
    """The PATCHES a staged code gets (profile and start_after when asked for)."""
    return [n for n, _ in PATCHES if n != "fp8_scale_alignment" or name in FP8_MLP_CODES]


def patch_public(code: PublicCode, *, train_glob: str, val_file: str, val_tokens: int, val_seq_len: int,
                 val_every: int, accum: int, batch_div: int, step_div: int, attention: str, nproc: int = 1,
                 profile_step: int | None = None, start_after: str | None = None) -> dict[str, str]:
    """The staged files of a public code after PATCHES (seed and run_id are per run, later)."""
    s = code.script
    if code.name in MUDD_HUB_LOADERS:
        s = patch(s, "hub_fa3_loader", "from kernels import get_kernel\n",
                  "# from kernels import get_kernel  (harness: the hub loader is replaced below)\n")
        for old, new in MUDD_HUB_LOADERS[code.name]:
            s = patch(s, "hub_fa3_loader", old, new)
    elif "get_kernel('kernels-community/flash-attn3'" in s:
        s = patch(s, "hub_fa3_loader", "from kernels import get_kernel\n",
                  "# from kernels import get_kernel  (harness: the hub loader is replaced below)\n")
        s = re.sub(r"^flash_attn_interface = get_kernel\('kernels-community/flash-attn3'.*$", STAND_IN_IMPORT,
                   s, count=1, flags=re.M)
    else:
        fail("patch 'hub_fa3_loader': the public script does not load FlashAttention-3 through get_kernel")
    if re.search(r"^[^#\n]*\bget_kernel\(", s, re.M):
        fail("patch 'hub_fa3_loader': the public script still calls get_kernel after the patch")
    if code.name in FP8_MLP_CODES:
        s = patch(s, "fp8_scale_alignment", "self._mlp_down_proj_scales[i:i+1] for i in range(12)",
                  "self._mlp_down_proj_scales[[i]] for i in range(12)")
        s = patch(s, "fp8_scale_alignment", "self._mlp_down_act_scales[i:i+1],", "self._mlp_down_act_scales[[i]],")
    elif "_mlp_down_proj_scales" in s or "_mlp_down_act_scales" in s or "bootstrap_down" in s:
        fail(f"patch 'fp8_scale_alignment': the {code.name} script has per-layer FP8 MLP scales or their bootstrap; "
             "list it in FP8_MLP_CODES")
    if code.name in LOG_DIRS:
        s = patch(s, "log_dir", f'"{LOG_DIRS[code.name]}', '"logs', count=2)
    s = patch(s, "log_dir", 'logfile = f"logs/{run_id}.txt"', 'logfile = f"logs/{run_id}.txt"')  # where we read it
    for field, value in [("train_files", repr(train_glob)), ("val_files", repr(val_file)),
                         ("val_tokens", str(val_tokens)), ("val_batch_size", str(nproc * accum * val_seq_len)),
                         ("val_loss_every", str(val_every))]:
        s = override(s, field, value)
    s = patch(s, "micro_batches", "grad_accum_steps = 8 // world_size\n",
              f"grad_accum_steps = {accum}  # harness: micro-batches per step on each GPU\n"
              f"assert world_size == {nproc}, 'harness: staged for --nproc {nproc}'\n")
    if batch_div != 1:
        s = patch(s, "batch_div", "\ntraining_schedule = TrainingSchedule(",
                  f"\nfor _stage in TRAINING_STAGES:  # harness: the scaling rule's smaller batches\n"
                  f"    _stage.batch_size //= {batch_div}\ntraining_schedule = TrainingSchedule(")
    if step_div != 1:
        S, E = (int(field_value(s, f)) for f in ("num_scheduled_iterations", "num_extension_iterations"))
        s = override(s, "num_scheduled_iterations", str(round(S / step_div)))
        s = override(s, "num_extension_iterations", str(max(1, round(E / step_div))))
        s = patch(s, "step_div", "muon_warmup_steps=300, muon_cooldown_steps=50",
                  f"muon_warmup_steps={round(300 / step_div)}, muon_cooldown_steps={max(1, round(50 / step_div))}")
        if code.name in FP8_MLP_CODES:
            s = patch(s, "step_div", "bootstrap_down=(step < 16)",
                      f"bootstrap_down=(step < {max(1, round(16 / step_div))})")
    if profile_step is not None:
        anchor = "    # --------------- TRAINING SECTION -----------------\n"
        s = patch(s, "profile", anchor, anchor + PROFILE_HOOK.format(n=profile_step))
    if start_after is not None:
        s = patch(s, "start_after", "\ntraining_time_ms = 0\n# start the clock\n",
                  f"\nprint0({'harness: waiting for ' + start_after + ' before the clock starts'!r}, console=True)\n"
                  f"while not os.path.exists({start_after!r}):  # harness: the GPU is still shared\n"
                  f"    time.sleep(5)\ntraining_time_ms = 0\n# start the clock\n")
    s = patch(s, "stage_log", "\nmodel: nn.Module = GPT(",
              '\nprint0(f"harness: stage boundaries {training_schedule.boundaries}", console=True)\n'
              "model: nn.Module = GPT(")
    files = dict(code.files, **{"train_gpt.py": s})
    files["harness_attention.py"] = ATTENTION_MODULE.format(backend=attention)
    return files


def link_shards(folder: Path, files: list[str]):
    """Numbered links to the training shards, then a last shard of a few BOS tokens (a sentinel): the public
    loader opens the next shard ahead of time (it fails at its start with a single shard), and one that reaches
    the sentinel fails there, loudly."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.bin"):
        old.unlink()
    for i, f in enumerate(files):
        os.symlink(os.path.abspath(f), folder / f"fineweb_train_{i + 1:06d}.bin")
    tg.write_shard(folder / f"fineweb_train_{len(files) + 1:06d}.bin", np.full(16, BOS))


def staged_files(a, code: PublicCode, stage: Path, val_file: str) -> dict[str, str]:
    """The public code's files as the harness stages them into `stage` for the flags `a` (patch_public)."""
    return patch_public(code, train_glob=str(stage / "train" / "fineweb_train_*.bin"), val_file=val_file,
                        val_tokens=a.val_tokens, val_seq_len=a.val_seq_len, val_every=a.val_every,
                        accum=a.accum, batch_div=a.batch_div, step_div=a.step_div, attention=a.public_attention,
                        nproc=a.nproc, profile_step=a.profile_step, start_after=a.start_after)


def stage_public(a, work: Path, code: PublicCode) -> Path:
    stage = work / f"public_{code.name}"
    stage.mkdir(parents=True, exist_ok=True)
    train = tg.shard_files(a.train_files, "training")
    val = os.path.abspath(tg.shard_files(a.val_files, "validation")[0])
    link_shards(stage / "train", train)  # once: the harness refuses a run that needs more
    for name, text in staged_files(a, code, stage, val).items():
        (stage / name).write_text(text)
    return stage


# ------------------------------------------------------------------------------------------------
# Running


# GPU memory one run takes at its peak (one H100): under batches / 16 ours reserves 21.3 GiB (the ours_rule16 logs
# that bench/results/side_by_side_master_h100_20261125.md names) and the public master more (two of three public runs beside a
# 34 GiB timing run ran out of 80 GB, section 6 of side_by_side_master_h100_20261125.md); the 09/03 protocol's
# runs 17.5 and 14 GiB (bench/results/fidelity_0903_h100.md).
RUN_GIB = 24


def runs_that_fit() -> int:
    import torch
    return max(1, torch.cuda.get_device_properties(0).total_memory // (RUN_GIB << 30)) if torch.cuda.is_available() else 1


def launch(cmd: list[str], cwd: Path, log: Path, env: dict) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **env}, stdout=open(log, "w"), stderr=subprocess.STDOUT)


# The conditions each run met, so that a run slowed by its host shows as such (one public stage 3 once ran at
# 853 ms against 643.5 ms that morning while other GPUs of the host worked): nvidia-smi samples every GPU of the
# host twice a second, with the host's 1-minute load, while the runs go.
MONITOR_FIELDS = "index,clocks.sm,power.draw,temperature.gpu,utilization.gpu,{reasons}"
# the clock limits' field: drivers since R535 call it clocks_event_reasons.active, older ones only
# clocks_throttle_reasons.active (the name nvidia-smi --help-query-gpu lists is taken)
REASONS_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# NVML's clock event reasons (nvmlClocksEventReasons), the bits of that field; GPU idle (0x1)
# is left out: it is the state between runs, not a limit on one
CLOCK_REASONS = {0x2: "applications clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x10: "sync boost",
                 0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake", 0x100: "display clocks"}
BUSY_PERCENT = 50  # a sample counts towards a run's clocks and power where its GPU is at least this busy


def parse_monitor_line(line: str) -> tuple | None:
    """(index, SM MHz, W, C, utilization %, reasons bits) from one line of nvidia-smi's CSV (MONITOR_FIELDS,
    noheader, nounits); a field nvidia-smi cannot read ("[N/A]") is None; a line of another form is None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 6 or not parts[0].isdigit():
        return None
    number = lambda x: float(x) if re.fullmatch(r"[0-9.]+", x) else None
    reasons = int(parts[5], 16) if re.fullmatch(r"0x[0-9a-fA-F]+", parts[5]) else None
    return (int(parts[0]), *map(number, parts[1:5]), reasons)


MONITOR_CSV_HEADER = "time,load_1min_per_core,index,sm_mhz,power_w,temperature_c,utilization_percent,clock_reasons"


def monitor_csv_line(sample: tuple) -> str:
    """A GpuMonitor sample as a row of its CSV file (MONITOR_CSV_HEADER; the clock limits in hex)."""
    return ",".join("" if v is None else (f"{v:#x}" if i == 7 else str(v)) for i, v in enumerate(sample))


def read_monitor_csv(path: Path) -> list[tuple]:
    """The samples of a GpuMonitor CSV file, as GpuMonitor.samples holds them (a cut-off last row is left out).
    A file of before 2026-12-03 held the host's whole load (header load_1min), not per core: read as unknown."""
    lines = path.read_text().splitlines()
    whole_load = bool(lines) and lines[0].split(",")[1:2] == ["load_1min"]
    samples = []
    for line in lines[1:]:
        cells = line.split(",")
        if len(cells) != 8:
            continue
        num = lambda c, kind=float: None if c == "" else kind(c)
        samples.append((float(cells[0]), None if whole_load else float(cells[1]), int(cells[2]),
                        *(num(c) for c in cells[3:7]),
                        num(cells[7], lambda c: int(c, 16))))
    return samples


class GpuMonitor:
    """nvidia-smi's MONITOR_FIELDS for every GPU every `period_ms`, each row stamped with its arrival time and the
    host's 1-minute load: samples (time, load, index, SM MHz, W, C, utilization %, reasons), each also written to
    the CSV file `path` as it arrives (so a command stopped halfway keeps them). Where nvidia-smi is missing or
    fails, `error` says so and the runs go on unmonitored."""

    def __init__(self, period_ms: int = 500, path: Path | None = None):
        self.samples: list[tuple] = []
        self.error = ""
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("w")
            self.file.write(MONITOR_CSV_HEADER + "\n")
        try:
            listed = subprocess.run(["nvidia-smi", "--help-query-gpu"], capture_output=True, text=True,
                                    timeout=30).stdout
            self.fields = MONITOR_FIELDS.format(reasons=next((f for f in REASONS_FIELDS if f in listed),
                                                             REASONS_FIELDS[-1]))
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.fields}", "--format=csv,noheader,nounits",
                                          "-lms", str(period_ms)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, start_new_session=True)  # stop() ends its whole group
        except (OSError, subprocess.TimeoutExpired) as e:
            self.proc, self.error = None, f"nvidia-smi did not start ({e})"
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            row = parse_monitor_line(line)
            if row is not None:
                # the load per core of the host that samples it: a --report rebuilt on another machine reads it as is
                self.samples.append((time.time(), os.getloadavg()[0] / (os.cpu_count() or 1), *row))
                if self.file is not None:
                    self.file.write(monitor_csv_line(self.samples[-1]) + "\n")
                    self.file.flush()

    def stop(self):
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:  # it had ended (an nvidia-smi that failed)
                pass
            self.proc.wait()
            self.thread.join(timeout=5)
            if not self.samples:
                said = (self.proc.stderr.read() or "").strip().splitlines()
                self.error = f"nvidia-smi gave no samples (exit {self.proc.returncode}{': ' + said[0] if said else ''})"
        if self.file is not None:
            self.file.close()


def run_conditions(samples: list[tuple], start: float, end: float, gpu: int, also: tuple = ()) -> dict | None:
    """What a run between `start` and `end` (seconds since the epoch) on GPU `gpu` met, over the samples where
    that GPU was busy (BUSY_PERCENT): SM clock median and minimum, largest power and temperature, the clock limits
    seen, the busiest other GPU's median utilization in that span (`also`: the run's own other GPUs, not
    counted), and the host's largest 1-minute load per core. None without a busy sample."""
    busy = [s for s in samples if start <= s[0] <= end and s[2] == gpu and (s[6] or 0) >= BUSY_PERCENT]
    if not busy:
        return None
    first, last = busy[0][0], busy[-1][0]
    others: dict[int, list[float]] = {}
    for s in samples:
        if first <= s[0] <= last and s[2] != gpu and s[2] not in also and s[6] is not None:
            others.setdefault(s[2], []).append(s[6])
    bits = 0
    for s in busy:
        bits |= s[7] or 0
    values = lambda k: [s[k] for s in busy if s[k] is not None]
    sm = values(3)
    return {"gpu": gpu, "samples": len(busy),
            "sm_median": statistics.median(sm) if sm else None, "sm_min": min(sm, default=None),
            "power_max": max(values(4), default=None), "temperature_max": max(values(5), default=None),
            "reasons": [name for bit, name in CLOCK_REASONS.items() if bits & bit],
            "others_busiest": max((statistics.median(u) for u in others.values()), default=None),
            "load_per_core": max((s[1] for s in busy if s[1] is not None), default=None)}


def conditions_table(rows: list[tuple[str, dict | None]], error: str = "") -> list[str]:
    """The markdown table of run_conditions per run."""
    if error:
        return [f"Conditions: not monitored ({error})"]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    lines = ["Conditions while each run's GPU was busy (nvidia-smi twice a second): a run beside other work on the "
             "host, or under a clock limit, is not a clean timing", "",
             "| run | GPU | samples | SM clock MHz, median (min) | power W, max | temperature C, max | "
             "clock limits seen | busiest other GPU, median use % | host load per core, max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in rows:
        if c is None:
            lines.append(f"| {name} | - | 0 | - | - | - | - | - | - |")
            continue
        lines.append(f"| {name} | {c['gpu']} | {c['samples']} | {fmt(c['sm_median'], '.0f')} "
                     f"({fmt(c['sm_min'], '.0f')}) | {fmt(c['power_max'], '.0f')} | "
                     f"{fmt(c['temperature_max'], '.0f')} | "
                     f"{', '.join(c['reasons']) or 'none'} | {fmt(c['others_busiest'], '.0f')} | "
                     f"{fmt(c['load_per_core'], '.2f')} |")
    return lines


def visible_gpu() -> int:
    """The host index of the GPU a one-GPU run sees first: CUDA_VISIBLE_DEVICES' first entry, or 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def visible_gpus(n: int) -> list[int]:
    """The host indexes of the n GPUs a run on n GPUs sees: CUDA_VISIBLE_DEVICES' first n entries (an entry
    that is not an index, and a missing one: its position), or 0 .. n-1."""
    got = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    return [int(got[i]) if i < len(got) and got[i].isdigit() else i for i in range(n)]


def group_of(name: str) -> str:
    """The code a run belongs to: 'public ...' or a variant label (the column name without ' seed N')."""
    return "public" if name.startswith("public") else name.rsplit(" seed ", 1)[0]


def in_turns(runs: list) -> list:
    """The runs in turns, for --alternate: every code's first run, then every code's second, and so on (public, ours,
    public, ours: A B A B), a code with fewer runs leaving the turns early."""
    groups: dict[str, list] = {}
    for r in runs:
        groups.setdefault(group_of(r[0]), []).append(r)
    return [g[i] for i in range(max(map(len, groups.values()), default=0)) for g in groups.values() if i < len(g)]


def ran_out_of_memory(log: Path) -> bool:
    """The run's console output says CUDA ran out of memory."""
    out = log.with_suffix(".out")
    return out.exists() and "CUDA out of memory" in out.read_text(errors="replace")


def launch_all(runs, at_once: int, stagger: bool, poll: float = 2.0, journal: Path | None = None) -> list:
    """Start the runs, at most `at_once` at a time, in order; with `stagger`, the other runs of a code wait
    until its first run has logged a training step, so that they find its compiled graphs in the shared
    Inductor cache instead of compiling the same graphs at once. Each start is appended to `journal` (its time,
    a tab, the run's name), for --report. One at a time (at_once 1), a run that fails stops the ones after it: a
    timing's pairs need every run, and its code would fail again on the machine's time. Several at once, a run that
    ran out of GPU memory starts again, once, with one run fewer at a time from then on (seven runs sharing an H200
    lost four so); its first logs are kept beside, as NAME.oom.txt / .oom.out. Returns the processes in run order
    (None: not started)."""
    procs: dict[int, subprocess.Popen] = {}
    leader: dict[str, int] = {}
    failed_seen: set[int] = set()  # each failure's output is read once: a run is started again at most once
    parallel = at_once > 1  # then the runs are watched to their end: one of the last may still run out of memory
    going = lambda: parallel and any(p.poll() is None for p in procs.values())
    while len(procs) < len(runs) or going():
        for j, p in list(procs.items()):
            if j in failed_seen or not p.poll():
                continue
            failed_seen.add(j)
            if at_once > 1 and ran_out_of_memory(runs[j][1]):  # beside others
                del procs[j]
                at_once -= 1
                for f in (runs[j][1], runs[j][1].with_suffix(".out")):  # a new run may not follow another's log
                    if f.exists():
                        f.replace(f.with_suffix(".oom" + f.suffix))
                print(f"{runs[j][0]} ran out of GPU memory: it starts again, {at_once} run(s) at a time from now",
                      flush=True)
        for i, (name, log, cmd, cwd, env, *_) in enumerate(runs):
            if i in procs or sum(p.poll() is None for p in procs.values()) >= at_once:
                continue
            failed = [runs[j][0] for j, p in procs.items() if p.poll()]  # finished with a nonzero exit
            if not parallel and failed:
                left = [r[0] for j, r in enumerate(runs) if j not in procs]
                print(f"{failed[0]} failed: not starting {', '.join(left)}", flush=True)
                return [procs.get(j) for j in range(len(runs))]
            g = group_of(name)
            if stagger and g in leader:
                first = leader[g]
                if first not in procs or (procs[first].poll() is None and
                                          not logparse.step_times(log_text(runs[first][1]))):
                    continue  # (a leader that ran out of memory starts again first: it comes first in the order)
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd)}", flush=True)
            procs[i] = launch(cmd, cwd, log.with_suffix(".out"), env)
            procs[i].started_at = time.time()  # the run's span for run_conditions: to its logs' last write
            if journal is not None:
                with journal.open("a") as f:
                    f.write(f"{procs[i].started_at}\t{name}\n")
            leader.setdefault(g, i)
        if len(procs) < len(runs) or going():
            time.sleep(poll)
    return [procs[i] for i in range(len(runs))]


def read_journal(path: Path) -> dict[str, float]:
    """launch_all's journal: each run's start time by name (none where the file is missing)."""
    if not path.exists():
        return {}
    return {name: float(t) for t, name in (line.split("\t", 1) for line in path.read_text().splitlines() if "\t" in line)}


def runs_conditions(runs: list, samples: list[tuple], starts: dict[str, float], nproc: int) -> list[tuple]:
    """(name, run_conditions) of each run, over its span from its start to its logs' last write (None for a run that
    did not start)."""
    last_write = lambda log: max((f.stat().st_mtime for f in (log, log.with_suffix(".out")) if f.exists()),
                                 default=time.time())
    gpus = visible_gpus(nproc)  # a run's first GPU, and its others (not counted as other work)
    return [(name, run_conditions(samples, starts[name], last_write(log), gpus[0], tuple(gpus[1:]))
             if name in starts else None) for name, log, *_ in runs]


def log_text(path: Path) -> str:
    """A run's log so far ("" before it has one)."""
    return path.read_text() if path.exists() else ""


def stage_step_ms(times: dict[int, int], stages, skip: int = 2) -> list[dict]:
    """Per stage: the median of the per-step time differences (training step s takes times[s+1] - times[s]),
    leaving out each stage's first `skip` steps and step 0, and the stage's mean."""
    out = []
    for st in stages:
        d = [times[s + 1] - times[s] for s in range(max(st.start, 1), st.end) if s in times and s + 1 in times]
        tail = d[skip:] if len(d) > skip else d
        batch = step_tokens(st)
        out.append(dict(steps=st.end - st.start, batch=batch, median=statistics.median(tail) if tail else None,
                        mean=statistics.fmean(d) if d else None))
    return out


def step_tokens(st) -> int:
    """Tokens per step of a stage: ours (train_gpt.Stage) holds a BatchSpec, the public plan (Stage) a count."""
    return st.spec.batch_size if isinstance(st, tg.Stage) else st.batch


def tokens_at(stages, step: int) -> int:
    return sum(step_tokens(st) * max(0, min(step, st.end) - st.start)
               for st in stages)


def interval95(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% t-interval (0 for a single value)."""
    from scipy.stats import t
    m = statistics.fmean(xs)
    return m, (t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def target_table(results: dict[str, dict[int, tuple]], target: float) -> list[str]:
    """Markdown table: for each run, the first validation at or below the target loss, with the training
    tokens and time spent to get there (tokens '-' where the log and the schedule do not say them)."""
    lines = [f"To val loss <= {target}: the first validation that reached it", "",
             "| run | step | training tokens | training time (s) |", "| --- | --- | --- | --- |"]
    for name, by_step in results.items():
        hit = next((s for s in sorted(by_step) if by_step[s][0] <= target), None)
        if hit is None:
            lines.append(f"| {name} | not reached | - | - |")
            continue
        loss, ms, tokens = (*by_step[hit], None)[:3]
        lines.append(f"| {name} | {hit} | {'-' if tokens is None else f'{tokens:,}'} | {ms / 1000:.1f} |")
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


def finals_table(results: dict[str, dict[int, tuple]], groups: dict[str, list[str]], seeds: dict[str, int]) -> list[str]:
    """Final val loss per group (mean and 95% interval) and, for each group after the first, the mean
    paired difference to the first over the seeds both ran, with its interval."""
    final = {n: r[max(r)][0] for n, r in results.items() if r}
    reference, *others = groups
    lines = ["| group | runs | final val loss, mean +- 95% | paired diff to " + reference + " (seeds), mean +- 95% |",
             "| --- | --- | --- | --- |"]
    for g, members in groups.items():
        xs = [final[n] for n in members if n in final]
        if not xs:
            lines.append(f"| {g} | 0 | - | - |")
            continue
        m, h = interval95(xs)
        cell = "-"
        if g != reference:
            ref = {seeds[n]: final[n] for n in groups[reference] if n in final}
            pairs = [final[n] - ref[seeds[n]] for n in members if n in final and seeds[n] in ref]
            if pairs:
                dm, dh = interval95(pairs)
                cell = f"{dm:+.4f} +- {dh:.4f} ({len(pairs)})"
        lines.append(f"| {g} | {len(xs)} | {m:.4f} +- {h:.4f} | {cell} |")
    return lines


def recipe(cmd: list[str]) -> tuple[str, ...]:
    """A run of ours' flags without its seed, run id and step count: one recipe run at several lengths shares it."""
    argv, out = cmd[next(i for i, c in enumerate(cmd) if c.endswith(".py")) + 1:], []
    i = 0
    while i < len(argv):
        if argv[i] in ("--seed", "--run_id", "--num_iterations"):
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return tuple(out)


def tie_table(results: dict[str, dict[int, tuple]], groups: dict[str, list[str]], seeds: dict[str, int],
              recipes: dict[str, tuple]) -> list[str]:
    """Where one recipe of ours, run at several step counts (labels whose flags differ only in --num_iterations),
    ends at the public code's final loss: for each seed, the trained tokens at which its final loss equals the
    public run's of that seed, linear in tokens between the two step counts whose finals bracket it, and their
    share of the public run's tokens (the issue "Fewer tokens than the frontier" measures tokens so). A seed whose
    finals do not bracket it is extrapolated on the line through the two nearest step counts, and marked so. Empty
    without such a recipe."""
    final = {n: r[max(r)] for n, r in results.items() if r}  # (loss, ms, tokens) at the last validation
    public = {seeds[n]: final[n] for n in groups.get("public", []) if n in final}
    by_recipe: dict[tuple, list[str]] = {}
    for label, key in recipes.items():
        by_recipe.setdefault(key, []).append(label)
    lines = []
    for labels in by_recipe.values():
        if len(labels) < 2 or not public:
            continue
        if not lines:
            lines = ["Tokens to the public code's final loss: each seed's finals at several step counts of one recipe, "
                     "linear in trained tokens between the two that bracket the public run's final (else through the "
                     "two nearest, marked)", "",
                     "| labels | seed | public final | tokens there (share of the public run's) |",
                     "| --- | --- | --- | --- |"]
        shares, extrapolated = [], 0
        for seed, (target, _, public_tokens) in sorted(public.items()):
            points = sorted((final[n][2], final[n][0]) for label in labels for n in groups[label]
                            if n in final and seeds[n] == seed and final[n][2])
            if len(points) < 2:
                continue
            line = lambda a, b: a[0] + (a[1] - target) / (a[1] - b[1]) * (b[0] - a[0]) if a[1] != b[1] else None
            tokens = next((line(a, b) for a, b in zip(points, points[1:]) if min(a[1], b[1]) <= target <= max(a[1], b[1])),
                          None)
            note = ""
            if tokens is None:  # on the line through the two nearest step counts, said so
                below = points[0][1] < target  # the shortest run already ends below it
                tokens = line(*points[:2]) if below else line(*points[-2:])
                note = f", extrapolated {'below the shortest' if below else 'beyond the longest'} run"
                extrapolated += 1
            if tokens is None:
                continue
            shares.append(tokens / public_tokens)
            lines.append(f"| {' / '.join(labels)} | {seed} | {target:.4f} | {tokens:,.0f} ({shares[-1]:.3f}{note}) |")
        if shares:
            m, h = interval95(shares)
            lines.append(f"| {' / '.join(labels)} | mean of {len(shares)}{f' ({extrapolated} extrapolated)' if extrapolated else ''}"
                         f" | - | share {m:.3f} +- {h:.3f} |")
    return lines


def stage_table(per_run: dict[str, list[dict]], full_steps: list[int] | None = None) -> list[str]:
    """ms/step and us/token per stage for each run (runs that did not share the GPU). With full_steps (the public
    schedule's unscaled steps per stage), also each run's time over that schedule: the sum of its stage medians
    times those steps, for runs with one timed stage per public stage (the timing run: --step_div > 1). Then each
    later run's us/token (and schedule time) over the first run's, stage by stage (issue 33's bar: <= 1)."""
    n = max(map(len, per_run.values()))
    whole = full_steps is not None
    lines = ["| run | " + " | ".join(f"stage {i + 1}" for i in range(n))
             + (f" | public schedule ({' / '.join(map(str, full_steps))} steps) |" if whole else " |"),
             "| --- |" + " --- |" * (n + whole)]
    us = {name: [s["median"] * 1000 / s["batch"] if s["median"] is not None else None for s in stages]
          for name, stages in per_run.items()}
    total = {}
    for name, stages in per_run.items():
        cells = [f"{s['median']:.1f} ms ({u:.3f} us/tok, {s['batch']:,}, {s['steps']} steps)" if u is not None else "-"
                 for s, u in zip(stages, us[name])]
        if whole:
            timed = len(stages) == len(full_steps) and all(s["median"] is not None for s in stages)
            total[name] = sum(s["median"] * k for s, k in zip(stages, full_steps)) / 1000 if timed else None
            cells.append(f"{total[name]:.1f} s" if timed else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first, *later = per_run
    ratio = lambda a, b: f"{a / b:.3f}x" if a is not None and b is not None else "-"
    for name in later:
        cells = [ratio(a, b) for a, b in zip(us[name], us[first])] + ["-"] * (len(us[first]) - len(us[name]))
        if whole:
            cells.append(ratio(total[name], total[first]))
        lines.append(f"| {name} / {first} | " + " | ".join(cells) + " |")
    return lines


def report(a, runs: list, code: PublicCode, labels: list[str], plans: list[str] = (), conditions: list[str] = ()):
    """Print (and with --out write) the tables of the runs from their logs, grouped by code (the public code, then
    each of our labels): validation losses and times, finals with paired differences, and (runs one at a time) each
    stage's step time; with --report, from the logs a stopped command left, a run without a log or with part of one
    shown as far as it got."""
    results, seeds, per_stage, cut = {}, {}, {}, {}
    for name, log, _, _, _, seed, stages in runs:
        text = log_text(log)
        by_step = logparse.val_losses(text)
        total = max((s.total for s in logparse.step_lines(text)), default=None)
        if by_step and total is not None and max(by_step) < total:  # stopped before its last validation
            cut[name] = f"{name} (last validation at step {max(by_step)} of {total})"
        if name.startswith("public"):  # the public lines lack tokens: from its schedule
            by_step = {s: (v, ms, tokens_at(stages, s)) for s, (v, ms, _) in by_step.items()}
            logged = logparse.stage_boundaries(text)
            if logged is not None and logged != [(st.start, st.end) for st in stages]:
                print(f"warning: {name} logged stage boundaries {logged}, the harness computed "
                      f"{[(st.start, st.end) for st in stages]}", flush=True)
        results[name], seeds[name] = by_step, seed
        per_stage[name] = stage_step_ms(logparse.step_times(text), stages)
    groups = {label: [n for n, *_ in runs if n.startswith(f"{label} seed ")] for label in labels}
    pub_names = [n for n, *_ in runs if n.startswith("public")]
    if pub_names:
        groups = {"public": pub_names, **groups}
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    shared = "; runs shared the GPU (--parallel): step times are not comparable" if a.parallel else ""
    rule = (f"{a.nproc} GPU(s) per run, batches / {a.batch_div}, steps / {a.step_div}, {a.accum} public "
            f"micro-batch(es) per step per GPU, public attention {a.public_attention}")
    where = (f"Tables rebuilt from the logs of the runs started at {a.report} (--report; the device not recorded "
             "here)" if a.report else f"Device: {device}; PyTorch {torch.__version__}")
    lines = [f"{where}; public code {code.name}: {code.origin}; {rule}; validation {a.val_tokens:,} tokens in buffers "
             f"of {a.val_seq_len:,}{shared}",
             f"Command: python bench/side_by_side.py {' '.join(sys.argv[1:])}", *(["Data: " + "; ".join(plans)] if plans else []),
             f"Patches: {', '.join(patches_for(code.name))} (bench/side_by_side.py PATCHES)"]
    missing = [f"{name} ({log})" for name, log, *_ in runs if not log.exists()]
    if missing:
        lines.append("No log: " + ", ".join(missing))
    if cut:  # a stopped run's last validation is not its final loss
        lines.append("Stopped before their last step, left out of the finals and the tie table: "
                     + ", ".join(cut.values()))
    finished = {n: r for n, r in results.items() if n not in cut}
    lines += ["", *format_table(results, groups), "", *finals_table(finished, groups, seeds)]
    recipes = {label: recipe(next(cmd for n, _, cmd, *_ in runs if n.startswith(f"{label} seed ")))
               for label in labels if groups.get(label)}
    tie = tie_table(finished, groups, seeds, recipes)
    lines += ["", *tie] if tie else []
    if a.target is not None:
        lines += ["", *target_table(results, a.target)]
    if not a.parallel:
        full = [st.end - st.start for st in public_stages(code.script, a.batch_div)] if a.step_div > 1 \
            else None  # the timing run: each code's stage times over the public schedule's own step counts
        lines += ["", "Per stage: median ms per step (us per token, tokens per step, steps), each stage's first two "
                  "steps left out" + (", and the public schedule's time at these step times" if full else "")
                  + "; then each later run over the first", "",
                  *stage_table(per_stage, full)]
    if conditions:
        lines += ["", *conditions]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--public", required=True, type=Path, help="a checkout of KellerJordan/modded-nanogpt")
    p.add_argument("--public_code", choices=["master", "89", *RECORD_MD5], default="master")
    p.add_argument("--public_commit", default=PUBLIC_MASTER, help="the commit --public_code master runs")
    p.add_argument("--public_attention", choices=["fa3", "fa4", "varlen"], default="fa3",
                   help="the public code's attention (FA3 of xformers==0.0.34, FA4 of flash-attn-4, or PyTorch's "
                        "varlen); ours gets --attention of the same kernels")
    p.add_argument("--train_files", required=True)
    p.add_argument("--val_files", required=True)
    p.add_argument("--batch_div", type=int, default=16, help="divide every stage's batch by this")
    p.add_argument("--step_div", type=int, default=1,
                   help="divide step counts and step constants by this")
    p.add_argument("--accum", type=int, help="public micro-batches per step on each GPU (default: 1 with "
                   "--batch_div > 1, else 8 // --nproc, the public code's)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs per run (torchrun --nproc_per_node), for every run; "
                   "the runs go one at a time")
    p.add_argument("--val_every", type=int, default=125, help="validate every N steps")
    p.add_argument("--val_tokens", type=int, default=983040)
    p.add_argument("--val_seq_len", type=int, default=40960)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="one run of ours per seed")
    p.add_argument("--public_seeds", type=int, nargs="*", default=[0, 1, 2], help="one public run per seed, seeded "
                   "before its model is built (no values: no public run)")
    p.add_argument("--ours", type=Path, default=ROOT / "train_gpt.py", help="our trainer file")
    p.add_argument("--ours_args", default="", help="extra `--field value` flags for every run of ours")
    p.add_argument("--label", default="ours", help="column name for our runs")
    p.add_argument("--variant", nargs=2, action="append", default=[], metavar=("NAME", "ARGS"),
                   help="one more variant of ours: --ours_args plus these flags (repeatable); --seeds runs of each, "
                        "compared with the public code, or without public runs with the first variant")
    p.add_argument("--parallel", action="store_true", help="start every run at once (curves only)")
    p.add_argument("--stagger", action="store_true", help="with --parallel: start the other runs of a code once "
                   "its first run trains (they then load its compiled graphs from the cache)")
    p.add_argument("--max_parallel", type=int, default=0, help="with --parallel: at most this many runs at once "
                   f"(0: as many as fit, one per {RUN_GIB} GiB of GPU memory)")
    p.add_argument("--work", type=Path, default=Path("/tmp/side_by_side"), help="staging and log folder")
    p.add_argument("--target", type=float, help="also tabulate the tokens and time each run took to reach this val loss")
    p.add_argument("--profile_step", type=int, help="profile public training steps N and N+1 and print "
                   "the top kernels into its log")
    p.add_argument("--warm_first", action="store_true", help="before the runs, which then go one at a time: each "
                   "code's first run once, all at the same time, untimed, so that every timed run compiles from a warm "
                   "cache (one cold compile's wait instead of one per code; the warming runs train their whole "
                   "schedule: meant for the short timing runs, --step_div 16)")
    p.add_argument("--alternate", action="store_true", help="run the codes in turns, one at a time: public seed 0, "
                   "ours seed 0, public seed 1, ours seed 1, ... (A B A B), so that a drift of the machine falls on "
                   "both codes alike; with --warm_first, the timing behind --plan's rows (--public_seeds 0 1 --seeds 0 1)")
    p.add_argument("--allow_repeat", action="store_true", help="let our runs read the shards more than once (our "
                   "loader then starts over; the public loader cannot): for timing runs on a small corpus, whose losses "
                   "are not compared")
    p.add_argument("--start_after", help="public runs wait after their warm-up until this file exists, "
                   "then start the clock (compile a timing run while learning runs still share the GPU)")
    p.add_argument("--check_only", action="store_true", help="stage and check the data plan, run nothing")
    p.add_argument("--report", metavar="STAMP", help="run nothing: the tables of the runs a command with these same "
                   "flags started at STAMP (the stamp in their log names, as 20261129_165049), from the logs they left in "
                   "--work; for a command stopped before it printed them (a run that did not finish shows what its log "
                   "holds)")
    p.add_argument("--out", type=Path, help="also write the table here")
    a = p.parse_args()
    if (a.warm_first or a.alternate) and a.parallel:
        fail(f"--{'warm_first' if a.warm_first else 'alternate'} is for runs timed one after the other; --parallel "
             "runs share the GPU anyway")
    if a.nproc < 1 or 8 % a.nproc:
        fail(f"--nproc {a.nproc}: the public code runs on a divisor of 8 GPUs (8 // world_size micro-batches): "
             "use --nproc 1, 2, 4 or 8")
    if a.parallel and a.nproc > 1:
        fail(f"--parallel shares one GPU between runs; with --nproc {a.nproc} each run takes all {a.nproc} GPUs: "
             "leave out --parallel (the runs go one after the other)")
    if a.accum is None:
        a.accum = 1 if a.batch_div > 1 else 8 // a.nproc
    per_step = a.nproc * a.accum * a.val_seq_len  # the public val_batch_size: val_seq_len per rank and micro-batch
    if a.val_tokens % per_step:
        fail(f"the public code needs --val_tokens to be a multiple of --nproc x its micro-batches x --val_seq_len "
             f"({a.nproc} x {a.accum} x {a.val_seq_len} = {per_step:,}): use --val_tokens "
             f"{max(1, round(a.val_tokens / per_step)) * per_step}")

    variants = [(a.label, ""), *a.variant]  # each variant: ours with --ours_args and its own flags
    if (len({name for name, _ in variants}) < len(variants) or any(n.startswith("public") for n, _ in variants)
            or not all(re.fullmatch(r"[\w.-]+", n) for n, _ in variants)):
        fail("--label and the --variant names must differ, be made of letters, digits, '_', '.' or '-', and not "
             "start with 'public'")

    code = public_source(a.public, a.public_code, a.public_commit)
    pub_batches = sorted({st.batch for st in public_stages(code.script, a.batch_div)})
    if a.public_seeds and any(b % (a.accum * a.nproc) for b in pub_batches):  # its loader asserts this
        fits = [k for k in range(a.accum, 0, -1) if all(b % (k * a.nproc) == 0 for b in pub_batches)]
        fail(f"the public stage batches ({', '.join(f'{b:,}' for b in pub_batches)} tokens) do not split into --accum "
             f"{a.accum} x --nproc {a.nproc} micro-batches: "
             + (f"use --accum {fits[0]}" if fits else f"use a --batch_div that leaves them multiples of {a.nproc}"))
    if a.report:  # nothing staged or read but the logs: the schedules from the patched script in memory
        stage = a.work / f"public_{code.name}"
        pub_stages = public_stages(staged_files(a, code, stage, a.val_files)["train_gpt.py"], a.batch_div)
    else:
        stage = stage_public(a, a.work, code)
        train_files = tg.shard_files(a.train_files, "training")
        pub_stages = public_stages((stage / "train_gpt.py").read_text(), a.batch_div)
    ours_common = ["--preset", "record", "--attention", a.public_attention, "--train_files", a.train_files,
                   "--val_files", a.val_files, "--val_tokens", str(a.val_tokens), "--val_seq_len", str(a.val_seq_len),
                   "--val_every", str(a.val_every), "--log_dir", str(a.work / "logs"), *a.ours_args.split()]
    env_public = {"PYTHONPATH": os.pathsep.join([str(stage), *filter(None, [os.environ.get("PYTHONPATH")])]),
                  "TORCHINDUCTOR_CACHE_DIR": str(a.work / f"cache_public_{code.name}"), "PYTHONUNBUFFERED": "1"}
    # every variant of ours compiles into one Inductor cache, the caller's if set (shared across commands), else one
    # in --work: variants that differ in a schedule or a flag share most graphs and their tuned kernels, and a later
    # command finds them (compiling is untimed: only the warm-up shortens)
    env_ours = {"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(a.work / "cache_ours")}
    for label, extra in variants if a.seeds else []:  # our BatchProducer deals a step's micro-batches to the ranks
        h = tg.parse_args([*ours_common, *extra.split()])
        if h.batch_size // h.seq_len % a.nproc:
            fail(f"{label}: its {h.batch_size // h.seq_len} micro-batches per step (batch_size / seq_len) do not "
                 f"split over --nproc {a.nproc}: give it a batch_size of seq_len x a multiple of {a.nproc}")

    def make_runs(stamp: str) -> list:
        """(column, log path, command, cwd, env, seed, stages) of every run, its files named by stamp (each public
        run's script written into the stage, but for --report)."""
        runs = []
        for seed in a.public_seeds:
            rid = f"public_{code.name}_{stamp}_seed{seed}"
            if not a.report:
                source_i = override((stage / "train_gpt.py").read_text(), "run_id", repr(rid))
                (stage / f"{rid}.py").write_text(seed_public(source_i, seed))
            runs.append((f"public {code.name} seed {seed}",
                         stage / "logs" / f"{rid}.txt",
                         ["torchrun", "--standalone", f"--nproc_per_node={a.nproc}", f"{rid}.py"],
                         stage, env_public, seed, pub_stages))
        for label, extra in variants:
            for seed in a.seeds:
                rid = f"{label}_{stamp}_seed{seed}"
                argv = [*ours_common, *extra.split(), "--seed", str(seed), "--run_id", rid]
                runs.append((f"{label} seed {seed}", a.work / "logs" / f"{rid}.txt",
                             ["torchrun", "--standalone", f"--nproc_per_node={a.nproc}", str(a.ours.resolve()), *argv],
                             ROOT, env_ours, seed, training_stages(tg.Schedule(tg.parse_args(argv)))))
        return runs

    def data_plans(train_files: list[str] | None) -> list[str]:
        """Each code's and label's steps, tokens trained and tokens read (the loaders simulated on the host); without
        the shards (None: --report away from the data) the tokens trained from the schedules alone."""
        plans = []
        if a.public_seeds:
            steps = len(step_plan(pub_stages))
            if train_files is None:
                plans.append(f"public {code.name}: {steps} steps, {tokens_at(pub_stages, steps):,} tokens trained")
            else:
                pub = simulate_public_loader(train_files, pub_stages, a.accum, a.nproc)
                plans.append(f"public {code.name}: {steps} steps, {pub['trained']:,} tokens trained, reads "
                             f"{pub['read']:,} of the shards' {pub['total']:,}")
        for label, extra in variants if a.seeds else []:
            args = tg.parse_args([*ours_common, *extra.split()])
            if train_files is None:
                trained = tokens_at(tg.Schedule(args).stages, args.num_iterations)
                plans.append(f"{label}: {args.num_iterations} steps, {trained:,} tokens trained")
                continue
            try:
                ours = simulate_our_loader(train_files, args)
            except DataExhausted as e:
                if not a.allow_repeat:
                    raise
                plans.append(f"{label}: {args.num_iterations} steps, {e}, as --allow_repeat lets it (a timing run: "
                             "its losses are not for comparison)")
                continue
            plans.append(f"{label}: {args.num_iterations} steps, {ours['trained']:,} tokens trained, reads "
                         f"{ours['read']:,} of {ours['total']:,}")
        return plans

    stamp = a.report or time.strftime("%Y%m%d_%H%M%S")
    runs = in_turns(make_runs(stamp)) if a.alternate else make_runs(stamp)
    if a.report:  # the conditions from the monitor's file and the runs' journal, where the command left them
        monitored, journal = a.work / f"gpu_monitor_{stamp}.csv", a.work / f"runs_{stamp}.tsv"
        missing = [f.name for f in (monitored, journal) if not f.exists()]
        conditions = ([f"Conditions: not recorded (not in --work: {', '.join(missing)})"] if missing else
                      conditions_table(runs_conditions(runs, read_monitor_csv(monitored), read_journal(journal),
                                                       a.nproc)))
        # the Data: line (pair_tables' --tie reads each label's tokens from it): the tokens read where the shards are
        # here to plan from, else the tokens trained alone
        try:
            files = tg.shard_files(a.train_files, "training")
        except FileNotFoundError:
            files = None
        try:
            plans = data_plans(files)
        except DataExhausted as e:
            print(f"no Data: line: {e}", file=sys.stderr)
            plans = []
        report(a, runs, code, [label for label, _ in variants], plans, conditions=conditions)
        return

    print(f"public code: {code.name}, {code.origin}; staged in {stage}", flush=True)
    try:  # the data check, before any GPU time: no run may read a token twice
        plans = data_plans(train_files)
    except DataExhausted as e:
        fail(f"{e}: the shards hold too few tokens for this schedule once; use a larger --batch_div or "
             "--step_div, or more data")
    print("data plan: " + "; ".join(plans), flush=True)
    check_vocabulary()
    if a.check_only:
        return
    if a.warm_first:  # each code's first run once, all at the same time: its compile cache fills while they share
        warm = []
        for r in make_runs(stamp + "_warm"):
            if all(group_of(w[0]) != group_of(r[0]) for w in warm):
                warm.append(r)
        print(f"warming the compile caches: {', '.join(r[0] for r in warm)} at once (their times are not used)",
              flush=True)
        procs = launch_all(warm, len(warm), False)
        failed = [f"{name} exited with {proc.returncode}; its output: {log.with_suffix('.out')}"
                  for (name, log, *_), proc in zip(warm, procs) if proc.wait() != 0]  # every run ends first
        if failed:
            fail("the cache-warming run of " + "; ".join(failed))
    at_once = (a.max_parallel or runs_that_fit()) if a.parallel else 1
    monitor = GpuMonitor(path=a.work / f"gpu_monitor_{stamp}.csv")  # written as it goes, as is the journal
    procs = launch_all(runs, at_once, a.parallel and a.stagger, journal=a.work / f"runs_{stamp}.tsv")
    for (name, log, *_), proc in zip(runs, procs):
        if proc is not None and proc.wait() != 0:
            print(f"{name} exited with {proc.returncode}; its output: {log.with_suffix('.out')}", flush=True)
    monitor.stop()
    conditions = runs_conditions(runs, monitor.samples, {r[0]: p.started_at for r, p in zip(runs, procs) if p}, a.nproc)
    report(a, runs, code, [label for label, _ in variants], plans, conditions_table(conditions, monitor.error))


if __name__ == "__main__":
    main()
