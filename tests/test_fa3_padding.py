"""bench/fa3_padding.py's CPU side: the padded cu_seqlens it times and its count of documents per micro-batch (the
same count as train_gpt.most_documents, which sizes a run's cu_seqlens)."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fa3_padding  # noqa: E402
import train_gpt as tg  # noqa: E402  (fa3_padding put the repository on the path)
from conftest import BOS  # noqa: E402


def test_cu_seqlens_are_padded_with_empty_sequences_at_the_end():
    cu = fa3_padding.cu_seqlens([3, 5, 2], 6, "cpu").tolist()
    assert cu == [0, 3, 8, 10, 10, 10, 10]


def test_synthetic_documents_fill_the_micro_batch_exactly_and_respect_the_cut():
    lengths = fa3_padding.synthetic(4096, 300)
    assert sum(lengths) == 4096 and max(lengths) <= 300 and min(lengths) >= 1 and len(lengths) > 4096 // 300


def test_counted_documents_are_the_training_loaders(corpus, capsys, monkeypatch):
    files = tg.shard_files(corpus[0], "training")
    counts = fa3_padding.doc_counts(files, 128, 24, 40, BOS)
    producer = tg.BatchProducer(files, 0, 1, BOS, log=lambda m: None)
    spec = tg.BatchSpec(128, 128, 24, num_docs=128)
    for lengths in counts:  # the same pieces, in order, as the training producer cuts them
        (x, _, cu), = producer.step(spec)
        assert lengths == np.diff(cu)[np.diff(cu) > 0].tolist()
    assert max(map(len, counts)) == tg.most_documents(files, BOS, [[spec] * 40])[128, 24]
    monkeypatch.setattr(sys, "argv", ["fa3_padding.py", "--train_files", corpus[0], "--seq_len", "128",
                                      "--max_doc_len", "24", "--slots", "40", "--bos_id", str(BOS),
                                      "--count_only"])
    fa3_padding.main()
    out = capsys.readouterr().out
    assert f"max {max(map(len, counts))}" in out and "over 40 micro-batches" in out
