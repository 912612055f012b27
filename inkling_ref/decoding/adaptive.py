"""Choosing k, the number of drafts, cycle by cycle (`num_speculative_tokens="auto"`).

A cycle with k drafts gains L(k) tokens per sequence on average and costs cost(B, k) milliseconds for
a batch padded to B rows, so the k worth running is the one with the most expected tokens per ms:

    rate(k)  = live * L(k) / cost(B, k)                     live: sequences in the batch, B its padded size
    L(k)     = 1 + sum_{j=1..k} c_1 * c_2 * ... * c_j       acceptance length
    c_j      = P(draft j accepted | drafts 1..j-1 accepted)  conditional acceptance of position j

Acceptance alone cannot pick k: the same c_j favour k = 8 where a cycle costs about the same for any
k (small batches, where reading the weights dominates) and k = 0 where each extra draft costs a
sequential depth pass over many rows (large batches). So the cost table is per batch size and k.

Which tokens count. While prompts wait for slots, a finished sequence's slot is refilled at once, so
every token is worth the same and the rate above (the batch's tokens per ms) is the one to maximize.
When nothing waits, the batch ends with its slowest sequence, and the mean acceptance overstates what
a deeper k does for that one: a sequence that rejects its second draft gains nothing from an eighth,
while the sequences that accept all eight finish early and leave. Then the rate is the tokens the
batch has left over the time until its last sequence is done,

    finish(k) = cost(B, k) * max_i  left_i / L_i(k)          left_i: tokens sequence i has left

with each sequence's own acceptance L_i (its own counts, with the batch's posterior as their prior, of
a small weight: one slow sequence among fast ones must show itself within a few cycles). Until every
live sequence has shown itself (`interval` cycles of its own), the current k holds: the batch's
posterior alone would pick the k of the average sequence, and a switch up costs a catch-up.

Acceptance is learned as it decodes: c_j ~ Beta(prior + accepted_j, prior + rejected_j), counted over
the cycles that reached position j. Position 1's prior has mean PRIOR_MEAN (0.8: MTP depths are trained
to be accepted); position j's prior has the posterior mean of position j - 1, each with the weight of
PRIOR_WEIGHT cycles. So a position never reached is expected to accept about as often as the one
before it (successive depths' acceptance changes slowly), and the controller deepens step by step while
the deepest position it runs keeps being accepted, then its own counts take over. Each decision draws c
from these posteriors (Thompson sampling) instead of taking their means: a k the means rank below the
best is still tried now and then, in proportion to how likely it is to be the best. The first decision
of a request takes the means, and fixes the k of its prefill passes unless the engine names one (the
fast engine prefills a request at the k the previous request of its batch size ran most: the same
captured graphs from one request to the next, and the depth rows its cycles will use).
`AcceptanceCounts` can outlive a request: the fast engine keeps one per decoding mode, so that a
request starts from what the requests before it saw.

Costs are measured, never constants: the fast engine times its captured cycles (at setup, then every
cycle on the device), the reference its own passes. A cost never measured is estimated from those
measured at the same batch size (a line in k) or at the nearest batch size.

Switching to a larger k has a price: depths that did not run while k was smaller (and rows that a long
acceptance left behind) must catch up before they draft (their missing rows recomputed from the
committed tokens). `choose` is told how many rows that is for each k and charges the catch-up's cost
once, spread over the cycles the sequences have left at that k (a switch is kept once paid for). That
cost is measured too: a fixed part plus a part per row, a line through the catch-ups timed at each
(batch size, k). A switch must also promise `margin` more tokens per ms than staying: Thompson draws
alone would flap between ks of nearly equal rates, and every change of k costs the engine one wait for
the cycle in flight.

    DepthPolicy           the interface both engines drive: choose, observe, observe_cost
    FixedDepth(k)         always k
    ScriptedDepths(ks)    k from a list, cycle after cycle (tests)
    AdaptiveDepth(max_k)  the controller above
    AcceptanceCounts      what it learns of acceptance (per position, fading; per batch and per sequence)
    CycleCosts            the measured cost table
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field


class DepthPolicy:
    """How many drafts the next cycle makes. `max_k`: the depths loaded (the largest k it may return)."""
    max_k: int = 0

    def choose(self, live: int, batch: int, remaining: int, current: int | None, catchup_rows=None,
               sequences=None) -> int:
        """k for the next cycle of `live` sequences padded to `batch` rows; `remaining`: the most new tokens
        any of them may still emit; `current`: the k of the last cycle (None before the first);
        catchup_rows(k): rows the depths must recompute before a cycle at k (None: none), called only
        when a decision is made; sequences: (tokens left, AcceptanceCounts) per live sequence when the
        batch ends with its slowest (nothing waits for a slot), else None."""
        raise NotImplementedError

    def observe(self, k: int, accepted: list[int]) -> None:
        """The accepted counts a of the rows of a cycle that made all k drafts."""

    def observe_cost(self, batch: int, k: int, ms: float, catchup_rows: int = 0) -> None:
        """A measured cycle (catchup_rows = 0), or a catch-up of depths 0..k-1 over `catchup_rows` rows per
        sequence, at `batch` rows."""


@dataclass
class FixedDepth(DepthPolicy):
    k: int

    def __post_init__(self):
        self.max_k = self.k

    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None) -> int:
        return self.k


@dataclass
class ScriptedDepths(DepthPolicy):
    """ks[0] for the first cycle, ks[1] for the second, ...; the last entry for every cycle after."""
    ks: list[int]
    calls: int = 0

    def __post_init__(self):
        if not self.ks or any(not isinstance(k, int) or k < 0 for k in self.ks):
            raise ValueError(f"ScriptedDepths needs a non-empty list of integers >= 0, got {self.ks!r}")
        self.max_k = max(self.ks)

    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None) -> int:
        k = self.ks[min(self.calls, len(self.ks) - 1)]
        self.calls += 1
        return k


@dataclass
class CycleCosts:
    """Measured milliseconds: cycles per (batch, k), and catch-ups per (batch, k, rows recomputed per
    sequence). Each entry is a running mean that follows the latest measurements (`weight` for a new one
    once there are a few)."""
    cycles: dict[tuple[int, int], float] = field(default_factory=dict)
    catchup: dict[tuple[int, int, int], float] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    weight: float = 0.2

    def add(self, table: dict, key: tuple, ms: float) -> None:
        if not (ms > 0 and math.isfinite(ms)):
            return
        n = self.counts[(id(table), key)] = self.counts[(id(table), key)] + 1
        old = table.get(key)
        table[key] = ms if old is None else old + max(self.weight, 1 / n) * (ms - old)

    def cycle_ms(self, batch: int, k: int) -> float | None:
        """Measured, or estimated: a line through the measured ks of this batch size (one measured k: the
        slope of the nearest batch size that has two), else the nearest measured batch size's value."""
        if (batch, k) in self.cycles:
            return self.cycles[(batch, k)]
        if not self.cycles:
            return None
        sizes = sorted({b for b, _ in self.cycles}, key=lambda b: (abs(math.log(b / batch)), b))
        here = {kk: ms for (b, kk), ms in self.cycles.items() if b == batch}
        for b in sizes:
            line = _line({kk: ms for (bb, kk), ms in self.cycles.items() if bb == b})
            if line is None:
                continue
            if len(here) >= 2:
                line = _line(here)
            elif len(here) == 1:
                (k0, ms0), = here.items()
                line = (ms0 - line[1] * k0, line[1])
            return max(1e-6, line[0] + line[1] * k)
        b = sizes[0]
        (k0, ms0), = ((kk, ms) for (bb, kk), ms in self.cycles.items() if bb == b)
        return ms0

    def catchup_ms(self, batch: int, k: int, rows: int) -> float:
        """A catch-up of `rows` rows per sequence through depths 0..k-1: a line in the rows through the
        catch-ups measured at (batch, k) (one measured: in proportion to the rows), else estimated as
        the draft part of a cycle (cycle(k) - cycle(0), k + 1 rows per depth) per row."""
        if rows <= 0 or k == 0:
            return 0.0
        measured = {r: ms for (b, kk, r), ms in self.catchup.items() if b == batch and kk == k}
        line = _line(measured)
        if line is not None:
            return max(min(measured.values()), line[0] + line[1] * rows)
        if measured:
            (r0, ms0), = measured.items()
            return ms0 * rows / r0
        with_k, without = self.cycle_ms(batch, k), self.cycle_ms(batch, 0)
        if with_k is None or without is None:
            return 0.0
        return max(0.0, with_k - without) / (k + 1) * rows


