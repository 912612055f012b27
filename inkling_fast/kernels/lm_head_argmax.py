"""Greedy token selection straight from the LM head, without writing the [T, V] logits.

    logits[t, v] = (h[t] . W[v]) / mup          for v < V_out (the unpadded vocabulary)
    ids[t]       = argmax_v logits[t, v]        ties to the LOWEST id; padding rows v >= V_out never win
    vals[t]      = max_v logits[t, v]           (float32)

h: [T, H] (the trunk's post-final-norm hidden, or an MTP depth's output), W: [V, H] the unembedding.
The argmax is taken over the float32 dot products; mup > 0 only scales the returned value (dividing
by a positive constant does not change which id is largest). Equal dot products are true ties and go
to the lowest id, as `torch.argmax` and inkling_ref do.

Two launches, both free of host synchronization:
  1. split-V: program (i, j) computes the logits of a V-tile of BLOCK_V rows for a block of up to
     BLOCK_T (<= 64) token rows, `tl.dot(W_tile [BLOCK_V, BLOCK_K], h_tile^T [BLOCK_K, BLOCK_T])`
     accumulated in float32 over H, and writes, per group of GROUP = 64 ids, the group's maximum
     and the lowest id reaching it: partials [T, cdiv(V_out, GROUP)] (a few KB, never the logits).
     With W as the wide operand and T as the narrow one, every program streams BLOCK_V * H weights
     once for all T rows: the kernel reads W once (for T <= 64), which is the floor.
  2. reduce: one program per token row scans its partials in id order and keeps the first maximum.
The group granularity is fixed (independent of the tile size `launch_config` picks), so the second
pass never needs to know the launch configuration of the first.

The tiles follow from H, BLOCK_T and the dtype by a rule (`launch_config`; no autotuning), and the
row count T is a runtime value: the first kernel compiles once per BLOCK_T (16, 32 or 64 rows).

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (FLOAT_DTYPES, check_kernel_device, check_tensor, interpreting, k_loop, need, out_tensor,
                     pipeline_stages)

GROUP = 64            # ids per partial (max, argmax) entry
MAX_BLOCK_T = 64      # token rows per program; more rows are split over a second grid axis
REDUCE_BLOCK = 1024   # partials per step of the reduction
INT32_MAX = tl.constexpr(2**31 - 1)  # a constexpr: Triton 3.6 refuses plain globals in kernels


@triton.jit(do_not_specialize=["T"])
def _lm_head_partial_kernel(h_ptr, w_ptr, pmax_ptr, pidx_ptr, T, H, V_out, n_groups,
                            BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                            FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    G: tl.constexpr = BLOCK_V // 64                                   # groups of GROUP = 64 ids per tile
    v = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)            # vocabulary ids of this tile
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)            # token rows of this block
    kk = tl.arange(0, BLOCK_K)
    v_ok = v < V_out
    t_ok = t < T
    w_ptrs = w_ptr + v[:, None].to(tl.int64) * H + kk[None, :]        # [BLOCK_V, BLOCK_K]
    h_ptrs = h_ptr + t[None, :].to(tl.int64) * H + kk[:, None]        # [BLOCK_K, BLOCK_T] = h^T
    acc = tl.zeros([BLOCK_V, BLOCK_T], dtype=tl.float32)
    acc = k_loop(acc, w_ptrs, h_ptrs, v_ok, t_ok, kk, H, BLOCK_K, EVEN_K, FP32_DOT)
    # per group of 64 ids: the maximum and the lowest id that reaches it (ids >= V_out never win)
    scores = tl.where(v_ok[:, None], acc, float("-inf"))
    scores = tl.reshape(scores, [G, 64, BLOCK_T])
    ids = tl.reshape(v, [G, 64])[:, :, None]
    m = tl.max(scores, axis=1)                                            # [G, BLOCK_T]
    idx = tl.min(tl.where(scores == m[:, None, :], ids, INT32_MAX), axis=1)
    idx = tl.minimum(idx, V_out - 1)  # a NaN logit matches nothing: keep the id in range regardless
    grp = tl.program_id(0) * G + tl.arange(0, G)
    offs = t[None, :] * n_groups + grp[:, None]                          # partials are [T, n_groups]
    ok = (grp[:, None] < n_groups) & t_ok[None, :]
    tl.store(pmax_ptr + offs, m, mask=ok)
    tl.store(pidx_ptr + offs, idx, mask=ok)


# ids and vals may be rows of a caller's larger buffer (one per draft depth), at any offset: one build
# serves every alignment (the kernel stores one value per program, so alignment buys nothing)
@triton.jit(do_not_specialize_on_alignment=["ids_ptr", "vals_ptr"])
def _lm_head_reduce_kernel(pmax_ptr, pidx_ptr, ids_ptr, vals_ptr, n_groups, mup, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for c0 in range(0, n_groups, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        ok = offs < n_groups
        vals = tl.load(pmax_ptr + t * n_groups + offs, mask=ok, other=float("-inf"))
        idx = tl.load(pidx_ptr + t * n_groups + offs, mask=ok, other=INT32_MAX)
        m = tl.max(vals, axis=0)
        cand = tl.min(tl.where(vals == m, idx, INT32_MAX), axis=0)
        take = m > best        # strictly greater: an equal maximum in a later chunk has a higher id
        best_id = tl.where(take, cand, best_id)
        best = tl.where(take, m, best)
    tl.store(ids_ptr + t, best_id.to(tl.int64))
    tl.store(vals_ptr + t, best / mup)


_INTERPRET_META = dict(BLOCK_V=64, BLOCK_K=32, num_warps=4)   # small tiles: tests span several


def launch_config(H: int, BLOCK_T: int, dtype: torch.dtype) -> dict:
    """The partial kernel's BLOCK_V, BLOCK_K, num_warps, num_stages for [BLOCK_T, H] rows of `dtype`:
    bf16/fp16 128 ids x 128 of H, 4 warps, 4 stages (64 ids at H <= 1024: more programs over a small
    vocabulary); float32 (exact products on the FMA units) 64 x 64, 4 warps, 2 stages. Stages are
    capped so that the W and h tiles of every stage fit shared memory."""
    if dtype == torch.float32:
        block_v, block_k, warps, stages = 64, 64, 4, 2
    else:
        block_v, block_k, warps, stages = (64 if H <= 1024 else 128), 128, 4, 4
    nbytes = (block_v + BLOCK_T) * block_k * torch.finfo(dtype).bits // 8
    return dict(BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps, num_stages=pipeline_stages(stages, nbytes))


def reduce_partials(pmax: torch.Tensor, pidx: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
                    mup: float) -> None:
    """The second pass: pmax, pidx [T, n_groups] (per group of GROUP ids, in id order: the maximum and
    the lowest id reaching it) -> ids[t] (int64), vals[t] = max / mup (float32). One launch."""
    T, n_groups = pmax.shape
    _lm_head_reduce_kernel[(T,)](pmax, pidx, ids, vals, n_groups, float(mup), BLOCK=REDUCE_BLOCK, num_warps=4)


def lm_head_argmax_torch(h: torch.Tensor, weight: torch.Tensor, vocab_out: int | None = None,
                         mup: float = 1.0, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: float32 logits chunk by chunk over the vocabulary, argmax with ties to the lowest id.
    h: [T, H], weight: [V, H] -> (ids int64 [T], vals float32 [T])."""
    V_out = weight.shape[0] if vocab_out is None else vocab_out
    hf = h.float()
    best = torch.full((h.shape[0],), float("-inf"), device=h.device)
    best_id = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
    for v0 in range(0, V_out, chunk):
        logits = hf @ weight[v0: min(v0 + chunk, V_out)].float().T          # [T, chunk]
        idx = logits.argmax(dim=-1)                                         # first maximum in the chunk
        m = logits.gather(1, idx[:, None])[:, 0]
        take = m > best                                                     # earlier chunks win ties
        best_id = torch.where(take, idx + v0, best_id)
        best = torch.where(take, m, best)
    return best_id, best / mup


