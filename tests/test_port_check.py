"""The port checker (inkling_ref.port_check, `inkling-mtp check-port`) on the demo checkpoint.

  * dumps written by the reference cycle pass: float32 (vLLM's minimal window and the full one, with and
    without logits) and bfloat16;
  * a dump written by each mutant of tests/mutants.py that docs/pitfalls.md measures (every row of that
    table) fails and is diagnosed as that mistake, and the diagnoses are all different;
  * a checker that always passes, or always blames one mistake, fails these assertions (mutants of
    inkling_ref/port_check/check.py);
  * unrepaired stale rows are caught at the first row after the rejection that made them stale;
  * a mistake smaller than bfloat16's rounding is still named (it fits the outputs twice as well);
  * the known mistakes and their costs are the rows of docs/pitfalls.json;
  * the head loader reads no trunk layer; the command line's exit status says pass (0) or fail (3).
The fast engine's dumps: tests/fast/test_port_dump_fast.py. Malformed dumps: tests/bad_inputs.py.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

import inkling_ref
from inkling_mtp.cli import main
from inkling_ref.port_check import DumpRecorder, capture_reference, check_dump, load_head, read_dump
from inkling_ref.port_check import head_loader
from inkling_ref.port_check.pitfalls import KNOWN_MISTAKES, REFERENCE_ACCEPTANCE, STALE
from mutants import load_mutant

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from pitfalls import MUTANTS, PITFALLS  # noqa: E402  (scripts/pitfalls.py: the rows of docs/pitfalls.md)

DEMO = inkling_ref.DEFAULT_CHECKPOINT
K, CYCLES = 4, 5
HELD_OUT = json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"][0]["ids"]
PROMPT = HELD_OUT[:40]
LOG_TAU = "log-tau inside the MTP depths"
LONG_PROMPT = HELD_OUT[:140]    # log-tau changes nothing below the demo's n_floor = 128 positions


def write_dump(path: Path, package=inkling_ref, dtype=torch.float32, prompt=PROMPT, **kw) -> Path:
    """The dump of CYCLES greedy cycles at k = K on `prompt`, written by `package`'s reference cycle."""
    model = package.load_checkpoint(DEMO, dtype=dtype, num_mtp_depths=K)
    capture_reference(model, prompt, K, CYCLES, path, cycle=package.decoding.speculative, **kw)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The reference's many small ops run fastest on one thread (idle OpenMP workers spin against them)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def head():
    return load_head(DEMO, num_depths=K)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """mistake -> its mutant's dump; "none (the reference)" -> the correct dump."""
    tmp = tmp_path_factory.mktemp("port_dumps")
    out = {}
    for i, p in enumerate(PITFALLS):
        package = inkling_ref if p.mutant is None else load_mutant(tmp, MUTANTS[p.mutant])
        out[p.mistake] = write_dump(tmp / f"dump{i}.safetensors", package,
                                    prompt=LONG_PROMPT if p.mistake == LOG_TAU else PROMPT)
    return out


@pytest.fixture(scope="module")
def reports(head, dumps) -> dict:
    return {mistake: check_dump(head, read_dump(path)) for mistake, path in dumps.items()}


def assert_each_mistake_is_named(reports: dict) -> None:
    """The suite's claim: the correct dump passes, every mutant's fails with its own mistake first, and no
    two mistakes get the same diagnosis."""
    correct = reports[PITFALLS[0].mistake]
    assert correct.passed, correct.render()
    named = {}
    for mistake, r in reports.items():
        if mistake == PITFALLS[0].mistake:
            continue
        assert not r.passed, f"{mistake}: the dump passes\n{r.render()}"
        assert r.diagnosis and r.diagnosis[0].mistake == mistake, f"{mistake}: diagnosed as " \
            f"{[d.mistake for d in r.diagnosis]}\n{r.render()}"
        named[mistake] = r.diagnosis[0].mistake
    assert len(set(named.values())) == len(PITFALLS) - 1


# ----------------------------------------------------------------------------- correct dumps pass
@pytest.mark.parametrize("dtype,window,logits", [(torch.float32, "full", False), (torch.float32, "minimal", True),
                                                 (torch.bfloat16, "full", False)])