def _line(points: dict[int, float]) -> tuple[float, float] | None:
    """Least squares (intercept, slope) of ms against x (k, or rows), or None with fewer than two points."""
    if len(points) < 2:
        return None
    ks, ms = list(points), list(points.values())
    mk, mm = sum(ks) / len(ks), sum(ms) / len(ms)
    slope = sum((a - mk) * (b - mm) for a, b in zip(ks, ms)) / sum((a - mk) ** 2 for a in ks)
    return mm - slope * mk, slope


def acceptance_length(conditional: list[float], k: int) -> float:
    """L(k) = 1 + sum_{j<=k} prod_{i<=j} c_i."""
    total, run = 1.0, 1.0
    for c in conditional[:k]:
        run *= c
        total += run
    return total


@dataclass
class AcceptanceCounts:
    """Per draft position j = 1..max_k: how often it was accepted and rejected, over the cycles that
    reached it; the last `memory` observations per position count (older ones fade, so that acceptance
    that drifts is followed)."""
    max_k: int
    memory: float = 200.0
    accepted: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.accepted = self.accepted or [0.0] * self.max_k
        self.rejected = self.rejected or [0.0] * self.max_k
        if len(self.accepted) != self.max_k or len(self.rejected) != self.max_k:
            raise ValueError(f"accepted and rejected need one count per position 1..{self.max_k}, got "
                             f"{len(self.accepted)} and {len(self.rejected)}")

    def observe(self, k: int, accepted: list[int]) -> None:
        """The accepted counts a of the rows of a cycle that made all k drafts."""
        for a in accepted:
            for j in range(min(a + 1, k)):              # positions 1..a accepted, a + 1 (if <= k) rejected
                if j < a:
                    self.accepted[j] += 1
                else:
                    self.rejected[j] += 1
        for j in range(self.max_k):
            n = self.accepted[j] + self.rejected[j]
            if n > self.memory:
                self.accepted[j] *= self.memory / n
                self.rejected[j] *= self.memory / n


