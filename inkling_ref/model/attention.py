"""Inkling attention: per-head q/k RMSNorm, short convs on K and V, a relative-logit bias, log-tau.

For a query at position i and a key at position j (d = i - j >= 0), per head h:

    logit(i, j, h) = tau(i) * ( q_i . k_j / hd  +  L_rel[i, h, d] * [d < E] )
    L_rel[i, h, :] = r[i, h, :] @ P                     r = x @ Wr^T, P = rel_proj [d_rel, E]
    tau(i)         = 1 + alpha * ln(max(1, (i + 1) / n_floor))   (global layers with log scaling; else 1)

The scale is 1/hd (not 1/sqrt(hd)): q and k are RMS-normalized per head. Sliding layers see the
last `window` keys including the query's own position and use E = window; global layers see every
earlier key and use E = rel_extent. Query heads share KV heads in groups of nH / nKV (GQA).

Draft trees (`parents`, inkling_ref/tree_paths.py): the new rows sit at positions start + level,
each sees the cached keys and its own ancestors among the new rows (never a sibling's branch), and
the K/V short convs read along the row's path. Positions, distances and windows are otherwise the
same formulas.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from .cache import LayerCache, append
from ..io.config import SLIDING, InklingConfig
from .conv import ShortConv
from .norm import RMSNorm, compute_dtype
from .tree_paths import ancestor_mask, path_levels


def relative_bias(rel_logits: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """rel_logits: [B, h, Tq, E] (L_rel per query), q_pos: [Tq], k_pos: [Tk] -> bias [B, h, Tq, Tk].

    bias[b, h, i, j] = rel_logits[b, h, i, q_pos[i] - k_pos[j]] if 0 <= distance < E else 0."""
    E = rel_logits.shape[-1]
    distance = q_pos[:, None] - k_pos[None, :]  # [Tq, Tk]
    inside = (distance >= 0) & (distance < E)
    index = distance.clamp(0, E - 1).expand(*rel_logits.shape[:2], -1, -1)  # [B, h, Tq, Tk]
    bias = rel_logits.gather(-1, index)
    return bias.masked_fill(~inside, 0.0)


def log_tau(q_pos: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """q_pos: [Tq] -> tau: [Tq] = 1 + alpha * ln(max(1, (pos + 1) / n_floor))."""
    ratio = (q_pos.to(torch.float64) + 1) / n_floor
    return 1.0 + alpha * torch.log(ratio.clamp(min=1.0))


class Attention(nn.Module):
    def __init__(self, config: InklingConfig, kind: str, apply_log_tau: bool):
        super().__init__()
        H = config.hidden_size
        self.kind = kind
        self.num_heads, self.num_kv_heads, self.head_dim, self.extent = config.attention_shape(kind)
        self.window = config.sliding_window if kind == SLIDING else None
        self.n_floor = config.log_scaling_n_floor if (apply_log_tau and kind != SLIDING) else None
        self.alpha = config.log_scaling_alpha
        nH, nKV, hd = self.num_heads, self.num_kv_heads, self.head_dim

        self.q_proj = nn.Linear(H, nH * hd, bias=False)
        self.k_proj = nn.Linear(H, nKV * hd, bias=False)
        self.v_proj = nn.Linear(H, nKV * hd, bias=False)
        self.r_proj = nn.Linear(H, nH * config.d_rel, bias=False)
        self.o_proj = nn.Linear(nH * hd, H, bias=False)
        self.k_conv = ShortConv(nKV * hd, config.conv_kernel_size)
        self.v_conv = ShortConv(nKV * hd, config.conv_kernel_size)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        self.rel_proj = nn.Parameter(torch.zeros(config.d_rel, self.extent))  # P: [d_rel, E]

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None,
                parents: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, H] at positions start..start+T-1 (start = cache length, 0 without cache) -> [B, T, H].

        With a cache, the new K/V rows and conv inputs are appended to it (in row order).
        parents: [T] (optional) the new rows form a tree: row t follows row parents[t] (-1: the last
        cached position), sits at position start + level[t] and attends to the cached keys and to its
        ancestors among the new rows."""
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        hd = self.head_dim

        q = self.q_proj(x)
        k_in, v_in = self.k_proj(x), self.v_proj(x)
        r = self.r_proj(x)
        k = self.k_conv(k_in, past=cache.k_conv_in if cache is not None else None, parents=parents)
        v = self.v_conv(v_in, past=cache.v_conv_in if cache is not None else None, parents=parents)

        q = self.q_norm(rearrange(q, "b t (h d) -> b h t d", d=hd))
        k = self.k_norm(rearrange(k, "b t (g d) -> b g t d", d=hd))
        v = rearrange(v, "b t (g d) -> b g t d", d=hd)
        r = rearrange(r, "b t (h r) -> b h t r", h=self.num_heads)

        if cache is not None:  # keys/values of every position 0..start+T-1
            cache.k_conv_in = append(cache.k_conv_in, k_in, dim=1)
            cache.v_conv_in = append(cache.v_conv_in, v_in, dim=1)
            cache.keys = append(cache.keys, k, dim=2)
            cache.values = append(cache.values, v, dim=2)
            k, v = cache.keys, cache.values

        dt = compute_dtype(x)
        if parents is None:
            q_pos = torch.arange(start, start + T, device=x.device)
            k_pos = torch.arange(0, start + T, device=x.device)
        else:  # tree rows: position = start + level; keys = the cached positions, then the new rows'
            q_pos = start + path_levels(parents)
            k_pos = torch.cat([torch.arange(0, start, device=x.device), q_pos])
        rel_logits = torch.einsum("bhtr,re->bhte", r.to(dt), self.rel_proj.to(dt))  # L_rel [B, nH, T, E]
        bias = relative_bias(rel_logits, q_pos, k_pos)  # [B, nH, T, S]

        q = q.to(dt)
        if self.n_floor is not None:
            tau = log_tau(q_pos, self.n_floor, self.alpha).to(dt)  # [T]
            q = q * rearrange(tau, "t -> 1 1 t 1")
            bias = bias * rearrange(tau, "t -> 1 1 t 1")

        # GQA: query head h = g * n_rep + i reads KV head g
        q = rearrange(q, "b (g i) t d -> b g i t d", g=self.num_kv_heads)
        bias = rearrange(bias, "b (g i) t s -> b g i t s", g=self.num_kv_heads)
        scores = torch.einsum("bgitd,bgsd->bgits", q, k.to(dt)) / hd + bias

        distance = q_pos[:, None] - k_pos[None, :]  # [T, S]
        visible = distance >= 0
        if self.window is not None:
            visible = visible & (distance < self.window)
        if parents is not None:  # among the new rows: only the row itself and its ancestors
            visible = visible & torch.cat([visible.new_ones(T, start), ancestor_mask(parents)], dim=1)
        scores = scores.masked_fill(~visible, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bgits,bgsd->bgitd", probs, v.to(dt))
        out = rearrange(out, "b g i t d -> b t (g i d)").to(x.dtype)
        return self.o_proj(out)
