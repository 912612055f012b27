"""Speculative rejection sampling for a batch, on the device (Leviathan et al.; the batched twin of
inkling_ref.decoding.sampling.rejection_sample, fed the same uniforms it gives the same tokens):

    for j < k_eff[b]:  accept d_j  iff  u_accept[b, j] * q[b, j, d_j] < p[b, j, d_j]
    a[b]           = the first rejected j (k_eff[b] if none)
    next_token[b]  = sample(max(p[b, a] - q[b, a], 0), u_final[b])   at a rejection
                                                   (p[b, a] itself if that residual has no mass)
                   = sample(p[b, k_eff], u_final[b])                 when all k_eff were accepted
    emitted[b]     = d_1..d_a, next_token, then -1 padding [B, K+1]

p: [B, K+1, V] the target's filtered probabilities (`sampling_probs` of the verify logits); row j
judges d_{j+1}, row k_eff gives the bonus. q: [B, K, V] the draft distributions the drafts were drawn
from, or None for greedy drafting (q one-hot at the draft: accept iff u < p(d), residual = p without
d). A draft id outside 0..V-1 is rejected (the reference would raise instead).

One program per sequence, float64 throughout, no host sync: the k acceptance tests are one gather,
the residual/bonus is drawn by the inverse-CDF scan of sampling.py (`_inverse_cdf`: two passes over
the row, a third only if rounding hit an id of zero mass). The uniforms come from the caller, e.g.
`philox_uniforms` (uniforms.py) seeded per sequence on the device.

Copy with it: accept.py, common.py, sampling.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .accept import accept_outputs
from .common import INDEX_DTYPES, PROB_DTYPES, check_kernel_device, check_tensor, need
from .sampling import BLOCK_V, _inverse_cdf, sample_tokens_torch


@triton.jit(do_not_specialize=["K"])
def _rejection_kernel(p_ptr, q_ptr, drafts_ptr, k_eff_ptr, ua_ptr, uf_ptr, a_ptr, next_ptr, emitted_ptr,
                      K, V, ua_s0, ua_s1, uf_s0,
                      HAS_Q: tl.constexpr, HAS_K_EFF: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    if HAS_K_EFF:
        ke = tl.minimum(tl.maximum(tl.load(k_eff_ptr + b).to(tl.int32), 0), K)
    else:
        ke = tl.zeros([], tl.int32) + K
    valid = j < ke
    d = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1).to(tl.int64)
    d_ok = valid & (d >= 0) & (d < V)
    # the acceptance tests, all k at once: u * q(d) < p(d)   (float64, as the reference)
    p_d = tl.load(p_ptr + (b * (K + 1) + j) * V + d, mask=d_ok, other=0.0).to(tl.float64)
    if HAS_Q:
        q_d = tl.load(q_ptr + (b * K + j) * V + d, mask=d_ok, other=0.0).to(tl.float64)
    else:
        q_d = tl.full([BLOCK_K], 1.0, tl.float64)
    u = tl.load(ua_ptr + b * ua_s0 + j * ua_s1, mask=valid, other=1.0).to(tl.float64)
    accepted = (u * q_d < p_d) & d_ok
    a = tl.min(tl.where(valid & (accepted == 0), j, ke), axis=0)          # first rejection, else k_eff
    # the correction (residual of row a) or the bonus (p of row k_eff)
    rejected = a < ke
    a64 = a.to(tl.int64)
    p_row = p_ptr + (b * (K + 1) + a64) * V
    if HAS_Q:
        mode = tl.where(rejected, 1, 0)
        q_row = q_ptr + (b * K + a64) * V                  # read only when rejected (a < K)
    else:
        mode = tl.where(rejected, 2, 0)
        q_row = p_row
    d_a = tl.sum(tl.where(j == a, d, 0), axis=0)
    u_final = tl.load(uf_ptr + b * uf_s0).to(tl.float64)
    nxt, _ = _inverse_cdf(p_row, q_row, mode, d_a, u_final, V, BLOCK_V)
    tl.store(a_ptr + b, a)
    tl.store(next_ptr + b, nxt)
    jj = tl.arange(0, 2 * BLOCK_K)                         # K + 1 entries
    d_all = tl.load(drafts_ptr + b * K + jj, mask=jj < K, other=-1).to(tl.int64)
    emitted = tl.where(jj < a, d_all, tl.where(jj == a, nxt, -1))
    tl.store(emitted_ptr + b * (K + 1) + jj, emitted, mask=jj < K + 1)


def rejection_sample_torch(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
                           u_accept: torch.Tensor, u_final: torch.Tensor, k_eff: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin (vectorized over the batch). Shapes as `rejection_sample`."""
    B, K1, V = p.shape
    K = K1 - 1
    dev = p.device
    p = p.to(torch.float64)
    ke = torch.full((B,), K, device=dev) if k_eff is None else k_eff.long().clamp(0, K)
    j = torch.arange(K, device=dev)
    valid = j[None] < ke[:, None]
    d = drafts.long()
    d_ok = valid & (d >= 0) & (d < V)
    dc = d.clamp(0, V - 1)[..., None]
    p_d = p[:, :K].gather(2, dc)[..., 0]
    q_d = q.to(torch.float64).gather(2, dc)[..., 0] if q is not None else torch.ones_like(p_d)
    accepted = (u_accept.to(torch.float64) * q_d < p_d) & d_ok
    first_reject = torch.where(valid & ~accepted, j[None], ke[:, None])
    a = torch.cat([first_reject, ke[:, None]], dim=1).min(dim=1).values
    rejected = a < ke
    rows = torch.arange(B, device=dev)
    p_row = p[rows, a]                                                     # [B, V]
    if q is not None:
        q_row = q.to(torch.float64)[rows, a.clamp(max=max(K - 1, 0))] if K > 0 else torch.zeros_like(p_row)
        q_row = q_row * rejected[:, None]
    else:
        d_a = torch.cat([d, d.new_full((B, 1), -1)], dim=1).gather(1, a[:, None])[:, 0]
        hit = rejected & (d_a >= 0) & (d_a < V)
        q_row = torch.zeros_like(p_row).scatter(1, d_a.clamp(0, V - 1)[:, None], hit[:, None].double())
    res = (p_row - q_row).clamp(min=0)
    res = torch.where(res.sum(-1, keepdim=True) <= 0, p_row, res)         # p == q: sample from p
    nxt = sample_tokens_torch(res, u_final)
    jj = torch.arange(K + 1, device=dev)
    dd = torch.cat([d, d.new_full((B, 1), -1)], dim=1)
    emitted = torch.where(jj[None] < a[:, None], dd, torch.where(jj[None] == a[:, None], nxt[:, None], -1))
    return a.int(), nxt, emitted


