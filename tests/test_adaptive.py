"""The depth controller (inkling_ref/decoding/adaptive.py) against synthetic costs and acceptance with a
known best k, and the reference's `generate` with k changing from cycle to cycle.

The synthetic world: a cycle at (batch B, k) costs cost(B, k) ms and each row accepts draft j with
probability c_j given drafts 1..j-1 were. The controller sees only what an engine shows it (the
measured costs, the accepted counts of its own cycles) and must end up, at every batch size, on a k
whose true rate is within 3 % of the best. Two broken controllers must fail the same check: one that
ignores the batch size (it reads the costs of batch 1 everywhere), and one that never explores (it
takes the posterior means under one flat prior instead of drawing from posteriors whose priors follow
the position before, so positions it never reached keep a prior that here underrates the true
acceptance, and it stays below the best k).
"""

from __future__ import annotations

import random

import pytest
import torch

from configs import tiny_config
from inkling_ref import generate, random_model
from inkling_ref.decoding.adaptive import (AcceptanceCounts, AdaptiveDepth, CycleCosts, FixedDepth, ScriptedDepths,
                                           acceptance_length, depth_policy)

MAX_K = 8


def true_rate(live, B, k, costs, c):
    return live * acceptance_length(c, k) / costs[(B, k)]


def best_rate(live, B, costs, c):
    return max(true_rate(live, B, k, costs, c) for k in range(MAX_K + 1))


def simulate(policy, costs, c, schedule, seed=0):
    """Run `policy` through cycles: schedule is a list of (live, B, cycles). Returns, per (live, B), the
    ks it chose in the second half of that stretch."""
    rng, chosen, k = random.Random(seed), {}, None
    for live, B, n in schedule:
        picks = []
        for i in range(n):
            k = policy.choose(live, B, 10_000, k)
            accepted = []
            for _ in range(live):
                a = 0
                while a < k and rng.random() < c[a]:
                    a += 1
                accepted.append(a)
            policy.observe(k, accepted)
            policy.observe_cost(B, k, costs[(B, k)] * rng.uniform(0.97, 1.03))
            if i >= n // 2:
                picks.append(k)
        chosen.setdefault((live, B), []).extend(picks)
    return chosen


def check_controller(make_policy, costs, c, schedule):
    """Every stretch's second half: the mean true rate of the chosen ks is >= 0.97 x the best."""
    table = CycleCosts()
    for key, ms in costs.items():                        # the setup measurement an engine makes
        table.add(table.cycles, key, ms)
    chosen = simulate(make_policy(table), costs, c, schedule)
    for (live, B), ks in chosen.items():
        got = sum(true_rate(live, B, k, costs, c) for k in ks) / len(ks)
        best = best_rate(live, B, costs, c)
        assert got >= 0.97 * best, f"batch {B}: chose {sorted(set(ks))}, rate {got:.3f} < 0.97 x best {best:.3f}"


def world(draft_cost_1: float, draft_cost_32: float):
    """cost(B, k) = base + k * draft cost: drafts cheap at batch 1, dear at batch 32."""
    return {(B, k): (1.0 if B == 1 else 3.0) + k * (draft_cost_1 if B == 1 else draft_cost_32)
            for B in (1, 32) for k in range(MAX_K + 1)}


HIGH = [0.97] * MAX_K                                   # acceptance the prior (mean 0.8) underrates
SCHEDULES = {
    "batch 1 only": [(1, 1, 400)],
    "batch 32, then 1": [(32, 32, 300), (1, 1, 400)],
}


class IgnoresBatch(AdaptiveDepth):
    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None):
        return super().choose(live, 1, remaining, current, catchup_rows, sequences)


class IgnoresTheSlowest(AdaptiveDepth):
    """Maximizes the batch's tokens per ms even when the batch ends with its slowest sequence."""
    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None):
        return super().choose(live, batch, remaining, current, catchup_rows, None)


class NeverExplores(AdaptiveDepth):
    def conditional(self, draw=True):
        p, w = self.PRIOR_MEAN, self.PRIOR_WEIGHT
        return [(w * p + a) / (w + a + r) for a, r in zip(self.acceptance.accepted, self.acceptance.rejected)]


def test_controller_finds_the_best_k_at_every_batch_size():
    costs = world(0.6, 3.0)
    assert max(range(MAX_K + 1), key=lambda k: true_rate(1, 1, k, costs, HIGH)) == 5      # drafts pay
    assert max(range(MAX_K + 1), key=lambda k: true_rate(32, 32, k, costs, HIGH)) == 0    # they do not
    for name, schedule in SCHEDULES.items():
        check_controller(lambda t: AdaptiveDepth(MAX_K, t, interval=1, seed=1), costs, HIGH, schedule)


@pytest.mark.parametrize("mutant", [IgnoresBatch, NeverExplores])
def test_controller_check_catches_broken_controllers(mutant):
    """The same check fails a controller that ignores the batch size and one that never explores."""
    costs = world(0.6, 3.0)
    schedule = SCHEDULES["batch 32, then 1"] if mutant is IgnoresBatch else SCHEDULES["batch 1 only"]
    with pytest.raises(AssertionError, match="0.97 x best"):
        check_controller(lambda t: mutant(MAX_K, t, interval=1, seed=1), costs, HIGH, schedule)


