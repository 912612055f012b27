"""Train the demo's byte-level BPE tokenizer on the *train* split of the corpus (data/corpus/files.json).

    python scripts/train_tokenizer.py        # -> inkling_ref/default_checkpoint/tokenizer.json

Byte-level: every byte sequence round-trips exactly (no normalizer, no whitespace stripping, no
prefix space). The GPT-2 style pre-tokenizer regex keeps a run of whitespace before a line's first
word as one piece (e.g. "\\n        " before "return"), so BPE learns newline+indentation tokens,
and words keep their leading space (" return"). Specials first: <|bos|> = 0, <|eos|> = 1, <|pad|> = 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_corpus import FILES_JSON, TOKENIZER, default_stdlib_root, read_listed  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib-root", type=Path, default=default_stdlib_root())
    ap.add_argument("--files", type=Path, default=FILES_JSON)
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=TOKENIZER)
    args = ap.parse_args(argv)

    listing = json.loads(args.files.read_text())
    texts = [text for _, text in read_listed(listing, args.stdlib_root, "train")]
    tok = train_tokenizer(texts, args.vocab_size)
    if tok.get_vocab_size() != args.vocab_size:
        raise SystemExit(f"BPE stopped at {tok.get_vocab_size()} tokens, asked for {args.vocab_size}")
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens, train split {n_bytes} bytes -> {n_tok} tokens "
          f"({n_bytes / n_tok:.2f} bytes/token)")


if __name__ == "__main__":
    main()
