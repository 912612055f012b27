"""The tree speaks of the model, the code and the measurements, not of how the measurements were scheduled.

A measurement is described by its date, its GPU, its commit and its command. Words about the
machinery that ran it (a lease on a machine, a device call, a session, runs made back to back on a
warm machine, a table copied by hand from a run's log) say nothing a reader can use, and they age.
This test greps every text file of the repository for them: docs, notebooks (sources and stored
outputs), the README, code, scripts and the benchmark JSON (whose notes are printed by notebook 05).

Legitimate technical uses are listed in ALLOWED, each with its reason. `test_a_planted_word_fails`
plants each word into a copy of a doc, a notebook output and a code comment, and checks that the grep
finds it."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> pattern (case-insensitive; \b keeps "release" and "please" out of "lease")
WORDS = {
    "lease": r"\blease[sd]?\b",
    "session": r"\bsessions?\b",
    "device call": r"\bdevice calls?\b",
    "back to back": r"\b(?:ran|run|runs|measured|timed) back[ -]to[ -]back\b|, back[ -]to[ -]back\b",
    "warm or same machine": r"\b(?:warm|same) machines?\b",
    "an earlier run": r"\b(?:an|the) (?:earlier|previous|later) runs?\b|\bearlier runs\b",
    "the call before": r"\b(?:in )?the (?:call|run) before\b",
    "by hand from a run": r"\b(?:copied|recorded)(?: here)? by hand\b|\bthe run's (?:log|output)\b",
}

# (path glob, pattern of the allowed line, reason)
ALLOWED = [
    ("tests/bad_inputs.py", r"written once per session",
     "pytest's session scope: the fixture is built once per pytest run"),
    ("tests/*.py", r"""scope=["']session["']""", "pytest's fixture scope, an API name"),
]

SUFFIXES = {".md", ".py", ".ipynb", ".sh", ".json", ".toml", ".yaml", ".yml", ".cfg", ".txt"}
# (path prefix, reason)
SKIPPED = [
    ("inkling_ref/default_checkpoint/tokenizer.json", "a vocabulary: 'lease' is one of its words"),
    ("data/", "third-party text: excerpts of the Python standard library used as prompts and corpus"),
    ("tests/test_no_scheduling_words.py", "this file names the words it looks for"),
]


def files() -> list[str]:
    """Every text file of the tree (git's tracked and untracked-but-not-ignored files; a walk where there is
    no .git), relative to the root."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        out = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "build", "runs")]
            out += [str((Path(folder) / n).relative_to(ROOT)) for n in names]
    paths = [p for p in out if Path(p).suffix in SUFFIXES or p == ".ci/run"]
    return sorted(p for p in paths if not any(p.startswith(prefix) for prefix, _ in SKIPPED) and (ROOT / p).is_file())


def hits(path: str, text: str) -> list[str]:
    """'path:line: word: the line' for each scheduling word in `text` that ALLOWED does not excuse."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, pattern in WORDS.items():
            if re.search(pattern, line, re.IGNORECASE) and not any(
                    fnmatch.fnmatch(path, p) and re.search(allowed, line) for p, allowed, _ in ALLOWED):
                found.append(f"{path}:{n}: {name}: {line.strip()[:160]}")
    return found


def test_no_scheduling_words_in_the_tree():
    paths = files()
    assert "README.md" in paths and "notebooks/05_when_mtp_pays.ipynb" in paths and "docs/benchmarks/engine.json" in paths
    found = [h for p in paths for h in hits(p, (ROOT / p).read_text(errors="replace"))]
    assert not found, ("describe a measurement by its date, GPU, commit and command, not by how it was scheduled "
                       "(or add a legitimate use to ALLOWED, with its reason):\n" + "\n".join(found))


def test_every_allowed_file_use_is_still_there():
    for path, allowed, reason in ALLOWED:
        if not any(c in path for c in "*?["):
            assert re.search(allowed, (ROOT / path).read_text()), f"{path} no longer has {allowed!r} ({reason}): drop it"


def test_a_planted_word_fails():
    doc = (ROOT / "docs" / "benchmarks" / "whole_requests.md").read_text()
    notebook = json.loads((ROOT / "notebooks" / "05_when_mtp_pays.ipynb").read_text())
    code = (ROOT / "inkling_fast" / "cost_model.py").read_text()
    plants = {"lease": "measured in one lease", "session": "in the same session", "device call": "in one device call",
              "back to back": "run back to back", "warm or same machine": "on the same machine",
              "an earlier run": "an earlier run measured 1.35x", "the call before": "in the call before",
              "by hand from a run": "copied by hand"}
    assert set(plants) == set(WORDS)
    for name, phrase in plants.items():
        assert not hits("doc.md", doc) and not hits("cost_model.py", code)
        assert [h for h in hits("doc.md", doc + f"\nThe table was {phrase}.\n") if f": {name}:" in h]
        assert [h for h in hits("cost_model.py", code.replace('"""', f'"""({phrase}) ', 1)) if f": {name}:" in h]
        planted = json.loads(json.dumps(notebook))
        cell = next(c for c in planted["cells"] if c["cell_type"] == "code" and c.get("outputs"))
        cell["outputs"].append({"name": "stdout", "output_type": "stream", "text": [f"note: {phrase}\n"]})
        assert [h for h in hits("nb.ipynb", json.dumps(planted, indent=1)) if f": {name}:" in h], name
    assert not hits("tests/bad_inputs.py", "`env` holds a tiny random checkpoint written once per session, a model")
    assert hits("tests/other.py", "written once per session")
    assert not hits("tests/conftest.py", '@pytest.fixture(scope="session")')
    assert hits("docs/x.md", 'scope="session"')
