"""Tree drafts (inkling_ref/tree/drafts.py) pinned against chains, in float64 on random tiny models.

1. tree_paths: levels, ancestor masks and conv windows of hand-written trees; a chain gives back the
   causal mask and the unfolded windows; the hooks with chain parents give the default forward
2. draft: every node's logits are speculative.draft's logits on the chain along its parent's path
3. verify: the one-pass tree verify equals verify_paths (each root-to-leaf path verified as a chain)
4. commit: after commit_tree the state equals the state a chain cycle that drafted the accepted path
   leaves (its valid rows), over scripted outcomes; the trunk cache equals a fresh prefill, the
   depth caches the teacher-forced fold, and a chain cycle can follow a tree cycle
5. lossless: greedy tree decoding == plain greedy decoding, many prompts and shapes
and the mutants the suite must catch."""

import importlib
import random

import pytest
import torch

from configs import tiny_config
from cycle_checks import (ATOL, assert_cache_rows_equal, assert_trunk_cache_is_fresh_prefill, four_depth_model,
                          plain_greedy)
from inkling_ref import random_model
from inkling_ref import speculative as S
from inkling_ref.tree import drafts as TR
from inkling_ref.model.cache import TrunkCache
from inkling_ref.model.tree_paths import ancestor_mask, conv_window_index, path_levels
from mutants import assert_some_check_fails, load_mutant

FULL_SHAPES = [[2, 2, 1, 1], [3, 1, 2], [1, 1, 1, 1], [4], [2, 1, 1, 1]]
# sparse: a top-1 chain with second choices; (1,) is a leaf, so depth 1 never expands it
SPARSE = TR.TreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)))
SPECS = [TR.TreeSpec.from_branching(b) for b in FULL_SHAPES] + [SPARSE]
SPEC_IDS = [str(b) for b in FULL_SHAPES] + ["sparse"]


@pytest.fixture(scope="module")
def model():
    return four_depth_model()


def assert_depth_caches_are_the_fold(model, state, D):
    oracle = S.teacher_forced_depth_caches(model, state.tokens)
    for m in range(D):
        assert state.depth_caches[m].length == state.depth_valid[m], f"depth {m}: rows beyond the valid ones"
        assert_cache_rows_equal(state.depth_caches[m], oracle[m], state.depth_valid[m], f"depth {m}")


# ----------------------------------------------------------------------------- 1: paths and hooks
def test_paths_of_a_hand_written_tree():
    # rows: 0 root; 1, 2 its children; 3 child of 1; 4 child of 2; 5 child of 3
    parents = torch.tensor([-1, 0, 0, 1, 2, 3])
    assert path_levels(parents).tolist() == [0, 1, 1, 2, 2, 3]
    want = [[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],   # row 2 does not see its sibling 1
            [1, 1, 0, 1, 0, 0],
            [1, 0, 1, 0, 1, 0],
            [1, 1, 0, 1, 0, 1]]
    assert ancestor_mask(parents).int().tolist() == want
    # K = 3: history = [past_-2, past_-1, rows 0..5] -> indices 0, 1, then 2..7
    assert conv_window_index(parents, 3).tolist() == [[0, 1, 2], [1, 2, 3], [1, 2, 4], [2, 3, 5], [2, 4, 6],
                                                      [3, 5, 7]]
    # a second path root (-1) restarts from the past inputs
    assert conv_window_index(torch.tensor([-1, -1, 1]), 4).tolist() == [[0, 1, 2, 3], [0, 1, 2, 4],
                                                                      [1, 2, 4, 5]]


@pytest.mark.parametrize("T", [1, 2, 7])
def test_chain_parents_give_the_causal_mask_and_unfolded_windows(T):
    chain = torch.arange(T) - 1
    assert torch.equal(path_levels(chain), torch.arange(T))
    assert torch.equal(ancestor_mask(chain), torch.ones(T, T, dtype=torch.bool).tril())
    assert torch.equal(conv_window_index(chain, 4), torch.arange(T)[:, None] + torch.arange(4)[None])


def test_bad_parents_are_refused():
    with pytest.raises(ValueError, match=r"parents\[2\] = 2: a row's parent must be an earlier row"):
        path_levels(torch.tensor([-1, 0, 2]))
    with pytest.raises(ValueError, match="1-d integer tensor"):
        ancestor_mask(torch.tensor([[-1, 0]]))


