"""bench/timing.py, the bench scripts' one timing helper, on a fake clock (no GPU here): warm-up calls untimed and
followed by a garbage collection, before() outside the timed span, phases timed apart and chained, back-to-back
calls averaged, ranks started together; and the kernel benches' forward + backward timing built on it."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import timing  # noqa: E402


class Clock:
    """A fake GPU clock in ms: what the code under test spends is added by hand; CUDA events read it."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.t - self.t
        return Event()

    def spend(self, ms, note=None):
        self.now += ms
        if note is not None:
            self.log.append(note)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(torch.cuda, "Event", c.event)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(timing.gc, "collect", lambda: c.log.append("gc"))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: c.now / 1e3)
    return c


def test_each_call_is_timed_alone_after_untimed_warm_up_calls_and_a_garbage_collection(clock):
    durations = iter([50, 40, 30, 1, 2, 3, 4])  # three warm-up calls (compile), then the timed ones
    fn = lambda: clock.spend(next(durations), "call")
    assert timing.cuda_times(fn, 4) == [1, 2, 3, 4]
    assert clock.log == ["call"] * 3 + ["gc"] + ["call"] * 4
    durations = iter([9, 5, 6, 7])
    assert timing.median_ms(lambda: clock.spend(next(durations)), 3, warmup=1) == 6


def test_before_runs_ahead_of_every_call_and_is_not_timed(clock):
    fn = lambda: clock.spend(2, "call")
    assert timing.cuda_times(fn, 2, warmup=1, before=lambda: clock.spend(100, "before")) == [2, 2]
    assert clock.log == ["before", "call", "gc", "before", "call", "before", "call"]


def test_phases_are_timed_apart_and_each_gets_what_the_one_before_returned(clock):
    seen = []

    def forward():
        clock.spend(3)
        return "loss"

    def backward(loss):
        seen.append(loss)
        clock.spend(5)
    assert timing.phase_times([forward, backward], 2, warmup=1) == [[3, 5], [3, 5]]
    assert seen == ["loss"] * 3


def test_back_to_back_calls_are_averaged_on_the_gpu_or_on_the_host_s_clock(clock):
    durations = iter([100] * 3 + [1, 2, 3, 6])
    assert timing.back_to_back_ms(lambda: clock.spend(next(durations)), 4) == 3.0
    assert timing.back_to_back_ms(lambda: clock.spend(0.5), 10, warmup=20, wall=True) == pytest.approx(0.5)


def test_wall_times_start_every_rank_together(clock, monkeypatch):
    monkeypatch.setattr(timing.dist, "barrier", lambda: clock.log.append("barrier"))
    fn = lambda: clock.spend(4, "call")
    assert timing.wall_times(fn, 2, warmup=1, world_size=2) == pytest.approx([4, 4])
    assert clock.log == ["call", "gc", "barrier", "call", "barrier", "call"]
    clock.log.clear()
    timing.wall_times(fn, 2, warmup=0)  # one rank: no barrier
    assert clock.log == ["gc", "call", "call"]


def test_the_fp8_head_bench_times_forward_and_backward_with_fresh_gradients(clock, monkeypatch):
    import ce_kernel
    x, w = torch.ones(4, 3, requires_grad=True), torch.ones(5, 3, requires_grad=True)
    fresh = []

    def fn(x, w, targets, weights):
        fresh.append(x.grad is None and w.grad is None)
        clock.spend(len(fresh))  # the i-th forward takes i ms
        return (x @ w.T).sum()
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self: (backward(self), clock.spend(10)))
    assert ce_kernel.time_fwd_bwd(fn, x, w, None, None, 3) == (15, 5, 10)  # forwards of 4, 5, 6 ms after 3 untimed
    assert fresh == [True] * 6


def test_the_mlp_bench_times_forward_and_backward_with_fresh_gradients(clock):
    import mlp_kernel
    x = torch.ones(4, 3, requires_grad=True)
    fresh = []

    def fn(x):
        fresh.append(x.grad is None)
        clock.spend(len(fresh))
        return x * 2
    assert mlp_kernel.time_fwd_bwd(fn, [x], torch.ones(4, 3), 3) == 5
    assert fresh == [True] * 6 and x.grad is not None


def test_host_times_are_the_hosts_share_of_each_timed_call(clock, monkeypatch):
    """host= gets each timed call's host time until its last launch returned; the GPU's time runs on past it by what
    the GPU still had queued (here a 5 ms tail after each call's 3 ms of launching): a host-bound step shows host ~
    GPU, a GPU-bound one host well under it."""
    make = clock.event

    def event(enable_timing=False):
        e = make(enable_timing)

        def synchronize():  # the GPU finishes 5 ms after the host's last launch
            clock.spend(5)
            e.t = clock.now
        e.synchronize = synchronize
        return e
    monkeypatch.setattr(torch.cuda, "Event", event)
    host = []
    assert timing.cuda_times(lambda: clock.spend(3), 4, warmup=1, host=host) == [8, 8, 8, 8]
    assert host == pytest.approx([3, 3, 3, 3])
    assert timing.cuda_times(lambda: clock.spend(3), 2, warmup=1) == [8, 8]  # host= is optional
