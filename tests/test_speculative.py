"""The greedy MTP cycle pinned by the invariants of docs/spec/mtp-cycle.md §5 (float64, CPU).

1. lossless greedy (any draft quality, every accept count a in 0..k exercised)
2. trunk cache == a fresh prefill of the committed tokens, after every cycle
3. depth caches == the teacher-forced chained fold, after every draft and after every commit,
   over scripted outcomes (random, all-reject, all-accept, alternating)
the two draft windows ("full": k+1 rows; "minimal": vLLM's rows) equivalent, and the mutants the
suite must catch."""

import copy
import random

import pytest
import torch

from cycle_checks import (ATOL, assert_cache_rows_equal, assert_trunk_cache_is_fresh_prefill, four_depth_model,
                          plain_greedy)
from inkling_ref import speculative as S
from mutants import CYCLE_MUTANTS, WINDOW_MUTANTS, assert_some_check_fails, load_mutant


@pytest.fixture(scope="module")
def model():
    return four_depth_model()


def run_cycles(model, prompt, k, max_len, select=S.greedy_select):
    state = S.prefill(model, prompt)
    accepts = []
    while state.n + k + 1 <= max_len:
        d = S.draft(model, state, k, select)
        v = S.verify(model, state, d.tokens)
        a, b = S.accept_greedy(d.tokens, v.logits)
        S.commit(state, d.tokens, a, b, v)
        accepts.append(a)
        assert_trunk_cache_is_fresh_prefill(model, state)
    return state, accepts


# ----------------------------------------------------------------------------- 1 + 2
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_lossless_with_scripted_drafter(model, k):
    """The drafter proposes the plain-greedy token for s drafts, then a wrong one (s random per
    cycle), so every accept count occurs; output must equal plain greedy token for token."""
    V = model.config.vocab_out
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(k)).tolist()
    greedy = plain_greedy(model, prompt, 60)
    rng = random.Random(100 + k)
    script = {}

    def select(m, logits, position):
        if m == 0:
            script["s"] = rng.randint(0, k)  # s drafts right, then wrong
        right = greedy[position]
        return right if m < script["s"] else (right + 1 + rng.randrange(V - 1)) % V

    state, accepts = run_cycles(model, prompt, k, len(greedy), select)
    assert state.tokens == greedy[: state.n]
    assert state.n >= len(greedy) - k - 1
    assert set(accepts) == set(range(k + 1)), f"accept counts seen: {sorted(set(accepts))}"


@pytest.mark.parametrize("head", ["own", "zeroed"])
@pytest.mark.parametrize("k", [0, 2, 4])
def test_lossless_with_model_head(model, head, k):
    """The model's own random head, and a zeroed head (every draft = token 0); k = 0 is plain
    decoding through the same state."""
    if head == "zeroed":
        model = four_depth_model(zeroed_head=True)
    prompt = [3, 14, 15, 9, 26, 5]
    greedy = plain_greedy(model, prompt, 40)
    state, accepts = run_cycles(model, prompt, k, len(greedy))
    assert state.tokens == greedy[: state.n]
    if k == 0:
        assert accepts and set(accepts) == {0}


# ----------------------------------------------------------------------------- 3
def scripted(kind, cycle, k, rng):
    if kind == "random":
        return rng.randint(0, k)
    if kind == "all-reject":
        return 0
    if kind == "all-accept":
        return k
    return k if cycle % 2 else 0  # alternating


