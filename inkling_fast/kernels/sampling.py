"""Sampling on the device, as functions of explicit uniforms (the twins of inkling_ref/decoding/sampling.py).

    sampling_probs(logits, temperature, top_k, top_p)   temperature, then top-k, then top-p -> float64
                                                         probabilities
    sample_tokens(p, u)              inverse CDF: the smallest id i with cumsum(p)[i] > u * sum(p)

`sampling_probs` is vectorized torch on the logits' device (softmax in float64 of (logits - max) / T,
sound at every T > 0 down to the smallest positive double: the greedy limit; a stable sort only
when top-k or top-p is set), with exactly the rules of the reference's `probs` (inkling_ref/decoding/sampling.py): the k most likely
ids, ties towards lower ids; then the smallest prefix of that order whose mass reaches top_p,
renormalizing after each filter. It never synchronizes with the host (every shape and parameter is
known on the host; no value is read back), so it can be captured in a CUDA graph.

`sample_tokens` is a Triton kernel, one program per row, in float64: pass 1 sums the row, pass 2
counts the running prefix sums <= u * total (= torch.searchsorted(cumsum, u * total, right=True),
clamped to V - 1); if rounding landed on an id of probability 0, pass 3 steps down to the nearest
id of positive probability, as the reference does. `_inverse_cdf` is shared with the rejection
sampler (rejection.py), which samples from the residual max(p - q, 0) the same way.

Exactness against the reference (same uniforms in, same tokens out): the decisions compare float64
numbers computed with the same formulas but summed in another order (chunked prefix sums here, a
sequential cumsum in the reference; GPU vs CPU exp). Ids can differ only when u * total falls within
a few float64 ulps of a cumulative boundary, or a top-p prefix mass within a few ulps of top_p:
probability ~1e-12 per draw for random logits. Tests use such inputs and require identical tokens.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .common import PROB_DTYPES, check_kernel_device, check_tensor, need, out_tensor

BLOCK_V = 1024


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """logits: [..., V] (any float dtype, any device) -> float64 probabilities [..., V] after
    temperature, top-k and top-p (the rules of the reference's `probs`). temperature must be > 0:
    greedy needs no probabilities (use lm_head_argmax and greedy_accept); top_k None or >= 1, top_p
    None or in (0, 1]."""
    need(isinstance(temperature, numbers.Real) and not isinstance(temperature, bool) and temperature > 0,
         f"temperature must be a number > 0 (greedy needs no probabilities: use lm_head_argmax / "
         f"greedy_accept), got {temperature!r}")
    need(top_k is None or (isinstance(top_k, numbers.Integral) and not isinstance(top_k, bool) and top_k >= 1),
         f"top_k must be None or an integer >= 1, got {top_k!r}")
    need(top_p is None or (isinstance(top_p, numbers.Real) and not isinstance(top_p, bool) and 0 < top_p <= 1),
         f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a float tensor [..., V]")
    V = logits.shape[-1]
    z = logits.to(torch.float64)
    # the maximum first, then the division: exponents (l - max) / T <= 0 stay finite or -inf at every
    # T > 0 (dividing first overflows to inf at a tiny T, and inf - inf is NaN)
    p = torch.softmax((z - z.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_k is None and top_p is None:
        return p
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices   # equal p: lower id first
    sorted_p = p.gather(-1, order)
    if top_k is not None and top_k < V:
        sorted_p = sorted_p.clone()
        sorted_p[..., top_k:] = 0.0
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    if top_p is not None:
        before = sorted_p.cumsum(-1) - sorted_p                  # mass of the more likely ids
        sorted_p = torch.where(before < top_p, sorted_p, 0.0)  # the first id is always kept
    filtered = torch.zeros_like(p).scatter(-1, order, sorted_p)
    return filtered / filtered.sum(-1, keepdim=True)


@triton.jit
def _residual(p_row, q_row, offs, ok, MODE, d):
    """The distribution sampled from: MODE 0: p; 1: max(p - q, 0); 2: max(p - onehot(d), 0)."""
    mode = offs * 0 + MODE                 # as a vector (the interpreter cannot AND a scalar into a mask)
    p = tl.load(p_row + offs, mask=ok, other=0.0).to(tl.float64)
    q = tl.load(q_row + offs, mask=ok & (mode == 1), other=0.0).to(tl.float64)
    q = tl.where((mode == 2) & (offs == d), 1.0, q)
    return tl.maximum(p - q, 0.0)


@triton.jit
def _inverse_cdf(p_row, q_row, MODE, d, u, V, BLOCK: tl.constexpr):
    """The smallest id whose running sum of the residual exceeds u * total (float64), as
    inkling_ref.decoding.sampling.sample: clamped to V - 1, then down to the nearest id of positive mass.
    If the residual of MODE 1/2 has no mass at all, samples from p (MODE 0), as rejection_sample does.
    Returns (id int64, the MODE used)."""
    base = tl.arange(0, BLOCK).to(tl.int64)
    total = tl.zeros([], tl.float64)
    for v0 in range(0, V, BLOCK):
        offs = v0 + base
        total += tl.sum(_residual(p_row, q_row, offs, offs < V, MODE, d), axis=0)
    if total <= 0.0:                       # p == q (or p one-hot on d): fall back to p
        MODE = MODE * 0
        total = tl.zeros([], tl.float64)
        for v0 in range(0, V, BLOCK):
            offs = v0 + base
            total += tl.sum(_residual(p_row, q_row, offs, offs < V, MODE, d), axis=0)
    target = u * total
    count = tl.zeros([], tl.int64)
    running = tl.zeros([], tl.float64)
    for v0 in range(0, V, BLOCK):
        offs = v0 + base
        ok = offs < V
        r = _residual(p_row, q_row, offs, ok, MODE, d)
        c = running + tl.cumsum(r, axis=0)
        count += tl.sum(((c <= target) & ok).to(tl.int64), axis=0)
        running += tl.sum(r, axis=0)
    i = tl.minimum(count, V - 1)
    r_i = tl.sum(_residual(p_row, q_row, i + base, base == 0, MODE, d), axis=0)
    if r_i <= 0.0:                         # rounding landed on an id of zero mass: step down
        last = tl.zeros([], tl.int64) - 1
        for v0 in range(0, V, BLOCK):
            offs = v0 + base
            r = _residual(p_row, q_row, offs, offs < V, MODE, d)
            last = tl.maximum(last, tl.max(tl.where((r > 0.0) & (offs <= i), offs, -1), axis=0))
        i = tl.maximum(last, 0)
    return i, MODE


@triton.jit(do_not_specialize=["u_stride"], do_not_specialize_on_alignment=["u_ptr"])
def _sample_kernel(p_ptr, u_ptr, out_ptr, V, u_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    u = tl.load(u_ptr + row * u_stride).to(tl.float64)
    p_row = p_ptr + row * V
    mode = tl.zeros([], tl.int32)                      # sample from p itself
    i, _ = _inverse_cdf(p_row, p_row, mode, tl.full([], -1, tl.int64), u, V, BLOCK)
    tl.store(out_ptr + row, i)


def sample_tokens_torch(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The twin: p [M, V] (need not be normalized), u [M] in [0, 1) -> ids int64 [M]."""
    p = p.to(torch.float64)
    c = p.cumsum(-1)
    i = torch.searchsorted(c, (u.to(torch.float64) * c[:, -1])[:, None], right=True)[:, 0]
    i = i.clamp(max=p.shape[-1] - 1)
    ids = torch.arange(p.shape[-1], device=p.device)
    # down to the nearest id of positive probability (only when rounding landed on a zero)
    below = torch.where((p > 0) & (ids[None] <= i[:, None]), ids[None], -1).max(-1).values
    return torch.where(p.gather(1, i[:, None])[:, 0] > 0, i, below.clamp(min=0))


def sample_tokens(p: torch.Tensor, u: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """p: contiguous float64/float32 [M, V] probabilities (need not be normalized; each row must have
    positive mass); u: float [M] uniforms in [0, 1) (any stride). Returns ids int64 [M] (into `out`
    when given). One launch, no host sync."""
    check_tensor("p", p, dtypes=PROB_DTYPES, contiguous=True)
    need(p.dim() == 2 and p.shape[1] > 0, f"p must be a tensor [M, V] with V >= 1, got shape {tuple(p.shape)}")
    check_kernel_device("p", p)
    M, V = p.shape
    need(isinstance(u, torch.Tensor) and u.shape == (M,) and u.is_floating_point() and u.device == p.device,
         f"u must be a float tensor of shape ({M},) on {p.device}")
    out = out_tensor("out", out, (M,), torch.int64, p.device)
    if M > 0:
        _sample_kernel[(M,)](p, u, out, V, u.stride(0), BLOCK=BLOCK_V, num_warps=4)
    return out
