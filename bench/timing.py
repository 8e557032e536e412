"""Timing for the bench/ scripts: a function's calls after untimed warm-up calls, timed one at a time (CUDA events,
or the host's clock where the ranks start together or there is no GPU) or back to back, and their median.

Every helper first makes the warm-up calls (compilation, autotuning, allocation), then waits for the GPU and
collects Python's garbage, so that neither lands in a timed call.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

median = statistics.median


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(fn: Callable, calls: int, before: Callable | None = None):
    """`calls` untimed calls of fn() (each after before(), if given); then the GPU idle and the garbage collected."""
    for _ in range(calls):
        if before is not None:
            before()
        fn()
    _sync()
    gc.collect()


def _run(phases: Sequence[Callable], events: list | None = None):
    """The phases in order, each later one given what the one before returned; with events, one recorded after
    each phase (events[0] is the start)."""
    value = None
    for i, phase in enumerate(phases):
        value = phase() if i == 0 else phase(value)
        if events is not None:
            events[i + 1].record()


def phase_times(phases: Sequence[Callable], iters: int, warmup: int = 3, before: Callable | None = None,
                host: list | None = None) -> list[list[float]]:
    """For each of `iters` runs of the phases (the first called without arguments, each later one with what the
    one before returned), the milliseconds of each phase between CUDA events: the GPU's time from the phase's
    first launch to its last kernel's end. before(), if given, runs ahead of every run, untimed. host, if given,
    gets each run's milliseconds on the host's clock until its last launch returned: near the GPU's time, the run
    waits on the host (the GPU idles between launches); well under it, the host runs ahead."""
    warm_up(lambda: _run(phases), warmup, before)
    out = []
    for _ in range(iters):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
        if before is not None:
            before()
        start = time.perf_counter()
        events[0].record()
        _run(phases, events)
        if host is not None:
            host.append(1000 * (time.perf_counter() - start))
        events[-1].synchronize()
        out.append([a.elapsed_time(b) for a, b in zip(events, events[1:])])
    return out


def cuda_times(fn: Callable, iters: int, warmup: int = 3, before: Callable | None = None,
               host: list | None = None) -> list[float]:
    """Milliseconds of each of `iters` calls of fn() between two CUDA events, after `warmup` untimed calls (host:
    as phase_times')."""
    return [t[0] for t in phase_times([fn], iters, warmup, before, host)]


def median_ms(fn: Callable, iters: int, warmup: int = 3, before: Callable | None = None) -> float:
    """The median of cuda_times."""
    return median(cuda_times(fn, iters, warmup, before))


def back_to_back_ms(fn: Callable, calls: int, warmup: int = 3, wall: bool = False) -> float:
    """Milliseconds per call of `calls` calls of fn() issued back to back, after `warmup` untimed ones: between CUDA
    events, or with `wall` on the host's clock between two synchronizations (what issuing the calls costs where
    the host, not the GPU, is the bottleneck)."""
    warm_up(fn, warmup)
    if wall:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        return (time.perf_counter() - start) * 1e3 / calls
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def wall_times(fn: Callable, iters: int, warmup: int = 3, world_size: int = 1) -> list[float]:
    """Milliseconds of each of `iters` calls of fn() on the host's clock, after `warmup` untimed ones: each call
    starts with the GPU idle and, on several ranks, all of them together (a barrier), and ends when the GPU has
    finished it. Without a GPU, the host's time alone."""
    warm_up(fn, warmup)
    times = []
    for _ in range(iters):
        _sync()
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(1000 * (time.perf_counter() - start))
    return times