@pytest.mark.parametrize("kind", ["random", "all-reject", "all-accept", "alternating"])
@pytest.mark.parametrize("k,prompt_len", [(1, 1), (2, 2), (3, 13), (4, 3), (4, 17)])
def test_depth_caches_equal_teacher_forced_fold(model, kind, k, prompt_len):
    """Right after each draft: every depth m's rows p <= n-2-m equal the one-shot chained pass over
    x_0..x_{n-1}. Right after each commit: rows p <= min(n_prev-2, n-3-m) still do. Outcomes are
    scripted; a token committed after a rejection always differs from the rejected draft."""
    V = model.config.vocab_out
    rng = random.Random(f"{kind}-{k}-{prompt_len}")
    prompt = [rng.randrange(V) for _ in range(prompt_len)]
    state = S.prefill(model, prompt)
    for cycle in range(7):
        d = S.draft(model, state, k)
        n = state.n
        oracle = S.teacher_forced_depth_caches(model, state.tokens)
        for m in range(k):
            assert state.depth_caches[m].length == n - 1
            assert_cache_rows_equal(state.depth_caches[m], oracle[m], n - 1 - m, f"after draft, depth {m}")
        v = S.verify(model, state, d.tokens)
        a = scripted(kind, cycle, k, rng)
        b = rng.randrange(V)
        while a < k and b == d.tokens[a]:
            b = rng.randrange(V)  # the committed token differs from the rejected draft
        S.commit(state, d.tokens, a, b, v)
        assert_trunk_cache_is_fresh_prefill(model, state)
        oracle = S.teacher_forced_depth_caches(model, state.tokens)
        for m in range(k):
            upto = min(n - 1, state.n - 2 - m)  # rows 0 .. min(n_prev-2, n-3-m)
            assert_cache_rows_equal(state.depth_caches[m], oracle[m], upto, f"after commit, depth {m}")


@pytest.mark.parametrize("window", S.WINDOWS)
def test_window_adapts_when_k_changes(model, window):
    """A cycle with fewer drafts than the one before must still repair every stale row."""
    V = model.config.vocab_out
    state = S.prefill(model, list(range(5, 16)))
    for k in [4, 4, 1, 3, 2, 4, 0, 4]:
        d = S.draft(model, state, k, window=window)
        oracle = S.teacher_forced_depth_caches(model, state.tokens)
        for m in range(k):
            assert_cache_rows_equal(state.depth_caches[m], oracle[m], state.n - 1 - m, f"k={k} depth {m}")
        v = S.verify(model, state, d.tokens)
        a = k
        b = (d.tokens[-1] + 1) % V if k else 7
        S.commit(state, d.tokens, a, b, v)


def test_draft_logits_are_the_teacher_forced_logits(model):
    """Depth m's draft logits at the last window row equal mtp_logits of the committed tokens
    followed by the drafts d_1..d_m (the chained fold, evaluated on the drafted continuation)."""
    state = S.prefill(model, [4, 8, 15, 16, 23, 42, 7])
    d = S.draft(model, state, 4)
    n = state.n
    for m in range(4):
        seq = state.tokens + d.tokens[:m]
        want = model.mtp_logits(torch.tensor([seq]))[m][0, n - 2]  # row p = n-2 of depth m
        assert torch.allclose(d.logits[m], want, atol=1e-12, rtol=0)


def test_mtp_logits_shapes(model):
    T = 11
    out = model.mtp_logits(torch.randint(0, model.config.vocab_out, (2, T)))
    assert [tuple(o.shape) for o in out] == [(2, T - 1 - m, model.config.vocab_out) for m in range(4)]


def test_bad_k_is_refused(model):
    state = S.prefill(model, [1, 2, 3])
    with pytest.raises(ValueError, match="the model has 4"):
        S.draft(model, state, 5)
    with pytest.raises(ValueError, match="window must be one of"):
        S.draft(model, state, 2, window="vllm")
    with pytest.raises(ValueError, match="prompt is empty"):
        S.prefill(model, [])


# ----------------------------------------------------------------------------- windows
def counting_rows(model):
    """A shallow copy of `model` whose mtp_depth records (m, rows computed) per call into the returned list."""
    calls, counted = [], copy.copy(model)

    def mtp_depth(m, h_prev, tokens, cache=None):
        calls.append((m, tokens.shape[1]))
        return model.mtp_depth(m, h_prev, tokens, cache)

    counted.mtp_depth = mtp_depth
    return counted, calls


