"""Sampling is numerically sound at every legal temperature, in the reference and in the fast kernels.

At T in {5e-324 (the smallest positive double), 1e-300, 1e-30} the distribution must be the greedy
limit (one-hot at the argmax: every other exponent (l - max) / T underflows), and at T in {1e-3, 1, 100}
the exact softmax(l / T), computed here with mpmath at 40 digits (an oracle that shares no code or
float64 rounding with the code under test). The same holds for what is sampled from it: `sample`,
`rejection_sample` (reference), `sample_tokens` and the rejection kernel (Triton; the interpreter on a
machine without a GPU), and `generate` end to end.

Mutation: a softmax that divides the logits by T before it subtracts their maximum overflows to
infinity at a tiny T and gives NaN; each check below fails on such a sampler (the reference as a
source-edited copy, the kernels' `sampling_probs` as a source-edited copy of kernels/)."""

from __future__ import annotations

import importlib
import itertools
import shutil
import sys
from pathlib import Path

import mpmath
import pytest
import torch

from configs import tiny_config
from inkling_ref import generate, random_model
from inkling_ref.decoding import sampling as ref_sampling
from inkling_ref.decoding.sampling import SamplingParams
from mutants import load_mutant

TINY_T = [5e-324, 1e-300, 1e-30]     # the greedy limit (logit gaps here are >= 1e-3 >> 745 T)
EXACT_T = [1e-3, 1.0, 100.0]          # the exact distribution
ALL_T = TINY_T + EXACT_T
V = 64


def logits_rows(rows: int = 3, seed: int = 0) -> torch.Tensor:
    """Distinct logits, float64 [rows, V], with gaps between sorted values of at least 1e-3."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(V, dtype=torch.float64) * 0.05 - 1.6
    return torch.stack([base[torch.randperm(V, generator=g)] * (1 + r) for r in range(rows)])


def exact_softmax(row: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(row / T) at 40 significant digits (mpmath), rounded to float64."""
    with mpmath.workdps(40):
        T = mpmath.mpf(temperature)
        e = [mpmath.exp(mpmath.mpf(float(x)) / T) for x in row]
        total = mpmath.fsum(e)
        return torch.tensor([float(x / total) for x in e], dtype=torch.float64)


def want(row: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature in TINY_T:
        return torch.nn.functional.one_hot(row.argmax(), V).double()
    return exact_softmax(row, temperature)


def check_probs(probs_fn) -> None:
    """probs_fn(logits [M, V], T) -> float64 probabilities: the greedy limit or the exact distribution."""
    logits = logits_rows()
    for T in ALL_T:
        got = probs_fn(logits, T)
        assert torch.isfinite(got).all(), f"T={T}: non-finite probabilities"
        for r in range(logits.shape[0]):
            w = want(logits[r], T)
            assert torch.allclose(got[r], w, rtol=1e-12, atol=1e-300), f"T={T}, row {r}: {got[r]} vs {w}"


# ----------------------------------------------------------------------------- the reference
def ref_probs(module):
    return lambda logits, T: module.probs(logits, module.SamplingParams(T))


def test_reference_probs_at_every_temperature():
    check_probs(ref_probs(ref_sampling))


@pytest.mark.parametrize("top", [dict(top_k=5), dict(top_p=0.5), dict(top_k=3, top_p=0.9)])
def test_reference_filters_keep_the_greedy_limit(top):
    logits = logits_rows()
    for T in TINY_T:
        p = ref_sampling.probs(logits, SamplingParams(T, **top))
        assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), V).double()), T


def test_reference_sample_and_rejection_at_every_temperature():
    """`sample` returns the argmax at a tiny T whatever u; `rejection_sample` with a one-hot q accepts a
    draft iff it is the argmax and otherwise returns the argmax (the greedy cycle)."""
    logits = logits_rows(rows=4, seed=1)
    top = logits.argmax(-1).tolist()
    for T in ALL_T:
        p = ref_sampling.probs(logits, SamplingParams(T))
        for u in (0.0, 0.3, 0.999999):
            token = ref_sampling.sample(p[0], u)
            if T in TINY_T:
                assert token == top[0], (T, u)
        drafts = [top[0], (top[1] + 1) % V, top[2]]
        q = torch.nn.functional.one_hot(torch.tensor(drafts), V).double()
        a, b = ref_sampling.rejection_sample(p, q, drafts, [0.5, 0.5, 0.5], 0.7)
        if T in TINY_T:
            assert (a, b) == (1, top[1]), T


