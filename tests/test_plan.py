"""`train_gpt.py --plan`: the resolved schedule and its projected training time, printed on the CPU
before any GPU work."""
import re

import pytest
import torch

import train_gpt as tg

RECORD_SHAPES = [(49152, 896, 3), (49152, 2048, 7), (49152, 4096, 11), (49152, 4096, 13)]  # record's stages, extension
# the shapes before the 3,072-token cut in stage 3 (2026-12-02), those of the H100 and four-H200 rows
CUT_2048 = ["--doc_len_schedule", "896,2048,2048"]
SHAPES_2048 = [(tokens, min(cut, 2048), window) for tokens, cut, window in RECORD_SHAPES]
RECORD_CANDIDATES = (16384, 14336, 12288)  # the sampled softmax's rows in stages 1-3 (full from step 664)
# the record's schedule before stage 1's smaller batch (2026-12-03), the one every measured row was timed in: 720
# steps, every stage at batch_size and lr x 1
EQUAL = ["--batch_schedule", "0,0,0", "--lr_schedule", "1,1,1", "--num_iterations", "720"]
FULL = [*EQUAL, "--full_softmax_from", "0"]  # that schedule with the full softmax throughout
# the record's model before ANVIL2's architecture, the one its one-GPU H100 rows and four-GPU H200 rows were timed on
# (MEASURED_MODEL: BEFORE_ANVIL2's fields, narrow heads off; its injection order is no longer built); 776 steps
MEASURED = ["--skip_layers", "", "--no_attn_layers", "6", "--skip_into", "0", "--xsa_blocks", "1,3,4,7",
            "--paired_head_blocks", "0,2,5,9", "--value_embed_blocks", "1,2,8,9,10", "--parallel_mlp_blocks", "",
            "--mlp_hidden", "0", "--no_x0_blocks", "", "--no_ngram_blocks", "", "--no_resid_scale_blocks", "",
            "--narrow_qk_blocks", "", "--narrow_v_blocks", "", "--num_iterations", "776", "--doc_copy", "false",
            "--tied_embed_stages", "2", "--bigram_rows", "377280", "--trigram_rows", "0", *EQUAL[:4]]
# the n-gram table's split before the even one (2026-12-03), which the one-GPU H200 rows before it were timed with
OLD_SPLIT = ["--bigram_rows", "377280", "--trigram_rows", "20773440"]
STEPS = [234, 234, 232, 20]  # EQUAL's 720 steps by stage: 234 / 234 / 232, the extension's 20
# the same steps by softmax: stages 1-2 and stage 3's first 196 sampled (to step 664), stage 3's last 36 and the
# extension's full
S1, S2, S3_SAMPLED, S3_FULL, EXT = *STEPS[:2], 196, STEPS[2] - 196, STEPS[3]


def stage_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"\s+(\d+|ext)\s+\d+-\d+\s", line)}


