"""Exposed communication of whole training steps on several GPUs (issue 33 item 3):

    torchrun --standalone --nproc_per_node=2 bench/comm_time.py --steps 10 --batch_size 98304 [train_gpt.py flags]

With --batch_size 98304 (2 x 49,152) each of 2 GPUs holds one micro-batch a step, as each of 8 GPUs does in the
record run, so no accumulation hides the communication. Every rank times --steps steps of one stage of the
schedule (--stage, default the last scheduled one), each between a barrier and a synchronize, then profiles
--profile_steps more and reports for each step: its time, the NCCL kernels' time, and the exposed part: NCCL time
during which no other kernel runs on the GPU, so the step waits on the network, split into the time a rank waits
for another to arrive at the collective (uneven work) and the time data moves (that by collective: the
reduce-scatters, the all-gathers, the n-gram table's all-to-all), and the bytes a rank sends a step (as a ring moves
them); where the kernel time goes (the forward and backward replayed from CUDA graphs, the kernels launched on their
own with the operators that take longest, NCCL); then the --places places of the step where data moves exposed the
longest, each by its collective and the kernels the GPU ran before and after it, and the places where the GPU sits
idle the longest (--trace DIR keeps each rank's trace for a timeline viewer). Under --adam_every 2 half the
profiled steps are with Adam, half without. Last, the losses of the steps run since the last measurement (warm-up,
timed and profiled) summed over the ranks: two versions that should compute alike show it at the same seed.
--repeats N measures N times in one process (one compile), to see how much a figure moves between measurements.
--variants "defaults;ngram_plan_ahead;muon_fused_normuon" measures each variant in turn in one process (each repeat
goes through them all): built with every field named on, then switched off where a variant leaves it out. Only
fields whose switch is a plain swap of what build made are accepted (VARIANT_FIELDS); the loss sums then cover
steps of several variants. A field on by default (ngram_plan_ahead) that some variant names is off in the variants
that leave it out, "defaults" among them: there "defaults" means without it."""
import argparse
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402
from profile_compare import kernel_events  # noqa: E402


def kernel_intervals(trace: dict) -> list[tuple[float, float, bool]]:
    """(start, end, is_communication) in microseconds of every GPU kernel of a Chrome trace written by
    torch.profiler (events of category "kernel"; NCCL's kernels are the communication)."""
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), "nccl" in e.get("name", "").lower())
            for e in kernel_events(trace)]


