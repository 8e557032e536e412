"""data/cached_fineweb10B.py, run for real against a fake Hugging Face hub on 127.0.0.1 (no network).

The fake hub answers what huggingface_hub asks for a dataset file: HEAD and GET on
/datasets/<repo>/resolve/<revision>/<file>, with the X-Repo-Commit, ETag and Content-Length headers
(and X-Error-Code: EntryNotFound on a 404). It counts the requests, so the tests can tell what was fetched.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "data" / "cached_fineweb10B.py"
REPO = "kjj0/fineweb10B-gpt2"
COMMIT = "3f6c0b0d5e2a4c1b9a8f7e6d5c4b3a2918273645"
VAL = "fineweb_val_000000.bin"
TRAIN = [f"fineweb_train_{i:06d}.bin" for i in (1, 2, 3)]
TOKENS = 1000


class FakeHub:
    """A threaded HTTP server serving {filename: bytes} as the dataset REPO at revision main."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.requests: collections.Counter = collections.Counter()  # (method, filename) -> count
        self.fail_next: collections.Counter = collections.Counter()  # filename -> HTTP 503s still to send
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, with_body: bool):
                prefix = f"/datasets/{REPO}/resolve/main/"
                name = self.path[len(prefix):] if self.path.startswith(prefix) else None
                hub.requests[(self.command, name or self.path)] += 1
                if name not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if hub.fail_next[name] > 0:
                    hub.fail_next[name] -= 1
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = hub.files[name]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
                self.send_header("X-Repo-Commit", COMMIT)
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def do_HEAD(self):
                self._serve(with_body=False)

            def do_GET(self):
                self._serve(with_body=True)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, since: collections.Counter | None = None) -> dict[str, int]:
        """GETs per file (file bodies fetched), counted from the snapshot `since` if given."""
        done = self.requests - (since or collections.Counter())
        return {name: n for (method, name), n in done.items() if method == "GET"}

    def snapshot(self) -> collections.Counter:
        return self.requests.copy()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _shard_bytes(tmp_path: Path, name: str, seed: int) -> bytes:
    path = tmp_path / "remote" / name
    path.parent.mkdir(exist_ok=True)
    tg.write_shard(path, np.random.default_rng(seed).integers(0, 50257, size=TOKENS))
    return path.read_bytes()


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote")
    return {name: _shard_bytes(folder, name, seed) for seed, name in enumerate([VAL] + TRAIN)}


@pytest.fixture(scope="module")
def hub(remote):
    server = FakeHub(remote)
    yield server
    server.close()


def run_script(tmp_path: Path, endpoint: str, *args: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "SPEEDRUN_DEBUG"}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost", **extra)  # never via a proxy
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, hub):
    """One real download of the val shard + 2 train shards: (result, folder, GETs it made)."""
    tmp = tmp_path_factory.mktemp("fresh")
    before = hub.snapshot()
    r = run_script(tmp, hub.endpoint, "2", "--dir", str(tmp / "out"))
    return r, tmp / "out", hub.gets(since=before)


@pytest.fixture
def downloaded(fresh, tmp_path):
    """A private copy of the freshly downloaded folder."""
    assert fresh[0].returncode == 0, fresh[0].stderr
    return Path(shutil.copytree(fresh[1], tmp_path / "out"))


def test_fresh_download_fetches_val_and_first_n_train_shards_as_valid_real_files(fresh, remote):
    r, out, gets = fresh
    assert r.returncode == 0, r.stderr
    wanted = [VAL] + TRAIN[:2]
    for name in wanted:
        path = out / name
        assert path.is_file() and not path.is_symlink()
        assert tg.read_shard_header(path) == TOKENS
        assert path.read_bytes() == remote[name]
    assert sorted(p.name for p in out.iterdir()) == sorted(wanted)  # no partial files, staging tidied away
    assert gets == {name: 1 for name in wanted}  # train shard 3 exists remotely but was not asked for
    last = _last_line(r.stdout)
    assert str(out) in last and f"{3 * TOKENS:,} tokens" in last


def test_second_run_makes_no_requests_at_all(tmp_path, hub, downloaded):
    before = hub.snapshot()
    r = run_script(tmp_path, hub.endpoint, "2", "--dir", str(downloaded))
    assert r.returncode == 0, r.stderr
    assert hub.requests == before  # complete files are checked locally: no GET, not even a HEAD
    assert "Fetched 0 file(s), 0 tokens" in _last_line(r.stdout)


