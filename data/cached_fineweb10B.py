#!/usr/bin/env python
"""Fetch the GPT-2-tokenized FineWeb shards that the public speedrun trains on, from the Hugging Face hub.

    python data/cached_fineweb10B.py 8              # val shard + train shards 1..8 into data/fineweb10B/
    python data/cached_fineweb10B.py                # the whole corpus (103 train shards, ~10B tokens)
    python data/cached_fineweb10B.py 8 --corpus finewebedu10B --dir /scratch/fwe

Each shard is ~100M tokens (~200 MB). Files that are already complete (valid header, exact size, checked
with data/shards.py) are skipped without touching the network; truncated or corrupt ones
are deleted and fetched again. Downloads go through huggingface_hub, so HF_ENDPOINT, HF_TOKEN,
HF_HUB_OFFLINE, proxies and its cache apply. Each file is downloaded into the hidden staging folder
DIR/.hf_staging, validated there and only then renamed to DIR/<name>, so DIR never holds half a file.
A run that fails before any file is in place removes the folders it created, so a failed first
download (no network) leaves no empty data/fineweb10B/ behind. Errors are one line,
`cached_fineweb10B.py: error: ...`; SPEEDRUN_DEBUG=1 shows the Python traceback instead.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from data.shards import ShardError, read_shard_header  # noqa: E402  (the shard format without torch)

STAGING = ".hf_staging"  # subfolder of DIR where huggingface_hub writes before the file is validated and moved
PROG = "cached_fineweb10B.py"
DEBUG_ENV = "SPEEDRUN_DEBUG"  # set to 1: errors show their Python traceback (the same in every tool)


@dataclass(frozen=True)
class Corpus:
    repo_id: str    # hub dataset repository
    prefix: str     # files are <prefix>_val_000000.bin and <prefix>_train_000001.bin ...
    num_train: int  # number of training shards published
    about: str


# Repository ids, file names and shard counts as used by the public speedrun's data/cached_*.py scripts
# (KellerJordan/modded-nanogpt).
CORPORA = {
    "fineweb10B": Corpus("kjj0/fineweb10B-gpt2", "fineweb", 103, "FineWeb sample-10BT"),
    "finewebedu10B": Corpus("kjj0/finewebedu10B-gpt2", "finewebedu", 99, "FineWeb-Edu sample-10BT"),
    "fineweb100B": Corpus("kjj0/fineweb100B-gpt2", "fineweb", 1030, "FineWeb sample-100BT"),
}


def shard_names(corpus: Corpus, num_train: int) -> list[str]:
    """The validation shard, then training shards 1..num_train."""
    return [f"{corpus.prefix}_val_{0:06d}.bin"] + [
        f"{corpus.prefix}_train_{i:06d}.bin" for i in range(1, num_train + 1)
    ]


class DownloadError(Exception):
    """An expected failure: reported as one line on stderr, no traceback."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    corpora = "\n".join(f"  {name:14s} {c.about}: hub dataset {c.repo_id}, {c.num_train} train shards "
                        f"({c.prefix}_train_000001.bin ...) + {c.prefix}_val_000000.bin"
                        for name, c in CORPORA.items())
    parser = argparse.ArgumentParser(
        prog="cached_fineweb10B.py",
        description="Download the validation shard and the first N training shards of a GPT-2-tokenized\n"
                    "FineWeb corpus: the public speedrun's data, ~100M tokens (~200 MB) per shard.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"corpora:\n{corpora}\n\n"
               "The trainer reads $DATA_PATH/data/fineweb10B/ (DATA_PATH defaults to the repo root), which is\n"
               "this script's default --dir for fineweb10B. Complete files are skipped; truncated or corrupt\n"
               "ones are fetched again. Environment: HF_ENDPOINT (mirror), HF_TOKEN, HF_HOME (cache),\n"
               "HF_HUB_OFFLINE, HF_HUB_DISABLE_PROGRESS_BARS. DIR/.hf_staging holds downloads in flight and\n"
               "may be deleted whenever no download is running.")
    parser.add_argument("num_train", metavar="N", type=int, nargs="?", default=None,
                        help="number of training shards to fetch (0 = validation shard only; "
                             "default: all of the corpus)")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="fineweb10B",
                        help="which corpus (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to put the files (default: <repo root>/data/<corpus>)")
    parser.add_argument("--revision", default="main", help="hub branch, tag or commit (default: %(default)s)")
    parser.add_argument("--retries", type=int, default=4,
                        help="retries per file after transient failures (HTTP 429/5xx, dropped connections), "
                             "with exponential backoff; a server that cannot be reached at all gets at most 2 "
                             "quick retries (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds to wait for the server before a request counts as failed; sets "
                             "HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT (default: those variables, else 10)")
    args = parser.parse_args(argv)
    corpus = CORPORA[args.corpus]
    if args.num_train is None:
        args.num_train = corpus.num_train
    if not 0 <= args.num_train <= corpus.num_train:
        parser.error(f"N={args.num_train} is out of range: {args.corpus} ({corpus.repo_id}) has "
                     f"{corpus.num_train} training shards, so N must lie in 0..{corpus.num_train}")
    if args.retries < 0:
        parser.error("--retries must be >= 0")
    if args.timeout is not None and args.timeout <= 0:
        parser.error("--timeout must be a positive number of seconds")
    if args.dir is None:
        args.dir = REPO_ROOT / "data" / args.corpus
    return args


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split("\n")[0].split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class Fetcher:
    """Downloads one file at a time through huggingface_hub, with retries and one-line error reports."""

    def __init__(self, args: argparse.Namespace):
        if args.timeout is not None:  # must be set before huggingface_hub is imported: it reads them once
            os.environ["HF_HUB_ETAG_TIMEOUT"] = str(args.timeout)
            os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] = str(args.timeout)
        import httpx2
        import huggingface_hub
        from huggingface_hub import constants, errors
        from huggingface_hub.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # its warnings would add lines on stderr next to our own report
        self.httpx2, self.hub, self.errors = httpx2, huggingface_hub, errors
        self.endpoint = constants.ENDPOINT
        self.timeout = constants.HF_HUB_ETAG_TIMEOUT
        self.args = args
        self.repo_id = CORPORA[args.corpus].repo_id
        self.staging = args.dir / STAGING

    def _classify(self, error: BaseException) -> tuple[str, bool, str]:
        """(what went wrong, whether it is worth retrying, what the user can do)."""
        httpx2, errors = self.httpx2, self.errors
        net_hint = f"check the network connection, proxy settings and HF_ENDPOINT (now {self.endpoint})"
        auth_hint = (f"check HF_TOKEN ({'set' if os.environ.get('HF_TOKEN') else 'not set'}) "
                     f"and HF_ENDPOINT (now {self.endpoint})")
        if isinstance(error, errors.OfflineModeIsEnabled):
            return "offline mode is on", False, "unset HF_HUB_OFFLINE to download"
        if isinstance(error, (errors.GatedRepoError, errors.RepositoryNotFoundError, errors.DisabledRepoError)):
            return f"no access to dataset {self.repo_id} ({_first_line(error)})", False, auth_hint
        if isinstance(error, (errors.RemoteEntryNotFoundError, errors.RevisionNotFoundError)):
            return (f"not found in dataset {self.repo_id} at revision {self.args.revision}", False,
                    f"check --corpus, N, --revision and HF_ENDPOINT (now {self.endpoint})")
        if isinstance(error, errors.HfHubHTTPError):
            status = getattr(getattr(error, "response", None), "status_code", None)
            if status in (401, 403):
                return f"HTTP {status} from the hub", False, auth_hint
            transient = status is None or status in (408, 429) or status >= 500
            return f"HTTP {status} from the hub ({_first_line(error)})", transient, \
                "try again later, or " + net_hint
        if isinstance(error, (httpx2.ConnectError, httpx2.TimeoutException, httpx2.ProxyError)):
            return f"cannot reach the server ({_first_line(error)})", True, net_hint
        if isinstance(error, (httpx2.TransportError, errors.XetDownloadError)):
            return f"connection failed mid-transfer ({_first_line(error)})", True, net_hint
        if isinstance(error, OSError) and error.errno is not None:  # a local problem: disk full, permissions
            return (f"local file error ({_first_line(error)})", False,
                    f"check free space and permissions in {self.args.dir}")
        if isinstance(error, OSError):  # huggingface_hub's size-consistency check after a broken transfer
            return f"incomplete transfer ({_first_line(error)})", True, net_hint
        return f"{type(error).__name__}: {_first_line(error)}", False, \
            f"check HF_ENDPOINT (now {self.endpoint}) and HF_TOKEN"

    def _attempt(self, name: str, force: bool) -> Path:
        hub = self.hub
        url = hub.hf_hub_url(self.repo_id, name, repo_type="dataset", revision=self.args.revision)
        # A HEAD of our own first: huggingface_hub retries an unreachable server for ~20 s by itself when
        # no local copy exists; this call fails at once, so our own (short) retry policy applies.
        meta = hub.get_hf_file_metadata(url, timeout=self.timeout)
        if meta.commit_hash is None or meta.etag is None:
            raise DownloadError(f"{url} answered without the X-Repo-Commit/ETag headers of a Hugging Face hub")
        path = hub.hf_hub_download(self.repo_id, name, repo_type="dataset", revision=self.args.revision,
                                   local_dir=self.staging, force_download=force, etag_timeout=self.timeout)
        return Path(path)

    def fetch(self, name: str) -> int:
        """Download `name` into DIR (atomically) and return its token count; raise DownloadError on failure."""
        where = f"{self.endpoint}/datasets/{self.repo_id}"
        force = False  # after a download that fails validation, fetch once more bypassing every cache
        failures = 0
        while True:
            try:
                staged = self._attempt(name, force)
            except DownloadError:
                raise
            except Exception as error:  # noqa: BLE001 -- every failure is classified and reported in one line
                what, transient, hint = self._classify(error)
                httpx2 = self.httpx2
                unreachable = isinstance(error, (httpx2.ConnectError, httpx2.TimeoutException,
                                                 httpx2.ProxyError))
                limit = min(2, self.args.retries) if unreachable else self.args.retries
                if not transient or failures >= limit:
                    tries = f" after {failures + 1} attempts" if failures else ""
                    raise DownloadError(f"could not download {name} from {where}{tries}: {what}; {hint}") \
                        from error  # the cause shows only in SPEEDRUN_DEBUG=1's traceback
                wait = (0.5 if unreachable else 2.0) * 2 ** failures
                failures += 1
                time.sleep(min(wait, 30.0))
                continue
            try:
                num_tokens = read_shard_header(staged)
            except ShardError as error:
                staged.unlink(missing_ok=True)
                if force:
                    raise DownloadError(f"{name} from {where} is not a valid shard even after a fresh download "
                                        f"({_first_line(error)}); the remote file may be broken, try "
                                        "--revision or another HF_ENDPOINT") from error
                force = True
                continue
            os.replace(staged, self.args.dir / name)
            return num_tokens


