"""data/tokenize_corpus.py: sharding (no BPE), input formats and errors, and a real GPT-2 round trip via the CLI."""
import bz2
import gzip
import json
import lzma
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train_gpt as tg
from data import tokenize_corpus as tok

ROOT = Path(__file__).resolve().parents[1]
BOS = tg.BOS_ID


def fake_encode(text):
    """A stand-in for the BPE: one token per UTF-8 byte (picklable, so it also runs in worker processes)."""
    return list(text.encode("utf-8"))


def shard_files(out, prefix="fineweb"):
    return sorted(Path(out).glob(f"{prefix}_*.bin"), key=lambda p: p.name.rsplit("_", 1)[1])


def concat_shards(out, prefix="fineweb"):
    return np.concatenate([tg.load_shard(p) for p in shard_files(out, prefix)])


def expected_stream(docs):
    return np.concatenate([np.concatenate([[BOS], d]) for d in docs if len(d)]).astype(np.uint16)


def random_docs(n, seed=0, max_len=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50257, size=rng.integers(1, max_len)) for _ in range(n)]


# -----------------------------------------------------------------------------------------------
# Sharding, with hand-made token arrays

def test_val_shard_takes_whole_documents_until_it_holds_val_tokens_plus_one(tmp_path):
    docs = [np.arange(9), np.arange(9), np.arange(9), np.arange(9)]  # 10 tokens each with BOS
    rep = tok.write_shards(docs, tmp_path, val_tokens=15, shard_tokens=7)
    # 16 tokens needed: two whole documents (20 tokens), the second one not cut
    assert rep.shards[0] == (tmp_path / "fineweb_val_000000.bin", 20)
    val = tg.load_shard(tmp_path / "fineweb_val_000000.bin")
    np.testing.assert_array_equal(val, expected_stream(docs[:2]))


def test_val_shard_with_exact_fit_stops_at_that_document(tmp_path):
    docs = [np.arange(4), np.arange(4), np.arange(4)]  # 5 tokens each
    rep = tok.write_shards(docs, tmp_path, val_tokens=9, shard_tokens=100)
    assert [n for _, n in rep.shards] == [10, 5]


def test_train_shards_have_shard_tokens_each_and_the_last_fewer(tmp_path):
    docs = random_docs(50, seed=1)
    total = sum(len(d) + 1 for d in docs)
    rep = tok.write_shards(docs, tmp_path, val_tokens=30, shard_tokens=64)
    names = [p.name for p, _ in rep.shards]
    assert names[0] == "fineweb_val_000000.bin"
    assert names[1:] == [f"fineweb_train_{i:06d}.bin" for i in range(1, len(names))]
    sizes = [n for _, n in rep.shards]
    assert sizes[0] >= 31
    assert all(n == 64 for n in sizes[1:-1]) and 0 < sizes[-1] <= 64
    assert sum(sizes) == total == rep.tokens
    assert [tg.read_shard_header(p) for p, _ in rep.shards] == sizes


def test_concatenated_shards_equal_bos_plus_each_document_nothing_lost_or_duplicated(tmp_path):
    docs = random_docs(200, seed=2)
    rep = tok.write_shards(docs, tmp_path, val_tokens=100, shard_tokens=97)
    np.testing.assert_array_equal(concat_shards(tmp_path), expected_stream(docs))
    assert rep.documents == 200


def test_every_document_is_preceded_by_bos_even_across_shard_boundaries(tmp_path):
    # documents without 50256 inside: BOS positions in the stream are exactly the document starts
    docs = [np.full(k, 7) for k in (3, 11, 1, 25, 6, 13, 2)]
    tok.write_shards(docs, tmp_path, val_tokens=5, shard_tokens=4)
    stream = concat_shards(tmp_path)
    starts = np.cumsum([0] + [len(d) + 1 for d in docs[:-1]])
    np.testing.assert_array_equal(np.flatnonzero(stream == BOS), starts)
    train = [tg.load_shard(p) for p in shard_files(tmp_path)[1:]]
    assert any(s[0] != BOS for s in train)  # some training shard starts mid-document


