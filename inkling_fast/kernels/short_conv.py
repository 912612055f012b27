"""The short convolution over a position-addressed conv-input ring (docs/fast_path.md).

    y[b, t] = x[b, t] + sum_{j=0..K-1} w[:, j] * hist_b(pos[b, t] - (K-1) + j)       fp32 accumulation
    out     = y                       or, with the fused residual add,   out = residual + round(y)

hist_b(p) is the conv input of the sequence in slot[b] at position p: taken from x itself when row
p of the sequence is in this call (row t - d of x holds position pos[b, t] - d), from the ring row
p % R otherwise, and zero for p < 0. The call also writes every input x[b, t] at ring[slot[b],
pos[b, t] % R] (a bit-exact copy). Padding rows (pos = -1) read nothing, write nothing to the
ring, and their output is 0.

Shapes: x, residual, out [B, T, C] (model dtype); ring [slots, R, C] (same dtype); weight [C, K]
or [C, 1, K], any strides: tap-major weights (weight[:, j] contiguous, the transpose of a contiguous
[K, C]; what `inkling_fast.weights` stores) make windows and decode steps faster; slot int32 [B];
pos int32 [B, T]. Each row's valid positions form one run of consecutive positions (padding may sit
before or after it), and batch rows with valid positions use distinct slots.

Three kernels, chosen from host-known sizes (`launch_config`, `takes_window_kernel`,
`strip_launch_config`):
  * tiles, for decode steps, the windows (T <= 16) the window kernel leaves, and K > 4: a program takes
    BLOCK_R consecutive rows of the flattened B * T row index (so windows, T = 1 or k + 1, fill whole
    tiles with the rows of several sequences) by BLOCK_C channels; each tap is a load of the tile's
    rows shifted by d, from x or from the ring. The grid is 1-D, channel tiles of a row tile adjacent.
    Windows of more than LEAN_MIN_ROWS rows take a lean variant (int32 offsets, no load masks; see
    the kernel), when C is a multiple of the channel tile.
  * windows, for verify / draft windows of 2 <= T <= 16 rows with K <= 4 where they measured faster
    (`takes_window_kernel`): a program takes whole sequences by BLOCK_C channels and walks their rows
    with the K-1 previous inputs in registers (`inkling_fast.kernels.short_conv_window`; bit-identical
    to the tiles).
  * strips, for chunks of T > 16 rows (prefill) with K <= 4: a program walks L rows of one sequence
    over BLOCK_C channels, the K-1 previous inputs held in registers, so x is read once; x and the
    residual are loaded four rows ahead of the row being computed (four buffers), so that four rows of
    loads are in flight per warp. Measured on the H200 at C = 6144: 67 % of copy bandwidth with the
    tiles, 88 % with 32-row strips, 87 % with the 16-row strips of today (docs/benchmarks/kernels.md).

Races: a call reads ring rows of the K-1 positions before its first one and writes the rows of
its own positions. When T + K - 1 <= R these rows are all distinct and one launch does both.
Otherwise (long prefill chunks) the wrapper splits the work in two launches on the stream: first
every output (ring reads, no writes; tiles, windows or strips), then the ring writes, each ring row taking
the last position of the call that maps to it: one program per (sequence, channel tile) finds the
last valid row and copies the last R valid rows (`_ring_write_kernel`). Both launches are
graph-capturable; T and R are shapes, so the choice never needs the device.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .short_conv_window import _window_kernel, window_launch_config

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _short_conv_kernel(x_ptr, ring_ptr, w_ptr, slot_ptr, pos_ptr, res_ptr, out_ptr, zero_ptr,
                       N, T, C, R, n_slots,
                       sx_b, sx_t, sr_s, sr_r, sw_c, sw_k, sp_b, sp_t, sres_b, sres_t, so_b, so_t,
                       K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       HAS_RES: tl.constexpr, WRITE: tl.constexpr, T_CONST: tl.constexpr, W_TILE: tl.constexpr,
                       LEAN: tl.constexpr):
    # A tile is BLOCK_R consecutive rows of the flattened [B * T] row index (rows of several
    # sequences when T is small: decode and verify windows waste no lanes on padding to a power of
    # two) by BLOCK_C channels. Row r is (b, t) = (r // T, r % T).
    # Channel tiles vary fastest along the 1-D grid: programs running together cover whole rows
    # (contiguous memory), not one channel strip of many rows (short runs, rows of C apart).
    # LEAN (large windows; the wrapper checks C % BLOCK_C == 0 and that every offset fits int32):
    # fewer instructions per element, for a kernel near the SM's issue limit there: int32 offsets,
    # no channel masks, and no row masks on loads: rows past N re-read row N - 1 (their stores stay
    # masked), and a tap that reads nothing reads the zero row `zero_ptr` instead of a masked load.
    n_ct = tl.cdiv(C, BLOCK_C)
    r = (tl.program_id(0) // n_ct) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (tl.program_id(0) % n_ct) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_in = r < N
    if LEAN:
        c_in = c >= 0  # all true: the compiler drops the channel masks
        r_ld = tl.minimum(r, N - 1)
    else:
        c_in = c < C
        r_ld = r
    # T_CONST > 0 (windows and decode, T <= 16): the division by T is one by a constant (a multiply)
    TT = T_CONST if T_CONST > 0 else T
    b = r_ld // TT
    t = r_ld - b * TT
    if LEAN:
        t_off = t
        slot = tl.load(slot_ptr + b)
        p = tl.where(r_in, tl.load(pos_ptr + b * sp_b + t * sp_t), -1)
    else:
        b = tl.where(r_in, b, 0).to(tl.int64)
        t_off = t.to(tl.int64)
        slot = tl.load(slot_ptr + b, mask=r_in, other=-1).to(tl.int64)
        p = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=r_in, other=-1)
    slot_ok = (slot >= 0) & (slot < n_slots)
    valid = r_in & (p >= 0)
    valid_slot = valid & slot_ok
    ld_mask = r_in[:, None] & c_in[None, :]  # (not used when LEAN)
    p_mod = tl.where(valid, p, 0) % R  # the one division by R: tap d's ring row is p_mod - d, wrapped once
    x_row = b * sx_b + t_off * sx_t
    if LEAN:
        x_cur = tl.load(x_ptr + x_row[:, None] + c[None, :])
    else:
        x_cur = tl.load(x_ptr + x_row[:, None] + c[None, :], mask=ld_mask, other=0.0)
    if HAS_RES:
        res_ptrs = res_ptr + (b * sres_b + t_off * sres_t)[:, None] + c[None, :]
        if LEAN:
            res = tl.load(res_ptrs)
        else:
            res = tl.load(res_ptrs, mask=ld_mask, other=0.0)
    conv = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        d = K - 1 - j  # a constexpr: tap j reads position p - d
        if W_TILE:
            # tap-major weights (sw_c = 1) read as a tile-shaped, row-broadcast load: each thread holds one
            # row, so this is one vector load per thread, in the tile's own layout (a 1-D load would be
            # re-laid out through shared memory, with barriers, for every tap)
            w_ptrs = w_ptr + (c * sw_c + j * sw_k)[None, :] + 0 * r[:, None]
            if LEAN:
                w_j = tl.load(w_ptrs).to(tl.float32)
            else:
                w_j = tl.load(w_ptrs, mask=ld_mask, other=0.0).to(tl.float32)
        else:
            w_j = tl.load(w_ptr + c * sw_c + j * sw_k, mask=c_in, other=0.0).to(tl.float32)[None, :]
        if d == 0:
            v = x_cur.to(tl.float32)
        else:
            tp = t - d
            if LEAN:
                p_prev = tl.where(tp >= 0, tl.load(pos_ptr + b * sp_b + tl.maximum(tp, 0) * sp_t), -2)
            else:
                p_prev = tl.load(pos_ptr + b * sp_b + tp * sp_t, mask=r_in & (tp >= 0), other=-2)
            q = p - d
            from_x = valid & (q >= 0) & (p_prev == q)  # position q is row t - d of x
            from_ring = valid_slot & (q >= 0) & (p_prev != q)
            q_mod = p_mod - d                               # q % R, as d <= K - 1 <= R
            q_mod = tl.where(q_mod < 0, q_mod + R, q_mod)
            # one load per tap, from x or from the ring: a pointer per row (fewer registers and
            # loads than reading both and selecting, so more programs fit an SM)
            ring_row = slot * sr_s + tl.where(from_ring, q_mod, 0).to(slot.dtype) * sr_r
            x_src = x_ptr + (x_row - d * sx_t)[:, None] + c[None, :]
            ring_src = ring_ptr + ring_row[:, None] + c[None, :]
            if LEAN:
                src = tl.where(from_x[:, None], x_src, tl.where(from_ring[:, None], ring_src, zero_ptr + c[None, :]))
                v = tl.load(src).to(tl.float32)
            else:
                src = tl.where(from_x[:, None], x_src, ring_src)
                v = tl.load(src, mask=(from_x | from_ring)[:, None] & c_in[None, :], other=0.0).to(tl.float32)
        conv += v * w_j
    y = x_cur.to(tl.float32) + conv
    if HAS_RES:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
    y = tl.where(slot_ok[:, None], y, float("nan"))  # a bad slot (unchecked): visible, no memory touched
    y = tl.where(valid[:, None], y, 0.0)
    out_row = b * so_b + t_off * so_t
    tl.store(out_ptr + out_row[:, None] + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=r_in[:, None] & c_in[None, :])

    if WRITE:
        # only in the one-launch case, T + K - 1 <= R: the call's T <= R positions map to distinct
        # ring rows, so every valid row writes its own
        ring_row = slot * sr_s + tl.where(valid_slot, p_mod, 0).to(slot.dtype) * sr_r
        tl.store(ring_ptr + ring_row[:, None] + c[None, :], x_cur, mask=valid_slot[:, None] & c_in[None, :])


@triton.jit
def _strip_hist(d: tl.constexpr, t, p, b, slot, slot_ok, c, c_in, x_ptr, ring_ptr, pos_ptr, R,
                sx_b, sx_t, sr_s, sr_r, sp_b, sp_t):
    # The input at position q = p - d, for the row t (position p) where a strip's run of valid rows
    # starts: row t - d of x when it holds q, else the ring row q % R, else (q < 0) zero. p = -1: zero.
    q = p - d
    tp = t - d
    p_prev = tl.load(pos_ptr + b * sp_b + tl.maximum(tp, 0) * sp_t)
    from_x = (q >= 0) & (tp >= 0) & (p_prev == q)
    from_ring = (q >= 0) & (~from_x) & slot_ok
    x_src = x_ptr + b * sx_b + tl.maximum(tp, 0).to(tl.int64) * sx_t + c
    ring_src = ring_ptr + slot * sr_s + (tl.maximum(q, 0) % R).to(tl.int64) * sr_r + c
    # (a vector & scalar-bool mask is spelled with where: the Triton 3.9 interpreter rejects the other)
    return tl.load(tl.where(from_x, x_src, ring_src), mask=tl.where(from_x | from_ring, c_in, False), other=0.0)


@triton.jit
def _strip_load(t, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES: tl.constexpr):
    # row t of x and of the residual (zeros past the strip's last row)
    m = tl.where(t < t_end, c_in, False)
    xv = tl.load(x_row + t.to(tl.int64) * sx_t, mask=m, other=0.0)
    rv = xv
    if HAS_RES:
        rv = tl.load(res_row + t.to(tl.int64) * sres_t, mask=m, other=0.0)
    return xv, rv


@triton.jit
def _strip_row(t, xv, rv, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, p_first, t_end, b, slot, slot_ok, c, c_in,
               ring_ptr, out_ptr, R, sr_s, sr_r, so_b, so_t,
               K: tl.constexpr, HAS_RES: tl.constexpr, WRITE: tl.constexpr):
    # One output row t of a strip, from its input xv and the inputs h1, h2, h3 at positions p-1, p-2, p-3
    # (model dtype); w_d: fp32 weights of tap d (w[:, K-1-d]). Returns the history for row t + 1.
    # The taps are summed in the tile kernel's order (d = K-1 first), so the two agree bit for bit.
    valid = (t >= t_first) & (t < t_stop)  # the strip's run: row t at position p_first + t - t_first
    xf = xv.to(tl.float32)
    conv = tl.zeros_like(xf)
    if K >= 4:
        conv += h3.to(tl.float32) * w3
    if K >= 3:
        conv += h2.to(tl.float32) * w2
    if K >= 2:
        conv += h1.to(tl.float32) * w1
    conv += xf * w0
    y = xf + conv
    if HAS_RES:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + rv.to(tl.float32)
    y = tl.where(slot_ok, y, float("nan"))  # a bad slot (unchecked): visible, no memory touched
    y = tl.where(valid, y, 0.0)
    tl.store(out_ptr + b * so_b + t.to(tl.int64) * so_t + c, y.to(out_ptr.dtype.element_ty),
             mask=tl.where(t < t_end, c_in, False))
    if WRITE:  # only when T + K - 1 <= R (see the tile kernel)
        ring_row = (tl.where(valid, p_first + t - t_first, 0) % R).to(tl.int64)
        tl.store(ring_ptr + slot * sr_s + ring_row * sr_r + c, xv, mask=tl.where(valid & slot_ok, c_in, False))
    # shift the history on valid rows only (rows before the run keep the run's first history)
    return tl.where(valid, xv, h1), tl.where(valid, h1, h2), tl.where(valid, h2, h3)


@triton.jit
def _strip_kernel(x_ptr, ring_ptr, w_ptr, slot_ptr, pos_ptr, res_ptr, out_ptr,
                  T, C, R, n_slots,
                  sx_b, sx_t, sr_s, sr_r, sw_c, sw_k, sp_b, sp_t, sres_b, sres_t, so_b, so_t,
                  K: tl.constexpr, L: tl.constexpr, BLOCK_C: tl.constexpr, HAS_RES: tl.constexpr,
                  WRITE: tl.constexpr):
    # Program (sequence b, strip of rows t0 .. t0 + L - 1, channel tile), channel tiles adjacent on
    # the 1-D grid. K <= 4: the history is three registers h1, h2, h3 (unused ones stay zero).
    n_ct = tl.cdiv(C, BLOCK_C)
    n_strips = tl.cdiv(T, L)
    pid = tl.program_id(0)
    c = (pid % n_ct) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_in = c < C
    t0 = ((pid // n_ct) % n_strips) * L
    b = (pid // (n_ct * n_strips)).to(tl.int64)
    t_end = tl.minimum(t0 + L, T)
    x_row = x_ptr + b * sx_b + c
    res_row = res_ptr + b * sres_b + c
    # the first four rows' loads go out before anything else
    xa, ra = _strip_load(t0, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
    xb, rb = _strip_load(t0 + 1, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
    xc, rc = _strip_load(t0 + 2, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
    xd, rd = _strip_load(t0 + 3, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < n_slots)
    # The strip's valid rows are one run (the index contract): t_first <= t < t_stop, row t_first at
    # position p_first (the smallest). One scan of L positions instead of a load per row.
    tt = t0 + tl.arange(0, L)
    pp = tl.load(pos_ptr + b * sp_b + tl.minimum(tt, T - 1) * sp_t)
    ok = (tt < t_end) & (pp >= 0)
    t_first = tl.min(tl.where(ok, tt, t_end), 0)
    t_stop = tl.max(tl.where(ok, tt + 1, 0), 0)
    p_first = tl.where(t_first < t_stop, tl.min(tl.where(ok, pp, 2147483647), 0), -1)
    w0 = tl.load(w_ptr + c * sw_c + (K - 1) * sw_k, mask=c_in, other=0.0).to(tl.float32)
    w1 = w0
    w2 = w0
    w3 = w0
    h1 = tl.zeros([BLOCK_C], dtype=x_ptr.dtype.element_ty)
    h2 = h1
    h3 = h1
    if K >= 2:
        w1 = tl.load(w_ptr + c * sw_c + (K - 2) * sw_k, mask=c_in, other=0.0).to(tl.float32)
        h1 = _strip_hist(1, t_first, p_first, b, slot, slot_ok, c, c_in, x_ptr, ring_ptr, pos_ptr, R,
                         sx_b, sx_t, sr_s, sr_r, sp_b, sp_t)
    if K >= 3:
        w2 = tl.load(w_ptr + c * sw_c + (K - 3) * sw_k, mask=c_in, other=0.0).to(tl.float32)
        h2 = _strip_hist(2, t_first, p_first, b, slot, slot_ok, c, c_in, x_ptr, ring_ptr, pos_ptr, R,
                         sx_b, sx_t, sr_s, sr_r, sp_b, sp_t)
    if K >= 4:
        w3 = tl.load(w_ptr + c * sw_c + (K - 4) * sw_k, mask=c_in, other=0.0).to(tl.float32)
        h3 = _strip_hist(3, t_first, p_first, b, slot, slot_ok, c, c_in, x_ptr, ring_ptr, pos_ptr, R,
                         sx_b, sx_t, sr_s, sr_r, sp_b, sp_t)
    # Four rows per iteration; each buffer is refilled with the row four ahead as soon as its row is
    # done (buffers are only ever overwritten by loads: no copies at the loop's back edge, which would
    # wait for the loads to land).
    for i in range(0, L, 4):
        t = t0 + i
        h1, h2, h3 = _strip_row(t, xa, ra, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, p_first, t_end, b, slot,
                                slot_ok, c, c_in, ring_ptr, out_ptr, R, sr_s, sr_r, so_b, so_t, K, HAS_RES, WRITE)
        xa, ra = _strip_load(t + 4, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _strip_row(t + 1, xb, rb, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, p_first, t_end, b, slot,
                                slot_ok, c, c_in, ring_ptr, out_ptr, R, sr_s, sr_r, so_b, so_t, K, HAS_RES, WRITE)
        xb, rb = _strip_load(t + 5, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _strip_row(t + 2, xc, rc, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, p_first, t_end, b, slot,
                                slot_ok, c, c_in, ring_ptr, out_ptr, R, sr_s, sr_r, so_b, so_t, K, HAS_RES, WRITE)
        xc, rc = _strip_load(t + 6, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)
        h1, h2, h3 = _strip_row(t + 3, xd, rd, h1, h2, h3, w0, w1, w2, w3, t_first, t_stop, p_first, t_end, b, slot,
                                slot_ok, c, c_in, ring_ptr, out_ptr, R, sr_s, sr_r, so_b, so_t, K, HAS_RES, WRITE)
        xd, rd = _strip_load(t + 7, t_end, x_row, res_row, c_in, sx_t, sres_t, HAS_RES)


@triton.jit
def _ring_write_kernel(x_ptr, ring_ptr, slot_ptr, pos_ptr, T, C, R, n_slots, sx_b, sx_t, sr_s, sr_r, sp_b, sp_t,
                       BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    # The ring writes of a long chunk, after every read (second launch). Program (b, channel tile):
    # the valid rows are one run of consecutive positions, so the ring rows the call leaves behind
    # are those of its last min(R, count) valid rows, positions p_last - i (i < R map to distinct
    # ring rows; every earlier position of the call maps to a ring row a later one also maps to).
    # One scan of pos[b] (ints: cheap next to the rows) gives the run's last row, its length and
    # its last position (the largest valid one); the slot load goes out with it. Then the copy:
    # two dependent round trips in all.
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    t_last = tl.full([BLOCK_T], -1, tl.int32)
    p_last = tl.full([BLOCK_T], -1, tl.int32)
    count = tl.zeros([BLOCK_T], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        p = tl.load(pos_ptr + b * sp_b + t * sp_t, mask=t < T, other=-1)
        t_last = tl.maximum(t_last, tl.where(p >= 0, t, -1))
        p_last = tl.maximum(p_last, p)
        count += (p >= 0).to(tl.int32)
    t_last = tl.max(t_last, 0)
    p_last = tl.max(p_last, 0)
    count = tl.sum(count, 0)
    i = tl.arange(0, BLOCK_W)
    # count = 0: no valid row, no write. (A vector & scalar-bool mask is spelled with where: the
    # Triton 3.9 interpreter rejects the other spelling.)
    keep = tl.where((slot >= 0) & (slot < n_slots), (i < R) & (i < count), False)
    x_row = b * sx_b + (t_last - i).to(tl.int64) * sx_t
    ring_row = slot * sr_s + (tl.where(keep, p_last - i, 0) % R).to(tl.int64) * sr_r
    m = keep[:, None] & (c < C)[None, :]
    v = tl.load(x_ptr + x_row[:, None] + c[None, :], mask=m, other=0.0)
    tl.store(ring_ptr + ring_row[:, None] + c[None, :], v, mask=m)


# ---------------------------------------------------------------------------------------------
# torch twin

def short_conv_torch(x: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor,
                     pos: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `short_conv` (ring updated in place, all reads before all writes), in plain
    vectorized torch with no host sync, so that it can be captured in a CUDA graph."""
    B, T, C = x.shape
    S, R, _ = ring.shape
    w = weight.reshape(C, -1).float()
    K = w.shape[1]
    pos = pos.long()
    valid = pos >= 0                                                # [B, T]
    slot_ok = ((slot >= 0) & (slot < S))[:, None]                   # [B, 1]
    s = slot.long().clamp(0, S - 1)[:, None]                        # gather index; bad slots are masked
    t = torch.arange(T, device=x.device)
    xf = x.float()
    conv = torch.zeros_like(xf)
    for j in range(K):  # over taps, not tokens
        d = K - 1 - j
        if d == 0:
            v = xf
        else:
            q = pos - d                                             # the position tap j reads
            tp = (t - d).clamp(min=0)
            from_x = valid & (q >= 0) & (t >= d) & (pos[:, tp] == q)  # row t - d of this call holds q
            from_ring = valid & slot_ok & (q >= 0) & ~from_x
            vr = ring[s, q.clamp(min=0) % R].float()                # [B, T, C]
            v = torch.where(from_x[..., None], xf[:, tp], torch.where(from_ring[..., None], vr, 0.0))
        conv = conv + v * w[:, j]
    y = xf + conv
    if residual is not None:
        y = y.to(x.dtype).float() + residual.float()
    y = torch.where(slot_ok[..., None], y, float("nan"))
    out = torch.where(valid[..., None], y, 0.0).to(x.dtype)

    # ring writes: row t writes unless row t + R (same ring row, later position) is in the call
    later = torch.full_like(pos, -1)
    if T > R:
        later[:, : T - R] = pos[:, R:]
    keep = (valid & slot_ok & (later < 0)).reshape(-1)
    tgt_s = s.expand(B, T).reshape(-1)
    tgt_r = (pos.clamp(min=0) % R).reshape(-1)
    src = x.reshape(B * T, C)
    # Sync-free masked write: a row that must not write repeats the write of the first kept row g
    # (same target, same value); when no row is kept, every row rewrites ring[0, 0] with itself.
    g = torch.argmax(keep.int()).view(1)
    any_keep = keep.any()
    tgt_s = torch.where(keep, tgt_s, torch.where(any_keep, tgt_s.index_select(0, g), 0))
    tgt_r = torch.where(keep, tgt_r, torch.where(any_keep, tgt_r.index_select(0, g), 0))
    fallback = torch.where(any_keep, src.index_select(0, g), ring[0, 0:1])
    ring.index_put_((tgt_s, tgt_r), torch.where(keep[:, None], src, fallback))
    return out


