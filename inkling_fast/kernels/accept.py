"""Greedy accept / correct / bonus for a batch, on the device (docs/spec/mtp-cycle.md §3.3):

    a[b]          = length of the longest prefix j < k_eff[b] with drafts[b, j] == target[b, j]
    next_token[b] = target[b, a[b]]        the trunk's argmax there: the correction, or the bonus if a = k_eff
    emitted[b]    = drafts[b, :a], next_token, then -1 padding          [B, K+1]

    first_bad[b]  = 1 + the first j (in the order draft_scores[0..K-1, b], then target_scores[b, 0..k_eff])
                    whose score is NaN or infinite; 0 if all are finite (or no scores are given)

target[b, j] is the trunk's argmax at verify row j (row j judges draft j+1; row k_eff gives the
bonus), e.g. from `lm_head_argmax` over the verify hiddens. k_eff (per sequence, <= K) allows ragged
draft counts; drafts and targets beyond it are ignored. One program per sequence, no host sync: the
engine reads a and next_token on the device (commit n += a + 1) or copies them back asynchronously.

The scores are the maxima `lm_head_argmax` returns beside each id (draft_scores [K, B]: a row per
draft depth, as the depths make them; target_scores [B, K+1]). A hidden state holding a NaN or an
infinity makes every logit of its row NaN (after the final norm), so the row's maximum is NaN or
-inf: checking K + 1 + K numbers per sequence here catches it at no extra launch, where a separate
check would read every hidden state again. When first_bad[b] > 0, a[b] and next_token[b] are
meaningless and the caller must not use them.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INDEX_DTYPES, check_kernel_device, check_tensor, need, out_tensor


@triton.jit(do_not_specialize=["K", "B"])
def _greedy_accept_kernel(drafts_ptr, target_ptr, k_eff_ptr, dscore_ptr, tscore_ptr, a_ptr, next_ptr, emitted_ptr,
                          bad_ptr, K, B, HAS_K_EFF: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    if HAS_K_EFF:
        ke = tl.minimum(tl.maximum(tl.load(k_eff_ptr + b).to(tl.int32), 0), K)
    else:
        ke = K
    d = tl.load(drafts_ptr + b * K + j, mask=j < K, other=-1).to(tl.int64)
    tgt = tl.load(target_ptr + b * (K + 1) + j, mask=j < K + 1, other=-1).to(tl.int64)
    stop = (d != tgt) | (j >= ke)                       # j = k_eff always stops: a <= k_eff
    a = tl.min(tl.where(stop, j, BLOCK), axis=0)
    nxt = tl.sum(tl.where(j == a, tgt, 0), axis=0)      # target[b, a]
    emitted = tl.where(j < a, d, tl.where(j == a, nxt, -1))
    tl.store(a_ptr + b, a)
    tl.store(next_ptr + b, nxt)
    tl.store(emitted_ptr + b * (K + 1) + j, emitted, mask=j < K + 1)
    bad = tl.zeros([], dtype=tl.int32)
    if HAS_SCORES:                                      # |x| < inf is False for NaN and for +-inf
        ds = tl.load(dscore_ptr + j.to(tl.int64) * B + b, mask=j < K, other=0.0)
        ts = tl.load(tscore_ptr + b * (K + 1) + j, mask=j <= ke, other=0.0)
        first = tl.minimum(tl.min(tl.where(tl.abs(ds) < float("inf"), 2 * BLOCK, j), axis=0),
                           tl.min(tl.where(tl.abs(ts) < float("inf"), 2 * BLOCK, K + j), axis=0))
        bad = tl.where(first < 2 * BLOCK, first + 1, 0).to(tl.int32)
    tl.store(bad_ptr + b, bad)


def first_nonfinite_torch(draft_scores: torch.Tensor, target_scores: torch.Tensor, k_eff: torch.Tensor
                          ) -> torch.Tensor:
    """first_bad int32 [B] (see the module's docstring) from draft_scores [K, B], target_scores [B, K+1],
    k_eff int [B] (clamped to 0..K): the rule the kernel applies, in torch (also for callers whose scores
    come from elsewhere, e.g. sums of sampled probabilities)."""
    K, B = draft_scores.shape
    j = torch.arange(K + 1, device=target_scores.device)
    bad = torch.cat([~torch.isfinite(draft_scores.T),
                     ~torch.isfinite(target_scores) & (j[None] <= k_eff.long().clamp(0, K)[:, None])], dim=1)
    return torch.where(bad.any(dim=1), bad.int().argmax(dim=1) + 1, 0).int()


def greedy_accept_torch(drafts: torch.Tensor, target: torch.Tensor, k_eff: torch.Tensor | None = None,
                        scores: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The twin. drafts [B, K], target [B, K+1], k_eff [B] or None, scores (draft_scores [K, B],
    target_scores [B, K+1]) or None -> (a int32 [B], next int64 [B], emitted int64 [B, K+1],
    first_bad int32 [B])."""
    B, K = drafts.shape
    j = torch.arange(K + 1, device=drafts.device)
    ke = torch.full((B,), K, device=drafts.device) if k_eff is None else k_eff.long().clamp(0, K)
    match = (drafts.long() == target[:, :K].long()) & (j[None, :K] < ke[:, None])
    a = match.long().cumprod(dim=1).sum(dim=1)                            # longest agreeing prefix
    nxt = target.long().gather(1, a[:, None])[:, 0]
    d = torch.cat([drafts.long(), drafts.new_full((B, 1), -1).long()], dim=1)
    emitted = torch.where(j[None] < a[:, None], d, torch.where(j[None] == a[:, None], nxt[:, None], -1))
    bad = torch.zeros(B, dtype=torch.int32, device=drafts.device) if scores is None else \
        first_nonfinite_torch(*scores, ke)
    return a.int(), nxt, emitted, bad


def accept_outputs(out, B: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (a, next_token, emitted) buffers: new ones, or `out` checked (e.g. a CUDA graph's static ones)."""
    if out is None:
        out = (None, None, None)
    need(isinstance(out, (tuple, list)) and len(out) == 3, "out must be a tuple (a, next_token, emitted)")
    return (out_tensor("out[a]", out[0], (B,), torch.int32, device),
            out_tensor("out[next_token]", out[1], (B,), torch.int64, device),
            out_tensor("out[emitted]", out[2], (B, K + 1), torch.int64, device))


def greedy_accept(drafts: torch.Tensor, target: torch.Tensor, k_eff: torch.Tensor | None = None,
                  out: tuple | None = None, scores: tuple[torch.Tensor, torch.Tensor] | None = None,
                  first_bad_out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafts: int [B, K] (d_1..d_K per sequence); target: int [B, K+1] (the trunk's argmax per verify
    row); k_eff: int [B] (drafts actually made, <= K; values outside 0..K are clamped) or None (= K);
    scores (optional): (draft_scores float32 [K, B], target_scores float32 [B, K+1]), the maxima behind
    the drafts and the targets. Returns (a int32 [B], next_token int64 [B], emitted int64 [B, K+1],
    first_bad int32 [B]), into `out` (the first three) and `first_bad_out` when given.
    One launch, no host sync."""
    check_tensor("drafts", drafts, dtypes=INDEX_DTYPES, contiguous=True)
    need(drafts.dim() == 2, f"drafts must be a tensor [B, K], got shape {tuple(drafts.shape)}")
    check_kernel_device("drafts", drafts)
    B, K = drafts.shape
    check_tensor("target", target, (B, K + 1), INDEX_DTYPES, drafts.device, contiguous=True)
    if k_eff is not None:
        check_tensor("k_eff", k_eff, (B,), INDEX_DTYPES, drafts.device, contiguous=True)
    if scores is not None:
        need(isinstance(scores, (tuple, list)) and len(scores) == 2,
             "scores must be a tuple (draft_scores [K, B], target_scores [B, K+1])")
        check_tensor("draft_scores", scores[0], (K, B), torch.float32, drafts.device, contiguous=True)
        check_tensor("target_scores", scores[1], (B, K + 1), torch.float32, drafts.device, contiguous=True)
    a, nxt, emitted = accept_outputs(out, B, K, drafts.device)
    bad = out_tensor("first_bad_out", first_bad_out, (B,), torch.int32, drafts.device)
    if B > 0:
        dscore, tscore = scores if scores is not None else (a, a)     # never read without scores
        _greedy_accept_kernel[(B,)](drafts, target, k_eff if k_eff is not None else a, dscore, tscore,
                                    a, nxt, emitted, bad, K, B, HAS_K_EFF=k_eff is not None,
                                    HAS_SCORES=scores is not None, BLOCK=triton.next_power_of_2(K + 1),
                                    num_warps=1)
    return a, nxt, emitted, bad
