"""Sampling, rejection sampling and generate: distribution preserved, batches independent,
statistics right, bad input refused."""

import math

import pytest
import torch

from configs import tiny_config
from inkling_ref import InklingConfig, generate, random_model
from inkling_ref.decoding import generation as G
from inkling_ref.decoding.generation import AcceptanceStats, CycleRecord
from inkling_ref.decoding.sampling import DRAFT_SAMPLING, SamplingParams, draft_params, probs, rejection_sample, sample
from mutants import load_mutant

scipy_stats = pytest.importorskip("scipy.stats", reason="scipy is a test dependency")


# ----------------------------------------------------------------------------- filters
def test_probs_filters_in_order():
    logits = torch.tensor([2.0, 1.0, 3.0, 1.0, 0.0, -1.0])
    # temperature only: softmax(logits / T)
    want = torch.softmax(logits.double() / 0.5, -1)
    assert torch.allclose(probs(logits, SamplingParams(0.5)), want)
    # top-k 3 keeps ids 2, 0 and (of the tie 1/3) the lower id 1
    p = probs(logits, SamplingParams(1.0, top_k=3))
    e = torch.exp(torch.tensor([2.0, 1.0, 3.0], dtype=torch.float64))
    assert torch.allclose(p, torch.tensor([e[0], e[1], e[2], 0, 0, 0], dtype=torch.float64) / e.sum())
    # top-p: sorted probs of softmax(logits) are ~ .61 .22 .08 .08 .03 .01: 0.7 keeps the first two
    p = probs(logits, SamplingParams(1.0, top_p=0.7))
    assert (p > 0).tolist() == [True, False, True, False, False, False]
    # top-k then top-p: top_k=2 renormalizes to .73/.27, so top_p=0.7 keeps only id 2
    p = probs(logits, SamplingParams(1.0, top_k=2, top_p=0.7))
    assert p.tolist() == [0, 0, 1, 0, 0, 0]
    # temperature 0: one-hot argmax, ties to the lowest id
    assert probs(torch.tensor([1.0, 3.0, 3.0]), SamplingParams(0.0)).tolist() == [0, 1, 0]


def test_sample_is_inverse_cdf():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    assert [sample(p, u) for u in (0.0, 0.0999, 0.1001, 0.69, 0.71, 0.9999)] == [0, 0, 2, 2, 3, 3]


def test_rejection_sample_scripted():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.75, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    # d_1 = 1: p/q = 2/3; u = 0.5 accepts, u = 0.8 rejects -> residual max(p-q,0) = [.25, 0, 0] -> 0
    assert rejection_sample(p, q, [1, 2], [0.8, 0.0], 0.5) == (0, 0)
    # d_2 = 2: p/q = 0.5; u = 0.4 accepts -> all accepted, bonus from p[2] = token 0
    assert rejection_sample(p, q, [1, 2], [0.5, 0.4], 0.3) == (2, 0)
    # d_2 rejected (u = 0.6): residual [.2, .3, 0] -> u_final 0.5 of 0.5 total -> token 1
    assert rejection_sample(p, q, [1, 2], [0.5, 0.6], 0.5) == (1, 1)


# ----------------------------------------------------------------------------- distribution
def small_vocab_model():
    # one trunk layer keeps 10^4 runs fast; mup 6 keeps the distributions broad enough that drafts
    # are accepted at a rate far from 0 and 1 (the check needs that to have power)
    cfg = InklingConfig(vocab_size=8, unpadded_vocab_size=6, hidden_size=16, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=8, swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=8,
                        sliding_window=4, rel_extent=8, d_rel=4, log_scaling_n_floor=None,
                        layer_types=["global"], mlp_types=["dense"],
                        dense_intermediate_size=16, mup=6.0, max_position_embeddings=64,
                        num_mtp_depths=2, mtp_layer_types=["sliding", "global"])
    return random_model(cfg, seed=2, dtype=torch.float64)


PROMPT = [1, 4, 2, 5]


def exact_joint(model, params, n_tokens):
    """P(first n_tokens emitted) under plain sampling from the trunk with the same filters."""
    V = model.config.vocab_out
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * n_tokens).reshape(-1, n_tokens)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        p = probs(model.logits(ids), params)  # [N, L + n, V]
    L = len(PROMPT)
    joint = torch.ones(len(prefixes), dtype=torch.float64)
    for t in range(n_tokens):
        joint *= p[torch.arange(len(prefixes)), L - 1 + t, prefixes[:, t]]
    return prefixes, joint


