"""The short convolution ("sconv"): a depthwise causal conv over time with an internal residual.

    y[t, c] = x[t, c] + sum_{j=0..K-1} w[c, j] * x[t - (K-1) + j, c]      (x before the sequence = 0)

Tap K-1 multiplies the current token. Each Inkling layer has four of them (on K, on V, on the
attention output, on the MLP output). The state a cached forward needs is the last K-1 *inputs*
(never outputs): `past` below. Rows of a draft tree read their window along their own path
instead of the previous rows: `parents` below (inkling_ref/tree_paths.py).
"""

import torch
from einops import rearrange
from torch import nn

from .norm import compute_dtype
from .tree_paths import conv_window_index


class ShortConv(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        # torch grouped-conv layout, as stored in checkpoints: [C, 1, K]
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel_size))

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, C] new inputs; past: [B, P, C] earlier inputs of the same sequence (P >= 0, only
        the last K-1 are used). Returns y: [B, T, C] in x's dtype, accumulated in float32 (or float64).

        parents: [T] (optional) row t follows row parents[t] (-1: the last past input) instead of row
        t-1; its window is the K inputs ending at t along that path (tree_paths.conv_window_index)."""
        K = self.kernel_size
        B, T, C = x.shape
        dt = compute_dtype(x)
        if past is None:
            past = x.new_zeros(B, 0, C)
        past = past[:, -(K - 1):] if K > 1 else past[:, :0]
        missing = (K - 1) - past.shape[1]  # positions before the sequence start read as zero
        history = torch.cat([x.new_zeros(B, missing, C), past.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
        if parents is None:
            windows = history.to(dt).unfold(1, K, 1)  # [B, T, C, K]; windows[b, t, c, j] = x[t-(K-1)+j]
        else:  # windows[b, t, c, j] = history[index[t, j]]: the path's inputs, oldest first
            index = conv_window_index(parents, K)  # [T, K]
            windows = rearrange(history.to(dt)[:, index], "b t k c -> b t c k")
        w = rearrange(self.weight, "c 1 k -> c k").to(dt)
        y = x.to(dt) + torch.einsum("btck,ck->btc", windows, w)
        return y.to(x.dtype)
