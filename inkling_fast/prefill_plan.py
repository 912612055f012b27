"""Which prompt chunks go into the engine's next batched prefill pass (host only, no tensors).

A prefill pass is one [B, T] batch: row b holds the next chunk of one admitted sequence (its prompt
tokens from where the previous pass stopped, at most T of them), padding after the chunk and in the
rows beyond the sequences. B comes from the engine's batch sizes and T from a short list of lengths,
so that a pass replays one of a few captured CUDA graphs and pads little:

    for each length T:  rows = the first min(#pending, largest batch size B with B * T <= budget) sequences
                        real = sum over those rows of min(remaining tokens, T)
    take the T with the most real tokens; on a tie the one with the fewest padded tokens B * T

A sequence is in a pass at most once (the prefill kernels read a row's history from the caches, so a
sequence's next chunk must come in a later pass), and the pending sequences are served in order, so a
long prompt is finished before later ones take its place.
"""

from __future__ import annotations


def default_prefill_lengths(budget: int) -> list[int]:
    """Chunk lengths T of the prefill passes: 16, 32, 64, ... below `budget`, and `budget` itself
    (only `budget` when it is below 16)."""
    lengths, t = [], 16
    while t < budget:
        lengths.append(t)
        t *= 2
    return lengths + [budget]


def plan_prefill_pass(remaining: list[int], lengths: list[int], batch_sizes: list[int],
                      budget: int) -> tuple[int, int, int]:
    """remaining: prompt tokens still to prefill per pending sequence (in admission order, each >= 1).
    Returns (rows, T, B): the first `rows` sequences each put their next min(remaining, T) tokens into
    a pass of B x T tokens (B >= rows a batch size, B * T <= budget)."""
    if not remaining or min(remaining) < 1:
        raise ValueError(f"remaining must list at least one sequence with tokens left, got {remaining}")
    best = None
    for T in sorted(lengths):
        fits = [b for b in batch_sizes if b * T <= budget]
        if not fits:
            continue
        rows = min(len(remaining), max(fits))
        B = min(b for b in batch_sizes if b >= rows)
        key = (sum(min(r, T) for r in remaining[:rows]), -B * T)
        if best is None or key > best[0]:
            best = (key, rows, T, B)
    if best is None:
        raise ValueError(f"no prefill pass fits the budget of {budget} tokens: the smallest batch size "
                         f"{min(batch_sizes)} times the shortest length {min(lengths)} exceeds it")
    return best[1], best[2], best[3]


def prefill_passes(prompt_lengths: list[int], lengths: list[int], batch_sizes: list[int],
                   budget: int) -> list[tuple[int, int]]:
    """(B, T) of every pass, in order, that prefills prompts of these lengths admitted together (passes of
    plan_prefill_pass until no prompt has tokens left)."""
    remaining, passes = list(prompt_lengths), []
    while remaining:
        rows, T, B = plan_prefill_pass(remaining, lengths, batch_sizes, budget)
        passes.append((B, T))
        remaining = [r - T for r in remaining[:rows] if r > T] + remaining[rows:]
    return passes


def possible_passes(prompt_lengths: list[int], lengths: list[int], batch_sizes: list[int],
                    budget: int) -> list[tuple[int, int]]:
    """Every (B, T) that plan_prefill_pass may return for prompts of these lengths, however they are
    admitted (any subset, in any groups, with any chunks already done): B any of `batch_sizes` (pass only
    those a request can fill), T any length up to the shortest one that holds the longest prompt (a
    longer T holds no more real tokens and pads more, so the plan never picks it), B * T <= budget."""
    longest = max(prompt_lengths)
    cap = min((t for t in lengths if t >= longest), default=max(lengths))
    return [(B, T) for T in sorted(lengths) if T <= cap for B in sorted(batch_sizes) if B * T <= budget]
