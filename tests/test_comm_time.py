"""bench/comm_time.py's arithmetic: which kernels are communication, and how much of their time no
computing kernel covers (the GPU run itself is a bench, not a test)."""
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import comm_time  # noqa: E402


def test_exposed_time_counts_nccl_time_that_no_computing_kernel_overlaps():
    intervals = [(0, 10, False), (5, 15, True),  # 5 of 10 covered
                 (20, 30, True), (22, 24, False), (26, 27, False),  # 3 of 10 covered
                 (40, 50, True), (45, 55, True),  # two NCCL kernels at once: 15 us, none covered
                 (60, 70, False)]  # compute alone
    total, exposed = comm_time.exposed_time(intervals)
    assert total == 10 + 10 + 15
    assert exposed == 5 + 7 + 15
    assert comm_time.exposed_time([(0, 10, False)]) == (0.0, 0.0)
    assert comm_time.exposed_time([(0, 4, True), (0, 10, False)]) == (4, 0)  # fully hidden


def test_kernel_intervals_reads_the_profilers_kernel_events_only():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "ts": 100, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "ts": 90, "dur": 15},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 80, "dur": 50},
        {"ph": "i", "cat": "kernel", "name": "ncclKernel", "ts": 1}]}
    assert comm_time.kernel_intervals(trace) == [(100.0, 120.0, True), (90.0, 105.0, False)]
    assert comm_time.exposed_time(comm_time.kernel_intervals(trace)) == (20.0, 15.0)


def test_exposed_nccl_time_splits_into_waiting_for_the_other_rank_and_moving_data():
    # one collective: rank 0 arrives at 10, rank 1 at 16; both finish at 20
    nccl = [[(10.0, 20.0)], [(16.0, 20.0)]]
    # rank 0 computes 8-12 (covers 2 us of its wait) and nothing while data moves
    assert comm_time.peer_wait_split(nccl, 0, [(8.0, 12.0)]) == (4.0, 4.0)
    # rank 1 arrived last: no wait; its compute 17-18 covers 1 us of the transfer
    assert comm_time.peer_wait_split(nccl, 1, [(17.0, 18.0)]) == (0.0, 3.0)
    # the k-th kernels pair up across ranks: a second collective where rank 1 waits
    nccl = [[(10.0, 20.0), (30.0, 35.0)], [(16.0, 20.0), (25.0, 35.0)]]
    assert comm_time.peer_wait_split(nccl, 1, []) == (5.0, 4.0 + 5.0)
    assert comm_time.peer_wait_split([[(0.0, 1.0)], []], 0, []) is None  # counts differ: no pairing


def test_exposed_moving_time_splits_by_collective_kind():
    """Which collectives the step waits on: the moving part of each NCCL kernel, exposed, summed by kind."""
    assert [comm_time.nccl_kind(n) for n in ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL",
                                            "ncclDevKernel_AllGather_RING_LL", "ncclDevKernel_SendRecv",
                                            "ncclKernel_AllReduce_RING_LL_Sum_float", "ncclDevKernel_Generic")] == \
        ["ReduceScatter", "AllGather", "SendRecv", "AllReduce", "other"]
    # rank 0: a reduce-scatter 10-20 (rank 1 arrives at 16: 4 us moving), an all-gather 30-40 (rank 1 at 30: 10 us
    # moving, 32-35 covered by compute), a second reduce-scatter 50-52 (both at 50)
    nccl = [[(10.0, 20.0), (30.0, 40.0), (50.0, 52.0)], [(16.0, 20.0), (30.0, 40.0), (50.0, 52.0)]]
    kinds = ["ReduceScatter", "AllGather", "ReduceScatter"]
    by_kind = comm_time.moving_by_kind(nccl, 0, [(32.0, 35.0)], kinds)
    assert by_kind == {"ReduceScatter": 4.0 + 2.0, "AllGather": 7.0}
    assert sum(by_kind.values()) == comm_time.peer_wait_split(nccl, 0, [(32.0, 35.0)])[1]
    assert comm_time.moving_by_kind(nccl, 0, [], kinds[:2]) is None  # a kind for each kernel, or nothing
    assert comm_time.moving_by_kind([[(0.0, 1.0)], []], 0, [], ["AllGather"]) is None


