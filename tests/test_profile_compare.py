"""bench/profile_compare.py: kernels read from torch.profiler tables and Chrome traces, sorted into kinds of work,
and two profiles compared per step."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import profile_compare as pc  # noqa: E402

RULE = "-" * 90 + "  " + "  ".join(["-" * 12] * 10) + "  "
HEADER = ("Name".rjust(90) + "  " + "  ".join(c.rjust(12) for c in (
    "Self CPU %", "Self CPU", "CPU total %", "CPU total", "CPU time avg", "Self CUDA", "Self CUDA %", "CUDA total",
    "CUDA time avg", "# of Calls")) + "  ")


def row(name, cpu_total, self_cuda, calls):
    cols = ["0.10%", "1.000ms", "0.20%", cpu_total, "10.000us", self_cuda, "1.00%", self_cuda, "5.000us", str(calls)]
    return name.rjust(90) + "  " + "  ".join(c.rjust(12) for c in cols) + "  "


def table(rows):
    """A key_averages() table laid out as torch.profiler prints it (name column 90 wide, ten columns after it)."""
    return "\n".join(["some log line", RULE, HEADER, RULE, *rows, RULE, "Self CPU time total: 1.000s",
                      "Self CUDA time total: 1.000s", ""])


def test_table_rows_without_cpu_time_are_the_kernels_and_op_rows_are_left_out():
    text = table([
        row("aten::mm", "221.419ms", "339.289ms", 2238),  # an operator: its GPU time repeats its kernels'
        row("## Call CompiledFxGraph abc ##", "669.538ms", "0.000us", 16),
        row("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "0.000us", "108.405ms", 506),
        row("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<flash::...",
            "0.000us", "99.060ms", 160),
        row("triton_red_fused__fused_rms_norm_add", "2.464ms", "19.134ms", 64),  # the launch, on the CPU side
        row("triton_red_fused__fused_rms_norm_add", "0.000us", "19.134ms", 64),  # the kernel
        row("_softcap_ce_bwd_kernel", "0.000us", "1.5s", 16),
    ])
    kernels = pc.kernels_from_table(text)
    assert set(kernels) == {"nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "_softcap_ce_bwd_kernel",
                            "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnBwdSm90<flash::...",
                            "triton_red_fused__fused_rms_norm_add"}
    assert kernels["nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN"] == pytest.approx((108.405, 506))
    assert kernels["triton_red_fused__fused_rms_norm_add"] == pytest.approx((19.134, 64))  # counted once
    assert kernels["_softcap_ce_bwd_kernel"] == pytest.approx((1500.0, 16))  # seconds read as such
    with pytest.raises(ValueError, match="no torch.profiler"):
        pc.kernels_from_table("no table here")


def test_only_the_last_table_of_a_log_counts():
    first = table([row("_matmul_relu2_kernel", "0.000us", "5.000ms", 2)])
    second = table([row("_matmul_relu2_kernel", "0.000us", "7.000ms", 2)])
    assert pc.kernels_from_table(first + second)["_matmul_relu2_kernel"] == pytest.approx((7.0, 2))


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication (NCCL)"),
    ("void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<cute::tuple<cute::C<64>, cute...",
     "attention backward (FlashAttention)"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<...",
     "attention forward (FlashAttention)"),
    ("_matmul_relu2_tma_kernel", "fused ReLU² MLP matmul (Triton)"),
    ("linear_relu_square_kernel", "fused ReLU² MLP matmul (Triton)"),
    ("ce_fwd_bwd_kernel", "cross-entropy (Triton)"),
    ("_softcap_ce_fwd_kernel", "cross-entropy (Triton)"),
    ("_dc_postonly_corr_bwd_qk_wsmall_kernel", "DC attention (Triton)"),
    ("nvjet_sm90_qqtst_192x192_128x4_1x2_h_bz_coopB_TNN", "FP8 matmuls (cuBLAS)"),
    ("nvjet_sm90_tst_256x128_64x4_1x4_h_bz_coopA_splitK_NTT", "bf16/fp32 matmuls (cuBLAS, CUTLASS)"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4",
     "bf16/fp32 matmuls (cuBLAS, CUTLASS)"),
    ("triton_per_fused__to_copy_pow_sum_28", "Inductor-generated (fused elementwise, norms, reductions)"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFlo...",
     "PyTorch's own kernels (elementwise, copies, fills, scatters)"),
    ("_transpose_copy_kernel_5", "FP8 transposes (Triton)"),
    ("_qk_norm_rope_bwd_kernel", "QK-norm and rotary (Triton)"),
    ("_relu2_fp8_gluon_kernel", "fused ReLU² MLP matmul (Triton)"),
    ("_pointer_dq_kernel", "copy pointer, CPLM (Triton)"),
    ("_some_new_kernel", "other Triton kernels"),
    ("Memcpy HtoD (Pinned -> Device)", "PyTorch's own kernels (elementwise, copies, fills, scatters)"),
    ("some_unknown_thing", "other"),
])
def test_kernel_kinds(name, kind):
    assert pc.kind_of(name) == kind


def trace(kernels):
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50.0}]
    events += [{"ph": "X", "cat": "kernel", "name": n, "ts": 100 * i, "dur": d} for i, (n, d) in enumerate(kernels)]
    return {"traceEvents": events}


def test_compare_per_step_by_kind_and_the_cli_on_a_trace_and_a_table(tmp_path):
    ours = trace([("_matmul_relu2_tma_kernel", 3000.0), ("_matmul_relu2_tma_kernel", 1000.0),
                  ("_softcap_ce_bwd_kernel", 2000.0)])  # µs over 2 steps
    assert pc.kernels_from_trace(ours) == {"_matmul_relu2_tma_kernel": (4.0, 2), "_softcap_ce_bwd_kernel": (2.0, 1)}
    public = table([row("linear_relu_square_kernel", "0.000us", "6.000ms", 4),
                    row("ce_fwd_bwd_kernel", "0.000us", "1.000ms", 2)])
    report = pc.compare(pc.kernels_from_trace(ours), pc.kernels_from_table(public), ("ours", "public"), (2, 2))
    lines = report.splitlines()
    assert lines[2] == "| fused ReLU² MLP matmul (Triton) | 2.00 | 3.00 | +1.00 |"  # largest difference first
    assert lines[3] == "| cross-entropy (Triton) | 1.00 | 0.50 | -0.50 |"
    assert lines[4] == "| **all kernels** | **3.00** | **3.50** | **+0.50** |"
    assert "  - public: 3.00 ms, 2 calls: `linear_relu_square_kernel`" in lines
    path = tmp_path / "ours.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(ours, f)
    (tmp_path / "public.txt").write_text(public)
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_compare.py"), str(path),
                          str(tmp_path / "public.txt"), "--names", "ours", "public", "--top", "0"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[:5] == lines[:5] and "Largest" not in out
    (tmp_path / "empty.json").write_text(json.dumps(trace([])))
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_compare.py"), str(tmp_path / "empty.json"),
                          str(tmp_path / "public.txt")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no GPU kernels in" in bad.stderr


def test_largest_kernels_of_a_kind_per_step_largest_first():
    kernels = {"triton_red_fused_a": (30.0, 4), "triton_poi_fused_b": (50.0, 8), "triton_per_fused_c": (10.0, 2),
               "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": (90.0, 6)}
    inductor = pc.kind_of("triton_red_fused_a")
    assert pc.largest(kernels, 2, inductor, 2) == [(25.0, 4.0, "triton_poi_fused_b"), (15.0, 2.0, "triton_red_fused_a")]
    assert [name for _, _, name in pc.largest(kernels, 1, inductor, 10)] == [
        "triton_poi_fused_b", "triton_red_fused_a", "triton_per_fused_c"]  # the matmul is another kind
    assert pc.largest(kernels, 1, "communication (NCCL)", 3) == []


def test_the_step_ranges_the_profiler_shows_on_the_gpu_are_not_kernels():
    text = table([row("step 9 (Adam)", "0.000us", "395.339ms", 1), row("step 10", "0.000us", "371.430ms", 1),
                  row("_matmul_relu2_tma_kernel", "0.000us", "112.674ms", 352)])
    assert pc.kernels_from_table(text) == {"_matmul_relu2_tma_kernel": pytest.approx((112.674, 352))}


def test_kernels_from_a_profiles_own_averages_every_row_not_only_the_printed_ones():
    from types import SimpleNamespace as Row
    averages = [Row(key="_softcap_ce_bwd_kernel", cpu_time_total=0, self_device_time_total=14025.0, count=16,
                    is_user_annotation=False)]  # µs
    averages += [Row(key=f"triton_poi_fused_{i}", cpu_time_total=0, self_device_time_total=10.0, count=2,
                     is_user_annotation=False) for i in range(60)]  # more rows than a printed table holds
    averages += [Row(key="aten::mm", cpu_time_total=500.0, self_device_time_total=0.0, count=4,
                     is_user_annotation=False),
                 Row(key="step 10", cpu_time_total=0, self_device_time_total=371430.0, count=1,
                     is_user_annotation=True)]
    kernels = pc.kernels_from_averages(averages)
    assert len(kernels) == 61 and "step 10" not in kernels and "aten::mm" not in kernels
    assert kernels["_softcap_ce_bwd_kernel"] == pytest.approx((14.025, 16))
    report = pc.kinds_report(kernels, 2, top=1).splitlines()
    assert report[1].split() == ["7.01", "cross-entropy", "(Triton)"]  # the largest kind first
    assert report[2].split() == ["7.01", "8x", "_softcap_ce_bwd_kernel"]
    assert report[3].split()[0] == "0.30" and "Inductor-generated" in report[3]  # 60 x 10 µs over 2 steps
    assert report[-1].split() == ["7.31", "all", "kernels"]


def test_a_real_cpu_profiles_averages_have_the_fields_read():
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("step 1"):
            torch.ones(8).add_(1)
    averages = prof.key_averages()
    assert any(e.is_user_annotation for e in averages)
    assert pc.kernels_from_averages(averages) == {}  # no GPU: no kernels, and the step range is none
