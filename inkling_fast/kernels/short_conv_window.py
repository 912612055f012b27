"""The short-conv kernel of verify / draft windows (2 <= T <= 16 rows): whole sequences a program.

Same contract and same result, bit for bit, as the tile kernel of `inkling_fast.kernels.short_conv`
(see its docstring for the formula, shapes and index rules); that wrapper launches it. A program takes
BLOCK_S whole sequences by BLOCK_C channels and walks their T <= 16 rows (unrolled; T is a constant)
with the K - 1 <= 3 previous inputs in fp32 registers, so each input row is read once from x and the
ring once per sequence (the tile kernel reads every row K times, from x or the ring), and the
positions are scanned once per sequence. All of the first eight rows' loads go out before the first
row is computed; each row buffer is refilled with the row eight ahead when its row is done.

Where it runs (`short_conv.takes_window_kernel`, measured on an H100 against the lean tiles,
docs/benchmarks/tuning.md, 2026-12-05): windows of 2 to 5 rows at any batch (0.1-0.6 µs faster at a few
sequences, 3-10 % at 256 and 1024 x 5 rows), and windows of 6 to 16 rows from 2**21 elements (B * T * C)
on; decode steps (T = 1) and longer windows of few sequences stay on the tiles, which spread a window's
rows over more programs. The H200 sweep of 2026-12-06 (same file) confirms the routing: 1024 x 5
windows 8-13 % faster than the tiles, 256 x 9 windows 8-19 %. Static sm_90a compile (ptxas,
`scripts/short_conv_sass.py`), 1024 x 5 windows, C = 4096 with the residual, (4, 256, 4): 955 SASS
instructions for 5 rows of 8 channels a thread (191 a row) against 420 for one row of the lean tile,
124 registers, no shared memory or barriers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _window_load(t: tl.constexpr, T: tl.constexpr, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES: tl.constexpr):
    # row t of x and of the residual for the program's sequences, [BLOCK_S, BLOCK_C]; rows t >= T: none
    if t < T:
        xv = tl.load(x_base + t * sx_t, mask=m, other=0.0)
        rv = xv
        if HAS_RES:
            rv = tl.load(r_base + t * sres_t, mask=m, other=0.0)
    else:
        xv = zero
        rv = zero
    return xv, rv


@triton.jit
def _window_hist(e: tl.constexpr, p_first, pf_mod, slot_ok, ring_base, m, R, sr_r):
    # the input at position p_first - e (ring row (p_first - e) % R) in fp32; zero before position 0
    rr = pf_mod - e
    rr = tl.where(rr < 0, rr + R, rr)
    ok = (p_first - e >= 0) & slot_ok
    return tl.load(ring_base + tl.where(ok, rr, 0) * sr_r, mask=m & ok, other=0.0).to(tl.float32)


@triton.jit
def _window_row(t: tl.constexpr, T: tl.constexpr, xv, rv, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod,
                slot_ok, m, out_base, ring_base, R, so_t, sr_r,
                K: tl.constexpr, HAS_RES: tl.constexpr, WRITE: tl.constexpr):
    # Output row t of the program's sequences from its input xv and the fp32 inputs h1, h2, h3 at
    # positions p-1, p-2, p-3; w_d: fp32 weights of tap d. Returns the history for row t + 1. The taps
    # are summed in the tile kernel's order (d = K-1 first), so the kernels agree bit for bit.
    if t < T:
        valid = (t >= t_first) & (t < t_stop)  # [BLOCK_S, 1]: the run, row t_first at position p_first
        xf = xv.to(tl.float32)
        conv = tl.zeros_like(xf)
        if K >= 4:
            conv += h3 * w3
        if K >= 3:
            conv += h2 * w2
        if K >= 2:
            conv += h1 * w1
        conv += xf * w0
        y = xf + conv
        if HAS_RES:
            y = y.to(out_base.dtype.element_ty).to(tl.float32) + rv.to(tl.float32)
        y = tl.where(slot_ok, y, float("nan"))  # a bad slot (unchecked): visible, no memory touched
        y = tl.where(valid, y, 0.0)
        tl.store(out_base + t * so_t, y.to(out_base.dtype.element_ty), mask=m)
        if WRITE:  # only when T + K - 1 <= R: the row's ring row (p_first + t - t_first) % R, one wrap
            rr = pf_mod + (t - t_first)
            rr = tl.where(rr >= R, rr - R, rr)
            tl.store(ring_base + tl.where(valid, rr, 0) * sr_r, xv, mask=m & valid & slot_ok)
        # shift the history on valid rows only (rows before the run keep the run's first history)
        h1, h2, h3 = tl.where(valid, xf, h1), tl.where(valid, h1, h2), tl.where(valid, h2, h3)
    return h1, h2, h3


@triton.jit
def _window_kernel(x_ptr, ring_ptr, w_ptr, slot_ptr, pos_ptr, res_ptr, out_ptr,
                   B, C, R, n_slots,
                   sx_b, sx_t, sr_s, sr_r, sw_c, sw_k, sp_b, sp_t, sres_b, sres_t, so_b, so_t,
                   T: tl.constexpr, K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                   HAS_RES: tl.constexpr, WRITE: tl.constexpr):
    # Program (BLOCK_S whole sequences, channel tile), channel tiles adjacent on the 1-D grid; T <= 16
    # a constant, K <= 4. The rows are walked in order with the history in registers (x read once,
    # the ring once per sequence, the positions scanned once); eight buffers hold the next eight
    # rows' loads, all issued before the first row is computed. Per-sequence values are [BLOCK_S, 1].
    n_ct = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    s = (pid // n_ct) * BLOCK_S + tl.arange(0, BLOCK_S)[:, None]
    c = (pid % n_ct) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    s_in = s < B
    m = s_in & (c < C)
    b = tl.where(s_in, s, 0).to(tl.int64)
    x_base = x_ptr + b * sx_b + c
    r_base = res_ptr + b * sres_b + c
    zero = tl.zeros([BLOCK_S, BLOCK_C], dtype=x_ptr.dtype.element_ty)
    xa, ra = _window_load(0, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xb, rb = _window_load(1, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xc, rc = _window_load(2, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xd, rd = _window_load(3, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xe, re = _window_load(4, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xf, rf = _window_load(5, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xg, rg = _window_load(6, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    xh, rh = _window_load(7, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
    slot = tl.load(slot_ptr + b, mask=s_in, other=-1).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < n_slots)
    # Each sequence's valid rows are one run (the index contract): t_first <= t < t_stop, row t_first
    # at p_first, the smallest valid position. Its history, positions p_first - 1 .. p_first - K + 1,
    # comes from the ring: the rows before t_first are padding.
    t_first = tl.full([BLOCK_S, 1], T, tl.int32)
    t_stop = tl.zeros([BLOCK_S, 1], tl.int32)
    p_first = tl.full([BLOCK_S, 1], 2147483647, tl.int32)
    for t in tl.static_range(T):
        p = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=s_in, other=-1)
        t_first = tl.minimum(t_first, tl.where(p >= 0, t, T))
        t_stop = tl.maximum(t_stop, tl.where(p >= 0, t + 1, 0))
        p_first = tl.minimum(p_first, tl.where(p >= 0, p, 2147483647))
    p_first = tl.where(t_first < t_stop, p_first, -1)
    pf_mod = tl.where(p_first >= 0, p_first, 0) % R  # the one division by R
    ring_base = ring_ptr + tl.where(slot_ok, slot, 0) * sr_s + c
    # tap-major weights (sw_c = 1) read as tile-shaped, sequence-broadcast loads (see the tile kernel)
    w0 = tl.load(w_ptr + c * sw_c + (K - 1) * sw_k + 0 * s, mask=m, other=0.0).to(tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    h1 = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    h2 = h1
    h3 = h1
    if K >= 2:
        w1 = tl.load(w_ptr + c * sw_c + (K - 2) * sw_k + 0 * s, mask=m, other=0.0).to(tl.float32)
        h1 = _window_hist(1, p_first, pf_mod, slot_ok, ring_base, m, R, sr_r)
    if K >= 3:
        w2 = tl.load(w_ptr + c * sw_c + (K - 3) * sw_k + 0 * s, mask=m, other=0.0).to(tl.float32)
        h2 = _window_hist(2, p_first, pf_mod, slot_ok, ring_base, m, R, sr_r)
    if K >= 4:
        w3 = tl.load(w_ptr + c * sw_c + (K - 4) * sw_k + 0 * s, mask=m, other=0.0).to(tl.float32)
        h3 = _window_hist(3, p_first, pf_mod, slot_ok, ring_base, m, R, sr_r)
    out_base = out_ptr + b * so_b + c
    # rows i .. i + 7 from the eight buffers, each refilled with the row eight ahead once its row is done
    # (all unrolled: T is a constant; rows t >= T neither load nor compute)
    for i in tl.static_range(0, T, 8):
        h1, h2, h3 = _window_row(i, T, xa, ra, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xa, ra = _window_load(i + 8, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 1, T, xb, rb, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xb, rb = _window_load(i + 9, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 2, T, xc, rc, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xc, rc = _window_load(i + 10, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 3, T, xd, rd, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xd, rd = _window_load(i + 11, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 4, T, xe, re, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xe, re = _window_load(i + 12, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 5, T, xf, rf, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xf, rf = _window_load(i + 13, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 6, T, xg, rg, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xg, rg = _window_load(i + 14, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _window_row(i + 7, T, xh, rh, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, pf_mod, slot_ok, m,
                                 out_base, ring_base, R, so_t, sr_r, K, HAS_RES, WRITE)
        xh, rh = _window_load(i + 15, T, x_base, r_base, m, zero, sx_t, sres_t, HAS_RES)


def window_launch_config(B: int, C: int, T: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_C, num_warps) of `_window_kernel` for B sequences of T rows by C channels: 4
    sequences (one a warp) by 256 channels (8 a thread, 16-byte loads in bf16) when that grid has at
    least 384 programs (about three an SM of an H100 or H200), else by 128 channels (twice the programs).
    Measured on an H100 (tuning.md, 2026-12-05): within 0.4 µs of the best of five configs on each of
    the 36 window cases (T = 2 ... 16, 3 ... 1024 sequences, C = 1024 ... 6144); a fixed 256 loses up to
    0.3 µs at 3 x 5 rows, a fixed 128 up to 1 µs at 64 x 16 rows of C = 6144."""
    block_c = 256 if triton.cdiv(B, 4) * triton.cdiv(C, 256) >= 384 else 128
    return 4, min(block_c, max(16, triton.next_power_of_2(C))), 4
