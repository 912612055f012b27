"""How this project compares tensors: one definition, used by the tests, the notebooks and the scripts.

    rel_l2(a, b)       ||a - b|| / ||b|| in float64; non-finite anywhere gives inf (never passes a bound)
    bits_equal(a, b)   bit-for-bit equality, NaN payloads included (pure copies such as cache writes)

Tolerances (docs/fast_path.md): float32 against float64 far under 1e-5, bf16 under 1e-2.
"""

from __future__ import annotations

import torch

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| computed in float64 on the CPU. Shapes must match; NaN or inf in a or b gives inf."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b have the same shape, dtype and bit pattern (NaN poison compares equal to itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