def expected_first_acceptance(model, params, draft_sampling):
    """E over x_1 of sum_x min(p(x | x_1), q(x | x_1)), from the model's exact distributions."""
    V, L = model.config.vocab_out, len(PROMPT)
    ids = torch.cat([torch.tensor(PROMPT).expand(V, -1), torch.arange(V)[:, None]], dim=1)
    with torch.no_grad():
        p1 = probs(model.logits(torch.tensor([PROMPT]))[0, -1], params)
        p2 = probs(model.logits(ids)[:, -1], params)                       # [V(x1), V]
        q_logits = model.mtp_logits(ids)[0][:, L - 1]                        # depth 0, row n-2
    q = probs(q_logits, draft_params(params, draft_sampling))
    return float((p1 * torch.minimum(p2, q).sum(-1)).sum())


def distribution_check(pkg, params, draft_sampling, runs, k=2, n_tokens=3):
    """`runs` seeded sequences, k drafts per cycle. Returns (chi-square p-value of the first n_tokens
    emitted tokens, empirical and expected acceptance of d_1, its standard error)."""
    model = pkg.random_model(small_vocab_model().config, seed=2, dtype=torch.float64)
    res = pkg.generate(model, [PROMPT] * runs, max_new_tokens=n_tokens + 1, num_speculative_tokens=k,
                       temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                       draft_sampling=draft_sampling, seed=1234)
    prefixes, joint = exact_joint(model, params, n_tokens)
    index = {tuple(p): i for i, p in enumerate(prefixes.tolist())}
    counts = torch.zeros(len(prefixes), dtype=torch.float64)
    for toks in res.token_ids:
        key = tuple(toks[:n_tokens])
        assert key in index and joint[index[key]] > 0, f"emitted {key}, which has probability 0"
        counts[index[key]] += 1
    expected = joint * runs
    # pool cells expected below 5 into one bin
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum()[None]]) if small.any() else expected
    keep = exp > 0
    pvalue = scipy_stats.chisquare(obs[keep].numpy(), exp[keep].numpy() * obs.sum().item() / exp[keep].sum().item()).pvalue
    first = [seq[0] for seq in res.cycles]  # the first cycle of every run uses the full k
    assert all(c.k == k for c in first)
    rate = sum(c.accepted >= 1 for c in first) / runs
    want = expected_first_acceptance(model, params, draft_sampling)
    return pvalue, rate, want, math.sqrt(want * (1 - want) / runs)


PARAMS = {"T=1": SamplingParams(1.0), "T=0.9 top-k 4 top-p 0.85": SamplingParams(0.9, top_k=4, top_p=0.85)}


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_distribution_preserved(params, draft_sampling):
    """4000 seeded runs: the first three emitted tokens follow the trunk's exact distribution
    (chi-square), and d_1 is accepted at the rate sum_x min(p, q) predicts (within 4 sigma). The same
    check catches each sampler mutant below with 3000 runs."""
    import inkling_ref
    torch.set_num_threads(1)
    pvalue, rate, want, se = distribution_check(inkling_ref, PARAMS[params], draft_sampling, 4000)
    print(f"{params} {draft_sampling}: chi-square p = {pvalue:.3f}; acceptance {rate:.4f} vs {want:.4f} +- {se:.4f}")
    assert pvalue > 1e-3
    assert abs(rate - want) < 4 * se
    assert 0.05 < want < 0.95  # the check has power: drafts are neither always right nor always wrong


