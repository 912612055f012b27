"""`Engine`: batched multi-depth MTP speculative decoding on the fast kernels, replayed as CUDA graphs.

The same loop as `inkling_ref.generate` (docs/spec/mtp-cycle.md), with the same names; what
changes is where the state lives (static position-addressed caches, caches.py) and that one cycle
is a fixed sequence of kernels over a padded batch, with no host synchronization inside it:

    prefill(slot, prompt)      eager: trunk over the prompt (chunks of <= 256 tokens), x_L, and every
                               depth over the prompt rows 0..L-2-k (teacher-forced)
    cycle(batch):              on the device, captured per batch size:
        draft                  depths 0..k-1 over the window [n-2-k, n-2]; d_{m+1} -> tokens[n+m]
        verify                 trunk over tokens[n-1 .. n-1+k] at positions n-1 .. n-1+k
        accept                 greedy_accept / rejection_sample, capped at k_eff per sequence
        commit                 tokens[n+a] = b; n += a + 1          (rollback = the length only)
    host, between cycles:      one copy of (a, b, drafts) per cycle -> CycleRecords, stop at
                               max_new_tokens / EOS, refill freed slots with waiting prompts

Fixed shapes: every cycle runs T = k+1 rows per sequence for every depth and the verify. A window
row at a position < 0 (short prompts) and a verify row beyond k_eff = min(k, stop - n - 1) are
padding (pos = -1: no cache reads or writes). A batch is padded to the next captured size with rows
that point at the scratch slot (SlotState.scratch) with every position -1: they write nothing but
the scratch slot. Depths beyond k_eff still run (their rows are rewritten by the next window), and
drafts beyond k_eff are never accepted, so the records are those of the reference: CycleRecord.k
is k_eff.

Sampling (temperature > 0) uses, per sequence, the uniforms in the reference's order (k for sampled
drafts, k for the acceptance tests, one for the correction/bonus). `uniforms="device"` draws them
with Philox on the device inside the graph (a different stream than the reference's, the same
distribution); `uniforms="reference"` draws the reference's own per-sequence torch.Generator stream
on the host and copies it in before each cycle: sampled output then equals inkling_ref.generate's
for the same seed, token for token.
"""

from __future__ import annotations

import dataclasses
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
from .kernels.accept import greedy_accept
from .kernels.moe import MAX_TOKENS
from .kernels.rejection import rejection_sample
from .kernels.common import interpreting
from .kernels.sampling import sample_tokens, sampling_probs
from .kernels.uniforms import philox_uniforms

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


@dataclass
class _Sequence:
    """Host bookkeeping of one running sequence."""
    index: int
    prompt: list[int]
    slot: int
    stop: int                               # prompt length + max_new_tokens
    uniforms: Uniforms | None               # the reference's stream (uniforms="reference")
    n: int = 0                              # committed tokens (mirrors SlotState.n)
    out: list[int] = field(default_factory=list)
    cycles: list[CycleRecord] = field(default_factory=list)


