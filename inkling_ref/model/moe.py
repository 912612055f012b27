"""The mixture of experts: sigmoid router with a selection-only bias, routed + shared experts.

For one token x (R routed experts, S shared, top-k):

    z      = x @ W_gate^T                          [R + S] router logits, float32
    chosen = top-k over e < R of sigmoid(z_e) + bias_e      (the bias only picks; it never weighs)
    A      = chosen + the S shared experts
    w_a    = sigmoid(z_a) / sum_{b in A} sigmoid(z_b) * route_scale * gate_global_scale
    out    = sum_{a in A} w_a * Expert_a(x)         each expert a SwiGLU with interleaved w13

The reference loops over experts: slow and obvious.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..io.config import InklingConfig
from .mlp import swiglu_interleaved
from .norm import compute_dtype


class MoE(nn.Module):
    def __init__(self, config: InklingConfig):
        super().__init__()
        H, Fm = config.hidden_size, config.moe_intermediate_size
        R, S = config.n_routed_experts, config.n_shared_experts
        self.num_routed, self.num_shared, self.top_k = R, S, config.num_experts_per_tok
        self.route_scale = config.route_scale
        self.router = nn.Parameter(torch.zeros(R + S, H))             # W_gate: routed rows, then shared
        self.router_bias = nn.Parameter(torch.zeros(R))               # selection-only bias
        self.gate_global_scale = nn.Parameter(torch.ones(1))
        self.experts_gate_up = nn.Parameter(torch.zeros(R, 2 * Fm, H))  # interleaved rows
        self.experts_down = nn.Parameter(torch.zeros(R, H, Fm))
        self.shared_gate_up = nn.Parameter(torch.zeros(S, 2 * Fm, H))
        self.shared_down = nn.Parameter(torch.zeros(S, H, Fm))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, H] -> (chosen [N, k] routed ids, routed weights [N, k], shared weights [N, S])."""
        dt = compute_dtype(x)
        z = x.to(dt) @ self.router.to(dt).T                           # [N, R + S]
        s = torch.sigmoid(z)
        chosen = torch.topk(s[:, : self.num_routed] + self.router_bias.to(dt), self.top_k, dim=-1).indices
        active = torch.cat([s.gather(1, chosen), s[:, self.num_routed:]], dim=1)  # [N, k + S]
        w = active / active.sum(dim=1, keepdim=True) * self.route_scale * self.gate_global_scale.to(dt)
        return chosen, w[:, : self.top_k], w[:, self.top_k:]

    @staticmethod
    def expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """One SwiGLU expert: x [N, H], gate_up [2F, H] interleaved, down [H, F] -> [N, H]."""
        return F.linear(swiglu_interleaved(F.linear(x, gate_up)), down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, w_routed, w_shared = self.route(x)
        out = torch.zeros_like(x, dtype=w_routed.dtype)
        for e in range(self.num_routed):
            token, slot = torch.where(chosen == e)
            if token.numel():
                y = self.expert(x[token], self.experts_gate_up[e], self.experts_down[e])
                out.index_add_(0, token, y.to(out.dtype) * w_routed[token, slot, None])
        for s in range(self.num_shared):
            y = self.expert(x, self.shared_gate_up[s], self.shared_down[s])
            out += y.to(out.dtype) * w_shared[:, s, None]
        return out.to(x.dtype).reshape(shape)
