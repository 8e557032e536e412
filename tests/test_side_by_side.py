"""bench/side_by_side.py: the public script is read from a record log or a commit and staged with the
run-time patches it needs; the scaling rule and the data check; logs of both codes parse into the same
tables."""
import os
import sys
from types import SimpleNamespace
from pathlib import Path

import re

import numpy as np
import torch
import pytest

import train_gpt as tg
from conftest import write_corpus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import side_by_side as fh  # noqa: E402

REAL_CHECK_VOCABULARY = fh.check_vocabulary


@pytest.fixture(autouse=True)
def vocabulary_present(monkeypatch):
    """The GPT-2 files tiktoken fetches on first use are not part of the tests (offline CI): the harness's check
    that they load passes here, but in the test of that check."""
    monkeypatch.setattr(fh, "check_vocabulary", lambda: None)


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
    """A checkout holding a log of record #89 (the code read from a record's log) that embeds `source`."""
    log = tmp_path / "ck" / fh.RECORD_LOGS["89"].replace("*", "b")
    log.parent.mkdir(parents=True)
    log.write_text(source + "=" * 100 + "\nstep:0/1670 val_loss:10.8258 train_time:0ms\n")
    return tmp_path / "ck"


def test_public_source_is_the_log_text_before_the_separator(tmp_path):
    code = fh.public_source(fake_checkout(tmp_path), "89")
    assert code.script == PUBLIC_LIKE and code.files == {"train_gpt.py": PUBLIC_LIKE}
    assert re.fullmatch(r"records/track_1_short/2026-07-17_FP8DownProjection/this_pr/11cb620c-b\.txt "
                        r"\(md5 [0-9a-f]{32}\)", code.origin)


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
    with pytest.raises(SystemExit, match="2026-07-17_FP8DownProjection"):
        fh.public_source(tmp_path, "89")


def test_tokens_to_a_target_loss_come_from_the_log_or_the_schedule():
    ours = ("=" * 100 + "\nstep:50/200 val_loss:3.1000 train_time:9000ms step_avg:180.00ms tokens:4,000,000\n"
            "step:100/200 val_loss:2.9000 train_time:20000ms step_avg:200.00ms tokens:10000000\n")
    results = {"ours seed 0": fh.logparse.val_losses(ours), "public seed 0": {50: (3.0, 15000, 6553600), 100: (2.95, 30000, 13107200)},
               "slow seed 0": {100: (3.2, 30000, None)}, "untold seed 0": {100: (2.9, 30000, None)}}
    assert results["ours seed 0"] == {50: (3.1, 9000, 4000000), 100: (2.9, 20000, 10000000)}
    lines = fh.target_table(results, 2.98)
    assert lines[4:] == ["| ours seed 0 | 100 | 10,000,000 | 20.0 |", "| public seed 0 | 100 | 13,107,200 | 30.0 |",
                         "| slow seed 0 | not reached | - | - |", "| untold seed 0 | 100 | - | 30.0 |"]


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
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--public", str(tmp_path), "--train_files", "x",
                                      "--val_files", "y", "--variant", *variant])
    with pytest.raises(SystemExit, match="--variant names must differ"):
        fh.main()


def test_parallel_runs_are_capped_by_the_gpu_memory(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gib, runs in ((80, 3), (141, 5), (10, 1)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, gib=gib: SimpleNamespace(total_memory=gib << 30))
        assert fh.runs_that_fit() == runs


def fake_main(monkeypatch, tmp_path, argv: list[str], rc: int = 0, launched=None, loaders=None, envs=None) -> list:
    """main() against master_code() on a small corpus, nothing run: the launched (command, log name) pairs, the
    data check passed (it has its own tests) unless `loaders` gives stand-ins for its walks by name; each launched
    run exits with rc. `envs`, if given, gets each run's Inductor cache by log name."""
    train, val = write_corpus(tmp_path / "data")
    launched = [] if launched is None else launched

    def fake_launch(cmd, cwd, log, env):
        launched.append((cmd, log.name))
        if envs is not None:
            envs[log.name] = env["TORCHINDUCTOR_CACHE_DIR"]
        return SimpleNamespace(poll=lambda: 0, wait=lambda: rc, returncode=0)
    monkeypatch.setattr(fh, "launch", fake_launch)
    monkeypatch.setattr(fh, "public_source", lambda *a: master_code())
    for loader in ("simulate_public_loader", "simulate_our_loader"):
        monkeypatch.setattr(fh, loader, (loaders or {}).get(loader, lambda *a: dict(trained=1, read=1, total=1)))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--public", str(tmp_path), "--train_files", train,
                                      "--val_files", val, "--work", str(tmp_path / "w"), *argv])
    fh.main()
    return launched


def test_a_missing_vocabulary_stops_the_command_before_any_run_naming_the_fix(monkeypatch, tmp_path):
    """Offline without tiktoken's GPT-2 files every run of both codes stops at its start: the harness says so once,
    with the trainer's fix (TIKTOKEN_CACHE_DIR), after the data check and before anything is launched."""
    def unreachable():
        raise OSError("the prefix-token loss reads the GPT-2 vocabulary, and tiktoken could not load it (no network); "
                      "offline, set TIKTOKEN_CACHE_DIR to a folder holding tiktoken's GPT-2 files")
    monkeypatch.setattr(tg, "gpt2_token_bytes", unreachable)
    with pytest.raises(SystemExit, match="every run would stop at its start: .*set TIKTOKEN_CACHE_DIR"):
        REAL_CHECK_VOCABULARY()
    monkeypatch.setattr(tg, "gpt2_token_bytes", lambda: [b"a"] * 3)
    REAL_CHECK_VOCABULARY()  # loads: nothing said
    # main calls it before launching: with the check failing, nothing is launched
    monkeypatch.setattr(fh, "check_vocabulary", lambda: fh.fail("no vocabulary"))
    launched = []
    with pytest.raises(SystemExit, match="no vocabulary"):
        fake_main(monkeypatch, tmp_path, ["--public_seeds", "0", "--seeds", "0"], launched=launched)
    assert launched == []


def test_ours_runs_the_record_preset_on_the_public_attention_and_each_variant_adds_its_flags(monkeypatch, tmp_path):
    launched = fake_main(monkeypatch, tmp_path, ["--public_seeds", "0", "--seeds", "0", "--public_attention", "varlen",
                                                 "--ours_args", "--muon_lr 0.05", "--variant", "lr", "--muon_lr 0.07"])
    ours = [cmd[cmd.index("--nproc_per_node=1") + 2:] for cmd, _ in launched if str(fh.ROOT / "train_gpt.py") in cmd]
    assert len(ours) == 2 and len(launched) == 3  # the public run, then ours and the variant
    base, lr = (tg.parse_args(argv) for argv in ours)
    assert base.preset == lr.preset == "record" and base.attention == lr.attention == "varlen"
    assert (base.muon_lr, lr.muon_lr) == (0.05, 0.07) and (base.seed, base.val_every) == (0, 125)
    assert launched[0][0][-1].startswith("public_master_") and launched[0][0][-1].endswith("_seed0.py")


def test_every_variant_of_ours_compiles_into_one_inductor_cache_the_caller_s_if_set(monkeypatch, tmp_path):
    """Ours' variants share one Inductor cache (most graphs are the same), the caller's TORCHINDUCTOR_CACHE_DIR when
    set, else one in --work; the public code keeps its own."""
    argv = ["--public_seeds", "0", "--seeds", "0", "1", "--variant", "lr", "--muon_lr 0.07"]
    for cache in (None, str(tmp_path / "shared")):
        envs = {}
        with monkeypatch.context() as m:
            if cache:
                m.setenv("TORCHINDUCTOR_CACHE_DIR", cache)
            else:
                m.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
            fake_main(m, tmp_path, argv, envs=envs)
        ours = {v for k, v in envs.items() if not k.startswith("public")}
        public = {v for k, v in envs.items() if k.startswith("public")}
        assert len(envs) == 5 and ours == {cache or str(tmp_path / "w" / "cache_ours")}
        assert len(public) == 1 and public != ours


def test_warm_first_runs_each_code_once_at_the_same_time_before_the_timed_runs(monkeypatch, tmp_path):
    """--warm_first: one untimed run per code (the public code, ours, each variant), files named apart from the
    timed runs', all launched before any timed run; a warming run that fails stops the harness."""
    argv = ["--public_seeds", "0", "--seeds", "0", "1", "--variant", "today", "--preset record", "--warm_first"]
    launched = fake_main(monkeypatch, tmp_path, argv)
    logs = [name for _, name in launched]
    warm, timed = logs[:3], logs[3:]
    assert [n.split("_")[0] for n in warm] == ["public", "ours", "today"] and all("_warm_" in n for n in warm)
    assert len(timed) == 5 and not any("_warm" in n for n in timed)  # one public run, 2 seeds x 2 of ours
    launched = []
    with pytest.raises(SystemExit, match="cache-warming run of public master seed 0 exited"):
        fake_main(monkeypatch, tmp_path / "again", argv, rc=1, launched=launched)
    assert len(launched) == 3  # the warming runs only
    with pytest.raises(SystemExit, match="--warm_first is for runs timed one after the other"):
        fake_main(monkeypatch, tmp_path / "parallel", argv + ["--parallel"])



def test_alternate_takes_the_codes_in_turns_after_the_warming_runs(monkeypatch, tmp_path):
    """--alternate: public, ours, public, ours (A B A B), each variant in its turn, a code with fewer runs leaving the
    turns early; the warming runs still go first; refused with --parallel (shared runs are not timed)."""
    argv = ["--public_seeds", "0", "1", "--seeds", "0", "1", "2", "--variant", "v", "--preset record", "--alternate",
            "--warm_first"]
    logs = [name for _, name in fake_main(monkeypatch, tmp_path, argv)]
    assert all("_warm_" in n for n in logs[:3]) and not any("_warm" in n for n in logs[3:])
    timed = [(n.split("_")[0], n.rsplit("seed", 1)[1].split(".")[0]) for n in logs[3:]]
    assert timed == [("public", "0"), ("ours", "0"), ("v", "0"), ("public", "1"), ("ours", "1"), ("v", "1"),
                     ("ours", "2"), ("v", "2")]
    plain = [n.split("_")[0] for _, n in fake_main(monkeypatch, tmp_path / "plain", argv[:-2])]
    assert plain == ["public", "public", "ours", "ours", "ours", "v", "v", "v"]  # without it: each code's runs together
    with pytest.raises(SystemExit, match="--alternate is for runs timed one after the other"):
        fake_main(monkeypatch, tmp_path / "parallel", argv[:-1] + ["--parallel"])

