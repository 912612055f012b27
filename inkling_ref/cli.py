"""The `inkling-mtp` command line.

    inkling-mtp generate [--checkpoint DIR] (--prompt TEXT | --prompt-ids "3 17 5") [--k N]
                         [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                         [--engine ref|fast]
    inkling-mtp convert SRC DST [--max-shard-size 5GB] [--overwrite]

Each subcommand is one `add_<name>(subparsers)` function that registers its arguments and sets
`func`, the function that runs it and returns the exit status. To add a subcommand, write its
`add_` function and list it in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .checkpoint import CheckpointError, convert_transformers_checkpoint, load_checkpoint
from .config import ConfigError

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "default_checkpoint"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


# ---------------------------------------------------------------------- convert
def run_convert(args) -> int:
    summary = convert_transformers_checkpoint(args.src, args.dst, max_shard_bytes=args.max_shard_size,
                                              overwrite=args.overwrite)
    print(f"converted {summary['tensors']} tensors ({summary['bytes'] / 1e9:.3f} GB) from {args.src} "
          f"(transformers layout) to {args.dst} (released layout): {', '.join(summary['files'])}")
    if not summary["mtp_depths"]:
        print("no MTP head: the transformers layout has none. To add one, copy the release's "
              f"mtp.safetensors into {args.dst} (config.json keeps the MTP fields of the source config).")
    return 0


def add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="transformers-layout checkpoint -> released layout",
        description="Convert an Inkling checkpoint written by transformers' save_pretrained "
                    "(InklingForCausalLM, or the text part of InklingForConditionalGeneration) into the "
                    "released layout that inkling_ref.load_checkpoint reads. Safetensors only.")
    p.add_argument("src", metavar="SRC", help="transformers checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", help="output directory (released layout)")
    p.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                   help="write the trunk in shards of at most SIZE (e.g. 5GB) plus an index; "
                        "default: one model.safetensors")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    p.set_defaults(func=run_convert)


# ---------------------------------------------------------------------- generate
def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be integers separated by spaces, got {text!r}") from None


def resolve_engine(name: str | None, dtype: str = "float32") -> str:
    """--engine: 'ref' (the reference) or 'fast' (inkling_fast.Engine, CUDA). Default: fast when a CUDA
    GPU is present and the dtype is one the fast engine runs (float32, bfloat16), ref otherwise."""
    import torch

    if name is None:
        return "fast" if torch.cuda.is_available() and dtype in ("float32", "bfloat16") else "ref"
    if name == "fast" and not torch.cuda.is_available():
        raise ValueError("--engine fast needs a CUDA GPU and none is available; use --engine ref")
    return name


def run_generate(args) -> int:
    import torch

    from .generation import generate

    torch.set_num_threads(args.threads)
    path = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"--prompt needs a tokenizer, and {path} has no tokenizer.json: pass token ids "
                             "with --prompt-ids instead")
        if not args.prompt:
            raise ValueError("the prompt is empty")
        prompt = tokenizer.encode(args.prompt).ids
    else:
        prompt = args.prompt_ids
    if not prompt:
        raise ValueError("the prompt is empty")
    k = args.k
    model = load_checkpoint(path, dtype=getattr(torch, args.dtype), num_mtp_depths=k)
    options = dict(max_new_tokens=args.max_new_tokens, num_speculative_tokens=k, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=model.config.eos_token_id)
    if resolve_engine(args.engine, args.dtype) == "fast":
        from inkling_fast import Engine  # imported only here: inkling_ref never depends on inkling_fast

        max_seq_len = max(2, min(len(prompt) + args.max_new_tokens, model.config.max_position_embeddings))
        engine = Engine(model, max_batch_size=1, max_seq_len=max_seq_len, num_speculative_tokens=k,
                        dtype=getattr(torch, args.dtype))
        result = engine.generate(prompt, **options)
    else:
        result = generate(model, prompt, **options)
    new = result.token_ids[0]
    if tokenizer is not None:
        print(tokenizer.decode(prompt + new, skip_special_tokens=False))
    else:
        print(" ".join(map(str, new)))
    s = result.stats
    print(f"\n--- {len(new)} tokens in {result.elapsed_s:.2f} s ({len(new) / result.elapsed_s:.1f} tokens/s), "
          f"k = {k}, {sum(len(c) for c in result.cycles)} verify passes", file=sys.stderr)
    if k > 0:
        per = " ".join(f"{100 * v:.0f}%" for v in s.per_position.values())
        print(f"acceptance length {s.acceptance_length:.2f} over {s.num_cycles} full cycles; "
              f"per-position acceptance {per}", file=sys.stderr)
    return 0


def add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a continuation with MTP speculative decoding",
        description="Generate with k drafts per cycle from the MTP head, on the fast engine (CUDA) or the "
                    "reference model (CPU), and print the continuation and its acceptance statistics.")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help=f"released-layout checkpoint (default: the bundled one, {DEFAULT_CHECKPOINT.name}/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json in the checkpoint)")
    src.add_argument("--prompt-ids", metavar="IDS", type=parse_ids, help='prompt token ids, e.g. "3 17 5"')
    p.add_argument("--k", type=int, default=4, metavar="N", help="draft tokens per cycle (0 = plain decoding)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32",
                   help="weights and activations (the fast engine runs float32 or bfloat16)")
    p.add_argument("--engine", choices=["ref", "fast"], default=None,
                   help="ref: the reference (CPU); fast: inkling_fast.Engine, Triton kernels in CUDA graphs "
                        "(needs a GPU). Default: fast when a GPU is present and --dtype is float32 or "
                        "bfloat16, else ref")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="CPU threads for torch (default 1: the reference's many small ops run fastest on one)")
    p.set_defaults(func=run_generate)


# The subcommands, in the order `--help` lists them.
SUBCOMMANDS = [add_generate, add_convert]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling-mtp",
                                     description="Inkling reference: checkpoints and MTP speculative decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `inkling-mtp`; returns the exit status (0 ok, 1 bad checkpoint/config, 2 bad usage)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"inkling-mtp {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