def test_empty_documents_are_skipped(tmp_path):
    docs = [np.arange(3), np.array([], dtype=np.int64), np.arange(2)]
    rep = tok.write_shards(docs, tmp_path, val_tokens=1, shard_tokens=10)
    assert (rep.documents, rep.empty_documents) == (2, 1)
    np.testing.assert_array_equal(concat_shards(tmp_path), expected_stream(docs))


def test_too_few_tokens_give_a_short_val_shard_and_no_train_shard(tmp_path):
    rep = tok.write_shards([np.arange(5)], tmp_path, val_tokens=100, shard_tokens=10)
    assert [(p.name, n) for p, n in rep.shards] == [("fineweb_val_000000.bin", 6)]


def test_prefix_names_the_shards(tmp_path):
    tok.write_shards(random_docs(20), tmp_path, prefix="proxy", val_tokens=10, shard_tokens=50)
    assert shard_files(tmp_path, "proxy") and not list(tmp_path.glob("fineweb_*"))


def test_token_ids_beyond_uint16_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="65535"):
        tok.write_shards([np.array([1, 70000])], tmp_path, val_tokens=1, shard_tokens=10)


def test_encoding_in_order_is_the_same_for_any_worker_count():
    texts = [f"doc {i} " + "x" * (i % 17) for i in range(300)]
    one = list(tok.encode_documents(texts, fake_encode, workers=1, batch_docs=7))
    two = list(tok.encode_documents(texts, fake_encode, workers=2, batch_docs=7, batch_chars=50))
    assert len(one) == len(two) == 300
    for t, a, b in zip(texts, one, two):
        np.testing.assert_array_equal(a, fake_encode(t))
        np.testing.assert_array_equal(a, b)


def test_output_bytes_are_identical_with_one_or_two_workers(tmp_path):
    texts = [f"document {i}: " + "é ab " * (i % 23) for i in range(400)]
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        tok.write_shards(tok.encode_documents(texts, fake_encode, workers=workers, batch_docs=16),
                         out, val_tokens=500, shard_tokens=1000)
        outs.append({p.name: p.read_bytes() for p in shard_files(out)})
    assert len(outs[0]) > 2 and outs[0] == outs[1]


def test_stale_shards_of_an_earlier_longer_run_are_removed(tmp_path):
    for name in ("fineweb_train_000009.bin", "fineweb_train_000002.bin", "other_train_000009.bin"):
        (tmp_path / name).write_bytes(b"")
    rep = tok.write_shards(random_docs(5), tmp_path, val_tokens=5, shard_tokens=1000)
    removed = tok.remove_stale_shards(tmp_path, "fineweb", [p for p, _ in rep.shards])
    assert [p.name for p in removed] == ["fineweb_train_000002.bin", "fineweb_train_000009.bin"]
    assert (tmp_path / "other_train_000009.bin").exists()


# -----------------------------------------------------------------------------------------------
# Input formats and errors

TEXTS = ["first document\nwith two lines", "second: ünïcödé ✓", 'third has "quotes" and <|endoftext|>']


