"""The MTP cost model (inkling_fast/cost_model.py) on synthetic measurement dicts built here.

Every expected value is computed independently of the module: by enumeration, Monte Carlo, the
reference model's parameter count, or arithmetic written out by hand."""

import itertools
import math
import random

import pytest

from inkling_fast import cost_model as cm
from inkling_ref import InklingConfig, random_model

# ---------------------------------------------------------------- a synthetic engine.json

TINY = dict(num_layers=3, layer_types=["sliding", "sliding", "global"], mlp_types=["dense", "moe", "moe"])
BATCHES, TS = (1, 4), (1, 2, 3)


def layer_ms(kind, B, T):
    base = {"sliding_dense": 1.0 + 0.5 * (T - 1), "sliding_moe": 2.0 * T, "global_moe": 3.0 + T}[kind]
    return base * (1 + 0.1 * (B - 1))                   # linear in B: interpolation in B is exact


def engine(**drop):
    rows = [dict(kind=k, batch=B, T=T, ms=layer_ms(k, B, T))
            for k in ("sliding_dense", "sliding_moe", "global_moe") for B in BATCHES for T in TS]
    rows += [dict(kind="lm_head_argmax", batch=B, T=T, ms=0.5 + 0.01 * B * T) for B in BATCHES for T in TS]
    steps = [dict(batch=B, rows=r, ms=0.2 + 0.05 * r) for B in BATCHES for r in TS]
    split = [dict(batch=1, k=1, cycle_ms=2.0, draft_ms=0.5, verify_ms=1.4, accept_commit_ms=0.1),
             dict(batch=4, k=1, cycle_ms=2.0, draft_ms=0.5, verify_ms=1.0, accept_commit_ms=0.5),
             dict(batch=1, k=2, cycle_ms=2.5, draft_ms=0.9, verify_ms=1.4, accept_commit_ms=0.2),
             dict(batch=4, k=2, cycle_ms=2.5, draft_ms=0.9, verify_ms=1.4, accept_commit_ms=0.2)]
    e = {"copy_gbps": 4000.0,
         "layers": {"context": 4096, "rows": rows},
         "mtp_head": {"context": 4096, "depth_step": steps,
                      "chain": [dict(batch=1, k=2, a=0, graph_ms=0.9, steps_sum_ms=0.8)]},
         "demo": {"new_tokens": 9, "cycle_split": split, "end_to_end": []}}
    for path in drop:
        *head, last = path.split("__")
        node = e
        for key in head:
            node = node[key]
        del node[last]
    return e


CURVES = {1: [0.8], 2: [0.8, 0.6]}


# ---------------------------------------------------------------- acceptance

def enumerate_tokens_per_cycle(cond):
    """E[a + 1] and P(a = j) by enumerating every outcome of k independent draft checks (check j passes
    with probability cond[j]); a = the number of leading passes."""
    k = len(cond)
    mean, pmf = 0.0, [0.0] * (k + 1)
    for bits in itertools.product((0, 1), repeat=k):
        p = math.prod(c if b else 1 - c for b, c in zip(bits, cond))
        a = next((j for j, b in enumerate(bits) if not b), k)
        mean += p * (a + 1)
        pmf[a] += p
    return mean, pmf


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_acceptance_length_and_pmf_match_enumeration(k):
    rng = random.Random(k)
    cond = [rng.uniform(0.3, 0.98) for _ in range(k)]
    per_position = [math.prod(cond[: j + 1]) for j in range(k)]       # P(first j accepted)
    mean, pmf = enumerate_tokens_per_cycle(cond)
    assert cm.acceptance_length(per_position) == pytest.approx(mean, rel=1e-12)
    assert cm.accepted_pmf(per_position) == pytest.approx(pmf, abs=1e-12)
    # judging only the first k_eff drafts: the enumeration over those k_eff checks
    for k_eff in range(k + 1):
        _, pmf_eff = enumerate_tokens_per_cycle(cond[:k_eff])
        assert cm.accepted_pmf(per_position, k_eff) == pytest.approx(pmf_eff, abs=1e-12)


