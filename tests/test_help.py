"""--help as a newcomer reads it (issue 36 item 7): the presets first, every field described, the chosen
preset's defaults, each default in a form the parser takes back; and Ctrl-C before training starts is one
line, not a traceback (item 8)."""
import dataclasses
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train_gpt as tg

ROOT = Path(__file__).resolve().parents[1]


def help_text(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        tg.parse_args([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def defaults_shown(out: str) -> dict[str, str]:
    """--field -> the text after '(default: ' in its help, the lines of one entry joined."""
    entries = re.split(r"\n  (?=--\w)", out.split("\nthe flags most runs need:\n", 1)[1])
    shown = {}
    for entry in entries:
        entry = entry.split("\n\n")[0]  # the last field's entry ends where the next group begins
        m = re.match(r"(--\w+)", entry)
        d = re.search(r"\(default:\s*(.*)\)\s*$", " ".join(entry.split()))
        if m and d:
            shown[m[1]] = d[1].replace(" ", "") if m[1] == "--stages" else d[1]
    return shown


def test_help_lists_the_presets_before_any_field_and_describes_every_field(capsys):
    out = help_text(capsys)
    first_field = out.index("--train_files")
    for name in tg.PRESETS:
        assert out.index(f"\n  {name} ") < first_field, name
    assert out.index("usage:") == 0 and len(out.split("\n\n", 1)[0].splitlines()) <= 2  # a short usage line
    fields = [f.name for f in dataclasses.fields(tg.Hyperparameters)]
    assert set(fields) <= set(tg.field_help()), set(fields) - set(tg.field_help())
    for name in fields:
        entry = out.split(f"\n  --{name} ", 1)[1].split("\n  --", 1)[0]
        assert len(entry.split("(default:")[0].split()) >= 3, name  # a description, not just the metavar


def test_help_opens_with_examples_and_the_flags_a_newcomer_needs_then_the_rest(capsys):
    """--help listed --preset, --resume, --save_every, --device and --plan among ~100 fields, the last ones at the
    bottom, with no example (issue 61 item 7): now they and the examples come first, on the first screen."""
    out = help_text(capsys)
    head = out[:out.index("\npresets (")]
    assert len(head.splitlines()) <= 30 and "--train_files" not in head
    for name in tg.FIRST_FLAGS:
        assert f"\n  --{name} " in head and out.count(f"\n  --{name} ") == 1, name  # listed once, up here
    examples = [line.split("#")[0].split() for line in head.splitlines() if line.startswith(("  python ", "  ./run.sh"))]
    assert ["python", "train_gpt.py", "--preset", "smoke"] in examples and ["./run.sh", "--resume", "latest"] in examples
    for example in examples:  # each parses (a resume needs a checkpoint: its flag is read, not followed)
        flags = example[2:] if example[0] == "python" else example[1:]
        assert tg.parse_args([f for f in flags if f not in ("--resume", "latest")]).preset in tg.PRESETS, example


@pytest.mark.parametrize("preset", list(tg.PRESETS))
def test_help_shows_the_chosen_presets_defaults_in_a_form_the_parser_takes_back(capsys, preset):
    shown = defaults_shown(help_text(capsys, "--preset", preset))
    expected = tg.parse_args(["--preset", preset])
    for f in dataclasses.fields(tg.Hyperparameters):
        text = shown[f"--{f.name}"]
        value = getattr(expected, f.name)
        assert text == (tg.cli_text(value) or '""'), f.name
        if f.name in ("preset", "resume"):
            continue  # parsing these has effects beyond the field (the preset's fields; reading a checkpoint)
        again = tg.parse_args(["--preset", preset, f"--{f.name}", "" if text == '""' else text])
        assert getattr(again, f.name) == value, (f.name, text)
    assert "(3, 7, 11)" not in " ".join(shown.values())  # no Python tuple reprs


def test_smoke_help_is_not_the_records(capsys):
    smoke, record = defaults_shown(help_text(capsys, "--preset", "smoke")), defaults_shown(help_text(capsys))
    assert smoke["--vocab_size"] == "136" and record["--vocab_size"] == "50304"
    assert smoke["--stages"] == "window=1,doc_len=256,mtp=0.5/0.25;window=2,mtp=0.5/0;window=3,mtp=0/0"


def test_ctrl_c_before_training_starts_is_one_line_and_status_130(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"), "--preset", "smoke", "--log_dir",
                             str(tmp_path / "logs")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    # inside the imports: once numpy's library is mapped (it loads after the handler is set, and torch after it),
    # not at a fixed delay, which a loaded machine can outlast before the handler is set
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 60
    if maps.parent.exists():
        while "numpy" not in maps.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
    else:  # no /proc: a delay that is inside the imports on an idle machine
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, (out, err)
    assert err == "train_gpt.py: interrupted before training started; nothing was saved\n"
