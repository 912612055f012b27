"""The dense SwiGLU MLP (layers < dense_mlp_idx, and every MTP depth).

    [g; u] = x @ W13^T        W13 = w13_dn, rows INTERLEAVED: g0, u0, g1, u1, ...
    y      = (silu(g) * u) @ W2^T * global_scale

Splitting W13 into a top half (gate) and a bottom half (up) instead is a known silent bug:
the model still runs, and is wrong.
"""

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


def swiglu_interleaved(gu: torch.Tensor) -> torch.Tensor:
    """gu: [..., 2F] with g and u interleaved -> silu(g) * u: [..., F]."""
    gu = rearrange(gu, "... (f two) -> ... f two", two=2)
    g, u = gu[..., 0], gu[..., 1]
    return F.silu(g) * u


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)  # interleaved rows
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        return self.down(swiglu_interleaved(self.gate_up(x))) * self.global_scale