# ---------------------------------------------------------------------------------------------
# wrapper

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of x)")


def check_indices(slot: torch.Tensor, pos: torch.Tensor, n_slots: int) -> None:
    """Host-side check (one device sync) of the index contract: pos >= -1; each row's valid positions
    one run of consecutive positions; slots of rows with valid positions in range and distinct."""
    valid = pos >= 0
    has = valid.any(dim=1)
    steps = (pos[:, 1:] - pos[:, :-1] != 1) & valid[:, 1:] & valid[:, :-1]
    starts = (valid[:, 1:] & ~valid[:, :-1]).sum(dim=1) + valid[:, 0].long()
    used = torch.where(has, slot.long(), -1 - torch.arange(len(slot), device=slot.device)).sort().values
    flags = torch.stack([(pos < -1).any(), steps.any(), (starts > 1).any(),
                         (has & ((slot < 0) | (slot >= n_slots))).any(),
                         (used[1:] == used[:-1]).any()]).tolist()  # rows without valid positions: -1 - b
    problems = ["pos has values below -1 (-1 marks padding)",
                "pos is not consecutive within a row",
                "a row of pos has valid positions separated by padding (they must form one run)",
                f"slot out of range [0, {n_slots}) for a row with valid positions",
                "two batch rows with valid positions use the same slot"]
    for bad, msg in zip(flags, problems):
        if bad:
            raise ValueError(msg)


