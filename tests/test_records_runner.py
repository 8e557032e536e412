"""Tests of the record runners (records/interleave.py, calibrate.py and their runner.py).

No training runs here: the launch command is a small Python script written by the test (FAKE
below) that takes the trainer's flags and writes a log in the trainer's format, as the synthetic
logs of tests/test_records.py do: code, a line of 100 '=', versions, another line of 100 '=',
hyperparameters, step lines with validation lines, the final validation, and the closing
`finished at step T/T: ...` line. Its final loss and time come from flags the test gives each
version (--fake_loss, --fake_ms, ...), varied per seed by a fixed pattern; FAKE_ORDER names a file
it appends its run id to, FAKE_CRASH run ids it stops half-way (a partial log, exit 1), FAKE_SLOW run
ids that stop half-way and wait there for SIGTERM.
"""
from __future__ import annotations

import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"
sys.path.insert(0, str(RECORDS))

import calibrate  # noqa: E402
import check  # noqa: E402
import interleave  # noqa: E402
import runner  # noqa: E402

PATTERN = [0.0, 1.0, -1.0, 0.5, -0.5, 0.25, -0.25]  # the fake's per-seed variation, seed % 7

FAKE = r'''
import math, os, sys

script, rest = sys.argv[1], sys.argv[2:]
flags = {}
for name, value in zip(rest[::2], rest[1::2]):
    assert name.startswith("--"), rest
    flags[name[2:]] = value
run_id, seed, steps = flags["run_id"], int(flags["seed"]), int(flags.get("num_iterations", 20))
vary = PATTERN[seed % len(PATTERN)]
loss = (float(flags.get("fake_loss", 3.27)) + float(flags.get("fake_slope", 0.0)) * math.log(steps)
        + float(flags.get("fake_loss_jitter", 0.002)) * vary)
ms = round(float(flags.get("fake_ms", 80000)) + float(flags.get("fake_jitter_ms", 100)) * vary)
crash = run_id in os.environ.get("FAKE_CRASH", "").split(",")
slow = run_id in os.environ.get("FAKE_SLOW", "").split(",")  # runs until SIGTERM, after half its steps
crash = crash or slow
params = {"val_files": "data/fineweb10B/fineweb_val_*.bin", "val_tokens": "10485760", "val_seq_len": "262144",
          "vocab_size": "50304", "preset": flags.get("preset", "record"), "markov_corpus": "False",
          "num_iterations": steps, "seed": seed, "run_id": run_id, **flags}
lines = [open(script).read().rstrip("\n"), "=" * 100, "Python 3.12.3", "PyTorch 2.13.0", "=" * 100]
lines += [f"{k}: {v}" for k, v in params.items()]
lines += ["device: cuda:0 x 8, grad accumulation 1, parameters: 123,456",
          f"step:0/{steps} val_loss:10.8258 train_time:0ms step_avg:0.02ms"]
for s in range(1, (steps // 2 if crash else steps) + 1):
    t = round(ms * s / steps)
    lines.append(f"step:{s}/{steps} train_time:{t}ms step_avg:{t / s:.2f}ms")
    if s % 10 == 0 and s < steps:
        lines.append(f"step:{s}/{steps} val_loss:{loss + 0.5 * (steps - s) / steps:.4f} train_time:{t}ms")
if not crash:
    lines += [f"step:{steps}/{steps} val_loss:{loss:.4f} train_time:{ms}ms step_avg:{ms / steps:.2f}ms",
              "peak memory allocated: 34217 MiB reserved: 49936 MiB",
              f"finished at step {steps}/{steps}: training time {ms / 1000:.1f}s, val_loss {loss:.4f}",
              f"train_loss per step 1-{steps}: " + " ".join(["4.0000"] * steps)]
os.makedirs(flags["log_dir"], exist_ok=True)
with open(os.path.join(flags["log_dir"], run_id + ".txt"), "a") as f:  # the trainer appends too
    f.write("\n".join(lines) + "\n")
if slow:
    import signal, time
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(128 + 15))
if os.environ.get("FAKE_ORDER"):
    with open(os.environ["FAKE_ORDER"], "a") as f:
        f.write(run_id + "\n")
if slow:
    time.sleep(30)
print("fake trainer", run_id, "crashed" if crash else "done")
sys.exit(1 if crash else 0)
'''.replace("PATTERN", repr(PATTERN))