FAST, SLOW = [0.97] * MAX_K, [0.7] + [0.2] * (MAX_K - 1)


def static_batch_ms(policy, c_per_seq, tokens=200, seed=0):
    """Decode a static batch at batch size 4 until its last sequence is done: every sequence needs
    `tokens` tokens, sequence i accepts draft j with probability c_per_seq[i][j-1] given drafts 1..j-1
    were, and a cycle at k costs 1 + 0.15 k ms whatever its live rows. The policy sees the measured
    costs, its cycles' accepted counts and times, and each live sequence's tokens left and counts.
    Returns the total ms."""
    cost = [1.0 + 0.15 * k for k in range(MAX_K + 1)]
    for k in range(MAX_K + 1):
        policy.observe_cost(4, k, cost[k])                  # the setup measurement an engine makes
    rng, n = random.Random(seed), len(c_per_seq)
    left, counts, ms, k = [tokens] * n, [AcceptanceCounts(MAX_K) for _ in range(n)], 0.0, None
    while any(left):
        live = [i for i in range(n) if left[i]]
        k = policy.choose(len(live), 4, max(left), k, None, [(left[i], counts[i]) for i in live])
        accepted = []
        for i in live:
            a = 0
            while a < k and rng.random() < c_per_seq[i][a]:
                a += 1
            left[i] = max(0, left[i] - a - 1)
            counts[i].observe(k, [a])
            accepted.append(a)
        policy.observe(k, accepted)
        policy.observe_cost(4, k, cost[k])
        ms += cost[k]
    return ms


def test_a_batch_that_ends_with_its_slowest_sequence_runs_at_the_slowest_ones_best_k():
    """Three sequences accept nearly every draft, one rejects its second draft most of the time. The
    batch's tokens per ms favour k = 8, but the batch ends with the slow sequence, which gains little
    past k = 1. Over three seeds, the controller's total time (learning as it goes) is within 5 % of the
    best fixed k's, found by simulating every fixed k; a controller that maximizes the batch's tokens
    per ms is not."""
    batch, seeds = [FAST, FAST, FAST, SLOW], range(3)

    def mean_ms(make):
        return sum(static_batch_ms(make(seed), batch, seed=seed) for seed in seeds) / len(seeds)

    fixed = {k: mean_ms(lambda seed, k=k: FixedDepth(k)) for k in range(MAX_K + 1)}
    best = min(fixed.values())
    assert min(fixed, key=fixed.get) in (1, 2) and fixed[8] > 1.4 * best        # the world is as described
    auto = mean_ms(lambda seed: AdaptiveDepth(MAX_K, interval=1, seed=seed))
    assert auto <= 1.05 * best, f"auto took {auto:.1f} ms, the best fixed k {best:.1f} ms"
    wrong = mean_ms(lambda seed: IgnoresTheSlowest(MAX_K, interval=1, seed=seed))
    assert wrong > 1.2 * best, f"the batch-rate controller took {wrong:.1f} ms, the best fixed k {best:.1f} ms"


def test_a_finishing_batch_holds_its_k_until_every_sequence_has_shown_itself():
    """With sequences whose own counts are fewer than `interval` cycles, the current k holds (the batch's
    counts alone would pick the average sequence's k); with their counts, the controller decides."""
    costs = CycleCosts()
    for k in range(MAX_K + 1):
        costs.add(costs.cycles, (4, k), 1.0 + 0.5 * k)
    policy = AdaptiveDepth(MAX_K, costs, interval=4)
    policy.acceptance.accepted = [1e3] * MAX_K                 # the batch accepts everything: k = 8 pays
    fresh = [(100, AcceptanceCounts(MAX_K)) for _ in range(4)]
    assert policy.choose(4, 4, 100, 2, None, fresh) == 2
    slow = AcceptanceCounts(MAX_K)
    slow.observe(2, [1] * 4)                                  # one sequence rejects its second draft
    shown = [(100, c) for c in (AcceptanceCounts(MAX_K, accepted=[4.0, 4.0] + [0.0] * (MAX_K - 2)),) * 3]
    assert policy.choose(4, 4, 100, 2, None, shown + [(100, slow)]) < 2
    batch_rate = AdaptiveDepth(MAX_K, costs, interval=4, acceptance=policy.acceptance)
    assert batch_rate.choose(4, 4, 100, 2, None, None) == MAX_K   # no sequences: the batch's rate


def test_a_switch_pays_its_catch_up_once():
    """A catch-up costing many cycles keeps the current k when the sequences are about to end, and is
    taken when they have far to go."""
    costs = CycleCosts()
    for k in range(5):
        costs.add(costs.cycles, (1, k), 1.0 + 0.1 * k)
    costs.add(costs.catchup, (1, 4, 1), 0.5)                 # one row measured: 0.5 ms per row
    policy = AdaptiveDepth(4, costs, interval=8)
    policy.acceptance.accepted = [1e3] * 4                   # drafts all but certain: k = 4 is best
    rows = {4: 40}                                          # 40 rows to catch up: 20 ms
    assert policy.rates(1, 1, 4, 1, policy.conditional(False), rows)[4] < \
        policy.rates(1, 1, 4, 1, policy.conditional(False), rows)[1]
    assert max(policy.rates(1, 1, 10_000, 1, policy.conditional(False), {4: 2}).items(), key=lambda kv: kv[1])[0] == 4


