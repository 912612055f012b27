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
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from . import speculative as S
from .adaptive import CycleCosts, DepthPolicy, depth_policy
from ..io.config import InklingConfig, is_int
from ..model.model import InklingModel
from .sampling import DRAFT_SAMPLING, SamplingParams, draft_params, probs, rejection_sample, sample


@dataclass
class CycleRecord:
    k: int                 # drafts made this cycle (k_eff)
    drafts: list[int]      # d_1 .. d_k
    accepted: int          # a
    emitted: list[int]     # the tokens this cycle appended (accepted drafts, then b; cut at EOS)
    counted: bool          # in the statistics: used the full k and emitted no EOS
    planned: int = -1      # the k the cycle ran with (k_eff is less near the end of a sequence)

    @classmethod
    def of_cycle(cls, k: int, drafts: list[int], accepted: int, next_token: int,
                 eos_token_id: int | None) -> "CycleRecord":
        """The record of a cycle run with k drafts that made len(drafts) = k_eff <= k of them, accepted
        `accepted` and then appended `next_token` (the correction or the bonus). Emitted tokens stop
        at EOS; the cycle counts in the statistics if it used the full k and emitted no EOS. The
        reference and the fast engine both write their records with this."""
        emitted = list(drafts[:accepted]) + [next_token]
        hit_eos = eos_token_id is not None and eos_token_id in emitted
        if hit_eos:
            emitted = emitted[: emitted.index(eos_token_id) + 1]
        return cls(k=len(drafts), drafts=list(drafts), accepted=accepted, emitted=emitted,
                   counted=len(drafts) == k and not hit_eos, planned=k)


@dataclass
class AcceptanceStats:
    k: int
    num_cycles: int                                    # cycles counted
    acceptance_length: float                           # mean(a + 1)
    per_position: dict[int, float] = field(default_factory=dict)   # j -> #(a >= j) / #cycles
    conditional: dict[int, float] = field(default_factory=dict)    # j -> #(a >= j) / #(a >= j-1)
    k_used: dict[int, int] = field(default_factory=dict)           # k -> cycles run with it (all cycles)

    @classmethod
    def from_cycles(cls, k: int, cycles: list[CycleRecord]) -> "AcceptanceStats":
        """Over the counted cycles. When their k varies (num_speculative_tokens="auto"), position j is
        judged over the counted cycles that made at least j drafts: per_position[j] = #(a >= j) /
        #(cycles with k >= j); with one k throughout that is the spec's #(a >= j) / #cycles."""
        counted = [c for c in cycles if c.counted]
        a = [c.accepted for c in counted]
        n = len(a)

        def ratio(x, y):
            return x / y if y else math.nan

        reach = [sum(1 for c in counted if c.k >= j) for j in range(k + 1)]          # cycles with >= j drafts
        at_least = [sum(1 for c in counted if c.k >= j and c.accepted >= j) for j in range(k + 1)]
        below = [sum(1 for c in counted if c.k >= j and c.accepted >= j - 1) for j in range(k + 1)]
        used = Counter(c.planned if c.planned >= 0 else c.k for c in cycles)
        return cls(k=k, num_cycles=n,
                   acceptance_length=ratio(sum(x + 1 for x in a), n),
                   per_position={j: ratio(at_least[j], reach[j]) for j in range(1, k + 1)},
                   conditional={j: ratio(at_least[j], below[j]) for j in range(1, k + 1)},
                   k_used=dict(sorted(used.items(), key=lambda kv: -kv[1])))

    def by_k(self, cycles: list[CycleRecord]) -> dict[int, "AcceptanceStats"]:
        """The statistics of the cycles run with each k."""
        return {k: AcceptanceStats.from_cycles(k, [c for c in cycles if (c.planned if c.planned >= 0 else c.k) == k])
                for k in sorted(self.k_used)}


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


def _describe(x) -> str:
    return f"{x!r} ({type(x).__name__})"


def _array_to_list(x, name: str, ranks: tuple[int, ...]) -> list:
    """A torch tensor or NumPy array of token ids -> nested lists of ints, after checking its rank and dtype."""
    shape = list(x.shape)
    if isinstance(x, torch.Tensor) and x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values: pass token ids on the CPU")
    if len(shape) not in ranks:
        want = " or ".join({1: "[T] (one prompt)", 2: "[B, T] (a batch)"}[r] for r in ranks)
        raise ValueError(f"{name} has shape {shape}: token ids come as {want}")
    integer = (not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
               if isinstance(x, torch.Tensor) else x.dtype.kind in "iu")
    if not integer:
        raise ValueError(f"{name} has dtype {x.dtype}: token ids must be integers (e.g. torch.long)")
    return x.tolist()


