"""Mutation testing helper: a copy of `inkling_ref` with deliberate source edits, imported under a
fresh package name. Tests use it to prove they fail on a broken implementation.

Each edit is (file, old, new); `old` must occur exactly once in that file, so a mutant cannot
silently stop applying when the reference changes.
"""

from __future__ import annotations

import importlib
import itertools
import shutil
import sys
from pathlib import Path

import inkling_ref

_counter = itertools.count()


def load_mutant(tmp_path: Path, edits: list[tuple[str, str, str]], package: str = "inkling_ref"):
    """Copy `package` into tmp_path under a new name, apply `edits`, import and return it."""
    src = Path(importlib.import_module(package).__file__).parent
    name = f"{package}_mutant_{next(_counter)}"
    dst = tmp_path / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "default_checkpoint"))
    for file, old, new in edits:
        path = dst / file
        text = path.read_text()
        count = text.count(old)
        assert count == 1, f"mutation target {old!r} occurs {count} times in {file}"
        path.write_text(text.replace(old, new))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


assert inkling_ref  # the original must import before any mutant is made from it
