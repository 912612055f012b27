"""The demo corpus: Python standard-library source, split into train and held-out by file.

Two steps, both reproducible offline:

    python scripts/build_corpus.py list     # scan a CPython 3.11 stdlib -> data/corpus/files.json (committed)
    python scripts/build_corpus.py tokens   # files.json + tokenizer.json -> runs/corpus/*.npy (ignored)

`list` keeps every non-empty `.py` file under the stdlib root that decodes as UTF-8 and parses with `ast`,
except machine-specific or data-like files (site-packages, encodings/ charmap tables, pydoc_data,
_sysconfigdata*, config-*/); byte-identical files are kept once (first path in sorted order), so no
content can land in both splits. A file is held out when the seeded hash of its *path* falls below
`--heldout-fraction`: the split does not depend on which other files exist.

`tokens` reads exactly the files listed, checks each sha256 (another Python's stdlib fails loudly),
and writes one token stream per split, uint16: `<|bos|> file <|eos|>` for every file in list order,
plus `meta.json` with each file's offset in its stream (the evaluation takes prompts from it).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FILES_JSON = REPO / "data" / "corpus" / "files.json"
TOKENIZER = REPO / "inkling_ref" / "default_checkpoint" / "tokenizer.json"
BOS, EOS = "<|bos|>", "<|eos|>"

EXCLUDED_TOP = {"site-packages", "encodings", "pydoc_data", "lib-dynload", "__pycache__"}


def default_stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(path: str, seed: int, heldout_fraction: float) -> str:
    """'heldout' when sha256(f"{seed}:{path}") read as a fraction in [0, 1) is below heldout_fraction."""
    u = int(hashlib.sha256(f"{seed}:{path}".encode()).hexdigest()[:16], 16) / 16**16
    return "heldout" if u < heldout_fraction else "train"


def excluded(rel: Path) -> str | None:
    """Why a stdlib path (relative to the root) is left out, or None."""
    top = rel.parts[0]
    if top in EXCLUDED_TOP or "__pycache__" in rel.parts:
        return f"directory {top}"
    if top.startswith("config-") or rel.name.startswith("_sysconfigdata"):
        return "machine-specific build configuration"
    return None


def unusable(data: bytes) -> str | None:
    """Why a file's content is left out (empty, not UTF-8, not Python 3.11), or None."""
    if not data.strip():
        return "empty"
    try:
        ast.parse(data.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except (SyntaxError, ValueError):
        return "does not parse"
    return None


def make_list(root: Path, seed: int, heldout_fraction: float) -> dict:
    files, seen, skipped = [], {}, {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        why = excluded(rel)
        if why is None:
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            why = unusable(data) or ("duplicate content" if digest in seen else None)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        seen[digest] = rel.as_posix()
        files.append({"path": rel.as_posix(), "sha256": digest, "bytes": len(data),
                      "split": split_of(rel.as_posix(), seed, heldout_fraction)})
    counts = {s: sum(f["split"] == s for f in files) for s in ("train", "heldout")}
    nbytes = {s: sum(f["bytes"] for f in files if f["split"] == s) for s in ("train", "heldout")}
    return {
        "description": "Python standard-library source files of the inkling-mtp demo corpus",
        "source": f"CPython {sys.version.split()[0]} standard library (Lib/), PSF License",
        "python_version": sys.version.split()[0],
        "split_rule": f"heldout iff sha256('{seed}:' + path)[:16] / 16**16 < {heldout_fraction}",
        "split_seed": seed,
        "heldout_fraction": heldout_fraction,
        "skipped": skipped,
        "counts": counts,
        "bytes": nbytes,
        "files": files,
    }


def read_listed(listing: dict, root: Path, split: str | None = None) -> list[tuple[str, str]]:
    """(path, text) of every listed file (of one split, or all), in list order, hashes verified."""
    out, bad = [], []
    for f in listing["files"]:
        if split is not None and f["split"] != split:
            continue
        path = root / f["path"]
        if not path.exists():
            bad.append(f"{f['path']}: missing under {root}")
            continue
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            bad.append(f"{f['path']}: sha256 mismatch")
            continue
        out.append((f["path"], data.decode("utf-8")))
    if bad:
        raise SystemExit(
            f"{len(bad)} listed corpus file(s) differ from files.json (made from CPython "
            f"{listing['python_version']}'s stdlib; pass --stdlib-root pointing at one):\n  "
            + "\n  ".join(bad[:10]) + ("\n  ..." if len(bad) > 10 else ""))
    return out


def tokenize_split(tokenizer, docs: list[tuple[str, str]]) -> tuple[np.ndarray, list[dict]]:
    """One stream `<|bos|> doc <|eos|>` per document -> (uint16 tokens, [{path, start, length}])."""
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    encodings = tokenizer.encode_batch([text for _, text in docs], add_special_tokens=False)
    pieces, index, start = [], [], 0
    for (path, _), enc in zip(docs, encodings):
        ids = [bos, *enc.ids, eos]
        pieces.append(np.asarray(ids, dtype=np.uint16))
        index.append({"path": path, "start": start, "length": len(ids)})
        start += len(ids)
    return np.concatenate(pieces), index


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("list", help="scan the stdlib and write files.json")
    a.add_argument("--stdlib-root", type=Path, default=default_stdlib_root())
    a.add_argument("--out", type=Path, default=FILES_JSON)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--heldout-fraction", type=float, default=0.05)
    b = sub.add_parser("tokens", help="tokenize the listed files into uint16 .npy streams")
    b.add_argument("--stdlib-root", type=Path, default=default_stdlib_root())
    b.add_argument("--files", type=Path, default=FILES_JSON)
    b.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    b.add_argument("--out", type=Path, default=REPO / "runs" / "corpus")
    args = ap.parse_args(argv)

    if args.cmd == "list":
        listing = make_list(args.stdlib_root, args.seed, args.heldout_fraction)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(listing, indent=1) + "\n")
        print(f"wrote {args.out}: {listing['counts']} files, {listing['bytes']} bytes, skipped {listing['skipped']}")
        return

    from tokenizers import Tokenizer

    listing = json.loads(args.files.read_text())
    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    if tokenizer.get_vocab_size() > 2**16:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} tokens: does not fit uint16")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"files_json_sha256": sha256_file(args.files), "tokenizer_sha256": sha256_file(args.tokenizer),
            "vocab_size": tokenizer.get_vocab_size(), "splits": {}}
    for split in ("train", "heldout"):
        docs = read_listed(listing, args.stdlib_root, split)
        tokens, index = tokenize_split(tokenizer, docs)
        np.save(args.out / f"{split}.npy", tokens)
        n_bytes = sum(len(t.encode()) for _, t in docs)
        meta["splits"][split] = {"tokens": int(tokens.size), "files": len(docs), "bytes": n_bytes,
                                 "bytes_per_token": round(n_bytes / tokens.size, 3), "documents": index}
        print(f"{split}: {len(docs)} files, {n_bytes} bytes -> {tokens.size} tokens "
              f"({n_bytes / tokens.size:.2f} bytes/token)")
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out}/train.npy, heldout.npy, meta.json")


if __name__ == "__main__":
    main()