def test_report_rebuilds_the_tables_from_the_logs_of_a_stopped_command_and_runs_nothing(monkeypatch, tmp_path, capsys):
    """--report STAMP: the tables of the runs a command with the same flags started at STAMP, from the logs it left
    (no staging, nothing launched): a public run's stage times and loss, a run cut off in its warm-up (its log without
    a step) and a run that never started (no log), each shown as far as it got; the Data: line (each label's tokens,
    which pair_tables' --tie reads) with the tokens read where the shards are there to plan from, else the tokens
    trained from the schedules alone."""
    argv = ["--public_seeds", "0", "1", "--seeds", "0", "1", "--alternate", "--step_div", "16", "--batch_div", "1"]
    started = [name for _, name in fake_main(monkeypatch, tmp_path, argv)]
    stamp = started[0].split("_seed")[0].removeprefix("public_master_")
    assert started == [f"public_master_{stamp}_seed0.out", f"ours_{stamp}_seed0.out", f"public_master_{stamp}_seed1.out",
                       f"ours_{stamp}_seed1.out"]
    work = tmp_path / "w"
    bounds = [(0, 26), (26, 53), (53, 79), (79, 80)]  # 1270 + 15 steps / 16
    ms_per_step, t, lines = [10, 20, 30, 31], 0, []
    for (start, end), ms in zip(bounds, ms_per_step):
        for step in range(start + 1, end + 1):
            t += ms
            lines.append(f"step:{step}/80 train_time:{t}ms step_avg:1ms")
    public_log = "\n".join(lines + [f"step:80/80 val_loss:3.0400 train_time:{t}ms step_avg:1ms"]) + "\n"
    (work / "public_master" / "logs").mkdir(parents=True, exist_ok=True)
    (work / "public_master" / "logs" / f"public_master_{stamp}_seed0.txt").write_text(public_log)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    (work / "logs" / f"ours_{stamp}_seed0.txt").write_text(  # cut off after its first validation
        "warm-up: shape 1/5 done at 30s\nstep:0/80 val_loss:10.9000 train_time:0ms step_avg:0ms\n")
    # the monitor's file and the runs' journal as the command leaves them: GPU 0 busy at 1980 MHz while the master's
    # first run trained, one sample under the power cap; its second run has no busy sample
    (work / f"runs_{stamp}.tsv").write_text(f"100.0\tpublic master seed 0\n150.0\tours seed 0\n")
    samples = [(t, 1.0, 0, 1980.0 if t != 120 else 1700.0, 600.0, 50.0, 100.0, 4 if t == 120 else 0)
               for t in range(110, 131)]
    (work / f"gpu_monitor_{stamp}.csv").write_text(
        fh.MONITOR_CSV_HEADER + "\n" + "\n".join(map(fh.monitor_csv_line, samples)) + "\n1000.0,1.0,0,19")
    os.utime(work / "public_master" / "logs" / f"public_master_{stamp}_seed0.txt", (140, 140))
    for shard in (tmp_path / "data").iterdir():  # without the shards: the tables all the same
        shard.unlink()
    monkeypatch.setattr(fh, "stage_public", lambda *a: pytest.fail("--report staged the public code"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--public", str(tmp_path), "--train_files",
                                      str(tmp_path / "data" / "syn_train_*.bin"), "--val_files",
                                      str(tmp_path / "data" / "syn_val_*.bin"), "--work", str(work), *argv,
                                      "--report", stamp, "--out", str(tmp_path / "table.md")])
    monkeypatch.setattr(fh, "launch", lambda *a: pytest.fail("--report launched a run"))
    capsys.readouterr()
    fh.main()
    out = capsys.readouterr().out
    assert out == (tmp_path / "table.md").read_text()
    # the master's 80 steps: 26 / 27 / 26 / 1 of 131,072 / 262,144 / 393,216 / 393,216 tokens; ours its record
    # preset's (stage 1 at 262,144 tokens a step, then 393,216)
    master_tokens = 26 * 131072 + 27 * 262144 + 27 * 393216
    data = next(line for line in out.splitlines() if line.startswith("Data: "))
    ours_steps = int(re.search(r"; ours: (\d+) steps", data)[1])
    ours_tokens = tg.Schedule(tg.parse_args([])).tokens_before(ours_steps)
    assert ours_steps == tg.Hyperparameters().num_iterations and ours_tokens == 252 * 262144 + 521 * 393216
    assert data == (f"Data: public master: 80 steps, {master_tokens:,} tokens trained; "
                    f"ours: {ours_steps} steps, {ours_tokens:,} tokens trained")
    import pair_tables as pt
    assert pt.trained_tokens(tmp_path / "table.md") == {"public master": master_tokens, "ours": ours_tokens}
    assert f"Tables rebuilt from the logs of the runs started at {stamp} (--report" in out
    assert f"No log: public master seed 1 ({work / 'public_master' / 'logs' / f'public_master_{stamp}_seed1.txt'}), " \
           f"ours seed 1" in out
    assert "| 80 | 3.0400 | - | - | - |" in out  # the public run's final loss; the others have none
    assert "| 0 | - | - | 10.9000 | - | - |" in out  # the stopped run's curve as far as it went, but no final loss:
    assert "left out of the finals and the tie table: ours seed 0 (last validation at step 0 of 80)" in out
    assert "| ours | 0 | - | - |" in out
    row = next(line for line in out.splitlines() if line.startswith("| public master seed 0 | "))
    assert row.startswith("| public master seed 0 | 10.0 ms") and "| 30.0 ms (" in row
    assert row.endswith(f"| {(423 * 10 + 424 * 20 + 423 * 30 + 15 * 31) / 1000:.1f} s |")  # the master's own schedule
    assert next(line for line in out.splitlines() if line.startswith("| ours seed 0 | ")).startswith(
        "| ours seed 0 | - | - |")
    conditions = out.split("Conditions while each run's GPU was busy")[1].splitlines()
    assert conditions[4] == "| public master seed 0 | 0 | 21 | 1980 (1700) | 600 | 50 | SW power cap | - | 1.00 |"
    assert conditions[5].startswith("| ours seed 0 | - | 0 |") and conditions[6].startswith("| public master seed 1 | - |")
    (work / f"runs_{stamp}.tsv").unlink()  # without the journal: said, not guessed
    fh.main()
    assert f"Conditions: not recorded (not in --work: runs_{stamp}.tsv)" in capsys.readouterr().out
    write_corpus(tmp_path / "data")  # the shards back: the data plan as the command printed it (loaders stood in)
    fh.main()
    assert re.search(r"^Data: public master: \d+ steps, 1 tokens trained, reads 1 of the shards' 1; ours: \d+ steps, "
                     r"1 tokens trained, reads 1 of 1$", capsys.readouterr().out, re.M)


# ---- the public line's current code (master) and record #89: patches, the scaling rule, the data check

# The lines of the public master script each patch anchors on, in a stand-in that is not the public code.
MASTER_LIKE = '''import os
from kernels import get_kernel
grad_accum_steps = 8 // world_size
flash_attn_interface = get_kernel('kernels-community/flash-attn3', version=1).flash_attn_interface
class GPT:
    def forward(self):
        if use_mlp_fp8:
            mlp_down_proj_scales = [self._mlp_down_proj_scales[i:i+1] for i in range(12)]
            mlp_args = (
                    self._mlp_down_act_scales[i:i+1],
            )
@dataclass(slots=True)
class Hyperparameters:
    train_files: str = os.path.join(data_path, "data/fineweb10B/fineweb_train_*.bin") # input .bin to train on
    val_files: str = os.path.join(data_path, "data/fineweb10B/fineweb_val_*.bin") # input .bin to eval
    val_tokens: int = 10485760 # how many tokens of validation data?
    val_batch_size: int = 4 * 64 * 1024 * 8
    num_scheduled_iterations: int = 1270  # number of steps to complete lr and ws schedule
    num_extension_iterations: int = 15  # number of steps to continue training at final lr and ws
    run_id: str = f"{uuid.uuid4()}"
    val_loss_every: int = 250  # every how many steps to evaluate val loss? 0 for only at the end
TRAINING_STAGES = [
    TrainingStage(duration=1/3, train_max_seq_len=896, batch_size=8 * 2048 * 8, window_sizes=(1, 3), lr_mul=1.0,
                  mtp_weights_start=[1.0, 0.5, 0.25], mtp_weights_end=[1.0, 0.5, 0.0]),
    TrainingStage(duration=1/3, train_max_seq_len=2048, batch_size=16 * 2048 * 8, window_sizes=(3, 7), lr_mul=1.52,
                  mtp_weights_start=[1.0, 0.5], mtp_weights_end=[1.0, 0.0]),
    TrainingStage(duration=1/3, train_max_seq_len=2048, batch_size=24 * 2048 * 8, window_sizes=(5, 11), lr_mul=1.73,
                  mtp_weights_start=[1.0], mtp_weights_end=[1.0]),
    # extension stage
    TrainingStage(train_max_seq_len=2048, batch_size=24 * 2048 * 8, window_sizes=(6, 13), lr_mul=1.0,
                  mtp_weights_start=[1.0], mtp_weights_end=[1.0]),
]

training_schedule = TrainingSchedule(TRAINING_STAGES, args.num_scheduled_iterations, args.num_extension_iterations)

def get_muon_momentum(step: int, muon_warmup_steps=300, muon_cooldown_steps=50, momentum_min=0.85, momentum_max=0.95):
    pass
if master_process:
    os.makedirs("logs", exist_ok=True)
    logfile = f"logs/{run_id}.txt"
print0("=" * 100)
model: nn.Module = GPT(
    vocab_size=50257,
).cuda()
training_time_ms = 0
# start the clock
torch.cuda.synchronize()
for step in range(train_steps + 1):
    # --------------- TRAINING SECTION -----------------
    model.quantize_mlp_fp8(bootstrap_down=(step < 16))
'''
STAGING = dict(train_glob="/d/train_*.bin", val_file="/d/val.bin", val_tokens=983040, val_seq_len=40960,
               val_every=125, attention="fa3")


