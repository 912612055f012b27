"""Where the results of a script come from: the commit of this repository, for the provenance line of the
pages the scripts write. A library of the scripts beside it (they import it as `provenance`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The short hash of the repository's HEAD, or "unknown" when git cannot tell (no git, no .git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT, check=True).stdout.strip()
    except Exception:
        return "unknown"
