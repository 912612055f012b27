"""`generate`: speculative (or plain) decoding of a batch of prompts, with acceptance statistics.

Each sequence of the batch runs the cycle of `speculative.py` on its own state, so a batch of
different lengths and different accept counts gives every sequence exactly what it gets alone.

Randomness: with `seed`, sequence i draws its uniforms from its own generator seeded with
`sequence_seed(seed, i)`, in this order: one for the token sampled at prefill, then per cycle
k_eff for sampled drafts (draft_sampling "sample" or "temperature"), k_eff for the acceptance tests and
one for the correction/bonus token. Temperature 0 draws nothing.

Statistics (docs/spec/mtp-cycle.md §6): a cycle is one verify pass with a accepted drafts;
acceptance_length = mean(a + 1), per_position[j] = #(a >= j) / #cycles, conditional[j] =
#(a >= j) / #(a >= j-1), j = 1..k, over the cycles that used the full k and emitted no EOS.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from . import speculative as S
from .model import InklingModel
from .sampling import DRAFT_SAMPLING, SamplingParams, draft_params, probs, rejection_sample, sample


@dataclass
class CycleRecord:
    k: int                 # drafts made this cycle (k_eff)
    drafts: list[int]      # d_1 .. d_k
    accepted: int          # a
    emitted: list[int]     # the tokens this cycle appended (accepted drafts, then b; cut at EOS)
    counted: bool          # in the statistics: used the full k and emitted no EOS


@dataclass
class AcceptanceStats:
    k: int
    num_cycles: int                                    # cycles counted
    acceptance_length: float                           # mean(a + 1)
    per_position: dict[int, float] = field(default_factory=dict)   # j -> #(a >= j) / #cycles
    conditional: dict[int, float] = field(default_factory=dict)    # j -> #(a >= j) / #(a >= j-1)

    @classmethod
    def from_cycles(cls, k: int, cycles: list[CycleRecord]) -> "AcceptanceStats":
        a = [c.accepted for c in cycles if c.counted]
        n = len(a)

        def ratio(x, y):
            return x / y if y else math.nan

        at_least = [sum(1 for x in a if x >= j) for j in range(k + 1)]  # at_least[0] = n
        return cls(k=k, num_cycles=n,
                   acceptance_length=ratio(sum(x + 1 for x in a), n),
                   per_position={j: ratio(at_least[j], n) for j in range(1, k + 1)},
                   conditional={j: ratio(at_least[j], at_least[j - 1]) for j in range(1, k + 1)})


@dataclass
class GenerationResult:
    token_ids: list[list[int]]          # new tokens per sequence (the prefill token first)
    cycles: list[list[CycleRecord]]     # per sequence, one record per verify pass
    stats: AcceptanceStats              # over every sequence's counted cycles
    elapsed_s: float

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


def sequence_seed(seed: int, i: int) -> int:
    """The seed of sequence i's generator: a fixed mix of (seed, i)."""
    return (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


class Uniforms:
    """A stream of uniforms in [0, 1) from one sequence's generator."""

    def __init__(self, seed: int | None):
        self.g = torch.Generator()
        if seed is None:
            self.g.seed()
        else:
            self.g.manual_seed(seed)

    def __call__(self, n: int = 1) -> list[float]:
        return torch.rand(n, generator=self.g, dtype=torch.float64).tolist()


def normalize_prompts(prompt_ids) -> list[list[int]]:
    """A list of ints (one prompt) or a list of lists (a batch) -> a list of lists."""
    if isinstance(prompt_ids, torch.Tensor):
        prompt_ids = prompt_ids.tolist()
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty list of token ids or a list of such lists")
    if all(isinstance(x, int) for x in prompt_ids):
        return [list(prompt_ids)]
    if all(isinstance(x, (list, tuple)) for x in prompt_ids):
        return [list(p) for p in prompt_ids]
    raise ValueError("prompt_ids must be a list of ints or a list of lists of ints")


def validate(model: InklingModel, prompts: list[list[int]], max_new_tokens: int, k: int,
             draft_sampling: str) -> None:
    cfg = model.config
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if k < 0 or k > model.num_mtp_depths:
        raise ValueError(f"num_speculative_tokens={k} needs {k} MTP depths; the model has "
                         f"{model.num_mtp_depths} loaded")
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: at least one token is needed")
        bad = [t for t in p if not isinstance(t, int) or not 0 <= t < cfg.vocab_out]
        if bad:
            raise ValueError(f"prompt {i} has token ids out of range 0..{cfg.vocab_out - 1}: {bad[:10]}")
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} the "
                             f"sequence would reach {len(p) + max_new_tokens} tokens, beyond the model's "
                             f"maximum length {cfg.max_position_embeddings}")


