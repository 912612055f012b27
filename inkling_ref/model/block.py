"""The Inkling decoder block (a trunk layer, and the body of every MTP depth).

    a = Attention(rms(h; attn_norm))
    h = h + SConv_attn(a)
    m = MLP_or_MoE(rms(h; mlp_norm))
    h = h + SConv_mlp(m)

Both residual branches go through their own short conv before the add.
"""

import torch
from torch import nn

from .attention import Attention
from .cache import LayerCache, append
from ..io.config import MOE, InklingConfig
from .conv import ShortConv
from .mlp import DenseMLP
from .moe import MoE
from .norm import RMSNorm


class InklingBlock(nn.Module):
    def __init__(self, config: InklingConfig, kind: str, mlp_type: str, apply_log_tau: bool):
        super().__init__()
        H = config.hidden_size
        self.attn_norm = RMSNorm(H, config.rms_norm_eps)
        self.attn = Attention(config, kind, apply_log_tau)
        self.attn_conv = ShortConv(H, config.conv_kernel_size)
        self.mlp_norm = RMSNorm(H, config.rms_norm_eps)
        self.mlp = MoE(config) if mlp_type == MOE else DenseMLP(H, config.dense_intermediate_size)
        self.mlp_conv = ShortConv(H, config.conv_kernel_size)

    def forward(self, h: torch.Tensor, cache: LayerCache | None = None,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """h: [B, T, H] -> [B, T, H]. With a cache: positions continue after it and it is extended.
        parents: [T] (optional) the rows form a draft tree (inkling_ref/tree_paths.py): attention
        and all four short convs follow each row's path instead of the previous row."""
        a = self.attn(self.attn_norm(h), cache, parents)
        h = h + self.attn_conv(a, past=cache.attn_conv_in if cache is not None else None, parents=parents)
        m = self.mlp(self.mlp_norm(h))
        h = h + self.mlp_conv(m, past=cache.mlp_conv_in if cache is not None else None, parents=parents)
        if cache is not None:
            cache.attn_conv_in = append(cache.attn_conv_in, a, dim=1)
            cache.mlp_conv_in = append(cache.mlp_conv_in, m, dim=1)
        return h