def check_lm_head(h, weight, vocab_out, mup) -> tuple[int, int, int]:
    """The arguments of `lm_head_argmax` (and `lm_head_rows.lm_head_rows`) checked, one clear
    ValueError naming the first bad one. Returns (T, H, V_out)."""
    check_tensor("h", h, dtypes=FLOAT_DTYPES)
    need(h.dim() == 2, f"h must be a tensor [T, H], got shape {tuple(h.shape)}")
    check_tensor("weight", weight, dtypes=h.dtype, device=h.device)
    need(weight.dim() == 2, f"weight must be a 2-D tensor [V, H] (the unembedding), got shape {tuple(weight.shape)}")
    check_kernel_device("h", h)
    T, H = h.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"weight has {weight.shape[1]} columns, h has H={H}: they must match")
    if not h.is_contiguous() or not weight.is_contiguous():
        raise ValueError(f"h and weight must be contiguous (h strides {h.stride()}, weight strides {weight.stride()})")
    V_out = V if vocab_out is None else vocab_out
    if not isinstance(V_out, int) or not 1 <= V_out <= V:
        raise ValueError(f"vocab_out must be an int in 1..{V} (the rows of weight), got {vocab_out!r}")
    if not isinstance(mup, (int, float)) or not math.isfinite(mup) or mup <= 0:
        raise ValueError(f"mup must be a finite number > 0, got {mup!r}")
    if H == 0:
        raise ValueError("h has H=0 columns: nothing to score")
    return T, H, V_out


