"""The engine's draft distributions (Decoding.draft_sampling) against inkling_ref, float32.

draft_sampling="temperature" draws drafts from softmax(logits / T) only, with no top-k / top-p, and
gives rejection sampling that distribution as q (vLLM's probabilistic drafting); "sample" draws from
the target's filtered distribution. With top-k and top-p set the two differ.

On every machine (CPU: the Triton interpreter): fed the reference's uniforms, the engine emits exactly
the tokens and cycle records of inkling_ref.generate in the same mode, and that output differs from
the other mode's (so an engine that ignored the mode would fail). The reference's own distribution
tests (tests/test_sampling.py) then carry over.
GPU only: with device (Philox) uniforms, the first three tokens of 4000 sequences follow the trunk's
exact filtered distribution (chi-square).
"""

from __future__ import annotations

import pytest
import torch
from test_engine import (DEVICE, agreeable_model, assert_accepts_and_rejects,
                         assert_first_three_tokens_follow_the_trunk, assert_same_result, engine_config, poison)
from test_engine import one_thread  # noqa: F401 (its autouse fixture: one CPU thread)

from inkling_fast import Engine
from inkling_fast.step_io import Decoding
from inkling_ref import generate
from inkling_ref.decoding.sampling import SamplingParams

FILTERED = dict(temperature=3.0, top_k=4, top_p=0.7)  # broad enough for the chi-square to have power


@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(), seed=3)


def test_draft_params_of_each_mode():
    params = SamplingParams(**FILTERED)
    assert Decoding(0, params, "temperature").draft_params == SamplingParams(3.0)
    assert Decoding(0, params, "sample").draft_params == params
    assert Decoding(0, params, "greedy").draft_params == SamplingParams()
    assert Decoding(0, params, "temperature").sampled_drafts and not Decoding(0, params, "greedy").sampled_drafts


def test_temperature_drafts_with_reference_uniforms_equal_reference(model):
    engine = Engine(model, max_batch_size=2, max_seq_len=20, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE, uniforms="reference")
    prompts = [[1, 2, 3], [0, 4]]
    kw = dict(max_new_tokens=8, num_speculative_tokens=2, seed=5, **FILTERED)
    poison(engine)
    got = engine.generate(prompts, draft_sampling="temperature", **kw)
    want = generate(model, prompts, draft_sampling="temperature", **kw)
    assert_same_result(got, want)
    assert_accepts_and_rejects(got)
    other = generate(model, prompts, draft_sampling="sample", **kw)
    assert (other.token_ids, other.cycles) != (want.token_ids, want.cycles), "the two modes agree here: no power"


@pytest.mark.gpu
def test_gpu_temperature_drafts_distribution_with_device_uniforms(model):
    """x_L from the prefill, then a cycle with k_eff = 1 (an accepted draft + bonus, or a correction +
    a k_eff = 0 cycle): the first three tokens of 4000 sequences against the exact filtered
    distribution of the trunk, chi-square p > 1e-3."""
    engine = Engine(model, max_batch_size=64, max_seq_len=16, num_speculative_tokens=2, dtype=torch.float32)
    prompt, N, params = [1, 2, 3], 4000, SamplingParams(**FILTERED)
    res = engine.generate([prompt] * N, max_new_tokens=3, draft_sampling="temperature", seed=2, **FILTERED)
    assert_first_three_tokens_follow_the_trunk(model, res, prompt, params)
    assert_accepts_and_rejects(res)