def test_hooks_with_chain_parents_give_the_default_forward(model):
    """The trunk and a depth with parents = a chain, with and without a cache, equal the default."""
    ids = torch.randint(0, model.config.vocab_out, (1, 13), generator=torch.Generator().manual_seed(1))
    for start in (0, 9):
        c1, c2 = TrunkCache(len(model.trunk.layers)), TrunkCache(len(model.trunk.layers))
        with torch.no_grad():
            if start:
                model.trunk(ids[:, :start], c1)
                model.trunk(ids[:, :start], c2)
            a = model.trunk(ids[:, start:], c1)
            b = model.trunk(ids[:, start:], c2, torch.arange(13 - start) - 1)
        assert (a - b).abs().max().item() < ATOL
        for la, lb in zip(c1.layers, c2.layers):
            assert_cache_rows_equal(lb, la, 13, "trunk cache with chain parents")


# ----------------------------------------------------------------------------- states to test from
def states(model, spec):
    """A few states to test from: right after prefill (short and long prompts) and after tree cycles."""
    V = model.config.vocab_out
    rng = random.Random(str(spec.paths))
    out = []
    for L in (1, 2, 6, 13):
        state = S.prefill(model, [rng.randrange(V) for _ in range(L)])
        out.append(state)
        if L in (2, 13):
            s2 = TR.clone_state(state)
            for _ in range(3):
                tree = TR.draft_tree(model, s2, spec)
                v = TR.verify_tree(model, s2, tree)
                path, b = TR.accept_tree_greedy(tree, v.logits)
                TR.commit_tree(s2, tree, path, b, v)
            out.append(s2)
    return out


# ----------------------------------------------------------------------------- 2: draft
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_draft_equals_the_chain_along_each_path(model, spec):
    """Node u's candidates come from depth level(u)-1 at its parent's row: the logits equal those of
    speculative.draft with k = level(u) drafting the parent's path, and u holds its rank-th choice."""
    for state in states(model, spec):
        tree = TR.draft_tree(model, state, spec)
        for u in range(1, spec.num_nodes + 1):
            ancestors = spec.path_to(u)[:-1]
            k = spec.levels[u]
            chain = S.draft(model, TR.clone_state(state), k,
                            lambda m, logits, pos: tree.tokens[ancestors[m]] if m < k - 1 else 0)
            err = (chain.logits[k - 1] - tree.logits[u]).abs().max().item()
            assert err < ATOL, f"n={state.n} node {u} {spec.paths[u - 1]}: draft logits differ by {err:.2e}"
            assert tree.tokens[u] == TR.top_candidates(k - 1, chain.logits[k - 1], 0, spec.ranks[u] + 1)[-1]


# ----------------------------------------------------------------------------- 3: verify
@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_tree_verify_equals_path_by_path_verify(model, spec):
    for state in states(model, spec):
        tree = TR.draft_tree(model, state, spec)
        want = TR.verify_paths(model, state, tree)
        got = TR.verify_tree(model, TR.clone_state(state), tree)
        for name in ("logits", "hiddens"):
            err = (getattr(got, name) - getattr(want, name)).abs().max().item()
            assert err < ATOL, f"n={state.n}: tree verify {name} differ from the path-by-path verify by {err:.2e}"


# ----------------------------------------------------------------------------- 4: commit
def chain_cycle_on_path(model, state, tree, path, b):
    """The chain cycle that drafts the accepted path (then the leftmost nodes below it), verifies it,
    and commits the same outcome."""
    spec, nodes = tree.spec, list(path)
    while len(nodes) < spec.depth:
        below = spec.children[nodes[-1] if nodes else 0]
        if not below:
            break
        nodes.append(below[0])
    drafts = [tree.tokens[u] for u in nodes]
    d = S.draft(model, state, spec.depth,
                lambda m, logits, pos: drafts[m] if m < len(drafts) else int(logits.argmax()))
    v = S.verify(model, state, d.tokens)
    S.commit(state, d.tokens, len(path), b, v)


