"""`inkling-mtp convert SRC DST`: a transformers `save_pretrained` checkpoint into the released layout."""

from __future__ import annotations

from inkling_ref.io.checkpoint import convert_transformers_checkpoint

from .argtypes import parse_size, path


def run(args) -> int:
    summary = convert_transformers_checkpoint(args.src, args.dst, max_shard_bytes=args.max_shard_size,
                                              overwrite=args.overwrite)
    print(f"converted {summary['tensors']} tensors ({summary['bytes'] / 1e9:.3f} GB) from {args.src} "
          f"(transformers layout) to {args.dst} (released layout): {', '.join(summary['files'])}")
    if not summary["mtp_depths"]:
        print("no MTP head: the transformers layout has none. To add one, copy the release's "
              f"mtp.safetensors into {args.dst} (config.json keeps the MTP fields of the source config).")
    return 0


def add(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="transformers-layout checkpoint -> released layout",
        description="Convert an Inkling checkpoint written by transformers' save_pretrained "
                    "(InklingForCausalLM, or the text part of InklingForConditionalGeneration) into the "
                    "released layout that inkling_ref.load_checkpoint reads. Safetensors only.")
    p.add_argument("src", metavar="SRC", type=path, help="transformers checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", type=path, help="output directory (released layout)")
    p.add_argument("--max-shard-size", type=parse_size, default=None, metavar="SIZE",
                   help="write the trunk in shards of at most SIZE (e.g. 5GB, 512MiB, 1000000; at least one "
                        "byte) plus an index; default: one model.safetensors")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint already in DST (its other files are kept). Without it a DST that "
                        "holds a checkpoint is refused; a DST that is not empty but holds no checkpoint is "
                        "always refused. The new files are written beside DST and swapped in when complete, "
                        "so a failed convert leaves DST as it was")
    p.set_defaults(func=run)
