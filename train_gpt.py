"""GPT-2-small speedrun: train a ~124M-parameter GPT on FineWeb to <= 3.28 validation loss, fast.

One file, read top to bottom: hyperparameters -> model -> optimizers -> data -> schedule -> training
loop; every kernel and custom op (Triton kernels, the FP8 LM head and its loss, the attention backends)
lives next to it in kernels.py. Launch with `torchrun --standalone
--nproc_per_node=8 train_gpt.py` (see run.sh); every hyperparameter is a `--field value` override.
The log written to logs/<run_id>.txt starts with the full source of this file, kernels.py and data/shards.py,
so every result names the exact code that made it.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import glob
import hashlib
import itertools
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import unicodedata
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple


def _interrupted_at_start(*_):
    print("train_gpt.py: interrupted before training started; nothing was saved", file=sys.stderr, flush=True)
    # the shell's status for Ctrl-C, at once: a SystemExit raised inside a library's import can be swallowed by its
    # bare `except:` (a run went on to its end after Ctrl-C once in the test suite); nothing is open to clean up yet
    os._exit(130)


if __name__ == "__main__":  # Ctrl-C while the libraries load or the model compiles: one line, no traceback
    signal.signal(signal.SIGINT, _interrupted_at_start)  # (the training loop's own handler saves and stops)

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernels  # kernels and custom ops (kernels.py, next to this file; logged with it)
from kernels import (ATTENTION_BACKENDS, E4M3_MAX, HEAD_GRAD_SCALE, HEAD_W_SCALE, MIXED_WIDTHS, ModelKernels,
                     attention_reference, choose_kernels, document_ids, head_x_scale)


# -----------------------------------------------------------------------------------------------
# Hyperparameters: every field is a command-line override, `--field value`.
# The defaults are the record (--preset record, what a command without --preset runs); the other presets (PRESETS,
# below) train the same model at other sizes or batch layouts.

DATA_PATH = os.environ.get("DATA_PATH", os.path.dirname(os.path.abspath(__file__)))
BOS_ID = 50256  # GPT-2's <|endoftext|>, put before every document: the speedrun's beginning of sequence


@dataclass(frozen=True)
class Stage:
    """A stage of the schedule: a row of its table (Hyperparameters.stages), then, once Schedule has resolved it,
    also its steps and what it trains with in tokens. A row is a stretch of training with its own batch, document
    cut, attention window, learning-rate multiplier and multi-token prediction weights. The rows share the scheduled
    steps in proportion to `share`, in order; the extension (extension_steps) follows as one more stage.
    On the command line: --stages "window=3,doc_len=896;window=7;window=11" (fields left out keep their
    defaults; mtp's weights joined by '/')."""
    # The row: the table's columns (STAGE_TEXT, below: the --stages text).
    window: int  # long attention window in window_block blocks (the short blocks' is half of it)
    batch: int = 0  # global batch in tokens; 0: batch_size (the micro-batch count stays: their length follows the batch)
    doc_len: int = 0  # training documents are cut at this length and the rest dropped; 0: max_doc_len
    lr: float = 1.0  # multiplies both optimizers' learning rates, before the cooldown's decay
    # Multi-token prediction (2025-12-22 record, @varunneal, PR 178): position t is also trained on the tokens at
    # t+2, t+3, ... of its document (same head), with these weights at the stage's start, moving linearly to the
    # next row's by its start (the last row and the extension hold theirs); every row has the same count. The
    # record's [1, 0.5, 0.25 -> 0], [1, 0.5 -> 0], [1] over three stages: mtp=0.5/0.25, 0.5/0, 0/0.
    mtp: tuple[float, ...] = ()
    # Prefix-token loss (2026-07-13 record, PR 337): position t is also trained on the longest proper byte prefix
    # of its target that is itself a token (prefix_table), at this weight at the stage's start, moving linearly
    # to the next row's by its start. The record's 0.25 -> 0.25, 0.25 -> 0, 0: prefix=0.25, 0.25, 0.
    prefix: float = 0.0
    # Sampled softmax in training (the public record ANVIL2's, 2026-08-30): the head's softmax over this many of its
    # rows per micro-batch, every target of the loss among them (sampled_head), until the step full_softmax_from
    # of the run; 0 = the full softmax. Validation always takes the full softmax. ANVIL2's 10,240 / 14,336 / 24,576.
    candidates: int = 0
    share: int = 1  # this row's share of the scheduled steps, relative to the other rows'
    # Resolved by Schedule (a row of the table leaves them at these defaults): token counts, and where it falls.
    start: int = 0  # the first step of the stage
    end: int = 0  # the stage covers steps [start, end); the last stage's end is past the final validation's step
    spec: BatchSpec | None = None  # batch and doc_len in tokens: global batch, micro-batch length, document cut
    windows: tuple[int, int] = (0, 0)  # window in tokens: the long and the short blocks' left attention windows
    mtp_ramp: tuple[tuple[float, float], ...] = ()  # mtp as (start, end) weights of targets t+2, t+3, ... (mtp_pairs)
    prefix_ramp: tuple[float, float] = (0.0, 0.0)  # prefix as its (start, end) weight

    def loss_weights(self, step: int) -> tuple[float, ...]:
        """The multi-token prediction weights of targets t+2, t+3, ... at a step, then the prefix-token
        loss' weight if the stage has that term: linear over the stage from its start to its end values
        (as the record anneals them, reaching the end value at the next stage's first step)."""
        f = min(max((step - self.start) / (self.end - self.start), 0.0), 1.0)
        prefix = (self.prefix_ramp,) if any(self.prefix_ramp) else ()
        return tuple(a + (b - a) * f for a, b in self.mtp_ramp + prefix)

    def with_slots(self, slots: dict[tuple[int, int], int]) -> Stage:
        """The stage with its micro-batches' cu_seqlens length (BatchSpec.num_docs) from doc_slots."""
        return dataclasses.replace(self, spec=dataclasses.replace(
            self.spec, num_docs=slots[self.spec.seq_len, self.spec.max_doc_len]))


# The columns of the stages table, in the --stages text: field -> how its text reads (mtp's weights joined by '/')
STAGE_TEXT = {"window": int, "batch": int, "doc_len": int, "lr": float,
              "mtp": lambda v: tuple(float(w) for w in v.split("/") if w.strip()), "prefix": float,
              "candidates": int, "share": int}


def number_text(v: float | int) -> str:
    """A number as short as it reads back exactly: 1.52, not 1.5200000000000000; 1e-10; 3."""
    return f"{v:g}" if float(f"{v:g}") == v else repr(v)


def format_stages(stages) -> str:
    """The --stages text of a table: rows joined by ';', each field that differs from its default."""
    defaults = Stage(0)
    return ";".join(",".join(f"{name}={'/'.join(map(number_text, v)) if name == 'mtp' else number_text(v)}"
                             for name in STAGE_TEXT
                             if (v := getattr(row, name)) != getattr(defaults, name) or name == "window")
                    for row in stages)


@dataclass
class Hyperparameters:
    # data
    train_files: str = os.path.join(DATA_PATH, "data/fineweb10B/fineweb_train_*.bin")  # training shards (glob), read in name order
    val_files: str = os.path.join(DATA_PATH, "data/fineweb10B/fineweb_val_*.bin")  # validation shard(s) (glob): the first val_tokens tokens are the validation set
    val_tokens: int = 10_485_760  # fixed validation set, the same on any world size
    bos_id: int = BOS_ID  # the token that starts every document
    # batches: one micro-batch is a 1-D buffer of whole documents (varlen attention)
    batch_size: int = 8 * 49152  # tokens per optimizer step, summed over ranks and accumulation steps
    seq_len: int = 49152  # tokens per micro-batch (one rank, one accumulation step)
    val_seq_len: int = 262144  # validation buffer: context resets at its edges (the public speedrun's 262,144)
    max_doc_len: int = 2048  # training documents are cut here and the rest dropped (validation: never cut)
    max_num_docs: int = 0  # cu_seqlens padded to this many sequences (static shapes); 0: this run's fullest micro-batch (doc_slots)
    # model: the public master's 11 blocks in ANVIL2's layout (record #92, 08/30/26): block 7 removed, no attention in
    # blocks 4, 6 and 9, long windows in blocks 3 and 10
    vocab_size: int = 50304  # GPT-2's 50,257 padded to a multiple of 128 for fast matmuls (@Grad62304977)
    num_layers: int = 11  # transformer blocks (09/03/25: 12)
    model_dim: int = 768  # residual stream width
    num_heads: int = 6  # attention heads per block
    head_dim: int = 128  # width of each attention head
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio x model_dim (where mlp_hidden is 0)
    # ANVIL2's rate on its MLP (ANVIL, its Muon) is its shape factor max(1, hidden/dim)^0.5 x (1, 2): (1.915, 3.830)
    # at 2816. mlp_muon_lr_mults' (2, 4) is that rule at 3072 and stays as set whatever the width (the record's 2816
    # was measured at (2, 4): bench/results/arch_h200_20261129d.md)
    mlp_hidden: int = 2816  # MLP hidden width exactly, 0 = mlp_ratio x model_dim: the record's 2816 at model_dim 768, ANVIL2's (record #92, 08/30/26; before it 3072)
    no_attn_layers: tuple[int, ...] = (4, 6, 9)  # blocks without attention: the record's 4, 6, 9 are ANVIL2's (record #92, 08/30/26; before it 6, as 09/03/25's block 7 of 12, @YouJiacheng)
    # ANVIL2 (the public record #92) removes block 7 whole and the attention of blocks 4 and 9. Block indices stay as
    # they are (block 8 is still block 8): a removed block has no attention, no MLP and no bigram injection, but keeps
    # its residual weights and its gated x0 injection (ANVIL2: "residual structure ... intact")
    skip_layers: tuple[int, ...] = (7,)  # blocks without attention or MLP, only their residual weights: the record removes block 7, as ANVIL2 (record #92, 08/30/26)
    # ANVIL2 also runs a second MLP beside block 8's, in the MLP bank's spare slot 11 (its train_gpt.py, at the start of
    # records/track_1_short/2026-08-30_ANVIL2/this_pr/*.txt, @fd1b14a5: `if i == 8:` "Parallel second MLP on layer 8"):
    # it reads the same normed input, its output projection starts at zero (the same function at step 0), its output
    # joins the MLP's under the block's MLP output weight, and it learns at the MLP rates (per_matrix_lr_mul 1 / 2)
    parallel_mlp_blocks: tuple[int, ...] = (8,)  # blocks with a second MLP beside their own: same input, output projection zero at the start, summed before the MLP output's weight; the record's 8 is ANVIL2's (record #92, 08/30/26)
    # ANVIL2 injects x0 and the n-gram (its "hashed bigram") embedding on fewer blocks than every one before the last:
    # `_NOINJ_X0 = frozenset((3, 8, 9))`, `_NOINJ_BG = frozenset((2, 3, 7, 8))` (its train_gpt.py, printed at the start
    # of records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-*.txt @fd1b14a5, ~102k characters in), and its skip
    # target, layer 6, only adds the skip: `elif i == 6:` `x = x + skip_gate_out * cache[3]` (~143k): no
    # resid_lambdas_attn[6] (its MLP's residual lambda stays), no x0, no n-gram injection. A block listed below has no
    # gate output for what it skips (the MUDD gates' layout leaves it out); the last block's weights are MUDD's, so it
    # is in none of them
    no_x0_blocks: tuple[int, ...] = (3, 6, 8, 9)  # blocks that take no x0 injection (no x0 gate output): the record's 3,6,8,9 are ANVIL2's (record #92, 08/30/26)
    no_ngram_blocks: tuple[int, ...] = (2, 3, 6, 8)  # blocks that take no n-gram (bigram + trigram) embedding (no gate output for it): the record's 2,3,6,8 are ANVIL2's (record #92, 08/30/26; its 7 is the removed block, which has none)
    no_resid_scale_blocks: tuple[int, ...] = (6,)  # blocks whose residual enters unscaled (no learned weight before the attention; the one around the MLP stays): the record's 6 is ANVIL2's (record #92, 08/30/26)
    # untied value embeddings (01/26/26, init 02/03/26): these blocks have a table each, drawn N(0, 0.01)
    value_embed_blocks: tuple[int, ...] = (1, 2, 8, 10)  # blocks with a value-embedding table each, N(0, 0.01); () = off: the record's 1,2,8,10 are ANVIL2's (record #92, 08/30/26; before it 1,2,8,9,10)
    window_pattern: str = "SSSLSSSSSSL"  # per block: L = long window, S = short window (half)
    window_block: int = 128  # tokens per window block
    attn_scale: float = 0.1  # attention logit scale, QK being normed (@leloykun; 09/03/25: 0.12; YaRN raises it)
    gate_channels: int = 12  # input channels of the sparse head gate
    rotary_min_freq: float = 1 / 1024  # lowest rotary frequency (the highest is 1)
    logit_softcap: float = 23.0  # logits = logit_softcap * sigmoid((z + softcap_shift) / softcap_temp) (09/03/25: 30)
    softcap_temp: float = 7.5  # the softcap's temperature
    softcap_shift: float = 5.0  # asymmetric softcap: 5 with logit_softcap 23 is the 2025-12-26 record's cap (09/03/25: 0)
    # half the n-gram table, as ANVIL2's layout (bigram rows [0, V/2)): on the proxy at 5.0M rows, the even split
    # against 377,280 bigram rows -0.0028 +- 0.0014 (3 paired seeds, bench/results/learning_decisions.md); ~5% more
    # distinct rows a step
    bigram_rows: int = 10_575_360  # rows of the bigram hash embedding, 0 = off (01/19/26; 377,280 from 05/27/26 to the even split of 12/03/26)
    bigram_sign_rows: int = 8_192  # rows of fixed random +-1 signs that multiply bigram rows, 0 = none (05/20/26)
    # the trigram channel of ANVIL2 (modded-nanogpt 2026-08-30: half of its 84.6M-row table): rows after the bigram
    # rows of the same table, hashed from (t-2, t-1, t) within a document, signed from the same sign rows. With the
    # bigram rows 21,150,720 in all, which split over 1, 2, 4 and 8 GPUs (ngram_sparse_adam shards the table). On the
    # proxy: -0.0136 +- 0.0076 at 4.6M rows (3 paired seeds), -0.0138 at 20.8M (2 seeds); 1.015x a step at 4.6M rows
    # on one H200 (bench/results/learning_decisions.md)
    trigram_rows: int = 10_575_360  # trigram hash rows summed with the bigram lookup, 0 = none: with the bigram rows ANVIL2's ~21M-row point of its FineWeb size sweep (record #92, 08/30/26), ~31 of its 36 millinats at a quarter of its 84.6M-row table's memory
    # public pull request 375 (on ANVIL2: 1,179 against 1,194 steps; -6.2 +- 1.5 millinats over 16 seeds of its
    # one-GPU proxy): the n-gram rows and signs hashed from normalized token ids (normalized_token_table: NFKC,
    # accents stripped, lowercase, whitespace runs as one space), so " The" / "the" / "THE" share rows; the model
    # reads and predicts the raw tokens. On our proxy at 680 steps, 3 paired seeds: -0.0045 +- 0.0037, lower in every
    # seed (one H200, 2026-12-03: bench/results/nnorm_h200_20261203.md); its cost, one gather of the ids
    ngram_normalize: bool = True  # PR 375's n-gram hashing over normalized token ids (normalized_token_table); GPT-2's vocabulary only
    ngram_spread: bool = False  # the n-gram table's rows stored in a scattered order (row x NGRAM_SPREAD_MULT mod rows, a bijection: the same model, relabelled), so that each GPU's block of a sharded table holds its share of the bigram channel's rows; in row order the first half of the GPUs owns them, and a bigram row recurs more within a step than a trigram row: at 8 GPUs each of that half serves ~33K distinct rows of a 393K-token step, each of the other ~61K (the proxy's text; with 377,280 bigram rows the first GPU served 140K, another ~31K)
    # backout (10/04/25): a learned multiple of this block's output is subtracted before the head; MUDD mixes it in
    # and the later blocks attend over it (parallel attention inputs, 03/06/26)
    backout_layer: int = 7  # the backout block: below the last, after the attention-less one
    paired_head_blocks: tuple[int, ...] = (0, 2, 5)  # paired-head attention in these short-window blocks (01/07/26): the record's 0,2,5 are ANVIL2's (record #92, 08/30/26; before it 0,2,5,9)
    # learnable XSA (04/29/26): each head removes tanh(a) of its output along its own value, a set per token by the gates
    xsa_blocks: tuple[int, ...] = (1, 3)  # XSA in these blocks (05/27/26): the record's 1,3 are ANVIL2's (record #92, 08/30/26; before it 1,3,4,7)
    # ANVIL2's narrow heads (its train_gpt.py, printed at the start of records/track_1_short/2026-08-30_ANVIL2/this_pr/
    # 32a48562-*.txt @fd1b14a5, ~100k characters in): "the long-window carriers {3,10} keep the full d_qk=128 head,
    # every other layer runs d_qk=64 with a fully-rotating 64-dim rotary at this scale", QK_NARROW_ATTN_SCALE = 0.13
    # (its wide heads': 0.085), and "these layers carry d_v = 64 end to end", _DV64_LAYERS = (1, 4, 7, 8) (4 and 7
    # have no attention there). A narrow Q/K is QK-normed over its width and rotates all of it at the frequencies of
    # the wide heads' rotating half; a narrow V takes its heads' first halves of the value embedding (ANVIL2: "adding
    # only the live half") and narrows the output projection's input. Long-window blocks stay wide: their key offset
    # moves the dims rotary leaves alone, which a narrow head has none of. On the proxy -0.0001 +- 0.0037 (3 seeds), the
    # step 0.972x on FA4 (one H200; bench/results/dc_narrow_2gpu_h200_20261129k.md)
    narrow_qk_blocks: tuple[int, ...] = (0, 1, 2, 5, 8)  # blocks whose Q and K heads are head_dim/2 wide, all of it rotating, at narrow_attn_scale; short-window blocks with attention: ANVIL2's (#92)
    narrow_v_blocks: tuple[int, ...] = (1, 8)  # blocks of narrow_qk_blocks whose V heads (and the output projection's input) are head_dim/2 wide too: ANVIL2's (#92)
    # DC attention in the last block (05/27/26 record, PR 315: DCMHA's post-composition, rank 1, 112 keys back, weights
    # from the MUDD gates); ANVIL2 (#92) runs without it. Removed on the proxy: +0.0080 +- 0.0048 (3 seeds, ~2% of the
    # tokens), the step 0.925x (one H200, FA4; bench/results/dc_narrow_2gpu_h200_20261129k.md)
    dc_attention: bool = True  # DC attention in the last block
    # The document-local copy feature of public pull request 378 (on ANVIL2; 1,132 against 1,194 steps with PR 375's
    # normalized n-gram hashing, step +2.4%): each position's candidate, the token that followed the latest earlier
    # occurrence in its document of its longest matching context (doc_copy_candidates), enters as embed(candidate) x
    # a gain per bucket (match length x occurrences) + an embedding per bucket, both zero at the start, added to the
    # token embedding before its norm (x 0.5 at the start) and before the final norm (x 1); here over raw token ids, its
    # matches found a micro-batch ahead (plan_copy_ahead). On the proxy the master's loss at 0.832 +- 0.034 of its
    # tokens against 0.885, step +3.7% at the 8-GPU per-GPU shape (one H200): ~0.975 of the time to that loss
    doc_copy: bool = True  # PR 378's document-local copy candidates as an input feature (doc_copy_candidates)
    narrow_attn_scale: float = 0.13  # attention logit scale in narrow_qk_blocks, QK normed over head_dim/2 (YaRN raises it as attn_scale): ANVIL2's 0.13
    # the copy-pointer mixture of public pull request 379 (not in the master): on the proxy -0.0398 +- 0.0040 at
    # equal tokens, +5.0% step (an H200)
    cplm_bands: tuple[int, ...] = (2048, 8192)  # copy mixture (CPLM, PR 379): pointer bands in training, evaluation; () = off
    # one skip instead of the U-net, weighted sigmoid(l), l = -1.5 at init (2025-11-18 and 12-14 records, PRs 159, 169)
    skip_from: int = 3  # one skip from this block's output into the first attention-less block (or skip_into)
    skip_into: int = 6  # the attention-less block the skip goes into; 0 = the first one: the record's 6 is ANVIL2's (record #92, 08/30/26; before it 0, block 6 being the only one)
    # schedule: the stages in order (rows of Stage, above), sharing the scheduled steps, then extension_steps more.
    # Three stages of equal steps with 3 / 7 / 11-block windows, short documents in the first (02/10/26),
    # multi-token prediction (12/22/25), the prefix-token loss (07/13/26) and ANVIL2's sampled softmax (08/30/26: the
    # head's rows a micro-batch of 49,152 tokens; full from full_softmax_from); on the proxy +0.0090 +- 0.0073 at equal
    # tokens, 0.886x the step on one H200 (bench/results/learning_decisions.md). Learning rates x 1 in stages 2-3:
    # x 1.3 (the public line's 1.52 / 1.73 at 262K / 393K tokens a step) beat 1 on the proxy with full-width heads,
    # but with the narrow heads at 840 steps it ended +0.016 above full heads at 1.3 (3 seeds, 2026-11-30), where the
    # narrow heads at 1 had equalled full heads at 1; at 689 steps x 1.15 +0.0079 +- 0.0129, x 0.87 +0.0015 +- 0.0036
    # and a 30-step extension instead of 20 +0.0009 +- 0.0021 (3 seeds, 2026-12-03: bench/results/
    # plan689_h200_20261203f.md). Documents cut at 896 / 2,048 / 4,096 tokens (the extension keeps
    # the last); ANVIL2's sequence caps (its README) are 896 / 2,048 / 3,072. On the proxy the 3,072 cut against 2,048
    # ended -0.0080 +- 0.0024 at 760 steps (seeds 3-5), the master's loss at 0.815 of its tokens against 0.832 (one
    # H200, 2026-12-02: bench/results/step_count_h200_20261201.md); 4,096 against 3,072 at 680 steps -0.0044 +-
    # 0.0035 and -0.0034 +- 0.0029 (two sessions, lower in all 6 runs), the master's loss at 0.780 of its tokens
    # against 0.789, its stage-3 and extension steps 1.003-1.005x the 3,072 cut's (one H200, 2026-12-03, one run
    # each: bench/results/tie_h200_20261203c.md)
    # Stage 1 at ANVIL2's smaller batch, 262,144 tokens (2/3 of the others'), at the public line's rate for it: x
    # 0.8786 = 1.52 / 1.73, its multipliers at 262K / 393K tokens a step. On the proxy at 773 steps (the 689 steps'
    # tokens), against the master's finals: -0.0141 +- 0.0126 (seeds 0-2), -0.0201 +- 0.0121 (3-5); against the
    # equal-batch stages at equal tokens lower in all 6 seeds, the master's loss at 0.762 of its tokens against 0.780;
    # its step (varlen, one H200) 0.994x stage 2's time a token, where the equal-batch stage 1 ran 0.980x (FA4)
    # (one H200, 2026-12-03: bench/results/b16_h200_20261203g.md)
    stages: tuple[Stage, ...] = (  # the schedule table: batch, document cut, window, lr, MTP per stage
        #     window  batch         documents cut at  lr          targets t+2, t+3  prefix-token weight  sampled rows
        Stage(3,      batch=262144, doc_len=896,      lr=0.8786,  mtp=(0.5, 0.25),  prefix=0.25,   candidates=16384),
        Stage(7,                    doc_len=2048,     lr=1.0,     mtp=(0.5, 0.0),   prefix=0.25,   candidates=14336),
        Stage(11,                   doc_len=4096,     lr=1.0,     mtp=(0.0, 0.0),   prefix=0.0,    candidates=12288))
    extension_steps: int = 20  # last steps, after the cooldown: final learning rate, long window extension_window (09/21/25)
    extension_window: int = 13  # long window of the extension, in blocks
    # Tied for the three stages, untied for the extension, as ANVIL2 (record #92) unties at its extension's start: on
    # the proxy -0.0025 +- 0.0012 at 680 steps against two stages (3 seeds, lower in each), the master's loss at 0.808
    # of its tokens against 0.815; stage 3's step within 0.2% of the untied one (one H200, 2026-12-02:
    # bench/results/step_count_h200_20261201.md, timing_tied3_h200_20261202b.md)
    tied_embed_stages: int = 3  # embeddings read from the LM head for this many stages, then a copy learns (12/22/25)
    # the final validation raises only the long window (09/10/25: 13 blocks), without a YaRN step (the last stage's
    # rotary tables), and keeps the short window, as records #89 and ANVIL2 validate
    final_val_window: int = 20  # the final validation's long window, in blocks (0: the last stage's windows)
    # ANVIL2 (2026-08-30) samples until step 1,101 of its 1,194 (its README), 0.922 of the run, a fraction here so that
    # the switch moves with num_iterations
    full_softmax_from: float = 0.922  # training's softmax is full from this fraction of num_iterations on; before it, each stage's candidates (0: full)
    # optimization
    # 776 x 393,216 = 305.1M tokens (the public record #89: 338.8M). On the proxy at batches / 16 (the harness's rule:
    # the 8-GPU step count is the proxy's) it reached the public code's mean final loss at steps 763-771 of 776 in
    # 3 seeds of 3 (bench/results/cooldown_timing_h100_20261127b.md). ANVIL2's architecture against that model at 776
    # steps, 3 seeds paired on the proxy: +0.0229 +- 0.0051 at 776 steps, +0.0050 +- 0.0042 at 824 (~0.0029 per 1%
    # more steps); the proxy's slope prices equal loss at ~835-838 steps. 840 = 776 x 1.082, 330.3M tokens (0.975 of
    # record #89's 338.8M), chosen from that; run at 840, 3 seeds: -0.0010 +- 0.0037 against 776 steps of the model
    # before it, the same or lower in each seed (bench/results/preset_h200_20261129g.md). With the copy feature
    # (doc_copy) at 760 steps, 298.8M tokens (0.882 of #89's), 3 seeds (0-2) on the proxy against the master's
    # finals, one H200, varlen for both: -0.0180 +- 0.0112, lower in every seed; at 740 (interpolated from 680 and
    # 760) -0.0095 +- 0.0115, an interval over zero (bench/results/step_count_h200_20261201.md); seeds 3-5 against
    # the master's seeds 3-5: -0.0211 +- 0.0111, confirmed. With the 3,072 cut in stage 3 (stages): -0.0245 +- 0.0111
    # (seeds 0-2), -0.0291 +- 0.0088 (seeds 3-5). With the embedding tied for three stages (tied_embed_stages) at 740
    # steps, 291.0M tokens (0.859 of #89's): -0.0196 +- 0.0123 (seeds 0-2; 720: -0.0104 +- 0.0124, over zero),
    # confirmed on seeds 3-5: -0.0224 +- 0.0087 (one H200, 2026-12-02: bench/results/step_count_h200_20261201.md).
    # With the even n-gram split and the 4,096 cut, 720 steps, 283.1M tokens (0.836 of #89's): -0.0196 +- 0.0128
    # (seeds 0-2; 700 interpolated -0.0115 +- 0.0118, over zero; bench/results/tie_h200_20261203c.md), confirmed on
    # seeds 3-5: -0.0237 +- 0.0094, lower in every seed (one H200, 2026-12-03:
    # bench/results/confirm720_h200_20261203d.md). With stage 1 at 262,144 tokens a step (stages), 773 steps,
    # 270.9M tokens (0.800 of #89's), the step count fixed beforehand by --plan's 271M line: -0.0141 +- 0.0126
    # (seeds 0-2), confirmed on seeds 3-5: -0.0201 +- 0.0121 (one H200, 2026-12-03: bench/results/b16_h200_20261203g.md)
    num_iterations: int = 773  # training steps, extension_steps included: chosen on the proxy against the public master (720 before the smaller first stage, 740 before the even n-gram split and the 4,096 cut, 760 before the embedding tied for three stages, 840 before the copy feature, 776 before ANVIL2's architecture)
    # The public master decays over 0.6 of its 1270 + 15 steps to 0.15 (02/10/26); ANVIL2 (record #92, 08/30/26) over
    # 0.8 to 0.2. ANVIL2's shape against our 0.7 to 0.15, 3 paired seeds on the proxy: -0.0028 +- 0.0030 at 776 steps,
    # -0.0054 +- 0.0011 at 840, lower in every seed (bench/results/preset_h200_20261129g.md)
    cooldown_frac: float = 0.8  # linear decay of both learning rates over this final fraction (before the extension)
    final_lr_frac: float = 0.2  # learning rates end the cooldown at this fraction of their peak (ANVIL2's floor)
    # Endgame weight averaging (WeightAverage), after the public record ANVIL2 (modded-nanogpt #92), whose ablation
    # prices its "EMA+tavg+blend+decon" ships at 20.2 millinats of final loss for 0.52 s. Its TailEMA's window (298 of
    # 1194 steps) and blend (0.65) over all averaged weights: -0.0031 +- 0.0008 at the end on the proxy, lower in each
    # of 3 paired seeds; the setting nearer its four ships (0.25,0.55,0.085,1): -0.0002 (bench/results/
    # one_model_h200x4_20261128.md)
    weight_average: tuple[float, ...] = (0.25, 0.65)  # endgame weight average: window,blend[,tail[,renorm]], window and tail as fractions of num_iterations (WeightAverage); () = off
    # ANVIL, the update rule of the public record ANVIL2 (modded-nanogpt record #92, 08/30/26, PR 360, @devenpzak), with
    # its decay 2.25 and momentum 0.85 -> 0.93 over 240 steps (back over the last 50), NorMuon's neuron normalization
    # (beta2 0.9) kept. Its README prices the rule at 4.9 millinats against record #89's NorMuon + Polar Express. On
    # the proxy at 840 steps, 3 paired seeds against NorMuon at decay 1.2 and 0.95 over 300: -0.0051 +- 0.0060, lower
    # in every seed; ANVIL2's decay and momentum alone -0.0014 +- 0.0030. Muon's step on one H200 8.8 against 9.2 ms
    # (bench/results/anvil_rule_h200_20261129i.md). The public master's rule (Polar Express, one momentum, decay where
    # the update has p's sign) was deleted with it: git has it (muon_rule before 11/29/26)
    muon_lr: float = 0.023  # Muon's learning rate (block matrices; 09/03/25: 0.05)
    muon_momentum: float = 0.93  # Muon's peak momentum (Nesterov; ANVIL2's; the public master's 0.95)
    muon_momentum_start: float = 0.85  # Muon's momentum at step 0, warmed up linearly to muon_momentum
    muon_momentum_warmup: int = 240  # steps of that momentum warm-up (ANVIL2's; the public master's 300)
    muon_momentum_cooldown: int = 50  # last steps: momentum back down to muon_momentum_start, linearly; 0 = none
    muon_beta2: float = 0.9  # NorMuon: divide each neuron's update by the root of its mean-square EMA; 0 = off
    muon_weight_decay: float = 2.25  # Muon's cautious weight decay: lr_t x this x p joins the update; 0 = off (11/10/25; ANVIL2's 2.25, the public master's 1.2)
    muon_bf16_comm: bool = False  # block matrices at bf16 values on every rank, the float32 ones kept by their owner's Muon: reduce-scatters and all-gathers in bf16, half the bytes (the public master's bf16 banks and their mantissa state)
    # NorMuon's normalization fused: 53.5 against 54.4 ms a step at the 8-GPU record's per-GPU shape on two H200s
    # (bench/results/comm_gate_h200x2_20261201.md); on the proxy at 680 steps +0.0002 +- 0.0018, 3 seeds paired (one
    # H200, bench/results/confirm720_h200_20261203d.md); the record step on one H200 1.00x (409.3 against 410.0 / 410.1
    # ms, varlen, window 11: the GPU, not the host, bounds it there; bench/results/plan689_h200_20261203f.md)
    muon_fused_normuon: bool = True  # NorMuon's neuron normalization compiled into the orthogonalization's graph (normuon_orthogonalize): a Muon group's normalization, a dozen eager launches, goes into the one graph; the same arithmetic up to the fused graph's rounding
    # at the 8-GPU record's per-GPU shape on two H200s: 54.4 against 57.0 ms a step, in turns in one process, 3 times; bench/results/comm_gate_h200x2_20261201.md
    ngram_plan_ahead: bool = True  # a sharded n-gram table's pulls and flushes planned one micro-batch ahead (GPT.plan_pull_ahead): the distinct rows and the owners' counts found on a side stream over a group of their own while the GPU runs the micro-batch before, so neither waits on a host sync in the step's path (ANVIL2 swaps its counts off the GPU's queue too)
    anvil_rails: tuple[float, ...] = (0.98, 0.4385, 0.85, 0.43)  # Muon's rails (ANVIL): the slow rail's beta, the fast rail's weight and beta once engaged, and from what fraction of num_iterations (ANVIL2's 0.98, 0.4385, 0.85 from its step 514 of 1194); before it, weight 1 at Muon's momentum
    # the public master's NorMuon rates: 0.023 x 2 on the MLP's input (its shape factor), x 4 on its output (10/27/25)
    mlp_muon_lr_mults: tuple[float, ...] = (2.0, 4.0)  # Muon lr multipliers of the MLP's input and output matrices; () = 1, 1
    adam_lr: float = 0.008  # Adam's base learning rate (embeddings, head and scalars: times their *_lr_mult)
    adam_beta1: float = 0.8  # Adam's first-moment decay
    adam_beta2: float = 0.95  # Adam's second-moment decay
    adam_eps: float = 1e-10  # small epsilon: no dependence on the gradient's scale (@YouJiacheng)
    embed_lr_mult: float = 75.0  # token and value embeddings
    # decays are per Adam step (Adam stepping every second training step: adam_every)
    embed_weight_decay: float = 0.025  # value-embed + bigram tables: cautious decay lr_t^2 x this; 0 = off (2026)
    embed_adam_betas: tuple[float, ...] = (0.75, 0.95)  # value-embed + bigram tables' Adam betas; empty = Adam's (2026)
    # the n-gram (bigram + trigram) table learns by a row-sparse Adam (ANVIL2's, 2026-08-30): only the rows looked up
    # since its last step are read and written, beta1 0 and one second moment per row (its gradient's mean square),
    # embed_adam_betas' beta2, the embedding lr and embed_weight_decay; a row's missed steps are caught up exactly
    # when it is next looked up (row_sparse_adam). On several GPUs the table is sharded by owner (ANVIL2's): each rank
    # holds rows / world_size of it (bigram_rows + trigram_rows must split), rows and gradients go to and from their
    # owners by all-to-all (GPT.pull_ngram_rows, push_row_grads). Off: the table is in the embedding tables' dense
    # Adam group, whole on every rank.
    ngram_sparse_adam: bool = True  # the n-gram table's row-sparse Adam (beta1 0, a moment per row; ANVIL2, 08/30/26)
    head_lr_mult: float = 1.0  # LM head: adam_lr times this
    # The 2026 records' LM head: betas 0.5,0.95 and cautious decay 0.005 x 150 = 0.75 per Adam step (Adam stepping
    # every second training step there: 0.375 where Adam steps every step, as the tables' 0.0125)
    head_weight_decay: float = 0.75  # LM head: cautious decay lr_t^2 x this; 0 = off
    head_adam_betas: tuple[float, ...] = (0.5, 0.95)  # LM head's Adam betas; empty = Adam's
    scalar_lr_mult: float = 5.0  # scalars (residual mixes, skip and bigram weights): adam_lr times this
    scalar_adam_betas: tuple[float, ...] = (0.9, 0.99)  # the scalars' Adam betas; empty = Adam's (12/21/25)
    # (2025-09-30 record, PR 136); checkpoints and signal stops fall on Adam's steps
    adam_every: int = 2  # Adam steps every Nth step, on its gradients summed over those N steps; Muon every step
    # ANVIL2's embedding cadence (record #92: period 4 from its step 336 of 1194, from every second step): the
    # value-embedding and n-gram tables' Adam steps every Nth step from a fraction of the run on, on their gradients
    # summed since their last step, with the per-update equivalents of their betas and decay (betas to the power
    # N / adam_every, decay times it: ANVIL2's squared betas and doubled decay); their communication and updates halve
    table_adam_every: tuple[float, ...] = ()  # period,from: the tables' Adam every period-th step from that fraction of num_iterations on; () = adam_every's
    # run
    val_every: int = 125  # validate every N steps (and at the end); 0 = only at the end
    warmup_steps: int = 3  # untimed compile warm-up steps per window size (weights restored after)
    seed: int = 0  # seed of the weights' initialization (the data order is fixed by the shards)
    device: str = "cuda"  # cuda (refused with the reason where torch sees no GPU) | cpu | auto (cuda if seen, else cpu)
    compile: bool = True  # torch.compile the model (false: eager, for debugging and CPU runs)
    # Inductor's C++ wrapper: the compiled graphs launch their kernels from C++, not Python. At 16K-token micro-batches
    # Python's launches left the GPU waiting: 8 x 16K tokens at window 3, 283-332 -> 245-246 ms a step on an H100; at
    # 49K no change (660.5 against 659.9 ms at window 11), and g++ builds each graph's wrapper, a longer compile: the
    # warm-up of 4 stage shapes took 775 s cold (beside another compile) and 157 s warm on an H100
    # (bench/results/cpp_wrapper_fp8_grad_h100_20261127.md, one_session_h100_20261127.md). At the 8-GPU record's
    # per-GPU shape (one 49,152-token micro-batch a GPU) Python's launches leave the GPU waiting too: on two H200s
    # 86.9 -> 63.5 ms a step at window 11 (0.73x), +20 GiB peak on one (bench/results/dc_kernels_2gpu_h200_20261130.md);
    # on one H200 at the record's eight 49K micro-batches 386 against 395.5-481 ms, about 150 s more of cold compile
    # (bench/results/host_ops_h200_20261130c.md)
    # With --cuda_graphs the forward and backward graphs keep the Python wrapper (GraphRunner: replays launch none)
    cpp_wrapper: bool = True  # the compiled training graphs launch their kernels from C++, not Python (false: a quicker compile)
    # ANVIL2's forward/backward CUDA-graph runners (record #92; its README prices them at 3.0 s of 39.9 on 8xH100):
    # each training shape's forward and backward captured as one CUDA graph and replayed for every micro-batch. One
    # H200, the record step at window 11 with the Python wrapper: 0.953x (368 against 387 ms, 3 pairs in turns), 2 GiB
    # less peak memory (bench/results/graphs_tiles_h200_20261130h.md)
    cuda_graphs: bool = True  # GraphRunner (compiled runs on a GPU): one launch a micro-batch, not the graphs' kernels
    fp8_head: bool = True  # FP8 LM head in training where the GPU supports it
    # our kernels: ReLU² in the matmul epilogues (-12 ms a step at stage 3 on an H100), its forward in FP8 (-16 ms,
    # final loss -0.0014 +- 0.0021) and then its backward too (-26 ms, final loss -0.0008 +- 0.0023;
    # bench/results/fp8_mlp_backward_h100_20261127.md, fp8_mlp_default_h100_20261127.md),
    # the FP8 head's soft-capped cross-entropy in Triton (-22 ms)
    fused_mlp: bool = True  # ReLU² inside the MLP's matmul epilogues (kernels.py), where the GPU has the shared memory
    fp8_mlp: bool = True  # the fused MLP's matmuls in FP8, forward and backward (kernels.py), on Hopper's TMA kernel
    fused_ce: bool = True  # the FP8 head's soft-capped cross-entropy in Triton kernels, its gradient written in FP8
    fused_dc: bool = True  # DC attention's correction in Triton kernels (kernels.dc_attention) where Triton runs, else written out
    # these two as triton_ops (custom ops cost more host time a call than their kernels saved): together the record
    # step at 0.974-0.988x main's in four runs on one H200, 80 same-seed steps' loss sum 0.05% under main's
    # (bench/results/host_ops_h200_20261130c.md, triton_ops_h200_20261130d.md); apart not yet timed
    fp8_transpose: bool = True  # the FP8 MLP's transposed input and output gradient by a tiled Triton transpose (kernels.transpose), not inside Inductor's norm kernels
    fused_qk_rope: bool = True  # QK-norm, rotary and the key offset in one Triton kernel each way (kernels.qk_norm_rope) where Triton runs, else Inductor's
    attention: str = "auto"  # auto | fa3 | fa4 | varlen | reference
    run_id: str = ""  # default: a fresh uuid (on --resume: the checkpoint's run)
    log_dir: str = "logs"  # logs go to log_dir/<run_id>.txt (rank 0 writes)
    log_every: int = 25  # loss, tokens/s, MFU and memory every N steps (read without a device sync)
    peak_tflops: float = 0.0  # dense bf16 peak per GPU for MFU; 0 = look up by device name
    collective_timeout_s: float = 600.0  # a collective stuck longer fails the run (a rank died or hangs); above minutes of compile lag
    # checkpoints: model, sharded optimizer states, data position, RNG, hyperparameters, code hash
    save_every: int = 0  # save every N steps and at the end; 0 = only on SIGTERM / Ctrl-C
    checkpoint_dir: str = "checkpoints"  # checkpoints go to checkpoint_dir/<run_id>/step_NNNNNN/
    keep_checkpoints: int = 3  # keep the newest K of a run
    resume: str = ""  # a checkpoint folder, or "latest" (newest under checkpoint_dir)
    plan: bool = False  # print the resolved schedule and its projected 1- and 8-GPU time, then exit (no GPU used)
    plan_gpu: str = "H200"  # the GPU kind --plan projects on, beside the public master: H200 | H100 (full softmax only)
    # presets and the smoke preset's built-in data
    preset: str = "record"  # record | smoke | single | medium (then any field overrides)
    markov_corpus: bool = False  # write a synthetic Markov-chain corpus to train/val_files first

    def __post_init__(self):
        h = self
        for name in ("num_iterations", "batch_size", "seq_len", "val_tokens", "val_seq_len", "max_doc_len"):
            if getattr(h, name) < 1:
                raise ValueError(f"--{name} {getattr(h, name)}: must be positive")
        # cadences: 0 means "never" (save, validate, log) or "keep all"; a negative count used to act as 0
        for name, what, zero in (("save_every", "steps between checkpoints", "saves only at a SIGTERM or Ctrl-C"),
                                 ("val_every", "steps between validations", "validates only at the end"),
                                 ("log_every", "steps between progress lines", "logs none"),
                                 ("keep_checkpoints", "the newest checkpoints kept per run", "keeps them all")):
            if getattr(h, name) < 0:
                raise ValueError(f"--{name} {getattr(h, name)}: {what}, or 0 ({zero}); not negative")
        if h.max_num_docs < 0:
            raise ValueError(f"--max_num_docs {h.max_num_docs}: a positive count, or 0 to size it from the data")
        if h.plan_gpu not in plan_kinds():
            raise ValueError(f"--plan_gpu {h.plan_gpu}: --plan has measured times for {', '.join(plan_kinds())}")
        if h.batch_size % h.seq_len:
            raise ValueError(f"batch_size={h.batch_size} must be a multiple of seq_len={h.seq_len}")
        if not h.stages or not all(isinstance(row, Stage) for row in h.stages):
            raise ValueError(f"stages={h.stages!r}: one Stage row or more")
        micro = h.batch_size // h.seq_len  # micro-batches per step, the same in every stage
        for i, row in enumerate(h.stages, start=1):
            if (row.window < 1 or row.batch < 0 or row.doc_len < 0 or row.share < 1 or not 0 < row.lr < math.inf
                    or not 0 <= row.prefix < math.inf):
                raise ValueError(f"stage {i} ({format_stages([row])}): window and share must be >= 1, batch and "
                                 "doc_len >= 0 (0: batch_size, max_doc_len), lr a positive number, prefix >= 0")
            if row.batch and (row.batch % micro or row.batch // micro > h.seq_len):
                raise ValueError(f"stage {i}: batch={row.batch} must split into batch_size/seq_len={micro} "
                                 f"micro-batches of at most seq_len={h.seq_len} tokens: give stage batches that do "
                                 "(--batch_schedule, one per stage; 0 is batch_size)")
        if h.extension_steps < 0 or (h.extension_steps > 0) != (h.extension_window > 0):
            raise ValueError(f"extension_steps={h.extension_steps} and extension_window={h.extension_window}: both "
                             "zero (no extension), or a number of steps and a long window in blocks")
        if h.extension_steps >= h.num_iterations:  # the extension is the run's last steps: some must come before
            raise ValueError(f"num_iterations={h.num_iterations} leaves no step before the {h.extension_steps}-step "
                             f"extension: give --num_iterations {h.extension_steps + 1} or more, or leave the "
                             "extension out with --extension_steps 0 --extension_window 0")
        if h.mlp_ratio < 1 or h.mlp_hidden < 0:
            raise ValueError(f"mlp_ratio={h.mlp_ratio}, mlp_hidden={h.mlp_hidden}: the MLP's hidden width is "
                             "mlp_hidden, or where that is 0 mlp_ratio (>= 1) x model_dim")
        if len(h.mlp_muon_lr_mults) not in (0, 2) or not all(0 < m < math.inf for m in h.mlp_muon_lr_mults):
            raise ValueError(f"mlp_muon_lr_mults={h.mlp_muon_lr_mults}: empty, or two positive numbers (input, output)")
        if len(h.scalar_adam_betas) not in (0, 2):
            raise ValueError(f"scalar_adam_betas={h.scalar_adam_betas}: empty, or two numbers (beta1, beta2)")
        if h.adam_every < 1 or h.save_every % h.adam_every:
            raise ValueError(f"adam_every={h.adam_every}, save_every={h.save_every}: adam_every >= 1, and checkpoints "
                             "fall on Adam's steps, so save_every must be a multiple of it")
        period, start = (*h.table_adam_every, None)[:2] if h.table_adam_every else (h.adam_every, 0.0)
        if (len(h.table_adam_every) > 2 or start is None or period != int(period) or period < h.adam_every
                or period % h.adam_every or not 0 <= start < 1 or h.save_every % period):
            raise ValueError(f"table_adam_every={h.table_adam_every}: a period (a multiple of adam_every={h.adam_every}) "
                             f"and the fraction of num_iterations it starts from, in [0, 1); checkpoints fall on the "
                             f"tables' steps, so save_every={h.save_every} must be a multiple of the period")
        if not 0 <= h.tied_embed_stages <= len(h.stages) + (h.extension_steps > 0):
            raise ValueError(f"tied_embed_stages={h.tied_embed_stages}: 0 (untied) up to the number of stages "
                             f"({len(h.stages)} + the extension if any)")
        if h.final_val_window < 0:
            raise ValueError(f"final_val_window={h.final_val_window}: 0 (the last stage's window) or a window in blocks")
        h.check_layout()
        h.check_softmax()
        if not 0 <= h.muon_beta2 < 1:
            raise ValueError(f"muon_beta2={h.muon_beta2}: 0 (plain Muon) or an EMA factor in (0, 1) for NorMuon")
        if len(h.anvil_rails) != 4 or not (0 < h.anvil_rails[0] < 1 and all(0 <= x <= 1 for x in h.anvil_rails[1:])):
            raise ValueError(f"anvil_rails={h.anvil_rails}: four numbers: the slow rail's beta in (0, 1), then the fast "
                             "rail's weight, its beta and the fraction of the run they engage at, each in [0, 1]")
        for name in ("embed_weight_decay", "head_weight_decay", "muon_weight_decay"):
            if not 0 <= getattr(h, name) < math.inf:
                raise ValueError(f"{name}={getattr(h, name)} must be a finite number >= 0")
        for name in ("embed_adam_betas", "head_adam_betas"):
            betas = getattr(h, name)
            if betas and (len(betas) != 2 or not all(0 <= b < 1 for b in betas)):
                raise ValueError(f"{name}={betas}: empty (Adam's betas) or two numbers in [0, 1)")
        if len({len(row.mtp) for row in h.stages}) > 1 or not all(0 <= w < math.inf for row in h.stages for w in row.mtp):
            raise ValueError(f"stages={format_stages(h.stages)}: every stage needs the same number of finite "
                             "mtp weights >= 0 (the record's: 0.5/0.25, 0.5/0, 0/0), or none")
        if not h.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s={h.collective_timeout_s} must be a positive number of seconds")
        if h.bos_id >= h.vocab_size:
            raise ValueError(f"bos_id={h.bos_id} must be < vocab_size={h.vocab_size}")
        if h.preset not in PRESETS:
            raise ValueError(f"preset={h.preset!r}: choose one of {', '.join(PRESETS)}")
        if h.device not in ("cuda", "cpu", "auto"):
            raise ValueError(f"device={h.device!r}: choose cuda, cpu or auto")
        if h.attention not in ("auto", *ATTENTION_BACKENDS):
            raise ValueError(f"attention={h.attention!r}: choose one of auto, {', '.join(ATTENTION_BACKENDS)}")


    def check_softmax(self):
        """The sampled softmax's columns and switch: counts of the head's rows, and a fraction of the run."""
        for i, row in enumerate(self.stages, start=1):
            if not 0 <= row.candidates <= self.vocab_size:
                raise ValueError(f"stage {i}: candidates={row.candidates}: 0 (the full softmax) or a number of the "
                                 f"head's rows up to vocab_size={self.vocab_size}")
        if not 0 <= self.full_softmax_from <= 1:
            raise ValueError(f"full_softmax_from={self.full_softmax_from}: a fraction of num_iterations in [0, 1]")

    def check_layout(self):
        """The model's block-indexed parts fit its blocks and one another (each error names the field)."""
        h = self
        if len(h.window_pattern) != h.num_layers or set(h.window_pattern) - {"L", "S"}:
            raise ValueError(f"window_pattern={h.window_pattern!r} needs one L or S per layer ({h.num_layers})")
        # a removed block (skip_layers) keeps its index, as every other field names blocks by theirs, and is in none
        if len(set(h.skip_layers)) < len(h.skip_layers) or any(not 0 < i < h.num_layers - 1 for i in h.skip_layers):
            raise ValueError(f"skip_layers={h.skip_layers}: distinct blocks between the first and the last "
                             f"({h.num_layers - 1}, where MUDD gives the weights and DC attention runs); without "
                             "block 0 the model is one of num_layers - 1 blocks: give that, with the indices shifted")
        for name in ("no_attn_layers", "xsa_blocks", "paired_head_blocks", "value_embed_blocks", "parallel_mlp_blocks",
                     "narrow_qk_blocks", "narrow_v_blocks"):
            both = sorted(set(h.skip_layers) & set(getattr(h, name)))
            if both:
                raise ValueError(f"skip_layers={h.skip_layers}: block(s) {both} also in {name}={getattr(h, name)}; a "
                                 f"removed block has no attention and no MLP: take it out of {name}")
        if (len(set(h.parallel_mlp_blocks)) < len(h.parallel_mlp_blocks)
                or any(not 0 <= i < h.num_layers for i in h.parallel_mlp_blocks)):
            raise ValueError(f"parallel_mlp_blocks={h.parallel_mlp_blocks}: distinct blocks 0-{h.num_layers - 1}, each "
                             "given one second MLP")
        # the injections a block goes without (no_x0_blocks etc.): blocks before the last, each named once; a removed
        # block keeps its x0 injection and residual weight unless listed, and has no n-gram injection to go without
        for name in ("no_x0_blocks", "no_ngram_blocks", "no_resid_scale_blocks"):
            blocks = getattr(h, name)
            if len(set(blocks)) < len(blocks) or any(not 0 <= i < h.num_layers - 1 for i in blocks):
                raise ValueError(f"{name}={blocks}: distinct blocks 0-{h.num_layers - 2}, below the last, whose "
                                 "residual, x0 and n-gram weights MUDD gives per token")
        both = sorted(set(h.skip_layers) & set(h.no_ngram_blocks))
        if both:
            raise ValueError(f"no_ngram_blocks={h.no_ngram_blocks}: block(s) {both} removed (skip_layers="
                             f"{h.skip_layers}) take no n-gram injection already: leave them out")
        if any(h.window_pattern[i] == "L" for i in h.skip_layers):
            raise ValueError(f"skip_layers={h.skip_layers}: a removed block has no attention window, but "
                             f"window_pattern={h.window_pattern!r} marks one long (L), where the MUDD gates and the "
                             "long-window heads expect attention: mark it S")
        bad = [i for i in h.paired_head_blocks if not 0 <= i < h.num_layers or i in h.no_attn_layers
               or h.window_pattern[i] != "S"]
        if bad or h.num_heads % 2 or len(set(h.paired_head_blocks)) != len(h.paired_head_blocks):
            raise ValueError(f"paired_head_blocks={h.paired_head_blocks}: distinct blocks with attention and a short "
                             f"window (S in window_pattern={h.window_pattern!r}), and an even num_heads={h.num_heads}")
        if not h.value_embed_blocks or len(set(h.value_embed_blocks)) < len(h.value_embed_blocks) or any(
                not 0 <= i < h.num_layers or i in h.no_attn_layers for i in h.value_embed_blocks):
            raise ValueError(f"value_embed_blocks={h.value_embed_blocks}: one or more distinct blocks with attention "
                             "(MUDD mixes the first one's table into the head's input)")
        if h.skip_into and h.skip_into not in h.no_attn_layers:
            raise ValueError(f"skip_into={h.skip_into}: the attention-less block the skip goes into, one of "
                             f"no_attn_layers={h.no_attn_layers}, or 0 for the first of them")
        skip_into = h.skip_into or min(h.no_attn_layers, default=0)
        if not (h.no_attn_layers and 0 <= h.skip_from < skip_into):
            raise ValueError(f"skip_from={h.skip_from}: a block before the attention-less one the skip goes into "
                             f"(skip_into={h.skip_into}, 0: the first of no_attn_layers={h.no_attn_layers}, which "
                             "needs one)")
        if h.logit_softcap + math.log(h.vocab_size) >= 88:  # exp(cap) * vocab must fit in fp32 (any shift)
            raise ValueError(f"logit_softcap={h.logit_softcap} is too large for the overflow-free cross-entropy")
        if not math.isfinite(h.softcap_shift):
            raise ValueError(f"softcap_shift={h.softcap_shift} must be a finite number")
        if h.bigram_rows < 2:  # the MUDD gates weigh it per block
            raise ValueError(f"bigram_rows={h.bigram_rows}: at least 2 (hashed rows + a document-start row)")
        if h.ngram_spread and (h.bigram_rows + h.trigram_rows) % NGRAM_SPREAD_MULT == 0:
            name, n = ("trigram_rows", h.trigram_rows) if h.trigram_rows else ("bigram_rows", h.bigram_rows)
            raise ValueError(f"ngram_spread: the n-gram table's {h.bigram_rows + h.trigram_rows:,} rows are a multiple "
                             f"of its multiplier {NGRAM_SPREAD_MULT:,}, so the scatter would not be a bijection: use "
                             f"--{name} {n - 8} (8 fewer rows still split over 2, 4 or 8 GPUs)")
        if h.trigram_rows == 1 or h.trigram_rows < 0:
            raise ValueError(f"trigram_rows={h.trigram_rows}: 0 (none) or at least 2 (hashed rows + a reserved row)")
        if h.bigram_sign_rows < 0:
            raise ValueError(f"bigram_sign_rows={h.bigram_sign_rows}: 0 (no signs) or a positive count")
        if not 0 <= h.backout_layer < h.num_layers - 1:
            raise ValueError(f"backout_layer={h.backout_layer}: a block below the last ({h.num_layers - 1}), whose "
                             "output MUDD mixes in, the later blocks attend over and the head has subtracted")
        if "L" not in h.window_pattern[:-2] or skip_into <= h.window_pattern.index("L"):
            raise ValueError(f"window_pattern={h.window_pattern!r}: the MUDD gates need a long-window block (L) "
                             f"before the last two and before the attention-less block the skip goes into "
                             f"({skip_into}), where the skip's weight is read from the gate after it")
        if h.num_layers - 1 in h.paired_head_blocks + h.no_attn_layers:
            raise ValueError("DC attention runs in the last block: it needs attention, without paired heads "
                             f"(paired_head_blocks={h.paired_head_blocks}, no_attn_layers={h.no_attn_layers})")
        if any(not 0 <= i < h.num_layers or i in h.no_attn_layers for i in h.xsa_blocks):
            raise ValueError(f"xsa_blocks={h.xsa_blocks}: blocks with attention")
        narrow = h.narrow_qk_blocks
        if narrow and (len(set(narrow)) < len(narrow) or h.head_dim % 4 or any(
                not 0 <= i < h.num_layers or i in h.no_attn_layers or h.window_pattern[i] != "S" for i in narrow)):
            raise ValueError(f"narrow_qk_blocks={narrow}: distinct blocks with attention and a short window (S in "
                             f"window_pattern={h.window_pattern!r}: a long window's key offset moves the dims rotary "
                             f"leaves alone, which a narrow head has none of), and head_dim={h.head_dim} a multiple "
                             "of 4 (its half rotates in pairs)")
        if len(set(h.narrow_v_blocks)) < len(h.narrow_v_blocks) or not set(h.narrow_v_blocks) <= set(narrow):
            raise ValueError(f"narrow_v_blocks={h.narrow_v_blocks}: distinct blocks of narrow_qk_blocks={narrow} (a "
                             "narrow V under a wide Q/K, ANVIL2's unused (128,64), has no kernel route here)")
        if not 0 < h.narrow_attn_scale < math.inf:
            raise ValueError(f"narrow_attn_scale={h.narrow_attn_scale} must be a positive number")
        if h.cplm_bands and (len(h.cplm_bands) != 2 or min(h.cplm_bands) < 1 or h.bos_id + 1 >= h.vocab_size):
            raise ValueError(f"cplm_bands={h.cplm_bands}: two band lengths in tokens (training, evaluation; the PR's "
                             f"2048,8192), and the copy column bos_id + 1 = {h.bos_id + 1} below vocab_size={h.vocab_size}")


# The defaults above are the record: the public record line's techniques after 09/03 at the public master's values
# (modded-nanogpt master, 2026-08), on its 11 blocks, with our kernels and CPLM. On the proxy under the harness's
# batches/16 rule, 3 seeds paired on H100s: -0.129 final loss against the previous record preset (12 blocks, our
# 2025 A/B's subset) at 1.06x its step time on 12 blocks; on 11 blocks 0.99x the time and +0.005 +- 0.021 against 12
# (an H200; bench/results/public_line_ab_20261126.md, step_time_stages_h100_20261126.md). Its block layout, MLP width,
# injection sites and order are ANVIL2's architecture (record #92, 08/30/26; on the proxy +0.0050 +- 0.0042 at 824
# steps against the model before it at 776, 3 seeds: bench/results/arch_h200_20261129f.md).
# Every preset trains this model. ANVIL2's layout names blocks of 11, so the presets of other depths keep the layout
# before it (one attention-less block and none removed, no second MLP, every block's injections, MLPs mlp_ratio x
# model_dim), its block-indexed parts (the attention-less block, the skip, backout, XSA, value tables, paired heads,
# long windows) placed as the record had them, in proportion. They take ANVIL2's injection order, the one built here,
# although on that layout it measured worse than the one before it (x0 and the n-gram term before a block's
# attention): +0.0016 +- 0.0011, 3 seeds on the proxy at 776 steps (bench/results/arch_h200_20261129f.md).
DEFAULT_PRESET = "record"  # what a command without --preset runs: the dataclass defaults
SMOKE = dict(  # the record model at 4 blocks of 128 on a synthetic corpus, sized for a 2-core CPU
    markov_corpus=True, train_files=os.path.join(DATA_PATH, "data/smoke/markov_train_*.bin"),
    val_files=os.path.join(DATA_PATH, "data/smoke/markov_val_*.bin"),
    vocab_size=136, bos_id=127,  # 128 corpus tokens, BOS the last (as GPT-2's 50,256); CPLM's copy column 128
    num_layers=4, model_dim=128, num_heads=2, head_dim=64, gate_channels=8, no_attn_layers=(2,), window_pattern="LSSL",
    value_embed_blocks=(1, 3), paired_head_blocks=(1,), xsa_blocks=(1,), backout_layer=2, skip_from=1,
    narrow_qk_blocks=(1,), narrow_v_blocks=(1,),  # the narrow heads in its one short-window block with attention
    # the layout before ANVIL2's (its indices are the 11 blocks'): none removed, the skip into block 2, MLPs 4 x 128,
    # no second MLP, every block's injections
    skip_layers=(), skip_into=0, mlp_hidden=0, parallel_mlp_blocks=(), no_x0_blocks=(), no_ngram_blocks=(),
    no_resid_scale_blocks=(),
    bigram_rows=4096, bigram_sign_rows=64, cplm_bands=(128, 512), window_block=64,
    ngram_normalize=False,  # its table is over GPT-2's token texts
    trigram_rows=28_672,  # the record's trigram channel and its row-sparse Adam, 32,768 n-gram rows in all (not 21M)
    # the record's stages without the prefix-token loss (it is over GPT-2's token bytes)
    stages=(Stage(1, doc_len=256, mtp=(0.5, 0.25)), Stage(2, mtp=(0.5, 0.0)), Stage(3, mtp=(0.0, 0.0))),
    extension_steps=6, extension_window=4, final_val_window=6, batch_size=8 * 512, seq_len=512, val_seq_len=1024,
    val_tokens=32768, max_doc_len=512, num_iterations=150, val_every=50, log_every=10, compile=False,
    warmup_steps=0, device="auto", save_every=50)
PRESETS = {  # name: (what it is, the fields it sets)
    "record": ("the 8-GPU record configuration: the public line's current model and optimizer (modded-nanogpt "
               "master, 2026-08) as far as this file implements them, on its 11 blocks in ANVIL2's layout (record "
               "#92, 2026-08-30): block 7 removed (its residual weights and x0 kept), no attention in blocks 4, 6 "
               "and 9, a second parallel MLP in block 8, MLPs 2,816 wide, x0 injected in blocks 0-2, 4, 5 and 7 and "
               "the n-gram embedding in 0, 1, 4, 5 and 9 (the last block's by MUDD; block 6, the skip's target, "
               "takes the skip alone, without its attention-side residual weight), after a block's attention and "
               "before its MLP (block 0's n-gram before it); bigram hash embedding "
               "with ANVIL2's hashed trigram channel (21.2M rows in one table, half each, learned by a row-sparse "
               "Adam, sharded over the GPUs by owner), both hashed from normalized token ids (public pull "
               "request 375), "
               "MUDD with its gates, XSA and DC attention, YaRN, smear and value-embedding gates, paired heads, "
               "partial key offset, ANVIL2's narrow heads (Q and K 64 wide in blocks 0, 1, 2, 5 and 8, V too in 1 "
               "and 8), four untied value tables, parallel attention inputs, backout, per-sublayer "
               "residual weights and one gated skip, ANVIL2's update rule (twin momentum rails, six trace-normed quintic "
               "maps, NorMuon's neuron normalization, cautious decay 2.25), Adam every second step, "
               "multi-token and prefix-token losses, the embedding tied for the three stages (untied for the "
               "extension, as ANVIL2), documents cut at 896 / 2,048 / 4,096 tokens by stage (ANVIL2's caps with "
               "its 3,072 raised), stage 1 at ANVIL2's 262,144 tokens a step, 773 steps (on the proxy 0.014 below "
               "the public master's final loss, 3 seeds; 0.020 on 3 more) with a 20-step extension, ANVIL2's "
               "cooldown over 0.8 of the steps to 0.2; plus "
               "the copy-pointer mixture of public pull request 379 (CPLM) and the document-local copy feature of "
               "public pull request 378; with our fused ReLU² MLP (FP8 forward "
               "and backward) and soft-capped cross-entropy kernels, and Inductor's C++ wrapper: the dataclass "
               "defaults", {}),
    "smoke": ("the record model at a tiny size (4 blocks of 128, a vocabulary of 128 tokens) on a built-in synthetic "
              "corpus (a random Markov chain whose entropy per token, the lowest loss possible, is known): about 3 "
              "minutes on a 2-core CPU; every technique of the record but the prefix-token loss and the n-gram "
              "hashing over normalized ids (both over GPT-2's tokens) and ANVIL2's 11-block layout (here one "
              "attention-less block, none removed, no second MLP, every block's injections, after its attention as "
              "the record's); a checkpoint every 50 steps, for `python sample.py latest`", SMOKE),
    "single": ("the record on one GPU with 32-80 GB: 32 micro-batches of 12K tokens (8K in stage 1), the same "
               "global batches; the n-gram table at 5.0M rows (2.5M bigram + 2.5M trigram, the size of the proxy "
               "runs): 14.0 GiB (--plan) of the run's estimate at start (at 24 micro-batches of 16K, before the "
               "smaller first stage: every stage's peak 27.0 GiB allocated on one H200 capped at 80 GiB, FA4, "
               "2026-12-03)",
               dict(seq_len=12288, bigram_rows=2_500_000, trigram_rows=2_500_000)),
    "medium": ("the record model at GPT-2-medium size (24 blocks x 1024, 16 heads of 64), an untuned start: the "
               "record's learning rates, its block layout before ANVIL2's stretched to 24 blocks (one attention-less "
               "block, none removed, no second MLP, every block's injections, MLPs 4 x 1024), the injections after "
               "a block's attention as the record's, 4000 steps, 5.0M n-gram rows",
               dict(num_layers=24, model_dim=1024, num_heads=16, head_dim=64, no_attn_layers=(13,),
                    window_pattern="SSSSSSSLSSSSSSSSSSSSSSSL", skip_from=7, backout_layer=14,
                    value_embed_blocks=(1, 2, 21, 22, 23), paired_head_blocks=(0, 2, 5, 9, 11, 16, 20),
                    xsa_blocks=(1, 7, 8, 14), seq_len=24576, num_iterations=4000,
                    # ANVIL2's layout is the 11 blocks' (its indices): the one before it, the skip into block 13
                    skip_layers=(), skip_into=0, mlp_hidden=0, parallel_mlp_blocks=(), no_x0_blocks=(),
                    no_ngram_blocks=(), no_resid_scale_blocks=(), narrow_qk_blocks=(), narrow_v_blocks=(),
                    bigram_rows=2_500_000, trigram_rows=2_500_000)),  # 5.0M n-gram rows at width 1024: one 80 GB GPU holds the run
}


class _Parser(argparse.ArgumentParser):
    """Command-line errors in one line, naming what was expected (not argparse's usage wall)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (python {self.prog} --help lists every field)\n")


def _bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,7,11, not {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers such as 1,1.52,1.73, not {text!r}") from None


def _stages(text: str) -> tuple[Stage, ...]:
    """--stages: rows joined by ';', each `field=value` pairs joined by ',' (mtp's weights by '/')."""
    rows = []
    for part in filter(str.strip, text.split(";")):
        try:
            pairs = dict(item.split("=", 1) for item in part.replace(" ", "").split(",") if item)
            rows.append(Stage(**{k: STAGE_TEXT[k](v) for k, v in pairs.items()}))
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f"expected rows such as 'window=3,doc_len=896;window=7' (fields {', '.join(STAGE_TEXT)}; window "
                f"required), not {part.strip()!r}") from None
    return tuple(rows)


# Columns of the stages table the command line can set on their own (the public speedrun's own lists):
# flag -> (Stage field, parser, help).
STAGE_COLUMNS = {
    "window_schedule": ("window", _ints, "long window in blocks per stage, e.g. 3,7,11; a new length makes new "
                                         "rows (other columns at their defaults unless also given)"),
    "batch_schedule": ("batch", _ints, "global batch per stage, e.g. 131072,262144,393216 (empty: batch_size)"),
    "doc_len_schedule": ("doc_len", _ints, "document cut per stage, e.g. 896,2048,2048 (empty: max_doc_len)"),
    "lr_schedule": ("lr", _floats, "learning-rate multiplier per stage, e.g. 1,1.52,1.73 (empty: 1)"),
    "mtp_weights": ("mtp", _floats, "multi-token prediction weights, K per stage in stage order, e.g. the "
                                   "record line's 0.5,0.25,0.5,0,0,0 (empty: off)"),
    "candidates_schedule": ("candidates", _ints, "sampled softmax: the head's rows per micro-batch in training, per "
                                                 "stage, e.g. 10240,14336,24576 (0 or empty: the full softmax)"),
}


def set_stage_columns(rows: tuple[Stage, ...], columns: dict[str, tuple]) -> tuple[Stage, ...]:
    """The table with the given STAGE_COLUMNS flags applied (ValueError naming the flag when a column's
    length does not fit the rows)."""
    if "window_schedule" in columns and len(columns["window_schedule"]) != len(rows):
        rows = tuple(Stage(w) for w in columns["window_schedule"])
    for flag, values in columns.items():
        field, n = STAGE_COLUMNS[flag][0], len(rows)
        if field == "mtp":
            if len(values) % n:
                raise ValueError(f"--mtp_weights {','.join(map(number_text, values))}: K weights per stage, "
                                 f"{n} stages")
            k = len(values) // n
            values = [tuple(values[i * k: (i + 1) * k]) for i in range(n)]
        elif not values:
            values = [Stage.__dataclass_fields__[field].default] * n
        elif len(values) != n:
            raise ValueError(f"--{flag} {','.join(map(number_text, values))}: needs one entry per stage ({n})")
        rows = tuple(dataclasses.replace(row, **{field: v}) for row, v in zip(rows, values))
    return rows


def stored_args(saved: dict) -> dict:
    """A checkpoint's hyperparameters as fields: its stages rows made Stage again (their table columns), list values
    made tuples, a checkpoint's cpp_wrapper of auto/true/false (2026-11-30) as the bool the field is again, and an
    n-gram table stored before ngram_spread existed as the row order it was."""
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    if isinstance(saved.get("cpp_wrapper"), str):  # auto was on at one micro-batch a GPU; it is on everywhere now
        saved["cpp_wrapper"] = saved["cpp_wrapper"] != "false"
    saved.setdefault("ngram_spread", False)  # before the field (2026-12-01) the table was stored in row order
    saved["stages"] = tuple(Stage(**{**{k: row[k] for k in STAGE_TEXT if k in row}, "mtp": tuple(row["mtp"])})
                            for row in saved["stages"])
    return saved


def field_help() -> dict[str, str]:
    """Each Hyperparameters field's comment in this file's source: its --help text."""
    source = Path(__file__).read_text().split("class Hyperparameters:")[1].split("def __post_init__")[0]
    return {m[1]: m[2] for m in re.finditer(r"^ {4}(\w+): [^=\n]+=[^#\n]*#\s*(.+)$", source, re.M)}


def cli_text(value) -> str:
    """A value as the command line writes it: true/false, comma lists, the --stages text."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple) and value and isinstance(value[0], Stage):
        return format_stages(value)
    if isinstance(value, tuple):
        return ",".join(number_text(v) for v in value)
    return str(value)


# --help opens with these flags and examples, before the presets and the other fields
FIRST_FLAGS = ("preset", "resume", "save_every", "device", "plan", "plan_gpu")
HELP_EXAMPLES = """examples:
  python train_gpt.py --preset smoke             # a tiny model on a built-in synthetic corpus, CPU or GPU
  ./run.sh --save_every 200                      # the record on 8 GPUs (NPROC=4 ./run.sh: on 4), checkpoints
  ./run.sh --resume latest                       # continue the newest checkpoint under checkpoints/"""


def parse_args(argv: list[str] | None = None) -> Hyperparameters:
    """Hyperparameters from `--field value` pairs over a base: the checkpoint's hyperparameters when
    resuming (so `--resume CKPT` alone continues a run exactly), else the preset's (default: record).
    The STAGE_COLUMNS flags then set single columns of the stages table."""
    argv = sys.argv[1:] if argv is None else list(argv)
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset", default=DEFAULT_PRESET)
    shown = pre.parse_known_args(argv)[0].preset  # --help shows this preset's defaults
    shown = shown if shown in PRESETS else DEFAULT_PRESET
    defaults = Hyperparameters(**PRESETS[shown][1], preset=shown)
    helps = field_help()
    presets = "\n".join(textwrap.fill(text, 98, initial_indent=f"{name:12s}", subsequent_indent=" " * 12)
                        for name, (text, _) in PRESETS.items())
    title, about = __doc__.split("\n", 1)
    parser = _Parser(prog="train_gpt.py", formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
                         prog, width=110, max_help_position=34),
                     usage="train_gpt.py [--preset NAME] [--plan] [--FIELD VALUE ...]  (or torchrun ... train_gpt.py ...)",
                     argument_default=argparse.SUPPRESS, allow_abbrev=False, add_help=False,
                     description=f"{title}\n\n{HELP_EXAMPLES}", epilog=about.strip())
    # what a newcomer needs first (issue 61), then the presets, then every other field in the dataclass' order
    first = parser.add_argument_group("the flags most runs need")
    first.add_argument("-h", "--help", action="help", help="show this help and exit")
    groups = {name: first for name in FIRST_FLAGS}
    parser.add_argument_group(f"presets (--preset NAME, then any field overrides; defaults below are --preset "
                              f"{shown}'s)", presets)
    rest = parser.add_argument_group("every other field (--FIELD VALUE)")
    for name in [*FIRST_FLAGS, *(n for n in fields if n not in FIRST_FLAGS)]:
        default = getattr(defaults, name)
        if name == "stages":
            kind = _stages
        elif isinstance(default, tuple):
            kind = _floats if "float" in str(fields[name].type) else _ints
        else:
            kind = _bool if isinstance(default, bool) else type(default)
        flag = dict(nargs="?", const=True) if kind is _bool else {}  # a true/false field alone means true
        metavar = "ROWS" if name == "stages" else "LIST" if isinstance(default, tuple) else type(default).__name__.upper()
        groups.get(name, rest).add_argument(f"--{name}", type=kind, metavar=metavar, **flag,
                                            help=f"{helps.get(name, '')} (default: {cli_text(default) or chr(34) * 2})".lstrip())
    columns = parser.add_argument_group("single columns of --stages (applied after it)")
    for flag, (_, kind, text) in STAGE_COLUMNS.items():
        columns.add_argument(f"--{flag}", type=kind, metavar="LIST", help=text)
    given = vars(parser.parse_args(argv))
    column_values = {flag: given.pop(flag) for flag in STAGE_COLUMNS if flag in given}
    preset = given.get("preset", DEFAULT_PRESET)
    if preset not in PRESETS:
        parser.error(f"--preset {preset}: choose one of {', '.join(PRESETS)}")
    base: dict = {}
    if given.get("resume"):
        where = given.get("checkpoint_dir", defaults.checkpoint_dir)
        checkpoint = find_checkpoint(given["resume"], where)
        meta = read_checkpoint_file(checkpoint / "model.pt")
        saved = stored_args(meta["args"])
        if given["resume"] == "latest" and int(os.environ.get("RANK", 0)) == 0:  # the newest of any run: say which
            preset = f", preset {saved['preset']}" if "preset" in saved else ""
            print(f"--resume latest: {checkpoint} (run {checkpoint.parent.name}{preset}, step {meta['step']} of "
                  f"{saved['num_iterations']}), the newest checkpoint under {where}/", flush=True)
        base = {k: v for k, v in saved.items() if k in fields and k != "run_id"}  # run id: name_run decides
        given["resume"] = str(checkpoint)
    if "preset" in given or not base:
        base.update(PRESETS[preset][1], preset=preset)
    merged = {**base, **given}
    if column_values:
        try:
            merged["stages"] = set_stage_columns(merged.get("stages", Hyperparameters.stages), column_values)
        except ValueError as e:
            parser.error(str(e))
    return Hyperparameters(**merged)


# -----------------------------------------------------------------------------------------------
# Model

def norm(x: Tensor) -> Tensor:
    """RMS norm without a learned gain."""
    return F.rms_norm(x, (x.size(-1),))


def uniform_init_(w: Tensor, fan_in: int) -> Tensor:
    """Uniform init with the std of 0.5/sqrt(fan_in) (bound sqrt(3) times that; @YouJiacheng)."""
    bound = math.sqrt(3) * 0.5 / math.sqrt(fan_in)
    return w.uniform_(-bound, bound)


def mlp_width(fields: dict) -> int | None:
    """The MLP's hidden width of a run's hyperparameters (vars() of Hyperparameters, or a checkpoint's stored ones):
    mlp_hidden, or where that is 0 or not yet a field mlp_ratio x model_dim; None where those are missing too."""
    if fields.get("mlp_hidden"):
        return fields["mlp_hidden"]
    if "mlp_ratio" in fields and "model_dim" in fields:
        return fields["mlp_ratio"] * fields["model_dim"]
    return None


@dataclass
class ModelConfig:
    vocab_size: int
    num_layers: int
    model_dim: int
    num_heads: int
    head_dim: int
    mlp_hidden: int  # the MLP's hidden width, resolved (mlp_width)
    no_attn_layers: tuple[int, ...]
    value_embed_blocks: tuple[int, ...]
    window_pattern: str
    attn_scale: float
    gate_channels: int
    rotary_min_freq: float
    logit_softcap: float
    softcap_temp: float
    softcap_shift: float
    bigram_rows: int
    bigram_sign_rows: int
    trigram_rows: int
    ngram_normalize: bool
    ngram_spread: bool
    backout_layer: int
    paired_head_blocks: tuple[int, ...]
    xsa_blocks: tuple[int, ...]
    cplm_bands: tuple[int, ...]
    bos_id: int  # CPLM's copy column is bos_id + 1
    skip_from: int
    skip_into: int  # 0: the first of no_attn_layers (skip_target)
    skip_layers: tuple[int, ...]
    parallel_mlp_blocks: tuple[int, ...]
    no_x0_blocks: tuple[int, ...]
    no_ngram_blocks: tuple[int, ...]
    no_resid_scale_blocks: tuple[int, ...]
    narrow_qk_blocks: tuple[int, ...]
    narrow_v_blocks: tuple[int, ...]
    narrow_attn_scale: float
    dc_attention: bool
    doc_copy: bool
    tied_embed_stages: int
    max_seq_len: int  # longest sequence the rotary tables must cover
    yarn_windows: tuple[int, ...] = ()  # YaRN: the schedule's long windows in tokens, in order

    @classmethod
    def from_args(cls, args: Hyperparameters) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"max_seq_len", "yarn_windows", "mlp_hidden"}
        blocks = (*(row.window for row in args.stages), *([args.extension_window] if args.extension_steps else []))
        yarn = tuple(dict.fromkeys(b * args.window_block for b in blocks))  # long windows
        longest = max(args.seq_len, args.val_seq_len) * (2 if args.paired_head_blocks else 1)  # paired: 2 per token
        return cls(**{n: getattr(args, n) for n in names}, mlp_hidden=mlp_width(vars(args)), max_seq_len=longest,
                   yarn_windows=yarn)

    @property
    def skip_target(self) -> int:
        """The attention-less block the skip goes into (skip_into, or the first of no_attn_layers)."""
        return self.skip_into or min(self.no_attn_layers)

    def head_widths(self, block: int) -> tuple[int, int]:
        """A block's attention head widths (d_qk, d_v): head_dim, or half of it in narrow_qk_blocks, narrow_v_blocks."""
        half = self.head_dim // 2
        return (half if block in self.narrow_qk_blocks else self.head_dim,
                half if block in self.narrow_v_blocks else self.head_dim)



# Bigram hash embedding (2026-01-19 record, @classiclarryd, PR 201; hash embeddings: arXiv 1709.03933):
# each position also looks up a row picked by a hash of (previous token, token), so every block gets
# the local bigram directly rather than through attention. The multipliers are the record's; the
# row counts are fields. Sizes in the records: 251,520 rows (5 x 50,304) on 01-19; 754,560 rows of
# the first 192 dims with 8,192 sign rows on 05-20; 377,280 full-width rows with 8,192 sign rows in
# the 2026-05-27 record (@Lisennlp, PR 315). A table narrower than model_dim is not offered here.
BIGRAM_HASH_MULTS = (36313, 27191)  # for the current and the previous token (2026-01-19 record)
# ANVIL2's (2026-08-30) trigram row multipliers for tokens t, t-1, t-2 (get_sgsame_hash's _TG_ROW_0.._2) and
# its trigram sign multipliers for t-2, t-1, t (bigram_kernels.py's `ss` hash)
TRIGRAM_HASH_MULTS = (17351, 60961, 45259)
TRIGRAM_SIGN_MULTS = (26801, 39779, 58699)


def document_starts(cu_seqlens: Tensor, T: int) -> Tensor:
    """(T,) bool: where a document starts (a BOS, or a validation buffer's first, partial document)."""
    return torch.zeros(T + 1, dtype=torch.bool, device=cu_seqlens.device).index_fill(0, cu_seqlens.long(), True)[:T]


def blocks_with_lookback(t: Tensor, block: int, lookback: int, value=0) -> Tensor:
    """t (T, ...) cut into blocks of `block` rows, each with the `lookback` rows before it, padded with `value`
    before the start and after the end: (n, ..., lookback + block), n = ceil(T / block). The keys of blocked local
    attention (dc_correction, GPT.copy_pointer)."""
    pad = -t.size(0) % block
    return F.pad(t.movedim(0, -1), (lookback, pad), value=value).movedim(-1, 0).unfold(0, lookback + block, block)


def pointer_written_out(q: Tensor, k: Tensor, sink: Tensor, doc: Tensor, inputs: Tensor, targets: Tensor,
                        band: int, chunked: bool = False) -> tuple[Tensor, Tensor]:
    """CPLM's pointer softmax written out in PyTorch (GPT.copy_pointer where Triton does not run; kernels.copy_pointer
    computes the same): query i's scores q_i.k_j over its keys j (earlier positions of its document `doc` in its band
    of `band` tokens and the band before) and the sink's score sink_i. Returns p_copy (the softmax's mass on keys
    whose input token is i's target) and a_sink (the sink's share). Bands of queries go together (memory
    O(T band)), one at a time if `chunked`."""
    T, d = q.shape
    pad = -T % band
    n = (T + pad) // band
    qb, sink = F.pad(q, (0, 0, 0, pad)).view(n, band, d), F.pad(sink, (0, pad)).view(n, band, 1)
    kb = blocks_with_lookback(k, band, band)  # (n, d, 2 band): the band before and this one
    doc_q, doc_k = F.pad(doc, (0, pad), value=-1).view(n, band), blocks_with_lookback(doc, band, band, value=-2)
    tokens = blocks_with_lookback(inputs, band, band, value=-1)
    wanted = F.pad(targets, (0, pad), value=-2).view(n, band)
    i, j = torch.arange(band, device=q.device), torch.arange(2 * band, device=q.device)
    earlier = j[None, :] < i[:, None] + band  # key j of the two bands lies strictly before query i
    step = 1 if chunked else n
    p_copy, a_sink = [], []
    for b in range(0, n, step):  # the softmax over the keys and the sink written out: no (.., 1 + 2 band) copy
        s = slice(b, b + step)
        scores = torch.einsum("nid,ndj->nij", qb[s], kb[s])
        scores = torch.where(earlier & (doc_q[s, :, None] == doc_k[s, None, :]), scores, float("-inf"))
        top = torch.maximum(scores.amax(-1), sink[s, :, 0]).detach()  # any shift gives the same softmax
        e, e_sink = (scores - top[..., None]).exp(), (sink[s, :, 0] - top).exp()
        total = e.sum(-1) + e_sink
        a_sink.append(e_sink / total)
        p_copy.append(torch.where(tokens[s, None, :] == wanted[s, :, None], e, 0).sum(-1) / total)
    return torch.cat(p_copy).flatten()[:T], torch.cat(a_sink).flatten()[:T]


# doc_copy (public pull request 378): the context lengths matched, longest first wins, and the buckets: one per
# (length, earlier occurrences of that context in the document: 1, 2, 3 or more), bucket 0 for no match
DOC_COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
DOC_COPY_BUCKETS = 1 + 3 * len(DOC_COPY_LENGTHS)
DOC_COPY_HASH = (0x2545F4914F6CDD1D, 0x1B873593CC9E2D51, 0x5851F42D4C957F2D)  # odd 63-bit multipliers: window, length, doc


def wrap64(n: int) -> int:
    """n mod 2^64 as a signed 64-bit integer (what int64 tensor arithmetic wraps to)."""
    n %= 1 << 64
    return n - (1 << 64) if n >= 1 << 63 else n


def doc_copy_candidates(inputs: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """Each position t's copy candidate and bucket (doc_copy; public pull request 378's matcher, written here): for
    each length L of DOC_COPY_LENGTHS, the window of t's last L tokens (inside t's document) is hashed with L and
    the document; one stable sort of all (length, position) keys puts each window right after its latest earlier
    twin, and its rank counts the earlier twins. The longest L with a twin wins: the candidate is the token after
    the twin's end (an input at or before t: nothing from the future), the bucket 1 + 3 (L's index) + min(twins,
    3) - 1. No twin at any length: candidate -1, bucket 0. All on the device, shapes fixed (no host sync)."""
    T, device = inputs.size(0), inputs.device
    doc = document_ids(cu_seqlens, T)
    pos = torch.arange(T, device=device)
    depth = pos - cu_seqlens[doc - 1].long()  # tokens of t's document before t
    mult, by_length, by_doc = DOC_COPY_HASH
    h, keys, tokens = torch.zeros(T, dtype=torch.long, device=device), [], inputs.long() + 1
    for L in range(1, DOC_COPY_LENGTHS[-1] + 1):  # h: the window t-L+1..t, one token more each time (wraps mod 2^64)
        h = h * mult + F.pad(tokens, (L - 1, 0))[:T]
        if L in DOC_COPY_LENGTHS:
            k = len(keys)
            key = h ^ wrap64(L * by_length) ^ (doc * by_doc)
            keys.append(torch.where(depth >= L - 1, key, -1 - (k * T + pos)))  # a window leaving the document: unique
    keys = torch.cat(keys)  # (lengths x T), in position order within each length
    order = torch.sort(keys, stable=True).indices
    sorted_keys = keys[order]
    n = order.numel()
    first = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    idx = torch.arange(n, device=device)
    rank = idx - torch.cummax(torch.where(first, idx, 0), 0).values  # earlier twins of the same window
    twin = torch.where(first, order, torch.roll(order, 1)) % T  # the latest earlier twin's end (itself if none)
    ranks = torch.empty_like(rank).scatter_(0, order, rank).view(-1, T)
    twins = torch.empty_like(twin).scatter_(0, order, twin).view(-1, T)
    found = (ranks > 0) & (twins < pos)  # (a twin is always earlier; a hash shared across lengths is not a twin)
    level = torch.where(found, torch.arange(1, len(DOC_COPY_LENGTHS) + 1, device=device)[:, None], 0).amax(0)
    at = (level - 1).clamp(min=0)[None]
    end, seen = twins.gather(0, at)[0], ranks.gather(0, at)[0]
    candidate = torch.where(level > 0, inputs.long()[(end + 1).clamp(max=T - 1)], -1)
    bucket = torch.where(level > 0, 3 * (level - 1) + seen.clamp(max=3), 0)
    return candidate, bucket


def bigram_indices(inputs: Tensor, cu_seqlens: Tensor, rows: int, sign_rows: int = 0) -> tuple[Tensor, Tensor | None]:
    """Each position's row of the bigram table and (sign_rows > 0) of the sign table.

    Row = (36313 * token xor 27191 * previous token) mod (rows - 1). A document's first position
    (where cu_seqlens starts a document: a BOS, or a validation buffer's first, partial document) has
    no previous token in its document and takes the reserved last row, rows - 1; so no position sees
    the document before it, as with varlen attention. (The records hash a BOS with the previous
    document's last token and reserve the row only for the buffer's first position.) Sign row =
    (previous xor token) mod sign_rows, 0 at a document start (the 2026-05-20 record's sign trick)."""
    starts = document_starts(cu_seqlens, inputs.size(0))
    cur = inputs.long()
    prev = cur.roll(1)  # position 0 wraps around, but it is always a document start
    a, b = BIGRAM_HASH_MULTS
    row = torch.where(starts, rows - 1, torch.bitwise_xor(a * cur, b * prev) % (rows - 1))
    sign = torch.where(starts, 0, torch.bitwise_xor(cur, prev) % sign_rows) if sign_rows else None
    return row, sign


def trigram_indices(inputs: Tensor, cu_seqlens: Tensor, offset: int, rows: int,
                    sign_rows: int = 0) -> tuple[Tensor, Tensor | None]:
    """Each position's row of the trigram channel, rows offset .. offset + rows - 1 of the n-gram table (after the
    bigram rows), and (sign_rows > 0) of the shared sign table. Row = offset + (17351 * token xor 60961 *
    previous xor 45259 * the one before) mod (rows - 1), ANVIL2's hash; a position with fewer than two earlier
    positions in its document takes the reserved last row and sign row 0, as ANVIL2 does for the first two
    positions of its stream (ANVIL2 otherwise hashes across documents; here nothing crosses into a document).
    Sign row = (26801 * the one before xor 39779 * previous xor 58699 * token) mod sign_rows (ANVIL2's)."""
    starts = document_starts(cu_seqlens, inputs.size(0))
    short = starts | starts.roll(1)  # a document start, or the position after one (position 0 wraps: a start)
    cur = inputs.long()
    prev, prev2 = cur.roll(1), cur.roll(2)
    a, b, c = TRIGRAM_HASH_MULTS
    row = offset + torch.where(short, rows - 1, (a * cur ^ b * prev ^ c * prev2) % (rows - 1))
    sa, sb, sc = TRIGRAM_SIGN_MULTS
    sign = torch.where(short, 0, (sa * prev2 ^ sb * prev ^ sc * cur) % sign_rows) if sign_rows else None
    return row, sign


class RowGradLog(torch.autograd.Function):
    """weight[idx], whose backward writes each looked-up position's gradient into grad_log at positions pos (the
    n-gram table's gradient log, ngram_lookup) and hands the table (or the sharded table's row cache) no gradient
    of its own."""

    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor, pos: Tensor, grad_log: Tensor) -> Tensor:
        ctx.save_for_backward(pos)
        ctx.grad_log = grad_log
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pos, = ctx.saved_tensors
        ctx.grad_log.index_copy_(0, pos, grad.reshape(-1, grad.size(-1)).to(ctx.grad_log.dtype))
        return None, None, None, None


def ngram_lookup(idx: Tensor, rows: Tensor, weight: Tensor, log: dict) -> Tensor:
    """weight[idx] with the row-sparse gradient (ngram_sparse_adam): the positions' table rows `rows` (weight's own
    rows idx on one GPU, their places idx in the row cache of a sharded table) and, in the backward, their gradients
    (bf16, the lookup's own) are appended to the log (GPT.keep_table_grads), whose next free position `used` is a
    device counter, so a compiled step has no host sync; the table's memory per step is its looked-up rows."""
    pos = log["used"] + torch.arange(idx.numel(), device=idx.device)
    log["rows"].index_copy_(0, pos, rows.reshape(-1))
    log["used"].add_(idx.numel())
    return RowGradLog.apply(idx, weight, pos, log["grads"])


class TableLookup(torch.autograd.Function):
    """weight[idx], whose backward adds the looked-up rows' gradients into grad_sum (float32, the table's shape)
    instead of handing autograd a gradient of the whole table: a dense table gradient costs a zero fill, a
    scatter and a cast of every row per micro-batch and an add per micro-batch accumulated, where only the
    looked-up rows change (ours; the trainer hands the sum to the optimizer: flush_table_grads). One H100, window 11:
    16 ms off a 698 ms step, 1.2 GiB more memory (bench/results/mlp_tma_tables_h100_20261127.md)."""

    @staticmethod
    def forward(ctx, idx: Tensor, weight: Tensor, grad_sum: Tensor) -> Tensor:
        ctx.save_for_backward(idx)
        ctx.grad_sum = grad_sum
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        idx, = ctx.saved_tensors
        ctx.grad_sum.index_add_(0, idx.reshape(-1), grad.reshape(-1, grad.size(-1)).float())
        return None, None, None


def lookup(idx: Tensor, weight: Tensor, grad_sum: Tensor | None) -> Tensor:
    """weight[idx]; in training with the table's gradient sum attached (keep_table_grads), through TableLookup."""
    if grad_sum is None or not torch.is_grad_enabled():
        return F.embedding(idx, weight)
    return TableLookup.apply(idx, weight, grad_sum)


def smear(x: Tensor, cu_seqlens: Tensor, weight: Tensor, gate_w: Tensor) -> Tensor:
    """Smear gate (2025-09-18 record, @classiclarryd, PR 130): each position's token embedding adds
    the previous position's, times weight * sigmoid(gate_w . its own first channels), so one token
    of look-back is there before any attention. Nothing crosses into a document from the one
    before (the record smears across document boundaries)."""
    prev = torch.where(document_starts(cu_seqlens, x.size(0))[:, None], 0, x.roll(1, dims=0))
    gate = weight * torch.sigmoid(F.linear(x[:, : gate_w.size(1)], gate_w.type_as(x)))
    return x + (gate * prev).type_as(x)


def mtp_targets(targets: Tensor, cu_seqlens: Tensor, n: int) -> list[tuple[Tensor, Tensor]]:
    """Multi-token prediction's extra targets: for k = 2 .. n + 1, each position t's token at t + k
    (targets[t + k - 1]) and whether it is t's document's own: no document starts in (t, t + k - 1]
    and t + k - 1 is inside the micro-batch. A document's last target (the next BOS, or the token
    after a cut at max_doc_len) is its own, as in next-token prediction."""
    T = targets.size(0)
    starts = torch.zeros(T + n, dtype=torch.bool, device=targets.device).index_fill(0, cu_seqlens.long(), True)
    starts = starts | (torch.arange(T + n, device=targets.device) >= T)  # the buffer's end closes every document
    padded = F.pad(targets, (0, n))  # the padding is never a kept target
    keep, out = torch.ones(T, dtype=torch.bool, device=targets.device), []
    for j in range(1, n + 1):
        keep = keep & ~starts[j: T + j]
        out.append((padded[j: T + j], keep))
    return out


def prefix_table(token_bytes: list[bytes | None], vocab_size: int) -> Tensor:
    """The prefix-token loss' table (2026-07-13 record, PR 337): for each token id, the id of
    the longest proper prefix of its bytes that is itself a token; -1 where there is none (one-byte
    tokens, special and padding ids). Made from the vocabulary alone, never from the data."""
    ids = {b: i for i, b in enumerate(token_bytes) if b is not None}
    table = [-1] * vocab_size
    for b, i in ids.items():
        table[i] = next((ids[b[:k]] for k in range(len(b) - 1, 0, -1) if b[:k] in ids), -1)
    return torch.tensor(table, dtype=torch.int64)


def gpt2_token_bytes() -> list[bytes | None]:
    """Each GPT-2 token's bytes (None for the special <|endoftext|>), from tiktoken."""
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except ImportError:
        raise ValueError("the prefix-token loss reads the GPT-2 vocabulary: pip install tiktoken") from None
    except Exception as e:  # tiktoken fetches its files on first use
        raise OSError(f"the prefix-token loss reads the GPT-2 vocabulary, and tiktoken could not load it ({e}); "
                      "offline, set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's GPT-2 files") from None
    special = {enc.encode_single_token(t) for t in enc.special_tokens_set}
    return [None if i in special else enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]


def normalized_text(text: str) -> str:
    """A token's text as ngram_normalize compares it (public pull request 375's normalizer chain, written with
    unicodedata): NFKC, then NFD with the combining marks dropped (accents), lowercase, each run of spaces, tabs
    and line breaks as one space, then stripped; a token of whitespace alone stays one space."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = re.sub(r"[ \t\r\n]+", " ", "".join(c for c in text if not unicodedata.combining(c)).lower())
    return " " if text == " " else text.strip()


def normalized_token_table(token_bytes: list[bytes | None], vocab_size: int) -> Tensor:
    """ngram_normalize's table: each token id to the smallest id whose text normalizes the same (normalized_text);
    special tokens, byte tokens that are not UTF-8 text, tokens that normalize to nothing and padding ids keep their
    own. Made from the vocabulary alone, never from the data."""
    if vocab_size < len(token_bytes):
        raise ValueError(f"ngram_normalize is for GPT-2 tokens: vocab_size={vocab_size} is below GPT-2's "
                         f"{len(token_bytes)}; use --ngram_normalize false")
    table, first = list(range(vocab_size)), {}
    for i, b in enumerate(token_bytes):
        try:
            key = normalized_text(b.decode("utf-8")) if b is not None else ""
        except UnicodeDecodeError:
            continue
        if key:
            table[i] = first.setdefault(key, i)
    return torch.tensor(table, dtype=torch.int64)


def yarn_frequencies(freqs: Tensor, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0) -> Tensor:
    """YaRN (arXiv 2309.00071) as the 2025-09-10 record (@classiclarryd, PR 122) applies it when the
    long window grows from old_window to new_window tokens: a frequency that turns fewer than alpha
    times across the old window is slowed by old/new (position interpolation: the new window spans
    the angles the model learned), one that turns more than beta times is kept, and those between
    are blended linearly in their number of turns."""
    turns = old_window * freqs / (2 * math.pi)
    kept = ((turns - alpha) / (beta - alpha)).clamp(0, 1)
    ratio = old_window / new_window
    return freqs * (ratio + kept * (1 - ratio))


class Rotary(nn.Module):
    """Rotary position embedding on half of each head's dims; the other half carries no position
    (@YouJiacheng's half-truncated RoPE, with its base frequency tuned). Positions run over the whole buffer: rotary is
    relative, so offsets between documents do not matter.

    With YaRN (yarn_windows: the long windows in schedule order), each long window has its own
    tables, its frequencies rescaled at every growth from the previous window's by
    yarn_frequencies, and its own attention-scale multiplier, 1 + 0.2 ln(new / old) per growth
    (the record's). `at(long_window)` gives a stage's (cos, sin, scale multiplier)."""

    def __init__(self, head_dim: int, max_seq_len: int, min_freq: float, yarn_windows: tuple[int, ...] = ()):
        super().__init__()
        freqs = min_freq ** torch.linspace(0, 1, steps=head_dim // 4)
        freqs = torch.cat([freqs, freqs.new_zeros(head_dim // 4)])
        self.tables: dict[int, tuple[int, float]] = {}  # long window -> (table index, attention-scale multiplier)
        scale = 1.0
        for i, window in enumerate(yarn_windows or (None,)):
            if i:
                freqs = yarn_frequencies(freqs, yarn_windows[i - 1], window)
                scale *= 1 + 0.2 * math.log(window / yarn_windows[i - 1])
            theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
            self.register_buffer(f"cos{i}", theta.cos(), persistent=False)
            self.register_buffer(f"sin{i}", theta.sin(), persistent=False)
            if window is not None:
                self.tables[window] = (i, scale)

    def at(self, long_window: int) -> tuple[Tensor, Tensor, float]:
        if not self.tables:
            return self.cos0, self.sin0, 1.0
        if long_window not in self.tables:
            raise ValueError(f"YaRN has tables for the long windows {list(self.tables)}, not {long_window}")
        i, scale = self.tables[long_window]
        return getattr(self, f"cos{i}"), getattr(self, f"sin{i}"), scale


def offset_keys(k: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Partial key offset (2025-12-14 record, @classiclarryd, PR 169): the dims of each head's key
    that rotary leaves unrotated, [D/4, D/2) and [3D/4, D) (the zero frequencies of Rotary), are
    taken from the previous position's key. A query can then match the token before a key, so one
    block can do induction: find an earlier occurrence of the current token, attend to what came
    after it. A document's first key keeps its own (the record takes the previous document's)."""
    D = k.size(-1)
    unrotated = torch.arange(D, device=k.device) % (D // 2) >= D // 4
    prev = torch.where(document_starts(cu_seqlens, k.size(0))[:, None, None], k, k.roll(1, dims=0))
    return torch.where(unrotated, prev, k)


def pair_heads(x: Tensor) -> Tensor:
    """Paired-head attention (2026-01-07 record, @classiclarryd, PR 191): (T, H, D) -> (2T, H/2, D), a
    reshape that puts head h of token t at position 2t and head h + H/2 at 2t + 1, in the same head.
    Each query then sees two keys per earlier token (one per head of the pair) in one softmax, and
    rotary, at positions 2t and 2t + 1, tells the two apart. Documents and their lengths double; the
    window, in positions, then covers half as many tokens. Undone by reshaping the output to (T, H, D)."""
    T, H, D = x.shape
    return x.reshape(2 * T, H // 2, D)


def exclude_own_value(y: Tensor, v: Tensor, alpha: Tensor) -> Tensor:
    """Learnable exclusive self-attention (XSA, arXiv 2603.09078; learnable strength: the 2026-04-29
    record, @_djdumpling, PR 264). y, v: (T, H, D) attention outputs and the values they attend over;
    alpha: (H,) or per token (T, H). Each head removes tanh(alpha) of its output's component along its own token's value
    direction, i.e. of what it copies of the token itself, which the residual stream already carries.
    alpha = 0 (the start) changes nothing; tanh(alpha) = 1 leaves y orthogonal to v."""
    unit = F.normalize(v, dim=-1, eps=1e-4)
    along = (y * unit).sum(-1, keepdim=True)
    return y - torch.tanh(alpha).type_as(y)[..., None] * along * unit


DC_WINDOW, DC_CHUNK = 112, 128  # DC attention's local window in tokens (the public master's), and its query blocks


def dc_correction(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, w1: Tensor, w2: Tensor, scale: float,
                  window: int = DC_WINDOW, chunk: int = DC_CHUNK, fused: bool = False) -> Tensor:
    """Dynamically composable attention, post-composition only, rank 1 (DCMHA, arXiv 2405.08553; the 2026-05-27
    record's lightweight DC, PR 315). Each head g's softmax over the `window` latest keys of the
    query's document (itself included), P_g, is recomputed; per token, one map A = sum_g w1_g P_g mixes the heads
    (w1 RMS-normed over heads) and head h adds w2_h A v_h to its output. q, k, v: (T, H, D) as attention saw them;
    w1, w2: (T, H) per-token weights. `fused`: kernels.dc_attention computes it (Triton; scores in registers). Else,
    written out: queries go in blocks of `chunk`, each against its keys and the window - 1 before them, so memory is
    O(T H chunk (chunk + window)), never T x T."""
    T, H, D = q.shape
    w1 = w1.float() * torch.rsqrt(w1.float().square().mean(-1, keepdim=True) + 1e-6)
    if fused:
        doc = document_ids(cu_seqlens, T).int()
        out = kernels.dc_attention(q.contiguous(), k.contiguous(), v.contiguous(), doc, w1.contiguous(), scale,
                                   window)[0]
        return (out * w2.unsqueeze(-1)).type_as(v)
    halo, pad = window - 1, -T % chunk
    # the key blocks' width rounded up to a multiple of 8 with keys that are always masked: a width of 239 (the
    # public window) left a float32 matmul on CUDA cores with 4-byte-aligned rows (5.7 ms a step in a profile)
    extra = -(chunk + halo) % 8
    lookback = halo + extra
    n, width = (T + pad) // chunk, chunk + lookback
    doc = document_ids(cu_seqlens, T)
    q_blocks = F.pad(q, (0, 0, 0, 0, 0, pad)).view(n, chunk, H, D)
    k_blocks, v_blocks = (blocks_with_lookback(t, chunk, lookback) for t in (k, v))  # (n, H, D, width)
    # padded queries in the keys' padding document (-2): each sees at least its own padded key, so no row of the
    # softmax is all -inf (a row of -1s matched no key: NaN gradients through v where T is not a multiple of chunk)
    doc_q = F.pad(doc, (0, pad), value=-2).view(n, chunk)
    doc_k = blocks_with_lookback(doc, chunk, lookback, value=-2)  # (n, width)
    i, j = torch.arange(chunk, device=q.device), torch.arange(width, device=q.device)
    near = (j[None, :] >= i[:, None] + extra) & (j[None, :] <= i[:, None] + lookback)  # key j of row i: window back
    mask = near & (doc_q[:, :, None] == doc_k[:, None, :])  # (n, chunk, width)
    scores = torch.einsum("nihd,nhdj->nhij", q_blocks.float(), k_blocks.float()) * scale
    probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(dim=-1)  # each row has its own key
    # the heads' mix as a broadcast sum over H = 6, which the compiler fuses into the softmax, not a K = 6 matmul
    w1_blocks = F.pad(w1, (0, 0, 0, pad)).view(n, chunk, H).transpose(1, 2)  # (n, H, chunk)
    composed = (w1_blocks[..., None] * probs).sum(1)  # (n, chunk, width)
    out = torch.einsum("nij,nhdj->nihd", composed.type_as(v), v_blocks)
    return (out.reshape(n * chunk, H, D)[:T] * w2.unsqueeze(-1)).type_as(v)


def rotate(x: Tensor, rope: tuple[Tensor, Tensor, float]) -> Tensor:  # x: (T, H, D)
    """Rotary embedding with a stage's tables (Rotary.at)."""
    cos, sin = rope[0][: x.size(0), None, :], rope[1][: x.size(0), None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).type_as(x)


class BlockWeights(NamedTuple):
    """One block's mixing weights, each a scalar tensor or per token ((T, 1); per head (T, H)), set by GPT.hidden from
    the learned scalars, the MUDD gates and, in the last block, MUDD: x <- resid x; x <- x + attn_out attention(x)
    + x0_w x0 + bigram; then x <- mlp_resid x + mlp_out MLP(x). A block without attention: x <- resid x + x0_w x0 +
    bigram, then the MLP."""
    resid: Tensor | None  # the residual stream's own weight before the block; None: unscaled (no_resid_scale_blocks)
    x0: Tensor | None  # the normed embedding's weight; None: no x0 injection (no_x0_blocks)
    attn_out: Tensor  # the attention output's weight
    mlp_resid: Tensor  # the residual's weight around the MLP
    mlp_out: Tensor  # the MLP output's weight
    value_mix: Tensor  # (2,): weights of the block's own values and of its value embedding
    bigram: Tensor | None = None  # the bigram embedding, already weighted for this block
    xsa: Tensor | None = None  # XSA's strength per token and head (xsa_blocks)
    head_out: Tensor | None = None  # per token and head: the heads' output weights (the long-window blocks')
    ve_gate: Tensor | None = None  # per token and head: the value embedding's gate, in place of the block's own
    value_extra: Tensor | None = None  # MUDD's value channel, added to the values (the last block)
    dc: tuple[Tensor, Tensor] | None = None  # DC attention's per-token (w1, w2), (T, H) each (the last block)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_fn, ve_gate: bool, key_offset: bool, paired: bool,
                 widths: tuple[int, int] | None = None, native_widths: bool = False, fused_dc: bool = False,
                 fused_qk_rope: bool = False):
        """widths: the heads' (d_qk, d_v) (ModelConfig.head_widths; default head_dim both); native_widths: attn_fn
        takes Q/K narrower than V as they are (kernels.MIXED_WIDTHS), else they are zero-padded to V's width;
        fused_dc: DC attention's correction (where BlockWeights.dc is set) in kernels.dc_attention; fused_qk_rope:
        QK-norm, rotary and the key offset in kernels.qk_norm_rope (not written for paired heads with a key offset)."""
        super().__init__()
        self.attn_fn, self.key_offset, self.paired = attn_fn, key_offset, paired  # attn_fn: chosen by build()
        self.native_widths, self.fused_dc = native_widths, fused_dc
        self.fused_qk_rope = fused_qk_rope and not (paired and key_offset)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qk_dim, self.v_dim = widths or (cfg.head_dim, cfg.head_dim)
        self.scale = cfg.narrow_attn_scale if self.qk_dim < cfg.head_dim else cfg.attn_scale
        H, dim = cfg.num_heads, cfg.model_dim
        # One fused weight for Q, K, V and the output projection (stored transposed, hdim x dim): one matmul for QKV
        # and one Muon group of same-shape matrices; the output projection drawn as V (the public master's, after the
        # 2026-01-30 record's V/O init). Q/K narrower than V (narrow_qk_blocks without narrow_v_blocks): Q and K in
        # one weight, V and O in another, drawn alike (ANVIL2 draws its banks full and reads the narrow rows)
        if self.qk_dim == self.v_dim:
            self.qkvo_w = nn.Parameter(uniform_init_(torch.empty(4, H * self.v_dim, dim), dim))
        else:
            self.qk_w = nn.Parameter(uniform_init_(torch.empty(2, H * self.qk_dim, dim), dim))
            self.vo_w = nn.Parameter(uniform_init_(torch.empty(2, H * self.v_dim, dim), dim))
        # Value-embedding gate (2025-12-29 record, @classiclarryd, PR 186), in blocks with a value embedding (but the
        # last, whose gate MUDD gives): 2 sigmoid(W x[:12]) scales each head's value embedding by context; zero = 1
        self.ve_gate_w = nn.Parameter(torch.zeros(cfg.num_heads, cfg.gate_channels)) if ve_gate else None

    def forward(self, x: Tensor, ve: Tensor | None, w: BlockWeights, cu_seqlens: Tensor, max_seqlen: int, window: int,
                rope: tuple[Tensor, Tensor, float]) -> Tensor:
        T, H, dq, dv = x.size(0), self.num_heads, self.qk_dim, self.v_dim
        if dq == dv:
            w_qkv, w_out = self.qkvo_w[:3].flatten(0, 1), self.qkvo_w[3]
        else:
            w_qkv, w_out = torch.cat([self.qk_w.flatten(0, 1), self.vo_w[0]]), self.vo_w[1]
        qkv = F.linear(x, w_qkv.type_as(x))
        # a narrow Q/K (narrow_qk_blocks) rotates all of its dq dims: the tables' first dq/2 columns, the wide heads'
        # nonzero frequencies (ANVIL2's 64-dim rotary: the same 32 frequencies as its 128-dim one's rotating half)
        rope_qk = rope if dq == self.head_dim else (rope[0][:, : dq // 2], rope[1][:, : dq // 2], rope[2])
        if self.fused_qk_rope:  # q and k normed, rotated (at paired rows where paired) and offset; v a copy
            starts = document_starts(cu_seqlens, T) if self.key_offset else None
            q, k, v = torch.ops.speedrun.qk_norm_rope(qkv, rope_qk[0], rope_qk[1], starts, H, dq, dv, self.paired)
        else:
            q, k, v = (t.view(T, H, -1) for t in qkv.split((H * dq, H * dq, H * dv), dim=-1))
        # per token (T, model_dim) -> (T, H, dv): each head's first dv dims of a value-width vector (a narrow V's
        # share, narrow_v_blocks: "adding only the live half equals adding at full width and dropping the top", ANVIL2)
        heads = (lambda t: t.view(T, H, -1)) if dv == self.head_dim else (lambda t: t.view(T, H, -1)[..., :dv])
        # Value embeddings (@KoszarskyB, @Grad62304977; value residual, arXiv 2410.17897): v mixes in a
        # per-token table lookup.
        ve_gate = w.ve_gate
        if ve is not None and ve_gate is None and self.ve_gate_w is not None:
            ve_gate = 2 * torch.sigmoid(F.linear(x[:, : self.ve_gate_w.size(1)], self.ve_gate_w.type_as(x)))
        if ve is not None and ve_gate is not None:
            ve = heads(ve) * ve_gate.unsqueeze(-1)
        v = w.value_mix[0] * v + w.value_mix[1] * heads(ve) if ve is not None else w.value_mix[0] * v
        if w.value_extra is not None:  # MUDD's value channel (GPT.hidden)
            v = v + heads(w.value_extra)
        own_v = v  # (T, H, dv) before any pairing: each head's value at each token, for XSA
        if self.paired:
            q, k, v = pair_heads(q), pair_heads(k), pair_heads(v)
            cu_seqlens, max_seqlen = 2 * cu_seqlens, 2 * max_seqlen
        if not self.fused_qk_rope:
            q, k = rotate(norm(q), rope_qk), rotate(norm(k), rope_qk)  # QK-norm (@Grad62304977), then rotary
            if self.key_offset:
                k = offset_keys(k, cu_seqlens)
        if dq < dv and not self.native_widths:  # a backend of one head width: Q and K zero-padded to V's, exact
            # (zeros add nothing to q.k), at this block's own scale (passed: never a kernel's default 1/sqrt(dv)); the
            # padding's gradient is dropped (bench/results/attention_head_widths.md). FA4 takes (dq, dv) as they are
            q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
        y = self.attn_fn(q, k, v, cu_seqlens, max_seqlen, window, self.scale * rope[2])  # rope[2]: YaRN's
        y = y.reshape(T, H, dv)  # paired heads back in place (otherwise already this shape)
        if w.dc is not None:  # before XSA and the output weights, as in the 2026-05-27 record
            y = y + dc_correction(q, k, v, cu_seqlens, w.dc[0], w.dc[1], self.scale * rope[2], fused=self.fused_dc)
        if w.xsa is not None:
            y = exclude_own_value(y, own_v, w.xsa)
        if w.head_out is not None:
            y = y * w.head_out.unsqueeze(-1)
        return y.reshape(T, H * dv) @ w_out.type_as(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool = False, fp8: bool = False, fp8_transpose: bool = False):
        super().__init__()
        hidden = cfg.mlp_hidden  # mlp_hidden, or mlp_ratio x model_dim
        # Both matrices are stored (dim, hidden), as in the 2025-09-03 record: one Muon group of
        # same-shape matrices, and Muon's shape scale max(1, rows/cols)^0.5 is 1 for both. Stored
        # (hidden, dim), the input matrix got scale 2, i.e. twice the record's learning rate.
        self.fc_w = nn.Parameter(uniform_init_(torch.empty(cfg.model_dim, hidden), cfg.model_dim))
        self.proj_w = nn.Parameter(torch.zeros(cfg.model_dim, hidden))  # zero init (@Grad62304977)
        self.fused = fused  # kernels.py's relu2_mlp (ModelKernels.fused_mlp)
        self.fp8 = fp8  # kernels.py's relu2_mlp_all_fp8 in training (ModelKernels.fp8_mlp)
        self.fp8_transpose = fp8_transpose  # its transposed operands by kernels.transpose (ModelKernels.transpose)

    def forward(self, x: Tensor) -> Tensor:
        # ReLU^2 (arXiv 2109.08668; @SKYLINEZ007, @Grad62304977): ~1-2% better than GELU in the speedrun.
        fc_w, proj_w = self.fc_w.type_as(x), self.proj_w.type_as(x)
        if self.fp8 and self.training:
            return torch.ops.speedrun.relu2_mlp_all_fp8(x, *fp8_mlp_operands(x, fc_w, proj_w, self.fp8_transpose),
                                                        self.fp8_transpose)[0]
        if self.fused:
            return torch.ops.speedrun.relu2_mlp(x, fc_w, proj_w)[0]
        return F.linear(F.relu(x @ fc_w).square(), proj_w)


@torch.no_grad()
def fp8_mlp_operands(x: Tensor, fc_w: Tensor, proj_w: Tensor, transpose_kernel: bool = False) -> tuple[Tensor, ...]:
    """relu2_mlp_all_fp8's operands after x: (x_f8, x_f8_t, fc_w, fc_f8, fc_f8_t, proj_w, proj_f8, proj_f8_t,
    scales, parts), e4m3 copies in the layouts the matmuls read, with scales from bounds (traced, so the compiler
    fuses them with the norm before). x is RMS-normed, so |x| <= sqrt(dim), as for the FP8 head; each weight matrix
    by its absolute maximum; post = relu(x w_j)² <= dim * max_j |w_j|² over W_fc's columns w_j (Cauchy-Schwarz),
    times 1.3 for the operands' rounding (up to 1/16 each), so post never saturates. scales: x's times W_fc's,
    W_proj's, post's; parts: x's, W_fc's, and W_proj's largest column norm (for grad_pre's scale,
    kernels.pre_grad_scale); a 16-byte row each (kernels.fp8_scale_rows). transpose_kernel: x_f8_t by the
    transpose op, a kernel of its own (kernels.transposed), not inside the norm's."""
    x_s = math.sqrt(x.size(-1)) / E4M3_MAX
    fc_s, proj_s = (w.detach().abs().amax().float().clamp_min(1e-30) / E4M3_MAX for w in (fc_w, proj_w))
    post_s = (1.3 * x.size(-1) * fc_w.float().square().sum(0).amax() / E4M3_MAX).clamp_min(1e-30)
    e4m3 = lambda t: t.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    x_f8, fc_f8, proj_f8 = e4m3(x / x_s), e4m3(fc_w / fc_s), e4m3(proj_w / proj_s)  # divided in x's dtype
    one = lambda t: t.reshape(1)
    scales = kernels.fp8_scale_rows(one(x_s * fc_s), one(proj_s), one(post_s))
    parts = kernels.fp8_scale_rows(one(torch.full_like(fc_s, x_s)), one(fc_s), one(proj_w.float().norm(dim=0).amax()))
    return (x_f8, kernels.transposed(x_f8, transpose_kernel), fc_w, fc_f8, fc_f8.T.contiguous(), proj_w, proj_f8,
            proj_f8.T.contiguous(), scales, parts)


def residual_in(x: Tensor, x0: Tensor, w: BlockWeights) -> Tensor:
    """A block's residual before its sublayers: resid x + x0_w x0, where a block of no_resid_scale_blocks takes x as it
    comes (w.resid None) and one of no_x0_blocks no x0 (w.x0 None). Both given, the one expression it always was."""
    if w.resid is not None and w.x0 is not None:
        return w.resid * x + w.x0 * x0
    scaled = x if w.resid is None else w.resid * x
    return scaled if w.x0 is None else scaled + w.x0 * x0


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_fn, has_attn: bool, ve_gate: bool, long_window: bool, paired: bool,
                 fused_mlp: bool = False, fp8_mlp: bool = False, widths: tuple[int, int] | None = None,
                 native_widths: bool = False, fused_dc: bool = False, fused_qk_rope: bool = False,
                 fp8_transpose: bool = False):
        super().__init__()
        self.attn = CausalSelfAttention(cfg, attn_fn, ve_gate=ve_gate, key_offset=long_window, paired=paired,
                                        widths=widths, native_widths=native_widths, fused_dc=fused_dc,
                                        fused_qk_rope=fused_qk_rope) if has_attn else None
        self.mlp = MLP(cfg, fused=fused_mlp, fp8=fp8_mlp, fp8_transpose=fp8_transpose)
        # parallel_mlp_blocks: a second MLP of the same kind, set by GPT after every other weight is drawn
        self.parallel_mlp: MLP | None = None

    def forward(self, x: Tensor, x0: Tensor, ve: Tensor | None, w: BlockWeights, attn_in: Tensor | None,
                cu_seqlens: Tensor, max_seqlen: int, window: int, rope: tuple[Tensor, Tensor, float]) -> Tensor:
        """attn_in: the attention's normed input when it is not this block's own (parallel attention inputs)."""
        # x0 and the n-gram embedding join after the attention, which reads the (weighted) residual alone: ANVIL2's
        # order (#92; its train_gpt.py in records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-*.txt @fd1b14a5,
        # ~148k characters in), the public line's since #73 (PR 230). Without attention, before the MLP
        if self.attn is None:
            x = residual_in(x, x0, w)  # learned mix with the embedding stream x0
            if w.bigram is not None:  # this block's weighted bigram hash embedding (see bigram_indices)
                x = x + w.bigram
        else:
            x = x if w.resid is None else w.resid * x
            y = self.attn(norm(x) if attn_in is None else attn_in, ve, w, cu_seqlens, max_seqlen, window, rope)
            x = x + w.attn_out * y
            x = x if w.x0 is None else x + w.x0 * x0
            x = x if w.bigram is None else x + w.bigram
        h = norm(x)  # with parallel_mlp both MLPs read it (ANVIL2's `normed`), their outputs summed under one weight
        out = self.mlp(h) if self.parallel_mlp is None else self.mlp(h) + self.parallel_mlp(h)
        return w.mlp_resid * x + w.mlp_out * out


class SkippedBlock(nn.Module):
    """A block removed (skip_layers; the public record ANVIL2, #92, removes block 7 of 11): no attention, no MLP, no
    parameters of its own, but its residual weights and its gated x0 injection stay, as in ANVIL2 ("residual
    structure (resid lambdas, x0 ...) intact"; no bigram injection there); no_x0_blocks and no_resid_scale_blocks
    may take its x0 injection and residual weight too (residual_in). It holds the block's place in GPT.blocks:
    every other block keeps its index, name and checkpoint keys."""
    attn = mlp = parallel_mlp = None

    def forward(self, x: Tensor, x0: Tensor, w: BlockWeights) -> Tensor:
        return w.mlp_resid * residual_in(x, x0, w)


COPY_DIM = 128  # CPLM's pointer: the width of its query and key
MUDD_DIM, MUDD_COEFS = 64, 16  # MUDD: each MLP's hidden width, and its outputs (14 and 5 used, 16 for even shards)
# What MUDD's per-token weights multiply, in order, with their values at the start (the public master's). MLP 0,
# before the last block: the value channel's x0, backout and x; the residual's x0, backout and own weight - 1; the
# value embedding's gate for the first and the second half of the heads; then the last block's own weights
# (BlockWeights): the residual, the attention output, x0, the bigram, the residual around the MLP, the MLP output.
MUDD_BEFORE_LAST = dict(value_x0=0, value_backout=0, value_x=0, x0=0, backout=0, own=0, ve_gate_first=2,
                        ve_gate_second=2, resid=math.sqrt(1.1), attn_out=1, block_x0=0, bigram=0.05,
                        mlp_resid=math.sqrt(1.1), mlp_out=1)
# MLP 1, before the head: x0, backout, the last block's input, the first value embedding, the skip's source block
MUDD_BEFORE_HEAD = dict(x0=0, backout=0, last_input=0, value_embed=0, skip=0)
MUDD_INIT = (tuple(MUDD_BEFORE_LAST.values()), tuple(MUDD_BEFORE_HEAD.values()))
MUDD_SCALE = 0.1  # the MLPs' outputs are 0.1 (W2 GELU(W1 x) + b2), the public master's


def mudd_mlp(x: Tensor, w1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """The small per-token MLP of MUDD and of its gates: W2 GELU(W1 x) + b2, in x's dtype."""
    return F.linear(F.gelu(F.linear(x, w1.type_as(x))), w2.type_as(x)) + b2.type_as(x)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: ModelKernels = ModelKernels(), ngram_shard: tuple[int, int] = (0, 1)):
        """ngram_shard = (rank, world_size): this rank holds block `rank` of the n-gram table's rows cut into
        world_size equal blocks (the row-sparse Adam's sharded table; build() passes it); (0, 1) = the whole table."""
        super().__init__()
        self.cfg, self.kernels = cfg, kernels  # kernels: chosen for the device once (build(): choose_kernels)
        self.sweep_inverse = sweep_inverse(cfg.vocab_size)  # the sampled softmax's sweep (candidate_rows), a constant
        L, dim = cfg.num_layers, cfg.model_dim
        self.embed = nn.Embedding(cfg.vocab_size, dim)
        self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, dim) for _ in cfg.value_embed_blocks)
        for m in self.value_embeds:  # the untied tables start small (the 2026-02-03 record's N(0, 0.01))
            m.weight.data.mul_(0.01)
        # each block with a value embedding has its own gate, but the last: MUDD gives its gate (MUDD_BEFORE_LAST)
        self.blocks = nn.ModuleList(
            SkippedBlock() if i in cfg.skip_layers else
            Block(cfg, kernels.attn_fn, has_attn=i not in cfg.no_attn_layers, ve_gate=ve is not None and i < L - 1,
                  long_window=cfg.window_pattern[i] == "L", paired=i in cfg.paired_head_blocks,
                  fused_mlp=kernels.fused_mlp, fp8_mlp=kernels.fp8_mlp, widths=cfg.head_widths(i),
                  native_widths=kernels.attention in MIXED_WIDTHS, fused_dc=kernels.dc,
                  fused_qk_rope=kernels.qk_rope, fp8_transpose=kernels.transpose)
            for i, ve in enumerate(self.value_embed_layers()))
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rotary_min_freq, cfg.yarn_windows)
        self.lm_head_w = nn.Parameter(torch.zeros(cfg.vocab_size, dim))  # zero init (@Grad62304977)
        # All scalars in one tensor (one Adam group, one collective), laid out by scalar_layout(): per block the
        # residual mix (a, b) = (sqrt(1.1), 0) and the value mix (c, d) = (0.5, 0.5); the skip's logit (-1.5); the
        # backout weight (0.5, the 2025-10-04 record's); the smear weight (0, the 2025-09-18 record's); per block the
        # attention output's and the MLP's residual and output weights (1, sqrt(1.1), 1: the 2026-02-12 record's
        # per-sublayer init); with CPLM the pointer's query gain (1); padded to a multiple of 64 so it shards over any
        # world size <= 64. (b is unused: the MUDD gates and MUDD give x0's weight per token.) A removed block
        # (skip_layers) keeps its rows; it reads only a and the residual's weight around the MLP.
        r, n = math.sqrt(1.1), cfg.num_layers
        inits = dict(blocks=torch.tensor([r, 0.0, 0.5, 0.5]).repeat(n), skips=torch.tensor([-1.5]),
                     backout=torch.tensor([0.5]), smear=torch.zeros(1), sublayer=torch.tensor([1.0, r, 1.0]).repeat(n),
                     copy_gain=torch.ones(1))
        scalars = torch.cat([inits[name] for name, part in self.scalar_layout().items() if part.stop > part.start])
        self.scalars = nn.Parameter(F.pad(scalars, (0, -scalars.numel() % 64)))
        for m in (self.embed, *self.value_embeds):
            m.weight.data = m.weight.data.bfloat16()  # embeddings live in bf16, as in the 09/03 record
        # Bigram hash embedding (see bigram_indices): a bf16 table, zero at start as in the 2026-01-19
        # record. With bigram_sign_rows, each looked-up row is multiplied by a fixed random row of +-1
        # signs picked by another hash (2026-05-20 record, @TrianX, PR 299: the sign trick of feature
        # hashing), so two bigrams that collide on a row mostly see it with different signs.
        # Made last, so that the weights above do not depend on these fields.
        # With trigram_rows, the trigram channel's rows follow the bigram rows in the same table (ANVIL2's layout).
        # Sharded by owner (ANVIL2, 08/30/26): with ngram_shard (r, W) this rank stores only rows r R .. (r + 1) R - 1,
        # R = rows / W (check_ngram_shards), and a micro-batch reads its rows from a cache pulled from their owners
        # (pull_ngram_rows). W = 1: the shard is the whole table, read directly.
        rows = cfg.bigram_rows + cfg.trigram_rows
        check_ngram_shards(cfg.bigram_rows, cfg.trigram_rows, ngram_shard[1])
        self.ngram_rank, self.ngram_world = ngram_shard
        shard = rows // self.ngram_world
        self.bigram_embed = nn.Embedding(shard, dim, _weight=torch.zeros(shard, dim, dtype=torch.bfloat16))
        self.ngram_cache = None  # with W > 1: the micro-batch's (rows, each position's row in them), pull_ngram_rows
        self.ngram_train_cache = None  # the trainer's, refilled in place (pull_ngram_rows)
        self.ngram_plan_group = None  # ngram_plan_ahead: the group its pulls' questions go over (build makes it)
        self.ngram_plan_stream = None  # ... and the side stream they run on (made at the first plan)
        self.ngram_pull_ahead = None  # the planned pull: (key, distinct rows, places, plan_pull's answer, its event,
        #                               and the flush's plan where that micro-batch ends a table step, or None)
        signs = None
        if cfg.bigram_sign_rows:  # drawn from the seeded RNG: the same on every rank, and saved in checkpoints
            signs = (torch.randint(0, 2, (cfg.bigram_sign_rows, dim)) * 2 - 1).bfloat16()
        self.register_buffer("bigram_signs", signs)
        # the prefix-token loss' table (prefix_table), set by the trainer when a stage has that loss
        self.register_buffer("prefix_ids", None, persistent=False)
        # ngram_normalize's table (normalized_token_table), set from the GPT-2 vocabulary by set_vocabulary
        self.register_buffer("ngram_ids", None, persistent=False)
        # the token tables' gradient sums in float32 (TableLookup), attached by the trainer: keep_table_grads
        self.register_buffer("lm_head_grad_sum", None, persistent=False)
        self.token_lookups = set()
        for m in self.tables():
            m.register_buffer("grad_sum", None, persistent=False)
        self.ngram_log, self.ngram_logged = {}, 0  # the n-gram table's gradient log with ngram_sparse_adam (keep_table_grads)
        self.ngram_flush_plan = None  # the next flush's distinct rows, made before the step's last forward (plan_ngram_flush)
        self.bigram_embed.weight.sparse_grad = None  # its row-sparse gradient (flush_ngram_log)
        self.bigram_embed.weight.sparse_route = None  # a sharded table's push, planned (plan_row_push)
        # the smear gate's weights on the embedding's first gate_channels channels: zero, as the record
        self.smear_w = nn.Parameter(torch.zeros(1, cfg.gate_channels))
        # Tied embedding (2025-12-22 record, @varunneal, PR 178): while tied_embed is set, token embeddings
        # are the LM head's rows, so every position's output gradient trains them too; the training loop
        # unties it at a stage start (untie_embedding). The head then starts at N(0, 0.005) as in the
        # record, not zero: zero rows would make every embedding zero. Drawn last: the rest is unchanged.
        self.tied_embed = cfg.tied_embed_stages > 0
        if self.tied_embed:
            with torch.no_grad():
                self.lm_head_w.normal_(0, 0.005)
        # MUDD (multiway dynamic dense connections, arXiv 2502.12170; the 2026-04-22 record, @lishengping, PR 259, as
        # the public master has it): two small MLPs (dim -> 64, GELU -> MUDD_COEFS per token) whose outputs weigh
        # earlier block outputs and set the last block's own weights per token (MUDD_INIT, hidden). The second
        # layers start at zero and the biases at MUDD_INIT. Drawn last: the rest is unchanged.
        self.mudd_w1 = nn.Parameter(torch.empty(2 * MUDD_DIM, dim))
        nn.init.kaiming_uniform_(self.mudd_w1, a=math.sqrt(5))  # as the public master (nn.Linear's init)
        self.mudd_w2 = nn.Parameter(torch.zeros(2 * MUDD_COEFS, MUDD_DIM))
        self.mudd_b2 = nn.Parameter(torch.cat([F.pad(torch.tensor(b, dtype=torch.float) / MUDD_SCALE,
                                                     (0, MUDD_COEFS - len(b))) for b in MUDD_INIT]))
        self.make_mudd_gates()  # drawn after MUDD's first layer, as they were
        if cfg.doc_copy:  # PR 378's tables, rows padded for 8 shards: an embedding per bucket (zero), and the gains:
            # one per bucket (zero), then the two sites' (0.5 before the embedding's norm, 1 before the final norm)
            buckets = DOC_COPY_BUCKETS + -DOC_COPY_BUCKETS % 8
            self.doc_copy_embed = nn.Parameter(torch.zeros(buckets, dim))
            self.doc_copy_gains = nn.Parameter(torch.cat([torch.zeros(buckets), torch.tensor([0.5, 1.0]),
                                                          torch.zeros(6)]))
        # the trainer's matches come from outside the model's graph, found a micro-batch ahead (plan_copy_ahead) by
        # copy_matcher (build compiles it), on a side stream made at the first plan
        self.copy_matcher, self.copy_stream, self.copy_ahead = doc_copy_candidates, None, None
        # CPLM's pointer (copy_pointer): query and key projections of the final state, N(0, 1/dim) (uniform), and the
        # sink's key, N(0, 1/COPY_DIM), as in PR 379; its query gain (1 at the start) is a scalar. Drawn last.
        if cfg.cplm_bands:
            bound = math.sqrt(3 / dim)
            self.copy_qk = nn.Parameter(torch.empty(2 * COPY_DIM, dim).uniform_(-bound, bound))
            self.copy_sink = nn.Parameter(torch.randn(COPY_DIM) / math.sqrt(COPY_DIM))
        # parallel_mlp_blocks (ANVIL2's second MLP in block 8): an MLP as the block's own, same kernels, its input
        # matrix drawn as theirs and its output matrix zero, so the block computes what it did without it until the
        # first update. Drawn after everything else: every other weight is the one drawn without it at that seed.
        for i in cfg.parallel_mlp_blocks:
            self.blocks[i].parallel_mlp = MLP(cfg, fused=kernels.fused_mlp, fp8=kernels.fp8_mlp,
                                              fp8_transpose=kernels.transpose)

    def make_mudd_gates(self):
        """MUDD gates (the 2026-05-27 record, PR 315): two more small MLPs of MUDD's form, one from x0 and one from the
        input of the block after the first long-window block (gate_layout), give per token the x0 and bigram weights
        of the blocks before the last, XSA's strengths in xsa_blocks, a linear weight per head of the long-window
        blocks' outputs (instead of the 09/03 record's sigmoid head gates), the skip's weight and DC attention's
        weights. The last entry of the biases is the outputs' common scale (learned, 0.1 at start)."""
        cfg, dim = self.cfg, self.cfg.model_dim
        self.gate_split = cfg.window_pattern.index("L") + 1  # the master's: gate 0 for blocks 0-3, gate 1 from 4 on
        self.gate_parts = self.gate_layout()  # built once: the forward reads it, the compiler sees constants
        width = max(sum(n for _, _, n, _ in part) for part in self.gate_parts)
        self.gate_width = width + -width % 8  # padded: every gate tensor's rows shard over 8 ranks
        self.mudd_gate_w1 = nn.Parameter(torch.empty(2 * MUDD_DIM, dim))
        nn.init.kaiming_uniform_(self.mudd_gate_w1, a=math.sqrt(5))
        self.mudd_gate_w2 = nn.Parameter(torch.zeros(2 * self.gate_width, MUDD_DIM))
        b2 = torch.zeros(2 * self.gate_width + 8)
        for j, part in enumerate(self.gate_parts):
            start = j * self.gate_width
            for _, _, n, init in part:
                b2[start: start + n], start = init / MUDD_SCALE, start + n
        b2[-8] = MUDD_SCALE
        self.mudd_gate_b2 = nn.Parameter(b2)

    def scalar_layout(self) -> dict[str, slice]:
        """Where each kind of scalar lies in self.scalars (the features that are off take no room)."""
        cfg, L = self.cfg, self.cfg.num_layers
        sizes = dict(blocks=4 * L, skips=1, backout=1, smear=1, sublayer=3 * L,
                     copy_gain=1 if cfg.cplm_bands else 0)
        layout, start = {}, 0
        for name, n in sizes.items():
            layout[name], start = slice(start, start + n), start + n
        return layout

    def gate_layout(self) -> tuple[list[tuple[str, int, int, float]], list[tuple[str, int, int, float]]]:
        """The MUDD gates' outputs, (what, block, width, value at the start) in order, of the gate from x0 (the
        blocks up to the first long-window one) and of the gate from the next block's input (the later blocks, then
        the skip's weight and DC's). The last block's x0 and bigram weights are MUDD's own (MUDD_INIT)."""
        cfg, H = self.cfg, self.cfg.num_heads
        parts = ([], [])
        for i in range(cfg.num_layers):
            part = parts[int(i >= self.gate_split)]
            if i in cfg.xsa_blocks:
                part.append(("xsa", i, H, 0.0))
            if cfg.window_pattern[i] == "L" and i not in cfg.no_attn_layers:
                part.append(("out", i, H, 0.25))
            # a removed block (skip_layers) takes x0's weight, not the bigram's; no_x0_blocks and no_ngram_blocks
            # take neither output they name (ANVIL2's _NOINJ_X0 / _NOINJ_BG, and its layer 6)
            if i < cfg.num_layers - 1 and i not in cfg.no_x0_blocks:
                part.append(("x0", i, 1, 0.0))
            if i < cfg.num_layers - 1 and i not in cfg.skip_layers and i not in cfg.no_ngram_blocks:
                part.append(("bigram", i, 1, 0.05))
        parts[1].append(("skip", cfg.skip_target, 1, 0.5))
        if cfg.dc_attention:  # DC attention's w1 (1 at the start) and w2 (0: no correction at the start)
            parts[1].extend([("dc1", cfg.num_layers - 1, H, 1.0), ("dc2", cfg.num_layers - 1, H, 0.0)])
        return parts

    def gates(self, x: Tensor, j: int, into: dict[str, list]) -> None:
        """Gate MLP j's per-token weights from x, (T, width) each, stored into[what][block] (gate_layout)."""
        rows = slice(j * self.gate_width, (j + 1) * self.gate_width)
        out = mudd_mlp(x, self.mudd_gate_w1[j * MUDD_DIM: (j + 1) * MUDD_DIM], self.mudd_gate_w2[rows],
                       self.mudd_gate_b2[rows])
        out, start = self.mudd_gate_b2[-8].type_as(x) * out, 0
        for what, i, n, _ in self.gate_parts[j]:
            into[what][i], start = out[:, start: start + n], start + n

    def tables(self) -> list[nn.Embedding]:
        """The token tables looked up by index: the token embedding, the value embeddings, the bigram table."""
        return [self.embed, *self.value_embeds, self.bigram_embed]

    def keep_table_grads(self, ngram_positions: int = 0, segment=None):
        """Training from here on sums the token tables' gradients in float32 buffers (TableLookup), the LM
        head's too for its lookups while tied; flush_table_grads hands the sums to the optimizer. With
        ngram_positions (ngram_sparse_adam), the n-gram table instead logs its looked-up rows and their gradients,
        room for that many lookups to start with (reserve_ngram_log grows it), summed per row at the flush by
        `segment` (segment_sum or its compiled twin: build)."""
        self.lm_head_grad_sum = torch.zeros_like(self.lm_head_w, dtype=torch.float32)
        for m in self.tables():  # not the row-logged n-gram table: a float32 sum of its shape would be twice its
            # bf16 bytes, made and dropped (65 GB at 21M rows, on top of the table's 32.5 GB)
            logged = ngram_positions and m is self.bigram_embed
            m.grad_sum = None if logged else torch.zeros_like(m.weight, dtype=torch.float32)
        if ngram_positions:
            w = self.bigram_embed.weight
            self.ngram_log = dict(rows=torch.zeros(ngram_positions, dtype=torch.long, device=w.device),
                                  grads=w.new_zeros(ngram_positions, w.size(1)),
                                  used=torch.zeros((), dtype=torch.long, device=w.device))
            self.ngram_logged = 0  # the log's positions in use, counted on the host (the compiled graph reads none)
            self.ngram_segment_sum = segment or segment_sum

    def reserve_ngram_log(self, tokens: int):
        """Before a training micro-batch of `tokens` tokens (the trainer's, outside the compiled graph): make room for
        its n-gram lookups in the log, doubling it when full (a warm-up's run of steps without an Adam step)."""
        log = self.ngram_log
        if not log:
            return
        self.ngram_logged += tokens * (2 if self.cfg.trigram_rows else 1)
        if self.ngram_logged > log["rows"].numel():
            n = max(self.ngram_logged, 2 * log["rows"].numel())
            log["rows"] = torch.cat([log["rows"], log["rows"].new_zeros(n - log["rows"].numel())])
            log["grads"] = torch.cat([log["grads"], log["grads"].new_zeros(n - log["grads"].size(0), log["grads"].size(1))])

    def plan_ngram_flush(self, inputs: Tensor, cu_seqlens: Tensor):
        """Before an Adam step's last training micro-batch (the trainer's, after reserve_ngram_log for it): the
        flush's distinct rows and each logged position's place among them, from the log so far and this micro-batch's
        rows, which its forward appends as they are. torch.unique waits for the GPU (its output size): here it waits
        for the micro-batches before this one, and the host then queues this one's forward and backward and the
        optimizers' work while the GPU runs it; at the flush it would wait for all of them and leave the GPU idle while
        the host queues the optimizers. The same rows and order as the flush's own unique. A sharded table's push to
        the owners is planned here too (plan_row_push), with its own syncs."""
        if not self.ngram_log:
            return
        rows = self.ngram_indices(inputs, cu_seqlens)[0]
        self.ngram_flush_plan = (*self.flush_plan(self.logged_with(rows)), None)

    def logged_with(self, rows: Tensor, *later: Tensor) -> Tensor:
        """The log as it will be once the latest reserved micro-batch's forward has written its `rows` (the log before
        them, then them), followed by `later` micro-batches' rows, not reserved yet."""
        return torch.cat([self.ngram_log["rows"][: self.ngram_logged - rows.numel()], rows, *later])

    def flush_plan(self, logged: Tensor, group=None) -> tuple:
        """A flush's plan for a log of these rows: (its positions, distinct rows, each position's place among them,
        the owners' route of a sharded table, plan_row_push over `group`)."""
        distinct, inverse = torch.unique(logged, return_inverse=True)
        route = None if self.ngram_world == 1 else plan_row_push(distinct, self.bigram_embed.weight.size(0),
                                                                 self.ngram_rank, self.ngram_world, group)
        return logged.numel(), distinct, inverse, route

    def flush_ngram_log(self):
        """The log since the last flush as the n-gram table's row-sparse gradient, p.sparse_grad = (rows, float32
        gradient sums): its distinct looked-up rows, ascending, each with the sum of its positions' gradients (the
        rows found before the last forward where plan_ngram_flush ran for this log)."""
        log, p = self.ngram_log, self.bigram_embed.weight
        n, self.ngram_logged = self.ngram_logged, 0
        plan, self.ngram_flush_plan = self.ngram_flush_plan, None
        log["used"].zero_()
        if plan and plan[0] == n:
            take_side_work(plan[4], plan[1], plan[2], *(plan[3] or ())[2:])
        rows, inverse, p.sparse_route = (plan[1:4] if plan and plan[0] == n else
                                         (*torch.unique(log["rows"][:n], return_inverse=True), None))
        p.sparse_grad = (rows, self.ngram_segment_sum(inverse, log["grads"][:n], rows.numel()))
        self.token_lookups = set()  # which of lm_head_w and embed.weight served the token lookups since the flush

    def note_token_lookups(self):
        """Called once per training step (the trainer's, outside the compiled graph): the table its lookups read."""
        self.token_lookups.add("lm_head_w" if self.tied_embed else "embed")

    def zero_table_grads(self):
        for grad_sum in (self.lm_head_grad_sum, *(m.grad_sum for m in self.tables())):
            if grad_sum is not None:
                grad_sum.zero_()
        if self.ngram_log:
            self.ngram_log["used"].zero_()
            self.ngram_logged = 0
        self.ngram_flush_plan = None
        self.bigram_embed.weight.sparse_grad = self.bigram_embed.weight.sparse_route = None
        self.token_lookups = set()

    def flush_table_grads(self, tables: bool = True):
        """The sums since the last flush into the tables' .grad (added to what autograd left there: the LM head's
        own gradient), then zeroed. A table not looked up since (the token embedding while tied, the head once
        untied) gets none from here, as with autograd. tables False (an Adam step without the tables' step,
        table_adam_every): the value-embedding and n-gram tables' sums and log keep summing, and get no .grad."""
        used = [(self.lm_head_w, self.lm_head_grad_sum)] if "lm_head_w" in self.token_lookups else []
        used += [(self.embed.weight, self.embed.grad_sum)] if "embed" in self.token_lookups else []
        used += [(m.weight, m.grad_sum) for m in self.tables()[1:]] if tables else []
        self.token_lookups = set()
        if self.ngram_log and tables:
            self.flush_ngram_log()
        for p, grad_sum in used:
            if grad_sum is None:
                continue
            p.grad = grad_sum.to(p.dtype, copy=True) if p.grad is None else p.grad.add_(grad_sum)
            grad_sum.zero_()

    def value_embed_layers(self) -> list[int | None]:
        """Which value-embedding table each block uses: one table each on value_embed_blocks, none elsewhere."""
        blocks = self.cfg.value_embed_blocks
        return [blocks.index(i) if i in blocks else None for i in range(self.cfg.num_layers)]

    def block_windows(self, windows: tuple[int, ...]) -> list[int]:
        """Each block's left attention window in tokens, from the stage's (long, short) windows and
        window_pattern (the record's: S,S,S,L,S,S,S,S,S,S,L)."""
        return [windows[0] if p == "L" else windows[1] for p in self.cfg.window_pattern]

    def embeddings(self, inputs: Tensor, cu_seqlens: Tensor, copy_match: tuple[Tensor, Tensor] | None = None
                   ) -> tuple[Tensor, list[Tensor | None], Tensor, Tensor | None]:
        """The normed token embedding x0 (smeared), each block's value embedding (or None), the bigram embedding,
        and doc_copy's vector for the final norm (None without it). copy_match: doc_copy's (candidate, bucket), found
        outside (the trainer's, take_copy_match); None: found here."""
        s, at = self.scalars, self.scalar_layout()
        ids, copy = inputs, None
        if self.cfg.doc_copy:  # the candidates' embeddings in the same lookup as the tokens'
            candidate, bucket = copy_match if copy_match is not None else doc_copy_candidates(inputs, cu_seqlens)
            ids = torch.cat([inputs, candidate.clamp(min=0).to(inputs.dtype)])
        e = (lookup(ids, self.lm_head_w, self.lm_head_grad_sum).type_as(self.embed.weight) if self.tied_embed
             else lookup(ids, self.embed.weight, self.embed.grad_sum))
        T = inputs.size(0)
        x = smear(e[:T], cu_seqlens, s[at["smear"]], self.smear_w)
        if self.cfg.doc_copy:  # embed(candidate) x the bucket's gain + the bucket's embedding; nothing in bucket 0
            # the gains are looked up in float32, then cast: their gradient sums every position of a bucket, and
            # summed in bf16 such a sum stalls (at 512 in a test; bf16 keeps 8 bits)
            gains, n = self.doc_copy_gains, self.doc_copy_embed.size(0)
            live = (bucket > 0).to(x.dtype)[:, None]
            copy = live * (e[T:] * gains[bucket].type_as(x)[:, None]
                           + F.embedding(bucket, self.doc_copy_embed).type_as(x))
            x = x + gains[n].type_as(x) * copy
            copy = gains[n + 1].type_as(x) * copy
        x0 = norm(x)  # normed embedding (@Grad62304977)
        tables = {i: lookup(inputs, self.value_embeds[i].weight, self.value_embeds[i].grad_sum)  # each table once
                  for i in dict.fromkeys(self.value_embed_layers()) if i is not None}
        # one bigram lookup, added before every block with that block's weight
        return (x0, [tables.get(i) for i in self.value_embed_layers()], self.ngram_embedding(inputs, cu_seqlens),
                copy)

    def set_vocabulary(self, token_bytes: list[bytes | None]):
        """With ngram_normalize, its table of normalized ids (normalized_token_table) from the tokens' texts
        (gpt2_token_bytes). The trainer and sample.py call it before a forward; the model's shapes (--plan) do not
        need the vocabulary."""
        if self.cfg.ngram_normalize:
            self.ngram_ids = normalized_token_table(token_bytes, self.cfg.vocab_size).to(self.bigram_embed.weight.device)

    def ngram_indices(self, inputs: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor | None]:
        """Each position's n-gram table row (of the whole table), the bigram channel's then with trigram_rows the
        trigram channel's, and their sign rows (or None)."""
        cfg = self.cfg
        if cfg.ngram_normalize:  # hashed from the normalized ids
            if self.ngram_ids is None:
                raise RuntimeError("ngram_normalize: the model's table of normalized ids is not set: call "
                                   "model.set_vocabulary(gpt2_token_bytes()) before a forward, or --ngram_normalize false")
            inputs = self.ngram_ids[inputs.long()]
        rows, signs = bigram_indices(inputs, cu_seqlens, cfg.bigram_rows, cfg.bigram_sign_rows)
        if cfg.trigram_rows:
            rows3, signs3 = trigram_indices(inputs, cu_seqlens, cfg.bigram_rows, cfg.trigram_rows, cfg.bigram_sign_rows)
            rows = torch.cat([rows, rows3])
            signs = None if signs is None else torch.cat([signs, signs3])
        if cfg.ngram_spread:  # ngram_spread: each row stored at its scattered place
            rows = rows * NGRAM_SPREAD_MULT % (cfg.bigram_rows + cfg.trigram_rows)
        return rows, signs

    def ngram_embedding(self, inputs: Tensor, cu_seqlens: Tensor) -> Tensor:
        """The bigram lookup, plus with trigram_rows the trigram lookup (one gather of both channels' rows), each
        channel's row times its sign row, summed into one embedding (ANVIL2's x0_bigram). A sharded table
        (ngram_world > 1) is read from the micro-batch's row cache (pull_ngram_rows, before this forward)."""
        rows, signs = self.ngram_indices(inputs, cu_seqlens)
        table, index = self.bigram_embed.weight, rows
        if self.ngram_world > 1:  # ANVIL2, 08/30/26: the rows pulled from their owners, each position's among them
            if self.ngram_cache is None or self.ngram_cache[1].shape != rows.shape:
                raise RuntimeError("the sharded n-gram table is read from a row cache: call "
                                   "model.pull_ngram_rows(inputs, cu_seqlens) before each forward")
            table, index = self.ngram_cache
        if self.ngram_log and torch.is_grad_enabled():
            ngram = ngram_lookup(index, rows, table, self.ngram_log)
        else:
            ngram = lookup(index, table, self.bigram_embed.grad_sum)
        ngram = ngram if signs is None else ngram * self.bigram_signs[signs]
        return ngram[: inputs.size(0)] + ngram[inputs.size(0):] if self.cfg.trigram_rows else ngram

    @torch.no_grad()
    def pull_ngram_rows(self, inputs: Tensor, cu_seqlens: Tensor, training: bool = False, key=None):
        """Before a forward (the trainer's and evaluate's, outside the compiled graph; a collective: every rank pulls
        once per micro-batch): with a sharded table, its rows for this micro-batch from their owners into a compact
        cache, ngram_cache = (rows, each position's row in them). The cache has a row per position (the distinct
        rows first, the rest unused), so the compiled graph sees one shape per stage. Nothing to do on one GPU.
        training: the trainer's micro-batches refill one cache in place while their shape holds, so that a captured
        graph (GraphRunner) reads it where it was; evaluate's is made for its buffer and dropped after. key: the
        micro-batch's (step, index); where plan_pull_ahead planned it, its plan is taken (no host sync)."""
        if self.ngram_world == 1:
            return
        kept = self.ngram_train_cache if training else None
        self.ngram_cache = None  # the last micro-batch's cache is freed before this one is made
        ahead = self.ngram_pull_ahead
        if training or (ahead is not None and ahead[0] == key):  # a training pull leaves no plan behind: one of
            self.ngram_pull_ahead = None                            # another key is stale; evaluate's keeps it
        if ahead is not None and ahead[0] == key:
            _, wanted, slots, plan, done, _ = ahead
            take_side_work(done, wanted, slots, plan[2])
        else:
            wanted, slots = torch.unique(self.ngram_indices(inputs, cu_seqlens)[0], return_inverse=True)
            plan = None
        w = self.bigram_embed.weight
        if kept is None or kept[1].shape != slots.shape:
            # a leaf that asks for a gradient, as the table does: the lookup's backward (RowGradLog) then runs and logs
            kept = (w.new_empty(slots.numel(), w.size(1)).requires_grad_(), torch.empty_like(slots))
            if training:
                self.ngram_train_cache = kept
        cache, places = kept
        places.copy_(slots)
        pull_rows(w, wanted, cache[: wanted.numel()], self.ngram_rank, self.ngram_world, plan)
        self.ngram_cache = kept

    @torch.no_grad()
    def plan_pull_ahead(self, key, inputs: Tensor, cu_seqlens: Tensor, after: "torch.cuda.Event | None" = None,
                        flush: tuple | None = None):
        """ngram_plan_ahead: the pull of a later micro-batch (key: its (step, index); inputs and cu_seqlens on the
        host, pinned, or on the device) planned now, while the GPU runs this one's forward and backward: its
        distinct rows and their owners' questions (plan_pull) on a side stream and over the planning group, so the
        counts' host sync waits only for that small work, not for the main stream's queue. The rows themselves move
        at the pull, after the optimizers have stepped the table. after: the event before this micro-batch's forward,
        which the side stream waits for where it reads the main stream's tensors (not for the rest of its queue).
        flush: where that micro-batch is the last of a table step, the flush's plan too (plan_ngram_flush's, with
        plan_row_push over the planning group): (whether the log is flushed before it, this micro-batch's inputs and
        cu_seqlens on the device); the log so far, less this micro-batch's rows (whose forward may still be
        running), is the earlier forwards' (before `after`)."""
        if self.ngram_world == 1 or self.ngram_plan_group is None:
            return
        cuda = self.bigram_embed.weight.device.type == "cuda"
        side = self.ngram_plan_stream = self.ngram_plan_stream or (torch.cuda.Stream() if cuda else None)
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            device, shard_rows = self.bigram_embed.weight.device, self.bigram_embed.weight.size(0)
            if side is not None and after is not None:
                side.wait_event(after)
            inputs, cu_seqlens = (t.to(device, non_blocking=True) for t in (inputs, cu_seqlens))
            rows = self.ngram_indices(inputs, cu_seqlens)[0]
            wanted, slots = torch.unique(rows, return_inverse=True)
            plan = plan_pull(wanted, shard_rows, self.ngram_world, self.ngram_plan_group)
            flush_plan = None
            if flush is not None and self.ngram_log:
                flushed_before, now_inputs, now_cu_seqlens = flush
                # this step's flush empties the log: the next one holds that micro-batch only
                logged = rows if flushed_before else \
                    self.logged_with(self.ngram_indices(now_inputs, now_cu_seqlens)[0], rows)
                flush_plan = self.flush_plan(logged, self.ngram_plan_group)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record(side)
        self.ngram_pull_ahead = (key, wanted, slots, plan, done, flush_plan and (*flush_plan, done))

    def plans_ahead(self) -> bool:
        """Whether train_step does work of the next step's first micro-batch during this step (its `ahead`):
        ngram_plan_ahead's pull with a sharded table, doc_copy's matches."""
        return self.ngram_plan_group is not None or self.cfg.doc_copy

    @torch.no_grad()
    def plan_copy_ahead(self, key, inputs: Tensor, cu_seqlens: Tensor, after: "torch.cuda.Event | None" = None):
        """doc_copy: a later micro-batch's matches (key: its (step, index); inputs and cu_seqlens on the host, pinned,
        or on the device) found now on a side stream, while the GPU runs this micro-batch's forward and backward, so
        the matcher (a sort of ten windows a position, 1.7 ms of a 49,152-token micro-batch on an H200) leaves the
        step's path. after: the event before this forward, which the side stream waits for where it reads the main
        stream's tensors."""
        device = self.lm_head_w.device
        side = self.copy_stream = self.copy_stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None and after is not None:
                side.wait_event(after)
            candidate, bucket = self.copy_matcher(*(t.to(device, non_blocking=True) for t in (inputs, cu_seqlens)))
            done = torch.cuda.Event() if side is not None else None
            if done is not None:
                done.record(side)
        self.copy_ahead = (key, candidate, bucket, done)

    @torch.no_grad()
    def take_copy_match(self, key, inputs: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """doc_copy: micro-batch `key`'s (candidate, bucket), plan_copy_ahead's where it found them (the stream waits
        for them), else found now; a plan of another key is stale and dropped."""
        ahead, self.copy_ahead = self.copy_ahead, None
        if ahead is not None and ahead[0] == key:
            take_side_work(ahead[3], ahead[1], ahead[2])
            return ahead[1], ahead[2]
        return self.copy_matcher(inputs, cu_seqlens)

    def take_planned_flush(self, key):
        """The flush's plan that plan_pull_ahead made with the pull of micro-batch `key`, as the log's next flush's
        (train_step, before that micro-batch's forward)."""
        ahead = self.ngram_pull_ahead
        if ahead is not None and ahead[0] == key and ahead[5] is not None:
            self.ngram_flush_plan = ahead[5]

    @torch.no_grad()
    def serve_ngram_pulls(self, pulls: int):
        """A sharded table's owner answering `pulls` more pulls of the other ranks while it has nothing to ask (a
        rank with fewer validation buffers than another: evaluate)."""
        w = self.bigram_embed.weight
        for _ in range(pulls):
            pull_rows(w, torch.zeros(0, dtype=torch.long, device=w.device), w.new_empty(0, w.size(1)), self.ngram_rank,
                      self.ngram_world)

    def hidden(self, inputs: Tensor, cu_seqlens: Tensor, max_seqlen: int, windows: tuple[int, int],
               copy_match: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """The final normed hidden state of every position (before the LM head); copy_match: embeddings'."""
        cfg, L = self.cfg, self.cfg.num_layers
        s, at = self.scalars, self.scalar_layout()
        own = s[at["blocks"]].view(L, 4)  # per block: the residual's weight, (unused), the value mix's two
        sub = s[at["sublayer"]].view(L, 3)  # per block: attention output, residual around the MLP, MLP output
        x0, ves, bigram, doc_copy = self.embeddings(inputs, cu_seqlens, copy_match)
        x = x0
        # the stage's rotary tables (YaRN: by its long window; the final validation's third entry names the last
        # training stage's long window, whose tables it keeps)
        rope = self.rotary.at(windows[2] if len(windows) > 2 else windows[0])
        windows = self.block_windows(windows)
        skip_into = cfg.skip_target  # validated: after skip_from and the first long-window block
        g = {what: [None] * L for what in ("xsa", "out", "x0", "bigram", "skip", "dc1", "dc2")}  # from the MUDD gates
        self.gates(x0, 0, g)
        skip = backout = attn_in = before_last = None
        for i, block in enumerate(self.blocks):
            if i == self.gate_split:
                self.gates(x, 1, g)
            if i == skip_into:  # one skip, weighted sigmoid(l) times the gate's per-token weight
                x = x + (torch.sigmoid(s[at["skips"]][0]) * g["skip"][i]) * skip
            # no_resid_scale_blocks: the residual unscaled (ANVIL2's layer 6); no_x0_blocks leave g["x0"][i] None
            resid = None if i in cfg.no_resid_scale_blocks else own[i, 0]
            if i in cfg.skip_layers:  # removed (SkippedBlock): its residual weights and x0 injection only
                x = block(x, x0, BlockWeights(resid, g["x0"][i], *sub[i], own[i, 2:]))
            else:
                if i < L - 1:
                    weighted = None if i in cfg.no_ngram_blocks else g["bigram"][i] * bigram
                    if i == 0 and weighted is not None:
                        # ANVIL2's stream starts as x0 + block 0's n-gram term, which block 0's attention reads
                        # ("pre-layer-0 bigram injection", its train_gpt.py ~140k characters in)
                        x, weighted = x + weighted, None
                    w = BlockWeights(resid, g["x0"][i], *sub[i], own[i, 2:], weighted, g["xsa"][i], g["out"][i])
                else:
                    before_last = x
                    x, w = self.mudd_before_last(x, x0, backout, bigram, own[i, 2:], g, i)
                x = block(x, x0, ves[i], w, attn_in, cu_seqlens, max_seqlen, windows[i], rope)
            if i == cfg.skip_from:
                skip = x
            if i == cfg.backout_layer:
                backout = x
                # Parallel attention inputs (2026-02-12 record's parallel residuals, PR 230, as the 2026-03-06
                # record simplified them): every later block's attention reads this output, normed once, while
                # its MLP reads the current residual; the public master's layers 8-10 read layer 7's
                attn_in = norm(x)
        # MUDD before the head: x0, block backout_layer's output, the last block's input, the first value embedding
        # and the skip's source block's output
        c = self.mudd_coefs(x, 1, MUDD_BEFORE_HEAD)
        x = (x + c["x0"] * x0 + c["backout"] * backout + c["last_input"] * before_last
             + c["value_embed"] * ves[cfg.value_embed_blocks[0]].type_as(x) + c["skip"] * skip)
        # Backout (2025-10-04 record, @snimu, @classiclarryd; PRs 138, 140): the early blocks write much that later
        # blocks need as context but the prediction does not; a learned multiple of the residual after block
        # backout_layer is taken out before the final norm and the head: the output of the block after the
        # attention-less one (block 8 of 12 on 10/04/25, block 7 of 11 now).
        x = x - s[at["backout"]][0] * backout
        return norm(x if doc_copy is None else x + doc_copy)  # doc_copy's second site: before the final norm

    def mudd_before_last(self, x: Tensor, x0: Tensor, backout: Tensor, bigram: Tensor, value_mix: Tensor,
                         g: dict[str, list], i: int) -> tuple[Tensor, BlockWeights]:
        """MUDD before the last block, over x0, block backout_layer's output and x itself: one mix joins the last
        block's attention values, another recombines the residual, and the block's own weights and value-embedding
        gate come per token (MUDD_BEFORE_LAST). Returns the new residual and the last block's weights."""
        c = self.mudd_coefs(x, 0, MUDD_BEFORE_LAST)
        value = c["value_x0"] * x0 + c["value_backout"] * backout + c["value_x"] * x
        x = (1 + c["own"]) * x + c["x0"] * x0 + c["backout"] * backout
        half = self.cfg.num_heads // 2
        ve_gate = torch.cat([c["ve_gate_first"].expand(-1, half),
                             c["ve_gate_second"].expand(-1, self.cfg.num_heads - half)], dim=-1)
        return x, BlockWeights(c["resid"], c["block_x0"], c["attn_out"], c["mlp_resid"], c["mlp_out"], value_mix,
                               c["bigram"] * bigram, g["xsa"][i], g["out"][i], ve_gate, value,
                               (g["dc1"][i], g["dc2"][i]) if self.cfg.dc_attention else None)

    def mudd_coefs(self, x: Tensor, j: int, names: dict) -> dict[str, Tensor]:
        """MUDD MLP j's per-token weights by name, (T, 1) each: MUDD_SCALE (W2 GELU(W1 x) + b2), as the public
        master."""
        rows = slice(j * MUDD_COEFS, j * MUDD_COEFS + len(names))
        out = mudd_mlp(x, self.mudd_w1[j * MUDD_DIM: (j + 1) * MUDD_DIM], self.mudd_w2[rows], self.mudd_b2[rows])
        return dict(zip(names, (MUDD_SCALE * out).split(1, dim=-1)))

    def softcap(self, logits: Tensor) -> Tensor:
        """Logit soft-cap: bounded logits, smoother early training (tanh cap of Gemma 2 brought in by
        @Grad62304977, lowered by @KoszarskyB, written as a shifted sigmoid by @YouJiacheng). The
        values lie in (0, logit_softcap) for any softcap_shift."""
        z = logits.float()
        if self.cfg.softcap_shift:
            # Asymmetric softcap (2025-12-26 record, @classiclarryd, PR 181: 23 * sigmoid((z + 5) / 7.5)).
            # A zero logit still maps to ~15, as under 30 * sigmoid(z / 7.5), but the room above it
            # shrinks from 15 to 8 while the room below stays 15: high logits are capped harder.
            z = z + self.cfg.softcap_shift
        return self.cfg.logit_softcap * torch.sigmoid(z / self.cfg.softcap_temp)

    def next_token_logits(self, inputs: Tensor, cu_seqlens: Tensor, max_seqlen: int, windows: tuple[int, int]) -> Tensor:
        """Soft-capped logits at the last position (for sampling; bf16 head)."""
        x = self.hidden(inputs, cu_seqlens, max_seqlen, windows)[-1:]
        logits = self.softcap(F.linear(x, self.lm_head_w.type_as(x)))[0]
        if self.cfg.cplm_bands:  # the copy column is no token (sampling here leaves CPLM's pointer out)
            logits[self.cfg.bos_id + 1] = float("-inf")
        return logits

    def copy_pointer(self, x: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """CPLM's pointer (copy-pointer language model, @NathanGodey, PR 379 of the public line): one head over the
        final states x, q = g norm(W_q x), k = norm(W_k x), scores q.k / sqrt(COPY_DIM), attends over the earlier
        positions of the same document in the query's band of `band` tokens and the one before it (the stage's
        cplm_bands entry), plus a learned sink key. Returns, per position, the probability it gives the target, summed
        over earlier positions holding that token (p_copy), and the sink's share (a_sink). On a GPU through
        kernels.copy_pointer; elsewhere written out (pointer_written_out), bands of queries one at a time in
        evaluation."""
        cfg, d = self.cfg, COPY_DIM
        band = cfg.cplm_bands[0 if self.training else 1]
        gain = self.scalars[self.scalar_layout()["copy_gain"]][0]
        q = (norm(F.linear(x, self.copy_qk[:d].type_as(x))) * gain).float() / math.sqrt(d)
        k = norm(F.linear(x, self.copy_qk[d:].type_as(x))).float()
        sink, doc = q @ self.copy_sink.float(), document_ids(cu_seqlens, x.size(0))
        if self.kernels.pointer:  # the flash-style kernels of kernels.py: no (T, 2 band) scores in memory
            start = cu_seqlens[doc - 1].int()  # each position's document start
            p_copy, a_sink, _ = torch.ops.speedrun.copy_pointer(q, k, sink, start, inputs.int(), targets.int(), band)
            return p_copy, a_sink
        return pointer_written_out(q, k, sink, doc, inputs, targets, band, chunked=not self.training)

    def head_losses(self, x: Tensor, targets: Tensor, mtp_weights: Tensor | None = None,
                    cu_seqlens: Tensor | None = None, prefix_weight: Tensor | None = None,
                    copy: tuple[Tensor, Tensor] | None = None, sampled: tuple[int, Tensor] | None = None) -> Tensor:
        """Cross-entropy of every position of the final hidden state x against its target; with
        mtp_weights (w_2, w_3, ...), plus multi-token prediction's sum_k w_k * CE(logits_t, token t+k)
        over the targets of t's document (mtp_targets); with prefix_weight (one value), plus that times
        CE(logits_t, the prefix token of t's target) where it has one (prefix_ids); all from the same logits.
        With copy = (p_copy, a_sink) (copy_pointer), the next-token term is CPLM's: -log of the mixture
        p_lm(y) (1 - alpha (1 - a_sink)) / (1 - alpha) + alpha p_copy(y), alpha the softmax's share of the copy
        column bos_id + 1 (a padding row no token uses), as PR 379. With sampled = (count, offset), in training, the
        softmax runs over `count` rows of the head (sampled_head): every target above and the copy column, and rows
        of a sweep over the vocabulary from offset (ANVIL2's sampled softmax)."""
        cfg = self.cfg
        extra = [] if mtp_weights is None else [(y, torch.where(keep, mtp_weights[j], 0)) for j, (y, keep) in
                                                 enumerate(mtp_targets(targets, cu_seqlens, mtp_weights.size(0)))]
        if prefix_weight is not None:
            prefix = self.prefix_ids[targets]
            extra.append((prefix.clamp(min=0), torch.where(prefix >= 0, prefix_weight[0], 0)))
        head, column = self.lm_head_w, cfg.bos_id + 1  # the head's rows, and the copy column's among them
        if sampled is not None:  # the candidates' rows only, every target and the copy column as its place among them
            head, targets, extra, column = sampled_head(head, targets, extra, column if copy is not None else None,
                                                        *sampled, self.sweep_inverse)
        if self.kernels.fused_ce and self.training:
            # every target of a token in one pass over its logits: (T, K) targets, (T, K) weights; with CPLM, the
            # next token's term and the copy column's (the last target) go into the mixture instead, at weight 0
            ys = torch.stack([targets, *(y for y, _ in extra)], 1)
            ws = torch.stack([torch.ones_like(targets, dtype=torch.float32), *(w for _, w in extra)], 1)
            if copy is not None:
                columns = torch.full_like(targets, column) if isinstance(column, int) else column
                ys = torch.cat([ys, columns[:, None]], 1)
                ws = torch.cat([torch.zeros_like(ws[:, :1]), ws[:, 1:], torch.zeros_like(ws[:, :1])], 1)
            out = torch.ops.speedrun.fp8_head_ce(x, head, ys, ws, head_x_scale(cfg.model_dim), HEAD_W_SCALE,
                                                 HEAD_GRAD_SCALE, cfg.logit_softcap, cfg.softcap_shift,
                                                 cfg.softcap_temp)
            return out[0] if copy is None else out[0] + cplm_nll(out[5][:, 0], out[5][:, -1], *copy)
        if self.kernels.fp8_head and self.training:
            logits = torch.ops.speedrun.mm_fp8(x, head, head_x_scale(cfg.model_dim), HEAD_W_SCALE, HEAD_GRAD_SCALE)[0]
        else:
            logits = F.linear(x, head.type_as(x))
        z = self.softcap(logits)
        # Cross-entropy written out so that it compiles to one pass over the (tokens x vocab) logits
        # each way: z is in (0, cap) (any shift), so exp(z) needs no max-subtraction pass, and the target
        # logit is picked by a compare instead of a gather (whose backward would be a scatter).
        vocab = torch.arange(z.size(-1), device=z.device)
        lse = z.exp().sum(-1).log()
        losses = lse - torch.where(vocab == targets[:, None], z, 0).sum(-1)
        if copy is not None:
            z_copy = z[:, column] if isinstance(column, int) else z.gather(1, column[:, None])[:, 0]
            losses = cplm_nll(losses, lse - z_copy, *copy)
        # The weights are a tensor, not Python floats: new values every step reuse the compiled graph.
        for y, w in extra:
            losses = losses + w * (lse - torch.where(vocab == y[:, None], z, 0).sum(-1))
        return losses

    # Evaluation buffers are long (262,144 tokens, as in the public validation): there the head and
    # the loss run on slices of this many positions, so the (tokens x vocab) logits never exist whole.
    eval_slice = 16384

    def forward(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, max_seqlen: int, windows: tuple[int, int],
                reduction: str = "sum", mtp_weights: Tensor | None = None,
                prefix_weight: Tensor | None = None, sampled: tuple[int, Tensor] | None = None,
                copy_match: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Summed cross-entropy of the micro-batch (reduction="none": per token). In training, mtp_weights
        and prefix_weight add multi-token prediction's and the prefix-token loss' terms, and sampled (count,
        offset) restricts the softmax to count candidates (head_losses); evaluation is always next-token only,
        over the full softmax. copy_match: doc_copy's matches found outside the graph (take_copy_match), or None."""
        x = self.hidden(inputs, cu_seqlens, max_seqlen, windows, copy_match)
        copy = self.copy_pointer(x, inputs, targets, cu_seqlens) if self.cfg.cplm_bands else None
        if self.training:
            losses = self.head_losses(x, targets, mtp_weights, cu_seqlens, prefix_weight, copy, sampled)
        else:
            n = self.eval_slice
            part = (lambda i: None) if copy is None else (lambda i: (copy[0][i: i + n], copy[1][i: i + n]))
            losses = torch.cat([self.head_losses(x[i: i + n], targets[i: i + n], copy=part(i))
                                for i in range(0, x.size(0), n)])
        return losses.sum() if reduction == "sum" else losses


# -----------------------------------------------------------------------------------------------
# Sampled softmax in training (the public record ANVIL2, modded-nanogpt records/track_1_short/2026-08-30_ANVIL2, its
# "shared-negative sampled softmax"): in the early stages each micro-batch's softmax runs over `candidates` rows of
# the head instead of all vocab_size: every target its loss reads (next token, multi-token prediction's, the prefix
# token, and CPLM's copy column), then rows taken in the order of a fixed sweep over the vocabulary that moves on from
# micro-batch to micro-batch. No correction for the rows left out (no log-Q term), as ANVIL2 trains: a bias in the
# gradient, which ANVIL2 ends by training its last ~8% of steps on the full softmax (full_softmax_from); validation
# always reads the full softmax. The head's matmuls run over the candidates' rows only, gathered (the FP8 head's
# kernels take any row count divisible by 16); rows outside them get no gradient that micro-batch.
SWEEP_STRIDE = 20011  # ANVIL2's _SNS_STRIDE: its negatives sweep k * 20011 mod 50304 (coprime: a permutation)


def sweep_inverse(vocab: int) -> int:
    """The inverse mod vocab of the sweep's stride: the first stride from SWEEP_STRIDE up coprime to vocab (20011
    itself for GPT-2's 50304), so that row k * stride mod vocab comes k-th in the sweep."""
    stride = next(s for s in itertools.count(SWEEP_STRIDE) if math.gcd(s, vocab) == 1)
    return pow(stride, -1, vocab)


def sweep_offsets(step: int, micro: int, count: int, vocab: int) -> list[int]:
    """Where each of this rank's micro-batches of a step starts in the sweep: each micro-batch a stride of about
    `count` places after the one before (step after step; the first count up coprime to vocab, so that over the
    laps every row starts a window, whatever the targets skipped in each), each rank 1/world of the vocabulary after
    the one before (ANVIL2 staggers its ranks so). A function of the step alone: a resumed run samples as an
    unbroken one."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    advance = next(a for a in itertools.count(max(count, 1)) if math.gcd(a, vocab) == 1)
    return [((step * micro + m) * advance + vocab * rank // world) % vocab for m in range(micro)]


def candidate_rows(ids: Tensor, count: int, vocab: int, offset: Tensor, inverse: int) -> tuple[Tensor, Tensor]:
    """The sampled softmax's candidates, without a host sync: (count,) rows of the head, ascending: every id in ids,
    then the others in sweep order from offset (row v's place in the sweep: v * inverse mod vocab, sweep_inverse);
    and each row's position among them, -1 for the rest (vocab,). More distinct ids than count is an error on the
    device (the loss would lose targets), as ANVIL2's "candidate overflow" is."""
    taken = torch.zeros(vocab, dtype=torch.bool, device=ids.device).index_fill_(0, ids, True)
    torch._assert_async(taken.sum() <= count, "sampled softmax: more distinct targets than candidates")
    place = (torch.arange(vocab, device=ids.device) * inverse - offset) % vocab
    rows = torch.where(taken, -1, place).topk(count, largest=False, sorted=False).indices.sort().values
    positions = torch.full((vocab,), -1, dtype=torch.long, device=ids.device)
    return rows, positions.index_copy_(0, rows, torch.arange(count, device=ids.device))


def sampled_head(head: Tensor, targets: Tensor, extra: list[tuple[Tensor, Tensor]], column: int | None, count: int,
                 offset: Tensor, inverse: int):
    """The head restricted to the sampled softmax's candidates (candidate_rows): their rows of the head
    (count, dim), the targets (T,) and extra's (target, weight) pairs with each target as its row's position among
    them, and CPLM's copy column (None: no CPLM) likewise, one per token (T,)."""
    ids = [targets, *(y for y, _ in extra)] + ([] if column is None else [targets.new_full((1,), column)])
    rows, positions = candidate_rows(torch.cat(ids).long(), count, head.size(0), offset, inverse)
    column = None if column is None else positions[column].expand_as(targets)
    return head[rows], positions[targets], [(positions[y], w) for y, w in extra], column


def cplm_nll(next_term: Tensor, copy_term: Tensor, p_copy: Tensor, a_sink: Tensor) -> Tensor:
    """CPLM's next-token loss (PR 379) from the head's cross-entropy terms lse - z of the next token (p_lm =
    exp(-term)) and of the copy column (alpha = exp(-term)): -log(p_lm (1 - alpha (1 - a_sink)) / (1 - alpha) +
    alpha p_copy). The pointer's sink share goes back to the head's softmax, renormalized without the copy column."""
    alpha = (-copy_term).exp()
    p_lm = (-next_term).exp() * (1 - alpha * (1 - a_sink)) / (1 - alpha).clamp_min(1e-6)
    return -(p_lm + alpha * p_copy + 1e-9).log()


# -----------------------------------------------------------------------------------------------
# Optimizers. Gradients arrive as per-rank sums (no DDP); each optimizer reduce-scatters them so
# every rank updates only its share, then all-gathers the new parameters. Summing (not averaging)
# makes world size x accumulation steps interchangeable.

def quintic_orthogonalize(G: Tensor, coefficients, safety: float = 0.0, dtype: torch.dtype | None = None) -> Tensor:
    """Approximately orthogonalize a batch of matrices (..., m, n) in bf16 (float32 on the CPU; or in dtype): scale to
    spectral norm <= 1 (by the Frobenius norm, times 1 + safety), then per (a, b, c) one step X <- aX + (bA + cA^2)X
    with A = X X^T, an odd quintic polynomial of the singular values that pushes them toward 1."""
    # float32 on the CPU (see to_device: bf16 matmuls are emulated); a test asks for the GPU's bf16 with dtype
    X = G.to(dtype) if dtype else G.bfloat16() if G.is_cuda else G.float()
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / (norm * (1 + safety) + 1e-6) if safety else X / (norm + 1e-7)
    for a, b, c in coefficients:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if transposed else X


# Muon's orthogonalization, in order of the public line: the 09/03/25 record's quintic Newton-Schulz (Keller Jordan)
# used (3.4445, -4.7750, 2.0315) at every step; Polar Express (arXiv 2505.16932; the 2025-09-29 record, PR 134) a
# different (a, b, c) at each of 5 steps, the public master's; ANVIL2's maps (below) replaced it here on 11/29/26.
# ANVIL's maps, from the public record ANVIL2 (modded-nanogpt record #92, 08/30/26, PR 360, @devenpzak; ANVIL_MAPS in
# its train_gpt.py, printed at the start of records/track_1_short/2026-08-30_ANVIL2/this_pr/*.txt): six quintics
# re-derived for its trace-normed input, which together take every singular value in [3e-3, 1/1.05] into
# [0.9951, 1.0004], small ones gaining 643x (its README). One more step than Polar Express' five.
ANVIL_MAPS = ((3.923798038567, -6.095026865488, 3.905234618423),
              (3.278126713798, -3.328923386476, 0.989127286973),
              (3.505298394150, -5.137358782410, 1.968325560615),
              (2.815058591845, -3.685181239622, 1.417196497642),
              (2.245503932403, -2.443826979899, 0.963091710461),
              (2.256537145403, -2.166840097229, 0.929501253245))
# ANVIL2 divides the input by 1.05 x the root of its Gram's trace (sqrt(tr X X^T) = the Frobenius norm) + 1e-6. That
# puts a rank-1 matrix's one singular value at 1/1.05, where the maps' basin ends: from 1.00007/1.05 on they run away
# from 1, by 1.003/1.05 past bf16's range (inf, then NaN). bf16 rounding (~2^-9) puts a rank-1 input (the smear gate's
# 1 x 12 matrix, a gate's gradient) there often (tests/test_anvil.py): an earlier version of this rule lost its loss
# to NaN at step 4-5 on a GPU. 3% more puts it 3% inside, where bf16 stays finite; the maps are flat there, so
# nothing else moves by more than the 3% of singular values below 3e-3 x the Frobenius norm.
ANVIL_SAFETY = 1.05 * 1.03 - 1


def anvil_orthogonalize(G: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """ANVIL's orthogonalization (ANVIL_MAPS): six quintic maps on the input scaled by its trace norm (ANVIL_SAFETY)."""
    return quintic_orthogonalize(G, ANVIL_MAPS, safety=ANVIL_SAFETY, dtype=dtype)


def neuron_normalize(update: Tensor, ema: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """NorMuon (arXiv 2510.05491, public record of 2025-10-24): orthogonalized updates give every neuron the same step
    size only on average; divide each neuron's slice of the update (a row, or a column when the matrix is wide: one
    statistic per index of the longer side, as the public record does) by the root of an EMA of its mean square
    (ema: the matrices' stacked moments, returned updated), then rescale each matrix's update back to its Frobenius
    norm before normalization, so the learning rate keeps its meaning."""
    u = update.float()
    side = -1 if u.size(-2) >= u.size(-1) else -2  # averaged over: the shorter side
    ema = ema.lerp(u.square().mean(dim=side, keepdim=True), 1 - beta2)
    scaled = u * ema.clamp_min(1e-10).rsqrt()
    frobenius = lambda t: t.square().sum(dim=(-2, -1), keepdim=True).sqrt()
    return scaled * (frobenius(u) / frobenius(scaled).clamp_min(1e-10)), ema


def normuon_orthogonalize(G: Tensor, ema: Tensor, beta2: float) -> tuple[Tensor, Tensor]:
    """anvil_orthogonalize and neuron_normalize as one function, so that compiled (muon_fused_normuon) a Muon group's
    orthogonalization and normalization are one graph: the normalization's dozen eager launches a group go."""
    return neuron_normalize(anvil_orthogonalize(G), ema, beta2)


def cautious_decay(updates: list[Tensor], params: list[Tensor], slow: list[Tensor], decay: float) -> list[Tensor]:
    """Each update plus decay x p where the slow rail s has p's sign (s p >= 0; ANVIL2's gate of Muon's cautious
    decay), as multi-tensor (foreach) ops: a handful of launches for a group instead of five per matrix. The mask is
    sign(s p) + 1 clamped to 1, exactly 1 where s p >= 0 and 0 where it is negative, so the sums are those of
    u + decay p (s p >= 0) bit for bit (a float32 p promotes a bf16 u as there)."""
    mask = torch._foreach_mul(slow, params)
    torch._foreach_sign_(mask)
    torch._foreach_add_(mask, 1.0)
    torch._foreach_clamp_max_(mask, 1.0)
    decayed = torch._foreach_mul(params, decay)
    torch._foreach_mul_(decayed, mask)
    return torch._foreach_add(updates, decayed)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-Schulz (Keller Jordan): SGD-Nesterov whose update is
    replaced by its nearest semi-orthogonal matrix, scaled by max(1, rows/cols)^0.5; here by ANVIL2's rule (record
    #92): ANVIL_MAPS (orthogonalize's default), and two momentum rails for one (`anvil_rails`).

    Parameters are grouped by shape. Per group, the stacked gradients are reduce-scattered, so rank r
    owns a contiguous share of the matrices: it keeps their momentum, orthogonalizes them in one
    batched orthogonalization, and updates them; then all ranks all-gather the group. Collectives run
    asynchronously, so one group's communication overlaps another's math.

    With beta2 > 0 it is NorMuon (arXiv 2510.05491, public record of 2025-10-24): see
    `normalize_neurons`. With weight_decay > 0, cautious weight decay (arXiv 2510.12402; public record
    of 2025-11-10) as ANVIL2 gates it: lr x weight_decay x p joins the update only where the slow rail has p's
    sign (the public master's: where the update has), i.e. where the gradient's long average already moves the
    entry toward zero; lr is the group's current (scheduled) lr, so the decay per step falls as lr^2. lr_mults: a
    learning-rate multiplier by parameter (default 1), applied as the shape scale is (matrices of one shape and
    multiplier share a group)."""

    def __init__(self, params, lr: float, momentum: float, rank: int = 0, world_size: int = 1,
                 orthogonalize=None, beta2: float = 0.0, weight_decay: float = 0.0,
                 lr_mults: dict[nn.Parameter, float] | None = None, slow_beta: float = 0.98, bf16_comm: bool = False,
                 normalized=None):
        if not 0 < slow_beta < 1:
            raise ValueError(f"Muon: slow_beta={slow_beta}: the slow rail needs a beta in (0, 1)")
        params, mult = list(params), (lr_mults or {}).get
        keys = sorted({(tuple(p.shape), mult(p, 1.0)) for p in params}, key=lambda k: (-math.prod(k[0]), k))
        groups = [{"params": [p for p in params if (tuple(p.shape), mult(p, 1.0)) == k], "lr_mult": k[1]} for k in keys]
        # the rails before they engage: the fast one is Muon's momentum (train_step sets both)
        defaults = dict(lr=lr, momentum=momentum, beta2=beta2, weight_decay=weight_decay, fast_beta=momentum,
                        fast_weight=1.0, slow_beta=slow_beta)
        super().__init__(groups, defaults)
        self.rank, self.world_size, self.bf16_comm = rank, world_size, bf16_comm
        self.orthogonalize = anvil_orthogonalize if orthogonalize is None else orthogonalize
        self.normalized = normalized  # normuon_orthogonalize, compiled (muon_fused_normuon), or None

    def kept(self, p: Tensor, key: str, make) -> Tensor:
        """p's state tensor `key`, made by make(p) the first time (dict.setdefault would build, and the GPU fill, a
        new one at every step only to drop it)."""
        state = self.state[p]
        if key not in state:
            state[key] = make(p)
        return state[key]

    def anvil_rails(self, group, owned: list[Tensor], fast: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
        """ANVIL's twin momentum rails (ANVIL2, record #92: `anvil_cascade` in its train_gpt.py): a fast rail (the
        momentum buffer) and a slow rail, EMAs of the gradient from zero at fast_beta and slow_beta, and their blend
        fast_weight x fast + (1 - fast_weight) x slow as the Nesterov look-ahead: the gradient lerped toward it by
        momentum, in place. Until the rails engage (fast_weight 1, fast_beta the momentum) that is Muon's momentum
        exactly, the slow rail accumulating unread. Returns the slow rails, which gate the decay."""
        slow = [self.kept(p, "slow_rail", torch.zeros_like) for p in owned]
        torch._foreach_lerp_(fast, grads, 1 - group["fast_beta"])
        torch._foreach_lerp_(slow, grads, 1 - group["slow_beta"])
        w = group["fast_weight"]
        blend = torch._foreach_lerp(slow, fast, w)  # w fast + (1 - w) slow; exactly fast at w = 1
        torch._foreach_lerp_(grads, blend, group["momentum"])
        return slow

    def normalize_neurons(self, grad: Tensor, owned: list[Tensor], beta2: float) -> Tensor:
        """The group's orthogonalized and NorMuon-normalized update (neuron_normalize) from its stacked look-ahead,
        with the matrices' second moments kept per matrix like Adam's; one compiled graph for both where build
        made one (muon_fused_normuon), else the orthogonalization's graph and the normalization's eager ops."""
        side = -1 if grad.size(-2) >= grad.size(-1) else -2  # averaged over: the shorter side
        shape = tuple(1 if d == grad.dim() + side else n for d, n in enumerate(grad.shape))[1:]
        moments = [self.kept(p, "neuron_second_moment", lambda q: q.new_zeros(shape, dtype=torch.float32))
                   for p in owned]
        ema = torch.stack(moments)
        if self.normalized is not None:
            update, ema = self.normalized(grad, ema, beta2)
        else:
            update, ema = neuron_normalize(self.orthogonalize(grad), ema, beta2)
        torch._foreach_copy_(moments, list(ema.unbind(0)))
        return update

    def _owned(self, group) -> tuple[int, int]:
        per_rank = -(-len(group["params"]) // self.world_size)  # ceil
        return per_rank, self.rank * per_rank

    def reshard(self, shards: list[dict]) -> dict:
        """This rank's state dict from the state dicts of every rank of a run on len(shards) ranks (a
        checkpoint resumed on another GPU count): a matrix's state lives whole on the rank that owned
        it, so merge them all and keep the matrices this rank owns now."""
        merged = {i: state for shard in shards for i, state in shard["state"].items()}
        owned, index = set(), 0
        for group in self.param_groups:
            per_rank, first = self._owned(group)
            owned.update(range(index + first, index + min(first + per_rank, len(group["params"]))))
            index += len(group["params"])
        return dict(state={i: s for i, s in merged.items() if i in owned}, param_groups=shards[0]["param_groups"])

    @torch.no_grad()
    def step(self):
        self.finish(self.apply_updates(self.launch_reduce()))

    # step() in three phases, so that train_step can launch both optimizers' reduce-scatters before either
    # updates anything: launch_reduce -> apply_updates (waits on one group's reduce at a time) -> finish

    @torch.no_grad()
    def launch_reduce(self) -> list:
        """Launch every group's reduce-scatter (asynchronously); returns what `apply_updates` takes."""
        W = self.world_size
        pending = []
        for group in self.param_groups:
            params = group["params"]
            per_rank, _ = self._owned(group)
            grads = torch.stack([p.grad for p in params])
            if self.bf16_comm:  # summed in bf16 on the wire, as the public master's bf16 gradients are
                grads = grads.bfloat16()
            if per_rank * W > len(params):  # pad so every rank gets the same share
                grads = torch.cat([grads, grads.new_zeros(per_rank * W - len(params), *grads.shape[1:])])
            if W > 1:
                mine = grads.new_empty(per_rank, *grads.shape[1:])
                work = dist.reduce_scatter_tensor(mine, grads, op=dist.ReduceOp.SUM, async_op=True)
            else:
                mine, work = grads, None
            pending.append((group, mine, work))
        return pending

    @torch.no_grad()
    def apply_updates(self, pending: list) -> list:
        """Per group: wait for its reduce-scatter, update this rank's share, launch its all-gather."""
        W = self.world_size
        gathers = []
        for group, grad, work in pending:
            if work is not None:
                work.wait()
            params = group["params"]
            per_rank, first = self._owned(group)
            owned = params[first: first + per_rank]
            bufs = []
            for p in owned:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            grad = grad[: len(owned)].to(params[0].dtype)  # (bf16_comm: from bf16)
            # bf16_comm: the float32 matrices this rank owns, updated here; the parameters hold their bf16 values
            exact = [self.kept(p, "exact", lambda q: q.detach().float().clone()) for p in owned] if self.bf16_comm \
                else owned
            if owned:
                # Multi-tensor (foreach) ops: one pass over all of the group's matrices, not one kernel per
                # matrix plus a stacked copy of the buffers
                grads = list(grad.unbind(0))
                slow = self.anvil_rails(group, owned, bufs, grads)  # the look-ahead, in place in the stacked grad
                update = self.normalize_neurons(grad, owned, group["beta2"]) if group["beta2"] else \
                    self.orthogonalize(grad)
                shape = owned[0].shape
                scale = max(1, shape[-2] / shape[-1]) ** 0.5 * group["lr_mult"]
                lr, decay = group["lr"], group["lr"] * group["weight_decay"]
                updates = list(update.to(owned[0].dtype).unbind(0))
                if decay:  # cautious: where the slow rail has p's sign
                    updates = cautious_decay(updates, exact, slow, decay)
                torch._foreach_add_(exact, updates, alpha=-lr * scale)
                if self.bf16_comm:  # every rank's copy, the owner's too: the bf16 value the all-gather sends
                    rounded = torch.stack(exact).bfloat16()
                    torch._foreach_copy_(owned, list(rounded.unbind(0)))
            if W > 1:
                dtype = torch.bfloat16 if self.bf16_comm else params[0].dtype
                out = torch.empty(per_rank * W, *params[0].shape, dtype=dtype, device=params[0].device)
                local = (rounded if self.bf16_comm else torch.stack(owned)) if owned else \
                    out.new_empty(0, *params[0].shape)
                if per_rank > len(owned):  # the last ranks' shares padded to every rank's (a copy only then)
                    local = torch.cat([local, out.new_zeros(per_rank - len(owned), *params[0].shape)])
                gathers.append((params, out, dist.all_gather_into_tensor(out, local, async_op=True)))
        return gathers

    @torch.no_grad()
    def finish(self, gathers: list):
        """Wait for the all-gathers: every rank gets every updated matrix."""
        for params, out, work in gathers:
            work.wait()
            torch._foreach_copy_(params, list(out[: len(params)].unbind(0)))


def adam_update(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step_size: float, decay_rate: float,
                beta1: float, beta2: float, eps: float):
    """One Adam step of p (any float dtype) with float32 moments, in place; decay_rate > 0 adds cautious
    weight decay (decay_rate = lr^2 x weight_decay). Compiled (DistAdam's `update`), the step is one fused
    pass over p, g and the moments, where eager PyTorch makes about a dozen: for the 377,280 x 768 bigram
    table about 30 GB of memory traffic a step instead of 6; the step size, a new number every step, is an
    argument of the compiled kernel, not a constant in it (see build), so nothing recompiles."""
    # Every number enters as a factor of a tensor, never as an op's scalar argument (lerp_'s weight,
    # addcmul_'s value), which the compiled graph would have to specialize on
    g = g.float()
    exp_avg.copy_(exp_avg * beta1 + g * (1 - beta1))
    exp_avg_sq.copy_(exp_avg_sq * beta2 + g * g * (1 - beta2))
    p32 = p.float()
    update = exp_avg / (exp_avg_sq.sqrt() + eps) * step_size
    # cautious: decay only entries the update already pulls toward zero. Computed even at decay_rate 0
    # (adding zeros): a Python branch on decay_rate would make the compiled graph specialize on its value
    update = update + torch.where(update * p32 > 0, p32, 0) * decay_rate
    p.copy_(p32 - update)


def segment_sum(inverse: Tensor, grads: Tensor, num_rows: int) -> Tensor:
    """grads (any float dtype) summed into num_rows float32 rows, grads[i] into row inverse[i]: the n-gram log's
    gradients per distinct row (GPT.flush_ngram_log), an owner's received ones (sum_owned_rows). Compiled (build),
    the cast happens in the scatter's own kernel, where eager PyTorch first writes a float32 copy of every logged
    row (at 1.6M lookups, 4.8 GB)."""
    return torch.zeros(num_rows, grads.size(1), device=grads.device).index_add_(0, inverse, grads.float())


def row_adam_update(p: Tensor, rows: Tensor, g: Tensor, exp_avg_sq: Tensor, decay: Tensor, step_size: float,
                    decay_rate: float, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """row_sparse_adam's arithmetic on p's `rows`: (their new values in p's dtype, their new second moments), with
    decay the second moments' factor (beta2 times the missed steps' product). Compiled (build), one pass over the
    rows, where eager PyTorch makes about a dozen over float32 copies; every number is a factor of a tensor, as in
    adam_update, so one graph serves every step and every number of rows."""
    v = exp_avg_sq[rows] * decay + g.square().mean(1) * (1 - beta2)
    p32 = p[rows].float()
    update = g / (v.sqrt() + eps)[:, None] * step_size
    update = update + torch.where(update * p32 > 0, p32, 0) * decay_rate
    return (p32 - update).to(p.dtype), v


def row_sparse_adam(p: Tensor, rows: Tensor, g: Tensor, state: dict, lr: float, beta2: float, eps: float,
                    weight_decay: float, update=row_adam_update):
    """One Adam step of the n-gram table p on its looked-up `rows` only (ascending, distinct; g their float32
    gradient sums), equal to a dense step of every row (ANVIL2's row-compacted Adam, modded-nanogpt 2026-08-30):
    beta1 = 0 and one second moment per row, v <- beta2 v + (1 - beta2) mean(g^2); update = g / (sqrt(v) + eps) x
    lr sqrt(1 - beta2^t), plus the cautious decay lr^2 x weight_decay x p where the update has p's sign. A row not
    looked up takes a zero gradient in the dense step: v <- beta2 v, update 0 and so no decay: the weights do not
    move. So a row's missed steps come down to v times the product of their beta2, applied exactly when the row is
    next looked up ("exact replay"): last_step holds each row's last step, log_beta2[j] the sum of log beta2 over
    steps 1..j (float64; any beta2 schedule). Reads and writes 2 x dim + 8 bytes of state and weights per row.
    `update` is row_adam_update or its compiled twin (DistAdam's row_update)."""
    if not state:
        state.update(step=0, exp_avg_sq=torch.zeros(p.size(0), device=p.device),
                     last_step=torch.zeros(p.size(0), dtype=torch.int32, device=p.device),
                     log_beta2=torch.zeros(1, dtype=torch.float64, device=p.device))
    state["step"] += 1
    t, logs = state["step"], state["log_beta2"]
    missed = (logs[t - 1] - logs[state["last_step"][rows].long()]).exp()  # product of beta2 over missed steps
    new, v = update(p, rows, g, state["exp_avg_sq"], missed.float() * beta2, lr * math.sqrt(1 - beta2**t),
                    lr**2 * weight_decay, beta2, eps)
    p.index_copy_(0, rows, new)
    state["exp_avg_sq"].index_copy_(0, rows, v)
    state["last_step"].index_fill_(0, rows, t)
    state["log_beta2"] = torch.cat([logs, logs[-1:] + math.log(beta2)])


# The n-gram table sharded by owner (ANVIL2, 08/30/26): its rows cut into world_size contiguous blocks of
# R = rows / world_size, rank r owning rows r R .. (r + 1) R - 1 (its parameter, its row-sparse Adam state). Rows go
# over the wire only to or from their owner, by all-to-all: a micro-batch pulls the rows it reads (pull_rows), an
# Adam step pushes the looked-up rows' gradients (push_row_grads). The table is never sent whole.

NGRAM_SPREAD_MULT = 1_000_003  # ngram_spread's multiplier: a prime, so row -> row x it mod rows is a bijection wherever
#                                it does not divide the row count; consecutive rows land ~1M apart, every block alike


def check_ngram_shards(bigram_rows: int, trigram_rows: int, world_size: int):
    """The table's rows must split into world_size equal shards: else one line naming the rows to use."""
    rows, rest = bigram_rows + trigram_rows, (bigram_rows + trigram_rows) % world_size
    if not rest:
        return
    name, n = ("trigram_rows", trigram_rows) if trigram_rows else ("bigram_rows", bigram_rows)
    fix = n - rest if n - rest >= 2 else n + world_size - rest
    raise ValueError(f"the n-gram table's {rows:,} rows (bigram_rows + trigram_rows) do not split over {world_size} "
                     f"GPUs (--ngram_sparse_adam shards it into equal blocks): use --{name} {fix}")


def owner_counts(rows: Tensor, shard_rows: int, world_size: int) -> Tensor:
    """How many of `rows` (ascending, of the whole table) each rank owns: their split sizes, in rank order."""
    return torch.bincount(rows // shard_rows, minlength=world_size)


def exchange_counts(send: Tensor, group=None) -> tuple[list[int], list[int]]:
    """Each rank's counts for every other rank swapped (one small all-to-all, one host sync): (sent, received)
    split sizes for the all-to-alls that follow."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return send.tolist(), received.tolist()


def take_side_work(done: "torch.cuda.Event | None", *tensors: Tensor):
    """Tensors a side stream made (ngram_plan_ahead), taken by the current stream: it waits for their event, and the
    caching allocator learns that it uses them. Nothing to do for tensors made on this stream (done None)."""
    if done is None:
        return
    current = torch.cuda.current_stream(tensors[0].device)
    current.wait_event(done)
    for t in tensors:
        t.record_stream(current)


def plan_pull(wanted: Tensor, shard_rows: int, world_size: int, group=None) -> tuple:
    """pull_rows' questions, before any row moves: (sent, received split sizes, the rows the other ranks ask of this
    owner). Its host sync (the counts) is the pull's only one; over its own group (ngram_plan_ahead) it can run
    ahead, beside the GPU's other work, since the rows asked do not change when the table steps."""
    sent, received = exchange_counts(owner_counts(wanted, shard_rows, world_size), group)
    asked = wanted.new_empty(sum(received))
    dist.all_to_all_single(asked, wanted, received, sent, group=group)
    return sent, received, asked


def pull_rows(table: Tensor, wanted: Tensor, out: Tensor, rank: int, world_size: int, plan: tuple | None = None):
    """The rows `wanted` (ascending, distinct, of the whole table) of a sharded table into `out`, in order: each rank
    asks every owner for its rows (ids by all-to-all), the owners read them from their shards (index_select) and
    send them back (all-to-all). Rows received per rank: the distinct rows its micro-batch reads (ANVIL2, 08/30/26).
    plan: plan_pull's answer, made before (then no host sync here)."""
    sent, received, asked = plan or plan_pull(wanted, table.size(0), world_size)
    served = table.index_select(0, asked - rank * table.size(0))
    dist.all_to_all_single(out, served, sent, received)


def push_row_grads(rows: Tensor, grads: Tensor, shard_rows: int, world_size: int,
                   route: tuple | None = None) -> tuple[tuple, list]:
    """An Adam step's gradient sums of this rank's looked-up rows (ascending, distinct, of the whole table; in the
    table's dtype, bf16 on the wire as the dense table's reduce-scatter sends) to their owners, by all-to-all after
    the counts' (the row-sparse reduce-scatter of ANVIL2, 08/30/26). Returns (the received rows, their gradients)
    and the all-to-alls to wait for; on one GPU the rows themselves and nothing to wait for. Received per rank:
    about its share of the ranks' rows, each 8 + 2 x dim bytes. With a route (plan_row_push) the counts and rows
    went over before: only the gradients go, and the received rows are None (the route has the owner's)."""
    if world_size == 1:
        return (rows, grads), []
    sent, received = route[:2] if route else exchange_counts(owner_counts(rows, shard_rows, world_size))
    got_rows, got = None if route else rows.new_empty(sum(received)), grads.new_empty(sum(received), grads.size(1))
    works = [] if route else [dist.all_to_all_single(got_rows, rows, received, sent, async_op=True)]
    works.append(dist.all_to_all_single(got, grads, received, sent, async_op=True))
    return (got_rows, got), works


def plan_row_push(rows: Tensor, shard_rows: int, rank: int, world_size: int, group=None) -> tuple:
    """push_row_grads' exchange and sum_owned_rows' unique ahead of the gradients (GPT.plan_ngram_flush, before the
    step's last forward, where their host syncs find less of the GPU's queue to wait for): (sent, received, the
    distinct rows this owner receives, minus its first row, and each received position's place among them). After
    the backward only the gradients go over the wire, by these split sizes, and are summed by these places."""
    sent, received = exchange_counts(owner_counts(rows, shard_rows, world_size), group)
    got_rows = rows.new_empty(sum(received))
    dist.all_to_all_single(got_rows, rows, received, sent, group=group)
    return sent, received, *torch.unique(got_rows - rank * shard_rows, return_inverse=True)


def sum_owned_rows(rows: Tensor | None, grads: Tensor, first_row: int, segment=segment_sum,
                   route: tuple | None = None) -> tuple[Tensor, Tensor]:
    """The pushed gradients an owner received (rows of the whole table, one list per sending rank) summed per row:
    its own rows (minus first_row: rows of its shard), distinct and ascending, and their float32 sums (segment);
    with a route (plan_row_push), its rows and places found before."""
    owned, inverse = route[2:] if route else torch.unique(rows - first_row, return_inverse=True)
    return owned, segment(inverse, grads, owned.numel())


class DistAdam(torch.optim.Optimizer):
    """Adam, its state sharded over ranks (ZeRO-1 style): each parameter is split along dim 0; rank r
    reduce-scatters the gradient, updates its slice with fp32 moments, and the slices are all-gathered
    back into the full parameter. A group's `weight_decay` (default 0: none) is cautious weight decay
    as in the 2026 records: lr^2 x weight_decay x p joins the update only where the update has p's
    sign, i.e. where Adam already moves the entry toward zero; lr is the group's current lr. `update`
    is adam_update or its compiled twin (build() passes that one when it compiles the model), as are row_update
    (row_adam_update) and segment (segment_sum) for a sparse_rows group's row-sparse Adam."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, rank: int = 0, world_size: int = 1,
                 weight_decay: float = 0.0, update=adam_update, row_update=row_adam_update, segment=segment_sum):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.rank, self.world_size, self.update = rank, world_size, update
        self.row_update, self.segment = row_update, segment
        for group in self.param_groups:
            for p in group["params"]:
                if p.size(0) % world_size and not group.get("sparse_rows"):
                    raise ValueError(f"DistAdam shards dim 0: a parameter of shape {tuple(p.shape)} "
                                     f"does not split over world_size={world_size}")

    def copy_state(self, src: nn.Parameter, dst: nn.Parameter):
        """dst continues from src's moments and step count (same shape, so the same row shard)."""
        self.state[dst] = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.state[src].items()}

    def reshard(self, shards: list[dict]) -> dict:
        """This rank's state dict from the state dicts of every rank of a run on len(shards) ranks (a
        checkpoint resumed on another GPU count): each moment's row slices joined back in rank order,
        then cut for this world size."""
        state = {}
        for i, first in shards[0]["state"].items():
            state[i] = dict(first)
            # the moments' rows; the row-sparse Adam's (the sharded n-gram table) are its second moments and last steps
            for key in ("exp_avg_sq", "last_step") if "last_step" in first else ("exp_avg", "exp_avg_sq"):
                full = torch.cat([shard["state"][i][key] for shard in shards])
                rows = full.size(0) // self.world_size
                state[i][key] = full[self.rank * rows: (self.rank + 1) * rows].clone()
        return dict(state=state, param_groups=shards[0]["param_groups"])

    def load_state_dict(self, state_dict: dict):
        """Restore exactly: torch.optim would cast the fp32 moments of bf16 parameters to bf16. Group
        settings are matched by parameter (index in the flat order), so a checkpoint grouped otherwise
        (before the value-embedding and bigram tables had a group of their own) loads too; a setting
        the checkpoint lacks keeps its current value."""
        params = [p for group in self.param_groups for p in group["params"]]
        saved_groups = {i: saved for saved in state_dict["param_groups"] for i in saved["params"]}
        first = 0
        for group in self.param_groups:
            group.update({k: v for k, v in saved_groups[first].items() if k != "params"})
            first += len(group["params"])
        self.state.clear()
        for i, saved in state_dict["state"].items():
            p = params[int(i)]
            self.state[p] = {k: v.to(p.device) if torch.is_tensor(v) else v for k, v in saved.items()}

    @torch.no_grad()
    def step(self):
        self.finish(self.apply_updates(self.launch_reduce()))

    # the three phases of step(), as Muon's (train_step interleaves the two optimizers' phases)

    @torch.no_grad()
    def launch_reduce(self) -> list:
        """Launch every parameter's reduce-scatter (asynchronously); returns what `apply_updates` takes."""
        W = self.world_size
        pending = []
        for group in self.param_groups:
            for p in group["params"]:
                if group.get("sparse_rows"):  # the sharded n-gram table: its rows' gradients to their owners
                    if getattr(p, "sparse_grad", None) is not None:  # in the table's dtype, as the dense .grad
                        rows, grads = p.sparse_grad
                        pending.append((group, p, *push_row_grads(rows, grads.to(p.dtype) if W > 1 else grads,
                                                                  p.size(0), W, getattr(p, "sparse_route", None))))
                    continue
                if p.grad is None:  # unused this step on every rank (a tied token embedding): no update
                    continue
                rows = p.size(0) // W
                if W > 1:
                    g = p.grad.new_empty(rows, *p.shape[1:])
                    pending.append((group, p, g, dist.reduce_scatter_tensor(g, p.grad, op=dist.ReduceOp.SUM, async_op=True)))
                else:
                    pending.append((group, p, p.grad, None))
        return pending

    @torch.no_grad()
    def apply_updates(self, pending: list) -> list:
        """Per parameter: wait for its reduce-scatter, update this rank's rows, launch their all-gather."""
        W, r = self.world_size, self.rank
        gathers = []
        for group, p, g, work in pending:
            if group.get("sparse_rows"):  # sharded: each owner updates its rows, nothing to gather
                for w in work:
                    w.wait()
                route, p.sparse_grad, p.sparse_route = getattr(p, "sparse_route", None), None, None
                # one GPU: the flush's; else the owner's sums, by the route's places where the push was planned
                rows, grads = sum_owned_rows(*g, r * p.size(0), self.segment, route) if W > 1 else g
                row_sparse_adam(p.data, rows, grads, self.state[p], group["lr"], group["betas"][1],
                                group["eps"], group["weight_decay"], self.row_update)
                continue
            if work is not None:
                work.wait()
            rows = p.size(0) // W
            p_slice = p[r * rows: (r + 1) * rows]
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p_slice, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p_slice, dtype=torch.float32)
            state["step"] += 1
            beta1, beta2 = group["betas"]
            t = state["step"]
            step_size = group["lr"] * math.sqrt(1 - beta2**t) / (1 - beta1**t)
            self.update(p_slice, g, state["exp_avg"], state["exp_avg_sq"], step_size,
                        group["lr"] ** 2 * group["weight_decay"], beta1, beta2, group["eps"])
            if W > 1:
                gathers.append(dist.all_gather_into_tensor(p, p_slice, async_op=True))
        return gathers

    @torch.no_grad()
    def finish(self, gathers: list):
        """Wait for the all-gathers: every rank has every updated parameter."""
        for work in gathers:
            work.wait()


# -----------------------------------------------------------------------------------------------
# Data

# Shard format: data/shards.py, one module for this file and the data tools (numpy only: they need no torch);
# logged with this file, like kernels.py. A shard is a 256 x int32 header -- magic, version, token count,
# zeros -- followed by the tokens as uint16: the format of llm.c and the public speedrun's FineWeb shards.
from data import shards as shard_format  # noqa: E402
from data.shards import ShardError, load_shard, read_shard_header, write_shard  # noqa: E402


def shard_files(pattern: str, what: str) -> list[str]:
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no {what} shards match {pattern!r}: download them with "
                                "`python data/cached_fineweb10B.py 9`, tokenize your own text with "
                                "`python data/tokenize_corpus.py`, or point --train_files/--val_files (or DATA_PATH) at them")
    return files


class TokenStream:
    """Walks the documents of a list of shards in order and cuts micro-batches ("slots") from them.

    A slot is built the way the public record's BOS finder builds a rank's buffer (2025-09-03 record,
    @varunneal and @classiclarryd): it starts at a document start (a BOS) and takes whole documents,
    each cut at `max_doc_len` tokens, the last one cut to fill the slot exactly; what a cut leaves of
    a document is dropped, and the next slot starts at the first document that begins after this
    slot's last target. Training only ever sees a document from its beginning: measured on the
    fidelity harness (bench/README.md), continuing the cut-off rest as new sequences behind a
    substituted BOS cost about half of a 0.1 val-loss gap to the public code at equal steps.
    A piece is a range [a, b) of input positions in one shard; its targets are positions a+1..b
    (the true next tokens, also after a cut at max_doc_len). A slot that a shard cannot complete is
    dropped, and the next starts at the next shard's first document. Each shard's BOS positions are
    indexed once, when it is loaded; the next shard loads in the background."""

    def __init__(self, files: list[str], bos_id: int, wrap: bool, log=print, state: dict | None = None):
        self.files, self.bos_id, self.wrap, self.log = files, bos_id, wrap, log
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._next = None
        state = state or dict(shard=0, pos=0, epoch=0)
        self.epoch = state["epoch"]
        self._open(state["shard"])
        self.pos = state["pos"]  # the next slot starts at the first document start >= pos

    def _index(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = load_shard(self.files[i])
        if tokens.size < 2:
            raise ShardError(f"{self.files[i]}: holds {tokens.size} tokens; a shard needs at least 2")
        return tokens, np.flatnonzero(tokens == self.bos_id)

    def _open(self, i: int):
        if i == getattr(self, "shard", None):
            pass  # a single shard wrapping around: already loaded
        elif self._next is not None and self._next[0] == i:
            self.tokens, self.bos = self._next[1].result()
        else:
            self.tokens, self.bos = self._index(i)
        self.shard, self.pos = i, 0
        nxt = (i + 1) % len(self.files)
        if nxt != i and (i + 1 < len(self.files) or self.wrap):
            self._next = (nxt, self._pool.submit(self._index, nxt))

    def _advance_shard(self):
        if self.shard + 1 < len(self.files):
            self._open(self.shard + 1)
        elif self.wrap:
            self.epoch += 1
            self.log(f"data: all {len(self.files)} training shards used; starting pass {self.epoch + 1} over them")
            self._open(0)
        else:
            raise EOFError(f"data: ran out of tokens at the end of {self.files[-1]}")

    def state(self) -> dict:
        return dict(shard=self.shard, pos=self.pos, epoch=self.epoch)

    def take(self, num_tokens: int, max_doc_len: int) -> list[tuple[np.ndarray, int, int]]:
        """The next slot: pieces of exactly `num_tokens` input positions in all."""
        for _ in range(2 * len(self.files) + 1):
            k = int(np.searchsorted(self.bos, self.pos))  # first document start >= pos
            pieces, room = [], num_tokens
            while room > 0 and k < self.bos.size:
                a = int(self.bos[k])
                doc_end = int(self.bos[k + 1]) if k + 1 < self.bos.size else self.tokens.size - 1
                b = min(doc_end, a + max_doc_len, a + room)
                pieces.append((self.tokens, a, b))
                room -= b - a
                k += 1
            if room == 0:
                self.pos = pieces[-1][2] + 1  # past the last target
                return pieces
            self._advance_shard()  # this shard cannot complete the slot
        raise ShardError(f"data: no shard of {self.files[0]}... holds a micro-batch of {num_tokens} tokens "
                         f"(documents from a BOS on): use longer shards or a smaller --seq_len")


def assemble(pieces, num_tokens: int, max_num_docs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack pieces into one micro-batch: inputs, targets (inputs shifted by one) and cu_seqlens, which
    has max_num_docs + 1 entries, padded with num_tokens (empty sequences) so shapes stay static."""
    if len(pieces) > max_num_docs:
        raise ValueError(f"a micro-batch of {num_tokens} tokens holds {len(pieces)} documents, more than "
                         f"max_num_docs={max_num_docs}: raise --max_num_docs, or 0 to size it from the data")
    x = np.empty(num_tokens, dtype=np.int32)
    y = np.empty(num_tokens, dtype=np.int32)
    cu = np.full(max_num_docs + 1, num_tokens, dtype=np.int32)
    o = 0
    for i, (tokens, a, b) in enumerate(pieces):
        x[o: o + b - a] = tokens[a:b]
        y[o: o + b - a] = tokens[a + 1: b + 1]
        cu[i] = o
        o += b - a
    return x, y, cu


@dataclass(frozen=True)
class BatchSpec:
    """The shape of one step's batch: its tokens, their micro-batches, the document cut and cu_seqlens' length."""
    batch_size: int  # tokens per step, all ranks
    seq_len: int  # tokens per micro-batch
    max_doc_len: int
    num_docs: int = 0  # cu_seqlens' sequences (max_num_docs); 0 until doc_slots has read the run's documents


class BatchProducer:
    """One rank's training micro-batches, step by step (CPU arrays).

    The global stream is cut into slots of seq_len tokens; a step uses the next batch_size/seq_len
    slots, and rank r's micro-step m gets slot m * world_size + r. The tokens a step sees therefore
    do not depend on how world size and accumulation split the batch. Each step takes its own
    BatchSpec, so batch size and max_doc_len may change between steps."""

    def __init__(self, files: list[str], rank: int, world_size: int, bos_id: int, state: dict | None = None,
                 log=print):
        self.rank, self.world_size = rank, world_size
        self.stream = TokenStream(files, bos_id, wrap=True, log=log, state=state)

    def step(self, spec: BatchSpec) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        num_slots = spec.batch_size // spec.seq_len
        if spec.batch_size % spec.seq_len or num_slots % self.world_size:
            raise ValueError(f"batch_size={spec.batch_size} must be seq_len={spec.seq_len} times a multiple "
                             f"of world_size={self.world_size}")
        if spec.num_docs < 1:
            raise ValueError(f"{spec}: num_docs not set; doc_slots sizes it from the data (or set --max_num_docs)")
        out = []
        for slot in range(num_slots):
            pieces = self.stream.take(spec.seq_len, spec.max_doc_len)
            if slot % self.world_size == self.rank:
                out.append(assemble(pieces, spec.seq_len, spec.num_docs))
        return out


LOADER_READ_AHEAD = 4  # steps a BatchLoader may have cut past the last one taken: its queue's 3 and one in hand


class BatchLoader:
    """A BatchProducer run ahead by a background thread: batches are pinned and copied to the device
    without blocking. `plan(step)` gives each step's BatchSpec."""

    def __init__(self, producer: BatchProducer, plan, device: torch.device, start_step: int = 0,
                 prefetch: int = LOADER_READ_AHEAD - 1):
        self.producer, self.plan, self.device = producer, plan, device
        self.state = producer.stream.state()  # stream position at the start of the next step handed out
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._ahead = None  # an item peek took from the queue, which next hands out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(start_step,), daemon=True)
        self._thread.start()

    def _produce(self, step: int):
        pin = self.device.type == "cuda"
        try:
            while not self._stop.is_set():
                spec = self.plan(step)
                micro = [tuple(torch.from_numpy(a) for a in arrays) for arrays in self.producer.step(spec)]
                if pin:
                    micro = [tuple(t.pin_memory() for t in m) for m in micro]
                item = (step, spec, micro, self.producer.stream.state())
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        pass
                step += 1
        except BaseException as e:  # hand the error to the training loop, which raises it
            self._queue.put(e)

    def _take(self):
        item, self._ahead = (self._ahead, None) if self._ahead is not None else (self._queue.get(), None)
        if isinstance(item, BaseException):
            raise item
        return item

    def next(self) -> tuple[BatchSpec, list[tuple[Tensor, Tensor, Tensor]]]:
        """This rank's micro-batches (inputs, targets, cu_seqlens) for the next step, on the device."""
        _, spec, micro, self.state = self._take()
        return spec, [tuple(t.to(self.device, non_blocking=True) for t in m) for m in micro]

    def peek(self) -> list[tuple[Tensor, Tensor, Tensor]] | None:
        """The micro-batches `next` hands out next, on the host (pinned on a GPU machine), without taking them
        (ngram_plan_ahead plans the next step's first pull from them); None where the data broke (`next` raises)."""
        if self._ahead is None:
            self._ahead = self._queue.get()
        return None if isinstance(self._ahead, BaseException) else self._ahead[2]

    def close(self):
        self._stop.set()
        self._thread.join()


def validation_batches(pattern: str, val_tokens: int, seq_len: int, bos_id: int, rank: int, world_size: int):
    """This rank's share of the fixed validation set, defined as the public speedrun defines it (so
    val losses compare with its records): the val shards read as one stream; its first val_tokens + 1
    tokens cut into buffers of seq_len inputs, each with its targets shifted by one, so each of the
    first val_tokens targets is scored exactly once. Inside a buffer a document runs from its BOS to
    the next and sees its whole context (up to the attention window); the first, partial document of
    a buffer sees its context from the buffer start only, and the last one is cut with the stream.
    cu_seqlens holds the buffer start and every BOS after it, padded to one static length for all
    buffers (the largest count, rounded up to a multiple of 128). Rank r takes buffers r, r + W, ..."""
    files = shard_files(pattern, "validation")
    if val_tokens % seq_len:
        raise ValueError(f"val_tokens={val_tokens} must be a multiple of val_seq_len={seq_len}: "
                         f"use --val_tokens {val_tokens // seq_len * seq_len or seq_len}")
    parts, have = [], 0
    for f in files:
        if have > val_tokens:
            break
        parts.append(load_shard(f))
        have += parts[-1].size
    if have < val_tokens + 1:
        raise ValueError(f"validation shards {pattern!r} hold {have} tokens, fewer than val_tokens + 1 = "
                         f"{val_tokens + 1}: use the full validation shard or lower --val_tokens")
    stream = np.concatenate(parts)[: val_tokens + 1]
    starts = []
    for i in range(val_tokens // seq_len):
        x = stream[i * seq_len: (i + 1) * seq_len]
        starts.append(np.concatenate([[0], np.flatnonzero(x[1:] == bos_id) + 1]))
    width = -(-max(s.size for s in starts) // 128) * 128 + 1
    for i in range(rank, len(starts), world_size):
        x = stream[i * seq_len: (i + 1) * seq_len + 1]
        cu = np.full(width, seq_len, dtype=np.int32)
        cu[: starts[i].size] = starts[i]
        yield torch.from_numpy(x[:-1].astype(np.int32)), torch.from_numpy(x[1:].astype(np.int32)), torch.from_numpy(cu)



def markov_chain(vocab_size: int, bos_id: int, seed: int = 0, alpha: float = 0.02, p_end: float = 1 / 200):
    """A fixed random Markov chain over the vocabulary, BOS included: from a token, BOS (end of the
    document) with probability p_end, else a Dirichlet(alpha) row; after BOS, a uniform token.
    Returns the transition matrix and its entropy rate in nats per token: the lowest loss any
    model can reach on text drawn from it."""
    rng = np.random.default_rng(seed)
    others = np.array([i for i in range(vocab_size) if i != bos_id])
    Q = np.zeros((vocab_size, vocab_size))
    Q[np.ix_(others, others)] = (1 - p_end) * rng.dirichlet(np.full(others.size, alpha), size=others.size)
    Q[others, bos_id] = p_end
    Q[bos_id, others] = 1 / others.size
    mu = np.full(vocab_size, 1 / vocab_size)
    for _ in range(2000):  # stationary distribution by power iteration
        mu = mu @ Q
    row_entropy = -np.sum(Q * np.log(np.where(Q > 0, Q, 1)), axis=1)
    return Q, float(mu @ row_entropy)


def write_markov_corpus(train_pattern: str, val_pattern: str, vocab_size: int, bos_id: int, val_tokens: int,
                        train_tokens: int = 4_000_000, seed: int = 0) -> float:
    """Write the smoke preset's corpus (one val and one train shard) unless already there; return
    its entropy floor. Deterministic: every machine writes the same bytes. A `.markov` file beside
    each shard holds its sha256, so a later run skips the work; an existing file that does not hold
    exactly the generator's tokens is never overwritten (it may be the user's data): every target is checked
    before any file is written, so a refusal leaves nothing behind."""
    Q, entropy = markov_chain(vocab_size, bos_id, seed)
    paths = [Path(val_pattern.replace("*", "000000")), Path(train_pattern.replace("*", "000001"))]
    sizes = [2 * val_tokens, train_tokens]
    markers = [path.with_name(path.name + ".markov") for path in paths]
    digest = lambda path: hashlib.sha256(path.read_bytes()).hexdigest()
    if all(m.exists() and p.exists() and m.read_text().strip() == digest(p) for p, m in zip(paths, markers)):
        return entropy
    rng = np.random.default_rng(seed + 1)
    cdf = Q.cumsum(axis=1)
    cdf[:, -1] = 1.0
    shards = []
    for n in sizes:  # both sampled, in order: the bytes never vary
        # Sample chains side by side, each starting at a BOS and cut just before its last BOS, so laid
        # end to end they are one valid realisation of the chain (no impossible transitions).
        streams = max(1, min(1024, n // 4000))
        out = np.empty((streams, -(-n // streams) + 2000), dtype=np.uint16)
        state = np.full(streams, bos_id)
        for t in range(out.shape[1]):
            out[:, t] = state
            state = (cdf[state] < rng.random(streams)[:, None]).sum(axis=1)
        tokens = np.concatenate([row[: np.flatnonzero(row == bos_id)[-1]] for row in out])[:n]
        if tokens.size < n:
            raise RuntimeError(f"Markov corpus: sampled {tokens.size} tokens, fewer than {n}")
        shards.append(tokens)
    for path, tokens in zip(paths, shards):  # every target checked before any file is written
        if path.exists():  # ours only if it holds exactly what the generator writes
            try:
                ours = np.array_equal(load_shard(path), tokens)
            except ShardError:
                ours = False
            if not ours:
                raise ValueError(f"{path} exists and was not written by the synthetic-corpus generator: refusing "
                                 "to overwrite it. Point --train_files/--val_files at a folder of their own, or "
                                 "train on the file with --markov_corpus false")
    for path, marker, tokens in zip(paths, markers, shards):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_shard(path, tokens)
        marker.write_text(digest(path) + "\n")
    return entropy


# -----------------------------------------------------------------------------------------------
# Schedule: the run as a table of stages, resolved once (Schedule); every per-step quantity (batch, windows,
# learning rate, momentum, multi-token prediction weights) is read from it.

def window_tokens(blocks: int, block: int) -> tuple[int, int]:
    """(long, short) windows in tokens from a long window in blocks: the short one is half of it,
    rounded down to a block (the 09/03 record's sliding windows)."""
    return blocks * block, blocks // 2 * block


def mtp_pairs(start: tuple[float, ...], end: tuple[float, ...]) -> tuple[tuple[float, float], ...]:
    """A stage's (start, end) multi-token prediction weights, without the trailing targets that stay
    at 0 all stage: the stage's graph computes only the targets it trains on (none: plain next-token)."""
    pairs = tuple(zip(start, end))
    while pairs and pairs[-1] == (0.0, 0.0):
        pairs = pairs[:-1]
    return pairs


class Schedule:
    """The run's schedule, built once from the hyperparameters: its stages (the table's rows, then the extension),
    each resolved to its steps, batch and windows in tokens, and every per-step quantity that the training loop,
    the data loader, the compile warm-up and --plan read: the stage of a step, its batch, the learning-rate factor,
    Muon's momentum, Adam's steps, the validation windows and the tokens trained."""

    def __init__(self, args: Hyperparameters, stages: list[Stage] | None = None):
        self.args = args
        self.stages = tuple(self.resolve(args) if stages is None else stages)
        n = args.tied_embed_stages  # the first step with the token embedding untied: the start of stage n
        self.untie = self.stages[n].start if n < len(self.stages) else math.inf  # (0: never tied; inf: always)
        self.full_softmax = round(args.full_softmax_from * args.num_iterations)  # the first step of the full softmax

    @staticmethod
    def resolve(args: Hyperparameters) -> list[Stage]:
        """The table made concrete: each row of args.stages with its resolved fields. The rows share the
        S = num_iterations - extension_steps scheduled steps in proportion to their shares (with equal shares,
        step s trains in stage floor(n * s / (S + 1)): the 2025-09-03 record's split of steps 0..S); batches and
        windows are counted in tokens; the loss weights ramp to the next row's. An extension stage, if any,
        follows at the last row's batch, loss weights and candidates, lr 1 and the longer
        extension_window (the public record line's extension, from 11/2025)."""
        rows, E = list(args.stages), args.extension_steps
        S = args.num_iterations - E
        total = sum(row.share for row in rows)
        ends = [-(-shares * (S + 1) // total) for shares in itertools.accumulate(row.share for row in rows)]
        if E:  # the extension takes over at step S and holds the last row's batch and loss weights
            last = rows[-1]
            rows.append(Stage(args.extension_window, batch=last.batch, doc_len=last.doc_len,
                              mtp=last.mtp, prefix=last.prefix, candidates=last.candidates))
            ends[-1:] = [S, S + E + 1]
        micro = args.batch_size // args.seq_len  # micro-batches per step, the same in every stage
        stages = []
        for i, (row, start, end) in enumerate(zip(rows, [0] + ends, ends)):
            following = rows[min(i + 1, len(rows) - 1)]  # the weights move to the next row's; the last holds its own
            batch = row.batch or args.batch_size
            stages.append(dataclasses.replace(
                row, start=start, end=end, spec=BatchSpec(batch, batch // micro, row.doc_len or args.max_doc_len),
                windows=window_tokens(row.window, args.window_block), mtp_ramp=mtp_pairs(row.mtp, following.mtp),
                prefix_ramp=(row.prefix, following.prefix)))
        return stages

    def stage_at(self, step: int) -> Stage:
        """The stage a step trains in (validation after the last step: the last stage)."""
        return next((st for st in self.stages if step < st.end), self.stages[-1])

    def spec_at(self, step: int) -> BatchSpec:
        """The batch a step trains on: the training loader's plan."""
        return self.stage_at(step).spec

    def tokens_before(self, step: int) -> int:
        """Training tokens of steps 0 .. step - 1 (staged batches differ in size: this is what compares runs
        at equal tokens)."""
        return sum(st.spec.batch_size * max(0, min(step, st.end) - st.start) for st in self.stages)

    def lr_factor(self, step: int, stage: Stage) -> float:
        """Both optimizers' learning rates over their base at a step of a stage: the stage's multiplier (lr),
        then a linear decay to final_lr_frac over the last cooldown_frac of the scheduled steps; final_lr_frac
        through the extension."""
        args = self.args
        x = step / (args.num_iterations - args.extension_steps)
        if x < 1 - args.cooldown_frac:
            return stage.lr
        w = max(1 - x, 0) / args.cooldown_frac
        return stage.lr * w + (1 - w) * args.final_lr_frac

    def momentum(self, step: int) -> float:
        """Muon's momentum: warmed up linearly from muon_momentum_start over muon_momentum_warmup steps, and
        cooled back down to it over the last muon_momentum_cooldown steps."""
        args = self.args
        frac = min(step / args.muon_momentum_warmup, 1) if args.muon_momentum_warmup else 1
        cooldown_start = args.num_iterations - args.muon_momentum_cooldown
        if args.muon_momentum_cooldown and step > cooldown_start:
            frac = max(1 - (step - cooldown_start) / args.muon_momentum_cooldown, 0)
        return (1 - frac) * args.muon_momentum_start + frac * args.muon_momentum

    def anvil_rails(self, step: int) -> tuple[float, float]:
        """Muon's fast rail at a step: its beta and its weight in the blend with the slow rail. Muon's
        momentum and weight 1 (the slow rail unread) until anvil_rails' fraction of num_iterations, then the fixed
        ones (ANVIL2's train_gpt.py: `step_optimizers`, `_RAIL_ENGAGE_STEP`)."""
        _, weight, beta, engage = self.args.anvil_rails
        return (beta, weight) if step >= engage * self.args.num_iterations else (self.momentum(step), 1.0)

    def adam_steps_at(self, step: int) -> bool:
        """Whether Adam steps at the end of this step (every adam_every-th, on the gradients summed since its
        last); Muon steps every step."""
        return (step + 1) % self.args.adam_every == 0

    def tables_step_at(self, step: int) -> bool:
        """Whether the value-embedding and n-gram tables' Adam steps at the end of this step (table_adam_every);
        always a step of Adam's."""
        return (step + 1) % table_adam_period(self.args, step) == 0

    def table_adam_settings(self, step: int, group: dict) -> tuple[tuple[float, float], float]:
        """A table group's Adam betas and weight decay at a step: per update of table_adam_period's, the
        equivalents of its settings per adam_every steps."""
        k = table_adam_period(self.args, step) // self.args.adam_every
        return tuple(b ** k for b in group["initial_betas"]), group["initial_weight_decay"] * k

    def candidates_at(self, step: int, stage: Stage) -> int:
        """The sampled softmax's rows at a step of a stage (or a warm-up shape): the stage's candidates before the
        step full_softmax_from of the run, 0 (the full softmax) from it on."""
        return stage.candidates if step < self.full_softmax else 0

    def val_windows(self, step: int) -> tuple[int, ...]:
        """The windows of the validation before a step: its stage's, except the final validation, whose long
        window can look further back than training did (final_val_window: the 2025-09-10 record's 13 blocks).
        Records #89 and ANVIL2 raise only the long window and keep the last stage's rotary tables (no YaRN step):
        (long, short, the long window whose rotary tables to use)."""
        args = self.args
        last = self.stage_at(min(step, args.num_iterations - 1)).windows
        if step >= args.num_iterations and args.final_val_window:
            return window_tokens(args.final_val_window, args.window_block)[0], last[1], last[0]
        return last

    def validation_graphs(self) -> dict[tuple, int]:
        """What each of the run's validations compiles, (its windows, the embedding tied), with the first step that
        validates so: steps 0, val_every, 2 val_every, ... and the final one (as the training loop validates)."""
        args, graphs = self.args, {}
        steps = range(0, args.num_iterations, args.val_every) if args.val_every > 0 else ()
        for step in (*steps, args.num_iterations):
            graphs.setdefault((self.val_windows(step), step < self.untie), step)
        return graphs

    def warmup_shapes(self) -> list[Stage]:
        """The distinct stage shapes the warm-up compiles, each as its first stage; a stage that samples the softmax
        and reaches the switch to the full one (full_softmax_from) once with its candidates, once with 0."""
        softmax = [(st, c) for st in self.stages for c in dict.fromkeys(
            ([st.candidates] if st.start < self.full_softmax else []) + ([0] if st.end > self.full_softmax else []))]
        return list({(st.spec, st.windows, len(st.mtp_ramp), any(st.prefix_ramp), st.start < self.untie, c):
                     dataclasses.replace(st, candidates=c) for st, c in softmax}.values())

    def warmup_spec_at(self, step: int) -> BatchSpec:
        """The batch of a warm-up step: warmup_steps steps of each shape in turn (the warm-up loader's plan)."""
        shapes = self.warmup_shapes()
        return shapes[min(step // self.args.warmup_steps, len(shapes) - 1)].spec

    def loader_plans(self) -> list[list[BatchSpec]]:
        """Every step's BatchSpec in the order the run's two loaders ask for them, each loader from the stream's
        start: the warm-up's (warmup_steps steps of each shape), then the timed run's; each with its read-ahead."""
        k = self.args.warmup_steps
        warm = [self.warmup_spec_at(s) for s in range(k * len(self.warmup_shapes()) + LOADER_READ_AHEAD)] if k else []
        return [warm, [self.spec_at(s) for s in range(self.args.num_iterations + LOADER_READ_AHEAD)]]

    def with_slots(self, slots: dict[tuple[int, int], int]) -> Schedule:
        """The schedule with its micro-batches' cu_seqlens length (BatchSpec.num_docs) from doc_slots."""
        return Schedule(self.args, [st.with_slots(slots) for st in self.stages])


DOC_SLOT_MULTIPLE = 16  # doc_slots rounds cu_seqlens' sequence count up to a multiple of this


def most_documents(files: list[str], bos_id: int, plans: list[list[BatchSpec]]) -> dict[tuple[int, int], int]:
    """Per (seq_len, max_doc_len): the most documents (pieces, after the cut) in any micro-batch these step
    plans cut from the training stream, each plan read from the stream's start. Only document starts are
    read, so a record run's whole stream takes seconds."""
    most = {}
    for plan in plans:
        stream = TokenStream(files, bos_id, wrap=True, log=lambda msg: None)
        for spec in plan:
            key = (spec.seq_len, spec.max_doc_len)
            for _ in range(spec.batch_size // spec.seq_len):
                most[key] = max(most.get(key, 0), len(stream.take(*key)))
    return most


def doc_slots(schedule: Schedule, files: list[str], log=lambda msg: None,
              plans: list[list[BatchSpec]] = ()) -> dict[tuple[int, int], int]:
    """cu_seqlens' sequence count per (seq_len, max_doc_len) of micro-batch (BatchSpec.num_docs, with_slots):
    --max_num_docs, or with 0 the most documents any micro-batch of this run holds (most_documents over
    the schedule's loader_plans and any extra plans), rounded up to DOC_SLOT_MULTIPLE. The data and the
    schedule fix every micro-batch, so none can hold more. Fewer empty slots are faster: FlashAttention-3's
    backward runs thread blocks for every slot, empty or not; 128 slots instead of 256 took 5.6 ms off the
    record's step at window 11 on one H100 (bench/fa3_padding.py; the public code pads to 128 at 49K tokens,
    64 at 16K)."""
    args, plans = schedule.args, schedule.loader_plans() + list(plans)
    if args.max_num_docs:
        return {(spec.seq_len, spec.max_doc_len): args.max_num_docs for plan in plans for spec in plan}
    t = time.perf_counter()
    most = most_documents(files, args.bos_id, plans)
    slots = {key: -(-n // DOC_SLOT_MULTIPLE) * DOC_SLOT_MULTIPLE for key, n in most.items()}
    log("data: cu_seqlens sized to this run's fullest micro-batches (--max_num_docs 0): "
        + "; ".join(f"{seq_len:,} tokens cut at {cut:,}: at most {most[seq_len, cut]} documents, {n} slots"
                    for (seq_len, cut), n in slots.items()) + f" (read in {time.perf_counter() - t:.1f}s)")
    return slots


def untie_embedding(model: "GPT", adam: "DistAdam"):
    """The token embedding table becomes a copy of the LM head, and continues from its Adam moments (the
    model reads it from the next step on: tie_embedding_at)."""
    with torch.no_grad():
        model.embed.weight.copy_(model.lm_head_w)
    adam.copy_state(model.lm_head_w, model.embed.weight)


def tie_embedding_at(model: "GPT", step: int, untie: float):
    """The one writer of model.tied_embed: tied for the steps before `untie` (Schedule.untie), as the graphs of
    those steps are compiled."""
    model.tied_embed = step < untie


# The schedule's cost before a run (--plan). Measured one-GPU time per token of a preset's model at a stage's shape,
# by (GPU kind, preset, micro-batch tokens per GPU, document cut, long window in blocks): each stage's mean step
# time, training steps only (as the public logs' train_time counts), from bench/step_time.py --stages (CUDA events
# around whole steps) or from train_gpt.py's own log. A table row is a real run; a shape without one is reported
# unmeasured, never interpolated. Time per token: ms per step x 1000 / tokens per step, in us.
STEP_US_PER_TOKEN = {
    # one H100 80GB HBM3, 2026-11-27, PyTorch 2.11.0+cu130, FlashAttention-3 (xformers 0.0.34), main at 46b1702 (FP8
    # MLP backward), the record's model before ANVIL2's architecture (MEASURED_MODEL): `python bench/step_time.py
    # --stages --steps 12 --preset record --attention fa3 --num_iterations 776`, each stage's mean step: 603.3 /
    # 615.3 / 624.8 / 619.7 ms per 393,216-token step (bench/results/one_session_h100_20261127c.md)
    ("H100", "record", 49152, 896, 3): 1.534,
    ("H100", "record", 49152, 2048, 7): 1.565,
    ("H100", "record", 49152, 2048, 11): 1.589,
    ("H100", "record", 49152, 2048, 13): 1.576,
    # one H200 of a one-GPU machine, alone, 2026-12-03, PyTorch 2.11.0+cu130, FlashAttention-4 (flash-attn-4
    # 4.0.0b36), the record preset at main 4d94d98 (the even n-gram split) with its defaults: `python train_gpt.py
    # --preset record --num_iterations 80 --full_softmax_from 0.65 --attention fa4 ...`, twice in a row, the second
    # with `--doc_len_schedule 896,2048,4096` (the preset's cut since), each stage's mean step from the log's stage
    # lines: stage 3's full-softmax steps 451.5 ms, the extension's 456.6 ms per 393,216-token step (at the 3,072 cut
    # 450.0 / 454.3) (bench/results/tie_h200_20261203c.md). Stages 1-2 have no full-softmax row
    ("H200", "record", 49152, 4096, 11): 1.148,
    ("H200", "record", 49152, 4096, 13): 1.161,
}
# The sampled softmax's steps (those before Schedule.full_softmax in a stage with candidates): time per token as
# STEP_US_PER_TOKEN's, keyed as it is plus the stage's candidates (the head's rows a micro-batch); a stage's full
# softmax steps are priced at its STEP_US_PER_TOKEN row.
SAMPLED_US_PER_TOKEN = {
    # the runs of STEP_US_PER_TOKEN's H200 rows (2026-12-03, main 4d94d98): stages 1-2 the mean of both runs (362.4 /
    # 361.9 and 370.0 / 369.4 ms per 393,216-token step), stage 3 the 4,096 cut's, 375.0 ms (373.4 at 3,072)
    # (bench/results/tie_h200_20261203c.md)
    ("H200", "record", 49152, 896, 3, 16384): 0.921,
    ("H200", "record", 49152, 2048, 7, 14336): 0.940,
    ("H200", "record", 49152, 4096, 11, 12288): 0.954,
}
# The record's model before ANVIL2's architecture (record #92's layout, MLP width, injection sites and order) became
# it: the fields it had then, and its injections (x0 and the n-gram term) before a block's attention, an order no
# longer built (not a field: every run differs in it). ANVIL2's architecture ran 0.825x its step on one H200 over 80
# steps (bench/results/arch_h200_20261129d.md).
BEFORE_ANVIL2 = dict(skip_layers=(), no_attn_layers=(6,), skip_into=0, xsa_blocks=(1, 3, 4, 7),
                     paired_head_blocks=(0, 2, 5, 9), value_embed_blocks=(1, 2, 8, 9, 10), parallel_mlp_blocks=(),
                     mlp_hidden=0, no_x0_blocks=(), no_ngram_blocks=(), no_resid_scale_blocks=(), narrow_qk_blocks=(),
                     narrow_v_blocks=(), doc_copy=False, tied_embed_stages=2, bigram_rows=377_280, trigram_rows=0,
                     injections="before a block's attention")
# The model a preset's rows of one GPU kind and count were timed on, where it is not the preset's present model, by
# (preset, GPU kind, GPUs): the fields it had then. 1 GPU: STEP_US_PER_TOKEN's and SAMPLED_US_PER_TOKEN's rows; more:
# MULTI_GPU_US_PER_TOKEN's. --plan names these rows as that model's.
MEASURED_MODEL = {("record", "H100", 1): BEFORE_ANVIL2, ("record", "H200", 4): BEFORE_ANVIL2}
# what --plan says of each kind's rows: the attention kernel they ran with, and where they come from
STEP_US_ATTENTION = {"H100": "FlashAttention-3", "H200": "FlashAttention-4"}
STEP_US_SOURCE = {"H100": "one H100 80GB HBM3, 2026-11-27, PyTorch 2.11.0+cu130, main at 46b1702 "
                          "(bench/results/one_session_h100_20261127c.md)",
                  "H200": "one H200 of a one-GPU machine, alone, 2026-12-03, PyTorch 2.11.0+cu130: the record preset "
                          "at main 4d94d98 with its defaults (the even n-gram split) and the 4,096-token cut, one run of "
                          "80 steps (stages 1-2: the mean of it and one at the 3,072 cut), before muon_fused_normuon "
                          "was on (bench/results/tie_h200_20261203c.md)"}
# The public master (f411b3d3, record #89's code) on its own schedule: steps and tokens per step of each stage,
# 423 / 424 / 423 steps at 131,072 / 262,144 / 393,216 tokens, then the 15-step extension at 393,216: 338,821,120
# tokens (bench/results/public_master_comparison.md rows 32-34 and 47; bench/side_by_side.py's public_stages
# computes the same boundaries from its TRAINING_STAGES).
PUBLIC_MASTER_STAGES = ((423, 131072), (424, 262144), (423, 393216), (15, 393216))
# Its ms per step at each of those stages (the mean, or the median where the source says), by GPU kind: with the
# attention kernel, the source, and how the times pair with ours of the same kind (STEP_US_PER_TOKEN), as --plan
# prints them.
PUBLIC_MASTER_STEP_MS = {
    # record #89's code in its own one-H100 logs, mean of five runs, PyTorch 2.10 / CUDA 12.8 (the public
    # records/track_1_short/2026-08-06-CanonicalMasking/ folder, quoted in bench/results/public_line.md)
    "H100": dict(ms=(229.44, 421.83, 619.35, 628.03), attention="its own FlashAttention-3",
                 source="its own logs, one H100 80GB HBM3, PyTorch 2.10 / CUDA 12.8, mean of five runs "
                        "(bench/results/public_line.md)",
                 paired="not timed with ours: another machine, another PyTorch"),
    # one H200 of a one-GPU machine, 2026-11-30, PyTorch 2.11.0+cu130, FlashAttention-4 (flash-attn-4 4.0.0b36, in
    # place of its attention by the harness's patch), in turns with the record preset before the copy feature on the
    # same machine (A B A B, bench/side_by_side.py --alternate --public_attention fa4): each stage's median step, the
    # mean of its two runs (299.0 / 292.0, 409.0 / 410.0, 605.0 / 607.0, 615.0 / 594.0 ms; its stage-3 rate, 1.541 us
    # per token, within 1.3% of its stage 2's 1.562) (bench/results/abab_graphs_h200_20261130j.md). Its stage 1 ran
    # unsteadily there, steps of 241-380 ms (the cause not found); on the machine of abab_fa4_h200_20261130e.md that
    # day, 220.5 / 414.5 / 611.0 / 615.5 (with that stage 1, R = 0.607 beside ours of 2026-12-03). With PyTorch's
    # varlen attention: 284.5 / 430.0 / 642.0 / 651.0 ms on 2026-11-29 (abab_h200_20261129h.md), 254.0 / 439.0 /
    # 658.5 / 661.0 on 2026-11-28 (bench/results/public_line_history.md)
    "H200": dict(ms=(295.5, 409.5, 606.0, 604.5), attention="FlashAttention-4",
                 source="one H200 of a one-GPU machine, 2026-11-30, PyTorch 2.11.0+cu130, stage medians, mean of two "
                        "runs (bench/results/abab_graphs_h200_20261130j.md)",
                 paired="not in one session with ours: the master on 2026-11-30 in turns with the model before the "
                        "copy feature, A B A B; ours on another one-GPU machine on 2026-12-03, same PyTorch and "
                        "attention; the master's stage 1 ran unsteadily there, steps of 241-380 ms, a median of 295.5 "
                        "against 220.5 on another machine that day; with that, R = 0.607"),
}
RECORD_89_SECONDS = 73.8  # public record #89 on 8xH100, its whole schedule
# Measured on several GPUs of one host: time per token of the whole global batch, by (GPU kind, GPUs, preset,
# micro-batch tokens per GPU, document cut, long window in blocks), as STEP_US_PER_TOKEN's one-GPU rows: the full
# softmax only (a stage with sampled steps has no multi-GPU time).
MULTI_GPU_US_PER_TOKEN = {
    # four H200s of one host (NVLink), 2026-11-28, PyTorch 2.11.0+cu130, PyTorch's varlen attention, main at 28d32b5
    # (the record's model before ANVIL2's architecture, MEASURED_MODEL): `NPROC=4 ./run.sh --preset record
    # --num_iterations 80 --attention varlen ...`, each stage's mean step: 147.0 / 157.6 / 162.4 / 165.0 ms per
    # 393,216-token step, two micro-batches a GPU, alone on the host (bench/results/x4_h200_20261128b.md)
    ("H200", 4, "record", 49152, 896, 3): 0.374,
    ("H200", 4, "record", 49152, 2048, 7): 0.401,
    ("H200", 4, "record", 49152, 2048, 11): 0.413,
    ("H200", 4, "record", 49152, 2048, 13): 0.420,
}
MULTI_GPU_SOURCE = {("H200", 4): "four H200s of one host, 2026-11-28 (bench/results/x4_h200_20261128b.md)"}
# 8-GPU step time over one-GPU step time at the same global batch, by micro-batch tokens per GPU, with one
# micro-batch per GPU on 8 (bench/README: record #89's 8xH100 logs over its and the public master's
# one-H100 times in the harness: 30.9/238.0, 57.7/435.5, 83.0/644.0 ms). No other kind has a measured ratio.
EIGHT_GPU_RATIO = {"H100": {16384: 0.130, 32768: 0.132, 49152: 0.129}}


TABLES = "STEP_US_PER_TOKEN (full softmax) / SAMPLED_US_PER_TOKEN (sampled)"  # --plan's name for its one-GPU tables


def softmax_column(stage: Stage, full_from: int, steps: int) -> str:
    """--plan's softmax column of a stage: 'full', or the sampled softmax's rows, '*' where its steps reach the
    switch to the full softmax (Schedule.full_softmax)."""
    if not stage.candidates or stage.start >= full_from:
        return "full"
    return f"{stage.candidates:,}" + ("*" if min(stage.end, steps) > full_from else "")


def plan_kinds() -> list[str]:
    """The GPU kinds --plan_gpu takes: those with rows of ours or of the public master."""
    return sorted({key[0] for key in (*STEP_US_PER_TOKEN, *SAMPLED_US_PER_TOKEN)} | set(PUBLIC_MASTER_STEP_MS))


def public_master_time(kind: str) -> tuple[float, int] | None:
    """The public master's seconds and tokens over its whole schedule on one GPU of this kind (steps x ms per step
    at each stage), or None without its stage times there."""
    if kind not in PUBLIC_MASTER_STEP_MS:
        return None
    ms = PUBLIC_MASTER_STEP_MS[kind]["ms"]
    return (sum(n * t for (n, _), t in zip(PUBLIC_MASTER_STAGES, ms)) / 1000,
            sum(n * tokens for n, tokens in PUBLIC_MASTER_STAGES))


def stage_shape(args: Hyperparameters, stage: Stage) -> tuple[str, int, int, int]:
    """A stage's key in the measured tables (STEP_US_PER_TOKEN, MULTI_GPU_US_PER_TOKEN) after the GPU kind (and
    count): preset, micro-batch tokens per GPU, document cut, long window in blocks."""
    return args.preset, stage.spec.seq_len, stage.spec.max_doc_len, stage.windows[0] // args.window_block


def softmax_steps(schedule: Schedule, stage: Stage) -> tuple[int, int]:
    """A stage's training steps as (sampled softmax, full softmax): with candidates, those before
    Schedule.full_softmax sample, the rest are full (the last stage's end is the final validation's step)."""
    end = min(stage.end, schedule.args.num_iterations)
    sampled = max(0, min(end, schedule.full_softmax) - stage.start) if stage.candidates else 0
    return sampled, end - stage.start - sampled


def stage_us_per_token(schedule: Schedule, stage: Stage, kind: str) -> float | None:
    """A stage's mean one-GPU time per token on this kind: its sampled steps at SAMPLED_US_PER_TOKEN's row, its full
    ones at STEP_US_PER_TOKEN's; None where a row it needs is missing."""
    sampled, full = softmax_steps(schedule, stage)
    key = (kind, *stage_shape(schedule.args, stage))
    us_sampled = SAMPLED_US_PER_TOKEN.get((*key, stage.candidates)) if sampled else 0.0
    us_full = STEP_US_PER_TOKEN.get(key) if full else 0.0
    if us_sampled is None or us_full is None:
        return None
    return (sampled * us_sampled + full * us_full) / max(sampled + full, 1)


def schedule_plan(schedule: Schedule, kind: str | None = None) -> list[str]:
    """--plan: the resolved schedule, one line per stage, the trained tokens, and the projected training time on
    --plan_gpu's kind (steps x global batch x the tables' time per token, a stage's sampled and full softmax steps
    each at its own row (stage_us_per_token); x the 8-GPU ratio on 8 GPUs, where that kind has one), per stage where
    the tables have its rows on this GPU kind and in total where they have every stage's; then where the times come
    from, and ours against the public master over each code's schedule on the same kind. Validation, compile and
    warm-up are not counted."""
    args, stages, N = schedule.args, schedule.stages, schedule.args.num_iterations
    kind = kind or args.plan_gpu
    micro = args.batch_size // args.seq_len
    lines = [f"--preset {args.preset}: {N} steps of {micro} micro-batches; projected seconds on {kind} "
             f"({STEP_US_ATTENTION.get(kind, 'no rows')}), steps only ('-': shape not measured)",
             f"{'stage':>5}  {'steps':>11}  {'batch':>9}  {'micro-batches 1/8 GPUs':>22}  {'micro tokens':>12}  "
             f"{'doc cut':>7}  {'windows':>9}  {'lr x':>4}  {'tokens':>13}  {'softmax':>9}  {'us/token':>8}  "
             f"{'1 GPU':>7}  {'8 GPUs':>7}"]
    one, eight, missing, ratios = 0.0, 0.0, [], {}
    for i, st in enumerate(stages):
        steps, b = min(st.end, N) - st.start, st.spec  # the last stage's end is the final validation's step
        name = "ext" if args.extension_steps and i == len(stages) - 1 else str(i + 1)
        us = stage_us_per_token(schedule, st, kind)
        ratio = EIGHT_GPU_RATIO.get(kind, {}).get(b.seq_len) if micro == 8 else None  # one micro-batch per GPU
        s1 = None if us is None else steps * b.batch_size * us * 1e-6
        s8 = None if s1 is None or ratio is None else s1 * ratio
        one, eight = one + (s1 or 0.0), None if eight is None or s8 is None else eight + s8
        if s1 is None:
            missing.append(name)
        if ratio is not None:
            ratios[b.seq_len] = ratio
        per_rank = f"{micro} / {micro / 8:g}"
        lines.append(f"{name:>5}  {f'{st.start}-{st.start + steps - 1}':>11}  {b.batch_size:>9,}  {per_rank:>22}  "
                     f"{b.seq_len:>12,}  {b.max_doc_len:>7,}  {f'{st.windows[0]}/{st.windows[1]}':>9}  "
                     f"{st.lr:>4g}  {steps * b.batch_size:>13,}  {softmax_column(st, schedule.full_softmax, N):>9}  "
                     f"{'-' if us is None else f'{us:.3f}':>8}  "
                     f"{'-' if s1 is None else f'{s1:.1f}':>7}  {'-' if s8 is None else f'{s8:.1f}':>7}")
    if any(st.candidates and st.start < schedule.full_softmax for st in stages):
        lines.append(f"softmax: in training over that many of the head's rows (sampled), the full softmax from step "
                     f"{schedule.full_softmax} (full_softmax_from {args.full_softmax_from:g} x {N} steps; '*': from "
                     "inside the stage, its us/token the mean of its sampled and full steps); validation: always the "
                     "full softmax")
    tokens = schedule.tokens_before(N)
    lines.append(f"trained tokens: {tokens:,}")
    if missing:
        lines.append(f"projected time: incomplete, stage(s) {', '.join(missing)} not in train_gpt.py's "
                     f"{TABLES} for {kind} and --preset {args.preset} (bench/side_by_side.py times each "
                     "stage of a schedule)")
    elif eight is not None:
        used = ", ".join(f"{r:.3f} at {n:,}" for n, r in sorted(ratios.items()))
        lines.append(f"projected time: 1 x {kind} {one:.1f} s, 8 x {kind} {eight:.1f} s (time per token at each "
                     f"stage's shape, x record #89's 8/1-GPU step-time ratio on {kind} ({used} tokens a micro-batch; "
                     "EIGHT_GPU_RATIO))")
    else:
        why = (f"no measured 8/1-GPU step-time ratio on {kind} (EIGHT_GPU_RATIO has {', '.join(EIGHT_GPU_RATIO)})"
               if kind not in EIGHT_GPU_RATIO else
               f"record #89's 8/1-GPU ratio is measured at one micro-batch per GPU, not {micro / 8:g}"
               if micro != 8 else "no measured 8/1-GPU ratio at some stage's micro-batch (EIGHT_GPU_RATIO)")
        lines.append(f"projected time: 1 x {kind} {one:.1f} s (time per token at each stage's shape); 8 GPUs not "
                     f"projected: {why}")
    if kind in STEP_US_SOURCE:
        lines.append(f"ours on {kind} ({STEP_US_ATTENTION[kind]}): {STEP_US_SOURCE[kind]}; times as measured for "
                     f"--preset {args.preset}'s model{measured_when(args.preset, kind)}, other model or kernel flags "
                     "are not reflected")
    master = public_master_time(kind)
    if master is not None:
        ms, attention, source = (PUBLIC_MASTER_STEP_MS[kind][k] for k in ("ms", "attention", "source"))
        steps = " / ".join(str(n) for n, _ in PUBLIC_MASTER_STAGES)
        batches = " / ".join(f"{n:,}" for _, n in PUBLIC_MASTER_STAGES)
        us = " / ".join(f"{t * 1000 / n:.3f}" for t, (_, n) in zip(ms, PUBLIC_MASTER_STAGES))
        lines.append(f"public master on {kind} ({attention}; f411b3d3, record #89's code): {steps} steps of {batches} "
                     f"tokens at {' / '.join(f'{t:g}' for t in ms)} ms ({us} us/token), {master[0]:.1f} s over "
                     f"{master[1]:,} tokens; {source}")
    lines += multi_gpu_lines(schedule, kind, None if missing else one)
    lines.append(vs_public_master(kind, None if missing else one, tokens, missing, args.preset))
    unmeasured = unmeasured_model(args, kind)
    if unmeasured and len(missing) < len(stages):  # some stage priced, at another model's rows
        lines.append(f"step times of another model: the times above are --preset {args.preset}'s model's"
                     f"{measured_when(args.preset, kind)}; this run's model is not measured (it differs in "
                     f"{', '.join(unmeasured)}: the model line gives the measured model's values)")
    return lines


def measured_when(preset: str, kind: str, gpus: int = 1) -> str:
    """--plan's words for a preset's rows on `gpus` GPUs of this kind that are of a model it no longer trains
    (MEASURED_MODEL)."""
    return " before its present one (MEASURED_MODEL)" if (preset, kind, gpus) in MEASURED_MODEL else ""


def unmeasured_model(args: Hyperparameters, kind: str, gpus: int = 1) -> dict:
    """The MODEL_FIELDS in which a run's model is not the one its preset's rows on `gpus` GPUs of this kind were timed
    on (the preset's, with MEASURED_MODEL's fields of then), and what that model had that no field builds now:
    {field: the measured model's value}."""
    ours = model_values(vars(args))
    then = MEASURED_MODEL.get((args.preset, kind, gpus), {})
    fields = {k: v for k, v in then.items() if k in MODEL_FIELDS}
    theirs = model_values(vars(Hyperparameters(**{**PRESETS[args.preset][1], **fields}, preset=args.preset)))
    return {**{k: theirs[k] for k in MODEL_FIELDS if ours[k] != theirs[k]},
            **{k: v for k, v in then.items() if k not in fields}}


def multi_gpu_lines(schedule: Schedule, kind: str, one: float | None) -> list[str]:
    """--plan: the schedule's time from step times measured on several GPUs of this kind (MULTI_GPU_US_PER_TOKEN),
    where every stage's shape has a row and trains with the full softmax, beside the one-GPU projection `one`."""
    args, N, lines = schedule.args, schedule.args.num_iterations, []
    for k, gpus in sorted(key for key in MULTI_GPU_SOURCE if key[0] == kind):
        # full-softmax rows only: a stage with sampled steps has none
        us = [None if softmax_steps(schedule, st)[0] else MULTI_GPU_US_PER_TOKEN.get((k, gpus, *stage_shape(args, st)))
              for st in schedule.stages]
        if None in us:
            continue
        seconds = sum((min(st.end, N) - st.start) * st.spec.batch_size * u * 1e-6 for st, u in zip(schedule.stages, us))
        # against the one-GPU time only where both sets of rows are of one model
        same = MEASURED_MODEL.get((args.preset, k, gpus)) == MEASURED_MODEL.get((args.preset, k, 1))
        share = f", {seconds / one:.3f} of one GPU's" if one and same else ""
        differs = unmeasured_model(args, k, gpus)
        model = (f"; --preset {args.preset}'s model{measured_when(args.preset, k, gpus)}"
                 + (f", not this run's (it differs in {', '.join(differs)})" if differs else ""))
        lines.append(f"measured on {gpus} x {kind}: {seconds:.1f} s (each stage's {gpus}-GPU step time{share}){model}; "
                     f"{MULTI_GPU_SOURCE[k, gpus]}")
    return lines


def vs_public_master(kind: str, seconds: float | None, tokens: int, missing: list[str], preset: str) -> str:
    """--plan's one line of ours against the public master on one GPU of this kind: per token over each code's
    whole schedule (R), and record #89's 8xH100 time scaled by ours / its one-GPU time over each schedule (T)."""
    master = public_master_time(kind)
    gaps = ([] if seconds is not None else
            [f"ours: stage(s) {', '.join(missing)} not in {TABLES} for {kind} and --preset {preset}"])
    if master is None:
        gaps.append(f"the public master: no stage times on {kind} (PUBLIC_MASTER_STEP_MS has "
                    f"{', '.join(PUBLIC_MASTER_STEP_MS)})")
    if gaps:
        return f"vs public master ({kind}): not computed, " + "; ".join(gaps)
    ratio = seconds / master[0]
    per_token = (seconds / tokens) / (master[0] / master[1])
    return (f"vs public master ({kind}, {PUBLIC_MASTER_STEP_MS[kind]['paired']}): per-token "
            f"{per_token:.3f}x, projected 8xH100 {ratio * RECORD_89_SECONDS:.1f} s (ours {seconds:.1f} s / its "
            f"{master[0]:.1f} s over each schedule on one {kind}, x record #89's {RECORD_89_SECONDS} s: assumes both "
            "codes scale to 8 GPUs alike)")


# -----------------------------------------------------------------------------------------------
# Optimizer wiring: which parameters each optimizer gets, at which learning rate.

def param_groups_by_role(model: GPT) -> dict[str, list[nn.Parameter]]:
    """Parameters by what they are (the optimizers and the size report split them so)."""
    groups = {"token embedding": [model.embed.weight], "value embeddings": [m.weight for m in model.value_embeds]}
    groups["bigram embedding"] = [model.bigram_embed.weight]
    mudd = {"MUDD": [model.mudd_w1, model.mudd_w2, model.mudd_b2],
            "MUDD gates": [model.mudd_gate_w1, model.mudd_gate_w2, model.mudd_gate_b2]}
    if model.cfg.cplm_bands:
        mudd["copy pointer"] = [model.copy_qk, model.copy_sink]
    if model.cfg.doc_copy:
        mudd["document copy"] = [model.doc_copy_embed, model.doc_copy_gains]
    # the smear gate's matrix is Muon's, as in the 2025-09-18 record
    return {**groups, "block matrices": [p for p in model.blocks.parameters() if p.ndim >= 2] + [model.smear_w],
            "LM head": [model.lm_head_w], "scalars": [model.scalars], **mudd}


def build_optimizers(model: GPT, args: Hyperparameters, rank: int, world_size: int, orthogonalize=None,
                     update=adam_update, row_update=row_adam_update, segment=segment_sum, normalized=None):
    """Muon for every matrix inside the blocks and the smear gate's (as the 2025-09-18 record); Adam for
    embeddings, LM head and scalars. The bigram table learns as the other embeddings do (the
    2026-01-19 record gave it the value embeddings' Adam settings); its per-block weights, the
    backout weight and the smear weight are scalars. The value-embedding
    and bigram tables are a group apart from the token embedding, at its lr, for their own weight
    decay and betas (embed_weight_decay, embed_adam_betas), as the LM head may have (head_weight_decay,
    head_adam_betas); at the defaults nothing differs."""
    groups = param_groups_by_role(model)
    # decayed as in the 2026 records; the n-gram table by the row-sparse Adam with ngram_sparse_adam
    tables = groups["value embeddings"] + ([] if args.ngram_sparse_adam else groups["bigram embedding"])
    betas = (args.adam_beta1, args.adam_beta2)
    # a token embedding that starts tied learns, once untied, as the head does: its rate (the 2025-12-22 record),
    # betas and decay (the public master's embed and lm_head entries)
    head = dict(lr=args.adam_lr * args.head_lr_mult, weight_decay=args.head_weight_decay,
                betas=tuple(args.head_adam_betas) or betas)
    token = head if args.tied_embed_stages else dict(lr=args.adam_lr * args.embed_lr_mult)
    adam_groups = [dict(params=groups["token embedding"], **token),
                   dict(params=tables, lr=args.adam_lr * args.embed_lr_mult, weight_decay=args.embed_weight_decay,
                        betas=tuple(args.embed_adam_betas) or betas, tables=True),
                   dict(params=groups["LM head"], **head),
                   dict(params=groups["scalars"], lr=args.adam_lr * args.scalar_lr_mult,
                        betas=tuple(args.scalar_adam_betas) or betas),
                   # MUDD's MLPs: a quarter of the base rate, betas 0.9 / 0.99 (the public master's)
                   dict(params=groups["MUDD"], lr=args.adam_lr * 0.25, betas=(0.9, 0.99)),
                   # the MUDD gates' MLPs and scale: a tenth of it (the 2026-05-27 record's)
                   dict(params=groups["MUDD gates"], lr=args.adam_lr * 0.1, betas=(0.9, 0.99)),
                   # CPLM's pointer: the base rate, betas 0.9 / 0.99 (PR 379's)
                   dict(params=groups.get("copy pointer", []), lr=args.adam_lr, betas=(0.9, 0.99)),
                   # doc_copy's tables: the base rate, betas 0.9 / 0.99, no decay (PR 378's)
                   dict(params=groups.get("document copy", []), lr=args.adam_lr, betas=(0.9, 0.99))]
    if args.ngram_sparse_adam:  # ANVIL2's n-gram table Adam: beta1 0, the tables' beta2, lr and decay
        adam_groups.append(dict(params=groups["bigram embedding"], sparse_rows=True, lr=args.adam_lr * args.embed_lr_mult,
                                weight_decay=args.embed_weight_decay,
                                betas=(0.0, (tuple(args.embed_adam_betas) or betas)[1]), tables=True))
    adam = DistAdam([g for g in adam_groups if g["params"]], lr=args.adam_lr, betas=betas, eps=args.adam_eps,
                    rank=rank, world_size=world_size, update=update, row_update=row_update, segment=segment)
    fc, proj = args.mlp_muon_lr_mults or (1.0, 1.0)
    # every MLP's two matrices, a block's second MLP (parallel_mlp_blocks) too: ANVIL2 gives its bank slot 11 the MLP
    # rates (per_matrix_lr_mul 1 on c_fc, 2 on c_proj, as every live slot); none in a removed block (skip_layers)
    mlps = [m for block in model.blocks for m in (block.mlp, block.parallel_mlp) if m is not None]
    mults = {p: m for mlp in mlps for p, m in ((mlp.fc_w, fc), (mlp.proj_w, proj))}
    muon = Muon(groups["block matrices"], lr=args.muon_lr, momentum=args.muon_momentum, rank=rank,
                world_size=world_size, orthogonalize=orthogonalize, beta2=args.muon_beta2,
                weight_decay=args.muon_weight_decay, lr_mults=mults, slow_beta=args.anvil_rails[0],
                bf16_comm=args.muon_bf16_comm, normalized=normalized)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
            if group.get("tables"):  # the tables' betas and decay per update change with table_adam_every
                group["initial_betas"], group["initial_weight_decay"] = tuple(group["betas"]), group["weight_decay"]
    return adam, muon


# -----------------------------------------------------------------------------------------------
# Metrics: model FLOPs per token (MFU), memory estimate, size report.

# Dense bf16 tensor-core peaks per GPU from the vendors' datasheets (TFLOP/s, no sparsity); the
# first name found in the device name wins, so specific names come before general ones.
PEAK_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "GH200": 989, "B200": 2250,
               "A100": 312, "L40S": 362, "L4": 121, "RTX 4090": 165}


def peak_tflops(device: torch.device, override: float) -> float | None:
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(model: GPT, windows: tuple[int, int], max_doc_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights (block matrices + LM head), plus attention:
    QK^T and AV, 2 x heads x (d_qk + d_v) multiply-adds per key forward (2 x 2 x heads x head_dim at full width),
    x3 with the backward, over the keys a query sees (its window + itself, at most a document). The model's widths:
    the zeros a narrow Q/K is padded with for the kernel (narrow_qk_blocks) are not counted. Table lookups (token,
    value and bigram embeddings) and elementwise work (norms, scalar mixes, backout, softcap) are not counted."""
    cfg = model.cfg
    groups = param_groups_by_role(model)
    matmul = sum(p.numel() for p in groups["block matrices"] + groups["LM head"])
    attn = sum(6 * cfg.num_heads * (block.attn.qk_dim + block.attn.v_dim) * min(w + 1, max_doc_len)
               for w, block in zip(model.block_windows(windows), model.blocks) if block.attn is not None)
    return 6 * matmul + attn


def ngram_shard(args: Hyperparameters, rank: int, world_size: int) -> tuple[int, int]:
    """The n-gram table's shard of this rank, (rank, world_size) for GPT: sharded by owner with the row-sparse Adam
    (ANVIL2, 08/30/26), whole on every rank in the dense Adam's group (which shards only its moments)."""
    return (rank, world_size) if args.ngram_sparse_adam else (0, 1)


def table_adam_period(args: Hyperparameters, step: int) -> int:
    """The value-embedding and n-gram tables' Adam period at a step: table_adam_every's from its fraction of
    num_iterations on, adam_every before."""
    t = args.table_adam_every
    return int(t[0]) if t and step >= t[1] * args.num_iterations else args.adam_every


def ngram_positions(schedule: Schedule, world_size: int) -> int:
    """The n-gram table's lookups on one rank between two of its Adam steps at the schedule's largest batch (its
    gradient log's room, ngram_sparse_adam, made once: a log that grew would move under the captured graphs): tokens
    per rank x the tables' longest period x channels (2 with the trigram channel)."""
    args = schedule.args
    batch = max(st.spec.batch_size for st in schedule.stages)
    period = max(args.adam_every, int(args.table_adam_every[0]) if args.table_adam_every else 0)
    return batch // world_size * period * (2 if args.trigram_rows else 1)


def ngram_cache_positions(schedule: Schedule) -> int:
    """The n-gram lookups of the schedule's longest training micro-batch: the rows of a sharded table's row cache."""
    return max(st.spec.seq_len for st in schedule.stages) * (2 if schedule.args.trigram_rows else 1)


def ngram_memory(rows: int, dim: int, world_size: int, positions: int, sparse: bool,
                 cache_positions: int = 0) -> dict[str, int]:
    """Bytes per GPU of the n-gram table (bigram + trigram rows x dim), by part. Dense (the embedding tables' Adam):
    bf16 weights and gradient on every rank, the float32 gradient sum (TableLookup), fp32 Adam moments sharded.
    Row-sparse (ngram_sparse_adam), the table sharded by owner (ANVIL2, 08/30/26): R = rows / world_size rows of
    bf16 weights and 8 bytes of Adam state per row (the second moment, the last step); gradients bounded by the
    looked-up positions n per rank between Adam steps (every one a distinct row at worst): the log (id + bf16 row)
    and the rank's sums (id + fp32 row); on several GPUs also the sums sent (id + bf16 row), those received (at
    worst every rank's n rows, at most R each) and their fp32 sums (at most R rows); and the micro-batch's row cache
    (several GPUs only): its m = cache_positions bf16 rows and row ids, the ids asked of this rank and the rows it
    serves (at worst every rank's m, at most R each)."""
    if not sparse:
        return {"weights": 2 * rows * dim, "Adam state": 8 * rows * dim // world_size, "gradients": 6 * rows * dim,
                "row cache": 0}
    shard, n, m = -(-rows // world_size), positions, cache_positions
    bf16_row, fp32_row = 8 + 2 * dim, 8 + 4 * dim
    gradients = n * (bf16_row + fp32_row)
    cache = 0
    if world_size > 1:
        gradients += n * bf16_row + world_size * min(n, shard) * bf16_row + min(world_size * n, shard) * fp32_row
        cache = m * (2 * dim + 24) + world_size * min(m, shard) * bf16_row
    return {"weights": 2 * shard * dim, "Adam state": 8 * shard, "gradients": gradients, "row cache": cache}


def ngram_memory_of(args: Hyperparameters, world_size: int) -> dict[str, int]:
    """ngram_memory for a run of args on world_size GPUs."""
    schedule = Schedule(args)
    return ngram_memory(args.bigram_rows + args.trigram_rows, args.model_dim, world_size,
                        ngram_positions(schedule, world_size), args.ngram_sparse_adam, ngram_cache_positions(schedule))


def ngram_memory_lines(args: Hyperparameters) -> list[str]:
    """--plan: the n-gram table's bytes per GPU on 1, 2, 4 and 8 GPUs (ngram_memory): weights, Adam state, gradients,
    and the sharded table's row cache."""
    kind = "row-sparse Adam, sharded by owner" if args.ngram_sparse_adam else "dense Adam"
    lines = [f"n-gram table {args.bigram_rows:,} bigram + {args.trigram_rows:,} trigram rows x {args.model_dim} "
             f"({kind}), GiB per GPU:",
             f"{'GPUs':>5}  {'weights':>8}  {'Adam state':>10}  {'gradients':>9}  {'row cache':>9}  {'total':>7}"]
    gib = 2**30
    for world in (1, 2, 4, 8):
        m = ngram_memory_of(args, world)
        lines.append(f"{world:>5}  {m['weights'] / gib:>8.2f}  {m['Adam state'] / gib:>10.2f}  "
                     f"{m['gradients'] / gib:>9.2f}  {m['row cache'] / gib:>9.2f}  {sum(m.values()) / gib:>7.2f}")
    return lines


def model_plan_line(schedule: Schedule) -> str:
    """--plan: the MLP's hidden width and what MFU counts with it (flops_per_token), from the model built on the meta
    device: the matmul weights (block matrices and LM head) and the training FLOPs per token at each stage's windows
    and document cut; where the model is not the one the preset's rows were timed on (unmeasured_model: its width, or
    any other of MODEL_FIELDS, such as the layout's skip_layers or parallel_mlp_blocks), that the step times above are
    that model's, naming its values where they differ."""
    args = schedule.args
    with torch.device("meta"):
        model = GPT(ModelConfig.from_args(args))
    groups = param_groups_by_role(model)
    matmul = sum(p.numel() for p in groups["block matrices"] + groups["LM head"])
    flops = " / ".join(f"{flops_per_token(model, st.windows, st.spec.max_doc_len) / 1e9:.4g}" for st in schedule.stages)
    width, how = model.cfg.mlp_hidden, ("mlp_hidden" if args.mlp_hidden else
                                        f"mlp_ratio {args.mlp_ratio} x model_dim {args.model_dim}")
    line = (f"model: MLP hidden {width:,} ({how}), {matmul:,} matmul weights (block matrices, LM head), training "
            f"GFLOPs per token by stage {flops} (flops_per_token: MFU's count)")
    kind = args.plan_gpu
    named = [f"MLP hidden {v:,}" if k == "mlp_hidden" else f"{k} {v}" for k, v in unmeasured_model(args, kind).items()]
    if named:
        line += (f"; the step times above are --preset {args.preset}'s model's{measured_when(args.preset, kind)}, "
                 + ", ".join(named))
    return line


def check_memory_fits(args: Hyperparameters, world_size: int, gpu_bytes: int, kernels: ModelKernels):
    """Start-up: refuse, in one line, a run whose estimated memory per GPU (memory_estimate, the n-gram table's
    part by ngram_memory) exceeds the GPU's, naming the table's share and the fixes, before anything is allocated."""
    with torch.device("meta"):  # PyTorch's paths (nothing allocated, no kernel asked); the logits' size as chosen
        model = GPT(ModelConfig.from_args(args), ModelKernels(fused_ce=kernels.fused_ce), ngram_shard(args, 0, world_size))
        model.keep_table_grads(ngram_positions(Schedule(args), world_size) if args.ngram_sparse_adam else 0)
    need = sum(memory_estimate(model, args, world_size).values())
    if need > gpu_bytes:
        rows, gib = args.bigram_rows + args.trigram_rows, 2**30
        table = sum(ngram_memory_of(args, world_size).values())
        fixes = ["fewer rows (--bigram_rows, --trigram_rows)",  # and those of the others not already taken
                 *([] if args.ngram_sparse_adam else ["--ngram_sparse_adam"]), "more GPUs",
                 *([] if args.preset == "single" else ["--preset single"])]
        raise ValueError(f"this run needs ~{need / gib:.1f} GiB per GPU (the n-gram table of {rows:,} rows "
                         f"{table / gib:.1f} of it), the GPU has {gpu_bytes / gib:.1f} GiB: use "
                         f"{', '.join(fixes[:-1])} or {fixes[-1]}")


def memory_estimate(model: GPT, args: Hyperparameters, world_size: int) -> dict[str, int]:
    """Estimated bytes per GPU at the peak of a training step (the LM head's backward), by part; with
    ngram_sparse_adam the n-gram table is a part of its own (ngram_memory)."""
    groups, sparse = param_groups_by_role(model), args.ngram_sparse_adam
    table = groups.pop("bigram embedding") if sparse else []
    adam = sum(p.numel() for name, ps in groups.items() if name != "block matrices" for p in ps)
    muon = sum(p.numel() for p in groups["block matrices"])
    sums = {}
    if model.lm_head_grad_sum is not None:  # float32, the shapes of the LM head and the token tables (keep_table_grads)
        summed = [m.weight for m in model.tables() if not (sparse and m is model.bigram_embed)]
        sums["table gradient sums"] = 4 * (model.lm_head_w.numel() + sum(w.numel() for w in summed))
    if sparse:  # the sharded table: its part per GPU
        sums["n-gram table"] = sum(ngram_memory_of(args, world_size).values())
    return sums | {
        "weights + grads": 2 * sum(p.numel() * p.element_size() for p in model.parameters()
                                   if all(p is not q for q in table)),
        # fp32 Adam moments, Muon's two fp32 momentum rails
        "optimizer shards": (8 * adam + 8 * muon) // world_size,
        # bf16 logits, then a fp32 soft-capped copy and a bf16 gradient, or (fused) two FP8 gradients
        "logits": (4 if model.kernels.fused_ce else 8) * args.seq_len * args.vocab_size,
        # Tensors kept for the backward, bf16 per token per block: ~8 of model_dim (norms, q, k, v, attention
        # output) and the MLP's hidden before and after ReLU^2 (2 of its width: 16 of model_dim at 4x). The peaks
        # measured on H100 for the record, single and medium presets (4x) lie within 15% of the total
        # (bench/README.md). A removed block (skip_layers) keeps none; a second MLP (parallel_mlp_blocks) keeps its
        # own hidden before and after ReLU^2, at the same width (2 of it). A narrow V (narrow_v_blocks) halves q, k, v
        # and the attention output; a narrow Q/K under a full V is counted at V's width (padded to it for a kernel of
        # one width; FA4's native route keeps less, an upper bound here).
        "activations": 2 * args.seq_len * ((args.num_layers - len(args.skip_layers))
                                           * (8 * args.model_dim + 2 * model.cfg.mlp_hidden)
                                           + 2 * model.cfg.mlp_hidden * len(args.parallel_mlp_blocks)
                                           - 2 * args.num_heads * args.head_dim * len(args.narrow_v_blocks)),
    }


def size_report(model: GPT, args: Hyperparameters, world_size: int, device: torch.device | None = None) -> list[str]:
    """Parameter counts by group, and the estimate of memory per GPU (per process on the CPU)."""
    lines = [f"parameters: {name} {sum(p.numel() for p in ps):,}" for name, ps in param_groups_by_role(model).items()]
    parts = memory_estimate(model, args, world_size)
    unit, size = ("GiB", 2**30) if sum(parts.values()) >= 2**30 else ("MiB", 2**20)
    where = "process" if device is not None and device.type == "cpu" else "GPU"
    lines.append(f"memory per {where}: ~{sum(parts.values()) / size:.1f} {unit}: " +
                 ", ".join(f"{name} {v / size:.1f}" for name, v in parts.items()))
    return lines


def run_report(model: GPT, args: Hyperparameters, device: torch.device, world_size: int) -> list[str]:
    """The start-of-run lines: where and how it runs (the kernels build() chose), then the size report."""
    k = model.kernels
    return [f"device: {device} x {world_size}, grad accumulation {args.batch_size // args.seq_len // world_size}, "
            f"attention backend: {k.attention}, "
            f"LM head: {'fp8' if k.fp8_head else 'bf16' if device.type == 'cuda' else 'float32'}, "
            f"MLP: {'fused' if k.fused_mlp else 'unfused'}{' fp8' if k.fp8_mlp else ''}"
            f"{' (its transposes by kernel)' if k.transpose else ''}, "
            f"cross-entropy: {'fused' if k.fused_ce else 'unfused'}, "
            f"DC attention: {('kernels' if k.dc else 'written out') if args.dc_attention else 'off'}, "
            f"QK-norm and rotary: {'kernels' if k.qk_rope else 'compiled'}, "
            f"compile: {args.compile}, CUDA graphs: {args.cuda_graphs and args.compile and device.type == 'cuda'}, "
            f"parameters: {sum(p.numel() for p in model.parameters()):,}", *size_report(model, args, world_size, device),
            *sampled_softmax_report(Schedule(args))]


def sampled_softmax_report(schedule: Schedule) -> list[str]:
    """A start-of-run line where training samples the softmax (Stage.candidates): where, and that the training
    losses logged there are over the candidates only, lower than the full softmax's (validation's are full)."""
    sampled = [st for st in schedule.stages if st.candidates and st.start < schedule.full_softmax]
    if not sampled:
        return []
    return ["sampled softmax in training: " + ", ".join(f"{st.candidates:,} rows from step {st.start}"
                                                        for st in sampled)
            + f", the full softmax from step {schedule.full_softmax}; training losses logged before it are over the "
              "candidates (lower than the full softmax's), validation's over the full vocabulary"]


# -----------------------------------------------------------------------------------------------
# Checkpoints: whole or absent, sharded optimizer states, exact resume.

# model.pt's format: 2 since the trainer has one model (2026-11-28: the 2025-09-03 record's model, its U-net and tied
# value tables, and the switches that turned the later techniques off were deleted). An older checkpoint is refused.
CHECKPOINT_FORMAT = 2


class CheckpointFormatError(ValueError):
    """A checkpoint written by a train_gpt.py of another format (CHECKPOINT_FORMAT)."""


def code_hash() -> str:  # this file and the two it imports from the repository, the sources its log holds
    files = (__file__, kernels.__file__, shard_format.__file__)
    return hashlib.sha256(b"".join(Path(f).read_bytes() for f in files)).hexdigest()[:16]


MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in ("max_seq_len", "yarn_windows")]


def model_values(fields: dict) -> dict:
    """The MODEL_FIELDS of a run's hyperparameters (vars() of Hyperparameters, or a checkpoint's stored ones), as a
    checkpoint is checked against a run: the MLP's width resolved (mlp_width: mlp_ratio 4 at model_dim 768 and
    mlp_hidden 3072 are one model, and a checkpoint from before mlp_hidden has its ratio's width); a field absent
    there is left out."""
    values = {k: fields[k] for k in MODEL_FIELDS if k in fields and k != "mlp_hidden"}
    width = mlp_width(fields)
    return values if width is None else {**values, "mlp_hidden": width}


def barrier(world_size: int):
    if world_size > 1:
        dist.barrier()


def copy_state_dict(state):
    """Deep copy of a (nested) optimizer state dict, tensors cloned."""
    if isinstance(state, Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: copy_state_dict(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(copy_state_dict(v) for v in state)
    return state


def state_bytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict: what torch.save writes of it, less a small overhead."""
    if isinstance(state, Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def checkpoint_bytes(model: GPT, optimizers, rank: int) -> int:
    """The tensor bytes of this rank's checkpoint files (save_checkpoint's split: rank 0 alone writes the weights)."""
    sharded = model.ngram_world > 1
    need = state_bytes([o.state_dict() for o in optimizers])
    need += state_bytes(model.bigram_embed.weight) if sharded else 0
    if rank == 0:
        need += sum(state_bytes(v) for k, v in model.state_dict().items() if not (sharded and k == "bigram_embed.weight"))
    return need


CHECKPOINT_SPARE = 2**30  # bytes a checkpoint leaves free on its disk (logs, compile caches, the next checkpoint's .tmp)


def checkpoint_room(step: int, model: GPT, optimizers, args: Hyperparameters, rank: int, control) -> str:
    """'' if the checkpoint of `step` fits on its disk with CHECKPOINT_SPARE to spare, else the line that says
    why it is not written. Every rank's files are counted against every rank's disk (one node's ranks share one;
    on several nodes with their own disks this asks for more than each needs). A full disk is worse than a
    missing checkpoint: the record preset's 20.8M-row table alone is 30 GiB a checkpoint, and two such
    checkpoints once filled a 64 GiB disk and took its machine down."""
    need = checkpoint_bytes(model, optimizers, rank)
    where = Path(args.checkpoint_dir).resolve()
    while not where.exists():  # the nearest folder that exists: the checkpoint's disk
        where = where.parent
    free = shutil.disk_usage(where).free
    if control is not None:
        total, least = torch.tensor([need], dtype=torch.float64), torch.tensor([free], dtype=torch.float64)
        dist.all_reduce(total, group=control)  # every rank's files
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=control)  # the fullest disk
        need, free = total.item(), least.item()
    if need + CHECKPOINT_SPARE <= free:
        return ""
    size = lambda n: f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    return (f"checkpoint at step {step} not written: it needs {size(need)} and {where} has {size(free)} free "
            f"({size(CHECKPOINT_SPARE)} kept spare); point --checkpoint_dir at a disk with room")


def save_checkpoint(step: int, model: GPT, optimizers, loader_state: dict, training_time_ms: float,
                    args: Hyperparameters, rank: int, world_size: int) -> Path:
    """checkpoint_dir/<run_id>/step_NNNNNN/: model.pt (weights, step, hyperparameters, code hash) and
    rank<r>.pt per rank (its optimizer shards, data position, RNG states, and its shard of a sharded n-gram table,
    which model.pt then leaves out: ngram_shards). Written into a .tmp folder renamed when every rank is done, so a
    checkpoint either exists whole or not at all."""
    final = Path(args.checkpoint_dir) / args.run_id / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(world_size)
    rng = dict(torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [])
    sharded = model.ngram_world > 1
    table = dict(ngram_table=model.bigram_embed.weight.detach()) if sharded else {}
    torch.save(dict(optimizers=[o.state_dict() for o in optimizers], loader=loader_state, rng=rng, run_id=args.run_id,
                    step=step, **table), tmp / f"rank{rank}.pt")  # run and step: the files of one checkpoint are a set
    if rank == 0:
        weights = {k: v for k, v in model.state_dict().items() if not (sharded and k == "bigram_embed.weight")}
        torch.save(dict(model=weights, step=step, args=dataclasses.asdict(args), world_size=world_size,
                        ngram_shards=model.ngram_world, code_hash=code_hash(), training_time_ms=training_time_ms,
                        format=CHECKPOINT_FORMAT), tmp / "model.pt")
    barrier(world_size)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        old = sorted(final.parent.glob("step_??????"))[: -args.keep_checkpoints or None]
        for path in old if args.keep_checkpoints > 0 else []:
            shutil.rmtree(path, ignore_errors=True)
    barrier(world_size)
    return final


def find_checkpoint(resume: str, checkpoint_dir: str) -> Path:
    if resume != "latest":
        path = Path(resume)
        if not (path / "model.pt").is_file():
            raise FileNotFoundError(f"--resume {resume}: no checkpoint there (expected {path / 'model.pt'})")
        return path
    found = sorted(Path(checkpoint_dir).glob("*/step_??????"), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise FileNotFoundError(f"--resume latest: no checkpoint under {checkpoint_dir}/ (save with --save_every N)")
    return found[-1]


def read_checkpoint_file(path: Path) -> dict:
    """One file of a checkpoint; model.pt (the one with the hyperparameters) only in this file's format."""
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing: the checkpoint is incomplete; resume from another one") from None
    except Exception as e:
        raise ValueError(f"{path}: cannot read the checkpoint ({type(e).__name__}: {e}); it is corrupt or "
                         "truncated: resume from another one") from e
    if "args" in content and content.get("format", 1) != CHECKPOINT_FORMAT:
        raise CheckpointFormatError(
            f"{path}: written by a train_gpt.py of checkpoint format {content.get('format', 1)}, this one reads "
            f"{CHECKPOINT_FORMAT} (format 2: one model, the 2025 model's switches deleted); use it with the commit "
            f"that wrote it (its code hash: {content.get('code_hash', 'unknown')})")
    return content


# Fields deleted since checkpoints stored them: the one value built now, what another value meant, and what is built
RETIRED_FIELDS = {
    "inject_after_attn": (True, "x0 and the n-gram term before a block's attention", "always after it"),
    "muon_rule": ("anvil", "Polar Express, one momentum: no slow rail to resume", "always ANVIL's")}


def load_checkpoint(path: Path, model: GPT, optimizers, args: Hyperparameters, rank: int, world_size: int, log):
    """Restore weights and this rank's optimizer shards; return (step, data position, training ms).
    Refuses a checkpoint of another model shape, naming what differs. A checkpoint of another world
    size is re-sharded: every rank reads every rank's file and keeps its new share (the data position
    is the same on every rank: each reads the whole stream)."""
    meta = read_checkpoint_file(path / "model.pt")
    then, now = model_values(stored_args(meta["args"])), model_values(vars(args))
    # a width not resolved (then) lacks model_dim or mlp_ratio, which are named themselves
    diff = [f"{k}: checkpoint {then[k]!r}, now {now[k]!r}" if k in then else
            f"{k}: not a field when the checkpoint was written, now {now[k]!r}"
            for k in MODEL_FIELDS if then.get(k) != now[k] and (k in then or k != "mlp_hidden")]
    for k, (kept, was, now) in RETIRED_FIELDS.items():
        if meta["args"].get(k, kept) != kept:
            diff.append(f"{k}: checkpoint {meta['args'][k]!r} ({was}), now {now}")
    if diff:
        raise ValueError(f"{path} holds a different model: " + "; ".join(diff))
    if meta["code_hash"] != code_hash():
        log(f"note: {path} was written by another version of train_gpt.py ({meta['code_hash']} vs {code_hash()})")
    saved_world = meta["world_size"]

    read = {}  # each rank file read once (the n-gram table's shards come from them too: ngram_table_rows)

    def shard_of(r: int) -> dict:
        if r in read:
            return read[r]
        shard = read[r] = read_checkpoint_file(path / f"rank{r}.pt")
        made = (shard.get("run_id", meta["args"]["run_id"]), shard.get("step", meta["step"]))  # older: unmarked
        if made != (meta["args"]["run_id"], meta["step"]):
            raise ValueError(f"{path}: rank{r}.pt was written by run {made[0]} at step {made[1]}, model.pt by run "
                             f"{meta['args']['run_id']} at step {meta['step']}: files of two checkpoints mixed; "
                             "resume from a checkpoint folder as it was written")
        return shard
    if saved_world == world_size:
        shard = shard_of(rank)
        states = shard["optimizers"]
    else:
        shards = [shard_of(r) for r in range(saved_world)]
        states = [opt.reshard([s["optimizers"][i] for s in shards]) for i, opt in enumerate(optimizers)]
        shard = shards[rank % saved_world]  # its RNG states; the data position is every rank's
        log(f"note: {path} was written by {saved_world} process(es); optimizer states re-sharded over {world_size}")
    weights = dict(meta["model"])
    if meta.get("ngram_shards", 1) > 1 or model.ngram_world > 1:  # the n-gram table: this model's shard of it
        weights["bigram_embed.weight"] = ngram_table_rows(path, meta, model.ngram_rank, model.ngram_world, shard_of)
    model.load_state_dict(weights)
    for opt, state in zip(optimizers, states):
        settings = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        opt.load_state_dict(state)
        for group, mine in zip(opt.param_groups, settings):  # this run's settings: `--resume CKPT --muon_lr X` applies X
            group.update(mine)
    torch.set_rng_state(shard["rng"]["torch"])
    if shard["rng"]["cuda"] and torch.cuda.is_available() and len(shard["rng"]["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(shard["rng"]["cuda"])
    return meta["step"], shard["loader"], meta["training_time_ms"]


def ngram_table_rows(path: Path, meta: dict, rank: int, world_size: int, shard_of=None) -> Tensor:
    """Block `rank` of world_size of a checkpoint's n-gram table (world_size 1: the whole table): from model.pt, or
    from the rank files' shards where the writing run sharded it (ngram_shards ranks; the same count: only this
    rank's file is read, else every one, the table joined whole in memory first)."""
    saved = meta.get("ngram_shards", 1)
    shard_of = shard_of or (lambda r: read_checkpoint_file(path / f"rank{r}.pt"))
    if saved == world_size > 1:
        return shard_of(rank)["ngram_table"]
    table = meta["model"]["bigram_embed.weight"] if saved == 1 else \
        torch.cat([shard_of(r)["ngram_table"] for r in range(saved)])
    rows = table.size(0) // world_size
    return table[rank * rows: (rank + 1) * rows]


def resume_command(checkpoint: Path, world_size: int) -> str:
    """The complete command that continues from a checkpoint (its hyperparameters come with it)."""
    launch = f"NPROC={world_size} ./run.sh" if world_size > 1 else "python train_gpt.py"
    return f"{launch} --resume {checkpoint}"


# -----------------------------------------------------------------------------------------------
# Logging

class Logger:
    """Rank 0 prints and appends to logs/<run_id>.txt; other ranks stay silent. Lines are held in
    memory until start() (the run has passed its start-up checks), so a refused or failed start
    leaves no log behind and never appends to the log of the run it tried to resume."""

    def __init__(self, args: Hyperparameters, rank: int):
        self.path = os.path.join(args.log_dir, f"{args.run_id}.txt") if rank == 0 else None
        self.held: list[str] | None = []

    def __call__(self, msg: str = "", console: bool = True):
        if self.path is None:
            return
        if console:
            print(msg, flush=True)
        if self.held is not None:
            self.held.append(msg)
        else:
            with open(self.path, "a") as f:
                f.write(msg + "\n")

    def start(self):
        if self.path is not None and self.held is not None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.writelines(m + "\n" for m in self.held)
        self.held = None


def environment_report(device: torch.device) -> str:
    lines = [f"Python {sys.version.split()[0]}", f"PyTorch {torch.__version__}",
             f"CUDA {torch.version.cuda}", f"Triton {_version('triton')}"]
    if device.type == "cuda":
        try:
            lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout)
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"nvidia-smi unavailable: {e}")
    return "\n".join(lines)


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "not installed"


# -----------------------------------------------------------------------------------------------
# Training: build, one step, validation, warm-up, the run

def to_device(model: GPT, device: torch.device) -> GPT:
    """The model on device. On the CPU in float32 throughout: a CPU without bf16 instructions (AVX2) emulates bf16
    matmuls, ~40x slower than float32; the GPU keeps the record's bf16 embeddings and activations."""
    model = model.to(device)
    return model.float() if device.type == "cpu" else model


def check_fp8_head_shapes(vocab_size: int, model_dim: int, candidates: tuple[int, ...] = ()):
    """cuBLAS' FP8 matmuls (torch._scaled_mm) take only dimensions divisible by 16: refused here, before any compile,
    with the fix, rather than as a cuBLAS error in the first step. The sampled softmax's head has `candidates` rows."""
    if vocab_size % 16 or model_dim % 16:
        raise ValueError(f"--fp8_head: the FP8 LM head's matmuls need vocab_size and model_dim divisible by 16, not "
                         f"{vocab_size} and {model_dim}; pad the vocabulary (the record's 50304 is GPT-2's 50257 "
                         "rounded up to 128) or pass --fp8_head false")
    if any(n % 16 for n in candidates):
        raise ValueError(f"--fp8_head: the sampled softmax's head rows (the stages' candidates {list(candidates)}) "
                         "must be multiples of 16 for the FP8 matmuls, or pass --fp8_head false")


def check_fp8_mlp_shapes(hidden: int):
    """The FP8 MLP (--fp8_mlp) reads and writes e4m3 tensors with a row of the hidden width (post, W_fc and W_proj
    in their two layouts) through TMA, whose rows are 16-byte multiples, and cuBLAS' FP8 matmuls take only dimensions
    divisible by 16: a width that is not is refused here, before any compile, naming the field (model_dim: the FP8
    head's check). The tiles need no multiple: edge tiles are zero-filled and clipped (2816 = 11 x 256 has none)."""
    if hidden % 16:
        raise ValueError(f"--fp8_mlp: the FP8 MLP's matmuls need the MLP's hidden width (mlp_hidden, or mlp_ratio x "
                         f"model_dim) divisible by 16, not {hidden}: set --mlp_hidden to a multiple of 16 (ANVIL2's "
                         "2816 is 176 x 16) or pass --fp8_mlp false")


def recompile_limit(schedule: Schedule) -> int:
    """dynamo's limit of graphs per function that this run's planned compiles stay within (fullgraph turns the limit
    into a failure; its default is 8). The model: one graph per stage and mode (training, evaluation), one for the
    final validation, one more per sampled stage. The FP8 head's operand cast (kernels.quantize): one graph per
    operand shape, i.e. per micro-batch token count (each stage's, validation's) and per head row count (each
    stage's candidates, the full head, which is also a Parameter), each met in two dispatch-key sets on an H200
    (the capture's call and the compile run's). ANVIL2's 8K / 16K / 24K batches on the proxy stopped at 13."""
    args, stages = schedule.args, schedule.stages
    model = 2 * len(stages) + 1 + sum(1 for st in stages if st.candidates)
    tokens = {st.spec.seq_len for st in stages} | {args.val_seq_len}
    rows = {st.candidates for st in stages if st.candidates} | {args.vocab_size}
    return max(model, 2 * (len(tokens) + len(rows) + 1))


def build(args: Hyperparameters, device: torch.device, rank: int, world_size: int, log=print,
          schedule: Schedule | None = None):
    """The model (seeded, identical on every rank), its compiled twin, the optimizers, and the
    attention backend and LM-head kind chosen for this device; for the run's schedule (default: args')."""
    schedule = Schedule(args) if schedule is None else schedule
    chosen = choose_kernels(device, args.attention, args.compile, args.fp8_head, args.fused_ce, args.fused_mlp,
                            args.fp8_mlp, args.fused_dc, args.fused_qk_rope, args.fp8_transpose, log)
    if chosen.fp8_head:
        check_fp8_head_shapes(args.vocab_size, args.model_dim, tuple(row.candidates for row in args.stages))
    if chosen.fp8_mlp:
        check_fp8_mlp_shapes(mlp_width(vars(args)))
    # TF32 tensor cores for the float32 matmuls: DC attention's and CPLM's scores (their bf16 inputs are exact in
    # TF32's 10-bit mantissa; the pointer's query and the DC mix round at 2^-11), no longer on CUDA cores
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as Inductor advises
    if device.type == "cuda":  # a table (or a model) too large for the GPU: one line, before any allocation
        check_memory_fits(args, world_size, torch.cuda.get_device_properties(device).total_memory, chosen)
    torch.manual_seed(args.seed)
    model = to_device(GPT(ModelConfig.from_args(args), chosen, ngram_shard(args, rank, world_size)), device)
    prefix = any(any(st.prefix_ramp) for st in schedule.stages)
    if prefix or args.ngram_normalize:  # the tables from GPT-2's token texts (untimed; the record builds the
        vocab = gpt2_token_bytes()      # prefix-token loss' in its timed region, ~0.1 s)
        if prefix and args.vocab_size < len(vocab):
            raise ValueError(f"the prefix-token loss (a stage's prefix > 0) is for GPT-2 tokens: vocab_size="
                             f"{args.vocab_size} is below GPT-2's {len(vocab)}; set the stages' prefix to 0")
        if prefix:
            model.prefix_ids = prefix_table(vocab, args.vocab_size).to(device)
        model.set_vocabulary(vocab)  # ngram_normalize's table
    orthogonalize, update, compiled, normalized = anvil_orthogonalize, adam_update, model, None
    row_update, segment = row_adam_update, segment_sum
    if args.ngram_plan_ahead and model.ngram_world > 1:  # every rank makes it, in the same order: a collective
        model.ngram_plan_group = dist.new_group()
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, recompile_limit(schedule))
        # Inductor's fusions capped at 32 input/output buffers: uncapped, the backward fuses every block's
        # scalar-gradient reductions with the bigram and embedding backward into one kernel of 80+ buffers,
        # ~2.7 ms per 49K-token micro-batch on an H100; capped, the stage-3 step is ~10 ms faster (bench/README)
        # set globally, not as the model's compile option: the backward compiles lazily, after the option's
        # scope has closed, and fails without it (pytorch/pytorch#178845); the optimizers' graphs take it too
        torch._inductor.config.cpp_wrapper = args.cpp_wrapper and device.type == "cuda"
        compiled = torch.compile(model, dynamic=False, fullgraph=True, options=dict(max_fusion_unique_io_buffers=32))
        orthogonalize = torch.compile(orthogonalize, dynamic=False, fullgraph=True)
        # muon_fused_normuon: NorMuon's normalization in the orthogonalization's graph
        normalized = torch.compile(normuon_orthogonalize, dynamic=False, fullgraph=True) \
            if args.muon_fused_normuon else None
        # dynamic=True: shapes, step sizes, decay rates and betas are arguments of one graph per dtype and
        # rank of parameter, not constants that recompile it for every tensor and every step
        update = torch.compile(adam_update, dynamic=True, fullgraph=True)
        # the n-gram table's row-sparse Adam and per-row gradient sums: one graph each for any number of rows
        row_update = torch.compile(row_adam_update, dynamic=True, fullgraph=True)
        segment = torch.compile(segment_sum, dynamic=True, fullgraph=True)
        if args.doc_copy:  # its matcher, run outside the model's graph in training (plan_copy_ahead)
            model.copy_matcher = torch.compile(doc_copy_candidates, dynamic=False, fullgraph=True)
    # the token tables' gradients summed sparsely (TableLookup), flushed on Adam's steps; with ngram_sparse_adam the
    # n-gram table's logged, room for an Adam step's lookups on this rank at the largest batch
    model.keep_table_grads(ngram_positions(schedule, world_size) if args.ngram_sparse_adam else 0, segment)
    if args.cuda_graphs and args.compile and device.type == "cuda":
        compiled = GraphRunner(model, compiled)
    return model, compiled, build_optimizers(model, args, rank, world_size, orthogonalize, update, row_update,
                                             segment, normalized), chosen


class GraphRunner:
    """--cuda_graphs: each training shape's forward and backward as one CUDA graph, replayed for every micro-batch
    of that shape (ANVIL2's forward/backward graph runners, record #92): the host launches one graph a micro-batch
    instead of the compiled graphs' hundreds of kernels. A shape's first micro-batch runs as usual (its compile,
    which also shows which parameters its backward gives gradients); its second is captured (torch.cuda.graph) and
    then replayed, as is every one after. What a replay reads and writes stays where it was at the capture:
    - the batch (with doc_copy's matches), the loss weights and the sweep offset: copied into the graph's own tensors
      before each replay;
    - the gradients: autograd adds into an existing .grad in place, so each parameter's gradient is a tensor the
      runner keeps, attached as .grad before each replay where something took it off (an optimizer's zero_grad:
      then it is zeroed first, one launch for all) and copied in where something put another there;
    - the n-gram log and a sharded table's row cache are fixed buffers (keep_table_grads, pull_ngram_rows); if one
      moves (the log grows), the graphs captured with it are dropped and their shapes captured again, each after one
      micro-batch run as usual: dynamo guards the buffers' sizes, so the first call after a move compiles anew, and a
      compile inside a capture fails (Inductor's passes call CUDA as a capture forbids: an H200, 2026-12-01).
    All graphs share one memory pool (a new one once every graph of the old is dropped). Evaluation calls the
    compiled model as usual (__call__). capture=False (the CPU tests): the same tensors and bookkeeping, the compiled
    model run on them instead of a replay."""

    def __init__(self, model: "GPT", compiled, capture: bool = True):
        self.model, self.compiled, self.capture = model, compiled, capture
        self.graphs: dict[tuple, tuple] = {}  # key -> (graph or None, its input tensors, its loss)
        self.ran: set[tuple] = set()  # keys (shape, buffer addresses) run once as usual: the next one is captured
        self.touched: dict[tuple, list[nn.Parameter]] = {}  # shape -> the parameters its backward gives gradients
        self.grads: dict[nn.Parameter, Tensor] = {}  # parameter -> the tensor its gradient accumulates in
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs captured so far (a test reads it)
        self.compiled_in_capture = 0  # captures during which dynamo compiled a graph anew (the warm-up logs it)

    def __call__(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def fixed(self) -> tuple[int, ...]:
        """The addresses a graph holds beyond its own tensors: the n-gram log's and the row cache's."""
        log, cache = self.model.ngram_log, self.model.ngram_cache
        return tuple(t.data_ptr() for t in (*log.values(), *(cache or ())))

    def attach(self, params: list[nn.Parameter]):
        """Each parameter's kept gradient tensor as its .grad, holding what .grad held (zero where it was None)."""
        cleared = []
        for p in params:
            kept = self.grads.get(p)
            if kept is None:  # the first: what autograd made becomes the kept tensor
                kept = self.grads[p] = p.grad if p.grad is not None else torch.zeros_like(p)
            elif p.grad is None:
                cleared.append(kept)
            elif p.grad is not kept:
                kept.copy_(p.grad)
            p.grad = kept
        if cleared:
            torch._foreach_zero_(cleared)

    def train_micro(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, max_doc_len: int,
                    windows: tuple[int, int], mtp: Tensor | None, prefix: Tensor | None, sampled,
                    copy_match: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """One training micro-batch's forward and backward (train_step's); returns its loss (the graph's tensor,
        overwritten by the next replay of that graph). copy_match: doc_copy's matches (take_copy_match), or None."""
        count, offset = sampled if sampled else (0, None)
        shape = (tuple(inputs.shape), tuple(cu_seqlens.shape), max_doc_len, tuple(windows), count,
                 None if mtp is None else mtp.numel(), None if prefix is None else prefix.numel(),
                 self.model.tied_embed)
        candidate, bucket = copy_match if copy_match is not None else (None, None)
        batch = dict(inputs=inputs, targets=targets, cu_seqlens=cu_seqlens, mtp=mtp, prefix=prefix, offset=offset,
                     candidate=candidate, bucket=bucket)
        if shape not in self.touched:  # compile: with every .grad held aside, to see which ones the backward makes
            params = [p for p in self.model.parameters() if p.requires_grad]
            held = [p.grad for p in params]
            for p in params:
                p.grad = None
            loss = self.forward_backward(batch, shape)
            self.touched[shape] = [p for p in params if p.grad is not None]
            self.ran.add(shape + (self.fixed(),))
            for p, before in zip(params, held):  # autograd's accumulation: added in place into what was there
                if before is not None:
                    p.grad = before if p.grad is None else before.add_(p.grad)
            return loss
        fixed = self.fixed()
        key = shape + (fixed,)
        if key not in self.graphs:
            kept = {k: v for k, v in self.graphs.items() if k[-1] == fixed}  # moved buffers: recapture
            if self.graphs and not kept and self.capture:  # the allocator refuses to capture into a pool whose
                self.pool = torch.cuda.graph_pool_handle()  # graphs are all gone (its use_count assert): a new one
            self.graphs = kept
            if key not in self.ran:  # moved buffers: run as usual once, where dynamo may compile for their new sizes
                self.ran.add(key)
                self.attach(self.touched[shape])
                return self.forward_backward(batch, shape)
            self.graphs[key] = self.record(shape, **batch)
        graph, static, loss = self.graphs[key]
        for name, t in batch.items():
            if t is not None:
                static[name].copy_(t, non_blocking=True)
        self.attach(self.touched[shape])
        if graph is not None:
            graph.replay()
            return loss
        return self.forward_backward(static, shape)

    def forward_backward(self, batch: dict, shape: tuple) -> Tensor:
        """The compiled model's forward and backward on one micro-batch's tensors (a shape's compile run, or a graph's
        own tensors: what a capture records); its loss, detached: no autograd graph may outlive its backward, or the
        capture's forward would find its parameters' AccumulateGrad nodes (made on another stream) alive and fail on
        their stream."""
        max_doc_len, windows, count = shape[2], shape[3], shape[4]
        # The Python wrapper, for the compile run and the capture alike: a replay launches no wrapper, the Python one
        # compiles quicker than the C++ one (which --cpp_wrapper keeps for the optimizers' graphs, called every
        # step), and a graph compiled during a capture must not be the C++ wrapper's, whose compile runs its kernels'
        # autotuning on the GPU (a capture refuses that: the record preset's first stage failed so on an H200)
        with torch._inductor.config.patch(cpp_wrapper=False):
            loss = self.compiled(batch["inputs"], batch["targets"], batch["cu_seqlens"], max_doc_len, windows,
                                 mtp_weights=batch["mtp"], prefix_weight=batch["prefix"],
                                 sampled=(count, batch["offset"]) if count else None,
                                 copy_match=None if batch["candidate"] is None else (batch["candidate"], batch["bucket"]))
            loss.backward()
        return loss.detach()

    def record(self, shape: tuple, **batch) -> tuple:
        """A shape's graph (captured, not run: the replay that follows runs it), its input tensors and its loss."""
        static = {name: None if t is None else t.clone() for name, t in batch.items()}
        inputs = batch["inputs"]
        if not self.capture:
            return None, static, None
        touched = self.touched[shape]
        self.attach(touched)
        others = [p for p in self.model.parameters() if p.requires_grad and p.grad is None]
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may call CUDA while this one captures (the loader's pins its next batches, NCCL's
        # watchdog queries events); "global" would make their potentially unsafe calls fail (CUDA's stream capture
        # modes). The backward, issued from autograd's thread onto the capturing stream, is captured either way.
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                loss = self.forward_backward(static, shape)
        except RuntimeError as e:  # CUDA's capture errors included (torch.AcceleratorError)
            raise RuntimeError(f"--cuda_graphs: capturing the forward and backward of a {inputs.numel():,}-token "
                               f"micro-batch failed ({str(e).splitlines()[0]}); run with --cuda_graphs false") from e
        if any(p.grad is not self.grads[p] for p in touched) or any(p.grad is not None for p in others):
            raise RuntimeError("--cuda_graphs: the captured backward did not add into the kept gradients as the "
                               "compile's run did; run with --cuda_graphs false")
        self.captures += 1
        # a guard that failed on the graph's own tensors: a second compile of the shape (TORCH_LOGS=recompiles)
        self.compiled_in_capture += torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before
        return graph, static, loss


def train_step(model: GPT, compiled, optimizers, micro, step: int, stage: Stage, schedule: Schedule,
               ahead: list | None = None) -> Tensor:
    """One optimizer step over this rank's micro-batches, in a stage of the schedule (the step's own, or in the
    warm-up a shape to compile); returns the summed loss (on the device), with multi-token prediction's extra
    terms when the stage has them. Muon steps every step; Adam on every adam_every-th (step + 1 a multiple of
    it), its parameters' gradients summed until then. ahead: the next step's micro-batches on the host
    (BatchLoader.peek), whose first pull ngram_plan_ahead plans, and whose first matches doc_copy finds, during this
    step's last forward and backward."""
    device = model.lm_head_w.device
    loss = torch.zeros((), device=device)
    copying = model.cfg.doc_copy  # its matches found a micro-batch ahead (plan_copy_ahead)
    marking = (model.ngram_plan_group is not None or copying) and device.type == "cuda"  # side streams' work ahead
    # multi-token prediction's and the prefix-token loss' weights as one tensor (one graph per stage whatever
    # the values), pinned: no sync
    w, n = stage.loss_weights(step), len(stage.mtp_ramp)
    weights = torch.tensor(w, pin_memory=device.type == "cuda").to(device, non_blocking=True) if w else None
    mtp, prefix = (weights[:n] if n else None), (weights[n:] if len(w) > n else None)
    count = schedule.candidates_at(step, stage)  # the sampled softmax's rows, its sweep's offsets as a tensor: no sync
    offsets = torch.tensor(sweep_offsets(step, len(micro), count, model.cfg.vocab_size), pin_memory=device.type ==
                           "cuda").to(device, non_blocking=True) if count else None
    model.note_token_lookups()
    for m, (inputs, targets, cu_seqlens) in enumerate(micro):
        mark = torch.cuda.Event() if marking else None  # before this forward: what a plan made during it may read
        if mark is not None:
            mark.record()
        model.reserve_ngram_log(inputs.numel())
        model.take_planned_flush((step, m))
        planned = model.ngram_flush_plan is not None and model.ngram_flush_plan[0] == model.ngram_logged
        if m == len(micro) - 1 and schedule.tables_step_at(step) and not planned:  # the flush's host sync, before
            model.plan_ngram_flush(inputs, cu_seqlens)                                # the last forward
        # a sharded n-gram table: this micro-batch's rows, as last updated
        model.pull_ngram_rows(inputs, cu_seqlens, training=True, key=(step, m))
        batch = (inputs, targets, cu_seqlens, stage.spec.max_doc_len, stage.windows)
        sampled = (count, offsets[m]) if count else None
        match = model.take_copy_match((step, m), inputs, cu_seqlens) if copying else None
        if isinstance(compiled, GraphRunner):  # --cuda_graphs: forward and backward in one replay
            micro_loss = compiled.train_micro(*batch, mtp, prefix, sampled, match)
        else:
            micro_loss = compiled(*batch, mtp_weights=mtp, prefix_weight=prefix, sampled=sampled, copy_match=match)
            micro_loss.backward()
        loss += micro_loss.detach()
        # while the GPU runs this micro-batch: the next one's copy matches (doc_copy), first (the pull's plan below
        # waits on the host for its counts); ngram_plan_ahead: its pull, and the flush's where that one is the last
        # of a table step
        last = m + 1 == len(micro)
        key, nxt, micros = ((step + 1, 0), ahead and ahead[0], len(ahead or ())) if last else ((step, m + 1),
                                                                                              micro[m + 1], len(micro))
        if nxt and copying:
            model.plan_copy_ahead(key, nxt[0], nxt[2], mark)
        if nxt and model.ngram_plan_group is not None:
            flush = (last and schedule.tables_step_at(step), inputs, cu_seqlens) \
                if key[1] == micros - 1 and schedule.tables_step_at(key[0]) else None
            model.plan_pull_ahead(key, nxt[0], nxt[2], mark, flush)
    adam, muon = optimizers
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * schedule.lr_factor(step, stage)
            if group.get("tables"):
                group["betas"], group["weight_decay"] = schedule.table_adam_settings(step, group)
    for group in muon.param_groups:
        group["momentum"] = schedule.momentum(step)
        group["fast_beta"], group["fast_weight"] = schedule.anvil_rails(step)
    stepping = (muon, adam) if schedule.adam_steps_at(step) else (muon,)
    if adam in stepping:
        model.flush_table_grads(schedule.tables_step_at(step))  # the token tables' gradients summed since their last step
    # Communication overlapped with the optimizers' math: every reduce-scatter is launched before any update
    # (Muon's first: its orthogonalization is the longest math, so it can start soonest), each update waits
    # only on its own parameters' reduce, and the all-gathers are waited on last (as the public code orders
    # its reduces and updates since its record of 2026-01-18)
    reduces = [opt.launch_reduce() for opt in stepping]
    gathers = [opt.apply_updates(pending) for opt, pending in zip(stepping, reduces)]
    for opt, launched in zip(stepping, gathers):
        opt.finish(launched)
    for opt in stepping:  # Adam's gradients otherwise wait for its step
        opt.zero_grad(set_to_none=True)
    return loss


def evaluate(model: GPT, compiled, val, windows: tuple[int, int], args: Hyperparameters, world_size: int) -> float:
    """Mean loss per token over the whole validation set (all ranks)."""
    model.eval()
    # validation is untimed: its graphs keep the Python wrapper, quicker to compile than the C++ one (--cpp_wrapper)
    with torch.no_grad(), torch._inductor.config.patch(cpp_wrapper=False):
        total = torch.zeros((), device=model.lm_head_w.device)
        pulls = 0
        for inputs, targets, cu_seqlens in val:
            model.pull_ngram_rows(inputs, cu_seqlens)  # a sharded n-gram table: the buffer's rows from their owners
            pulls += 1
            # a document may run the whole buffer: max_seqlen is the buffer length
            total += compiled(inputs, targets, cu_seqlens, args.val_seq_len, windows, reduction="sum")
        if model.ngram_world > 1:  # ranks with fewer buffers than another serve its last pulls
            most = torch.tensor(pulls, device=total.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            model.serve_ngram_pulls(int(most) - pulls)
            model.ngram_cache = None
    if world_size > 1:
        dist.all_reduce(total)
    model.train()
    return total.item() / args.val_tokens


def warmup(model: GPT, compiled, optimizers, producer: BatchProducer, val, schedule: Schedule, world_size: int,
           log=lambda msg: None):
    """Untimed warm-up: compile the training graphs of every distinct stage shape on real batches
    (warmup_steps optimizer steps each) and the validation graphs the run will use (Schedule.validation_graphs:
    with val_every 0 only the final one's), then restore the initial weights and optimizer state exactly. The
    producer is a fresh one: the timed run starts from the same data. Logs each shape as it is done (a cold compile
    takes minutes)."""
    args, untie, shapes = schedule.args, schedule.untie, schedule.warmup_shapes()
    graphs = schedule.validation_graphs()
    # the initial weights, kept to restore; one that is all zeros is zeroed again rather than copied (the n-gram
    # table starts at zero: a copy of 21M rows would take another 30 GiB of the GPU)
    initial_model = {name: v.detach().clone() if v.any() else None for name, v in model.state_dict().items()}
    initial_opts = [copy_state_dict(opt.state_dict()) for opt in optimizers]
    loader = BatchLoader(producer, schedule.warmup_spec_at, model.lm_head_w.device)
    t0 = time.perf_counter()
    log(f"warm-up: compiling {len(shapes)} stage shape(s) and {len(graphs)} validation graph(s)"
        f"{' with the C++ wrapper' if torch._inductor.config.cpp_wrapper and not isinstance(compiled, GraphRunner) else ''}"
        f"; minutes each on a cold compile "
        "cache")
    try:
        for n, stage in enumerate(shapes, 1):
            tie_embedding_at(model, stage.start, untie)  # its graphs are compiled with the embedding it trains with
            for i in range(args.warmup_steps):
                train_step(model, compiled, optimizers, loader.next()[1], i, stage, schedule)
            model.zero_table_grads()  # gradients of steps after the shape's last Adam step: the n-gram log would grow
            anew = compiled.compiled_in_capture if isinstance(compiled, GraphRunner) else 0
            log(f"warm-up: shape {n}/{len(shapes)} (stage from step {stage.start}: {stage.spec.batch_size:,} tokens, "
                f"windows {stage.windows[0]}/{stage.windows[1]} tokens) done at {time.perf_counter() - t0:.0f}s"
                + (f"; {anew} capture(s) so far compiled anew (TORCH_LOGS=recompiles names why)" if anew else ""))
        for (windows, _), step in graphs.items():  # each tied as the first validation that uses it
            tie_embedding_at(model, step, untie)
            evaluate(model, compiled, val, windows, args, world_size)
    finally:
        loader.close()
        tie_embedding_at(model, 0, untie)
    model.zero_grad(set_to_none=True)  # Adam's gradients summed for a step that never came
    model.zero_table_grads()  # (and the tables' sums)
    with torch.no_grad():
        for name, v in model.state_dict().items():
            v.copy_(initial_model[name]) if initial_model[name] is not None else v.zero_()
    for opt, state in zip(optimizers, initial_opts):
        opt.load_state_dict(state)


class Clock:
    """Training time: it runs only inside the timed region. stop() and start() bracket what is not
    training (validation, checkpoints), each after waiting for the GPU to finish its queued work."""

    def __init__(self, device: torch.device, ms: float = 0.0):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.ms, self.t0 = ms, None

    def start(self):
        self.sync()
        self.t0 = time.perf_counter()

    def stop(self):
        self.sync()
        self.ms += 1000 * (time.perf_counter() - self.t0)
        self.t0 = None

    def read_ms(self) -> float:
        """Training time so far, without waiting for the GPU (approximate while steps are queued)."""
        return self.ms + (1000 * (time.perf_counter() - self.t0) if self.t0 is not None else 0.0)


# Endgame weight averaging (public record ANVIL2, modded-nanogpt #92): last steps' weight averages blended into the model
class WeightAverage:
    """--weight_average window,blend[,tail[,renorm]]. Over the last W = round(window x num_iterations) steps, after
    each step: an EMA of the weights at rate 2 / (W + 1), and with tail > 0 a shorter EMA of span
    T = round(tail x num_iterations), at rate 2 / (T + 1). Both are seeded by a copy at the window's first step.
    ANVIL2: W = 298 of its 1194 steps; its tail average moves 4/53 every 4th step, a span of about 102 steps.
    At the end, inside the timed region as in ANVIL2, each averaged weight becomes lerp(base, EMA, blend). The base
    is the tail EMA, or the live weight without one (ANVIL2: 0.65 over live for the embedding and head, 0.55 over
    live for Q/K, 0.35 over the tail for V/O and the MLP). With renorm 1 (the default) each weight is then scaled
    back to its Frobenius norm before the ship: ANVIL2's decontraction, which ANVIL2 applies per bank.
    Averaged, as ANVIL2's ships are: the token embedding (it tracks the LM head's rows while tied, as ANVIL2's
    copy of the head does), the value tables, the LM head, and the blocks' attention and MLP matrices. Not averaged:
    the bigram table, the scalars, the gates, MUDD and the copy pointer. Each rank averages its 1/world_size share of
    every weight's elements (as ANVIL2's ranks do their shards); the ship all-gathers the shares.
    Checkpoints keep the averages through the optimizers' protocol (state_dict, load_state_dict, reshard,
    param_groups). The trainer lists this object after the two optimizers in what it saves and loads, so a resume
    inside the window goes on exactly as before, on any number of processes."""

    param_groups = ()  # no settings for load_checkpoint to carry over from this run

    def __init__(self, model: nn.Module, args: Hyperparameters, rank: int = 0, world_size: int = 1, log=print,
                 params: list[nn.Parameter] | None = None):
        values = tuple(args.weight_average)
        if not 2 <= len(values) <= 4:
            raise ValueError(f"--weight_average {cli_text(values)}: window,blend[,tail[,renorm]] (near ANVIL2's: "
                             "0.25,0.55,0.085,1)")
        window, blend, tail, renorm = values + (0.0, 1.0)[len(values) - 2:]
        if not (0 < window <= 1 and 0 <= blend <= 1 and 0 <= tail <= 1 and renorm in (0, 1)):
            raise ValueError(f"--weight_average {cli_text(values)}: window in (0, 1] and tail in [0, 1] (fractions of "
                             "num_iterations; tail 0: no tail average), blend in [0, 1], renorm 0 or 1")
        self.model, self.rank, self.world_size, self.log = model, rank, world_size, log
        self.N, self.blend, self.renorm = args.num_iterations, blend, bool(renorm)
        W, T = max(1, round(window * self.N)), (max(1, round(tail * self.N)) if tail else 0)
        self.first = self.N - W + 1  # steps done at the first tick: the weights after the last W steps
        self.rates = {"ema": 2 / (W + 1), **({"tail": 2 / (T + 1)} if T else {})}
        self.avgs: dict[str, list[Tensor]] = {key: [] for key in self.rates}  # this rank's shares, float32
        self.params = list(params) if params is not None else self.averaged(model)
        self.tied = (model.embed.weight, model.lm_head_w) if isinstance(model, GPT) else None
        share = sum(hi - lo for lo, hi, _ in (self._span(p.numel()) for p in self.params))
        log(f"weight_average: EMA of the last {W} steps (steps {self.first}-{self.N}, rate {self.rates['ema']:.5f})"
            + (f", tail EMA of span {T} (rate {self.rates['tail']:.5f})" if T else "")
            + f"; shipped as lerp({'tail' if T else 'live'}, EMA, {blend:g}){', renormed' if renorm else ''}: "
            f"{sum(p.numel() for p in self.params) / 1e6:.1f}M weights, {share / 1e6:.1f}M on this rank")

    @staticmethod
    def averaged(model: GPT) -> list[nn.Parameter]:
        groups = param_groups_by_role(model)
        matrices = [p for name, p in model.blocks.named_parameters()
                    if name.endswith(("qkvo_w", "qk_w", "vo_w", "fc_w", "proj_w"))]
        return [*groups["token embedding"], *groups["value embeddings"], *groups["LM head"], *matrices]

    def _span(self, n: int) -> tuple[int, int, int]:
        """This rank's elements [lo, hi) of a flattened weight of n, and the chunk (a multiple of 16) ranks own."""
        chunk = -(-n // (16 * self.world_size)) * 16
        lo = min(self.rank * chunk, n)
        return lo, min(lo + chunk, n), chunk

    def _unused(self, p: nn.Parameter) -> bool:  # the token embedding while tied: the model reads the head's rows
        return self.tied is not None and self.model.tied_embed and p is self.tied[0]

    @torch.no_grad()
    def tick(self, step: int):
        """After `step` steps: inside the window, every average seeded with (first tick) or moved toward this rank's
        share of each weight."""
        if not self.first <= step <= self.N:
            return
        for i, p in enumerate(self.params):
            lo, hi, _ = self._span(p.numel())
            x = (self.tied[1] if self._unused(p) else p).detach().view(-1)[lo:hi].float()
            for key, rate in self.rates.items():
                if len(self.avgs[key]) <= i:
                    self.avgs[key].append(x.clone())
                else:
                    self.avgs[key][i].lerp_(x, rate)

    @torch.no_grad()
    def ship(self):
        """Each averaged weight <- lerp(base, EMA, blend), on this rank's share, all-gathered; then with renorm back to
        its norm before the ship. The averages are dropped: the next checkpoint holds the shipped weights alone."""
        ema, tail = self.avgs["ema"], self.avgs.get("tail")
        if not ema:
            return
        shipped = [(i, p) for i, p in enumerate(self.params) if not self._unused(p)]
        before = [p.detach().float().norm() for _, p in shipped] if self.renorm else []
        for i, p in shipped:
            flat, (lo, hi, chunk) = p.detach().view(-1), self._span(p.numel())
            base = tail[i] if tail else flat[lo:hi].float()
            flat[lo:hi].copy_(torch.lerp(base, ema[i], self.blend))
            if self.world_size > 1:
                out = flat.new_empty(chunk * self.world_size)
                dist.all_gather_into_tensor(out, F.pad(flat[lo:hi], (0, chunk - (hi - lo))))
                flat.copy_(out[:flat.numel()])
        if self.renorm:  # the ratios as Python floats: each weight rounds once, as ANVIL2's decontraction does
            after = torch.stack([p.detach().float().norm() for _, p in shipped])
            for (_, p), ratio in zip(shipped, torch.where(after > 0, torch.stack(before) / after, 1.0).tolist()):
                p.detach().mul_(ratio)
        self.avgs = {key: [] for key in self.rates}

    def at(self, step: int, clock: Clock, evaluate_live):
        """The training loop's call, `step` steps done, before that step's validation: the tick; after the last step,
        the live weights' validation (untimed, logged as val_loss_live: the paired difference) and the ship (timed)."""
        self.tick(step)
        if step == self.N and self.avgs["ema"]:
            clock.stop()
            self.log(f"step:{step}/{self.N} val_loss_live:{evaluate_live():.4f} (untimed diagnostic: the weights "
                     "before the weight_average ship; the val_loss line that follows is the shipped weights')")
            clock.start()
            self.ship()

    def state_dict(self) -> dict:
        return {key: list(shares) for key, shares in self.avgs.items()}

    def load_state_dict(self, state: dict):
        for key in self.rates:  # an average the checkpoint lacks starts again at the next tick
            shares = state.get(key, [])
            if shares and len(shares) != len(self.params):
                raise ValueError(f"the checkpoint's weight average holds {len(shares)} weights; this model averages "
                                 f"{len(self.params)}")
            self.avgs[key] = [t.to(self.params[0].device, torch.float32) for t in shares]

    def reshard(self, shards: list[dict]) -> dict:
        """This rank's averages from every rank's of a run on len(shards) processes: each weight's shares joined
        in rank order, then cut for this world size."""
        state = {}
        for key in self.rates:
            ranks = [shard.get(key, []) for shard in shards]
            whole = all(len(r) == len(self.params) for r in ranks)  # else load_state_dict refuses or starts again
            state[key] = [torch.cat([r[i] for r in ranks])[slice(*self._span(p.numel())[:2])]
                          for i, p in enumerate(self.params)] if whole else ranks[0]
        return state


@dataclass
class RunResult:
    train_losses: list[float]  # mean loss per token of each step this run made, all ranks
    val_losses: list[tuple[int, float]]  # (step, validation loss)
    train_time_ms: float
    log_path: str | None
    first_step: int = 0  # a resumed run starts after its checkpoint's step
    checkpoint: str | None = None  # the last checkpoint written
    interrupted: int = 0  # the signal (SIGTERM / SIGINT) that stopped the run after saving a checkpoint
    stage_ms: list = dataclasses.field(default_factory=list)  # (stage number, first step, steps, training ms, softmax rows)


class LossWatch:
    """Per-step losses copied to the host without blocking; read once the GPU has produced them,
    so figures and the non-finite check never add a device->host synchronisation."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: deque = deque()
        self.latest: tuple[int, float] | None = None
        self.failure: FloatingPointError | None = None  # the first non-finite loss: the ranks agree on it, then stop

    def push(self, step: int, loss: Tensor, tokens: int):
        host = torch.empty((), pin_memory=self.cuda)
        host.copy_(loss, non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, host, event, tokens))

    def newest(self, checkpoint) -> tuple[int, float] | None:
        """(step, mean loss per token on this rank) of the newest step the GPU has finished; a
        non-finite loss becomes `failure`, naming the step and the last good checkpoint."""
        while self.failure is None and self.pending and (self.pending[0][2] is None or self.pending[0][2].query()):
            step, host, _, tokens = self.pending.popleft()
            if math.isfinite(host.item()):
                self.latest = (step, host.item() / tokens)
            else:
                self.failure = FloatingPointError(
                    f"loss is {host.item() / tokens} at step {step}: stopping. " +
                    (f"Last good checkpoint: {checkpoint} (continue from it, e.g. with a lower learning rate: "
                     f"--resume {checkpoint} --muon_lr ...)" if checkpoint else
                     "No checkpoint to continue from (save them with --save_every N)"))
        return self.latest


class Figures:
    """The every-log_every-steps line: loss of the newest finished step, tokens/s, MFU, memory."""
    LEGEND = ("train_loss (mean per token)@the newest finished step, tokens/s, mfu (model FLOPs / peak), "
              "step_ms, mem (allocated/reserved)")

    def __init__(self, model: GPT, device: torch.device, peak: float | None, world_size: int, step: int):
        self.model, self.device, self.peak, self.world_size = model, device, peak, world_size
        self.restart(step)

    def restart(self, step: int):  # after anything untimed
        self.t, self.tokens = time.perf_counter(), 0
        self.step = step

    def line(self, step: int, stage: Stage, latest) -> str:
        now = time.perf_counter()
        tokens_per_s = self.tokens / max(now - self.t, 1e-9)
        flops = flops_per_token(self.model, stage.windows, stage.spec.max_doc_len)
        mfu = f"{100 * flops * tokens_per_s / (self.peak * 1e12 * self.world_size):.1f}%" if self.peak else "n/a"
        mem = (f"{torch.cuda.memory_allocated() / 2**30:.1f}/{torch.cuda.memory_reserved() / 2**30:.1f}GiB"
               if self.device.type == "cuda" else "n/a")
        loss = f"{latest[1]:.4f}@step{latest[0]}" if latest else "pending"  # the newest finished step
        text = (f"train_loss:{loss} tokens/s:{tokens_per_s:,.0f} mfu:{mfu} "
                f"step_ms:{1000 * (now - self.t) / max(step - self.step, 1):.1f} mem:{mem}")
        self.restart(step)
        return text


def no_gpu_reason() -> str:
    """Why torch sees no GPU, and what to do: one line."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:  # torch explains a failed CUDA start in a warning
        warnings.simplefilter("always")
        torch.cuda.is_available()
    why = " ".join(str(seen[-1].message).split()) if seen else ""
    build = (f"this PyTorch ({torch.__version__}) is a CPU-only build" if torch.version.cuda is None else
             f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU" + (f": {why}" if why else
             " (no NVIDIA driver, a driver older than the build needs, or CUDA_VISIBLE_DEVICES hides them)"))
    return (f"no usable GPU: {build}. Install the PyTorch build for this machine's driver (README, Set-up), or "
            "run on the CPU on purpose with --device cpu (the smoke preset does so by itself)")


def start_processes(args: Hyperparameters) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process under torchrun (or alone), process group joined."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    num_slots = args.batch_size // args.seq_len
    if num_slots % world_size:
        raise ValueError(f"world_size={world_size} must divide the {num_slots} micro-batches of a step "
                         f"(batch_size/seq_len): use 1, 2, 4 or 8 GPUs with the default batch")
    device = torch.device("cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(no_gpu_reason())
    if args.device != "cpu" and torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs are visible: "
                             "lower --nproc_per_node")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1:
        # NCCL's watchdog can itself get stuck aborting a timed-out collective while this rank is still
        # queueing work; its heartbeat monitor then ends the process after this many seconds (default 480)
        os.environ.setdefault("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(math.ceil(args.collective_timeout_s)))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=args.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return rank, world_size, device


def changed_fields(saved: dict, args: Hyperparameters) -> list[str]:
    """'field: checkpoint value -> this run's' for each hyperparameter that differs from the one the
    checkpoint was written with (saved: its model.pt's args; the checkpoint and run id aside)."""
    saved = stored_args(saved)
    return [f"{k}: {cli_text(v)} -> {cli_text(getattr(args, k))}" for k, v in saved.items()
            if k not in ("resume", "run_id") and hasattr(args, k) and v != getattr(args, k)]


def name_run(args: Hyperparameters, world_size: int) -> tuple[Hyperparameters, Path | None, list[str] | None]:
    """The run id, the checkpoint to resume and, for a new run started from a checkpoint, why it is new.
    A resume never changes the run it starts from: with the same hyperparameters, from that run's newest
    checkpoint and into its own folder, it continues the run (same id, folder and log); otherwise
    (changed flags, or an earlier checkpoint, whose run already went on) it is a new run with a new id
    whose log names its parent. A new run never writes into a folder that holds checkpoints, nor into
    an existing log. A checkpoint with no step left to train is refused before anything is written."""
    resume = find_checkpoint(args.resume, args.checkpoint_dir) if args.resume else None
    branch = None
    if resume is not None:
        meta = read_checkpoint_file(resume / "model.pt")
        step, N = meta["step"], args.num_iterations
        if step >= N:  # a finished run: resuming it would only append an empty "resumed ... finished" block
            done = f" (run {resume.parent.name} finished there)" if step == meta["args"]["num_iterations"] else ""
            raise ValueError(f"--resume {resume}: nothing to train: the checkpoint is at step {step} and "
                             f"num_iterations is {N}{done}; to train further, resume with --num_iterations above "
                             f"{step} (a new run)")
        branch = changed_fields(meta["args"], args)
        newest = sorted(resume.parent.glob("step_??????"))[-1]
        if newest != resume:
            branch.append(f"{resume.parent} went on to {newest.name}")
        if (Path(args.checkpoint_dir) / (args.run_id or resume.parent.name)).resolve() != resume.parent.resolve():
            branch.append(f"checkpoints go to {Path(args.checkpoint_dir) / (args.run_id or '<new id>')}")
        if not branch:
            args, branch = dataclasses.replace(args, run_id=resume.parent.name), None
    if not args.run_id:
        run_id = [str(uuid.uuid4())]
        if world_size > 1:
            dist.broadcast_object_list(run_id, src=0)
        args = dataclasses.replace(args, run_id=run_id[0])
    folder = Path(args.checkpoint_dir) / args.run_id
    if (resume is None or branch is not None) and any(folder.glob("step_??????")):
        raise ValueError(f"--run_id {args.run_id}: {folder} already holds checkpoints of another run (or of this "
                         "one before the changes); leave --run_id out for a new id, or name another")
    log_file = Path(args.log_dir) / f"{args.run_id}.txt"  # Logger's path
    if (resume is None or branch is not None) and log_file.exists():  # a new run: its log would follow another's
        raise ValueError(f"--run_id {args.run_id}: {log_file} already holds another run's log; leave --run_id out "
                         "for a new id, or name another (a log goes on only when --resume continues its run from "
                         "the run's newest checkpoint)")
    if world_size > 1:  # every rank checks before rank 0 goes on to write the log and checkpoints (it may be first)
        dist.barrier()
    return args, resume, branch


# In a log, the line before the source of each file this one imports (this file's own source comes first)
KERNELS_MARKER = "# ---------- kernels.py, imported by the code above ----------"
SHARDS_MARKER = "# ---------- data/shards.py, imported by the code above ----------"


def log_header(log: Logger, args: Hyperparameters, device: torch.device, resume: Path | None,
               branch: list[str] | None = None):
    """A new log starts with the code that made the run, the environment and every hyperparameter; a
    continued run's log is marked where it resumed, and a run started from another's checkpoint says
    which and what changed."""
    if resume is not None and branch is None and log.path and os.path.exists(log.path):
        log(f"resuming from {resume}")
        return
    if resume is not None:
        log(f"a new run from {resume} (run {resume.parent.name}); changed: {'; '.join(branch or ['nothing'])}")
    log(Path(__file__).read_text().rstrip("\n"), console=False)
    log(f"{KERNELS_MARKER}\n{Path(kernels.__file__).read_text().rstrip()}", console=False)
    log(f"{SHARDS_MARKER}\n{Path(shard_format.__file__).read_text().rstrip()}", console=False)
    log("=" * 100, console=False)
    log(environment_report(device), console=False)
    log("=" * 100, console=False)
    for f in dataclasses.fields(args):  # the stages table as --stages writes it
        log(f"{f.name}: {cli_text(args.stages) if f.name == 'stages' else getattr(args, f.name)}", console=False)


def prepare_data(args: Hyperparameters, rank: int, world_size: int, device: torch.device, log):
    """Training shards (every header checked now, not when the loader reaches it) and this rank's
    validation batches on the device; the smoke preset's synthetic corpus written first."""
    if args.markov_corpus:
        smoke_folder = Path(DATA_PATH, "data/smoke").resolve()
        for flag, pattern in (("train_files", args.train_files), ("val_files", args.val_files)):
            folder = Path(pattern).parent
            if not Path(pattern).name.startswith("markov_"):  # a synthetic file is never named like real data
                raise ValueError(f"--{flag} {pattern}: the synthetic corpus (--markov_corpus) is written only to "
                                 "files named markov_*; to train on these shards add --markov_corpus false")
            if not folder.is_dir() and folder.resolve() != smoke_folder:  # user paths are read, never created
                raise ValueError(f"--{flag} {pattern}: no folder {folder}; the synthetic corpus goes into an existing "
                                 f"folder or the smoke preset's own {smoke_folder}")
        if rank == 0:  # its tokens are 0..bos_id, BOS the last (as GPT-2's); the floor is that chain's
            floor = write_markov_corpus(args.train_files, args.val_files, args.bos_id + 1, args.bos_id, args.val_tokens)
            log(f"data: synthetic Markov-chain corpus, entropy floor {floor:.4f} nats/token (uniform: "
                f"{math.log(args.vocab_size - 1):.4f}): no model can go below the floor")
        barrier(world_size)
    train_files = shard_files(args.train_files, "training")
    for f in train_files:
        read_shard_header(f)
    val = [tuple(t.to(device) for t in b) for b in validation_batches(
        args.val_files, args.val_tokens, args.val_seq_len, args.bos_id, rank, world_size)]
    return train_files, val


class RankLost(ConnectionError):
    """Another rank stopped answering the per-step exchange: it died, or hangs past collective_timeout_s."""


def agree(stop: bool, failure: Exception | None, control) -> bool:
    """Every rank's stop flag and failure (a non-finite loss, the data breaking) in one small all-reduce
    on a CPU group, which never waits for the GPU. True if any rank was signalled; if any rank failed,
    every rank raises the first failing rank's error, naming that rank, so all stop at the same step."""
    if control is None:
        if failure is not None:
            raise failure
        return stop
    t = torch.zeros(1 + control.size())
    t[0], t[1 + control.rank()] = stop, failure is not None
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
    except RuntimeError as e:  # gloo: a timeout, or the connection closed by a process that ended
        raise RankLost(f"rank {control.rank()}: another rank stopped answering (it died, or hangs longer than "
                       f"--collective_timeout_s; its own output says why): {str(e).splitlines()[0]}") from e
    if t[1:].any():  # only now do the failing ranks send their errors
        errors = [None] * control.size()
        dist.all_gather_object(errors, failure, group=control)
        first, *more = [r for r, e in enumerate(errors) if e is not None]
        also = f" (rank{'s' * (len(more) > 1)} {', '.join(map(str, more))} too)" if more else ""
        raise type(errors[first])(f"rank {first}{also}: {errors[first]}") from failure
    return bool(t[0])


def stop_on_signals() -> tuple[list[int], dict]:
    """SIGTERM / Ctrl-C only set a flag: the loop finishes its step, saves and stops (ranks agree
    through a small all-reduce on a CPU group, which never waits for the GPU)."""
    stop_signals: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, lambda signum, frame: stop_signals.append(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
    return stop_signals, handlers


def next_batches(loader: BatchLoader, step: int) -> tuple[list | None, ShardError | None]:
    """This step's micro-batches, or the error if the data broke mid-run (a shard damaged or gone
    since the start-up checks, a micro-batch of this rank's over max_num_docs): the ranks agree on it
    before any of them runs the step."""
    try:
        return loader.next()[1], None
    except (ValueError, OSError, EOFError) as e:  # ShardError is a ValueError
        error = ShardError(f"data error at step {step + 1}: {e}")
        error.__cause__ = e
        return None, error


class RunControl:
    """Everything around the timed loop that is not training: the stop signals, the ranks' agreement to go on
    (a non-finite loss, the data breaking on a rank), the checkpoint cadence and the checkpoints themselves, each
    outside the clock. The loop asks `go(step)` before each step."""

    def __init__(self, args: Hyperparameters, model, optimizers, loader: BatchLoader, clock: Clock,
                 watch: LossWatch, figures: Figures, rank: int, world_size: int, first_step: int, log):
        self.args, self.model, self.optimizers, self.loader, self.clock = args, model, optimizers, loader, clock
        self.watch, self.figures, self.rank, self.world_size, self.first_step, self.log = (
            watch, figures, rank, world_size, first_step, log)
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=args.collective_timeout_s))
                      if world_size > 1 else None)
        self.signals, self.handlers = stop_on_signals()  # last: close() restores the handlers
        self.checkpoint, self.interrupted = None, 0

    def line_up(self):
        """Every rank waits here for the others (one all-reduce on the CPU group: no GPU wait): called just before
        the clock starts, so that no rank's clock counts another rank's last untimed work (without it, rank 0's clock
        once read 0.82 s before the first step on two H100s, against 2 ms on one)."""
        agree(False, self.watch.failure, self.group)

    def save(self, step: int, data_state: dict) -> Path | None:
        """A checkpoint of `step` steps, written once every rank's losses so far are known finite (the GPU
        synchronised first, so every loss is in): the last good checkpoint a failure names is good. None, and a
        log line saying why, where its disk lacks the room (checkpoint_room)."""
        self.clock.sync()
        self.watch.newest(self.checkpoint)
        agree(False, self.watch.failure, self.group)
        if short := checkpoint_room(step, self.model, self.optimizers, self.args, self.rank, self.group):
            self.log(short)
            return None
        self.checkpoint = save_checkpoint(step, self.model, self.optimizers, data_state, self.clock.ms, self.args,
                                          self.rank, self.world_size)
        return self.checkpoint

    def go(self, step: int) -> list | None:
        """`step` steps done: the ranks agree to go on, a checkpoint is written if due (outside the clock), then
        step + 1's micro-batches (None after the last step, or once stopped: `interrupted` says by what)."""
        args, N = self.args, self.args.num_iterations
        data_state = self.loader.state  # the data position after `step` steps: what a checkpoint made now holds
        micro, failure = next_batches(self.loader, step) if step < N else (None, None)
        try:
            stop = agree(bool(self.signals), self.watch.failure or failure, self.group)
        except ShardError as e:  # the data broke on a rank: every rank saves the steps done, then stops
            # (a gradient summed for Adam's next step, adam_every > 1, is not in the checkpoint)
            self.clock.stop()
            if self.save(step, data_state) is None:
                raise ShardError(f"{e}. No checkpoint of step {step} (no room: see the line above)") from e
            raise ShardError(f"{e}. Saved {self.checkpoint}; once the data is fixed, continue with: "
                             f"{resume_command(self.checkpoint, self.world_size)}") from e
        if stop and step % table_adam_period(args, step - 1) and step < N:  # summed gradients are not checkpointed:
            stop = False  # stop after Adam's (and the tables') next step (every rank defers alike: the flag is agreed)
        if step > self.first_step and (stop or (args.save_every > 0 and step % args.save_every == 0 and step < N)):
            self.clock.stop()  # checkpoints are not timed
            if saved := self.save(step, data_state):
                self.log(f"checkpoint: {saved}")
            self.clock.start()
            self.figures.restart(step)
            if stop:
                self.interrupted = self.signals[0] if self.signals else signal.SIGTERM
                self.log(f"stopped by signal after step {step}; " + (
                    f"continue with: {resume_command(self.checkpoint, self.world_size)}" if self.checkpoint else
                    "no checkpoint was written"))
                return None
        return micro

    def finish(self):
        """The final checkpoint (--save_every > 0), unless a signal stopped the run (it saved already)."""
        if self.args.save_every > 0 and not self.interrupted:
            if saved := self.save(self.args.num_iterations, self.loader.state):
                self.log(f"checkpoint: {saved}")

    def close(self):
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)


def stage_times(schedule: Schedule, marks: list[tuple[int, float]], step: int,
                train_ms: float) -> list[tuple[int, int, int, float, int]]:
    """(stage number from 1, first step, steps, training ms, softmax rows: candidates or 0 for the full softmax) of
    each stage this run trained in, a stage that switches to the full softmax as two parts, from the training time
    at each part's first step (`marks`) and at the last step done (`step`, `train_ms`)."""
    parts = []
    for (a, ms_a), (b, ms_b) in zip(marks, marks[1:] + [(step, train_ms)]):
        if b > a:
            stage = schedule.stage_at(a)
            parts.append((schedule.stages.index(stage) + 1, a, b - a, ms_b - ms_a, schedule.candidates_at(a, stage)))
    return parts


def finish(log, args: Hyperparameters, device: torch.device, world_size: int, step: int, losses, tokens, val_losses,
           train_ms: float, first_step: int, checkpoint, interrupted: int, stages: tuple[Stage, ...] = (),
           stages_ms: list[tuple[int, int, int, float, int]] = ()) -> RunResult:
    """Every rank's per-step losses gathered, peak memory, each stage's step time, and the closing summary
    line (`step` steps done)."""
    per_step = torch.stack(losses) if losses else torch.zeros(0, device=device)
    if world_size > 1:
        dist.all_reduce(per_step)
    if device.type == "cuda":
        log(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 2**20} MiB "
            f"reserved: {torch.cuda.max_memory_reserved() // 2**20} MiB")
    for number, first, steps, ms, rows in stages_ms:  # a stage's first step is one of its steps (no recompile: warm-up)
        stage = stages[number - 1]
        softmax = (f", sampled softmax ({rows:,} rows)" if rows else ", full softmax") if stage.candidates else ""
        log(f"stage {number}, steps {first}-{first + steps - 1}: {ms / steps:.1f} ms a step over {steps} steps, "
            f"{stage.spec.batch_size * steps / ms * 1000:,.0f} tokens/s{softmax}")
    log(f"{'stopped' if interrupted else 'finished'} at step {step}/{args.num_iterations}: training time "
        f"{train_ms / 1000:.1f}s ({train_ms / max(step, 1):.1f} ms/step)" +
        (f", val_loss {val_losses[-1][1]:.4f} at step {val_losses[-1][0]}" if val_losses else "") +
        (f", checkpoint {checkpoint}" if checkpoint else "") + f", log {log.path}")
    train_losses = (per_step.cpu() / torch.tensor(tokens, dtype=torch.float32)).tolist() if tokens else []
    if train_losses:  # the whole curve, every rank's tokens: runs on other GPU counts compare step for step
        log(f"train_loss per step {first_step + 1}-{first_step + len(train_losses)}: " +
            " ".join(f"{x:.4f}" for x in train_losses), console=False)
    return RunResult(train_losses, val_losses, train_ms, log.path, first_step, str(checkpoint) if checkpoint else None,
                     interrupted, list(stages_ms))


def train(args: Hyperparameters) -> RunResult:
    rank, world_size, device = start_processes(args)
    args, resume, branch = name_run(args, world_size)
    log, loader, run = Logger(args, rank), None, None
    try:
        log_header(log, args, device, resume, branch)
        train_files, val = prepare_data(args, rank, world_size, device, log)
        schedule, N = Schedule(args), args.num_iterations  # the run's stages and per-step quantities
        model, compiled, optimizers, _ = build(args, device, rank, world_size, log, schedule)
        kept = (*optimizers, WeightAverage(model, args, rank, world_size, log)) if args.weight_average else optimizers
        log("\n".join(run_report(model, args, device, world_size)))
        first_step, data_state, clock = 0, None, Clock(device)
        if resume is not None:
            first_step, data_state, clock.ms = load_checkpoint(resume, model, kept, args, rank, world_size, log)
            log(f"resumed at step {first_step} from {resume}")
        log.start()  # start-up checks passed: from here on the run has a log
        log(f"logging to {log.path}")
        schedule = schedule.with_slots(doc_slots(schedule, train_files, log))
        producer = lambda state=None: BatchProducer(train_files, rank, world_size, args.bos_id, state, log)
        if args.warmup_steps > 0:
            t = time.perf_counter()
            warmup(model, compiled, optimizers, producer(), val, schedule, world_size, log)
            log(f"warm-up (compile) done in {time.perf_counter() - t:.1f}s")
        loader = BatchLoader(producer(data_state), schedule.spec_at, device, start_step=first_step)
        figures = Figures(model, device, peak_tflops(device, args.peak_tflops), world_size, first_step)
        watch, losses, tokens, val_losses = LossWatch(device), [], [], []
        run = RunControl(args, model, kept, loader, clock, watch, figures, rank, world_size, first_step, log)
        if args.log_every > 0:
            log(f"every {args.log_every} steps: {Figures.LEGEND}")
        stage_marks = []  # (step, training ms) where each stage's steps of this run begin
        gc.collect()  # the warm-up's garbage collected now, not by a pause inside the timed steps (as the public code)
        run.line_up()  # every rank starts its clock together
        # =============================== the timed region: training =================================
        clock.start()
        for step in range(first_step, N + 1):  # `step` steps done; the ranks agree to go on, then run one more
            micro = run.go(step)
            if run.interrupted:
                break
            tie_embedding_at(model, step, schedule.untie)
            for average in kept[2:]:  # what checkpoints hold beside the optimizers: the weight average (WeightAverage.at)
                average.at(step, clock, lambda: evaluate(model, compiled, val, schedule.val_windows(N), args, world_size))
            if (step == N or (args.val_every > 0 and step % args.val_every == 0)) and not (resume and step == first_step):
                clock.stop()  # validation is not timed
                val_losses.append((step, evaluate(model, compiled, val, schedule.val_windows(step), args,
                                                  world_size)))
                log(f"step:{step}/{N} val_loss:{val_losses[-1][1]:.4f} train_time:{clock.ms:.0f}ms "
                    f"step_avg:{clock.ms / max(step, 1):.2f}ms tokens:{schedule.tokens_before(step)}")
                clock.start()
                figures.restart(step)
            if step == N:
                break
            stage = schedule.stage_at(step)
            # each stage's time, exact at its edges and at the switch to the full softmax inside it (a GPU sync)
            if step == first_step or step == stage.start or (step == schedule.full_softmax and stage.candidates):
                clock.stop()
                stage_marks.append((step, clock.ms))
                clock.start()
            ahead = loader.peek() if model.plans_ahead() and step + 1 < N else None
            loss = train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead)
            if step + 1 == schedule.untie:  # the last tied step is done: the next step, and its checkpoint, are untied
                untie_embedding(model, optimizers[0])
            losses.append(loss)
            tokens.append(stage.spec.batch_size)
            figures.tokens += stage.spec.batch_size
            watch.push(step + 1, loss, sum(m[0].numel() for m in micro))
            ms = clock.read_ms()
            log(f"step:{step + 1}/{N} train_time:{ms:.0f}ms step_avg:{ms / (step + 1):.2f}ms")
            latest = watch.newest(run.checkpoint)
            if args.log_every > 0 and (step + 1) % args.log_every == 0:
                log(f"step:{step + 1}/{N} {figures.line(step + 1, stage, latest)}")
        # ============================================================================================
        run.finish()
        return finish(log, args, device, world_size, step, losses, tokens, val_losses, clock.ms, first_step,
                      run.checkpoint, run.interrupted, schedule.stages,
                      stage_times(schedule, stage_marks, step, clock.ms))
    finally:
        if run is not None:
            run.close()
        if loader is not None:
            loader.close()
        if world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


# -----------------------------------------------------------------------------------------------
# Command line: user errors in one line

# Errors a user can fix (bad flags, data, checkpoints, memory): one line, no traceback, unless
# SPEEDRUN_DEBUG=1. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, OSError, EOFError, FloatingPointError, torch.OutOfMemoryError)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.plan:
            schedule = Schedule(args)
            print("\n".join(schedule_plan(schedule) + [model_plan_line(schedule)] + ngram_memory_lines(args)))
            return 0
        result = train(args)
    except USER_ERRORS as e:
        if os.environ.get("SPEEDRUN_DEBUG"):
            raise
        rank = int(os.environ.get("RANK", 0))
        print(f"train_gpt.py: error{f' (rank {rank})' if rank else ''}: {e}", file=sys.stderr, flush=True)
        return 1
    return 128 + result.interrupted if result.interrupted else 0  # the shell's convention for a signal


if __name__ == "__main__":
    sys.exit(main())