def master_code(source=MASTER_LIKE):
    return fh.PublicCode("master", {"train_gpt.py": source, "triton_kernels.py": "# kernels\n"}, "commit x")


def test_a_logged_source_splits_into_the_files_it_embeds():
    bar = "-" * 40
    log = (f"import os\nprint(1)\n\n\n{bar}\n# triton_kernels.py\n{bar}\n\ndef k(): pass\n\n\n{bar}\n"
           f"# dc_triton_kernels.py\n{bar}\n\nX = 1\n" + "=" * 100 + "\nstep:0/10 val_loss:10.8\n")
    assert fh.split_logged_source(log) == {"train_gpt.py": "import os\nprint(1)\n", "triton_kernels.py": "def k(): pass\n",
                                           "dc_triton_kernels.py": "X = 1\n"}


def test_master_is_read_at_its_commit_with_the_kernel_files_it_imports(tmp_path):
    import subprocess
    repo = tmp_path / "ck"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    (repo / "train_gpt.py").write_text("from triton_kernels import XXT\nv = 1\n")
    (repo / "triton_kernels.py").write_text("XXT = 0\n")
    (repo / "dc_triton_kernels.py").write_text("not imported\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    first = git("rev-parse", "HEAD").strip()
    (repo / "train_gpt.py").write_text("v = 2\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "two")
    code = fh.public_source(repo, "master", first)
    assert code.files == {"train_gpt.py": "from triton_kernels import XXT\nv = 1\n", "triton_kernels.py": "XXT = 0\n"}
    assert code.origin == f"commit {first}"
    with pytest.raises(SystemExit, match="no train_gpt.py at commit 1234567"):
        fh.public_source(repo, "master", "1234567")


def test_every_patch_of_the_master_script_is_applied():
    files = fh.patch_public(master_code(), accum=1, batch_div=16, step_div=1, **STAGING)
    s = files["train_gpt.py"]
    assert "\nfrom kernels import" not in s and "get_kernel('kernels" not in s.split("import harness_attention")[1]
    assert "import harness_attention as flash_attn_interface" in s
    assert "self._mlp_down_proj_scales[[i]] for i in range(12)" in s and "self._mlp_down_act_scales[[i]]," in s
    assert "[i:i+1]" not in s
    assert "grad_accum_steps = 1  #" in s
    assert "    val_batch_size: int = 40960\n" in s and "    val_tokens: int = 983040 #" in s
    assert "    train_files: str = '/d/train_*.bin' # input .bin to train on" in s
    assert "    val_loss_every: int = 125  #" in s
    assert "    _stage.batch_size //= 16\ntraining_schedule = TrainingSchedule(" in s
    assert "num_scheduled_iterations: int = 1270" in s and "muon_warmup_steps=300" in s  # batch_div keeps steps
    assert s.index("harness: stage boundaries") < s.index("model: nn.Module = GPT(")
    assert files["triton_kernels.py"] == "# kernels\n"
    compile(files["harness_attention.py"], "harness_attention.py", "exec")
    assert "BACKEND = 'fa3'" in files["harness_attention.py"] and "num_splits=1" in files["harness_attention.py"]



SCALE = 0.3  # the softmax scale the FA4 stand-in test passes through


def test_the_fa4_stand_in_passes_the_public_calls_arguments_to_flash_attn_4s_kernels_in_their_order(monkeypatch):
    """--public_attention fa4: the staged harness_attention.py runs the public code's flash_attn_varlen_func through
    FA4's own forward and backward functions. Stood in here by attention computed by hand (causal, a left window,
    documents from cu_seqlens), so the output and the input gradients must equal that attention's under autograd;
    a swapped argument (out for dout, window -1 for None) or a dropped document boundary would not."""
    import types
    def attend(q, k, v, cu, window):  # (T, H, D) per document, causal, `window` keys back (None: all)
        out, lse = torch.zeros_like(q), torch.zeros(q.size(1), q.size(0))
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            i = torch.arange(b - a)
            mask = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] <= window) if window is not None else True)
            s = torch.einsum("thd,shd->hts", q[a:b], k[a:b]) * SCALE
            s = s.masked_fill(~mask, float("-inf"))
            out[a:b] = torch.einsum("hts,shd->thd", s.softmax(-1), v[a:b])
            lse[:, a:b] = s.logsumexp(-1)
        return out, lse
    calls = []
    def fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size_left, window_size_right, return_lse):
        assert cu_seqlens_q is cu_seqlens_k and causal and window_size_right == 0 and return_lse
        assert softmax_scale == SCALE and max_seqlen_q == max_seqlen_k == 6
        calls.append(window_size_left)
        with torch.no_grad():
            return attend(q, k, v, cu_seqlens_q, window_size_left)
    def bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, window_size_left, window_size_right, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        assert torch.equal(out, attend(q, k, v, cu_seqlens_q, window_size_left)[0])  # out, then dout
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # by hand: autograd is off in ops
        for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
            s = torch.einsum("thd,shd->hts", q[a:b], k[a:b]) * softmax_scale
            p = (s - lse[:, a:b, None]).exp()  # masked entries: softmax of -inf rows is 0 through the mask below
            i = torch.arange(b - a)
            w = window_size_left
            p = p * ((i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] <= w) if w is not None else True))
            dv[a:b] = torch.einsum("hts,thd->shd", p, dout[a:b])
            dp = torch.einsum("thd,shd->hts", dout[a:b], v[a:b])
            ds = p * (dp - (dout[a:b] * out[a:b]).sum(-1).T[:, :, None])
            dq[a:b] = torch.einsum("hts,shd->thd", ds, k[a:b]) * softmax_scale
            dk[a:b] = torch.einsum("hts,thd->shd", ds, q[a:b]) * softmax_scale
        return dq, dk, dv, None
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = fwd, bwd
    for name, module in (("flash_attn", types.ModuleType("flash_attn")),
                         ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
                         ("flash_attn.cute.interface", interface)):
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["flash_attn.cute"].interface = interface
    stand_in = {"__name__": "harness_attention_fa4_test"}
    exec(compile(fh.ATTENTION_MODULE.format(backend="fa4"), "harness_attention.py", "exec"), stand_in)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for window, expect in ((-1, None), (3, 3)):
        out = stand_in["flash_attn_varlen_func"](q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                                                 max_seqlen_k=6, causal=True, softmax_scale=SCALE,
                                                 window_size=(window, 0))
        assert calls[-1] == expect
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ref = attend(*leaves, cu, expect)[0]
        torch.testing.assert_close(out, ref)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        torch.testing.assert_close(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, leaves, dout))

def test_step_div_scales_the_step_counts_and_step_constants():
    s = fh.patch_public(master_code(), accum=8, batch_div=1, step_div=16, **STAGING)["train_gpt.py"]
    assert "num_scheduled_iterations: int = 79  #" in s and "num_extension_iterations: int = 1  #" in s
    assert "muon_warmup_steps=19, muon_cooldown_steps=3," in s and "bootstrap_down=(step < 1))" in s
    assert "_stage.batch_size //=" not in s and "grad_accum_steps = 8  #" in s
    assert "    val_batch_size: int = 327680\n" in s


@pytest.mark.parametrize("anchor, patch", [
    ("self._mlp_down_act_scales[i:i+1],", "fp8_scale_alignment"),
    ("grad_accum_steps = 8 // world_size\n", "micro_batches"),
    ("\ntraining_schedule = TrainingSchedule(", "batch_div"),
    ("bootstrap_down=(step < 16)", "step_div"),
    ("\nmodel: nn.Module = GPT(", "stage_log"),
    ('logfile = f"logs/{run_id}.txt"', "log_dir"),
])
def test_a_public_script_without_a_patch_anchor_is_refused_naming_the_patch(anchor, patch):
    code = master_code(MASTER_LIKE.replace(anchor, "\n# gone\n"))
    with pytest.raises(SystemExit, match=f"patch '{patch}'"):
        fh.patch_public(code, accum=1, batch_div=16, step_div=16, **STAGING)


def test_a_script_that_loads_attention_otherwise_is_refused():
    code = master_code(MASTER_LIKE.replace("get_kernel('kernels-community/flash-attn3', version=1)", "other()"))
    with pytest.raises(SystemExit, match="patch 'hub_fa3_loader'"):
        fh.patch_public(code, accum=1, batch_div=16, step_div=1, **STAGING)


def test_profile_hook_goes_at_the_top_of_the_training_section():
    s = fh.patch_public(master_code(), accum=8, batch_div=1, step_div=16, profile_step=70, **STAGING)["train_gpt.py"]
    hook = s.index("if step == 70:  # harness: profile two training steps")
    assert s.index("# --------------- TRAINING SECTION") < hook < s.index("model.quantize_mlp_fp8(bootstrap_down")
    compile(s[s.index("for step in range"):], "loop", "exec")  # the loop with the hook is valid Python


def test_start_after_holds_the_clock_until_the_file_exists(tmp_path):
    gate = tmp_path / "gpu free"
    s = fh.patch_public(master_code(), accum=8, batch_div=1, step_div=16, start_after=str(gate), **STAGING)["train_gpt.py"]
    wait = s[s.index("print0('harness: waiting"):s.index("training_time_ms = 0")]
    assert s.index(wait) < s.index("training_time_ms = 0") < s.index("# start the clock")
    slept = []
    env = {"os": os, "print0": lambda *a, **k: None, "time": type("T", (), {"sleep": lambda n: (slept.append(n), gate.touch())})}
    exec(wait, env)  # waits (one sleep) while the file is missing
    assert slept == [5] and gate.exists()
    exec(wait, env)  # and not at all once it exists
    assert slept == [5]
    unpatched = fh.patch_public(master_code(), accum=8, batch_div=1, step_div=16, **STAGING)["train_gpt.py"]
    assert "harness: waiting" not in unpatched


