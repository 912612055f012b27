"""The engine's device steps: a cycle and a batched prefill pass, each captured as one CUDA graph.

Nothing in this file may synchronize with the host: no `.item()`, `.tolist()`, `int(tensor)`, no
branch on a tensor's value, no shape that depends on one. Every data-dependent value (slots,
lengths, positions, tokens) is device state (caches.py) or part of the step's one input tensor
(step_io.py), so a step is a fixed sequence of launches for its key and can be captured and replayed.

    cycle(batch, dec)          draft -> verify -> accept -> commit -> outcome
        draft                  depths 0..k-1 over the window [n-2-k, n-2]; d_{m+1} -> tokens[n+m]
        verify                 trunk over tokens[n-1 .. n-1+k] at positions n-1 .. n-1+k
        accept                 greedy_accept / rejection_sample, capped at k_eff per sequence
        commit                 tokens[n+a] = b; n += a + 1          (rollback = the length only)
        outcome                the emitted tokens cut at EOS; done[slot] at EOS or n = stop
    prefill_rows(rows, T, dec) the next chunk of up to B admitted prompts: the trunk, its H_p, every
                               depth over the chunk's teacher-forced rows, and for a prompt's last
                               chunk x_L and the slot's state
    catchup_rows(rows, T, dec) depths 0..k-1 over up to T committed rows per sequence, teacher-forced
                               from SlotState's tokens and hiddens: the rows a cycle at k needs below
                               its window when a smaller k ran before (or a longer acceptance)

Fixed shapes: every cycle runs T = k+1 rows per sequence for every depth and the verify. A window
row at a position < 0 (short prompts) and a verify row beyond k_eff = min(k, stop - n - 1) are
padding (pos = -1: no cache reads or writes). A batch row on the scratch slot (SlotState.scratch)
with every position -1 is padding: it writes nothing but the scratch slot. A row whose slot is
`done` runs as such a padding row. Depths beyond k_eff still run (their rows are rewritten by the
next window), and drafts beyond k_eff are never accepted, so the records are those of the
reference: CycleRecord.k is k_eff.

Sampling draws its uniforms per sequence in the reference's order (k_eff for sampled drafts, k_eff
for the acceptance tests, one for the correction or bonus; one for x_L first): with Philox on the
device (`uniforms="device"`, another stream than the reference's, the same distribution) or read
from each slot's copy of the reference's own stream (`uniforms="reference"`: the same tokens as
inkling_ref.generate for the same seed).
"""

from __future__ import annotations

import torch

from inkling_ref.decoding.sampling import SamplingParams

from . import forward
from .caches import LayerCache, SlotState
from .kernels.accept import first_nonfinite_torch, greedy_accept
from .kernels.rejection import rejection_sample
from .kernels.sampling import sample_tokens, sampling_probs
from .kernels.uniforms import philox_uniforms
from .step_io import PASS, PASS_COLUMNS, Batch, CatchupKey, CycleKey, Decoding, NonFinite, StepKey
from .weights import ModelWeights


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 probabilities after temperature, top-k and top-p (kernels/sampling.py)."""
    return sampling_probs(logits, params.temperature, params.top_k, params.top_p)


def rows_not_finite(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [B]: row b of x [B, T, ...] holds a NaN or an infinity at a valid position (valid [B, T]).
    Positions that are not valid (padding, pos = -1) compute on nothing and may hold anything."""
    bad = ~torch.isfinite(x).flatten(2).all(dim=2)
    return (bad & valid).any(dim=1)