def test_reference_dumps_pass(head, tmp_path, dtype, window, logits):
    dump = read_dump(write_dump(tmp_path / "d.safetensors", dtype=dtype, window=window, logits=logits))
    assert (dump.get("row_logits") is not None) == logits
    r = check_dump(head, dump)
    print(r.render())
    assert r.passed and not r.diagnosis and r.first_divergence is None
    assert r.correct_error <= (1e-6 if dtype == torch.float32 else 2e-2)
    assert all(d.drafts == d.drafts_agree == CYCLES for d in r.depths)


def test_a_dump_a_port_writes_by_hand_passes(head, tmp_path):
    """DumpRecorder fed by hand (what a port adds to its draft loop) from the reference's own pieces: the
    teacher-forced fold over a committed sequence is one step that ran every row and drafted nothing new."""
    model = inkling_ref.load_checkpoint(DEMO, num_mtp_depths=2)
    tokens = PROMPT[:40]
    n = len(tokens)
    rec = DumpRecorder()
    rec.step(n, 2)
    with torch.no_grad():
        h = model.hidden(torch.tensor([tokens]))[0, : n - 1]
        rec.trunk_hidden(range(n - 1), h)
        drafts = []
        for m in range(2):
            slots = tokens + drafts
            h, logits = model.mtp_depth(m, h[None], torch.tensor([slots[m + 1: n + m]]))
            h = h[0]
            rec.depth_rows(m, range(n - 1), h, tokens=slots[m + 1: n + m])
            drafts.append(int(logits[0, -1].argmax()))
    rec.drafts(drafts)
    rec.write(tmp_path / "hand.safetensors", tokens)
    r = check_dump(load_head(DEMO, num_depths=2), read_dump(tmp_path / "hand.safetensors"))
    assert r.passed, r.render()


# ----------------------------------------------------------------------------- every mistake, named
@pytest.mark.parametrize("mistake", [p.mistake for p in PITFALLS[1:]])
def test_each_mistake_is_diagnosed_as_itself(reports, mistake):
    r = reports[mistake]
    print(r.render())
    assert not r.passed
    assert r.diagnosis[0].mistake == mistake
    assert "acceptance length" in r.diagnosis[0].cost and r.diagnosis[0].fix


def test_the_diagnoses_are_distinct_and_the_correct_dump_passes(reports):
    assert_each_mistake_is_named(reports)


CHECKER_MUTANTS = {
    "always passes": [("port_check/check.py", "passed = not bool(bad.any()) and not found and not blamed",
                       "passed = True")],
    "always blames the same mistake": [("port_check/check.py", "blamed = [c for c in candidates if c.reproduces]",
                                        "blamed = [c for c in candidates if c.mistake == KNOWN_MISTAKES[0].name]"),
                                       ("port_check/check.py", "    for text, mistake in found:\n",
                                        "    for text, mistake in []:\n")],
}


@pytest.mark.parametrize("name", list(CHECKER_MUTANTS))
def test_a_broken_checker_fails_this_suite(dumps, tmp_path, name):
    """The same assertions, run on a checker that always passes or always blames one mistake, fail."""
    checker = importlib.import_module(load_mutant(tmp_path, CHECKER_MUTANTS[name]).__name__ + ".port_check")
    head = checker.load_head(DEMO, num_depths=K)
    some = [PITFALLS[0].mistake, PITFALLS[3].mistake, PITFALLS[7].mistake]   # correct, concat order, stale rows
    reports = {m: checker.check_dump(head, checker.read_dump(dumps[m])) for m in some}
    with pytest.raises(AssertionError):
        assert_each_mistake_is_named(reports)


# ----------------------------------------------------------------------------- stale rows
def test_stale_rows_are_caught_at_the_first_row_after_a_rejection(dumps, reports):
    """The first step after one that accepted a <= k-2 drafts: depth a+1 has a stale row (n_prev - 2); the
    first row it runs after the rejection, n_prev - 1, reads it and diverges there."""
    dump = read_dump(dumps[STALE])
    ns = dump["step_n"].tolist()
    c = next(c for c in range(1, len(ns)) if ns[c] - ns[c - 1] - 1 <= K - 2)
    a = ns[c] - ns[c - 1] - 1
    r = reports[STALE]
    f = r.first_divergence
    assert (f.step, f.position, f.depth) == (c, ns[c - 1] - 1, a + 1), r.render()
    assert any(s.startswith(f"step {c}, depth {a + 1}: rows {ns[c - 1] - 2}..{ns[c - 1] - 2} were not recomputed")
               for s in r.findings), r.findings


