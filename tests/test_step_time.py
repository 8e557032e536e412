"""bench/step_time.py's reading of a profile (where the GPU sat idle between kernels) and its --stages lines for
--plan's table."""
import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import step_time  # noqa: E402
import train_gpt as tg  # noqa: E402  (step_time put the repository on the path)


def kernel(ts, dur, name):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name}


def test_idle_report_counts_only_time_no_kernel_covers_and_names_the_longest_gap():
    trace = {"traceEvents": [
        kernel(0, 10, "gemm"), kernel(5, 20, "relu"),  # overlapping: busy 0-25
        {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 500, "name": "aten::mm"},  # host events are not GPU time
        kernel(40, 10, "softmax"),  # idle 25-40
        kernel(50, 5, "copy"),  # back to back: no gap
        kernel(155, 45, "adam")]}  # idle 55-155
    report = step_time.idle_report(trace, steps=2).splitlines()
    # span 0-200 = 0.1 ms a step over 2 steps; idle 15 + 100 = 115 us of 200
    assert report[0] == "trace: 5 kernels over 0.1 ms a step; GPU idle 0.1 ms a step (57.5%) in 2 gaps; longest:"
    assert report[1].split() == ["0.100", "ms", "after", "copy", "/", "before", "adam"]
    assert report[2].strip() == "no host events around it"  # no launches in this trace (see the next test)
    assert report[3].split() == ["0.015", "ms", "after", "relu", "/", "before", "softmax"]


def test_idle_report_says_what_the_host_did_in_a_gap_its_late_launch_and_the_sync_that_held_it():
    """The kernel after a gap was launched (cuda_runtime event of its correlation id) 80 us into the gap from
    aten::mm inside the record_function `step 3 (Adam)`; the host sat in cudaStreamSynchronize for 70 us of the gap
    inside aten::item (a .item()), and a short cudaLaunchKernel elsewhere is no wait."""
    def host(cat, ts, dur, name, tid=1, **args):
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "tid": tid, "pid": 1,
                **({"args": args} if args else {})}
    after = dict(kernel(120, 10, "triton_poi_fused_adam"), args={"correlation": 7})
    trace = {"traceEvents": [
        kernel(0, 20, "gemm"), after,  # gap 20-120
        host("user_annotation", 0, 200, "step 3 (Adam)"),
        host("cpu_op", 10, 85, "aten::item"), host("cuda_runtime", 15, 75, "cudaStreamSynchronize"),  # 20-90 in gap
        host("cpu_op", 95, 20, "aten::mm"), host("cpu_op", 90, 30, "Optimizer.step"),  # mm innermost at 100
        host("cuda_runtime", 100, 5, "cudaLaunchKernel", correlation=7),
        host("cuda_runtime", 96, 2, "cudaLaunchKernel", correlation=3),  # not a wait
        host("cpu_op", 0, 500, "aten::mm", tid=2)]}  # another thread's op does not enclose the launch
    report = step_time.idle_report(trace, steps=1).splitlines()
    assert report[1].split() == ["0.100", "ms", "after", "gemm", "/", "before", "triton_poi_fused_adam"]
    assert report[2].strip() == ("launched +0.080 ms from the gap's start by aten::mm in step 3 (Adam); "
                                 "host in cudaStreamSynchronize 0.070 ms (aten::item in step 3 (Adam))")
    assert len(report) == 3


def test_idle_report_of_a_trace_without_kernels():
    assert step_time.idle_report({"traceEvents": []}, 2) == "trace: no GPU kernels"


