"""The training loop end to end on the CPU: learning, world-size invariance, warm-up, the log."""
import dataclasses
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
import train_gpt as tg
from conftest import FAST, TINY, first_stage, stages as table
from distributed import spawn


# Slow: 30 steps of TINY's whole batch, 12 s of a 2-core CPU. The quick set sees the same learning in
# test_golden.py (the record model's losses over 20 steps, 4.26 -> 3.65, pinned to the digit) and in test_mtp.py's
# run (validation from about log 71 down by 0.5 in 20 steps).
@pytest.mark.slow
def test_loss_falls_well_below_uniform_on_a_learnable_corpus(tiny_args):
    run = tg.train(tiny_args(num_iterations=30, val_every=10))
    steps, losses = zip(*run.val_losses)
    assert steps == (0, 10, 20, 30)
    # about uniform at first: a zero bigram table, and a head at N(0, 0.005) (tied to the embedding); CPLM gives the
    # copy column's share back to the other 71 columns of the vocabulary of 72
    assert abs(losses[0] - math.log(TINY["vocab_size"] - 1)) < 1e-2
    # (tied, and Adam on every second step, the tiny model learns a bit slower than an untied one with Adam every step)
    assert losses[-1] < losses[0] - 0.8 and losses[-1] < losses[1]
    assert run.train_losses[-1] < run.train_losses[0] - 0.8


def test_token_tables_summed_by_their_lookups_train_as_autograds_gradients(tiny_args, monkeypatch):
    """The trainer's table sums (TableLookup, flushed on Adam's steps, zeroed after the warm-up) train as the
    tables' autograd gradients do: tied then untied, Adam every second step (float32 on the CPU: the same sums in
    another order)."""
    args = tiny_args(**FAST, num_iterations=8, val_every=4, warmup_steps=1)
    summed = tg.train(args)
    monkeypatch.setattr(tg.GPT, "keep_table_grads", lambda self, ngram_positions=0, segment=None: None)
    plain = tg.train(args)
    torch.testing.assert_close(torch.tensor(summed.train_losses), torch.tensor(plain.train_losses), rtol=2e-5, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in summed.val_losses]),
                               torch.tensor([v for _, v in plain.val_losses]), rtol=2e-5, atol=0)
    assert summed.train_losses[-1] != summed.train_losses[0]


def _train_worker(rank, world_size, args, out):
    run = tg.train(args)
    if rank == 0:
        torch.save((run.train_losses, run.val_losses), out)


def two_processes_train_as_one(args, tmp_path) -> tg.RunResult:
    """args on 2 gloo processes (one micro-batch each a step) and on 1 (two in turn): the same training and
    validation losses; returns the one-process run. Equal to the bit with Adam every step. With Adam every second
    step its gradient sums two steps of two micro-batches in another order on 2 processes (each rank's two steps,
    then the ranks) than on 1 (the micro-batches in turn), and Adam's second step onwards shows that rounding:
    2-3e-5 of the loss."""
    out = str(tmp_path / "two.pt")
    spawn(_train_worker, 2, args, out)
    two_train, two_val = torch.load(out)
    one = tg.train(args)
    rtol = 1e-5 if args.adam_every == 1 else 1e-4
    torch.testing.assert_close(torch.tensor(two_train), torch.tensor(one.train_losses), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in two_val]), torch.tensor([v for _, v in one.val_losses]),
                               rtol=rtol, atol=0)
    return one


@pytest.mark.slow
def test_two_processes_one_accumulation_step_equal_one_process_two_steps(tiny_args, tmp_path):
    two_processes_train_as_one(tiny_args(batch_size=2 * 128, num_iterations=8, val_every=4), tmp_path)


@pytest.mark.slow
def test_doc_copy_trains_on_two_processes_as_on_one(tiny_args, tmp_path):
    """doc_copy's tables in their optimizer's group (the MUDD group's Adam, rows padded for 8 shards) train on 2
    gloo processes as on one: the same losses to float32 rounding (the micro-batches' gradients summed in another
    order), and its embedding learned."""
    one = two_processes_train_as_one(tiny_args(batch_size=2 * 128, num_iterations=8, val_every=4, save_every=8,
                                               doc_copy=True), tmp_path)
    weights = torch.load(Path(one.checkpoint) / "model.pt", weights_only=True)["model"]
    assert weights["doc_copy_embed"].abs().sum() > 0  # zero at the start


