"""Caches of the reference: plain tensors holding every position of the sequence so far.

One idea everywhere (`docs/spec/design.md`): a cache row belongs to an absolute position, and
the sequence length is the only thing rollback changes. The reference keeps the *whole* history
(no ring buffers) so that rollback is a slice: `cache.truncate(n)` keeps positions 0..n-1.

Per layer (trunk layer or MTP depth block):
    keys, values        [B, nKV, n, hd]   convolved + normed k, convolved v (what attention reads)
    k_conv_in, v_conv_in [B, n, nKV*hd]   inputs of the K and V short convs
    attn_conv_in         [B, n, H]         input of the short conv on the attention output
    mlp_conv_in          [B, n, H]         input of the short conv on the MLP output
Only the last K-1 conv inputs are ever read; keeping them all makes truncation trivial.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def append(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate `new` after `old` along the time dimension `dim`."""
    return new if old is None else torch.cat([old, new], dim=dim)


@dataclass
class LayerCache:
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    k_conv_in: torch.Tensor | None = None
    v_conv_in: torch.Tensor | None = None
    attn_conv_in: torch.Tensor | None = None
    mlp_conv_in: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """Number of positions held (0 .. length-1)."""
        return 0 if self.keys is None else self.keys.shape[2]

    def truncate(self, n: int) -> None:
        """Keep positions 0..n-1, drop the rest (the reference's rollback)."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        if self.keys is None:  # empty cache: nothing to drop
            return
        self.keys, self.values = self.keys[:, :, :n], self.values[:, :, :n]
        for name in ("k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in"):
            setattr(self, name, getattr(self, name)[:, :n])

    def clone(self) -> "LayerCache":
        return LayerCache(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).clone()
                             for f in fields(self)})


class TrunkCache:
    """One `LayerCache` per trunk layer; all hold the same positions."""

    def __init__(self, num_layers: int):
        self.layers = [LayerCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n)

    def clone(self) -> "TrunkCache":
        c = TrunkCache(0)
        c.layers = [layer.clone() for layer in self.layers]
        return c