def test_step_report_splits_the_profile_at_the_steps_gpu_ranges():
    def step(ts, dur, name):
        return {"ph": "X", "cat": "gpu_user_annotation", "ts": ts, "dur": dur, "name": name}
    trace = {"traceEvents": [
        step(0, 100, "step 40"), kernel(0, 60, "sm90_xmma_gemm_bf16"), kernel(70, 30, "triton_poi_fused_relu"),
        step(100, 300, "step 41 (Adam)"), kernel(100, 60, "sm90_xmma_gemm_bf16"),
        kernel(250, 50, "triton_poi_fused_adam"), kernel(300, 100, "triton_poi_fused_relu"),
        {"ph": "X", "cat": "user_annotation", "ts": 0, "dur": 400, "name": "step 40"}]}  # host range: not the GPU's
    lines = step_time.step_report(trace, top=1).splitlines()
    assert lines[0].startswith("step 40: 0.1 ms on the GPU, 2 kernels, idle 0.0 ms in 1 gaps; kernel ms by kind: ")
    assert lines[1].split() == ["0.010", "ms", "after", "sm90_xmma_gemm_bf16", "/", "before", "triton_poi_fused_relu"]
    assert lines[2].startswith("step 41 (Adam): 0.3 ms on the GPU, 3 kernels, idle 0.1 ms in 1 gaps")
    assert lines[3].split() == ["0.090", "ms", "after", "sm90_xmma_gemm_bf16", "/", "before", "triton_poi_fused_adam"]
    assert len(lines) == 4
    assert step_time.step_report({"traceEvents": [kernel(0, 5, "gemm")]}).startswith("trace: no per-step GPU ranges")


def test_plan_entries_are_train_gpts_table_keys_in_us_per_token():
    rows = [(49152, 896, 3, 0, 393216, 659.6), (49152, 2048, 11, 0, 393216, 695.0), (49152, 2048, 11, 0, 393216, 700.0)]
    lines = step_time.plan_entries("NVIDIA H100 80GB HBM3", "record", rows)
    assert lines == ["    ('H100', 'record', 49152, 896, 3): 1.677,", "    ('H100', 'record', 49152, 2048, 11): 1.767,"]
    table = ast.literal_eval("{" + "".join(lines) + "}")  # pastes into train_gpt.STEP_US_PER_TOKEN as it is
    assert set(table) <= set(tg.STEP_US_PER_TOKEN) and table[("H100", "record", 49152, 896, 3)] == 1.677


def test_a_sampled_stage_gives_a_sampled_entry_and_a_mixed_one_none():
    """A stage timed with the sampled softmax: SAMPLED_US_PER_TOKEN's key (the candidates last); timed steps across
    the switch to the full softmax: no entry; the full softmax: STEP_US_PER_TOKEN's."""
    rows = [(49152, 896, 3, 16384, 393216, 362.15), (49152, 4096, 11, None, 393216, 420.0),
            (49152, 4096, 13, 0, 393216, 456.6)]
    lines = step_time.plan_entries("NVIDIA H200", "record", rows)
    sampled, full = ("H200", "record", 49152, 896, 3, 16384), ("H200", "record", 49152, 4096, 13)
    assert lines == [f"    {sampled!r}: 0.921,", f"    {full!r}: 1.161,"]
    table = ast.literal_eval("{" + "".join(lines) + "}")  # the H200 rows of 2026-12-03 (tie_h200_20261203c.md)
    assert table == {sampled: tg.SAMPLED_US_PER_TOKEN[sampled], full: tg.STEP_US_PER_TOKEN[full]}


def test_timed_candidates_follow_the_switch_to_the_full_softmax():
    """The record preset (773 steps, full from step round(0.922 x 773) = 713): stage 1's timed steps sample 16,384
    rows; stage 3's near the switch mix both; the extension, whose row carries stage 3's candidates, trains with the
    full softmax."""
    schedule = tg.Schedule(tg.parse_args([]))
    first, third, ext = schedule.stages[0], schedule.stages[2], schedule.stages[3]
    assert schedule.full_softmax == 713 and ext.candidates == 12288
    assert step_time.timed_candidates(schedule, first, 3, 12) == 16384
    assert step_time.timed_candidates(schedule, third, 708, 12) is None
    assert step_time.timed_candidates(schedule, third, 701, 12) == 12288  # 701-712: all before the switch
    assert step_time.timed_candidates(schedule, ext, ext.start + 3, 12) == 0


