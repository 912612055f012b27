"""Attention prep: everything between one layer's q/k/v/r projections and its attention, in one launch.

For the B x T rows of one layer (row t of batch row b sits at position p = pos[b, t] and uses cache
slot s = slot[b]; see docs/fast_path.md), with C = nKV * hd channels and conv kernel K:

    k      = k_norm( SConv_K(k_in) )        v = SConv_V(v_in)         (convs over positions p-K+1..p)
    q'     = tau(p) * q_norm(q)                                        [B, T, nH, hd]  model dtype
    L_rel' = tau(p) * (r @ P)                                          [B, T, nH, E]   float32
    k_ring[s, p % R] = k_in     v_ring[s, p % R] = v_in                (conv inputs, exact copies)
    k_cache[s, p % cap] = k     v_cache[s, p % cap] = v                ([slots, cap, nKV, hd])

    SConv(x)[p] = x[p] + sum_{j<K} w[c, j] * x[p - (K-1) + j]          (x before position 0 = 0)
    tau(p) = 1 + alpha * ln(max(1, (p + 1) / n_floor))                 (only when log_tau is given)

Design:

* **One launch**, grid (B*T, nKV + ceil(E / BLOCK_E)). Program (row, g < nKV) owns KV head g: both
  short convs of its hd channels, the k RMSNorm, the ring and cache writes, and the q RMSNorm of the
  G = nH/nKV query heads that read KV head g. Program (row, nKV + e) computes the columns
  e*BLOCK_E.. of L_rel for all nH heads as one tl.dot (r [nH, d_rel] @ P [d_rel, BLOCK_E], fp32
  accumulation): P is read once per row, r once per program.
* **Conv taps.** Tap j of row t reads position p - (K-1) + j: from the call's own input row t-(K-1)+j
  when that row holds exactly that position, from the ring row (position % R) otherwise, zero before
  position 0. So a call reads the ring only at the K-1 positions before its first row and writes it
  only at its own positions: these rows are distinct when T + K - 1 <= R, and the single launch is
  race-free. Larger T (prefill) must pass `flat_kv=True` (else ValueError): the launch then writes no
  ring row and no cache row, returns k and v as flat [B, T, nKV, hd] tensors, and two more launches
  (`commit_rows`) copy the last R conv inputs of each row into the rings. The KV cache is then
  written by the prefill attention *after* it has read the history (attention_prefill.py).
* **Bias as L_rel, not r.** The relative logits are written once here (fp32, tau-scaled) and the
  attention kernel gathers L_rel[b, t, h, p - j] for the keys within the extent; the alternative
  (16 FMAs per score from r and P inside attention) needs, for a window of T rows at different
  positions, a per-row gather of P columns ([rows, d_rel, keys]) in the inner loop. The cost of the
  choice is T * nH * E * 4 bytes written here and read again there per batch row (128 KB each way
  at T = 1 for Inkling-Small's global layers): under 1% of the K/V bytes decode reads at 8k context,
  6% at 1k.
  At prefill sizes it is large (T * nH * E * 4 bytes), the price of the simpler prefill path.
* **Numerics** follow the reference: the conv accumulates in fp32 and rounds to the model dtype
  (the reference's ShortConv returns its input dtype), the k/q RMSNorms run in fp32 and round once;
  q' = tau * round(q_norm(q)) is rounded to the model dtype, L_rel' stays fp32.
* Padding rows (pos = -1) read nothing and write nothing (not even q' or L_rel').
* Under the interpreter (CI), `round_to` rounds to nearest even by hand, as the GPU does
  (inkling_fast/kernels/common.py).

Constraints checked by the wrapper: dtypes (bf16, fp16 or fp32 activations/caches, any float
weights), shapes, devices, int32 indices, R >= T + K - 1 and T <= cap unless `flat_kv`.
Positions and slots live on the device and are not inspected (that would be a host sync): slots
must be in range and distinct across the batch rows that hold valid rows (two rows writing one slot
would race), the valid rows of a batch row must hold consecutive positions, and a global layer's
cap must exceed every position.

Copy with it: commit_rows.py, common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .commit_rows import commit_rows
from .common import FLOAT_DTYPES, both, check_kernel_device, interpreting, need, out_tensor, round_to



class Prep(NamedTuple):
    q: torch.Tensor          # [B, T, nH, hd] normed (tau-scaled) queries, model dtype
    rel: torch.Tensor        # [B, T, nH, E] tau-scaled relative logits, float32
    k: torch.Tensor | None   # [B, T, nKV, hd] convolved + normed keys (flat_kv only)
    v: torch.Tensor | None   # [B, T, nKV, hd] convolved values (flat_kv only)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _conv_channel_block(x_ptr, stride_b, stride_t, ring_ptr, w_ptr, pos_ptr, b, t, p, s, c, cmask,
                        T, R, C, KSIZE: tl.constexpr):
    """SConv of one row over the channels c: returns (y fp32, x_t in its own dtype)."""
    x_t = tl.load(x_ptr + b * stride_b + t * stride_t + c, mask=cmask)
    y = x_t.to(tl.float32) * (1.0 + tl.load(w_ptr + c * KSIZE + (KSIZE - 1), mask=cmask).to(tl.float32))
    for j in tl.static_range(KSIZE - 1):
        back = KSIZE - 1 - j
        pp = p - back                                   # position this tap reads
        tb = t - back                                   # the call's row that may hold it
        held = tl.load(pos_ptr + b * T + tb, mask=tb >= 0, other=-1)
        in_call = (tb >= 0) & (pp >= 0) & (held == pp)  # pp >= 0: a padding row holds -1, never position -1
        from_ring = (pp >= 0) & (held != pp)
        x_call = tl.load(x_ptr + b * stride_b + tb * stride_t + c, mask=both(cmask, in_call), other=0.0)
        ring_row = tl.maximum(pp, 0) % R
        x_ring = tl.load(ring_ptr + (s * R + ring_row) * C + c, mask=both(cmask, from_ring), other=0.0)
        w = tl.load(w_ptr + c * KSIZE + j, mask=cmask).to(tl.float32)
        y += w * (x_call.to(tl.float32) + x_ring.to(tl.float32))
    return y, x_t


@triton.jit
def _prep_kv_head(q_ptr, k_in_ptr, v_in_ptr, q_norm_ptr, k_norm_ptr, k_conv_ptr, v_conv_ptr,
                  k_ring_ptr, v_ring_ptr, k_dst_ptr, v_dst_ptr, q_out_ptr, slot_ptr, pos_ptr,
                  row, b, t, p, live, g, tau, T, R, CAP,
                  stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt, eps,
                  NKV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, KSIZE: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, TO_CACHE: tl.constexpr, INTERPRET: tl.constexpr):
    """KV head g of one row: both convs, k RMSNorm, ring and cache writes; q RMSNorm of its G heads."""
    s = tl.load(slot_ptr + b).to(tl.int64)
    C = NKV * HD
    d = tl.arange(0, BLOCK_D)
    if HD == BLOCK_D:   # a mask constant along d keeps the loads vectorized
        dmask = both(tl.full([BLOCK_D], 1, tl.int1), live)
    else:
        dmask = both(d < HD, live)
    c = g * HD + d
    # K: conv (fp32, rounded to the model dtype like the reference), then RMSNorm
    kc, k_t = _conv_channel_block(k_in_ptr, stride_kb, stride_kt, k_ring_ptr, k_conv_ptr, pos_ptr,
                                  b, t, p, s, c, dmask, T, R, C, KSIZE)
    kc = round_to(kc, k_dst_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    kc = tl.where(dmask, kc, 0.0)
    k = kc * tl.rsqrt(tl.sum(kc * kc, 0) / HD + eps) * tl.load(k_norm_ptr + d, mask=dmask).to(tl.float32)
    # V: conv only
    vc, v_t = _conv_channel_block(v_in_ptr, stride_vb, stride_vt, v_ring_ptr, v_conv_ptr, pos_ptr,
                                  b, t, p, s, c, dmask, T, R, C, KSIZE)
    if TO_CACHE:
        tl.store(k_ring_ptr + (s * R + p % R) * C + c, k_t, mask=dmask)
        tl.store(v_ring_ptr + (s * R + p % R) * C + c, v_t, mask=dmask)
        dst = (s * CAP + p % CAP) * C + c
    else:
        dst = row.to(tl.int64) * C + c
    tl.store(k_dst_ptr + dst, round_to(k, k_dst_ptr.dtype.element_ty, INTERPRET), mask=dmask)
    tl.store(v_dst_ptr + dst, round_to(vc, v_dst_ptr.dtype.element_ty, INTERPRET), mask=dmask)

    # the G query heads of this KV head: RMSNorm (rounded), then tau
    i = tl.arange(0, BLOCK_G)
    h = g * G + i
    qmask = (i[:, None] < G) & dmask[None, :]
    x = tl.load(q_ptr + b * stride_qb + t * stride_qt + h[:, None] * HD + d[None, :], mask=qmask,
                other=0.0).to(tl.float32)
    w_q = tl.load(q_norm_ptr + d, mask=dmask).to(tl.float32)
    qn = x * tl.rsqrt(tl.sum(x * x, 1) / HD + eps)[:, None] * w_q[None, :]
    qn = round_to(qn, q_out_ptr.dtype.element_ty, INTERPRET).to(tl.float32) * tau
    tl.store(q_out_ptr + (row.to(tl.int64) * (NKV * G) + h[:, None]) * HD + d[None, :],
             round_to(qn, q_out_ptr.dtype.element_ty, INTERPRET), mask=qmask)


@triton.jit
def _prep_rel_block(r_ptr, rel_proj_ptr, rel_out_ptr, row, b, t, live, eb, tau, E, stride_rb, stride_rt,
                    NH: tl.constexpr, D_REL: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_E: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """Columns eb*BLOCK_E.. of L_rel[row, h, e] = tau * sum_c r[row, h, c] * P[c, e]: one tl.dot of
    r [heads, d_rel] (padded to >= 16) by P [d_rel, BLOCK_E], fp32 accumulation (bf16 products are
    exact in fp32; fp32 operands use IEEE dots)."""
    e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.arange(0, BLOCK_H)
    cr = tl.arange(0, BLOCK_R)
    emask = both(e < E, live)
    hmask = both(h < NH, live)
    r = tl.load(r_ptr + b * stride_rb + t * stride_rt + h[:, None] * D_REL + cr[None, :],
                mask=hmask[:, None] & (cr[None, :] < D_REL), other=0.0)
    P = tl.load(rel_proj_ptr + cr[:, None] * E + e[None, :], mask=(cr[:, None] < D_REL) & emask[None, :], other=0.0)
    if INTERPRET or r_ptr.dtype.element_ty != rel_proj_ptr.dtype.element_ty:
        acc = tl.dot(r.to(tl.float32), P.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(r, P, input_precision=PREC)
    tl.store(rel_out_ptr + (row.to(tl.int64) * NH + h[:, None]) * E + e[None, :], acc * tau,
             mask=hmask[:, None] & emask[None, :])


@triton.jit(do_not_specialize=["T"])
def _prep_kernel(
    q_ptr, k_in_ptr, v_in_ptr, r_ptr,
    q_norm_ptr, k_norm_ptr, k_conv_ptr, v_conv_ptr, rel_proj_ptr,
    k_ring_ptr, v_ring_ptr, k_dst_ptr, v_dst_ptr, q_out_ptr, rel_out_ptr,
    slot_ptr, pos_ptr,
    T, R, CAP, E,
    stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt, stride_rb, stride_rt,
    eps, n_floor, alpha,
    NKV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, D_REL: tl.constexpr, KSIZE: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr, HAS_TAU: tl.constexpr, TO_CACHE: tl.constexpr, PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)                       # b * T + t
    work = tl.program_id(1)                      # KV head g < NKV, else L_rel column block
    b = (row // T).to(tl.int64)                  # int64: b * stride_b can pass 2^31 for long prompts
    t = row % T
    p = tl.load(pos_ptr + row)
    live = p >= 0
    if HAS_TAU:
        tau = 1.0 + alpha * tl.log(tl.maximum((p + 1).to(tl.float32) / n_floor, 1.0))
    else:
        tau = 1.0
    if work < NKV:
        _prep_kv_head(q_ptr, k_in_ptr, v_in_ptr, q_norm_ptr, k_norm_ptr, k_conv_ptr, v_conv_ptr,
                      k_ring_ptr, v_ring_ptr, k_dst_ptr, v_dst_ptr, q_out_ptr, slot_ptr, pos_ptr,
                      row, b, t, p, live, work, tau, T, R, CAP,
                      stride_qb, stride_qt, stride_kb, stride_kt, stride_vb, stride_vt, eps,
                      NKV, G, HD, KSIZE, BLOCK_D, BLOCK_G, TO_CACHE, INTERPRET)
    else:
        _prep_rel_block(r_ptr, rel_proj_ptr, rel_out_ptr, row, b, t, live, work - NKV, tau, E, stride_rb, stride_rt,
                        NKV * G, D_REL, BLOCK_H, BLOCK_R, BLOCK_E, PREC, INTERPRET)


# ----------------------------------------------------------------------------------------------- checks
def _check_rows(name: str, x: torch.Tensor, B: int, T: int, width: int) -> None:
    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    need(isinstance(x, torch.Tensor) and tuple(x.shape) == (B, T, width),
         f"{name}: expected shape [B={B}, T={T}, {width}], got {got}")
    need(x.stride(-1) == 1, f"{name}: the last dimension must be contiguous (stride 1), got stride {x.stride(-1)}")


def _conv_weight(name: str, w: torch.Tensor, C: int) -> torch.Tensor:
    """Accept [C, K] or the checkpoint layout [C, 1, K]; return a contiguous [C, K] view/copy."""
    if w.dim() == 3 and w.shape[1] == 1:
        w = w[:, 0]
    need(w.dim() == 2 and w.shape[0] == C, f"{name}: expected [C={C}, K] (or [C, 1, K]), got {tuple(w.shape)}")
    return w.contiguous()


def _validate(q, k_in, v_in, r, q_norm, k_norm, k_conv, v_conv, rel_proj, k_ring, v_ring, k_cache, v_cache,
              slot, pos, log_tau):
    need(isinstance(pos, torch.Tensor) and pos.dim() == 2, "pos: expected an int32 tensor [B, T]")
    B, T = pos.shape
    need(pos.dtype == torch.int32 and slot.dtype == torch.int32, "pos and slot must be int32 tensors")
    need(tuple(slot.shape) == (B,), f"slot: expected shape [B={B}], got {tuple(slot.shape)}")
    need(k_cache.dim() == 4, f"k_cache: expected [slots, cap, nKV, hd], got {tuple(k_cache.shape)}")
    slots, cap, nKV, hd = k_cache.shape
    need(tuple(v_cache.shape) == tuple(k_cache.shape),
         f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    C = nKV * hd
    need(q.shape[-1] % hd == 0, f"q: width {q.shape[-1]} is not a multiple of head_dim={hd} (from k_cache)")
    nH = q.shape[-1] // hd
    need(nH % nKV == 0, f"q: {nH} query heads is not a multiple of the {nKV} KV heads of k_cache")
    need(rel_proj.dim() == 2, f"rel_proj: expected [d_rel, E], got {tuple(rel_proj.shape)}")
    d_rel, E = rel_proj.shape
    _check_rows("q", q, B, T, nH * hd)
    _check_rows("k_in", k_in, B, T, C)
    _check_rows("v_in", v_in, B, T, C)
    _check_rows("r", r, B, T, nH * d_rel)
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        need(tuple(w.shape) == (hd,) and w.is_contiguous(), f"{name}: expected a contiguous [{hd}], got "
             f"{tuple(w.shape)} with strides {w.stride()}")
    k_conv = _conv_weight("k_conv", k_conv, C)
    v_conv = _conv_weight("v_conv", v_conv, C)
    need(k_conv.shape == v_conv.shape, f"k_conv {tuple(k_conv.shape)} and v_conv {tuple(v_conv.shape)} differ")
    K = k_conv.shape[1]
    need(k_ring.dim() == 3 and k_ring.shape[0] == slots and k_ring.shape[2] == C,
         f"k_ring: expected [slots={slots}, R, C={C}], got {tuple(k_ring.shape)}")
    need(tuple(v_ring.shape) == tuple(k_ring.shape),
         f"v_ring: expected the shape of k_ring {tuple(k_ring.shape)}, got {tuple(v_ring.shape)}")
    R = k_ring.shape[1]
    need(R >= K - 1, f"k_ring: R={R} rows cannot hold the K-1={K - 1} previous conv inputs")
    dt = k_cache.dtype
    need(dt in FLOAT_DTYPES, f"k_cache: dtype {dt} not supported (bf16, fp16, fp32)")
    for name, x in (("q", q), ("k_in", k_in), ("v_in", v_in), ("r", r), ("k_ring", k_ring), ("v_ring", v_ring),
                    ("v_cache", v_cache)):
        need(x.dtype == dt, f"{name}: dtype {x.dtype} differs from the cache dtype {dt}")
    for name, x in (("q_norm", q_norm), ("k_norm", k_norm), ("k_conv", k_conv), ("v_conv", v_conv),
                    ("rel_proj", rel_proj)):
        need(x.dtype in FLOAT_DTYPES, f"{name}: dtype {x.dtype} not supported")
    dev = k_cache.device
    check_kernel_device("k_cache", k_cache)
    for name, x in (("q", q), ("k_in", k_in), ("v_in", v_in), ("r", r), ("q_norm", q_norm), ("k_norm", k_norm),
                    ("k_conv", k_conv), ("v_conv", v_conv), ("rel_proj", rel_proj), ("k_ring", k_ring),
                    ("v_ring", v_ring), ("v_cache", v_cache), ("slot", slot), ("pos", pos)):
        need(x.device == dev, f"{name}: on {x.device}, the caches are on {dev}")
    for name, x in (("k_ring", k_ring), ("v_ring", v_ring), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot", slot), ("pos", pos)):
        need(x.is_contiguous(), f"{name}: must be contiguous")
    if log_tau is not None:
        need(len(log_tau) == 2 and log_tau[0] > 0, f"log_tau: expected (n_floor > 0, alpha), got {log_tau!r}")
    return B, T, slots, cap, nKV, hd, nH, d_rel, E, K, R, k_conv.contiguous(), v_conv.contiguous()


# ----------------------------------------------------------------------------------------------- wrapper
def attention_prep(q, k_in, v_in, r, *, q_norm, k_norm, k_conv, v_conv, rel_proj, k_ring, v_ring, k_cache,
                   v_cache, slot, pos, eps: float, log_tau: tuple[float, float] | None = None,
                   flat_kv: bool = False, q_out=None, rel_out=None, k_out=None, v_out=None) -> Prep:
    """q: [B, T, nH*hd], k_in/v_in: [B, T, nKV*hd], r: [B, T, nH*d_rel] (projection outputs, last dim
    contiguous); q_norm/k_norm: [hd]; k_conv/v_conv: [C, K] or [C, 1, K]; rel_proj P: [d_rel, E];
    k_ring/v_ring: [slots, R, C]; k_cache/v_cache: [slots, cap, nKV, hd]; slot: int32 [B];
    pos: int32 [B, T] (-1 = padding); log_tau: (n_floor, alpha) on global layers with log scaling.

    Decode/windows (flat_kv=False, needs R >= T + K - 1 and T <= cap): one launch; writes the rings and
    the KV cache, returns Prep(q, rel, None, None). Prefill (flat_kv=True): writes the rings only,
    returns k and v flat for `attention_prefill` (which writes the KV cache). Outputs may be passed in
    (q_out, rel_out, k_out, v_out) so that a CUDA graph owns them."""
    (B, T, slots, cap, nKV, hd, nH, d_rel, E, K, R, k_conv, v_conv) = _validate(
        q, k_in, v_in, r, q_norm, k_norm, k_conv, v_conv, rel_proj, k_ring, v_ring, k_cache, v_cache, slot,
        pos, log_tau)
    if not flat_kv:
        need(T + K - 1 <= R, f"k_ring: a call of T={T} rows with conv kernel K={K} needs R >= T + K - 1 = "
             f"{T + K - 1} ring rows (R={R}) to read and write the ring in one launch; pass flat_kv=True "
             "(the prefill path) for longer calls")
        need(T <= cap, f"k_cache: T={T} rows do not fit a cache of cap={cap} rows; pass flat_kv=True "
             "(the prefill path) for longer calls")
    dev, dt = k_cache.device, k_cache.dtype
    q_out = out_tensor("q_out", q_out, (B, T, nH, hd), dt, dev)
    rel_out = out_tensor("rel_out", rel_out, (B, T, nH, E), torch.float32, dev)
    if flat_kv:
        k_dst = out_tensor("k_out", k_out, (B, T, nKV, hd), dt, dev)
        v_dst = out_tensor("v_out", v_out, (B, T, nKV, hd), dt, dev)
    else:
        k_dst, v_dst = k_cache, v_cache
    if B * T == 0:
        return Prep(q_out, rel_out, k_dst if flat_kv else None, v_dst if flat_kv else None)

    BLOCK_H = max(16, triton.next_power_of_2(nH))
    BLOCK_E = max(16, min(triton.next_power_of_2(E), 4096 // BLOCK_H))   # 4096 fp32 accumulators per program
    n_floor, alpha = (float(log_tau[0]), float(log_tau[1])) if log_tau is not None else (1.0, 0.0)
    G = nH // nKV
    grid = (B * T, nKV + triton.cdiv(E, BLOCK_E))
    _prep_kernel[grid](
        q, k_in, v_in, r, q_norm, k_norm, k_conv, v_conv, rel_proj.contiguous(),
        k_ring, v_ring, k_dst, v_dst, q_out, rel_out, slot, pos,
        T, R, cap, E,
        q.stride(0), q.stride(1), k_in.stride(0), k_in.stride(1), v_in.stride(0), v_in.stride(1),
        r.stride(0), r.stride(1),
        float(eps), n_floor, alpha,
        NKV=nKV, G=G, HD=hd, D_REL=d_rel, KSIZE=K,
        BLOCK_D=triton.next_power_of_2(hd), BLOCK_G=triton.next_power_of_2(G), BLOCK_H=BLOCK_H,
        BLOCK_R=max(16, triton.next_power_of_2(d_rel)), BLOCK_E=BLOCK_E, HAS_TAU=log_tau is not None,
        TO_CACHE=not flat_kv, PREC="ieee" if r.dtype == torch.float32 else None, INTERPRET=interpreting(),
        num_warps=4,
    )
    if not flat_kv:
        return Prep(q_out, rel_out, None, None)
    commit_rows(k_in, k_ring, slot, pos)
    commit_rows(v_in, v_ring, slot, pos)
    return Prep(q_out, rel_out, k_dst, v_dst)


# ----------------------------------------------------------------------------------------------- twin
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _conv_torch(x, ring, w, slot, pos):
    """x: [B, T, C] inputs, ring [slots, R, C] -> y [B, T, C] (fp32/fp64), as SConv over positions."""
    B, T = pos.shape
    K, R = w.shape[1], ring.shape[1]
    dt = _compute_dtype(x)
    back = torch.arange(K - 1, -1, -1, device=pos.device)             # tap j reads p - back[j]
    tap_pos = pos[:, :, None] - back                                    # [B, T, K]
    src_t = torch.arange(T, device=pos.device)[None, :, None] - back    # [1, T, K] call row
    src_tc = src_t.clamp(0, T - 1).expand(B, T, K)
    in_call = (src_t >= 0) & (tap_pos >= 0) & (pos.gather(1, src_tc.reshape(B, -1)).view(B, T, K) == tap_pos)
    b_idx = torch.arange(B, device=pos.device)[:, None, None]
    from_call = x[b_idx, src_tc]                                        # [B, T, K, C]
    from_ring = ring[slot.long()[:, None, None], tap_pos.clamp(min=0) % R]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    hist = torch.where(in_call[..., None], from_call, torch.where(tap_pos[..., None] >= 0, from_ring, zero))
    return x.to(dt) + torch.einsum("btkc,ck->btc", hist.to(dt), w.to(dt))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(x.dtype)


def log_tau_torch(pos: torch.Tensor, log_tau, dtype) -> torch.Tensor:
    """tau(pos) = 1 + alpha * ln(max(1, (pos + 1) / n_floor)) (ones without log_tau)."""
    if log_tau is None:
        return torch.ones(pos.shape, dtype=dtype, device=pos.device)
    n_floor, alpha = log_tau
    return (1.0 + alpha * torch.log(((pos.to(torch.float64) + 1) / n_floor).clamp(min=1.0))).to(dtype)


def attention_prep_torch(q, k_in, v_in, r, *, q_norm, k_norm, k_conv, v_conv, rel_proj, k_ring, v_ring, k_cache,
                         v_cache, slot, pos, eps: float, log_tau=None, flat_kv: bool = False) -> Prep:
    """The vectorized-torch twin of `attention_prep` (same arguments, same writes; float64 inputs
    compute in float64). Reads the rings before writing them, so it has no size limit."""
    B, T = pos.shape
    slots, cap, nKV, hd = k_cache.shape
    nH, (d_rel, E) = q.shape[-1] // hd, rel_proj.shape
    C = nKV * hd
    k_conv = k_conv.reshape(C, -1)
    v_conv = v_conv.reshape(C, -1)
    dt, mdt = _compute_dtype(q), k_cache.dtype
    valid = pos >= 0
    tau = log_tau_torch(pos, log_tau, dt)[:, :, None, None]                      # [B, T, 1, 1]

    kc = _conv_torch(k_in, k_ring, k_conv, slot, pos).to(mdt).to(dt)            # rounded like the reference
    k = _rms(kc.view(B, T, nKV, hd), k_norm, eps).to(mdt)
    v = _conv_torch(v_in, v_ring, v_conv, slot, pos).to(mdt).view(B, T, nKV, hd)
    qn = _rms(q.to(dt).view(B, T, nH, hd), q_norm, eps).to(mdt).to(dt)
    q_out = (qn * tau).to(mdt)
    rel = torch.einsum("bthc,ce->bthe", r.to(dt).view(B, T, nH, d_rel), rel_proj.to(dt)) * tau

    last = torch.where(valid, pos, -1).amax(dim=1, keepdim=True).expand(B, T)
    R = k_ring.shape[1]
    ring_rows = valid & (pos > last - R)
    b_i, t_i = ring_rows.nonzero(as_tuple=True)
    s_i, p_i = slot.long()[b_i], pos[b_i, t_i].long()
    k_ring[s_i, p_i % R] = k_in[b_i, t_i]
    v_ring[s_i, p_i % R] = v_in[b_i, t_i]
    if flat_kv:
        return Prep(q_out, rel, k, v)
    b_i, t_i = valid.nonzero(as_tuple=True)
    s_i, p_i = slot.long()[b_i], pos[b_i, t_i].long()
    k_cache[s_i, p_i % cap] = k[b_i, t_i]
    v_cache[s_i, p_i % cap] = v[b_i, t_i]
    return Prep(q_out, rel, None, None)

