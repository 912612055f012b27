"""Prefill attention: many query rows per sequence (a prompt, or a chunk of one), then the KV cache
write of the call's keys.

The path, for one layer:

    prep = attention_prep(..., flat_kv=True)          # q', L_rel', flat k and v; conv rings written
    out  = attention_prefill(prep.q, prep.rel, prep.k, prep.v, k_cache, v_cache, slot, pos, window=...)

A prompt may be longer than a sliding layer's ring (cap = window + k + 1 rows), so its keys cannot
all sit in the cache, and writing them first would overwrite history that the first queries still
need. So attention reads the call's own keys from the flat k/v tensors and only the history (the
positions before each row's first one, e.g. an earlier chunk) from the cache; the cache is written
afterwards, with the keys of the last `cap` positions of each row (distinct ring rows: no race).

It is the kernel of attention_decode.py (a tiled flash-attention over the position-addressed cache)
launched with query tiles of max(1, 64 // G) window rows times the G heads of a KV head, one
program per (batch row, KV head, query tile), no split-KV (the query tiles give the parallelism),
and FLAT_KV on. Known cost: L_rel' is materialized by the prep ([B, T, nH, E] fp32, 128 KB per
token for Inkling-Small's global layers) — the price of sharing one kernel and one bias layout
with decode; a production prefill would compute the bias from r and P in the kernel.

Copy with it: attention_decode.py, commit_rows.py, common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch

from .attention_decode import attend_torch, launch_attention, validate_attention_args
from .commit_rows import commit_rows
from .common import check_tensor, need, out_tensor


def attention_prefill(q, rel, k_new, v_new, k_cache, v_cache, slot, pos, *, window: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, T, nH, hd], rel: [B, T, nH, E] fp32, k_new/v_new: [B, T, nKV, hd] (the call's keys, from
    attention_prep(flat_kv=True)), k_cache/v_cache: [slots, cap, nKV, hd] holding the history before
    each row's first position, slot: int32 [B], pos: int32 [B, T] (-1 = padding; the valid rows of a
    batch row hold consecutive positions). Returns out [B, T, nH, hd]; afterwards the cache holds the
    keys of each row's last min(cap, n) positions. Three launches (attention, then the cache writes of K and V)."""
    B, T, nH, hd, nKV, cap, E = validate_attention_args(q, rel, k_cache, v_cache, slot, pos, window)
    for name, x in (("k_new", k_new), ("v_new", v_new)):  # attention_prep(flat_kv=True)'s k and v
        check_tensor(name, x, (B, T, nKV, hd), q.dtype, q.device, contiguous=True)
    need(window is None or cap >= window,
         f"k_cache: a sliding ring of cap={cap} rows cannot hold the window={window} keys")
    out = out_tensor("out", out, tuple(q.shape), q.dtype, q.device)
    G = nH // nKV
    launch_attention(q, rel, k_cache, v_cache, k_new, v_new, slot, pos, window, 1, out, block_t=max(1, 64 // G))
    if B * T:
        commit_rows(k_new.view(B, T, nKV * hd), k_cache, slot, pos)
        commit_rows(v_new.view(B, T, nKV * hd), v_cache, slot, pos)
    return out


def attention_prefill_torch(q, rel, k_new, v_new, k_cache, v_cache, slot, pos, *, window: int | None = None):
    """The vectorized-torch twin of `attention_prefill` (same arguments, same cache writes)."""
    B, T = pos.shape
    cap = k_cache.shape[1]
    valid = pos >= 0
    t_idx = torch.arange(T, device=pos.device)
    last = torch.where(valid, pos, -1).amax(dim=1)                                   # [B]
    first = torch.where(valid, pos, 2**30).amin(dim=1)                                # first position
    off = torch.where(valid, pos - t_idx, 2**30).amin(dim=1)                          # position - row
    lo = (first - window + 1).clamp(min=0) if window is not None else torch.zeros_like(first)
    num_keys = max(1, int((last - lo + 1).max().item()))
    key_pos = last[:, None] - num_keys + 1 + torch.arange(num_keys, device=pos.device)  # [B, n]
    key_pos = torch.where(key_pos >= 0, key_pos, -1)
    s = slot.long()[:, None]
    from_cache_k = k_cache[s, key_pos.clamp(min=0) % cap]
    from_cache_v = v_cache[s, key_pos.clamp(min=0) % cap]
    in_call = key_pos >= first[:, None]
    call_row = (key_pos - off[:, None]).clamp(0, T - 1)
    b_idx = torch.arange(B, device=pos.device)[:, None]
    keys = torch.where(in_call[..., None, None], k_new[b_idx, call_row], from_cache_k)
    values = torch.where(in_call[..., None, None], v_new[b_idx, call_row], from_cache_v)
    out = attend_torch(q, rel, keys, values, key_pos, pos, window)
    commit = valid & (pos > last[:, None] - cap)
    b_i, t_i = commit.nonzero(as_tuple=True)
    rows = pos[b_i, t_i].long() % cap
    k_cache[slot.long()[b_i], rows] = k_new[b_i, t_i]
    v_cache[slot.long()[b_i], rows] = v_new[b_i, t_i]
    return out
