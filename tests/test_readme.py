"""The README's code runs as written: its Python blocks in order, in one namespace (each block goes on
from the ones before it, as when a reader runs them one after the other), and its `inkling-mtp generate`
command.

A block whose first line is `# needs a CUDA GPU` runs only where CUDA is (test_gpu_blocks); without a
GPU that test is skipped with the reason, and the CPU test runs every other block."""

import shlex
from pathlib import Path

import pytest
import torch

from inkling_mtp.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
GPU_MARK = "# needs a CUDA GPU"


def blocks(language: str) -> list[str]:
    """The code of the README's fenced blocks in `language` ("" for plain fences), in order."""
    found, current, lang = [], None, None
    for line in README.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if current is None:
                current, lang = [], line[3:].strip()
            else:
                if lang == language:
                    found.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    assert current is None, "README.md has an unclosed code fence"
    return found


def run_blocks(codes: list[str], tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace = {"__name__": "__readme__"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the command line runs the reference: its many small ops are fastest on one
    try:
        for i, code in enumerate(codes, 1):
            exec(compile(code, f"README.md, Python block {i}", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)


def test_there_are_python_blocks_and_only_marked_ones_need_a_gpu():
    codes = blocks("python")
    assert len(codes) >= 3
    for code in codes:
        uses_gpu = "inkling_fast" in code or "cuda" in code.replace(GPU_MARK, "")
        assert uses_gpu == code.startswith(GPU_MARK), f"mark this block with '{GPU_MARK}' or not:\n{code}"


def test_cpu_blocks_run_in_order(tmp_path, monkeypatch, capsys):
    codes = [c for c in blocks("python") if not c.startswith(GPU_MARK)]
    run_blocks(codes, tmp_path, monkeypatch)
    printed = capsys.readouterr().out
    assert "def fibonacci(n):" in printed and "accepted, then" in printed


@pytest.mark.gpu
def test_gpu_blocks_run_after_the_cpu_blocks(tmp_path, monkeypatch, capsys):
    run_blocks(blocks("python"), tmp_path, monkeypatch)
    assert "tokens/s" in capsys.readouterr().out


def test_the_generate_command_runs_as_written(capsys, monkeypatch):
    """The README's `inkling-mtp generate ...` line, run through the entry point of the console script
    (on a GPU it takes the fast engine, as the README says)."""
    commands = [line for code in blocks("bash") for line in code.splitlines()
                if line.startswith("inkling-mtp generate")]
    assert commands, "the README shows no `inkling-mtp generate` command"
    for command in commands:
        argv = shlex.split(command.split("#")[0])[1:]
        assert main(argv) == 0, command
        out, err = capsys.readouterr()
        assert out.startswith("def fibonacci(n):") and "acceptance length" in err
        assert ("fast engine" in err) == torch.cuda.is_available()
    if not torch.cuda.is_available():  # the reference, greedy: the README's example is this output exactly
        text, statistics = example_output()
        assert [line.rstrip() for line in out.splitlines()] == text
        assert err.strip().splitlines()[1:] == statistics


def example_output() -> tuple[list[str], list[str]]:
    """The README's example output of the command: (the continuation's lines, the statistics after the
    timing line)."""
    example = next(b for b in blocks("") if b.startswith("def fibonacci(n):"))
    lines = example.rstrip("\n").splitlines()
    timing = next(i for i, line in enumerate(lines) if line.startswith("--- "))
    return lines[:timing - 1], lines[timing + 1:]