def launch_config(n_rows: int, C: int, T: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of the tile kernel for n_rows = B * T flattened rows of C channels.
    Measured on the H200 (docs/benchmarks/tuning.md, A/B of 2026-12-03): decode and verify windows
    (T <= 16) are fastest with 4 x 256 tiles and 4 warps, long chunks (now only those with K > 4: the
    others take strips) with 16 x 256 tiles and 4 warps. Decode steps of up to 16
    sequences (T = 1) take one row per program, 256 channels, 2 warps: 0.2-0.7 µs faster than 4 x 256
    at 1 x 1 and 16 x 1 (tile sweep of 2026-12-03, fourth session)."""
    if T == 1 and n_rows <= 16:
        block_r, block_c, warps = 1, 256, 2
    else:
        block_r, block_c, warps = (4, 256, 4) if T <= 16 else (16, 256, 4)
    block_c = min(block_c, max(16, triton.next_power_of_2(C)))
    return block_r, block_c, max(1, min(warps, block_r * block_c // 128))  # >= 1 value per thread


LEAN_MIN_ROWS = 64  # windows of more rows take the lean tile kernel (T <= 16; measured, tuning.md)
_ZERO_ROWS: dict = {}


def _zero_row(C: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A cached row of at least C zeros (what the lean tile kernel's taps read instead of masked
    loads). Allocated outside CUDA-graph capture only: None when it would have to be made inside one
    (the caller then launches the masked kernel)."""
    key = (dtype, str(device))
    z = _ZERO_ROWS.get(key)
    if z is None or z.numel() < C:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        z = _ZERO_ROWS[key] = torch.zeros(max(C, 8192), dtype=dtype, device=device)
    return z


def _fits_int32(*tensors: torch.Tensor) -> bool:
    """Every element offset of these tensors (their extent, from the strides) fits int32, with room
    for the -d * stride of the taps."""
    return all(1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) < 2**31 - 2**24 for t in tensors)


