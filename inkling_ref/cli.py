"""The `inkling-mtp` command line.

    inkling-mtp generate [--checkpoint DIR] (--prompt TEXT | --prompt-ids "3 17 5") [--k N]
                         [--max-new-tokens N] [--temperature T [--top-k K] [--top-p P] [--seed S]]
                         [--dtype D] [--engine ref|fast] [--threads N]
    inkling-mtp convert SRC DST [--max-shard-size 5GB] [--overwrite]

Each subcommand is one `add_<name>(subparsers)` function that registers its arguments and sets
`func`, the function that runs it and returns the exit status. To add a subcommand, write its
`add_` function and list it in `SUBCOMMANDS`.

Errors are one line, `inkling-mtp COMMAND: error: ...`, that names the flag or file and what would be
valid, in the command line's own words (`--k 9`, not the API's `num_speculative_tokens=9`); never a
traceback. Exit status 2: the command line is invalid whatever the checkpoint (a flag's value, flags
that contradict each other); 1: it cannot run with these files (the checkpoint, its config or
tokenizer, or a prompt, --k or --max-new-tokens beyond what the checkpoint holds).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from .checkpoint import (CheckpointError, convert_transformers_checkpoint, inspect_checkpoint, load_checkpoint,
                         load_tokenizer)
from .config import ConfigError
from .generation import Limits, validate

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "default_checkpoint"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '512MiB' -> 536_870_912, '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def integer(lo: int):
    """argparse type: an integer >= lo."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    return parse


def number(lo: float, hi: float = math.inf, lo_open: bool = False):
    """argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open). NaN and infinity are refused:
    they would pass no check downstream and sample garbage."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi < math.inf else f">= {lo:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {'in ' if hi < math.inf else ''}"
                                             f"{interval}, got {text!r}")
        return v
    return parse


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
        raise argparse.ArgumentTypeError(f"must be integers separated by spaces, e.g. \"3 17 5\", got {text!r}") \
            from None


def resolve_engine(name: str | None, dtype: str = "float32") -> str:
    """--engine: 'ref' (the reference) or 'fast' (inkling_fast.Engine, CUDA). Default: fast when a CUDA
    GPU is present and the dtype is one the fast engine runs (float32, bfloat16), ref otherwise."""
    import torch

    if name is None:
        return "fast" if torch.cuda.is_available() and dtype in FAST_DTYPES else "ref"
    if name == "fast" and not torch.cuda.is_available():
        raise ValueError("--engine fast needs a CUDA GPU and none is available; use --engine ref")
    return name


FAST_DTYPES = ("float32", "bfloat16")
SAMPLING_ONLY = ("top_k", "top_p", "seed")  # flags that mean nothing to greedy decoding

GLOSSARY = """\
what the statistics mean (docs/spec/mtp-cycle.md, section 6):
  cycle / verify pass   the MTP head drafts k tokens, then one pass of the trunk checks them all,
                        keeps the longest prefix it agrees with and adds one token of its own
  full cycle            a cycle that made all k drafts and emitted no end-of-text; cycles cut short
                        by --max-new-tokens are left out of the statistics
  acceptance length     tokens gained per verify pass, mean(accepted drafts + 1) over the full
                        cycles: 1 for plain decoding, k + 1 at most
  per-position acceptance  for j = 1..k, the share of full cycles that accepted draft j (and so
                        every draft before it)