class Engine:
    """Batched speculative decoding with k = `num_speculative_tokens` MTP drafts per cycle.

    checkpoint_or_model: a released-layout checkpoint directory or an `InklingModel` (not modified;
    its weights are copied to `device` in `dtype`), or kernel-ready `weights.ModelWeights` already in
    `dtype` on `device` (used as they are; e.g. random weights at a scale no host model would fit). Caches are allocated for `max_batch_size`
    sequences of at most `max_seq_len` tokens (prompt + new) and up to k drafts per cycle.
    use_cuda_graphs (default: on CUDA) captures one cycle per batch size in `batch_sizes` (default
    1, 2, 4, ... up to max_batch_size); False runs the same code eagerly (also the CPU interpreter).
    """

    def __init__(self, checkpoint_or_model, max_batch_size: int, max_seq_len: int, num_speculative_tokens: int,
                 dtype: torch.dtype = torch.bfloat16, *, device=None, use_cuda_graphs: bool | None = None,
                 batch_sizes: list[int] | None = None, prefill_chunk: int = MAX_TOKENS, uniforms: str = "device"):
        k = num_speculative_tokens
        for name, v, lo in (("max_batch_size", max_batch_size, 1), ("max_seq_len", max_seq_len, 2),
                            ("num_speculative_tokens", k, 0)):
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
        if not isinstance(prefill_chunk, int) or not 1 <= prefill_chunk <= MAX_TOKENS:
            raise ValueError(f"prefill_chunk must be an integer in 1..{MAX_TOKENS} (the MoE kernel's limit), "
                             f"got {prefill_chunk!r}")
        if uniforms not in ("device", "reference"):
            raise ValueError(f"uniforms must be 'device' or 'reference', got {uniforms!r}")
        sizes = batch_sizes if batch_sizes is not None else _default_batch_sizes(max_batch_size)
        if not sizes or any(not isinstance(b, int) or not 1 <= b <= max_batch_size for b in sizes) \
                or max(sizes) != max_batch_size:
            raise ValueError(f"batch_sizes must be integers in 1..max_batch_size={max_batch_size} including "
                             f"max_batch_size itself, got {batch_sizes!r}")

        W = self._weights(checkpoint_or_model, k, dtype, device)
        cfg = W.config
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} is beyond the model's maximum length "
                             f"{cfg.max_position_embeddings} (max_position_embeddings)")
        self.config, self.k, self.dtype, self.device = cfg, k, dtype, device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.batch_sizes = sorted(set(sizes))
        self.use_cuda_graphs, self.prefill_chunk, self.uniforms = use_cuda_graphs, prefill_chunk, uniforms
        self.W = W

        def cache(block):
            return LayerCache.allocate(block.attn, cfg.hidden_size, cfg.conv_kernel_size, max_batch_size,
                                       max_seq_len, k, dtype, device)

        self.trunk_caches = [cache(b) for b in self.W.blocks]
        self.depth_caches = [cache(d.block) for d in self.W.depths]
        self.state = SlotState.allocate(max_batch_size, max_seq_len, k, cfg.hidden_size, dtype, device)
        self.graphs: dict = {}                         # (B, k, mode) -> graphs.CycleGraph
        self.graph_pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None

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
        """draft -> verify -> accept -> commit, all on the device. Returns int64 [B, k+2]: per row
        a, the next token b, then d_1..d_k."""
        if not mode.greedy and self.uniforms == "device":
            s = batch.slot.long()
            counters = self.state.counters[s]
            philox_uniforms(self.state.seeds[s], counters, 2 * k + 1, out=batch.uniforms)
            self.state.counters.index_put_((s,), counters)
        drafts, q = self.draft(batch, k, mode)
        hidden, k_eff = self.verify(batch, k)
        a, nxt = self.accept(batch, k, mode, drafts, q, hidden, k_eff)
        self.commit(batch, a, nxt)
        return torch.cat([a[:, None], nxt[:, None], drafts], dim=1)

    # ================================================================== prefill (eager)
    @torch.no_grad()
    def prefill(self, slot: int, prompt: list[int], k: int, stop: int, mode: DecodeMode,
                first_uniform: float | None = None) -> int:
        """Start the sequence `prompt` (x_0..x_{L-1}) in `slot`: the trunk over the prompt in chunks,
        x_L picked from its last logits, the hidden ring filled with H_{L-1-k..L-1}, and every depth over
        the prompt rows 0..L-2-k (teacher-forced), so that the first cycle's window [L-1-k, L-1] continues
        them. Returns x_L (one host sync). `first_uniform`: x_L's uniform (reference uniforms only)."""
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
        for c0 in range(0, L, self.prefill_chunk):
            c1 = min(L, c0 + self.prefill_chunk)
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
        return int(first[0])

    # ================================================================== host loop
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
        copies: outside a cycle). uniforms: [len(slots), 2k+1] (uniforms="reference" only)."""
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

    @torch.no_grad()
    def run_cycle(self, slots: list[int], k: int, mode: DecodeMode, uniforms: torch.Tensor | None = None) -> list:
        """One cycle for the sequences in `slots` (graph replay, or eager); returns per sequence
        [a, b, d_1..d_k] (the one host sync of the cycle)."""
        batch = self.make_batch(slots, k, uniforms)
        if self.use_cuda_graphs:
            from .graphs import CycleGraph
            key = (len(batch.slot), k, mode)
            if key not in self.graphs:
                self.graphs[key] = CycleGraph(self, len(batch.slot), k, mode)
            out = self.graphs[key].run(batch)
        else:
            out = self.cycle(batch, k, mode)
        return out[: len(slots)].tolist()

    def validate(self, prompts: list[list[int]], max_new_tokens: int, k: int, draft_sampling: str,
                 seed: int | None = None, eos_token_id: int | None = None) -> None:
        """inkling_ref's checks of a request, under this engine's limits: its loaded depths and the
        max_seq_len its caches are allocated for, besides the model's maximum length."""
        cfg = self.config
        limits = Limits(cfg.vocab_out, ((cfg.max_position_embeddings, "the model's maximum length {n}"),
                                        (self.max_seq_len, "the engine's max_seq_len={n} (its caches are "
                                                           "allocated for that)")),
                        self.k, "{k_arg} is beyond this engine's {depths} loaded MTP depths (built with "
                                "num_speculative_tokens={depths})")
        validate(limits, prompts, max_new_tokens, k, draft_sampling, seed, eos_token_id)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int, num_speculative_tokens: int | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 draft_sampling: str = "greedy", seed: int | None = None,
                 eos_token_id: int | None = None) -> GenerationResult:
        """As `inkling_ref.generate` (same arguments without the model, same result). k defaults to the
        engine's num_speculative_tokens and may be smaller. Prompts beyond max_batch_size wait for a
        free slot (a finished sequence's slot is refilled before the next cycle)."""
        prompts = normalize_prompts(prompt_ids)
        k = self.k if num_speculative_tokens is None else num_speculative_tokens
        mode = DecodeMode(SamplingParams(temperature, top_k, top_p), draft_sampling)
        self.validate(prompts, max_new_tokens, k, draft_sampling)
        t0 = time.perf_counter()
        waiting = deque(range(len(prompts)))
        free = list(range(self.max_batch_size - 1, -1, -1))
        running: dict[int, _Sequence] = {}
        finished: dict[int, _Sequence] = {}

        def finish_if_done(seq: _Sequence) -> None:
            if len(seq.out) >= max_new_tokens or (eos_token_id is not None and seq.out[-1] == eos_token_id):
                finished[seq.index] = running.pop(seq.slot)
                free.append(seq.slot)

        while waiting or running:
            while waiting and free:                                  # refill free slots
                i = waiting.popleft()
                seq = self._start(i, prompts[i], free.pop(), k, mode, max_new_tokens, seed)
                running[seq.slot] = seq
                finish_if_done(seq)
            if not running:
                continue
            seqs = sorted(running.values(), key=lambda s: s.slot)
            rows = self.run_cycle([s.slot for s in seqs], k, mode, self._host_uniforms(seqs, k, mode))
            for seq, row in zip(seqs, rows):
                self._record(seq, row, k, eos_token_id)
                finish_if_done(seq)
        elapsed = time.perf_counter() - t0
        done = [finished[i] for i in range(len(prompts))]
        stats = AcceptanceStats.from_cycles(k, [c for s in done for c in s.cycles])
        return GenerationResult(token_ids=[s.out for s in done], cycles=[s.cycles for s in done], stats=stats,
                                elapsed_s=elapsed)

    def _start(self, i: int, prompt: list[int], slot: int, k: int, mode: DecodeMode, max_new_tokens: int,
               seed: int | None) -> _Sequence:
        seq_seed = secrets.randbits(62) if seed is None else sequence_seed(seed, i)
        seq = _Sequence(index=i, prompt=prompt, slot=slot, stop=len(prompt) + max_new_tokens,
                        uniforms=Uniforms(seq_seed) if self.uniforms == "reference" else None)
        self.state.seeds[slot] = seq_seed
        self.state.counters[slot] = 0
        u = seq.uniforms(1)[0] if seq.uniforms is not None and not mode.greedy else None
        seq.out.append(self.prefill(slot, prompt, k, seq.stop, mode, u))
        seq.n = len(prompt) + 1
        return seq

    def _host_uniforms(self, seqs: list[_Sequence], k: int, mode: DecodeMode) -> torch.Tensor | None:
        """uniforms="reference": each sequence's next draws, in the reference's order and counts
        (k_eff sampled drafts, k_eff acceptance tests, one final), laid out as [draft | accept | final]."""
        if mode.greedy or self.uniforms != "reference":
            return None
        u = torch.zeros(len(seqs), 2 * k + 1, dtype=torch.float64)
        for b, seq in enumerate(seqs):
            ke = min(k, seq.stop - seq.n - 1)
            if mode.sampled_drafts:
                u[b, :ke] = torch.tensor(seq.uniforms(ke), dtype=torch.float64)
            u[b, k: k + ke] = torch.tensor(seq.uniforms(ke), dtype=torch.float64)
            u[b, 2 * k] = seq.uniforms(1)[0]
        return u

    @staticmethod
    def _record(seq: _Sequence, row: list[int], k: int, eos_token_id: int | None) -> None:
        """The CycleRecord of one sequence's cycle, as inkling_ref.generate writes it."""
        k_eff = min(k, seq.stop - seq.n - 1)
        record = CycleRecord.of_cycle(k, row[2: 2 + k_eff], row[0], row[1], eos_token_id)
        seq.out += record.emitted
        seq.n += record.accepted + 1
        seq.cycles.append(record)


def _default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, and max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]
