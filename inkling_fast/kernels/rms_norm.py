"""RMSNorm, and residual-add fused with RMSNorm: one row per program, held whole in registers.

    rms_norm:      y = x * rsqrt(mean(x^2) + eps) * w
    add_rms_norm:  s = x + residual  (rounded to the model dtype: the new residual stream)
                   y = rms_norm(s)

Numerics as the reference (`rms_norm` in inkling_ref/model/norm.py): fp32 math, the weight multiplied in fp32,
one rounding to the model dtype at the end. Shapes: x, residual [..., H] (any leading dimensions that
view as rows without a copy, last dimension contiguous); weight [H].

Program layout: program i takes row i, BLOCK_H = H rounded up to a power of two lanes (masked past
H), so the sum of squares is one in-register reduction and the row is read once. Up to 8 warps keep
16-32 elements per thread at the model widths.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, check_kernel_device, check_tensor, need, starts_like


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, x_row, y_row, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    x = tl.load(x_ptr + row * x_row + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    tl.store(y_ptr + row * y_row + offs, (x * r * w).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, s_ptr, y_ptr, H, x_row, res_row, s_row, y_row, eps,
                         BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    x = tl.load(x_ptr + row * x_row + offs, mask=m, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * res_row + offs, mask=m, other=0.0).to(tl.float32)
    s = (x + res).to(s_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
    tl.store(s_ptr + row * s_row + offs, s, mask=m)
    sf = s.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(sf * sf, 0) / H + eps)
    tl.store(y_ptr + row * y_row + offs, (sf * r * w).to(y_ptr.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# torch twins (the test oracles and benchmark baselines)

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] in x's dtype (fp32 math, one rounding)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] -> (s = x + residual, rms_norm(s)), both in x's dtype."""
    s = (x.float() + residual.float()).to(x.dtype)
    return s, rms_norm_torch(s, weight, eps)


# ---------------------------------------------------------------------------------------------
# wrappers

def _num_warps(H: int) -> int:
    return max(1, min(8, triton.next_power_of_2(H) // 512))


def _check_rows(name: str, t, H: int, like: torch.Tensor | None = None) -> None:
    """t: [..., H] with a contiguous last dimension; with `like`, also of like's shape, dtype and device."""
    if like is None:
        check_tensor(name, t)
    else:
        check_tensor(name, t, like.shape, like.dtype, like.device)
    need(t.dim() >= 1 and t.shape[-1] == H and (t.numel() == 0 or t.stride(-1) == 1),
         f"{name} must have a contiguous last dimension of size {H}, got shape {tuple(t.shape)} strides {t.stride()}")


def _check_common(x: torch.Tensor, weight: torch.Tensor, eps: float) -> int:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    need(x.dim() >= 1 and x.shape[-1] > 0, f"x must be a tensor [..., H] with H > 0, got shape {tuple(x.shape)}")
    check_kernel_device("x", x)
    H = x.shape[-1]
    need(isinstance(weight, torch.Tensor) and weight.shape == (H,), f"weight must be a tensor of shape ({H},), got "
         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, device=x.device, contiguous=True)
    need(isinstance(eps, (int, float)) and eps > 0, f"eps must be a positive number, got {eps!r}")
    return H


def _rows(name: str, t: torch.Tensor, H: int) -> torch.Tensor:
    """A [N, H] view of t (no copy); the kernels take the row stride."""
    try:
        return t.view(-1, H)
    except RuntimeError:
        raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {t.stride()}) cannot be viewed as "
                         "[rows, H] without a copy; pass a tensor whose leading dimensions are contiguous") from None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., H], weight: [H] -> y: [..., H] in x's dtype, written into `out` when given."""
    H = _check_common(x, weight, eps)
    _check_rows("x", x, H)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_rows("out", out, H, like=x)
    x2, y2 = _rows("x", x, H), _rows("out", out, H)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y2, H, x2.stride(0), y2.stride(0), float(eps),
                                         BLOCK_H=triton.next_power_of_2(H), num_warps=_num_warps(H))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_sum: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] -> (s = x + residual, rms_norm(s; weight)).

    `out_sum` may be `residual` (or x) itself, updated in place: each element is read before it is
    written, by the same program. `out` must be a separate buffer."""
    H = _check_common(x, weight, eps)
    _check_rows("x", x, H)
    _check_rows("residual", residual, H, like=x)
    if out_sum is None:
        out_sum = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_rows("out_sum", out_sum, H, like=x)
    _check_rows("out", out, H, like=x)
    need(not starts_like(out, x, residual, out_sum),
         "out must not alias x, residual or out_sum (the normed output is a separate buffer)")
    x2, r2 = _rows("x", x, H), _rows("residual", residual, H)
    s2, y2 = _rows("out_sum", out_sum, H), _rows("out", out, H)
    if x2.shape[0] > 0:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, s2, y2, H, x2.stride(0), r2.stride(0), s2.stride(0),
                                             y2.stride(0), float(eps), BLOCK_H=triton.next_power_of_2(H),
                                             num_warps=_num_warps(H))
    return out_sum, out