def write_jsonl(path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    return path


@pytest.mark.parametrize("suffix,opener", [(".jsonl", open), (".jsonl.gz", gzip.open), (".jsonl.xz", lzma.open),
                                           (".jsonl.bz2", bz2.open)])
def test_jsonl_plain_and_compressed_yield_the_text_fields(tmp_path, suffix, opener):
    path = write_jsonl(tmp_path / f"docs{suffix}", TEXTS, opener)
    assert list(tok.iter_documents(tok.expand_inputs([path]))) == TEXTS


def test_jsonl_zst_yields_the_text_fields_when_zstandard_imports(tmp_path):
    zstandard = pytest.importorskip("zstandard", reason="zstandard not installed: .zst input unsupported")
    path = tmp_path / "docs.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()))
    assert list(tok.iter_documents(tok.expand_inputs([path]))) == TEXTS


@pytest.mark.parametrize("name,package", [("docs.jsonl.zst", "zstandard"), ("docs.parquet", "pyarrow")])
def test_input_needing_a_missing_optional_package_is_a_clear_error(tmp_path, monkeypatch, name, package):
    path = tmp_path / name
    path.write_bytes(b"")
    monkeypatch.setattr(tok, "_have", lambda module: module != package)
    with pytest.raises(tok.InputError, match=re.escape(name) + ".*" + package):
        tok.expand_inputs([path])


def test_txt_file_is_one_document(tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[0] + "\n\n" + TEXTS[1], encoding="utf-8")
    assert list(tok.iter_documents(tok.expand_inputs([tmp_path / "a.txt"]))) == [TEXTS[0] + "\n\n" + TEXTS[1]]


def test_parquet_text_column_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed: parquet input unsupported")
    import pyarrow.parquet as pq
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "text": TEXTS}), path)
    assert list(tok.iter_documents(tok.expand_inputs([path]))) == TEXTS


