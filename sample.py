"""Generate text from a checkpoint of train_gpt.py, on a GPU or the CPU.

    python sample.py checkpoints/<run_id>/step_001670 --prompt "The meaning of life" --tokens 100
    python sample.py latest --temperature 0.8 --top_k 50

Attention is the plain masked computation (train_gpt.attention_reference), so no varlen kernels
are needed; the model sees its trained windows at the final window size. GPT-2 vocabularies are
decoded with tiktoken (offline: set TIKTOKEN_CACHE_DIR); other vocabularies (e.g. --preset smoke's
synthetic one) print token ids.
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402


def load_model(checkpoint: Path, device: torch.device, max_len: int) -> tuple[tg.GPT, tg.Hyperparameters]:
    meta = tg.read_checkpoint_file(checkpoint / "model.pt")
    known = {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["args"].items() if k in known}
    args = tg.Hyperparameters(**saved)
    cfg = tg.ModelConfig.from_args(args)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, max_len))
    model = tg.GPT(cfg, tg.attention_reference, fp8_head=False)
    model.load_state_dict(meta["model"])
    return model.to(device).eval(), args


@torch.no_grad()
def generate(model: tg.GPT, args: tg.Hyperparameters, prompt: list[int], n: int, temperature: float, top_k: int,
             generator: torch.Generator, device: torch.device) -> list[int]:
    """Sample n tokens after [BOS] + prompt. The context is the last max_doc_len tokens; when cut,
    its first token becomes BOS, as in training."""
    tokens = [args.bos_id, *prompt]
    ws = args.window_schedule[-1]
    for _ in range(n):
        context = tokens[-args.max_doc_len:]
        context[0] = args.bos_id
        x = torch.tensor(context, dtype=torch.int32, device=device)
        cu = torch.tensor([0, len(context)], dtype=torch.int32, device=device)
        logits = model.next_token_logits(x, cu, len(context), ws)[: args.vocab_size]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
        tokens.append(nxt)
    return tokens[1 + len(prompt):]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (checkpoints/<run_id>/step_NNNNNN) or 'latest'")
    parser.add_argument("--checkpoint_dir", default="checkpoints", help="where 'latest' looks")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--tokens", type=int, default=100, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = parser.parse_args()
    try:
        checkpoint = tg.find_checkpoint(opts.checkpoint, opts.checkpoint_dir)
        device = torch.device(opts.device)
        model, args = load_model(checkpoint, device, max_len=args_len(opts))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"sample.py: {e}")
    encoder = None
    if args.bos_id == 50256:  # GPT-2 BPE
        import tiktoken
        try:
            encoder = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise SystemExit(f"sample.py: cannot load the GPT-2 encoding ({e}); offline, set TIKTOKEN_CACHE_DIR")
        prompt = encoder.encode_ordinary(opts.prompt)
    elif opts.prompt:
        raise SystemExit("sample.py: this model's vocabulary is not GPT-2's; it takes no text --prompt")
    else:
        prompt = []
    generator = torch.Generator().manual_seed(opts.seed)
    out = generate(model, args, prompt, opts.tokens, opts.temperature, opts.top_k, generator, device)
    print(f"# {checkpoint}: {opts.tokens} tokens, temperature {opts.temperature}, top_k {opts.top_k}", file=sys.stderr)
    if encoder is not None:
        print(opts.prompt + encoder.decode(out))
    else:
        print(" ".join(map(str, out)))


def args_len(opts) -> int:
    return 1 + len(opts.prompt.encode()) + opts.tokens  # an upper bound on the tokens ever in context


if __name__ == "__main__":
    main()
