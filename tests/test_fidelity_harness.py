"""bench/fidelity_0903.py: the public script is cut from a record log and staged with only the
overrides the protocol needs; logs of both codes parse into the same table."""
import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import fidelity_0903 as fh  # noqa: E402

PUBLIC_LIKE = '''import os
@dataclass
class Hyperparameters:
    train_files: str = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
    val_tokens: int = 10485760 # how many tokens
    train_batch_size: int = 2048 * 24 * 8
    num_iterations: int = 1670 # number of iterations to run
    run_id: str = str(uuid.uuid4())
print0(f"step:{step}/{train_steps} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms")
'''


def fake_checkout(tmp_path, source=PUBLIC_LIKE):
    folder = tmp_path / "ck" / "records" / "track_1_short" / "2025-09-03_FA3"
    folder.mkdir(parents=True)
    (folder / "b.txt").write_text(source + "=" * 100 + "\nstep:0/1670 val_loss:10.8258 train_time:0ms\n")
    return tmp_path / "ck"


def test_public_source_is_the_log_text_before_the_separator(tmp_path):
    source, md5 = fh.public_source(fake_checkout(tmp_path))
    assert source == PUBLIC_LIKE and len(md5) == 32


def test_overrides_replace_one_default_and_keep_the_comment():
    out = fh.override(PUBLIC_LIKE, "num_iterations", "400")
    assert "    num_iterations: int = 400 # number of iterations to run\n" in out
    out = fh.override(out, "train_batch_size", "131072")
    assert "    train_batch_size: int = 131072\n" in out
    assert out.count("\n") == PUBLIC_LIKE.count("\n")


def test_a_field_the_public_script_lacks_is_a_clear_error():
    with pytest.raises(SystemExit, match="no single field 'val_batch_size'"):
        fh.override(PUBLIC_LIKE, "val_batch_size", "1")


def test_missing_checkout_names_the_expected_files(tmp_path):
    with pytest.raises(SystemExit, match="2025-09-03_FA3"):
        fh.public_source(tmp_path)


def test_val_lines_after_the_source_are_read_and_example_lines_in_the_code_are_not(tmp_path):
    log = tmp_path / "run.txt"
    log.write_text(PUBLIC_LIKE + "=" * 100 + "\nstep:0/400 val_loss:10.8258 train_time:0ms step_avg:0.02ms\n"
                   "step:1/400 train_time:300ms step_avg:300.00ms\n"
                   "step:50/400 val_loss:4.4530 train_time:14000ms step_avg:280.00ms\n")
    assert fh.val_losses(log) == {0: (10.8258, 0, None), 50: (4.453, 14000, None)}


def test_tokens_to_a_target_loss_come_from_the_log_or_from_steps_times_the_batch(tmp_path):
    ours = tmp_path / "ours.txt"
    ours.write_text("=" * 100 + "\nstep:50/200 val_loss:3.1000 train_time:9000ms step_avg:180.00ms tokens:4,000,000\n"
                    "step:100/200 val_loss:2.9000 train_time:20000ms step_avg:200.00ms tokens:10000000\n")
    results = {"ours seed 0": fh.val_losses(ours), "public seed 0": {50: (3.0, 15000), 100: (2.95, 30000)},
               "slow seed 0": {100: (3.2, 30000, None)}}
    assert results["ours seed 0"] == {50: (3.1, 9000, 4000000), 100: (2.9, 20000, 10000000)}
    lines = fh.target_table(results, 2.98, 131072)
    assert lines[4:] == ["| ours seed 0 | 100 | 10,000,000 | 20.0 |", "| public seed 0 | 100 | 13,107,200 | 30.0 |",
                         "| slow seed 0 | not reached | - | - |"]


def test_a_seeded_public_run_seeds_torch_just_before_the_model_is_built():
    source = PUBLIC_LIKE + "print0('=' * 100)\nmodel: nn.Module = GPT(\n    vocab_size=50257,\n).cuda()\n"
    out = fh.seed_public(source, 7)
    assert out.replace("torch.manual_seed(7)  # inserted by the harness\n", "", 1) == source
    assert out.index("torch.manual_seed(7)") < out.index("model: nn.Module = GPT(") < out.index("vocab_size=50257")
    with pytest.raises(SystemExit, match="no single `model: nn.Module = GPT\\(` line"):
        fh.seed_public(PUBLIC_LIKE, 7)