def test_exposed_places_name_the_kernels_around_each_exposed_transfer_and_sum_repeats():
    """Where the step waits on moving data: each collective's exposed moving part, summed over the steps by its kind
    and the computing kernels around it, largest first."""
    # rank 0, two steps: an all-gather after the optimizer's kernel "ns" before the forward's "fwd" (rank 1 arrives at
    # once: 10 us moving, none covered), a reduce-scatter under "bwd" (covered), and a SendRecv 2 us after "ns"
    # with "ns2" covering half of it
    compute = [(0.0, 10.0, "bwd"), (12.0, 20.0, "ns"), (30.0, 40.0, "fwd"), (100.0, 110.0, "bwd"),
               (112.0, 120.0, "ns"), (130.0, 140.0, "fwd"), (61.0, 62.0, "ns2"), (58.0, 59.0, "ns")]
    nccl = [[(2.0, 8.0), (20.0, 30.0), (60.0, 62.0), (102.0, 108.0), (120.0, 130.0)],
            [(2.0, 8.0), (20.0, 30.0), (60.0, 62.0), (102.0, 108.0), (120.0, 130.0)]]
    kinds = ["ReduceScatter", "AllGather", "SendRecv", "ReduceScatter", "AllGather"]
    places = comm_time.exposed_places(nccl, 0, compute, kinds)
    assert places == [(20.0, "AllGather", "ns", "fwd"), (1.0, "SendRecv", "ns", "ns2")]
    # their sum is the exposed moving time (no two NCCL kernels overlap here)
    spans = [(a, b) for a, b, _ in compute]
    assert sum(t for t, *_ in places) == comm_time.peer_wait_split(nccl, 0, spans)[1]
    # a rank that arrives first waits, and waiting is not a place: rank 1 arrives at 20 for rank 0's 25 below
    late = [[(2.0, 8.0), (25.0, 30.0)], [(2.0, 8.0), (20.0, 30.0)]]
    assert comm_time.exposed_places(late, 1, compute[:3], kinds[:2]) == [(5.0, "AllGather", "ns", "fwd")]
    assert comm_time.exposed_places(nccl, 0, compute, kinds[:2]) is None  # a kind for each kernel, or nothing


def test_idle_places_sum_the_gaps_between_the_same_two_kernels_largest_first():
    kernels = [(0, 10, "opt"), (12, 20, "nccl_ag"), (25, 30, "fwd"), (100, 110, "opt"), (111, 120, "nccl_ag"),
               (126, 130, "fwd"), (130, 131, "bwd"), (140, 150, "bwd")]
    assert comm_time.idle_places(kernels) == [(70, "fwd", "opt"), (11, "nccl_ag", "fwd"), (9, "bwd", "bwd"),
                                              (3, "opt", "nccl_ag")]
    assert sum(t for t, *_ in comm_time.idle_places(kernels)) == comm_time.idle_time(kernels)


def test_idle_time_is_the_time_no_kernel_of_any_kind_runs():
    assert comm_time.idle_time([(0, 10, False), (5, 12, True), (20, 30, False), (25, 26, True), (31, 40, True)]) == 8 + 1
    assert comm_time.idle_time([]) == 0.0


def test_collective_bytes_counts_what_each_rank_sends_in_a_ring_and_restores_torch_distributed():
    import torch
    import torch.distributed as dist
    before = {name: getattr(dist, name) for name in comm_time.CollectiveBytes.FULL}
    calls = []
    for name in before:  # stand-ins that only record: no process group on this CPU
        setattr(dist, name, lambda *a, _name=name, **k: calls.append(_name))
    try:
        stand_ins = {name: getattr(dist, name) for name in before}
        with comm_time.CollectiveBytes(world_size=4) as sent:
            full, shard = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(shard, full, op=None, async_op=True)  # 256 bytes in: 3/4 of them sent
            dist.all_gather_into_tensor(full, shard, async_op=True)  # 256 bytes out: 3/4
            dist.all_reduce(torch.zeros(10))  # 40 bytes, two passes: 2 x 3/4
        assert calls == list(before) and sent.sent == 192 + 192 + 60
        assert {name: getattr(dist, name) for name in before} == stand_ins  # put back on exit
    finally:
        for name, fn in before.items():
            setattr(dist, name, fn)


def test_the_exposed_share_is_scaled_to_eight_gpus_by_a_rings_bytes():
    assert comm_time.ring_factor(2) == pytest.approx(1.75) and comm_time.ring_factor(4) == pytest.approx(7 / 6)
    assert comm_time.at_eight(0.02, 2) == "; 3.5% at eight GPUs, the ring's bytes x1.75"
    assert comm_time.at_eight(0.02, 1) == "" and comm_time.at_eight(0.02, 8) == ""


def test_the_split_reads_only_the_durations_of_other_ranks_kernels_not_their_clocks():
    """Each rank's GPU clock reaches the host's through its own process: shifting one rank's timestamps, as a
    different clock offset would, changes no rank's split. Rank 0 arrives at 10, rank 1 at 16; both end at 20."""
    nccl = [[(10.0, 20.0), (30.0, 35.0)], [(16.0, 20.0), (25.0, 35.0)]]
    shifted = [nccl[0], [(a + 3.0, b + 3.0) for a, b in nccl[1]]]  # rank 1's clock 3 us ahead
    assert comm_time.arrival_split(shifted, 0) == comm_time.arrival_split(nccl, 0)
    back = lambda span: span and (span[0] - 3.0, span[1] - 3.0)  # rank 1's own spans, on its own clock
    assert [tuple(map(back, cut)) for cut in comm_time.arrival_split(shifted, 1)] == comm_time.arrival_split(nccl, 1)
    assert comm_time.peer_wait_split(shifted, 0, [(8.0, 12.0)]) == (4.0, 4.0 + 5.0)
    assert comm_time.arrival_split(nccl, 0) == [((10.0, 16.0), (16.0, 20.0)), (None, (30.0, 35.0))]