def exposed_time(intervals: list[tuple[float, float, bool]]) -> tuple[float, float]:
    """(communication time, the part of it not covered by any computing kernel), both as lengths of
    unions of intervals: two overlapping NCCL kernels count once."""
    def union(spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    comm = union([(a, b) for a, b, c in intervals if c])
    compute = union([(a, b) for a, b, c in intervals if not c])
    total = sum(b - a for a, b in comm)
    covered, j = 0.0, 0
    for a, b in comm:  # both lists are sorted and disjoint within themselves
        while j < len(compute) and compute[j][1] <= a:
            j += 1
        k = j
        while k < len(compute) and compute[k][0] < b:
            covered += min(b, compute[k][1]) - max(a, compute[k][0])
            k += 1
    return total, total - covered


def kernel_gaps(kernels: list[tuple]) -> list[tuple[float, object, object]]:
    """The stretches no kernel covers, between the first kernel's start and the last one's end: (length, label of the
    kernel that ended last before it, label of the kernel after it) for kernels (start, end, label) in any order. The
    GPU waits on the host there (launches, Python, a CPU wait)."""
    kernels = sorted(kernels)
    if not kernels:
        return []
    gaps, end, before = [], kernels[0][1], kernels[0][2]
    for a, b, label in kernels:
        if a > end:
            gaps.append((a - end, before, label))
        if b >= end:
            end, before = b, label
    return gaps


def idle_time(intervals: list[tuple[float, float, bool]]) -> float:
    """Time during which no kernel of any kind runs, between the first kernel's start and the last one's end."""
    return sum(g for g, _, _ in kernel_gaps(intervals))


def idle_places(kernels: list[tuple[float, float, str]]) -> list[tuple[float, str, str]]:
    """Where the GPU sits idle: kernel_gaps' stretches summed by the kernel before and the kernel after, largest first,
    as (microseconds, before, after) for kernels (start, end, name). A gap before an NCCL kernel or a forward's first
    kernel is the host late with its launches (a host sync, the optimizers' Python)."""
    sums: dict[tuple[str, str], float] = {}
    for length, before, after in kernel_gaps(kernels):
        sums[(before, after)] = sums.get((before, after), 0.0) + length
    return sorted(((t, *key) for key, t in sums.items()), key=lambda x: -x[0])


def arrival_split(nccl_by_rank: list[list[tuple[float, float]]], rank: int) -> list[tuple] | None:
    """Each of this rank's NCCL kernels cut where the last rank arrives: (waiting span or None, moving span or None).
    The ranks launch the same collectives in the same order, so the k-th NCCL kernel of every rank is one collective.
    An NCCL kernel starts when its rank arrives and spins until the last rank does, then moves data, and every rank's
    kernel ends with the transfer: the last rank to arrive waits for nobody, so the shortest of the k-th kernels is
    the transfer, and each rank's kernel moves data for that long before its end. Only durations cross between ranks:
    each rank's GPU clock is converted to the host's by its own process, so their timestamps may disagree by more than
    a transfer lasts (on two H200s, 2026-11-30, the split by timestamps swung by 2 ms between repeats; its sum held).
    None when the ranks' NCCL kernel counts differ."""
    if len({len(k) for k in nccl_by_rank}) != 1:
        return None
    cuts = []
    for k, (start, end) in enumerate(nccl_by_rank[rank]):
        transfer = min(kernels[k][1] - kernels[k][0] for kernels in nccl_by_rank)
        cut = max(start, end - transfer)
        cuts.append(((start, cut) if cut > start else None, (cut, end) if end > cut else None))
    return cuts


def peer_wait_split(nccl_by_rank: list[list[tuple[float, float]]], rank: int,
                    compute: list[tuple[float, float]]) -> tuple[float, float] | None:
    """This rank's exposed NCCL time split in two: (waiting for another rank to arrive, transferring), by
    arrival_split; None when the ranks' NCCL kernels do not pair up."""
    cuts = arrival_split(nccl_by_rank, rank)
    if cuts is None:
        return None
    busy = [(a, b, False) for a, b in compute]
    waiting = [(*span, True) for span, _ in cuts if span]
    moving = [(*span, True) for _, span in cuts if span]
    return exposed_time(waiting + busy)[1], exposed_time(moving + busy)[1]


def nccl_kind(name: str) -> str:
    """The collective an NCCL kernel runs, from its name (ncclDevKernel_ReduceScatter_Sum_f32_RING_LL: ReduceScatter;
    all_to_all's kernels are SendRecv)."""
    found = re.search(r"(AllGather|ReduceScatter|AllReduce|SendRecv|Broadcast|Reduce)", name)
    return found[1] if found else "other"


def moving_by_kind(nccl_by_rank: list[list[tuple[float, float]]], rank: int, compute: list[tuple[float, float]],
                   kinds: list[str]) -> dict[str, float] | None:
    """The exposed part of the time data moves (peer_wait_split's second) per collective kind, kinds[k] the kind of
    this rank's k-th NCCL kernel: which collectives a step waits on."""
    cuts = arrival_split(nccl_by_rank, rank)
    if cuts is None or len(kinds) != len(cuts):
        return None
    busy = [(a, b, False) for a, b in compute]
    return {kind: exposed_time([(*moving, True) for (_, moving), k in zip(cuts, kinds) if moving and k == kind]
                               + busy)[1] for kind in dict.fromkeys(kinds)}


def exposed_places(nccl_by_rank: list[list[tuple[float, float]]], rank: int, compute: list[tuple[float, float, str]],
                   kinds: list[str]) -> list[tuple[float, str, str, str]] | None:
    """Where in the step data moves exposed: for each of this rank's NCCL kernels the moving part (arrival_split's
    second) that no computing kernel covers, summed by (collective kind, the computing kernel the GPU ran last
    before it, the one it runs next), largest first: (microseconds, kind, before, after). compute holds (start,
    end, name). The neighbours' names say which phase of the step waits: the optimizers' math, the all-gathers'
    tail before the next forward, the n-gram rows' exchange. None when the ranks' NCCL kernels do not pair up."""
    cuts = arrival_split(nccl_by_rank, rank)
    if cuts is None or len(kinds) != len(cuts):
        return None
    spans = sorted(compute)
    busy = [(a, b, False) for a, b, _ in spans]
    sums: dict[tuple[str, str, str], float] = {}
    for (_, moving), kind in zip(cuts, kinds):
        if not moving:
            continue
        length = exposed_time([(*moving, True)] + busy)[1]
        if length <= 0:
            continue
        before = max((s for s in spans if s[1] <= moving[0]), key=lambda s: s[1], default=None)
        after = next((s for s in spans if s[0] >= moving[0]), None)
        key = (kind, before[2] if before else "(none)", after[2] if after else "(none)")
        sums[key] = sums.get(key, 0.0) + length
    return sorted(((t, *key) for key, t in sums.items()), key=lambda x: -x[0])


class CollectiveBytes:
    """While active, counts the bytes this rank sends in the collectives train_step launches, as a ring moves them:
    a reduce-scatter or all-gather of a full tensor of n bytes sends n (W - 1) / W per rank, an all-reduce twice
    that. Bytes a step over the time data moves give the link's effective bandwidth; at another GPU count W' the
    same tensors send (W' - 1) / W' of their size."""
    FULL = {"reduce_scatter_tensor": (lambda out, inp, *a, **k: inp, 1),  # (the full tensor, ring passes)
            "all_gather_into_tensor": (lambda out, inp, *a, **k: out, 1),
            "all_reduce": (lambda t, *a, **k: t, 2)}

    def __init__(self, world_size: int):
        self.world_size, self.sent, self.saved = world_size, 0.0, {}

    def __enter__(self):
        share = (self.world_size - 1) / self.world_size
        for name, (tensor_of, passes) in self.FULL.items():
            original = self.saved[name] = getattr(dist, name)

            def counted(*a, _original=original, _tensor_of=tensor_of, _passes=passes, **k):
                t = _tensor_of(*a, **k)
                self.sent += t.numel() * t.element_size() * share * _passes
                return _original(*a, **k)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def ring_factor(world_size: int, to: int = 8) -> float:
    """How many times the bytes a GPU sends in a ring collective grow from world_size GPUs to `to`: (n - 1) / n of
    the data each (x1.75 from two to eight, x7/6 from four)."""
    return ((to - 1) / to) / ((world_size - 1) / world_size)


def at_eight(share: float, world_size: int) -> str:
    """The exposed share of the step scaled to eight GPUs by the ring's bytes, for the line (the figure that says
    whether an 8-GPU step would wait on moving data); nothing on one GPU or on eight."""
    if not 1 < world_size < 8:
        return ""
    factor = ring_factor(world_size)
    return f"; {share * factor:.1%} at eight GPUs, the ring's bytes x{factor:.2f}"


def graph_launched(trace: dict) -> set:
    """The correlation ids of the CUDA-graph launches in a torch.profiler Chrome trace: a kernel with one of these
    was replayed from a graph (train_gpt.GraphRunner's forward and backward), not launched on its own."""
    return {e.get("args", {}).get("correlation") for e in trace.get("traceEvents", [])
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "GraphLaunch" in e.get("name", "")}


def step_parts(trace: dict, top: int = 6) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Where a rank's kernel time goes: {"graphs": the forward and backward replayed from CUDA graphs, "other": every
    kernel launched on its own (the optimizers' math, the n-gram table's planning, the copies), "nccl": the
    collectives} in microseconds, and the `top` operators whose kernels outside the graphs take longest, as
    (microseconds, operator name; a compiled graph's name for Inductor's). At one micro-batch a GPU "other" is
    the step's overhead over its forward and backward; the sharded optimizers' share of it shrinks with more GPUs."""
    graphs = graph_launched(trace)
    owner = {e["args"]["External id"]: e.get("name", "") for e in trace.get("traceEvents", [])
             if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    parts, by_op = {"graphs": 0.0, "other": 0.0, "nccl": 0.0}, {}
    for k in kernel_events(trace):
        dur, args = float(k["dur"]), k.get("args", {})
        if "nccl" in k.get("name", "").lower():
            parts["nccl"] += dur
        elif args.get("correlation") in graphs:
            parts["graphs"] += dur
        else:
            parts["other"] += dur
            op = owner.get(args.get("External id"), "(no operator)")
            by_op[op] = by_op.get(op, 0.0) + dur
    return parts, sorted(((t, op) for op, t in by_op.items()), reverse=True)[:top]


# fields a variant may switch between measurements in one process, and how: what build made for the field, kept,
# and put back or taken away (None) on the model or an optimizer; the training step reads nothing else of them
VARIANT_FIELDS = {"ngram_plan_ahead": (lambda model, opts: model, "ngram_plan_group"),
                  "muon_fused_normuon": (lambda model, opts: opts[1], "normalized")}


def parse_variants(spec: str) -> list[tuple[str, set[str]]]:
    """--variants "defaults;a;a+b": each variant's name and the fields it switches on (defaults: none)."""
    variants = []
    for name in (v.strip() for v in spec.split(";") if v.strip()):
        fields = set() if name == "defaults" else set(name.split("+"))
        unknown = sorted(fields - set(VARIANT_FIELDS))
        if unknown:
            raise SystemExit(f"comm_time.py: --variants {spec!r}: {', '.join(unknown)} cannot be switched within one "
                             f"process; switchable: {', '.join(VARIANT_FIELDS)} (run a process per value of any "
                             f"other field)")
        variants.append((name, fields))
    return variants or [("", set())]


