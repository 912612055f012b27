"""`random_model`: a seeded model whose every parameter is non-trivial.

Tests are only as strong as the weights they run on. Default inits (norms at 1, biases at 0, scales
at 1) would hide whole classes of bugs: a missing norm weight, a bias used in the wrong place, a
forgotten global_scale. Here every norm weight and scale is drawn away from 1, and the router's
selection bias is large enough to change which experts are chosen.
"""

from __future__ import annotations

import math

import torch

from ..io.config import InklingConfig
from .model import InklingModel


@torch.no_grad()
def randomize_(model: InklingModel, seed: int = 0) -> InklingModel:
    """Overwrite every parameter of `model` in place, deterministically from `seed`."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=g, dtype=torch.float64) * std

    def away_from_one(shape):  # 1 +- U(0.15, 0.45): never close to 1
        sign = torch.randint(0, 2, shape, generator=g).to(torch.float64) * 2 - 1
        return 1 + sign * (0.15 + 0.3 * torch.rand(shape, generator=g, dtype=torch.float64))

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            v = away_from_one(p.shape)
        elif leaf in ("global_scale", "gate_global_scale"):
            v = away_from_one(p.shape)
        elif name.endswith("conv.weight"):            # short convs: small taps, [C, 1, K]
            v = normal(p.shape, 0.3)
        elif leaf == "rel_proj":                      # relative-logit profiles [d_rel, E]
            v = normal(p.shape, 1.0)
        elif leaf == "router_bias":                   # comparable to the spread of sigmoid scores
            v = normal(p.shape, 0.2)
        elif leaf == "router":
            v = normal(p.shape, 2.0 / math.sqrt(p.shape[-1]))
        elif name.endswith("embed.weight") or name.endswith("unembed.weight"):
            v = normal(p.shape, 1.0)                  # unembed at std 1: logits with a real spread
        elif p.dim() >= 2:                            # projections: variance-preserving
            v = normal(p.shape, 1.0 / math.sqrt(p.shape[-1]))
        else:
            raise AssertionError(f"randomize_ has no rule for parameter {name} {tuple(p.shape)}")
        p.copy_(v.to(p.dtype))
    return model


def random_model(config: InklingConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 num_mtp_depths: int | None = None) -> InklingModel:
    """A seeded `InklingModel` (with its MTP head when the config has one), every parameter randomized."""
    model = InklingModel(config, num_mtp_depths=num_mtp_depths)
    randomize_(model, seed)
    return model.to(dtype).eval()
