"""The short convolution over a position-addressed conv-input ring (docs/fast_path.md).

    y[b, t] = x[b, t] + sum_{j=0..K-1} w[:, j] * hist_b(pos[b, t] - (K-1) + j)       fp32 accumulation
    out     = y                       or, with the fused residual add,   out = residual + round(y)

hist_b(q) is the conv input of the sequence in slot[b] at position q: from x itself when row q of
the sequence is in this call (row t - d of x holds position pos[b, t] - d), from the ring row q % R
otherwise, and zero for q < 0. The call also stores every input x[b, t] at ring[slot[b], pos[b, t] % R]
(a bit-exact copy). Padding rows (pos = -1) read nothing, write nothing to the ring, and output 0.

Shapes: x, residual, out [B, T, C] (model dtype, last dimension contiguous); ring [slots, R, C]
(same dtype, contiguous); weight [C, K] or [C, 1, K], any strides (tap-major weights, weight[:, j]
contiguous, load each tap as one vector: what `inkling_fast.weights` stores); slot int32 [B];
pos int32 [B, T]. Each row's valid positions form one run of consecutive positions (padding may sit
before or after it), and batch rows with valid positions use distinct slots.

The engine runs it on decode steps (T = 1), draft / verify windows (T = k + 1) and prefill chunks
(one sequence, T up to 256). One kernel serves them all: a program takes BLOCK_R consecutive rows
of the flattened B * T row index by BLOCK_C channels, so windows of a few rows fill whole tiles with
the rows of several sequences, and a long chunk spreads over many programs. Tap d of a row is one
load, of row t - d of x or of a ring row. Channel tiles vary fastest along the 1-D grid: programs
that run together read whole rows (contiguous memory).

Races: a call reads the ring rows of the K-1 positions before its first one and writes the rows of
its own positions. When T + K - 1 <= R (decode steps and windows: the engine's ring has R = K + k
rows) these rows are all distinct, and the kernel writes the ring as it goes (one launch).
Otherwise (prefill chunks) every output is computed first, then `commit_rows` writes each
sequence's last R inputs (a second launch on the same stream). Both are graph-capturable; T and R
are shapes, so the choice never needs the device.

Copy with it: commit_rows.py, common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .commit_rows import commit_rows
from .common import FLOAT_DTYPES, check_kernel_device, check_tensor, need, refuse_sync_in_capture, starts_like


@triton.jit(do_not_specialize=["N", "T"])
def _short_conv_kernel(x_ptr, ring_ptr, w_ptr, slot_ptr, pos_ptr, res_ptr, out_ptr,
                       N, T, C, R, n_slots, sx_b, sx_t, sr_s, sr_r, sw_c, sw_k, sres_b, sres_t, so_b, so_t,
                       K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       HAS_RES: tl.constexpr, WRITE: tl.constexpr):
    # Program: rows r of the flattened [B * T] index (row r is (b, t) = (r // T, r % T); pos is
    # contiguous, so pos[b, t] sits at r) by channels c. Row vectors are [BLOCK_R], tiles [BLOCK_R, BLOCK_C].
    n_ct = tl.cdiv(C, BLOCK_C)
    r = (tl.program_id(0) // n_ct) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (tl.program_id(0) % n_ct) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_in = r < N
    c_in = c < C
    b = tl.where(r_in, r // T, 0)
    t = r - b * T
    p = tl.load(pos_ptr + r, mask=r_in, other=-1)
    slot = tl.load(slot_ptr + b, mask=r_in, other=-1).to(tl.int64)
    slot_ok = (slot >= 0) & (slot < n_slots)
    valid = r_in & (p >= 0)
    tile = r_in[:, None] & c_in[None, :]
    x_rows = x_ptr + (b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t)[:, None] + c[None, :]
    x_t = tl.load(x_rows, mask=tile, other=0.0)
    conv = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        d = K - 1 - j                     # tap j reads position q = p - d
        # the weights of tap j as a row-broadcast tile (one vector load per thread for tap-major
        # weights, already in the tile's layout)
        w_j = tl.load(w_ptr + (c * sw_c + j * sw_k)[None, :] + 0 * r[:, None], mask=tile, other=0.0)
        if d == 0:
            v = x_t.to(tl.float32)
        else:
            q = p - d
            p_prev = tl.load(pos_ptr + r - d, mask=r_in & (t >= d), other=-2)   # pos[b, t - d]
            from_x = valid & (q >= 0) & (p_prev == q)
            from_ring = valid & slot_ok & (q >= 0) & (p_prev != q)
            ring_row = slot * sr_s + (tl.maximum(q, 0) % R).to(tl.int64) * sr_r
            src = tl.where(from_x[:, None], x_rows - d * sx_t, ring_ptr + ring_row[:, None] + c[None, :])
            v = tl.load(src, mask=(from_x | from_ring)[:, None] & c_in[None, :], other=0.0).to(tl.float32)
        conv += v * w_j.to(tl.float32)
    y = x_t.to(tl.float32) + conv
    if HAS_RES:
        res = tl.load(res_ptr + (b.to(tl.int64) * sres_b + t.to(tl.int64) * sres_t)[:, None] + c[None, :],
                      mask=tile, other=0.0)
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) + res.to(tl.float32)
    y = tl.where(slot_ok[:, None], y, float("nan"))     # a bad slot (unchecked): visible, no memory touched
    y = tl.where(valid[:, None], y, 0.0)
    out_rows = out_ptr + (b.to(tl.int64) * so_b + t.to(tl.int64) * so_t)[:, None] + c[None, :]
    tl.store(out_rows, y.to(out_ptr.dtype.element_ty), mask=tile)
    if WRITE:  # only when T + K - 1 <= R: every valid row writes its own ring row
        ring_row = slot * sr_s + (tl.maximum(p, 0) % R).to(tl.int64) * sr_r
        tl.store(ring_ptr + ring_row[:, None] + c[None, :], x_t, mask=(valid & slot_ok)[:, None] & c_in[None, :])


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


def writes_as_it_goes(T: int, K: int, R: int) -> bool:
    """Whether one launch may read the ring and write it: the K-1 positions before the call's first
    one and the call's T positions map to distinct ring rows."""
    return T + K - 1 <= R


