"""How this project compares tensors: one definition, used by the tests, the notebooks and the scripts.

    rel_l2(a, b)                     ||a - b|| / ||b|| in float64; non-finite anywhere gives inf (never passes a bound)
    bits_equal(a, b)                 bit-for-bit equality, NaN payloads included (pure copies such as cache writes)
    assert_close(got, want, tol, what)   rel_l2(got, want) <= tol, else an AssertionError that says what and how far
    cache_rows(cache, name, positions)   rows of a reference LayerCache by position, one row per position

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


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """rel_l2(got, want) <= tol, else AssertionError naming `what` and the error."""
    err = rel_l2(got, want)
    if not err <= tol:
        raise AssertionError(f"{what}: relative L2 error {err:.2e} > {tol:g}")


def cache_rows(cache, name: str, positions: list[int], batch_row: int = 0) -> torch.Tensor:
    """The rows of `positions` in one field of a reference `LayerCache` (batch row `batch_row`),
    position first: keys / values [P, nKV, hd] (stored [B, nKV, n, hd]), conv inputs [P, C]
    (stored [B, n, C]). A position-addressed cache read at the same positions compares directly."""
    t = getattr(cache, name)
    if name in ("keys", "values"):
        return t[batch_row][:, positions].transpose(0, 1)
    return t[batch_row, positions]
