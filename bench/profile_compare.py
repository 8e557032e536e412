"""Two GPU profiles side by side, kernel time per step by kind of work: where one code's step spends more than the
other's (issue 33: close the gap to the public code kernel by kernel).

    python bench/profile_compare.py OURS PUBLIC [--names ours public] [--steps 2 2] [--top 3]

Each profile is a Chrome trace that torch.profiler wrote (.json or .json.gz: every kernel; `bench/step_time.py
--profile --trace PATH`, `bench/side_by_side.py --profile_step N` writes one beside the public log) or a text file
holding the key_averages() table that those scripts print (only the rows printed: the top kernels). --steps: how
many training steps each profile covers (both scripts profile 2). Prints a markdown table: per kind of work, ms
per step in each profile and the difference, then each kind's largest kernels."""
import argparse
import gzip
import json
import re
from collections import defaultdict

# Kinds of GPU work, first match wins; matched against the kernel's name (case-insensitive).
KINDS = [
    ("communication (NCCL)", r"nccl"),
    ("attention backward (FlashAttention)", r"flash.*bwd|flashattnbwd|flash_bwd|fmha.*bwd"),
    ("attention forward (FlashAttention)", r"flash|fmha"),
    ("fused ReLU² MLP matmul (Triton)", r"matmul_relu2|linear_relu_square|relu2_fp8_gluon"),
    ("cross-entropy (Triton)", r"softcap_ce|ce_fwd_bwd|cross_?entropy"),
    ("copy pointer, CPLM (Triton)", r"pointer_|copy_pointer"),
    ("DC attention (Triton)", r"_dc_|dc_corr"),
    ("FP8 matmuls (cuBLAS)", r"nvjet_sm\d+_q|_qq|f8f8|e4m3|e5m2|fp8"),
    ("bf16/fp32 matmuls (cuBLAS, CUTLASS)", r"nvjet|gemm|xmma|cutlass|sm\d+_.*mma"),
    ("Inductor-generated (fused elementwise, norms, reductions)", r"^triton_"),
    ("PyTorch's own kernels (elementwise, copies, fills, scatters)", r"at::native|^void at::|memcpy|memset"),
    ("QK-norm and rotary (Triton)", r"qk_norm_rope"),
    ("FP8 transposes (Triton)", r"^_transpose"),
    ("other Triton kernels", r"_kernel(_\d+)?$"),
]
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
TABLE_ROW = re.compile(r"^(.*\S)" + r"\s+(\S+)" * 10 + r"\s*$")
STEP_RANGE = re.compile(r"^step \d+")  # the scripts' record_function ranges, which the profiler also shows on the GPU


def kind_of(name: str) -> str:
    for label, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def _ms(token: str) -> float:
    number = re.fullmatch(r"([0-9.]+)(us|ms|s)", token)
    if not number:
        raise ValueError(f"not a time: {token!r}")
    return float(number.group(1)) * UNITS[number.group(2)]


