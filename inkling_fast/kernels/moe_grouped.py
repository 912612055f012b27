"""The MoE layer for many tokens (prefill chunks, verify passes at large batch): a grouped GEMM over
the (token, expert) pairs sorted by expert. Any number of tokens.

    out[t] = sum_{j < k} w[t, j] * Expert_{chosen[t, j]}(x[t]) + sum_{s < S} w[t, k + s] * Shared_s(x[t])
    Expert_e(x) = (silu(g) * u) @ W2_e^T,  [g; u] = x @ W13_e^T with INTERLEAVED rows (g0, u0, g1, u1, ...)

The layer of `moe.py`, with its router (`moe_route`: the same top-k, selection bias and weights; the
gate's global scale and route_scale are inside the weights w) and its arithmetic: dot products
accumulated in float32, act = silu(g) * u computed in float32 and rounded once to x's dtype, each
pair's w * (act @ W2_e^T) in float32, the k + S pair outputs of a token summed in float32 and rounded
once to x's dtype. Only the summation orders inside the dots differ (the tiles).

Why sort by expert
------------------
`moe.py` gives each touched expert one program that loops over that expert's tokens 16 at a time:
right for a few tokens, where every expert has one or two. With hundreds of tokens every expert has
dozens, the shared experts have all N, and one program per expert leaves the GPU idle while it loops.
Sorting the P = N * (k + S) pairs by expert turns the layer into one GEMM per expert over the rows of
its own tokens (a *grouped* GEMM), tiled like the Triton matmul tutorial: the rows of the sorted
order are cut into tiles of BLOCK_M rows that each belong to a single expert, and program (m, n)
multiplies tile m's token rows with the n-th tile of that expert's weights. Each expert's weights
are read once per tile of tokens, from memory once (the launch order below keeps the tiles of one
expert together, so the others find the weight tile in L2), by tensor-core dots. Shared experts are
experts too: ids R..R+S-1, chosen by every token (slots k..k+S-1 of each token's pairs).

The steps (eight launches, no host synchronization, every shape a function of N, k, S and R only, so
the whole layer can be captured in a CUDA graph):

  0. route (moe_router.py): chosen [N, k] int32, weights [N, k + S] float32.
  1. count: program b looks at the pairs p = t * (k + S) + j of block b (SORT_BLOCK of them) and
     writes how many belong to each expert: hist[e, b].
  2. plan (one program, all E = R + S experts as one vector): per expert, the exclusive prefix of
     hist over the blocks and its count c_e; each expert gets ceil(c_e / BLOCK_M) whole tiles of
     the sorted order (an empty expert none), starting at row_start[e] (the padded counts of the
     lower ids summed); row_end[e] = row_start[e] + c_e. Then every tile m gets its expert:
     tile_expert[m] = the number of experts whose padded rows end at or before row m * BLOCK_M.
     Empty experts are skipped by that count; tiles past the last expert get E ("nothing to do").
  3. scatter: program b writes each of its pairs p (expert e) to row
     row_start[e] + prefix[e, b] + (pairs of e before p in block b): sorted[row] = p. A stable
     counting sort: within an expert the pairs keep their order, so the layout is deterministic.
  4. up: program (m, n) of a 1-D grid over tiles x F-tiles computes, for the BLOCK_M rows of tile m
     (pairs of expert e = tile_expert[m]), g and u of BLOCK_N columns over H, and stores
     act = silu(g) * u (float32 math, rounded to x's dtype) at those rows of the sorted order.
  5. down: program (m, n) over tiles x H-tiles: pair_out[p] = w[p] * (act[row] @ W2_e^T) in float32,
     each pair to its own row p (no atomics).
  6. combine: out[t] = pair_out[t * (k+S)] + pair_out[t * (k+S) + 1] + ... in this order (float32),
     rounded to x's dtype. Deterministic: the result does not depend on any scheduling.

Static sizes: expert e takes ceil(c_e / BLOCK_M) * BLOCK_M <= c_e + BLOCK_M - 1 rows, and at most
D = min(R, N * k) + S experts are touched, so n_tiles = cdiv(P + D * (BLOCK_M - 1), BLOCK_M) tiles
always hold the sorted order; the grids of steps 4 and 5 cover all n_tiles, and the tiles past the
end (tile_expert = E) return at once. Scratch per call: act [n_tiles * BLOCK_M, F] in x's dtype and
pair_out [P, H] float32 (4 * N * (k + S) * H bytes: 1 GiB for 7680 tokens at Inkling-Small's width).

Masks: a tile's rows at or past row_end[e] (its expert's padding) are neither read (their pair
index, x row and act row load as 0) nor written; F- and H-tiles past F and H are masked; K loops
over H (up) and F (down) mask the tail when the width is not a multiple of BLOCK_K.

Program layout of the GEMMs: the weight tile is the wide operand and the tokens the narrow one,
acc[BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K, BLOCK_M], so the MMA's wide
side is always >= 64 weight rows while BLOCK_M follows the tokens per expert (16 for a dozen, up to
128). The 1-D grid is walked in the tutorial's grouped ordering: program ids run through GROUP_M
consecutive tiles for column tile n = 0, then the same tiles for n = 1, and so on. The tiles of one
expert are consecutive in the sorted order, so the programs in flight together read each weight
tile of that expert from memory once, and the token rows of the group stay in L2 across its n.

BLOCK_M is chosen from the expected tokens per routed expert, N * k / R (at least 16, at most 128;
the sorted order depends on it). The other tiles follow from H, BLOCK_M and the dtype
(`launch_config`; no autotuning), and the sizes that change with N (pairs, blocks, tiles, tokens) are
runtime values: the kernels compile once per BLOCK_M the calls need.

Copy with it: common.py, moe.py, moe_router.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from .common import interpreting, k_loop, k_loop_pair, out_tensor, pipeline_stages, round_to
from .moe import check_experts, check_router_rows, pair_expert, store_weighted_pairs
from .moe_router import moe_route, moe_route_torch

SORT_BLOCK = 128      # pairs per program of the count and scatter steps
MAX_EXPERTS = 4096    # the plan step holds all R + S experts in one program's registers


def block_m_for(N: int, top_k: int, R: int) -> int:
    """Token rows per tile: the expected pairs of a routed expert, N * k / R, as a power of two in 16..128."""
    return min(128, max(16, triton.next_power_of_2(triton.cdiv(N * top_k, R))))


# ----------------------------------------------------------------------------- sort by expert
@triton.jit(do_not_specialize=["P", "n_blocks"])
def _count_kernel(chosen_ptr, hist_ptr, P, R, TOP_K, KS, E, n_blocks,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    p = b * BLOCK_P + tl.arange(0, BLOCK_P)
    ep = pair_expert(chosen_ptr, p, P, R, TOP_K, KS, E)                 # E (no expert) for p >= P
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        cnt = tl.sum((ep[:, None] == e[None, :]).to(tl.int32), axis=0)
        tl.store(hist_ptr + e * n_blocks + b, cnt, mask=e < E)


@triton.jit(do_not_specialize=["n_blocks", "n_tiles"])
def _plan_kernel(hist_ptr, prefix_ptr, row_start_ptr, row_end_ptr, tile_expert_ptr, E, n_blocks, n_tiles,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    e = tl.arange(0, BLOCK_E)                                            # every expert (BLOCK_E >= E)
    e_ok = e < E
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):                               # prefix over the pair blocks
        b = b0 + tl.arange(0, BLOCK_B)
        offs = e[:, None] * n_blocks + b[None, :]
        ok = e_ok[:, None] & (b < n_blocks)[None, :]
        h = tl.load(hist_ptr + offs, mask=ok, other=0)
        tl.store(prefix_ptr + offs, count[:, None] + tl.cumsum(h, axis=1) - h, mask=ok)
        count += tl.sum(h, axis=1)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M                  # whole tiles per expert
    pad_end = tl.cumsum(padded, axis=0)
    start = pad_end - padded
    tl.store(row_start_ptr + e, start, mask=e_ok)
    tl.store(row_end_ptr + e, start + count, mask=e_ok)
    pad_end = tl.where(e_ok, pad_end, 2**30)                             # lanes >= E never end before a tile
    for t0 in range(0, n_tiles, BLOCK_T):                                # tile -> expert
        t = t0 + tl.arange(0, BLOCK_T)
        first = t * BLOCK_M
        expert = tl.sum((pad_end[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + t, expert, mask=t < n_tiles)


@triton.jit(do_not_specialize=["P", "n_blocks"])
def _scatter_kernel(chosen_ptr, prefix_ptr, row_start_ptr, sorted_ptr, P, R, TOP_K, KS, E, n_blocks,
                    BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    p = b * BLOCK_P + tl.arange(0, BLOCK_P)
    ok = p < P
    ep = pair_expert(chosen_ptr, p, P, R, TOP_K, KS, E)
    before = (ep[None, :] == ep[:, None]) & (p[None, :] < p[:, None])    # same expert, earlier in the block
    rank = tl.sum(before.to(tl.int32), axis=1)
    row = tl.load(row_start_ptr + ep, mask=ok, other=0) + tl.load(prefix_ptr + ep * n_blocks + b, mask=ok, other=0)
    tl.store(sorted_ptr + row + rank, p, mask=ok)


# ----------------------------------------------------------------------------- grouped GEMMs
@triton.jit
def _tile_order(pid, n_m, n_n, GROUP_M: tl.constexpr):
    """The tutorial's grouped ordering: program pid -> (tile m, column tile n), GROUP_M tiles at a time,
    m fastest, so the programs that run together share column tile n (one expert's weight tile)."""
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["n_tiles"])
def _grouped_up_kernel(x_ptr, w13_ptr, sw13_ptr, sorted_ptr, tile_expert_ptr, row_end_ptr, act_ptr,
                       H, F, R, E, KS, n_tiles,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       FP32_DOT: tl.constexpr, FIX_BF16: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_order(tl.program_id(0), n_tiles, tl.cdiv(F, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= E:                                                           # past the last expert's tiles
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                       # rows of the sorted order
    r_ok = rows < tl.load(row_end_ptr + e)
    tok = tl.load(sorted_ptr + rows, mask=r_ok, other=0) // KS
    if e < R:
        w_base = w13_ptr + e.to(tl.int64) * (2 * F * H)
    else:
        w_base = sw13_ptr + (e - R).to(tl.int64) * (2 * F * H)
    f = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    f_ok = f < F
    kk = tl.arange(0, BLOCK_K)
    g_ptrs = w_base + (2 * f)[:, None].to(tl.int64) * H + kk[None, :]   # gate rows 2f   [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + H                                                 # up rows 2f + 1
    x_ptrs = x_ptr + tok[None, :].to(tl.int64) * H + kk[:, None]         # x^T of the tile's tokens [BLOCK_K, BLOCK_M]
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_g, acc_u = k_loop_pair(acc_g, acc_u, g_ptrs, u_ptrs, x_ptrs, f_ok, r_ok, kk, H, BLOCK_K, EVEN_K, FP32_DOT)
    act = acc_g * tl.sigmoid(acc_g) * acc_u                              # silu(g) * u, float32
    tl.store(act_ptr + rows[None, :].to(tl.int64) * F + f[:, None],
             round_to(act, act_ptr.dtype.element_ty, FIX_BF16), mask=f_ok[:, None] & r_ok[None, :])


@triton.jit(do_not_specialize=["n_tiles"])
def _grouped_down_kernel(act_ptr, w2_ptr, sw2_ptr, sorted_ptr, tile_expert_ptr, row_end_ptr, weights_ptr,
                         pair_out_ptr, H, F, R, E, n_tiles,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                         FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = _tile_order(tl.program_id(0), n_tiles, tl.cdiv(H, BLOCK_N), GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= E:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < tl.load(row_end_ptr + e)
    pair = tl.load(sorted_ptr + rows, mask=r_ok, other=0)
    if e < R:
        w_base = w2_ptr + e.to(tl.int64) * (H * F)
    else:
        w_base = sw2_ptr + (e - R).to(tl.int64) * (H * F)
    h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = h < H
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_base + h[:, None].to(tl.int64) * F + kk[None, :]           # W2 rows h     [BLOCK_N, BLOCK_K]
    a_ptrs = act_ptr + rows[None, :].to(tl.int64) * F + kk[:, None]       # act^T         [BLOCK_K, BLOCK_M]
    acc = k_loop(tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), w_ptrs, a_ptrs, h_ok, r_ok, kk, F, BLOCK_K,
                 EVEN_K, FP32_DOT)
    store_weighted_pairs(acc, pair, r_ok, h, h_ok, weights_ptr, pair_out_ptr, H)


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(pair_out_ptr, y_ptr, N, H, KS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    FIX_BF16: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (t < N)[:, None] & (h < H)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(KS):                                         # slot order: a fixed sum
        acc += tl.load(pair_out_ptr + (t * KS + j).to(tl.int64)[:, None] * H + h[None, :], mask=ok, other=0.0)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * H + h[None, :], round_to(acc, y_ptr.dtype.element_ty, FIX_BF16),
             mask=ok)


_UP_INTERPRET = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4)    # small tiles: tests span several
_DOWN_INTERPRET = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4)


def launch_config(H: int, block_m: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """(up, down) launch parameters (BLOCK_N weight rows x BLOCK_K per step) for tiles of block_m token
    rows. bf16/fp16 with few tokens per expert (block_m <= 32) or a small model (H <= 1024): 64 rows of
    W13 (each of gate and up) and 128 of W2 (64 at H <= 1024) x 128, 4 warps, 4 stages; with many
    (block_m >= 64, the GEMMs bound by their arithmetic) 128 and 256 rows x 64, 8 warps. float32 (exact
    products on the FMA units): 64 x 32, 2 stages. Stages are capped so that every stage's tiles fit
    shared memory."""
    if dtype == torch.float32:
        (n_up, k_up), (n_down, k_down), warps, stages = (64, 32), (64, 32), 4, 2
    elif H <= 1024:
        (n_up, k_up), (n_down, k_down), warps, stages = (64, 128), (64, 128), 4, 4
    elif block_m <= 32:
        (n_up, k_up), (n_down, k_down), warps, stages = (64, 128), (128, 128), 4, 4
    else:
        (n_up, k_up), (n_down, k_down), warps, stages = (128, 64), (256, 64), 8, 4
    size = torch.finfo(dtype).bits // 8
    up = dict(BLOCK_N=n_up, BLOCK_K=k_up, num_warps=warps,
              num_stages=pipeline_stages(stages, (2 * n_up + block_m) * k_up * size))
    down = dict(BLOCK_N=n_down, BLOCK_K=k_down, num_warps=warps,
                num_stages=pipeline_stages(stages, (n_down + block_m) * k_down * size))
    return up, down


# ----------------------------------------------------------------------------- twins
def moe_grouped_experts_torch(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                              w2: torch.Tensor, shared_w13: torch.Tensor | None = None,
                              shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """The twin, in the kernels' arithmetic and independent of their tiling: per expert, all its tokens
    at once: [g; u] = x @ W13_e^T in float32 (float64 for float64 x), act = silu(g) * u rounded to x's
    dtype, w * (act @ W2_e^T) added in float32; the sum rounded once to x's dtype. x [N, H] -> [N, H]."""
    N, H = x.shape
    K = chosen.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa = x.to(acc)

    def expert(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gu = rows @ gate_up.to(acc).T
        act = (torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]).to(x.dtype)
        return act.to(acc) @ down.to(acc).T

    out = torch.zeros(N, H, dtype=acc, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(chosen == e)                # host sync: fine for the twin
        if tok.numel():
            out.index_add_(0, tok, expert(xa[tok], w13[e], w2[e]) * weights[tok, slot, None].to(acc))
    for s in range(0 if shared_w13 is None else shared_w13.shape[0]):
        out += expert(xa, shared_w13[s], shared_w2[s]) * weights[:, K + s, None].to(acc)
    return out.to(x.dtype)


def moe_grouped_torch(x, router_weight, router_bias, gate_global_scale, route_scale, top_k, w13, w2,
                      shared_w13=None, shared_w2=None) -> torch.Tensor:
    """The twin of `moe_grouped`: moe_route_torch, then moe_grouped_experts_torch."""
    chosen, weights = moe_route_torch(x, router_weight, router_bias, gate_global_scale, route_scale, top_k)
    return moe_grouped_experts_torch(x, chosen, weights, w13, w2, shared_w13, shared_w2)


# ----------------------------------------------------------------------------- wrappers
def moe_grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, shared_w13: torch.Tensor | None = None,
                        shared_w2: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
                        block_m: int | None = None) -> torch.Tensor:
    """The arguments of `moe.moe_experts`, any N: x contiguous [N, H]; chosen int [N, k] routed ids in
    0..R-1 (clamped into range for memory safety, not validated: that would need a host sync);
    weights float32 [N, k + S] (chosen first, then shared); w13 [R, 2F, H] (interleaved rows), w2
    [R, H, F], shared_w13 [S, 2F, H] and shared_w2 [S, H, F] (or None), in x's dtype. block_m: token
    rows per tile, a power of two >= 16 (default `block_m_for`). Returns [N, H] in x's dtype (into
    `out` when given). Six launches (count, plan, scatter, up, down, combine), no host sync."""
    R, F, S, K = check_experts(x, chosen, weights, w13, w2, shared_w13, shared_w2)
    if R + S > MAX_EXPERTS:
        raise ValueError(f"R + S = {R + S} experts: the grouped MoE plans at most {MAX_EXPERTS} in one program")
    N, H = x.shape
    out = out_tensor("out", out, (N, H), x.dtype, x.device)
    BM = block_m_for(N, K, R) if block_m is None else block_m
    if not isinstance(BM, int) or BM < 16 or BM & (BM - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m!r}")
    if N == 0:
        return out
    KS, E = K + S, R + S
    P = N * KS
    n_tiles = triton.cdiv(P + (min(R, N * K) + S) * (BM - 1), BM)
    n_blocks = triton.cdiv(P, SORT_BLOCK)
    dev = x.device
    hist = torch.empty(E, n_blocks, dtype=torch.int32, device=dev)           # pairs per (expert, block)
    prefix = torch.empty(E, n_blocks, dtype=torch.int32, device=dev)         # their prefixes over the blocks
    row_start = torch.empty(E, dtype=torch.int32, device=dev)
    row_end = torch.empty(E, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    sorted_pairs = torch.empty(n_tiles * BM, dtype=torch.int32, device=dev)
    act = torch.empty(n_tiles * BM, F, dtype=x.dtype, device=dev)
    pair_out = torch.empty(P, H, dtype=torch.float32, device=dev)
    _count_kernel[(n_blocks,)](chosen, hist, P, R, K, KS, E, n_blocks, BLOCK_P=SORT_BLOCK,
                               BLOCK_E=min(128, triton.next_power_of_2(E)), num_warps=4)
    BLOCK_E = triton.next_power_of_2(E)
    per_step = max(1, 8192 // BLOCK_E)                                     # [BLOCK_E, BLOCK_B] tiles of <= 8K
    # two tile widths each (the engine's windows and verify passes fit the small ones): few compilations
    _plan_kernel[(1,)](hist, prefix, row_start, row_end, tile_expert, E, n_blocks, n_tiles, BLOCK_M=BM,
                       BLOCK_E=BLOCK_E, BLOCK_B=min(per_step, 16 if n_blocks <= 16 else 512),
                       BLOCK_T=min(per_step, 64 if n_tiles <= 64 else 512), num_warps=8)
    _scatter_kernel[(n_blocks,)](chosen, prefix, row_start, sorted_pairs, P, R, K, KS, E, n_blocks,
                                 BLOCK_P=SORT_BLOCK, num_warps=4)
    interp = interpreting()
    fp32_dot = x.dtype == torch.float32 or interp
    up, down = (_UP_INTERPRET, _DOWN_INTERPRET) if interp else launch_config(H, BM, x.dtype)
    group_m = max(1, 512 // BM)
    _grouped_up_kernel[(n_tiles * triton.cdiv(F, up["BLOCK_N"]),)](
        x, w13, shared_w13 if S else w13, sorted_pairs, tile_expert, row_end, act, H, F, R, E, KS, n_tiles,
        BLOCK_M=BM, GROUP_M=group_m, FP32_DOT=fp32_dot, FIX_BF16=interp, EVEN_K=H % up["BLOCK_K"] == 0, **up)
    _grouped_down_kernel[(n_tiles * triton.cdiv(H, down["BLOCK_N"]),)](
        act, w2, shared_w2 if S else w2, sorted_pairs, tile_expert, row_end, weights, pair_out, H, F, R, E, n_tiles,
        BLOCK_M=BM, GROUP_M=group_m, FP32_DOT=fp32_dot, EVEN_K=F % down["BLOCK_K"] == 0, **down)
    BLOCK_T, BLOCK_H = 4, 256
    _combine_kernel[(triton.cdiv(N, BLOCK_T), triton.cdiv(H, BLOCK_H))](
        pair_out, out, N, H, KS=KS, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, FIX_BF16=interp, num_warps=4)
    return out


def moe_grouped(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
                gate_global_scale: torch.Tensor, route_scale: float, top_k: int, w13: torch.Tensor, w2: torch.Tensor,
                shared_w13: torch.Tensor | None = None, shared_w2: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE layer (inkling_ref/model/moe.py, MoE.forward) for x [N, H], any N, with the arguments of
    `moe.moe`: router_weight [R + S, H], router_bias [R], gate_global_scale [1] (on the device),
    route_scale (float), top_k, expert weights as in `moe_grouped_experts`. `moe_route`, then
    `moe_grouped_experts`: eight launches, no host sync."""
    check_router_rows(router_weight, router_bias, route_scale, shared_w13)
    chosen, weights = moe_route(x, router_weight, router_bias, gate_global_scale, route_scale, top_k)
    return moe_grouped_experts(x, chosen, weights, w13, w2, shared_w13, shared_w2, out=out)
