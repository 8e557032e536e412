"""Tokenize raw text into the project's token shards (GPT-2 BPE, one <|endoftext|> before every document).

    python data/tokenize_corpus.py INPUT... --out DIR [--val_tokens N] [--shard_tokens N] [--workers N] [--prefix NAME]

Inputs, recognised by extension (compressed variants .gz, .xz, .bz2 and, if the `zstandard` package
imports, .zst):
  *.jsonl / *.ndjson   JSON Lines, one document per line in its "text" field
  *.txt                a plain text file is one document
  *.parquet            a "text" column, one document per row (needs pyarrow)
A directory stands for the supported files under it, in sorted order.

Output, in DIR:
  {prefix}_val_000000.bin     validation: the first whole documents, until it holds >= val_tokens + 1 tokens
  {prefix}_train_000001.bin   training: shard_tokens tokens each (the last one fewer); documents run on
  {prefix}_train_000002.bin   from one training shard into the next
  ...
With the default prefix "fineweb" the names match the public speedrun's FineWeb shards, so the trainer's
default file patterns pick up a tokenized corpus as they are.

Validation rule: the trainer evaluates on the first val_tokens tokens of the val shard and needs one more
token for the last target, so the val shard must hold at least val_tokens + 1 tokens. It takes whole
documents, in input order, until it holds that many; the document that crosses the mark is kept whole
there and never cut. So no document is split between validation and training (no validation text leaks
into training), and the val shard may be a little longer than val_tokens + 1.

Offline use: tiktoken downloads the GPT-2 BPE files on first use and keeps them in its cache folder,
TIKTOKEN_CACHE_DIR when that is set. For a machine without network, fill such a folder on one with
network and copy it over; then, from the repository root:

    TIKTOKEN_CACHE_DIR=DIR python -c "import tiktoken; tiktoken.get_encoding('gpt2')"   # with network
    TIKTOKEN_CACHE_DIR=DIR python data/tokenize_corpus.py corpus/*.jsonl.xz --out data/proxy

The output does not depend on --workers: documents are encoded in batches by a process pool and written
back in input order, byte for byte the same for any number of workers.

Errors are one line, `tokenize_corpus.py: error: ...`; SPEEDRUN_DEBUG=1 shows the Python traceback instead.
"""
import argparse
import bz2
import collections
import dataclasses
import gzip
import io
import json
import lzma
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from data.shards import BOS_ID, write_shard  # noqa: E402  (the shard format without torch)

DEFAULT_VAL_TOKENS = 10_485_760
DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_PREFIX = "fineweb"
GPT2_CACHE_HINT = ("fill one on a machine with network with TIKTOKEN_CACHE_DIR=DIR python -c "
                   "\"import tiktoken; tiktoken.get_encoding('gpt2')\" and copy DIR")
PROG = "tokenize_corpus.py"
DEBUG_ENV = "SPEEDRUN_DEBUG"  # set to 1: errors show their Python traceback (the same in every tool)


class InputError(ValueError):
    """An input that is missing, of an unknown kind or malformed; the message names the file."""


# -----------------------------------------------------------------------------------------------
# Inputs: files and directories -> a stream of document texts