def _slow_collector_worker(rank, world_size, args, out):
    import gc
    import time
    collect = gc.collect
    gc.collect = lambda *a: (time.sleep(10.0) if rank == 1 else None, collect(*a))[1]  # rank 1 lags into the clock
    run = tg.train(args)
    torch.save(run.train_time_ms, f"{out}.{rank}")


@pytest.mark.slow
def test_no_rank_clock_counts_another_rank_still_getting_ready(tiny_args, tmp_path):
    """Rank 1 spends 10 s collecting garbage before the timed region; rank 0 must not time its wait for it."""
    args = tiny_args(batch_size=2 * 128, num_iterations=2, val_every=0)
    out = str(tmp_path / "ms")
    spawn(_slow_collector_worker, 2, args, out)
    ms = [torch.load(f"{out}.{rank}") for rank in range(2)]
    # two steps of the tiny record model (0.6-1.7 s each on 2 processes of a 2-core CPU); the lag would make rank 0's
    # over 10000
    assert max(ms) < 5000, ms


def test_warmup_leaves_weights_and_optimizer_state_bit_identical(tiny_args):
    """Also with the n-gram table's row-sparse Adam (its table starts at zero, restored by zeroing) and an odd number
    of warm-up steps, so that each shape ends on a step without Adam: its gradient log keeps its size (a grown log
    would change the compiled graphs' input shapes: a recompile in the timed run)."""
    args = tiny_args(**FAST, warmup_steps=3, ngram_sparse_adam=True, trigram_rows=64)
    device = torch.device("cpu")
    model, compiled, optimizers, _ = tg.build(args, device, 0, 1)
    log_size = model.ngram_log["rows"].numel()
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before_opts = [tg.copy_state_dict(o.state_dict()) for o in optimizers]
    files = tg.shard_files(args.train_files, "training")
    producer = tg.BatchProducer(files, 0, 1, args.bos_id)
    val = list(tg.validation_batches(args.val_files, args.val_tokens, args.val_seq_len, args.bos_id, 0, 1))
    schedule = tg.Schedule(args)
    schedule = schedule.with_slots(tg.doc_slots(schedule, files))
    changed = []
    original_finish = optimizers[1].finish  # Muon's last phase (train_step runs the optimizers in phases)
    optimizers[1].finish = lambda g: (original_finish(g), changed.append(model.blocks[0].mlp.fc_w.clone()))
    lines = []
    tg.warmup(model, compiled, optimizers, producer, val, schedule, 1, lines.append)
    assert len(changed) == 3 * len(args.stages)
    assert model.ngram_log["rows"].numel() == log_size
    n = len(args.stages)  # the tiny stages differ in windows: one shape each, each shape's progress logged
    assert lines[0].startswith(f"warm-up: compiling {n} stage shape(s)")
    assert [line.split(" (")[0] for line in lines[1:]] == [f"warm-up: shape {i}/{n}" for i in range(1, n + 1)]
    assert not torch.equal(changed[-1], before_model["blocks.0.mlp.fc_w"]), "warm-up really trained"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for opt, before in zip(optimizers, before_opts):
        after = opt.state_dict()
        assert after["state"] == {} == before["state"]
        assert after["param_groups"] == before["param_groups"]


def test_a_run_with_warmup_trains_exactly_like_one_without(tiny_args):
    a = tg.train(tiny_args(**FAST, num_iterations=6, warmup_steps=0))
    b = tg.train(tiny_args(**FAST, num_iterations=6, warmup_steps=2))
    assert a.train_losses == b.train_losses and a.val_losses == b.val_losses


def test_log_holds_source_environment_hyperparameters_and_step_lines(tiny_args):
    run = tg.train(tiny_args(**FAST, num_iterations=4, val_every=2, run_id="logtest"))
    text = open(run.log_path).read()
    assert run.log_path.endswith("logtest.txt")
    source = (open(tg.__file__).read() + tg.KERNELS_MARKER + "\n" + open(tg.kernels.__file__).read()
              + tg.SHARDS_MARKER + "\n" + open(tg.shard_format.__file__).read())
    assert text.startswith(source)  # the trainer's source, then the kernels' and the shard format's it imports
    rest = text[len(source):]
    assert rest.startswith("=" * 100 + "\n") and "PyTorch" in rest and f"muon_lr: {tg.Hyperparameters.muon_lr}" in rest
    assert re.findall(r"^step:(\d+)/4 val_loss:[\d.]+ train_time:\d+ms step_avg:[\d.]+ms tokens:\d+$", rest, re.M) == ["0", "2", "4"]
    assert len(re.findall(r"^step:\d+/4 train_time:\d+ms step_avg:[\d.]+ms$", rest, re.M)) == 4
    assert "attention backend: reference" in rest
    (curve,) = re.findall(r"^train_loss per step 1-4: (.*)$", rest, re.M)  # the whole curve, for other GPU counts
    assert curve == " ".join(f"{x:.4f}" for x in run.train_losses)