def test_per_position_checks():
    with pytest.raises(ValueError, match="increases at position 2"):
        cm.acceptance_length([0.7, 0.9])                              # a conditional curve
    with pytest.raises(ValueError, match=r"\[1\] = 1.2"):
        cm.acceptance_length([1.0, 1.2])
    assert cm.acceptance_length([]) == 1.0


def test_load_acceptance_and_prefix_rule():
    acc = {"runs": {"greedy": {"2": {"per_position": [0.9, 0.7]},
                               "4": {"per_position": [0.8, 0.6, 0.5, 0.3]}}}}
    curves = cm.load_acceptance(acc)
    assert cm.per_position_for_k(curves, 2) == ([0.9, 0.7], "measured")
    assert cm.per_position_for_k(curves, 3) == ([0.8, 0.6, 0.5], "prefix of k=4")
    assert cm.per_position_for_k(curves, 0) == ([], "no drafts")
    with pytest.raises(ValueError, match="k = 5: the deepest measured is k = 4"):
        cm.per_position_for_k(curves, 5)
    with pytest.raises(ValueError, match="no run 'sampled'"):
        cm.load_acceptance(acc, run="sampled")
    with pytest.raises(ValueError, match="runs.greedy.2 lacks 'per_position'"):
        cm.load_acceptance({"runs": {"greedy": {"2": {"acceptance_length": 2.0}}}})
    with pytest.raises(ValueError, match="has 1 entries, expected 2"):
        cm.load_acceptance({"runs": {"greedy": {"2": {"per_position": [0.5]}}}})


# ---------------------------------------------------------------- interpolation and validation

def test_grid_exact_at_points_and_linear_between():
    f = lambda b, t: b ** 2 + 3 * t ** 3 + b * t                     # noqa: E731  (not bilinear)
    bs, ts = (1, 2, 4, 8), (1, 3, 5)
    g = cm.Grid2D({(b, t): f(b, t) for b in bs for t in ts}, "test", ("batch", "T"))
    for b in bs:
        for t in ts:
            assert g(b, t) == f(b, t)
    assert g(6, 3) == pytest.approx((f(4, 3) + f(8, 3)) / 2)         # linear in batch at a measured T
    assert g(3, 5) == pytest.approx(0.5 * f(2, 5) + 0.5 * f(4, 5))
    assert g(4, 2) == pytest.approx((f(4, 1) + f(4, 3)) / 2)         # linear in T at a measured batch
    bil = lambda b, t: 2 + 3 * b + 5 * t + 0.5 * b * t                # noqa: E731  bilinear: exact anywhere
    h = cm.Grid2D({(b, t): bil(b, t) for b in bs for t in ts}, "test", ("batch", "T"))
    for b, t in ((1.5, 2.0), (5.0, 4.2), (7.9, 1.1)):
        assert h(b, t) == pytest.approx(bil(b, t), rel=1e-12)
    with pytest.raises(ValueError, match=r"batch = 16 is outside the measured batch range 1..8"):
        g(16, 1)
    with pytest.raises(ValueError, match=r"T = 0.5 is outside"):
        g(1, 0.5)


