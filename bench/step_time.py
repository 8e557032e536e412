"""Time full training steps of train_gpt.py on one GPU at one or more attention window sizes, and
optionally show where the time goes (torch.profiler: top kernels by GPU time, kernel time by kind of work).

    python bench/step_time.py --ws 3 7 11 --steps 20 [--profile] [any train_gpt.py --field value ...]
    python bench/step_time.py --stages --steps 20 [--preset record ...]   # each stage of the schedule
    python bench/step_time.py --stages "window=3,share=1;window=11,share=1" ... # each stage of that stage table
    python bench/step_time.py --ws 11 --swap 'RELU2_FP8_TILES={...}' --rounds 3 ... # kernels.py's table against
                                                                              # another, in turns, in one process
    python bench/step_time.py --ws 3 --profile --trace ws3.json.gz ...        # + the GPU's idle gaps (and what the
                                                                              # host did in them), step by step, and
                                                                              # each kernel against the ceilings

A step is the whole optimizer step of the configured global batch (8 micro-batches of 49,152
tokens by default, accumulated on one GPU): forward, backward, Muon and Adam. Times are CUDA-event
medians (and means: with --adam_every > 1 the steps alternate) after compile and warm-up steps. --ws
times the first stage's targets at each window; --stages times every stage of the resolved schedule at
its own batch, windows, extra targets and tied or untied embedding, then sums the schedule's training time at
those mean step times (`--num_iterations 760`: that schedule's one-GPU time, beside bench/side_by_side.py's
public schedule time measured in the same session) and prints them as train_gpt.py's STEP_US_PER_TOKEN entries
(SAMPLED_US_PER_TOKEN's for a stage whose timed steps sample the softmax). --swap times kernels.py as it is (A)
and with some of its module-level settings replaced (B: tile tables its custom ops read at each call, not compiled
into the model's graphs), A B B A ... over --rounds rounds after one compile, and prints B / A with its interval;
--graphs_ab does the same with the usual launch (A) and train_gpt.GraphRunner's replays (B, --cuda_graphs)."""
import argparse
import ast
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402
from comm_time import kernel_gaps  # noqa: E402
from profile_compare import (by_kind, kernel_events, kernels_from_averages, kernels_from_trace,  # noqa: E402
                             kinds_report, load_trace)
from side_by_side import interval95  # noqa: E402
import roofline  # noqa: E402

START = time.perf_counter()  # after the imports: the script's own clock, where a run's minutes go before its steps


def spans(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of Chrome-trace complete events."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")) for e in events]


def idle_report(trace: dict, steps: int, top: int = 12) -> str:
    """Where the GPU waited on the host in a torch.profiler Chrome trace: the span from the first kernel's start
    to the last one's end, the part of it no kernel covers, and the longest such gaps with the kernels around
    them (a gap before a kernel is host time: Python, launches, or a wait on the CPU), each with what the host did
    meanwhile (host_during)."""
    events = kernel_events(trace)
    if not events:
        return "trace: no GPU kernels"
    kernels = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), i) for i, e in enumerate(events)]  # i: sortable
    gaps = [(g, events[i], events[j]) for g, i, j in kernel_gaps(kernels)]
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    idle = sum(g for g, _, _ in gaps)
    lines = [f"trace: {len(kernels)} kernels over {span / 1e3 / steps:.1f} ms a step; GPU idle {idle / 1e3 / steps:.1f} "
             f"ms a step ({idle / span:.1%}) in {len(gaps)} gaps; longest:"]
    explain = host_during(trace)
    for g, a, b in sorted(gaps, key=lambda gap: -gap[0])[:top]:
        lines.append(f"  {g / 1e3:8.3f} ms after {a.get('name', '')[:70]} / before {b.get('name', '')[:70]}")
        lines.append(f"           {explain(a, b)}")
    return "\n".join(lines)


BLOCKING = ("Synchronize", "Memcpy")  # CUDA runtime calls in which the host may wait for the GPU (.item(), unique)


