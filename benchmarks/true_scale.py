"""Random kernel-ready weights at true Inkling widths, built directly on the device.

A true-size Inkling-Small `InklingModel` would be ~60 GB of float32 parameters on the host; the
benchmarks of the MTP head and of single trunk layers only need `inkling_fast.weights` dataclasses,
so they are drawn here slice by slice, in bf16, on the GPU (random weights: the timings do not depend
on the values, only on the shapes). The router is drawn so that routing is realistic for a trained,
load-balanced router: logits of std ~2 and a tiny selection bias, so that N tokens touch about as many
distinct experts as uniform top-6 routing would, 256 * (1 - (1 - 6/256)^N) (checked on the CPU at
H = 4096: 6 / 24 / 75-80 / 154-200 distinct experts at N = 1 / 4 / 16 / 64 for bias std 0.02 / 0). A
larger bias (bench_moe.py's 0.2) dominates the saturated sigmoid scores and sends every token to the
same few experts (62 distinct at N = 64), which would make a verify pass look too cheap.

    inkling_small(...)            the Inkling-Small config (spec §4), with its 8 MTP depths
    random_block(cfg, kind, mlp)  one BlockWeights: attention "sliding" | "global", mlp "dense" | "moe"
    random_head(cfg, depths)      ModelWeights with no trunk layers: embedding, LM head, MTP depths
    weight_bytes(x)               bytes of every tensor in a weights dataclass (the HBM floor's weights)
"""

from __future__ import annotations

import dataclasses

import torch

from inkling_fast.weights import (AttentionWeights, BlockWeights, DenseWeights, DepthWeights, ModelWeights,
                                  MoEWeights)
from inkling_fast.cost_model import inkling_small_config
from inkling_ref import InklingConfig


def inkling_small(**changes) -> InklingConfig:
    """Inkling-Small (spec §4, as `inkling_fast.cost_model.inkling_small_config` spells it): H 4096,
    42 layers (7 global), 32 heads, 8 KV heads, head_dim 128, window 512, dense layers 0-1 (16384),
    MoE 256 x top-6 + 2 shared (2048), mup 16, 8 MTP depths (global: 1 and 3)."""
    return InklingConfig(**{**inkling_small_config(), **changes})


def tiny_inkling_small() -> InklingConfig:
    """Inkling-Small's structure (layer mix, depth kinds, routed + shared experts) at widths the Triton
    interpreter runs on the CPU in seconds: the dry runs of the true-width scripts."""
    return inkling_small(hidden_size=64, num_heads=4, num_kv_heads=2, swa_num_heads=4, swa_num_kv_heads=2,
                         head_dim=16, swa_head_dim=16, sliding_window=16, rel_extent=24,
                         dense_intermediate_size=96, moe_intermediate_size=32, n_routed_experts=16,
                         num_experts_per_tok=3, vocab_size=300, unpadded_vocab_size=290, d_rel=4)