def line_of(lines: list[str], start: str) -> str:
    """The one line of --plan's output that opens so."""
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, (start, lines)
    return found[0]


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
    # steps, batch, micro-batches on 1 / 8 GPUs, micro tokens, document cut, windows, lr, tokens: stage 1 at 2/3 of
    # the batch (its micro-batches shorter) and the public line's rate there, 1.52 / 1.73
    assert rows["1"][1:11] == ["0-251", "262,144", "8", "/", "1", "32,768", "896", "384/128", "0.8786",
                               f"{252 * 262144:,}"]
    assert rows["2"][1:3] == ["252-502", "393,216"] and rows["2"][9] == "1"
    assert rows["3"][1] == "503-752" and rows["3"][8] == "1408/640"
    assert rows["ext"][1] == "753-772" and rows["ext"][8] == "1664/768"  # step 773 is the final validation only
    tokens = 252 * 262144 + (251 + 250 + 20) * 393216  # 252 / 251 / 250 steps, the extension's 20
    assert f"trained tokens: {tokens:,}" in out and tokens == 270_925_824
    assert tokens <= 0.80 * 338_800_000  # issue 64's line: at most 0.80 of public record #89's 338.8M tokens
    # stage 1's shape has no H200 row: the plan leaves it unmeasured (never interpolated) and projects nothing
    assert rows["1"][-3:] == ["-", "-", "-"] and rows["2"][-3] != "-"
    assert line_of(out.splitlines(), "projected time:").startswith("projected time: incomplete, stage(s) 1 not in")
    assert not list(tmp_path.iterdir())  # no log, no checkpoint folder
    # the H200 rows (--plan_gpu's default) are of the record's present model: no line says the model differs; given
    # the n-gram split before the even one, the plan says so, naming the split's fields
    assert "step times of another model:" not in out
    assert tg.main(["--plan", *OLD_SPLIT]) == 0
    assert line_of(capsys.readouterr().out.splitlines(), "step times of another model:") == (
        "step times of another model: the times above are --preset record's model's; this run's model is not "
        "measured (it differs in bigram_rows, trigram_rows: the model line gives the measured model's values)")
    # the H100 rows are of the record's model before ANVIL2's architecture: the plan says so, naming what differs
    # (at their 2,048-token cut in stage 3: at the record's 4,096 no H100 row prices a stage, and nothing is said)
    assert tg.main(["--plan", "--plan_gpu", "H100"]) == 0
    assert "step times of another model:" not in capsys.readouterr().out
    assert tg.main(["--plan", "--plan_gpu", "H100", *CUT_2048]) == 0
    assert line_of(capsys.readouterr().out.splitlines(), "step times of another model:") == (
        "step times of another model: the times above are --preset record's model's before its present one "
        "(MEASURED_MODEL); this run's model is not measured (it differs in mlp_hidden, no_attn_layers, "
        "value_embed_blocks, bigram_rows, trigram_rows, paired_head_blocks, xsa_blocks, skip_into, skip_layers, "
        "parallel_mlp_blocks, no_x0_blocks, no_ngram_blocks, no_resid_scale_blocks, narrow_qk_blocks, "
        "narrow_v_blocks, doc_copy, tied_embed_stages, injections: the model line gives the measured model's values)")


