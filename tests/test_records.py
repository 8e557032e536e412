"""Tests of the record tools (records/check.py, plot.py, new.py) and of run.sh's GPU check.

Logs are written here in the trainer's format: code, a line of 100 '=', versions, another line of
100 '=', hyperparameters (`name: value`), then step lines with a validation line every 25 steps and
at the end.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"
sys.path.insert(0, str(RECORDS))

import check  # noqa: E402
import new  # noqa: E402
import plot  # noqa: E402

SEP = "=" * 100
CODE = "import torch\nprint('the trainer')\n"
LOSSES = [3.2771, 3.2755, 3.2760, 3.2766, 3.2778]
TIMES_MS = [163871, 163621, 163848, 163998, 163897]
# the hyperparameter lines check.py looks at, as train_gpt.py writes them for a record run
RECORD_PARAMS = {"train_files": "/data/speedrun/data/fineweb10B/fineweb_train_*.bin",
                 "val_files": "/data/speedrun/data/fineweb10B/fineweb_val_*.bin", "val_tokens": "10485760",
                 "val_seq_len": "262144", "vocab_size": "50304", "run_id": "r", "preset": "record",
                 "markov_corpus": "False"}
# and for `python train_gpt.py --preset smoke`
SMOKE_PARAMS = {**RECORD_PARAMS, "train_files": "/repo/data/smoke/markov_train_*.bin",
                "val_files": "/repo/data/smoke/markov_val_*.bin", "val_tokens": "32768", "vocab_size": "128",
                "preset": "smoke", "markov_corpus": "True"}
NVIDIA_SMI = ["Wed Sep  3 19:58:00 2025       ", "+" + "-" * 89 + "+",
              "| NVIDIA-SMI 560.35.03              Driver Version: 560.35.03      CUDA Version: 12.6     |"]


def write_log(path: Path, final_loss: float, final_ms: int, *, steps: int = 100, code: str = CODE,
              stop_at: int | None = None, final_val: bool = True, params: dict | None = RECORD_PARAMS,
              env: list[str] = (), gpus: int = 8, device: str = "cuda:0") -> Path:
    """A log of `steps` steps; stop_at cuts it after that step (a crashed or copied-short run).
    params=None writes no hyperparameter lines (the public speedrun's logs have none); env: lines
    of the environment report (e.g. NVIDIA_SMI); device and gpus: the run report's device line."""
    lines = [code.rstrip("\n"), SEP, "Running Python 3.12.3", "Running PyTorch 2.13.0", *env, SEP]
    if params is not None:
        lines += [f"{k}: {v}" for k, v in {**params, "num_iterations": steps}.items()]
        lines += [f"device: {device} x {gpus}, grad accumulation {8 // gpus}, parameters: 123,456"]
    lines += [f"step:0/{steps} val_loss:10.8258 train_time:0ms step_avg:0.02ms"]
    last = steps if stop_at is None else stop_at
    for s in range(1, last + 1):
        ms = round(final_ms * s / steps)
        lines.append(f"step:{s}/{steps} train_time:{ms}ms step_avg:{ms / s:.2f}ms")
        if s % 25 == 0 and s < steps:
            loss = final_loss + 0.6 * (steps - s) / steps
            lines.append(f"step:{s}/{steps} val_loss:{loss:.4f} train_time:{ms}ms step_avg:{ms / s:.2f}ms")
    if stop_at is None and final_val:
        lines.append(f"step:{steps}/{steps} val_loss:{final_loss:.4f} train_time:{final_ms}ms "
                     f"step_avg:{final_ms / steps:.2f}ms")
    if stop_at is None:
        lines.append("peak memory allocated: 34217 MiB reserved: 49936 MiB")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path: Path) -> list[Path]:
    return [write_log(tmp_path / "logs" / f"run{i}.txt", loss, ms)
            for i, (loss, ms) in enumerate(zip(LOSSES, TIMES_MS))]


# --- check.py --------------------------------------------------------------------------------

def test_check_mean_std_and_pvalues_equal_scipy_computed_independently(runs):
    result = check.check(runs, target=3.28, time_claim=164.5)
    times = [ms / 1000 for ms in TIMES_MS]
    assert result.n == len(LOSSES)
    assert result.mean_loss == pytest.approx(np.mean(LOSSES))
    assert result.std_loss == pytest.approx(statistics.stdev(LOSSES))
    assert result.p_loss == pytest.approx(stats.ttest_1samp(LOSSES, 3.28, alternative="less").pvalue)
    assert result.mean_time == pytest.approx(np.mean(times))
    assert result.p_time == pytest.approx(stats.ttest_1samp(times, 164.5, alternative="less").pvalue)
    assert result.passed and result.exit_code == 0