def test_missing_grid_points_and_keys_are_named():
    e = engine()
    e["layers"]["rows"] = [r for r in e["layers"]["rows"]
                           if not (r["kind"] == "global_moe" and r["batch"] == 4 and r["T"] == 2)]
    with pytest.raises(ValueError, match=r"kind 'global_moe'.*missing \(batch, T\) = \(4, 2\)"):
        cm.Costs(e)
    with pytest.raises(ValueError, match="engine.json lacks 'layers'"):
        cm.Costs(engine(layers=1))
    with pytest.raises(ValueError, match="engine.json.mtp_head lacks 'depth_step'"):
        cm.Costs(engine(mtp_head__depth_step=1))
    e = engine()
    del e["layers"]["rows"][5]["ms"]
    with pytest.raises(ValueError, match=r"layers.rows\[5\] lacks 'ms'"):
        cm.Costs(e)
    e = engine()
    e["mtp_head"]["depth_step"][0]["ms"] = -1.0
    with pytest.raises(ValueError, match=r"depth_step\[0\].ms = -1.0"):
        cm.Costs(e)
    e = engine()
    e["mtp_head"]["depth_step"].append(dict(e["mtp_head"]["depth_step"][0]))
    with pytest.raises(ValueError, match=r"two rows at \(batch, rows\) = \(1, 1\)"):
        cm.Costs(e)
    e = engine()
    e["demo"]["cycle_split"][2]["accept_commit_ms"] = None
    with pytest.raises(ValueError, match=r"cycle_split\[2\].accept_commit_ms = None"):
        cm.Costs(e)
    costs = cm.Costs(engine())
    with pytest.raises(ValueError, match="mtp_head.depth_step: batch = 8 is outside"):
        cm.t_draft(costs, 8, 1)
    with pytest.raises(ValueError, match="has no kind 'global_dense'"):
        cm.t_verify(costs, dict(TINY, layer_types=["global"] * 3), 1, 0)


def test_lm_head_rows_with_one_product_are_averaged():
    e = engine()
    for r in e["layers"]["rows"]:
        if r["kind"] == "lm_head_argmax" and r["batch"] * r["T"] == 4:   # (4, 1): the only 4-row one
            r["ms"] = 1.0
    e["layers"]["rows"].append(dict(kind="lm_head_argmax", batch=2, T=2, ms=2.0))
    assert cm.Costs(e).lm_head_ms(4) == pytest.approx(1.5)


# ---------------------------------------------------------------- the cycle, by hand

def test_speedup_on_a_synthetic_table_by_hand():
    costs = cm.Costs(engine())
    assert costs.accept_ms == 0.2                                      # median of 0.1, 0.5, 0.2, 0.2
    # B = 1, k = 0: dense 1.0 + moe 2.0 + global 4.0 + LM head (1 row) 0.51
    assert cm.cycle_parts(costs, TINY, 1, 0) == pytest.approx(dict(verify=7.51, draft=0.0, accept=0.0, cycle=7.51))
    # B = 1, k = 2 (T = 3): 2.0 + 6.0 + 6.0 + LM head (3 rows) 0.53; draft 2 * (0.2 + 0.15); accept 0.2
    assert cm.cycle_parts(costs, TINY, 1, 2) == pytest.approx(dict(verify=14.53, draft=0.7, accept=0.2, cycle=15.43))
    assert cm.tokens_per_s(costs, TINY, 1, 2, [0.8, 0.6]) == pytest.approx(2.4 / 15.43e-3)
    assert cm.speedup(costs, TINY, 1, 2, [0.8, 0.6]) == pytest.approx(2.4 * 7.51 / 15.43)
    # B = 2 (between the measured 1 and 4): layers x 1.1, LM head over 2 and 6 rows, draft as at B = 1
    k0 = (1.0 + 2.0 + 4.0) * 1.1 + 0.52
    k2 = (2.0 + 6.0 + 6.0) * 1.1 + 0.56 + 0.7 + 0.2
    assert cm.tokens_per_s(costs, TINY, 2, 0, []) == pytest.approx(2 / (k0 * 1e-3))
    assert cm.speedup(costs, TINY, 2, 2, [0.8, 0.6]) == pytest.approx(2.4 * k0 / k2)
    with pytest.raises(ValueError, match="per_position has 1 entries but k = 2"):
        cm.tokens_per_s(costs, TINY, 1, 2, [0.8])


