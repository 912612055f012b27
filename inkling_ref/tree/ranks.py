"""Tree acceptance from teacher-forced draft ranks: replay any tree shape without decoding it.

Greedy decoding is lossless, so every cycle of every tree shape walks the same token sequence
x_0 .. x_{T-1}: the plain greedy continuation of the prompt. Along that sequence the depths' logits
are teacher-forced (speculative.teacher_forced_depth_caches, tested for chains and, node by node, for
trees in tests/test_tree.py): at a cycle that starts with n committed tokens, the draft node with
rank path (r_0, .., r_{d-1}) is accepted (it and its ancestors hold x_n .. x_{n-1+d}) exactly when

    r_j = ranks[j][n-2]   for j = 0..d-1,    ranks[j][p] = rank of x_{p+j+2} in depth j's logits at row p

(rank 0 = the top-1, ties to the lowest id, as tree.top_candidates orders them). So the cycle accepts
the longest prefix of (ranks[0][n-2], ranks[1][n-2], ..) that is a node of the tree, and n advances
by a + 1. `replay` runs exactly that loop, with generate_tree's rules for the length limit; the
measurement script checks it cycle by cycle against generate_tree.

The same replay chooses trees: `grow_trees` adds one node at a time, each time the child (the next
rank under some node) that raises the replayed acceptance length of a set of sequences the most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.model import InklingModel
from .drafts import TreeSpec


@torch.no_grad()
def draft_ranks(model: InklingModel, sequences: list[list[int]]) -> list[list[list[int]]]:
    """Per sequence, ranks[j][p] = rank of tokens[p+j+2] in depth j's teacher-forced logits at row p,
    for every depth j of the model and every row p = 0..T-3-j. The sequences (one batch) must have
    the same length T."""
    if len({len(s) for s in sequences}) != 1:
        raise ValueError(f"draft_ranks takes sequences of one length, got {sorted({len(s) for s in sequences})}")
    device = next(model.parameters()).device
    ids = torch.tensor(sequences, dtype=torch.long, device=device)      # [B, T]
    T = ids.shape[1]
    per_depth = []
    for j, logits in enumerate(model.mtp_logits(ids)):
        rows = max(0, T - 2 - j)                                        # rows whose target exists
        lg = logits[:, :rows]                                           # [B, rows, V]
        target = ids[:, j + 2: j + 2 + rows, None]                      # [B, rows, 1]
        t_logit = lg.gather(2, target)
        vocab = torch.arange(lg.shape[-1], device=device)               # [V]
        better = (lg > t_logit) | ((lg == t_logit) & (vocab < target))  # ties: the lower id ranks first
        per_depth.append(better.sum(dim=2).tolist())                    # [B][rows]
    return [[per_depth[j][b] for j in range(len(per_depth))] for b in range(len(sequences))]


@dataclass
class ReplayCycle:
    depth: int              # levels of the tree used this cycle
    accepted: int           # a
    ranks: tuple[int, ...]  # the accepted node's rank path, () when a = 0
    counted: bool           # the full tree was used


def replay(ranks: list[list[int]], prompt_len: int, max_new_tokens: int, spec: TreeSpec,
           max_len: int) -> list[ReplayCycle]:
    """The cycles generate_tree(model, prompt, max_new_tokens, spec) runs, from the ranks of the
    prompt + its greedy continuation (no EOS). max_len: the model's max_position_embeddings."""
    if spec.depth > len(ranks):
        raise ValueError(f"a tree of depth {spec.depth} needs ranks of {spec.depth} depths, got {len(ranks)}")
    nodes = set(spec.paths)
    n, emitted, cycles = prompt_len + 1, 1, []
    while emitted < max_new_tokens:
        depth = min(spec.depth, max_new_tokens - emitted - 1, max_len - n)
        path: tuple[int, ...] = ()
        while len(path) < depth and path + (ranks[len(path)][n - 2],) in nodes:
            path += (ranks[len(path)][n - 2],)
        cycles.append(ReplayCycle(depth=depth, accepted=len(path), ranks=path, counted=depth == spec.depth))
        n += len(path) + 1
        emitted += len(path) + 1
    return cycles


def acceptance_length(sequences: list[tuple[list[list[int]], int]], max_new_tokens: int, spec: TreeSpec,
                      max_len: int) -> float:
    """Mean a + 1 over the counted cycles of replay(ranks, prompt_len, ...) for (ranks, prompt_len)
    in `sequences`."""
    a = [c.accepted for ranks, L in sequences for c in replay(ranks, L, max_new_tokens, spec, max_len)
         if c.counted]
    return sum(x + 1 for x in a) / len(a) if a else float("nan")


def grow_trees(sequences: list[tuple[list[list[int]], int]], max_new_tokens: int, max_len: int,
               max_nodes: int, max_depth: int, start: TreeSpec | None = None) -> dict[int, TreeSpec]:
    """{N: tree of N nodes} for N = start's nodes + 1 .. max_nodes, grown greedily from `start` (default:
    the root alone) on `sequences` ((ranks, prompt_len) pairs): each step adds, under some node of
    level < max_depth, its next-ranked child, the one whose tree has the highest replayed acceptance
    length (ties: the shallower, then lower ranks)."""
    if not 1 <= max_depth <= min(len(r) for r, _ in sequences):
        raise ValueError(f"max_depth {max_depth}: the ranks cover {min(len(r) for r, _ in sequences)} depths")
    paths: list[tuple[int, ...]] = list(start.paths) if start is not None else []
    out = {}
    while len(paths) < max_nodes:
        nodes = [()] + paths
        options = sorted((u + (sum(1 for p in paths if p[:-1] == u),) for u in nodes if len(u) < max_depth),
                         key=lambda p: (len(p), p))
        best = max(options, key=lambda p: acceptance_length(sequences, max_new_tokens,
                                                            TreeSpec(tuple(paths + [p])), max_len))
        paths.append(best)
        out[len(paths)] = TreeSpec(tuple(paths))
    return out
