"""RMSNorm: `x * rsqrt(mean(x^2) + eps) * w`, computed in float32 (or float64 when x is float64)."""

import torch
from torch import nn


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the reference computes sensitive ops in: float64 stays float64, all else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] (same dtype as x)."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(y.dtype)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