def test_plan_counts_the_models_mlp_width_and_says_the_step_times_are_the_measured_models(no_gpu, capsys):
    """--plan's model line: the MLP's hidden width and MFU's counts from it (flops_per_token), 2816 against 3072 on the
    model the H100 rows were timed on (11 blocks x 2 matrices x 768 x 256 fewer weights, 6 FLOPs each per token);
    the measured step times stay that model's, and the line says so where the width, or another model field, is not
    its, and always its injection order, which no run has now (MEASURED_MODEL). The H200 rows are of the record's
    present model: the line names the fields in which a run differs from it."""
    lines = {}
    for given in (MEASURED, [*MEASURED, "--mlp_hidden", "3072"], [*MEASURED, "--mlp_hidden", "2816"]):
        assert tg.main(["--plan", "--plan_gpu", "H100", *given, *CUT_2048]) == 0  # the rows' cut
        out = capsys.readouterr().out.splitlines()
        lines[" ".join(given)] = line_of(out, "model: MLP hidden")
        assert line_of(out, "step times of another model:").endswith(
            ("in mlp_hidden, injections: " if "2816" in given else "in injections: ") + "the model line gives the "
            "measured model's values)")
    measured, same, anvil2 = lines.values()
    assert measured.startswith("model: MLP hidden 3,072 (mlp_ratio 4 x model_dim 768), 114,131,244 matmul weights")
    assert measured.endswith("; the step times above are --preset record's model's before its present one "
                             "(MEASURED_MODEL), injections before a block's attention")
    assert same.replace("(mlp_hidden)", "(mlp_ratio 4 x model_dim 768)") == measured  # 3072 given: the same model
    assert anvil2.startswith(f"model: MLP hidden 2,816 (mlp_hidden), {114_131_244 - 11 * 2 * 768 * 256:,} matmul")
    assert anvil2.endswith("; the step times above are --preset record's model's before its present one "
                           "(MEASURED_MODEL), MLP hidden 3,072, injections before a block's attention")
    gflops = [[float(v) for v in re.search(r"by stage ([\d. /]+) \(", line)[1].split(" / ")]
              for line in (measured, anvil2)]
    args = tg.parse_args([*MEASURED, "--mlp_hidden", "2816"])
    with torch.device("meta"):
        model = tg.GPT(tg.ModelConfig.from_args(args))
    assert model.blocks[0].mlp.fc_w.shape == (768, 2816)
    exact = [tg.flops_per_token(model, st.windows, st.spec.max_doc_len) / 1e9 for st in tg.Schedule(args).stages]
    assert gflops[1] == pytest.approx(exact, rel=1e-3) and len(exact) == 4
    for a, b in zip(*gflops):
        assert a - b == pytest.approx(6 * 11 * 2 * 768 * 256 / 1e9, abs=2e-4)
    # the record, ANVIL2's whole architecture (its layout, the second MLP in block 8, 2816, its injection sites and
    # order), on H100: every model field that differs from the measured model named, with the measured model's value
    assert tg.main(["--plan", "--plan_gpu", "H100"]) == 0
    line = line_of(capsys.readouterr().out.splitlines(), "model: MLP hidden")
    assert line.startswith("model: MLP hidden 2,816 (mlp_hidden)")
    record_then = ("MLP hidden 3,072, no_attn_layers (6,), value_embed_blocks (1, 2, 8, 9, 10), bigram_rows 377280, "
                   "trigram_rows 0, paired_head_blocks (0, 2, 5, 9), xsa_blocks (1, 3, 4, 7), skip_into 0, "
                   "skip_layers (), parallel_mlp_blocks (), no_x0_blocks (), no_ngram_blocks (), "
                   "no_resid_scale_blocks (), narrow_qk_blocks (), narrow_v_blocks ()")
    assert line.endswith("; the step times above are --preset record's model's before its present one "
                         f"(MEASURED_MODEL), {record_then}, doc_copy False, tied_embed_stages 2, "
                         "injections before a block's attention")
    # on H200 the measured model is the record's present one (the copy feature's included); the model before
    # ANVIL2's differs from it in ANVIL2's architecture, the narrow heads, the copy feature, the embedding tied for
    # three stages and the n-gram table: the plan says the times are not its (the measured model's values named)
    assert tg.main(["--plan"]) == 0
    assert line_of(capsys.readouterr().out.splitlines(), "model: MLP hidden").endswith("(flops_per_token: MFU's count)")
    assert tg.main(["--plan", *MEASURED]) == 0
    assert line_of(capsys.readouterr().out.splitlines(), "model: MLP hidden").endswith(
        "; the step times above are --preset record's model's, MLP hidden 2,816, no_attn_layers (4, 6, 9), "
        "value_embed_blocks (1, 2, 8, 10), bigram_rows 10575360, trigram_rows 10575360, "
        "paired_head_blocks (0, 2, 5), xsa_blocks (1, 3), skip_into 6, skip_layers (7,), parallel_mlp_blocks (8,), "
        "no_x0_blocks (3, 6, 8, 9), no_ngram_blocks (2, 3, 6, 8), no_resid_scale_blocks (6,), narrow_qk_blocks (0, 1, "
        "2, 5, 8), narrow_v_blocks (1, 8), doc_copy True, tied_embed_stages 3")
    # MEASURED is that model, field for field (its injection order aside), and the rows of it are H100's and 4 x H200's
    fields = {k: v for k, v in tg.BEFORE_ANVIL2.items() if k != "injections"}
    assert tg.parse_args(MEASURED) == tg.Hyperparameters(**fields, num_iterations=776,
                                                         stages=tg.parse_args(EQUAL).stages)
    assert tg.MEASURED_MODEL == {("record", "H100", 1): tg.BEFORE_ANVIL2, ("record", "H200", 4): tg.BEFORE_ANVIL2}


def test_plan_projects_each_measured_stage_and_the_total_from_the_table(no_gpu, capsys, monkeypatch):
    table = {("H100", "record", *shape): us for shape, us in zip(RECORD_SHAPES, (2.0, 2.5, 3.0, 3.5))}
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", table)
    monkeypatch.setattr(tg, "EIGHT_GPU_RATIO", {"H100": {49152: 0.125}})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H100", *FULL])))
    one = [n * 393216 * us * 1e-6 for n, us in zip(STEPS, (2.0, 2.5, 3.0, 3.5))]
    rows = stage_rows("\n".join(lines))
    for name, seconds in zip(["1", "2", "3", "ext"], one):
        assert float(rows[name][-2]) == pytest.approx(seconds, abs=0.05)
        assert float(rows[name][-1]) == pytest.approx(seconds * 0.125, abs=0.05)
    assert line_of(lines, "projected time:") == (
        f"projected time: 1 x H100 {sum(one):.1f} s, 8 x H100 {sum(one) * 0.125:.1f} s (time per token at each "
        "stage's shape, x record #89's 8/1-GPU step-time ratio on H100 (0.125 at 49,152 tokens a micro-batch; "
        "EIGHT_GPU_RATIO))")