def test_the_public_stage_table_gives_the_boundaries_of_its_schedule():
    stages = fh.public_stages(MASTER_LIKE)
    # 1270 scheduled steps in thirds (round(1270/3) = 423, round(2 x 1270/3) = 847), then 15 of extension
    assert [(st.start, st.end) for st in stages] == [(0, 423), (423, 847), (847, 1270), (1270, 1285)]
    assert [st.batch for st in stages] == [131072, 262144, 393216, 393216]
    assert [st.max_seq_len for st in stages] == [896, 2048, 2048, 2048]
    assert stages[2].windows == (5, 11)
    assert fh.tokens_at(stages, 1285) == 338_821_120  # the public record's 338.8M tokens
    scaled = fh.public_stages(fh.patch_public(master_code(), accum=1, batch_div=16, step_div=1, **STAGING)["train_gpt.py"], 16)
    assert [st.batch for st in scaled] == [8192, 16384, 24576, 24576] and fh.tokens_at(scaled, 1285) * 16 == 338_821_120
    short = fh.public_stages(fh.patch_public(master_code(), accum=8, batch_div=1, step_div=16, **STAGING)["train_gpt.py"])
    assert [(st.start, st.end) for st in short] == [(0, 26), (26, 53), (53, 79), (79, 80)]


def write_docs(path, lengths, bos=tg.BOS_ID):
    """A shard of documents of these lengths (each a BOS, then tokens 1, 2, ...)."""
    tg.write_shard(path, np.concatenate([[bos, *range(1, n)] for n in lengths]))


def test_the_public_loader_walk_cuts_documents_and_refuses_to_run_out(tmp_path):
    # BOS at 0, 5, 8, 18, 22, 28, 30; 39 tokens. Micro-batches of 8 inputs (+1 target), documents cut at 6:
    # step 0 takes [0,5) [5,8) [8,9); step 1 [18,22) [22,27); step 2 cannot finish in this shard
    write_docs(tmp_path / "a.bin", [5, 3, 10, 4, 6, 2, 9])
    stages = [fh.Stage(0, 2, 8, 6, (1, 3))]
    got = fh.simulate_public_loader([str(tmp_path / "a.bin")], stages, accum=1)
    assert got == dict(trained=16, read=27, total=39)
    with pytest.raises(fh.DataExhausted, match="runs out of documents at step 2 of 3"):
        fh.simulate_public_loader([str(tmp_path / "a.bin")], [fh.Stage(0, 3, 8, 6, (1, 3))], accum=1)
    # a second shard: step 2 starts at its first document, the first shard's tail is dropped
    write_docs(tmp_path / "b.bin", [7, 7])
    got = fh.simulate_public_loader([str(tmp_path / "a.bin"), str(tmp_path / "b.bin")], [fh.Stage(0, 3, 8, 6, (1, 3))], 1)
    assert got == dict(trained=24, read=39 + 10, total=53)  # [0,6) (cut at 6) then [7,10)
    # two micro-batches of 4 per step read differently from one of 8
    got = fh.simulate_public_loader([str(tmp_path / "a.bin")], [fh.Stage(0, 1, 8, 6, (1, 3))], accum=2)
    assert got["trained"] == 8 and got["read"] == 10  # [0,5), then [5,8) [8,10): one token further than [0,9)


def test_our_loader_walk_refuses_a_second_pass(tmp_path):
    from conftest import BOS
    train, val = write_corpus(tmp_path / "d", train_sizes=(6000, 6000))
    argv = lambda n: ["--preset", "smoke", "--bos_id", str(BOS), "--train_files", train, "--val_files", val, "--batch_size", "1024",
                      "--seq_len", "512", "--num_iterations", str(n), "--max_doc_len", "96", "--window_schedule", "1,2,3",
                      "--extension_steps", "0", "--extension_window", "0"]
    got = fh.simulate_our_loader(tg.shard_files(train, "training"), tg.parse_args(argv(5)))
    assert got["trained"] == 5 * 1024 and 5 * 1024 < got["read"] <= got["total"] == 12000
    with pytest.raises(fh.DataExhausted, match="second pass over the shards at step"):
        fh.simulate_our_loader(tg.shard_files(train, "training"), tg.parse_args(argv(40)))


def test_a_run_that_would_repeat_data_is_refused_before_anything_starts(monkeypatch, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    write_docs(tmp_path / "d" / "t_000001.bin", [3, 5, 2, 7] * 5000)
    write_docs(tmp_path / "d" / "v_000000.bin", [100] * 20)
    train, val = str(tmp_path / "d" / "t_*.bin"), str(tmp_path / "d" / "v_*.bin")
    monkeypatch.setattr(fh, "public_source", lambda *a: master_code())
    monkeypatch.setattr(fh, "launch", lambda *a: pytest.fail("nothing may be launched"))
    base = ["side_by_side.py", "--public", str(tmp_path), "--train_files", train, "--val_files", val, "--work",
            str(tmp_path / "w"), "--public_seeds", "0", "--seeds"]
    monkeypatch.setattr(sys, "argv", base)  # 21.2M tokens of the rule: far more than the shard's 85,000
    with pytest.raises(SystemExit, match="public loader runs out of documents at step"):
        fh.main()
    monkeypatch.setattr(sys, "argv", base + ["--batch_div", "8192", "--check_only"])  # 16/32/48-token steps fit
    fh.main()
    out = capsys.readouterr().out
    assert "public master: 1285 steps, 41,360 tokens trained" in out
    staged = sorted((tmp_path / "w" / "public_master" / "train").iterdir())
    assert [p.name for p in staged] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert staged[0].resolve() == Path(train.replace("*", "000001")).resolve() and tg.read_shard_header(staged[1]) == 16



def test_allow_repeat_lets_our_timing_run_start_over_on_the_shards_and_nothing_else(monkeypatch, tmp_path, capsys):
    """--allow_repeat: a run of ours that would read the shards twice goes ahead, said in the data plan (our loader
    starts over); without it the same run is refused, and a public run that would run out is refused either way."""
    def exhausted(*a):
        raise fh.DataExhausted("our loader would start a second pass over the shards at step 57 of 80")
    ours_short = {"simulate_our_loader": exhausted}
    argv = ["--public_seeds", "--seeds", "0"]
    with pytest.raises(SystemExit, match="second pass over the shards at step 57"):
        fake_main(monkeypatch, tmp_path / "a", argv, loaders=ours_short)
    launched = fake_main(monkeypatch, tmp_path / "b", argv + ["--allow_repeat"], loaders=ours_short)
    assert len(launched) == 1 and "as --allow_repeat lets it" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="second pass"):  # the public run's shortfall: refused even so
        fake_main(monkeypatch, tmp_path / "c", ["--public_seeds", "0", "--seeds", "--allow_repeat"],
                  loaders={"simulate_public_loader": exhausted})

def test_our_stages_in_the_tables_end_at_the_last_training_step():
    """train_gpt's last stage ends past the final validation's step; the harness's tables count training steps only:
    the record preset's 773 steps as 252 / 251 / 250 / 20, the extension's 20 (not 21) in its stage column."""
    schedule = tg.Schedule(tg.parse_args([]))
    assert schedule.stages[-1].end == 774
    stages = fh.training_stages(schedule)
    assert [st.end - st.start for st in stages] == [252, 251, 250, 20]
    assert [st.start for st in stages] == [st.start for st in schedule.stages]
    times = {s: 10 * s for s in range(775)}  # 10 ms a step
    assert [d["steps"] for d in fh.stage_step_ms(times, stages)] == [252, 251, 250, 20]


def test_step_times_give_each_stage_its_median_step():
    steps = [0, 100, 200, 300, 400, 500, 700, 900, 1100, 1300, 1500, 1800]  # ms after n steps
    lines = [f"step:{n}/11 train_time:{t}ms step_avg:1ms" for n, t in enumerate(steps) if n]
    log = ("print0('step:1/2 train_time:5ms')\n" + "=" * 100 + "\nharness: stage boundaries [(0, 5), (5, 11)]\n"
           + "\n".join(lines[:5] + ["step:5/11 val_loss:4.0000 train_time:500ms step_avg:100.00ms"] + lines[5:]))
    assert fh.logparse.stage_boundaries(log) == [(0, 5), (5, 11)]
    times = fh.logparse.step_times(log)
    assert times[1] == 100 and times[11] == 1800 and len(times) == 11
    stages = [fh.Stage(0, 5, 1000, 896, (1, 3)), fh.Stage(5, 11, 2000, 2048, (3, 7))]
    got = fh.stage_step_ms(times, stages, skip=2)
    assert got[0] == dict(steps=5, batch=1000, median=100, mean=100)  # step 0 (compile-sized) never counts
    assert got[1]["median"] == 200 and got[1]["mean"] == pytest.approx(1300 / 6)  # 300 at the end is one of 6
    assert "| a | 100.0 ms (100.000 us/tok, 1,000, 5 steps) | 200.0 ms (100.000 us/tok, 2,000, 6 steps) |" in \
        fh.stage_table({"a": got})
    # over the public schedule's own step counts: 400 x 100 ms + 30 x 200 ms; a run with a stage untimed gets none
    whole = fh.stage_table({"a": got, "b": [got[0], dict(got[1], median=None)]}, full_steps=[400, 30])
    assert whole[0].endswith("| public schedule (400 / 30 steps) |") and whole[2].endswith("| 46.0 s |")
    assert whole[3].endswith("| - | - |")
    # each later run over the first, stage by stage: us per token (the bar), and the schedule's time
    slower = [dict(got[0], median=110), dict(got[1], median=190)]
    ratios = fh.stage_table({"public": got, "ours": slower}, full_steps=[400, 30])
    assert ratios[-1] == "| ours / public | 1.100x | 0.950x | 1.080x |"  # (400 x 110 + 30 x 190) / 46,000 ms
    assert fh.stage_table({"public": got, "b": [got[0], dict(got[1], median=None)]})[-1] == "| b / public | 1.000x | - |"