def test_check_cli_prints_a_row_per_run_and_exits_0_when_p_below_001(runs):
    proc = subprocess.run([sys.executable, str(RECORDS / "check.py"), *map(str, runs)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for path, loss, ms in zip(runs, LOSSES, TIMES_MS):
        row = next(line for line in out.splitlines() if line.startswith(str(path)))
        assert row.split()[1:] == ["100", f"{loss:.4f}", f"{ms / 1000:.3f}"]
    p = stats.ttest_1samp(LOSSES, 3.28, alternative="less").pvalue
    assert f"runs: {len(runs)} of 100 steps" in out
    assert f"mean {np.mean(LOSSES):.4f}" in out
    assert check._fmt_p(p) in out and out.rstrip().splitlines()[-1].startswith("PASS")


def test_check_cli_help_describes_usage():
    proc = subprocess.run([sys.executable, str(RECORDS / "check.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "--time-claim" in proc.stdout and "--target" in proc.stdout and "LOG_OR_DIR" in proc.stdout


def test_check_names_truncated_and_unfinished_logs_and_leaves_them_out(runs, tmp_path):
    cut = write_log(tmp_path / "cut.txt", 3.2, 160000, stop_at=60)
    unfinished = write_log(tmp_path / "noval.txt", 3.2, 160000, final_val=False)
    empty = tmp_path / "empty.log"
    empty.write_text(CODE + SEP + "\nno steps here\n")
    result = check.check([*runs, cut, unfinished, empty])
    assert result.n == len(runs)
    reasons = dict(result.skipped)
    assert "truncated" in reasons[cut] and "60 of 100" in reasons[cut]
    assert "no final validation line" in reasons[unfinished]
    assert "no step lines" in reasons[empty]
    report = check.format_report(result)
    assert "not counted:" in report and str(cut) in report and str(unfinished) in report


def test_check_names_and_skips_a_log_holding_two_runs_and_counts_a_resumed_one(runs, tmp_path):
    """Two runs appended to one log under one --run_id (issue 61 item 2) were read as one clean run with the second
    run's loss. A run resumed into its own log (no second header) is one run."""
    merged = tmp_path / "merged.txt"
    merged.write_text(write_log(tmp_path / "a.txt", 3.3500, 160000).read_text() +
                      write_log(tmp_path / "b.txt", 3.2700, 161000).read_text())
    full = write_log(tmp_path / "full.txt", 3.2766, 163000).read_text()
    resumed = tmp_path / "resumed.txt"
    resumed.write_text(write_log(tmp_path / "cut.txt", 3.2766, 163000, stop_at=60).read_text() +
                       "resuming from checkpoints/r/step_000050\n" + full[full.index("step:51/100 "):])
    result = check.check([*runs, merged, resumed])
    assert [r.path for r in result.runs] == [*runs, resumed] and result.runs[-1].final_loss == 3.2766
    assert result.skipped == [(merged, "holds 2 runs, not one (the source and settings appear 2 times: runs appended "
                                       "to one log under one run id); check each run from a log of its own")]
    assert f"  {merged}: holds 2 runs, not one" in check.format_report(result)


def test_check_counts_a_file_given_twice_and_an_identical_copy_once(runs, tmp_path):
    copy = tmp_path / "elsewhere" / "copy.txt"
    copy.parent.mkdir()
    shutil.copy(runs[0], copy)
    result = check.check([*runs, runs[0], copy])
    assert result.n == len(runs)
    notes = "\n".join(result.notes)
    assert "given more than once" in notes
    assert f"{copy}: same contents as {runs[0]}" in notes


def test_check_flags_runs_with_another_step_count_and_keeps_the_majority(runs, tmp_path):
    odd = write_log(tmp_path / "odd.txt", 3.27, 150000, steps=80)
    result = check.check([*runs, odd])
    assert result.total_steps == 100 and result.n == len(runs)
    assert "80" in dict(result.skipped)[odd]
    assert any("disagree on the step count" in n for n in result.notes)


def test_check_needs_two_runs_for_a_p_value(runs, capsys):
    assert check.main([str(runs[0])]) == 1
    out = capsys.readouterr().out
    assert "a p-value needs at least 2 runs" in out


def test_check_exits_1_when_mean_loss_is_not_significantly_below_target(tmp_path, capsys):
    logs = [write_log(tmp_path / f"r{i}.txt", loss, 160000)
            for i, loss in enumerate([3.2790, 3.2805, 3.2798])]
    assert check.main([str(p) for p in logs]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("FAIL")


def test_check_exits_1_when_the_time_claim_does_not_hold(runs, capsys):
    assert check.main([*map(str, runs), "--time-claim", "163.9"]) == 1
    assert "mean time < 163.9 s is not shown" in capsys.readouterr().out


def test_check_exits_2_when_no_log_can_be_read(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("nothing useful\n")
    assert check.main([str(bad)]) == 2
    out = capsys.readouterr().out
    assert "no step lines" in out and out.rstrip().splitlines()[-1] == "FAIL: no run counts (see 'not counted' above)"


def test_check_names_a_missing_path_in_one_line_on_stderr_and_exits_2(runs, tmp_path, capsys):
    missing, empty = tmp_path / "missing.txt", tmp_path / "nologs"
    empty.mkdir()
    assert check.main([*map(str, runs), str(missing), str(empty)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"check.py: error: {missing}: no such file or directory; "
                            f"{empty}: directory holds no .txt or .log file\n")


def _cli(tool: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "SPEEDRUN_DEBUG"}
    return subprocess.run([sys.executable, str(RECORDS / tool), *args], capture_output=True, text=True,
                          timeout=60, env={**full_env, **env})


def test_check_cli_errors_are_one_line_and_speedrun_debug_shows_the_traceback(tmp_path):
    plain = _cli("check.py", str(tmp_path / "missing.txt"))
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.splitlines() == [f"check.py: error: {tmp_path / 'missing.txt'}: no such file or directory"]
    debug = _cli("check.py", str(tmp_path / "missing.txt"), SPEEDRUN_DEBUG="1")
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_check_reports_an_unforeseen_error_in_one_line_naming_the_fix(runs, tmp_path):
    fake = tmp_path / "fake_site"
    fake.mkdir()
    (fake / "scipy.py").write_text("raise ImportError(\"No module named 'scipy'\")\n")
    proc = _cli("check.py", *map(str, runs), PYTHONPATH=str(fake))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == ["check.py: error: No module named 'scipy' (pip install -r requirements.txt)"]


def test_check_never_passes_smoke_runs_and_says_why(tmp_path):
    smoke = [write_log(tmp_path / f"smoke{i}.txt", loss, 95000, steps=150, params=SMOKE_PARAMS)
             for i, loss in enumerate([1.7276, 1.7301, 1.7290])]
    result = check.check(smoke)
    assert result.n == 0 and not result.passed and result.exit_code == 2
    for path in smoke:
        why = dict(result.skipped)[path]
        assert why.startswith("not a record run: ")
        for part in ("preset smoke, not record", "vocab_size 128, not 50304", "val_tokens 32768, not 10485760",
                     "val_files /repo/data/smoke/markov_val_*.bin, not fineweb10B/fineweb_val_*.bin"):
            assert part in why
    proc = _cli("check.py", *map(str, smoke))
    assert proc.returncode == 2
    assert "PASS" not in proc.stdout and "not a record run: preset smoke" in proc.stdout


@pytest.mark.parametrize("change,needle", [
    ({"preset": "single"}, "preset single, not record"),
    ({"preset": "record-0903"}, "preset record-0903, not record"),  # the 09/03 record's preset, since deleted
    ({"vocab_size": "50257"}, "vocab_size 50257, not 50304"),
    ({"val_tokens": "1048576"}, "val_tokens 1048576, not 10485760"),
    ({"val_seq_len": "65536"}, "val_seq_len 65536, not 262144"),  # validation cut unlike the public one
    ({"val_files": "/data/mytext/fineweb_val_*.bin"}, "val_files /data/mytext/fineweb_val_*.bin"),
    ({"val_files": "data/fineweb10B/finewebedu_val_*.bin"}, "val_files data/fineweb10B/finewebedu_val_*.bin"),
    ({"markov_corpus": "True"}, "markov_corpus True"),
])
def test_check_leaves_out_a_run_off_the_record_configuration_and_names_why(runs, tmp_path, change, needle):
    odd = write_log(tmp_path / "odd.txt", 3.20, 150000, params={**RECORD_PARAMS, **change})
    result = check.check([*runs, odd])
    assert result.n == len(runs) and odd not in [r.path for r in result.runs]
    why = dict(result.skipped)[odd]
    assert why.startswith(f"not a record run: {needle}") and ";" not in why  # this one reason only
    assert f"odd.txt: not a record run: {needle}" in check.format_report(result)


def test_check_says_the_cpu_for_runs_whose_log_shows_a_cpu_device(runs, tmp_path):
    """CPU runs were reported as "on 1 GPU(s)" (issue 61 item 7)."""
    cpu = [write_log(tmp_path / "cpu" / f"c{i}.txt", loss, ms, device="cpu", gpus=1)
           for i, (loss, ms) in enumerate(zip(LOSSES, TIMES_MS))]
    report = check.format_report(check.check(cpu))
    assert "\nruns: 5 of 100 steps on the CPU\n" in report and "GPU" not in report
    two = [write_log(tmp_path / "cpu2" / f"c{i}.txt", 3.27 + i / 1000, 160000, device="cpu", gpus=2) for i in range(2)]
    assert "\nruns: 2 of 100 steps on the CPU (2 processes)\n" in check.format_report(check.check(two))
    assert "\nruns: 5 of 100 steps on 8 GPU(s)\n" in check.format_report(check.check(runs))


def test_check_counts_logs_without_hyperparameter_lines_as_record_runs(tmp_path):
    public = [write_log(tmp_path / f"p{i}.txt", loss, ms, params=None, env=NVIDIA_SMI)
              for i, (loss, ms) in enumerate(zip(LOSSES, TIMES_MS))]
    result = check.check(public)
    assert result.n == len(public) and result.passed
    assert check.parse_log(public[0]).params == {} and check.parse_log(public[0]).date == "2025-09-03"


def test_parse_log_reads_the_hyperparameter_block_after_the_second_separator(tmp_path):
    code = CODE + "preset: smoke\n"  # a line of the code that looks like a hyperparameter
    run = check.parse_log(write_log(tmp_path / "r.txt", 3.2766, 163000, code=code))
    assert run.preset == "record" and run.params["vocab_size"] == "50304"
    assert run.params["val_files"] == RECORD_PARAMS["val_files"] and run.date is None


def test_check_ignores_step_lines_inside_the_code_section(tmp_path):
    code = CODE + '# example: "step:100/100 val_loss:1.0000 train_time:1ms"\n'
    log = write_log(tmp_path / "r.txt", 3.2766, 163000, code=code)
    run = check.parse_log(log)
    assert run.ok and run.final_loss == 3.2766 and run.final_time_s == 163.0
    assert run.code.startswith(CODE) and "hyperparameters" not in run.code


def test_check_expands_directories_recursively(runs, tmp_path):
    result = check.check([tmp_path / "logs"])
    assert sorted(r.path for r in result.runs) == sorted(runs)


def test_parse_log_takes_the_validation_line_of_the_last_step_in_the_public_format(tmp_path):
    log = tmp_path / "public.txt"
    log.write_text("code\n" + SEP + "\nnvidia-smi\n" + SEP + "\n"
                   "step:0/1670 val_loss:10.8258 train_time:0ms step_avg:0.02ms\n"
                   "step:1669/1670 train_time:163426ms step_avg:97.92ms\n"
                   "step:1670/1670 train_time:163524ms step_avg:97.92ms\n"
                   "step:1670/1670 val_loss:3.2755 train_time:163621ms step_avg:97.98ms\n"
                   "peak memory allocated: 34217 MiB reserved: 49936 MiB\n")
    run = check.parse_log(log)
    assert (run.total_steps, run.final_loss, run.final_time_s) == (1670, 3.2755, 163.621)


# --- check.py: sets that are never pooled, and a candidate against a baseline (issue 35) --------

BASE_LOSSES = [3.2790, 3.2774, 3.2781, 3.2769, 3.2785, 3.2777]
BASE_MS = [80610, 80720, 80680, 80750, 80690, 80700]
CAND_LOSSES = [3.2772, 3.2779, 3.2768, 3.2781, 3.2770, 3.2775]
CAND_MS = [79540, 79650, 79600, 79700, 79580, 79630]
CAND_CODE = CODE + "# the candidate's change\n"


def _set(folder: Path, losses, times_ms, **kw) -> list[Path]:
    return [write_log(folder / f"run{i}.txt", loss, ms, **kw) for i, (loss, ms) in enumerate(zip(losses, times_ms))]


def test_check_never_pools_runs_of_different_code_and_judges_each_version_alone(runs, tmp_path, capsys):
    other = _set(tmp_path / "other", CAND_LOSSES[:3], CAND_MS[:3], code=CAND_CODE)
    result = check.check([*runs, *other])
    assert result.n == 0 and not result.passed and result.exit_code == 2
    assert [sub.n for _, sub in result.unpooled] == [len(runs), len(other)]
    first, second = (sub for _, sub in result.unpooled)
    assert first.p_loss == pytest.approx(check.check(runs).p_loss)  # each set as if checked alone
    assert second.mean_time == pytest.approx(np.mean(CAND_MS[:3]) / 1000)
    assert result.verdict.startswith("FAIL: the runs differ in code (2 sets")
    assert check.main([*map(str, runs), *map(str, other)]) == 2
    assert "sets not pooled" in capsys.readouterr().out


def test_check_never_pools_8_gpu_runs_with_a_1_gpu_run(runs, tmp_path):
    one_gpu = write_log(tmp_path / "one_gpu.txt", 3.2770, 740000, gpus=1)
    result = check.check([*runs, one_gpu])
    assert result.n == 0 and result.exit_code == 2 and "differ in GPU count" in result.verdict
    assert [name for name, _ in result.unpooled] == ["8 GPUs", "1 GPUs"]
    assert check.parse_log(one_gpu).gpus == 1


def test_parse_log_counts_the_gpus_of_nvidia_smis_process_table(tmp_path):
    smi = [*NVIDIA_SMI, "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:8D:00.0 Off |      0 |",
           "| Processes:                                                                    |",
           "|  GPU   GI   CI              PID   Type   Process name              GPU Memory |",
           *[f"|    {g}   N/A  N/A         10396{g}      C   .../bin/python       1512MiB |" for g in (0, 1, 2, 2)]]
    run = check.parse_log(write_log(tmp_path / "public.txt", 3.2770, 80000, params=None,
                                    env=["Running PyTorch 2.10.0+cu128 compiled for CUDA 12.8",
                                         "Running Triton version 3.6.0", *smi]))
    assert run.gpus == 3 and run.gpu_name == "NVIDIA H100 80GB HBM3"
    assert run.versions == {"PyTorch": "2.13.0", "CUDA": "12.8", "Triton": "3.6.0", "Python": "3.12.3"}  # the first line wins


def test_compare_numbers_equal_scipys_welch_test_and_interval(tmp_path):
    base = _set(tmp_path / "baseline", BASE_LOSSES, BASE_MS)
    cand = _set(tmp_path / "candidate", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    result = check.compare(base, cand)
    bt, ct = [ms / 1000 for ms in BASE_MS], [ms / 1000 for ms in CAND_MS]
    time = stats.ttest_ind(ct, bt, equal_var=False)
    loss = stats.ttest_ind(CAND_LOSSES, BASE_LOSSES, equal_var=False)
    assert result.delta_time == pytest.approx(np.mean(ct) - np.mean(bt))
    assert result.ci_time == pytest.approx(tuple(time.confidence_interval(0.99)))
    assert result.welch_time == pytest.approx((time.statistic, time.df, time.pvalue))
    assert result.welch_loss == pytest.approx((loss.statistic, loss.df, loss.pvalue))
    assert result.speedup == pytest.approx(np.mean(bt) / np.mean(ct))
    assert result.relative_time == pytest.approx((np.mean(ct) - np.mean(bt)) / np.mean(bt))
    assert result.candidate.p_loss == pytest.approx(stats.ttest_1samp(CAND_LOSSES, 3.28, alternative="less").pvalue)
    assert result.passed and result.exit_code == 0 and result.verdict.startswith("PASS: a record")


def test_check_compares_a_record_folder_of_baseline_and_candidate_without_flags(tmp_path, capsys):
    folder = tmp_path / "2026-07-17_X"
    _set(folder / "baseline", BASE_LOSSES, BASE_MS)
    _set(folder / "this_pr", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    assert check.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{folder}: comparing this_pr/ against baseline/")
    assert "== this_pr - baseline ==" in out and "speedup 1.0135x" in out
    assert out.rstrip().splitlines()[-1].startswith("PASS: a record")
    # the same as naming both sets
    assert check.main([str(folder / "this_pr"), "--baseline", str(folder / "baseline")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == out.rstrip().splitlines()[-1]


def test_check_judges_a_folder_of_several_sets_one_by_one_and_refuses_to_pool_them(tmp_path, capsys):
    folder = tmp_path / "rec"
    _set(folder / "this_pr_v1", [3.2830, 3.2790, 3.2801], BASE_MS[:3], code=CODE + "# v1\n")
    _set(folder / "this_pr_v2", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    _set(folder / "baseline", BASE_LOSSES, BASE_MS)
    assert check.main([str(folder)]) == 2
    captured = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in captured.out.splitlines()[2:]}
    assert rows["this_pr_v1"][-1] == "FAIL" and rows["this_pr_v2"][-1] == "PASS" and rows["baseline"][1] == "6"
    assert captured.err.splitlines() == [
        f"check.py: error: {folder} holds 3 sets of runs (baseline, this_pr_v1, this_pr_v2), not one baseline and "
        f"one candidate: name the set(s) to judge, e.g. python records/check.py {folder / 'this_pr_v1'} "
        f"--baseline {folder / 'baseline'}"]


def test_compare_a_candidate_faster_but_not_significantly_is_not_a_record(tmp_path, capsys):
    base = _set(tmp_path / "baseline", BASE_LOSSES, [80000, 81000, 79500, 80800, 79900, 80300])
    cand = _set(tmp_path / "candidate", CAND_LOSSES, [79800, 80900, 79300, 80600, 79700, 80200], code=CAND_CODE)
    result = check.compare(base, cand)
    assert result.delta_time < 0 and result.ci_time[0] < 0 < result.ci_time[1]
    assert result.candidate.passed and not result.passed and result.exit_code == 1
    assert "but not significantly" in result.verdict
    assert check.main([*map(str, cand), "--baseline", *map(str, base)]) == 1


def test_compare_a_slower_candidate_and_one_that_misses_the_loss_target_are_not_records(tmp_path):
    base = _set(tmp_path / "baseline", BASE_LOSSES, BASE_MS)
    slow = _set(tmp_path / "slow", CAND_LOSSES, [ms + 2000 for ms in BASE_MS], code=CAND_CODE)
    high = _set(tmp_path / "high", [3.2810, 3.2795, 3.2802, 3.2799, 3.2806, 3.2791], CAND_MS, code=CAND_CODE)
    slower = check.compare(base, slow)
    assert not slower.passed and "not faster" in slower.verdict and slower.ci_time[0] > 0
    missed = check.compare(base, high)
    assert not missed.passed and missed.ci_time[1] < 0 and "is not shown" in missed.verdict


def test_compare_refuses_a_baseline_on_another_gpu_count(tmp_path):
    base = _set(tmp_path / "baseline", BASE_LOSSES, BASE_MS, gpus=1)
    cand = _set(tmp_path / "candidate", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    result = check.compare(base, cand)
    assert not result.passed and result.exit_code == 1
    assert "the baseline ran on 1 GPU(s), the candidate on 8" in result.verdict


def test_check_markdown_is_the_public_statistics_md_and_its_snippet_recomputes_it(tmp_path, capsys):
    base = _set(tmp_path / "baseline", BASE_LOSSES, BASE_MS)
    cand = _set(tmp_path / "candidate", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    assert check.main([str(tmp_path / "candidate"), "--baseline", str(tmp_path / "baseline"), "--markdown"]) == 0
    md = capsys.readouterr().out
    result = check.compare(base, cand)
    for heading in ("## Summary", "## Statistics", "Losses:", "Times:", "Calculation snippet:", "## Vs Baseline"):
        assert heading in md
    assert f"| mean val loss | {np.mean(CAND_LOSSES):.10f} |" in md
    assert f"| one-sided p vs 3.28 | {result.candidate.p_loss:.10f} |" in md
    assert f"- speedup: `{result.speedup:.8f}x`" in md
    snippet = md.split("Calculation snippet:\n\n```python\n")[1].split("```")[0]
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"mean loss {np.mean(CAND_LOSSES):.10f}" in proc.stdout
    assert f"speedup {result.speedup:.8f}x" in proc.stdout
    assert f"CI {result.ci_time[0]:.6f} to {result.ci_time[1]:.6f} s" in proc.stdout


# --- plot.py ---------------------------------------------------------------------------------

def test_plot_writes_a_png_with_one_line_per_run_and_per_folder_and_the_target(runs, tmp_path):
    group = tmp_path / "group"
    for i, loss in enumerate([3.27, 3.29]):
        write_log(group / f"g{i}.txt", loss, 150000)
    out = tmp_path / "runs.png"
    fig = plot.plot_runs([runs[0], runs[1], group], out, ymin=3.2, ymax=4.5)
    assert out.stat().st_size > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(out)
    w, h = fig.get_size_inches() * 110
    assert img.shape[:2] == (round(h), round(w))
    assert len(fig.axes) == 2
    for ax in fig.axes:
        run_lines = [line for line in ax.get_lines() if line.get_gid() == plot.RUN_GID]
        assert len(run_lines) == 3
        assert any(list(line.get_ydata()) == [3.28, 3.28] for line in ax.get_lines())
        assert ax.get_yscale() == "log"
        assert ax.get_ylim() == pytest.approx((3.2, 4.5))
        assert len(ax.collections) == 1  # the folder's min-max band
    group_line = [line for line in fig.axes[1].get_lines() if line.get_gid() == plot.RUN_GID][2]
    assert group_line.get_ydata()[-1] == pytest.approx(3.28)  # mean of 3.27 and 3.29
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "target 3.28" in labels and any("mean of 2 runs" in lab for lab in labels)


def test_plot_cli_runs_headless(runs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    out = tmp_path / "cli.png"
    proc = subprocess.run([sys.executable, str(RECORDS / "plot.py"), *map(str, runs), "-o", str(out)],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 10_000 and f"({len(runs)} line(s))" in proc.stdout


def _run_lines(fig):
    return [line for line in fig.axes[0].get_lines() if line.get_gid() == plot.RUN_GID]


def test_plot_fits_the_loss_axis_to_a_small_run_leaving_out_step_0(tmp_path):
    # a smoke-sized run: 4.85 at step 0, then 2.23 ... 1.73, far below the record's 3.2-4.5
    log = write_log(tmp_path / "smoke.txt", 1.73, 95000, steps=150, params=SMOKE_PARAMS)
    fig = plot.plot_runs([log], tmp_path / "smoke.png")
    after_start = _run_lines(fig)[0].get_ydata()[1:]
    lo, hi = fig.axes[0].get_ylim()
    assert lo <= min(after_start) and hi >= max(after_start)  # every point after step 0 is on the axis
    assert 1.6 < lo and hi < 2.5  # and the axis is fitted to them, not to step 0's 10.8
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "target 3.28 (off the axis)" in labels


def test_plot_axis_takes_in_the_target_when_the_runs_end_near_it(tmp_path):
    logs = [write_log(tmp_path / f"r{i}.txt", loss, 160000) for i, loss in enumerate([3.30, 3.31])]
    fig = plot.plot_runs(logs, tmp_path / "near.png")
    lo, hi = fig.axes[0].get_ylim()
    highest = max(max(line.get_ydata()[1:]) for line in _run_lines(fig))  # after step 0
    assert lo < 3.28 and highest <= hi < 4.5


def test_plot_explicit_ymin_and_ymax_win_over_the_fit(tmp_path):
    log = write_log(tmp_path / "smoke.txt", 1.73, 95000, steps=150, params=SMOKE_PARAMS)
    fig = plot.plot_runs([log], ymin=1.0)
    assert fig.axes[0].get_ylim()[0] == pytest.approx(1.0) and fig.axes[0].get_ylim()[1] < 2.5


def test_plot_legend_names_run_id_preset_final_loss_and_date(tmp_path):
    ours = write_log(tmp_path / "logs" / "abc.txt", 3.2771, 163871, env=NVIDIA_SMI)
    public = write_log(tmp_path / "090325_FA3" / "44fc1276-0510-4961-92c0-730c65e5feba.txt", 3.2755, 163621,
                       params=None)
    local = write_log(tmp_path / "logs" / "smoke1.txt", 1.7276, 95000, steps=150, params=SMOKE_PARAMS)
    os.utime(local, (1709208000, 1709208000))  # 2024-02-29 12:00 UTC: a log that names no date
    fig = plot.plot_runs([ours, public, local])
    assert [line.get_label() for line in _run_lines(fig)] == [
        "abc: record, val 3.2771, 2025-09-03",  # date from nvidia-smi's report in the log
        "44fc1276: val 3.2755, 2025-09-03",     # no preset line; date from the record folder's name
        "smoke1: smoke, val 1.7276, 2024-02-29",  # date from the file's modification time
    ]


def test_plot_legend_of_a_folder_gives_the_mean_final_loss_and_its_date(tmp_path):
    group = tmp_path / "2025-09-03_FA3"
    for i, loss in enumerate([3.27, 3.29]):
        write_log(group / f"g{i}.txt", loss, 150000)
    fig = plot.plot_runs([group])
    assert _run_lines(fig)[0].get_label() == "2025-09-03_FA3: record, mean val 3.2800, 2025-09-03 (mean of 2 runs, min-max band)"


def test_plot_cli_with_nothing_to_plot_exits_2_in_one_line_and_writes_no_file(tmp_path):
    bad, out = tmp_path / "bad.txt", tmp_path / "out.png"
    bad.write_text("not a log\n")
    proc = _cli("plot.py", str(bad), "-o", str(out))
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.splitlines() == [f"plot.py: error: nothing to plot ({bad}: no validation lines "
                                        "(no step lines (step:N/T ...) found))"]
    missing = _cli("plot.py", str(tmp_path / "missing.txt"), "-o", str(out))
    assert missing.returncode == 2 and missing.stderr.splitlines() == [
        f"plot.py: error: {tmp_path / 'missing.txt'}: no such file or directory"]


# --- new.py ----------------------------------------------------------------------------------

def test_new_creates_the_folder_with_logs_readme_table_and_plot(runs, tmp_path, capsys):
    recs = tmp_path / "records"
    rc = new.main(["FA3", *map(str, runs), runs[0].as_posix(), "--records-dir", str(recs),
                   "--date", "2025-09-03"])
    assert rc == 0, capsys.readouterr().err
    folder = recs / "2025-09-03_FA3"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["README.md", "statistics.md", "val_loss.png", *[p.name for p in runs]])
    stats_md = (folder / "statistics.md").read_text()
    assert f"| mean val loss | {np.mean(LOSSES):.10f} |" in stats_md and "## Vs Baseline" not in stats_md
    assert "[" + ", ".join(f"{x:.4f}" for x in LOSSES) + "]" in stats_md
    for p in runs:
        assert (folder / p.name).read_bytes() == p.read_bytes()
    readme = (folder / "README.md").read_text()
    assert "WARNING" not in readme
    assert "](val_loss.png)" in readme and (folder / "val_loss.png").stat().st_size > 10_000
    for p, loss in zip(runs, LOSSES):
        assert any(line.startswith(p.name) and f"{loss:.4f}" in line for line in readme.splitlines())
    assert "python records/check.py records/2025-09-03_FA3" in readme
    # the folder checks out by itself, with the same numbers
    assert check.check([folder]).p_loss == pytest.approx(check.check(runs).p_loss)


def test_new_refuses_logs_from_different_code_and_creates_nothing(runs, tmp_path, capsys):
    other = write_log(tmp_path / "other.txt", 3.2760, 163000, code=CODE + "# changed\n")
    recs = tmp_path / "records"
    recs.mkdir()
    assert new.main(["X", *map(str, runs), str(other), "--records-dir", str(recs)]) == 1
    assert "different versions of the code" in capsys.readouterr().err
    assert list(recs.iterdir()) == []


def test_new_refuses_when_p_not_below_001_and_force_writes_a_warning(tmp_path, capsys):
    logs = [write_log(tmp_path / f"r{i}.txt", loss, 160000)
            for i, loss in enumerate([3.2790, 3.2805, 3.2798])]
    recs = tmp_path / "records"
    recs.mkdir()
    args = ["Slow", *map(str, logs), "--records-dir", str(recs), "--date", "2025-01-01"]
    assert new.main(args) == 1
    assert "check.py: FAIL" in capsys.readouterr().err
    assert list(recs.iterdir()) == []
    assert new.main(args + ["--force"]) == 0
    readme = (recs / "2025-01-01_Slow" / "README.md").read_text()
    assert "WARNING: created with --force" in readme and "is not shown" in readme


def test_new_refuses_smoke_runs_with_one_line_on_stderr_and_creates_nothing(tmp_path, capsys):
    smoke = [write_log(tmp_path / f"smoke{i}.txt", loss, 95000, steps=150, params=SMOKE_PARAMS)
             for i, loss in enumerate([1.7276, 1.7301])]
    recs = tmp_path / "records"
    recs.mkdir()
    assert new.main(["Smoke", *map(str, smoke), "--records-dir", str(recs), "--date", "2025-01-01"]) == 1
    captured = capsys.readouterr()
    assert list(recs.iterdir()) == []
    assert "not a record run: preset smoke" in captured.out
    assert captured.err.splitlines() == [
        f"new.py: error: refusing to create {recs / '2025-01-01_Smoke'}: check.py: FAIL: no run counts "
        "(see 'not counted' above) (--force creates it anyway, with the problems in its README.md)"]


def test_new_names_a_missing_log_in_one_line(runs, tmp_path, capsys):
    assert new.main(["X", str(runs[0]), str(tmp_path / "gone.txt"), "--records-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"new.py: error: {tmp_path / 'gone.txt'}: no such file or directory\n"


def test_new_refuses_an_existing_folder_even_with_force(runs, tmp_path, capsys):
    recs = tmp_path / "records"
    (recs / "2025-09-03_FA3").mkdir(parents=True)
    rc = new.main(["FA3", *map(str, runs), "--records-dir", str(recs), "--date", "2025-09-03",
                   "--force"])
    assert rc == 1 and "already exists" in capsys.readouterr().err
    assert list((recs / "2025-09-03_FA3").iterdir()) == []


def test_new_with_a_baseline_writes_both_sets_and_the_public_statistics_md(tmp_path, capsys):
    base = _set(tmp_path / "old", BASE_LOSSES, BASE_MS)
    cand = _set(tmp_path / "new", CAND_LOSSES, CAND_MS, code=CAND_CODE)
    recs = tmp_path / "records"
    rc = new.main(["FP8Down", str(tmp_path / "new"), "--baseline", str(tmp_path / "old"), "--records-dir", str(recs),
                   "--date", "2026-07-17"])
    assert rc == 0, capsys.readouterr().err
    folder = recs / "2026-07-17_FP8Down"
    assert sorted(p.name for p in (folder / "baseline").iterdir()) == sorted(p.name for p in base)
    assert sorted(p.name for p in (folder / "candidate").iterdir()) == sorted(p.name for p in cand)
    result = check.compare(base, cand)
    md = (folder / "statistics.md").read_text()
    assert md.startswith("# FP8Down statistics\n\n## Summary\n")
    assert f"- train time: `{result.delta_time:+.6f} s`" in md and f"- speedup: `{result.speedup:.8f}x`" in md
    assert f"| mean val loss | {np.mean(BASE_LOSSES):.10f} |" in md  # the baseline's table too
    readme = (folder / "README.md").read_text()
    assert "candidate/run0.txt" in readme and "PASS: a record" in readme and "WARNING" not in readme
    # the folder compares itself without flags, to the same verdict
    assert check.main([str(folder)]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == result.verdict


def test_new_refuses_a_candidate_faster_but_not_significantly(tmp_path, capsys):
    _set(tmp_path / "old", BASE_LOSSES, [80000, 81000, 79500, 80800, 79900, 80300])
    _set(tmp_path / "new", CAND_LOSSES, [79800, 80900, 79300, 80600, 79700, 80200], code=CAND_CODE)
    recs = tmp_path / "records"
    recs.mkdir()
    assert new.main(["X", str(tmp_path / "new"), "--baseline", str(tmp_path / "old"), "--records-dir", str(recs)]) == 1
    assert "but not significantly" in capsys.readouterr().err and list(recs.iterdir()) == []


def test_new_refuses_8_gpu_runs_pooled_with_a_1_gpu_run(runs, tmp_path, capsys):
    one_gpu = write_log(tmp_path / "one_gpu.txt", 3.2770, 740000, gpus=1)
    recs = tmp_path / "records"
    recs.mkdir()
    assert new.main(["X", *map(str, runs), str(one_gpu), "--records-dir", str(recs)]) == 1
    assert "differ in GPU count" in capsys.readouterr().err and list(recs.iterdir()) == []


# --- run.sh ----------------------------------------------------------------------------------

def _bin_dir(tmp_path: Path, nvidia_smi: str | None) -> Path:
    """A PATH with only the tools run.sh needs, plus a fake nvidia-smi and a fake torchrun."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "grep", "tr"):
        (bindir / tool).symlink_to(shutil.which(tool))
    if nvidia_smi is not None:
        (bindir / "nvidia-smi").write_text("#!/bin/bash\n" + nvidia_smi)
        (bindir / "nvidia-smi").chmod(0o755)
    (bindir / "torchrun").write_text('#!/bin/bash\necho "torchrun $*"; pwd\n')
    (bindir / "torchrun").chmod(0o755)
    # a fake python3: the GPU count PyTorch sees is $FAKE_TORCH_GPUS (default: all that nvidia-smi lists)
    (bindir / "python3").write_text('#!/bin/bash\ncase "$*" in *device_count*) echo "${FAKE_TORCH_GPUS:-8}";; '
                                    '*no_gpu_reason*) echo "no usable GPU: this PyTorch (2.0+cpu) is a CPU-only build";; '
                                    '*) exit 1;; esac\n')
    (bindir / "python3").chmod(0o755)
    return bindir


def _run_sh(tmp_path, nvidia_smi, **env):
    bindir = _bin_dir(tmp_path, nvidia_smi)
    full_env = {"PATH": str(bindir), "HOME": str(tmp_path), **env}
    return subprocess.run([str(bindir / "bash"), str(ROOT / "run.sh"), "--seed", "1"],
                          capture_output=True, text=True, timeout=30, env=full_env, cwd=tmp_path)


def test_run_sh_without_nvidia_smi_exits_1_with_one_line_naming_the_cpu_command(tmp_path):
    proc = _run_sh(tmp_path, None)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("run.sh: error: no NVIDIA GPU found")
    assert lines[0].endswith("python train_gpt.py --preset smoke")
    assert "torchrun" not in proc.stdout


@pytest.mark.parametrize("fake", ["exit 0\n", "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"])
def test_run_sh_exits_1_naming_the_cpu_command_when_nvidia_smi_lists_no_gpu_or_fails(tmp_path, fake):
    proc = _run_sh(tmp_path, fake)
    assert proc.returncode == 1 and "no NVIDIA GPU found" in proc.stderr
    assert "python train_gpt.py --preset smoke" in proc.stderr


TWO_GPUS = 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"; echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)"\n'


def test_run_sh_names_both_counts_and_suggests_nproc_when_too_few_gpus(tmp_path):
    proc = _run_sh(tmp_path, TWO_GPUS, NPROC="8")
    assert proc.returncode == 1
    assert "NPROC=8 but only 2 NVIDIA GPU(s) found" in proc.stderr
    assert "NPROC=2 ./run.sh" in proc.stderr and len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("seen, expected", [
    ("0", "run.sh: error: no usable GPU: this PyTorch (2.0+cpu) is a CPU-only build (nvidia-smi lists 2 GPU(s))"),
    ("1", "run.sh: error: NPROC=2 but PyTorch sees only 1 GPU(s) of the 2 nvidia-smi lists")])
def test_run_sh_checks_what_pytorch_sees_not_only_nvidia_smi(tmp_path, seen, expected):
    proc = _run_sh(tmp_path, TWO_GPUS, NPROC="2", FAKE_TORCH_GPUS=seen)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [expected] and "torchrun" not in proc.stdout


def test_run_sh_launches_torchrun_from_the_repo_with_nproc_and_arguments(tmp_path):
    proc = _run_sh(tmp_path, TWO_GPUS, NPROC="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "torchrun --standalone --nproc_per_node=2 train_gpt.py --seed 1", str(ROOT)]