def tidy_staging(staging: Path) -> None:
    """Remove the staging folder once it holds only huggingface_hub's bookkeeping (locks, metadata)."""
    if not staging.is_dir():
        return
    for path in staging.rglob("*"):
        if path.is_file() and path.suffix not in (".lock", ".metadata") \
                and path.name not in (".gitignore", "CACHEDIR.TAG"):
            return  # a download in flight (perhaps another process's), or a file someone put there
    shutil.rmtree(staging, ignore_errors=True)


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def make_dir(path: Path) -> list[Path]:
    """mkdir -p; returns the folders it created, deepest first (remove_if_empty takes them back)."""
    created = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        created.append(folder)
    path.mkdir(parents=True, exist_ok=True)
    return created


def remove_if_empty(folders: list[Path]) -> None:
    """Remove the given folders, deepest first, as long as they are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (or gone): leave it and everything above it
            return


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        created = make_dir(args.dir)
    except OSError as e:
        print(f"{PROG}: error: cannot create {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    code = None
    try:
        code = download(args)
        return code
    finally:
        if code != 0:  # failed or interrupted: tidy up what this run left and created
            tidy_staging(args.dir / STAGING)
            remove_if_empty(created)


def download(args: argparse.Namespace) -> int:
    corpus = CORPORA[args.corpus]
    names = shard_names(corpus, args.num_train)

    from tqdm import tqdm

    present_tokens = fetched_tokens = fetched = 0
    fetcher = None  # huggingface_hub is imported only when something has to be downloaded
    bar = tqdm(names, desc=f"{args.corpus} shards", unit="file", file=sys.stdout, dynamic_ncols=True,
               mininterval=0.1 if sys.stdout.isatty() else 30)  # into a log file: a line now and then
    try:
        for name in bar:
            target = args.dir / name
            if target.exists():
                try:
                    present_tokens += read_shard_header(target)
                    continue
                except ShardError as e:
                    bar.write(f"{name}: {_first_line(e)}; replacing it", file=sys.stdout)
                    target.unlink()
            fetcher = fetcher or Fetcher(args)
            bar.set_postfix_str(name)
            num_tokens = fetcher.fetch(name)
            fetched += 1
            fetched_tokens += num_tokens
    except DownloadError as e:
        bar.close()
        if debugging():
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # deleting a corrupt file, or other local trouble
        bar.close()
        if debugging():
            raise
        print(f"{PROG}: error: {_first_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        bar.close()
        print(f"{PROG}: interrupted; completed files are kept, run again to continue", file=sys.stderr)
        return 130
    bar.close()
    tidy_staging(args.dir / STAGING)
    total = present_tokens + fetched_tokens
    print(f"Fetched {fetched} file(s), {fetched_tokens:,} tokens, into {args.dir} "
          f"({len(names) - fetched} already complete); it holds the val shard + {args.num_train} train "
          f"shard(s) of {args.corpus}: {total:,} tokens.")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """main(), with an unforeseen error (a missing package, ...) reported as one line too, unless
    SPEEDRUN_DEBUG=1 asks for the traceback."""
    try:
        return main(argv)
    except Exception as e:  # noqa: BLE001
        if debugging():
            raise
        hint = " (pip install -r requirements.txt)" if isinstance(e, ImportError) else \
            f" ({DEBUG_ENV}=1 shows the traceback)"
        print(f"{PROG}: error: {type(e).__name__}: {_first_line(e)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
