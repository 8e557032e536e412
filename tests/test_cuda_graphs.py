"""--cuda_graphs (GraphRunner): the runner's tensors and bookkeeping give the usual launch's arithmetic bit for bit.
On the CPU the runner runs with capture=False: everything but the capture itself (the graphs' input tensors, the
kept gradients attached and zeroed, the shapes' compile runs, the n-gram log and row cache at fixed addresses). The
GPU test captures and replays."""
import dataclasses

import pytest
import torch

import train_gpt as tg
from conftest import FAST, TINY_RECORD, first_stage


def with_runner(capture: bool, seen: list):
    """tg.build wrapped: its compiled model behind a GraphRunner (kept in seen)."""
    build = tg.build

    def wrapped(*args, **kwargs):
        model, compiled, optimizers, chosen = build(*args, **kwargs)
        runner = tg.GraphRunner(model, compiled, capture=capture)
        seen.append(runner)
        return model, runner, optimizers, chosen
    return wrapped


# the record's moving parts at a tiny size: extra targets over three stages and an extension, the embedding tied
# for the first stage, Adam every second step, the n-gram log (trigram channel, row-sparse Adam), the sampled
# softmax (every row a candidate) switched to the full one at step 10
RECORD_PARTS = dict(TINY_RECORD, **FAST, num_iterations=12, extension_steps=2, val_every=6, ngram_sparse_adam=True,
                    trigram_rows=512, tied_embed_stages=1, full_softmax_from=0.8,
                    stages=tuple(dataclasses.replace(row, candidates=TINY_RECORD["vocab_size"])
                                 for row in TINY_RECORD["stages"]))


@pytest.mark.parametrize("doc_copy", [False, True], ids=["record", "doc_copy"])
def test_the_runner_trains_as_the_usual_launch_bit_for_bit(corpus, tmp_path, monkeypatch, doc_copy):
    """doc_copy: its matches, found outside the graph (plan_copy_ahead), are the graph's tensors too."""
    train, val = corpus
    common = dict(RECORD_PARTS, train_files=train, val_files=val, log_dir=str(tmp_path / "logs"),
                  checkpoint_dir=str(tmp_path / "checkpoints"), doc_copy=doc_copy)
    plain = tg.train(tg.Hyperparameters(**common, run_id="plain"))
    seen = []
    monkeypatch.setattr(tg, "build", with_runner(False, seen))
    graphed = tg.train(tg.Hyperparameters(**common, run_id="graphed"))
    assert graphed.train_losses == plain.train_losses and graphed.val_losses == plain.val_losses
    runner, = seen
    model = runner.model
    # a shape for each stage and the extension (full softmax from step 10, the extension's start), the embedding tied
    # in stage 1 only: each compiled once, then given its graph's tensors
    shapes = list(runner.touched)
    assert len(shapes) == len(runner.graphs) == 4
    assert [s[-1] for s in shapes] == [True, False, False, False] and [s[4] for s in shapes] == [72, 72, 72, 0]
    for shape, params in runner.touched.items():
        # the token tables' gradients are summed aside (TableLookup), never autograd's: the embedding is in no set
        ids = {id(p) for p in params}
        assert id(model.embed.weight) not in ids and {id(model.lm_head_w), id(model.blocks[0].mlp.fc_w)} <= ids
    assert all(graph is None and loss is None for graph, _, loss in runner.graphs.values())  # capture=False


class StandInGraph:
    """torch.cuda.CUDAGraph's stand-in on the CPU (the tests' captures are their own context managers)."""

    def replay(self):
        pass


def test_a_grown_ngram_log_retires_the_graphs_that_read_the_old_one(tiny_args):
    """The log's addresses are part of a graph's key: when reserve_ngram_log grows it (a third step without Adam's
    flush: the log has room for two), the graphs made with the old log are dropped, the shape's next micro-batch runs
    as usual (no graph) and the one after it gets a new graph."""
    args = tiny_args(**FAST, ngram_sparse_adam=True, trigram_rows=512)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    runner = tg.GraphRunner(model, compiled, capture=False)
    schedule, stage, loader = first_stage(args)
    keys, room = [], model.ngram_log["rows"].numel()
    for _ in range(4):  # step 0 each time: not an Adam step (adam_every 2), so no flush; 2 micro-batches a step
        tg.train_step(model, runner, optimizers, loader.next()[1], 0, stage, schedule)
        keys.append([key[-1] for key in runner.graphs])
    loader.close()
    assert model.ngram_log["rows"].numel() > room, "the third step grew the log"
    assert keys[0] == keys[1] == [keys[0][0]] and keys[2] == keys[3] == [runner.fixed()] and keys[2] != keys[0]


