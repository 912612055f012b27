"""Only what the MTP head reads, loaded from a released checkpoint: the MTP depths and the trunk's
embedding, its embed_norm, its final norm and its LM head. Never a trunk layer: of a real checkpoint
that is the MTP shard (about 4.5 GB for Inkling-Small in bf16) and three trunk tensors, not the
experts (hundreds of GB). The final norm is not part of a correct depth; the checker reads it to test
that H is the post-final-norm hidden and to reproduce the mistake that applies it to a depth's output.

    head = load_head(DIR, num_depths=4)      # MTPHeadModel
    head.trunk.embed_tokens(ids)             rms(E[id]; embed_norm), as the trunk computes it
    head.trunk.readout(h)                    (h @ W_unembed^T / mup)[..., :V]
    head.mtp.depths[m], head.mtp.chain       the depths (inkling_ref/model/mtp.py)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..io import names
from ..io.checkpoint import (CheckpointError, check_quantized, complete_mtp_depths, read_config, read_headers,
                             tensor_files)
from ..io.config import InklingConfig
from ..model.mtp import MTPHead
from ..model.norm import RMSNorm
from ..model.trunk import Trunk


class TrunkEnds(nn.Module):
    """The trunk's tensors the MTP head shares, without its layers."""

    def __init__(self, config: InklingConfig):
        super().__init__()
        H = config.hidden_size
        self.config = config
        self.embed = nn.Embedding.from_pretrained(torch.zeros(config.vocab_size, H), freeze=False)  # no init run
        self.embed_norm = RMSNorm(H, config.rms_norm_eps)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.unembed = nn.Linear(H, config.vocab_size, bias=False)

    embed_tokens = Trunk.embed_tokens      # the trunk's own formulas, not copies of them
    readout = Trunk.readout


class MTPHeadModel(nn.Module):
    """`trunk` (TrunkEnds) and `mtp` (MTPHead with `num_depths` depths), named as in InklingModel so that
    released names map the same way (inkling_ref/io/names.py)."""

    def __init__(self, config: InklingConfig, num_depths: int):
        super().__init__()
        self.config = config
        self.trunk = TrunkEnds(config)
        self.mtp = MTPHead(config, num_depths)

    @property
    def num_mtp_depths(self) -> int:
        return len(self.mtp)


def head_shapes(config: InklingConfig, num_depths: int) -> dict[str, tuple[int, ...]]:
    """Released name -> shape of every tensor the head reads."""
    with torch.device("meta"):
        head = MTPHeadModel(config, num_depths)
    return {names.to_released(n): tuple(p.shape) for n, p in head.named_parameters()}


def load_head(path, num_depths: int | None = None, dtype: torch.dtype = torch.float32, device="cpu") -> MTPHeadModel:
    """The head of the checkpoint directory `path` with its first `num_depths` depths (None: every complete
    depth), read tensor by tensor from the safetensors files (headers first: nothing else is read)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist" if not directory.exists() else
                              f"{directory} is a file; pass the checkpoint directory (the one holding config.json)")
    config, _ = read_config(directory)
    files, weight_map = tensor_files(directory)
    infos = read_headers(directory, files, weight_map)
    complete = complete_mtp_depths(config, infos, f"checkpoint {directory}", trunk=False)  # trunk layers: unread
    k = complete if num_depths is None else num_depths
    if k < 1 or k > complete:
        raise CheckpointError(f"checkpoint {directory} has {complete} complete MTP depth(s) (config.json declares "
                              f"{config.num_mtp_depths}); the check needs depths 0..{max(k, 1) - 1}")
    wanted = head_shapes(config, k)
    missing = sorted(n for n in wanted if n not in infos)
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks tensors the MTP head reads: {', '.join(missing)}")
    check_quantized(f"checkpoint {directory}", {n: infos[n] for n in wanted})
    wrong = [f"{n} expected {list(s)} got {list(infos[n].shape)}" for n, s in wanted.items() if infos[n].shape != s]
    if wrong:
        raise CheckpointError(f"checkpoint {directory} does not match its config.json: {'; '.join(wrong)}")

    with torch.device("meta"):
        head = MTPHeadModel(config, k)
    state = {}
    for f in files:
        here = [n for n in wanted if infos[n].file == f]
        if not here:
            continue
        with safe_open(directory / f, framework="pt", device="cpu") as s:
            for released in here:
                t = s.get_tensor(released).to(device).to(dtype)     # one tensor at a time on the host
                if not bool(torch.isfinite(t).all()):
                    raise CheckpointError(f"checkpoint {directory}: {released} in {f} holds NaN or infinite values")
                state[names.from_released(released)] = t
    head.load_state_dict(state, strict=True, assign=True)
    return head.eval()
