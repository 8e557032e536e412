"""The token shard format, one module for train_gpt.py and the data tools: numpy only, so downloading and
tokenizing need no torch.

A shard is a 256 x int32 little-endian header -- magic 20240520, version 1, token count, zeros -- followed by the
tokens as uint16: the format of llm.c and of the public speedrun's FineWeb shards. train_gpt.py imports this module
and, as it does kernels.py, copies its source into every run's log and its hash into every checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS_ID = 50256  # GPT-2's <|endoftext|>, put before every document


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
    magic, version, num_tokens = (int(v) for v in np.frombuffer(raw, dtype="<i4")[:3])
    if magic != SHARD_MAGIC:
        raise ShardError(f"{path}: bad magic number {magic} (expected {SHARD_MAGIC}): "
                         "not a token shard, or written by another tool")
    if version != SHARD_VERSION:
        raise ShardError(f"{path}: unsupported shard version {version} (expected {SHARD_VERSION})")
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise ShardError(f"{path}: file is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes): truncated or corrupt, download or tokenize it again")
    return num_tokens


def load_shard(path: str | os.PathLike) -> np.ndarray:
    """A whole validated shard as a uint16 array."""
    num_tokens = read_shard_header(path)
    return np.fromfile(path, dtype="<u2", count=num_tokens, offset=HEADER_BYTES)


def write_shard(path: str | os.PathLike, tokens) -> None:
    """Write tokens (values < 2**16) as a shard, atomically: a temporary file, then a rename."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must lie in [0, 65535] to fit uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2", copy=False).tobytes())
    os.replace(tmp, path)
