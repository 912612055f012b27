"""The host side of `Engine.generate`: admission, the overlapped launch loop, and booking.

Everything a step needs is device state (the committed length n, stop, the EOS id and `done` per
slot), so the host may launch step i+1 before it has read step i's result (`overlap=True`, the
default): it launches, then books the previous step from its pinned copy (one device-to-host copy
per step, waited on through an event). A sequence that finished in cycle i is still in the batch of
cycle i+1, already launched: its slot is `done` on the device, so that row runs as padding and comes
back with live = 0, and the host discards it; the slot is refilled after cycle i is booked, at most
one cycle late. Results are the same as with `overlap=False`, the synchronous loop (launch a step,
wait, book it), token for token and record for record.

    admit     prompts take free slots in order; with reference uniforms, the sequence's whole stream
              is copied to its slot
    prefill   the next batched pass over the admitted prompts (prefill_plan.py); running sequences
              wait at most one pass between two cycles
    cycle     every sequence whose prompt is in and that is not known to be finished, padded to the
              next captured batch size
    book      the emitted tokens and a CycleRecord per live row, built as inkling_ref.generate builds
              them; a finished sequence frees its slot. A row whose step produced a NaN or an infinity
              (its `nonfinite` column) raises NonFiniteError naming the step: nothing of it is booked

With a depth policy (num_speculative_tokens="auto": inkling_ref.decoding.adaptive) the k of each cycle
is the policy's choice for the batch it launches: the policy sees every cycle's measured device time
and accepted counts when the cycle is booked, and, once no prompt waits for a slot, each sequence's
tokens left and its own accepted counts (the batch then ends with its slowest sequence). Every prefill
pass of a request writes the depth rows of one k, `Request.prefill_k` (None: the policy's largest k;
`Engine.generate` sets it for auto), so that its captured graphs are the same from pass to pass.
Before a cycle at another k than the one in flight, the scheduler books what is in flight (one wait:
the only one k changes add), then launches the catch-up passes the depths need (catchup.py) and the
cycle.

Host timings of each step land in `StepTiming`s; nothing here changes what a step computes.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from inkling_ref.decoding.adaptive import AcceptanceCounts, AdaptiveDepth, DepthPolicy, FixedDepth
from inkling_ref.decoding.generation import CycleRecord, Uniforms
from inkling_ref.decoding.speculative import NonFiniteError, non_finite_message

from .catchup import DepthRows, catchup_passes
from .graphs import Launched, StepRunner
from .prefill_plan import plan_prefill_pass
from .step_io import (PASS, PASS_COLUMNS, PASS_RESULT, CatchupKey, CycleColumns, CycleKey, Decoding, NonFinite,
                      PassColumns, PrefillKey)


@dataclass(frozen=True)
class Request:
    """One checked `generate` call: its prompts, a limit of new tokens per prompt, how it decodes (k: the
    most drafts a cycle makes), a seed per sequence, the EOS id (None: none), and the policy that
    picks each cycle's k (None: k throughout), and the k of its prefill passes under a policy (None: the
    policy's largest k)."""
    prompts: list[list[int]]
    max_new_tokens: list[int]
    decoding: Decoding
    seeds: list[int]
    eos_token_id: int | None
    policy: DepthPolicy | None = None
    prefill_k: int | None = None


@dataclass
class StepTiming:
    """Host-side timing of one step of the last `generate` (time.perf_counter seconds)."""
    kind: str               # "prefill" (one batched pass), "cycle" or "catchup" (a catch-up pass)
    shape: tuple            # prefill, catchup: (B, T), the captured pass; cycle: (B,)
    rows: int               # prefill: prompt chunks in the pass; cycle: rows that ran live; catchup: sequences
    tokens: int             # prefill: prompt tokens in the pass; cycle: tokens emitted; catchup: rows redone
    launched_s: float       # when the host began to launch it
    ready_s: float = math.nan   # when its result array was on the host (after the wait)
    host_s: float = 0.0     # host time spent on it outside the wait: launching and booking


@dataclass
class Sequence:
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
    rows: DepthRows = field(default_factory=DepthRows)   # its depths' caches, as far as the host knows
    acceptance: AcceptanceCounts | None = None           # its own accepted counts (k = "auto")


@dataclass
class LaunchedStep:
    """A launched step: its batch rows' sequences and its result on its way to the host."""
    key: CycleKey | PrefillKey | CatchupKey
    seqs: list[Sequence]
    last: list[bool]                        # prefill: the row's chunk ends its prompt
    launched: Launched                      # its result on the way, the event to wait on, its timer
    timing: StepTiming


