"""The engine's draft distributions (DecodeMode.draft_sampling) against inkling_ref, float32.

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
from test_engine import DEVICE, agreeable_model, assert_accepts_and_rejects, assert_same_result, engine_config, poison

from inkling_fast import Engine
from inkling_fast.engine import DecodeMode
from inkling_ref import generate
from inkling_ref.sampling import SamplingParams, probs

FILTERED = dict(temperature=3.0, top_k=4, top_p=0.7)  # broad enough for the chi-square to have power


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The interpreter runs one Python thread; torch's idle OpenMP workers would spin against it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(), seed=3)


def test_draft_params_of_each_mode():
    params = SamplingParams(**FILTERED)
    assert DecodeMode(params, "temperature").draft_params == SamplingParams(3.0)
    assert DecodeMode(params, "sample").draft_params == params
    assert DecodeMode(params, "greedy").draft_params == SamplingParams()
    assert DecodeMode(params, "temperature").sampled_drafts and not DecodeMode(params, "greedy").sampled_drafts


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
    from scipy.stats import chi2
    engine = Engine(model, max_batch_size=64, max_seq_len=16, num_speculative_tokens=2, dtype=torch.float32)
    prompt, N, params = [1, 2, 3], 4000, SamplingParams(**FILTERED)
    res = engine.generate([prompt] * N, max_new_tokens=3, draft_sampling="temperature", seed=2, **FILTERED)
    V = model.config.vocab_out
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for t in res.token_ids:
        counts[t[0], t[1], t[2]] += 1
    expected = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.no_grad():
        p1 = probs(model.logits(torch.tensor([prompt], device=DEVICE))[0, -1], params).cpu()
        for a in range(V):
            p2 = probs(model.logits(torch.tensor([prompt + [a]], device=DEVICE))[0, -1], params).cpu()
            for b in range(V):
                p3 = probs(model.logits(torch.tensor([prompt + [a, b]], device=DEVICE))[0, -1], params).cpu()
                expected[a, b] = p1[a] * p2[b] * p3 * N
    e, o = expected.flatten(), counts.flatten()
    assert o[e == 0].sum() == 0, "emitted a sequence the filtered target gives probability 0"
    big = e >= 5                                      # cells expecting < 5 are merged into one
    stat = (((o[big] - e[big]) ** 2) / e[big]).sum().item()
    cells = int(big.sum())
    small = ~big & (e > 0)
    if small.any():
        stat += ((o[small].sum() - e[small].sum()) ** 2 / e[small].sum()).item()
        cells += 1
    dof = cells - 1
    p_value = chi2.sf(stat, dof)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom: p = {p_value:.2e}"
    assert_accepts_and_rejects(res)
