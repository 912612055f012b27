"""`InklingModel`: the trunk plus an optional MTP head, with the three forwards everything else
is tested against: `logits`, `hidden` and the teacher-forced `mtp_logits`."""

from __future__ import annotations

import torch
from torch import nn

from .cache import LayerCache
from ..io.config import InklingConfig
from .mtp import MTPHead
from .trunk import Trunk


class InklingModel(nn.Module):
    def __init__(self, config: InklingConfig, num_mtp_depths: int | None = None):
        """`num_mtp_depths`: how many of the config's MTP depths to build (None: all of them)."""
        super().__init__()
        n = config.num_mtp_depths if num_mtp_depths is None else num_mtp_depths
        if not 0 <= n <= config.num_mtp_depths:
            raise ValueError(f"num_mtp_depths={n}: the config has {config.num_mtp_depths} MTP depths")
        self.config = config
        self.trunk = Trunk(config)
        self.mtp = MTPHead(config, n) if n > 0 else None

    @property
    def num_mtp_depths(self) -> int:
        return 0 if self.mtp is None else len(self.mtp)

    def check_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            got = f"shape {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a [B, T] tensor of token ids, got {got} (one sequence: ids[None])")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.device.type == "meta":
            raise ValueError("input_ids is on the meta device, which holds no values: pass token ids on the "
                             "model's device")
        if input_ids.numel() == 0:
            raise ValueError(f"input_ids has no tokens (shape {list(input_ids.shape)}): at least one sequence "
                             "of at least one token is needed")
        device = next(self.parameters()).device
        if input_ids.device != device:
            raise ValueError(f"input_ids is on {input_ids.device} and the model on {device}: move one of them")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_out):
            raise ValueError(f"token ids must be in 0..{self.config.vocab_out - 1}, got "
                             f"min {int(input_ids.min())}, max {int(input_ids.max())}")

    # ------------------------------------------------------------------ trunk
    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] -> the post-final-norm hidden H: [B, T, H] (before the division by mup)."""
        self.check_ids(input_ids)
        return self.trunk(input_ids)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, T] -> logits [B, T, unpadded_vocab] (full forward, no cache)."""
        return self.trunk.readout(self.hidden(input_ids))

    # ------------------------------------------------------------------ MTP
    def mtp_depth(self, m: int, h_prev: torch.Tensor, tokens: torch.Tensor,
                  cache: LayerCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run depth m on rows whose token slots hold `tokens` [B, T] and hidden inputs h_prev [B, T, H].

        Returns (out [B, T, H], the next depth's h_prev; logits [B, T, V])."""
        y = self.mtp.depths[m](h_prev, self.trunk.embed_tokens(tokens), cache)
        out = self.mtp.chain(y)
        return out, self.trunk.readout(out)

    def mtp_logits(self, input_ids: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced chained MTP forward. input_ids: [B, T] -> one tensor per depth m:
        [B, T-1-m, V], row p = 0..T-2-m consumed token p+m+1 and predicts token p+m+2."""
        if self.mtp is None:
            raise ValueError("this model has no MTP head")
        self.check_ids(input_ids)
        T = input_ids.shape[1]
        h_prev = self.trunk(input_ids)[:, : T - 1]  # depth 0 reads H_p, p = 0..T-2
        out = []
        for m in range(self.num_mtp_depths):
            rows = T - 1 - m  # rows p = 0..T-2-m
            if rows <= 0:  # the input is too short for this depth: no rows
                out.append(h_prev.new_zeros(input_ids.shape[0], 0, self.config.vocab_out))
                continue
            h_prev, logits = self.mtp_depth(m, h_prev[:, :rows], input_ids[:, m + 1: m + 1 + rows])
            out.append(logits)
        return out
