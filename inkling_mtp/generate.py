"""`inkling-mtp generate`: continue a prompt with MTP speculative decoding, on the fast engine (CUDA)
or the reference, and print the continuation (stdout) and its acceptance statistics (stderr)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inkling_ref import DEFAULT_CHECKPOINT, CheckpointError
from inkling_ref.decoding.generation import Limits, validate
from inkling_ref.io.checkpoint import inspect_checkpoint, load_checkpoint, load_tokenizer

from .argtypes import depth_count, integer, max_threads, number, path, threads, utf8_text


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers separated by spaces, e.g. \"3 17 5\", got {text!r}") \
            from None


def resolve_engine(name: str | None, dtype: str = "float32") -> str:
    """--engine: 'ref' (the reference) or 'fast' (inkling_fast.Engine, CUDA). Default: fast when a CUDA
    GPU is present and the dtype is one the fast engine runs (FAST_DTYPES), ref otherwise."""
    import torch

    if name is None:
        return "fast" if torch.cuda.is_available() and dtype in FAST_DTYPES else "ref"
    if name == "fast" and not torch.cuda.is_available():
        raise ValueError("--engine fast needs a CUDA GPU and none is available; use --engine ref")
    return name


FAST_DTYPES = ("float32", "bfloat16")   # inkling_fast.engine.DTYPES (tests/test_layering.py keeps them equal)
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
             f"on {where}, {dtype}, k = {k if k != 'auto' else f'auto (0 to {s.k})'}"]
    cycles = [c for seq in result.cycles for c in seq]
    if k == "auto":
        return "\n".join(lines + auto_report(s, cycles))
    if k == 0:
        lines.append(f"plain decoding: {_count(len(cycles), 'trunk pass', 'trunk passes')} after the prompt, "
                     "one token each (the first new token comes from the prompt's own pass)")
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


SEQ_BUCKET = 64       # max_seq_len is rounded up to a multiple of this
PREFILL_CHUNK = 8     # tokens per prefill pass (batch 1)


def fast_engine_sizes(prompt_len: int, max_new_tokens: int, model_max: int) -> dict:
    """The fast engine's sizes for one request: max_seq_len rounded up to a multiple of SEQ_BUCKET
    (within the model's maximum), and prefill passes of PREFILL_CHUNK tokens. Prompts of other lengths
    then run the same prefill pass shape over caches of the same layout, so a new prompt on a warm
    Triton cache finds its kernels built (a kernel is built per shape class of its arguments). A chunk
    this short runs the prompt through the few-token kernels the cycles use (a cycle's rows carry up to
    k + 1 tokens), so that a first run builds few kernels for the prompt alone; longer chunks take the
    many-token paths (inkling_fast/forward.py) and wider tiles, each one more kernel to build."""
    need = prompt_len + max_new_tokens
    return dict(max_seq_len=max(2, min(-(-need // SEQ_BUCKET) * SEQ_BUCKET, model_max)),
                prefill_tokens=PREFILL_CHUNK, prefill_lengths=[PREFILL_CHUNK])


def auto_report(s, cycles) -> list[str]:
    """The statistics of a --k auto run: which k ran how often, and the acceptance of each."""
    used = ", ".join(f"{k} x {n}" for k, n in s.k_used.items())
    lines = [f"{_count(len(cycles), 'cycle')}, k chosen each cycle; k used: {used}"]
    if s.num_cycles:
        lines.append(f"acceptance length {s.acceptance_length:.2f}: tokens gained per verify pass, mean of "
                     f"{_count(s.num_cycles, 'full cycle')}")
    for k, by in s.by_k(cycles).items():
        if k and by.num_cycles:
            per = " ".join(f"{100 * v:.0f}%" for v in by.per_position.values())
            lines.append(f"  k = {k}: acceptance length {by.acceptance_length:.2f}, per position {per} "
                         f"({_count(by.num_cycles, 'full cycle')})")
    return lines


def run(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    path = Path(args.checkpoint) if args.checkpoint is not None else DEFAULT_CHECKPOINT
    config, depths = inspect_checkpoint(path)  # config.json and headers only: no weight is read yet
    k = args.k
    if k != "auto" and k > depths:
        raise CheckpointError(mtp_depths_message(k, path, depths))
    loaded = depths if k == "auto" else k                 # "auto" chooses among every depth the checkpoint has
    prompt, prompt_name, tokenizer = read_prompt(args, path)
    engine = resolve_engine(args.engine, args.dtype)
    flags = {name: _flag(name) for name in ("max_new_tokens", "seed")}
    validate(Limits.of_config(config, depths), [prompt], args.max_new_tokens, k, seed=args.seed,
             flags=dict(flags, num_speculative_tokens="--k", prompt_ids=prompt_name))

    model = load_checkpoint(path, dtype=getattr(torch, args.dtype), num_mtp_depths=loaded)
    options = dict(max_new_tokens=args.max_new_tokens, num_speculative_tokens=k, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos_token_id=model.config.eos_token_id)
    setup = None
    if engine == "fast":
        from inkling_fast import Engine  # imported only here: a CPU-only install has no Triton

        fast = Engine(model, max_batch_size=1, num_speculative_tokens=loaded, dtype=getattr(torch, args.dtype),
                      **fast_engine_sizes(len(prompt), args.max_new_tokens, model.config.max_position_embeddings))
        setup = fast.warmup(prompt, **options)      # compile + capture for exactly this request's shapes
        result = fast.generate(prompt, **options)
    else:
        from inkling_ref import generate

        result = generate(model, prompt, **options)
    new = result.token_ids[0]
    if tokenizer is not None:
        print(tokenizer.decode(prompt + new, skip_special_tokens=False))
    else:
        print(" ".join(map(str, new)))
    print("\n" + report(result, k, engine, args.dtype, setup), file=sys.stderr)
    return 0


def add(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate a continuation with MTP speculative decoding",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=GLOSSARY,
        description="Generate with k drafts per cycle from the MTP head, on the fast engine (CUDA) or the\n"
                    "reference model (CPU), and print the continuation (stdout) and its acceptance statistics\n"
                    "(stderr).")
    p.add_argument("--checkpoint", metavar="DIR", type=path, default=None,
                   help=f"released-layout checkpoint (default: the bundled one, {DEFAULT_CHECKPOINT.name}/; an "
                        "empty DIR is an error)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", type=utf8_text,
                     help="prompt text, valid UTF-8 (needs tokenizer.json in the checkpoint)")
    src.add_argument("--prompt-ids", metavar="IDS", type=parse_ids,
                     help='prompt token ids, e.g. "3 17 5": integers in 0..vocabulary size - 1')
    p.add_argument("--k", type=depth_count, default=4, metavar="N",
                   help="draft tokens per cycle, at most the checkpoint's MTP depths (0 = plain decoding; "
                        "default 4), or auto: each cycle the k with the most expected tokens per second, "
                        "from measured cycle costs and the acceptance seen so far")
    p.add_argument("--max-new-tokens", type=integer(1), default=64, metavar="N",
                   help="an integer >= 1, with the prompt at most the model's maximum length (default 64)")
    p.add_argument("--temperature", type=number(0), default=0.0, metavar="T",
                   help="0 = greedy (the default); > 0 samples, with --top-k, --top-p and --seed (any finite "
                        "T > 0, down to the smallest positive double, where sampling is greedy in the limit)")
    p.add_argument("--top-k", type=integer(1), default=None, metavar="K",
                   help="sample among the K most likely, an integer >= 1 (any K >= the vocabulary keeps all)")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=None, metavar="P",
                   help="sample among the most likely tokens that together reach probability P, 0 < P <= 1")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampling (any integer)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32",
                   help="weights and activations (the fast engine runs float32 or bfloat16)")
    p.add_argument("--engine", choices=["ref", "fast"], default=None,
                   help="ref: the reference (CPU); fast: inkling_fast.Engine, Triton kernels in CUDA graphs "
                        "(needs a GPU). Default: fast when a GPU is present and --dtype is one it runs, "
                        "else ref")
    p.add_argument("--threads", type=threads, default=1, metavar="N",
                   help="CPU threads for torch, 1 to the number of CPUs of this machine "
                        f"({max_threads()} here) (default 1: the reference's many small ops run fastest on one)")
    p.set_defaults(func=run, check=lambda args: check_generate_args(p, args))