SEP = "=" * 100


@pytest.fixture
def fake(tmp_path: Path) -> str:
    """The --launch of the fake trainer."""
    path = tmp_path / "fake_trainer.py"
    path.write_text(FAKE)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(path))}"


@pytest.fixture
def order(tmp_path: Path, monkeypatch) -> Path:
    """The file the fake appends each run id to, in the order they ran."""
    path = tmp_path / "order.txt"
    monkeypatch.setenv("FAKE_ORDER", str(path))
    monkeypatch.delenv("FAKE_CRASH", raising=False)
    return path


def checkout(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train_gpt.py").write_text(text)
    return path


def ran(order: Path) -> list[str]:
    return order.read_text().split() if order.exists() else []


def interleave_args(tmp_path: Path, out: Path, fake: str, pairs: int, baseline: str, candidate: str,
                    *extra: str) -> list[str]:
    base = checkout(tmp_path / "base", "print('baseline trainer')\n")
    cand = checkout(tmp_path / "cand", "print('candidate trainer')\n")
    return [str(out), "--pairs", str(pairs), "--baseline_dir", str(base), "--candidate_dir", str(cand),
            "--baseline_flags", baseline, "--candidate_flags", candidate, "--launch", fake, *extra]


FAST = "--fake_ms 70000"      # 10 s faster than the baseline's 80 s, times within +-100 ms: a record
SLOWER = "--fake_ms 80000"


# --- interleave.py -------------------------------------------------------------------------------

def test_interleave_runs_baseline_and_candidate_A_B_B_A_and_collects_their_logs(tmp_path, fake, order, capsys):
    out = tmp_path / "ab"
    code = interleave.main(interleave_args(tmp_path, out, fake, 3, SLOWER, FAST, "--", "--train_files", "x_*.bin"))
    assert code == 0
    ids = [f"ab-{side}-{i:02d}" for i, side in
           [(1, "baseline"), (1, "candidate"), (2, "candidate"), (2, "baseline"), (3, "baseline"), (3, "candidate")]]
    assert ran(order) == ids
    for side in ("baseline", "candidate"):
        assert sorted(p.name for p in (out / side).iterdir()) == [f"ab-{side}-{i:02d}.txt" for i in (1, 2, 3)]
        for i in (1, 2, 3):
            log = check.parse_log(out / side / f"ab-{side}-{i:02d}.txt")
            assert log.ok and log.params["seed"] == str(i - 1)  # pair i's seed, the same for both versions
            assert log.params["train_files"] == "x_*.bin"       # the shared flags reach both
            assert log.params["fake_ms"] == ("80000" if side == "baseline" else "70000")
            assert log.code.startswith(f"print('{side}")         # each ran its own checkout
    text = capsys.readouterr().out
    assert text.count(" started: ") == 6 and text.count(" finished in ") == 6
    assert "PASS: a record" in text and "next: python records/new.py" in text


def test_interleave_returns_the_comparisons_exit_status(tmp_path, fake, order, capsys):
    out = tmp_path / "ab"
    assert interleave.main(interleave_args(tmp_path, out, fake, 2, FAST, SLOWER)) == 1  # slower: not a record
    text = capsys.readouterr().out
    assert "FAIL: not a record" in text and "not faster" in text
    assert check.main([str(out)]) == 1  # what check.py says of the folder on its own


def test_interleave_reports_a_faster_candidate_that_is_not_significantly_faster_as_no_record(tmp_path, fake, order,
                                                                                            capsys):
    out = tmp_path / "ab"
    noisy = "--fake_jitter_ms 3000"
    code = interleave.main(interleave_args(tmp_path, out, fake, 3, f"{SLOWER} {noisy}", f"--fake_ms 79500 {noisy}"))
    text = capsys.readouterr().out
    assert code == 1
    assert "faster by 0.500 s but not significantly" in text
    assert text.rstrip().splitlines()[-1].startswith("FAIL: not a record")


def test_interleave_exits_2_when_check_py_does_not_count_the_runs_and_any_config_compares_them(
        tmp_path, fake, order, capsys):
    smoke = ["--", "--preset", "smoke"]
    assert interleave.main(interleave_args(tmp_path, tmp_path / "a", fake, 3, SLOWER, FAST, *smoke)) == 2
    assert "not a record run: preset smoke" in capsys.readouterr().out
    assert interleave.main(interleave_args(tmp_path, tmp_path / "b", fake, 3, SLOWER, FAST, "--any_config",
                                           *smoke)) == 0
    text = capsys.readouterr().out
    assert "--any_config: runs of any configuration are compared" in text and "next:" not in text
    assert check.main([str(tmp_path / "b")]) == 2  # check.py itself is unchanged by --any_config


def test_interleave_resumes_skipping_complete_runs_and_rerunning_a_partial_one_moved_aside(
        tmp_path, fake, order, monkeypatch, capsys):
    out = tmp_path / "ab"
    args = interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)
    monkeypatch.setenv("FAKE_CRASH", "ab-candidate-02")
    assert interleave.main(args) == runner.FAILED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("interleave.py: error: run 3/6, pair 2 candidate")
    partial = out / "candidate" / "ab-candidate-02.txt"
    assert f"its log {partial} is partial (truncated" in err and str(out / "console" / "ab-candidate-02.out") in err
    assert "run the same command again" in err
    assert ran(order) == ["ab-baseline-01", "ab-candidate-01", "ab-candidate-02"]
    partial_bytes = partial.read_bytes()
    first = {p: p.read_bytes() for p in [out / "baseline" / "ab-baseline-01.txt",
                                         out / "candidate" / "ab-candidate-01.txt"]}

    monkeypatch.delenv("FAKE_CRASH")
    assert interleave.main(args) == 0
    text = capsys.readouterr().out
    # the two complete runs are not run again; the partial one runs under a new id, then the last
    assert ran(order)[3:] == ["ab-candidate-02-try2", "ab-baseline-02", "ab-baseline-03", "ab-candidate-03"]
    assert text.count("done before") == 2 and text.count(" started: ") == 4
    assert all(p.read_bytes() == b for p, b in first.items())
    aside = out / "partial" / "ab-candidate-02.txt.partial"
    assert aside.read_bytes() == partial_bytes and f"moved the partial log {partial} to {aside}" in text
    assert sorted(p.name for p in (out / "candidate").iterdir()) == ["ab-candidate-01.txt", "ab-candidate-02-try2.txt",
                                                                    "ab-candidate-03.txt"]
    for side in ("baseline", "candidate"):  # every log holds one run: nothing appended to a partial one
        for p in (out / side).iterdir():
            assert p.read_text().count(SEP) == 2 and check.parse_log(p).ok

    assert interleave.main(args) == 0  # all done: nothing runs, the comparison again
    assert len(ran(order)) == 7 and capsys.readouterr().out.count("done before") == 6


