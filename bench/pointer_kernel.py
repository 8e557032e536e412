"""Time CPLM's pointer, forward and backward, at the record's micro-batch shape on one GPU: the written-out
PyTorch pointer (train_gpt.pointer_written_out) as torch.compile builds it, against kernels.py's copy_pointer op (its
Triton kernels) with each tile configuration given; the op's largest errors against the written-out pointer. Random
queries and keys as the model norms them, documents of random lengths, a vocabulary of 512 so that copies happen.
Seconds per run: the way to choose kernels.POINTER_TILES before timing whole steps (bench/step_time.py).

    python bench/pointer_kernel.py [--tokens 49152] [--band 2048] [--tiles 64,64,4,2 64,32,4,3 32,64,4,2 ...]

A tile configuration is BM (query rows), BN (key rows), num_warps, num_stages."""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402
import timing  # noqa: E402  (bench/timing.py)
import train_gpt as tg  # noqa: E402


def case(T: int, band: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = tg.COPY_DIM
    q = torch.nn.functional.normalize(torch.randn(T, d, device="cuda", generator=g), dim=-1) * 12 / math.sqrt(d)
    k = torch.nn.functional.normalize(torch.randn(T, d, device="cuda", generator=g), dim=-1) * math.sqrt(d)
    sink = torch.randn(T, device="cuda", generator=g)
    lengths = torch.randint(64, 3000, (T // 64,), generator=g, device="cuda").cumsum(0)
    cu = torch.cat([torch.zeros(1, device="cuda", dtype=torch.long), lengths[lengths < T], torch.full((1,), T, device="cuda")])
    tokens = torch.randint(0, 512, (T,), device="cuda", generator=g, dtype=torch.int32)
    targets = torch.roll(tokens, -1)
    return q, k, sink, cu.int(), tokens, targets


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--band", type=int, default=2048)
    parser.add_argument("--tiles", nargs="+", default=["64,64,4,2", "64,64,4,1", "64,32,4,2", "32,64,4,2", "32,32,4,3", "64,64,8,2"])
    a = parser.parse_args()
    q, k, sink, cu, tokens, targets = case(a.tokens, a.band)
    doc = kernels.document_ids(cu, a.tokens)
    start = cu[doc - 1].int()
    up = torch.randn(2, a.tokens, device="cuda")
    written = torch.compile(tg.pointer_written_out)

    def run(kernel: bool):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, sink)]
        if kernel:
            p, s, _ = torch.ops.speedrun.copy_pointer(*leaves, start, tokens, targets, a.band)
        else:
            p, s = written(*leaves, doc, tokens.long(), targets.long(), a.band)
        (p * up[0] + s * up[1]).sum().backward()
        return p, s, *(t.grad for t in leaves)

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; {a.tokens:,} tokens, band {a.band}, "
          f"{len(cu) - 1} documents")
    ref = run(False)
    print(f"written out, compiled: {timing.back_to_back_ms(lambda: run(False), 10):.2f} ms forward + backward")
    for text in a.tiles:
        bm, bn, warps, stages = (int(v) for v in text.split(","))
        kernels.POINTER_TILES = dict(BM=bm, BN=bn, num_warps=warps, num_stages=stages)
        got = run(True)
        errors = ", ".join(f"{name} {(x - y).abs().max().item():.1e}" for name, x, y in
                           zip(("p_copy", "a_sink", "dq", "dk", "dsink"), got, ref))
        ms = timing.back_to_back_ms(lambda: run(True), 10)
        print(f"kernel BM={bm} BN={bn} warps={warps} stages={stages}: {ms:.2f} ms forward + backward; "
              f"max errors: {errors}")


if __name__ == "__main__":
    main()