def test_plan_says_which_stages_are_unmeasured_rather_than_guessing(no_gpu, monkeypatch):
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", {("H100", "record", 49152, 4096, 11): 1.8})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H100", *FULL])))
    rows = stage_rows("\n".join(lines))
    assert rows["1"][-2:] == ["-", "-"] and rows["3"][-2] != "-"
    assert line_of(lines, "projected time:").startswith("projected time: incomplete, stage(s) 1, 2, ext not in")
    assert line_of(lines, "vs public master").startswith(
        "vs public master (H100): not computed, ours: stage(s) 1, 2, ext not in STEP_US_PER_TOKEN (full softmax) / "
        "SAMPLED_US_PER_TOKEN (sampled) for H100")
    # another preset's model at the same shapes has no measured time
    medium = tg.Schedule(tg.parse_args(["--preset", "medium", "--seq_len", "49152"]))
    other = stage_rows("\n".join(tg.schedule_plan(medium)))
    assert all(row[-2:] == ["-", "-"] for row in other.values())
    # 32 micro-batches a step (the single preset) is not the measured one-micro-batch-per-GPU case on 8 GPUs
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN",
                        {("H100", "single", 12288, *shape[1:]): 2.0 for shape in RECORD_SHAPES})
    single = tg.schedule_plan(tg.Schedule(tg.parse_args(["--preset", "single", "--plan_gpu", "H100", *FULL])))
    assert all(row[-2] != "-" and row[-1] == "-" for row in stage_rows("\n".join(single)).values())
    assert line_of(single, "projected time:").endswith(
        "8 GPUs not projected: record #89's 8/1-GPU ratio is measured at one micro-batch per GPU, not 4")


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


# Ours alone on one H200 of a one-GPU machine, 2026-12-03, FlashAttention-4, 80 steps of the record preset at main
# 4d94d98 with its defaults (the even n-gram split; --full_softmax_from 0.65), twice, the second at the 4,096 cut (the
# preset's since): ms per 393,216-token step, each stage's mean from the log's stage lines: stages 1-2 the mean of both
# runs, stage 3 and the extension the 4,096 cut's (bench/results/tie_h200_20261203c.md). The full softmax in stage 3
# and the extension; the sampled one at 16,384 / 14,336 / 12,288 rows in stages 1-3
OURS_H200_MS = (451.5, 456.6)
OURS_H200_SAMPLED_MS = ((362.4 + 361.9) / 2, (370.0 + 369.4) / 2, 375.0)
# The public master on another one-GPU machine on 2026-11-30, in turns with the record preset before the copy feature
# (A B A B), each stage's median, the mean of its two runs, at its own stages' batches (abab_graphs_h200_20261130j.md)
MASTER_H200_MS = (295.5, 409.5, 606.0, 604.5)


def test_the_record_presets_stages_split_at_the_switch_to_the_full_softmax():
    """720 steps, the full softmax from round(0.922 x 720) = 664: stage 3 (steps 468-699) samples 196 steps and
    trains 36 with the full softmax; the extension (700-719) is full although its row carries stage 3's candidates."""
    schedule = tg.Schedule(tg.parse_args(EQUAL))
    assert schedule.full_softmax == 664 and schedule.stages[2].start == 468 and schedule.stages[3].start == 700
    assert [tg.softmax_steps(schedule, st) for st in schedule.stages] == [(S1, 0), (S2, 0), (S3_SAMPLED, S3_FULL),
                                                                           (0, EXT)]
    assert [st.candidates for st in schedule.stages] == [*RECORD_CANDIDATES, 12288]
    assert [tg.softmax_steps(tg.Schedule(tg.parse_args(FULL)), st)[0] for st in schedule.stages] == [0, 0, 0, 0]


