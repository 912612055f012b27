"""RMSNorm, and residual-add fused with RMSNorm: whole rows held in registers, `launch_config` rows per program.

    rms_norm:      y = x * rsqrt(mean(x^2) + eps) * w
    add_rms_norm:  s = x + residual  (rounded to the model dtype: the new residual stream)
                   y = rms_norm(s)

Numerics as the reference (`inkling_ref.norm.rms_norm`): fp32 math, the weight multiplied in fp32,
one rounding to the model dtype at the end. Shapes: x, residual [..., H]; weight [H].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, H, x_row, y_row, eps, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # ROWS rows per program
    offs = tl.arange(0, BLOCK_H)
    h_in = offs < H
    mask = (row < N)[:, None] & h_in[None, :]
    x = tl.load(x_ptr + row[:, None] * x_row + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=h_in, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)                       # [ROWS]
    tl.store(y_ptr + row[:, None] * y_row + offs[None, :], (x * r[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, s_ptr, y_ptr, N, H, x_row, res_row, s_row, y_row, eps,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_H)
    h_in = offs < H
    mask = (row < N)[:, None] & h_in[None, :]
    x = tl.load(x_ptr + row[:, None] * x_row + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row[:, None] * res_row + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (x + res).to(s_ptr.dtype.element_ty)  # the residual stream is kept in the model dtype
    tl.store(s_ptr + row[:, None] * s_row + offs[None, :], s, mask=mask)
    sf = s.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=h_in, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(sf * sf, axis=1) / H + eps)
    tl.store(y_ptr + row[:, None] * y_row + offs[None, :], (sf * r[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=mask)


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

def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_config(H: int, n_rows: int) -> tuple[int, int]:
    """(rows per program, num_warps) of the row kernels of this module (BLOCK_H = next power of 2 of H):
    one row, up to 8 warps (16-32 elements per thread); on the H200 at H = 4096 / 6144 this beat 16
    warps and 2-4 rows per program (docs/benchmarks/tuning.md)."""
    return 1, max(1, min(8, triton.next_power_of_2(H) // 512))


def _check_row_tensor(name: str, t: torch.Tensor, H: int, device: torch.device, dtype: torch.dtype,
                      shape: torch.Size | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of x)")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} (the dtype of x)")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (the shape of x)")
    if t.dim() < 1 or t.shape[-1] != H or (t.numel() > 0 and t.stride(-1) != 1):
        raise ValueError(f"{name} must have a contiguous last dimension of size {H}, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")


def _check_common(x: torch.Tensor, weight: torch.Tensor, eps: float) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor [..., H] with at least one dimension")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported: float32, float16, bfloat16")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"x is on {x.device}: the Triton kernels need CUDA tensors "
                         "(CPU tensors only under TRITON_INTERPRET=1)")
    H = x.shape[-1]
    if H == 0:
        raise ValueError("x has an empty last dimension (H = 0)")
    if not isinstance(weight, torch.Tensor) or weight.shape != (H,):
        raise ValueError(f"weight must be a tensor of shape ({H},), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dtype not in FLOAT_DTYPES or weight.device != x.device or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous float tensor on {x.device}, got {weight.dtype} "
                         f"on {weight.device} with stride {weight.stride()}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
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
    _check_row_tensor("x", x, H, x.device, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_row_tensor("out", out, H, x.device, x.dtype, x.shape)
    x2, y2 = _rows("x", x, H), _rows("out", out, H)
    if x2.shape[0] > 0:
        N = x2.shape[0]
        rows, warps = launch_config(H, N)
        _rms_norm_kernel[(triton.cdiv(N, rows),)](x2, weight, y2, N, H, x2.stride(0), y2.stride(0), float(eps),
                                                  ROWS=rows, BLOCK_H=triton.next_power_of_2(H), num_warps=warps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_sum: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., H] -> (s = x + residual, rms_norm(s; weight)).

    `out_sum` may be `residual` (or x) itself, updated in place: each element is read before it is
    written, by the same program. `out` must be a separate buffer."""
    H = _check_common(x, weight, eps)
    _check_row_tensor("x", x, H, x.device, x.dtype)
    _check_row_tensor("residual", residual, H, x.device, x.dtype, x.shape)
    if out_sum is None:
        out_sum = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _check_row_tensor("out_sum", out_sum, H, x.device, x.dtype, x.shape)
    _check_row_tensor("out", out, H, x.device, x.dtype, x.shape)
    if out.numel() > 0 and out.data_ptr() in (x.data_ptr(), residual.data_ptr(), out_sum.data_ptr()):
        raise ValueError("out must not alias x, residual or out_sum (the normed output is a separate buffer)")
    x2, r2 = _rows("x", x, H), _rows("residual", residual, H)
    s2, y2 = _rows("out_sum", out_sum, H), _rows("out", out, H)
    if x2.shape[0] > 0:
        N = x2.shape[0]
        rows, warps = launch_config(H, N)
        _add_rms_norm_kernel[(triton.cdiv(N, rows),)](x2, r2, weight, s2, y2, N, H, x2.stride(0), r2.stride(0),
                                                      s2.stride(0), y2.stride(0), float(eps), ROWS=rows,
                                                      BLOCK_H=triton.next_power_of_2(H), num_warps=warps)
    return out_sum, out
