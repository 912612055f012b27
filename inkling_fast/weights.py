"""Kernel-ready weights of an `inkling_ref.InklingModel`: one dataclass per block, tensors on the
engine's device in the engine's dtype, in the layouts the kernels take (contiguous, but for the
tap-major output-conv weights below).

What changes from the reference's modules (nothing else does):

* q, k, v and r projections are concatenated into one [nH*hd + 2*nKV*hd + nH*d_rel, H] matrix, so a
  block runs one GEMM for all four (their outputs are column slices of one [B, T, width] tensor).
* short-conv weights [C, 1, K] become [C, K]; those of the attention- and MLP-output convs are stored
  tap-major (a [C, K] view of a contiguous [K, C] tensor: the short-conv kernel then reads each tap's
  C weights as one vector load instead of C strided ones).
* the MoE router bias stays float32 (it only selects experts; a bf16 copy would change which).

The model itself is never modified: tensors are copied when the dtype or device differs (and the
tap-major conv weights always), shared otherwise. Only the first `num_depths` MTP depths are taken.

`load_weights` is the engine's intake: a checkpoint directory, an `InklingModel`, or `ModelWeights`
already on the device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from inkling_ref import InklingModel, load_checkpoint
from inkling_ref.model.attention import Attention
from inkling_ref.model.block import InklingBlock
from inkling_ref.io.config import InklingConfig
from inkling_ref.model.mlp import DenseMLP
from inkling_ref.model.moe import MoE


@dataclass
class AttentionWeights:
    qkvr: torch.Tensor            # [nH*hd + 2*C + nH*d_rel, H]   C = nKV*hd
    o_proj: torch.Tensor          # [H, nH*hd]
    q_norm: torch.Tensor          # [hd]
    k_norm: torch.Tensor          # [hd]
    k_conv: torch.Tensor          # [C, K]
    v_conv: torch.Tensor          # [C, K]
    rel_proj: torch.Tensor        # P: [d_rel, E]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_rel: int
    window: int | None            # sliding window, None on global layers
    log_tau: tuple[int, float] | None   # (n_floor, alpha) where log-tau applies

    @property
    def split(self) -> list[int]:
        """Column widths of the qkvr GEMM output: q, k_in, v_in, r."""
        C = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, C, C, self.num_heads * self.d_rel]


@dataclass
class DenseWeights:
    w13: torch.Tensor             # [2F, H], gate and up rows interleaved
    w2: torch.Tensor              # [H, F]
    global_scale: torch.Tensor    # [1]


@dataclass
class MoEWeights:
    router: torch.Tensor          # [R + S, H]
    router_bias: torch.Tensor     # [R] float32
    gate_global_scale: torch.Tensor  # [1]
    route_scale: float
    top_k: int
    w13: torch.Tensor             # [R, 2F, H]
    w2: torch.Tensor              # [R, H, F]
    shared_w13: torch.Tensor | None  # [S, 2F, H]
    shared_w2: torch.Tensor | None   # [S, H, F]


@dataclass
class BlockWeights:
    """One decoder block: a trunk layer, or the body of an MTP depth."""
    attn_norm: torch.Tensor
    attn: AttentionWeights
    attn_conv: torch.Tensor       # [H, K], tap-major: strides (1, H)
    mlp_norm: torch.Tensor
    mlp: DenseWeights | MoEWeights
    mlp_conv: torch.Tensor        # [H, K], tap-major: strides (1, H)


@dataclass
class DepthWeights:
    hidden_norm: torch.Tensor
    embed_norm: torch.Tensor
    input_proj: torch.Tensor      # [H, 2H]
    block: BlockWeights


@dataclass
class ModelWeights:
    config: InklingConfig
    embed: torch.Tensor           # [V, H]
    embed_norm: torch.Tensor      # [H]
    blocks: list[BlockWeights]
    norm: torch.Tensor            # [H]
    unembed: torch.Tensor         # [V, H]
    depths: list[DepthWeights]
    chain_norm: torch.Tensor | None

    @property
    def eps(self) -> float:
        return self.config.rms_norm_eps

    @property
    def mup(self) -> float:
        return float(self.config.mup)

    @property
    def vocab_out(self) -> int:
        return self.config.vocab_out


def load_weights(source, k: int, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """The kernel-ready weights of the trunk and the first k MTP depths, in dtype on device, from a
    released-layout checkpoint directory, an `InklingModel` (not modified), or `ModelWeights` already in
    `dtype` on `device` (used as they are; e.g. random weights at a scale no host model would fit)."""
    if isinstance(source, ModelWeights):
        if k > len(source.depths):
            raise ValueError(f"num_speculative_tokens={k} needs {k} MTP depths; the weights have {len(source.depths)}")
        on = source.embed.device                                         # "cuda" means any index; "cuda:1" that one
        if source.embed.dtype != dtype or on.type != device.type or device.index not in (None, on.index):
            raise ValueError(f"the weights are {source.embed.dtype} on {source.embed.device}; the engine was asked "
                             f"for {dtype} on {device}")
        return dataclasses.replace(source, depths=source.depths[:k])
    if isinstance(source, InklingModel):
        model = source
        if k > model.num_mtp_depths:
            raise ValueError(f"num_speculative_tokens={k} needs {k} MTP depths; the model has "
                             f"{model.num_mtp_depths} loaded")
    elif isinstance(source, (str, Path)):
        model = load_checkpoint(source, dtype=dtype, device=device, num_mtp_depths=k)
    else:
        raise TypeError("checkpoint_or_model must be a checkpoint directory, an inkling_ref.InklingModel or "
                        f"inkling_fast.weights.ModelWeights, got {type(source).__name__}")
    return from_model(model, k, dtype, device)


def from_model(model: InklingModel, num_depths: int, dtype: torch.dtype, device) -> ModelWeights:
    """The kernel-ready weights of `model`'s trunk and its first `num_depths` MTP depths."""
    def t(x: torch.Tensor, as_dtype: torch.dtype = dtype) -> torch.Tensor:
        return x.detach().to(device=device, dtype=as_dtype).contiguous()

    cfg = model.config
    mtp = model.mtp
    return ModelWeights(
        config=cfg,
        embed=t(model.trunk.embed.weight),
        embed_norm=t(model.trunk.embed_norm.weight),
        blocks=[_block(layer, cfg, t) for layer in model.trunk.layers],
        norm=t(model.trunk.norm.weight),
        unembed=t(model.trunk.unembed.weight),
        depths=[DepthWeights(hidden_norm=t(d.hidden_norm.weight), embed_norm=t(d.embed_norm.weight),
                             input_proj=t(d.input_proj.weight), block=_block(d.block, cfg, t))
                for d in (list(mtp.depths)[:num_depths] if mtp is not None else [])],
        chain_norm=t(mtp.chain_norm.weight) if mtp is not None and mtp.chain_norm is not None else None,
    )


