"""`Engine`: batched multi-depth MTP speculative decoding on the fast kernels, replayed as CUDA graphs.

The same loop as `inkling_ref.generate` (docs/spec/mtp-cycle.md), with the same names; what
changes is where the state lives (static position-addressed caches, caches.py), that prompts and
cycles are fixed sequences of kernels over padded batches, and that the host never waits inside them:

    prefill pass(rows)         on the device, captured per (B, T, k, mode): the next chunk of up to B
                               admitted sequences at once (one row each, padded to T tokens; plan in
                               prefill_plan.py): the trunk over the chunk, H_p of the first window into
                               the hidden ring, every depth over the chunk's teacher-forced rows
                               p <= L-2-k; for a prompt's last chunk x_L (greedy, or sampled with its
                               uniform) and the slot's state (n = L+1, stop, EOS, done)
    cycle(batch):              on the device, captured per (B, k, mode):
        draft                  depths 0..k-1 over the window [n-2-k, n-2]; d_{m+1} -> tokens[n+m]
        verify                 trunk over tokens[n-1 .. n-1+k] at positions n-1 .. n-1+k
        accept                 greedy_accept / rejection_sample, capped at k_eff per sequence
        commit                 tokens[n+a] = b; n += a + 1          (rollback = the length only)
        outcome                the emitted tokens cut at EOS; done[slot] at EOS or n = stop
    host (generate)            admits prompts into free slots, launches passes and cycles, and books
                               each step from one asynchronous copy of its result array

Fixed shapes: every cycle runs T = k+1 rows per sequence for every depth and the verify. A window
row at a position < 0 (short prompts) and a verify row beyond k_eff = min(k, stop - n - 1) are
padding (pos = -1: no cache reads or writes). A batch is padded to the next captured size with rows
that point at the scratch slot (SlotState.scratch) with every position -1: they write nothing but
the scratch slot. A row whose slot is `done` is such a padding row too. Depths beyond k_eff still run
(their rows are rewritten by the next window), and drafts beyond k_eff are never accepted, so the
records are those of the reference: CycleRecord.k is k_eff.

The host loop (`generate`). Everything a cycle needs is device state: the committed length n, stop,
the EOS id and `done` per slot. So the host may launch step i+1 before it has read step i's results
(`overlap=True`, the default): it launches, then books the previous step from its pinned copy (one
device-to-host copy per step, waited on through an event). A sequence that finished in cycle i is
still in the batch of cycle i+1, already launched: its slot is `done` on the device, so that row runs
as padding and comes back with live = 0, and the host discards it; the slot is refilled after
cycle i is booked, at most one cycle late. Results are the same as with `overlap=False`, the
synchronous reference loop (launch a step, wait, book it), token for token and record for record.
Prefill passes and cycles alternate while sequences are running (a running sequence waits at most
one pass between two cycles); prompts queued beyond max_batch_size wait for a free slot.

Sampling (temperature > 0) uses, per sequence, the uniforms in the reference's order (k_eff for
sampled drafts, k_eff for the acceptance tests, one for the correction/bonus; one for x_L first).
`uniforms="device"` draws them with Philox on the device inside the graph (a different stream than
the reference's, the same distribution); `uniforms="reference"` copies each sequence's stream from
the reference's own per-sequence torch.Generator to the device when it is admitted, and the cycle
reads it at the slot's offset (SlotState.counters): sampled output then equals inkling_ref.generate's
for the same seed, token for token.

Driving the steps by hand (tests, notebooks): `prefill(slot, prompt, k, stop, mode)` starts one
sequence (eager, the reference path of the batched passes); `prefill_batch(slots, prompts, k, stops,
mode)` starts several at once with the batched passes that generate uses; then `make_batch`, `draft`,
`verify`, `accept`, `commit` (or `cycle` / `run_cycle`) run cycles on chosen slots.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inkling_ref import InklingModel, load_checkpoint
from inkling_ref.generation import (AcceptanceStats, CycleRecord, GenerationResult, Limits, Uniforms,
                                    normalize_prompts, sequence_seed, validate)
from inkling_ref.sampling import SamplingParams, draft_params

from . import forward, weights
from .caches import LayerCache, SlotState
from .graphs import StepGraph
from .kernels.accept import greedy_accept
from .kernels.rejection import rejection_sample
from .kernels.common import interpreting
from .kernels.sampling import sample_tokens, sampling_probs
from .kernels.uniforms import philox_uniforms
from .prefill_plan import default_prefill_lengths, plan_prefill_pass, prefill_passes
from .warmup import SetupReport, build_concurrently, warmup

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PASS_META = ("slot", "start", "length", "prompt_len", "stop", "eos", "seed", "last")  # prefill row columns
META = len(PASS_META)


@dataclass(frozen=True)
class DecodeMode:
    """How tokens are chosen (a graph is captured per mode): greedy, or sampling with `params` and
    drafts chosen by `draft_sampling` (inkling_ref.sampling.DRAFT_SAMPLING: greedy, sampled from the
    target's filtered distribution, or sampled at the temperature only, as vLLM drafts)."""
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


@dataclass
class Batch:
    """The inputs of one cycle: batch row b is the sequence in slot[b] (the scratch slot for padding
    rows, live[b] = False); uniforms [B, 2k+1] float64 (sampling only): draft, accept, final."""
    slot: torch.Tensor      # int32 [B]
    live: torch.Tensor      # bool [B]
    uniforms: torch.Tensor  # float64 [B, 2k+1]


class CycleColumns:
    """Columns of a cycle's result row (int64 [B, k+7]): a, b, d_1..d_k, then k_eff, the number of
    tokens emitted (a+1, or up to and including an EOS), whether an EOS was emitted, whether the
    sequence is done after the cycle, and whether the row ran live (0: padding or an already finished
    sequence; nothing to book)."""

    def __init__(self, k: int):
        self.a, self.b, self.drafts = 0, 1, 2
        self.k_eff, self.emitted, self.eos, self.done, self.live = k + 2, k + 3, k + 4, k + 5, k + 6


@dataclass
class StepTiming:
    """Host-side timing of one step of the last `generate` (time.perf_counter seconds)."""
    kind: str               # "prefill" (one batched pass) or "cycle"
    shape: tuple            # prefill: (B, T), the captured pass; cycle: (B,)
    rows: int               # prefill: prompt chunks in the pass; cycle: rows that ran live
    tokens: int             # prefill: prompt tokens in the pass; cycle: tokens emitted
    launched_s: float       # when the host began to launch it
    ready_s: float = math.nan   # when its result array was on the host (after the wait)
    host_s: float = 0.0     # host time spent on it outside the wait: launching and booking


@dataclass
class _Sequence:
    """Host bookkeeping of one sequence."""
    index: int
    prompt: torch.Tensor                    # int64 [L] on the host
    stop: int                               # prompt length + max_new_tokens
    seed: int
    eos: int                                # -1: none
    uniforms: Uniforms | None               # the reference's stream (uniforms="reference", sampling)
    draws: int                              # the most uniforms it can use: x_L's, then 2k+1 per cycle
    slot: int = -1
    prefilled: int = 0                      # prompt tokens whose prefill pass is launched
    out: list[int] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)
    first_s: float = math.nan               # when x_L was booked (time.perf_counter)
    done_s: float = math.nan                # when the step that finished it was booked