@pytest.mark.parametrize("T", [1e-310, 5e-324])
def test_generate_at_a_tiny_temperature_is_greedy(T):
    model = random_model(tiny_config(), seed=3)
    greedy = generate(model, [5, 9, 2], max_new_tokens=12, num_speculative_tokens=2)
    tiny = generate(model, [5, 9, 2], max_new_tokens=12, num_speculative_tokens=2, temperature=T, seed=1)
    assert tiny.token_ids == greedy.token_ids
    assert tiny.stats.acceptance_length == greedy.stats.acceptance_length


DIVIDE_FIRST = [("decoding/sampling.py", "    z = z - z.amax(-1, keepdim=True)\n", "")]


def test_reference_checks_catch_a_sampler_that_divides_first(tmp_path):
    mutant = load_mutant(tmp_path, DIVIDE_FIRST)
    with pytest.raises(AssertionError):
        check_probs(ref_probs(mutant.decoding.sampling))


# ----------------------------------------------------------------------------- the kernels
from inkling_fast.kernels import sampling as kernel_sampling  # noqa: E402
from inkling_fast.kernels.rejection import rejection_sample  # noqa: E402


def kernel_probs(module):
    return lambda logits, T: module.sampling_probs(logits, T)


def test_kernel_probs_at_every_temperature():
    check_probs(kernel_probs(kernel_sampling))


def test_kernel_sampling_and_rejection_at_every_temperature():
    """The inverse-CDF kernel and the rejection kernel, fed probabilities at each T: the same tokens as the
    reference for the same uniforms, and the greedy cycle at a tiny T."""
    B, K = 3, 3
    logits = torch.stack([logits_rows(rows=K + 1, seed=10 + b) for b in range(B)])        # [B, K+1, V]
    top = logits.argmax(-1)                                                                # [B, K+1]
    drafts = top[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V           # row 1 rejects its second draft
    drafts[2, 0] = (drafts[2, 0] + 7) % V           # row 2 rejects its first
    g = torch.Generator().manual_seed(5)
    u_acc, u_fin = torch.rand(B, K, generator=g, dtype=torch.float64), torch.rand(B, generator=g, dtype=torch.float64)
    for T in ALL_T:
        p = kernel_sampling.sampling_probs(logits, T).contiguous()
        ids = kernel_sampling.sample_tokens(p[:, 0].contiguous(), u_fin)
        a, nxt, _ = rejection_sample(p, None, drafts, u_acc, u_fin)
        for b in range(B):
            assert int(ids[b]) == ref_sampling.sample(p[b, 0], float(u_fin[b])), (T, b)
            q = torch.nn.functional.one_hot(drafts[b], V).double()
            assert (int(a[b]), int(nxt[b])) == ref_sampling.rejection_sample(
                p[b], q, drafts[b].tolist(), u_acc[b].tolist(), float(u_fin[b])), (T, b)
        if T in TINY_T:
            assert torch.equal(ids, top[:, 0]), T
            want_a = [K, 1, 0]
            assert a.tolist() == want_a, T
            assert nxt.tolist() == [int(top[b, want_a[b]]) for b in range(B)], T


_copies = itertools.count()


def kernels_copy(tmp_path: Path, file: str, old: str, new: str):
    """A copy of inkling_fast/kernels/ under a new package name with one source edit (`old` once in `file`)."""
    src = Path(kernel_sampling.__file__).parent
    name = f"kernels_mutant_{next(_copies)}"
    shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / name / file
    text = path.read_text()
    assert text.count(old) == 1, f"mutation target occurs {text.count(old)} times in {file}"
    path.write_text(text.replace(old, new))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module(f"{name}.sampling")
    finally:
        sys.path.remove(str(tmp_path))


def test_kernel_checks_catch_a_sampler_that_divides_first(tmp_path):
    mutant = kernels_copy(tmp_path, "sampling.py", "(z - z.amax(-1, keepdim=True)) / temperature",
                          "z / temperature")
    with pytest.raises(AssertionError):
        check_probs(kernel_probs(mutant))