def check_windows_equivalent(spec, model, kind, k, prompt_len, cycles=6):
    """Run window="full" and window="minimal" side by side through the same scripted outcomes. After
    every draft: the same drafts and draft logits, the same depth caches (every row, every field), and
    the minimal window computed exactly vLLM's rows for every depth: the whole prompt right after
    prefill, then min(n-1, k) rows after a cycle that rejected a draft, min(n-1, k+1) after one that
    accepted all k."""
    V = model.config.vocab_out
    rng = random.Random(f"windows-{kind}-{k}-{prompt_len}")
    prompt = [rng.randrange(V) for _ in range(prompt_len)]
    counted, calls = counting_rows(model)
    states = {w: spec.prefill(model, prompt) for w in ("full", "minimal")}
    last_a = None
    for cycle in range(cycles):
        drafts, rows = {}, {}
        for w, state in states.items():
            calls.clear()
            drafts[w] = spec.draft(counted, state, k, window=w)
            rows[w] = list(calls)
        full, minimal, n = drafts["full"], drafts["minimal"], states["full"].n
        assert full.tokens == minimal.tokens, f"cycle {cycle}: drafts differ"
        assert torch.allclose(full.logits, minimal.logits, atol=ATOL, rtol=0), f"cycle {cycle}: draft logits differ"
        for m in range(k):
            got, want = states["minimal"].depth_caches[m], states["full"].depth_caches[m]
            assert got.length == want.length == n - 1, f"cycle {cycle}: depth {m} cache lengths"
            assert_cache_rows_equal(got, want, n - 1, f"cycle {cycle}, depth {m} cache, minimal vs full window")
        vllm = n - 1 if last_a is None else min(n - 1, k + 1 if last_a == k else k)
        assert rows["minimal"] == [(m, vllm) for m in range(k)], f"cycle {cycle}: rows {rows['minimal']}, vLLM runs {vllm}"
        assert rows["full"] == [(m, n - 1 if last_a is None else min(n - 1, k + 1)) for m in range(k)]
        a = scripted(kind, cycle, k, rng)
        b = rng.randrange(V)
        while a < k and b == full.tokens[a]:
            b = rng.randrange(V)  # the committed token differs from the rejected draft
        for w, state in states.items():
            spec.commit(state, drafts[w].tokens, a, b, spec.verify(model, state, drafts[w].tokens))
        last_a = a


@pytest.mark.parametrize("kind", ["random", "all-reject", "all-accept", "alternating"])
@pytest.mark.parametrize("k,prompt_len", [(1, 4), (2, 2), (4, 9)])
def test_windows_are_equivalent(model, kind, k, prompt_len):
    check_windows_equivalent(S, model, kind, k, prompt_len)


@pytest.mark.parametrize("mutant", list(WINDOW_MUTANTS))
def test_window_equivalence_catches_mutant(mutant, tmp_path):
    pkg = load_mutant(tmp_path, WINDOW_MUTANTS[mutant])
    model = four_depth_model(pkg)
    with pytest.raises(AssertionError, match="differ") as caught:  # values, not the row count
        check_windows_equivalent(pkg.speculative, model, "random", 4, 9)
    print(mutant, str(caught.value).splitlines()[0])


# ----------------------------------------------------------------------------- mutants
@pytest.mark.parametrize("mutant", list(CYCLE_MUTANTS))
def test_suite_catches_cycle_mutant(mutant, tmp_path):
    """This file's invariant checks, run against a mutant package: at least one fails."""
    global S
    pkg = load_mutant(tmp_path, CYCLE_MUTANTS[mutant])
    m = four_depth_model(pkg)
    checks = [("fold", lambda: test_depth_caches_equal_teacher_forced_fold(m, "random", 4, 13)),
              ("fold-reject", lambda: test_depth_caches_equal_teacher_forced_fold(m, "all-reject", 3, 2)),
              ("lossless", lambda: test_lossless_with_scripted_drafter(m, 3))]
    saved, S = S, pkg.speculative
    try:
        assert_some_check_fails(mutant, checks)
    finally:
        S = saved
