"""The committed demo corpus list and tokenizer: disjoint splits, the documented split rule, lossless
tokenization that keeps Python indentation compact."""

import hashlib
import importlib.util
import json
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FILES_JSON = REPO / "data" / "corpus" / "files.json"
TOKENIZER = REPO / "inkling_ref" / "default_checkpoint" / "tokenizer.json"


def _build_corpus():
    spec = importlib.util.spec_from_file_location("build_corpus", REPO / "scripts" / "build_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def listing():
    return json.loads(FILES_JSON.read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TOKENIZER))


def test_splits_are_nonempty_and_disjoint(listing):
    files = listing["files"]
    train = [f for f in files if f["split"] == "train"]
    heldout = [f for f in files if f["split"] == "heldout"]
    assert len(train) + len(heldout) == len(files), "every file is train or heldout"
    assert len(train) > 1000 and len(heldout) > 20
    assert {f["path"] for f in train}.isdisjoint(f["path"] for f in heldout)
    assert {f["sha256"] for f in train}.isdisjoint(f["sha256"] for f in heldout)
    assert len({f["path"] for f in files}) == len(files), "a path is listed twice"
    assert listing["counts"] == {"train": len(train), "heldout": len(heldout)}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in files)


def test_split_follows_the_documented_rule(listing):
    """The split is the seeded hash of the path, recomputed here, so it cannot have been hand-picked."""
    split_of = _build_corpus().split_of
    for f in listing["files"]:
        assert f["split"] == split_of(f["path"], listing["split_seed"], listing["heldout_fraction"]), f["path"]
    frac = listing["counts"]["heldout"] / len(listing["files"])
    assert 0.02 < frac < 0.1


SNIPPET = '''class Cache(dict):
    """A cache with a limit."""

    def __init__(self, limit=128):
\tself.limit = limit  # a tab, on purpose
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit!r}")\r
        self._hits = {"naïve": 0, "日本": 1, "emoji": "\U0001f600"}

    def get(self, key,   default=None):   \n        return super().get(key, default)
'''


def test_tokenizer_round_trips_and_has_the_specials(tokenizer):
    assert tokenizer.get_vocab_size() == 4000
    assert [tokenizer.token_to_id(s) for s in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    ids = tokenizer.encode(SNIPPET, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == SNIPPET
    assert max(ids) < 4000 and min(ids) > 2, "plain text never produces a special token"


def test_tokenizer_keeps_indentation_compact(tokenizer):
    """A newline plus an indentation run costs one token (the pre-tokenizer keeps it as one piece)."""
    for depth in (4, 8, 12):
        text = "x = 1\n" + " " * depth + "return x"
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        pieces = [tokenizer.decode([i]) for i in ids]
        assert "\n" + " " * (depth - 1) in pieces, pieces
        assert len(ids) <= 6, pieces


def test_tokenizer_round_trips_a_heldout_file(listing, tokenizer):
    """A real held-out file, when this machine's stdlib is the one the list was made from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    f = next(f for f in listing["files"] if f["split"] == "heldout" and f["bytes"] > 4000)
    path = root / f["path"]
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != f["sha256"]:
        pytest.skip(f"this Python's stdlib ({root}) does not hold the listed {f['path']} "
                    f"(the list was made from CPython {listing['python_version']})")
    text = path.read_text(encoding="utf-8")
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids) == text


def test_token_streams_and_hash_check(tmp_path, tokenizer):
    """`tokens` writes `<|bos|> file <|eos|>` per file with its offset, and refuses a file whose hash differs."""
    bc = _build_corpus()
    texts = {"a.py": "import os\n", "pkg/b.py": "def f():\n    return 1\n"}
    for path, text in texts.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    listing = {"python_version": "test", "files": [
        {"path": p, "sha256": hashlib.sha256(t.encode()).hexdigest(), "bytes": len(t), "split": "train"}
        for p, t in texts.items()]}
    docs = bc.read_listed(listing, tmp_path, "train")
    stream, index = bc.tokenize_split(tokenizer, docs)
    assert stream.dtype.name == "uint16"
    assert [d["path"] for d in index] == ["a.py", "pkg/b.py"]
    for d in index:
        ids = stream[d["start"]: d["start"] + d["length"]].tolist()
        assert ids[0] == 0 and ids[-1] == 1
        assert tokenizer.decode(ids[1:-1]) == texts[d["path"]]
    assert index[1]["start"] == index[0]["length"] and stream.size == sum(d["length"] for d in index)

    (tmp_path / "pkg/b.py").write_text("def f():\n    return 2\n")
    with pytest.raises(SystemExit, match="pkg/b.py: sha256 mismatch"):
        bc.read_listed(listing, tmp_path, "train")