SAMPLER_MUTANTS = {
    "always accept": [("decoding/sampling.py", "if u_accept[j] * float(q[j, d]) < float(p[j, d]):", "if True:")],
    "always reject": [("decoding/sampling.py", "if u_accept[j] * float(q[j, d]) < float(p[j, d]):", "if False:")],
    # a classic bug: after a rejection, resample from p instead of the residual max(p - q, 0)
    "resample from p": [("decoding/sampling.py", "residual = (p[j] - q[j]).clamp(min=0)", "residual = p[j].clone()")],
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(SAMPLER_MUTANTS))
def test_distribution_check_catches_mutant(mutant, tmp_path):
    torch.set_num_threads(1)
    pkg = load_mutant(tmp_path, SAMPLER_MUTANTS[mutant])
    try:
        pvalue, rate, want, se = distribution_check(pkg, PARAMS["T=1"], "sample", 3000)
    except AssertionError:
        return  # it emitted a token the trunk gives probability 0: caught
    assert pvalue < 1e-3 or abs(rate - want) >= 4 * se, f"'{mutant}' passes the distribution check"


# vLLM's probabilistic drafting (draft_sampling="temperature"): drafts from softmax(logits / T) only, that
# distribution as q. It differs from "sample" only when top-k or top-p is set; with these filters
# (T 1.5 keeps the distributions broad) about 29 % of the drafts' mass lies outside the draft's own top-p
# set, which is what a q filtered unlike the draft gets wrong.
FILTERED = SamplingParams(1.5, top_k=4, top_p=0.6)
TEMPERATURE_RUNS = 1500
Q_MUTANTS = {
    # q computed with top-p while the draft was drawn without it
    "q filtered by top-p, draft not": [("decoding/generation.py", "q = probs(d.logits, q_params)",
                                        "q = probs(d.logits, SamplingParams(q_params.temperature, top_p=params.top_p))")],
}


@pytest.mark.slow
@pytest.mark.parametrize("k,n_tokens", [(1, 2), (2, 3)])
def test_distribution_preserved_with_temperature_drafts(k, n_tokens):
    """1500 seeded runs with top-k and top-p set: the first emitted tokens follow the trunk's exact
    filtered distribution (chi-square), and d_1 is accepted at the rate sum_x min(p, q_T) predicts."""
    import inkling_ref
    torch.set_num_threads(1)
    pvalue, rate, want, se = distribution_check(inkling_ref, FILTERED, "temperature", TEMPERATURE_RUNS, k, n_tokens)
    print(f"temperature drafts, k={k}: chi-square p = {pvalue:.3f}; acceptance {rate:.4f} vs {want:.4f} +- {se:.4f}")
    assert pvalue > 1e-3
    assert abs(rate - want) < 4 * se
    assert 0.05 < want < 0.95


@pytest.mark.slow
@pytest.mark.parametrize("mutant", list(Q_MUTANTS))
def test_temperature_drafts_check_catches_mutant(mutant, tmp_path):
    torch.set_num_threads(1)
    pkg = load_mutant(tmp_path, Q_MUTANTS[mutant])
    pvalue, rate, want, se = distribution_check(pkg, FILTERED, "temperature", TEMPERATURE_RUNS, 1, 2)
    print(f"{mutant}: chi-square p = {pvalue:.2e}; acceptance {rate:.4f} vs {want:.4f} +- {se:.4f}")
    assert pvalue < 1e-3 or abs(rate - want) >= 4 * se, f"'{mutant}' passes the distribution check"


def test_draft_params():
    """The draft distribution of each mode; temperature 0 is one-hot whatever the mode."""
    target = SamplingParams(0.7, top_k=5, top_p=0.9)
    assert draft_params(target, "sample") == target
    assert draft_params(target, "temperature") == SamplingParams(0.7)
    assert draft_params(target, "greedy") == SamplingParams()
    assert all(draft_params(SamplingParams(0.0), mode) == SamplingParams() for mode in DRAFT_SAMPLING)
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        draft_params(target, "vllm")


# ----------------------------------------------------------------------------- batches
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_members_get_what_they_get_alone(temperature):
    model = random_model(tiny_config(num_mtp_depths=2), seed=9, dtype=torch.float64)
    prompts = [[5, 6, 7], list(range(10, 30)), [3]]
    batch = generate(model, prompts, max_new_tokens=12, num_speculative_tokens=2, temperature=temperature,
                     top_p=0.9 if temperature else None, draft_sampling="sample", seed=77)
    params = SamplingParams(temperature, None, 0.9 if temperature else None)
    for i, prompt in enumerate(prompts):
        alone, cycles = G.generate_one(model, prompt, 12, 2, params, "sample",
                                       G.Uniforms(G.sequence_seed(77, i)), None)
        assert batch.token_ids[i] == alone
        assert [c.accepted for c in batch.cycles[i]] == [c.accepted for c in cycles]
        assert len(alone) == 12
    again = generate(model, prompts, max_new_tokens=12, num_speculative_tokens=2, temperature=temperature,
                     top_p=0.9 if temperature else None, draft_sampling="sample", seed=77)
    assert again.token_ids == batch.token_ids  # seeded: reproducible