def lm_head_buffers(h: torch.Tensor, V_out: int, ids_out: torch.Tensor | None, vals_out: torch.Tensor | None
                    ) -> tuple[torch.Tensor, ...]:
    """The results (ids int64 [T], vals float32 [T]: the given buffers checked, or new ones) and the
    partials a partial kernel writes, the maximum and its id per GROUP ids of each row (pmax float32,
    pidx int32, [T, ceil(V_out / GROUP)])."""
    T = h.shape[0]
    ids = out_tensor("ids_out", ids_out, (T,), torch.int64, h.device)
    vals = out_tensor("vals_out", vals_out, (T,), torch.float32, h.device)
    n_groups = triton.cdiv(V_out, GROUP)
    pmax = torch.empty(T, n_groups, dtype=torch.float32, device=h.device)
    pidx = torch.empty(T, n_groups, dtype=torch.int32, device=h.device)
    return ids, vals, pmax, pidx


def lm_head_argmax(h: torch.Tensor, weight: torch.Tensor, vocab_out: int | None = None,
                   mup: float = 1.0, ids_out: torch.Tensor | None = None,
                   vals_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h: contiguous [T, H]; weight: contiguous [V, H], same dtype (float32/float16/bfloat16) and
    device; vocab_out: the unpadded vocabulary V_out <= V (default V); mup > 0.
    Returns (ids int64 [T], vals float32 [T]): argmax and max of (h @ weight[:V_out]^T) / mup per row,
    ties to the lowest id; written into ids_out / vals_out when given (e.g. a CUDA graph's static
    buffers). Launches two kernels; no host synchronization."""
    T, H, V_out = check_lm_head(h, weight, vocab_out, mup)
    ids, vals, pmax, pidx = lm_head_buffers(h, V_out, ids_out, vals_out)
    if T == 0:
        return ids, vals
    n_groups = pmax.shape[1]
    BLOCK_T = min(MAX_BLOCK_T, max(16, triton.next_power_of_2(T)))
    interp = interpreting()
    meta = _INTERPRET_META if interp else launch_config(H, BLOCK_T, h.dtype)
    _lm_head_partial_kernel[(triton.cdiv(V_out, meta["BLOCK_V"]), triton.cdiv(T, BLOCK_T))](
        h, weight, pmax, pidx, T, H, V_out, n_groups, BLOCK_T=BLOCK_T, FP32_DOT=h.dtype == torch.float32 or interp,
        EVEN_K=H % meta["BLOCK_K"] == 0, **meta)
    reduce_partials(pmax, pidx, ids, vals, mup)
    return ids, vals
