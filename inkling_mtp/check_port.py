"""`inkling-mtp check-port DUMP --checkpoint DIR`: check what an engine's MTP depths computed (a dump,
docs/port_checker.md) against the reference, and name the known porting mistake that reproduces it.

Loads only the MTP head, the embedding, its norm, the final norm and the LM head of the checkpoint
(inkling_ref.port_check.load_head), recomputes every row of the dump, prints the report (stdout) and
exits 0 when the dump passes, 3 when it does not, 1 when the dump or the checkpoint cannot be read
(one line on stderr), 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from inkling_ref.io.checkpoint import inspect_checkpoint

from .argtypes import integer, number

FAILED = 3      # the exit status of a dump that does not pass


def run(args) -> int:
    import torch

    from inkling_ref.port_check import DumpError, check_dump, load_head, read_dump   # only this command needs it

    torch.set_num_threads(args.threads)
    dump = read_dump(args.dump)                                     # the dump first: its own errors come first
    _, depths = inspect_checkpoint(args.checkpoint)                 # config.json and headers only
    k = int(dump["step_k"].max())
    if k > depths:
        raise DumpError(f"{args.dump}: its steps ran {k} MTP depths and the checkpoint {args.checkpoint} has "
                        f"{depths}: the dump comes from another checkpoint")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a CUDA GPU and none is available; use --device cpu")
    head = load_head(args.checkpoint, num_depths=k, dtype=getattr(torch, args.dtype), device=device)
    report = check_dump(head, dump, tolerance=args.tolerance)
    print(report.render())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return 0 if report.passed else FAILED


def add(subparsers) -> None:
    p = subparsers.add_parser(
        "check-port", help="check an engine's MTP depths (a dump) against the reference",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recompute every MTP depth of a dump (docs/port_checker.md) with the reference and report, per\n"
                    "depth, the error of its hidden states, its argmax agreement, where it first diverges and the\n"
                    "known porting mistake that reproduces it (docs/pitfalls.md), with its cost in acceptance.\n"
                    f"Exit status: 0 pass, {FAILED} fail, 1 unreadable dump or checkpoint, 2 bad command line.")
    p.add_argument("dump", metavar="DUMP", help="the dump (.safetensors) written by the engine")
    p.add_argument("--checkpoint", metavar="DIR", required=True,
                   help="the released-layout checkpoint the engine ran (only the MTP head, the embedding, the final "
                        "norm and the LM head are read)")
    p.add_argument("--tolerance", type=number(0, lo_open=True), default=None, metavar="T",
                   help="relative error allowed per row (default by the dump's dtype: 1e-3 for float32, 8e-2 for "
                        "bfloat16, 1e-2 for float16)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="what the reference computes in (default float32)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the reference runs (default cpu)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.add_argument("--threads", type=integer(1), default=1, metavar="N", help="CPU threads for torch (default 1)")
    p.set_defaults(func=run)
