"""`train_gpt.py --plan`: the resolved schedule and its projected training time, printed on the CPU
before any GPU work."""
import re

import pytest
import torch

import train_gpt as tg

RECORD_SHAPES = [(49152, 896, 3), (49152, 2048, 7), (49152, 2048, 11), (49152, 2048, 13)]  # record's stages, extension


def stage_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"\s+(\d+|ext)\s+\d+-\d+\s", line)}


@pytest.fixture
def no_gpu(monkeypatch):
    """Any question to CUDA fails the test: --plan must not touch a GPU."""
    def refuse(*_, **__):
        raise AssertionError("--plan asked CUDA")
    for name in ("is_available", "device_count", "get_device_name", "get_device_capability", "set_device"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_plan_prints_the_record_schedule_and_exits_without_a_gpu_or_a_log(no_gpu, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert tg.main(["--plan"]) == 0
    out = capsys.readouterr().out
    rows = stage_rows(out)
    assert list(rows) == ["1", "2", "3", "ext"]
    # steps, batch, micro-batches on 1 / 8 GPUs, micro tokens, document cut, windows, lr, tokens
    assert rows["1"][1:11] == ["0-252", "393,216", "8", "/", "1", "49,152", "896", "384/128", "1", "99,483,648"]
    assert rows["3"][1] == "505-755" and rows["3"][8] == "1408/640"
    assert rows["ext"][1] == "756-775" and rows["ext"][8] == "1664/768"  # step 776 is the final validation only
    assert f"trained tokens: {776 * 393216:,}" in out
    assert 776 * 393216 <= 338_800_000  # the record's budget: at most public record #89's 338.8M tokens
    assert not list(tmp_path.iterdir())  # no log, no checkpoint folder


def test_plan_projects_each_measured_stage_and_the_total_from_the_table(no_gpu, capsys, monkeypatch):
    table = {("H100", "record", *shape): us for shape, us in zip(RECORD_SHAPES, (2.0, 2.5, 3.0, 3.5))}
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", table)
    monkeypatch.setattr(tg, "EIGHT_GPU_RATIO", {"H100": {49152: 0.125}})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args([])))
    steps = [253, 252, 251, 20]
    one = [n * 393216 * us * 1e-6 for n, us in zip(steps, (2.0, 2.5, 3.0, 3.5))]
    rows = stage_rows("\n".join(lines))
    for name, seconds in zip(["1", "2", "3", "ext"], one):
        assert float(rows[name][-2]) == pytest.approx(seconds, abs=0.05)
        assert float(rows[name][-1]) == pytest.approx(seconds * 0.125, abs=0.05)
    assert lines[-2] == f"projected time: 1 x H100 {sum(one):.1f} s, 8 x H100 {sum(one) * 0.125:.1f} s (time per " \
                        "token at each stage's shape, x record #89's 8-GPU ratio)"


def test_plan_says_which_stages_are_unmeasured_rather_than_guessing(no_gpu, monkeypatch):
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", {("H100", "record", 49152, 2048, 11): 1.8})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args([])))
    rows = stage_rows("\n".join(lines))
    assert rows["1"][-2:] == ["-", "-"] and rows["3"][-2] != "-"
    assert lines[-2].startswith("projected time: incomplete, stage(s) 1, 2, ext not in")
    # another preset's model at the same shapes has no measured time
    medium = tg.Schedule(tg.parse_args(["--preset", "medium", "--seq_len", "49152"]))
    other = stage_rows("\n".join(tg.schedule_plan(medium)))
    assert all(row[-2:] == ["-", "-"] for row in other.values())
    # 24 micro-batches a step (the single preset) is not the measured one-micro-batch-per-GPU case on 8 GPUs
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", {("H100", "single", 16384, *shape[1:]): 2.0 for shape in RECORD_SHAPES})
    single = stage_rows("\n".join(tg.schedule_plan(tg.Schedule(tg.parse_args(["--preset", "single"])))))
    assert all(row[-2] != "-" and row[-1] == "-" for row in single.values())


def test_plan_follows_the_schedule_flags_with_staged_batches_and_an_extension(no_gpu):
    args = tg.parse_args(["--plan", "--batch_schedule", "131072,262144,393216", "--num_iterations", "1285",
                          "--extension_steps", "15", "--extension_window", "13"])
    assert args.plan is True and tg.parse_args(["--plan", "false"]).plan is False
    lines = tg.schedule_plan(tg.Schedule(args))
    rows = stage_rows("\n".join(lines))
    assert list(rows) == ["1", "2", "3", "ext"]
    assert [r[2] for r in rows.values()] == ["131,072", "262,144", "393,216", "393,216"]
    assert [r[6] for r in rows.values()] == ["16,384", "32,768", "49,152", "49,152"]
    assert rows["ext"][1] == "1270-1284" and rows["ext"][8] == "1664/768"
    total = sum(int(r[10].replace(",", "")) for r in rows.values())
    assert f"trained tokens: {total:,}" in lines