"""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_generate_args(parser: argparse.ArgumentParser, args) -> None:
    """Contradictions between flags: usage errors (exit 2), whatever the checkpoint."""
    if args.prompt is not None and not args.prompt:
        parser.error("--prompt is empty: give some text, or token ids with --prompt-ids")
    if args.prompt_ids is not None and not args.prompt_ids:
        parser.error('--prompt-ids is empty: give at least one token id, e.g. --prompt-ids "3 17 5"')
    if args.temperature == 0:
        given = [_flag(n) for n in SAMPLING_ONLY if getattr(args, n) is not None]
        if given:
            parser.error(f"{' and '.join(given)} only {'apply' if len(given) > 1 else 'applies'} when sampling, and "
                         f"--temperature 0 (the default) decodes greedily: add --temperature T > 0 (e.g. 0.8) "
                         f"or drop {' and '.join(given)}")
    if args.engine == "fast" and args.dtype not in FAST_DTYPES:
        parser.error(f"--engine fast runs --dtype {' or '.join(FAST_DTYPES)}, not {args.dtype}: choose one of "
                     "those or --engine ref")


def mtp_depths_message(k: int, path: Path, depths: int) -> str:
    if depths == 0:
        return (f"--k {k}: the checkpoint {path} has no MTP head (no complete model.mtp.* depth), so it cannot "
                "draft: use --k 0 (plain decoding)")
    return f"--k {k}: the checkpoint {path} has {depths} MTP depths, so --k can be 0 to {depths}"


def read_prompt(args, path: Path):
    """(token ids, how errors name the prompt, tokenizer or None).

    --prompt needs the checkpoint's tokenizer; with --prompt-ids it only turns the output into text, so
    an unreadable tokenizer.json is then a warning and the output is printed as ids."""
    if args.prompt is not None:
        tokenizer = load_tokenizer(path)
        if tokenizer is None:
            raise CheckpointError(f"--prompt needs a tokenizer, and {path} has no tokenizer.json: pass token ids "
                                  "with --prompt-ids instead")
        ids = tokenizer.encode(args.prompt).ids
        if not ids:
            raise ValueError(f"--prompt {args.prompt!r} gives no tokens with {path / 'tokenizer.json'}")
        return ids, f"the prompt (--prompt, tokenized by {path / 'tokenizer.json'})", tokenizer
    try:
        tokenizer = load_tokenizer(path)
    except CheckpointError as e:
        print(f"inkling-mtp generate: warning: {e}; printing token ids instead of text", file=sys.stderr)
        tokenizer = None
    return args.prompt_ids, "the prompt (--prompt-ids)", tokenizer


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def report(result, k: int, engine: str, dtype: str, setup=None) -> str:
    """The statistics under the continuation, each term said in plain words (see GLOSSARY). setup: the
    fast engine's SetupReport (kernels built and graphs captured by a first run of the same request),
    reported apart from the timed run."""
    new, s = result.token_ids[0], result.stats
    where = "the fast engine (GPU)" if engine == "fast" else "the reference (CPU)"
    lines = [] if setup is None else [f"--- {setup}, then the timed run:"]
    lines += [f"--- {len(new)} new tokens in {result.elapsed_s:.2f} s ({len(new) / result.elapsed_s:.1f} tokens/s) "
             f"on {where}, {dtype}, k = {k}"]
    cycles = [c for seq in result.cycles for c in seq]
    if k == 0:
        lines.append(f"plain decoding: {_count(len(cycles), 'trunk pass', 'trunk passes')} after the prompt, "
                     "one token each")
        return "\n".join(lines)
    short = len(cycles) - s.num_cycles
    lines.append(f"{_count(len(cycles), 'cycle')}: in each the MTP head drafts up to {k} tokens and one trunk pass "
                 "verifies them" + (f"; {short} cut short by --max-new-tokens or end-of-text "
                                    f"{'is' if short == 1 else 'are'} not in the statistics" if short else ""))
    if s.num_cycles == 0:
        lines.append(f"no full cycle (one with all {k} drafts), so no acceptance statistics: raise "
                     "--max-new-tokens")
        return "\n".join(lines)
    per = " ".join(f"{100 * v:.0f}%" for v in s.per_position.values())
    lines.append(f"acceptance length {s.acceptance_length:.2f}: tokens gained per verify pass (accepted drafts + 1; "
                 f"plain decoding: 1), mean of {_count(s.num_cycles, 'full cycle')}")
    lines.append(f"per-position acceptance {per}: how often draft 1..{k} was accepted, over the full cycles")
    return "\n".join(lines)


def run_generate(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    path = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    config, depths = inspect_checkpoint(path)  # config.json and headers only: no weight is read yet
    k = args.k
    if k > depths:
        raise CheckpointError(mtp_depths_message(k, path, depths))
    prompt, prompt_name, tokenizer = read_prompt(args, path)
    engine = resolve_engine(args.engine, args.dtype)
    flags = {name: _flag(name) for name in ("max_new_tokens", "seed")}
    validate(Limits.of_config(config, depths), [prompt], args.max_new_tokens, k, seed=args.seed,
             flags=dict(flags, num_speculative_tokens="--k", prompt_ids=prompt_name))

    model = load_checkpoint(path, dtype=getattr(torch, args.dtype), num_mtp_depths=k)
    options = dict(max_new_tokens=args.max_new_tokens, num_speculative_tokens=k, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=model.config.eos_token_id)
    setup = None
    if engine == "fast":
        from inkling_fast import Engine  # imported only here: inkling_ref never depends on inkling_fast

        max_seq_len = max(2, min(len(prompt) + args.max_new_tokens, model.config.max_position_embeddings))
        fast = Engine(model, max_batch_size=1, max_seq_len=max_seq_len, num_speculative_tokens=k,
                      dtype=getattr(torch, args.dtype))
        setup = fast.warmup(prompt, **options)      # compile + capture for exactly this request's shapes
        result = fast.generate(prompt, **options)
    else:
        from .generation import generate

        result = generate(model, prompt, **options)
    new = result.token_ids[0]
    if tokenizer is not None:
        print(tokenizer.decode(prompt + new, skip_special_tokens=False))
    else:
        print(" ".join(map(str, new)))
    print("\n" + report(result, k, engine, args.dtype, setup), file=sys.stderr)
    return 0


def add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a continuation with MTP speculative decoding",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=GLOSSARY,
        description="Generate with k drafts per cycle from the MTP head, on the fast engine (CUDA) or the\n"
                    "reference model (CPU), and print the continuation (stdout) and its acceptance statistics\n"
                    "(stderr).")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help=f"released-layout checkpoint (default: the bundled one, {DEFAULT_CHECKPOINT.name}/)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs tokenizer.json in the checkpoint)")
    src.add_argument("--prompt-ids", metavar="IDS", type=parse_ids, help='prompt token ids, e.g. "3 17 5"')
    p.add_argument("--k", type=integer(0), default=4, metavar="N",
                   help="draft tokens per cycle, at most the checkpoint's MTP depths (0 = plain decoding; "
                        "default 4)")
    p.add_argument("--max-new-tokens", type=integer(1), default=64, metavar="N", help="default 64")
    p.add_argument("--temperature", type=number(0), default=0.0, metavar="T",
                   help="0 = greedy (the default); > 0 samples, with --top-k, --top-p and --seed")
    p.add_argument("--top-k", type=integer(1), default=None, metavar="K", help="sample among the K most likely")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=None, metavar="P",
                   help="sample among the most likely tokens that together reach probability P, 0 < P <= 1")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampling (any integer)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32",
                   help="weights and activations (the fast engine runs float32 or bfloat16)")
    p.add_argument("--engine", choices=["ref", "fast"], default=None,
                   help="ref: the reference (CPU); fast: inkling_fast.Engine, Triton kernels in CUDA graphs "
                        "(needs a GPU). Default: fast when a GPU is present and --dtype is float32 or "
                        "bfloat16, else ref")
    p.add_argument("--threads", type=integer(1), default=1, metavar="N",
                   help="CPU threads for torch (default 1: the reference's many small ops run fastest on one)")
    p.set_defaults(func=run_generate, check=lambda args: check_generate_args(p, args))


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
    """Entry point of `inkling-mtp`; returns the exit status (0 ok, 1 cannot run with these files, 2 bad usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "check", None) is not None:  # contradictions between flags: exit 2 with the usage
        args.check(args)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        print(f"inkling-mtp {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