def test_stage_runs_count_the_training_steps_and_not_the_final_validations():
    """The record preset's 773 steps: stages of 252 / 251 / 250 steps and the extension's 20, named by their first and
    last training step; the last stage's end (774) is the final validation's step and trains nothing."""
    schedule = tg.Schedule(tg.parse_args([]))
    runs = step_time.stage_runs(schedule)
    assert [name for name, _, _ in runs] == ["stage 1 (steps 0-251)", "stage 2 (steps 252-502)",
                                             "stage 3 (steps 503-752)", "stage 4 (steps 753-772)"]
    assert [n for _, _, n in runs] == [252, 251, 250, 20] and schedule.stages[-1].end == 774
    # --plan's trained tokens: stage 1 at 262,144 tokens a step, the rest at 393,216
    assert sum(n * st.spec.batch_size for _, st, n in runs) == 252 * 262144 + 521 * 393216


def test_stages_alone_times_the_presets_table_and_with_a_table_times_that_one():
    """`--stages` is this script's per-stage mode and also train_gpt.py's stage table: alone, the preset's stages;
    with a table, that table reaches the trainer (a store_true flag would swallow it and leave the table stray)."""
    own, args = step_time.parse(["--stages", "--steps", "4", "--preset", "record"])
    assert own.stages == "" and own.steps == 4 and args.stages == tg.Hyperparameters().stages
    own, args = step_time.parse(["--stages", "window=3,share=1;window=11,batch=327680,share=1", "--preset", "record"])
    assert own.stages is not None and [(st.window, st.batch) for st in args.stages] == [(3, 0), (11, 327680)]
    own, args = step_time.parse(["--ws", "3", "11"])
    assert own.stages is None and own.ws == [3, 11]


def test_memory_cap_is_the_fraction_of_the_gpu_and_refuses_more_than_it_has():
    h200 = int(139.8 * 2**30)
    assert step_time.memory_fraction(80, h200) == pytest.approx(80 / 139.8)
    for bad in (0, -1, 140):
        with pytest.raises(SystemExit, match="--memory_gib"):
            step_time.memory_fraction(bad, h200)
    own, _ = step_time.parse(["--memory_gib", "80", "--preset", "single"])
    assert own.memory_gib == 80


def test_swap_takes_kernels_settings_as_literals_and_refuses_a_name_kernels_lacks():
    own, _ = step_time.parse(["--ws", "11", "--swap", 'RELU2_FP8_BACKWARD_TILES={"BLOCK_M": 128, "PER_SM": 2}',
                              "--rounds", "3"])
    assert own.rounds == 3 and own.swap[0].startswith("RELU2_FP8_BACKWARD_TILES=")
    for bad in (["--swap", "NO_SUCH_TABLE=1"], ["--swap", "RELU2_FP8_TILES=dict(BLOCK_M=1)"],
                ["--swap", "RELU2_FP8_TILES={}", "--profile"]):
        with pytest.raises(SystemExit):
            step_time.parse(bad)


def test_swap_summary_pairs_each_b_run_with_its_a_run():
    line = step_time.swap_summary("ws=11", [100.0, 102.0], [99.0, 99.96], ["X={}"])
    # ratios 0.99 and 0.98: mean 0.985, half-width t(0.975, 1) x 0.00707 / sqrt(2) = 12.706 x 0.005 = 0.0635
    assert line.startswith("swap ws=11: A 100.0 102.0 ms; B 99.0 100.0 ms; B / A 0.9850 +- 0.0635 (95% t, 2 pairs)")
    assert step_time.swap_summary("ws=3", [10.0], [11.0], []).startswith("swap ws=3: A 10.0 ms; B 11.0 ms; B / A 1.1000;")
