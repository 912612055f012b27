"""Trunk and MTP-depth forwards on the fast kernels, over position-addressed caches.

Every forward takes a batch of B rows x T tokens: row b uses cache slot `slot[b]` and its token t
sits at absolute position `pos[b, t]` (-1: a padding token, which reads and writes no cache).

    block:  x = rms(h; attn_norm)
            q | k_in | v_in | r = x @ W_qkvr^T                   one GEMM (torch/cuBLAS)
            q', L_rel', K/V, conv rings = attention_prep(...)     k/v short convs, norms, tau, cache writes
            o = attention(q', L_rel', KV cache)                   decode/window kernel, or prefill kernel
            h = h + SConv_attn(o @ W_o^T)                         short_conv with the residual fused
            h = h + SConv_mlp(MLP(rms(h; mlp_norm)))              dense: GEMM, swiglu, GEMM; or MoE kernels
    trunk:  H = rms(block_L-1(... block_0(embed_norm(ids))); norm)
    depth:  out = block_m([rms(h_prev; hidden_norm) | rms(rms(E[x]); embed_norm)] @ W_in^T)  (+ chain_norm)

`prefill=True` runs long calls (prompts, chunks of them): attention_prep in flat_kv mode and the
prefill attention, which reads the call's own keys from flat tensors and writes the cache after.
`prefill=False` is the T = k+1 window/verify path (one attention_prep launch writes rings and cache).
No host synchronization anywhere: these functions run inside CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .caches import LayerCache
from .kernels.attention_decode import attention_decode
from .kernels.attention_prefill import attention_prefill
from .kernels.attention_prep import attention_prep
from .kernels.embed_norm import embed_norm
from .kernels.lm_head_argmax import lm_head_argmax
from .kernels.lm_head_rows import lm_head_rows
from .kernels.moe import MAX_TOKENS, moe
from .kernels.moe_grouped import moe_grouped
from .kernels.mtp_input import mtp_input
from .kernels.rms_norm import rms_norm
from .kernels.short_conv import short_conv
from .kernels.swiglu import swiglu
from .weights import BlockWeights, DenseWeights, ModelWeights, MoEWeights

# Few-token kernels below these sizes, many-token designs from them on (both give the same results up to
# float32 summation order; tests force each path by setting these).
# MoE: `moe` (one program per touched expert, <= 256 tokens) below, `moe_grouped` from here on. The
# threshold is the token count from which the grouped path is the faster one at both the demo
# checkpoint's and Inkling-Small's MoE sizes, as benchmarks/bench_many_tokens.py measures them.
MANY_TOKENS = 32
MANY_ROWS = 65        # greedy LM head: `lm_head_argmax` (streams W once per 64 rows) below, `lm_head_rows` from here


def block_forward(w: BlockWeights, cache: LayerCache, h: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
                  eps: float, prefill: bool) -> torch.Tensor:
    """h: [B, T, H] (not modified) -> the block's output [B, T, H]; writes the block's cache rows."""
    B, T, _ = h.shape
    a = w.attn
    x = rms_norm(h, w.attn_norm, eps)
    q, k_in, v_in, r = F.linear(x, a.qkvr).split(a.split, dim=-1)
    prep = attention_prep(q, k_in, v_in, r, q_norm=a.q_norm, k_norm=a.k_norm, k_conv=a.k_conv, v_conv=a.v_conv,
                          rel_proj=a.rel_proj, k_ring=cache.k_ring, v_ring=cache.v_ring, k_cache=cache.k,
                          v_cache=cache.v, slot=slot, pos=pos, eps=eps, log_tau=a.log_tau, flat_kv=prefill)
    if prefill:
        o = attention_prefill(prep.q, prep.rel, prep.k, prep.v, cache.k, cache.v, slot, pos, window=a.window)
    else:
        o = attention_decode(prep.q, prep.rel, cache.k, cache.v, slot, pos, window=a.window)
    o = F.linear(o.view(B, T, -1), a.o_proj)
    h = short_conv(o, cache.attn_ring, w.attn_conv, slot, pos, residual=h, check=False)
    m = mlp_forward(w.mlp, rms_norm(h, w.mlp_norm, eps))
    return short_conv(m, cache.mlp_ring, w.mlp_conv, slot, pos, residual=h, out=h, check=False)


def mlp_forward(w: DenseWeights | MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H] -> [B, T, H]. Dense: (silu(g) * u * global_scale) @ W2^T. MoE over the N = B * T
    tokens: the few-token kernels (`moe`) for N < MANY_TOKENS, the grouped GEMM (`moe_grouped`, any N)
    from MANY_TOKENS or past `moe`'s limit of 256 tokens on."""
    if isinstance(w, DenseWeights):
        return F.linear(swiglu(F.linear(x, w.w13), w.global_scale), w.w2)
    flat = x.reshape(-1, x.shape[-1])
    many = flat.shape[0] >= MANY_TOKENS or flat.shape[0] > MAX_TOKENS
    out = (moe_grouped if many else moe)(flat, w.router, w.router_bias, w.gate_global_scale, w.route_scale, w.top_k,
                                         w.w13, w.w2, w.shared_w13, w.shared_w2)
    return out.view(x.shape)