class _Draw:
    def __init__(self, device, dtype, seed: int):
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.device, self.dtype = device, dtype

    def normal(self, *shape, std: float, dtype=None) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(1, -1)
        step = max(1, (1 << 26) // max(flat.shape[1], 1))          # ~64M values per slice
        for i in range(0, flat.shape[0], step):
            part = flat[i: i + step]
            part.copy_(torch.randn(part.shape, device=self.device, generator=self.g) * std)
        return out

    def near_one(self, *shape) -> torch.Tensor:
        return 1 + self.normal(*shape, std=0.1)


def random_attention(cfg: InklingConfig, kind: str, draw: _Draw) -> AttentionWeights:
    nH, nKV, hd, E = cfg.attention_shape(kind)
    H, C = cfg.hidden_size, nKV * hd
    rows = nH * hd + 2 * C + nH * cfg.d_rel
    return AttentionWeights(
        qkvr=draw.normal(rows, H, std=H ** -0.5), o_proj=draw.normal(H, nH * hd, std=(nH * hd) ** -0.5),
        q_norm=draw.near_one(hd), k_norm=draw.near_one(hd), k_conv=draw.normal(C, cfg.conv_kernel_size, std=0.3),
        v_conv=draw.normal(C, cfg.conv_kernel_size, std=0.3), rel_proj=draw.normal(cfg.d_rel, E, std=1.0),
        num_heads=nH, num_kv_heads=nKV, head_dim=hd, d_rel=cfg.d_rel,
        window=cfg.sliding_window if kind == "sliding" else None,
        log_tau=(cfg.log_scaling_n_floor, cfg.log_scaling_alpha)
        if kind == "global" and cfg.log_scaling_n_floor is not None else None)


def random_dense(H: int, F: int, draw: _Draw) -> DenseWeights:
    return DenseWeights(w13=draw.normal(2 * F, H, std=H ** -0.5), w2=draw.normal(H, F, std=F ** -0.5),
                        global_scale=draw.near_one(1))


def random_moe(cfg: InklingConfig, draw: _Draw) -> MoEWeights:
    H, F, R, S = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts
    return MoEWeights(
        router=draw.normal(R + S, H, std=2.0 / H ** 0.5), router_bias=draw.normal(R, std=0.005, dtype=torch.float32),
        gate_global_scale=draw.near_one(1), route_scale=float(cfg.route_scale), top_k=cfg.num_experts_per_tok,
        w13=draw.normal(R, 2 * F, H, std=H ** -0.5), w2=draw.normal(R, H, F, std=F ** -0.5),
        shared_w13=draw.normal(S, 2 * F, H, std=H ** -0.5) if S else None,
        shared_w2=draw.normal(S, H, F, std=F ** -0.5) if S else None)


def random_block(cfg: InklingConfig, kind: str, mlp: str | MoEWeights, device="cuda", dtype=torch.bfloat16,
                 seed: int = 0) -> BlockWeights:
    """One block. `mlp`: "dense" (cfg.dense_intermediate_size), "moe", or MoEWeights to share (the
    sliding and global MoE layers of a benchmark can share one 13 GB set of experts)."""
    draw = _Draw(device, dtype, seed)
    H, K = cfg.hidden_size, cfg.conv_kernel_size
    if isinstance(mlp, MoEWeights):
        m = mlp
    elif mlp == "dense":
        m = random_dense(H, cfg.dense_intermediate_size, draw)
    elif mlp == "moe":
        m = random_moe(cfg, draw)
    else:
        raise ValueError(f"mlp must be 'dense', 'moe' or MoEWeights, got {mlp!r}")
    return BlockWeights(attn_norm=draw.near_one(H), attn=random_attention(cfg, kind, draw),
                        attn_conv=draw.normal(H, K, std=0.3), mlp_norm=draw.near_one(H), mlp=m,
                        mlp_conv=draw.normal(H, K, std=0.3))


def random_head(cfg: InklingConfig, num_depths: int, device="cuda", dtype=torch.bfloat16, seed: int = 0) -> ModelWeights:
    """ModelWeights with no trunk blocks: the embedding, the LM head and `num_depths` MTP depths
    (dense MLP of cfg.dense_intermediate_size, attention kind from cfg.mtp_layer_types)."""
    draw = _Draw(device, dtype, seed)
    H, V = cfg.hidden_size, cfg.vocab_size
    depths = [DepthWeights(hidden_norm=draw.near_one(H), embed_norm=draw.near_one(H),
                           input_proj=draw.normal(H, 2 * H, std=(2 * H) ** -0.5),
                           block=random_block(cfg, cfg.mtp_layer_types[m], "dense", device, dtype, seed + 1 + m))
              for m in range(num_depths)]
    return ModelWeights(config=cfg, embed=draw.normal(V, H, std=1.0), embed_norm=draw.near_one(H), blocks=[],
                        norm=draw.near_one(H), unembed=draw.normal(V, H, std=1.0), depths=depths,
                        chain_norm=draw.near_one(H) if cfg.chain_hidden_post_norm else None)


def weight_bytes(x) -> int:
    """Bytes of every tensor reachable in a weights dataclass (or list of them)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(weight_bytes(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(weight_bytes(getattr(x, f.name)) for f in dataclasses.fields(x)
                   if not isinstance(getattr(x, f.name), InklingConfig))
    return 0
