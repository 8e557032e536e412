"""Each kernel of a profiled step against the GPU's ceilings: the bytes and FLOPs it must move, the time those take at
the copy and matmul ceilings, and how far over that time it runs. This is what to fuse or delete next.

    python bench/roofline.py TRACE.json.gz [--steps 2] [--copy_tbs 4.0] [--bf16_tflops 700] [--fp8_tflops 1300]

The trace is torch.profiler's Chrome trace from `bench/step_time.py --profile --trace PATH`. That tool records the
operators' input shapes, compiles with Inductor's kernel metadata on (torch._inductor.config.benchmark_kernel), and
prints this report itself, at ceilings it measures on the same GPU. The sizes come from:
- Inductor's Triton kernels: the bytes Inductor counts for their loads and stores (`kernel_num_gb` in the launch's
  profiler event). Inductor counts no FLOPs for elementwise work, so these kernels are priced by their bytes.
- cuBLAS matmuls (aten::mm, addmm, bmm, _scaled_mm): 2·M·N·K FLOPs, and the bytes of both inputs and the output,
  from their operator's input shapes and types.
- The rest (FlashAttention, our own Triton kernels, PyTorch's elementwise kernels) is listed by time alone.
Kernels replayed from CUDA graphs (the graph runners) have no operator in the trace: `step_time.py` sizes them by name
from two more steps launched as usual (borrow_sizes).

A kernel's ceiling time is max(bytes / copy rate, FLOPs / matmul rate), the matmul rate being that of its input type
(FP8, bf16, or TF32 for float32 inputs at half the bf16 rate). "over" is its time minus that: the most that fusing or
retuning it could save, if it still had to move those bytes. A kernel deleted saves its whole time.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_compare import kernel_events, kind_of, load_trace  # noqa: E402

MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::baddbmm"}
ELEMENT_BYTES = {"float8": 1, "bfloat16": 2, "half": 2, "float": 4, "double": 8, "long": 8, "int": 4}


@dataclass(frozen=True)
class Ceilings:
    """Rates the GPU reaches: a device-to-device copy (bytes read + written per second) and dense matmuls."""
    copy_tbs: float  # TB/s
    bf16_tflops: float
    fp8_tflops: float

    def matmul_tflops(self, dtype: str) -> float:
        if dtype.startswith("float8"):
            return self.fp8_tflops
        return self.bf16_tflops / 2 if dtype in ("float", "double") else self.bf16_tflops  # float32 as TF32


def measure_ceilings(device, size: int = 8192) -> Ceilings:
    """The rates this GPU reaches, each the median of 20 back-to-back calls (bench/timing.py): copying a 1 GiB
    buffer (2 GiB moved), a size³ bf16 matmul, and the same in FP8 (torch._scaled_mm, e4m3 at unit scales, bf16 out)."""
    import torch
    import timing  # bench/timing.py
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = timing.back_to_back_ms(lambda: dst.copy_(src), 20)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    bf16_ms = timing.back_to_back_ms(lambda: a @ b, 20)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm: the second operand column-major
    one = torch.ones((), device=device)
    fp8_ms = timing.back_to_back_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), 20)
    flop = 2.0 * size**3
    return Ceilings(copy_tbs=2 * 2**30 / copy_ms / 1e9, bf16_tflops=flop / bf16_ms / 1e9, fp8_tflops=flop / fp8_ms / 1e9)


def element_type(text: str) -> str:
    """A profiler "Input type" string (c10::BFloat16, float, c10::Float8_e4m3fn, ...) as a short dtype name."""
    t = text.lower().replace("c10::", "")
    if t.startswith("float8"):
        return "float8"
    return "long" if t == "long int" else t


def matmul_size(op: dict) -> tuple[float, float, str] | None:
    """(FLOPs, bytes, input dtype) of a matmul operator event from its "Input Dims" and "Input type", or None."""
    args = op.get("args", {})
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    name = op.get("name", "")
    i = 1 if name in ("aten::addmm", "aten::baddbmm") else 0  # addmm(bias, a, b)
    if len(dims) < i + 2 or len(dims[i]) not in (2, 3) or len(dims[i + 1]) != len(dims[i]):
        return None
    a, b = dims[i], dims[i + 1]
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    dtype = element_type(types[i]) if len(types) > i else "bfloat16"
    size_in = ELEMENT_BYTES.get(dtype, 2)
    size_out = 2 if dtype == "float8" else size_in  # _scaled_mm writes bf16 in this codebase
    flops = 2.0 * batch * m * n * k
    nbytes = batch * ((m * k + k * n) * size_in + m * n * size_out)
    return flops, float(nbytes), dtype


@dataclass
class Row:
    name: str
    kind: str
    calls: int = 0
    ms: float = 0.0
    gb: float = 0.0  # sized work only
    tflop: float = 0.0
    ceiling_ms: float = 0.0
    sized: int = 0  # calls with a known size

    def over_ms(self) -> float:
        return self.ms - self.ceiling_ms if self.sized else 0.0


def roofline(trace: dict, ceilings: Ceilings) -> list[Row]:
    """One row per kernel name: its calls, GPU time, bytes and FLOPs (where the trace sizes it) and its time at the
    ceilings. Kernels are tied to their operator by the trace's "External id"; the first kernel of a matmul operator
    carries its size, so a split-K matmul's second kernel is priced with it."""
    ops = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") != "kernel":
            ext = e.get("args", {}).get("External id")
            if ext is not None and ("kernel_num_gb" in e["args"] or e.get("name") in MATMUL_OPS):
                ops[ext] = e
    rows: dict[str, Row] = {}
    sized_ops = set()
    for k in sorted(kernel_events(trace), key=lambda e: e["ts"]):
        name = k.get("name", "")
        row = rows.setdefault(name, Row(name, kind_of(name)))
        dur_ms = float(k["dur"]) / 1e3
        row.calls += 1
        row.ms += dur_ms
        ext = k.get("args", {}).get("External id")
        op = ops.get(ext)
        if op is None:
            continue
        if ext in sized_ops:  # a second kernel of an operator already sized: its time counts against that size
            row.sized += 1
            continue
        sized_ops.add(ext)
        if "kernel_num_gb" in op["args"]:
            gb, tflop, rate = float(op["args"]["kernel_num_gb"]), float(op["args"].get("kernel_flop", 0)) / 1e12, None
        else:
            size = matmul_size(op)
            if size is None:
                continue
            flops, nbytes, dtype = size
            gb, tflop, rate = nbytes / 1e9, flops / 1e12, ceilings.matmul_tflops(dtype)
        row.sized += 1
        row.gb += gb
        row.tflop += tflop
        row.ceiling_ms += max(gb / ceilings.copy_tbs, tflop / rate * 1e3 if rate else 0.0)  # GB / (TB/s) = ms
    return list(rows.values())


