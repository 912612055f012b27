"""The MoE layer at small token counts (decode, verify and draft windows: N = 1..256 tokens).

    out[t] = sum_{j < k} w[t, j] * Expert_{chosen[t, j]}(x[t]) + sum_{s < S} w[t, k + s] * Shared_s(x[t])
    Expert_e(x) = (silu(g) * u) @ W2_e^T,  [g; u] = x @ W13_e^T with INTERLEAVED rows (g0, u0, g1, u1, ...)

At these sizes the layer is bound by the bytes of the experts it touches: every touched expert's
W13 [2F, H] and W2 [H, F] must be read once, and nothing else is large. So the kernels work per
*distinct expert* and read each one's weights once for all of its tokens. With no host sync, the set
of touched experts is data dependent; it is built on the device:

  0. routing (moe_router.py): chosen [N, k] and weights [N, k + S].
  1. align (one program): the pairs p = t * (k + S) + j (token t, slot j; slots k.. are the shared
     experts, ids R..R+S-1, "chosen" by every token) are grouped by expert: per-expert counts, a
     compact list of touched experts ("slots", in id order, with their first row and count), and
     each pair's row in the expert-sorted order.
  2. up: program (slot, F-tile) streams the gate and up rows of its expert's W13 tile once and
     multiplies them with the x rows of the expert's tokens (BLOCK_M = 16 at a time; an expert with
     more tokens loops, re-reading its tile from L2): act[row] = silu(g) * u (float32 math, stored in
     x's dtype) for the rows of the sorted order. The grid covers the largest possible number of
     touched experts, min(R, N * k) + S; programs past the actual count exit at once.
  3. down: program (slot, H-tile) streams W2's rows once: pair_out[p] = w[p] * act[row] @ W2_e^T
     (float32), each pair written to its own row (no atomics: deterministic).
  4. combine: out[t] = sum over its k + S pair rows (float32), stored in x's dtype.

Shared experts are treated exactly as routed ones (always-selected experts with their own weight
tensors). Correct for any routing: collisions (many tokens on one expert) only lengthen one
program's loop. Routed ids must lie in 0..R-1 (`moe_route` guarantees it; ids passed to
`moe_experts` are clamped into range for memory safety, not validated: that would need a host sync).

Launch configuration (`launch_config`, a rule on H and the dtype; no autotuning): the weight tiles
the experts are streamed in are fixed per model width and dtype, and the token count N (like P = N *
(k + S)) is a runtime value, so each kernel compiles once per model (the align step twice at most:
one pair tile for up to 32 pairs, a wider one above).

Copy with it: common.py, moe_router.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import (INDEX_DTYPES, check_tensor, interpreting, k_loop, k_loop_pair, need, out_tensor, pipeline_stages,
                     round_to)
from .moe_router import check_x, moe_route, moe_route_torch

MAX_TOKENS = 256      # the align step is one program comparing all pairs: meant for small N
BLOCK_M = 16          # token rows per dot (the smallest tl.dot tile)


@triton.jit
def pair_expert(chosen_ptr, p, P, R, TOP_K, KS, E):
    """Expert id of pair p = t * KS + j: chosen[t, j] (clamped into 0..R-1) for j < k, the shared
    expert R + j - k after; E (no expert) for p >= P."""
    t = p // KS
    j = p % KS
    ok = p < P
    routed = j < TOP_K
    c = tl.load(chosen_ptr + t * TOP_K + j, mask=ok & routed, other=0).to(tl.int32)
    c = tl.minimum(tl.maximum(c, 0), R - 1)
    return tl.where(ok, tl.where(routed, c, R + j - TOP_K), E)


@triton.jit(do_not_specialize=["P"])
def _moe_align_kernel(chosen_ptr, sorted_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr, num_slots_ptr,
                      P, R, TOP_K, KS, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    ar_p = tl.arange(0, BLOCK_P)
    ar_e = tl.arange(0, BLOCK_E)
    # touched experts, in id order: slot -> (expert, first row in the sorted order, token count)
    n_slots = tl.zeros([], tl.int32)
    n_rows = tl.zeros([], tl.int32)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + ar_e
        cnt = tl.zeros([BLOCK_E], tl.int32)
        for p0 in range(0, P, BLOCK_P):
            ep = pair_expert(chosen_ptr, p0 + ar_p, P, R, TOP_K, KS, E)
            cnt += tl.sum((ep[None, :] == e[:, None]).to(tl.int32), axis=1)
        cnt = tl.where(e < E, cnt, 0)
        touched = cnt > 0
        ti = touched.to(tl.int32)
        slot = n_slots + tl.cumsum(ti, axis=0) - ti
        tl.store(slot_expert_ptr + slot, e, mask=touched)
        tl.store(slot_start_ptr + slot, n_rows + tl.cumsum(cnt, axis=0) - cnt, mask=touched)
        tl.store(slot_count_ptr + slot, cnt, mask=touched)
        n_slots += tl.sum(ti, axis=0)
        n_rows += tl.sum(cnt, axis=0)
    tl.store(num_slots_ptr, n_slots)
    # each pair's row: pairs of lower experts, then the same expert's pairs of lower index
    for p0 in range(0, P, BLOCK_P):
        p = p0 + ar_p
        ep = pair_expert(chosen_ptr, p, P, R, TOP_K, KS, E)
        row = tl.zeros([BLOCK_P], tl.int32)
        for q0 in range(0, P, BLOCK_P):
            q = q0 + ar_p
            eq = pair_expert(chosen_ptr, q, P, R, TOP_K, KS, E)
            before = (eq[None, :] < ep[:, None]) | ((eq[None, :] == ep[:, None]) & (q[None, :] < p[:, None]))
            row += tl.sum(before.to(tl.int32), axis=1)
        tl.store(sorted_ptr + row, p, mask=p < P)


@triton.jit
def _slot_expert(slot, slot_expert_ptr, slot_start_ptr, slot_count_ptr, w_ptr, shared_w_ptr, R, expert_numel):
    """Slot `slot`'s expert: its first row in the expert-sorted order, its row count, and the base of
    its weights (routed experts, ids < R, in w_ptr; shared ones, ids R.., in shared_w_ptr)."""
    e = tl.load(slot_expert_ptr + slot)
    start = tl.load(slot_start_ptr + slot)
    cnt = tl.load(slot_count_ptr + slot)
    if e < R:
        w_base = w_ptr + e.to(tl.int64) * expert_numel
    else:
        w_base = shared_w_ptr + (e - R).to(tl.int64) * expert_numel
    return start, cnt, w_base


@triton.jit
def _moe_up_kernel(x_ptr, w13_ptr, sw13_ptr, sorted_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                   num_slots_ptr, act_ptr, H, F, R, KS,
                   BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr,
                   FP32_DOT: tl.constexpr, FIX_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    slot = tl.program_id(0)
    if slot >= tl.load(num_slots_ptr):
        return
    start, cnt, w_base = _slot_expert(slot, slot_expert_ptr, slot_start_ptr, slot_count_ptr, w13_ptr, sw13_ptr, R,
                                      2 * F * H)
    f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_ok = f < F
    kk = tl.arange(0, BLOCK_K)
    mm = tl.arange(0, BLOCK_M)
    g_ptrs = w_base + (2 * f)[:, None].to(tl.int64) * H + kk[None, :]      # gate rows 2f   [BLOCK_F, BLOCK_K]
    u_ptrs = g_ptrs + H                                                   # up rows 2f + 1
    for m0 in range(0, cnt, BLOCK_M):
        r_ok = (m0 + mm) < cnt
        rows = start + m0 + mm
        tok = tl.load(sorted_ptr + rows, mask=r_ok, other=0) // KS
        x_ptrs = x_ptr + tok[None, :].to(tl.int64) * H + kk[:, None]       # x^T of the tokens [BLOCK_K, BLOCK_M]
        acc_g = tl.zeros([BLOCK_F, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_F, BLOCK_M], dtype=tl.float32)
        acc_g, acc_u = k_loop_pair(acc_g, acc_u, g_ptrs, u_ptrs, x_ptrs, f_ok, r_ok, kk, H, BLOCK_K, EVEN_K, FP32_DOT)
        act = acc_g * tl.sigmoid(acc_g) * acc_u                               # silu(g) * u
        tl.store(act_ptr + rows[None, :].to(tl.int64) * F + f[:, None],
                 round_to(act, act_ptr.dtype.element_ty, FIX_BF16), mask=f_ok[:, None] & r_ok[None, :])


@triton.jit
def store_weighted_pairs(acc, pair, r_ok, h, h_ok, weights_ptr, pair_out_ptr, H):
    """pair_out[pair, h] = weights[pair] * acc[h, pair's column]: a tile of the down projection
    (acc [BLOCK_H, BLOCK_M], one column per (token, expert) pair) scaled by each pair's routing weight
    and written to the pair's own row, for the combine kernel to sum per token."""
    wt = tl.load(weights_ptr + pair, mask=r_ok, other=0.0)
    tl.store(pair_out_ptr + pair[None, :].to(tl.int64) * H + h[:, None], acc * wt[None, :],
             mask=h_ok[:, None] & r_ok[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w2_ptr, sw2_ptr, sorted_ptr, slot_expert_ptr, slot_start_ptr, slot_count_ptr,
                     num_slots_ptr, weights_ptr, pair_out_ptr, H, F, R,
                     BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    slot = tl.program_id(0)
    if slot >= tl.load(num_slots_ptr):
        return
    start, cnt, w_base = _slot_expert(slot, slot_expert_ptr, slot_start_ptr, slot_count_ptr, w2_ptr, sw2_ptr, R,
                                      H * F)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    kk = tl.arange(0, BLOCK_K)
    mm = tl.arange(0, BLOCK_M)
    w_ptrs = w_base + h[:, None].to(tl.int64) * F + kk[None, :]              # [BLOCK_H, BLOCK_K]
    for m0 in range(0, cnt, BLOCK_M):
        r_ok = (m0 + mm) < cnt
        rows = start + m0 + mm
        pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
        a_ptrs = act_ptr + rows[None, :].to(tl.int64) * F + kk[:, None]      # act^T [BLOCK_K, BLOCK_M]
        acc = k_loop(tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32), w_ptrs, a_ptrs, h_ok, r_ok, kk, F, BLOCK_K,
                     EVEN_K, FP32_DOT)
        store_weighted_pairs(acc, pair, r_ok, h, h_ok, weights_ptr, pair_out_ptr, H)


@triton.jit
def _moe_combine_kernel(pair_out_ptr, y_ptr, H, KS, BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr,
                        FIX_BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_J)
    h_ok = h < H
    v = tl.load(pair_out_ptr + (t * KS + j)[:, None] * H + h[None, :], mask=(j < KS)[:, None] & h_ok[None, :],
                other=0.0)
    tl.store(y_ptr + t * H + h, round_to(tl.sum(v, axis=0), y_ptr.dtype.element_ty, FIX_BF16), mask=h_ok)


_UP_INTERPRET = dict(BLOCK_F=16, BLOCK_K=32, num_warps=4)     # small tiles: tests span several
_DOWN_INTERPRET = dict(BLOCK_H=16, BLOCK_K=16, num_warps=4)


def launch_config(H: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(up, down) launch parameters for a layer of width H in `dtype`. bf16/fp16: the up step streams
    64 gate + 64 up rows of W13 x 128 of H per program, the down step 128 rows of W2 x 128 of F, 4 warps,
    4 stages; at H <= 1024 (small models, few programs per expert) half as many rows. float32 (exact
    products on the FMA units): 32 and 64 rows x 64, 2 stages. Stages are capped so that the weight and
    token tiles of every stage fit shared memory."""
    if dtype == torch.float32:
        (block_f, k_up), (block_h, k_down), stages = (32, 64), (64, 64), 2
    elif H <= 1024:
        (block_f, k_up), (block_h, k_down), stages = (32, 128), (64, 128), 4
    else:
        (block_f, k_up), (block_h, k_down), stages = (64, 128), (128, 128), 4
    size = torch.finfo(dtype).bits // 8
    up = dict(BLOCK_F=block_f, BLOCK_K=k_up, num_warps=4,
              num_stages=pipeline_stages(stages, (2 * block_f + BLOCK_M) * k_up * size))
    down = dict(BLOCK_H=block_h, BLOCK_K=k_down, num_warps=4,
                num_stages=pipeline_stages(stages, (block_h + BLOCK_M) * k_down * size))
    return up, down


# ----------------------------------------------------------------------------- twins
def swiglu_expert_torch(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert in x's dtype: x [N, H], gate_up [2F, H] with gate and up rows interleaved
    (g0, u0, g1, u1, ...), down [H, F] -> down @ (silu(g) * u): [N, H]."""
    gu = F.linear(x, gate_up)
    return F.linear(F.silu(gu[:, 0::2]) * gu[:, 1::2], down)


def moe_experts_torch(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, shared_w13: torch.Tensor | None, shared_w2: torch.Tensor | None
                      ) -> torch.Tensor:
    """The twin, a straightforward grouped implementation: one pass per touched expert over its tokens
    (swiglu_expert_torch, in x's dtype), weighted sum in float32 (float64 for float64 x).
    x [N, H] -> [N, H] in x's dtype."""
    N, H = x.shape
    K = chosen.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(N, H, dtype=acc, device=x.device)
    for e in torch.unique(chosen).tolist():                 # host sync: fine for the twin
        tok, slot = torch.where(chosen == e)
        y = swiglu_expert_torch(x[tok], w13[e], w2[e])
        out.index_add_(0, tok, y.to(acc) * weights[tok, slot, None].to(acc))
    S = 0 if shared_w13 is None else shared_w13.shape[0]
    for s in range(S):
        out += swiglu_expert_torch(x, shared_w13[s], shared_w2[s]).to(acc) * weights[:, K + s, None].to(acc)
    return out.to(x.dtype)


def moe_torch(x, router_weight, router_bias, gate_global_scale, route_scale, top_k, w13, w2,
              shared_w13=None, shared_w2=None) -> torch.Tensor:
    """The twin of `moe`: moe_route_torch, then moe_experts_torch."""
    chosen, weights = moe_route_torch(x, router_weight, router_bias, gate_global_scale, route_scale, top_k)
    return moe_experts_torch(x, chosen, weights, w13, w2, shared_w13, shared_w2)


# ----------------------------------------------------------------------------- wrappers
def check_experts(x, chosen, weights, w13, w2, shared_w13, shared_w2) -> tuple[int, int, int, int]:
    """The expert arguments of `moe_experts` (and `moe_grouped.moe_grouped_experts`) checked, one
    clear ValueError naming the first bad one. Returns (R, F, S, k)."""
    check_x(x)
    N, H = x.shape
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[1] % 2 != 0:
        raise ValueError("w13 must be a tensor [R, 2F, H] (gate and up rows interleaved)")
    R, F = w13.shape[0], w13.shape[1] // 2
    check_tensor("w13", w13, (R, 2 * F, H), x.dtype, x.device, contiguous=True)
    check_tensor("w2", w2, (R, H, F), x.dtype, x.device, contiguous=True)
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared_w13 and shared_w2 must be given together (or both None for no shared experts)")
    S = 0
    if shared_w13 is not None:
        if not isinstance(shared_w13, torch.Tensor) or shared_w13.dim() != 3:
            raise ValueError(f"shared_w13 must be a tensor [S, {2 * F}, {H}]")
        S = shared_w13.shape[0]
        check_tensor("shared_w13", shared_w13, (S, 2 * F, H), x.dtype, x.device, contiguous=True)
        check_tensor("shared_w2", shared_w2, (S, H, F), x.dtype, x.device, contiguous=True)
    check_tensor("chosen", chosen, dtypes=INDEX_DTYPES, device=x.device, contiguous=True)
    need(chosen.dim() == 2 and chosen.shape[0] == N and 1 <= chosen.shape[1] <= R,
         f"chosen must be a tensor [{N}, k] with 1 <= k <= R = {R}, got {tuple(chosen.shape)}")
    K = chosen.shape[1]
    check_tensor("weights", weights, (N, K + S), torch.float32, x.device, contiguous=True)
    return R, F, S, K


def check_router_rows(router_weight, router_bias, route_scale, shared_w13) -> None:
    """The layer's arguments that `moe_route` cannot check alone: route_scale a finite number, and
    router_weight's rows = R (router_bias) + S (shared_w13) when both are tensors of the right rank."""
    if not isinstance(route_scale, (int, float)) or not math.isfinite(route_scale):
        raise ValueError(f"route_scale must be a finite number, got {route_scale!r}")
    S = shared_w13.shape[0] if isinstance(shared_w13, torch.Tensor) else 0
    if isinstance(router_weight, torch.Tensor) and isinstance(router_bias, torch.Tensor) \
            and router_weight.dim() == 2 and router_bias.dim() == 1 \
            and router_weight.shape[0] != router_bias.shape[0] + S:
        raise ValueError(f"router_weight has {router_weight.shape[0]} rows; router_bias has R = "
                         f"{router_bias.shape[0]} and shared_w13 S = {S}: they must add up (R + S rows)")


def moe_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x: contiguous [N, H], N <= 256; chosen: int [N, k] routed ids in 0..R-1; weights: float32
    [N, k + S] (chosen first, then shared); w13: [R, 2F, H] (interleaved rows); w2: [R, H, F];
    shared_w13: [S, 2F, H], shared_w2: [S, H, F] (or None for S = 0); expert tensors in x's dtype.
    Returns [N, H] in x's dtype (into `out` when given). Four launches (align, up, down, combine), no host sync."""
    check_x(x)
    N, H = x.shape
    if N > MAX_TOKENS:
        raise ValueError(f"x has N={N} tokens: this small-batch MoE handles at most {MAX_TOKENS} "
                         "(its grouping step compares all token-expert pairs in one program)")
    R, F, S, K = check_experts(x, chosen, weights, w13, w2, shared_w13, shared_w2)
    out = out_tensor("out", out, (N, H), x.dtype, x.device)
    if N == 0:
        return out
    KS, E = K + S, R + S
    P = N * KS
    max_slots = min(R, N * K) + S
    dev = x.device
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=dev)
    # expert, first row, count per slot; rows padded to 16 bytes, so that each row's pointer has the
    # same alignment whatever N (Triton specializes a kernel on its pointers' 16-byte alignment)
    slot_info = torch.empty(3, triton.cdiv(max_slots, 4) * 4, dtype=torch.int32, device=dev)
    num_slots = torch.empty(1, dtype=torch.int32, device=dev)
    act = torch.empty(P, F, dtype=x.dtype, device=dev)
    pair_out = torch.empty(P, H, dtype=torch.float32, device=dev)
    _moe_align_kernel[(1,)](chosen, sorted_pairs, slot_info[0], slot_info[1], slot_info[2], num_slots,
                            P, R, K, KS, E, BLOCK_P=32 if P <= 32 else 128, BLOCK_E=128, num_warps=8)
    interp = interpreting()
    fp32_dot = x.dtype == torch.float32 or interp
    up, down = (_UP_INTERPRET, _DOWN_INTERPRET) if interp else launch_config(H, x.dtype)
    common = (sorted_pairs, slot_info[0], slot_info[1], slot_info[2], num_slots)
    _moe_up_kernel[(max_slots, triton.cdiv(F, up["BLOCK_F"]))](
        x, w13, shared_w13 if S else w13, *common, act, H, F, R, KS,
        BLOCK_M=BLOCK_M, FP32_DOT=fp32_dot, FIX_BF16=interp, EVEN_K=H % up["BLOCK_K"] == 0, **up)
    _moe_down_kernel[(max_slots, triton.cdiv(H, down["BLOCK_H"]))](
        act, w2, shared_w2 if S else w2, *common, weights, pair_out, H, F, R,
        BLOCK_M=BLOCK_M, FP32_DOT=fp32_dot, EVEN_K=F % down["BLOCK_K"] == 0, **down)
    BLOCK_H = 256
    _moe_combine_kernel[(N, triton.cdiv(H, BLOCK_H))](pair_out, out, H, KS, BLOCK_J=triton.next_power_of_2(KS),
                                                       BLOCK_H=BLOCK_H, FIX_BF16=interp, num_warps=4)
    return out


def moe(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, gate_global_scale: torch.Tensor,
        route_scale: float, top_k: int, w13: torch.Tensor, w2: torch.Tensor, shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE layer (inkling_ref/model/moe.py, MoE.forward) for x [N, H], N <= 256: `moe_route`, then
    `moe_experts`. router_weight [R + S, H], router_bias [R], gate_global_scale [1] (on the device),
    route_scale (float), top_k, expert weights as in `moe_experts`. Six launches, no host sync."""
    check_router_rows(router_weight, router_bias, route_scale, shared_w13)
    chosen, weights = moe_route(x, router_weight, router_bias, gate_global_scale, route_scale, top_k)
    return moe_experts(x, chosen, weights, w13, w2, shared_w13, shared_w2, out=out)