def test_cost_estimates_follow_measurements():
    t = CycleCosts()
    assert t.cycle_ms(1, 3) is None
    t.add(t.cycles, (4, 0), 2.0)
    t.add(t.cycles, (4, 2), 4.0)
    assert t.cycle_ms(4, 1) == pytest.approx(3.0) and t.cycle_ms(4, 4) == pytest.approx(6.0)
    t.add(t.cycles, (16, 1), 10.0)                           # one k here: the slope of batch 4
    assert t.cycle_ms(16, 3) == pytest.approx(12.0)
    for _ in range(50):
        t.add(t.cycles, (4, 0), 3.0)                          # a running mean that follows new measurements
    assert t.cycle_ms(4, 0) == pytest.approx(3.0, abs=1e-3)
    assert t.catchup_ms(4, 2, 6) == pytest.approx((4.0 - 3.0) / 3 * 6, rel=1e-3)   # none measured: the draft part
    t.add(t.catchup, (4, 2, 8), 0.5)                          # measured passes: a fixed part and a part per row
    t.add(t.catchup, (4, 2, 128), 2.0)
    assert t.catchup_ms(4, 2, 68) == pytest.approx(1.25) and t.catchup_ms(4, 2, 1) == pytest.approx(0.5)
    assert t.catchup_ms(4, 3, 6) == pytest.approx((t.cycle_ms(4, 3) - t.cycle_ms(4, 0)) / 4 * 6)   # at k = 3: none


def test_an_unseen_position_is_expected_to_accept_like_the_one_before():
    """The posterior mean of a position never reached is that of the position before; a reached one
    follows its own counts; the counts fade to `memory` observations and can be shared between policies."""
    acc = AcceptanceCounts(4, memory=50)
    policy = AdaptiveDepth(4, acceptance=acc)
    assert policy.conditional(draw=False) == pytest.approx([0.8] * 4)
    policy.observe(2, [2] * 95 + [0] * 5)                    # positions 1 and 2 accepted 95 %, 100 %
    c = policy.conditional(draw=False)
    assert c[0] == pytest.approx((4 + 47.5) / (5 + 50)) and c[1] > c[0]
    assert c[2] == pytest.approx(c[1]) and c[3] == pytest.approx(c[1])
    assert acc.accepted[0] + acc.rejected[0] == pytest.approx(50)
    assert AdaptiveDepth(4, acceptance=acc).conditional(draw=False) == pytest.approx(c)
    with pytest.raises(ValueError, match="acceptance counts for 4 positions"):
        AdaptiveDepth(3, acceptance=acc)
    with pytest.raises(ValueError, match="one count per position 1..4, got 3 and 4"):
        AcceptanceCounts(4, accepted=[1.0] * 3)


def test_the_first_decision_takes_the_means():
    """The k of a request's first cycle (and of its prefill passes) does not depend on the random draws."""
    costs = CycleCosts()
    for k in range(MAX_K + 1):
        costs.add(costs.cycles, (4, k), 1.0 + 0.1 * k)
    firsts = {AdaptiveDepth(MAX_K, costs, seed=seed).choose(4, 4, 1000, None) for seed in range(20)}
    later = {AdaptiveDepth(MAX_K, costs, seed=seed, interval=0).choose(4, 4, 1000, 8) for seed in range(20)}
    assert len(firsts) == 1 and len(later) > 1


def test_policies_and_their_checks():
    assert depth_policy(3, 8) == FixedDepth(3) and isinstance(depth_policy("auto", 8), AdaptiveDepth)
    s = ScriptedDepths([1, 4])
    assert [s.choose(1, 1, 9, None) for _ in range(4)] == [1, 4, 4, 4] and s.max_k == 4
    with pytest.raises(ValueError, match="ScriptedDepths"):
        ScriptedDepths([])
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveDepth(-1)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(num_mtp_depths=4, mtp_layer_types=["sliding", "global", "sliding", "sliding"])
    return random_model(cfg, seed=5, dtype=torch.float64)


def test_reference_generate_with_changing_k_is_lossless(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = generate(model, prompt, 30, 0)
    for script in ([1] * 8 + [4] * 5, [4, 0, 2, 4, 1, 3, 0, 4]):
        got = generate(model, prompt, 30, ScriptedDepths(list(script)))
        assert got.token_ids == plain.token_ids
        assert [c.planned for c in got.cycles[0]][: len(script)] == script[: len(got.cycles[0])]
    auto = generate(model, prompt, 30, "auto")
    assert auto.token_ids == plain.token_ids
    assert sum(auto.stats.k_used.values()) == len(auto.cycles[0])
    by_k = auto.stats.by_k(auto.cycles[0])
    assert set(by_k) == set(auto.stats.k_used)