def borrow_sizes(rows: list[Row], sizing: list[Row]) -> list[Row]:
    """Rows of a trace whose kernels no operator owns (CUDA-graph replays: train_gpt.GraphRunner) sized from another
    trace of the same work launched as usual (its operators known): a kernel's bytes, FLOPs and ceiling time per call
    there, times its calls here. A kernel this trace sized itself, or the other did not size, is left as it is."""
    by_name = {r.name: r for r in sizing if r.sized}
    out = []
    for r in rows:
        twin = by_name.get(r.name)
        if r.sized or twin is None:
            out.append(r)
            continue
        per_call = r.calls / twin.calls
        out.append(dataclasses.replace(r, gb=twin.gb * per_call, tflop=twin.tflop * per_call,
                                       ceiling_ms=twin.ceiling_ms * per_call, sized=r.calls))
    return out


def report(rows: list[Row], steps: int, ceilings: Ceilings, top: int = 25) -> str:
    """Markdown: the kinds of work (time, sized time, its ceiling, over), then the `top` kernels by time over their
    ceiling, then the largest unsized ones; all per step."""
    per = 1.0 / steps
    lines = [f"Ceilings: copy {ceilings.copy_tbs:.2f} TB/s, bf16 matmul {ceilings.bf16_tflops:.0f} TFLOP/s, FP8 matmul "
             f"{ceilings.fp8_tflops:.0f} TFLOP/s; per step ({steps} profiled)", "",
             "| kind of work | ms | of it sized | at the ceilings | over |", "| --- | --- | --- | --- | --- |"]
    kinds = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        sized_ms = r.ms if r.sized else 0.0
        kinds[r.kind][0] += r.ms * per
        kinds[r.kind][1] += sized_ms * per
        kinds[r.kind][2] += r.ceiling_ms * per
    for kind, (ms, sized, ceil) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {kind} | {ms:.1f} | {sized:.1f} | {ceil:.1f} | {sized - ceil:.1f} |")
    total = [sum(v[i] for v in kinds.values()) for i in range(3)]
    lines.append(f"| **all** | {total[0]:.1f} | {total[1]:.1f} | {total[2]:.1f} | {total[1] - total[2]:.1f} |")
    lines += ["", f"The {top} kernels furthest over their ceiling:", "",
              "| kernel | calls | ms | GB | TFLOP | TB/s | TFLOP/s | at the ceilings, ms | over, ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted((r for r in rows if r.sized), key=lambda r: -r.over_ms())[:top]:
        lines.append(f"| {r.name[:90]} | {r.calls * per:g} | {r.ms * per:.2f} | {r.gb * per:.2f} | {r.tflop * per:.2f} "
                     f"| {r.gb / r.ms:.2f} | {r.tflop / r.ms * 1e3:.0f} | {r.ceiling_ms * per:.2f} | "
                     f"{r.over_ms() * per:.2f} |")
    unsized = sorted((r for r in rows if not r.sized), key=lambda r: -r.ms)[:top]
    lines += ["", "The largest kernels the trace does not size (time only):", "", "| kernel | kind | calls | ms |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {r.name[:90]} | {r.kind} | {r.calls * per:g} | {r.ms * per:.2f} |" for r in unsized]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="torch.profiler Chrome trace (.json or .json.gz)")
    p.add_argument("--steps", type=int, default=2, help="training steps the trace covers (step_time.py profiles 2)")
    # without measured ceilings: rough dense figures for an H200 (its data sheet's 4.8 TB/s, and about 70% of its
    # 989 / 1979 dense TFLOP/s, what large cuBLAS matmuls reach); step_time.py measures them instead
    p.add_argument("--copy_tbs", type=float, default=4.0)
    p.add_argument("--bf16_tflops", type=float, default=700.0)
    p.add_argument("--fp8_tflops", type=float, default=1300.0)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    trace = load_trace(a.trace)
    ceilings = Ceilings(a.copy_tbs, a.bf16_tflops, a.fp8_tflops)
    print(report(roofline(trace, ceilings), a.steps, ceilings, a.top))


if __name__ == "__main__":
    main()
