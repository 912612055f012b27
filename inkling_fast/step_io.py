"""What goes into and comes out of the engine's device steps: their keys, inputs and result columns.

A step is a fixed sequence of kernel launches whose shapes depend only on its key; one CUDA graph is
captured per key (graphs.py), and the data that changes from call to call travels in one input tensor:

    CycleKey(batch_size, decoding)            cycle input: int32 [B], the slot of each batch row (-1: padding)
                                              result: int64 [B, k + 8], columns CycleColumns(k)
    PrefillKey(batch_size, length, decoding)  pass input: int64 [B, PASS_COLUMNS + T + k], a row per chunk
                                              (PassColumns, then the chunk's tokens)
                                              result: int64 [B, 3], columns PassResult
    CatchupKey(batch_size, length, decoding)  catch-up input: int64 [B, 3], a row per sequence: slot, the
                                              first row c0, the rows to recompute (<= length)
                                              result: int64 [B, 1], the rows recomputed

`Decoding` is what a step computes besides its shapes: k drafts per cycle and how tokens are chosen.
The keys are frozen dataclasses, not tuples: a prefill pass and a catch-up pass of the same batch size,
length and decoding are different steps, and must not find each other's graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from inkling_ref.decoding.sampling import SamplingParams, draft_params


@dataclass(frozen=True)
class Decoding:
    """k drafts per cycle (0: plain decoding), the target's sampling `params` (greedy when the
    temperature is 0), and how drafts are chosen: `draft_sampling` (inkling_ref's DRAFT_SAMPLING:
    greedy, sampled from the target's filtered distribution, or sampled at the temperature only, as
    vLLM drafts)."""
    k: int = 0
    params: SamplingParams = SamplingParams()
    draft_sampling: str = "greedy"

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def sampled_drafts(self) -> bool:
        return not self.greedy and self.draft_sampling != "greedy"

    @property
    def draft_params(self) -> SamplingParams:
        """The draft distribution q: what sampled drafts are drawn from and rejection sampling divides by."""
        return draft_params(self.params, self.draft_sampling)


@dataclass(frozen=True)
class CycleKey:
    """One cycle of `batch_size` rows."""
    batch_size: int
    decoding: Decoding


@dataclass(frozen=True)
class PrefillKey:
    """One batched prefill pass of `batch_size` rows, each a chunk of up to `length` prompt tokens."""
    batch_size: int
    length: int
    decoding: Decoding


@dataclass(frozen=True)
class CatchupKey:
    """One catch-up pass: depths 0..k-1 recompute up to `length` rows per sequence before a cycle at k
    (rows a smaller k, or an acceptance longer than k, left behind)."""
    batch_size: int
    length: int
    decoding: Decoding


StepKey = CycleKey | PrefillKey | CatchupKey


@dataclass
class Batch:
    """The rows of one cycle: row b runs the sequence in slot[b] (the scratch slot for padding rows,
    live[b] = False); uniforms [B, 2k+1] float64 (sampling only): draft | accept | final."""
    slot: torch.Tensor      # int32 [B]
    live: torch.Tensor      # bool [B]
    uniforms: torch.Tensor  # float64 [B, 2k+1]


class CycleColumns:
    """Columns of a cycle's result row (int64 [B, k+8]): a, b, d_1..d_k, then k_eff, the number of
    tokens emitted (a+1, or up to and including an EOS), whether an EOS was emitted, whether the
    sequence is done after the cycle, whether the row ran live (0: padding or an already finished
    sequence; nothing to book), and `nonfinite`: the NonFinite code of the first step of the row that
    produced a NaN or an infinity (0: none; else nothing else in the row may be trusted)."""

    def __init__(self, k: int):
        self.a, self.b, self.drafts = 0, 1, 2
        self.k_eff, self.emitted, self.eos, self.done, self.live = k + 2, k + 3, k + 4, k + 5, k + 6
        self.nonfinite = k + 7


class NonFinite:
    """Codes of the `nonfinite` result columns: which step of a row first produced a NaN or an infinity.
    Cycle rows (CycleColumns): 0 none; 1 + j for the j-th of the row's checked scores in step order,
    draft depth j for j < k, then the verify (greedy_accept's `first_bad`: the maximum logit behind each
    draft and target, or the sum of the probabilities sampled from, is NaN or infinite exactly when the
    row it was read from is). Prefill pass rows (PassResult): 0 none, PREFILL. The device steps compute
    them from values they already hold (no host sync), and the scheduler raises when it books a row
    that carries one."""
    NONE, PREFILL = 0, 1

    @staticmethod
    def cycle_step(code: int, k: int) -> str:
        """The step a cycle row's code names, in the reference's words (inkling_ref.decoding.speculative)."""
        return f"draft (MTP depth {code - 1})" if code - 1 < k else "verify"


class PassColumns(NamedTuple):
    """The leading columns of a prefill pass row, in order; the chunk's tokens follow them. slot
    (SlotState.scratch for a padding row), start c0 and length l >= 1 of the chunk (0: padding),
    prompt length L, stop (L + max_new_tokens), eos (-1: none), seed, last (1 if c0 + l = L)."""
    slot: int
    start: int
    length: int
    prompt_len: int
    stop: int
    eos: int
    seed: int
    last: int


PASS = PassColumns(*range(len(PassColumns._fields)))   # the column index of each field
PASS_COLUMNS = len(PASS)


class PassResult(NamedTuple):
    """Columns of a prefill pass's result row (int64 [B, 3]); first and done are meaningful for a prompt's
    last chunk only, nonfinite for every chunk."""
    first: int      # x_L, the first new token
    done: int       # the sequence is done after it (x_L is its EOS, or max_new_tokens = 1)
    nonfinite: int  # NonFinite.PREFILL if the chunk's hidden states (trunk or a depth) are not all finite


PASS_RESULT = PassResult(0, 1, 2)
