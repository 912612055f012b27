"""The `inkling-mtp` command line.

    inkling-mtp generate [--checkpoint DIR] (--prompt TEXT | --prompt-ids "3 17 5") [--k N]
                         [--max-new-tokens N] [--temperature T [--top-k K] [--top-p P] [--seed S]]
                         [--dtype D] [--engine ref|fast] [--threads N]
    inkling-mtp convert SRC DST [--max-shard-size 5GB] [--overwrite]
    inkling-mtp check-port DUMP --checkpoint DIR [--tolerance T] [--dtype D] [--device D] [--json FILE]

This package sits above both engines: it imports `inkling_ref`, and `inkling_fast` only when a
command runs the fast engine, so a CPU-only install without Triton runs every command with
`--engine ref`. Each subcommand is a module of this package with one `add(subparsers)` function
that registers its arguments and sets `func`, the function that runs it and returns the exit
status; `SUBCOMMANDS` lists them in the order `--help` shows them.

Errors are one line, `inkling-mtp COMMAND: error: ...`, that names the flag or file and what would be
valid, in the command line's own words (`--k 9`, not the API's `num_speculative_tokens=9`); never a
traceback. Exit status 2: the command line is invalid whatever the checkpoint (a flag's value, flags
that contradict each other); 1: it cannot run with these files (the checkpoint, its config or
tokenizer, or a prompt, --k or --max-new-tokens beyond what the checkpoint holds). check-port adds 3: the
dump was read and does not pass.
"""

from __future__ import annotations

import argparse
import sys

from inkling_ref import CheckpointError, ConfigError
from inkling_ref.decoding.speculative import NonFiniteError

from . import check_port, convert, generate

# The subcommands, in the order `--help` lists them.
SUBCOMMANDS = [generate.add, convert.add, check_port.add]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling-mtp", description="Inkling MTP speculative decoding: generate, "
                                                                      "convert checkpoints, check a port.")
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
    except (CheckpointError, ConfigError, ValueError, OSError, NonFiniteError) as e:
        print(f"inkling-mtp {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