def test_table_compares_each_variant_mean_with_the_reference_group():
    results = {"public seed 0": {0: (10.8, 0), 50: (4.40, 15000)}, "public seed 1": {0: (10.8, 0), 50: (4.42, 15100)},
               "ours seed 0": {0: (10.8, 0), 50: (4.45, 14000)}, "ours seed 1": {0: (10.8, 0), 50: (4.43, 14200)},
               "bigram seed 0": {0: (10.8, 0)}}  # a run that stopped before step 50
    groups = {"public": ["public seed 0", "public seed 1"], "ours": ["ours seed 0", "ours seed 1"],
              "bigram": ["bigram seed 0"]}
    lines = fh.format_table(results, groups)
    assert lines[0] == ("| step | public seed 0 | public seed 1 | ours seed 0 | ours seed 1 | bigram seed 0 "
                        "| ours mean - public mean | bigram mean - public mean |")
    assert lines[2] == "| 0 | 10.8000 | 10.8000 | 10.8000 | 10.8000 | 10.8000 | +0.0000 | +0.0000 |"
    assert lines[3] == "| 50 | 4.4000 | 4.4200 | 4.4500 | 4.4300 | - | +0.0300 | - |"
    assert lines[-1] == ("ms/step: public seed 0 300.0, public seed 1 302.0, ours seed 0 280.0, ours seed 1 284.0, "
                         "bigram seed 0 -")


@pytest.mark.parametrize("variant", [["ours", "--seed 3"], ["public-x", ""], ["has space", ""]])
def test_variant_names_that_would_clash_or_make_bad_file_names_are_refused(monkeypatch, tmp_path, variant):
    monkeypatch.setattr(sys, "argv", ["fidelity_0903.py", "--public", str(tmp_path), "--train_files", "x",
                                      "--val_files", "y", "--variant", *variant])
    with pytest.raises(SystemExit, match="--variant names must differ"):
        fh.main()


def test_parallel_runs_are_capped_by_the_gpu_memory(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gib, runs in ((80, 4), (141, 7), (10, 1)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert fh.runs_that_fit() == runs


def test_ours_runs_the_0903_algorithm_and_a_variant_can_pick_todays_record(monkeypatch, tmp_path):
    """The harness compares the public 09/03 code with our 09/03 preset, whatever the record preset has
    become; `--variant NAME "--preset record"` runs today's record on the same protocol."""
    import train_gpt as tg
    from conftest import write_corpus
    train, val = write_corpus(tmp_path / "data")
    launched = []

    def fake_launch(cmd, cwd, log, env):
        launched.append(cmd)
        return SimpleNamespace(poll=lambda: 0, wait=lambda: 0, returncode=0)
    monkeypatch.setattr(fh, "launch", fake_launch)
    fields = "".join(f"    {name}: int = 1 # x\n" for name in ("val_files", "val_batch_size", "val_loss_every"))
    public = PUBLIC_LIKE.replace("class Hyperparameters:\n", "class Hyperparameters:\n" + fields)
    monkeypatch.setattr(sys, "argv", ["fidelity_0903.py", "--public", str(fake_checkout(tmp_path, public)), "--train_files", train,
                                      "--val_files", val, "--steps", "20", "--seeds", "0", "--work", str(tmp_path / "w"),
                                      "--variant", "today", "--preset record"])
    fh.main()
    ours = [cmd[cmd.index("--nproc_per_node=1") + 2:] for cmd in launched if str(fh.ROOT / "train_gpt.py") in cmd]
    assert len(ours) == 2 and len(launched) == 3  # the public run, then ours and the variant
    base, today = (tg.parse_args(argv) for argv in ours)
    assert base.preset == "record-0903" and base.logit_softcap == 30.0 and base.orthogonalizer == "newton_schulz"
    assert today.preset == "record" and (today.logit_softcap, today.backout_layer) == (23.0, 8)
    assert base.num_iterations == today.num_iterations == 20 and base.batch_size == today.batch_size == 131072
