"""The tree extension of the cost model (inkling_fast/cost_model.py, 'tree drafts'), on the synthetic
engine.json of tests/test_cost_model.py. Expected values are worked out by hand below, or are the
chain model's own numbers (a chain is a tree with one node per level)."""

import json
from pathlib import Path

import pytest
from test_cost_model import TINY, engine

from inkling_fast import cost_model as cm

ROOT = Path(__file__).resolve().parents[1]


def tree_engine():
    """The synthetic table with dearer depth steps (0.7 + 0.05 rows ms), so that a step costs more
    than the argmax it includes (lm_head_argmax = 0.5 + 0.01 rows)."""
    e = engine()
    for s in e["mtp_head"]["depth_step"]:
        s["ms"] += 0.5
    return e


def chain_run(k, tau=2.0):
    return dict(name=f"chain k={k}", kind="chain", nodes=k, depth=k, acceptance_length=tau,
                draft_tree_rows=list(range(k)), draft_heads=[1] * k)


def run(name, nodes, tree_rows, heads, tau, kind="tree"):
    return dict(name=name, kind=kind, nodes=nodes, depth=len(tree_rows), acceptance_length=tau,
                draft_tree_rows=tree_rows, draft_heads=heads)


@pytest.mark.parametrize("B", [1, 2, 3.5, 4])
@pytest.mark.parametrize("k", [1, 2])
def test_a_chain_costs_what_the_chain_model_says(B, k):
    costs = cm.Costs(tree_engine())
    got = cm.tree_cycle_parts(costs, TINY, B, chain_run(k))
    want = cm.cycle_parts(costs, TINY, B, k)
    assert got == pytest.approx(want, rel=1e-12)
    assert cm.tree_tokens_per_s(costs, TINY, B, chain_run(k, 1.7)) == pytest.approx(
        cm.tokens_per_s(costs, TINY, B, k, [0.7] + [0.0] * (k - 1)), rel=1e-12)


def test_tree_cycle_by_hand():
    costs = cm.Costs(tree_engine())
    # branching [2]: 2 nodes, T = 3 (measured): dense 2.0 + moe 6.0 + global 6.0 + LM head (3 rows) 0.53;
    # depth 0 over 2 rows: step 0.2 + 0.1 + 0.5 = 0.8, less its argmax 0.51, plus the argmax of 1 row 0.51
    two = run("tree [2]", 2, [0], [1], 1.5)
    assert cm.tree_cycle_parts(costs, TINY, 1, two) == pytest.approx(
        dict(verify=14.53, draft=0.8, accept=0.2, cycle=15.53))
    # branching [2, 1]: 4 nodes, T = 5 > 3 measured: as B' = 5/3 sequences of 3 tokens; the layers grow by
    # 1 + 0.1 (B' - 1) = 16/15 in B; LM head over 5 rows: between 4 (0.54) and 8 (0.58) rows = 0.55
    verify = (2.0 + 6.0 + 6.0) * 16 / 15 + 0.55
    # depth 0: rows 2 + 1 = 3: 0.85 - 0.51 + 0.51 (one node expanded)
    # depth 1: rows 1 + 1 + 2 tree rows = 4 > 3: as B' = 4/3 x 3 rows: 0.85 less the argmax of 4/3 rows
    #          (0.51 + 0.01 / 3), plus the argmax of the 2 expanded nodes (0.52)
    draft = 0.85 + (0.85 - (0.51 + 0.01 / 3) + 0.52)
    parts = cm.tree_cycle_parts(costs, TINY, 1, run("tree [2, 1]", 4, [0, 2], [1, 2], 2.2))
    assert parts == pytest.approx(dict(verify=verify, draft=draft, accept=0.2, cycle=verify + draft + 0.2))
    assert cm.tree_tokens_per_s(costs, TINY, 1, run("t", 4, [0, 2], [1, 2], 2.2)) == pytest.approx(
        2.2 / ((verify + draft + 0.2) * 1e-3))