def test_parquet_without_text_column_is_a_clear_error(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow not installed: parquet input unsupported")
    import pyarrow.parquet as pq
    path = tmp_path / "notext.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(tok.InputError, match=r'notext\.parquet.*"text" column'):
        list(tok.iter_documents(tok.expand_inputs([path])))


def test_directory_expands_to_its_supported_files_sorted(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "b.jsonl", [TEXTS[1]])
    (d / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    write_jsonl(d / "sub" / "c.jsonl.gz", [TEXTS[2]], gzip.open)
    (d / "README.md").write_text("not an input")
    (d / ".hidden.jsonl").write_text("garbage")
    files = tok.expand_inputs([d])
    assert [p.relative_to(d).as_posix() for p in files] == ["a.txt", "b.jsonl", "sub/c.jsonl.gz"]
    assert list(tok.iter_documents(files)) == TEXTS


@pytest.mark.parametrize("name,content,needle", [
    ("missing.jsonl", None, "no such file"),
    ("notes.md", "hello", "unknown input type"),
    ("data.csv.gz", "", "unknown input type"),
])
def test_bad_input_paths_are_errors_naming_the_file(tmp_path, name, content, needle):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(tok.InputError, match=needle) as e:
        tok.expand_inputs([path])
    assert name in str(e.value)


def test_directory_without_inputs_is_an_error(tmp_path):
    (tmp_path / "x.md").write_text("")
    with pytest.raises(tok.InputError, match="no supported input"):
        tok.expand_inputs([tmp_path])


@pytest.mark.parametrize("line,needle", [
    ("{not json", "not valid JSON"),
    ('{"body": "x"}', 'no "text" field'),
    ('{"text": 3}', "not a string"),
])
def test_malformed_jsonl_is_an_error_naming_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n\n" + line + "\n")
    with pytest.raises(tok.InputError, match=needle) as e:
        list(tok.iter_documents([path]))
    assert "bad.jsonl:3" in str(e.value)


def test_corrupt_compressed_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "broken.jsonl.xz"
    path.write_bytes(b"definitely not xz")
    with pytest.raises(tok.InputError, match=r"broken\.jsonl\.xz"):
        list(tok.iter_documents([path]))


def test_cli_reports_input_errors_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tok.main([str(tmp_path / "absent.jsonl"), "--out", str(tmp_path / "out")])
    assert str(e.value) == f"tokenize_corpus.py: error: {tmp_path / 'absent.jsonl'}: no such file or directory"


def test_cli_refuses_an_out_that_is_a_file_in_one_line(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", TEXTS)
    (tmp_path / "out").write_text("a file")
    with pytest.raises(SystemExit) as e:
        tok.main([str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")])
    assert str(e.value) == f"tokenize_corpus.py: error: --out {tmp_path / 'out'}: exists and is not a directory"


def test_cli_usage_errors_carry_the_same_tool_name(capsys):
    with pytest.raises(SystemExit) as e:
        tok.main(["x.jsonl"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tokenize_corpus.py: error: the following arguments are required: --out")


def test_cli_reports_any_other_error_in_one_line_and_speedrun_debug_raises_it(tmp_path, monkeypatch, capsys):
    def disk_full(argv):
        raise OSError(28, "No space left on device", str(tmp_path / "fineweb_train_000001.bin"))
    monkeypatch.setattr(tok, "main", disk_full)
    monkeypatch.delenv("SPEEDRUN_DEBUG", raising=False)
    assert tok.cli([]) == 1
    assert capsys.readouterr().err == \
        f"tokenize_corpus.py: error: {tmp_path / 'fineweb_train_000001.bin'}: No space left on device\n"
    monkeypatch.setenv("SPEEDRUN_DEBUG", "1")
    with pytest.raises(OSError, match="No space left"):
        tok.cli([])


def test_cli_without_tiktoken_names_the_package(tmp_path, monkeypatch):
    def missing(cls):
        raise ImportError("No module named 'tiktoken'")
    monkeypatch.setattr(tok.GPT2Encoder, "load", classmethod(missing))
    write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(SystemExit) as e:
        tok.main([str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")])
    assert str(e.value) == "tokenize_corpus.py: error: the GPT-2 BPE needs the tiktoken package (pip install tiktoken)"


def test_cli_without_gpt2_files_says_to_set_tiktoken_cache_dir(tmp_path, monkeypatch):
    def unavailable(cls):
        raise ConnectionError("network is unreachable")
    monkeypatch.setattr(tok.GPT2Encoder, "load", classmethod(unavailable))
    write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(SystemExit) as e:
        tok.main([str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "out")])
    assert str(e.value).startswith("tokenize_corpus.py: error: cannot load tiktoken's GPT-2 encoding")
    assert "TIKTOKEN_CACHE_DIR" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------------------------
# Real GPT-2 through the command line

def gpt2_cache_dir():
    env = os.environ.get("TIKTOKEN_CACHE_DIR")
    if env:
        return env
    sibling = ROOT.parent / "shared" / "data" / "gpt2" / "tiktoken_cache"
    if sibling.is_dir():
        return str(sibling)
    pytest.skip("GPT-2 BPE files unavailable offline: set TIKTOKEN_CACHE_DIR to a folder with the GPT-2 BPE files")


def test_cli_gpt2_round_trip_reproduces_texts_with_endoftext_separators(tmp_path, monkeypatch):
    cache = gpt2_cache_dir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", cache)
    texts = TEXTS + [f"Document number {i}. " * (i + 1) for i in range(6)]
    write_jsonl(tmp_path / "a.jsonl.gz", texts[:5], gzip.open)
    (tmp_path / "b.txt").write_text(texts[5], encoding="utf-8")
    write_jsonl(tmp_path / "c.jsonl", texts[6:])
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "data" / "tokenize_corpus.py"), str(tmp_path / "a.jsonl.gz"),
           str(tmp_path / "b.txt"), str(tmp_path / "c.jsonl"), "--out", str(out),
           "--val_tokens", "20", "--shard_tokens", "40", "--workers", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"documents: {len(texts)}" in res.stdout and "fineweb_val_000000.bin" in res.stdout

    import tiktoken
    enc = tiktoken.get_encoding("gpt2")  # from the same cache the CLI used
    stream = concat_shards(out)
    assert stream[0] == BOS
    assert enc.decode(stream.tolist()) == "".join("<|endoftext|>" + t for t in texts)
    # the literal "<|endoftext|>" inside a text is ordinary text, not the special token
    assert int((stream == BOS).sum()) == len(texts)
    sizes = [tg.read_shard_header(p) for p in shard_files(out)]
    assert sizes[0] >= 21 and all(n == 40 for n in sizes[1:-1]) and sizes[-1] <= 40
