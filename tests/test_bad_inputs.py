"""Every bad input of tests/bad_inputs.py gets its one clear error (never a traceback, never a silent
wrong answer), and docs/bad_inputs.md is the table of exactly these outcomes."""

from pathlib import Path

import pytest

from bad_inputs import CASES, Env, masked, render, run_case, shown

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = Env(tmp_path_factory.mktemp("bad_inputs"))
    return [run_case(case, env) for case in CASES]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c.area}-{i + 1}" for i, c in enumerate(CASES)])
def test_bad_input_gets_one_clear_error(results, i):
    case, out = CASES[i], results[i]
    print(f"{case.given}: {out.kind}\n{out.message}")
    assert out.kind == case.expect, f"{case.given}: {out.kind} instead of {case.expect}:\n{out.message}"
    assert case.pattern in out.message
    assert "Traceback" not in out.message
    if case.area == "CLI":  # one line from inkling-mtp: the error (or the warning of a run that goes on)
        said = [line for line in out.message.splitlines() if line.startswith("inkling-mtp ")]
        if case.expect == "exit 0":
            assert len(said) <= 1 and all(": warning: " in line for line in said)
        else:
            assert len(said) == 1 and ": error: " in said[0]
    assert shown(out).splitlines()[0].strip()


def test_there_are_at_least_120_cases_in_every_area():
    areas = [c.area for c in CASES]
    assert len(CASES) >= 120 and {"CLI", "API", "config", "checkpoint"} <= set(areas)
    assert len({c.given for c in CASES}) == len(CASES)


def test_the_table_in_docs_is_what_the_cases_give_now(results):
    want = render(list(zip(CASES, results)))
    have = (ROOT / "docs" / "bad_inputs.md").read_text()
    # exact, except the words of Python / safetensors / tokenizers inside some messages (their versions vary)
    assert masked(have) == masked(want), "docs/bad_inputs.md is stale: run python scripts/bad_inputs_table.py"
    assert masked(want) != want  # the masks still find the library words they are meant for
