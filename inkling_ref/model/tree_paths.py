"""Rows that form a tree instead of a line: what each row sees, given only its parent.

A forward normally appends T rows that follow each other: row t comes right after row t-1, and
row 0 right after the last cached position. A tree of drafts appends T rows where row t comes right
after its *parent* row:

    parents[t] in {-1, 0, .., t-1}      -1: the last cached position (or nothing, with no cache)

Everything a row reads follows from that one array (the chain is parents = [-1, 0, 1, .., T-2]):

    level[t]       = 0 if parents[t] == -1 else level[parents[t]] + 1
    position[t]    = start + level[t]                        (start = cache length)
    ancestors[t,u] = u == t or u is an ancestor of t         attention among the new rows
    window[t]      = the K rows ending at t along its path   the short conv's inputs:
                     (parent, grandparent, .., then the cached rows before the path's root)

Two siblings share a position and never see each other. Inputs are plain Python/torch index math:
this module knows nothing about the model.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def check_parents(parents: torch.Tensor) -> tuple[int, ...]:
    """parents: [T] integer tensor -> the same as a tuple, after checking parents[t] in -1..t-1."""
    if parents.dim() != 1 or parents.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"parents must be a 1-d integer tensor, got shape {tuple(parents.shape)} "
                         f"and dtype {parents.dtype}")
    out = tuple(parents.tolist())
    bad = [t for t, p in enumerate(out) if not -1 <= p < t]
    if bad:
        t = bad[0]
        raise ValueError(f"parents[{t}] = {out[t]}: a row's parent must be an earlier row (0..{t - 1}) "
                         "or -1 (the last cached position)")
    return out


# Every layer of a forward asks the same questions about the same parents: the answers are cached.
@lru_cache(maxsize=256)
def _levels(par: tuple[int, ...]) -> torch.Tensor:
    level: list[int] = []
    for p in par:
        level.append(0 if p < 0 else level[p] + 1)
    return torch.tensor(level, dtype=torch.long)


@lru_cache(maxsize=256)
def _ancestors(par: tuple[int, ...]) -> torch.Tensor:
    T = len(par)
    rows = [[False] * T for _ in range(T)]
    for t in range(T):
        u = t
        while u >= 0:
            rows[t][u] = True
            u = par[u]
    return torch.tensor(rows, dtype=torch.bool).reshape(T, T)


@lru_cache(maxsize=256)
def _window(par: tuple[int, ...], K: int) -> torch.Tensor:
    def before(i: int) -> int:
        if i < K - 1:  # a past input: the one before it in time
            return i - 1
        p = par[i - (K - 1)]
        return K - 2 if p < 0 else K - 1 + p

    index = []
    for t in range(len(par)):
        window = [K - 1 + t]
        while len(window) < K:
            window.append(before(window[-1]))
        index.append(window[::-1])
    return torch.tensor(index, dtype=torch.long).reshape(len(par), K)


def path_levels(parents: torch.Tensor) -> torch.Tensor:
    """parents: [T] -> level: [T], the number of new rows before t on its path (its position offset)."""
    return _levels(check_parents(parents)).to(parents.device)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents: [T] -> mask: [T, T] bool, mask[t, u] = u is t itself or one of t's ancestors.

    Row t's attention may read new row u exactly when mask[t, u]; for a chain it is the causal
    lower triangle."""
    return _ancestors(check_parents(parents)).to(parents.device)


def conv_window_index(parents: torch.Tensor, K: int) -> torch.Tensor:
    """parents: [T] -> index: [T, K] into history = [K-1 past inputs (zero-padded in front), T new inputs].

    index[t, K-1] = K-1+t (the row itself); index[t, j-1] is the input before index[t, j] on t's path:
    a new row's parent (K-1+parents[.]), the last past input (K-2) after a path root, the past input
    before a past input (i-1). For a chain index[t] = [t, t+1, .., t+K-1], the unfolded windows."""
    return _window(check_parents(parents), K).to(parents.device)