def test_recommend_k_on_constructed_cases():
    costs = cm.Costs(engine())
    # cycles at B = 1: k=0 7.51, k=1 (1.5 + 4 + 5 + 0.52) + 0.3 + 0.2 = 11.52, k=2 15.43 ms
    # tokens per ms: k=0 1/7.51 = 0.1332, k=1 1.8/11.52 = 0.1563, k=2 2.4/15.43 = 0.1555 -> k = 1
    assert cm.recommend_k(costs, TINY, 1, CURVES, ks=[0, 1, 2]) == 1
    # a better second draft: k=2 2.5/15.43 = 0.1620 -> k = 2
    assert cm.recommend_k(costs, TINY, 1, {1: [0.8], 2: [0.8, 0.7]}, ks=[0, 1, 2]) == 2
    # poor drafts: k=1 1.1/11.52 = 0.0955, k=2 1.15/15.43 = 0.0745 < 0.1332 -> no MTP
    assert cm.recommend_k(costs, TINY, 1, {1: [0.1], 2: [0.1, 0.05]}, ks=[0, 1, 2]) == 0
    assert costs.measured_ks() == [1, 2]
    assert cm.recommend_k(costs, TINY, 1, CURVES) == 1                 # default ks: 0 + measured


def test_chain_check():
    (row,) = cm.chain_check(cm.Costs(engine()), engine())
    assert row["model_ms"] == pytest.approx(2 * (0.2 + 0.05 * 3))
    assert row["graph_over_model"] == pytest.approx(0.9 / 0.7)


# ---------------------------------------------------------------- Inkling-Small's shape and bytes

def test_inkling_small_layer_counts():
    cfg = cm.inkling_small_config()
    InklingConfig(**cfg)                                               # a valid reference config
    assert cm.trunk_layer_counts(cfg) == {"sliding_dense": 2, "sliding_moe": 33, "global_moe": 7}
    kinds = cm.trunk_layer_kinds(cfg)
    assert [i for i, k in enumerate(kinds) if k.startswith("global")] == [5, 11, 17, 23, 29, 35, 41]
    assert [d for d, t in enumerate(cfg["mtp_layer_types"]) if t == "global"] == [1, 3]


def test_layer_weight_elements_match_the_reference_model():
    cfg = dict(vocab_size=64, unpadded_vocab_size=61, hidden_size=40, num_layers=3, num_heads=4, num_kv_heads=2,
               head_dim=8, rel_extent=16, swa_num_heads=4, swa_num_kv_heads=1, swa_head_dim=8, sliding_window=8,
               d_rel=4, layer_types=["sliding", "global", "sliding"], mlp_types=["dense", "moe", "moe"],
               dense_intermediate_size=36, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
               n_shared_experts=1, max_position_embeddings=128, num_mtp_depths=2, mtp_layer_types=["sliding", "global"])
    cfg = InklingConfig(**cfg)                        # the model reads the config object's attributes
    model = random_model(cfg, seed=0)
    count = lambda m: sum(p.numel() for p in m.parameters())          # noqa: E731
    for i, kind in enumerate(cm.trunk_layer_kinds(cfg)):
        assert cm.layer_weight_elements(kind, cfg) == count(model.trunk.layers[i]), kind
    assert cm.layer_weight_elements("mtp_sliding", cfg) == count(model.mtp.depths[0])
    assert cm.layer_weight_elements("mtp_global", cfg) == count(model.mtp.depths[1])
    with pytest.raises(ValueError, match="kind 'lm_head_argmax' is not a trunk kind"):
        cm.layer_weight_elements("lm_head_argmax", cfg)
    # one token reads top_k + shared experts: all parameters minus the (R - top_k) untouched experts
    expert = 3 * 16 * 40
    assert cm.layer_weight_elements("sliding_moe", cfg, 1) == pytest.approx(count(model.trunk.layers[2]) - 6 * expert)


@pytest.mark.parametrize("n_tokens", [1, 2, 9, 64])
def test_distinct_experts_against_monte_carlo(n_tokens):
    rng, trials = random.Random(n_tokens), 3000
    draws = [len({e for _ in range(n_tokens) for e in rng.sample(range(256), 6)}) for _ in range(trials)]
    mean = sum(draws) / trials
    sd = (sum((d - mean) ** 2 for d in draws) / (trials - 1)) ** 0.5
    assert abs(mean - cm.expected_distinct_experts(n_tokens)) <= 4 * max(sd, 1e-9) / trials ** 0.5 + 1e-9


