"""inkling_ref/tree/ranks.py: draft ranks, the replay of tree cycles from them, and tree growth.

The replay must give generate_tree's cycles exactly (accepted count, accepted rank path, counted),
checked on the demo checkpoint in float64, where drafts are often right and paths leave the top-1."""

import json
import random
from pathlib import Path

import pytest
import torch

from configs import tiny_config
from inkling_ref import load_checkpoint, random_model
from inkling_ref.tree import drafts as TR
from inkling_ref.tree import ranks as RK

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    return load_checkpoint(ROOT / "inkling_ref" / "default_checkpoint", dtype=torch.float64)


def test_draft_ranks_match_a_sort():
    """rank = the target's index in the logits sorted descending (stable: ties to the lower id)."""
    model = random_model(tiny_config(num_mtp_depths=3, mtp_layer_types=["sliding", "global", "sliding"]),
                         seed=2, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, model.config.vocab_out, (2, 17), generator=g).tolist()
    ranks = RK.draft_ranks(model, seqs)
    for b, seq in enumerate(seqs):
        logits = model.mtp_logits(torch.tensor([seq]))
        for j in range(3):
            assert len(ranks[b][j]) == 17 - 2 - j
            for p, r in enumerate(ranks[b][j]):
                order = torch.sort(logits[j][0, p], descending=True, stable=True).indices.tolist()
                assert r == order.index(seq[p + j + 2]), (b, j, p)
    with pytest.raises(ValueError, match="sequences of one length"):
        RK.draft_ranks(model, [[1, 2, 3], [1, 2]])


@pytest.mark.parametrize("shape", [[2, 2, 1, 1], "sparse"])
def test_replay_equals_generate_tree_on_the_demo_checkpoint(demo, shape):
    spec = TR.TreeSpec(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0))) \
        if shape == "sparse" else TR.TreeSpec.from_branching(shape)
    prompts = [p["ids"][:64] for p in json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"][:2]]
    max_len = demo.config.max_position_embeddings
    off_top1 = 0
    for prompt in prompts:
        out, cycles = TR.generate_tree(demo, prompt, 37, spec)
        (ranks,) = RK.draft_ranks(demo, [prompt + out])
        replayed = RK.replay(ranks, len(prompt), 37, spec, max_len)
        assert [(c.accepted, c.ranks, c.counted, c.depth) for c in cycles] == \
               [(c.accepted, c.ranks, c.counted, c.depth) for c in replayed]
        off_top1 += sum(1 for c in cycles if any(c.ranks))
    if spec.num_nodes > spec.depth:
        assert off_top1 > 0, "no accepted path left the top-1 chain: the replay of branches is untested"


def synthetic_sequences(seed, n=6, depths=3):
    """Rank lists of `depths` depths over prompts of 5 tokens + 30 new ones; small ranks are likely."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        T = 35
        out.append(([[min(int(rng.expovariate(1.2)), 4) for _ in range(T - 2 - j)] for j in range(depths)], 5))
    return out


def test_grow_trees_takes_the_best_single_node_each_step():
    seqs = synthetic_sequences(0)
    grown = RK.grow_trees(seqs, 30, 512, max_nodes=7, max_depth=3)
    assert sorted(grown) == list(range(1, 8))
    prev: tuple = ()
    for N in range(1, 8):
        spec = grown[N]
        assert set(prev) < set(spec.paths) and len(spec.paths) == N        # one node added to the previous tree
        options = {u + (sum(1 for p in prev if p[:-1] == u),) for u in [()] + list(prev) if len(u) < 3}
        best = max(RK.acceptance_length(seqs, 30, TR.TreeSpec(prev + (o,)), 512) for o in options)
        assert RK.acceptance_length(seqs, 30, spec, 512) == pytest.approx(best)
        prev = spec.paths
    start = TR.TreeSpec.chain(3)
    assert sorted(RK.grow_trees(seqs, 30, 512, max_nodes=5, max_depth=3, start=start)) == [4, 5]


def test_replay_by_hand():
    """Depth-0 ranks [0, 1, ...] and depth-1 ranks [0, ...]: with prompt length 3, the first cycle
    (n = 4) reads row 2."""
    ranks = [[9, 9, 1, 0, 0, 0, 0, 0, 0, 0], [9, 9, 0, 0, 0, 0, 0, 0, 0]]
    cycles = RK.replay(ranks, 3, 8, TR.TreeSpec(((0,), (1,), (1, 0))), 512)
    # n = 4, 1 emitted: row 2 reads (1, 0), a node -> a = 2; n = 7, 4 emitted: row 5 reads (0, 0), not a
    # node, (0,) is -> a = 1; n = 9, 6 emitted: only 8 - 6 - 1 = 1 level fits, row 7 reads (0,) -> a = 1,
    # not counted; 8 emitted: done
    assert [(c.accepted, c.ranks, c.depth, c.counted) for c in cycles] == [
        (2, (1, 0), 2, True), (1, (0,), 2, True), (1, (0,), 1, False)]
