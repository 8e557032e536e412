"""bench/roofline.py: kernels tied to their operators by External id, sized by Inductor's bytes or by a matmul's
shapes, priced at the ceilings (a synthetic trace in torch.profiler's Chrome format)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import roofline as rf  # noqa: E402

CEIL = rf.Ceilings(copy_tbs=4.0, bf16_tflops=800.0, fp8_tflops=1600.0)


def op(name, ext, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": 0, "dur": 1, "args": {"External id": ext, **args}}


def kernel(name, ext, ts, dur_us):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur_us, "args": {"External id": ext}}


def trace():
    return {"traceEvents": [
        # an Inductor kernel moving 0.2 GB, launched twice (two steps): 100 us each
        op("triton_red_fused_rms_norm_0", 1, kernel_num_gb=0.2), kernel("triton_red_fused_rms_norm_0", 1, 0, 100),
        op("triton_red_fused_rms_norm_0", 2, kernel_num_gb=0.2), kernel("triton_red_fused_rms_norm_0", 2, 500, 100),
        # a bf16 matmul 4096 x 8192 @ 8192 x 2048 split into two kernels (main + split-K reduce)
        op("aten::mm", 3, **{"Input Dims": [[4096, 8192], [8192, 2048]], "Input type": ["c10::BFloat16"] * 2}),
        kernel("nvjet_sm90_tst_192x192_splitK", 3, 1000, 300), kernel("splitKreduce_kernel", 3, 1300, 20),
        # an FP8 matmul through _scaled_mm, its scales as further inputs
        op("aten::_scaled_mm", 4, **{"Input Dims": [[4096, 8192], [8192, 2048], [], []],
                                     "Input type": ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "float", "float"]}),
        kernel("nvjet_sm90_qqtst_128x160", 4, 2000, 150),
        # a kernel with no sizing operator (attention)
        kernel("flash_fwd_kernel", 9, 3000, 400),
        # an operator with no kernel is ignored
        op("aten::empty", 5),
    ]}


def test_kernels_are_sized_by_their_operator_and_priced_at_the_ceilings():
    rows = {r.name: r for r in rf.roofline(trace(), CEIL)}
    norm = rows["triton_red_fused_rms_norm_0"]
    assert (norm.calls, norm.sized) == (2, 2) and norm.gb == pytest.approx(0.4) and norm.tflop == 0
    assert norm.ceiling_ms == pytest.approx(0.4 / 4.0)  # 0.4 GB at 4 TB/s = 0.1 ms
    assert norm.over_ms() == pytest.approx(0.2 - 0.1)
    mm = rows["nvjet_sm90_tst_192x192_splitK"]
    flops = 2 * 4096 * 8192 * 2048
    nbytes = (4096 * 8192 + 8192 * 2048 + 4096 * 2048) * 2
    assert mm.tflop == pytest.approx(flops / 1e12) and mm.gb == pytest.approx(nbytes / 1e9)
    assert mm.ceiling_ms == pytest.approx(max(nbytes / 1e9 / 4.0, flops / 1e12 / 800 * 1e3))
    reduce = rows["splitKreduce_kernel"]  # the operator's second kernel: sized with it, no bytes of its own
    assert reduce.sized == 1 and reduce.gb == 0 and reduce.ceiling_ms == 0 and reduce.over_ms() == pytest.approx(0.02)
    fp8 = rows["nvjet_sm90_qqtst_128x160"]
    assert fp8.gb == pytest.approx(((4096 * 8192 + 8192 * 2048) * 1 + 4096 * 2048 * 2) / 1e9)
    assert fp8.ceiling_ms == pytest.approx(max(fp8.gb / 4.0, flops / 1e12 / 1600 * 1e3))  # at the FP8 rate
    attn = rows["flash_fwd_kernel"]
    assert attn.sized == 0 and attn.ms == pytest.approx(0.4) and attn.over_ms() == 0


def test_matmul_sizes_read_addmm_past_its_bias_and_batch_dims_and_refuse_what_they_cannot_read():
    addmm = op("aten::addmm", 1, **{"Input Dims": [[64], [32, 128], [128, 64]], "Input type": ["float"] * 3})
    assert rf.matmul_size(addmm) == (2.0 * 32 * 64 * 128, float((32 * 128 + 128 * 64 + 32 * 64) * 4), "float")
    bmm = op("aten::bmm", 2, **{"Input Dims": [[3, 16, 8], [3, 8, 4]], "Input type": ["c10::BFloat16"] * 2})
    assert rf.matmul_size(bmm)[0] == 2.0 * 3 * 16 * 4 * 8
    assert rf.matmul_size(op("aten::mm", 3)) is None  # no shapes recorded
    assert CEIL.matmul_tflops("float") == 400.0 and CEIL.matmul_tflops("float8") == 1600.0  # float32 as TF32


def test_the_report_ranks_kernels_by_time_over_their_ceiling_per_step():
    text = rf.report(rf.roofline(trace(), CEIL), steps=2, ceilings=CEIL)
    over = text.split("furthest over their ceiling:")[1].split("does not size")[0]
    names = [line.split(" | ")[0].strip("| ") for line in over.splitlines() if line.startswith("| ") and "---" not in line]
    names = [n for n in names if n != "kernel"]
    assert names[0] == "nvjet_sm90_tst_192x192_splitK"  # 0.300 ms against 0.172 at the ceilings: furthest over
    assert "flash_fwd_kernel" in text.split("does not size")[1]
    assert "| **all** |" in text and "per step (2 profiled)" in text


def test_graph_replayed_kernels_borrow_their_sizes_by_name_from_a_usual_launch():
    """Kernels a CUDA graph replays have no operator in the trace: their bytes, FLOPs and ceiling time per call come
    from a trace of the same work launched as usual, scaled by their own calls; what neither sizes stays unsized."""
    usual = {r.name: r for r in rf.roofline(trace(), CEIL)}
    # the same kernels replayed from a graph: no operator events, External ids that match none; the norm kernel
    # launched three times here against two there
    replayed = {"traceEvents": [kernel("triton_red_fused_rms_norm_0", 100 + i, 100 * i, 90) for i in range(3)] +
                [kernel("nvjet_sm90_tst_192x192_splitK", 200, 1000, 280), kernel("flash_fwd_kernel", 201, 3000, 380),
                 kernel("never_seen_kernel", 202, 4000, 5)]}
    alone = rf.roofline(replayed, CEIL)
    assert not any(r.sized for r in alone)
    rows = {r.name: r for r in rf.borrow_sizes(alone, list(usual.values()))}
    norm = rows["triton_red_fused_rms_norm_0"]
    assert (norm.calls, norm.sized) == (3, 3) and norm.ms == pytest.approx(0.27)  # its own times
    assert norm.gb == pytest.approx(0.6) and norm.ceiling_ms == pytest.approx(usual[norm.name].ceiling_ms * 1.5)
    mm = rows["nvjet_sm90_tst_192x192_splitK"]
    assert mm.tflop == pytest.approx(usual[mm.name].tflop) and mm.over_ms() == pytest.approx(0.28 - mm.ceiling_ms)
    assert rows["flash_fwd_kernel"].sized == 0 and rows["never_seen_kernel"].sized == 0  # the usual launch had no size