def test_kv_bytes():
    cfg = cm.inkling_small_config()
    # sliding: the window's 512 keys (+ T - 1 for the later queries); global: the whole context + T
    assert cm.kv_bytes("sliding", cfg, 2, 1, 4096) == 2 * 512 * 8 * 128 * 2 * 2
    assert cm.kv_bytes("sliding", cfg, 1, 9, 4096) == 520 * 8 * 128 * 2 * 2
    assert cm.kv_bytes("sliding", cfg, 1, 9, 100) == 109 * 8 * 128 * 2 * 2
    assert cm.kv_bytes("global", cfg, 3, 9, 4096) == 3 * 4105 * 8 * 128 * 2 * 2


# ---------------------------------------------------------------- the demo check

def demo_engine(rate_scale=1.0, host_ms=0.1):
    """cycle_split at B = 1, 4 and k = 0, 1, 2 (cycle_ms 1.0 / 2.0 / 2.5) and the engine's steady rates
    made to follow B * L / cycle exactly (rate_scale 1), with L per k."""
    e = engine()
    cyc = {0: 1.0, 1: 2.0, 2: 2.5}
    e["demo"]["cycle_split"] = [dict(batch=B, k=k, cycle_ms=c, accept_commit_ms=0.02) for B in (1, 4)
                                for k, c in cyc.items()]
    e2e = []
    for B in (1, 4):
        for k, L in ((0, 1.0), (1, 1.8), (2, 2.4)):
            rate = (rate_scale if k else 1.0) * B * L / (cyc[k] * 1e-3)
            e2e.append(dict(engine="fast_graphs", batch=B, k=k, new_tokens=9, tokens_per_s=1.0,
                            steady_tokens_per_s=rate, steady_acceptance_length=L,
                            steady_ms_per_cycle=cyc[k] + host_ms))
    e2e.append(dict(engine="fast_eager", batch=1, k=1, new_tokens=9, tokens_per_s=1.0))   # other engines: ignored
    e["demo"]["end_to_end"] = e2e
    return e


def test_demo_validation():
    rows = cm.demo_validation(demo_engine(), CURVES)
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for r in rows:                                   # measured = the formula: zero error
        assert r["err"] == pytest.approx(0.0, abs=1e-12)
        assert r["speedup_measured"] == pytest.approx(r["L_engine"] * 1.0 / r["cycle_ms"])
        assert r["basis"] == "steady" and r["host_ms"] == pytest.approx(0.1)
        # the curve's L instead of the engine's: the error is the ratio of the two
        assert r["err_curve"] == pytest.approx(r["L_curve"] / r["L_engine"] - 1)
    rows = cm.demo_validation(demo_engine(rate_scale=0.8), CURVES)
    assert all(r["err"] == pytest.approx(0.25) for r in rows)
    e = demo_engine()
    e["demo"]["end_to_end"] = [r for r in e["demo"]["end_to_end"] if not (r["batch"] == 4 and r["k"] == 0)]
    with pytest.raises(ValueError, match=r"no 'fast_graphs' row at \(batch, k\) = \(4, 0\)"):
        cm.demo_validation(e, CURVES)
    e = demo_engine()
    del e["demo"]["end_to_end"][1]["steady_acceptance_length"]
    with pytest.raises(ValueError, match="steady_acceptance_length"):
        cm.demo_validation(e, CURVES)


