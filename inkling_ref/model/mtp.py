"""The MTP head: up to 8 depth blocks, each predicting one token further ahead.

Depth m at position p reads h_prev (depth 0: the trunk's post-final-norm hidden H_p; depth m > 0:
depth m-1's output at p) and the id x = x_{p+m+1} of the token after it, and predicts x_{p+m+2}:

    e   = rms(rms(E[x]; backbone_embed_norm); embed_norm_m)    double-normed embedding
    c   = [rms(h_prev; hidden_norm_m) | e]                      hidden FIRST, then embedding
    y   = InklingBlock_m(c @ W_input_proj_m^T)                  full block, dense MLP
    out = rms(y; chain_norm) if chain_hidden_post_norm else y   -> h_prev of depth m+1
    logits = (out @ W_unembed^T / mup)[..., :V]                 NO trunk final norm

E, backbone_embed_norm and W_unembed are the trunk's own tensors, shared, never copied: the head
below holds only its own parameters, and the model passes the trunk in.
"""

from __future__ import annotations

import torch
from torch import nn

from .block import InklingBlock
from .cache import LayerCache
from ..io.config import DENSE, InklingConfig
from .norm import RMSNorm


class MTPDepth(nn.Module):
    def __init__(self, config: InklingConfig, kind: str):
        super().__init__()
        H = config.hidden_size
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.embed_norm = RMSNorm(H, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * H, H, bias=False)
        log_tau = config.mtp_apply_log_scaling and config.log_scaling_n_floor is not None
        self.block = InklingBlock(config, kind, DENSE, apply_log_tau=log_tau)

    def forward(self, h_prev: torch.Tensor, token_embed: torch.Tensor,
                cache: LayerCache | None = None, parents: torch.Tensor | None = None) -> torch.Tensor:
        """h_prev: [B, T, H]; token_embed: [B, T, H] = the trunk's normed embedding rms(E[x]; embed_norm)
        of the tokens x_{p+m+1}. Returns the block output y: [B, T, H].
        parents: [T] (optional) the rows form a draft tree (inkling_ref/tree_paths.py)."""
        e = self.embed_norm(token_embed)  # the second norm of the double-normed embedding
        c = torch.cat([self.hidden_norm(h_prev), e], dim=-1)  # [B, T, 2H], hidden first
        return self.block(self.input_proj(c), cache, parents)


class MTPHead(nn.Module):
    def __init__(self, config: InklingConfig, num_depths: int):
        super().__init__()
        self.depths = nn.ModuleList(MTPDepth(config, config.mtp_layer_types[m]) for m in range(num_depths))
        self.chain_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.chain_hidden_post_norm else None

    def __len__(self) -> int:
        return len(self.depths)

    def chain(self, y: torch.Tensor) -> torch.Tensor:
        """Depth output -> what the LM head and the next depth read."""
        return self.chain_norm(y) if self.chain_norm is not None else y
