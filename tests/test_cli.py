"""`inkling-mtp generate`: output and statistics on a checkpoint, and every error case named."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inkling_ref import random_model, save_checkpoint
from inkling_mtp.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_random_checkpoint import tiny_random_config  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_random_config().replace(max_position_embeddings=64)
    save_checkpoint(random_model(cfg, seed=0), path, overwrite=True)
    return path


def test_generate_prints_ids_and_statistics(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3 17 5", "--k", "3",
                 "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    ids = [int(t) for t in out.split()]
    assert len(ids) == 12 and all(0 <= t < 500 for t in ids)
    assert "tokens/s" in err and "acceptance length" in err and "per-position acceptance" in err
    # the printed continuation is the model's greedy continuation
    from inkling_ref import generate, load_checkpoint
    want = generate(load_checkpoint(ckpt), [3, 17, 5], max_new_tokens=12).token_ids[0]
    assert ids == want


def test_console_script_runs(ckpt):
    r = subprocess.run([sys.executable, "-m", "inkling_mtp.cli", "generate", "--checkpoint", str(ckpt),
                        "--prompt-ids", "1 2", "--k", "0", "--max-new-tokens", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3


def test_statistics_are_explained_and_match_the_run(ckpt, capsys):
    from inkling_ref import generate, load_checkpoint
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3 17 5", "--k", "2",
                 "--max-new-tokens", "20"]) == 0
    err = capsys.readouterr().err
    res = generate(load_checkpoint(ckpt, num_mtp_depths=2), [3, 17, 5], max_new_tokens=20, num_speculative_tokens=2)
    s, cycles = res.stats, res.cycles[0]
    assert s.num_cycles >= 1
    assert f"{len(cycles)} cycle" in err and "MTP head drafts up to 2 tokens and one trunk pass verifies them" in err
    assert f"acceptance length {s.acceptance_length:.2f}: tokens gained per verify pass (accepted drafts + 1" in err
    assert f"mean of {s.num_cycles} full cycle" in err
    per = " ".join(f"{100 * v:.0f}%" for v in s.per_position.values())
    assert f"per-position acceptance {per}: how often draft 1..2 was accepted" in err
    short = len(cycles) - s.num_cycles
    assert (f"{short} cut short by --max-new-tokens" in err) == (short > 0)
    assert "nan" not in err.lower()


def test_a_run_without_a_full_cycle_says_so_instead_of_nan(ckpt, capsys):
    """k = 4 and 3 new tokens: the prefill token, then one cycle of k_eff = 1 < 4 drafts (cut short)."""
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3 17 5", "--k", "4",
                 "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "nan" not in err.lower()
    assert "no full cycle (one with all 4 drafts), so no acceptance statistics" in err
    assert "acceptance length" not in err


def test_plain_decoding_reports_trunk_passes(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3 17 5", "--k", "0",
                 "--max-new-tokens", "5"]) == 0
    err = capsys.readouterr().err
    assert "plain decoding: 4 trunk passes after the prompt, one token each" in err
    assert "acceptance" not in err


def test_help_explains_every_term_the_output_prints(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for term in ("cycle / verify pass", "full cycle", "acceptance length", "per-position acceptance",
                 "mean(accepted drafts + 1)", "docs/spec/mtp-cycle.md"):
        assert term in help_text, term


# ----------------------------------------------------------------------------- --engine ref|fast
def test_engine_default_is_fast_on_a_gpu_and_ref_without(monkeypatch):
    from inkling_mtp.generate import resolve_engine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_engine(None) == "ref" and resolve_engine("ref") == "ref"
    with pytest.raises(ValueError, match="--engine fast needs a CUDA GPU"):
        resolve_engine("fast")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_engine(None) == "fast" and resolve_engine("ref") == "ref" and resolve_engine("fast") == "fast"
    assert resolve_engine(None, "bfloat16") == "fast" and resolve_engine(None, "float64") == "ref"


def test_engine_fast_without_a_gpu_is_a_clear_error(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1 2", "--engine", "fast"]) == 1
    assert "--engine fast needs a CUDA GPU" in capsys.readouterr().err


def test_engine_ref_does_not_import_inkling_fast(ckpt):
    """inkling_ref never depends on inkling_fast: the reference path runs without importing it."""
    code = ("import sys; from inkling_mtp.cli import main; "
            f"rc = main(['generate', '--checkpoint', {str(ckpt)!r}, '--prompt-ids', '1 2', '--k', '2', "
            "'--max-new-tokens', '4', '--engine', 'ref']); "
            "assert rc == 0; assert not any(m.startswith('inkling_fast') for m in sys.modules), 'imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 4


@pytest.mark.gpu
def test_engine_fast_prints_the_reference_continuation(ckpt, capsys):
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "3 17 5", "--k", "3",
                 "--max-new-tokens", "12", "--engine", "fast"]) == 0
    out, err = capsys.readouterr()
    from inkling_ref import generate, load_checkpoint
    want = generate(load_checkpoint(ckpt), [3, 17, 5], max_new_tokens=12, num_speculative_tokens=3).token_ids[0]
    assert [int(t) for t in out.split()] == want
    assert "acceptance length" in err
    # setup (kernels built, graphs captured by a first run of the same request) is reported apart
    setup = next(line for line in err.splitlines() if line.startswith("--- setup "))
    assert "graphs captured: 2" in setup and "kernels compiled: " in setup, setup


def test_the_fast_engine_sizes_of_two_prompts_share_their_shapes():
    """Prompts of 9 and 20 tokens get one max_seq_len and one prefill pass shape, so the second finds the
    first's kernels in Triton's cache; the model's maximum length still bounds max_seq_len."""
    from inkling_fast.prefill_plan import plan_prefill_pass
    from inkling_mtp.generate import fast_engine_sizes
    a, b = fast_engine_sizes(9, 64, 512), fast_engine_sizes(20, 64, 512)
    assert a == b and a["max_seq_len"] >= 20 + 64
    assert plan_prefill_pass([9], a["prefill_lengths"], [1], a["prefill_tokens"]) == \
        plan_prefill_pass([20], b["prefill_lengths"], [1], b["prefill_tokens"])
    assert fast_engine_sizes(500, 64, 512)["max_seq_len"] == 512


def test_the_cli_prefill_chunk_takes_the_few_token_kernels():
    """The CLI's prefill passes (batch 1) stay on the kernels a k <= 8 cycle uses: below the MoE's
    many-token threshold, and no more (token, expert) pairs than a cycle's rows at k = 8 have."""
    from inkling_fast import forward
    from inkling_mtp.generate import fast_engine_sizes
    chunk = fast_engine_sizes(9, 64, 512)["prefill_tokens"]
    assert chunk < forward.MANY_TOKENS and chunk <= 8 + 1

