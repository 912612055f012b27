"""The MoE router on the device (inkling_ref/model/moe.py, `MoE.route`), for any number of tokens:

    z      = x @ W_gate^T                                 [N, R + S] float32 (routed rows, then shared)
    chosen = top-k over e < R of sigmoid(z_e) + bias_e     the bias selects, it never weighs
    w_a    = sigmoid(z_a) / sum_{b in A} sigmoid(z_b) * route_scale * global_scale,
             A = the k chosen + the S shared experts       -> weights [N, k + S] (chosen first, then shared)

Two launches, no host sync:
  1. router logits: program (i, j, s) computes partial logits for a tile of BLOCK_E experts and
     BLOCK_N tokens over the s-th of up to 8 slices of H, `tl.dot(W_gate tile, x^T tile)` in float32
     (W_gate, 2 MB at real size, is read once, by ~136 programs instead of 17).
  2. selection: program i sums the partial logits (in a fixed order: deterministic), takes BLOCK_N
     tokens' R scores and picks the top k by k rounds of
     (max, lowest id reaching it, mask it out): equal scores go to the lower expert id (torch.topk
     does not specify its tie order; the reference's outputs are the same either way only when
     the k-th and (k+1)-th scores differ). global_scale is read on the device.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_kernel_device, check_tensor, dot, interpreting, need


@triton.jit(do_not_specialize=["N"])
def _router_logits_kernel(x_ptr, wg_ptr, z_ptr, N, H, E, H_SPLIT, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)                                     # this program's share of H
    kk = tl.arange(0, BLOCK_K)
    e_ok = e < E
    n_ok = n < N
    acc = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * H_SPLIT, tl.minimum(split * H_SPLIT + H_SPLIT, H), BLOCK_K):
        k_ok = (k0 + kk) < H
        w = tl.load(wg_ptr + e[:, None].to(tl.int64) * H + k0 + kk[None, :],
                    mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptr + n[None, :].to(tl.int64) * H + k0 + kk[:, None],
                     mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = dot(w, xt, acc, FP32_DOT)
    tl.store(z_ptr + (split * N + n[None, :]) * E + e[:, None], acc, mask=e_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _router_select_kernel(z_ptr, bias_ptr, gscale_ptr, chosen_ptr, weights_ptr, N, R, S, route_scale,
                          SPLITS: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr):
    E = R + S
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.arange(0, BLOCK_R)
    jj = tl.arange(0, BLOCK_J)                                   # slots: k chosen, then S shared
    n_ok = n < N
    e_ok = e < R
    z = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):                           # the partial logits over the H splits
        z += tl.load(z_ptr + (sp * N + n[:, None]) * E + e[None, :], mask=n_ok[:, None] & e_ok[None, :],
                     other=0.0)
    s = tl.sigmoid(z)
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    score = tl.where(e_ok[None, :], s + bias[None, :], float("-inf"))
    sel_s = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    sel_id = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(score, axis=1)
        idx = tl.min(tl.where(score == m[:, None], e[None, :], BLOCK_R), axis=1)
        idx = tl.minimum(idx, R - 1)                             # a NaN score matches nothing: stay in range
        hit = e[None, :] == idx[:, None]
        sv = tl.sum(tl.where(hit, s, 0.0), axis=1)
        sel_s = tl.where(jj[None, :] == j, sv[:, None], sel_s)
        sel_id = tl.where(jj[None, :] == j, idx[:, None], sel_id)
        score = tl.where(hit, float("-inf"), score)
    shared = (jj >= TOP_K) & (jj < TOP_K + S)
    zs = tl.zeros([BLOCK_N, BLOCK_J], dtype=tl.float32)
    for sp in tl.static_range(SPLITS):
        zs += tl.load(z_ptr + (sp * N + n[:, None]) * E + (R + jj - TOP_K)[None, :],
                      mask=n_ok[:, None] & shared[None, :], other=0.0)
    sel_s = tl.where(shared[None, :], tl.sigmoid(zs), sel_s)
    total = tl.sum(sel_s, axis=1)                                # slots >= k + S hold 0
    scale = route_scale * tl.load(gscale_ptr).to(tl.float32)
    w = sel_s / total[:, None] * scale
    tl.store(chosen_ptr + n[:, None] * TOP_K + jj[None, :], sel_id, mask=n_ok[:, None] & (jj < TOP_K)[None, :])
    tl.store(weights_ptr + n[:, None] * (TOP_K + S) + jj[None, :], w,
             mask=n_ok[:, None] & (jj < TOP_K + S)[None, :])


def moe_route_torch(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
                    gate_global_scale: torch.Tensor, route_scale: float, top_k: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin (the reference's formulas in float32, float64 for float64 x):
    -> (chosen int64 [N, k], weights [N, k+S])."""
    R = router_bias.shape[0]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = x.to(dt) @ router_weight.to(dt).T                                 # [N, R + S]
    s = torch.sigmoid(z)
    chosen = torch.topk(s[:, :R] + router_bias.to(dt), top_k, dim=-1).indices
    active = torch.cat([s.gather(1, chosen), s[:, R:]], dim=1)            # [N, k + S]
    w = active / active.sum(dim=1, keepdim=True) * route_scale * gate_global_scale.to(dt)
    return chosen, w