def test_demo_validation_with_a_host_term():
    """Rates that follow B * L / (cycle + h): the device-only formula is off by the host share, the
    formula with host_ms = h is exact, and host_overhead_ms recovers h (the median wall - device gap)."""
    h = 0.5
    e = demo_engine(host_ms=h)
    cyc = {0: 1.0, 1: 2.0, 2: 2.5}
    for r in e["demo"]["end_to_end"]:
        if r["engine"] == "fast_graphs":
            r["steady_tokens_per_s"] = r["batch"] * r["steady_acceptance_length"] / ((cyc[r["k"]] + h) * 1e-3)
    assert cm.host_overhead_ms(e) == pytest.approx(h)
    exact = cm.demo_validation(e, CURVES, host_ms=cm.host_overhead_ms(e))
    device_only = cm.demo_validation(e, CURVES)
    for r, d in zip(exact, device_only):
        assert r["err"] == pytest.approx(0.0, abs=1e-12) and r["host_term_ms"] == h
        k = r["k"]   # device only: L c0 / ck against L (c0 + h) / (ck + h)
        assert d["err"] == pytest.approx((cyc[0] / cyc[k]) / ((cyc[0] + h) / (cyc[k] + h)) - 1)
        assert abs(d["err"]) > 0.05
    with pytest.raises(ValueError, match="host_ms"):
        cm.demo_validation(e, CURVES, host_ms=-1.0)
    old = demo_engine()
    for r in old["demo"]["end_to_end"]:
        r.pop("steady_ms_per_cycle", None)
    assert cm.host_overhead_ms(old) is None
    hidden = demo_engine(host_ms=-0.05)   # an overlapped loop: wall per cycle below the captured cycle
    assert cm.host_overhead_ms(hidden) == 0.0


def test_demo_validation_from_decode_rates_without_a_k0_cycle():
    """Older runs: no steady fields (decode_tokens_per_s and acceptance_length instead) and no k = 0 in
    the split: the prediction is B * L / cycle_ms(k) over the measured k = 0 rate."""
    e = demo_engine()
    e["demo"]["cycle_split"] = [r for r in e["demo"]["cycle_split"] if r["k"] > 0]
    for r in e["demo"]["end_to_end"]:
        if r["engine"] == "fast_graphs":
            r["decode_tokens_per_s"] = 0.9 * r.pop("steady_tokens_per_s")  # 10 % host overhead on every rate
            r["acceptance_length"] = r.pop("steady_acceptance_length")
            del r["steady_ms_per_cycle"]
    rows = cm.demo_validation(e, CURVES)
    assert [(r["batch"], r["k"]) for r in rows] == [(1, 1), (1, 2), (4, 1), (4, 2)]
    for r in rows:   # predicted rate B L / cycle is 1/0.9 of the measured one; measured k = 0 divides both
        assert r["basis"] == "decode" and r["host_ms"] is None and r["cycle0_ms"] is None
        assert r["err"] == pytest.approx(1 / 0.9 - 1)
        assert r["speedup"] == pytest.approx(r["L_engine"] / r["cycle_ms"] / 0.9)
    del e["demo"]["end_to_end"][0]["decode_tokens_per_s"]
    with pytest.raises(ValueError, match="decode_tokens_per_s"):
        cm.demo_validation(e, CURVES)


def test_true_width_inputs_rebuild_the_runs_model():
    """The committed true-width run: the model rebuilt from its JSON through `true_width_inputs` and
    `true_width_slice` gives, at every (batch, k), the cycle the benchmark stored when it ran; the
    accept term is the median accept + commit of the split (k > 0), and a run without a split asks for
    one."""
    import json
    import statistics
    from pathlib import Path

    run = json.loads((Path(__file__).resolve().parents[1] / "docs/benchmarks/true_width.json").read_text())
    costs, cfg = cm.Costs(cm.true_width_inputs(run)), cm.true_width_slice(run)
    assert cfg["num_layers"] == len(cfg["layer_types"]) == len(cfg["mlp_types"]) == len(run["slice"]["layers"])
    assert costs.accept_ms == max(0.0, statistics.median(r["accept_commit_ms"] for r in run["split"] if r["k"] > 0))
    for row in run["model"]["rows"]:
        assert cm.cycle_parts(costs, cfg, row["batch"], row["k"]) == pytest.approx(row["model"], rel=1e-12)
    assert cm.Costs(cm.true_width_inputs(run, accept_commit_ms=0.25)).accept_ms == 0.25
    with pytest.raises(cm.CostModelError, match="no cycle split"):
        cm.true_width_inputs(dict(run, split=[]))