@pytest.mark.parametrize("how", ["SIGTERM to the runner", "Ctrl-C in the terminal"])
def test_a_stopped_run_stops_the_runner_and_the_same_command_runs_it_again(tmp_path, fake, order, how):
    out = tmp_path / "ab"
    args = [sys.executable, str(RECORDS / "interleave.py"), *interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)]
    env = {k: v for k, v in os.environ.items() if k != "SPEEDRUN_DEBUG"}
    # Ctrl-C as a terminal delivers it, also where this test itself runs as a background job (whose SIGINT a
    # shell ignores, and children inherit that): the runner starts with SIGINT's default action
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**env, "FAKE_SLOW": "ab-candidate-01"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 20
    while "ab-candidate-01" not in ran(order) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    if how == "SIGTERM to the runner":
        proc.send_signal(signal.SIGTERM)  # the runner alone: it passes it on to the run
    else:
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C reaches the runner and the run
    stdout, stderr = proc.communicate(timeout=20)
    partial = out / "candidate" / "ab-candidate-01.txt"
    assert proc.returncode == (128 + 15 if how.startswith("SIGTERM") else 130), stdout + stderr
    assert f"run 2/6 stopped by {how.split()[0]} after" in stdout
    assert f"its log {partial} is partial (truncated" in stdout and "started: pair 2" not in stdout
    assert interleave.main(interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)) == 0
    assert ran(order)[2] == "ab-candidate-01-try2" and (out / "partial" / "ab-candidate-01.txt.partial").is_file()


