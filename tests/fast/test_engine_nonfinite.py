"""The fast engine stops at the first NaN or infinity, naming the step, with no extra host sync: a cycle
checks the maximum logit behind each greedy draft and target (the sum of the probabilities it samples
from, when sampling) inside its accept step, a prefill pass its hidden states at valid positions, into
the result row's `nonfinite` column, and the scheduler raises `NonFiniteError` when it books that row.

A NaN is injected into one step's output (one MTP depth's hidden states, the verify's, the prefill's)
by wrapping the forward function the device steps call; every such injection must be caught and named,
greedy and sampled. The poisoned-cache runs of test_engine.py are the other half: they fill every cache
row no valid position reads with NaN, and must still give the reference's tokens (no false alarm)."""

from __future__ import annotations

import pytest
import torch

from inkling_fast import Engine, device_steps
from inkling_ref import NonFiniteError

from test_engine import DEVICE, agreeable_model, engine_config, one_thread  # noqa: F401 (its autouse fixture: one CPU thread)



@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(num_mtp_depths=2, mtp_layer_types=["sliding", "global"]), seed=3)


@pytest.fixture
def engine(model):
    """A fresh engine per test: on a GPU a step's CUDA graph is captured on first use, and must capture
    this test's injection, not an earlier test's."""
    return Engine(model, max_batch_size=2, max_seq_len=16, num_speculative_tokens=2, dtype=torch.float32,
                  device=DEVICE)


def inject(monkeypatch, name: str, when) -> None:
    """Wrap device_steps.forward.<name> so that its output is NaN in every row when when(args, kwargs)."""
    real = getattr(device_steps.forward, name)

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        return out * float("nan") if when(args, kwargs) else out
    monkeypatch.setattr(device_steps.forward, name, wrapped)


SAMPLED = dict(temperature=1.0, draft_sampling="sample", seed=4)
CASES = {
    # depth m's output in a cycle's draft (prefill passes also run the depths: those are left alone)
    "draft (MTP depth 1)": ("depth_forward", lambda a, kw: a[1] == 1 and not kw.get("prefill")),
    "verify": ("trunk_forward", lambda a, kw: not kw.get("prefill")),
    "prefill": ("trunk_forward", lambda a, kw: bool(kw.get("prefill"))),
}


@pytest.mark.parametrize("step,sampling", [(step, {}) for step in CASES] + [(step, SAMPLED) for step in CASES],
                         ids=[f"{step}-greedy" for step in CASES] + [f"{step}-sampled" for step in CASES])
def test_a_nan_in_any_step_stops_generate_naming_it(engine, monkeypatch, step, sampling):
    name, when = CASES[step]
    inject(monkeypatch, name, when)
    with pytest.raises(NonFiniteError) as e:
        engine.generate([[1, 2, 3, 4], [2, 0]], max_new_tokens=3, **sampling)
    msg = str(e.value)
    assert msg.startswith(f"the {step} pass produced NaN or infinite values") and "\n" not in msg, msg
