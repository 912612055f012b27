"""Every dump row recomputed by the reference from the dump's own inputs: H (as the engine handed it to
depth 0), the committed tokens and the engine's drafts (so that one depth's wrong draft does not make
the next depth's token slot wrong too).

`recompute` is the correct value, defined without the engine's schedule: depth m at row p of a step
is the chained fold over rows 0..p of that step's token slots (x_0..x_{n-1}, d_1..d_k), depth m-1's
fold feeding depth m, with the depth's history over rows < p equal to the teacher-forced fold of the
committed tokens (docs/spec/mtp-cycle.md §5, invariant 3). Its caches are kept across steps and only
the rows a commit made stale are recomputed, as the reference cycle does.

`replay` follows the engine's schedule instead: each step, each depth truncates its cache to the first
row the engine ran and recomputes from there, exactly as the engine did. With a correct schedule it
equals `recompute`; its `history` options and the depth functions of pitfalls.py rebuild the known
mistakes from the same inputs.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model.cache import LayerCache
from .schedule import Step

# depth(head, m, h_prev [1, T, H], tokens [1, T], cache) -> out [1, T, H]: the next depth's input and
# what the LM head reads
DepthFn = Callable[..., torch.Tensor]
HISTORIES = ("rollback", "kv-only", "depth-0-only")


class CannotReplay(ValueError):
    """The engine's schedule cannot be replayed by this variant (depth m's rows start before depth m-1's)."""


def correct_depth(head, m: int, h_prev: torch.Tensor, tokens: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """out = chain(depth_m(h_prev, rms(E[x]; embed_norm), cache)) (inkling_ref/model/mtp.py)."""
    y = head.mtp.depths[m](h_prev, head.trunk.embed_tokens(tokens), cache)
    return head.mtp.chain(y)


def _ids(slots: list[int], device) -> torch.Tensor:
    return torch.tensor([slots], dtype=torch.long, device=device)


def _hidden(head, dump) -> torch.Tensor:
    p = next(head.parameters())
    return dump["hidden"].to(device=p.device, dtype=p.dtype)


def _put(out: torch.Tensor, step: Step, m: int, h: torch.Tensor, start: int) -> None:
    """Write depth m's outputs h [1, T, H] (rows start..n-2) into the dump rows it ran."""
    r = step.rows[m]
    out[step.first[m]: step.first[m] + len(r)] = h[0, r.start - start:].to(out.dtype)


@torch.no_grad()
def recompute(head, dump, steps: list[Step], depth: DepthFn = correct_depth) -> torch.Tensor:
    """The correct output of every dump row: [R, H] in the head's dtype, rows in the dump's order."""
    p = next(head.parameters())
    H = _hidden(head, dump)
    out = torch.zeros(dump.num_rows, dump.hidden_size, dtype=p.dtype, device=p.device)
    K = max(s.k for s in steps)
    caches = [LayerCache() for _ in range(K)]
    valid = [0] * K                          # per depth: leading rows equal to the committed fold
    for step in steps:
        ran = range(step.k)
        w0 = min([valid[m] for m in ran] + [step.rows[m].start for m in ran])
        h = H[w0: step.n - 1][None]          # [1, W, H]: H_p for p = w0..n-2
        for m in ran:
            caches[m].truncate(w0)
            h = depth(head, m, h, _ids(step.slots[w0 + m + 1: step.n + m], p.device), caches[m])
            _put(out, step, m, h, w0)
        if step.next_n is not None:          # row p stays valid iff its slot p+m+1 holds a committed token
            for m in ran:
                valid[m] = max(0, min(step.n - 1, step.next_n - 2 - m))
    return out


@torch.no_grad()
def replay(head, dump, steps: list[Step], depth: DepthFn = correct_depth, slot_offset: int = 1,
           history: str = "rollback") -> torch.Tensor:
    """The engine's schedule recomputed with `depth`, depth m at row p reading slot p+m+slot_offset, and
    the depths' history kept as `history` says:
        rollback      each depth's cache truncated to the first row the engine ran (correct)
        kv-only       only K/V truncated; the conv inputs keep every row ever appended
        depth-0-only  depths 1.. start each step from an empty cache (only depth 0 keeps history)
    Returns [R, H] as `recompute`."""
    if history not in HISTORIES:
        raise ValueError(f"history must be one of {HISTORIES}, got {history!r}")
    p = next(head.parameters())
    H = _hidden(head, dump)
    out = torch.zeros(dump.num_rows, dump.hidden_size, dtype=p.dtype, device=p.device)
    K = max(s.k for s in steps)
    caches = [LayerCache() for _ in range(K)]
    for step in steps:
        prev = None
        for m in range(step.k):
            if history == "depth-0-only" and m > 0:
                caches[m] = LayerCache()
                start = step.rows[m].start
            else:
                start = min(step.rows[m].start, caches[m].length)
            if m == 0:
                h_in = H[start: step.n - 1][None]
            elif start < prev:
                raise CannotReplay(f"step {step.index}: depth {m} would start at row {start} before depth {m - 1}")
            else:
                h_in = h[:, start - prev:]
            cache = caches[m]
            if history == "kv-only" and cache.keys is not None:
                cache.keys, cache.values = cache.keys[:, :, :start], cache.values[:, :, :start]
            elif cache.keys is not None:
                cache.truncate(start)
            s0 = start + m + slot_offset
            h = depth(head, m, h_in, _ids(step.slots[s0: s0 + step.n - 1 - start], p.device), cache)
            _put(out, step, m, h, start)
            prev = start
    return out