def test_interleave_pairs_may_grow_on_a_resume(tmp_path, fake, order):
    out = tmp_path / "ab"
    assert interleave.main(interleave_args(tmp_path, out, fake, 2, SLOWER, FAST)) == 1  # 2 runs each: p > 0.01
    assert interleave.main(interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)) == 0
    assert ran(order)[4:] == ["ab-baseline-03", "ab-candidate-03"]  # pair 3: A then B, as pair 1


def test_interleave_dry_run_prints_the_commands_in_order_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "ab"
    base = checkout(tmp_path / "base", "print('baseline trainer')\n")
    code = interleave.main([str(out), "--pairs", "2", "--baseline_dir", str(base), "--nproc_per_node", "2",
                            "--first_seed", "5", "--dry_run", "--", "--val_every", "0"])
    assert code == 0 and not out.exists()
    lines = capsys.readouterr().out.splitlines()
    commands = [shlex.split(line) for line in lines if line.startswith("cd ")]
    assert [c[1] for c in commands] == [str(base), str(ROOT), str(ROOT), str(base)]  # A B B A
    for c, seed in zip(commands, [5, 5, 6, 6]):
        assert c[3:7] == ["torchrun", "--standalone", "--nproc_per_node=2", "train_gpt.py"]
        assert c[7:11] == ["--val_every", "0", "--seed", str(seed)]
    assert [c[c.index("--run_id") + 1] for c in commands] == ["ab-baseline-01", "ab-candidate-01",
                                                               "ab-candidate-02", "ab-baseline-02"]
    assert commands[0][commands[0].index("--log_dir") + 1] == str(out.resolve() / "baseline")
    assert lines[-1].endswith(f"check.py {out} --target 3.28")


@pytest.mark.parametrize("extra, needle", [
    (["--", "--seed", "3"], "the flags after --: --seed is set by interleave.py"),
    (["--", "--run_id=x"], "the flags after --: --run_id is set by interleave.py"),
    (["--pairs", "0"], "--pairs 0: give 1 or more"),
    (["--script", "nothing.py"], "base/nothing.py: no such file: --baseline_dir must be a checkout"),
    (["--candidate_flags", ""], "the baseline and the candidate are the same checkout with the same flags"),
    (["--nproc_per_node", "2"], "--nproc_per_node is used by the default torchrun launch or by {nproc}"),
])
def test_interleave_usage_errors_are_one_line_naming_the_fix_and_run_nothing(tmp_path, fake, order, capsys,
                                                                               extra, needle):
    base = checkout(tmp_path / "base", "print('trainer')\n")
    args = [str(tmp_path / "ab"), "--pairs", "2", "--baseline_dir", str(base), "--candidate_dir", str(base),
            "--candidate_flags", "--fake_ms 1", "--launch", fake]
    if "--" in extra:
        args += extra
    else:
        args[args.index("--launch"):args.index("--launch")] = extra
    assert interleave.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("interleave.py: error: ") and needle in err
    assert not ran(order) and not (tmp_path / "ab").exists()