class AdaptiveDepth(DepthPolicy):
    """The controller of this module's docstring. costs: measured CycleCosts (filled by the engine);
    acceptance: the AcceptanceCounts to learn into (None: new ones, with `memory`); interval: cycles a
    decision holds before the next one (a new batch size decides at once); seed: the random draws of
    the acceptance posteriors."""

    PRIOR_MEAN, PRIOR_WEIGHT = 0.8, 5.0
    OWN_PRIOR_WEIGHT = 2.0          # a sequence's own counts outweigh the batch's after a few cycles

    def __init__(self, max_k: int, costs: CycleCosts | None = None, interval: int = 4, seed: int = 0,
                 memory: float = 200.0, margin: float = 0.03, acceptance: AcceptanceCounts | None = None):
        if not isinstance(max_k, int) or max_k < 0:
            raise ValueError(f"max_k must be an integer >= 0, got {max_k!r}")
        if acceptance is not None and acceptance.max_k != max_k:
            raise ValueError(f"acceptance counts for {acceptance.max_k} positions, and max_k={max_k}")
        self.max_k, self.costs, self.interval, self.margin = max_k, costs or CycleCosts(), interval, margin
        self.acceptance = acceptance if acceptance is not None else AcceptanceCounts(max_k, memory)
        self.rng = random.Random(seed)
        self.held = 0                           # cycles since the last decision
        self.batch: int | None = None
        self.used: Counter = Counter()          # k -> cycles chosen

    def conditional(self, draw: bool = True) -> list[float]:
        """c_1..c_max_k: drawn from the Beta posteriors (draw=True), or their means. Position j's prior has
        the posterior mean of position j - 1 (position 1's: PRIOR_MEAN), with the weight PRIOR_WEIGHT."""
        out, mean = [], self.PRIOR_MEAN
        for a, r in zip(self.acceptance.accepted, self.acceptance.rejected):
            pa, pr = self.PRIOR_WEIGHT * mean + a, self.PRIOR_WEIGHT * (1 - mean) + r
            mean = min(max(pa / (pa + pr), 1e-9), 1 - 1e-9)     # a prior of weight > 0 on both sides
            out.append(self.rng.betavariate(pa, pr) if draw else mean)
        return out

    def own_conditional(self, counts: AcceptanceCounts, prior: list[float]) -> list[float]:
        """One sequence's c_1..c_max_k: the posterior means of its own counts, with `prior` (the batch's)
        as their prior means, each with the weight OWN_PRIOR_WEIGHT."""
        w = self.OWN_PRIOR_WEIGHT
        return [(w * p + a) / (w + a + r) for p, a, r in zip(prior, counts.accepted, counts.rejected)]

    def rates(self, live: int, batch: int, remaining: int, current: int | None, conditional: list[float],
              catchup_rows=None, sequences=None) -> dict[int, float]:
        """Expected tokens per ms of each k whose cost is known, with the catch-up a switch needs charged
        once. catchup_rows: a function of k, or a dict. sequences=None: the batch's tokens over the
        cycles the sequences have left at that k; else ((tokens left, AcceptanceCounts) per sequence)
        the tokens they have left over the time until the last of them is done (module docstring)."""
        rows = catchup_rows.get if isinstance(catchup_rows, dict) else catchup_rows
        own = [(left, self.own_conditional(counts, conditional)) for left, counts in sequences or ()]
        out = {}
        for k in range(self.max_k + 1):
            cost = self.costs.cycle_ms(batch, k)
            if cost is None:
                continue
            switch = self.costs.catchup_ms(batch, k, (rows(k) or 0) if rows else 0) if k != current else 0.0
            if own:
                cycles = max(max(1.0, left / acceptance_length(c, k)) for left, c in own)
                out[k] = sum(left for left, _ in own) / (cost * cycles + switch)
            else:
                L = acceptance_length(conditional, k)
                cycles = max(1.0, remaining / L)
                out[k] = live * L * cycles / (cost * cycles + switch)
        return out

    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None) -> int:
        unseen = current and sequences and any(c.accepted[0] + c.rejected[0] < self.interval for _, c in sequences)
        if current is not None and (unseen or batch == self.batch and self.held < self.interval):
            self.held += 1
            self.used[current] += 1
            return current
        rates = self.rates(live, batch, remaining, current, self.conditional(draw=current is not None),
                           catchup_rows, sequences)
        k = max(rates, key=rates.get) if rates else self.max_k
        if current in rates and rates[k] < rates[current] * (1 + self.margin):
            k = current                                   # not worth a change
        self.batch, self.held = batch, 1
        self.used[k] += 1
        return k

    def observe(self, k: int, accepted: list[int]) -> None:
        self.acceptance.observe(k, accepted)

    def observe_cost(self, batch: int, k: int, ms: float, catchup_rows: int = 0) -> None:
        if catchup_rows:
            self.costs.add(self.costs.catchup, (batch, k, catchup_rows), ms)
        else:
            self.costs.add(self.costs.cycles, (batch, k), ms)


def depth_policy(num_speculative_tokens, max_k: int) -> DepthPolicy:
    """The policy an engine runs for `num_speculative_tokens`: an integer k (FixedDepth), "auto"
    (AdaptiveDepth over the max_k depths loaded), or a DepthPolicy as it is."""
    if isinstance(num_speculative_tokens, DepthPolicy):
        return num_speculative_tokens
    if num_speculative_tokens == "auto":
        return AdaptiveDepth(max_k)
    return FixedDepth(num_speculative_tokens)
