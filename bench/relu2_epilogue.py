"""Why the fused ReLU² MLP's FP8 kernels trail cuBLAS's matmul: standalone copies of their arithmetic with one part
changed at a time, at the record's micro-batch (49,152 x 768 -> 2,816) on one GPU (Hopper: TMA descriptors).

    python bench/relu2_epilogue.py          # the forward: relu(x W_fc)² in e4m3, both layouts, a max a program
    python bench/relu2_epilogue.py --bwd    # the backward's grad_pre: (g W_proj) 2 sqrt(post) in e4m3, both layouts

Forward rows: cuBLAS's _scaled_mm alone (bf16 out, no epilogue); the persistent TMA kernel (kernels.py's
_matmul_relu2_tma_kernel's form) over tiles BMxBNxBK, warps, pipeline stages, the epilogue in one piece or two halves
(split), with or without the transposed store (T), Triton's warp specialization (ws; Hopper's pass) and the tile
loop flattened into the K loop (flat); then the two-kernel route: cuBLAS's bf16 pre and one elementwise kernel.
Backward rows: the same kernel with post read in the epilogue or loaded before the K loop (prefetch), at one or
two programs an SM.
Each row: median µs a call (triton.testing.do_bench), TFLOP/s of the matmul, and the largest error of both stored
layouts against float32 (the backward's also the max slot against the true largest value)."""
import argparse
import itertools
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def fwd(a_desc, b_desc, q_desc, qt_desc, scale_ptr, amax_ptr, M, N, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
        SPLIT: tl.constexpr, STORE_T: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr):
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * grid_n
    s = tl.load(scale_ptr)
    inv = 1.0 / tl.load(scale_ptr + 1)
    run_max = tl.full((1,), 0.0, tl.float32)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        first_m = (tile // group) * GROUP_M
        rows = tl.minimum(grid_m - first_m, GROUP_M)
        m0 = (first_m + (tile % group) % rows) * BM
        n0 = ((tile % group) // rows) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([m0, ki * BK]), b_desc.load([n0, ki * BK]).T, acc)
        acc = acc * s
        if SPLIT == 1:
            c = tl.maximum(acc, 0.0)
            c = (c * c).to(tl.bfloat16).to(tl.float32)
            q = tl.minimum(c * inv, 448.0).to(q_desc.dtype)
            q_desc.store([m0, n0], q)
            if STORE_T:
                qt_desc.store([n0, m0], tl.trans(q))
            run_max = tl.maximum(run_max, tl.max(tl.max(c, 1), 0))
        else:
            halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
            for h in tl.static_range(2):
                c = halves[0] if h == 0 else halves[1]
                c = tl.maximum(c, 0.0)
                c = (c * c).to(tl.bfloat16).to(tl.float32)
                q = tl.minimum(c * inv, 448.0).to(q_desc.dtype)
                q_desc.store([m0, n0 + h * (BN // 2)], q)
                if STORE_T:
                    qt_desc.store([n0 + h * (BN // 2), m0], tl.trans(q))
                run_max = tl.maximum(run_max, tl.max(tl.max(c, 1), 0))
    tl.store(amax_ptr + tl.program_id(0) + tl.arange(0, 1), run_max)


@triton.jit
def epilogue(pre_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """relu(pre)² from a bf16 pre (cuBLAS's), e4m3 both layouts, a max a program."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    inv = 1.0 / tl.load(scale_ptr + 1)
    c = tl.load(pre_ptr + rm[:, None] * N + rn[None, :]).to(tl.float32)
    c = tl.maximum(c, 0.0)
    c = (c * c).to(tl.bfloat16).to(tl.float32)
    q = tl.minimum(c * inv, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rm[:, None] * N + rn[None, :], q)
    tl.store(qt_ptr + rn[None, :] * M + rm[:, None], q)
    tl.store(amax_ptr + pm * tl.num_programs(1) + pn + tl.arange(0, 1), tl.max(tl.max(c, 1), 0)[None])


@triton.jit
def bwd(a_desc, b_desc, post_desc, q_desc, qt_desc, scale_ptr, amax_ptr, M, N, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
        STORE_T: tl.constexpr, PREFETCH: tl.constexpr, FLATTEN: tl.constexpr):
    """(g W_proj) * 2 sqrt(post) in e4m3 both layouts; post (e4m3) read in the epilogue or before the K loop."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = GROUP_M * grid_n
    s = tl.load(scale_ptr)
    ps = tl.load(scale_ptr + 1)
    inv = 1.0 / tl.load(scale_ptr + 2)
    run_max = tl.full((1,), 0.0, tl.float32)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS, flatten=FLATTEN):
        first_m = (tile // group) * GROUP_M
        rows = tl.minimum(grid_m - first_m, GROUP_M)
        m0 = (first_m + (tile % group) % rows) * BM
        n0 = ((tile % group) // rows) * BN
        if PREFETCH:
            p0 = post_desc.load([m0, n0])
            p1 = post_desc.load([m0, n0 + BN // 2])
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([m0, ki * BK]), b_desc.load([n0, ki * BK]).T, acc)
        acc = acc * s
        halves = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        for h in tl.static_range(2):
            c = halves[0] if h == 0 else halves[1]
            if PREFETCH:
                p = p0 if h == 0 else p1
            else:
                p = post_desc.load([m0, n0 + h * (BN // 2)])
            c = c * 2 * tl.sqrt(p.to(tl.float32) * ps)
            run_max = tl.maximum(run_max, tl.max(tl.max(tl.abs(c), 1), 0))
            q = tl.minimum(tl.maximum(c * inv, -448.0), 448.0).to(q_desc.dtype)
            q_desc.store([m0, n0 + h * (BN // 2)], q)
            if STORE_T:
                qt_desc.store([n0 + h * (BN // 2), m0], tl.trans(q))
    tl.store(amax_ptr + tl.program_id(0) + tl.arange(0, 1), run_max)


def backward_rows(report, M, K, N, sms):
    g = torch.Generator(device="cuda").manual_seed(1)
    grad = torch.randn(M, K, device="cuda", generator=g)
    proj = torch.randn(N, K, device="cuda", generator=g) * N ** -0.5  # W_projᵀ (hidden, dim)
    post = torch.relu(torch.randn(M, N, device="cuda", generator=g)).square()
    g_s, w_s, p_s = grad.abs().max() / 448, proj.abs().max() / 448, post.max() / 448
    a, b = (grad / g_s).to(torch.float8_e4m3fn), (proj / w_s).to(torch.float8_e4m3fn)
    p8 = (post / p_s).to(torch.float8_e4m3fn)
    ref = (a.float() @ b.float().T) * (g_s * w_s) * 2 * (p8.float() * p_s).sqrt()
    q_s = ref.abs().max() / 448
    scales = torch.stack([g_s * w_s, p_s, q_s]).float()
    flops = 2 * M * N * K
    one = lambda v: v.reshape(()).float()
    report("bwd: cuBLAS _scaled_mm bf16 out", lambda: torch._scaled_mm(
        a, b.T, scale_a=one(g_s), scale_b=one(w_s), out_dtype=torch.bfloat16, use_fast_accum=True))
    q = torch.empty(M, N, device="cuda", dtype=torch.float8_e4m3fn)
    qt = torch.empty(N, M, device="cuda", dtype=torch.float8_e4m3fn)
    amax = torch.zeros(2 * sms, device="cuda")
    err = lambda: max(((q.float() * q_s - ref).abs().max() / ref.abs().max()).item(),
                      ((qt.float().T * q_s - ref).abs().max() / ref.abs().max()).item(),
                      abs(amax.max().item() / ref.abs().max().item() - 1))
    # (tiles, warps, stages, programs an SM): 128x128 at two an SM is kernels.py's RELU2_FP8_BACKWARD_TILES
    for (BM, BN, BK, warps, stages, per_sm), store_t, pre, flat in itertools.product(
            [(128, 256, 128, 8, 3, 1), (128, 256, 128, 8, 2, 1), (128, 256, 64, 8, 3, 1), (128, 128, 128, 8, 2, 2),
             (128, 128, 128, 8, 2, 1), (128, 128, 128, 8, 3, 1)], (True, False), (False, True), (True, False)):
        if not store_t and not flat:
            continue
        descs = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]),
                 TensorDescriptor.from_tensor(p8, [BM, BN // 2]), TensorDescriptor.from_tensor(q, [BM, BN // 2]),
                 TensorDescriptor.from_tensor(qt, [BN // 2, BM]))
        programs = sms * per_sm
        amax.zero_()
        report(f"bwd {BM}x{BN}x{BK} w{warps} s{stages} {per_sm}/SM T{int(store_t)} prefetch{int(pre)} flat{int(flat)}",
               lambda: bwd[(programs,)](*descs, scales, amax, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                                        NUM_SMS=programs, STORE_T=store_t, PREFETCH=pre, FLATTEN=flat,
                                        num_warps=warps, num_stages=stages),
               err if store_t else None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bwd", action="store_true", help="the backward's grad_pre kernel instead of the forward")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("relu2_epilogue.py: needs a CUDA GPU with TMA (sm_90+)")
    M, K, N = 49152, 768, 2816
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
    x_s, w_s = x.abs().max() / 448, w.abs().max() / 448
    a = (x / x_s).to(torch.float8_e4m3fn)
    b = (w / w_s).to(torch.float8_e4m3fn)  # (N, K)
    ref = torch.relu((a.float() @ b.float().T) * (x_s * w_s)).square()
    post_s = ref.max() * 1.25 / 448
    scales = torch.stack([x_s * w_s, post_s]).float()
    flops = 2 * M * N * K
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

    def report(name, fn, check=None):
        try:
            fn()
            torch.cuda.synchronize()
            us = do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
            err = check() if check else float("nan")
            print(f"{name:<60} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s err {err:.1e}", flush=True)
        except Exception as e:
            print(f"{name:<60} failed: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)

    if args.bwd:
        return backward_rows(report, M, K, N, sms)
    one = lambda v: v.reshape(()).float()
    report("cuBLAS _scaled_mm bf16 out", lambda: torch._scaled_mm(a, b.T, scale_a=one(x_s), scale_b=one(w_s),
                                                                   out_dtype=torch.bfloat16, use_fast_accum=True))
    q = torch.empty(M, N, device="cuda", dtype=torch.float8_e4m3fn)
    qt = torch.empty(N, M, device="cuda", dtype=torch.float8_e4m3fn)
    amax = torch.empty(4096, device="cuda")
    err = lambda: max(((q.float() * post_s - ref).abs().max() / ref.max()).item(),
                      ((qt.float().T * post_s - ref).abs().max() / ref.max()).item())
    configs = [(128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4),
               (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (64, 256, 128, 4, 4)]
    for (BM, BN, BK, warps, stages), split, store_t, ws, flat in itertools.product(
            configs, (2, 1), (True, False), (False, True), (True, False)):
        if (BM, BN) != (128, 256) and (split == 1 or not store_t):
            continue
        if ws and flat:
            continue
        if not store_t and (ws or not flat or split == 1):
            continue
        descs = (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]),
                 TensorDescriptor.from_tensor(q, [BM, BN // split]), TensorDescriptor.from_tensor(qt, [BN // split, BM]))
        name = f"fwd {BM}x{BN}x{BK} w{warps} s{stages} split{split} T{int(store_t)} ws{int(ws)} flat{int(flat)}"
        q.zero_(), qt.zero_()
        report(name, lambda: fwd[(sms,)](*descs, scales, amax, M, N, K, BM=BM, BN=BN, BK=BK, GROUP_M=8, NUM_SMS=sms,
                                          SPLIT=split, STORE_T=store_t, WS=ws, FLATTEN=flat, num_warps=warps,
                                          num_stages=stages), err if store_t else None)
    pre = torch._scaled_mm(a, b.T, scale_a=one(x_s), scale_b=one(w_s), out_dtype=torch.bfloat16, use_fast_accum=True)
    for BM, BN, warps in ((64, 64, 4), (64, 128, 4), (128, 128, 8), (128, 64, 4), (32, 128, 4)):
        q.zero_(), qt.zero_()
        report(f"epilogue kernel alone {BM}x{BN} w{warps}", lambda: epilogue[(M // BM, N // BN)](
            pre, q, qt, scales, amax, M, N, BM=BM, BN=BN, num_warps=warps), err)

    def two_kernels():
        p = torch._scaled_mm(a, b.T, scale_a=one(x_s), scale_b=one(w_s), out_dtype=torch.bfloat16,
                             use_fast_accum=True)
        epilogue[(M // 64, N // 128)](p, q, qt, scales, amax, M, N, BM=64, BN=128, num_warps=4)
    report("cuBLAS + epilogue kernel 64x128", two_kernels, err)


if __name__ == "__main__":
    main()