WINDOW_MAX_K = 4                 # the window kernel keeps up to 3 previous inputs in registers
WINDOW_ANY_B_MAX_T = 5           # windows of 2 ... 5 rows take it at any batch
WINDOW_MIN_ELEMENTS = 2 ** 21    # windows of 6 ... 16 rows from this many elements (B * T * C) on


def takes_window_kernel(B: int, T: int, C: int) -> bool:
    """Whether B sequences of T rows by C channels (K <= WINDOW_MAX_K) take the window kernel rather than
    the tiles. Measured on an H100 against the lean tiles (2026-12-05, 48 cases; raw lines lost,
    docs/benchmarks/tuning.md says what remains): faster or equal at T = 2 and 5 for 3 ... 1024
    sequences; slower at T = 1 (decode: the tiles put one row a program) and at T = 9 and 16 with 16
    sequences or 64 x 16 x 1024 (too few programs for a serial walk of the rows), faster there from
    2**21 elements on. T = 3, 4 and 6 ... 8 were not measured (interpolated). Re-timed on the H200
    (tuning.md, 2026-12-06, same 48 cases): the routed kernel is the faster in 44; the other four are
    within 0.1 µs, or a 256 x 1 decode step at C = 1024 that the window kernel would run 0.4 µs faster."""
    return 2 <= T <= 16 and (T <= WINDOW_ANY_B_MAX_T or B * T * C >= WINDOW_MIN_ELEMENTS)


