"""The training loop end to end on the CPU: learning, world-size invariance, warm-up, the log."""
import re

import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from conftest import LATER_RECORDS
from distributed import spawn


def test_loss_falls_well_below_uniform_on_a_learnable_corpus(tiny_args):
    run = tg.train(tiny_args(num_iterations=30, val_every=10))
    steps, losses = zip(*run.val_losses)
    assert steps == (0, 10, 20, 30)
    assert abs(losses[0] - torch.log(torch.tensor(64.0)).item()) < 1e-3  # zero-init head: uniform
    assert losses[-1] < losses[0] - 1.0
    assert run.train_losses[-1] < run.train_losses[0] - 1.0


def test_loss_still_falls_with_bigram_hash_embedding_backout_and_asymmetric_softcap_on(tiny_args):
    run = tg.train(tiny_args(num_iterations=20, val_every=10, **LATER_RECORDS))
    losses = [v for _, v in run.val_losses]
    assert abs(losses[0] - torch.log(torch.tensor(64.0)).item()) < 1e-3  # zero-init head and bigram table
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < losses[1]
    assert run.train_losses[-1] < run.train_losses[0] - 1.0


def _train_worker(rank, world_size, args, out):
    run = tg.train(args)
    if rank == 0:
        torch.save((run.train_losses, run.val_losses), out)


@pytest.mark.parametrize("features", [{}, LATER_RECORDS], ids=["0903", "later_records"])
def test_two_processes_one_accumulation_step_equal_one_process_two_steps(tiny_args, tmp_path, features):
    args = tiny_args(batch_size=2 * 128, num_iterations=8, val_every=4, **features)
    out = str(tmp_path / "two.pt")
    spawn(_train_worker, 2, args, out)
    two_train, two_val = torch.load(out)
    one = tg.train(args)
    torch.testing.assert_close(torch.tensor(two_train), torch.tensor(one.train_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([v for _, v in two_val]), torch.tensor([v for _, v in one.val_losses]),
                               rtol=1e-5, atol=0)


def test_warmup_leaves_weights_and_optimizer_state_bit_identical(tiny_args):
    args = tiny_args(warmup_steps=2)
    device = torch.device("cpu")
    model, compiled, optimizers, _, _ = tg.build(args, device, 0, 1)
    before_model = {k: v.clone() for k, v in model.state_dict().items()}
    before_opts = [tg.copy_state_dict(o.state_dict()) for o in optimizers]
    producer = tg.BatchProducer(tg.shard_files(args.train_files, "training"), 0, 1, args.max_num_docs, args.bos_id)
    val = list(tg.validation_batches(args.val_files, args.val_tokens, args.val_seq_len, args.bos_id, 0, 1))
    changed = []
    original_step = optimizers[1].step
    optimizers[1].step = lambda: (original_step(), changed.append(model.blocks[0].mlp.fc_w.clone()))
    tg.warmup(model, compiled, optimizers, producer, val, tg.training_stages(args), args, 1)
    assert len(changed) == 2 * len(args.window_schedule)
    assert not torch.equal(changed[-1], before_model["blocks.0.mlp.fc_w"]), "warm-up really trained"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for opt, before in zip(optimizers, before_opts):
        after = opt.state_dict()
        assert after["state"] == {} == before["state"]
        assert after["param_groups"] == before["param_groups"]


def test_a_run_with_warmup_trains_exactly_like_one_without(tiny_args):
    a = tg.train(tiny_args(num_iterations=6, warmup_steps=0))
    b = tg.train(tiny_args(num_iterations=6, warmup_steps=2))
    assert a.train_losses == b.train_losses and a.val_losses == b.val_losses


def test_log_holds_source_environment_hyperparameters_and_step_lines(tiny_args):
    run = tg.train(tiny_args(num_iterations=4, val_every=2, run_id="logtest"))
    text = open(run.log_path).read()
    assert run.log_path.endswith("logtest.txt")
    source = open(tg.__file__).read()
    assert text.startswith(source)
    rest = text[len(source):]
    assert rest.startswith("=" * 100 + "\n") and "PyTorch" in rest and "muon_lr: 0.05" in rest
    assert re.findall(r"^step:(\d+)/4 val_loss:[\d.]+ train_time:\d+ms step_avg:[\d.]+ms$", rest, re.M) == ["0", "2", "4"]
    assert len(re.findall(r"^step:\d+/4 train_time:\d+ms step_avg:[\d.]+ms$", rest, re.M)) == 4
    assert "attention backend: reference" in rest


@pytest.mark.parametrize("N", [20, 200, 400, 1670])
def test_window_stages_split_the_steps_as_the_0903_record_does(N):
    """The record trains step s (0..N; N is the final validation) at window index floor(3s / (N + 1))."""
    args = tg.parse_args(["--num_iterations", str(N)])
    stages = tg.training_stages(args)
    expected = [tg.window_tokens(args.window_schedule[3 * s // (N + 1)], args.window_block) for s in range(N + 1)]
    assert [tg.stage_at(stages, s).windows for s in range(N + 1)] == expected
    assert len(args.window_schedule) == 3