@torch.no_grad()
def generate_one(model: InklingModel, prompt: list[int], max_new_tokens: int, k: int,
                 params: SamplingParams, draft_sampling: str, uniforms: Uniforms,
                 eos_token_id: int | None) -> tuple[list[int], list[CycleRecord]]:
    """One sequence: prefill, then cycles until max_new_tokens or EOS."""
    def pick(logits, u):
        return int(logits.argmax()) if params.greedy else sample(probs(logits, params), u)

    q_params = draft_params(params, draft_sampling)      # what drafts are drawn from, and q in rejection sampling
    first_u = uniforms(1)[0] if not params.greedy else 0.0
    state = S.prefill(model, prompt, select_first=lambda m, logits, pos: pick(logits, first_u))
    out = [state.tokens[-1]]
    cycles: list[CycleRecord] = []
    max_len = model.config.max_position_embeddings
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        remaining = max_new_tokens - len(out)
        k_eff = min(k, remaining - 1, max_len - state.n)  # verify writes positions n-1 .. n-1+k_eff
        sampled_drafts = draft_sampling != "greedy" and not params.greedy
        u_draft = uniforms(k_eff) if sampled_drafts else [0.0] * k_eff
        if sampled_drafts:
            select = lambda m, logits, pos: sample(probs(logits, q_params), u_draft[m])  # noqa: E731
        else:
            select = S.greedy_select
        d = S.draft(model, state, k_eff, select)
        v = S.verify(model, state, d.tokens)
        if params.greedy:
            a, b = S.accept_greedy(d.tokens, v.logits)
        else:
            p = probs(v.logits, params)                                           # [k+1, V]
            q = probs(d.logits, q_params)                                         # [k, V]; one-hot if greedy
            u_acc = uniforms(k_eff)
            a, b = rejection_sample(p, q, d.tokens, u_acc, uniforms(1)[0])
        S.commit(state, d.tokens, a, b, v)
        emitted = d.tokens[:a] + [b]
        hit_eos = eos_token_id is not None and eos_token_id in emitted
        if hit_eos:
            emitted = emitted[: emitted.index(eos_token_id) + 1]
        out += emitted
        cycles.append(CycleRecord(k=k_eff, drafts=list(d.tokens), accepted=a, emitted=emitted,
                                  counted=(k_eff == k and not hit_eos)))
    return out, cycles


def generate(model: InklingModel, prompt_ids, max_new_tokens: int, num_speculative_tokens: int = 0,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             draft_sampling: str = "greedy", seed: int | None = None,
             eos_token_id: int | None = None) -> GenerationResult:
    """Decode `max_new_tokens` new tokens for each prompt with k = num_speculative_tokens drafts
    per cycle (k = 0: plain decoding). `prompt_ids`: a list of ints or a list of lists.
    draft_sampling (temperature > 0 only): "greedy" drafts (one-hot q), "sample" (drafts from the
    target's filtered distribution) or "temperature" (from softmax(logits / T) only, as vLLM drafts);
    every choice is lossless (inkling_ref.sampling)."""
    prompts = normalize_prompts(prompt_ids)
    params = SamplingParams(temperature, top_k, top_p)
    validate(model, prompts, max_new_tokens, num_speculative_tokens, draft_sampling)
    t0 = time.perf_counter()
    token_ids, cycles = [], []
    for i, prompt in enumerate(prompts):
        uniforms = Uniforms(None if seed is None else sequence_seed(seed, i))
        out, recs = generate_one(model, prompt, max_new_tokens, num_speculative_tokens, params,
                                 draft_sampling, uniforms, eos_token_id)
        token_ids.append(out)
        cycles.append(recs)
    elapsed = time.perf_counter() - t0
    stats = AcceptanceStats.from_cycles(num_speculative_tokens, [c for seq in cycles for c in seq])
    return GenerationResult(token_ids=token_ids, cycles=cycles, stats=stats, elapsed_s=elapsed)
