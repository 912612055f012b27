"""The trunk ("backbone"): normed embedding, decoder blocks, final norm, muP-scaled LM head.

    e      = rms(E[id]; embed_norm)
    h      = block_L-1( ... block_0(e))
    H      = rms(h; norm)                       the post-final-norm hidden (MTP depth 0 reads it)
    logits = (H @ W_unembed^T / mup)[..., :unpadded_vocab]

The embedding and the unembedding are separate tensors (never tied).
"""

from __future__ import annotations

import torch
from torch import nn

from .block import InklingBlock
from .cache import TrunkCache
from ..io.config import InklingConfig
from .norm import RMSNorm


class Trunk(nn.Module):
    def __init__(self, config: InklingConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        # starts at zeros (randomize_ or the loader assigns it): from_pretrained runs no initializer, so
        # building the model on the meta device stays cheap (normal_ on a meta tensor imports torch._dynamo)
        self.embed = nn.Embedding.from_pretrained(torch.zeros(config.vocab_size, H), freeze=False)
        self.embed_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            InklingBlock(config, kind, mlp_type, apply_log_tau=config.log_scaling_n_floor is not None)
            for kind, mlp_type in zip(config.layer_types, config.mlp_types))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.unembed = nn.Linear(H, config.vocab_size, bias=False)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] -> rms(E[id]; embed_norm): [B, T, H]."""
        return self.embed_norm(self.embed(input_ids))

    def forward(self, input_ids: torch.Tensor, cache: TrunkCache | None = None,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [B, T] (the new tokens only, when a cache is given) -> H: [B, T, H].
        parents: [T] (optional) the new tokens form a draft tree (inkling_ref/model/tree_paths.py)."""
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache.layers[i] if cache is not None else None, parents)
        return self.norm(h)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] -> logits [..., unpadded_vocab] = (hidden @ W_unembed^T / mup)[..., :V]."""
        logits = self.unembed(hidden / self.config.mup)
        return logits[..., : self.config.vocab_out]