def test_damaged_local_files_are_replaced_and_only_they_are_fetched(tmp_path, hub, remote, downloaded):
    truncated, bad_magic = downloaded / TRAIN[1], downloaded / VAL
    truncated.write_bytes(truncated.read_bytes()[:-10])
    bad_magic.write_bytes(b"\0\0\0\0" + bad_magic.read_bytes()[4:])
    before = hub.snapshot()
    r = run_script(tmp_path, hub.endpoint, "2", "--dir", str(downloaded))
    assert r.returncode == 0, r.stderr
    assert hub.gets(since=before) == {TRAIN[1]: 1, VAL: 1}  # train shard 1 was intact and is left alone
    assert truncated.read_bytes() == remote[TRAIN[1]] and bad_magic.read_bytes() == remote[VAL]
    assert f"Fetched 2 file(s), {2 * TOKENS:,} tokens" in _last_line(r.stdout)


def test_transient_server_error_is_retried_and_the_download_completes(tmp_path, hub, remote, downloaded):
    hub.fail_next[TRAIN[2]] = 1  # one HTTP 503, then the file
    before = hub.snapshot()
    r = run_script(tmp_path, hub.endpoint, "3", "--dir", str(downloaded))
    assert r.returncode == 0, r.stderr
    assert (downloaded / TRAIN[2]).read_bytes() == remote[TRAIN[2]]
    assert hub.gets(since=before) == {TRAIN[2]: 1}
    assert hub.fail_next[TRAIN[2]] == 0


def test_unreachable_server_fails_fast_with_one_line_naming_file_and_endpoint(tmp_path):
    with socket.socket() as s:  # a port that nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    r = run_script(tmp_path, endpoint, "2", "--dir", str(tmp_path / "out"), timeout=30)
    elapsed = time.monotonic() - start
    assert r.returncode != 0
    # an unreachable server gets at most 2 quick retries, not the backoff of transient errors: a few seconds
    # (up to 20 s seen on a 2-core machine busy with other tests), not minutes
    assert elapsed < 25, f"took {elapsed:.1f}s to give up"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("cached_fineweb10B.py: error: ")
    assert VAL in lines[0] and endpoint in lines[0] and "HF_ENDPOINT" in lines[0]
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "out").exists()  # the folder it created for the download is gone again


class _FakeFetcher:
    """Stands in for the script's Fetcher (no HTTP): `files` are written as if downloaded, through a
    staging folder with huggingface_hub-style bookkeeping; any other name fails like an unreachable hub."""

    files: dict[str, bytes] = {}
    error: type[Exception] = Exception  # the script's DownloadError (set by the `offline` fixture)

    def __init__(self, args):
        self.args = args

    def fetch(self, name: str) -> int:
        staging = self.args.dir / ".hf_staging" / ".cache" / "huggingface" / "download"
        staging.mkdir(parents=True, exist_ok=True)
        (staging / f"{name}.lock").write_text("")
        if name not in self.files:
            raise self.error(f"could not download {name}: cannot reach the server")
        (self.args.dir / name).write_bytes(self.files[name])
        return tg.read_shard_header(self.args.dir / name)


@pytest.fixture
def offline(script, monkeypatch):
    """The script, in this process, with a hub that serves nothing."""
    fetcher = type("Offline", (_FakeFetcher,), {"files": {}, "error": script.DownloadError})
    monkeypatch.setattr(script, "Fetcher", fetcher)
    monkeypatch.delenv("SPEEDRUN_DEBUG", raising=False)
    return script