@dataclass
class _Step:
    """A launched step: its batch rows' sequences and its result array on its way to the host."""
    kind: str
    seqs: list[_Sequence]
    last: list[bool]                        # prefill: the row's chunk ends its prompt
    host: torch.Tensor
    event: object                           # torch.cuda.Event, None on the CPU
    timing: StepTiming


class Engine:
    """Batched speculative decoding with k = `num_speculative_tokens` MTP drafts per cycle.

    checkpoint_or_model: a released-layout checkpoint directory or an `InklingModel` (not modified;
    its weights are copied to `device` in `dtype`), or kernel-ready `weights.ModelWeights` already in
    `dtype` on `device` (used as they are; e.g. random weights at a scale no host model would fit). Caches are allocated for `max_batch_size`
    sequences of at most `max_seq_len` tokens (prompt + new) and up to k drafts per cycle.
    use_cuda_graphs (default: on CUDA) captures one cycle per batch size in `batch_sizes` (default
    1, 2, 4, ... up to max_batch_size) and one prefill pass per (batch size, chunk length); False runs
    the same code eagerly (also the CPU interpreter).
    prefill_tokens: the token budget of one prefill pass (batch rows x chunk length, padding included);
    prefill_lengths: its chunk lengths (default 16, 32, ... up to the budget, `default_prefill_lengths`).
    overlap: generate's default loop (True: the next step is launched before the last one is booked).

    Setup: the first call of a new shape builds Triton kernel specializations (about a second each from
    an empty Triton cache, milliseconds from a warm one) and captures CUDA graphs; `warmup(prompt_ids,
    **generate_kwargs)` pays that up front, building the request's kernels concurrently
    (`build_kernels`), and says what it cost (warmup.py).
    """

    def __init__(self, checkpoint_or_model, max_batch_size: int, max_seq_len: int, num_speculative_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, *, device=None, use_cuda_graphs: bool | None = None,
                 batch_sizes: list[int] | None = None, prefill_tokens: int = 4096,
                 prefill_lengths: list[int] | None = None, uniforms: str = "device", overlap: bool = True):
        k = num_speculative_tokens
        for name, v, lo in (("max_batch_size", max_batch_size, 1), ("max_seq_len", max_seq_len, 2),
                            ("num_speculative_tokens", k, 0), ("prefill_tokens", prefill_tokens, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype}: the fast kernels run torch.float32, torch.bfloat16 or torch.float16")
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"device={device}: the fast engine needs a CUDA device (or TRITON_INTERPRET=1 to "
                             "run its kernels through the Triton interpreter on CPU)")
        if use_cuda_graphs is None:
            use_cuda_graphs = device.type == "cuda"
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs a CUDA device")
        if uniforms not in ("device", "reference"):
            raise ValueError(f"uniforms must be 'device' or 'reference', got {uniforms!r}")
        sizes = batch_sizes if batch_sizes is not None else _default_batch_sizes(max_batch_size)
        if not sizes or any(not isinstance(b, int) or not 1 <= b <= max_batch_size for b in sizes) \
                or max(sizes) != max_batch_size:
            raise ValueError(f"batch_sizes must be integers in 1..max_batch_size={max_batch_size} including "
                             f"max_batch_size itself, got {batch_sizes!r}")
        lengths = prefill_lengths if prefill_lengths is not None else default_prefill_lengths(prefill_tokens)
        if not lengths or any(not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= prefill_tokens
                              for t in lengths):
            raise ValueError(f"prefill_lengths must be integers in 1..prefill_tokens={prefill_tokens}, "
                             f"got {prefill_lengths!r}")
        if min(lengths) * min(sizes) > prefill_tokens:
            raise ValueError(f"prefill_tokens={prefill_tokens} is below the smallest prefill pass: batch size "
                             f"{min(sizes)} x chunk length {min(lengths)}")

        W = self._weights(checkpoint_or_model, k, dtype, device)
        cfg = W.config
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} is beyond the model's maximum length "
                             f"{cfg.max_position_embeddings} (max_position_embeddings)")
        self.config, self.k, self.dtype, self.device = cfg, k, dtype, device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.batch_sizes = sorted(set(sizes))
        self.prefill_tokens, self.prefill_lengths = prefill_tokens, sorted(set(lengths))
        self.use_cuda_graphs, self.uniforms, self.overlap = use_cuda_graphs, uniforms, overlap
        self.W = W

        def cache(block):
            return LayerCache.allocate(block.attn, cfg.hidden_size, cfg.conv_kernel_size, max_batch_size,
                                       max_seq_len, k, dtype, device)

        self.trunk_caches = [cache(b) for b in self.W.blocks]
        self.depth_caches = [cache(d.block) for d in self.W.depths]
        self.state = SlotState.allocate(max_batch_size, max_seq_len, k, cfg.hidden_size, dtype, device)
        # uniforms="reference": each slot's copy of its sequence's reference stream, long enough for
        # x_L and max_seq_len - 1 cycles of 2k+1 draws
        self.reference_uniforms = (torch.zeros(max_batch_size + 1, 1 + (max_seq_len - 1) * (2 * k + 1),
                                               dtype=torch.float64, device=device)
                                   if uniforms == "reference" else None)
        self.graphs: dict = {}         # ("cycle", B, k, mode) / ("prefill", B, T, k, mode) -> graphs.StepGraph
        self.graph_pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
        self.timings: list[StepTiming] = []
        self.request_times: list[tuple[float, float]] = []
        self.started_s = math.nan

    @staticmethod
    def _weights(checkpoint_or_model, k: int, dtype: torch.dtype, device) -> weights.ModelWeights:
        """The kernel-ready weights of the trunk and the first k MTP depths, in dtype on device."""
        if isinstance(checkpoint_or_model, weights.ModelWeights):
            W = checkpoint_or_model
            if k > len(W.depths):
                raise ValueError(f"num_speculative_tokens={k} needs {k} MTP depths; the weights have {len(W.depths)}")
            on = W.embed.device                                          # "cuda" means any index; "cuda:1" that one
            if W.embed.dtype != dtype or on.type != device.type or device.index not in (None, on.index):
                raise ValueError(f"the weights are {W.embed.dtype} on {W.embed.device}; the engine was asked for "
                                 f"{dtype} on {device}")
            return dataclasses.replace(W, depths=W.depths[:k])
        if isinstance(checkpoint_or_model, InklingModel):
            model = checkpoint_or_model
            if k > model.num_mtp_depths:
                raise ValueError(f"num_speculative_tokens={k} needs {k} MTP depths; the model has "
                                 f"{model.num_mtp_depths} loaded")
        elif isinstance(checkpoint_or_model, (str, Path)):
            model = load_checkpoint(checkpoint_or_model, dtype=dtype, device=device, num_mtp_depths=k)
        else:
            raise TypeError("checkpoint_or_model must be a checkpoint directory, an inkling_ref.InklingModel or "
                            f"inkling_fast.weights.ModelWeights, got {type(checkpoint_or_model).__name__}")
        return weights.from_model(model, k, dtype, device)

    # ================================================================== the cycle (device only)
    @property
    def hidden_rows(self) -> int:
        return self.state.hidden.shape[1]

    def _lengths(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids as int64 [B], committed lengths n [B]); padding rows get n = 0, so that every index
        they form stays in range whatever the scratch slot holds."""
        s = batch.slot.long()
        return s, torch.where(batch.live, self.state.n[s], 0)

    def draft(self, batch: Batch, k: int, mode: DecodeMode) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depths 0..k-1 over the window [n-2-k, n-2]; d_{m+1} is written at tokens[n+m].
        Returns (drafts int64 [B, k], q [B, k, V] float64: the draft distributions, or None for greedy drafts)."""
        st, (s, n) = self.state, self._lengths(batch)
        if k == 0:                                                               # plain decoding: no drafts
            return st.tokens.new_zeros(len(s), 0), None
        p = n[:, None] - 2 - k + torch.arange(k + 1, device=n.device)            # window positions [B, T]
        pos = torch.where(batch.live[:, None] & (p >= 0), p, -1).int()
        h = st.hidden[s[:, None], p.clamp(min=0) % self.hidden_rows]            # H_p, depth 0's input
        drafts, q = [], []
        for m in range(k):
            ids = st.tokens[s[:, None], (p + m + 1).clamp(min=0)]               # slot p+m+1: x or an earlier draft
            h = forward.depth_forward(self.W, m, self.depth_caches[m], h, ids, batch.slot, pos)
            last = h[:, -1]                                                      # row p = n-2
            if mode.sampled_drafts:
                q_m = sampling_probs(forward.logits(self.W, last), mode.draft_params)  # [B, V]
                d = sample_tokens(q_m, batch.uniforms[:, m])
                q.append(q_m)
            else:
                d = forward.greedy_tokens(self.W, last)
            st.tokens.index_put_((s, n + m), d)                                  # d_{m+1} at position n+m
            drafts.append(d)
        return torch.stack(drafts, dim=1), (torch.stack(q, dim=1) if q else None)

    def verify(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk over [x_{n-1}, d_1, .., d_k] at positions n-1 .. n-1+k (rows beyond k_eff are padding);
        writes H_{n-1..n-1+k} into the hidden ring. Returns (H [B, k+1, H], k_eff int64 [B])."""
        st, (s, n) = self.state, self._lengths(batch)
        k_eff = torch.where(batch.live, (st.stop[s] - n - 1).clamp(0, k), 0)
        t = torch.arange(k + 1, device=n.device)
        p = n[:, None] - 1 + t                                                    # [B, T]
        pos = torch.where(batch.live[:, None] & (t <= k_eff[:, None]), p, -1).int()
        ids = st.tokens[s[:, None], p.clamp(min=0)]
        hidden = forward.trunk_forward(self.W, self.trunk_caches, ids, batch.slot, pos)
        st.hidden.index_put_((s[:, None].expand_as(p), p % self.hidden_rows), hidden)
        return hidden, k_eff

    def accept(self, batch: Batch, k: int, mode: DecodeMode, drafts: torch.Tensor, q: torch.Tensor | None,
               hidden: torch.Tensor, k_eff: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Accepted count a (<= k_eff) and the next token b (correction or bonus), per sequence."""
        B, T, H = hidden.shape
        if mode.greedy:
            target = forward.greedy_tokens(self.W, hidden.view(B * T, H)).view(B, T)
            a, nxt, _ = greedy_accept(drafts, target, k_eff)
        else:
            p = sampling_probs(forward.logits(self.W, hidden), mode.params)      # [B, T, V] float64
            u = batch.uniforms
            a, nxt, _ = rejection_sample(p, q, drafts, u[:, k:2 * k], u[:, 2 * k], k_eff)
        return a.long(), nxt

    def commit(self, batch: Batch, a: torch.Tensor, nxt: torch.Tensor) -> None:
        """tokens[n+a] = b, n <- n + a + 1 (padding rows: only the scratch slot's tokens change)."""
        st, (s, n) = self.state, self._lengths(batch)
        st.tokens.index_put_((s, n + a), nxt)
        st.n.index_put_((s,), torch.where(batch.live, n + a + 1, n))

    def cycle(self, batch: Batch, k: int, mode: DecodeMode) -> torch.Tensor:
        """draft -> verify -> accept -> commit -> outcome, all on the device, for the rows of `batch` whose
        slot is not done (the others run as padding). Returns int64 [B, k+7], see CycleColumns."""
        st = self.state
        live = batch.live & ~st.done[batch.slot.long()]
        batch = Batch(slot=torch.where(live, batch.slot, st.scratch).int(), live=live, uniforms=batch.uniforms)
        s, n = self._lengths(batch)
        if not mode.greedy:
            self._draw_uniforms(batch, k, mode, s, n)
        drafts, q = self.draft(batch, k, mode)
        hidden, k_eff = self.verify(batch, k)
        a, nxt = self.accept(batch, k, mode, drafts, q, hidden, k_eff)
        self.commit(batch, a, nxt)
        return self._outcome(batch, s, n, drafts, a, nxt, k_eff)

    def cycle_rows(self, rows: torch.Tensor, k: int, mode: DecodeMode) -> torch.Tensor:
        """`cycle` of the batch whose row b runs the sequence in slot rows[b] (int32 [B]; -1: a padding row)."""
        live = rows >= 0
        batch = Batch(slot=torch.where(live, rows, self.state.scratch).int(), live=live,
                      uniforms=torch.zeros(len(rows), 2 * k + 1, dtype=torch.float64, device=rows.device))
        return self.cycle(batch, k, mode)

    def _draw_uniforms(self, batch: Batch, k: int, mode: DecodeMode, s: torch.Tensor, n: torch.Tensor) -> None:
        """batch.uniforms [B, 2k+1] = this cycle's draws (draft | accept | final); the slots' counters advance.
        Device: 2k+1 Philox draws. Reference: the next draws of the slot's copied stream, as many as
        the reference takes (k_eff per sampled-draft and acceptance group, then one); the columns of a
        group beyond k_eff are never used."""
        st = self.state
        if self.uniforms == "device":
            counters = st.counters[s]
            philox_uniforms(st.seeds[s], counters, 2 * k + 1, out=batch.uniforms)
            st.counters.index_put_((s,), counters)
            return
        ref = self.reference_uniforms
        k_eff = torch.where(batch.live, (st.stop[s] - n - 1).clamp(0, k), 0)
        start = st.counters[s]
        j = torch.arange(k, device=s.device)
        last = ref.shape[1] - 1
        if mode.sampled_drafts:
            batch.uniforms[:, :k] = ref[s[:, None], (start[:, None] + j).clamp(max=last)]
            start = start + k_eff
        batch.uniforms[:, k:2 * k] = ref[s[:, None], (start[:, None] + j).clamp(max=last)]
        batch.uniforms[:, 2 * k] = ref[s, (start + k_eff).clamp(max=last)]
        st.counters.index_put_((s,), start + k_eff + 1)

    def _outcome(self, batch: Batch, s: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor, a: torch.Tensor,
                 nxt: torch.Tensor, k_eff: torch.Tensor) -> torch.Tensor:
        """The emitted tokens d_1..d_a, b cut after the first EOS, and done = EOS emitted or n = stop
        (written to the slot); the cycle's result rows (CycleColumns)."""
        st = self.state
        k = drafts.shape[1]
        j = torch.arange(k + 1, device=s.device)
        emitted = torch.where(j < a[:, None], torch.cat([drafts, nxt[:, None]], dim=1), nxt[:, None])
        at_eos = (emitted == st.eos[s][:, None]) & (j <= a[:, None])
        hit = at_eos.any(dim=1)
        count = torch.where(hit, at_eos.int().argmax(dim=1) + 1, a + 1)
        done = batch.live & (hit | (n + a + 1 >= st.stop[s]))
        st.done.index_put_((s,), done)
        status = torch.stack([k_eff, count, hit.long(), done.long(), batch.live.long()], dim=1)
        return torch.cat([a[:, None], nxt[:, None], drafts, status], dim=1)

    # ================================================================== prefill
    @torch.no_grad()
    def prefill(self, slot: int, prompt: list[int], k: int, stop: int, mode: DecodeMode,
                first_uniform: float | None = None) -> int:
        """Start the sequence `prompt` (x_0..x_{L-1}) in `slot`, one sequence eagerly (the reference path of
        the batched passes): the trunk over the prompt in chunks of prefill_tokens, x_L picked from its
        last logits, the hidden ring filled with H_{L-1-k..L-1}, and every depth over the prompt rows
        0..L-2-k (teacher-forced), so that the first cycle's window [L-1-k, L-1] continues them. Returns
        x_L (one host sync). `first_uniform`: x_L's uniform (reference uniforms only; with device
        uniforms the slot's seed and counter are used). No EOS is set for the slot."""
        st, L = self.state, len(prompt)
        if not 0 <= slot < self.max_batch_size:
            raise ValueError(f"slot={slot} is outside 0..max_batch_size-1={self.max_batch_size - 1}")
        if not 1 <= L <= stop - 1 or stop > self.max_seq_len:
            raise ValueError(f"a prompt of {L} tokens with stop={stop} does not fit max_seq_len={self.max_seq_len}")
        if k > self.k:
            raise ValueError(f"k={k} drafts need {k} MTP depths; the engine has {self.k} loaded")
        st.tokens[slot, :L] = torch.tensor(prompt, dtype=torch.int64)
        slot_t = torch.tensor([slot], dtype=torch.int32, device=self.device)
        depth_rows = L - 1 - k                                                   # depth rows 0..L-2-k
        chunk = self.prefill_tokens
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)
            pos = torch.arange(c0, c1, dtype=torch.int32, device=self.device)[None]
            hidden = forward.trunk_forward(self.W, self.trunk_caches, st.tokens[slot, c0:c1][None], slot_t, pos,
                                           prefill=True)
            w0 = max(c0, L - 1 - k)                                              # the first window's H_p
            if w0 < c1:
                rows = torch.arange(w0, c1, device=self.device) % self.hidden_rows
                st.hidden[slot, rows] = hidden[0, w0 - c0:]
            d1 = min(c1, depth_rows)
            if d1 > c0:                                                          # depth rows c0..d1-1
                h, d_pos = hidden[:, : d1 - c0], pos[:, : d1 - c0].contiguous()
                for m in range(k):
                    ids = st.tokens[slot, c0 + m + 1: d1 + m + 1][None]          # x_{p+m+1}
                    h = forward.depth_forward(self.W, m, self.depth_caches[m], h, ids, slot_t, d_pos, prefill=True)
        last = hidden[0, -1:]                                                    # H_{L-1}
        if mode.greedy:
            first = forward.greedy_tokens(self.W, last)
        else:
            if self.uniforms == "device":
                u = philox_uniforms(st.seeds[slot: slot + 1], st.counters[slot: slot + 1], 1)[:, 0]
            else:
                u = torch.tensor([first_uniform], dtype=torch.float64, device=self.device)
            first = sample_tokens(sampling_probs(forward.logits(self.W, last), mode.params), u)
        st.tokens[slot, L] = first[0]
        st.n[slot] = L + 1
        st.stop[slot] = stop
        st.eos[slot] = -1
        st.done[slot] = L + 1 >= stop
        return int(first[0])

    def prefill_rows(self, rows: torch.Tensor, T: int, k: int, mode: DecodeMode) -> torch.Tensor:
        """One batched prefill pass, on the device (no host sync: captured per (B, T, k, mode)).

        rows: int64 [B, 8 + T + k]. Row b: the columns PASS_META (slot: SlotState.scratch for a padding
        row; start c0, length l >= 1 (0: padding) of its chunk; prompt length L; stop; eos (-1: none);
        seed; last: 1 if c0 + l = L), then the prompt tokens at positions c0 .. c0+T+k-1 (those < L).
        The chunk sits at positions c0 .. c0+l-1 (row positions pos, -1 beyond l). Every sequence is in
        one row at most, and its earlier chunks were prefilled by earlier passes:

            tokens[slot, c0 .. min(L, c0+l+k) - 1] = the row's tokens (the depth rows read k ahead)
            H = trunk(chunk)                                         trunk caches at pos
            hidden[slot, p % (2k+2)] = H_p          for p >= L-1-k   the first window's hiddens
            depth m over rows p <= L-2-k (tokens x_{p+m+1}, inputs H / depth m-1)   depth caches
            last chunk:  x_L = pick(H_{L-1}); tokens[slot, L] = x_L; n = L+1; stop, eos, seed,
                         counter (1 after a sampled x_L, else 0) and done = (x_L == eos or L+1 >= stop)

        Returns int64 [B, 2]: x_L and done per row (meaningful for last chunks only)."""
        st, dev = self.state, rows.device
        B, scratch = rows.shape[0], st.scratch
        slot, c0, length, L, stop, eos, seed, last = rows[:, :META].unbind(1)
        ids = rows[:, META:]                                                     # [B, T + k]
        t = torch.arange(T + k, device=dev)
        p = c0[:, None] + t
        put = (t < length[:, None] + k) & (p < L[:, None])
        st.tokens.index_put_((torch.where(put, slot[:, None], scratch), torch.where(put, p, 0)), ids)
        pos = torch.where(t[:T] < length[:, None], p[:, :T], -1).int()
        slot32 = slot.int()
        hidden = forward.trunk_forward(self.W, self.trunk_caches, ids[:, :T].contiguous(), slot32, pos, prefill=True)
        window = (pos >= 0) & (pos >= (L - 1 - k)[:, None])
        st.hidden.index_put_((torch.where(window, slot[:, None], scratch), pos.clamp(min=0) % self.hidden_rows),
                             hidden)
        d_pos = torch.where(pos < (L - 1 - k)[:, None], pos, -1)                # depth rows p <= L-2-k
        h, width = hidden, st.tokens.shape[1]
        for m in range(k):
            tok = st.tokens[slot[:, None], (p[:, :T] + m + 1).clamp(max=width - 1)]   # x_{p+m+1}
            h = forward.depth_forward(self.W, m, self.depth_caches[m], h, tok, slot32, d_pos, prefill=True)
        h_last = hidden[torch.arange(B, device=dev), (length - 1).clamp(min=0)]  # H_{c0+l-1}
        counter = torch.zeros(B, dtype=torch.int64, device=dev)
        if mode.greedy:
            first = forward.greedy_tokens(self.W, h_last)
        else:
            if self.uniforms == "device":
                u = philox_uniforms(seed, counter, 1)[:, 0]                     # counter -> 1
            else:
                u = self.reference_uniforms[slot, 0]
                counter += 1
            first = sample_tokens(sampling_probs(forward.logits(self.W, h_last), mode.params), u)
        s = torch.where(last.bool(), slot, scratch)
        st.tokens.index_put_((s, L), first)
        done = (first == eos) | (L + 1 >= stop)
        for dst, value in ((st.n, L + 1), (st.stop, stop), (st.eos, eos), (st.seeds, seed), (st.counters, counter),
                           (st.done, done)):
            dst.index_put_((s,), value)
        return torch.stack([first, done.long()], dim=1)

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], prompts: list[list[int]], k: int, stops: list[int],
                      mode: DecodeMode = DecodeMode(), seeds: list[int] | None = None,
                      eos_token_id: int | None = None) -> list[int]:
        """Start the sequences `prompts` in `slots` with the batched prefill passes of `generate` (graph
        replays, or eager) and return their x_L (one host sync per pass, at the end). stops[i] = prompt
        length + max_new_tokens of sequence i; seeds: the per-sequence seeds of sampled x_L (device
        uniforms: the Philox seed; reference uniforms: the reference generator's seed). The passes' host
        timings are left in `self.timings`."""
        if len(slots) != len(prompts) or len(stops) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise ValueError(f"slots, prompts, stops (and seeds) must have one entry per sequence, got "
                             f"{len(slots)}, {len(prompts)}, {len(stops)}")
        if any(not 0 <= s < self.max_batch_size for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and in 0..{self.max_batch_size - 1}")
        if k > self.k:
            raise ValueError(f"k={k} drafts need {k} MTP depths; the engine has {self.k} loaded")
        for i, (p, stop) in enumerate(zip(prompts, stops)):
            if not 1 <= len(p) <= stop - 1 or stop > self.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens with stop={stop} do not fit max_seq_len="
                                 f"{self.max_seq_len}")
        seqs = [self._sequence(i, p, stops[i] - len(p), k, mode, seeds[i] if seeds is not None else 0, eos_token_id)
                for i, p in enumerate(prompts)]
        for seq, slot in zip(seqs, slots):
            self._admit(seq, slot)
        pending, steps = list(seqs), []
        while pending:
            steps.append(self._launch_prefill(pending, k, mode))
            pending = [s for s in pending if s.prefilled < len(s.prompt)]
        for step in steps:
            self._book(step, k)
        self.timings = [step.timing for step in steps]
        return [s.out[0] for s in seqs]

    # ================================================================== batches, graphs, copies
    def batch_size_for(self, num_sequences: int) -> int:
        """The smallest captured batch size that holds `num_sequences`."""
        if not 1 <= num_sequences <= self.max_batch_size:
            raise ValueError(f"a batch of {num_sequences} sequences is beyond max_batch_size={self.max_batch_size}")
        return next(b for b in self.batch_sizes if b >= num_sequences)

    def padding_batch(self, batch_size: int, k: int) -> Batch:
        """A batch of `batch_size` padding rows: every row on the scratch slot, none live."""
        dev = self.device
        return Batch(slot=torch.full((batch_size,), self.state.scratch, dtype=torch.int32, device=dev),
                     live=torch.zeros(batch_size, dtype=torch.bool, device=dev),
                     uniforms=torch.zeros(batch_size, 2 * k + 1, dtype=torch.float64, device=dev))

    def make_batch(self, slots: list[int], k: int, uniforms: torch.Tensor | None = None) -> Batch:
        """The batch of the sequences in `slots`, padded to the next captured size (host -> device
        copies: outside a cycle). uniforms: [len(slots), 2k+1], used as they are by `draft` and
        `accept` (`cycle` draws its own)."""
        B = self.batch_size_for(len(slots))
        if any(not 0 <= s < self.max_batch_size for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and in 0..{self.max_batch_size - 1}")
        batch = self.padding_batch(B, k)
        A = len(slots)
        batch.slot[:A] = torch.tensor(slots, dtype=torch.int32)
        batch.live[:A] = True
        if uniforms is not None:
            batch.uniforms[:A] = uniforms
        return batch

    def _upload(self, host: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """host -> device without a host sync (through pinned memory on CUDA), into `dst` when given."""
        if self.device.type == "cuda":
            host = host.pin_memory()                  # the caching host allocator keeps it until the copy ran
            if dst is None:
                return host.to(self.device, non_blocking=True)
        elif dst is None:
            return host
        return dst.copy_(host, non_blocking=True)

    def _fetch(self, out: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The one device -> host copy of a step: into pinned memory, asynchronously, with an event to wait on."""
        if self.device.type != "cuda":
            return out.clone(), None
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def padding_input(self, key: tuple) -> torch.Tensor:
        """The device input of the step `key` with every row padding (on the scratch slot, writing nothing
        else): what a graph is captured on. key: ("cycle", B, k, mode) or ("prefill", B, T, k, mode)."""
        if key[0] == "cycle":
            return torch.full((key[1],), -1, dtype=torch.int32, device=self.device)
        _, B, T, k, _ = key
        pad = torch.zeros(B, META + T + k, dtype=torch.int64, device=self.device)
        pad[:, 0] = self.state.scratch
        return pad

    def step(self, key: tuple, rows: torch.Tensor) -> torch.Tensor:
        """Run the step `key` on its device input `rows` (eagerly): `cycle_rows` or `prefill_rows`."""
        if key[0] == "cycle":
            _, _, k, mode = key
            return self.cycle_rows(rows, k, mode)
        _, _, T, k, mode = key
        return self.prefill_rows(rows, T, k, mode)

    def request_steps(self, prompt_lengths: list[int], k: int, mode: DecodeMode) -> list[tuple]:
        """The step keys a `generate` of prompts of these lengths runs: the prefill passes of the prompts
        admitted at the start (the first max_batch_size; later admissions depend on when sequences
        finish), then a cycle at every batch size up to the one that holds them (sequences finish at
        different cycles, so the batch shrinks)."""
        first = prompt_lengths[: self.max_batch_size]
        passes = prefill_passes(first, self.prefill_lengths, self.batch_sizes, self.prefill_tokens)
        top = self.batch_size_for(len(first))
        return [("prefill", B, T, k, mode) for B, T in dict.fromkeys(passes)] + \
               [("cycle", B, k, mode) for B in self.batch_sizes if B <= top]

    def _run_step(self, key: tuple, host_input: torch.Tensor) -> torch.Tensor:
        """The step `key` on `host_input` as a graph replay (captured on first use) or eagerly."""
        if not self.use_cuda_graphs:
            return self.step(key, self._upload(host_input))
        if key not in self.graphs:
            self.graphs[key] = StepGraph(self.graph_pool, lambda rows: self.step(key, rows), self.padding_input(key))
        return self.graphs[key].run(host_input, self._upload)

    def _launch_cycle(self, slots: list[int], k: int, mode: DecodeMode) -> tuple[torch.Tensor, object]:
        """Launch one cycle of the sequences in `slots`; returns its result array on its way to the host."""
        B = self.batch_size_for(len(slots))
        rows = torch.tensor(slots + [-1] * (B - len(slots)), dtype=torch.int32)
        out = self._run_step(("cycle", B, k, mode), rows)
        return self._fetch(out)

    @torch.no_grad()
    def run_cycle(self, slots: list[int], k: int, mode: DecodeMode) -> list[list[int]]:
        """One cycle for the sequences in `slots` (graph replay, or eager); waits for it and returns per
        sequence its result row (CycleColumns: a, b, d_1..d_k, k_eff, emitted, eos, done, live)."""
        if any(not 0 <= s < self.max_batch_size for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and in 0..{self.max_batch_size - 1}")
        host, event = self._launch_cycle(list(slots), k, mode)
        if event is not None:
            event.synchronize()
        return host[: len(slots)].tolist()

    def _launch_prefill(self, pending: list[_Sequence], k: int, mode: DecodeMode) -> _Step:
        """Launch the next prefill pass over the pending sequences (prefill_plan.py), advancing their
        `prefilled`."""
        t0 = time.perf_counter()
        n_rows, T, B = plan_prefill_pass([len(s.prompt) - s.prefilled for s in pending], self.prefill_lengths,
                                         self.batch_sizes, self.prefill_tokens)
        seqs, last = pending[:n_rows], []
        rows = torch.zeros(B, META + T + k, dtype=torch.int64)
        rows[:, 0] = self.state.scratch
        for b, seq in enumerate(seqs):
            L, c0 = len(seq.prompt), seq.prefilled
            c1 = min(L, c0 + T)
            rows[b, :META] = torch.tensor([seq.slot, c0, c1 - c0, L, seq.stop, seq.eos, seq.seed, int(c1 == L)])
            ids = seq.prompt[c0: c0 + T + k]
            rows[b, META: META + len(ids)] = ids
            seq.prefilled = c1
            last.append(c1 == L)

        out = self._run_step(("prefill", B, T, k, mode), rows)
        host, event = self._fetch(out)
        tokens = int(rows[:, 2].sum())
        timing = StepTiming("prefill", (B, T), len(seqs), tokens, t0, host_s=time.perf_counter() - t0)
        return _Step("prefill", seqs, last, host, event, timing)

    # ================================================================== host loop
    def validate(self, prompts: list[list[int]], max_new_tokens: int | list[int], k: int, draft_sampling: str,
                 seed: int | None = None, eos_token_id: int | None = None) -> None:
        """inkling_ref's checks of a request, under this engine's limits: its loaded depths and the
        max_seq_len its caches are allocated for, besides the model's maximum length. max_new_tokens:
        one limit for every prompt, or one per prompt."""
        cfg = self.config
        limits = Limits(cfg.vocab_out, ((cfg.max_position_embeddings, "the model's maximum length {n}"),
                                        (self.max_seq_len, "the engine's max_seq_len={n} (its caches are "
                                                           "allocated for that)")),
                        self.k, "{k_arg} is beyond this engine's {depths} loaded MTP depths (built with "
                                "num_speculative_tokens={depths})")
        validate(limits, prompts, max_new_tokens, k, draft_sampling, seed, eos_token_id)

    def warmup(self, prompt_ids, **generate_kwargs) -> "SetupReport":
        """Pay a request's setup up front: build the kernels its steps need (`build_kernels`), then run
        `generate(prompt_ids, **generate_kwargs)` once and discard it, so that the CUDA graphs of those
        shapes are captured too (warmup.py). Returns its SetupReport (seconds, kernel specializations
        built, graphs captured); a later call with the same shapes builds and captures nothing."""
        return warmup(self, prompt_ids, **generate_kwargs)

    def build_kernels(self, prompt_ids, *, threads: int | None = None, **generate_kwargs) -> None:
        """Build, on a pool of `threads` threads (default: one per CPU core), the Triton kernel
        specializations that `generate(prompt_ids, **generate_kwargs)` needs for its steps
        (`request_steps`), without running any of them (warmup.build_concurrently). Skipped when an
        earlier call left a record that Triton's on-disk cache holds them; a no-op under the interpreter."""
        prompts, k, mode = self._request(prompt_ids, **generate_kwargs)
        build_concurrently(self, self.request_steps([len(p) for p in prompts], k, mode), threads)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int | list[int], num_speculative_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 draft_sampling: str = "greedy", seed: int | None = None,
                 eos_token_id: int | None = None, overlap: bool | None = None) -> GenerationResult:
        """As `inkling_ref.generate` (same arguments without the model, same result). k defaults to the
        engine's num_speculative_tokens and may be smaller; max_new_tokens may also be a list, one limit
        per prompt. Prompts beyond max_batch_size wait for a free slot. overlap: the loop (None: the
        engine's default; see the module docstring). Host timings are left in `self.timings` (per
        step) and `self.request_times` (per prompt: when its first token and its last were booked),
        time.perf_counter seconds from `self.started_s`."""
        prompts, k, mode = self._request(prompt_ids, max_new_tokens, num_speculative_tokens, temperature, top_k,
                                         top_p, draft_sampling, seed, eos_token_id)
        overlap = self.overlap if overlap is None else overlap
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        t0 = self.started_s = time.perf_counter()
        seqs = [self._sequence(i, p, limits[i], k, mode,
                               secrets.randbits(62) if seed is None else sequence_seed(seed, i), eos_token_id)
                for i, p in enumerate(prompts)]
        self.timings = []
        waiting = deque(seqs)
        free = list(range(self.max_batch_size - 1, -1, -1))
        pending: list[_Sequence] = []            # admitted; prompt chunks still to launch
        decoding: dict[int, _Sequence] = {}      # slot -> sequence: prompt launched, not known to be finished
        inflight: deque[_Step] = deque()
        after_pass = False
        while waiting or pending or decoding or inflight:
            while waiting and free:
                seq = waiting.popleft()
                self._admit(seq, free.pop())
                pending.append(seq)
            step = None
            if pending and not (decoding and after_pass):      # running sequences wait one pass at most
                step = self._launch_prefill(pending, k, mode)
                for seq, last in zip(step.seqs, step.last):
                    if last and seq.stop > len(seq.prompt) + 1:      # max_new_tokens = 1: x_L is all
                        decoding[seq.slot] = seq
                pending = [s for s in pending if s.prefilled < len(s.prompt)]
                after_pass = True
            elif decoding:
                t_launch = time.perf_counter()
                rows = list(decoding.values())
                host, event = self._launch_cycle([s.slot for s in rows], k, mode)
                step = _Step("cycle", rows, [], host, event, StepTiming("cycle", (len(host),), 0, 0, t_launch,
                                                                        host_s=time.perf_counter() - t_launch))
                after_pass = False
            if step is not None:
                inflight.append(step)
                self.timings.append(step.timing)
            while inflight and (step is None or len(inflight) > int(overlap)):
                for seq in self._book(inflight.popleft(), k):
                    decoding.pop(seq.slot, None)
                    free.append(seq.slot)
        elapsed = time.perf_counter() - t0
        self.request_times = [(s.first_s, s.done_s) for s in seqs]
        stats = AcceptanceStats.from_cycles(k, [c for s in seqs for c in s.cycles])
        return GenerationResult(token_ids=[s.out for s in seqs], cycles=[s.cycles for s in seqs], stats=stats,
                                elapsed_s=elapsed)

    def _request(self, prompt_ids, max_new_tokens: int | list[int], num_speculative_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 draft_sampling: str = "greedy", seed: int | None = None, eos_token_id: int | None = None,
                 overlap: bool | None = None) -> tuple[list[list[int]], int, DecodeMode]:
        """generate's arguments checked: (prompts, k, decode mode); `overlap` changes no step."""
        prompts = normalize_prompts(prompt_ids)
        k = self.k if num_speculative_tokens is None else num_speculative_tokens
        self.validate(prompts, max_new_tokens, k, draft_sampling, seed, eos_token_id)
        return prompts, k, DecodeMode(SamplingParams(temperature, top_k, top_p), draft_sampling)

    def _sequence(self, i: int, prompt: list[int], max_new_tokens: int, k: int, mode: DecodeMode, seed: int,
                  eos_token_id: int | None) -> _Sequence:
        reference = self.uniforms == "reference" and not mode.greedy
        return _Sequence(index=i, prompt=torch.tensor(prompt, dtype=torch.int64), stop=len(prompt) + max_new_tokens,
                         seed=seed, eos=-1 if eos_token_id is None else eos_token_id,
                         uniforms=Uniforms(seed) if reference else None, draws=1 + (max_new_tokens - 1) * (2 * k + 1))

    def _admit(self, seq: _Sequence, slot: int) -> None:
        """Give `seq` its slot; with reference uniforms, copy the sequence's whole stream (x_L, then at most
        max_new_tokens - 1 cycles of 2k+1 draws) to the slot (ordered before the slot's next step)."""
        seq.slot = slot
        if seq.uniforms is not None:
            u = torch.rand(seq.draws, generator=seq.uniforms.g, dtype=torch.float64)
            self._upload(u, self.reference_uniforms[slot, : seq.draws])

    def _book(self, step: _Step, k: int) -> list[_Sequence]:
        """Wait for a step's result array and book it; returns the sequences that finished with it."""
        if step.event is not None:
            step.event.synchronize()
        t = step.timing
        t.ready_s = time.perf_counter()
        rows = step.host.tolist()
        finished = []
        if step.kind == "prefill":
            for seq, row, last in zip(step.seqs, rows, step.last):
                if last:
                    seq.out.append(row[0])
                    seq.first_s = t.ready_s
                    if row[1]:
                        finished.append(seq)
        else:
            c = CycleColumns(k)
            for seq, row in zip(step.seqs, rows):
                if row[c.live]:                       # else: finished in an earlier cycle, a padding row here
                    self._record(seq, row, k)
                    t.rows += 1
                    t.tokens += row[c.emitted]
                    if row[c.done]:
                        finished.append(seq)
        for seq in finished:
            seq.done_s = t.ready_s
        t.host_s += time.perf_counter() - t.ready_s
        return finished

    @staticmethod
    def _record(seq: _Sequence, row: list[int], k: int) -> None:
        """Book one sequence's cycle from its result row (CycleColumns): the emitted tokens and the
        CycleRecord, built as inkling_ref.generate builds it."""
        c = CycleColumns(k)
        record = CycleRecord.of_cycle(k, row[c.drafts: c.drafts + row[c.k_eff]], row[c.a], row[c.b],
                                      None if seq.eos < 0 else seq.eos)
        seq.out += record.emitted
        seq.cycles.append(record)


def _default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, and max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]