def normalize_prompts(prompt_ids) -> list[list[int]]:
    """One prompt (a list of ints, a [T] integer tensor or array) or a batch (a list of such prompts,
    a [B, T] integer tensor or array) -> a list of lists of Python ints.

    Floats, booleans, strings and nesting of another depth are refused with the prompt and position."""
    arrays = (torch.Tensor, np.ndarray)
    if isinstance(prompt_ids, arrays):
        prompt_ids = _array_to_list(prompt_ids, "prompt_ids", (1, 2))
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty list of token ids or a list of such lists, got "
                         f"{_describe(prompt_ids) if not isinstance(prompt_ids, (list, tuple)) else prompt_ids!r}")
    batch = any(isinstance(p, (list, tuple) + arrays) for p in prompt_ids)
    prompts = prompt_ids if batch else [prompt_ids]
    out = []
    for i, p in enumerate(prompts):
        where = f"prompt {i}" if batch else "prompt_ids"
        if isinstance(p, arrays):
            p = _array_to_list(p, where, (1,))
        if not isinstance(p, (list, tuple)):
            raise ValueError(f"prompt_ids mixes token ids and lists: {where} is {_describe(p)}; pass a list of "
                             "token ids or a list of such lists")
        for j, t in enumerate(p):
            if not is_int(t):
                nested = " (prompt_ids is nested one level too deep)" if isinstance(t, (list, tuple)) else ""
                raise ValueError(f"{where}, position {j}: {_describe(t)} is not a token id: token ids are "
                                 f"integers{nested}")
        out.append([int(t) for t in p])
    return out


@dataclass(frozen=True)
class Limits:
    """What a decoder can run, for `validate`: token ids 0..vocab-1; `lengths`, pairs (the longest
    sequence, prompt + new tokens, and the words naming that limit, with {n} for the number); `depths`
    MTP depths loaded, and the message when k exceeds them ({k_arg}, {k} and {depths} filled in)."""
    vocab: int
    lengths: tuple[tuple[int, str], ...]
    depths: int
    too_many_drafts: str = "{k_arg} needs {k} MTP depths; the model has {depths} loaded"

    @classmethod
    def of_config(cls, config: InklingConfig, depths: int) -> "Limits":
        return cls(config.vocab_out, ((config.max_position_embeddings, "the model's maximum length {n}"),), depths)

    @classmethod
    def of_model(cls, model: InklingModel) -> "Limits":
        return cls.of_config(model.config, model.num_mtp_depths)


