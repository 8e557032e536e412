"""What a newcomer meets at the command line: one-line errors naming the fix, help that explains
every field and preset, data never overwritten, failures found at start-up, a resume hint that is
a whole command, and non-zero exits when a run did not finish."""
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as tg
from conftest import FAST, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "train_gpt.py"), *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("argv, expected", [
    (["--compile", "maybe"], "argument --compile: expected true or false, not 'maybe'"),
    (["--window_schedule", "3,x"], "expected comma-separated integers such as 3,7,11, not '3,x'"),
    (["--lr_schedule", "1,x"], "expected comma-separated numbers such as 1,1.52,1.73, not '1,x'"),
    (["--no_such_field", "1"], "unrecognized arguments: --no_such_field 1"),
    (["--preset", "huge"], "--preset huge: choose one of record, smoke, single, medium"),
    (["--num_iteration", "10"], "unrecognized arguments: --num_iteration 10"),  # no abbreviations
    (["--save", "10"], "unrecognized arguments: --save 10"),
])
def test_bad_flags_are_one_line_errors_naming_the_expected_form(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        tg.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("train_gpt.py: error: ") and expected in err


def test_help_describes_every_commented_field_and_lists_the_presets(capsys):
    with pytest.raises(SystemExit):
        tg.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "tokens per optimizer step, summed over ranks and accumulation steps" in " ".join(out.split())
    helps = tg.field_help()
    assert {"batch_size", "val_seq_len", "max_doc_len", "save_every", "resume"} <= set(helps)
    for name in tg.PRESETS:
        assert f"\n  {name} " in out


@pytest.mark.slow
def test_a_start_up_error_is_one_line_with_a_non_zero_exit_and_leaves_no_log(tmp_path):
    proc = run_cli("--train_files", str(tmp_path / "none_*.bin"), "--log_dir", str(tmp_path / "logs"),
                   "--run_id", "failed", "--device", "cpu")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("train_gpt.py: error: no training shards match")
    assert not (tmp_path / "logs" / "failed.txt").exists()


@pytest.mark.slow
def test_no_usable_gpu_is_one_line_saying_why_unless_the_cpu_is_asked_for(tmp_path, monkeypatch):
    """The record preset where torch sees no GPU (a CPU-only build; a CUDA build without a driver) stops
    before anything else with one line naming the cause and the fix; --device cpu and the smoke preset's
    auto run on the CPU."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for build, cause in ((None, "is a CPU-only build"), ("13.0", "(CUDA 13.0) sees no GPU")):
        monkeypatch.setattr(torch.version, "cuda", build)
        with pytest.raises(ValueError, match="no usable GPU") as e:
            tg.start_processes(tg.parse_args([]))
        assert cause in str(e.value) and "--device cpu" in str(e.value) and "\n" not in str(e.value)
    assert tg.start_processes(tg.parse_args(["--device", "cpu"]))[2].type == "cpu"
    assert tg.start_processes(tg.parse_args(["--preset", "smoke"]))[2].type == "cpu"
    with pytest.raises(ValueError, match="device='gpu': choose cuda, cpu or auto"):
        tg.parse_args(["--device", "gpu"])
    if not torch.backends.cuda.is_built():  # this machine's torch is a CPU build: the whole command, one line
        monkeypatch.undo()
        proc = run_cli("--log_dir", str(tmp_path / "logs"), "--run_id", "x")
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("train_gpt.py: error: no usable GPU: this PyTorch") and not (tmp_path / "logs").exists()


def test_the_smoke_generator_never_overwrites_a_file_it_did_not_write(tmp_path):
    mine = tmp_path / "mine"
    write_corpus(mine)
    real = mine / "syn_train_000001.bin"
    before = hashlib.md5(real.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="not written by the synthetic-corpus generator: refusing"):
        tg.write_markov_corpus(str(mine / "syn_train_*.bin"), str(tmp_path / "v" / "val_*.bin"), 64, 63, 1024,
                               train_tokens=20_000)
    assert hashlib.md5(real.read_bytes()).hexdigest() == before
    # its own files are recognised, marked and reused; a damaged one of its own is not rewritten either
    train, val = str(tmp_path / "g" / "train_*.bin"), str(tmp_path / "g" / "val_*.bin")
    tg.write_markov_corpus(train, val, 64, 63, 1024, train_tokens=20_000)
    shard = tmp_path / "g" / "train_000001.bin"
    assert (tmp_path / "g" / "train_000001.bin.markov").read_text().strip() == hashlib.sha256(shard.read_bytes()).hexdigest()
    tg.write_markov_corpus(train, val, 64, 63, 1024, train_tokens=20_000)
    shard.write_bytes(shard.read_bytes()[:-2] + b"\x00\x00")
    with pytest.raises(ValueError, match="refusing"):
        tg.write_markov_corpus(train, val, 64, 63, 1024, train_tokens=20_000)


def test_a_refused_smoke_corpus_writes_no_file_at_all(tmp_path):
    """A foreign markov_train_000001.bin beside the smoke corpus' val shard (issue 61 item 5): the val shard and
    its .markov sidecar were written before the train shard was found foreign; now the folder is left as it was."""
    folder = tmp_path / "smoke"
    folder.mkdir()
    tg.write_shard(folder / "markov_train_000001.bin", np.arange(1000) % 60)
    before = hashlib.md5((folder / "markov_train_000001.bin").read_bytes()).hexdigest()
    with pytest.raises(ValueError, match="markov_train_000001.bin exists and was not written by the synthetic-corpus"):
        tg.write_markov_corpus(str(folder / "markov_train_*.bin"), str(folder / "markov_val_*.bin"), 64, 63, 1024,
                               train_tokens=20_000)
    assert [p.name for p in folder.iterdir()] == ["markov_train_000001.bin"]
    assert hashlib.md5((folder / "markov_train_000001.bin").read_bytes()).hexdigest() == before


def test_a_damaged_later_training_shard_is_found_at_start_up(tiny_args, tmp_path):
    args = tiny_args(num_iterations=2, run_id="bad")
    second = sorted(Path(args.train_files).parent.glob("syn_train_*.bin"))[1]
    second.write_bytes(second.read_bytes()[:-100])
    with pytest.raises(tg.ShardError, match=f"{second.name}: file is .* truncated"):
        tg.train(args)
    assert not (Path(args.log_dir) / "bad.txt").exists()


@pytest.mark.slow
def test_a_data_error_mid_run_saves_a_checkpoint_and_says_how_to_continue(tiny_args, tmp_path, monkeypatch):
    args = tiny_args(num_iterations=24, val_every=0, run_id="mid", checkpoint_dir=str(tmp_path / "ck"))
    second = sorted(Path(args.train_files).parent.glob("syn_train_*.bin"))[1]
    real_load = tg.load_shard

    def load(path):  # the second shard breaks after the start-up checks passed
        if Path(path) == second:
            raise tg.ShardError(f"{path}: read 7 tokens, header promises 20000")
        return real_load(path)
    monkeypatch.setattr(tg, "load_shard", load)
    with pytest.raises(tg.ShardError) as e:
        tg.train(args)
    saved = sorted((tmp_path / "ck" / "mid").glob("step_*"))
    assert len(saved) == 1 and 0 < int(saved[0].name[5:]) < 24
    assert f"continue with: python train_gpt.py --resume {saved[0]}" in str(e.value)
    monkeypatch.setattr(tg, "load_shard", real_load)  # the data fixed: the hint alone continues the run
    resumed = tg.train(tg.parse_args(["--resume", str(saved[0])]))
    assert resumed.first_step == int(saved[0].name[5:]) and resumed.val_losses[-1][0] == 24


@pytest.mark.slow
def test_the_resume_hint_alone_continues_with_the_checkpoints_hyperparameters(tiny_args, tmp_path):
    args = tiny_args(num_iterations=6, val_every=3, save_every=3, adam_every=1, run_id="hint", checkpoint_dir=str(tmp_path / "ck"),
                     max_doc_len=64, muon_lr=0.03)
    full = tg.train(args)
    parsed = tg.parse_args(["--resume", str(tmp_path / "ck" / "hint" / "step_000003")])
    assert parsed == tg.Hyperparameters(**{**vars(args), "resume": str(tmp_path / "ck" / "hint" / "step_000003"),
                                           "run_id": ""})  # the id: the run's if it continues, else a new one
    resumed = tg.train(parsed)
    assert resumed.train_losses == full.train_losses[3:] and resumed.val_losses[-1] == full.val_losses[-1]
    assert Path(resumed.log_path).stem != "hint"  # step 3 of a run that went on: a new run
    # a flag given now overrides the checkpoint's value; a different model shape is refused
    assert tg.parse_args(["--resume", "latest", "--checkpoint_dir", str(tmp_path / "ck"),
                          "--num_iterations", "9"]).num_iterations == 9
    with pytest.raises(ValueError, match="different model: model_dim"):
        tg.train(tg.parse_args(["--resume", parsed.resume, "--model_dim", "96", "--head_dim", "48"]))


def test_a_run_sizes_cu_seqlens_from_its_data_by_default(tiny_args, capsys):
    run = tg.train(tiny_args(**FAST, num_iterations=2, val_every=0, max_num_docs=0, warmup_steps=1))
    out = capsys.readouterr().out
    assert "data: cu_seqlens sized to this run's fullest micro-batches" in out and run.val_losses[-1][0] == 2


def test_cpu_runs_report_a_float32_head_and_memory_per_process(tiny_args, capsys):
    run = tg.train(tiny_args(**FAST, num_iterations=1, val_every=0, fp8_head=True, save_every=1, adam_every=1))
    out = capsys.readouterr().out
    assert "LM head: float32" in out and "memory per process: ~" in out and "MiB" in out
    # on the CPU every weight, the embeddings included, is float32 (bf16 matmuls are emulated there)
    weights = tg.read_checkpoint_file(Path(run.checkpoint) / "model.pt")["model"]
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}
    assert "finished at step 1/1: training time" in out


@pytest.mark.parametrize("argv", [["--num_iterations", "0"], ["--num_iterations", "-5"], ["--batch_size", "0"],
                                  ["--val_tokens", "-1"]])
def test_sizes_and_step_counts_must_be_positive(argv):
    with pytest.raises(ValueError, match=f"^{argv[0]} {argv[1]}: must be positive$"):
        tg.parse_args(argv)


@pytest.mark.parametrize("name, zero", [("save_every", "saves only at a SIGTERM or Ctrl-C"),
                                        ("val_every", "validates only at the end"), ("log_every", "logs none"),
                                        ("keep_checkpoints", "keeps them all")])
def test_negative_cadences_are_refused_naming_what_0_means(name, zero):
    """--save_every -1 was taken and acted as 0 (issue 61 item 4); refused before save_every's check against
    adam_every (the record's 2), which would name the wrong fix."""
    for preset in ("smoke", "record"):
        with pytest.raises(ValueError, match=rf"^--{name} -1: .*, or 0 \({re.escape(zero)}\); not negative$"):
            tg.parse_args(["--preset", preset, f"--{name}", "-1"])
    assert getattr(tg.parse_args([f"--{name}", "0"]), name) == 0


def test_too_few_steps_for_the_extension_name_both_fixes(capsys):
    """`--num_iterations 10 --plan` with the record's 20-step extension (issue 61 item 6): one line naming the
    step count that fits and the flags that turn the extension off; either fix then plans."""
    assert tg.main(["--num_iterations", "10", "--plan"]) == 1
    assert capsys.readouterr().err == (
        "train_gpt.py: error: num_iterations=10 leaves no step before the 20-step extension: give "
        "--num_iterations 21 or more, or leave the extension out with --extension_steps 0 --extension_window 0\n")
    for fix in (["--num_iterations", "21"], ["--num_iterations", "10", "--extension_steps", "0", "--extension_window", "0"]):
        assert tg.main([*fix, "--plan"]) == 0, fix
    with pytest.raises(ValueError, match="extension_steps=5 and extension_window=0: both zero"):
        tg.parse_args(["--extension_steps", "5", "--extension_window", "0"])


def test_no_gpu_reason_quotes_the_warning_torch_gives(monkeypatch):
    import warnings

    def unavailable():
        warnings.warn("CUDA initialization: The NVIDIA driver on your system is too old (found version 11040).")
        return False
    monkeypatch.setattr(tg.torch.cuda, "is_available", unavailable)
    monkeypatch.setattr(tg.torch.version, "cuda", "13.0")  # a CUDA build on a machine whose driver is too old
    reason = tg.no_gpu_reason()
    assert reason.startswith("no usable GPU: ") and "The NVIDIA driver on your system is too old" in reason