def test_interleave_refuses_a_resume_with_other_flags(tmp_path, fake, order, capsys):
    out = tmp_path / "ab"
    assert interleave.main(interleave_args(tmp_path, out, fake, 1, SLOWER, FAST)) == 1  # 1 pair: no p-value
    capsys.readouterr()
    assert interleave.main(interleave_args(tmp_path, out, fake, 2, SLOWER, "--fake_ms 60000")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"interleave.py: error: {out / 'interleave.json'}: the runs in {out} were made with other "
                          "settings (candidate: ")
    assert "rerun with the same settings, or give a new folder" in err
    assert len(ran(order)) == 2


def test_interleave_refuses_a_log_that_is_not_a_run_of_its_plan(tmp_path, fake, order, capsys):
    out = tmp_path / "ab"
    assert interleave.main(interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)) == 0
    stray = out / "candidate" / "other.txt"
    stray.write_text((out / "candidate" / "ab-candidate-01.txt").read_text())
    capsys.readouterr()
    assert interleave.main(interleave_args(tmp_path, out, fake, 3, SLOWER, FAST)) == 2
    err = capsys.readouterr().err
    assert f"{stray}: not a run of this plan" in err and f"move it out of {out / 'candidate'}" in err
    stray.unlink()
    assert interleave.main(interleave_args(tmp_path, out, fake, 2, SLOWER, FAST)) == 2  # fewer pairs than ran
    assert "ab-baseline-03.txt: not a run of this plan (--pairs 2" in capsys.readouterr().err


def test_interleave_refuses_a_folder_it_did_not_make(tmp_path, fake, order, capsys):
    out = tmp_path / "ab"
    (out / "baseline").mkdir(parents=True)
    (out / "baseline" / "old.txt").write_text("x\n")
    assert interleave.main(interleave_args(tmp_path, out, fake, 2, SLOWER, FAST)) == 2
    assert f"{out}: exists and has no interleave.json" in capsys.readouterr().err and not ran(order)