class DeviceSteps:
    """The weights, the caches of the trunk and of every depth, the slots' state, and the steps that
    run on them. `reference_uniforms` [slots+1, draws] float64: each slot's copy of its sequence's
    reference stream (uniforms="reference" only, else None). `on_depth`: None, or a callable
    (m, h_in, ids, slot, pos, out) that `depth` calls after every depth pass run eagerly (a replayed CUDA
    graph calls no Python): how a port dump records the depths (inkling_mtp/fast_dump.py)."""

    def __init__(self, W: ModelWeights, trunk_caches: list[LayerCache], depth_caches: list[LayerCache],
                 state: SlotState, uniforms: str, reference_uniforms: torch.Tensor | None):
        self.W, self.trunk_caches, self.depth_caches, self.state = W, trunk_caches, depth_caches, state
        self.uniforms, self.reference_uniforms = uniforms, reference_uniforms
        self.on_depth = None

    def depth(self, m: int, h: torch.Tensor, ids: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
              prefill: bool = False) -> torch.Tensor:
        """Depth m over h [B, T, H] with its cache (forward.depth_forward), then `on_depth` if set."""
        out = forward.depth_forward(self.W, m, self.depth_caches[m], h, ids, slot, pos, prefill=prefill)
        if self.on_depth is not None:
            self.on_depth(m, h, ids, slot, pos, out)
        return out

    def run(self, key: StepKey, rows: torch.Tensor) -> torch.Tensor:
        """The step `key` on its device input `rows`: `cycle_rows`, `prefill_rows` or `catchup_rows`."""
        if isinstance(key, CycleKey):
            return self.cycle_rows(rows, key.decoding)
        if isinstance(key, CatchupKey):
            return self.catchup_rows(rows, key.length, key.decoding)
        return self.prefill_rows(rows, key.length, key.decoding)

    def padding_input(self, key: StepKey, device) -> torch.Tensor:
        """The input of the step `key` with every row padding (on the scratch slot, writing nothing else):
        what a graph is captured on."""
        if isinstance(key, CycleKey):
            return torch.full((key.batch_size,), -1, dtype=torch.int32, device=device)
        if isinstance(key, CatchupKey):
            pad = torch.zeros(key.batch_size, 3, dtype=torch.int64, device=device)
            pad[:, 0] = self.state.scratch
            return pad
        pad = torch.zeros(key.batch_size, PASS_COLUMNS + key.length + key.decoding.k, dtype=torch.int64,
                          device=device)
        pad[:, PASS.slot] = self.state.scratch
        return pad

    # ------------------------------------------------------------------------------------------ the cycle
    def _lengths(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids as int64 [B], committed lengths n [B]); padding rows get n = 0, so that every index
        they form stays in range whatever the scratch slot holds."""
        s = batch.slot.long()
        return s, torch.where(batch.live, self.state.n[s], 0)

    def draft(self, batch: Batch, dec: Decoding) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Depths 0..k-1 over the window [n-2-k, n-2]; d_{m+1} is written at tokens[n+m].
        Returns (drafts int64 [B, k], q [B, k, V] float64: the draft distributions, or None for greedy
        drafts, scores float32 [k, B]: per draft the maximum logit (greedy) or the sum of its
        probabilities (sampled), NaN or infinite where depth m's output row was: `accept` checks them)."""
        st, (s, n), k = self.state, self._lengths(batch), dec.k
        scores = torch.empty(k, len(s), dtype=torch.float32, device=s.device)
        if k == 0:                                                               # plain decoding: no drafts
            return st.tokens.new_zeros(len(s), 0), None, scores
        p = n[:, None] - 2 - k + torch.arange(k + 1, device=n.device)            # window positions [B, T]
        pos = torch.where(batch.live[:, None] & (p >= 0), p, -1).int()
        h = st.hidden[s[:, None], p.clamp(min=0)]                               # H_p, depth 0's input
        drafts, q = [], []
        for m in range(k):
            ids = st.tokens[s[:, None], (p + m + 1).clamp(min=0)]               # slot p+m+1: x or an earlier draft
            h = self.depth(m, h, ids, batch.slot, pos)
            last = h[:, -1]                                                      # row p = n-2
            if dec.sampled_drafts:
                q_m = probs(forward.logits(self.W, last), dec.draft_params)      # [B, V]
                d = sample_tokens(q_m, batch.uniforms[:, m])
                q.append(q_m)
                scores[m] = q_m.sum(dim=1)
            else:
                d = forward.greedy_tokens(self.W, last, scores_out=scores[m])
            st.tokens.index_put_((s, n + m), d)                                  # d_{m+1} at position n+m
            drafts.append(d)
        return torch.stack(drafts, dim=1), (torch.stack(q, dim=1) if q else None), scores

    def verify(self, batch: Batch, dec: Decoding) -> tuple[torch.Tensor, torch.Tensor]:
        """The trunk over [x_{n-1}, d_1, .., d_k] at positions n-1 .. n-1+k (rows beyond k_eff are padding);
        writes H_{n-1..n-1+k} into SlotState.hidden. Returns (H [B, k+1, H], k_eff int64 [B])."""
        st, (s, n), k = self.state, self._lengths(batch), dec.k
        k_eff = torch.where(batch.live, (st.stop[s] - n - 1).clamp(0, k), 0)
        t = torch.arange(k + 1, device=n.device)
        p = n[:, None] - 1 + t                                                    # [B, T]
        pos = torch.where(batch.live[:, None] & (t <= k_eff[:, None]), p, -1).int()
        ids = st.tokens[s[:, None], p.clamp(min=0)]
        hidden = forward.trunk_forward(self.W, self.trunk_caches, ids, batch.slot, pos)
        st.hidden.index_put_((s[:, None].expand_as(p), p.clamp(min=0)), hidden)
        return hidden, k_eff

    def accept(self, batch: Batch, dec: Decoding, drafts: torch.Tensor, q: torch.Tensor | None,
               draft_scores: torch.Tensor, hidden: torch.Tensor, k_eff: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accepted count a (<= k_eff) and the next token b (correction or bonus), per sequence, and the
        row's NonFinite code: 1 + the first draft (depth m) or verify row t <= k_eff whose score (maximum
        logit, or sum of probabilities) is NaN or infinite, 0 if none (greedy_accept's first_bad: the
        greedy path checks it inside the accept kernel, without a launch of its own)."""
        B, T, H = hidden.shape
        k = dec.k
        if dec.greedy:
            target_scores = torch.empty(B, T, dtype=torch.float32, device=hidden.device)
            target = forward.greedy_tokens(self.W, hidden.view(B * T, H), scores_out=target_scores.view(B * T))
            a, nxt, _, bad = greedy_accept(drafts, target.view(B, T), k_eff, scores=(draft_scores, target_scores))
        else:
            p = probs(forward.logits(self.W, hidden), dec.params)                # [B, T, V] float64
            bad = first_nonfinite_torch(draft_scores, p.sum(dim=2).float(), k_eff)
            u = batch.uniforms
            a, nxt, _ = rejection_sample(p, q, drafts, u[:, k:2 * k], u[:, 2 * k], k_eff)
        return a.long(), nxt, bad.long()

    def commit(self, batch: Batch, a: torch.Tensor, nxt: torch.Tensor) -> None:
        """tokens[n+a] = b, n <- n + a + 1 (padding rows: only the scratch slot's tokens change)."""
        st, (s, n) = self.state, self._lengths(batch)
        st.tokens.index_put_((s, n + a), nxt)
        st.n.index_put_((s,), torch.where(batch.live, n + a + 1, n))

    def cycle(self, batch: Batch, dec: Decoding) -> torch.Tensor:
        """draft -> verify -> accept -> commit -> outcome for the rows of `batch` whose slot is not done
        (the others run as padding). Returns int64 [B, k+8], see CycleColumns: its `nonfinite` column names
        the first step of a row that produced a NaN or an infinity (then nothing else in the row counts)."""
        st = self.state
        live = batch.live & ~st.done[batch.slot.long()]
        batch = Batch(slot=torch.where(live, batch.slot, st.scratch).int(), live=live, uniforms=batch.uniforms)
        s, n = self._lengths(batch)
        if not dec.greedy:
            self._draw_uniforms(batch, dec, s, n)
        drafts, q, draft_scores = self.draft(batch, dec)
        hidden, k_eff = self.verify(batch, dec)
        a, nxt, nonfinite = self.accept(batch, dec, drafts, q, draft_scores, hidden, k_eff)
        self.commit(batch, a, nxt)
        return self._outcome(batch, s, n, drafts, a, nxt, k_eff, nonfinite)

    def cycle_rows(self, rows: torch.Tensor, dec: Decoding) -> torch.Tensor:
        """`cycle` of the batch whose row b runs the sequence in slot rows[b] (int32 [B]; -1: a padding row)."""
        live = rows >= 0
        batch = Batch(slot=torch.where(live, rows, self.state.scratch).int(), live=live,
                      uniforms=torch.zeros(len(rows), 2 * dec.k + 1, dtype=torch.float64, device=rows.device))
        return self.cycle(batch, dec)

    def _draw_uniforms(self, batch: Batch, dec: Decoding, s: torch.Tensor, n: torch.Tensor) -> None:
        """batch.uniforms [B, 2k+1] = this cycle's draws (draft | accept | final); the slots' counters advance.
        Device: 2k+1 Philox draws. Reference: the next draws of the slot's copied stream, as many as
        the reference takes (k_eff per sampled-draft and acceptance group, then one); the columns of a
        group beyond k_eff are never used."""
        st, k = self.state, dec.k
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
        if dec.sampled_drafts:
            batch.uniforms[:, :k] = ref[s[:, None], (start[:, None] + j).clamp(max=last)]
            start = start + k_eff
        batch.uniforms[:, k:2 * k] = ref[s[:, None], (start[:, None] + j).clamp(max=last)]
        batch.uniforms[:, 2 * k] = ref[s, (start + k_eff).clamp(max=last)]
        st.counters.index_put_((s,), start + k_eff + 1)

    def _outcome(self, batch: Batch, s: torch.Tensor, n: torch.Tensor, drafts: torch.Tensor, a: torch.Tensor,
                 nxt: torch.Tensor, k_eff: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
        """The emitted tokens d_1..d_a, b cut after the first EOS, and done = EOS emitted or n = stop
        (written to the slot); the cycle's result rows (CycleColumns)."""
        st = self.state
        k = drafts.shape[1]
        j = torch.arange(k + 1, device=s.device)
        emitted = torch.where(j < a[:, None], torch.cat([drafts, nxt[:, None]], dim=1), nxt[:, None])
        at_eos = (emitted == st.eos[s][:, None]) & (j <= a[:, None])
        hit = at_eos.any(dim=1)
        count = torch.where(hit, at_eos.int().argmax(dim=1) + 1, a + 1)
        done = batch.live & (hit | (n + a + 1 >= st.stop[s]) | (nonfinite != NonFinite.NONE))
        st.done.index_put_((s,), done)
        status = torch.stack([k_eff, count, hit.long(), done.long(), batch.live.long(), nonfinite], dim=1)
        return torch.cat([a[:, None], nxt[:, None], drafts, status], dim=1)

    # ------------------------------------------------------------------------------------------ prefill
    def prefill_rows(self, rows: torch.Tensor, T: int, dec: Decoding) -> torch.Tensor:
        """One batched prefill pass. rows: int64 [B, PASS_COLUMNS + T + k], a row per chunk: its
        PassColumns, then the prompt tokens at positions c0 .. c0+T+k-1 (those < L). The chunk sits at
        positions c0 .. c0+l-1 (row positions pos, -1 beyond l). Every sequence is in one row at most,
        and its earlier chunks were prefilled by earlier passes:

            tokens[slot, c0 .. min(L, c0+l+k) - 1] = the row's tokens (the depth rows read k ahead)
            H = trunk(chunk)                                         trunk caches at pos
            hidden[slot, p] = H_p                   every chunk row  (windows and catch-ups read them)
            depth m over rows p <= L-2-k (tokens x_{p+m+1}, inputs H / depth m-1)   depth caches
            last chunk:  x_L = pick(H_{L-1}); tokens[slot, L] = x_L; n = L+1; stop, eos, seed,
                         counter (1 after a sampled x_L, else 0) and done = (x_L == eos or L+1 >= stop)

        Returns int64 [B, 3]: PassResult (x_L, done, nonfinite) per row; nonfinite = NonFinite.PREFILL when
        the chunk's trunk or depth hidden states (or the probabilities x_L is sampled from) are not finite."""
        st, dev, k = self.state, rows.device, dec.k
        B, scratch = rows.shape[0], st.scratch
        slot, c0, length, L, stop, eos, seed, last = rows[:, :PASS_COLUMNS].unbind(1)
        ids = rows[:, PASS_COLUMNS:]                                             # [B, T + k]
        t = torch.arange(T + k, device=dev)
        p = c0[:, None] + t
        put = (t < length[:, None] + k) & (p < L[:, None])
        st.tokens.index_put_((torch.where(put, slot[:, None], scratch), torch.where(put, p, 0)), ids)
        pos = torch.where(t[:T] < length[:, None], p[:, :T], -1).int()
        slot32 = slot.int()
        hidden = forward.trunk_forward(self.W, self.trunk_caches, ids[:, :T].contiguous(), slot32, pos, prefill=True)
        bad = rows_not_finite(hidden, pos >= 0)
        st.hidden.index_put_((torch.where(pos >= 0, slot[:, None], scratch), pos.clamp(min=0)), hidden)
        d_pos = torch.where(pos < (L - 1 - k)[:, None], pos, -1)                # depth rows p <= L-2-k
        h, width = hidden, st.tokens.shape[1]
        for m in range(k):
            tok = st.tokens[slot[:, None], (p[:, :T] + m + 1).clamp(max=width - 1)]   # x_{p+m+1}
            h = self.depth(m, h, tok, slot32, d_pos, prefill=True)
            bad = bad | rows_not_finite(h, d_pos >= 0)
        h_last = hidden[torch.arange(B, device=dev), (length - 1).clamp(min=0)]  # H_{c0+l-1}
        counter = torch.zeros(B, dtype=torch.int64, device=dev)
        if dec.greedy:
            first = forward.greedy_tokens(self.W, h_last)
        else:
            if self.uniforms == "device":
                u = philox_uniforms(seed, counter, 1)[:, 0]                     # counter -> 1
            else:
                u = self.reference_uniforms[slot, 0]
                counter += 1
            p_first = probs(forward.logits(self.W, h_last), dec.params)
            first = sample_tokens(p_first, u)
            bad = bad | (last.bool() & ~torch.isfinite(p_first).all(dim=1))
        s = torch.where(last.bool(), slot, scratch)
        st.tokens.index_put_((s, L), first)
        done = (first == eos) | (L + 1 >= stop) | bad
        for dst, value in ((st.n, L + 1), (st.stop, stop), (st.eos, eos), (st.seeds, seed), (st.counters, counter),
                           (st.done, done)):
            dst.index_put_((s,), value)
        nonfinite = torch.where(bad, NonFinite.PREFILL, NonFinite.NONE)
        return torch.stack([first, done.long(), nonfinite], dim=1)

    # ------------------------------------------------------------------------------------------ catch-up
    def catchup_rows(self, rows: torch.Tensor, T: int, dec: Decoding) -> torch.Tensor:
        """One catch-up pass. rows: int64 [B, 3], per row the slot (SlotState.scratch: padding), the first
        row c0 and the count c <= T of rows to recompute; depth m runs over rows p = c0 .. c0+c-1 with
        tokens x_{p+m+1} and hidden inputs H_p (m = 0) or depth m-1's outputs of this pass, writing its
        cache rows. Every row read is committed: the caller asks only for rows below the next window
        [n-2-k, n-2], so p + m + 1 <= n - 2. Returns int64 [B, 1]: c per row."""
        st, dev = self.state, rows.device
        slot, c0, count = rows.unbind(1)
        t = torch.arange(T, device=dev)
        p = c0[:, None] + t                                                     # [B, T]
        pos = torch.where(t < count[:, None], p, -1).int()
        last = st.tokens.shape[1] - 1
        h = st.hidden[slot[:, None], p.clamp(max=st.hidden.shape[1] - 1)]       # H_p
        slot32 = slot.int()
        for m in range(dec.k):
            tok = st.tokens[slot[:, None], (p + m + 1).clamp(max=last)]         # x_{p+m+1}
            h = self.depth(m, h, tok, slot32, pos, prefill=True)
        return count[:, None].clone()
