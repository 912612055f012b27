"""`inkling-mtp generate`: output and statistics on a checkpoint, and every error case named."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inkling_ref import random_model, save_checkpoint
from inkling_ref.cli import main

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
    r = subprocess.run([sys.executable, "-m", "inkling_ref.cli", "generate", "--checkpoint", str(ckpt),
                        "--prompt-ids", "1 2", "--k", "0", "--max-new-tokens", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 3


@pytest.mark.parametrize("args,message", [
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1 2"], "no checkpoint directory at /nonexistent/ckpt"),
    (["--prompt-ids", ""], "the prompt is empty"),
    (["--prompt-ids", "1 999"], "out of range 0..499"),
    (["--prompt-ids", "1 2", "--k", "9"], "has 8 complete MTP depth"),
    (["--prompt", "def f():"], "has no tokenizer.json"),
    (["--prompt-ids", "1 2", "--max-new-tokens", "63"], "beyond the model's maximum length 64"),
])
def test_generate_errors_name_the_problem(ckpt, capsys, args, message):
    if "--checkpoint" not in args:
        args = ["--checkpoint", str(ckpt)] + args
    assert main(["generate"] + args) == 1
    assert message in capsys.readouterr().err


def test_bad_ids_are_a_usage_error(ckpt):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "1 x"])
    assert e.value.code == 2