COMPRESSIONS = (".gz", ".xz", ".bz2", ".zst")
KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "txt", ".parquet": "parquet"}


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def input_kind(path: Path) -> tuple[str, str | None]:
    """(kind, compression) of a file from its name, e.g. 'x.jsonl.xz' -> ('jsonl', '.xz'); InputError if unknown."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = suffixes.pop() if suffixes and suffixes[-1] in COMPRESSIONS else None
    kind = KINDS.get(suffixes[-1]) if suffixes else None
    if kind is None or (kind == "parquet" and compression):
        known = ", ".join(KINDS) + " (text kinds optionally + " + ", ".join(COMPRESSIONS) + ")"
        raise InputError(f"{path}: unknown input type (supported: {known})")
    return kind, compression


def _check_readable(path: Path) -> None:
    kind, compression = input_kind(path)
    if compression == ".zst" and not _have("zstandard"):
        raise InputError(f"{path}: .zst input needs the `zstandard` package (pip install zstandard)")
    if kind == "parquet" and not _have("pyarrow"):
        raise InputError(f"{path}: parquet input needs the `pyarrow` package (pip install pyarrow)")


def _is_supported(path: Path) -> bool:
    try:
        input_kind(path)
    except InputError:
        return False
    return True


def expand_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Files to read, in order: files as given, directories as their supported files (recursive, sorted).

    Checks everything before any work starts: a missing path, a file of unknown type, a directory with no
    supported file, or a format whose library is missing raises InputError naming the path."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
                           and _is_supported(p))
            if not found:
                raise InputError(f"{path}: directory holds no supported input files "
                                 f"({', '.join(KINDS)}, optionally compressed)")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise InputError(f"{path}: not a regular file or directory")
        else:
            raise InputError(f"{path}: no such file or directory")
    for path in files:
        _check_readable(path)
    return files


def _open_binary(path: Path, compression: str | None):
    if compression is None:
        return open(path, "rb")
    if compression == ".gz":
        return gzip.open(path, "rb")
    if compression == ".xz":
        return lzma.open(path, "rb")
    if compression == ".bz2":
        return bz2.open(path, "rb")
    import zstandard  # checked by expand_inputs
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)


def read_documents(path: Path) -> Iterator[str]:
    """The document texts of one input file, in file order. Malformed content raises InputError naming the file."""
    kind, compression = input_kind(path)
    try:
        if kind == "parquet":
            yield from _read_parquet(path)
            return
        with _open_binary(path, compression) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            if kind == "txt":
                yield f.read()
                return
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or "text" not in record:
                    raise InputError(f'{path}:{lineno}: JSON line has no "text" field')
                text = record["text"]
                if not isinstance(text, str):
                    raise InputError(f'{path}:{lineno}: "text" is {type(text).__name__}, not a string')
                yield text
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not valid UTF-8 text ({e.reason})") from None
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise InputError(f"{path}: cannot read ({e})") from None


def _read_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq  # checked by expand_inputs
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises its own error types for a bad file
        raise InputError(f"{path}: cannot read as parquet ({e})") from None
    if "text" not in pf.schema_arrow.names:
        raise InputError(f'{path}: parquet file has no "text" column (columns: {", ".join(pf.schema_arrow.names)})')
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is None:
                continue  # a null row is no document
            if not isinstance(text, str):
                raise InputError(f'{path}: "text" column holds {type(text).__name__}, not strings')
            yield text


def iter_documents(files: Iterable[Path]) -> Iterator[str]:
    for path in files:
        yield from read_documents(path)


# -----------------------------------------------------------------------------------------------
# Encoding: texts -> token arrays, in parallel, in input order

class GPT2Encoder:
    """Picklable str -> token ids with tiktoken's GPT-2 BPE; each process loads the encoding once.

    Uses encode_ordinary: the text is data, so a literal "<|endoftext|>" in it is encoded as ordinary text,
    never as the special token."""

    _encoding = None

    @classmethod
    def load(cls):
        if cls._encoding is None:
            import tiktoken
            cls._encoding = tiktoken.get_encoding("gpt2")
        return cls._encoding

    def __call__(self, text: str) -> list[int]:
        return self.load().encode_ordinary(text)


def _encode_batch(encode: Callable[[str], Sequence[int]], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode a batch of texts: (all their tokens as one uint16 array, each document's length)."""
    parts = [np.asarray(encode(t), dtype=np.int64) for t in texts]
    lengths = np.array([p.size for p in parts], dtype=np.int64)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("token ids must lie in [0, 65535] to fit the uint16 shard format")
    return tokens.astype(np.uint16), lengths