def kernel_events(trace: dict) -> list[dict]:
    """The GPU kernels of a torch.profiler Chrome trace: its complete events ("X") of category "kernel"."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]


def kernels_from_trace(trace: dict) -> dict[str, tuple[float, int]]:
    """{kernel name: (total ms, calls)} over the GPU kernel events of a torch.profiler Chrome trace."""
    out = defaultdict(lambda: [0.0, 0])
    for e in kernel_events(trace):
        entry = out[e.get("name", "")]
        entry[0] += float(e["dur"]) / 1e3
        entry[1] += 1
    return {name: (ms, calls) for name, (ms, calls) in out.items()}


def kernels_from_table(text: str) -> dict[str, tuple[float, int]]:
    """{kernel name: (total ms, calls)} from the last key_averages() table in text: its rows with no CPU time and
    some GPU time are kernels (operator rows have CPU time, and their GPU time repeats their kernels')."""
    tables = re.split(r"\n-{20,}[- ]*\n\s+Name\s+Self CPU %", text)
    if len(tables) < 2:
        raise ValueError("no torch.profiler key_averages() table found (a header 'Name  Self CPU %  ...')")
    out = {}
    for line in tables[-1].splitlines()[2:]:
        if line.startswith("---") or line.startswith("Self CPU time total"):
            break
        # the name, then ten columns: Self CPU %, Self CPU, CPU total %, CPU total, CPU time avg, Self CUDA,
        # Self CUDA %, CUDA total, CUDA time avg, # of Calls
        row = TABLE_ROW.match(line)
        if not row:
            continue
        name, fields = row.group(1).strip(), row.groups()[1:]
        cpu_total, self_cuda, calls = _ms(fields[3]), _ms(fields[5]), int(fields[9])
        if cpu_total == 0 and self_cuda > 0 and not STEP_RANGE.match(name):
            out[name] = (out.get(name, (0.0, 0))[0] + self_cuda, out.get(name, (0.0, 0))[1] + calls)
    return out


def kernels_from_averages(averages) -> dict[str, tuple[float, int]]:
    """{kernel name: (total ms, calls)} from a profile's key_averages() itself: every GPU kernel (its rows with GPU
    time and no CPU time), not only the rows a table prints; the record_function ranges shown on the GPU are not."""
    return {e.key: (e.self_device_time_total / 1e3, e.count) for e in averages
            if e.cpu_time_total == 0 and e.self_device_time_total > 0 and not e.is_user_annotation}


def load_trace(path: str) -> dict:
    """A torch.profiler Chrome trace from its .json or .json.gz file."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return json.load(f)


def load_kernels(path: str) -> dict[str, tuple[float, int]]:
    if path.endswith((".json", ".json.gz")):
        return kernels_from_trace(load_trace(path))
    with open(path) as f:
        return kernels_from_table(f.read())


def by_kind(kernels: dict[str, tuple[float, int]], steps: int) -> dict[str, float]:
    """ms per step of each kind of work."""
    out = defaultdict(float)
    for name, (ms, _) in kernels.items():
        out[kind_of(name)] += ms / steps
    return dict(out)


def largest(kernels: dict[str, tuple[float, int]], steps: int, kind: str, top: int) -> list[tuple[float, float, str]]:
    """The `top` largest kernels of one kind of work: (ms per step, calls per step, name), largest first."""
    mine = sorted(((ms, calls, name) for name, (ms, calls) in kernels.items() if kind_of(name) == kind), reverse=True)
    return [(ms / steps, calls / steps, name) for ms, calls, name in mine[:top]]


def kinds_report(kernels: dict[str, tuple[float, int]], steps: int, top: int = 6) -> str:
    """Kernel time by kind of work, ms a step, largest first, each kind's `top` largest kernels under it; the total."""
    kinds = by_kind(kernels, steps)
    lines = ["kernel time by kind of work, ms a step (bench/profile_compare.py compares two profiles), each kind's "
             "largest kernels under it (ms a step, calls a step):"]
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {ms:8.2f}  {kind}")
        lines += [f"      {k_ms:8.2f}  {calls:4g}x  {name[:110]}"
                  for k_ms, calls, name in largest(kernels, steps, kind, top)]
    lines.append(f"  {sum(kinds.values()):8.2f}  all kernels")
    return "\n".join(lines)


def compare(a: dict, b: dict, names: tuple[str, str], steps: tuple[int, int], top: int = 3) -> str:
    """The markdown report: one row per kind (ms per step in a and b, b - a), largest difference first, then the
    total; then each kind's `top` largest kernels in each profile."""
    ka, kb = by_kind(a, steps[0]), by_kind(b, steps[1])
    kinds = sorted(set(ka) | set(kb), key=lambda k: -abs(kb.get(k, 0) - ka.get(k, 0)))
    lines = [f"| kind of work | {names[0]}, ms per step | {names[1]}, ms per step | {names[1]} - {names[0]} |",
             "| --- | --- | --- | --- |"]
    for k in kinds:
        lines.append(f"| {k} | {ka.get(k, 0):.2f} | {kb.get(k, 0):.2f} | {kb.get(k, 0) - ka.get(k, 0):+.2f} |")
    ta, tb = sum(ka.values()), sum(kb.values())
    lines.append(f"| **all kernels** | **{ta:.2f}** | **{tb:.2f}** | **{tb - ta:+.2f}** |")
    if top:
        lines += ["", "Largest kernels of each kind (ms per step, calls per step):"]
        for k in kinds:
            lines.append(f"- {k}")
            for label, kernels, n in ((names[0], a, steps[0]), (names[1], b, steps[1])):
                for ms, calls, name in largest(kernels, n, k, top):
                    lines.append(f"  - {label}: {ms:.2f} ms, {calls:g} calls: `{name[:100]}`")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profiles", nargs=2, help="two Chrome traces (.json[.gz]) or key_averages() table texts")
    parser.add_argument("--names", nargs=2, default=["A", "B"], help="column names of the two profiles")
    parser.add_argument("--steps", nargs=2, type=int, default=[2, 2], help="training steps each profile covers")
    parser.add_argument("--top", type=int, default=3, help="largest kernels listed per kind and profile (0: none)")
    args = parser.parse_args()
    a, b = (load_kernels(p) for p in args.profiles)
    for path, kernels in zip(args.profiles, (a, b)):
        if not kernels:
            raise SystemExit(f"profile_compare.py: no GPU kernels in {path}: profile with CUDA activity "
                             "(torch.profiler.ProfilerActivity.CUDA)")
    print(compare(a, b, tuple(args.names), tuple(args.steps), args.top))


if __name__ == "__main__":
    main()