def test_the_h200_tables_hold_the_measured_step_times_and_give_the_masters_564_s_and_ours_0573(no_gpu):
    ours = [tg.STEP_US_PER_TOKEN[("H200", "record", *shape)] for shape in RECORD_SHAPES[2:]]
    assert ours == pytest.approx([ms * 1000 / 393216 for ms in OURS_H200_MS], abs=5e-4)  # rounded to 3 decimals
    # stages 1-2's full softmax was timed on the model before ANVIL2's only: no row (unmeasured, not interpolated)
    assert all(("H200", "record", *shape) not in tg.STEP_US_PER_TOKEN for shape in RECORD_SHAPES[:2])
    sampled = [tg.SAMPLED_US_PER_TOKEN[("H200", "record", *shape, c)]
               for shape, c in zip(RECORD_SHAPES, RECORD_CANDIDATES)]
    assert sampled == pytest.approx([ms * 1000 / 393216 for ms in OURS_H200_SAMPLED_MS], abs=5e-4)
    assert tg.PUBLIC_MASTER_STEP_MS["H200"]["ms"] == MASTER_H200_MS
    # the public master's schedule: 1270 steps in thirds, then a 15-step extension, 338.8M tokens
    master_steps, master_batches = [423, 424, 423, 15], [131072, 262144, 393216, 393216]
    assert tg.PUBLIC_MASTER_STAGES == tuple(zip(master_steps, master_batches))
    master_s = sum(n * ms for n, ms in zip(master_steps, MASTER_H200_MS)) / 1000
    master_tokens = sum(n * b for n, b in zip(master_steps, master_batches))
    assert master_tokens == 338_821_120 and master_s == pytest.approx(564.0, abs=0.05)
    assert tg.public_master_time("H200") == (pytest.approx(master_s), master_tokens)
    # ours: 234 / 234 / 196 sampled steps in stages 1-3, then 36 full ones in stage 3 and the 20 of the extension
    split = (S1, S2, S3_SAMPLED, S3_FULL, EXT)
    ours_s = sum(n * ms for n, ms in zip(split, (*OURS_H200_SAMPLED_MS, *OURS_H200_MS))) / 1000
    ours_tokens = 720 * 393216
    r, t = (ours_s / ours_tokens) / (master_s / master_tokens), ours_s / master_s * 73.8
    assert ours_tokens == 283_115_520 and ours_s == pytest.approx(270.14, abs=0.05)
    assert r == pytest.approx(0.573, abs=1e-3) and t == pytest.approx(35.3, abs=0.05)
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(EQUAL)))  # H200: --plan_gpu's default
    m = re.match(r"vs public master \(H200, .*\): per-token (\d\.\d\d\d)x, projected 8xH100 (\d+\.\d) s \(ours "
                 r"(\d+\.\d) s / its (\d+\.\d) s", line_of(lines, "vs public master"))
    assert m, line_of(lines, "vs public master")
    assert float(m[1]) == pytest.approx(r, abs=5e-4) and float(m[2]) == pytest.approx(t, abs=0.1)
    assert float(m[3]) == pytest.approx(ours_s, abs=0.2) and float(m[4]) == pytest.approx(564.0, abs=0.05)
    # R itself, unrounded, against the raw ms figures (the tables' 3 decimals move it by less than 1e-3)
    table_s = 393216e-6 * (S1 * sampled[0] + S2 * sampled[1] + S3_SAMPLED * sampled[2] + S3_FULL * ours[0] +
                          EXT * ours[1])
    assert (table_s / ours_tokens) / (master_s / master_tokens) == pytest.approx(r, abs=1e-3)
    assert line_of(lines, "projected time:").startswith(f"projected time: 1 x H200 {table_s:.1f} s")
    # stage 3's us/token: the mean of its 196 sampled and 36 full steps
    stage3 = (S3_SAMPLED * sampled[2] + S3_FULL * ours[0]) / STEPS[2]
    assert float(stage_rows("\n".join(lines))["3"][-3]) == pytest.approx(stage3, abs=5e-4)
    # labelled: the kind, the attention kernel and the sources; no 8-GPU figure without a measured H200 ratio
    assert "projected seconds on H200 (FlashAttention-4)" in lines[0]
    assert line_of(lines, "ours on H200 (FlashAttention-4): one H200 of a one-GPU machine, alone, 2026-12-03, "
                          "PyTorch 2.11.0+cu130: the record preset at main 4d94d98 with its defaults (the even n-gram "
                          "split) and the 4,096-token cut, one run of 80 steps (stages 1-2: the mean of it and one at "
                          "the 3,072 cut), before muon_fused_normuon was on (bench/results/tie_h200_20261203c.md); "
                          "times as measured for --preset "
                          "record's model, ")
    assert "FlashAttention-4" in line_of(lines, "public master on H200")
    # the pairing says how the master's times relate to ours (not in one session: two machines, two days), and its
    # host-bound stage 1
    assert ("not in one session with ours: the master on 2026-11-30 in turns with the model before the copy "
            "feature, A B A B; ours on another one-GPU machine on 2026-12-03") in line_of(lines, "vs public master")
    other_s = (423 * 220.5 + sum(n * ms for n, ms in zip(master_steps[1:], MASTER_H200_MS[1:]))) / 1000
    other_r = f"{(ours_s / ours_tokens) / (other_s / master_tokens):.3f}"
    assert other_r == "0.607" and f"day; with that, R = {other_r}" in line_of(lines, "vs public master")
    assert "8 GPUs not projected: no measured 8/1-GPU step-time ratio on H200" in line_of(lines, "projected time:")
    assert all(row[-1] == "-" for row in stage_rows("\n".join(lines)).values())
    # the rows are of the record's present model: as it is nothing said; without its narrow heads, or its copy
    # feature, said so, naming the fields
    assert not [line for line in lines if line.startswith("step times of another model")]
    assert line_of(tg.schedule_plan(tg.Schedule(tg.parse_args(["--narrow_qk_blocks", "", "--narrow_v_blocks", ""]))),
                   "step times of another model").endswith(
        "(it differs in narrow_qk_blocks, narrow_v_blocks: the model line gives the measured model's values)")
    assert line_of(tg.schedule_plan(tg.Schedule(tg.parse_args(["--doc_copy", "false"]))),
                   "step times of another model").endswith(
        "(it differs in doc_copy: the model line gives the measured model's values)")
    # the model before ANVIL2's architecture (776 steps): priced at those rows, and said to be another model's
    before = tg.schedule_plan(tg.Schedule(tg.parse_args(MEASURED)))
    before_s = 393216e-6 * (253 * sampled[0] + 252 * sampled[1] + 210 * sampled[2] + 41 * ours[0] + 20 * ours[1])
    assert line_of(before, "projected time:").startswith(f"projected time: 1 x H200 {before_s:.1f} s")
    assert line_of(before, "step times of another model:").startswith(
        "step times of another model: the times above are --preset record's model's; this run's model is not "
        "measured (it differs in mlp_hidden, no_attn_layers, ")
    # the full softmax throughout: stages 1-2 have no H200 row, so no projection and no ratio
    full = tg.schedule_plan(tg.Schedule(tg.parse_args(FULL)))
    assert line_of(full, "projected time:").startswith("projected time: incomplete, stage(s) 1, 2 not in")
    assert line_of(full, "vs public master").startswith("vs public master (H200): not computed")


