"""`Engine`: batched multi-depth MTP speculative decoding on the fast kernels, replayed as CUDA graphs.

The same loop as `inkling_ref.generate` (docs/spec/mtp-cycle.md), with the same names; what changes
is where the state lives (static position-addressed caches), that prompts and cycles are fixed
sequences of kernels over padded batches, and that the host never waits inside them. The engine is
four parts, one file each, composed here:

    caches.py         the static state: per-block caches and per-slot state (SlotState)
    device_steps.py   DeviceSteps: the cycle (draft, verify, accept, commit) and the batched prefill
                      pass, on the device only (nothing there may synchronize with the host)
    graphs.py         StepRunner: each step captured once per key (step_io.py) as a CUDA graph and
                      replayed, or run eagerly
    scheduler.py      Scheduler: the host loop of `generate` (admission, overlapped launches, booking)

Driving the steps by hand (tests, notebooks): `prefill(slot, prompt, dec, stop)` starts one sequence
(eager, the reference path of the batched passes; eager_prefill.py); `prefill_batch(slots, prompts,
dec, stops)` starts several with the batched passes that generate uses; `make_batch` and the methods
of `engine.steps` (draft, verify, accept, commit, cycle), or `run_cycle`, run cycles on chosen slots.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import replace

import torch

from inkling_ref.decoding.adaptive import AcceptanceCounts, AdaptiveDepth, CycleCosts, DepthPolicy
from inkling_ref.decoding.generation import (AcceptanceStats, GenerationResult, Limits, normalize_prompts,
                                             sequence_seed, validate)
from inkling_ref.decoding.sampling import SamplingParams

from .caches import LayerCache, SlotState
from .catchup import CATCHUP_LENGTHS
from .device_steps import DeviceSteps
from .eager_prefill import prefill_one
from .graphs import StepRunner
from .kernels.common import interpreting
from .prefill_plan import default_prefill_lengths, possible_passes
from .scheduler import Request, Scheduler, Sequence
from .step_io import Batch, CatchupKey, CycleKey, Decoding, PrefillKey
from .warmup import SetupReport, warmup
from .weights import load_weights

DTYPES = (torch.float32, torch.bfloat16)          # what the engine tests run


class Engine:
    """Batched speculative decoding with up to k = `num_speculative_tokens` MTP drafts per cycle.

    checkpoint_or_model: a released-layout checkpoint directory, an `InklingModel` (not modified; its
    weights are copied to `device` in `dtype`), or kernel-ready `weights.ModelWeights` already in `dtype`
    on `device`. Caches are allocated for `max_batch_size` sequences of at most `max_seq_len` tokens
    (prompt + new) and up to k drafts per cycle.
    use_cuda_graphs (default: on CUDA) captures one cycle per batch size in `batch_sizes` (default 1, 2,
    4, ... up to max_batch_size) and one prefill pass per (batch size, chunk length); False runs the
    same code eagerly (also the CPU interpreter).
    prefill_tokens: the token budget of one prefill pass (batch rows x chunk length, padding included);
    prefill_lengths: its chunk lengths (default 16, 32, ... up to the budget).
    uniforms: "device" (Philox in the graph) or "reference" (each sequence's stream copied from the
    reference's generator: sampled output equal to inkling_ref.generate's for the same seed).
    overlap: generate's default loop (True: the next step is launched before the last one is booked).

    The first call of a new shape compiles Triton kernels (about a second each from an empty Triton
    cache, milliseconds from a warm one) and captures CUDA graphs; `warmup` pays that up front."""

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
            raise ValueError(f"dtype={dtype}: the fast engine runs torch.float32 or torch.bfloat16")
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"device={device}: the fast engine needs a CUDA device (or TRITON_INTERPRET=1 to "
                             "run its kernels through the Triton interpreter on CPU)")
        use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if use_cuda_graphs and device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs a CUDA device")
        if uniforms not in ("device", "reference"):
            raise ValueError(f"uniforms must be 'device' or 'reference', got {uniforms!r}")
        sizes = batch_sizes if batch_sizes is not None else default_batch_sizes(max_batch_size)
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

        W = load_weights(checkpoint_or_model, k, dtype, device)
        cfg = W.config
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} is beyond the model's maximum length "
                             f"{cfg.max_position_embeddings} (max_position_embeddings)")
        self.config, self.k, self.dtype, self.device = cfg, k, dtype, device
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.use_cuda_graphs, self.uniforms, self.overlap = use_cuda_graphs, uniforms, overlap

        def cache(block) -> LayerCache:
            return LayerCache.allocate(block.attn, cfg.hidden_size, cfg.conv_kernel_size, max_batch_size,
                                       max_seq_len, k, dtype, device)

        state = SlotState.allocate(max_batch_size, max_seq_len, k, cfg.hidden_size, dtype, device)
        # uniforms="reference": each slot's copy of its sequence's reference stream, long enough for
        # x_L and max_seq_len - 1 cycles of 2k+1 draws
        reference = (torch.zeros(max_batch_size + 1, 1 + (max_seq_len - 1) * (2 * k + 1), dtype=torch.float64,
                                 device=device) if uniforms == "reference" else None)
        self.steps = DeviceSteps(W, [cache(b) for b in W.blocks], [cache(d.block) for d in W.depths], state,
                                 uniforms, reference)
        self.runner = StepRunner(self.steps, device, use_cuda_graphs)
        self.scheduler = Scheduler(self.runner, state.scratch, max_batch_size, sorted(set(sizes)),
                                   sorted(set(lengths)), prefill_tokens, reference)
        self.request_times: list[tuple[float, float]] = []
        self.started_s = self.setup_s = math.nan
        self.cycle_costs: dict[tuple, CycleCosts] = {}     # per (sampling params, draft sampling): measured
        self.acceptance: dict[tuple, AcceptanceCounts] = {}   # the same keys: what auto requests saw
        self.prefill_depth: dict[tuple, int] = {}   # prefill_depth_key(...): the k auto requests prefill at
        self.policy: DepthPolicy | None = None             # the depth policy of the last generate, if any

    # the parts' state, read by tests, notebooks and benchmarks
    W = property(lambda self: self.steps.W)
    state = property(lambda self: self.steps.state)
    trunk_caches = property(lambda self: self.steps.trunk_caches)
    depth_caches = property(lambda self: self.steps.depth_caches)
    graphs = property(lambda self: self.runner.graphs, doc="StepKey -> graphs.StepGraph")
    timings = property(lambda self: self.scheduler.timings, doc="host timing per step of the last call")
    batch_sizes = property(lambda self: self.scheduler.batch_sizes)
    prefill_lengths = property(lambda self: self.scheduler.prefill_lengths)
    prefill_tokens = property(lambda self: self.scheduler.prefill_tokens)

    # ------------------------------------------------------------------------------------------ requests
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

    def request(self, prompt_ids, max_new_tokens: int | list[int],
                num_speculative_tokens: int | str | DepthPolicy | None = None, temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None, draft_sampling: str = "greedy",
                seed: int | None = None, eos_token_id: int | None = None) -> Request:
        """generate's arguments checked and gathered into one Request."""
        prompts = normalize_prompts(prompt_ids)
        k = self.k if num_speculative_tokens is None else num_speculative_tokens
        self.validate(prompts, max_new_tokens, k, draft_sampling, seed, eos_token_id)
        limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
        seeds = [secrets.randbits(62) if seed is None else sequence_seed(seed, i) for i in range(len(prompts))]
        params = SamplingParams(temperature, top_k, top_p)
        policy = None
        if k == "auto":
            mode = (params, draft_sampling)
            policy = AdaptiveDepth(self.k, self.cycle_costs.setdefault(mode, CycleCosts()),
                                   acceptance=self.acceptance.setdefault(mode, AcceptanceCounts(self.k)),
                                   seed=0 if seed is None else seed)
        elif isinstance(k, DepthPolicy):
            policy = k
        dec = Decoding(k if policy is None else policy.max_k, params, draft_sampling)   # the most drafts a cycle makes
        prefill_k = self.prefill_depth.get(self.prefill_depth_key(dec, len(prompts))) if k == "auto" else None
        return Request(prompts, limits, dec, seeds, eos_token_id, policy, prefill_k)

    def prefill_depth_key(self, dec: Decoding, num_prompts: int) -> tuple:
        """Where an auto request's prefill k is kept: its decoding mode and its first batch size."""
        return dec.params, dec.draft_sampling, self.first_batch_size(num_prompts)

    def first_batch_size(self, num_prompts: int) -> int:
        """The captured batch size of a request's first batch (its prompts, at most max_batch_size of them):
        the largest any of its steps runs at."""
        return self.scheduler.batch_size_for(min(num_prompts, self.max_batch_size))

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int | list[int],
                 num_speculative_tokens: int | str | DepthPolicy | None = None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 draft_sampling: str = "greedy", seed: int | None = None,
                 eos_token_id: int | None = None, overlap: bool | None = None) -> GenerationResult:
        """As `inkling_ref.generate` (same arguments without the model, same result). k defaults to the
        engine's num_speculative_tokens and may be smaller, or "auto": each cycle the k with the most
        expected tokens per ms for the batch running (inkling_ref.decoding.adaptive.AdaptiveDepth, over
        this engine's measured cycle costs; `measure_cycle_costs`), or any DepthPolicy; max_new_tokens
        may also be a list, one limit per prompt. Prompts beyond max_batch_size wait for a free slot. overlap: the loop (None: the
        engine's default; scheduler.py). Host timings are left in `self.timings` (per step) and
        `self.request_times` (per prompt: when its first token and its last were booked),
        time.perf_counter seconds from `self.started_s`; `self.setup_s` holds the seconds the call spent
        before that (with auto: cycle costs measured and graphs captured), which the result's elapsed_s
        leaves out."""
        start = time.perf_counter()
        request = self.request(prompt_ids, max_new_tokens, num_speculative_tokens, temperature, top_k, top_p,
                               draft_sampling, seed, eos_token_id)
        if isinstance(request.policy, AdaptiveDepth):
            self.measure_cycle_costs(request)
            request = replace(request, prefill_k=self.choose_prefill_k(request))
            self.capture_prefill_passes(request)
        t0 = self.started_s = time.perf_counter()
        self.setup_s = t0 - start
        seqs = self.scheduler.run(request, self.overlap if overlap is None else overlap)
        elapsed = time.perf_counter() - t0
        self.request_times = [(s.first_s, s.done_s) for s in seqs]
        stats = AcceptanceStats.from_cycles(request.decoding.k, [c for s in seqs for c in s.cycles])
        if isinstance(request.policy, AdaptiveDepth) and stats.k_used:
            # the next such request prefills at the k this one ran most: its prefill graphs stay the same
            # from request to request, and its depth rows are the ones its cycles will use
            key = self.prefill_depth_key(request.decoding, len(request.prompts))
            self.prefill_depth[key] = max(stats.k_used, key=stats.k_used.get)
        self.policy = request.policy
        return GenerationResult(token_ids=[s.out for s in seqs], cycles=[s.cycles for s in seqs], stats=stats,
                                elapsed_s=elapsed)

    def measure_cycle_costs(self, request: Request) -> None:
        """The device time of a cycle at every k a policy may choose, and of a catch-up pass of each length
        at every k >= 1, at the batch sizes `request` can run, timed on all-padding steps (their graphs
        captured) where its cost table has none yet: what AdaptiveDepth decides from before the
        request's own steps are timed, and no graph of theirs is captured inside the request. On the CPU,
        nothing: the interpreter's times say nothing about a GPU's, and the request's own steps are timed."""
        if self.device.type != "cuda":
            return
        costs, dec = request.policy.costs, request.decoding
        top = self.first_batch_size(len(request.prompts))
        for B in [b for b in self.scheduler.batch_sizes if b <= top]:
            for k in range(request.policy.max_k + 1):
                if (B, k) not in costs.cycles:
                    key = CycleKey(B, Decoding(k, dec.params, dec.draft_sampling))
                    costs.add(costs.cycles, (B, k), self.runner.time_padding(key))
                for T in CATCHUP_LENGTHS if k else ():
                    if (B, k, T) not in costs.catchup:
                        costs.add(costs.catchup, (B, k, T), self.runner.time_padding(CatchupKey(B, T, Decoding(k))))

    def choose_prefill_k(self, request: Request) -> int:
        """The k of the depth rows an auto request's prefill passes write: the k the last auto request of
        its decoding mode and first batch size ran most (`request.prefill_k`), else the policy's choice for
        the first batch the request admits."""
        if request.prefill_k is not None:
            return request.prefill_k
        first = min(len(request.prompts), self.max_batch_size)
        return request.policy.choose(first, self.first_batch_size(first), max(request.max_new_tokens[:first]), None)

    def capture_prefill_passes(self, request: Request) -> None:
        """Capture the graph of every prefill pass `request` may run (prefill_plan.possible_passes, at its
        prefill k) before its timer starts. A policy's choices of k decide when sequences finish, so which
        prompts are admitted together, and with them the shapes of the passes, differ from call to call:
        captured on first use, they would be captured inside the request."""
        dec = request.decoding
        top = self.first_batch_size(len(request.prompts))
        sizes = [b for b in self.scheduler.batch_sizes if b <= top]
        for B, T in possible_passes([len(p) for p in request.prompts], self.prefill_lengths, sizes,
                                    self.prefill_tokens):
            self.runner.capture(PrefillKey(B, T, Decoding(request.prefill_k, dec.params, dec.draft_sampling)))

    def warmup(self, prompt_ids, **generate_kwargs) -> SetupReport:
        """Pay a request's setup up front: run `generate(prompt_ids, **generate_kwargs)` once and discard it,
        so that the kernels and CUDA graphs of those shapes exist (warmup.py). Returns its SetupReport."""
        return warmup(self, prompt_ids, **generate_kwargs)

    # ------------------------------------------------------------------------------------------ by hand
    @torch.no_grad()
    def prefill(self, slot: int, prompt: list[int], dec: Decoding, stop: int, first_uniform: float | None = None) -> int:
        """Start the sequence `prompt` in `slot`, eagerly, one sequence (eager_prefill.py); returns x_L."""
        if not 0 <= slot < self.max_batch_size:
            raise ValueError(f"slot={slot} is outside 0..max_batch_size-1={self.max_batch_size - 1}")
        if not 1 <= len(prompt) <= stop - 1 or stop > self.max_seq_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens with stop={stop} does not fit "
                             f"max_seq_len={self.max_seq_len}")
        self._check_k(dec.k)
        return prefill_one(self.steps, slot, prompt, dec, stop, self.scheduler.prefill_tokens, first_uniform)

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], prompts: list[list[int]], dec: Decoding, stops: list[int],
                      seeds: list[int] | None = None, eos_token_id: int | None = None) -> list[int]:
        """Start the sequences `prompts` in `slots` with the batched prefill passes of `generate` (graph
        replays, or eager) and return their x_L (one host sync per pass, at the end). stops[i] = prompt
        length + max_new_tokens of sequence i; seeds: the per-sequence seeds of sampled x_L. The passes'
        host timings are left in `self.timings`."""
        if len(slots) != len(prompts) or len(stops) != len(prompts) or (seeds is not None and len(seeds) != len(prompts)):
            raise ValueError(f"slots, prompts, stops (and seeds) must have one entry per sequence, got "
                             f"{len(slots)}, {len(prompts)}, {len(stops)}")
        self._check_slots(slots)
        self._check_k(dec.k)
        for i, (p, stop) in enumerate(zip(prompts, stops)):
            if not 1 <= len(p) <= stop - 1 or stop > self.max_seq_len:
                raise ValueError(f"prompt {i}: {len(p)} tokens with stop={stop} do not fit max_seq_len="
                                 f"{self.max_seq_len}")
        request = Request(prompts, [stop - len(p) for p, stop in zip(prompts, stops)], dec,
                          seeds if seeds is not None else [0] * len(prompts), eos_token_id)
        seqs: list[Sequence] = self.scheduler.sequences(request)
        self.scheduler.prefill(seqs, slots, dec)
        return [s.out[0] for s in seqs]

    def make_batch(self, slots: list[int], k: int, uniforms: torch.Tensor | None = None) -> Batch:
        """The batch of the sequences in `slots`, padded to the next captured size (host -> device copies:
        outside a cycle). uniforms: [len(slots), 2k+1], used as they are by `steps.draft` and `steps.accept`
        (`steps.cycle` draws its own)."""
        B, A, dev = self.scheduler.batch_size_for(len(slots)), len(slots), self.device
        self._check_slots(slots)
        batch = Batch(slot=torch.full((B,), self.state.scratch, dtype=torch.int32, device=dev),
                      live=torch.zeros(B, dtype=torch.bool, device=dev),
                      uniforms=torch.zeros(B, 2 * k + 1, dtype=torch.float64, device=dev))
        batch.slot[:A] = torch.tensor(slots, dtype=torch.int32)
        batch.live[:A] = True
        if uniforms is not None:
            batch.uniforms[:A] = uniforms
        return batch

    @torch.no_grad()
    def run_cycle(self, slots: list[int], dec: Decoding) -> list[list[int]]:
        """One cycle for the sequences in `slots` (graph replay, or eager); waits for it and returns per
        sequence its result row (step_io.CycleColumns: a, b, d_1..d_k, k_eff, emitted, eos, done, live,
        nonfinite)."""
        self._check_slots(slots)
        _, launched = self.scheduler.launch_slots(list(slots), dec)
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.host[: len(slots)].tolist()

    def _check_slots(self, slots: list[int]) -> None:
        if any(not 0 <= s < self.max_batch_size for s in slots) or len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} must be distinct and in 0..{self.max_batch_size - 1}")

    def _check_k(self, k: int) -> None:
        if k > self.k:
            raise ValueError(f"k={k} drafts need {k} MTP depths; the engine has {self.k} loaded")


def default_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... below max_batch_size, and max_batch_size."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]