STRIP_MIN_T = 17   # chunks of more rows than a verify / draft window take the strip kernel (K <= 4)
STRIP_MAX_K = 4


def strip_launch_config(C: int) -> tuple[int, int, int]:
    """(L, BLOCK_C, num_warps) of `_strip_kernel`: 16 rows, 128 channels (4 a thread), one warp.
    Measured on an H100 (2026-12-05, raw lines lost; ring-write launch included), against
    nine configs on 4 x 4096 and 1 x 2048 rows at C = 1024 ... 6144: the best or within 0.5 µs of it on
    seven of the eight cases, 1.4 µs (6 %) behind 32 x 128 at 1 x 2048, C = 4096; 0.9-5.9 µs faster
    than the earlier choice (32 rows; 256 channels below C = 4096, from an H200 A/B of 2026-12-04)
    on 4 x 4096 rows at C >= 2048 and 2.7-4.0 µs at 1 x 2048 rows at C <= 2048; slower by 0.3 µs at
    4 x 4096, C = 1024 and by 1.3 µs at 1 x 2048, C = 4096. On the H200 (tuning.md, 2026-12-06) it has
    the smallest total of the nine configs over those eight cases; per case it is 0.6-3.4 µs behind the
    best at six of them and the best at 1 x 2048 rows of C = 1024 and 2048."""
    return 16, 128, 1


