"""The tail of a long call written into a position-addressed buffer: a conv-input ring or a KV cache.

    dst[slot[b], p % KEEP] = src[b, t]    for each valid row t (position p = pos[b, t] >= 0) that no
                                          later row of the call overwrites: row t + KEEP is padding or
                                          past T (the valid rows of a batch row hold consecutive
                                          positions, so row t + KEEP, if valid, holds p + KEEP)

src [B, T, C] (last dimension contiguous), dst [slots, KEEP, ...] contiguous with C elements per row,
slot int32 [B], pos int32 [B, T] contiguous. The rows written are each batch row's last min(KEEP, n)
positions: distinct destination rows, so one launch has no race. A call whose rows do not fit its
buffer (T > KEEP) cannot write while it still reads the buffer's history; its kernels first read
everything, then this launch writes (short_conv, attention_prep in flat_kv mode, attention_prefill).

Program (row b * T + t, channel tile): a row that does not write loads nothing. Slots outside
[0, slots) write nothing (no memory is touched for them).

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import both, need


@triton.jit(do_not_specialize=["T", "KEEP"])
def _commit_rows_kernel(src_ptr, dst_ptr, slot_ptr, pos_ptr, T, KEEP, C, n_slots, stride_b, stride_t,
                        BLOCK_C: tl.constexpr):
    row = tl.program_id(0)                  # b * T + t
    b = (row // T).to(tl.int64)             # int64: b * stride_b can pass 2^31 for long prompts
    t = row % T
    p = tl.load(pos_ptr + row)
    later = tl.load(pos_ptr + row + KEEP, mask=t + KEEP < T, other=-1)   # pos[b, t + KEEP]
    s = tl.load(slot_ptr + b).to(tl.int64)
    ok = (p >= 0) & (later < 0) & (s >= 0) & (s < n_slots)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = both(c < C, ok)
    x = tl.load(src_ptr + b * stride_b + t * stride_t + c, mask=m)
    tl.store(dst_ptr + (s * KEEP + tl.maximum(p, 0) % KEEP) * C + c, x, mask=m)


def commit_rows(src: torch.Tensor, dst: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor) -> None:
    """Write each batch row's last positions of src [B, T, C] into dst [slots, KEEP, ...] at row
    p % KEEP (see the module docstring). One launch, no host sync."""
    B, T = pos.shape
    KEEP = dst.shape[1]
    C = dst[0, 0].numel()
    need(src.dim() == 3 and tuple(src.shape) == (B, T, C) and src.stride(-1) == 1,
         f"commit_rows: src must be [B={B}, T={T}, {C}] with a contiguous last dimension, got {tuple(src.shape)}")
    need(dst.is_contiguous() and src.dtype == dst.dtype,
         f"commit_rows: dst must be contiguous and of src's dtype {src.dtype}, got {dst.dtype}")
    need(pos.is_contiguous() and slot.shape == (B,), "commit_rows: pos must be contiguous [B, T], slot [B]")
    if B * T == 0:
        return
    BLOCK_C = min(1024, triton.next_power_of_2(C))
    _commit_rows_kernel[(B * T, triton.cdiv(C, BLOCK_C))](
        src, dst, slot, pos, T, KEEP, C, dst.shape[0], src.stride(0), src.stride(1), BLOCK_C=BLOCK_C, num_warps=4)
