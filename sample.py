"""Generate text from a checkpoint of train_gpt.py, on a GPU or the CPU.

    python sample.py checkpoints/<run_id>/step_000840 --prompt "The meaning of life" --tokens 100
    python sample.py latest --temperature 0.8 --top_k 50
    python sample.py latest --prompt "5 17 42"      # a non-GPT-2 vocabulary: the prompt is token ids

Attention is the plain masked computation (train_gpt.attention_reference), so no varlen kernels
are needed; the model sees its trained windows at the final window size. GPT-2 vocabularies are
decoded with tiktoken (offline: set TIKTOKEN_CACHE_DIR); other vocabularies (e.g. --preset smoke's
synthetic one) take the prompt as space-separated token ids and print token ids; a text prompt
there is ignored, with a note, and sampling starts a new document.

An error is one line, `sample.py: error: ...`; SPEEDRUN_DEBUG=1 shows its Python traceback.
"""
import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_gpt as tg  # noqa: E402

PROG = "sample.py"
DEBUG_ENV = "SPEEDRUN_DEBUG"  # set to 1: errors show their Python traceback (the same in every tool)
GPT2_BOS = tg.BOS_ID  # a checkpoint with this BOS uses GPT-2's BPE


class UsageError(Exception):
    """A mistake in what sample.py was given: reported as one line, exit status 2."""


def load_model(checkpoint: Path, device: torch.device, max_len: int) -> tuple[tg.GPT, tg.Hyperparameters]:
    try:
        meta = tg.read_checkpoint_file(checkpoint / "model.pt")
    except tg.CheckpointFormatError:  # another train_gpt.py's checkpoint: its message names the commit to use
        raise
    except ValueError as e:  # train_gpt's message tells how to resume; here a short one does
        why = type(e.__cause__).__name__ if e.__cause__ is not None else "unreadable"
        raise ValueError(f"{checkpoint / 'model.pt'}: cannot read the checkpoint ({why}): it is corrupt or "
                         "truncated; sample from another one") from e
    known = {f.name for f in dataclasses.fields(tg.Hyperparameters)}
    saved = {k: v for k, v in tg.stored_args(meta["args"]).items() if k in known}
    args = tg.Hyperparameters(**saved)
    cfg = tg.ModelConfig.from_args(args)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, max_len))
    model = tg.GPT(cfg)  # PyTorch's kernels (ModelKernels' defaults): sampling runs anywhere
    weights = dict(meta["model"])
    if meta.get("ngram_shards", 1) > 1:  # a sharded n-gram table: joined from the rank files
        weights["bigram_embed.weight"] = tg.ngram_table_rows(checkpoint, meta, 0, 1)
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # written by a train_gpt.py with another model layout
        lines = str(e).strip().splitlines()  # "Error(s) in loading state_dict ...", then one line per problem
        first = (lines[1] if len(lines) > 1 else lines[0]).strip()
        first = first if len(first) <= 200 else first[:197] + "..."
        raise ValueError(f"{checkpoint}: its weights do not fit this train_gpt.py's model ({first})") from e
    model.tied_embed = meta["step"] < tg.Schedule(args).untie  # as training would go on
    if args.ngram_normalize:  # the n-gram rows hashed from normalized ids, as in training
        model.set_vocabulary(tg.gpt2_token_bytes())
    return tg.to_device(model, device).eval(), args