def test_beyond_the_measurements_it_raises():
    costs = cm.Costs(tree_engine())
    big = run("tree [4, 4]", 20, [0, 4], [1, 4], 2.5)        # T = 21: B' = 7 at B = 1, beyond batch 4
    with pytest.raises(ValueError, match=r"batch = 7.0 is outside the measured batch range 1..4"):
        cm.tree_cycle_parts(costs, TINY, 1, big)
    e = tree_engine()
    for s in e["mtp_head"]["depth_step"]:
        s["ms"] -= 0.5                                          # steps cheaper than their own argmax
    with pytest.raises(ValueError, match="is not above the LM-head argmax"):
        cm.tree_cycle_parts(cm.Costs(e), TINY, 1, run("tree [2]", 2, [0], [1], 1.5))


def test_compare_trees_picks_by_tokens_per_s():
    costs = cm.Costs(tree_engine())
    runs = [chain_run(1, 1.8), chain_run(2, 2.4), run("tree [2]", 2, [0], [1], 1.95),
            run("tree [2, 1]", 4, [0, 2], [1, 2], 3.0), run("tree [4, 4]", 20, [0, 4], [1, 4], 3.9),
            run("in-sample 2", 2, [0], [1], 1.99, kind="in-sample"),
            run("grown 2, a chain", 2, [0, 1], [1, 1], 2.9, kind="grown")]
    rows = cm.compare_trees(costs, TINY, [1], runs)
    (r,) = rows
    rate = {x["name"]: cm.tree_tokens_per_s(costs, TINY, 1, x) for x in runs[:4]}
    best_chain = max(("chain k=1", "chain k=2"), key=rate.get)
    best_tree = max(("tree [2]", "tree [2, 1]"), key=rate.get)
    assert (r["chain"], r["tree"], r["not_predicted"]) == (best_chain, best_tree, ["tree [4, 4]"])
    assert r["tree_gain"] == pytest.approx(rate[best_tree] / rate[best_chain] - 1)
    assert r["chain_speedup"] == pytest.approx(rate[best_chain] / cm.tokens_per_s(costs, TINY, 1, 0, []))


def test_bad_runs_are_named():
    with pytest.raises(ValueError, match=r"runs\[0\] \(x\) lacks 'draft_heads'"):
        cm.load_tree_acceptance({"runs": [dict(name="x", kind="tree", nodes=2, depth=1, acceptance_length=1.5,
                                               draft_tree_rows=[0])]})
    with pytest.raises(ValueError, match=r"draft_tree_rows = \[0\]: expected 2 non-negative integers"):
        cm.check_tree_run(run("x", 3, [0], [1, 1], 1.5) | dict(depth=2))
    with pytest.raises(ValueError, match=r"acceptance_length = 3.5: must lie in 1..depth \+ 1 = 2"):
        cm.check_tree_run(run("x", 2, [0], [1], 3.5))
    with pytest.raises(ValueError, match="lacks a non-empty 'runs' list"):
        cm.load_tree_acceptance({"runs": []})


def test_committed_measurements_load_and_chains_agree():
    """docs/benchmarks/tree_acceptance.json: its chains are shaped as chains, and at every measured batch
    their tree cost on docs/benchmarks/engine.json is the chain model's."""
    acc = json.loads((ROOT / "docs" / "benchmarks" / "tree_acceptance.json").read_text())
    runs = cm.load_tree_acceptance(acc)
    costs = cm.Costs(json.loads((ROOT / "docs" / "benchmarks" / "engine.json").read_text()))
    cfg = cm.inkling_small_config()
    chains = [r for r in runs if r["kind"] == "chain"]
    assert [r["nodes"] for r in chains] == list(range(1, len(chains) + 1))
    for r in chains:
        k = r["nodes"]
        assert r["draft_tree_rows"] == list(range(k)) and r["draft_heads"] == [1] * k
        for B in costs.batches(1, cfg):
            assert cm.tree_cycle_parts(costs, cfg, B, r)["cycle"] == pytest.approx(
                cm.cycle_parts(costs, cfg, B, k)["cycle"], rel=1e-12)