def test_greedy_generate_equals_plain_greedy_and_stops_at_eos():
    model = random_model(tiny_config(num_mtp_depths=2), seed=9, dtype=torch.float64)
    prompt = [8, 1, 30, 2]
    plain = generate(model, prompt, max_new_tokens=20).token_ids[0]
    spec = generate(model, prompt, max_new_tokens=20, num_speculative_tokens=2)
    assert spec.token_ids[0] == plain and len(plain) == 20
    eos = plain[7]
    cut = generate(model, prompt, max_new_tokens=20, num_speculative_tokens=2, eos_token_id=eos)
    assert cut.token_ids[0] == plain[: plain.index(eos) + 1]
    assert sum(len(c.emitted) for c in cut.cycles[0]) + 1 == len(cut.token_ids[0])
    assert not cut.cycles[0][-1].counted


# ----------------------------------------------------------------------------- statistics
def test_statistics_on_scripted_cycles():
    recs = [CycleRecord(k=3, drafts=[1, 2, 3], accepted=a, emitted=[0] * (a + 1), counted=True)
            for a in [0, 3, 1, 2, 3, 0, 1]]
    recs.append(CycleRecord(k=1, drafts=[4], accepted=1, emitted=[4, 5], counted=False))  # cut short
    s = AcceptanceStats.from_cycles(3, recs)
    # a = 0,3,1,2,3,0,1: mean(a+1) = 17/7; #(a>=1)=5, #(a>=2)=3, #(a>=3)=2 of 7
    assert s.num_cycles == 7
    assert s.acceptance_length == pytest.approx(17 / 7)
    assert s.per_position == pytest.approx({1: 5 / 7, 2: 3 / 7, 3: 2 / 7})
    assert s.conditional == pytest.approx({1: 5 / 7, 2: 3 / 5, 3: 2 / 3})


def test_generate_statistics_count_what_happened():
    model = random_model(tiny_config(num_mtp_depths=2), seed=9, dtype=torch.float64)
    res = generate(model, [[3, 1, 4], [1, 5, 9, 2, 6]], max_new_tokens=15, num_speculative_tokens=2)
    counted = [c for seq in res.cycles for c in seq if c.counted]
    assert res.stats.num_cycles == len(counted) > 0
    assert res.stats.acceptance_length == pytest.approx(sum(c.accepted + 1 for c in counted) / len(counted))
    for seq, toks in zip(res.cycles, res.token_ids):
        assert 1 + sum(len(c.emitted) for c in seq) == len(toks) == 15
        assert all(c.k == 2 for c in seq if c.counted) and all(c.k < 2 for c in seq if not c.counted)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt_ids=[[]], max_new_tokens=3), "prompt 0 is empty"),
    (dict(prompt_ids=[[1, 2], [3, 999]], max_new_tokens=3), "prompt 1 has token ids out of range"),
    (dict(prompt_ids=[1, -1], max_new_tokens=3), "out of range"),
    (dict(prompt_ids=[1, 2], max_new_tokens=3, num_speculative_tokens=3), "the model has 2"),
    (dict(prompt_ids=[1] * 250, max_new_tokens=7), "beyond the model's maximum length 256"),
    (dict(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(prompt_ids=[1, 2], max_new_tokens=3, draft_sampling="beam"), "draft_sampling"),
    (dict(prompt_ids=[1, 2], max_new_tokens=3, temperature=-1.0), "temperature"),
    (dict(prompt_ids=[1, 2], max_new_tokens=3, temperature=1.0, top_p=1.5), "top_p"),
    (dict(prompt_ids=[], max_new_tokens=3), "non-empty"),
])
def test_bad_input_is_refused(kwargs, message):
    model = random_model(tiny_config(num_mtp_depths=2), seed=9)
    with pytest.raises(ValueError, match=message):
        generate(model, **kwargs)