def _block(block: InklingBlock, cfg: InklingConfig, t) -> BlockWeights:
    return BlockWeights(attn_norm=t(block.attn_norm.weight), attn=_attention(block.attn, cfg, t),
                        attn_conv=_tap_major(block.attn_conv.weight, t), mlp_norm=t(block.mlp_norm.weight),
                        mlp=_mlp(block.mlp, t), mlp_conv=_tap_major(block.mlp_conv.weight, t))


def _tap_major(conv_weight: torch.Tensor, t) -> torch.Tensor:
    """[C, 1, K] -> a [C, K] view with strides (1, C) of a contiguous [K, C] copy."""
    return t(conv_weight[:, 0].t()).t()


def _attention(a: Attention, cfg: InklingConfig, t) -> AttentionWeights:
    qkvr = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.r_proj.weight], dim=0)
    return AttentionWeights(
        qkvr=t(qkvr), o_proj=t(a.o_proj.weight), q_norm=t(a.q_norm.weight), k_norm=t(a.k_norm.weight),
        k_conv=t(a.k_conv.weight[:, 0]), v_conv=t(a.v_conv.weight[:, 0]), rel_proj=t(a.rel_proj),
        num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, d_rel=cfg.d_rel,
        window=a.window, log_tau=(a.n_floor, a.alpha) if a.n_floor is not None else None)


def _mlp(mlp: DenseMLP | MoE, t) -> DenseWeights | MoEWeights:
    if isinstance(mlp, DenseMLP):
        return DenseWeights(w13=t(mlp.gate_up.weight), w2=t(mlp.down.weight), global_scale=t(mlp.global_scale))
    shared = mlp.num_shared > 0
    return MoEWeights(
        router=t(mlp.router), router_bias=t(mlp.router_bias, torch.float32),
        gate_global_scale=t(mlp.gate_global_scale), route_scale=float(mlp.route_scale), top_k=mlp.top_k,
        w13=t(mlp.experts_gate_up), w2=t(mlp.experts_down),
        shared_w13=t(mlp.shared_gate_up) if shared else None, shared_w2=t(mlp.shared_down) if shared else None)