def trunk_forward(W: ModelWeights, caches: list[LayerCache], ids: torch.Tensor, slot: torch.Tensor,
                  pos: torch.Tensor, prefill: bool = False) -> torch.Tensor:
    """ids: int [B, T] -> the post-final-norm hiddens H: [B, T, H]."""
    h = embed_norm(ids, W.embed, W.embed_norm, W.eps, check_ids=False)
    for block, cache in zip(W.blocks, caches):
        h = block_forward(block, cache, h, slot, pos, W.eps, prefill)
    return rms_norm(h, W.norm, W.eps)


def depth_forward(W: ModelWeights, m: int, cache: LayerCache, h_prev: torch.Tensor, ids: torch.Tensor,
                  slot: torch.Tensor, pos: torch.Tensor, prefill: bool = False) -> torch.Tensor:
    """MTP depth m on rows whose token slots hold `ids` [B, T] (the tokens x_{p+m+1}) with hidden
    inputs h_prev [B, T, H] (H_p for depth 0). Returns the depth's output [B, T, H]: the next depth's
    h_prev and what the LM head reads."""
    d = W.depths[m]
    c = mtp_input(h_prev.contiguous(), ids, W.embed, d.hidden_norm, W.embed_norm, d.embed_norm, W.eps,
                  check_ids=False)
    y = block_forward(d.block, cache, F.linear(c, d.input_proj), slot, pos, W.eps, prefill)
    return rms_norm(y, W.chain_norm, W.eps) if W.chain_norm is not None else y


def greedy_tokens(W: ModelWeights, h: torch.Tensor, scores_out: torch.Tensor | None = None) -> torch.Tensor:
    """h: [N, H] -> argmax over the unpadded vocabulary of h @ W_unembed^T (float32 dot products, ties to the
    lowest id): int64 [N]. `lm_head_argmax` for N < MANY_ROWS, `lm_head_rows` (the same contract) from there.
    scores_out (float32 [N], optional) gets the maximum logit of each row: NaN or infinite where h is."""
    head = lm_head_rows if h.shape[0] >= MANY_ROWS else lm_head_argmax
    return head(h.contiguous(), W.unembed, W.vocab_out, W.mup, vals_out=scores_out)[0]


def logits(W: ModelWeights, h: torch.Tensor) -> torch.Tensor:
    """h: [..., H] -> (h / mup) @ W_unembed^T, the unpadded vocabulary: [..., V_out] (as Trunk.readout)."""
    return F.linear(h / W.mup, W.unembed)[..., : W.vocab_out]