def scripted_outcome(spec, tree, rng, V):
    """A random accepted node (the root included) and a next token that none of its children hold."""
    u = rng.randrange(spec.num_nodes + 1)
    below = {tree.tokens[c] for c in spec.children[u]}
    b = rng.randrange(V)
    while b in below:
        b = rng.randrange(V)
    return spec.path_to(u), b


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("prompt_len", [1, 3, 12])
def test_commit_leaves_the_chain_state_of_the_accepted_path(model, spec, prompt_len):
    V = model.config.vocab_out
    rng = random.Random(f"{spec.paths}-{prompt_len}")
    state = S.prefill(model, [rng.randrange(V) for _ in range(prompt_len)])
    for cycle in range(6):
        chain = TR.clone_state(state)
        tree = TR.draft_tree(model, state, spec)
        v = TR.verify_tree(model, state, tree)
        path, b = scripted_outcome(spec, tree, rng, V)
        TR.commit_tree(state, tree, path, b, v)
        chain_cycle_on_path(model, chain, tree, path, b)

        what = f"cycle {cycle}, accepted {[spec.paths[u - 1] for u in path]}"
        assert state.tokens == chain.tokens, what
        assert (state.hiddens - chain.hiddens).abs().max().item() < ATOL, what
        assert state.trunk_cache.length == chain.trunk_cache.length == state.n - 1, what
        for i, (got, want) in enumerate(zip(state.trunk_cache.layers, chain.trunk_cache.layers)):
            assert_cache_rows_equal(got, want, state.n - 1, f"{what}: trunk layer {i}")
        for m in range(spec.depth):
            kept = state.depth_valid[m]
            if spec.branching() is not None:
                assert kept == chain.depth_valid[m], \
                    f"{what}: depth {m} keeps {kept} rows, the chain {chain.depth_valid[m]}"
            assert kept <= chain.depth_valid[m], what
            assert state.depth_caches[m].length == kept, f"{what}: depth {m} keeps rows beyond the valid ones"
            assert_cache_rows_equal(state.depth_caches[m], chain.depth_caches[m], kept, f"{what}: depth {m}")
        assert_trunk_cache_is_fresh_prefill(model, state)
        assert_depth_caches_are_the_fold(model, state, spec.depth)


def test_a_chain_cycle_can_follow_a_tree_cycle(model):
    """After a tree commit the state is a valid chain state: speculative.draft repairs every row."""
    spec = TR.TreeSpec.from_branching([3, 2, 1, 1])
    state = S.prefill(model, list(range(4, 15)))
    for k in (4, 2, 3, 1, 4):
        tree = TR.draft_tree(model, state, spec)
        v = TR.verify_tree(model, state, tree)
        TR.commit_tree(state, tree, *TR.accept_tree_greedy(tree, v.logits), v)
        d = S.draft(model, state, k)
        oracle = S.teacher_forced_depth_caches(model, state.tokens)
        for m in range(k):
            assert_cache_rows_equal(state.depth_caches[m], oracle[m], state.n - 1 - m, f"k={k} depth {m}")
        v = S.verify(model, state, d.tokens)
        S.commit(state, d.tokens, *S.accept_greedy(d.tokens, v.logits), v)


# ----------------------------------------------------------------------------- 5: lossless
def scripted_candidates(greedy, rng, hit=0.75):
    """Candidates that hold the plain-greedy token at a random rank with probability `hit`."""
    def candidates(m, logits, position, count):
        right = greedy[position] if position < len(greedy) else 0
        out = [c for c in TR.top_candidates(m, logits, position, count + 1) if c != right][:count]
        if rng.random() < hit:
            out.insert(rng.randrange(count), right)
        return out[:count]
    return candidates


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_lossless_with_scripted_candidates(model, spec):
    """Every shape over prompts of several lengths; the right token sits at any rank, so accepted
    paths leave the top-1 chain. Output must equal plain greedy token for token."""
    V = model.config.vocab_out
    rng = random.Random(str(spec.paths))
    off_top1 = 0
    for L in (1, 11):
        prompt = [rng.randrange(V) for _ in range(L)]
        greedy = plain_greedy(model, prompt, L + 24)
        out, cycles = TR.generate_tree(model, prompt, 24, spec, scripted_candidates(greedy, rng))
        assert prompt + out == greedy, f"prompt length {L}: tree decoding differs from plain greedy"
        assert max(c.accepted for c in cycles) >= min(2, spec.depth)
        off_top1 += sum(1 for c in cycles if c.accepted and any(t != 0 for t in c.ranks))
    if any(len(spec.children[u]) > 1 for u in range(spec.num_nodes + 1)):
        assert off_top1 > 0, "no cycle accepted a path off the top-1 chain: the tree was never needed"


@pytest.mark.parametrize("head", ["own", "zeroed"])
@pytest.mark.parametrize("branching", [[2, 2, 1, 1], [3, 1, 1]])
def test_lossless_with_model_head(model, head, branching):
    if head == "zeroed":
        model = four_depth_model(zeroed_head=True)
    prompt = [3, 14, 15, 9, 26, 5]
    out, _ = TR.generate_tree(model, prompt, 25, TR.TreeSpec.from_branching(branching))
    assert prompt + out == plain_greedy(model, prompt, len(prompt) + 25)