@pytest.mark.parametrize("tool", ["interleave.py", "calibrate.py"])
def test_help_describes_the_options(tool):
    proc = subprocess.run([sys.executable, str(RECORDS / tool), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for option in ("--dry_run", "--nproc_per_node", "--launch", "--target", "Resumable", "examples:"):
        assert option in proc.stdout
    assert ("A B B A" in proc.stdout) if tool == "interleave.py" else ("ln(steps)" in proc.stdout)


def test_a_failed_launch_is_one_line_on_stderr_from_the_command_line(tmp_path):
    base = checkout(tmp_path / "base", "print('trainer')\n")
    env = {k: v for k, v in os.environ.items() if k != "SPEEDRUN_DEBUG"}
    proc = subprocess.run([sys.executable, str(RECORDS / "interleave.py"), str(tmp_path / "ab"), "--pairs", "1",
                           "--baseline_dir", str(base), "--candidate_flags", "--x 1", "--launch", "no-such-launcher"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert proc.stderr == ("interleave.py: error: no-such-launcher: command not found: install PyTorch "
                           "(pip install -r requirements.txt) for torchrun, or give --launch\n")
    assert proc.stdout == "" and not (tmp_path / "ab").exists()  # refused before anything is made


# --- runner.py -----------------------------------------------------------------------------------

def write_trainer_log(path: Path, steps: int = 20, last: int | None = None, closing: str | None = "finished") -> Path:
    last = steps if last is None else last
    lines = ["print('trainer')", SEP, "PyTorch 2.13.0", SEP, "seed: 0",
             *[f"step:{s}/{steps} train_time:{s * 100}ms" for s in range(1, last + 1)]]
    if last == steps:
        lines.append(f"step:{steps}/{steps} val_loss:3.2700 train_time:{steps * 100}ms")
    if closing:
        lines.append(f"{closing} at step {last}/{steps}: training time 2.0s")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_log_is_complete_only_with_the_final_validation_and_the_trainers_closing_line(tmp_path):
    assert runner.read_log(write_trainer_log(tmp_path / "done.txt")).ok
    cases = {"noclose.txt": dict(closing=None), "stopped.txt": dict(last=12, closing="stopped"),
             "cut.txt": dict(last=12, closing=None)}
    for name, kw in cases.items():
        log = runner.read_log(write_trainer_log(tmp_path / name, **kw))
        assert not log.ok, name
    assert "no closing line 'finished at step 20/20" in runner.read_log(tmp_path / "noclose.txt").error
    assert "truncated" in runner.read_log(tmp_path / "stopped.txt").error


def test_visible_gpus_counts_nvidia_smi_and_cuda_visible_devices(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n"
                                           for i in range(4)))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runner.visible_gpus() == 4
    assert runner.launch_prefix(None, None) == ["torchrun", "--standalone", "--nproc_per_node=4"]
    assert runner.launch_prefix("mpirun -n {nproc} python", None) == ["mpirun", "-n", "4", "python"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert runner.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(check.UsageError, match="no NVIDIA GPU visible .* give --nproc_per_node N"):
        runner.launch_prefix(None, None)
    assert runner.launch_prefix("python", None) == ["python"]  # no {nproc}: no GPU count needed


# --- calibrate.py: the numbers ------------------------------------------------------------------

LOW, HIGH = [3.30, 3.31, 3.29, 3.30], [3.27, 3.28, 3.26, 3.27]  # at 1000 and 2000 steps


def test_step_stats_p_value_equals_the_closed_form_t_distribution_with_3_degrees_of_freedom():
    s1000, s2000 = calibrate.step_stats({2000: HIGH, 1000: LOW}, target=3.28)
    # each set: deviations 0, +-0.01, 0 -> sample variance 2e-4 / 3; at 2000 steps the mean 3.27 gives
    # t = -0.01 / (s / 2) = -sqrt(6); with 3 degrees of freedom P(T < t) = 1/2 + (u / (1 + u^2) + atan(u)) / pi,
    # u = t / sqrt(3) = -sqrt(2)
    assert (s1000.steps, s1000.n, s2000.steps) == (1000, 4, 2000)
    assert s2000.mean == pytest.approx(3.27) and s2000.std == pytest.approx(math.sqrt(2e-4 / 3))
    assert s2000.p == pytest.approx(0.5 - (math.sqrt(2) / 3 + math.atan(math.sqrt(2))) / math.pi, rel=1e-9)
    u = 2 * math.sqrt(2)  # at 1000 steps: t = +0.02 / (s / 2) = 2 sqrt(6)
    assert s1000.p == pytest.approx(0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi, rel=1e-9)
    assert s2000.p == pytest.approx(0.0458606, abs=1e-7)


def test_fit_predicts_the_step_count_computed_by_hand():
    fit = calibrate.fit_ladder({1000: LOW, 2000: HIGH}, target=3.28, runs=4)
    # the line through the two means (equal runs): 3.30 at 1000 steps, 3.27 at 2000: b = -0.03 / ln 2
    assert fit.b == pytest.approx(-0.03 / math.log(2)) and fit.mean_at(1000) == pytest.approx(3.30)
    assert fit.sigma == pytest.approx(math.sqrt(2e-4 / 3)) and fit.df == 6
    t = 4.540703  # Student's t, 3 degrees of freedom, 99% (a t table's 4.541)
    assert fit.t_crit == pytest.approx(t, abs=1e-6)
    need = 3.28 - t * math.sqrt(2e-4 / 3) / 2  # 3.261463
    assert fit.loss_pass == pytest.approx(need, abs=1e-6)
    # 3.30 - 0.03 log2(S / 1000) = need  ->  S = 1000 * 2 ** ((3.30 - need) / 0.03) = 2436.1
    assert fit.steps_pass == math.ceil(1000 * 2 ** ((3.30 - need) / 0.03)) == 2437
    assert fit.mean_at(2437) <= fit.loss_pass < fit.mean_at(2436)
    assert fit.steps_power > fit.steps_pass and fit.loss_power < fit.loss_pass
    assert any("outside the ladder (1000 to 2000 steps)" in n for n in fit.notes)


def test_fit_pools_the_std_over_step_counts_weighted_by_their_runs():
    data = {100: [3.5, 3.6, 3.4], 200: [3.30, 3.32], 400: [3.2]}
    fit = calibrate.fit_ladder(data, target=3.28, runs=10)
    assert fit.df == 3  # 2 + 1 + 0
    assert fit.sigma == pytest.approx(math.sqrt((2 * 0.01 + 1 * 0.0002) / 3))
    x = [math.log(s) for s, ys in data.items() for _ in ys]
    y = [v for ys in data.values() for v in ys]
    assert fit.b == pytest.approx(np.polyfit(x, y, 1)[0]) and fit.a == pytest.approx(np.polyfit(x, y, 1)[1])
    assert fit.t_crit == pytest.approx(stats.t.ppf(0.99, 9))


def test_the_predicted_mean_losses_pass_as_often_as_stated_in_simulation():
    fit = calibrate.fit_ladder({1000: LOW, 2000: HIGH}, target=3.28, runs=4)
    rng = np.random.default_rng(0)
    for mean, chance in ((fit.loss_pass, fit.chance_pass), (fit.loss_power, calibrate.POWER)):
        sets = rng.normal(mean, fit.sigma, size=(40000, 4))
        t = (sets.mean(1) - 3.28) / (sets.std(1, ddof=1) / 2)
        assert np.mean(t < -fit.t_crit) == pytest.approx(chance, abs=0.01)
    assert fit.chance_pass == pytest.approx(0.59, abs=0.005)  # "a little more than half", as the help says


def test_fit_gives_no_prediction_without_two_step_counts_or_when_the_loss_does_not_fall():
    assert calibrate.fit_ladder({1000: LOW}, 3.28, runs=4) == "a fit needs runs at 2 or more step counts"
    assert "pooled std needs 2 or more runs" in calibrate.fit_ladder({1000: [3.3], 2000: [3.2]}, 3.28, runs=4)
    rising = calibrate.fit_ladder({1000: HIGH, 2000: LOW}, 3.28, runs=4)
    assert rising.steps_pass is None and "does not fall with steps" in rising.notes[0]


# --- calibrate.py: the command -------------------------------------------------------------------

LADDER = "--fake_loss 3.75 --fake_slope -0.07 --fake_loss_jitter 0.004"  # mean 3.75 - 0.07 ln(steps)


def calibrate_args(tmp_path: Path, out: Path, fake: str, *extra: str) -> list[str]:
    folder = checkout(tmp_path / "co", "print('trainer')\n")
    return [str(out), "--steps", "500,1000", "--seeds", "3", "--dir", str(folder), "--launch", fake, *extra,
            "--", *shlex.split(LADDER)]


def test_calibrate_runs_seed_by_seed_over_the_ladder_and_writes_the_report(tmp_path, fake, order, capsys):
    out = tmp_path / "cal"
    assert calibrate.main(calibrate_args(tmp_path, out, fake)) == 0
    assert ran(order) == [f"cal-steps{s}-seed{seed}" for seed in range(3) for s in (500, 1000)]
    losses = {s: [round(3.75 - 0.07 * math.log(s) + 0.004 * PATTERN[seed], 4) for seed in range(3)]
              for s in (500, 1000)}
    md = (out / "calibration.md").read_text()
    assert md in capsys.readouterr().out
    for s, ys in losses.items():
        p = stats.ttest_1samp(ys, 3.28, alternative="less").pvalue
        row = f"| {s} | 3 | {statistics.mean(ys):.4f} | {statistics.stdev(ys):.4f} | {check._fmt_p(p)} |"
        assert row in md
    fit = calibrate.fit_ladder(losses, 3.28, runs=3)
    assert f"**{fit.steps_pass} steps** for p < 0.01 with 3 runs" in md
    assert f"**{fit.steps_power} steps** for a 90% chance" in md
    assert "Assumed: the mean loss is linear in ln(steps)" in md and "not of the record's configuration" not in md
    assert md.count("steps_500/cal-steps500-seed") == 3


def test_calibrate_resumes_rerunning_only_the_partial_run(tmp_path, fake, order, monkeypatch, capsys):
    out = tmp_path / "cal"
    args = calibrate_args(tmp_path, out, fake)
    monkeypatch.setenv("FAKE_CRASH", "cal-steps1000-seed1")
    assert calibrate.main(args) == runner.FAILED
    assert "calibrate.py: error: run 4/6, 1000 steps, seed 1, failed (exit 1)" in capsys.readouterr().err
    assert not (out / "calibration.md").exists()
    monkeypatch.delenv("FAKE_CRASH")
    assert calibrate.main(args) == 0
    assert ran(order)[4:] == ["cal-steps1000-seed1-try2", "cal-steps500-seed2", "cal-steps1000-seed2"]
    assert capsys.readouterr().out.count("done before") == 3
    assert (out / "partial" / "cal-steps1000-seed1.txt.partial").is_file()
    assert "| 1000 | 3 |" in (out / "calibration.md").read_text()
    # more seeds later: only the new ones run
    assert calibrate.main([*args[:4], "4", *args[5:]]) == 0
    assert ran(order)[7:] == ["cal-steps500-seed3", "cal-steps1000-seed3"]
    assert "| 1000 | 4 |" in (out / "calibration.md").read_text()


def test_calibrate_dry_run_prints_the_commands_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "cal"
    assert calibrate.main([str(out), "--steps", "100", "200", "--seeds", "2", "--launch", "python", "--dry_run",
                           "--", "--preset", "smoke"]) == 0
    assert not out.exists()
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines() if line.startswith("cd ")]
    assert [c[3:] for c in commands] == [
        ["python", "train_gpt.py", "--preset", "smoke", "--num_iterations", str(s), "--seed", str(seed),
         "--run_id", f"cal-steps{s}-seed{seed}", "--log_dir", str(out.resolve() / f"steps_{s}")]
        for seed in (0, 1) for s in (100, 200)]


def test_calibrate_says_when_the_runs_are_not_of_the_record_configuration(tmp_path, fake, order):
    out = tmp_path / "cal"
    assert calibrate.main([*calibrate_args(tmp_path, out, fake), "--preset", "smoke"]) == 0
    assert "not of the record's configuration (preset smoke, not record)" in \
        (out / "calibration.md").read_text()


@pytest.mark.parametrize("extra, needle", [
    (["--", "--num_iterations", "5"], "the flags after --: --num_iterations is set by calibrate.py"),
    (["--seeds", "1"], "--plan_runs 1: a p-value needs 2 or more runs"),
    (["--steps", "0"], "argument --steps: expected positive step counts"),
])
def test_calibrate_usage_errors_are_one_line(tmp_path, fake, order, capsys, extra, needle):
    args = [str(tmp_path / "cal"), "--steps", "10", "20", "--seeds", "2", "--dir", str(checkout(tmp_path / "co", "")),
            "--launch", fake]
    if extra[0] == "--":
        args += extra
    else:
        args[args.index("--launch"):args.index("--launch")] = extra
    assert calibrate.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("calibrate.py: error: ") and needle in err and len(err.strip().splitlines()) == 1
    assert not ran(order) and not (tmp_path / "cal").exists()