def test_failed_first_download_removes_every_folder_it_created_and_no_other(offline, tmp_path, capsys):
    assert offline.cli(["1", "--dir", str(tmp_path / "a" / "b" / "fineweb10B")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"cached_fineweb10B.py: error: could not download {VAL}: cannot reach the server"]
    assert not (tmp_path / "a").exists()
    existing = tmp_path / "mine"  # a folder that was there before stays, as it was
    existing.mkdir()
    assert offline.cli(["1", "--dir", str(existing / "fineweb10B")]) == 1
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_speedrun_debug_raises_the_error_and_still_tidies_up(offline, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_DEBUG", "1")
    with pytest.raises(offline.DownloadError, match="could not download"):
        offline.cli(["1", "--dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_a_missing_package_is_one_line_naming_the_fix_and_leaves_no_folder(offline, tmp_path, monkeypatch, capsys):
    def no_hub(args):
        raise ImportError("No module named 'huggingface_hub'")
    monkeypatch.setattr(offline, "Fetcher", no_hub)
    assert offline.cli(["0", "--dir", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "cached_fineweb10B.py: error: ImportError: No module named 'huggingface_hub' (pip install -r requirements.txt)"]
    assert not (tmp_path / "out").exists()


def test_failure_after_a_completed_file_keeps_the_folder_and_the_file(offline, tmp_path, remote):
    offline.Fetcher.files = {VAL: remote[VAL]}  # the val shard, then nothing for train shard 1
    assert offline.cli(["1", "--dir", str(tmp_path / "out")]) == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [VAL]  # and no staging folder


def test_invalid_remote_file_fails_clearly_after_a_fresh_retry_and_leaves_nothing(tmp_path, remote):
    server = FakeHub({**remote, VAL: b"this is not a token shard at all" * 40})
    try:
        r = run_script(tmp_path, server.endpoint, "1", "--dir", str(tmp_path / "out"))
    finally:
        server.close()
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and VAL in lines[0] and "not a valid shard" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert server.gets() == {VAL: 2}  # fetched once, rejected, fetched afresh once more, rejected
    assert not (tmp_path / "out").exists()  # nor its staging folder, nor the folder itself


def test_missing_remote_file_is_reported_as_not_found(tmp_path, hub, downloaded):
    # the fake hub holds 3 train shards; asking for 4 is within the real corpus's 103 but 404s here
    r = run_script(tmp_path, hub.endpoint, "4", "--dir", str(downloaded))
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "fineweb_train_000004.bin" in lines[0] and "not found" in lines[0], r.stderr
    assert all(tg.read_shard_header(downloaded / name) == TOKENS for name in [VAL] + TRAIN)  # kept, + shard 3


def test_n_out_of_range_is_rejected_on_the_command_line_before_any_download(tmp_path):
    r = run_script(tmp_path, "http://127.0.0.1:9", "104", "--dir", str(tmp_path / "out"))
    assert r.returncode == 2
    assert "out of range" in r.stderr and "103" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,count", [(["104"], "103"), (["-1"], "103"),
                                        (["100", "--corpus", "finewebedu10B"], "99"),
                                        (["1031", "--corpus", "fineweb100B"], "1030")])
def test_n_out_of_range_names_the_corpus_shard_count(script, capsys, args, count):
    with pytest.raises(SystemExit) as e:
        script.parse_args(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "out of range" in err and count in err


@pytest.mark.parametrize("corpus,n", [("fineweb10B", 103), ("finewebedu10B", 99), ("fineweb100B", 1030)])
def test_n_up_to_the_corpus_shard_count_is_accepted(script, corpus, n):
    assert script.parse_args([str(n), "--corpus", corpus]).num_train == n
    assert script.parse_args(["0", "--corpus", corpus]).num_train == 0


def test_help_names_n_the_corpora_and_the_environment(script, capsys):
    with pytest.raises(SystemExit) as e:
        script.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("N", "--corpus", "--dir", "kjj0/fineweb10B-gpt2", "kjj0/finewebedu10B-gpt2",
                 "kjj0/fineweb100B-gpt2", "HF_ENDPOINT", "HF_TOKEN"):
        assert word in out


@pytest.fixture(scope="module")
def script():
    """data/cached_fineweb10B.py imported as a module (it is not a package member)."""
    spec = importlib.util.spec_from_file_location("cached_fineweb10B", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_default_dir_is_data_slash_corpus_under_the_repo_root(script):
    assert script.parse_args(["2"]).dir == ROOT / "data" / "fineweb10B"
    args = script.parse_args(["--corpus", "finewebedu10B"])
    assert args.dir == ROOT / "data" / "finewebedu10B" and args.num_train == 99  # no N: the whole corpus
    assert script.shard_names(script.CORPORA["finewebedu10B"], 2) == [
        "finewebedu_val_000000.bin", "finewebedu_train_000001.bin", "finewebedu_train_000002.bin"]
