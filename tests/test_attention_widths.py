"""bench/attention_widths.py on the CPU (the reference path, a small micro-batch): every width case timed, the native
(64,128) route only for backends that take mixed widths, and its output equal to the padded route's."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import attention_widths  # noqa: E402


def rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| reference |")]


def test_the_cases_are_timed_and_the_native_route_equals_the_padded_one(capsys):
    attention_widths.main(["--device", "cpu", "--seq_len", "192", "--max_doc_len", "64", "--windows", "16", "48",
                           "--reps", "1"])
    got = rows(capsys.readouterr().out)
    assert [(r[1], r[2]) for r in got] == [(w, c) for w in ("16", "48")
                                          for c in ("128/128", "64/128 padded", "64/128 native", "64/64")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in got) and {r[5] for r in got[::4]} == {"1.000x"}
    assert all(float(r[6]) < 1e-5 for r in got if r[2] == "64/128 native")
    assert all(r[6] == "-" for r in got if r[2] != "64/128 native")


def test_a_backend_of_one_width_gets_no_native_case_and_a_missing_backend_is_named(monkeypatch, capsys):
    monkeypatch.setattr(attention_widths.kernels, "MIXED_WIDTHS", {"fa4"})
    attention_widths.main(["--device", "cpu", "--seq_len", "128", "--max_doc_len", "64", "--windows", "16",
                           "--reps", "1", "--paired"])
    out = capsys.readouterr().out
    assert "256 tokens x 3 heads (paired)" in out and [r[2] for r in rows(out)] == ["128/128", "64/128 padded", "64/64"]
    with pytest.raises(SystemExit, match=r"backend\(s\) \['fa4'\] not installed here"):
        attention_widths.main(["--device", "cpu", "--backends", "fa4"])
