"""A fuzzer of `inkling-mtp generate`: random edits of a copy of the demo checkpoint and random flag values.

Each example edits a copy of the bundled demo checkpoint (up to two of: delete, scale, negate or retype a
config.json key; truncate, bit-flip or reshape a tensor file; corrupt or remove tokenizer.json), draws a
value for every flag (legal or not), and runs the command line in a child process with a time limit.
Every case must end in one of two ways:

* exit 0, with no NaN or infinity in what it printed (the statistics on stderr, and the ids when the
  continuation is printed as ids);
* exit 1 or 2 with exactly one `inkling-mtp generate: error:` line (argparse's usage lines may come
  before it, a CheckpointError's indented list of tensors after it, warnings anywhere), and no traceback.

Never a hang (the time limit), a crash (a signal) or another exit status.

The children are forked from a fork server that imports torch and the command line once, before any
thread exists, so a case starts in milliseconds and can be killed at its time limit. Hypothesis runs
derandomized (the same examples on every run) with a budget that keeps CI short:

    python -m pytest tests/test_fuzz.py                                   # the CI budget
    INKLING_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py -s     # a longer run
    INKLING_FUZZ_EXAMPLES=2000 INKLING_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz.py -s   # new examples

A failing example is printed by Hypothesis with the edits and the command line that reproduce it.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import shutil
import struct
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a test dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import inkling_ref  # noqa: E402

DEMO = Path(inkling_ref.__file__).resolve().parent / "default_checkpoint"
EXAMPLES = int(os.environ.get("INKLING_FUZZ_EXAMPLES", "25"))
TIME_LIMIT_S = float(os.environ.get("INKLING_FUZZ_TIME_LIMIT", "60"))
FILES = ("model.safetensors", "mtp.safetensors")


# ---------------------------------------------------------------------- running one case
def _child(argv: list[str], out_path: str, err_path: str) -> None:
    """In the child: run the command line with its stdout and stderr (file descriptors 1 and 2 too) sent to
    files; an exception that escapes main is printed as a traceback, exit status 99."""
    out, err = open(out_path, "w"), open(err_path, "w")
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdout, sys.stderr = out, err
    code = 99
    try:
        from unittest import mock

        import torch

        from inkling_mtp.cli import main
        with mock.patch.object(torch.cuda, "is_available", lambda: False):   # the same outcome on every machine
            code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - what the test must never see
        traceback.print_exc()
    finally:
        out.flush()
        err.flush()
        os._exit(code)


_context = None


def context():
    """The fork server: torch and the command line imported once, before any thread is started."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["torch", "inkling_mtp.cli", "inkling_ref"])
    return _context


def run_case(argv: list[str], tmp: Path) -> tuple[int | str, str, str]:
    """(exit status, or "timeout", or "signal N"; stdout; stderr) of `inkling-mtp` with `argv`."""
    out, err = tmp / "stdout", tmp / "stderr"
    p = context().Process(target=_child, args=(argv, str(out), str(err)))
    p.start()
    p.join(TIME_LIMIT_S)
    if p.is_alive():
        p.kill()
        p.join()
        return "timeout", out.read_text(errors="replace"), err.read_text(errors="replace")
    code = p.exitcode if p.exitcode >= 0 else f"signal {-p.exitcode}"
    return code, out.read_text(errors="replace"), err.read_text(errors="replace")


def check_outcome(argv, code, out: str, err: str) -> None:
    """The contract of the docstring above."""
    where = f"inkling-mtp {' '.join(map(repr, argv))}"
    assert code != "timeout", f"{where}: no answer within {TIME_LIMIT_S:.0f} s (a hang)\n{err[-2000:]}"
    assert "Traceback" not in err, f"{where}: a traceback\n{err[-4000:]}"
    assert code in (0, 1, 2), f"{where}: exit status {code}\n{err[-2000:]}"
    lines = err.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("inkling-mtp ")]
    errors = [i for i in said if ": error: " in lines[i]]
    assert all(": warning: " in lines[i] for i in said if i not in errors), f"{where}:\n{err}"
    if code == 0:
        assert not errors, f"{where}: exit 0 with an error line\n{err}"
        assert not re.search(r"\b(nan|inf)\b", err, re.IGNORECASE), f"{where}: NaN in the statistics\n{err}"
        if "--prompt-ids" in argv and "tokenizer.json" not in out:
            assert not re.search(r"\b(nan|inf)\b", out, re.IGNORECASE), f"{where}: NaN printed\n{out}"
        return
    assert len(errors) == 1, f"{where}: exit {code} with {len(errors)} error lines\n{err}"
    after = lines[errors[0] + 1:]
    assert all(line.startswith(" ") or line.startswith("inkling-mtp generate: warning:") or not line.strip()
               for line in after), f"{where}: more than one error line\n{err}"
    if code == 1:
        assert all(lines[i].startswith("inkling-mtp ") for i in range(errors[0]) if lines[i].strip()), \
            f"{where}: exit 1 with other lines before the error\n{err}"