def test_no_capture_follows_a_move_of_the_ngram_log_at_once(tiny_args, monkeypatch):
    """Dynamo guards the log's size: the compiled model's first call after the log grows compiles anew, and a compile
    inside a CUDA capture fails (an H200: "operation not permitted when stream is capturing"). Stand-ins: a capture
    that fails when the compiled model's call finds the log at another size than its call before (dynamo's guard)."""
    import contextlib
    capturing, sizes = [False], []

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode=None):
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: 0)
    args = tiny_args(**FAST, ngram_sparse_adam=True, trigram_rows=512)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)

    def guarded(*a, **k):
        sizes.append(model.ngram_log["rows"].numel())
        if capturing[0] and sizes[-2:-1] != sizes[-1:]:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return compiled(*a, **k)
    runner = tg.GraphRunner(model, guarded, capture=False)
    runner.capture = True  # as on a GPU, from here on
    schedule, stage, loader = first_stage(args)
    for _ in range(4):  # the third step grows the log (as above)
        tg.train_step(model, runner, optimizers, loader.next()[1], 0, stage, schedule)
    loader.close()
    room = sizes[0]
    # the compile run and the capture at the first size; after the move one usual run, then the capture
    assert sizes == [room, room, 2 * room, 2 * room] and runner.captures == 2


def test_a_pool_whose_graphs_are_all_dropped_is_not_captured_into_again(tiny_args, monkeypatch):
    """The caching allocator asserts (use_count > 0) when a capture names a pool that held graphs and holds none now:
    once the grown log drops every graph (as above), the next capture takes a new pool. Here stand-ins for CUDA's
    graphs and pools keep the allocator's rule: each pool counts its live graphs."""
    import contextlib
    import gc
    import weakref
    live, used, handles = {}, set(), iter(range(1, 100))

    @contextlib.contextmanager
    def graph(g, pool=None, capture_error_mode=None):
        if pool in used and not live.get(pool):
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        used.add(pool)
        live[pool] = live.get(pool, 0) + 1
        weakref.finalize(g, lambda: live.__setitem__(pool, live[pool] - 1))
        yield
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    args = tiny_args(**FAST, ngram_sparse_adam=True, trigram_rows=512)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    runner = tg.GraphRunner(model, compiled, capture=False)
    runner.capture, runner.pool = True, torch.cuda.graph_pool_handle()  # as on a GPU, from here on
    schedule, stage, loader = first_stage(args)
    pools = []
    for _ in range(4):  # the third step grows the log and drops the graphs; the fourth's capture needs a new pool
        tg.train_step(model, runner, optimizers, loader.next()[1], 0, stage, schedule)
        gc.collect()
        pools.append(runner.pool)
    loader.close()
    assert runner.captures == 2 and pools == [1, 1, 2, 2] and live == {1: 0, 2: 1}


def test_every_forward_and_backward_compiles_with_the_python_wrapper(tiny_args, monkeypatch):
    """With --cpp_wrapper on, the runner still calls the compiled model under Inductor's Python wrapper: at a shape's
    compile run and at its capture (here the capture's stand-in), so that a graph compiled during a capture is never
    the C++ wrapper's, whose compile autotunes on the GPU (an H200's capture refused it)."""
    monkeypatch.setattr(torch._inductor.config, "cpp_wrapper", True)
    args = tiny_args(**FAST)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    seen = []

    def spy(*a, **k):
        seen.append(torch._inductor.config.cpp_wrapper)
        return compiled(*a, **k)
    runner = tg.GraphRunner(model, spy, capture=False)
    schedule, stage, loader = first_stage(args)
    for step in range(2):  # 2 micro-batches a step: the compile run, the capture, then a replay's stand-in
        tg.train_step(model, runner, optimizers, loader.next()[1], step, stage, schedule)
    loader.close()
    assert len(seen) == 4 and not any(seen) and torch._inductor.config.cpp_wrapper


