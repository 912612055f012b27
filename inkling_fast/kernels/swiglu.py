"""SwiGLU on the interleaved output of w13, optionally times global_scale:

    gu = x @ W13^T : [..., 2F], columns g0, u0, g1, u1, ...   (interleaved, never split in halves)
    y  = silu(g) * u * global_scale : [..., F]                 fp32 math, one rounding

The dense MLP is `y = (silu(g) * u) @ W2^T * global_scale`; the down projection is linear, so the
scale may be applied before it (here, for free) instead of after it.

For contiguous tensors element i of y reads elements 2i and 2i + 1 of gu, so the kernel is a flat
1-D loop over y; each program loads one contiguous span of 2 * BLOCK elements of gu (wide vector
loads) and splits it into its even (g) and odd (u) elements in registers.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_kernel_device, check_tensor, need, out_tensor

BLOCK = 2048


@triton.jit
def _swiglu_kernel(gu_ptr, y_ptr, scale_ptr, n, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    pair = 2 * start + tl.arange(0, 2 * BLOCK)          # BLOCK (g, u) pairs: one contiguous span of gu
    gu = tl.load(gu_ptr + pair, mask=pair < 2 * n, other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(gu, [BLOCK, 2]))         # even elements g, odd elements u
    y = g * tl.sigmoid(g) * u
    if HAS_SCALE:
        y = y * tl.load(scale_ptr).to(tl.float32)
    offs = start + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=offs < n)


def swiglu_torch(gu: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """gu: [..., 2F] interleaved -> silu(g) * u (* global_scale): [..., F] in gu's dtype."""
    g, u = gu[..., 0::2].float(), gu[..., 1::2].float()
    y = g * torch.sigmoid(g) * u
    if global_scale is not None:
        y = y * global_scale.float()
    return y.to(gu.dtype)


def swiglu(gu: torch.Tensor, global_scale: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """gu: contiguous [..., 2F] (interleaved g, u); global_scale: a 1-element tensor on the same device
    (read on the device: no sync) or None. Returns y: [..., F] in gu's dtype, into `out` when given."""
    check_tensor("gu", gu, dtypes=FLOAT_DTYPES)
    need(gu.dim() >= 1, "gu must be a tensor [..., 2F]")
    check_kernel_device("gu", gu)
    need(gu.shape[-1] % 2 == 0, f"gu's last dimension must be even (interleaved g, u pairs), got {gu.shape[-1]}")
    need(gu.is_contiguous(), f"gu must be contiguous (shape {tuple(gu.shape)}, strides {gu.stride()})")
    if global_scale is not None:
        need(isinstance(global_scale, torch.Tensor) and global_scale.numel() == 1
             and global_scale.dtype in FLOAT_DTYPES and global_scale.device == gu.device,
             f"global_scale must be a 1-element float tensor on {gu.device}")
    out = out_tensor("out", out, tuple(gu.shape[:-1]) + (gu.shape[-1] // 2,), gu.dtype, gu.device)
    n = out.numel()
    if n > 0:
        scale = global_scale if global_scale is not None else out  # unused by the kernel when HAS_SCALE is off
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](gu, out, scale, n, HAS_SCALE=global_scale is not None,
                                                 BLOCK=BLOCK, num_warps=4)
    return out
