"""The greedy MTP cycle pinned by the invariants of docs/spec/mtp-cycle.md §5 (float64, CPU).

1. lossless greedy (any draft quality, every accept count a in 0..k exercised)
2. trunk cache == a fresh prefill of the committed tokens, after every cycle
3. depth caches == the teacher-forced chained fold, after every draft and after every commit,
   over scripted outcomes (random, all-reject, all-accept, alternating)
and the mutants the suite must catch."""

import random

import pytest
import torch

from configs import tiny_config
from inkling_ref import random_model
from inkling_ref import speculative as S
from inkling_ref.cache import TrunkCache
from mutants import load_mutant

CACHE_FIELDS = ("keys", "values", "k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in")
ATOL = 1e-12


def four_depth_config():
    return tiny_config(num_mtp_depths=4, mtp_layer_types=["sliding", "global", "sliding", "sliding"])


@pytest.fixture(scope="module")
def model():
    return random_model(four_depth_config(), seed=5, dtype=torch.float64)


def plain_greedy(model, prompt, total_len):
    """Greedy decoding by full forwards, no cache (an oracle independent of the cycle code)."""
    seq = list(prompt)
    with torch.no_grad():
        while len(seq) < total_len:
            seq.append(int(model.logits(torch.tensor([seq]))[0, -1].argmax()))
    return seq


def rows_of(t, field, upto):
    """Rows 0..upto-1 of one cache tensor along its time dim."""
    return t[:, :, :upto] if field in ("keys", "values") else t[:, :upto]


def assert_cache_rows_equal(got, want, upto, what):
    for f in CACHE_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        if upto <= 0:
            continue
        assert g is not None and rows_of(g, f, upto).shape == rows_of(w, f, upto).shape, f"{what}: {f} shape"
        err = (rows_of(g, f, upto) - rows_of(w, f, upto)).abs().max().item()
        assert err < ATOL, f"{what}: {f} rows 0..{upto - 1} differ by {err:.2e}"


def assert_trunk_cache_is_fresh_prefill(model, state):
    fresh = TrunkCache(len(model.trunk.layers))
    with torch.no_grad():
        model.trunk(torch.tensor([state.tokens[:-1]]), fresh)
    assert state.trunk_cache.length == state.n - 1 == fresh.length
    for i, (got, want) in enumerate(zip(state.trunk_cache.layers, fresh.layers)):
        assert_cache_rows_equal(got, want, state.n - 1, f"trunk layer {i}")


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
        model = random_model(four_depth_config(), seed=5, dtype=torch.float64)
        with torch.no_grad():
            for p in model.mtp.parameters():
                p.zero_()
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


def test_window_adapts_when_k_changes(model):
    """A cycle with fewer drafts than the one before must still repair every stale row."""
    V = model.config.vocab_out
    state = S.prefill(model, list(range(5, 16)))
    for k in [4, 4, 1, 3, 2, 4, 0, 4]:
        d = S.draft(model, state, k)
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
    with pytest.raises(ValueError, match="prompt is empty"):
        S.prefill(model, [])


# ----------------------------------------------------------------------------- mutants
def suite_fails_on(pkg) -> list[str]:
    """Run this file's invariant checks against a (mutant) package; return what failed."""
    global S
    m = pkg.random_model(four_depth_config(), seed=5, dtype=torch.float64)
    failures, saved, S = [], S, pkg.speculative
    try:
        for name, fn in [("fold", lambda: test_depth_caches_equal_teacher_forced_fold(m, "random", 4, 13)),
                         ("fold-reject", lambda: test_depth_caches_equal_teacher_forced_fold(m, "all-reject", 3, 2)),
                         ("lossless", lambda: test_lossless_with_scripted_drafter(m, 3))]:
            try:
                fn()
            except AssertionError as e:
                failures.append(f"{name}: {str(e).splitlines()[0][:120]}")
    finally:
        S = saved
    return failures


CYCLE_MUTANTS = {
    "block-0-only history": [(
        "speculative.py",
        "        cache = state.depth_caches[m]\n        cache.truncate(w0)",
        "        if m > 0:  # MUTANT: deeper depths restore (forget) their history every cycle\n"
        "            state.depth_caches[m] = LayerCache()\n"
        "        cache = state.depth_caches[m]\n        cache.truncate(min(w0, cache.length))")],
    "depth index off by one": [("speculative.py", "tokens = slots[w0 + m + 1: n + m]", "tokens = slots[w0 + m: n + m - 1]")],
    "depth conv states not rolled back": [(
        "speculative.py", "        cache.truncate(w0)                                          # drop rows from the window on\n",
        "        if cache.keys is not None:  # MUTANT: only K/V are rolled back\n"
        "            cache.keys, cache.values = cache.keys[:, :, :w0], cache.values[:, :, :w0]\n")],
}


@pytest.mark.parametrize("mutant", list(CYCLE_MUTANTS))
def test_suite_catches_cycle_mutant(mutant, tmp_path):
    pkg = load_mutant(tmp_path, CYCLE_MUTANTS[mutant])
    failures = suite_fails_on(pkg)
    print(mutant, failures)
    assert failures, f"the cycle tests pass on the mutant '{mutant}'"