def test_curves_script_puts_two_runs_step_for_step_and_names_their_differences(tiny_args):
    a = tg.train(tiny_args(**FAST, num_iterations=4, val_every=2, run_id="a"))
    b = tg.train(tiny_args(**FAST, num_iterations=4, val_every=2, run_id="b", muon_lr=0.2))  # another curve from step 2
    script = Path(__file__).resolve().parent.parent / "bench" / "curves.py"
    out = subprocess.run([sys.executable, str(script), a.log_path, b.log_path, "--every", "1"],
                         capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([+-][\d.]+) \|$", out, re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4]
    assert [float(r[1]) for r in rows] == [round(x, 4) for x in a.train_losses]
    assert [float(r[2]) for r in rows] == [round(x, 4) for x in b.train_losses]
    diffs = [abs(x - y) for x, y in zip(a.train_losses, b.train_losses)]
    assert diffs[0] == 0 and max(diffs) > 0  # the first step's loss precedes any update
    shown = re.search(r"max \|diff\| ([\d.]+)", out)  # from the log's 4-decimal losses: within their rounding
    assert shown and abs(float(shown[1]) - max(diffs)) <= 1.5e-4 and "val loss: step 0 +0.0000, step 2 " in out


@pytest.mark.parametrize("N", [23, 200, 400, 776])
def test_window_stages_split_the_steps_as_the_record_does(N):
    """The record's S = N - 20 scheduled steps (s = 0..S-1) train at window index floor(3s / (S + 1)) of its 3 / 7 /
    11-block windows, its 20 extension steps and the final validation (step N) at 13 blocks."""
    args = tg.parse_args(["--preset", "record", "--num_iterations", str(N)])
    assert [row.window for row in args.stages] == [3, 7, 11] and (args.extension_steps, args.extension_window) == (20, 13)
    S, schedule = N - 20, tg.Schedule(args)
    expected = [tg.window_tokens((3, 7, 11)[3 * s // (S + 1)], args.window_block) for s in range(S)]
    expected += [tg.window_tokens(13, args.window_block)] * (N + 1 - S)
    assert [schedule.stage_at(s).windows for s in range(N + 1)] == expected
    # stage 1 at ANVIL2's 262,144 tokens a step (its 8 micro-batches of 32,768) and x 0.8786 of the rates, then
    # batch_size; documents cut at 896 / 2,048 / 4,096 tokens (ANVIL2's caps with its 3,072 raised), the extension at
    # 4,096
    assert [(st.spec.batch_size, st.spec.seq_len, st.spec.max_doc_len, st.lr) for st in schedule.stages] == [
        (262144, 32768, 896, 0.8786), (args.batch_size, args.seq_len, 2048, 1.0),
        (args.batch_size, args.seq_len, 4096, 1.0), (args.batch_size, args.seq_len, 4096, 1.0)]


# The public record line's schedule after 09/03 (records of 11/2025 to 07/2026): three stages of
# batch 131,072 / 262,144 / 393,216 tokens, documents cut at 896 then 2,048, windows 3 / 7 / 11 blocks,
# stage learning-rate multipliers 1 / 1.52 / 1.73, then 10 extension steps at a 13-block window.
LINE = dict(stages=table(tg.Hyperparameters.stages, batch_schedule=(131072, 262144, 393216),  # the record's rows
                          doc_len_schedule=(896, 2048, 2048), lr_schedule=(1.0, 1.52, 1.73)), extension_steps=10, extension_window=13, num_iterations=1390, cooldown_frac=0.6, final_lr_frac=0.15,
            muon_momentum_cooldown=50)


def test_staged_schedule_gives_each_step_its_batch_document_cut_window_and_learning_rate():
    args = tg.Hyperparameters(**LINE)
    schedule = tg.Schedule(args)
    stages = schedule.stages
    assert [st.end for st in stages] == [461, 921, 1380, 1391]  # the extension covers steps 1380..1389 (+ final val)
    assert [(st.spec.batch_size, st.spec.seq_len, st.spec.max_doc_len) for st in stages] == [
        (131072, 16384, 896), (262144, 32768, 2048), (393216, 49152, 2048), (393216, 49152, 2048)]
    assert [st.windows for st in stages] == [(384, 128), (896, 384), (1408, 640), (1664, 768)]
    S, frac = 1380, 0.6
    for step in range(1390):  # the public formula: stage multiplier, then linear to 0.15 over the last 60%
        st = schedule.stage_at(step)
        t = min(max((step - S * (1 - frac)) / (S * frac), 0), 1)
        assert schedule.lr_factor(step, st) == pytest.approx(st.lr * (1 - t) + 0.15 * t)
    assert schedule.lr_factor(1385, stages[-1]) == pytest.approx(0.15)


def test_muon_momentum_warms_up_then_cools_down_over_the_last_steps():
    schedule = tg.Schedule(tg.Hyperparameters(**LINE, muon_momentum=0.95, muon_momentum_warmup=300))
    got = [schedule.momentum(s) for s in (0, 150, 300, 1340, 1365, 1390)]
    assert got == pytest.approx([0.85, 0.90, 0.95, 0.95, 0.90, 0.85])


def test_record_preset_momentum_is_anvil2s_schedule():
    """0.85 up to 0.93 over 240 steps, held, and back to 0.85 over the last 50 (ANVIL2's warm-up and peak;
    the public master's get_muon_momentum shape, whose cool-down counts from its total steps, the extension's
    included)."""
    args = tg.parse_args([])
    N = args.num_iterations
    schedule = tg.Schedule(args)
    m = [schedule.momentum(s) for s in range(N + 1)]
    assert m[0] == pytest.approx(0.85) and m[120] == pytest.approx(0.89) and m[240] == pytest.approx(0.93)
    assert m[N - 50] == pytest.approx(0.93) and m[N - 25] == pytest.approx(0.89) and m[N] == pytest.approx(0.85)
    assert all(x == pytest.approx(0.93) for x in m[240: N - 49])


@pytest.mark.parametrize("fields, message", [
    (dict(stages=(tg.Stage(3, batch=131072), tg.Stage(7, batch=786432))), "stage 2: batch=786432 .* micro-batches of at most seq_len=49152"),
    (dict(stages=(tg.Stage(3, batch=131071),)), "stage 1: batch=131071 must split into batch_size/seq_len=8"),
    (dict(stages=(tg.Stage(3), tg.Stage(7, share=0))), "stage 2 .*window and share must be >= 1"),
    (dict(stages=()), "one Stage row or more"),
    (dict(extension_steps=10, extension_window=0), "extension_steps=10 and extension_window=0"),
])
def test_a_schedule_that_cannot_run_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tg.Hyperparameters(**fields)


def test_a_staged_run_trains_each_stage_at_its_batch_and_learns(tiny_args, monkeypatch):
    rows = table(TINY["stages"], batch_schedule=(256, 512, 1024), doc_len_schedule=(32, 96, 96), lr_schedule=(1.0, 1.2, 1.4))
    args = tiny_args(num_iterations=24, val_every=0, stages=rows, extension_steps=3, extension_window=4,
                     muon_momentum_cooldown=4)
    seen, train_step = [], tg.train_step

    def recording(model, compiled, optimizers, micro, step, stage, schedule, ahead=None):
        seen.append((len(micro), {len(m[0]) for m in micro}, stage.spec.max_doc_len, stage.windows))
        return train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead)
    monkeypatch.setattr(tg, "train_step", recording)
    run = tg.train(args)
    assert len(run.train_losses) == 24 and run.train_losses[-1] < run.train_losses[0] - 0.5
    # S = 21 scheduled steps: stages [0, 8), [8, 15), [15, 21), then the extension [21, 24)
    assert seen[0] == seen[7] == (8, {32}, 32, (16, 0)) and seen[8] == seen[14] == (8, {64}, 96, (32, 16))
    assert seen[15] == seen[20] == (8, {128}, 96, (48, 16)) and seen[21] == seen[23] == (8, {128}, 96, (64, 32))
    # tokens so far, in the final validation line too: 8 x 256 + 7 x 512 + 6 x 1024 + 3 x 1024
    schedule = tg.Schedule(args)
    assert schedule.tokens_before(10) == 8 * 256 + 2 * 512 and schedule.tokens_before(24) == 14848
    assert "step:24/24 val_loss:" in Path(run.log_path).read_text().split("tokens:14848")[0].splitlines()[-1]


def test_a_smaller_batch_row_trains_at_its_own_batch_and_the_extension_at_the_last_rows(tiny_args, monkeypatch):
    """A row of the stages table with its own batch and lr (the public line's smaller first stages, ANVIL2's
    batches): each step's micro-batches as many as before and shorter; the extension holds the last row's batch
    and runs at lr 1; the tokens count them."""
    rows = table(TINY["stages"], batch_schedule=(1024, 1024, 1024), doc_len_schedule=(96, 96, 96))
    small = (tg.dataclasses.replace(rows[0], batch=256, lr=0.5), *rows[1:-1],
             tg.dataclasses.replace(rows[-1], batch=768, lr=0.875))
    args = tiny_args(num_iterations=20, val_every=0, stages=small, extension_steps=3, extension_window=4)
    schedule = tg.Schedule(args)
    assert [(st.start, st.end) for st in schedule.stages] == [(0, 6), (6, 12), (12, 17), (17, 21)]
    assert [(st.spec.batch_size, st.spec.seq_len) for st in schedule.stages] == [(256, 32), (1024, 128), (768, 96),
                                                                                 (768, 96)]
    assert [st.lr for st in schedule.stages] == [0.5, 1.0, 0.875, 1.0]
    assert schedule.tokens_before(20) == 6 * 256 + 6 * 1024 + 8 * 768
    seen, train_step = [], tg.train_step

    def recording(model, compiled, optimizers, micro, step, stage, schedule, ahead=None):
        seen.append((len(micro), {len(m[0]) for m in micro}))
        return train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead)
    monkeypatch.setattr(tg, "train_step", recording)
    run = tg.train(args)
    assert seen[0] == seen[5] == (8, {32}) and seen[6] == seen[11] == (8, {128}) and seen[12] == seen[19] == (8, {96})
    assert run.train_losses[-1] < run.train_losses[0]
    assert f"step:20/20 val_loss:" in Path(run.log_path).read_text().split(f"tokens:{6 * 256 + 6 * 1024 + 8 * 768}")[0]


def test_the_final_validation_can_look_further_back_than_training_did(tiny_args, monkeypatch):
    """final_val_window (the 2025-09-10 record's 13 blocks) raises the long window of the last validation
    only, as records #89 and ANVIL2 do: the short window and the last stage's rotary tables are kept (no YaRN
    step, so no tables of its own); 0 keeps the last stage's windows."""
    args = tiny_args(**FAST, num_iterations=6, val_every=3, final_val_window=5, warmup_steps=1)
    schedule = tg.Schedule(args)
    stages = schedule.stages
    last = stages[-1].windows
    wide = (tg.window_tokens(5, args.window_block)[0], last[1], last[0])
    assert wide == (80, 16, 48)  # ours before: (80, 32) with tables of its own
    assert [schedule.val_windows(s) for s in (0, 3, 5, 6)] == [stages[0].windows, stages[1].windows, last, wide]
    plain = tiny_args(num_iterations=6, val_every=3)
    assert tg.Schedule(plain).val_windows(6) == last
    assert tg.ModelConfig.from_args(plain).yarn_windows == (16, 32, 48)
    assert tg.ModelConfig.from_args(args).yarn_windows == (16, 32, 48)  # the final window has no tables
    model = tg.GPT(tg.ModelConfig.from_args(args))
    with pytest.raises(ValueError, match="not 80"):  # without the third entry the wide window would need them
        model.rotary.at(wide[0])
    seen = []
    evaluate = tg.evaluate
    monkeypatch.setattr(tg, "evaluate", lambda model, compiled, val, windows, *a: seen.append(windows) or
                        evaluate(model, compiled, val, windows, *a))
    tg.train(args)
    # warm-up: the windows of the run's validations only (steps 0 and 3: stages 1 and 2; the last stage's never
    # validates), then the final one; the run: steps 0 and 3, then the final (step 6)
    u = schedule.untie  # the tiny record ties the embedding for its first two stages
    assert len(stages) == 3 and u == stages[2].start and schedule.validation_graphs() == {
        (stages[0].windows, True): 0, (stages[1].windows, True): 3, (wide, False): 6}
    assert seen == [stages[0].windows, stages[1].windows, wide, stages[0].windows, stages[1].windows, wide]
    with pytest.raises(ValueError, match="final_val_window=-1"):
        tiny_args(final_val_window=-1)


def test_the_warm_up_compiles_the_validation_graphs_the_run_will_use_and_no_other(tiny_args, monkeypatch):
    """Validations: steps 0, val_every, ... and the final one, each at its stage's windows and with the embedding
    tied as at that step; without val_every, the final one only. The warm-up evaluates each of those once (a shape
    without a validation compiles its training graphs only), so no validation compiles inside the timed run."""
    seen, evaluate = [], tg.evaluate
    monkeypatch.setattr(tg, "evaluate", lambda model, compiled, val, windows, *a: seen.append(
        (windows, model.tied_embed)) or evaluate(model, compiled, val, windows, *a))
    for val_every, tied_stages in ((0, 1), (4, 1), (4, 0)):
        args = tiny_args(**FAST, num_iterations=12, val_every=val_every, tied_embed_stages=tied_stages,
                         extension_steps=2, extension_window=4, final_val_window=0, warmup_steps=1)
        schedule = tg.Schedule(args)
        stages, untie = schedule.stages, schedule.untie
        seen.clear()
        tg.train(args)
        steps = sorted({*range(0, 12, val_every or 12), 12} - ({0} if not val_every else set()))
        run = [(schedule.val_windows(s), s < untie) for s in steps]
        assert seen[-len(run):] == run  # the run's own validations
        warm = seen[:-len(run)]
        assert len(warm) == len(set(warm)) and set(warm) == set(run) == set(schedule.validation_graphs())
        assert len(stages) == 4 and len(set(st.windows for st in stages)) == 4
    assert schedule.validation_graphs() == {(stages[0].windows, False): 0, (stages[1].windows, False): 4,
                                            (stages[2].windows, False): 8, (stages[3].windows, False): 12}


def test_the_model_is_compiled_with_inductors_fusions_capped(tiny_args, monkeypatch):
    """build() passes the cap on fused kernels' buffers (see its comment) to the model's compile, and this
    torch's Inductor knows the option (torch.compile refuses an option it does not know)."""
    seen = []
    monkeypatch.setattr(tg.torch, "compile", lambda fn, **kw: seen.append((fn, kw)) or fn)
    # torch's config.patch, not monkeypatch: pytest 9.2's undo deletes an attribute of torch's config module
    with torch._inductor.config.patch(cpp_wrapper=True):  # as a former build on a GPU leaves it
        model, *_ = tg.build(tiny_args(compile=True, cpp_wrapper=True), torch.device("cpu"), 0, 1,
                             log=lambda *a, **k: None)
        assert torch._inductor.config.cpp_wrapper is False  # the C++ wrapper (--cpp_wrapper) only on a CUDA device
    options = [kw.get("options") for fn, kw in seen if fn is model]
    assert options == [{"max_fusion_unique_io_buffers": 32}]
    monkeypatch.undo()
    torch.compile(torch.nn.Linear(2, 2), options=options[0])
    with pytest.raises(RuntimeError, match="max_fusion_unique_io_bufers"):  # a misspelt option is refused
        torch.compile(torch.nn.Linear(2, 2), options={"max_fusion_unique_io_bufers": 32})


def test_the_cpp_wrapper_is_on_by_default_and_old_checkpoints_keep_their_setting():
    """--cpp_wrapper is on by default (every preset) and off by --cpp_wrapper false; a checkpoint written while
    the field took auto/true/false (2026-11-30) or was a bool resumes with a bool: auto on, as it is everywhere now."""
    assert all(tg.parse_args(["--preset", name]).cpp_wrapper is True for name in tg.PRESETS)
    assert tg.parse_args(["--cpp_wrapper", "false"]).cpp_wrapper is False
    record = tg.parse_args([])
    stored = {**dataclasses.asdict(record), "stages": [dataclasses.asdict(row) for row in record.stages]}
    for old, now in ((False, False), (True, True), ("false", False), ("true", True), ("auto", True)):
        assert tg.Hyperparameters(**tg.stored_args({**stored, "cpp_wrapper": old})).cpp_wrapper is now


def test_the_recompile_limit_covers_the_fp8_casts_of_a_schedule_with_three_batch_sizes():
    """The FP8 head's operand cast (kernels._quantize, compiled whole) meets each micro-batch token count and each head
    row count, the full head as a Parameter, in training and evaluation: with three stage batches (ANVIL2's 8K / 16K
    / 24K at the proxy's scale, which stopped an H200 run at dynamo's limit of 13) the run's limit holds them all,
    where the model's count alone does not. (aot_eager: the same guards, compiled in seconds on the CPU.)"""
    args = tg.parse_args(["--batch_size", "24576", "--seq_len", "24576", "--val_seq_len", "40960", "--stages",
                          "window=3,candidates=16384,batch=8192;window=7,candidates=14336,batch=16384;"
                          "window=11,candidates=12288"])
    schedule = tg.Schedule(args)
    model_only = 2 * len(schedule.stages) + 1 + sum(1 for st in schedule.stages if st.candidates)
    dim = 8  # the cast's guards see the row count, not the width
    tokens = sorted({st.spec.seq_len for st in schedule.stages} | {args.val_seq_len})
    rows = sorted({st.candidates for st in schedule.stages} | {args.vocab_size})
    operands = [torch.zeros(n, dim) for n in tokens + rows] + [torch.nn.Parameter(torch.zeros(args.vocab_size, dim))]

    def cast_all(limit: int):
        torch._dynamo.reset()
        cast = torch.compile(kernels._quantize, dynamic=False, fullgraph=True, backend="aot_eager")
        with torch._dynamo.config.patch(recompile_limit=limit):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    for t in operands:
                        cast(t, 448.0, torch.float8_e4m3fn)

    try:
        cast_all(tg.recompile_limit(schedule))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            cast_all(model_only)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_run_with_an_extension_and_a_final_window_compiles_every_graph_it_needs(tiny_args, monkeypatch):
    """3 stages + the extension, each in training and evaluation, and the final validation's window: 9
    graphs of one function, one more than dynamo's default limit, which fullgraph turns into a failure; with
    the record's sampled softmax (one more graph per sampled stage, and its switch inside stage 3) and its
    row-logged trigram table, as the record preset compiles them together.
    (aot_eager instead of inductor: the same tracing and guards, compiled in seconds on the CPU.)"""
    torch._dynamo.reset()  # forget the graphs other tests compiled of the same functions (they count)
    compile = torch.compile
    monkeypatch.setattr(tg.torch, "compile", lambda fn, **kw: compile(fn, **{**kw, "backend": "aot_eager"}))
    # the corpus' 64 tokens and the copy column: at most 65 distinct targets, so 66 or more rows never overflow
    sampled = tuple(dataclasses.replace(row, candidates=c) for row, c in zip(TINY["stages"], (66, 68, 70)))
    args = tiny_args(num_iterations=12, val_every=3, extension_steps=2, extension_window=4, final_val_window=5,
                     compile=True, warmup_steps=1, stages=sampled, full_softmax_from=0.75, trigram_rows=512,
                     ngram_sparse_adam=True)
    assert len(tg.Schedule(args).stages) == 4
    try:
        with torch._dynamo.config.patch(recompile_limit=8):
            run = tg.train(args)
    finally:
        torch._dynamo.reset()  # and leave none of these nine for the tests after
    assert [s for s, _ in run.val_losses] == [0, 3, 6, 9, 12] and run.val_losses[-1][1] < run.val_losses[0][1]


def test_each_stage_step_time_is_logged_and_the_stages_add_up_to_the_training_time(tiny_args):
    """Three stages of 20 steps (7 / 7 / 6): one line each in the log with the stage's steps and ms a step, and
    the stages' times sum to the run's training time, up to the timed bookkeeping before the first step; a run
    resumed mid-stage times that stage from its step."""
    args = tiny_args(**FAST, num_iterations=20, val_every=5, save_every=10)
    run = tg.train(args)
    stages = tg.Schedule(args).stages
    assert [(n, first, steps, rows) for n, first, steps, _, rows in run.stage_ms] == [
        (i + 1, st.start, min(st.end, args.num_iterations) - st.start, 0) for i, st in enumerate(stages)]
    total = sum(ms for _, _, _, ms, _ in run.stage_ms)  # all but the timed moments before step 0's step (bookkeeping)
    assert run.train_time_ms - 50 < total <= run.train_time_ms
    text = Path(run.log_path).read_text()
    for n, first, steps, ms, _ in run.stage_ms:
        assert f"stage {n}, steps {first}-{first + steps - 1}: {ms / steps:.1f} ms a step over {steps} steps" in text
    lines = re.findall(r"^stage \d, steps .*$", text, re.M)
    assert len(lines) == 3 and not any("softmax" in line for line in lines)  # no stage samples: no softmax named
    step_10 = str(Path(run.checkpoint).parent / "step_000010")
    resumed = tg.train(tiny_args(**FAST, num_iterations=20, val_every=5, save_every=10, resume=step_10))
    assert [(n, first, steps) for n, first, steps, _, _ in resumed.stage_ms] == [(2, 10, 4), (3, 14, 6)]


def test_a_stage_that_switches_to_the_full_softmax_is_timed_in_two_parts(tiny_args):
    """The sampled and the full softmax's steps of one stage are timed apart (--plan prices them from two tables):
    stage 3 of 20 steps (14-19) switches at round(0.8 x 20) = 16, so it logs steps 14-15 sampled and 16-19 full,
    and the parts still add up to the training time."""
    sampled = tuple(dataclasses.replace(row, candidates=c) for row, c in zip(TINY["stages"], (66, 68, 70)))
    args = tiny_args(**FAST, num_iterations=20, val_every=0, stages=sampled, full_softmax_from=0.8)
    run = tg.train(args)
    assert [(n, first, steps, rows) for n, first, steps, _, rows in run.stage_ms] == [
        (1, 0, 7, 66), (2, 7, 7, 68), (3, 14, 2, 70), (3, 16, 4, 0)]
    assert run.train_time_ms - 50 < sum(ms for _, _, _, ms, _ in run.stage_ms) <= run.train_time_ms
    text = Path(run.log_path).read_text()
    _, _, _, ms, _ = run.stage_ms[2]
    assert f"stage 3, steps 14-15: {ms / 2:.1f} ms a step over 2 steps" in text
    lines = re.findall(r"^stage \d, steps .*$", text, re.M)
    assert [line.split("tokens/s")[-1] for line in lines] == [
        ", sampled softmax (66 rows)", ", sampled softmax (68 rows)", ", sampled softmax (70 rows)", ", full softmax"]


def test_doc_copy_s_matches_found_a_micro_batch_ahead_are_each_forward_s_own(tiny_args):
    """doc_copy in training: every forward gets its own micro-batch's (candidate, bucket), the matcher's on its own
    tokens; each is found during the forward before it (plan_copy_ahead: the step's next micro-batch, and with
    `ahead` the next step's first), but a step's first when no plan of its key was made (the run's first, a step
    after one without `ahead`, a step numbered otherwise than planned: that plan is dropped)."""
    args = tiny_args(**FAST, doc_copy=True)  # two micro-batches a step
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    seen, planned = [], []

    def spy(inputs, targets, cu_seqlens, *rest, copy_match=None, **kwargs):
        seen.append((inputs, cu_seqlens, copy_match))
        return compiled(inputs, targets, cu_seqlens, *rest, copy_match=copy_match, **kwargs)

    def plan(key, *a, **k):
        plan_copy_ahead(key, *a, **k)
        planned.append((key, model.copy_ahead[1]))
    plan_copy_ahead, model.plan_copy_ahead = model.plan_copy_ahead, plan
    schedule, stage, loader = first_stage(args)
    for step, with_ahead in ((0, True), (1, True), (2, False), (3, True), (7, True)):
        micro = loader.next()[1]
        tg.train_step(model, spy, optimizers, micro, step, stage, schedule, loader.peek() if with_ahead else None)
    loader.close()
    assert [key for key, _ in planned] == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 1), (4, 0), (7, 1), (8, 0)]
    assert len(seen) == 10
    for inputs, cu_seqlens, match in seen:
        expected = tg.doc_copy_candidates(inputs, cu_seqlens)
        assert match is not None and all(torch.equal(a, b) for a, b in zip(match, expected))
    # found ahead: all but steps 0, 3 and 7's first micro-batches (the 1st, 7th and 9th forwards)
    ahead = [any(match[0] is candidate for _, candidate in planned) for _, _, match in seen]
    assert ahead == [False, True, True, True, True, True, False, True, False, True]
    assert model.copy_ahead is not None and model.copy_ahead[0] == (8, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host-device synchronization check needs a CUDA GPU")
def test_a_training_step_on_the_gpu_never_waits_for_the_gpu(tiny_args):
    """A whole optimizer step of the record model (forward, backward, Muon and, at step 1, Adam) queues
    its work without one synchronizing operation, after a first step that makes what is made once (the FP8 head's
    scales, the optimizers' state). A wait inside the step leaves the GPU idle until the host catches up: six
    blocking scale copies per micro-batch in the FP8 head were one. The batches are on the device and their
    loader stopped before the check."""
    args = tiny_args(vocab_size=80, device="cuda", attention="varlen")  # FP8 matmuls: 16 | V
    device = torch.device("cuda")
    model, compiled, optimizers, _ = tg.build(args, device, 0, 1, log=lambda line: None)
    files = tg.shard_files(args.train_files, "training")
    schedule = tg.Schedule(args)
    stage = schedule.stages[0].with_slots(tg.doc_slots(schedule, files))
    producer = tg.BatchProducer(files, 0, 1, args.bos_id)
    loader = tg.BatchLoader(producer, lambda i: stage.spec, device)
    micro = [loader.next()[1] for _ in range(2)]
    loader.close()
    tg.train_step(model, compiled, optimizers, micro[0], 0, stage, schedule)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = tg.train_step(model, compiled, optimizers, micro[1], 1, stage, schedule)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)