def launch_config(C: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): tiles of 4 rows by up to 256 channels (8 bf16 values, one
    16-byte vector, per thread at 4 warps)."""
    block_c = min(256, max(16, triton.next_power_of_2(C)))
    return 4, block_c, max(1, min(4, 4 * block_c // 256))


def short_conv(x: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
               residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
               check: bool = True) -> torch.Tensor:
    """x: [B, T, C] -> out: [B, T, C] (see the module docstring); writes the inputs into `ring`.

    `out` may be `residual` (in place: each element is read and written by one program), never x or
    the ring. `check=True` checks the index contract on the host (one device sync, see
    `check_indices`); pass False inside CUDA graphs (bad slots then give NaN rows, no memory access)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    need(x.dim() == 3, f"x must be a tensor [B, T, C], got shape {tuple(x.shape)}")
    check_kernel_device("x", x)
    B, T, C = x.shape
    dev, dt = x.device, x.dtype
    check_tensor("ring", ring)
    need(ring.dim() == 3 and ring.shape[2] == C, f"ring must be a tensor [slots, R, {C}], got {tuple(ring.shape)}")
    S, R, _ = ring.shape
    check_tensor("ring", ring, dtypes=dt, device=dev)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, device=dev)
    need(weight.dim() in (2, 3) and weight.shape[0] == C and (weight.dim() == 2 or weight.shape[1] == 1)
         and weight.shape[-1] >= 1, f"weight must be [{C}, K] or [{C}, 1, K], got {tuple(weight.shape)}")
    w2 = weight.reshape(C, weight.shape[-1])
    K = w2.shape[1]
    need(R >= max(K - 1, 1), f"ring holds R = {R} rows per slot; it needs at least max(K - 1, 1) = {max(K - 1, 1)}")
    check_tensor("slot", slot, (B,), torch.int32, dev, contiguous=True)
    check_tensor("pos", pos, (B, T), torch.int32, dev, contiguous=True)
    if residual is not None:
        check_tensor("residual", residual, (B, T, C), dt, dev)
    if out is None:
        out = torch.empty((B, T, C), dtype=dt, device=dev)
    check_tensor("out", out, (B, T, C), dt, dev)
    for name, t in (("x", x), ("residual", residual), ("out", out)):
        need(t is None or t.numel() == 0 or t.stride(-1) == 1,
             f"{name} must have a contiguous last dimension, got strides {None if t is None else t.stride()}")
    need(ring.is_contiguous(), f"ring must be contiguous, got strides {ring.stride()}")
    need(not starts_like(out, x, ring),
         "out must not alias x or ring (other programs read them); it may alias residual")
    if B * T == 0 or C == 0:
        return out
    if check:
        refuse_sync_in_capture("check")
        check_indices(slot, pos, S)

    res = residual if residual is not None else x  # unused by the kernel when HAS_RES is off
    one_launch = writes_as_it_goes(T, K, R)
    block_r, block_c, num_warps = launch_config(C)
    _short_conv_kernel[(triton.cdiv(B * T, block_r) * triton.cdiv(C, block_c),)](
        x, ring, w2, slot, pos, res, out, B * T, T, C, R, S,
        x.stride(0), x.stride(1), ring.stride(0), ring.stride(1), w2.stride(0), w2.stride(1),
        res.stride(0), res.stride(1), out.stride(0), out.stride(1),
        K=K, BLOCK_R=block_r, BLOCK_C=block_c, HAS_RES=residual is not None, WRITE=one_launch,
        num_warps=num_warps)
    if not one_launch:  # the reads and writes may overlap: every read above, then the writes
        commit_rows(x, ring, slot, pos)
    return out