def test_step_parts_split_kernel_time_into_graph_replays_kernels_launched_alone_and_nccl():
    """A kernel whose launch (by correlation id) is a CUDA-graph launch counts as replayed; the others launched alone
    are summed by the operator that launched them (External id), longest first."""
    def kernel(name, dur, corr, ext=None):
        args = {"correlation": corr} | ({"External id": ext} if ext is not None else {})
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0.0, "dur": dur, "args": args}
    trace = {"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 2}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::_foreach_lerp_", "args": {"External id": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "args": {"External id": 8}},
        kernel("triton_fwd", 30.0, 1), kernel("triton_bwd", 50.0, 1),
        kernel("multi_tensor_apply_kernel", 4.0, 2, 7), kernel("multi_tensor_apply_kernel", 3.0, 3, 7),
        kernel("copy_kernel", 5.0, 4, 8), kernel("fill", 1.0, 5),
        kernel("ncclDevKernel_AllGather_RING_LL", 6.0, 6)]}
    assert comm_time.graph_launched(trace) == {1}
    parts, outside = comm_time.step_parts(trace)
    assert parts == {"graphs": 80.0, "other": 13.0, "nccl": 6.0}
    assert outside == [(7.0, "aten::_foreach_lerp_"), (5.0, "aten::copy_"), (1.0, "(no operator)")]
    assert comm_time.step_parts(trace, top=1)[1] == [(7.0, "aten::_foreach_lerp_")]


def test_variants_name_fields_a_process_can_switch_and_nothing_else():
    assert comm_time.parse_variants("") == [("", set())]
    assert comm_time.parse_variants("defaults; ngram_plan_ahead;ngram_plan_ahead+muon_fused_normuon") == [
        ("defaults", set()), ("ngram_plan_ahead", {"ngram_plan_ahead"}),
        ("ngram_plan_ahead+muon_fused_normuon", {"ngram_plan_ahead", "muon_fused_normuon"})]
    with pytest.raises(SystemExit, match="muon_bf16_comm cannot be switched within one process"):
        comm_time.parse_variants("defaults;muon_bf16_comm")
    import train_gpt as tg
    fields = {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    assert set(comm_time.VARIANT_FIELDS) <= fields  # each one a real field


def test_a_variant_switches_only_the_fields_some_variant_names():
    """ngram_plan_ahead is on by default: in "defaults;muon_fused_normuon" it stays as built in both variants, and
    only the named field is switched; in "defaults;ngram_plan_ahead" the defaults variant runs without it."""
    from types import SimpleNamespace
    model, optimizers = SimpleNamespace(ngram_plan_group="group"), [None, SimpleNamespace(normalized="graph")]
    built = {"ngram_plan_ahead": "group", "muon_fused_normuon": "graph"}
    state = lambda: (model.ngram_plan_group, optimizers[1].normalized)
    comm_time.switch_variant(model, optimizers, built, set(), {"muon_fused_normuon"})
    assert state() == ("group", None)
    comm_time.switch_variant(model, optimizers, built, {"muon_fused_normuon"}, {"muon_fused_normuon"})
    assert state() == ("group", "graph")
    comm_time.switch_variant(model, optimizers, built, set(), {"ngram_plan_ahead", "muon_fused_normuon"})
    assert state() == (None, None)
    comm_time.switch_variant(model, optimizers, built, {"ngram_plan_ahead"}, {"ngram_plan_ahead", "muon_fused_normuon"})
    assert state() == ("group", None)


def test_the_summary_takes_each_variants_median_step_and_each_ranks_means():
    fig = lambda step, moving: dict(step=step, exposed=2 * moving, moving=moving, idle=1.0, alone=7.0)
    seen = {"defaults": [[fig(55.0, 0.5), fig(54.9, 1.0)], [fig(56.0, 0.7), fig(55.9, 1.2)],
                         [fig(55.2, 0.6), fig(55.1, 1.1)]],
            "ngram_plan_ahead": [[fig(54.0, 0.5), fig(53.9, 0.9)]]}
    text = comm_time.summary(seen, 2)
    lines = text.splitlines()
    assert lines[1].startswith("  defaults: step 55.2 (medians 55.0, 56.0, 55.2); exposed 1.20 / 2.20; "
                               "moving 0.60 / 1.10")
    moving_at_eight = 1.75 * (0.5 / 55.0 + 0.7 / 56.0 + 0.6 / 55.2) / 3
    assert f"({moving_at_eight:.1%} / " in lines[1] and "launched alone 7.00 / 7.00" in lines[1]
    assert lines[2].startswith("  ngram_plan_ahead: step 54.0 (medians 54.0)")
