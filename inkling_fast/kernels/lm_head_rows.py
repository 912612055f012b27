"""Greedy token selection from the LM head for many rows (verify passes at large batch, e.g.
64 sequences x 9 rows = 576; the last rows of a batched prefill), without writing the logits:

    ids[t]  = argmax_{v < V_out} h[t] . W[v]      float32 dot products; ties to the LOWEST id
    vals[t] = max_{v < V_out} h[t] . W[v] / mup   (float32)

The contract of `lm_head_argmax` (same arguments, same results up to the summation order inside the
float32 dot products), built for T in the hundreds. `lm_head_argmax` streams all of W once per
block of 64 rows, which is the floor for a few rows and nine passes over W (1.6 GB at
Inkling-Small) at 576. Here the work is what it is at that size, a GEMM [T, H] x [H, V_out] bound
by its arithmetic, and the kernel is the Triton matmul tutorial's with the argmax in the epilogue
where the tutorial stores C:

  1. partial: a 1-D grid over (T-tile, V-tile) pairs, the T-tiles of one V-tile consecutive, so
     the programs that run at the same time share a few W tiles: W is read from memory once (the
     other T-tiles of a V-tile find its tile in L2), and h ([T, H], a few MB) stays in L2.
     Program (i, j): acc[BLOCK_T, BLOCK_V] = h_tile [BLOCK_T, BLOCK_K] @ W_tile^T [BLOCK_K, BLOCK_V]
     accumulated over H in float32 (tensor cores for bf16/fp16, exact float32 products otherwise),
     then, for each group of GROUP = 64 ids of the tile, the maximum and the lowest id reaching it:
     partials [T, cdiv(V_out, 64)], the format of `lm_head_argmax`'s first pass.
  2. reduce: `lm_head_argmax`'s reduce kernel (one program per row scans the partials in id order
     and keeps the first maximum), so ties are broken the same way by construction.

Masks: rows t >= T load zeros and store nothing; ids v >= V_out (W's padding rows and the tail of
the last tile) score -inf and never win; the K loop masks H's tail when H % BLOCK_K != 0.

Why not GEMM + argmax: cuBLAS writes the logits and argmax reads them back. In bf16 that is cheap,
but bf16 logits are rounded to 8 significant bits and their ties are no longer the float32 ties
(the argmax then differs from `lm_head_argmax` at near ties: a result that depends on the batch
size); in float32 it is exact but writes and reads 4 * T * V_out bytes more than this kernel.

The tiles follow from the row count and the dtype by a rule (`launch_config`; no autotuning), and T
itself is a runtime value: the kernel compiles once per tile shape (two for bf16).

Copy with it: common.py, lm_head_argmax.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting, k_loop, pipeline_stages
from .lm_head_argmax import INT32_MAX, check_lm_head, lm_head_argmax_torch, lm_head_buffers, reduce_partials

lm_head_rows_torch = lm_head_argmax_torch   # the twin: float32 logits a chunk of ids at a time, first maximum


@triton.jit(do_not_specialize=["T"])
def _lm_head_rows_kernel(h_ptr, w_ptr, pmax_ptr, pidx_ptr, T, H, V_out, n_groups,
                         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    G: tl.constexpr = BLOCK_V // 64                                      # groups of GROUP = 64 ids per tile
    n_t = tl.cdiv(T, BLOCK_T)
    pid_t = tl.program_id(0) % n_t                                       # T-tiles of one V-tile run together
    pid_v = tl.program_id(0) // n_t
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)                          # token rows
    v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)                          # vocabulary ids
    kk = tl.arange(0, BLOCK_K)
    t_ok = t < T
    v_ok = v < V_out
    h_ptrs = h_ptr + t[:, None].to(tl.int64) * H + kk[None, :]          # h tile      [BLOCK_T, BLOCK_K]
    w_ptrs = w_ptr + v[None, :].to(tl.int64) * H + kk[:, None]          # W tile^T    [BLOCK_K, BLOCK_V]
    acc = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)
    acc = k_loop(acc, h_ptrs, w_ptrs, t_ok, v_ok, kk, H, BLOCK_K, EVEN_K, FP32_DOT)
    # epilogue: per group of 64 ids, the maximum and the lowest id reaching it (ids >= V_out never win)
    scores = tl.where(v_ok[None, :], acc, float("-inf"))
    scores = tl.reshape(scores, [BLOCK_T, G, 64])
    ids = tl.reshape(v, [G, 64])[None, :, :]
    m = tl.max(scores, axis=2)                                           # [BLOCK_T, G]
    idx = tl.min(tl.where(scores == m[:, :, None], ids, INT32_MAX), axis=2)
    idx = tl.minimum(idx, V_out - 1)  # a NaN logit matches nothing: keep the id in range regardless
    grp = pid_v * G + tl.arange(0, G)
    offs = t[:, None] * n_groups + grp[None, :]                          # partials are [T, n_groups]
    ok = t_ok[:, None] & (grp < n_groups)[None, :]
    tl.store(pmax_ptr + offs, m, mask=ok)
    tl.store(pidx_ptr + offs, idx, mask=ok)


_INTERPRET_META = dict(BLOCK_T=32, BLOCK_V=64, BLOCK_K=32, num_warps=4)   # small tiles: tests span several


def launch_config(T: int, dtype: torch.dtype) -> dict:
    """BLOCK_T, BLOCK_V, BLOCK_K, num_warps, num_stages for T rows of `dtype`: bf16/fp16 the matmul
    tutorial's tiles, 128 rows x 256 ids x 64 of H, 8 warps, 3 stages (64 rows, 4 warps, 4 stages below
    256 rows, where 128-row tiles would be mostly padding); float32 (exact products on the FMA units)
    32 x 64 x 32, 4 warps, 2 stages. Stages are capped so that every stage's tiles fit shared memory."""
    if dtype == torch.float32:
        block_t, block_v, block_k, warps, stages = 32, 64, 32, 4, 2
    elif T >= 256:
        block_t, block_v, block_k, warps, stages = 128, 256, 64, 8, 3
    else:
        block_t, block_v, block_k, warps, stages = 64, 256, 64, 4, 4
    nbytes = (block_t + block_v) * block_k * torch.finfo(dtype).bits // 8
    return dict(BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=warps,
                num_stages=pipeline_stages(stages, nbytes))


def lm_head_rows(h: torch.Tensor, weight: torch.Tensor, vocab_out: int | None = None, mup: float = 1.0,
                 ids_out: torch.Tensor | None = None, vals_out: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`lm_head_argmax`'s arguments and results, tiled for many rows: h contiguous [T, H]; weight
    contiguous [V, H] of h's dtype and device; vocab_out V_out <= V (default V); mup > 0. Returns
    (ids int64 [T], vals float32 [T]), into ids_out / vals_out when given. Two launches, no host sync."""
    T, H, V_out = check_lm_head(h, weight, vocab_out, mup)
    ids, vals, pmax, pidx = lm_head_buffers(h, V_out, ids_out, vals_out)
    if T == 0:
        return ids, vals
    n_groups = pmax.shape[1]
    interp = interpreting()
    meta = _INTERPRET_META if interp else launch_config(T, h.dtype)
    _lm_head_rows_kernel[(triton.cdiv(T, meta["BLOCK_T"]) * triton.cdiv(V_out, meta["BLOCK_V"]),)](
        h, weight, pmax, pidx, T, H, V_out, n_groups, FP32_DOT=h.dtype == torch.float32 or interp,
        EVEN_K=H % meta["BLOCK_K"] == 0, **meta)
    reduce_partials(pmax, pidx, ids, vals, mup)
    return ids, vals