# ---------------------------------------------------------------------- edits of the checkpoint
CONFIG = json.loads((DEMO / "config.json").read_text())
CONFIG_KEYS = [(section, key) for section in ("text_config", "mtp_config") for key in CONFIG[section]] + [
    (None, "mtp_config"), (None, "text_config"), (None, "model_type")]
FACTORS = (0, -1, 1e-300, 1e-30, 0.5, 2, 7, 1e30, 1e300, 10**6, 10**12)
RETYPES = ("string", "float", "bool", "list", "null", "object", "huge")


def _retyped(v, how: str):
    return {"string": str(v), "float": float(v) if isinstance(v, (int, float)) else 1.5, "bool": True,
            "list": [v], "null": None, "object": {"value": v}, "huge": 10**30}[how]


def edit_config(d: Path, section, key, action: str, factor, retype: str) -> None:
    cfg = json.loads((d / "config.json").read_text())
    part = cfg if section is None else cfg.get(section)
    if not isinstance(part, dict):      # an earlier edit removed or retyped the section
        return
    if action == "delete":
        part.pop(key, None)
    elif action == "retype":
        part[key] = _retyped(part.get(key), retype)
    else:
        v = part.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            part[key] = _retyped(v, retype)
        elif action == "negate":
            part[key] = -v
        else:
            scaled = v * factor
            part[key] = int(scaled) if isinstance(v, int) and isinstance(factor, int) else scaled
    (d / "config.json").write_text(json.dumps(cfg))


DEMO_CONFIG = (DEMO / "config.json").read_bytes()


def link_tensors(src, dst) -> None:
    """copytree's copy function: the tensor files are hard links (edit_tensors replaces a link by a copy of
    its own before it writes), every other file a copy."""
    if src.endswith(".safetensors"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def own_copy(path: Path) -> bool:
    """Replace a hard link by a file of its own before editing it (the demo's files stay untouched); False
    when an earlier edit removed the file."""
    if not path.exists():
        return False
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return True


def edit_tensors(d: Path, action: str, file: str, seed: int, fraction: float) -> None:
    path = d / file
    if not own_copy(path) or path.stat().st_size < 8:
        return
    raw = bytearray(path.read_bytes())
    if action == "truncate":
        path.write_bytes(bytes(raw[: int(len(raw) * fraction)]))
    elif action == "bitflip":
        for i in range(1 + seed % 8):
            at = (seed * (i + 1) * 2654435761 + int(fraction * len(raw))) % len(raw)
            raw[at] ^= 1 << ((seed >> i) % 8)
        path.write_bytes(bytes(raw))
    else:  # reshape one tensor: the header says another shape, the bytes stay
        n = struct.unpack("<Q", raw[:8])[0]
        try:
            header = json.loads(raw[8: 8 + n])
        except ValueError:        # an earlier edit broke the header
            return
        names = sorted(k for k in header if k != "__metadata__")
        info = header[names[seed % len(names)]]
        shape = info["shape"]
        numel = math.prod(shape)
        info["shape"] = [numel] if len(shape) > 1 else ([1, numel] if seed % 2 else [numel, 1])
        text = json.dumps(header).encode()
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(raw[8 + n:]))


def edit_tokenizer(d: Path, action: str) -> None:
    path = d / "tokenizer.json"
    if not own_copy(path):
        return
    if action == "delete":
        path.unlink()
    elif action == "truncate":
        path.write_bytes(path.read_bytes()[:1000])
    elif action == "garbage":
        path.write_bytes(b"\xff\xfe not a tokenizer")
    else:  # a tokenizer whose vocabulary is larger than the model's
        try:
            tok = json.loads(path.read_text())
        except ValueError:
            return
        vocab = tok["model"]["vocab"]
        for i in range(5000):
            vocab[f"<extra_{i}>"] = len(vocab)
        path.write_text(json.dumps(tok))


config_edits = st.tuples(st.just("config"), st.sampled_from(CONFIG_KEYS),
                         st.sampled_from(("delete", "scale", "negate", "retype")), st.sampled_from(FACTORS),
                         st.sampled_from(RETYPES))
tensor_edits = st.tuples(st.just("tensor"), st.sampled_from(("truncate", "bitflip", "reshape")),
                         st.sampled_from(FILES), st.integers(0, 2**31), st.floats(0, 1))
tokenizer_edits = st.tuples(st.just("tokenizer"), st.sampled_from(("delete", "truncate", "garbage", "bigger")))


def apply(d: Path, edit) -> None:
    kind, *args = edit
    if kind == "config":
        (section, key), action, factor, retype = args
        edit_config(d, section, key, action, factor, retype)
    elif kind == "tensor":
        edit_tensors(d, *args)
    else:
        edit_tokenizer(d, *args)