def test_a_capture_that_compiles_anew_is_counted(tiny_args, monkeypatch):
    """A capture during which dynamo compiles a graph (a guard failed on the graph's own tensors: here a stand-in
    compiled model that counts one at its second call, inside a stand-in capture) is counted for the warm-up's log;
    the capture without one is not."""
    import contextlib
    from torch._dynamo.utils import counters
    args = tiny_args(**FAST)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    calls = []

    def recompiling(*a, **k):
        calls.append(1)
        counters["stats"]["unique_graphs"] += len(calls) == 2  # the capture's call: the second
        return compiled(*a, **k)
    for fn, expected in ((compiled, 0), (recompiling, 1)):
        runner = tg.GraphRunner(model, fn, capture=False)
        runner.capture = True  # as on a GPU, from here on
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: type("Graph", (), {"replay": lambda self: None})())
        monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
        schedule, stage, loader = first_stage(args)
        tg.train_step(model, runner, optimizers, loader.next()[1], 0, stage, schedule)  # compile run, then capture
        loader.close()
        assert runner.captures == 1 and runner.compiled_in_capture == expected


def _graph_worker(rank, world_size, args, out, use_runner):
    if use_runner:
        tg.build = with_runner(False, [])
    run = tg.train(args)
    if rank == 0:
        torch.save((run.train_losses, run.val_losses), out)


@pytest.mark.slow
def test_the_runner_on_two_gloo_processes_trains_as_the_usual_launch(tiny_args, tmp_path):
    """Two processes and the sharded n-gram table: the trainer's row cache refilled in place (pull_ngram_rows), the
    graphs' tensors and kept gradients through the reduce-scatters; the same losses as the usual launch's."""
    from distributed import spawn
    common = dict(RECORD_PARTS, batch_size=4 * 128, num_iterations=6, extension_steps=0, extension_window=0, val_every=3)
    results = []
    for use_runner in (False, True):
        out = str(tmp_path / f"{use_runner}.pt")
        spawn(_graph_worker, 2, tiny_args(**common, run_id=f"runner{use_runner}"), out, use_runner)
        results.append(torch.load(out))
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_captured_graphs_train_as_the_usual_launch_on_the_gpu(tiny_args):
    """The tiny record model on the GPU (eager, PyTorch's kernels), 8 steps with graphs captured and replayed against
    the usual launch from the same weights: the same losses to float32 rounding (other kernels may be chosen inside
    a capture), graphs captured for each shape."""
    losses = []
    for capture in (False, True):
        args = tiny_args(**dict(RECORD_PARTS, device="cuda", fp8_head=False))  # FP8 needs 16 | vocab_size
        model, compiled, optimizers, _ = tg.build(args, torch.device("cuda"), 0, 1)
        runner = tg.GraphRunner(model, compiled) if capture else compiled
        files = tg.shard_files(args.train_files, "training")
        schedule = tg.Schedule(args)
        schedule = schedule.with_slots(tg.doc_slots(schedule, files))
        loader = tg.BatchLoader(tg.BatchProducer(files, 0, 1, args.bos_id), schedule.spec_at, torch.device("cuda"))
        run = []
        for step in range(8):
            run.append(tg.train_step(model, runner, optimizers, loader.next()[1], step, schedule.stage_at(step),
                                     schedule).item())
        loader.close()
        losses.append(run)
        if capture:
            assert runner.captures >= 1
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)


def test_a_failed_capture_stops_with_one_line_naming_the_flag(tiny_args, monkeypatch):
    """A capture CUDA refuses (here a stand-in for torch.cuda.graph that raises as CUDA does) stops the run with the
    micro-batch's size and the way around it, --cuda_graphs false."""
    import contextlib
    args = tiny_args(**FAST)
    model, compiled, optimizers, _ = tg.build(args, torch.device("cpu"), 0, 1)
    runner = tg.GraphRunner(model, compiled, capture=False)
    runner.capture = True  # as on a GPU, from here on

    @contextlib.contextmanager
    def refusing(*a, **k):
        raise torch.AcceleratorError("CUDA error: operation not permitted when stream is capturing")
        yield
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", refusing)
    schedule, stage, loader = first_stage(args)
    with pytest.raises(RuntimeError, match=r"--cuda_graphs: capturing the forward and backward of a 128-token "
                                           r"micro-batch failed \(CUDA error: .*\); run with --cuda_graphs false"):
        tg.train_step(model, runner, optimizers, loader.next()[1], 0, stage, schedule)  # 2 micro-batches: the 2nd
    loader.close()