def test_a_stage_split_by_the_switch_is_priced_as_the_weighted_sum_and_a_missing_row_leaves_it_out(no_gpu, monkeypatch):
    """Each stage's sampled steps at its SAMPLED_US_PER_TOKEN row, its full ones at its STEP_US_PER_TOKEN row: stage 3
    (196 sampled, 36 full) needs both, stages 1-2 (all sampled) only the sampled, the extension only the full."""
    full = {("H100", "record", *shape): us for shape, us in zip(RECORD_SHAPES[2:], (3.0, 3.5))}  # stage 3, extension
    sampled = {("H100", "record", *shape, c): us
               for shape, c, us in zip(RECORD_SHAPES, RECORD_CANDIDATES, (1.0, 1.5, 2.0))}  # stages 1-3
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", full)
    monkeypatch.setattr(tg, "SAMPLED_US_PER_TOKEN", sampled)
    args = tg.parse_args(["--plan_gpu", "H100", *EQUAL])
    lines = tg.schedule_plan(tg.Schedule(args))
    rows = stage_rows("\n".join(lines))
    seconds = [S1 * 1.0, S2 * 1.5, S3_SAMPLED * 2.0 + S3_FULL * 3.0, EXT * 3.5]  # x 393,216 tokens x 1e-6
    for name, s in zip(["1", "2", "3", "ext"], seconds):
        assert float(rows[name][-2]) == pytest.approx(s * 0.393216, abs=0.05)
    stage3 = (S3_SAMPLED * 2.0 + S3_FULL * 3.0) / STEPS[2]
    assert float(rows["3"][-3]) == pytest.approx(stage3, abs=5e-4)  # the stage's mean
    assert line_of(lines, "projected time:").startswith(f"projected time: 1 x H100 {sum(seconds) * 0.393216:.1f} s")
    # without stage 2's sampled row, or without stage 3's full one, that stage is '-' and the projection incomplete
    for table, key, name in ((sampled, ("H100", "record", *RECORD_SHAPES[1], 14336), "2"),
                             (full, ("H100", "record", *RECORD_SHAPES[2]), "3")):
        monkeypatch.delitem(table, key)
        lines = tg.schedule_plan(tg.Schedule(args))
        assert stage_rows("\n".join(lines))[name][-3:-1] == ["-", "-"]
        assert line_of(lines, "projected time:").startswith(f"projected time: incomplete, stage(s) {name} not in "
                                                           "train_gpt.py's STEP_US_PER_TOKEN (full softmax) / "
                                                           "SAMPLED_US_PER_TOKEN (sampled) for H100")
        assert line_of(lines, "vs public master").startswith("vs public master (H100): not computed")
        table[key] = 1.0  # back, for the next case
    # the H100 tables hold the full softmax only: the record preset's sampled stages are unmeasured there
    monkeypatch.undo()
    h100 = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H100", *CUT_2048])))  # their cut
    assert line_of(h100, "projected time:").startswith("projected time: incomplete, stage(s) 1, 2, 3 not in")