def validate(limits: Limits, prompts: list[list[int]], max_new_tokens: int | list[int], k: int,
             draft_sampling: str = "greedy", seed: int | None = None, eos_token_id: int | None = None,
             flags: dict[str, str] | None = None) -> None:
    """Refuse a request that `limits` cannot run, with a message naming the argument and what is valid.

    prompts: as `normalize_prompts` returns them. max_new_tokens: one limit, or one per prompt (the
    fast engine accepts a list). flags: how the caller's user spells the arguments
    (the command line passes {"max_new_tokens": "--max-new-tokens", "prompt_ids": "the prompt", ...});
    by default they are named as `generate`'s keyword arguments."""
    flags = flags or {}

    def arg(name, value):
        return f"{flags[name]} {value}" if name in flags else f"{name}={value}"

    def named(name):
        return flags.get(name, name)

    per_prompt = isinstance(max_new_tokens, (list, tuple))
    news = list(max_new_tokens) if per_prompt else [max_new_tokens] * len(prompts)
    if len(news) != len(prompts):
        raise ValueError(f"{named('max_new_tokens')}: {len(news)} limits for {len(prompts)} prompts (give one "
                         "limit, or one per prompt)")
    for n in news:
        if not is_int(n):
            raise ValueError(f"{named('max_new_tokens')} must be an integer, got {_describe(n)}")
        if n < 1:
            raise ValueError(f"{named('max_new_tokens')} must be >= 1, got {n}")
    if k == "auto" or isinstance(k, DepthPolicy):
        k = limits.depths if k == "auto" else k.max_k       # "auto" chooses among every depth loaded
    if not is_int(k):
        raise ValueError(f"{named('num_speculative_tokens')} must be an integer or \"auto\", got {_describe(k)}")
    if k < 0:
        raise ValueError(f"{named('num_speculative_tokens')} must be >= 0 (0 = plain decoding), got {k}")
    if k > limits.depths:
        raise ValueError(limits.too_many_drafts.format(k_arg=arg("num_speculative_tokens", k), k=k,
                                                       depths=limits.depths))
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    if seed is not None and not is_int(seed):
        raise ValueError(f"{named('seed')} must be an integer or None, got {_describe(seed)}")
    if eos_token_id is not None and (not is_int(eos_token_id) or not 0 <= eos_token_id < limits.vocab):
        raise ValueError(f"eos_token_id must be a token id in 0..{limits.vocab - 1} or None, got "
                         f"{_describe(eos_token_id)}")
    for i, (p, max_new_tokens) in enumerate(zip(prompts, news)):
        name = flags.get("prompt_ids", f"prompt {i}")
        if len(p) == 0:
            raise ValueError(f"{name} is empty: at least one token is needed")
        bad = [t for t in p if not 0 <= t < limits.vocab]
        if bad:
            raise ValueError(f"{name} has token ids out of range 0..{limits.vocab - 1}: {bad[:10]}")
        total = len(p) + max_new_tokens
        for n, what in limits.lengths:
            if total > n:
                room = (f"at most {n - len(p)} new tokens fit" if n > len(p)
                        else "the prompt alone fills it, so no new token fits")
                raise ValueError(f"{name} has {len(p)} tokens; with {arg('max_new_tokens', max_new_tokens)} the "
                                 f"sequence would reach {total} tokens, beyond {what.format(n=n)}: {room}")


@torch.no_grad()
def generate_one(model: InklingModel, prompt: list[int], max_new_tokens: int, policy: DepthPolicy | int,
                 params: SamplingParams, draft_sampling: str, uniforms: Uniforms,
                 eos_token_id: int | None) -> tuple[list[int], list[CycleRecord]]:
    """One sequence: prefill, then cycles until max_new_tokens or EOS, each with the k `policy` chooses
    (told the cost of each cycle, and of the rows a larger k would recompute first); an int: that k."""
    policy = depth_policy(policy, policy if isinstance(policy, int) else 0)
    def pick(logits, u):
        return int(logits.argmax()) if params.greedy else sample(probs(logits, params), u)

    q_params = draft_params(params, draft_sampling)      # what drafts are drawn from, and q in rejection sampling
    first_u = uniforms(1)[0] if not params.greedy else 0.0
    state = S.prefill(model, prompt, select_first=lambda m, logits, pos: pick(logits, first_u))
    out = [state.tokens[-1]]
    cycles: list[CycleRecord] = []
    max_len = model.config.max_position_embeddings
    k = None
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        remaining = max_new_tokens - len(out)
        k = policy.choose(1, 1, remaining, k, lambda j: S.catchup_rows(state, j))
        k_eff = min(k, remaining - 1, max_len - state.n)  # verify writes positions n-1 .. n-1+k_eff
        t0 = time.perf_counter()
        sampled_drafts = draft_sampling != "greedy" and not params.greedy
        u_draft = uniforms(k_eff) if sampled_drafts else [0.0] * k_eff
        if sampled_drafts:
            select = lambda m, logits, pos: sample(probs(logits, q_params), u_draft[m])  # noqa: E731
        else:
            select = S.greedy_select
        d = S.draft(model, state, k_eff, select)
        t1 = time.perf_counter()
        v = S.verify(model, state, d.tokens)
        t2 = time.perf_counter()
        if params.greedy:
            a, b = S.accept_greedy(d.tokens, v.logits)
        else:
            p = probs(v.logits, params)                                           # [k+1, V]
            q = probs(d.logits, q_params)                                         # [k, V]; one-hot if greedy
            u_acc = uniforms(k_eff)
            a, b = rejection_sample(p, q, d.tokens, u_acc, uniforms(1)[0])
        extra = max(0, state.n - 2 - k_eff - d.window_start)                   # rows of a catch-up
        S.commit(state, d.tokens, a, b, v)
        record = CycleRecord.of_cycle(k, d.tokens, a, b, eos_token_id)
        out += record.emitted
        cycles.append(record)
        if k_eff == k:
            share = (k + 1) / (k + 1 + extra)                                # the window's part of the draft
            policy.observe_cost(1, k, (t1 - t0) * share * 1e3 + (t2 - t1) * 1e3)
            if extra:
                policy.observe_cost(1, k, (t1 - t0) * (1 - share) * 1e3, catchup_rows=extra)
            if record.counted:
                policy.observe(k, [a])
    return out, cycles