# ----------------------------------------------------------------------------- within bf16's rounding
def test_a_mistake_within_bfloat16_rounding_is_still_named(head, tmp_path):
    """The embedding normed by the depth only moves the outputs less than bf16 tolerates per row, but the
    mistake fits them far better than the correct computation does (rule 4 of check.py)."""
    p = next(p for p in PITFALLS if p.mistake == KNOWN_MISTAKES[0].name)
    pkg = load_mutant(tmp_path, MUTANTS[p.mutant])
    r = check_dump(head, read_dump(write_dump(tmp_path / "d.safetensors", pkg, dtype=torch.bfloat16)))
    print(r.render())
    assert r.first_divergence is None and all(d.worst_row <= r.tolerance for d in r.depths)
    assert not r.passed and r.diagnosis[0].mistake == p.mistake


# ----------------------------------------------------------------------------- the table, the loader, the CLI
def test_known_mistakes_are_the_rows_of_docs_pitfalls():
    table = json.loads((ROOT / "docs" / "pitfalls.json").read_text())["pitfalls"]
    rows = [name for name in table if name != PITFALLS[0].mistake]
    assert [k.name for k in KNOWN_MISTAKES] == rows
    for k in KNOWN_MISTAKES + [None]:
        got = REFERENCE_ACCEPTANCE if k is None else k.acceptance
        want = table[PITFALLS[0].mistake if k is None else k.name]["k"]
        assert got == (round(want["4"]["acceptance_length"], 3), round(want["8"]["acceptance_length"], 3))


def test_the_head_loader_reads_only_the_head(monkeypatch):
    read = []
    open_ = head_loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = open_(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(head_loader, "safe_open", Recording)
    head = load_head(DEMO, num_depths=2)
    assert not [n for n in read if n.startswith("model.llm.layers.") or n.startswith("model.mtp.layers.2.")]
    assert {"model.llm.embed.weight", "model.llm.embed_norm.weight", "model.llm.norm.weight",
            "model.llm.unembed.weight"} <= set(read)
    full = inkling_ref.load_checkpoint(DEMO, num_mtp_depths=2)
    mine = dict(head.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in full.named_parameters() if n in mine)
    assert len(mine) == len([n for n in dict(full.named_parameters()) if n.startswith("mtp.")]) + 4


def test_the_head_loader_reads_files_that_hold_only_the_head(tmp_path):
    """The demo's head tensors alone (the trunk's layers left out, as when only the MTP shard and the
    shard with the embedding and unembedding are at hand): load_head reads them, equal to the full load,
    and the full loader still refuses the files, naming the trunk layers they lack."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    full = inkling_ref.load_checkpoint(DEMO)
    wanted = set(head_loader.head_shapes(full.config, full.config.num_mtp_depths))
    (tmp_path / "config.json").write_text((DEMO / "config.json").read_text())
    tensors = {}
    for f in sorted(DEMO.glob("*.safetensors")):
        with safe_open(f, framework="pt") as s:
            tensors.update({n: s.get_tensor(n) for n in s.keys() if n in wanted})
    assert set(tensors) == wanted
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    head = load_head(tmp_path, num_depths=2)
    ref = dict(full.named_parameters())
    assert all(torch.equal(p, ref[n]) for n, p in head.named_parameters())
    with pytest.raises(inkling_ref.CheckpointError, match="its files hold no trunk layer"):
        inkling_ref.load_checkpoint(tmp_path)


def test_the_command_line_exit_status(dumps, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["check-port", str(dumps[PITFALLS[0].mistake]), "--checkpoint", str(DEMO), "--json", str(out)]) == 0
    assert "port check: PASS" in capsys.readouterr().out and json.loads(out.read_text())["passed"] is True
    assert main(["check-port", str(dumps[STALE]), "--checkpoint", str(DEMO)]) == 3
    said = capsys.readouterr().out
    assert "port check: FAIL" in said and f"diagnosis: {STALE}" in said
