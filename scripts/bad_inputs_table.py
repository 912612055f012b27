"""Write docs/bad_inputs.md: every bad input of tests/bad_inputs.py with the error it gets now.

    python scripts/bad_inputs_table.py

tests/test_bad_inputs.py runs the same cases and fails when the committed file differs from this output."""

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from bad_inputs import CASES, Env, render, run_case  # noqa: E402


def main():
    with tempfile.TemporaryDirectory() as tmp:
        env = Env(Path(tmp))
        results = [(case, run_case(case, env)) for case in CASES]
    out = REPO / "docs" / "bad_inputs.md"
    out.write_text(render(results))
    print(f"wrote {out.relative_to(REPO)}: {len(results)} bad inputs")


if __name__ == "__main__":
    main()