def reference_costs(model: InklingModel, max_k: int) -> CycleCosts:
    """The reference's own cycle costs at batch 1 for k = 0..max_k, from one timed trunk pass and one
    timed depth pass at 1 and at max_k + 1 rows (a line in the rows between): cycle(k) = verify(k+1 rows)
    + k * depth(k+1 rows). `generate` measures this before an adaptive run and refines it as it decodes."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, max_k + 1, dtype=torch.long, device=device)

    def timed(fn, rows) -> float:
        fn(rows)                                                        # once untimed: first-call costs
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn(rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t) * 1e3

    def trunk(rows):
        model.trunk(ids[:, :rows])

    def depth(rows):
        model.mtp_depth(0, model.trunk.embed_tokens(ids[:, :rows]), ids[:, :rows])

    costs = CycleCosts()
    v1, vk = timed(trunk, 1), timed(trunk, max_k + 1)
    d1, dk = (timed(depth, 1), timed(depth, max_k + 1)) if max_k and model.num_mtp_depths else (0.0, 0.0)
    for k in range(max_k + 1):
        f = k / max_k if max_k else 0.0
        costs.add(costs.cycles, (1, k), v1 + f * (vk - v1) + k * (d1 + f * (dk - d1)))
    return costs


def generate(model: InklingModel, prompt_ids, max_new_tokens: int,
             num_speculative_tokens: int | str | DepthPolicy = 0, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, draft_sampling: str = "greedy",
             seed: int | None = None, eos_token_id: int | None = None) -> GenerationResult:
    """Decode `max_new_tokens` new tokens for each prompt with k = num_speculative_tokens drafts
    per cycle (k = 0: plain decoding; "auto": each cycle the k with the most expected tokens per ms,
    from the reference's own measured pass costs and the acceptance seen so far (adaptive.py); or a
    DepthPolicy of adaptive.py). `prompt_ids`: one prompt (a list of ints, a [T] integer tensor
    or array) or a batch (a list of them, a [B, T] tensor or array). Bad arguments raise ValueError
    naming the argument and what is valid (see `validate`).
    draft_sampling (temperature > 0 only): "greedy" drafts (one-hot q), "sample" (drafts from the
    target's filtered distribution) or "temperature" (from softmax(logits / T) only, as vLLM drafts);
    every choice is lossless (inkling_ref.sampling)."""
    if not isinstance(model, InklingModel):
        raise ValueError(f"model must be an InklingModel (e.g. load_checkpoint(path)), got {type(model).__name__}")
    if isinstance(max_new_tokens, (list, tuple)):
        raise ValueError(f"max_new_tokens must be an integer, got {_describe(max_new_tokens)}: this generate "
                         "takes one limit for every prompt (the fast engine's Engine.generate takes one per prompt)")
    prompts = normalize_prompts(prompt_ids)
    params = SamplingParams(temperature, top_k, top_p)
    validate(Limits.of_model(model), prompts, max_new_tokens, num_speculative_tokens, draft_sampling, seed,
             eos_token_id)
    t0 = time.perf_counter()
    policy = depth_policy(num_speculative_tokens, model.num_mtp_depths)
    if num_speculative_tokens == "auto":
        policy.costs = reference_costs(model, policy.max_k)
    token_ids, cycles = [], []
    for i, prompt in enumerate(prompts):
        uniforms = Uniforms(None if seed is None else sequence_seed(seed, i))
        out, recs = generate_one(model, prompt, max_new_tokens, policy, params, draft_sampling, uniforms,
                                 eos_token_id)
        token_ids.append(out)
        cycles.append(recs)
    elapsed = time.perf_counter() - t0
    stats = AcceptanceStats.from_cycles(policy.max_k, [c for seq in cycles for c in seq])
    return GenerationResult(token_ids=token_ids, cycles=cycles, stats=stats, elapsed_s=elapsed)