def encode_prompt(prompt: str, args: tg.Hyperparameters):
    """(token ids, tiktoken encoding or None). GPT-2 vocabularies encode the text; any other takes
    space-separated token ids below vocab_size, and ignores a text prompt with a note on stderr."""
    if args.bos_id == GPT2_BOS:
        try:
            import tiktoken
        except ImportError:
            raise UsageError("decoding GPT-2 tokens needs the tiktoken package (pip install tiktoken)") from None
        try:
            encoder = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise UsageError(f"cannot load the GPT-2 encoding ({type(e).__name__}); offline, set "
                             "TIKTOKEN_CACHE_DIR to a folder holding tiktoken's GPT-2 files") from None
        return encoder.encode_ordinary(prompt), encoder
    words = prompt.split()
    if not all(w.isascii() and w.isdigit() for w in words):
        print(f"{PROG}: note: this checkpoint's vocabulary is not GPT-2's ({args.vocab_size} tokens, BOS "
              f"{args.bos_id}), so text cannot be encoded: --prompt {prompt!r} is ignored and a new document "
              f"starts; a prompt here is token ids, e.g. --prompt \"1 2 3\"", file=sys.stderr)
        return [], None
    ids = [int(w) for w in words]
    bad = [i for i in ids if i >= args.vocab_size]
    if bad:
        raise UsageError(f"--prompt: token id {bad[0]} is out of this checkpoint's vocabulary "
                         f"(ids 0 to {args.vocab_size - 1})")
    return ids, None


@torch.no_grad()
def generate(model: tg.GPT, args: tg.Hyperparameters, prompt: list[int], n: int, temperature: float, top_k: int,
             generator: torch.Generator, device: torch.device) -> list[int]:
    """Sample n tokens after [BOS] + prompt, with the windows of the last training stage. Training
    never sees a document past max_doc_len tokens, so the context is the last max_doc_len tokens,
    opened by a BOS when cut."""
    tokens = [args.bos_id, *prompt]
    windows = tg.Schedule(args).stages[-1].windows
    for _ in range(n):
        context = tokens[-args.max_doc_len:]
        context[0] = args.bos_id
        x = torch.tensor(context, dtype=torch.int32, device=device)
        cu = torch.tensor([0, len(context)], dtype=torch.int32, device=device)
        logits = model.next_token_logits(x, cu, len(context), windows)[: args.vocab_size]
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (checkpoints/<run_id>/step_NNNNNN) or 'latest'")
    parser.add_argument("--checkpoint_dir", default="checkpoints", help="where 'latest' looks")
    parser.add_argument("--prompt", default="",
                        help="text to continue (empty: start a new document); token ids for a non-GPT-2 vocabulary")
    parser.add_argument("--tokens", type=_positive, default=100, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=50, help="sample among the k likeliest tokens; 0 = all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = parser.parse_args(argv)
    try:
        checkpoint = tg.find_checkpoint(opts.checkpoint, opts.checkpoint_dir)
    except FileNotFoundError:
        if opts.checkpoint == "latest":
            raise UsageError(f"no checkpoint under {opts.checkpoint_dir}/: a run saves them with --save_every N, "
                             "e.g. python train_gpt.py --preset smoke --save_every 50") from None
        raise UsageError(f"{opts.checkpoint}: no checkpoint there (expected "
                         f"{Path(opts.checkpoint) / 'model.pt'})") from None
    try:
        device = torch.device(opts.device)
    except RuntimeError:
        raise UsageError(f"--device {opts.device}: not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {opts.device}: no CUDA GPU is available here; use --device cpu")
    try:
        model, args = load_model(checkpoint, device, max_len=args_len(opts))
    except (FileNotFoundError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    prompt, encoder = encode_prompt(opts.prompt, args)
    generator = torch.Generator().manual_seed(opts.seed)
    out = generate(model, args, prompt, opts.tokens, opts.temperature, opts.top_k, generator, device)
    print(f"# {checkpoint}: {opts.tokens} tokens, temperature {opts.temperature}, top_k {opts.top_k}", file=sys.stderr)
    if encoder is not None:
        print(opts.prompt + encoder.decode(out))
    else:
        print(" ".join(map(str, prompt + out)))


def args_len(opts) -> int:
    return 1 + len(opts.prompt.encode()) + opts.tokens  # an upper bound on the tokens ever in context


def cli(argv: list[str] | None = None) -> int:
    """main(), with every error reported as one line `sample.py: error: ...` unless SPEEDRUN_DEBUG=1."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- one line for the user; the traceback on request
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        text = str(e) if isinstance(e, UsageError) else f"{type(e).__name__}: {e} ({DEBUG_ENV}=1 shows the traceback)"
        print(f"{PROG}: error: {' '.join(text.split())}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
