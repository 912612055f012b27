"""Sampling and speculative rejection sampling, written as functions of explicit uniforms.

Every random choice below takes its uniform number u in [0, 1) as an argument instead of drawing
it: `generate` draws them from a per-sequence generator, tests feed scripted ones, and the fast
path can be checked against this code by feeding both the same uniforms.

    probs(logits)           temperature, then top-k, then top-p; temperature 0 = one-hot argmax
    sample(probs, u)        inverse CDF: the smallest id whose cumulative probability exceeds u
    rejection_sample(...)   Leviathan et al.: accept d_j with probability min(1, p(d_j)/q(d_j));
                            at the first rejection sample from normalize(max(p - q, 0));
                            if all k are accepted, the bonus comes from p at row k
Greedy drafting is the special case of a one-hot q.

The draft distribution q (`draft_params`), chosen by `draft_sampling`:
    "greedy"        the draft is the argmax of the depth's logits; q is one-hot
    "sample"        drawn from, and q =, the target's own filtered distribution (temperature, top-k, top-p)
    "temperature"   drawn from, and q =, softmax(logits / T) with no top-k / top-p: vLLM's probabilistic
                    drafting
All three are lossless: the emitted tokens follow the target's filtered distribution p whatever q is,
as long as the draft was drawn from the very q that rejection sampling is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..io.config import is_int, is_real


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        """Refuse what no distribution comes from: a temperature that is negative, infinite or NaN (a NaN
        would pass every comparison and sample garbage), a top_k that is not a positive integer, a top_p
        outside (0, 1]. Python and NumPy numbers are accepted; booleans and strings are not."""
        if not is_real(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 (or None), got {self.top_k!r}")
        if self.top_p is not None and (not is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1] (or None), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


DRAFT_SAMPLING = ("greedy", "sample", "temperature")


def draft_params(params: SamplingParams, draft_sampling: str) -> SamplingParams:
    """The parameters of the draft distribution q for the target's `params` (see the module docstring).
    Temperature 0 (greedy decoding) gives a one-hot q in every mode."""
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    if draft_sampling == "greedy" or params.greedy:
        return SamplingParams()
    if draft_sampling == "temperature":
        return SamplingParams(params.temperature)
    return params


def tempered_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the last axis, in float64, sound for every T > 0 down to the smallest
    positive double: the maximum is subtracted *before* the division, so every exponent is
    (l - max) / T <= 0 and the largest is exactly 0. Dividing first would turn finite logits into
    infinities at a tiny T (inf - inf = NaN); this way the result tends to the argmax (shared evenly
    between tied maxima) as T -> 0, the greedy limit."""
    z = logits.to(torch.float64)
    z = z - z.amax(-1, keepdim=True)
    return torch.softmax(z / temperature, dim=-1)


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> a probability distribution [..., V] (float64).

    Temperature 0 gives the one-hot argmax (ties to the lowest id). Otherwise: softmax(logits / T)
    (`tempered_softmax`: numerically sound at every T > 0),
    then keep the k most likely ids (ties broken towards lower ids), then keep the smallest set of
    most likely ids whose total probability reaches top_p; renormalize after each filter."""
    logits = logits.to(torch.float64)
    V = logits.shape[-1]
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), V).to(torch.float64)
    p = tempered_softmax(logits, params.temperature)
    # a stable descending order: equal probabilities keep increasing id order
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices
    sorted_p = p.gather(-1, order)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if params.top_k is not None:
        keep[..., params.top_k:] = False
    sorted_p = torch.where(keep, sorted_p, 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    if params.top_p is not None:
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely ids
        keep &= before < params.top_p            # the first id is always kept
    filtered = torch.zeros_like(p).scatter(-1, order, torch.where(keep, sorted_p, 0.0))
    return filtered / filtered.sum(-1, keepdim=True)


def sample(p: torch.Tensor, u: float) -> int:
    """p: [V] probabilities (need not be normalized), u in [0, 1) -> the smallest id i with
    cumsum(p)[i] > u * sum(p). Ids of probability 0 are never returned."""
    c = p.to(torch.float64).cumsum(-1)
    i = int(torch.searchsorted(c, torch.tensor([u * float(c[-1])], dtype=torch.float64, device=c.device), right=True)[0])
    i = min(i, p.shape[-1] - 1)
    while p[i] <= 0:  # guard against rounding landing on a zero-probability id
        i -= 1
    return i


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     u_accept: list[float], u_final: float) -> tuple[int, int]:
    """Speculative sampling for one sequence.

    p: [k+1, V] target (trunk) probabilities, row j judges d_{j+1}, row k gives the bonus;
    q: [k, V] draft probabilities the drafts were drawn from (one-hot for greedy drafting);
    u_accept: k uniforms, u_final: one uniform. Returns (a, b): a drafts accepted, then token b."""
    k = len(drafts)
    for j in range(k):
        d = drafts[j]
        # accept with probability min(1, p/q):  u < p/q  <=>  u * q < p
        if u_accept[j] * float(q[j, d]) < float(p[j, d]):
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        if float(residual.sum()) <= 0:  # p == q: any rejection is a measure-zero event; use p
            residual = p[j]
        return j, sample(residual, u_final)
    return k, sample(p[k], u_final)