def write_launch_config(T: int, C: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) of `_ring_write_kernel`: the scan of pos in pieces of at most
    4096 rows (one piece for the usual prefill chunks), 256 channels a program (the R rows it copies
    are one tile, sized by the wrapper). Measured on the H200 (A/B of 2026-12-04, tenth session):
    0.5-0.9 µs faster per prefill chunk than 1024 channels at C = 1024 ... 6144 (4x the programs at
    C >= 1024; why that helps was not profiled), bit-identical."""
    return min(4096, max(16, triton.next_power_of_2(T))), max(16, min(256, triton.next_power_of_2(C))), 4


def short_conv(x: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
               residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               check: bool = True) -> torch.Tensor:
    """x: [B, T, C] -> out: [B, T, C] (see the module docstring); writes the inputs into `ring`.

    `out` may be `residual` (in place: each element is read and written by one program), never x or
    the ring. `check=True` checks the index contract on the host (one device sync, see
    `check_indices`); pass False inside CUDA graphs (bad slots then give NaN rows, no memory access)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in FLOAT_DTYPES:
        raise ValueError("x must be a float32/float16/bfloat16 tensor [B, T, C]")
    if x.device.type != "cuda" and not _interpreting():
        raise ValueError(f"x is on {x.device}: the Triton kernels need CUDA tensors "
                         "(CPU tensors only under TRITON_INTERPRET=1)")
    B, T, C = x.shape
    dev, dt = x.device, x.dtype
    if not isinstance(ring, torch.Tensor) or ring.dim() != 3 or ring.shape[2] != C:
        raise ValueError(f"ring must be a tensor [slots, R, {C}], got "
                         f"{tuple(ring.shape) if isinstance(ring, torch.Tensor) else type(ring).__name__}")
    S, R, _ = ring.shape
    _check_tensor("ring", ring, (S, R, C), dt, dev)
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3) or weight.shape[0] != C \
            or (weight.dim() == 3 and weight.shape[1] != 1):
        raise ValueError(f"weight must be [{C}, K] or [{C}, 1, K], got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    w2 = weight.reshape(C, weight.shape[-1])
    K = w2.shape[1]
    if K < 1 or weight.dtype not in FLOAT_DTYPES or weight.device != dev:
        raise ValueError(f"weight must be a float tensor with K >= 1 on {dev}, got {weight.dtype} on {weight.device}")
    if R < max(K - 1, 1):
        raise ValueError(f"ring holds R = {R} rows per slot; it needs at least max(K - 1, 1) = {max(K - 1, 1)}")
    _check_tensor("slot", slot, (B,), torch.int32, dev)
    _check_tensor("pos", pos, (B, T), torch.int32, dev)
    if residual is not None:
        _check_tensor("residual", residual, (B, T, C), dt, dev)
    if out is None:
        out = torch.empty((B, T, C), dtype=dt, device=dev)
    _check_tensor("out", out, (B, T, C), dt, dev)
    for name, t in (("x", x), ("ring", ring), ("residual", residual), ("out", out)):
        if t is not None and t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if out.numel() > 0 and out.data_ptr() in (x.data_ptr(), ring.data_ptr()):
        raise ValueError("out must not alias x or ring (other programs read them); it may alias residual")
    if B * T == 0 or C == 0:
        return out
    if check:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("check=True syncs with the device; pass check=False inside a CUDA graph")
        check_indices(slot, pos, S)

    res = residual if residual is not None else x  # unused by the kernels when HAS_RES is off
    strides = (x.stride(0), x.stride(1), ring.stride(0), ring.stride(1), w2.stride(0), w2.stride(1),
               pos.stride(0), pos.stride(1), res.stride(0), res.stride(1), out.stride(0), out.stride(1))
    one_launch = T + K - 1 <= R  # the rows this call reads and the rows it writes are disjoint
    if T >= STRIP_MIN_T and K <= STRIP_MAX_K:
        L, block_c, num_warps = strip_launch_config(C)
        _strip_kernel[(B * triton.cdiv(T, L) * triton.cdiv(C, block_c),)](
            x, ring, w2, slot, pos, res, out, T, C, R, S, *strides, K=K, L=L, BLOCK_C=block_c,
            HAS_RES=residual is not None, WRITE=one_launch, num_warps=num_warps)
    elif T <= 16 and K <= WINDOW_MAX_K and takes_window_kernel(B, T, C):
        block_s, block_c, num_warps = window_launch_config(B, C, T)
        _window_kernel[(triton.cdiv(B, block_s) * triton.cdiv(C, block_c),)](
            x, ring, w2, slot, pos, res, out, B, C, R, S, *strides, T=T, K=K, BLOCK_S=block_s, BLOCK_C=block_c,
            HAS_RES=residual is not None, WRITE=one_launch, num_warps=num_warps)
    else:
        block_r, block_c, num_warps = launch_config(B * T, C, T)
        grid = (triton.cdiv(B * T, block_r) * triton.cdiv(C, block_c),)
        # windows and decode: T as a constant, tap-major weights (C contiguous) read in the tile's layout
        small = T <= 16
        zero = (_zero_row(C, dt, dev) if small and B * T > LEAN_MIN_ROWS and C % block_c == 0
                and _fits_int32(x, ring, res, out, w2) else None)
        lean = zero is not None
        _short_conv_kernel[grid](x, ring, w2, slot, pos, res, out, zero if lean else x,
                                 B * T, T, C, R, S, *strides,
                                 K=K, BLOCK_R=block_r, BLOCK_C=block_c, HAS_RES=residual is not None,
                                 WRITE=one_launch, T_CONST=T if small else 0, W_TILE=small and w2.stride(0) == 1,
                                 LEAN=lean, num_warps=num_warps)
    if not one_launch:  # the reads and writes may overlap: every read above, then the writes
        bt, bc, ww = write_launch_config(T, C)
        _ring_write_kernel[(B, triton.cdiv(C, bc))](
            x, ring, slot, pos, T, C, R, S, x.stride(0), x.stride(1), ring.stride(0), ring.stride(1),
            pos.stride(0), pos.stride(1), BLOCK_T=bt, BLOCK_W=max(2, triton.next_power_of_2(R)), BLOCK_C=bc,
            num_warps=ww)
    return out
