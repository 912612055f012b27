"""The reference stops at the first NaN or infinity: every pass of the cycle (prefill, each MTP depth of a
draft, verify) checks the hidden states it hands on and the logits it picks from, and `generate` raises
`NonFiniteError` naming the step, in one line. Without the check a NaN run "agrees" with itself: one
repeated token and an acceptance length of k + 1.

A NaN injected into one MTP depth's output (or the verify's, or the prefill's) must be caught and named;
so must a config value that makes the weights overflow, on the command line too (exit 1, one line)."""

from __future__ import annotations

import json
import shutil

import pytest

from configs import tiny_config
from inkling_ref import DEFAULT_CHECKPOINT, NonFiniteError, generate, random_model
from inkling_ref.model.model import InklingModel
from inkling_ref.model.trunk import Trunk
from inkling_mtp.cli import main


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=2)


def nan_after(monkeypatch, cls, method: str, when) -> None:
    """Make cls.method return NaN (its first output) whenever when(args) holds."""
    real = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if not when(args):
            return out
        if isinstance(out, tuple):
            return (out[0] * float("nan"),) + out[1:]
        return out * float("nan")
    monkeypatch.setattr(cls, method, wrapped)


@pytest.mark.parametrize("m", [0, 1])
@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, draft_sampling="sample", seed=3)],
                         ids=["greedy", "sampled"])
def test_a_nan_in_one_mtp_depth_is_caught(model, monkeypatch, m, sampling):
    nan_after(monkeypatch, InklingModel, "mtp_depth", lambda args: args[0] == m)
    with pytest.raises(NonFiniteError) as e:
        generate(model, [3, 1, 4, 1, 5], max_new_tokens=6, num_speculative_tokens=2, **sampling)
    assert str(e.value).startswith(f"the draft (MTP depth {m}) pass produced NaN") and "\n" not in str(e.value)


def test_a_nan_in_the_trunk_is_caught_at_prefill_and_verify(model, monkeypatch):
    calls = []
    nan_after(monkeypatch, Trunk, "forward", lambda args: calls.append(1) or len(calls) == 2)   # the 1st verify
    with pytest.raises(NonFiniteError, match=r"^the verify pass produced NaN"):
        generate(model, [3, 1, 4], max_new_tokens=6, num_speculative_tokens=2)
    monkeypatch.undo()
    nan_after(monkeypatch, Trunk, "readout", lambda args: True)
    with pytest.raises(NonFiniteError, match=r"^the prefill pass produced NaN"):
        generate(model, [3, 1, 4], max_new_tokens=6)


def test_an_absurd_route_scale_is_an_error_not_a_perfect_acceptance():
    model = random_model(tiny_config(route_scale=1e300), seed=2)
    with pytest.raises(NonFiniteError, match=r"^the prefill pass produced NaN or infinite values.*route_scale"):
        generate(model, [3, 1, 4], max_new_tokens=6, num_speculative_tokens=2)


def test_the_command_line_says_it_in_one_line(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_CHECKPOINT, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["text_config"]["route_scale"] = 1e300
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt-ids", "5 6 7", "--max-new-tokens", "4"]) == 1
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert out.out == "" and len(lines) == 1 and lines[0].startswith(
        "inkling-mtp generate: error: the prefill pass produced NaN or infinite values"), out.err
