"""Time DC attention's correction (train_gpt.dc_correction, the record's last block), forward and backward, at the
record's micro-batch shape on one GPU: written out in PyTorch as torch.compile builds it, against kernels.py's
dc_attention op (its Triton kernels) with each tile configuration given; the op's largest errors against the
written-out form. Random normed queries and keys, bf16 as the model's, documents of random lengths.

    python bench/dc_kernel.py [--tokens 49152] [--heads 6] [--head_dim 128] [--tiles 64,4,2 64,8,2 32,4,2 ...]

A tile configuration is BM (query and key rows a block), num_warps, num_stages."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402


def case(T: int, H: int, D: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (tg.norm(torch.randn(T, H, D, device="cuda", generator=g)).bfloat16() for _ in range(3))
    w1, w2 = (torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(2))
    lengths = torch.randint(64, 3000, (T // 64,), generator=g, device="cuda").cumsum(0)
    cu = torch.cat([torch.zeros(1, device="cuda", dtype=torch.long), lengths[lengths < T],
                    torch.full((1,), T, device="cuda")]).int()
    return q, k, v, w1, w2, cu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--tiles", nargs="+", default=["64,4,2", "64,8,2", "32,4,2", "64,4,1", "128,8,2"])
    a = parser.parse_args()
    q, k, v, w1, w2, cu = case(a.tokens, a.heads, a.head_dim)
    scale = 0.12
    up = torch.randn_like(q)
    written = torch.compile(tg.dc_correction, dynamic=False, fullgraph=True)

    def run(fused: bool, backward: bool = True):
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v, w1, w2)]
        out = (tg.dc_correction(*leaves[:3], cu, *leaves[3:], scale, fused=True) if fused else
               written(*leaves[:3], cu, *leaves[3:], scale))
        if backward:
            (out * up).sum().backward()
        return out, *(t.grad for t in leaves)

    def times(fused: bool) -> str:
        both = timing.back_to_back_ms(lambda: run(fused), 10)
        return f"{both:.3f} ms forward + backward ({timing.back_to_back_ms(lambda: run(fused, False), 10):.3f} forward)"

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {a.tokens:,} tokens, {a.heads} heads "
          f"of {a.head_dim}, window {tg.DC_WINDOW}, {len(cu) - 1} documents")
    ref = run(False)
    print(f"written out, compiled: {times(False)}")
    for text in a.tiles:
        bm, warps, stages = (int(x) for x in text.split(","))
        kernels.DC_TILES = dict(BM=bm, num_warps=warps, num_stages=stages)
        got = run(True)
        errors = ", ".join(f"{name} {((x - y).abs().max() / y.abs().max()).item():.1e}" for name, x, y in
                           zip(("out", "dq", "dk", "dv", "dw1", "dw2"), got, ref))
        print(f"kernels BM={bm} warps={warps} stages={stages}: {times(True)}; largest errors relative to the "
              f"largest value: {errors}")


if __name__ == "__main__":
    main()