class Scheduler:
    """Drives one engine's steps from the host. `reference_uniforms`: the device buffer of each slot's
    copy of its sequence's reference stream (None unless uniforms="reference")."""

    def __init__(self, runner: StepRunner, scratch: int, max_batch_size: int, batch_sizes: list[int],
                 prefill_lengths: list[int], prefill_tokens: int, reference_uniforms: torch.Tensor | None):
        self.runner, self.scratch, self.max_batch_size = runner, scratch, max_batch_size
        self.batch_sizes, self.prefill_lengths, self.prefill_tokens = batch_sizes, prefill_lengths, prefill_tokens
        self.reference_uniforms = reference_uniforms
        self.timings: list[StepTiming] = []
        self.policy: DepthPolicy | None = None
        self.adaptive = False

    def batch_size_for(self, num_sequences: int) -> int:
        """The smallest captured batch size that holds `num_sequences`."""
        if not 1 <= num_sequences <= self.max_batch_size:
            raise ValueError(f"a batch of {num_sequences} sequences is beyond max_batch_size={self.max_batch_size}")
        return next(b for b in self.batch_sizes if b >= num_sequences)

    def sequences(self, request: Request) -> list[Sequence]:
        k, sampled = request.decoding.k, not request.decoding.greedy
        reference = sampled and self.reference_uniforms is not None
        own = isinstance(request.policy, AdaptiveDepth)
        return [Sequence(index=i, prompt=torch.tensor(p, dtype=torch.int64), stop=len(p) + limit, seed=seed,
                         eos=-1 if request.eos_token_id is None else request.eos_token_id,
                         uniforms=Uniforms(seed) if reference else None, draws=1 + (limit - 1) * (2 * k + 1),
                         acceptance=AcceptanceCounts(k, request.policy.acceptance.memory) if own else None)
                for i, (p, limit, seed) in enumerate(zip(request.prompts, request.max_new_tokens, request.seeds))]

    def run(self, request: Request, overlap: bool) -> list[Sequence]:
        """Decode every sequence of `request` to its end; returns them with their tokens and records."""
        dec, self.policy = request.decoding, request.policy
        self.adaptive = self.policy is not None and not isinstance(self.policy, FixedDepth)
        seqs = self.sequences(request)
        self.timings = []
        waiting = deque(seqs)
        free = list(range(self.max_batch_size - 1, -1, -1))
        pending: list[Sequence] = []             # admitted; prompt chunks still to launch
        decoding: dict[int, Sequence] = {}       # slot -> sequence: prompt launched, not known to be finished
        inflight: deque[LaunchedStep] = deque()
        after_pass, k_last, prefill_dec = False, None, dec
        if self.adaptive:                        # every pass writes the depth rows of one k: the first cycles'
            k_last = self.policy.max_k if request.prefill_k is None else request.prefill_k
            prefill_dec = Decoding(k_last, dec.params, dec.draft_sampling)

        def book(step: LaunchedStep) -> None:
            for seq in self.book(step):
                decoding.pop(seq.slot, None)
                free.append(seq.slot)

        while waiting or pending or decoding or inflight:
            while waiting and free:
                seq = waiting.popleft()
                self.admit(seq, free.pop())
                pending.append(seq)
            steps = []
            if pending and not (decoding and after_pass):      # running sequences wait one pass at most
                step = self.launch_prefill(pending, prefill_dec)
                for seq, last in zip(step.seqs, step.last):
                    if last and seq.stop > len(seq.prompt) + 1:      # max_new_tokens = 1: x_L is all
                        decoding[seq.slot] = seq
                pending = [s for s in pending if s.prefilled < len(s.prompt)]
                steps, after_pass = [step], True
            elif decoding:
                batch = list(decoding.values())
                k = self.next_k(batch, dec.k, k_last, finishing=not (waiting or pending))
                if self.adaptive and any(p != k for seq in batch for p in seq.rows.pending):
                    while inflight:                            # a change of k: book what is in flight first
                        book(inflight.popleft())
                    batch = [seq for seq in batch if decoding.get(seq.slot) is seq]
                if batch:
                    cycle = Decoding(k, dec.params, dec.draft_sampling)
                    steps = self.launch_catchup(batch, k) + [self.launch_cycle(batch, cycle)]
                    k_last, after_pass = k, False
            for step in steps:
                inflight.append(step)
                self.timings.append(step.timing)
            while inflight and (not steps or len(inflight) > int(overlap)):
                book(inflight.popleft())
        return seqs

    def next_k(self, batch: list[Sequence], k: int, current: int | None, finishing: bool = False) -> int:
        """The k of the next cycle of `batch`: the request's k, or its policy's choice. finishing: no prompt
        waits for a slot, so the batch ends with its slowest sequence (the policy sees each one's tokens
        left and acceptance)."""
        if self.policy is None:
            return k
        catchup = (lambda j: max(seq.rows.missing(j)[1] for seq in batch)) if self.adaptive else None
        left = [seq.stop - len(seq.prompt) - len(seq.out) for seq in batch]
        own = None
        if finishing and batch[0].acceptance is not None:       # AdaptiveDepth: each sequence's own counts
            own = [(n, seq.acceptance) for n, seq in zip(left, batch)]
        return self.policy.choose(len(batch), self.batch_size_for(len(batch)), max(left), current, catchup, own)

    def launch_catchup(self, batch: list[Sequence], k: int) -> list[LaunchedStep]:
        """The catch-up passes depths 0..k-1 need before a cycle of `batch` at k (catchup.py); none with
        a fixed k. The passes hold only the sequences that miss rows, padded to the next captured batch
        size: a prompt admitted below the batch's k (serving) costs the rows of its own sequence, not a
        pass over the whole batch."""
        needs = [(seq, seq.rows.missing(k)) for seq in batch] if self.adaptive else []
        needy = [(seq, need) for seq, need in needs if need[1]]      # need: (first row, count)
        if not needy:
            return []
        seqs = [seq for seq, _ in needy]
        T, passes = catchup_passes([need for _, need in needy])
        B, steps = self.batch_size_for(len(needy)), []
        key = CatchupKey(B, T, Decoding(k))
        for rows in passes:
            t0 = time.perf_counter()
            host = torch.zeros(B, 3, dtype=torch.int64)
            host[:, 0] = self.scratch
            for b, (seq, (first, count)) in enumerate(zip(seqs, rows)):
                host[b] = torch.tensor([seq.slot, first, count])
            launched = self.runner.launch(key, host, timed=True)
            timing = StepTiming("catchup", (B, T), sum(c > 0 for _, c in rows), sum(c for _, c in rows), t0,
                                host_s=time.perf_counter() - t0)
            steps.append(LaunchedStep(key, seqs, [], launched, timing))
        for seq in seqs:
            seq.rows.caught_up(k)
        return steps

    def prefill(self, seqs: list[Sequence], slots: list[int], dec: Decoding) -> None:
        """Admit `seqs` into `slots` and run their batched prefill passes, booking each (x_L in seq.out)."""
        self.policy, self.adaptive = None, False
        for seq, slot in zip(seqs, slots):
            self.admit(seq, slot)
        pending, steps = list(seqs), []
        while pending:
            steps.append(self.launch_prefill(pending, dec))
            pending = [s for s in pending if s.prefilled < len(s.prompt)]
        for step in steps:
            self.book(step)
        self.timings = [step.timing for step in steps]

    def admit(self, seq: Sequence, slot: int) -> None:
        """Give `seq` its slot; with reference uniforms, copy the sequence's whole stream (x_L, then at most
        max_new_tokens - 1 cycles of 2k+1 draws) to the slot (ordered before the slot's next step)."""
        seq.slot = slot
        if seq.uniforms is not None:
            u = torch.rand(seq.draws, generator=seq.uniforms.g, dtype=torch.float64)
            self.runner.upload(u, self.reference_uniforms[slot, : seq.draws])

    def launch_prefill(self, pending: list[Sequence], dec: Decoding) -> LaunchedStep:
        """Launch the next prefill pass over the pending sequences (prefill_plan.py), advancing their
        `prefilled`."""
        t0 = time.perf_counter()
        n_rows, T, B = plan_prefill_pass([len(s.prompt) - s.prefilled for s in pending], self.prefill_lengths,
                                         self.batch_sizes, self.prefill_tokens)
        seqs, last = pending[:n_rows], []
        rows = torch.zeros(B, PASS_COLUMNS + T + dec.k, dtype=torch.int64)
        rows[:, PASS.slot] = self.scratch
        for b, seq in enumerate(seqs):
            L, c0 = len(seq.prompt), seq.prefilled
            c1 = min(L, c0 + T)
            meta = PassColumns(slot=seq.slot, start=c0, length=c1 - c0, prompt_len=L, stop=seq.stop, eos=seq.eos,
                               seed=seq.seed, last=int(c1 == L))
            rows[b, :PASS_COLUMNS] = torch.tensor(meta)
            ids = seq.prompt[c0: c0 + T + dec.k]
            rows[b, PASS_COLUMNS: PASS_COLUMNS + len(ids)] = ids
            seq.prefilled = c1
            last.append(c1 == L)
        key = PrefillKey(B, T, dec)
        launched = self.runner.launch(key, rows)
        for seq, done in zip(seqs, last):
            if done and self.adaptive:
                seq.rows.after_prefill(len(seq.prompt), dec.k, self.policy.max_k)
        timing = StepTiming("prefill", (B, T), len(seqs), int(rows[:, PASS.length].sum()), t0,
                            host_s=time.perf_counter() - t0)
        return LaunchedStep(key, seqs, last, launched, timing)

    def launch_slots(self, slots: list[int], dec: Decoding, timed: bool = False) -> tuple[CycleKey, Launched]:
        """Launch one cycle of the sequences in `slots`, padded to the next captured batch size."""
        B = self.batch_size_for(len(slots))
        key = CycleKey(B, dec)
        return key, self.runner.launch(key, torch.tensor(slots + [-1] * (B - len(slots)), dtype=torch.int32), timed)

    def launch_cycle(self, seqs: list[Sequence], dec: Decoding) -> LaunchedStep:
        """Launch one cycle of `seqs` (timed on the device when a policy learns from it)."""
        t0 = time.perf_counter()
        key, launched = self.launch_slots([s.slot for s in seqs], dec, timed=self.adaptive)
        if self.adaptive:
            for seq in seqs:
                seq.rows.pending.append(dec.k)
        timing = StepTiming("cycle", (key.batch_size,), 0, 0, t0, host_s=time.perf_counter() - t0)
        return LaunchedStep(key, seqs, [], launched, timing)

    def book(self, step: LaunchedStep) -> list[Sequence]:
        """Wait for a step's result and book it; returns the sequences that finished with it."""
        if step.launched.ready is not None:
            step.launched.ready.synchronize()
        t = step.timing
        t.ready_s = time.perf_counter()
        rows = step.launched.host.tolist()
        finished = []
        if isinstance(step.key, CatchupKey):
            self.policy.observe_cost(step.key.batch_size, step.key.decoding.k, step.launched.device_ms(),
                                     catchup_rows=step.key.length)
        elif isinstance(step.key, PrefillKey):
            for row in rows[: len(step.seqs)]:
                if row[PASS_RESULT.nonfinite]:
                    raise NonFiniteError(non_finite_message("prefill"))
            for seq, row, last in zip(step.seqs, rows, step.last):
                if last:
                    seq.out.append(row[PASS_RESULT.first])
                    seq.first_s = t.ready_s
                    if row[PASS_RESULT.done]:
                        finished.append(seq)
        else:
            k = step.key.decoding.k
            c, counted = CycleColumns(k), []
            for row in rows[: len(step.seqs)]:
                if row[c.live] and row[c.nonfinite]:
                    raise NonFiniteError(non_finite_message(NonFinite.cycle_step(row[c.nonfinite], k)))
            for seq, row in zip(step.seqs, rows):
                if row[c.live]:                       # else: finished in an earlier cycle, a padding row here
                    record = CycleRecord.of_cycle(k, row[c.drafts: c.drafts + row[c.k_eff]], row[c.a], row[c.b],
                                                  None if seq.eos < 0 else seq.eos)
                    seq.out += record.emitted
                    seq.cycles.append(record)
                    t.rows += 1
                    t.tokens += row[c.emitted]
                    if row[c.done]:
                        finished.append(seq)
                    if record.counted:
                        counted.append(record.accepted)
                        if seq.acceptance is not None:
                            seq.acceptance.observe(k, [record.accepted])
                if self.adaptive:
                    seq.rows.after_cycle(k, row[c.a]) if row[c.live] else seq.rows.pending.pop(0)
            if self.adaptive:
                self.policy.observe(k, counted)
                self.policy.observe_cost(step.key.batch_size, k, step.launched.device_ms())
        for seq in finished:
            seq.done_s = t.ready_s
        t.host_s += time.perf_counter() - t.ready_s
        return finished