@pytest.mark.parametrize("kind, flags", [("H100", [*FULL, *CUT_2048]), ("H200", EQUAL)])  # H100: full softmax, 2,048
def test_plan_prints_one_line_against_the_public_master_for_each_kind(no_gpu, capsys, kind, flags):
    assert tg.main(["--plan", "--plan_gpu", kind, *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(rf"vs public master \({kind}, [^)]*\): per-token \d\.\d\d\dx, projected 8xH100 \d+\.\d s "
                        rf"\(ours \d+\.\d s / its \d+\.\d s over each schedule on one {kind}, x record #89's 73.8 s: "
                        r"assumes both codes scale to 8 GPUs alike\)", line_of(lines, "vs public master"))
    assert f"projected seconds on {kind} ({tg.STEP_US_ATTENTION[kind]})" in lines[0]


def test_an_unknown_plan_gpu_is_refused_naming_the_kinds(no_gpu, capsys):
    assert tg.main(["--plan", "--plan_gpu", "A100"]) == 1
    err = capsys.readouterr().err
    assert err == "train_gpt.py: error: --plan_gpu A100: --plan has measured times for H100, H200\n"
    assert all(kind in tg.field_help()["plan_gpu"] for kind in tg.plan_kinds())  # --help lists them too


def test_a_kind_without_the_masters_times_says_so_instead_of_a_ratio(no_gpu, monkeypatch):
    monkeypatch.setitem(tg.STEP_US_PER_TOKEN, ("A100", "record", *RECORD_SHAPES[0]), 2.0)
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "A100", *FULL])))
    assert line_of(lines, "vs public master") == (
        "vs public master (A100): not computed, ours: stage(s) 2, 3, ext not in STEP_US_PER_TOKEN (full softmax) / "
        "SAMPLED_US_PER_TOKEN (sampled) for A100 and --preset record; the public master: no stage times on A100 "
        "(PUBLIC_MASTER_STEP_MS has H100, H200)")
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", {("A100", "record", *shape): 2.0 for shape in RECORD_SHAPES})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "A100", *FULL])))
    assert line_of(lines, "vs public master") == (
        "vs public master (A100): not computed, the public master: no stage times on A100 (PUBLIC_MASTER_STEP_MS has "
        "H100, H200)")