def check_x(x) -> None:
    """x: a contiguous float tensor [N, H] the kernels can read (the MoE wrappers' activations)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, contiguous=True)
    need(x.dim() == 2, f"x must be a tensor [N, H], got shape {tuple(x.shape)}")
    check_kernel_device("x", x)


def moe_route(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor,
              gate_global_scale: torch.Tensor, route_scale: float, top_k: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, H]; router_weight: [R + S, H] (routed rows, then shared); router_bias: [R] (selection
    only); gate_global_scale: a 1-element tensor (read on the device); route_scale: float; top_k <= R.
    Returns (chosen int32 [N, k], weights float32 [N, k + S]). Two launches, no host sync."""
    check_x(x)
    N, H = x.shape
    if not isinstance(router_bias, torch.Tensor) or router_bias.dim() != 1:
        raise ValueError("router_bias must be a float tensor [R] (R routed experts)")
    R = router_bias.shape[0]
    if not isinstance(router_weight, torch.Tensor) or router_weight.dim() != 2 or router_weight.shape[0] < R:
        raise ValueError(f"router_weight must be a float tensor [R + S, H] with R = {R} (router_bias' length)")
    E = router_weight.shape[0]
    check_tensor("router_weight", router_weight, (E, H), FLOAT_DTYPES, x.device, contiguous=True)
    check_tensor("router_bias", router_bias, (R,), FLOAT_DTYPES + (torch.float64,), x.device, contiguous=True)
    if not isinstance(gate_global_scale, torch.Tensor) or gate_global_scale.numel() != 1 \
            or not gate_global_scale.is_floating_point() or gate_global_scale.device != x.device:
        raise ValueError(f"gate_global_scale must be a 1-element float tensor on {x.device}")
    if not isinstance(route_scale, (int, float)) or not math.isfinite(route_scale):
        raise ValueError(f"route_scale must be a finite number, got {route_scale!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= R:
        raise ValueError(f"top_k must be an int in 1..{R} (the routed experts), got {top_k!r}")
    S = E - R
    chosen = torch.empty(N, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(N, top_k + S, dtype=torch.float32, device=x.device)
    if N == 0:
        return chosen, weights
    BLOCK_N = 16 if N <= 16 else 64       # two token tiles: one compilation for decode, one for more
    BLOCK_E = 16
    interp = interpreting()
    BLOCK_K = 128 if not interp else 32
    # split H over up to 8 programs per expert tile, so that enough programs stream W_gate (its
    # rows make only ceil(E / 16) tiles); fewer under the interpreter, where programs run one by one
    splits = max(1, min(8 if not interp else 2, triton.cdiv(H, BLOCK_K)))
    h_split = triton.cdiv(triton.cdiv(H, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(H, h_split)
    z = torch.empty(splits, N, E, dtype=torch.float32, device=x.device)     # partial logits per split
    fp32_dot = x.dtype == torch.float32 or router_weight.dtype != x.dtype or interp
    _router_logits_kernel[(triton.cdiv(E, BLOCK_E), triton.cdiv(N, BLOCK_N), splits)](
        x, router_weight, z, N, H, E, h_split, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        FP32_DOT=fp32_dot, num_warps=4, num_stages=3 if not interp else 1)
    SEL_N = 4 if triton.next_power_of_2(R) >= 512 else 16
    _router_select_kernel[(triton.cdiv(N, SEL_N),)](
        z, router_bias, gate_global_scale, chosen, weights, N, R, S, float(route_scale), SPLITS=splits, TOP_K=top_k,
        BLOCK_N=SEL_N, BLOCK_R=triton.next_power_of_2(R), BLOCK_J=triton.next_power_of_2(top_k + S), num_warps=4)
    return chosen, weights