def test_monitor_lines_parse_and_a_run_s_conditions_come_from_its_busy_samples(monkeypatch):
    for visible, gpu in (("2,3", 2), ("GPU-9d30f7db", 0), ("", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert fh.visible_gpu() == gpu
    assert fh.parse_monitor_line("0, 1980, 689.51, 52, 100, 0x0000000000000004\n") == (0, 1980.0, 689.51, 52.0,
                                                                                         100.0, 4)
    assert fh.parse_monitor_line("3, [N/A], 71.2, 35, 0, [N/A]") == (3, None, 71.2, 35.0, 0.0, None)
    assert fh.parse_monitor_line("index, clocks.current.sm [MHz], ...") is None
    assert fh.parse_monitor_line("") is None
    # (time, load, index, SM MHz, W, C, use %, reasons): GPU 0 compiles idle from 10 s, trains 20-30 s, one sample
    # under the SW power cap; GPU 1 works beside it from 24 s; samples outside the run's span do not count
    samples = [(t, 8.0, 0, 345.0, 70.0, 30.0, 0.0, 0x1) for t in (10, 11)]
    samples += [(t, 16.0 if t < 25 else 48.0, 0, 1980.0 if t != 27 else 1600.0, 650.0 + t, 50.0 + t % 3, 100.0,
                 0x4 if t == 27 else 0) for t in range(20, 31)]
    samples += [(t, 8.0, 1, 1980.0, 690.0, 45.0, 0.0 if t < 24 else 100.0, 0) for t in range(20, 31)]
    samples += [(40, 90.0, 0, 1000.0, 700.0, 90.0, 100.0, 0x40)]
    c = fh.run_conditions(samples, 9.5, 30.5, gpu=0)
    assert c["samples"] == 11 and c["sm_median"] == 1980 and c["sm_min"] == 1600  # the idle compile is left out
    assert c["power_max"] == 680 and c["temperature_max"] == 52 and c["reasons"] == ["SW power cap"]
    assert c["others_busiest"] == 100  # GPU 1 busy in 7 of its 11 samples: median 100
    assert c["load_per_core"] == 48.0  # as sampled: the sampling host's load per core
    assert fh.run_conditions(samples, 9.5, 30.5, gpu=1)["others_busiest"] == 100  # GPU 0 while GPU 1 was busy
    assert fh.run_conditions(samples, 0, 15, gpu=0) is None  # no busy sample: nothing to say
    table = fh.conditions_table([("public master seed 0", c), ("ours seed 0", None)])
    assert "| public master seed 0 | 0 | 11 | 1980 (1600) | 680 | 52 | SW power cap | 100 |" in table[4]
    assert table[5] == "| ours seed 0 | - | 0 | - | - | - | - | - | - |"
    assert fh.conditions_table([], "nvidia-smi did not start (x)") == ["Conditions: not monitored (nvidia-smi did "
                                                                       "not start (x))"]


@pytest.mark.parametrize("script, error", [
    ("[ \"$1\" = --help-query-gpu ] && { echo '\"clocks_event_reasons.active\"'; exit 0; }; "
     "echo \"$1\" > \"${0%/*}/query\"; for i in 1 2 3; do echo '0, 1980, 650.5, 50, 100, 0x0000000000000000'; echo '1, 1755, 300, 40, 7, 0x4'; "
     "/bin/sleep 0.1; done; /bin/sleep 30", ""),
    ("echo 'Field \"clocks_throttle_reasons.active\" is not a valid field to query.' >&2; exit 2",
     "nvidia-smi gave no samples (exit 2: Field \"clocks_throttle_reasons.active\" is not a valid field to query.)"),
    (None, "nvidia-smi did not start"),
])
def test_the_gpu_monitor_reads_nvidia_smi_while_runs_go_and_says_why_it_cannot(monkeypatch, tmp_path, script, error):
    """GpuMonitor against a stand-in nvidia-smi on PATH: rows stamped and parsed while it runs, stopped on request;
    one that fails or is missing leaves the runs unmonitored with the reason."""
    if script is not None:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n" + script + "\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(fh.os, "getloadavg", lambda: (12.0, 1.0, 1.0))
    monkeypatch.setattr(fh.os, "cpu_count", lambda: 4)
    monitor = fh.GpuMonitor(period_ms=100, path=tmp_path / "w" / "m.csv")
    deadline = fh.time.time() + 10
    while script and not error and len(monitor.samples) < 6 and fh.time.time() < deadline:
        fh.time.sleep(0.05)
    fh.time.sleep(0.2)
    if not error:  # each sample is in the file once it has come, before the monitor stops
        lines = (tmp_path / "w" / "m.csv").read_text().splitlines()
        assert lines[0].startswith("time,load_1min_per_core,index")
        assert lines[2].endswith(",1,1755.0,300.0,40.0,7.0,0x4")
        assert len(lines) == 7
    monitor.stop()
    assert monitor.error.startswith(error)
    if not error:
        assert len(monitor.samples) == 6 and {s[2] for s in monitor.samples} == {0, 1}
        assert monitor.samples[1][3:] == (1755.0, 300.0, 40.0, 7.0, 4)
        assert fh.read_monitor_csv(tmp_path / "w" / "m.csv") == monitor.samples  # read back as they were
        # the load divided by the sampling host's 4 cores: a report rebuilt on a host of other cores reads the same
        assert {float(line.split(",")[1]) for line in lines[1:]} == {3.0}
        monkeypatch.setattr(fh.os, "cpu_count", lambda: 1000)
        assert fh.read_monitor_csv(tmp_path / "w" / "m.csv") == monitor.samples
        # a file of the older format (the host's whole load): its load unknown, the rest as it was
        (tmp_path / "old.csv").write_text("\n".join(["time,load_1min,index,sm_mhz,power_w,temperature_c,"
                                                      "utilization_percent,clock_reasons", *lines[1:]]) + "\n")
        old = fh.read_monitor_csv(tmp_path / "old.csv")
        assert [s[1] for s in old] == [None] * 6 and [s[2:] for s in old] == [s[2:] for s in monitor.samples]
        busy = fh.run_conditions(old, 0, fh.time.time() + 1, gpu=0)
        assert busy["load_per_core"] is None and fh.conditions_table([("x", busy)])[4].endswith("| 7 | - |")
        # the clock limits under the name this driver lists (an older one: clocks_throttle_reasons.active)
        assert (tmp_path / "query").read_text().strip().endswith(",utilization.gpu,clocks_event_reasons.active")
    else:
        assert monitor.samples == []


def test_finals_pair_runs_of_the_same_seed():
    res = {"public seed 0": {9: (3.00, 1, 1)}, "public seed 1": {9: (3.10, 1, 1)}, "public seed 2": {9: (3.05, 1, 1)},
           "ours seed 0": {9: (2.98, 1, 1)}, "ours seed 1": {9: (3.07, 1, 1)}, "ours seed 2": {5: (3.5, 1, 1)}}
    seeds = {n: int(n[-1]) for n in res}
    lines = fh.finals_table(res, {"public": [n for n in res if "public" in n], "ours": [n for n in res if "ours" in n]},
                            seeds)
    assert lines[2].startswith("| public | 3 | 3.0500 +- 0.1242 |")  # t(0.975, 2) = 4.303 x 0.05 / sqrt 3
    # pairs (-0.02, -0.03, +0.45): a run that stopped early counts with its last validation, paired by seed
    assert lines[3].startswith("| ours | 3 | 3.1833 +- ") and "+0.1333 +- " in lines[3] and "(3) |" in lines[3]


def test_staggered_runs_wait_for_their_code_s_first_run_to_train(monkeypatch, tmp_path):
    """With --stagger the second and third runs of a code start only once the first has logged a training
    step (its compiled graphs are then in the shared cache); each code's first run starts at once."""
    logs = {n: tmp_path / f"{n}.txt" for n in ("p0", "p1", "o0", "o1")}
    runs = [(f"public master seed {i}", logs[f"p{i}"], ["x"], tmp_path, {}, i, []) for i in (0, 1)] + \
           [(f"ours seed {i}", logs[f"o{i}"], ["x"], tmp_path, {}, i, []) for i in (0, 1)]
    order, clock, now = [], iter(range(1000)), [0]

    def fake_launch(cmd, cwd, out, env):
        order.append((out.stem, now[0]))
        return SimpleNamespace(poll=lambda: None if now[0] < 10 else 0)  # every run ends at tick 10

    def fake_sleep(_):
        t = now[0] = next(clock)
        if t == 2:  # the public leader reaches its first training step
            logs["p0"].write_text("code\n" + "=" * 100 + "\nstep:1/10 train_time:5ms step_avg:5ms\n")
        if t == 4:
            logs["o0"].write_text("step:0/10 val_loss:10.8 train_time:0ms\nstep:1/10 train_time:9ms step_avg:9ms\n")
    monkeypatch.setattr(fh, "launch", fake_launch)
    monkeypatch.setattr(fh.time, "sleep", fake_sleep)
    procs = fh.launch_all(runs, at_once=4, stagger=True)
    # p1 waited for step 2's log line, o1 for step 4's; several at once, launch_all returns when all have ended
    assert order == [("p0", 0), ("o0", 0), ("p1", 2), ("o1", 4)] and len(procs) == 4 and now[0] == 10
    order = [name for name, _ in order]
    order.clear()
    fh.launch_all(runs, at_once=4, stagger=False)
    assert [name for name, _ in order] == ["p0", "p1", "o0", "o1"]



def test_runs_one_at_a_time_stop_at_the_first_that_fails(monkeypatch, tmp_path, capsys):
    """One run at a time (a timing's A B A B), a run that exits nonzero leaves the runs after it unstarted (None),
    said in one line; runs that succeed all start; several at once, a failure stops nothing."""
    runs = [(f"{code} seed {i}", tmp_path / f"{code}{i}.txt", ["x"], tmp_path, {}, i, [])
            for i in (0, 1) for code in ("public master", "ours")]
    for fails, at_once, started in (("ours seed 0", 1, 2), (None, 1, 4), ("ours seed 0", 4, 4)):
        order = []

        def fake_launch(cmd, cwd, out, env):
            order.append(out.stem)
            code = 1 if fails and out.stem == fails.replace(" seed ", "") else 0
            return SimpleNamespace(poll=lambda: code)
        monkeypatch.setattr(fh, "launch", fake_launch)
        monkeypatch.setattr(fh.time, "sleep", lambda _: None)
        procs = fh.launch_all(runs, at_once=at_once, stagger=False)
        assert len(order) == started and sum(p is not None for p in procs) == started
    assert "ours seed 0 failed: not starting public master seed 1, ours seed 1" in capsys.readouterr().out


# ---- --nproc: every run on N GPUs, one run at a time, the public micro-batch shapes kept


def test_the_public_code_on_four_gpus_keeps_its_micro_batch_and_validation_shapes():
    s = fh.patch_public(master_code(), accum=2, batch_div=1, step_div=16, nproc=4, **STAGING)["train_gpt.py"]
    assert "grad_accum_steps = 2  # harness: micro-batches per step on each GPU\nassert world_size == 4," in s
    assert "    val_batch_size: int = 327680\n" in s  # 4 GPUs x 2 micro-batches x 40,960
    # the public code's per-rank validation length, args.val_batch_size // (grad_accum_steps * world_size)
    assert 327680 // (2 * 4) == STAGING["val_seq_len"]
    line = s[s.index("grad_accum_steps = 2"):s.index("\n", s.index("assert world_size")) + 1]
    exec(line, {"world_size": 4})
    with pytest.raises(AssertionError, match="staged for --nproc 4"):  # launched on another GPU count
        exec(line, {"world_size": 1})


def test_the_public_loader_walk_on_n_ranks_cuts_a_piece_per_rank_from_one_shard(tmp_path):
    # documents of 9 tokens: one per 8-token rank micro-batch (+1 target); a: 3 documents, b: 2
    write_docs(tmp_path / "a.bin", [9] * 3)
    write_docs(tmp_path / "b.bin", [9] * 2)
    files = [str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
    stages = [fh.Stage(0, 2, 16, 16, (1, 3))]
    # 2 ranks: step 1's rank 0 would fit a's last document, rank 1 would not: both take b's two documents
    assert fh.simulate_public_loader(files, stages, accum=1, world_size=2) == dict(trained=32, read=27 + 18, total=45)
    # one rank, 2 micro-batches of the same length: the second of step 1 alone moves to b
    assert fh.simulate_public_loader(files, stages, accum=2) == dict(trained=32, read=27 + 9, total=45)
    with pytest.raises(fh.DataExhausted, match="runs out of documents at step 2 of 3"):
        fh.simulate_public_loader(files, [fh.Stage(0, 3, 16, 16, (1, 3))], accum=1, world_size=2)


def test_every_run_goes_on_nproc_gpus_and_the_table_says_so(monkeypatch, tmp_path, capsys):
    out = tmp_path / "table.md"
    launched = fake_main(monkeypatch, tmp_path, ["--public_seeds", "0", "--seeds", "0", "--batch_div", "1",
                                                 "--step_div", "16", "--nproc", "4", "--out", str(out)])
    assert len(launched) == 2 and all(cmd[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]
                                      for cmd, _ in launched)
    staged = (tmp_path / "w" / "public_master" / "train_gpt.py").read_text()
    assert "grad_accum_steps = 2  #" in staged and "    val_batch_size: int = 327680\n" in staged  # 8 // 4
    assert "; 4 GPU(s) per run, batches / 1, steps / 16, 2 public micro-batch(es) per step per GPU," in \
        out.read_text().splitlines()[0]
    assert "4 GPU(s) per run" in capsys.readouterr().out
    # one GPU is the default: the commands and the micro-batches as before
    launched = fake_main(monkeypatch, tmp_path / "one", ["--public_seeds", "0", "--seeds", "0", "--batch_div", "1"])
    assert all("--nproc_per_node=1" in cmd for cmd, _ in launched)
    assert "grad_accum_steps = 8  #" in (tmp_path / "one" / "w" / "public_master" / "train_gpt.py").read_text()


@pytest.mark.parametrize("argv, error", [
    (["--nproc", "3"], r"--nproc 3: the public code runs on a divisor of 8 GPUs .*: use --nproc 1, 2, 4 or 8$"),
    (["--nproc", "0"], r"use --nproc 1, 2, 4 or 8$"),
    (["--nproc", "2", "--parallel"], r"each run takes all 2 GPUs: leave out --parallel"),
    (["--nproc", "4", "--batch_div", "1", "--accum", "3"],
     r"do not split into --accum 3 x --nproc 4 micro-batches: use --accum 2$"),
    (["--nproc", "8", "--batch_div", "1", "--val_tokens", "917504", "--val_seq_len", "65536"],
     r"\(8 x 1 x 65536 = 524,288\): use --val_tokens 1048576$"),
    (["--nproc", "8", "--ours_args", "--batch_size 147456 --batch_schedule 0,0,0"],
     r"ours: its 3 micro-batches per step \(batch_size / seq_len\) do not split over --nproc 8: give it a batch_size"),
])
def test_gpu_counts_and_splits_that_do_not_divide_are_refused_naming_the_fix(monkeypatch, tmp_path, argv, error):
    launched = []
    with pytest.raises(SystemExit, match=error) as e:
        fake_main(monkeypatch, tmp_path, ["--public_seeds", "0", "--seeds", "0", *argv], launched=launched)
    assert "\n" not in str(e.value) and not launched


def test_a_run_s_own_other_gpus_are_not_counted_as_other_work(monkeypatch):
    for visible, gpus in (("4,5,6,7", [4, 5, 6, 7]), ("", [0, 1, 2, 3]), ("GPU-a,GPU-b", [0, 1, 2, 3]), ("6", [6, 1])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert fh.visible_gpus(len(gpus)) == gpus
    samples = [(t, 1.0, g, 1980.0, 600.0, 50.0, 100.0, 0) for t in range(10) for g in (0, 1, 2)]
    assert fh.run_conditions(samples, 0, 10, gpu=0)["others_busiest"] == 100
    assert fh.run_conditions(samples, 0, 10, gpu=0, also=(1, 2))["others_busiest"] is None

# ---- the 2026-05-27 MUDD record folder: its baseline (mudd-base) and v1 (mudd-v1), for the proxy validity check

FP8_LINES = '''        if use_mlp_fp8:
            mlp_down_proj_scales = [self._mlp_down_proj_scales[i:i+1] for i in range(12)]
            mlp_args = (
                    self._mlp_down_act_scales[i:i+1],
            )
'''
MASTER_HUB = "flash_attn_interface = get_kernel('kernels-community/flash-attn3', version=1).flash_attn_interface\n"
# Stand-ins with the lines each patch anchors on in the two scripts (older than master: no per-layer FP8 scales,
# no FP8 bootstrap, another hub loader; v1 logs to logs0527/), not the public code.
BASE_HUB = "flash_attn_interface = get_kernel('varunneal/flash-attention-3').flash_attn_interface\n"
MUDD_BASE_LIKE = (MASTER_LIKE.replace(MASTER_HUB, BASE_HUB).replace(FP8_LINES, "        pass\n")
                  .replace("    model.quantize_mlp_fp8(bootstrap_down=(step < 16))\n", "    pass\n")
                  .replace("iterations: int = 1270", "iterations: int = 1375")
                  .replace("iterations: int = 15", "iterations: int = 10"))
MUDD_V1_LIKE = (MUDD_BASE_LIKE.replace(BASE_HUB, "# " + BASE_HUB)
                .replace("grad_accum_steps = 8 // world_size\n", '''grad_accum_steps = 8 // world_size
try:
    _fa3_mod = get_kernel("kernels-community/flash-attn3")
except BaseException as exc:
    print(f"load failed: {exc}", flush=True)
    _fa3_mod = get_kernel("varunneal/flash-attention-3", trust_remote_code=True)
flash_attn_interface = getattr(_fa3_mod, "flash_attn_interface", _fa3_mod)
''').replace("iterations: int = 1375", "iterations: int = 1315").replace("iterations: int = 10", "iterations: int = 20")
                .replace('"logs"', '"logs0527"').replace('f"logs/{run_id}.txt"', 'f"logs0527/{run_id}.txt"'))
MUDD_LIKE = {"mudd-base": MUDD_BASE_LIKE, "mudd-v1": MUDD_V1_LIKE}


def mudd_code(name, source=None):
    files = {"train_gpt.py": source or MUDD_LIKE[name], "triton_kernels.py": "# kernels\n"}
    if name == "mudd-v1":
        files["dc_triton_kernels.py"] = "# dc kernels\n"
    return fh.PublicCode(name, files, "log x")


def test_the_mudd_stand_ins_differ_from_master_where_the_scripts_do():
    assert MUDD_BASE_LIKE.count("varunneal") == 1
    assert "_scales" not in MUDD_BASE_LIKE and "bootstrap" not in MUDD_BASE_LIKE
    assert MUDD_V1_LIKE.count("logs0527") == 2 and MUDD_V1_LIKE.count("get_kernel(") == 3
    for s in MUDD_LIKE.values():
        compile(s, "stand-in", "exec")


@pytest.mark.parametrize("name", ["mudd-base", "mudd-v1"])
def test_every_patch_of_the_mudd_scripts_is_applied(name):
    files = fh.patch_public(mudd_code(name), accum=1, batch_div=16, step_div=1, **STAGING)
    s = files["train_gpt.py"]
    assert not re.search(r"^[^#\n]*get_kernel\(", s, re.M) and "\nfrom kernels import" not in s
    if name == "mudd-base":
        assert "\nimport harness_attention as flash_attn_interface  # harness" in s
    else:  # the try imports the stand-in, the fallback re-raises, getattr(...) gives the module itself
        assert "\n    import harness_attention as _fa3_mod  # harness" in s and "\n    raise  # harness" in s
        assert 'flash_attn_interface = getattr(_fa3_mod, "flash_attn_interface", _fa3_mod)' in s
        assert "logs0527" not in s and 'os.makedirs("logs", exist_ok=True)' in s
    assert 'logfile = f"logs/{run_id}.txt"' in s
    assert "grad_accum_steps = 1  #" in s and "    val_batch_size: int = 40960\n" in s
    assert "    train_files: str = '/d/train_*.bin' # input .bin to train on" in s
    assert "    _stage.batch_size //= 16\ntraining_schedule = TrainingSchedule(" in s
    assert s.index("harness: stage boundaries") < s.index("model: nn.Module = GPT(")
    compile(fh.seed_public(fh.override(s, "run_id", "'r'"), 1), name, "exec")
    assert sorted(files) == sorted([*mudd_code(name).files, "harness_attention.py"])  # the kernel files are staged
    assert "fp8_scale_alignment" not in fh.patches_for(name) and "fp8_scale_alignment" in fh.patches_for("master")


@pytest.mark.parametrize("name, bounds, tokens", [
    # 1375 scheduled steps in thirds (458, 917), 10 of extension; 1315 (438, 877), 20 of extension
    ("mudd-base", [(0, 458), (458, 917), (917, 1375), (1375, 1385)], 364_380_160),
    ("mudd-v1", [(0, 438), (438, 877), (877, 1315), (1315, 1335)], 352_583_680),
])
def test_the_mudd_schedules_are_parsed_and_scaled_as_master_s(name, bounds, tokens):
    stages = fh.public_stages(MUDD_LIKE[name])
    assert [(st.start, st.end) for st in stages] == bounds and fh.tokens_at(stages, bounds[-1][1]) == tokens
    assert [st.batch for st in stages] == [131072, 262144, 393216, 393216]
    assert [st.max_seq_len for st in stages] == [896, 2048, 2048, 2048]
    s = fh.patch_public(mudd_code(name), accum=1, batch_div=16, step_div=1, **STAGING)["train_gpt.py"]
    scaled = fh.public_stages(s, 16)
    assert [st.batch for st in scaled] == [8192, 16384, 24576, 24576]
    assert fh.tokens_at(scaled, bounds[-1][1]) * 16 == tokens
    assert "muon_warmup_steps=300, muon_cooldown_steps=50" in s  # batch_div keeps the steps and step constants


@pytest.mark.parametrize("name, scheduled, extension", [("mudd-base", 86, 1), ("mudd-v1", 82, 1)])
def test_step_div_scales_the_mudd_step_counts_and_step_constants(name, scheduled, extension):
    s = fh.patch_public(mudd_code(name), accum=8, batch_div=1, step_div=16, **STAGING)["train_gpt.py"]
    assert (fh.field_value(s, "num_scheduled_iterations"), fh.field_value(s, "num_extension_iterations")) == \
        (str(scheduled), str(extension))
    assert "muon_warmup_steps=19, muon_cooldown_steps=3," in s and "bootstrap" not in s
    assert fh.public_stages(s)[-1].end == scheduled + extension


@pytest.mark.parametrize("name, anchor, patch", [
    ("mudd-base", BASE_HUB, "hub_fa3_loader"),
    ("mudd-v1", '    _fa3_mod = get_kernel("varunneal/flash-attention-3", trust_remote_code=True)\n', "hub_fa3_loader"),
    ("mudd-v1", 'os.makedirs("logs0527", exist_ok=True)', "log_dir"),
    ("mudd-v1", "grad_accum_steps = 8 // world_size\n", "micro_batches"),
    ("mudd-base", "muon_warmup_steps=300, muon_cooldown_steps=50", "step_div"),
    ("mudd-base", "\nmodel: nn.Module = GPT(", "stage_log"),
])
def test_a_mudd_script_without_a_patch_anchor_is_refused_naming_the_patch(name, anchor, patch):
    assert MUDD_LIKE[name].count(anchor) == 1
    with pytest.raises(SystemExit, match=f"patch '{patch}'"):
        fh.patch_public(mudd_code(name, MUDD_LIKE[name].replace(anchor, "\n# gone\n")), accum=1, batch_div=16,
                        step_div=16, **STAGING)


def test_a_mudd_script_with_per_layer_fp8_scales_is_refused():
    source = MUDD_BASE_LIKE.replace("class GPT:\n    def forward(self):\n        pass\n",
                                    "class GPT:\n    def forward(self):\n" + FP8_LINES)
    with pytest.raises(SystemExit, match="patch 'fp8_scale_alignment'.*FP8_MLP_CODES"):
        fh.patch_public(mudd_code("mudd-base", source), accum=1, batch_div=16, step_div=1, **STAGING)


def mudd_log(source, kernels):
    bar = "-" * 40
    return source + "".join(f"\n\n{bar}\n# {name}\n{bar}\n\n{text}" for name, text in kernels.items()) + \
        "=" * 100 + "\nstep:0/1335 val_loss:10.8258 train_time:0ms\n"


def test_a_mudd_code_is_the_pinned_log_and_is_staged_with_its_kernel_files(monkeypatch, tmp_path, capsys):
    import hashlib
    kernels = {"triton_kernels.py": "XXT = 0\n", "dc_triton_kernels.py": "DC = 1\n"}
    text = mudd_log(MUDD_V1_LIKE, kernels)
    log = tmp_path / "ck" / fh.RECORD_LOGS["mudd-v1"]
    log.parent.mkdir(parents=True)
    (log.parent / "another_run.txt").write_text("not this one")  # the path is exact: other logs are not read
    log.write_text(text)
    with pytest.raises(SystemExit, match="embeds a source of md5 [0-9a-f]{32}, not the pinned"):
        fh.public_source(tmp_path / "ck", "mudd-v1")
    md5 = hashlib.md5(text[: text.index("=" * 100)].encode()).hexdigest()
    monkeypatch.setitem(fh.RECORD_MD5, "mudd-v1", md5)
    code = fh.public_source(tmp_path / "ck", "mudd-v1")
    assert code.files == {"train_gpt.py": MUDD_V1_LIKE, **kernels}
    assert code.origin == f"{fh.RECORD_LOGS['mudd-v1']} (md5 {md5})"
    (tmp_path / "d").mkdir()
    write_docs(tmp_path / "d" / "t_000001.bin", [3, 5, 2, 7] * 5000)
    write_docs(tmp_path / "d" / "v_000000.bin", [100] * 20)
    monkeypatch.setattr(fh, "launch", lambda *a: pytest.fail("nothing may be launched"))
    monkeypatch.setattr(sys, "argv", ["side_by_side.py", "--public", str(tmp_path / "ck"), "--public_code", "mudd-v1",
                                      "--train_files", str(tmp_path / "d" / "t_*.bin"),
                                      "--val_files", str(tmp_path / "d" / "v_*.bin"), "--work", str(tmp_path / "w"),
                                      "--batch_div", "8192", "--public_seeds", "0", "--seeds", "--check_only"])
    fh.main()
    assert "public mudd-v1: 1335 steps, 43,040 tokens trained" in capsys.readouterr().out  # 438x16 + 439x32 + 458x48
    staged = tmp_path / "w" / "public_mudd-v1"
    assert {p.name for p in staged.glob("*.py")} >= {"train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py",
                                                      "harness_attention.py"}
    assert (staged / "dc_triton_kernels.py").read_text() == "DC = 1\n"


# a clone of KellerJordan/modded-nanogpt (bare or not) to check the real pinned logs against, if you have one
MIRROR = Path(os.environ.get("MODDED_NANOGPT_MIRROR", "modded-nanogpt"))


@pytest.mark.parametrize("name", ["mudd-base", "mudd-v1"])
def test_the_pinned_public_logs_stage_into_valid_python(name, tmp_path):
    """With a (bare) clone of KellerJordan/modded-nanogpt at hand, the real pinned logs: their md5, every patch
    found, the staged files compile, the schedule as published; skipped where there is none."""
    import subprocess
    got = subprocess.run(["git", "-C", str(MIRROR), "show", f"HEAD:{fh.RECORD_LOGS[name]}"], capture_output=True,
                         text=True) if MIRROR.is_dir() else None
    if got is None or got.returncode:
        pytest.skip(f"no clone of KellerJordan/modded-nanogpt with {fh.RECORD_LOGS[name]} at {MIRROR}")
    log = tmp_path / fh.RECORD_LOGS[name]
    log.parent.mkdir(parents=True)
    log.write_text(got.stdout)
    code = fh.public_source(tmp_path, name)
    kernels = ["triton_kernels.py", *(["dc_triton_kernels.py"] if name == "mudd-v1" else [])]
    assert sorted(code.files) == sorted(["train_gpt.py", *kernels])
    for kw in (dict(accum=1, batch_div=16, step_div=1), dict(accum=8, batch_div=1, step_div=16)):
        files = fh.patch_public(code, profile_step=70, start_after=str(tmp_path / "go"), **kw, **STAGING)
        for file, text in files.items():
            if file == "train_gpt.py":
                text = fh.seed_public(fh.override(text, "run_id", "'r'"), 0)
            compile(text, file, "exec")
    total = {"mudd-base": 1385, "mudd-v1": 1335}[name]
    assert fh.public_stages(code.script)[-1].end == total


def test_pair_tables_reads_back_what_side_by_side_writes_and_pairs_across_files(tmp_path, capsys):
    """Two jobs' tables (side_by_side.format_table): a base run in one, a variant in the other, and a run lost in the
    first (a column of dashes); pair_tables parses them back exactly, pairs by seed and finds the target's crossing."""
    import pair_tables as pt
    base = {f"base seed {s}": {0: (10.0, 0.0), 50: (round(3.0 + 0.01 * s, 4), 5000.0),
                               100: (round(2.5 + 0.01 * s, 4), 10000.0)} for s in range(3)}  # as the table rounds
    variant = {f"var seed {s}": {0: (10.0, 0.0), 50: (round(2.9 + 0.01 * s, 4), 5500.0),
                                 100: (round(2.4 + 0.02 * s, 4), 11000.0)} for s in range(3)}
    lost = {"var seed 3": {}}
    first = tmp_path / "a.md"
    first.write_text("\n".join(["Device: x", "", *fh.format_table({**base, **lost}, {"base": list(base), "var": ["var seed 3"]})]))
    second = tmp_path / "b.md"
    second.write_text("\n".join(fh.format_table(variant, {"var": list(variant)})))
    assert pt.parse(first) == base and pt.parse(second) == variant  # the lost run is no run
    stopped = tmp_path / "c.md"  # a run stopped after its first validation, its label's steps on the Data: line
    cut = {**variant, "var seed 3": {0: (10.0, 0.0)}}
    stopped.write_text("\n".join(["Data: var: 100 steps, 1,000 tokens trained, reads 1 of 9", "",
                                   *fh.format_table(cut, {"var": list(cut)})]))
    assert "var seed 3" in pt.parse(stopped)
    sys.argv = ["pair_tables.py", str(stopped), str(first), "--base", "base"]
    pt.main()
    out, err = capsys.readouterr()
    assert "'var seed 3' stopped at step 0 of 100; left out" in err and "| var | 3 | " in out
    sys.argv = ["pair_tables.py", str(second), str(first), "--base", "base", "--target", "2.95"]
    pt.main()
    out = capsys.readouterr().out
    diffs = [v - b for v, b in zip([2.4, 2.42, 2.44], [2.5, 2.51, 2.52])]
    m, h = fh.interval95(diffs)
    assert "| var | 3 | " in out and f"{m:+.4f} +- {h:.4f} (3)" in out
    assert "| base seed 0 | 55.0 | 0.550 |" in out  # 3.00 at 50 and 2.50 at 100: 2.95 at step 55
    assert "| var seed 2 | 49.8 | 0.498 |" in out  # 10 at 0 and 2.92 at 50: between them


def test_pair_tables_ties_one_recipe_at_two_lengths_from_two_jobs_with_the_public_runs(tmp_path, capsys):
    """--tie: a recipe's short runs in one job beside the public code's, its long runs in another; each seed's
    tokens where its finals reach its public run's final, from the tables' Data: lines."""
    import pair_tables as pt
    public = {f"public master seed {s}": {0: (10.0, 0.0), 100: (2.60 + 0.01 * s, 1.0)} for s in range(2)}
    short = {f"short seed {s}": {0: (10.0, 0.0), 100: (2.70, 1.0)} for s in range(2)}
    long = {f"long seed {s}": {0: (10.0, 0.0), 100: (2.50, 1.0)} for s in range(2)}
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text("\n".join(["Data: public master: 100 steps, 2,000 tokens trained, reads 1 of 9; short: 100 steps, "
                                "1,000 tokens trained, reads 1 of 9", "",
                                *fh.format_table({**public, **short}, {"public master": list(public),
                                                                       "short": list(short)})]))
    second.write_text("\n".join(["Data: long: 100 steps, 1,600 tokens trained, reads 1 of 9", "",
                                 *fh.format_table(long, {"long": list(long)})]))
    assert pt.trained_tokens(first) == {"public master": 2000, "short": 1000}
    sys.argv = ["pair_tables.py", str(first), str(second), "--base", "short", "--tie", "short,long"]
    pt.main()
    out = capsys.readouterr().out
    # seed 0: 2.60 lies at 1000 + (2.70 - 2.60) / 0.20 x 600 = 1300 tokens, 0.650 of 2000; seed 1: 2.61 at 1270
    assert "| short / long | 0 | 2.6000 | 1,300 (0.650) |" in out and "| short / long | 1 | 2.6100 | 1,270 (0.635) |" in out
    sys.argv = ["pair_tables.py", str(second), "--tie", "short,long"]
    with pytest.raises(SystemExit):
        pt.main()
    assert "--tie needs the public code's runs" in capsys.readouterr().err
    # the public finals as a page quotes them, where no table of its runs is kept: the same ties
    third = tmp_path / "c.md"
    third.write_text("\n".join(["Data: short: 100 steps, 1,000 tokens trained, reads 1 of 9", "",
                                *fh.format_table(short, {"short": list(short)})]))
    sys.argv = ["pair_tables.py", str(third), str(second), "--base", "short", "--tie", "short,long",
                "--public_finals", "0:2.60,1:2.61", "--public_tokens", "2000"]
    pt.main()
    out = capsys.readouterr().out
    assert "| short / long | 0 | 2.6000 | 1,300 (0.650) |" in out and "| short / long | 1 | 2.6100 | 1,270 (0.635) |" in out
    assert "| public master | 2 | 2.6050 +- " in out  # paired with short's finals too
    # the long runs' finals as a page quotes them too (--finals): the same ties from one table
    sys.argv = ["pair_tables.py", str(third), "--base", "short", "--tie", "short,long", "--public_finals",
                "0:2.60,1:2.61", "--public_tokens", "2000", "--finals", "long@1600=0:2.50,1:2.50"]
    pt.main()
    out = capsys.readouterr().out
    assert "| short / long | 0 | 2.6000 | 1,300 (0.650) |" in out
    assert "| short / long | 1 | 2.6100 | 1,270 (0.635) |" in out
    assert "| long | 2 | 2.5000 +- 0.0000 | -0.2000 +- 0.0000 (2) |" in out
    for finals, says in (("long=0:2.5", "expected LABEL@TOKENS=SEED:LOSS"), ("long@1600=0:x", "expected LABEL@TOKENS"),
                         ("short@1000=0:2.7", "holds runs of short seed")):
        sys.argv = ["pair_tables.py", str(third), "--finals", finals]
        with pytest.raises(SystemExit):
            pt.main()
        assert says in capsys.readouterr().err
    for extra, says in ((["--public_tokens", "2000"], "holds the public code's runs"), ([], "needs --public_tokens")):
        sys.argv = ["pair_tables.py", str(first), "--public_finals", "0:2.60", *extra]
        with pytest.raises(SystemExit):
            pt.main()
        assert says in capsys.readouterr().err


def test_runs_sharing_a_gpu_start_again_once_after_running_out_of_memory_one_fewer_at_a_time(monkeypatch, tmp_path,
                                                                                             capsys):
    """Several at once, a run whose output says CUDA ran out of memory starts again once, its first logs kept
    beside (train_gpt.py refuses to follow another run's log), and from then on one run fewer goes at a time; a run
    that fails otherwise, or runs out of memory a second time, is not started again."""
    runs = [(f"ours seed {i}", tmp_path / f"ours{i}.txt", ["x"], tmp_path, {}, i, []) for i in range(4)]
    starts, running, most, now = [], set(), [0], [0]
    fate = {"ours0": ["oom", "ok"], "ours1": ["fail"], "ours2": ["oom", "oom"], "ours3": ["ok"]}

    def fake_launch(cmd, cwd, out, env):
        name = out.stem
        starts.append(name)
        outcome = fate[name].pop(0)
        (tmp_path / f"{name}.txt").write_text("step:0/10 val_loss:10.8\n")
        out.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate\n" if outcome == "oom" else "")
        running.add(name)
        most[0] = max(most[0], len(running))
        end = now[0] + 2  # each run takes two ticks of the fake clock

        def poll():
            if now[0] < end:
                return None
            running.discard(name)
            return {"ok": 0, "fail": 1, "oom": 1}[outcome]
        return SimpleNamespace(poll=poll)

    def fake_sleep(_):
        now[0] += 1
        assert now[0] < 100, "launch_all never returned"
    monkeypatch.setattr(fh, "launch", fake_launch)
    monkeypatch.setattr(fh.time, "sleep", fake_sleep)
    procs = fh.launch_all(runs, at_once=3, stagger=False)
    assert sorted(starts) == ["ours0", "ours0", "ours1", "ours2", "ours2", "ours3"]
    assert [p.poll() for p in procs] == [0, 1, 1, 0]  # the second launch of ours0 and of ours2 are the ones returned
    assert most[0] == 3
    assert (tmp_path / "ours0.oom.txt").exists() and (tmp_path / "ours0.oom.out").exists()
    assert "CUDA out of memory" not in (tmp_path / "ours0.out").read_text()  # the new run's output, not the first's
    printed = capsys.readouterr().out
    assert "ours seed 0 ran out of GPU memory: it starts again, 2 run(s) at a time from now" in printed
    assert "ours seed 2 ran out of GPU memory: it starts again, 1 run(s) at a time from now" in printed
    assert printed.count("ran out of GPU memory") == 2  # ours2's second time: not again


def test_the_tie_table_finds_the_tokens_at_which_one_recipe_at_several_lengths_ends_at_the_public_final():
    """Labels whose flags differ only in --num_iterations are one recipe: per seed, the trained tokens where its finals,
    linear in tokens, cross the public run's final (extrapolated through the two nearest lengths where none bracket it,
    and marked); a label with other flags, or no public runs, adds nothing."""
    cmd = lambda *flags: ["torchrun", "--standalone", "/x/train_gpt.py", "--batch_size", "24576", *flags,
                          "--seed", "0", "--run_id", "r"]
    assert fh.recipe(cmd("--num_iterations", "760")) == fh.recipe(cmd()) == ("--batch_size", "24576")
    assert fh.recipe(cmd("--stages", "window=3")) != fh.recipe(cmd())
    finals = {"public": (2.70, 2.70, 21_000_000), "n840": (2.60, 2.60, 20_000_000), "n760": (2.72, 2.68, 18_000_000),
              "other": (2.50, 2.50, 20_000_000)}
    results, seeds, groups = {}, {}, {}
    for label, (loss0, loss1, tokens) in finals.items():
        for seed, loss in ((0, loss0), (1, loss1)):
            name = f"{label} seed {seed}"
            results[name], seeds[name] = {100: (4.0, 0, 1), 840: (loss, 0, tokens)}, seed
            groups.setdefault(label, []).append(name)
    recipes = {"n840": ("a",), "n760": ("a",), "other": ("b",)}
    lines = fh.tie_table(results, groups, seeds, recipes)
    rows = [line for line in lines if line.startswith("| n840 / n760 |")]
    # seed 0: 2.72 at 18M, 2.60 at 20M: 2.70 at 18M + (0.02 / 0.12) x 2M; seed 1: both below 2.70, on their line
    assert rows[0] == f"| n840 / n760 | 0 | 2.7000 | {18_000_000 + 2_000_000 / 6:,.0f} ({(18e6 + 2e6 / 6) / 21e6:.3f}) |"
    assert rows[1] == (f"| n840 / n760 | 1 | 2.7000 | {18_000_000 - 2_000_000 / 4:,.0f} ({17.5e6 / 21e6:.3f}, "
                       "extrapolated below the shortest run) |")
    assert rows[2].startswith("| n840 / n760 | mean of 2 (1 extrapolated) | - | share ")
    assert not any("other" in line for line in lines)
    assert fh.tie_table(results, {k: v for k, v in groups.items() if k != "public"}, seeds, recipes) == []
    assert fh.tie_table(results, groups, seeds, {"n840": ("a",), "other": ("b",)}) == []
