"""The engine's static, position-addressed state (docs/spec/mtp-cycle.md §4, docs/fast_path.md).

Everything is allocated once, for `slots` sequences of up to `max_seq_len` tokens and up to k drafts
per cycle; a sequence owns one slot. Rows are addressed by absolute position p: "rollback" is only
the sequence length n, because rejected rows are never read and are overwritten later.

Per block (each trunk layer, and each MTP depth: one block each), `LayerCache`:

    k, v                 [slots, cap, nKV, hd]   KV at row p % cap; cap = max_seq_len (global layers)
                                                 or window + k + 1 (sliding layers: a ring)
    k_ring, v_ring       [slots, R, nKV*hd]      inputs of the K / V short convs at row p % R
    attn_ring, mlp_ring  [slots, R, H]           inputs of the short convs on the attention / MLP output
                                                 R = (K - 1) + (k + 1): the K-1 inputs before a window
                                                 of k+1 rows, and the window's own rows

Per sequence, `SlotState` (slots + 1 rows: row `slots` is the scratch slot that padding rows of a
batch point at; it absorbs their token and hidden writes; the block caches have no such row: padding
rows hold position -1 everywhere, and the kernels touch no cache memory for those, whatever the slot):

    tokens   [slots+1, max_seq_len + k + 1]  committed tokens at their positions, and this cycle's
                                             drafts d_1..d_k at positions n..n+k-1
    n        [slots+1]                       committed tokens (x_{n-1} is pending)
    stop     [slots+1]                       prompt length + max_new_tokens: the cycle makes at most
                                             k_eff = min(k, stop - n - 1) drafts
    hidden   [slots+1, max_seq_len + k + 1, H]  trunk hiddens H_p at row p, every position: a window reads
                                             H_{n-2-k..n-2} while the verify writes H_{n-1..n-1+k}, and
                                             a depth that fell behind (a smaller k ran meanwhile)
                                             recomputes its missing rows from them
    done     [slots+1]                       the sequence has finished (max_new_tokens or EOS): a batch row
                                             on this slot is padding in every cycle until the slot is refilled
    eos      [slots+1]                       the sequence's EOS token id (-1: none)
    seeds, counters [slots+1]                per-sequence uniform stream: the Philox seed (device uniforms)
                                             and the offset of the next draw in the stream

Why these sizes never lose a row that is still needed: every forward writes its own positions before
it reads them, and the highest position ever written in a trunk cache is n-2+k (a verify with no
accepted draft); in a depth cache it is n-2. A ring of X rows keeps position q intact while nothing at
q + X or later was written; X = window + k + 1 (KV) or K + k (conv) keeps the last `window` (KV) or
K-1 (conv) committed positions, which is all the next window or verify reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import AttentionWeights

FIELDS = ("keys", "values", "k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in")


def kv_capacity(window: int | None, max_seq_len: int, k: int) -> int:
    """Rows of a KV cache: every position (global), or the window plus a verify/draft window (sliding)."""
    return max_seq_len if window is None else window + k + 1


def ring_rows(conv_kernel: int, k: int) -> int:
    """Rows of a conv-input ring: the K-1 inputs before a window of k+1 rows, and those rows."""
    return conv_kernel - 1 + k + 1


@dataclass
class LayerCache:
    k: torch.Tensor
    v: torch.Tensor
    k_ring: torch.Tensor
    v_ring: torch.Tensor
    attn_ring: torch.Tensor
    mlp_ring: torch.Tensor

    @classmethod
    def allocate(cls, attn: AttentionWeights, hidden_size: int, conv_kernel: int, slots: int, max_seq_len: int,
                 k: int, dtype: torch.dtype, device) -> "LayerCache":
        nKV, hd = attn.num_kv_heads, attn.head_dim
        cap = kv_capacity(attn.window, max_seq_len, k)
        R = ring_rows(conv_kernel, k)

        def zeros(*shape):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(k=zeros(slots, cap, nKV, hd), v=zeros(slots, cap, nKV, hd),
                   k_ring=zeros(slots, R, nKV * hd), v_ring=zeros(slots, R, nKV * hd),
                   attn_ring=zeros(slots, R, hidden_size), mlp_ring=zeros(slots, R, hidden_size))

    @property
    def capacity(self) -> dict[str, int]:
        """Rows per slot of each field (a position p lives at row p % capacity)."""
        cap, R = self.k.shape[1], self.k_ring.shape[1]
        return {"keys": cap, "values": cap, "k_conv_in": R, "v_conv_in": R, "attn_conv_in": R, "mlp_conv_in": R}

    @torch.no_grad()
    def read(self, slot: int, positions: list[int]) -> dict[str, torch.Tensor]:
        """The rows of `positions` in `slot` (for tests and inspection): keys/values [P, nKV, hd], conv
        inputs [P, C]. A row holds its position only while the ring has not wrapped over it."""
        p = torch.as_tensor(positions, dtype=torch.long, device=self.k.device)
        tensors = {"keys": self.k, "values": self.v, "k_conv_in": self.k_ring, "v_conv_in": self.v_ring,
                   "attn_conv_in": self.attn_ring, "mlp_conv_in": self.mlp_ring}
        return {name: t[slot, p % t.shape[1]] for name, t in tensors.items()}


@dataclass
class SlotState:
    tokens: torch.Tensor
    n: torch.Tensor
    stop: torch.Tensor
    hidden: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, max_seq_len: int, k: int, hidden_size: int, dtype: torch.dtype,
                 device) -> "SlotState":
        S = slots + 1  # + the scratch slot of padding rows

        def zeros(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(tokens=zeros(S, max_seq_len + k + 1), n=zeros(S), stop=zeros(S),
                   hidden=zeros(S, max_seq_len + k + 1, hidden_size, dt=dtype), done=zeros(S, dt=torch.bool),
                   eos=torch.full((S,), -1, dtype=torch.int64, device=device), seeds=zeros(S), counters=zeros(S))

    @property
    def scratch(self) -> int:
        """The slot that padding rows point at."""
        return self.n.shape[0] - 1
