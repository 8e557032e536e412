"""GPT-2-small speedrun: train a ~124M-parameter GPT on FineWeb to <= 3.28 validation loss, fast.

One file, read top to bottom: hyperparameters -> kernels/custom ops -> model -> optimizers -> data
-> training loop. Launch with `torchrun --standalone --nproc_per_node=8 train_gpt.py` (see run.sh);
every hyperparameter is a `--field value` override. The log written to logs/<run_id>.txt starts with
this file's full source, so every result names the exact code that made it.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# -----------------------------------------------------------------------------------------------
# Shard format (used by train_gpt.py, data/tokenize.py, data/cached_fineweb10B.py and the tests)
# A shard is a 256 x int32 header -- magic, version, token count, zeros -- followed by the tokens
# as uint16. This is the format of llm.c and the public speedrun's FineWeb shards.

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS_ID = 50256  # GPT-2 <|endoftext|>, put before every document: the speedrun's beginning-of-sequence


class ShardError(ValueError):
    """A token shard that is missing, truncated or not in the expected format."""


def read_shard_header(path: str | os.PathLike) -> int:
    """Validate a shard's header and size; return its token count. Raises ShardError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard ({e.strerror or e})") from e
    if len(raw) < HEADER_BYTES:
        raise ShardError(f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic number {int(header[0])} (expected {SHARD_MAGIC}): "
                         "not a token shard, or written by another tool")
    if header[1] != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {int(header[1])} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise ShardError(f"{path}: file is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes): truncated or corrupt, download or tokenize it again")
    return num_tokens


def load_shard(path: str | os.PathLike) -> np.ndarray:
    """Read a whole validated shard into memory as a uint16 array."""
    num_tokens = read_shard_header(path)
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        tokens = np.fromfile(f, dtype="<u2", count=num_tokens)
    if tokens.size != num_tokens:
        raise ShardError(f"{path}: read {tokens.size} tokens, header promises {num_tokens}")
    return tokens


def write_shard(path: str | os.PathLike, tokens) -> None:
    """Write tokens (values < 2**16) as a shard, atomically: a temporary file, then a rename."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must lie in [0, 65535] to fit uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2", copy=False).tobytes())
    os.replace(tmp, path)