FOUR_H200_MS = (147.0, 157.6, 162.4, 165.0)  # the record preset on four H200s of one host, 393,216-token steps


def test_plan_gives_the_schedules_time_from_the_steps_measured_on_four_h200s(no_gpu, monkeypatch):
    """The line from MULTI_GPU_US_PER_TOKEN: the schedule's seconds from each stage's four-GPU step; only for the
    kind and preset measured, and not for a schedule with a stage shape the four-GPU runs did not time, nor with
    sampled-softmax steps (the four-GPU rows are of the full softmax): here the record preset with the full one. The
    rows are of the record's model before ANVIL2's architecture (MEASURED_MODEL): the line says so, names what a run's
    model differs in, and gives no share of the one-GPU time where the one-GPU rows are of another model."""
    four = [tg.MULTI_GPU_US_PER_TOKEN[("H200", 4, "record", *shape)] for shape in SHAPES_2048]
    assert four == pytest.approx([ms * 1000 / 393216 for ms in FOUR_H200_MS], abs=5e-4)
    seconds = sum(n * ms for n, ms in zip([253, 252, 251, 20], FOUR_H200_MS)) / 1000
    source = "four H200s of one host, 2026-11-28 (bench/results/x4_h200_20261128b.md)"
    old = "--preset record's model before its present one (MEASURED_MODEL)"
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H200", *FULL, *MEASURED, *CUT_2048])))
    m = re.fullmatch(rf"measured on 4 x H200: (\d+\.\d) s \(each stage's 4-GPU step time\); {re.escape(old)}, not "
                     rf"this run's \(it differs in injections\); {re.escape(source)}", line_of(lines, "measured on"))
    assert m and float(m[1]) == pytest.approx(seconds, abs=0.1)
    # the record's model (at the four-GPU runs' 2,048 cut): every field of ANVIL2's architecture named
    record = line_of(tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H200", *FULL, *CUT_2048]))),
                     "measured on")
    assert f"; {old}, not this run's (it differs in mlp_hidden, no_attn_layers, " in record
    assert record.endswith(f"no_resid_scale_blocks, narrow_qk_blocks, narrow_v_blocks, doc_copy, tied_embed_stages, "
                           f"injections); {source}")
    # one-GPU rows at every shape: no share while they and the four-GPU rows are of two models; with both of one, it
    monkeypatch.setattr(tg, "STEP_US_PER_TOKEN", {("H200", "record", *shape): 1.5 for shape in SHAPES_2048})
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H200", *FULL, *MEASURED, *CUT_2048])))
    assert line_of(lines, "projected time:").startswith("projected time: 1 x H200 ")
    assert "of one GPU's" not in line_of(lines, "measured on")
    monkeypatch.setattr(tg, "MEASURED_MODEL", {})  # as if the four-GPU rows were of the record's present model
    lines = tg.schedule_plan(tg.Schedule(tg.parse_args(["--plan_gpu", "H200", *FULL, *CUT_2048])))
    seconds = sum(n * ms for n, ms in zip(STEPS, FOUR_H200_MS)) / 1000
    one = sum(STEPS) * 393216 * 1.5e-6
    m = re.fullmatch(r"measured on 4 x H200: (\d+\.\d) s \(each stage's 4-GPU step time, (0\.\d+) of one GPU's\); "
                     rf"--preset record's model; {re.escape(source)}", line_of(lines, "measured on"))
    assert m and float(m[1]) == pytest.approx(seconds, abs=0.1) and float(m[2]) == pytest.approx(seconds / one, abs=1e-3)
    monkeypatch.undo()
    # the record's 4,096 cut in stage 3 (a shape the four-GPU runs did not time); the last: the record preset as it
    # is, sampled in stages 1-3
    for flags in (["--plan_gpu", "H100", *FULL], ["--plan_gpu", "H200", *FULL], ["--plan_gpu", "H200"]):
        assert not [line for line in tg.schedule_plan(tg.Schedule(tg.parse_args(flags))) if "measured on" in line]
