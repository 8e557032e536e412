"""records/logparse.py, the one reader of run logs for records/ and bench/: each kind of line, read only after the
code, in our form and the public code's."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "records"))
import logparse  # noqa: E402

BAR = "=" * 100
# example lines inside the code are never results
CODE = ("print0(f'step:{step}/{N} val_loss:{v:.4f} train_time:{ms:.0f}ms')\n"
        "step:1/9 val_loss:1.0 train_time:1ms\nstep:2/9 train_time:2ms\n"
        "train_loss per step 1-2: 1.0 2.0\nfinished at step 9/9: x\nharness: stage boundaries [(0, 1)]\n")
ENV = "PyTorch 2.11.0+cu130\nCUDA 13.0\n"
PARAMS = "preset: record\nval_tokens: 10485760\nrun_id:\npreset: other\n"
OURS = (CODE + BAR + "\n" + ENV + BAR + "\n" + PARAMS + "attention backend: reference\n"
        "step:0/4 val_loss:10.8258 train_time:0ms step_avg:0.00ms tokens:0\n"
        "step:1/4 train_time:250ms step_avg:250.00ms\n"
        "step:2/4 train_time:500ms step_avg:250.00ms\n"
        "step:2/4 train_loss:7.1000@step2 tokens/s:1,000 mfu:n/a step_ms:250.0 mem:n/a\n"
        "step:2/4 val_loss:7.5000 train_time:500ms step_avg:250.00ms tokens:1,024\n"
        "step:3/4 train_time:750ms step_avg:250.00ms\n"
        "step:4/4 train_time:1000ms step_avg:250.00ms\n"
        "step:4/4 val_loss:nan train_time:1000ms step_avg:250.00ms tokens:2048\n"
        "train_loss per step 1-4: 9.0000 8.0000 7.0000 6.5000\n"
        "finished at step 4/4: training time 1.0s (250.0 ms/step)\n")
PUBLIC = (CODE + BAR + "\n" + ENV + BAR + "\n"
          "harness: stage boundaries [(0, 2), (2, 4)]\n"
          "step:0/4 val_loss:10.8258 train_time:0ms step_avg:0.04ms\n"
          "step:1/4 train_time:300ms step_avg:300.00ms\n"
          "step:4/4 val_loss:4.4530 train_time:1400ms step_avg:350.00ms\n")


def test_the_code_is_what_precedes_the_first_line_of_exactly_100_equals():
    assert logparse.split_code(OURS) == (CODE, OURS[len(CODE) + 101:])
    assert logparse.split_code("=" * 101 + "\nstep:1/1\n") == (None, "=" * 101 + "\nstep:1/1\n")
    assert logparse.split_code("code\r\n" + BAR + "\r\nrest\r\n") == ("code\r\n", "rest\r\n")
    assert logparse.run_lines("step:1/2 train_time:3ms\n") == ["step:1/2 train_time:3ms"]  # no code section


def test_the_header_gives_the_environment_report_and_the_first_value_of_each_hyperparameter():
    params, env = logparse.header(logparse.split_code(OURS)[1])
    assert env == ENV.splitlines()
    assert params == {"preset": "record", "val_tokens": "10485760", "run_id": ""}  # stops at the run's first line
    assert logparse.header(logparse.split_code(CODE + BAR + "\n" + ENV)[1]) == ({}, [])  # no second separator


@pytest.mark.parametrize("line, fields", [
    ("step:2/4 val_loss:7.5000 train_time:500ms step_avg:250.00ms tokens:1,024", (2, 4, "7.5000", 500.0, 1024)),
    ("step:0/1670 val_loss:10.8258 train_time:0ms step_avg:0.04ms", (0, 1670, "10.8258", 0.0, None)),  # public
    ("step:3/4 train_time:750ms step_avg:250.00ms", (3, 4, None, 750.0, None)),
    ("step:2/4 train_loss:7.1000@step2 tokens/s:1,000 mfu:n/a step_ms:250.0", (2, 4, None, None, None)),
    ("  step:5/9 train_loss:3.1 train_time:12.5ms val_loss:x", (5, 9, "x", 12.5, None)),  # fields in any order
    ("step:7/7", (7, 7, None, None, None)),
])
def test_a_step_line_gives_its_fields_wherever_they_stand(line, fields):
    s = logparse.step_line(line)
    assert (s.step, s.total, s.val_loss, s.time_ms, s.tokens) == fields


@pytest.mark.parametrize("line", ["step:7/7x", "steps:1/2 val_loss:3", "# step:1/2 val_loss:3", "step:a/2"])
def test_other_lines_are_no_step_lines(line):
    assert logparse.step_line(line) is None


def test_validations_come_with_time_and_tokens_and_only_after_the_code():
    val = logparse.val_losses(OURS)
    assert list(val) == [0, 2, 4] and val[0] == (10.8258, 0, 0) and val[2] == (7.5, 500, 1024)
    assert math.isnan(val[4][0]) and val[4][1:] == (1000, 2048)
    assert logparse.val_losses(PUBLIC) == {0: (10.8258, 0, None), 4: (4.453, 1400, None)}  # no tokens: None
    assert logparse.val_losses(BAR + "\nstep:1/2 val_loss:3.0\nstep:2/2 val_loss:?? train_time:1ms\n") == {}


def test_step_times_are_the_training_steps_lines_not_the_validations():
    assert logparse.step_times(OURS) == {1: 250, 2: 500, 3: 750, 4: 1000}
    assert logparse.step_times(PUBLIC) == {1: 300}


def test_the_train_curve_is_the_finished_run_s_line():
    assert logparse.train_curve(OURS) == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.5}
    assert logparse.train_curve(PUBLIC) is None  # the public code writes none (and the code's example is no curve)


def test_closing_lines_and_stage_boundaries_are_read_after_the_code():
    assert logparse.closing_steps(OURS) == [(4, 4)] and logparse.closing_steps(PUBLIC) == []
    assert logparse.stage_boundaries(PUBLIC) == [(0, 2), (2, 4)] and logparse.stage_boundaries(OURS) is None