# ---------------------------------------------------------------------- flags
# Legal values are drawn more often than others (each strategy below lists them several times), so that
# most cases get past the argument checks and reach the edited checkpoint.
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=24)
ids = st.lists(st.integers(0, 3999), min_size=1, max_size=8).map(lambda v: " ".join(map(str, v)))
prompts = st.one_of(
    st.tuples(st.just("--prompt-ids"), ids), st.tuples(st.just("--prompt-ids"), ids),
    st.tuples(st.just("--prompt"), st.sampled_from(("def fibonacci(n):", "import numpy as np\n", "x = [1, 2"))),
    st.tuples(st.just("--prompt-ids"), st.one_of(
        st.lists(st.integers(-3, 5000), max_size=8).map(lambda v: " ".join(map(str, v))), text)),
    st.tuples(st.just("--prompt"), st.one_of(text, text.map(lambda t: t + "\udce9"))))


def values(legal: tuple[str, ...], other: tuple[str, ...]):
    return st.one_of(st.sampled_from(legal), st.sampled_from(legal), st.sampled_from(legal), st.sampled_from(other))


OTHER = ("-1", "99999999999", "x", "", "1.5", "nan")
flag_values = {
    "--k": values(("0", "1", "2", "4", "8"), ("9",) + OTHER),
    "--max-new-tokens": values(("1", "2", "5", "12"), ("0",) + OTHER),
    "--temperature": values(("0", "1e-310", "5e-324", "1e-30", "0.7", "1", "100"), ("nan", "inf", "-1", "1e400", "x")),
    "--top-k": values(("1", "3", "50", "99999999999"), ("0", "-2", "x")),
    "--top-p": values(("0.5", "1", "1e-300"), ("0", "1.5", "nan")),
    "--seed": values(("0", "7", "-3", "99999999999999999999999"), ("x",)),
    "--dtype": values(("float32", "float64", "bfloat16"), ("float16",)),
    "--threads": values(("1", "2"), ("0", "5000", "99999999999")),
    "--engine": values(("ref",), ("fast", "cpu")),
}
# each flag is left out or given (a legal value more often than not)
flags = st.fixed_dictionaries({}, optional={f: v for f, v in flag_values.items()})
edits = st.lists(st.one_of(config_edits, config_edits, tensor_edits, tokenizer_edits), min_size=1, max_size=2)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("INKLING_FUZZ_RANDOM"),
          database=None, suppress_health_check=list(HealthCheck), print_blob=True)
@given(edits=edits, prompt=prompts, flags=flags)
def test_fuzz_generate(edits, prompt, flags):
    with tempfile.TemporaryDirectory(prefix="inkling-fuzz-") as tmp:
        tmp = Path(tmp)
        ckpt = tmp / "ckpt"
        shutil.copytree(DEMO, ckpt, copy_function=link_tensors, ignore=shutil.ignore_patterns("README.md"))
        for edit in edits:
            apply(ckpt, edit)
        assert (DEMO / "config.json").read_bytes() == DEMO_CONFIG, "an edit reached the demo checkpoint itself"
        argv = ["generate", "--checkpoint", str(ckpt), *prompt]
        for flag, value in flags.items():
            argv += [flag, value]
        if "--max-new-tokens" not in flags:
            argv += ["--max-new-tokens", "6"]
        code, out, err = run_case(argv, tmp)
        said = next((line for line in err.splitlines() if line.startswith("inkling-mtp ")), out.strip()[:60])
        print(f"{edits} {argv[3:]}: exit {code}: {said[:160]}")
        check_outcome(argv, code, out, err)


def test_the_fuzzer_catches_what_it_must():
    """The checks fail on a traceback, a second error line, NaN statistics and a hang (never passing
    vacuously); a case that works passes."""
    ok = ("--- 6 new tokens in 0.10 s\nacceptance length 2.00: ...\nper-position acceptance 50% 25%: ...")
    check_outcome(["generate"], 0, "1 2 3", ok)
    check_outcome(["generate"], 1, "", "inkling-mtp generate: error: bad\n  tensors (1):\n    x\n")
    for code, err in ((1, "Traceback (most recent call last):\n  ...\nValueError: x"),
                      (1, "inkling-mtp generate: error: a\ninkling-mtp generate: error: b"),
                      (0, "acceptance length nan: ..."), ("timeout", ""), ("signal 11", ""), (99, "")):
        with pytest.raises(AssertionError):
            check_outcome(["generate"], code, "", err)


def test_the_child_process_reports_a_traceback_and_a_hang(tmp_path, monkeypatch):
    """run_case itself: a case that raises comes back as a traceback (exit 99), one that runs past the time
    limit as "timeout"."""
    code, _, err = run_case(["generate", "--checkpoint", str(DEMO), "--prompt-ids", "1 2", "--max-new-tokens",
                             "2", "--k", "1"], tmp_path)
    assert code == 0, err
    monkeypatch.setattr(sys.modules[__name__], "TIME_LIMIT_S", 0.01)
    code, _, _ = run_case(["generate", "--checkpoint", str(DEMO), "--prompt-ids", "1 2"], tmp_path)
    assert code == "timeout"