def rejection_sample(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, u_accept: torch.Tensor,
                     u_final: torch.Tensor, k_eff: torch.Tensor | None = None, out: tuple | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p: contiguous float64/float32 [B, K+1, V]; q: contiguous [B, K, V] of p's dtype, or None (greedy
    drafting: one-hot q); drafts: int [B, K]; u_accept: float [B, K] and u_final: float [B] uniforms in
    [0, 1) (any strides: e.g. columns of one [B, 2K+1] draw); k_eff: int [B] (<= K, clamped) or None.
    Returns (a int32 [B], next_token int64 [B], emitted int64 [B, K+1]), into `out` when given.
    One launch, no host sync."""
    check_tensor("p", p, dtypes=PROB_DTYPES, contiguous=True)
    need(p.dim() == 3 and p.shape[1] >= 1 and p.shape[2] >= 1,
         f"p must be a tensor [B, K+1, V] with K+1 >= 1 rows and V >= 1 ids, got shape {tuple(p.shape)}")
    check_kernel_device("p", p)
    B, K1, V = p.shape
    K = K1 - 1
    if q is not None:
        check_tensor("q", q, (B, K, V), p.dtype, p.device, contiguous=True)
    check_tensor("drafts", drafts, (B, K), INDEX_DTYPES, p.device, contiguous=True)
    need(isinstance(u_accept, torch.Tensor) and u_accept.is_floating_point() and tuple(u_accept.shape) == (B, K)
         and u_accept.device == p.device, f"u_accept must be a float tensor of shape {(B, K)} on {p.device}")
    need(isinstance(u_final, torch.Tensor) and u_final.is_floating_point() and tuple(u_final.shape) == (B,)
         and u_final.device == p.device, f"u_final must be a float tensor of shape ({B},) on {p.device}")
    if k_eff is not None:
        check_tensor("k_eff", k_eff, (B,), INDEX_DTYPES, p.device)
    a, nxt, emitted = accept_outputs(out, B, K, p.device)
    if B > 0:
        _rejection_kernel[(B,)](p, q if q is not None else p, drafts, k_eff if k_eff is not None else a,
                                u_accept, u_final, a, nxt, emitted, K, V,
                                u_accept.stride(0), u_accept.stride(1), u_final.stride(0),
                                HAS_Q=q is not None, HAS_K_EFF=k_eff is not None,
                                BLOCK_K=max(1, triton.next_power_of_2(K)), BLOCK_V=BLOCK_V, num_warps=4)
    return a, nxt, emitted
