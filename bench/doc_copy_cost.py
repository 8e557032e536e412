"""Where the copy feature's step time goes (doc_copy, public pull request 378's document-local copy candidates): the
matcher alone (train_gpt.doc_copy_candidates) and the embeddings' forward and backward with the feature and without,
each compiled as the model compiles them, on one micro-batch of real documents at the record's shape. With the
feature twice: the matches found inside the embeddings' graph, and given to it (copy_match), as the trainer runs
them since it finds them a micro-batch ahead (GPT.plan_copy_ahead): what is left on the step's path.

    python bench/doc_copy_cost.py --preset record --batch_size 49152 --seq_len 49152 --max_doc_len 2048 \
        --bigram_rows 2500000 --trigram_rows 2500000 --train_files "DATA/fineweb_train_*.bin" [--iters 50]

Prints the median and mean milliseconds of each part over --iters timed calls (CUDA events, after 5 untimed), and
the difference the feature makes to the embeddings. The rest of the feature's cost in a training step (the second
site before the final norm, a larger graph) is the full step's difference (bench/step_time.py --doc_copy true / false)
minus these."""
import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402


def cuda_ms(fn, iters: int, warmup: int = 5) -> list[float]:
    """Each call's milliseconds by CUDA events, after warmup untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def summary(name: str, times: list[float]) -> str:
    return f"{name}: median {statistics.median(times):.3f} ms, mean {statistics.fmean(times):.3f} ms ({len(times)} calls)"


def embeddings_step(model: tg.GPT, inputs: torch.Tensor, cu_seqlens: torch.Tensor, weights: list[torch.Tensor],
                    copy_match=None):
    """The embeddings' forward and a backward of a fixed linear function of every output (each output against its
    own random tensor), as the model's loss would send gradients into them; copy_match: the matches given."""
    if model.ngram_log:  # the n-gram table's gradient log starts over: each call is one micro-batch
        model.ngram_log["used"].zero_()
    x0, ves, bigram, copy = model.embeddings(inputs, cu_seqlens, copy_match)
    outs = [x0, bigram, *(v for v in ves if v is not None), *([] if copy is None else [copy])]
    loss = sum((o.float() * w[: o.numel()].view_as(o)).sum() for o, w in zip(outs, weights))
    loss.backward()


def main():
    own = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--iters", type=int, default=50, help="timed calls of each part")
    mine, rest = own.parse_known_args()
    args = tg.parse_args(rest + ["--doc_copy", "true"])
    device = torch.device("cuda", torch.cuda.current_device())
    torch.set_float32_matmul_precision("high")
    files = tg.shard_files(args.train_files, "training")
    spec = tg.BatchSpec(args.seq_len, args.seq_len, args.max_doc_len, num_docs=args.seq_len // 8 + 1)
    inputs, _, cu_seqlens = (torch.from_numpy(a).to(device) for a in tg.BatchProducer(files, 0, 1, args.bos_id)
                             .step(spec)[0])
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; one micro-batch of {inputs.numel()} "
          f"tokens, {int((cu_seqlens[1:] > cu_seqlens[:-1]).sum())} documents (cut at {args.max_doc_len})", flush=True)

    matcher = torch.compile(tg.doc_copy_candidates, dynamic=False)
    candidate, bucket = matcher(inputs, cu_seqlens)
    eager = tg.doc_copy_candidates(inputs, cu_seqlens)
    assert torch.equal(candidate, eager[0]) and torch.equal(bucket, eager[1]), "the compiled matcher differs"
    print(f"matched positions: {float((bucket > 0).float().mean()):.1%}", flush=True)
    print(summary("matcher, compiled", cuda_ms(lambda: matcher(inputs, cu_seqlens), mine.iters)), flush=True)
    print(summary("matcher, eager", cuda_ms(lambda: tg.doc_copy_candidates(inputs, cu_seqlens), mine.iters)),
          flush=True)

    model = tg.build(args, device, 0, 1)[0]  # the model with its table-gradient sums attached (keep_table_grads)
    cfg = model.cfg
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(inputs.numel() * args.model_dim, device=device, generator=gen) for _ in range(16)]
    results = {}
    for name, on, given in (("doc_copy True, its matches found inside", True, None),
                            ("doc_copy True, its matches given", True, (candidate, bucket)),
                            ("doc_copy False", False, None)):
        model.cfg = dataclasses.replace(cfg, doc_copy=on)
        step = torch.compile(embeddings_step, dynamic=False)
        results[name] = cuda_ms(lambda: step(model, inputs, cu_seqlens, weights, given), mine.iters)
        print(summary(f"embeddings forward + backward, {name}", results[name]), flush=True)
    base = statistics.median(results["doc_copy False"])
    for name in list(results)[:2]:
        print(f"the feature's cost in the embeddings, {name.split(', ')[1]}: "
              f"{statistics.median(results[name]) - base:+.3f} ms a micro-batch (medians)", flush=True)


if __name__ == "__main__":
    main()