def switch_variant(model, optimizers, built: dict, fields: set[str], named: set[str]) -> None:
    """Put one variant in place: each field some variant names (named) as build made it where this variant names it
    (fields), taken away (None) where it does not; a field no variant names keeps what build made (its flag)."""
    for field in named:
        owner, attr = VARIANT_FIELDS[field]
        setattr(owner(model, optimizers), attr, built[field] if field in fields else None)


def summary(seen: dict[str, list[list[dict]]], world_size: int) -> str:
    """One line per variant over its measurements: rank 0's step medians (their median), and per rank the mean of
    the exposed time, of its moving part (also at eight GPUs, in % of the step), of the GPU's idle time and of the
    kernels launched alone, in ms a step."""
    out = ["summary, per variant over its measurements (ms a step; per rank: rank 0 / 1 / ...):"]
    for name, runs in seen.items():
        steps = [r[0]["step"] for r in runs]
        mean = lambda key, f=lambda x: x: " / ".join(f"{f(statistics.fmean(r[i][key] for r in runs)):.2f}"
                                                      for i in range(world_size))
        factor = ring_factor(world_size) if 1 < world_size < 8 else 1.0
        at8 = " / ".join(f"{statistics.fmean(factor * r[i]['moving'] / r[i]['step'] for r in runs):.1%}"
                         for i in range(world_size))
        out.append(f"  {name or 'this run'}: step {statistics.median(steps):.1f} (medians "
                   f"{', '.join(f'{x:.1f}' for x in steps)}); exposed {mean('exposed')}; moving {mean('moving')} "
                   f"({at8} at eight); GPU idle {mean('idle')}; launched alone {mean('alone')}")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup untimed ones)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile_steps", type=int, default=8, help="steps profiled after the timed ones (even: "
                        "as many with Adam as without under --adam_every 2)")
    parser.add_argument("--stage", type=int, default=-1, help="which stage of the schedule (0-based; default: "
                        "the last scheduled stage, the one with the longest windows)")
    parser.add_argument("--places", type=int, default=5, help="print the N places of the step where data moves "
                        "exposed the longest, each by its collective and the kernels around it (exposed_places), and "
                        "the N where the GPU sits idle the longest (idle_places)")
    parser.add_argument("--trace", default="", help="a folder: write each rank's profiled steps there as a Chrome "
                        "trace (comm_trace_rank{R}.json.gz), to read the timeline in Perfetto")
    parser.add_argument("--repeats", type=int, default=1, help="measure N times in one process (one compile): the "
                        "timed and profiled steps again, each measurement printed")
    parser.add_argument("--variants", default="", help="variants measured in turn in one process, ';'-separated: "
                        f"'defaults' or '+'-joined fields of {', '.join(VARIANT_FIELDS)}")
    own, rest = parser.parse_known_args()
    args = tg.parse_args(rest)
    variants = parse_variants(own.variants)
    named = set().union(*(fields for _, fields in variants))
    for field in named:  # built on; switched off where left out
        setattr(args, field, True)
    rank, world_size, device = tg.start_processes(args)
    schedule = tg.Schedule(args)
    model, compiled, optimizers, chosen = tg.build(args, device, rank, world_size, schedule=schedule)
    built = {field: getattr(owner(model, optimizers), name) for field, (owner, name) in VARIANT_FIELDS.items()}
    attention = chosen.attention
    stage = schedule.stages[own.stage if own.stage >= 0 else len(args.stages) - 1]
    if stage.start >= schedule.untie and model.tied_embed:
        tg.untie_embedding(model, optimizers[0])
    tg.tie_embedding_at(model, stage.start, schedule.untie)
    files = tg.shard_files(args.train_files, "training")
    producer = tg.BatchProducer(files, rank, world_size, args.bos_id)
    # cu_seqlens as long as the training run's for this shape (and long enough for the batches read here)
    reads = own.repeats * len(variants) * (own.warmup + own.steps + own.profile_steps) + tg.LOADER_READ_AHEAD
    slots = tg.doc_slots(schedule, files, plans=[[stage.spec] * reads])
    stage = stage.with_slots(slots)
    loader = tg.BatchLoader(producer, lambda s: stage.spec, device, start_step=stage.start)  # run_step's steps
    step, losses = stage.start, []

    def run_step():
        nonlocal step
        micro = loader.next()[1]
        ahead = loader.peek() if model.plans_ahead() else None  # the next step's first micro-batch, as the trainer
        losses.append(tg.train_step(model, compiled, optimizers, micro, step, stage, schedule, ahead))
        step += 1

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # the CPU: a plumbing check only
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def measure(label: str, tag: str):
        """Time --steps steps, profile --profile_steps more, print every rank's lines (rank 0) after label; the
        trace's file name ends with tag."""
        times = timing.wall_times(run_step, own.steps, own.warmup, world_size)  # garbage collected first
        sync()
        if world_size > 1:
            dist.barrier()
        with profile(activities=activities) as prof, CollectiveBytes(world_size) as sent:
            for _ in range(own.profile_steps):
                run_step()
            sync()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"trace{rank}.json")
            prof.export_chrome_trace(path)
            trace = json.loads(Path(path).read_text())
            if own.trace:
                Path(own.trace).mkdir(parents=True, exist_ok=True)
                with gzip.open(Path(own.trace) / f"comm_trace_rank{rank}{tag}.json.gz", "wt") as f:
                    f.write(Path(path).read_text())
        intervals = kernel_intervals(trace)
        comm, exposed = exposed_time(intervals)
        base = trace.get("baseTimeNanoseconds", 0) / 1e3  # microseconds since the epoch on this rank's clock
        nccl = [[(base + a, base + b) for a, b, c in intervals if c]]  # every rank's, on rank `rank` at index `rank`
        if world_size > 1:
            mine, nccl = nccl[0], [None] * world_size
            dist.all_gather_object(nccl, mine)
        busy = [(base + a, base + b) for a, b, c in intervals if not c]
        split = peer_wait_split(nccl, rank, busy)
        kinds = [nccl_kind(e.get("name", "")) for e in kernel_events(trace) if "nccl" in e.get("name", "").lower()]
        by_kind = moving_by_kind(nccl, rank, busy, kinds)
        spans = [(base + float(e["ts"]), base + float(e["ts"]) + float(e["dur"]), e.get("name", "")[:70])
                 for e in kernel_events(trace)]  # every kernel, named (NCCL's begin "nccl")
        places = exposed_places(nccl, rank, [s for s in spans if "nccl" not in s[2].lower()], kinds) or []
        idle = idle_places(spans)
        n = own.profile_steps
        med = statistics.median(times)
        total = torch.stack(losses).sum()  # every step's loss since the last measurement on every rank: the same
        if world_size > 1:                 # seed gives the same sum, but for nondeterministic reductions
            dist.all_reduce(total)
        parts, outside = step_parts(trace)
        line = (f"{label}rank {rank}/{world_size}: stage windows {stage.windows}, {stage.spec.batch_size:,} tokens a "
                f"step, {stage.spec.batch_size // stage.spec.seq_len // world_size} micro-batch(es) a GPU, "
                f"attention {attention}: "
                f"step median {med:.1f} ms (min {min(times):.1f}, max {max(times):.1f}, {own.steps} steps); "
                f"profiled {n} steps: NCCL {comm / n / 1e3:.2f} ms a step, exposed {exposed / n / 1e3:.2f} ms a step "
                f"({exposed / n / 1e3 / med:.1%} of the median step)" +
                (f": {split[0] / n / 1e3:.2f} ms waiting for another rank to arrive, {split[1] / n / 1e3:.2f} ms "
                 f"moving data ({split[1] / n / 1e3 / med:.1%}{at_eight(split[1] / n / 1e3 / med, world_size)})"
                 if split else ": the ranks' NCCL kernels do not pair up") +
                (", by collective: " + ", ".join(f"{k} {t / n / 1e3:.2f} ms" for k, t in by_kind.items())
                 if by_kind else "") +
                f"; sent {sent.sent / n / 1e6:.1f} MB a step (ring)" +
                f"; GPU idle {idle_time(intervals) / n / 1e3:.2f} ms a step, {len(intervals)} kernels"
                f"; loss sum {total.item():.4f} over {len(losses)} steps, all ranks")
        losses.clear()
        line += (f"\n  kernels a step: {parts['graphs'] / n / 1e3:.2f} ms replayed from the graphs, "
                 f"{parts['other'] / n / 1e3:.2f} ms launched on their own, {parts['nccl'] / n / 1e3:.2f} ms NCCL; "
                 "the longest outside the graphs: " +
                 (", ".join(f"{op[:60]} {t / n / 1e3:.3f} ms" for t, op in outside) or "none"))
        line += "".join(f"\n  {t / n / 1e3:.3f} ms a step: {kind} after {before} / before {after}"
                        for t, kind, before, after in places[:own.places])
        line += "".join(f"\n  {t / n / 1e3:.3f} ms a step: GPU idle after {before} / before {after}"
                        for t, before, after in idle[:own.places])
        figures = dict(step=med, exposed=exposed / n / 1e3, moving=split[1] / n / 1e3 if split else float("nan"),
                       idle=idle_time(intervals) / n / 1e3, alone=parts["other"] / n / 1e3)
        lines = [(line, figures)]
        if world_size > 1:
            lines = [None] * world_size
            dist.all_gather_object(lines, (line, figures))
        if rank == 0:
            print("\n".join(text for text, _ in lines), flush=True)
        return [f for _, f in lines]

    if rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"device: {name}, torch {torch.__version__}", flush=True)
    seen: dict[str, list] = {}  # variant -> its measurements, each every rank's figures
    for k in range(own.repeats):
        for name, fields in variants:
            if own.variants:
                switch_variant(model, optimizers, built, fields, named)
            label = (f"measurement {k + 1}/{own.repeats}" if own.repeats > 1 else "") + (f" {name}" if name else "")
            tag = (f"_{k + 1}" if own.repeats > 1 else "") + (f"_{name.replace('+', '_')}" if name else "")
            seen.setdefault(name, []).append(measure(f"{label.strip()}: " if label.strip() else "", tag))
    if rank == 0 and sum(len(v) for v in seen.values()) > 1:
        print(summary(seen, world_size), flush=True)
    loader.close()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