def test_branching_one_is_the_chain(model):
    """[1] * k drafts exactly what the greedy chain drafts: same accepted count every cycle."""
    prompt = [7, 1, 8, 2, 8, 1, 8]
    out, cycles = TR.generate_tree(model, prompt, 30, TR.TreeSpec.chain(3))
    state, accepts = S.prefill(model, prompt), []
    while len(state.tokens) - len(prompt) < 30:
        k = min(3, 30 - (len(state.tokens) - len(prompt)) - 1)
        d = S.draft(model, state, k)
        v = S.verify(model, state, d.tokens)
        a, b = S.accept_greedy(d.tokens, v.logits)
        S.commit(state, d.tokens, a, b, v)
        accepts.append(a)
    assert state.tokens[len(prompt):] == out and [c.accepted for c in cycles] == accepts


def test_spec_shapes_and_errors():
    spec = TR.TreeSpec.from_branching([2, 2, 1, 1])
    assert (spec.num_nodes, spec.depth, spec.level_sizes()) == (14, 4, [2, 4, 4, 4])
    assert spec.parents[:7] == (-1, 0, 0, 1, 1, 2, 2) and spec.branching() == [2, 2, 1, 1]
    assert SPARSE.branching() is None and SPARSE.depth_rows(1) == [1] and SPARSE.expanding(1) == [1]
    assert TR.TreeSpec.chain(3).truncated(1).paths == ((0,),)
    with pytest.raises(ValueError, match=r"its parent \(0,\) is not in the tree"):
        TR.TreeSpec(((1,), (0, 0)))
    with pytest.raises(ValueError, match="integer branching >= 1"):
        TR.TreeSpec.from_branching([2, 0])
    model = random_model(tiny_config(), seed=1, dtype=torch.float64)   # 2 MTP depths
    with pytest.raises(ValueError, match="a tree of depth 3 needs 3 MTP depths; the model has 2"):
        TR.generate_tree(model, [1, 2], 5, TR.TreeSpec.chain(3))


# ----------------------------------------------------------------------------- mutants
TREE_MUTANTS = {
    "conv window follows the previous row, not the parent": [(
        "model/tree_paths.py", "return K - 2 if p < 0 else K - 1 + p", "return i - 1")],
    "siblings see each other": [(
        "model/tree_paths.py", "        u = t\n        while u >= 0:",
        "        for s in range(t):  # MUTANT: earlier siblings are visible too\n"
        "            rows[t][s] = rows[t][s] or par[s] == par[t]\n"
        "        u = t\n        while u >= 0:")],
    "commit keeps a rejected branch's trunk rows": [(
        "tree/drafts.py", "trunk_rows = list(range(n - 1)) + [n - 1 + u for u in [0] + path]",
        "trunk_rows = list(range(n + len(path)))")],
    "commit keeps a rejected branch's depth rows": [(
        "tree/drafts.py", "rows.append(tree.depth_rows[m][u])", "rows.append(tree.depth_committed[m] + i - 1)")],
    "tree rows at consecutive positions": [(
        "model/attention.py", "q_pos = start + path_levels(parents)",
        "q_pos = torch.arange(start, start + T, device=x.device)")],
    "depth reads its own row of the previous depth, not the parent's": [(
        "tree/drafts.py", "prev_out[[prev_row[spec.parents[u]] for u in nodes]]",
        "prev_out[[prev_row.get(u, prev_row[spec.parents[u]]) for u in nodes]]")],
}


@pytest.mark.parametrize("mutant", list(TREE_MUTANTS))
def test_suite_catches_tree_mutant(mutant, tmp_path):
    """This file's central checks, run against a mutant package: at least one fails."""
    global S, TR
    pkg = load_mutant(tmp_path, TREE_MUTANTS[mutant])
    tree = importlib.import_module(pkg.__name__ + ".tree.drafts")
    m = four_depth_model(pkg)
    spec = tree.TreeSpec.from_branching([2, 2, 1, 1])
    checks = [("verify", lambda: test_tree_verify_equals_path_by_path_verify(m, spec)),
              ("draft", lambda: test_draft_equals_the_chain_along_each_path(m, spec)),
              ("commit", lambda: test_commit_leaves_the_chain_state_of_the_accepted_path(m, spec, 3))]
    saved, (S, TR) = (S, TR), (pkg.speculative, tree)
    try:
        assert_some_check_fails(mutant, checks)
    finally:
        S, TR = saved
