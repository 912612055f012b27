"""The `inkling-mtp` command line.

    inkling-mtp convert SRC DST [--max-shard-size 5GB] [--overwrite]

Each subcommand is one `add_<name>(subparsers)` function that registers its arguments and sets
`func`, the function that runs it and returns the exit status. To add a subcommand, write its
`add_` function and list it in `SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import re
import sys

from .checkpoint import CheckpointError, convert_transformers_checkpoint
from .config import ConfigError

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


# The subcommands, in the order `--help` lists them. A `generate` subcommand (not written yet) belongs
# here as `add_generate`, next to the generation code it runs.
SUBCOMMANDS = [add_convert]


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
    except (CheckpointError, ConfigError) as e:
        print(f"inkling-mtp {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