def host_during(trace: dict):
    """explain(kernel before a gap, kernel after it) -> one line: when the host launched the kernel after the gap,
    relative to the gap's start (late: the GPU waited for that launch), from which operator (the innermost
    profiled op around the launch, and the innermost record_function range), and the CUDA calls that held the host
    during the gap (synchronizations, copies to the host: a sync drains the GPU's queue, then the host must refill
    it), with their operators. From the trace's CPU events ("cpu_op", "user_annotation", "cuda_runtime"), which
    name a kernel's launch by its "correlation" argument."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    launches = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    ops = defaultdict(list)  # (thread, category) -> its operators and ranges
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e.get("tid"), e["cat"]].append(e)
    waits = [e for e in runtime if any(word in e.get("name", "") for word in BLOCKING)]
    start, end = (lambda e: float(e["ts"])), (lambda e: float(e["ts"]) + float(e["dur"]))

    def around(e: dict, cat: str) -> str:
        """The shortest event of category cat on e's thread that contains e's start: the innermost."""
        inside = [o for o in ops[e.get("tid"), cat] if start(o) <= start(e) <= end(o)]
        return min(inside, key=lambda o: float(o["dur"]))["name"] if inside else "-"

    def where(e: dict) -> str:
        op, annotation = around(e, "cpu_op"), around(e, "user_annotation")
        return op if annotation == "-" else f"{op} in {annotation}"

    def explain(before: dict, after: dict) -> str:
        a, b = end(before), start(after)
        parts = []
        launch = launches.get(after.get("args", {}).get("correlation"))
        if launch is not None:
            parts.append(f"launched {(start(launch) - a) / 1e3:+.3f} ms from the gap's start by {where(launch)}")
        held = sorted(((min(end(w), b) - max(start(w), a), w) for w in waits if start(w) < b and end(w) > a),
                      key=lambda hw: -hw[0])
        parts += [f"host in {w['name']} {t / 1e3:.3f} ms ({where(w)})" for t, w in held[:2]]
        return "; ".join(parts) or "no host events around it"
    return explain


def step_report(trace: dict, top: int = 5) -> str:
    """Each profiled step on its own, from the GPU ranges of its record_function (`step N`, `step N (Adam)`: the
    Chrome trace's "gpu_user_annotation" events): its span on the GPU, the kernel time by kind of work within it,
    the idle time and the longest gaps. With adam_every 2 the steps alternate: the Adam step's extra time shows
    here as kernels (work) or as idle time (the GPU waiting on the host)."""
    steps = sorted(spans([e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                          and e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("step ")]))
    if not steps:
        return "trace: no per-step GPU ranges (gpu_user_annotation events): no per-step split"
    kernels = kernel_events(trace)
    lines = []
    for a, b, name in steps:
        mine = [e for e in kernels if a <= float(e["ts"]) < b]
        busy = kernels_from_trace({"traceEvents": mine})
        gaps = kernel_gaps(spans(mine))
        idle = sum(g for g, _, _ in gaps)
        kinds = ", ".join(f"{kind} {ms:.1f}" for kind, ms in sorted(by_kind(busy, 1).items(), key=lambda kv: -kv[1]))
        lines.append(f"{name}: {(b - a) / 1e3:.1f} ms on the GPU, {len(mine)} kernels, idle {idle / 1e3:.1f} ms in "
                     f"{len(gaps)} gaps; kernel ms by kind: {kinds}")
        lines += [f"  {g / 1e3:8.3f} ms after {x[:70]} / before {y[:70]}" for g, x, y in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines)


def plan_entries(device_name: str, preset: str, rows: list[tuple[int, int, int, int | None, int, float]]
                 ) -> list[str]:
    """--stages' measured stages as train_gpt.py's entries (what --plan projects from): key (GPU kind, preset,
    micro-batch tokens, document cut, long window in blocks), STEP_US_PER_TOKEN's for the full softmax, plus the
    candidates for SAMPLED_US_PER_TOKEN's; value mean us per token. rows: (seq_len, max_doc_len, long window in
    blocks, the sampled softmax's rows at the timed steps (0: full; None: they mixed both, no entry), tokens per
    step, mean ms per step), one per stage; a key measured twice (the extension's window, say) keeps its first."""
    kind = next((k for k in ("H100", "H200", "B200", "A100") if k in device_name), device_name)
    seen = {}
    for seq_len, doc_len, window, candidates, batch, ms in rows:
        if candidates is not None:
            key = (kind, preset, seq_len, doc_len, window) + ((candidates,) if candidates else ())
            seen.setdefault(key, ms * 1000 / batch)
    return [f"    {key!r}: {us:.3f}," for key, us in seen.items()]


def stage_runs(schedule: tg.Schedule) -> list[tuple[str, tg.Stage, int]]:
    """--stages: each stage's name with its first and last training step, the stage, and its training steps (the
    last stage's end is the final validation's step, which trains nothing)."""
    out = []
    for i, st in enumerate(schedule.stages):
        steps = sum(tg.softmax_steps(schedule, st))
        out.append((f"stage {i + 1} (steps {st.start}-{st.start + steps - 1})", st, steps))
    return out


def timed_candidates(schedule: tg.Schedule, stage: tg.Stage, first: int, steps: int) -> int | None:
    """The sampled softmax's rows at the timed steps first .. first + steps - 1 of a stage (Schedule.candidates_at:
    0 for the full softmax, as in the extension after the switch), None where they cross the switch (both)."""
    rows = {schedule.candidates_at(s, stage) for s in range(first, first + steps)}
    return rows.pop() if len(rows) == 1 else None


def swap_summary(window: str, a: list[float], b: list[float], swap: list[str]) -> str:
    """--swap's line for one window: each run's median step (ms) of A and B, and B / A from their paired runs (the
    i-th B against the i-th A) as a mean with a 95% t interval where there are two pairs or more."""
    ratios = [y / x for x, y in zip(a, b)]
    mean, half = interval95(ratios)
    line = (f"swap {window}: A {' '.join(f'{x:.1f}' for x in a)} ms; B {' '.join(f'{y:.1f}' for y in b)} ms; "
            f"B / A {mean:.4f}")
    if len(ratios) > 1:
        line += f" +- {half:.4f} (95% t, {len(ratios)} pairs)"
    return line + f"; B: {' '.join(swap)}"


def memory_fraction(gib: float, total_bytes: int) -> float:
    """--memory_gib as the fraction of the GPU's memory that set_per_process_memory_fraction takes."""
    if not 0 < gib * 2**30 <= total_bytes:
        raise SystemExit(f"step_time.py: error: --memory_gib {gib:g}: this GPU has {total_bytes / 2**30:.1f} GiB; give "
                         "a cap above 0 and at most that")
    return gib * 2**30 / total_bytes


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, tg.Hyperparameters]:
    """This script's own flags and train_gpt.py's (every other flag). `--stages TABLE` is both: per-stage timing of
    that stage table (train_gpt.py's --stages, which the flag would otherwise shadow); own.stages is None without
    --stages, "" for the preset's table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ws", type=int, nargs="+", default=[3], help="long windows in blocks of 128 tokens, "
                        "each timed in turn")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    parser.add_argument("--profile", action="store_true", help="profile two extra steps at the last ws and print "
                        "the top kernels and every kernel's time by kind of work")
    parser.add_argument("--trace", default="", help="with --profile: also write the profile's Chrome trace here "
                        "(.json.gz) and print where the GPU sat idle between kernels, its kernel time by kind of work, and each "
                        "kernel's bytes and FLOPs against this GPU's copy and matmul rates (bench/roofline.py)")
    parser.add_argument("--memory_gib", type=float, default=0.0, help="cap this process's GPU memory at this many GiB "
                        "(torch.cuda.set_per_process_memory_fraction): a larger GPU standing in for a smaller one, "
                        "80 for an 80 GB H100 on an H200; a step that needs more fails with CUDA's out-of-memory error")
    parser.add_argument("--stages", nargs="?", const="", default=None, metavar="TABLE",
                        help="time each stage of the resolved schedule (its batch, windows, extra targets, embedding "
                        "tied or not) instead of --ws; with TABLE, of that stage table (train_gpt.py's --stages)")
    parser.add_argument("--swap", nargs="+", default=[], metavar="NAME=VALUE",
                        help="kernels.py settings to time against its own (a Python literal each, e.g. "
                        "'RELU2_FP8_BACKWARD_TILES={\"BLOCK_M\": 128, ...}'): runs in turns A B B A ..., each with its "
                        "own warm-up steps")
    parser.add_argument("--graphs_ab", action="store_true",
                        help="time the compiled model's usual launch (A) against train_gpt.GraphRunner's replays (B, "
                        "--cuda_graphs) in turns, as --swap does")
    parser.add_argument("--rounds", type=int, default=2,
                        help="with --swap or --graphs_ab: rounds of A B (or B A) at each window")
    own, rest = parser.parse_known_args(argv)
    own.swapped = {}  # --swap as {kernels.py setting: its value in B}
    for item in own.swap:
        name, _, value = item.partition("=")
        if not hasattr(tg.kernels, name):
            parser.error(f"--swap {item!r}: kernels.py has no setting {name!r}")
        try:
            own.swapped[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parser.error(f"--swap {item!r}: the value is not a Python literal")
    if (own.swap or own.graphs_ab) and (own.stages is not None or own.profile):
        parser.error("--swap and --graphs_ab time --ws runs; leave out --stages and --profile")
    return own, tg.parse_args(rest + (["--stages", own.stages] if own.stages else []))


def main():
    own, args = parse()
    per_stage = own.stages is not None  # --stages, with or without a table
    device = torch.device("cuda", torch.cuda.current_device())  # with an index: the memory cap takes no bare "cuda"
    if own.memory_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(memory_fraction(own.memory_gib, total), device)
        print(f"GPU memory capped at {own.memory_gib:g} GiB of {total / 2**30:.1f}", flush=True)
    if own.trace:  # Inductor's kernels carry the bytes they move into the profile (bench/roofline.py): set before
        torch._inductor.config.benchmark_kernel = True  # the first compile (it changes the compile cache's key)
    schedule = tg.Schedule(args)
    built = time.perf_counter()
    model, compiled, optimizers, chosen = tg.build(args, device, 0, 1, schedule=schedule)
    print(f"clock: {built - START:.1f} s to the build, the build {time.perf_counter() - built:.1f} s", flush=True)
    attention, fp8 = chosen.attention, chosen.fp8_head
    files = tg.shard_files(args.train_files, "training")
    producer = tg.BatchProducer(files, 0, 1, args.bos_id)
    spec = tg.BatchSpec(args.batch_size, args.seq_len, args.max_doc_len)
    step, stage = 0, None

    losses = []
    # --graphs_ab: the runner around the same compiled model (its replays and the usual launch share the compile)
    if own.graphs_ab:
        usual = compiled.compiled if isinstance(compiled, tg.GraphRunner) else compiled
        launch = {"A": usual, "B": tg.GraphRunner(model, usual)}
    else:
        launch = {"A": compiled, "B": compiled}
    variant = "A"

    def run_step():
        nonlocal step
        _, micro = loader.next()
        ahead = loader.peek() if model.plans_ahead() else None  # the next step's first micro-batch, as the trainer
        losses.append(tg.train_step(model, launch[variant], optimizers, micro, step, stage, schedule, ahead))
        step += 1

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, attention: {attention}, "
          f"LM head: {'fp8' if fp8 else 'bf16'}")
    if per_stage:
        runs = [(name, st) for name, st, _ in stage_runs(schedule)]
    else:  # --ws: the first stage's extra targets at each long window
        runs = [(f"ws={ws}", dataclasses.replace(schedule.stages[0], spec=spec,
                                                 windows=tg.window_tokens(ws, args.window_block))) for ws in own.ws]
    # --swap: each window's run in turns A B B A A B ..., B with the swapped settings (variants[name])
    own_settings = {name: getattr(tg.kernels, name) for name in own.swapped}
    variants = {}
    if own.swap or own.graphs_ab:
        turns = [v for r in range(own.rounds) for v in (("A", "B") if r % 2 == 0 else ("B", "A"))]
        runs = [(f"{name} {v}{i // 2 + 1}", stage) for name, stage in runs for i, v in enumerate(turns)]
        variants = {name: name.split()[-1][0] for name, _ in runs}
    times_of = defaultdict(list)  # --swap: (window, variant) -> each run's median ms
    per_run = own.warmup + own.steps  # batches each timed run reads; the loader prefetches, so its plan is fixed here
    # the graph runners' replays launch kernels the trace ties to no operator: two steps more, launched as usual, size them
    sizing = bool(own.profile and own.trace) and isinstance(compiled, tg.GraphRunner)
    reads = per_run * len(runs) + 2 * own.profile + 2 * sizing + tg.LOADER_READ_AHEAD  # --profile: two steps more
    plan = [runs[min(i // per_run, len(runs) - 1)][1].spec for i in range(reads)]
    # cu_seqlens as long as the training run's for the same shapes (and long enough for the batches read here)
    slots = tg.doc_slots(schedule, files, print, plans=[plan])
    runs = [(name, stage.with_slots(slots)) for name, stage in runs]
    loader = tg.BatchLoader(producer, lambda i: runs[min(i // per_run, len(runs) - 1)][1].spec, device)
    whole_ms, tokens = 0.0, 0  # --stages: the schedule's training time at the measured mean step times
    plan_rows = []  # --stages: (seq_len, doc cut, long window in blocks, candidates, tokens per step, mean ms)
    for name, stage in runs:
        if per_stage:
            step = stage.start  # the stage's own weights of its extra targets (and learning rate)
            if model.tied_embed and stage.start >= schedule.untie:
                tg.untie_embedding(model, optimizers[0])
            tg.tie_embedding_at(model, stage.start, schedule.untie)
        spec = stage.spec
        if variants:
            variant = variants[name]
            for key, value in (own.swapped if variant == "B" else own_settings).items():
                setattr(tg.kernels, key, value)
        candidates = timed_candidates(schedule, stage, step + own.warmup, own.steps)
        # cuda_times collects the compile's garbage after the warm-up: not in a timed step (as train_gpt.py does)
        host = []  # each step's host time until its last launch: near the step's, the host bound it or a full launch queue
        began = time.perf_counter()
        times = timing.cuda_times(run_step, own.steps, own.warmup, host=host)
        print(f"clock: {name}: {own.warmup} warm-up steps (the compile's) and {own.steps} timed steps in "
              f"{time.perf_counter() - began:.1f} s, {time.perf_counter() - START:.1f} s since the start", flush=True)
        med, mean = statistics.median(times), statistics.fmean(times)
        if variants:
            times_of[name.rsplit(" ", 1)[0], variants[name]].append(med)
        trained = sum(tg.softmax_steps(schedule, stage))
        whole_ms += trained * mean
        tokens += trained * spec.batch_size
        plan_rows.append((spec.seq_len, spec.max_doc_len, stage.windows[0] // args.window_block, candidates,
                          spec.batch_size, mean))
        rows = "sampled and full" if candidates is None else f"{candidates:,} rows" if candidates else "full"
        print(f"{name}: step of {spec.batch_size:,} tokens, windows {stage.windows}, softmax {rows}: "
              f"median {med:.1f} ms, mean {mean:.1f} (min {min(times):.1f}, max {max(times):.1f}) over {own.steps} "
              f"steps; host {statistics.median(host):.1f} ms of it launching (median); "
              f"{spec.batch_size / mean * 1e3:,.0f} tokens/s; "
              f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; loss per micro-batch over them "
              f"{torch.stack(losses[-own.steps:]).mean().item() / (spec.batch_size // spec.seq_len):.4f}, the "
              f"steps' losses summed since the start {torch.stack(losses).sum().item():,.3f}", flush=True)
    for key, value in own_settings.items():  # kernels.py as it was
        setattr(tg.kernels, key, value)
    for window in dict.fromkeys(w for w, _ in times_of):
        print(swap_summary(window, times_of[window, "A"], times_of[window, "B"],
                           own.swap + (["the graph runner (--cuda_graphs)"] if own.graphs_ab else [])), flush=True)
    if per_stage:
        print(f"schedule: {args.num_iterations} steps, {tokens:,} tokens: {whole_ms / 1000:.1f} s of training "
              f"steps on this GPU at these mean step times", flush=True)
        print("as train_gpt.py's STEP_US_PER_TOKEN / SAMPLED_US_PER_TOKEN (key's last: candidates) entries (--plan's "
              "projection; a stage mixing both softmaxes has none):", *plan_entries(
            torch.cuda.get_device_name(), args.preset, plan_rows), sep="\n", flush=True)
    if own.profile:
        from torch.profiler import ProfilerActivity, profile, record_function
        sizes = None
        if sizing:  # the same compiled model on the runner's path with no capture: its compile run's launches
            graphs, launch = launch, {"A": tg.GraphRunner(model, compiled.compiled, capture=False)}
            variant = "A"
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as usual:
                for _ in range(2):
                    run_step()
                torch.cuda.synchronize()
            twin = Path(own.trace).with_name("usual_" + Path(own.trace).name)  # kept beside the trace
            usual.export_chrome_trace(str(twin))
            sizes = load_trace(str(twin))
            launch = graphs
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=bool(own.trace)) as prof:
            for _ in range(2):  # (counted in `reads`); one of them an Adam step where adam_every is 2
                with record_function(f"step {step}" + (" (Adam)" if schedule.adam_steps_at(step) else "")):
                    run_step()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        print(averages.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90))
        trace = None
        if own.trace:
            prof.export_chrome_trace(own.trace)
            trace = load_trace(own.trace)
            print(idle_report(trace, 2))
            print(step_report(trace))
        # every kernel by kind of work, not only the table's rows
        print(kinds_report(kernels_from_trace(trace) if trace else kernels_from_averages(averages), 2), flush=True)
        if trace:
            ceilings = roofline.measure_ceilings(device)
            print("each kernel against this GPU's ceilings (bench/roofline.py): the bytes and FLOPs it moves, its time at "
                  "those rates, and how far over it runs" + (" (the graph runners' kernels sized by name from two steps "
                  "launched as usual)" if sizes else ""), roofline.report(roofline.borrow_sizes(
                      roofline.roofline(trace, ceilings), roofline.roofline(sizes, ceilings) if sizes else []), 2,
                      ceilings), sep="\n", flush=True)
    loader.close()


if __name__ == "__main__":
    main()