def _batches(texts: Iterable[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_documents(texts: Iterable[str], encode: Callable[[str], Sequence[int]], workers: int = 1,
                     batch_docs: int = 256, batch_chars: int = 1 << 20) -> Iterator[np.ndarray]:
    """Yield each text's tokens (uint16, no BOS), in input order, encoded by `workers` processes.

    `encode` must be picklable when workers > 1. Texts are sent in batches with a bounded number in flight,
    so memory stays flat on corpora of any size; results are taken back strictly in submission order, so
    the output is the same for every worker count."""
    def unpack(tokens: np.ndarray, lengths: np.ndarray) -> Iterator[np.ndarray]:
        start = 0
        for n in lengths.tolist():
            yield tokens[start:start + n]
            start += n

    batches = _batches(texts, batch_docs, batch_chars)
    if workers <= 1:
        for batch in batches:
            yield from unpack(*_encode_batch(encode, batch))
        return
    # workers ignore Ctrl-C: the main process alone stops, with one line instead of a traceback per worker
    with multiprocessing.Pool(workers, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_batch, (encode, batch)))
            if len(pending) >= 4 * workers:
                yield from unpack(*pending.popleft().get())
        while pending:
            yield from unpack(*pending.popleft().get())


# -----------------------------------------------------------------------------------------------
# Sharding: token arrays per document -> val shard + training shards (no BPE here)

@dataclasses.dataclass
class ShardReport:
    documents: int = 0        # documents written (empty ones are skipped)
    empty_documents: int = 0  # documents with no tokens, skipped
    tokens: int = 0           # tokens written, BOS included
    shards: list = dataclasses.field(default_factory=list)  # (path, token count), in order


def shard_name(prefix: str, split: str, index: int) -> str:
    return f"{prefix}_{split}_{index:06d}.bin"


def write_shards(docs: Iterable[Sequence[int]], out_dir: str | os.PathLike, prefix: str = DEFAULT_PREFIX,
                 val_tokens: int = DEFAULT_VAL_TOKENS, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 on_shard: Callable[[Path, int], None] | None = None) -> ShardReport:
    """Write documents' tokens as shards in out_dir, each document preceded by BOS (50256).

    Shard 0, `{prefix}_val_000000.bin`, takes whole documents until it holds >= val_tokens + 1 tokens (the
    document crossing the mark stays whole, so none is split between validation and training). The rest go
    to `{prefix}_train_000001.bin`, ... of exactly shard_tokens tokens each, the last one fewer; there
    documents are split across shard boundaries. Documents with no tokens are skipped. If the documents run
    out first, the val shard is smaller and no training shard is written (the report shows it).
    """
    if val_tokens < 1 or shard_tokens < 1:
        raise ValueError(f"val_tokens and shard_tokens must be >= 1 (got {val_tokens}, {shard_tokens})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = ShardReport()
    bos = np.array([BOS_ID], dtype=np.uint16)

    def flush(split: str, tokens: np.ndarray) -> None:
        path = out_dir / shard_name(prefix, split, len(report.shards))
        write_shard(path, tokens)
        report.shards.append((path, int(tokens.size)))
        if on_shard is not None:
            on_shard(path, int(tokens.size))

    val_parts: list[np.ndarray] = []
    val_count = 0
    buf: np.ndarray | None = None  # the training shard being filled
    fill = 0
    for doc in docs:
        doc = np.asarray(doc)
        if doc.size == 0:
            report.empty_documents += 1
            continue
        if doc.min() < 0 or doc.max() >= 2**16:
            raise ValueError(f"document {report.documents}: token ids must lie in [0, 65535]")
        report.documents += 1
        report.tokens += doc.size + 1
        if buf is None:  # still filling the val shard, with whole documents
            val_parts += (bos, doc.astype(np.uint16, copy=False))
            val_count += doc.size + 1
            if val_count >= val_tokens + 1:
                flush("val", np.concatenate(val_parts))
                val_parts = []
                buf = np.empty(shard_tokens, dtype=np.uint16)
            continue
        for piece in (bos, doc):
            start = 0
            while start < piece.size:
                n = min(piece.size - start, shard_tokens - fill)
                buf[fill:fill + n] = piece[start:start + n]
                fill += n
                start += n
                if fill == shard_tokens:
                    flush("train", buf)
                    fill = 0
    if buf is None:
        if val_count:
            flush("val", np.concatenate(val_parts))
    elif fill:
        flush("train", buf[:fill])
    return report


def remove_stale_shards(out_dir: Path, prefix: str, written: Iterable[Path]) -> list[Path]:
    """Delete `{prefix}_{val,train}_NNNNNN.bin` files in out_dir that this run did not write (left by an
    earlier, longer run), so the trainer's glob sees exactly this corpus. Returns what was removed."""
    keep = {Path(p).name for p in written}
    pattern = re.compile(re.escape(prefix) + r"_(val|train)_\d{6}\.bin")
    stale = sorted(p for p in out_dir.iterdir() if pattern.fullmatch(p.name) and p.name not in keep)
    for p in stale:
        p.unlink()
    return stale


# -----------------------------------------------------------------------------------------------
# Command line

def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Tokenize raw text (JSON Lines, .txt, parquet; optionally .gz/.xz/.bz2/.zst) with the "
                    "GPT-2 BPE into the project's token shards: a validation shard, then training shards. "
                    "Every document is preceded by <|endoftext|> (50256).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
validation shard:
  {{prefix}}_val_000000.bin takes whole documents, in input order, until it holds at least
  val_tokens + 1 tokens (the trainer evaluates val_tokens tokens and needs one more for the
  last target). The document crossing that mark is kept whole, never cut, so no document is
  split between validation and training; the shard can be a little longer than val_tokens + 1.
  Training shards {{prefix}}_train_000001.bin, ... hold shard_tokens tokens each (the last one
  fewer), with documents running on across their boundaries. Shards of the same prefix left in
  --out by an earlier run are removed. The output is identical for any --workers.

offline use:
  tiktoken needs the GPT-2 BPE files; without network it finds them only in TIKTOKEN_CACHE_DIR,
  a folder filled once on a machine with network and copied over. From the repository root:
    TIKTOKEN_CACHE_DIR=DIR python -c "import tiktoken; tiktoken.get_encoding('gpt2')"  # with network
    TIKTOKEN_CACHE_DIR=DIR python data/tokenize_corpus.py corpus/*.jsonl.xz --out data/proxy
""")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="input files or directories (*.jsonl, *.ndjson, *.txt, *.parquet; text kinds may "
                        "end in .gz, .xz, .bz2 or .zst)")
    p.add_argument("--out", required=True, help="output directory (created if needed)")
    p.add_argument("--val_tokens", type=_positive, default=DEFAULT_VAL_TOKENS,
                   help="the val shard holds at least this many + 1 tokens, in whole documents "
                        "(default %(default)s)")
    p.add_argument("--shard_tokens", type=_positive, default=DEFAULT_SHARD_TOKENS,
                   help="tokens per training shard (default %(default)s)")
    p.add_argument("--workers", type=_positive, default=os.cpu_count() or 1,
                   help="encoding processes (default: the CPU count, %(default)s)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help="shard file name prefix (default %(default)s, the public speedrun's naming)")
    return p


def fail(message: str):
    """Stop with one line on stderr, `tokenize_corpus.py: error: <message>`, and exit status 1."""
    sys.exit(f"{PROG}: error: {message}")


def load_gpt2() -> None:
    """Load the GPT-2 encoding in this process (the pool's workers inherit or reload it) or exit with one line."""
    try:
        GPT2Encoder.load()
    except ImportError:
        fail("the GPT-2 BPE needs the tiktoken package (pip install tiktoken)")
    except Exception as e:  # no network and no cache: requests/urllib errors, a bad cache file, ...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        fail(f"cannot load tiktoken's GPT-2 encoding ({type(e).__name__}: {reason}); "
             f"set TIKTOKEN_CACHE_DIR to a folder with its cached files ({GPT2_CACHE_HINT})")


def main(argv: Sequence[str] | None = None) -> ShardReport:
    args = build_parser().parse_args(argv)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.prefix):
        fail(f"--prefix {args.prefix!r}: use only letters, digits, '.', '_' and '-'")
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        fail(f"--out {out_dir}: exists and is not a directory")
    try:
        files = expand_inputs(args.inputs)
    except InputError as e:
        fail(str(e))
    load_gpt2()
    from tqdm import tqdm

    t0 = time.perf_counter()
    print(f"tokenizing {len(files)} file(s) with {args.workers} worker(s) into {out_dir}/", file=sys.stderr)
    bar = tqdm(unit=" docs", desc="documents", dynamic_ncols=True, mininterval=1.0,
               disable=None)  # None: off when stderr is not a terminal; the per-shard lines still show

    def counted(docs: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for doc in docs:
            bar.update(1)
            yield doc

    def on_shard(path: Path, n: int) -> None:
        (bar.write if not bar.disable else lambda s: print(s, file=sys.stderr, flush=True))(
            f"wrote {path} ({n:,} tokens, {time.perf_counter() - t0:.1f} s)")

    try:
        docs = encode_documents(iter_documents(files), GPT2Encoder(), workers=args.workers)
        report = write_shards(counted(docs), out_dir, prefix=args.prefix, val_tokens=args.val_tokens,
                              shard_tokens=args.shard_tokens, on_shard=on_shard)
    except InputError as e:
        fail(str(e))
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    if report.documents == 0:
        fail("the inputs hold no non-empty documents; nothing written")
    removed = remove_stale_shards(out_dir, args.prefix, (p for p, _ in report.shards))

    print(f"documents: {report.documents:,}" + (f" ({report.empty_documents:,} empty skipped)"
                                                  if report.empty_documents else ""))
    print(f"tokens:    {report.tokens:,} (BOS included)")
    print(f"shards:    {len(report.shards)} in {out_dir}/")
    for path, n in report.shards:
        print(f"  {path.name}  {n:>12,} tokens")
    for path in removed:
        print(f"  removed stale {path.name}")
    print(f"time:      {elapsed:.1f} s ({report.tokens / max(elapsed, 1e-9) / 1e6:.2f} M tokens/s)")
    val_count = report.shards[0][1]
    if val_count < args.val_tokens + 1:
        print(f"warning: the val shard holds only {val_count:,} tokens, fewer than --val_tokens + 1 = "
              f"{args.val_tokens + 1:,}: the trainer cannot evaluate {args.val_tokens:,} tokens on it",
              file=sys.stderr)
    elif len(report.shards) == 1:
        print("warning: no training shard written: all documents went to validation", file=sys.stderr)
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    """main(), with any other error (disk full, permissions, Ctrl-C) reported as one line too, unless
    SPEEDRUN_DEBUG=1 asks for the traceback."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; the shards in --out are incomplete", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        if isinstance(e, OSError) and e.strerror:
            text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
        else:
            text = f"{type(e).__name__}: {e} ({DEBUG_ENV}=1 shows the traceback)"
        print(f"{PROG}: error: {' '.join(text.split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
