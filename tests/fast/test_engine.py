"""The fast engine (inkling_fast.Engine) against inkling_ref, float32.

On every machine (CPU: the Triton interpreter, eager; GPU: compiled, replayed from CUDA graphs), tiny
random models whose drafts are accepted in a fair share of cycles:
  * greedy `generate` == inkling_ref.generate: token ids, every CycleRecord and the statistics, for
    k = 0..4 at batch 1, and for a ragged batch (EOS inside a cycle, max-token stops, slot refill,
    padded rows, prompts split over several prefill passes) with the overlapped and the synchronous
    host loop; every ring wraps
  * batched prefill passes leave every cache (trunk and depth KV and conv rings, hidden ring, token
    buffer, slot state) as the per-sequence prefill and the reference leave them: ragged prompts of
    1..13 tokens (longer than the sliding window, split over passes, padded), and a sequence
    prefilled after others ran a cycle; the pass planner against a brute-force search
  * after scripted cycles (accept counts 0..k; the token committed after a rejection never equals the
    rejected draft) the caches read back from the rings equal the reference's: trunk rows == a fresh
    prefill, depth rows == the teacher-forced chained fold, hidden ring == the trunk's hiddens
  * sampling fed the reference's uniforms == inkling_ref.generate (greedy and sampled drafts), with
    both loops; sampling with device uniforms: the overlapped loop == the synchronous one
  * errors name the problem
Caches, hidden ring and token buffer are poisoned (NaN, id -7) before each run: a read of a row that
was never written turns into a wrong token or a failed comparison.

GPU only (@pytest.mark.gpu): the demo checkpoint at fp32 (k = 0..8, batch 1 and a ragged 8, both
loops, cache invariants, batched prefill caches), a random 8-depth model with refills, EOS and split
prompts (both loops), bf16 against its own plain decoding and the fp32 acceptance length, the cycle
and a prefill pass under sync-debug "error" and as graph replays, the overlapped steady state with
no host synchronization but the one result copy per step, the sampled distribution with device
(Philox) uniforms.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import pytest
import torch

import inkling_ref
from inkling_fast import Engine, weights
from inkling_fast.caches import FIELDS
from inkling_fast.step_io import Decoding
from inkling_fast.prefill_plan import default_prefill_lengths, plan_prefill_pass, possible_passes
from inkling_ref import InklingConfig, generate, load_checkpoint, random_model, save_checkpoint
from inkling_ref import speculative as S
from inkling_ref.decoding.generation import AcceptanceStats, Uniforms, sequence_seed
from inkling_ref.model.cache import TrunkCache
from inkling_ref.decoding.sampling import SamplingParams, probs
from inkling_ref.testing import assert_close, cache_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEMO = Path(inkling_ref.__file__).resolve().parent / "default_checkpoint"
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The interpreter runs one Python thread; torch's idle OpenMP workers would spin against it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    """fp32 means fp32 (no TF32 GEMMs in the reference or the engine) while these tests run."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def engine_config(**overrides) -> InklingConfig:
    """2 trunk layers (sliding + dense, global + MoE with log-tau from position 6), window 5, 4 MTP
    depths (sliding, global, sliding, sliding), a vocabulary of 5 (+3 padding rows): small enough for
    the interpreter, and every ring wraps within ~15 positions."""
    base = dict(
        vocab_size=8, unpadded_vocab_size=5, hidden_size=32, num_layers=2,
        num_heads=2, num_kv_heads=1, head_dim=16, rel_extent=12,
        swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=5,
        d_rel=4, log_scaling_n_floor=6, log_scaling_alpha=0.3,
        layer_types=["sliding", "global"], mlp_types=["dense", "moe"],
        dense_intermediate_size=24, moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, route_scale=2.0,
        mup=2.0, conv_kernel_size=4, max_position_embeddings=128,
        num_mtp_depths=4, mtp_layer_types=["sliding", "global", "sliding", "sliding"])
    base.update(overrides)
    return InklingConfig(**base)


def agreeable_model(cfg: InklingConfig, seed: int, dtype=torch.float32):
    """A random model whose unembedding rows are nearly parallel (c_v * u + noise): the trunk and the
    depths favour the same few tokens, so drafts get accepted (random heads accept almost nothing)."""
    model = random_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        W = model.trunk.unembed.weight
        u = torch.randn(W.shape[1], generator=g)
        c = torch.linspace(-1, 1, W.shape[0])[torch.randperm(W.shape[0], generator=g)]
        W.copy_(c[:, None] * u[None] + 0.5 * torch.randn(W.shape, generator=g))
    return model.to(dtype=dtype, device=DEVICE)


def poison(engine: Engine) -> None:
    for c in engine.trunk_caches + engine.depth_caches:
        for t in (c.k, c.v, c.k_ring, c.v_ring, c.attn_ring, c.mlp_ring):
            t.fill_(float("nan"))
    engine.state.hidden.fill_(float("nan"))
    engine.state.tokens.fill_(-7)


def assert_same_result(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.cycles == want.cycles
    assert repr(got.stats) == repr(want.stats)  # (NaN == NaN for empty statistics)


def eos_cuts(result, eos: int) -> bool:
    """Some cycle's emitted tokens were cut at the EOS before its correction/bonus token."""
    return any(c.emitted[-1] == eos and len(c.emitted) < c.accepted + 1 for seq in result.cycles for c in seq)


def eos_inside_a_cycle(model, prompts: list[list[int]], N: int, k: int, ragged: bool = False) -> int:
    """The lowest token id that, as eos_token_id, makes the reference stop some sequence inside a
    cycle (among its accepted drafts); ragged: while another still runs to N tokens."""
    for eos in range(model.config.vocab_out):
        r = generate(model, prompts, max_new_tokens=N, num_speculative_tokens=k, eos_token_id=eos)
        if eos_cuts(r, eos) and (not ragged or max(map(len, r.token_ids)) == N):
            return eos
    raise AssertionError("no token id stops a sequence inside a cycle: pick other prompts")


def assert_accepts_and_rejects(result) -> None:
    """The run exercised both outcomes: some cycle accepted a draft, some rejected the first."""
    accepted = {c.accepted for seq in result.cycles for c in seq if c.k > 0}
    assert 0 in accepted and max(accepted) >= 1, f"accept counts seen: {sorted(accepted)}"


def assert_first_three_tokens_follow_the_trunk(model, result, prompt: list[int], params: SamplingParams) -> None:
    """result: `generate` of N copies of `prompt`, three new tokens each. Their joint counts follow the
    trunk's own sampling distribution under params (exact, from the reference's logits): no sequence
    the target gives probability 0, and chi-square p > 1e-3 (cells expecting < 5 merged into one)."""
    from scipy.stats import chi2
    N, V = len(result.token_ids), model.config.vocab_out
    counts = torch.zeros(V, V, V, dtype=torch.float64)
    for t in result.token_ids:
        counts[t[0], t[1], t[2]] += 1
    expected = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.no_grad():
        p1 = probs(model.logits(torch.tensor([prompt], device=DEVICE))[0, -1], params).cpu()
        for a in range(V):
            p2 = probs(model.logits(torch.tensor([prompt + [a]], device=DEVICE))[0, -1], params).cpu()
            for b in range(V):
                p3 = probs(model.logits(torch.tensor([prompt + [a, b]], device=DEVICE))[0, -1], params).cpu()
                expected[a, b] = p1[a] * p2[b] * p3 * N
    e, o = expected.flatten(), counts.flatten()
    assert o[e == 0].sum() == 0, "emitted a sequence the target gives probability 0"
    big = e >= 5
    stat = (((o[big] - e[big]) ** 2) / e[big]).sum().item()
    cells = int(big.sum())
    small = ~big & (e > 0)
    if small.any():
        stat += ((o[small].sum() - e[small].sum()) ** 2 / e[small].sum()).item()
        cells += 1
    dof = cells - 1
    p_value = chi2.sf(stat, dof)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {dof} degrees of freedom: p = {p_value:.2e}"


def ring_sizes(engine: Engine) -> list[int]:
    return [c.capacity[f] for c in engine.trunk_caches + engine.depth_caches for f in FIELDS
            if c.capacity[f] < engine.max_seq_len]


@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(), seed=3)


@pytest.fixture(scope="module")
def engine4(model):
    return Engine(model, max_batch_size=3, max_seq_len=24, num_speculative_tokens=4, dtype=torch.float32,
                  device=DEVICE)


# ----------------------------------------------------------------------------- greedy == reference
@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_greedy_equals_reference(model, engine4, k):
    """One engine built for k = 4 runs every k <= 4; the sequence outgrows every ring."""
    prompt, N = [1, 2, 3, 4, 0], 8
    poison(engine4)
    got = engine4.generate(prompt, max_new_tokens=N, num_speculative_tokens=k)
    want = generate(model, prompt, max_new_tokens=N, num_speculative_tokens=k)
    assert_same_result(got, want)
    assert len(prompt) + N > max(ring_sizes(engine4))
    if k:
        assert max(c.accepted for c in got.cycles[0]) >= 1, "no draft was accepted: the test model is too weak"


def test_engine_from_kernel_ready_weights(model):
    """Engine(ModelWeights) uses the given weights as they are (no copy; only the first k depths get
    caches) and decodes exactly as the engine built from the model; mismatches are named."""
    W = weights.from_model(model, 4, torch.float32, torch.device(DEVICE))
    engine = Engine(W, max_batch_size=1, max_seq_len=24, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE)
    assert engine.W.embed is W.embed and len(engine.W.depths) == len(engine.depth_caches) == 2
    prompt, N = [1, 2, 3, 4, 0], 8
    got = engine.generate(prompt, max_new_tokens=N)
    assert_same_result(got, generate(model, prompt, max_new_tokens=N, num_speculative_tokens=2))
    with pytest.raises(ValueError, match="needs 5 MTP depths; the weights have 4"):
        Engine(W, 1, 24, 5, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="the weights are torch.float32 on .*; the engine was asked for torch.bfloat16"):
        Engine(W, 1, 24, 2, dtype=torch.bfloat16, device=DEVICE)


def test_ragged_batch_with_refill_padding_and_eos():
    """4 prompts of lengths 1..7 on 3 slots, always padded to a batch of 3: a finished sequence's slot
    is refilled, rows go idle as sequences stop (EOS inside a cycle, or length), each sequence gets
    what it gets alone, with the overlapped and the synchronous loop. The caches are sized exactly
    for k = 2; the depths end with chain_hidden_post_norm; prefill passes of 3 rows x 2 tokens (the
    7-token prompt in 4 passes, the last padded; later prompts prefilled between cycles)."""
    cfg = engine_config(chain_hidden_post_norm=True, num_mtp_depths=2, mtp_layer_types=["global", "sliding"])
    model = agreeable_model(cfg, seed=5)
    prompts = [[4], [1, 0, 3, 2, 2, 1, 4], [3, 3, 0], [2, 1]]
    N = 7
    engine = Engine(model, max_batch_size=3, max_seq_len=7 + N, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE, batch_sizes=[3], prefill_tokens=6, prefill_lengths=[2])
    eos = eos_inside_a_cycle(model, prompts, N, k=2, ragged=True)
    want = generate(model, prompts, max_new_tokens=N, num_speculative_tokens=2, eos_token_id=eos)
    for overlap in (True, False):
        poison(engine)
        got = engine.generate(prompts, max_new_tokens=N, num_speculative_tokens=2, eos_token_id=eos, overlap=overlap)
        assert_same_result(got, want)
    lengths = [len(t) for t in got.token_ids]
    assert min(lengths) < N and max(lengths) == N, f"not ragged: lengths {lengths}"
    assert_accepts_and_rejects(got)
    assert eos_cuts(got, eos)
    passes = [t for t in engine.timings if t.kind == "prefill"]
    assert len(passes) >= 4 and sum(t.tokens for t in passes) == sum(map(len, prompts))


# ----------------------------------------------------------------------------- caches after scripted cycles
def compare_rows(cache, ref_cache, slot: int, positions: dict[str, list[int]], what: str, tol: float) -> None:
    """The engine's rows (read back from its rings) == the reference LayerCache's rows, per field."""
    for f in FIELDS:
        pos = positions[f]
        if pos:
            assert_close(cache.read(slot, pos)[f], cache_rows(ref_cache, f, pos), tol,
                         f"{what}: {f} at positions {pos[0]}..{pos[-1]}")


def intact(cache, written: int, valid_upto: int, max_seq_len: int) -> dict[str, list[int]]:
    """Per field, the positions <= valid_upto that its ring still holds, when the highest position
    ever written into it is `written` (a ring of X rows holds written-X+1 .. written)."""
    out = {}
    for f, X in cache.capacity.items():
        lo = 0 if X >= max_seq_len else max(0, written - X + 1)
        out[f] = list(range(lo, valid_upto + 1))
    return out


def run_scripted_cycles(engine: Engine, model, prompt: list[int], k: int, script: list[int], slot: int,
                        tol: float = TOL) -> int:
    """Drive the engine's draft / verify / commit with scripted accept counts (capped at k_eff, so a
    script may run the slot up to max_seq_len) and check the caches after every draft and commit.
    Returns the number of cycles run."""
    dec, V = Decoding(k), model.config.vocab_out
    rng = random.Random(f"{k}-{script}")
    stop = engine.max_seq_len
    tokens = prompt + [engine.prefill(slot, prompt, dec, stop)]
    batch = engine.make_batch([slot], k)
    dev = engine.device
    for cycle, a in enumerate(script):
        n = len(tokens)
        if n >= stop:
            return cycle
        k_eff = min(k, stop - n - 1)
        a = min(a, k_eff)
        drafts = engine.steps.draft(batch, dec)[0][0].tolist()
        oracle = S.teacher_forced_depth_caches(model, tokens)            # x_0 .. x_{n-1}
        for m in range(k):                                                # rows p <= n-2-m
            rows = intact(engine.depth_caches[m], n - 2, n - 2 - m, engine.max_seq_len)
            compare_rows(engine.depth_caches[m], oracle[m], slot, rows, f"cycle {cycle} after draft, depth {m}", tol)
        with torch.no_grad():
            H = model.hidden(torch.tensor([tokens[:-1]], device=dev))[0]  # H_0 .. H_{n-2}
        window = [p for p in range(n - 2 - k, n - 1) if p >= 0]
        got = engine.state.hidden[slot, torch.tensor(window, device=dev)]
        assert_close(got, H[window], tol, f"cycle {cycle}: hidden rows")

        engine.steps.verify(batch, dec)
        b = rng.randrange(V)
        while a < k_eff and b == drafts[a]:
            b = rng.randrange(V)                                          # never the rejected draft
        engine.steps.commit(batch, torch.tensor([a], device=dev), torch.tensor([b], device=dev))
        tokens += drafts[:a] + [b]
        n_new = len(tokens)
        assert int(engine.state.n[slot]) == n_new
        assert engine.state.tokens[slot, :n_new].tolist() == tokens

        fresh = TrunkCache(len(model.trunk.layers))
        with torch.no_grad():
            model.trunk(torch.tensor([tokens[:-1]], device=dev), fresh)  # x_0 .. x_{n_new-2}
        for i, cache in enumerate(engine.trunk_caches):                   # the verify wrote up to n-1+k_eff
            rows = intact(cache, n - 1 + k_eff, n_new - 2, engine.max_seq_len)
            compare_rows(cache, fresh.layers[i], slot, rows, f"cycle {cycle} after commit, trunk layer {i}", tol)
        oracle = S.teacher_forced_depth_caches(model, tokens)
        for m in range(k):                                                # rows p <= min(n-2, n_new-3-m)
            rows = intact(engine.depth_caches[m], n - 2, min(n - 2, n_new - 3 - m), engine.max_seq_len)
            compare_rows(engine.depth_caches[m], oracle[m], slot, rows, f"cycle {cycle} after commit, depth {m}", tol)
    return len(script)


def test_caches_after_scripted_cycles(model):
    """k = 3 on rings sized for it; accept counts k, 0, 1, k, 0, 2, 0 (all-accept, all-reject,
    alternating, partial), then the slot runs to exactly max_seq_len (cycles with k_eff = 1 and 0);
    the sequence runs past every ring."""
    engine = Engine(model, max_batch_size=2, max_seq_len=24, num_speculative_tokens=3, dtype=torch.float32,
                    device=DEVICE)
    poison(engine)
    script = [3, 0, 1, 3, 0, 2, 0, 3, 3]
    cycles = run_scripted_cycles(engine, model, [2, 4, 1, 0, 3, 3], 3, script, slot=1)
    assert cycles == 8 and int(engine.state.n[1]) == engine.max_seq_len
    assert engine.max_seq_len > max(ring_sizes(engine))


# ----------------------------------------------------------------------------- batched prefill
def test_prefill_plan_against_brute_force():
    """plan_prefill_pass takes the pass of most prompt tokens (fewest padded tokens on a tie) within
    the budget, over every choice of chunk length and row count (brute force), in admission order."""
    sizes, budget = [1, 2, 4, 8, 16, 32], 4096
    lengths = default_prefill_lengths(budget)
    assert lengths == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096] and default_prefill_lengths(6) == [6]
    assert plan_prefill_pass([240] * 32, lengths, sizes, budget) == (32, 128, 32)
    assert plan_prefill_pass([112] * 32, lengths, sizes, budget) == (32, 128, 32)
    assert plan_prefill_pass([5000], lengths, sizes, budget) == (1, 4096, 1)
    assert plan_prefill_pass([300, 300, 1], lengths, sizes, budget) == (3, 512, 4)
    assert plan_prefill_pass([1, 3, 7], [2, 4, 8], [1, 2, 4], 8) == (3, 2, 4)
    rng = random.Random(0)
    for _ in range(300):
        remaining = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        lens = sorted(rng.sample([1, 2, 3, 5, 8, 16, 30, 64, 100, 256], rng.randint(1, 4)))
        bs = sorted(rng.sample([1, 2, 3, 4, 6, 8, 16, 32], rng.randint(1, 4)))
        budget = rng.randint(min(lens) * min(bs), max(2000, min(lens) * min(bs)))
        rows, T, B = plan_prefill_pass(remaining, lens, bs, budget)
        assert T in lens and B in bs and rows <= B and B * T <= budget and 1 <= rows <= len(remaining)
        best = max((sum(min(r, t) for r in remaining[:n]), -b * t)
                   for t in lens for b in bs for n in range(1, min(b, len(remaining)) + 1) if b * t <= budget)
        assert (sum(min(r, T) for r in remaining[:rows]), -B * T) == best, (remaining, lens, bs, budget)
    with pytest.raises(ValueError, match="smallest batch size 2 times the shortest length 4 exceeds it"):
        plan_prefill_pass([3], [4], [2], 7)


def test_possible_passes_hold_every_pass_the_plan_makes():
    """possible_passes lists every (B, T) plan_prefill_pass returns for a request's prompts, whichever of
    them are pending together and however far their chunks are: what auto captures before a request."""
    sizes, lengths = [1, 2, 4, 8, 16, 32], default_prefill_lengths(4096)
    assert possible_passes([240, 30], lengths, [1, 2], 4096) == [(b, t) for t in (16, 32, 64, 128, 256) for b in (1, 2)]
    assert max(t for _, t in possible_passes([5000], lengths, sizes, 4096)) == 4096
    assert max(t for _, t in possible_passes([64, 3], lengths, sizes, 4096)) == 64     # a prompt that fits T exactly
    rng = random.Random(1)
    for _ in range(400):
        prompts = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        lens = sorted(rng.sample([1, 2, 3, 5, 8, 16, 30, 64, 100, 256], rng.randint(1, 4)))
        bs = sorted(rng.sample([1, 2, 3, 4, 6, 8, 16], rng.randint(1, 4)))
        budget = rng.randint(min(lens) * min(bs), max(2000, min(lens) * min(bs)))
        max_batch = max(bs)
        top = next(b for b in bs if b >= min(len(prompts), max_batch))
        allowed = set(possible_passes(prompts, lens, [b for b in bs if b <= top], budget))
        for _ in range(5):                   # any group of at most max_batch pending prompts, any chunks done
            pending = rng.sample(prompts, rng.randint(1, min(len(prompts), max_batch)))
            remaining = [rng.randint(1, L) for L in pending]
            rows, T, B = plan_prefill_pass(remaining, lens, bs, budget)
            assert (B, T) in allowed, (prompts, remaining, lens, bs, budget)


def assert_prefill_state(engine: Engine, slot: int, prompt: list[int], k: int, stop: int, first: int,
                         other: Engine, other_slot: int, model) -> None:
    """What a prefill leaves in `slot` of `engine`: the token buffer, n/stop/done/EOS, every trunk row
    0..L-1, every depth m row 0..L-2-k, the hidden ring's H_{L-1-k..L-1}; equal to the rows `other`
    holds in `other_slot` (float32: relative L2 <= 1e-5, exact for the integer state) and to the
    reference (a fresh trunk prefill, the teacher-forced chained fold)."""
    st, L = engine.state, len(prompt)
    assert st.tokens[slot, : L + 1].tolist() == prompt + [first]
    assert [int(st.n[slot]), int(st.stop[slot]), bool(st.done[slot]), int(st.eos[slot])] == [L + 1, stop, L + 1 >= stop, -1]
    assert other.state.tokens[other_slot, : L + 1].tolist() == prompt + [first]
    dev = engine.device
    with torch.no_grad():
        fresh = TrunkCache(len(model.trunk.layers))
        model.trunk(torch.tensor([prompt], device=dev), fresh)
        H = model.hidden(torch.tensor([prompt], device=dev))[0]
    oracle = S.teacher_forced_depth_caches(model, prompt + [first])

    def same(a, a_slot, b, b_slot, positions, what):
        for f in FIELDS:
            if positions[f]:
                x, y = a.read(a_slot, positions[f])[f].double(), b.read(b_slot, positions[f])[f].double()
                err = ((x - y).norm() / y.norm()).item()
                assert err <= TOL, f"{what}: {f} at positions {positions[f]}: relative error {err:.2e}"

    for i, (cache, o) in enumerate(zip(engine.trunk_caches, other.trunk_caches)):
        rows = intact(cache, L - 1, L - 1, engine.max_seq_len)
        same(cache, slot, o, other_slot, rows, f"slot {slot}, trunk layer {i}")
        compare_rows(cache, fresh.layers[i], slot, rows, f"slot {slot}, trunk layer {i} vs reference", TOL)
    for m in range(k):
        rows = intact(engine.depth_caches[m], L - 2 - k, L - 2 - k, engine.max_seq_len)
        same(engine.depth_caches[m], slot, other.depth_caches[m], other_slot, rows, f"slot {slot}, depth {m}")
        compare_rows(engine.depth_caches[m], oracle[m], slot, rows, f"slot {slot}, depth {m} vs reference", TOL)
    window = list(range(L))                                             # every prompt position's H
    ring = torch.tensor(window, device=dev)
    for got, what in ((st.hidden[slot, ring], "engine"), (other.state.hidden[other_slot, ring], "per-sequence")):
        assert ((got - H[window]).norm() / H[window].norm()).item() <= TOL, f"slot {slot}: hidden rows ({what})"


def test_batched_prefill_equals_sequence_prefill(model):
    """prefill_batch (the passes of generate) against the per-sequence `prefill` and the reference, k = 2.
    Prompts of 1, 3 and 7 tokens (7 > the sliding window 5) in passes of budget 8 with lengths 2, 4, 8:
    4 x 2, then 2 x 4, then 1 x 2 tokens (the 7-token prompt in three chunks; padding in every pass);
    then, after a cycle of one of them, a 13-token prompt alone in two passes (admitted mid-run). The
    per-sequence engine prefills in chunks of 7."""
    k = 2
    prompts = [[3], [1, 4, 0], [2, 0, 1, 3, 3, 4, 1], [0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 1, 2, 3]]
    engine = Engine(model, max_batch_size=4, max_seq_len=20, num_speculative_tokens=k, dtype=torch.float32,
                    device=DEVICE, prefill_tokens=8, prefill_lengths=[2, 4, 8])
    single = Engine(model, max_batch_size=4, max_seq_len=20, num_speculative_tokens=k, dtype=torch.float32,
                    device=DEVICE, prefill_tokens=7)
    poison(engine)
    poison(single)
    stops = [len(p) + 6 for p in prompts]
    dec = Decoding(k)
    firsts = engine.prefill_batch([2, 0, 3], prompts[:3], dec, stops[:3])
    assert [(t.rows, t.tokens) for t in engine.timings] == [(3, 5), (2, 5), (1, 1)]
    for i, (slot, other) in enumerate(zip([2, 0, 3], [1, 3, 0])):
        assert single.prefill(other, prompts[i], dec, stops[i]) == firsts[i]
        assert_prefill_state(engine, slot, prompts[i], k, stops[i], firsts[i], single, other, model)
    engine.run_cycle([0], dec)
    first = engine.prefill_batch([1], prompts[3:], dec, stops[3:])[0]
    assert [(t.rows, t.tokens) for t in engine.timings] == [(1, 8), (1, 5)]
    assert single.prefill(2, prompts[3], dec, stops[3]) == first
    assert_prefill_state(engine, 1, prompts[3], k, stops[3], first, single, 2, model)


# ----------------------------------------------------------------------------- sampling == reference
def test_reference_stream_drawn_at_once_equals_its_pieces():
    """uniforms="reference" copies a sequence's whole stream to the device when it is admitted: one draw
    of n uniforms from its generator must equal the reference's draws of 1, then k_eff, k_eff, 1, ..."""
    u = Uniforms(sequence_seed(11, 3))
    pieces = u(1) + [x for ke in (4, 4, 0, 2, 2, 1, 1) for x in u(ke) + u(ke) + u(1)]
    whole = torch.rand(len(pieces), generator=Uniforms(sequence_seed(11, 3)).g, dtype=torch.float64).tolist()
    assert whole == pieces


@pytest.mark.parametrize("draft_sampling,params,overlap", [("greedy", dict(temperature=1.3, top_k=4), True),
                                                           ("sample", dict(temperature=0.9, top_p=0.9), False)])
def test_sampling_with_reference_uniforms_equals_reference(model, draft_sampling, params, overlap):
    """uniforms="reference": the engine draws each sequence's uniforms from the reference's own stream,
    so the rejection sampling on the device must pick exactly the reference's tokens (3 prompts on 2
    slots: the third takes a finished sequence's slot and stream; one max_new_tokens per prompt, each
    compared with the reference run at that limit)."""
    engine = Engine(model, max_batch_size=2, max_seq_len=20, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE, uniforms="reference")
    prompts, limits = [[1, 2, 3], [0, 4], [2]], [6, 4, 7]
    kw = dict(num_speculative_tokens=2, draft_sampling=draft_sampling, seed=11, **params)
    poison(engine)
    got = engine.generate(prompts, max_new_tokens=limits, overlap=overlap, **kw)
    runs = [generate(model, prompts, max_new_tokens=n, **kw) for n in limits]
    assert got.token_ids == [r.token_ids[i] for i, r in enumerate(runs)]
    assert got.cycles == [r.cycles[i] for i, r in enumerate(runs)]
    assert repr(got.stats) == repr(AcceptanceStats.from_cycles(2, [c for seq in got.cycles for c in seq]))
    assert_accepts_and_rejects(got)


def test_sampling_with_device_uniforms_overlapped_equals_synchronous(model):
    """uniforms="device" (Philox per slot): the overlapped loop gives exactly the synchronous loop's
    tokens, records and statistics (3 prompts on 2 slots, EOS, sampled drafts)."""
    engine = Engine(model, max_batch_size=2, max_seq_len=20, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE)
    prompts = [[1, 2, 3], [0, 4], [2]]
    kw = dict(max_new_tokens=7, temperature=1.0, draft_sampling="sample", seed=5, eos_token_id=3)
    poison(engine)
    want = engine.generate(prompts, overlap=False, **kw)
    poison(engine)
    got = engine.generate(prompts, overlap=True, **kw)
    assert_same_result(got, want)
    assert any(t[-1] == 3 and len(t) < 7 for t in got.token_ids), "no sequence stopped at the EOS"


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_problem(model, engine4, tmp_path):
    def make(**kw):
        args = dict(max_batch_size=2, max_seq_len=24, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE)
        args.update(kw)
        return Engine(model, **args)

    with pytest.raises(ValueError, match="needs 5 MTP depths; the model has 4"):
        make(num_speculative_tokens=5)
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        make(dtype=torch.float64)
    with pytest.raises(ValueError, match="max_seq_len=200 is beyond the model's maximum length 128"):
        make(max_seq_len=200)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        make(max_batch_size=0)
    with pytest.raises(ValueError, match="batch_sizes must be"):
        make(batch_sizes=[1])
    with pytest.raises(ValueError, match="prefill_tokens must be an integer >= 1"):
        make(prefill_tokens=0)
    with pytest.raises(ValueError, match="prefill_lengths must be integers in 1..prefill_tokens=8"):
        make(prefill_tokens=8, prefill_lengths=[4, 16])
    with pytest.raises(ValueError, match="prefill_tokens=3 is below the smallest prefill pass: batch size 2 x chunk"):
        make(prefill_tokens=3, prefill_lengths=[2], batch_sizes=[2])
    with pytest.raises(TypeError, match="checkpoint directory, an inkling_ref.InklingModel or "
                                        "inkling_fast.weights.ModelWeights, got int"):
        Engine(42, 1, 8, 0)

    with pytest.raises(ValueError, match="beyond the engine's max_seq_len=24"):
        engine4.generate([1, 2, 3], max_new_tokens=22)
    with pytest.raises(ValueError, match="beyond the model's maximum length 128"):
        engine4.generate([1, 2, 3], max_new_tokens=126)
    with pytest.raises(ValueError, match="num_speculative_tokens=5 is beyond this engine's 4 loaded MTP depths"):
        engine4.generate([1, 2, 3], max_new_tokens=4, num_speculative_tokens=5)
    with pytest.raises(ValueError, match="out of range 0..4"):
        engine4.generate([1, 7], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens: 3 limits for 2 prompts"):
        engine4.generate([[1], [2]], max_new_tokens=[4, 4, 4])
    with pytest.raises(ValueError, match="prompt 1 has 3 tokens; with max_new_tokens=22 .* max_seq_len=24"):
        engine4.generate([[1], [1, 2, 3]], max_new_tokens=[4, 22])
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        engine4.generate([1], max_new_tokens=4, eos_token_id=[1])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine4.generate([[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="a batch of 4 sequences is beyond max_batch_size=3"):
        engine4.make_batch([0, 1, 2, 2], 4)
    with pytest.raises(ValueError, match="must be distinct"):
        engine4.make_batch([0, 0], 4)
    with pytest.raises(ValueError, match="slot=3 is outside 0..max_batch_size-1=2"):
        engine4.prefill(3, [1, 2], Decoding(4), 10)
    with pytest.raises(ValueError, match="slots \\[0, 0\\] must be distinct"):
        engine4.prefill_batch([0, 0], [[1], [2]], Decoding(4), [5, 5])
    with pytest.raises(ValueError, match="prompt 1: 3 tokens with stop=3 do not fit"):
        engine4.prefill_batch([0, 1], [[1], [2, 3, 4]], Decoding(4), [5, 3])

    # a checkpoint with fewer complete MTP depths than k
    small = random_model(engine_config(num_mtp_depths=2, mtp_layer_types=["sliding", "global"]), seed=0)
    save_checkpoint(small, tmp_path / "ckpt")
    with pytest.raises(inkling_ref.CheckpointError, match="num_mtp_depths=3 requested.*has 2 complete MTP depth"):
        Engine(tmp_path / "ckpt", 1, 16, 3, dtype=torch.float32, device=DEVICE)


# ============================================================================= GPU
def demo_prompts(count: int) -> list[list[int]]:
    """Python source from this repository (the demo model was trained on Python), tokenized, of
    lengths 16, 29, 42, ... tokens."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    files = sorted(Path(inkling_ref.__file__).resolve().parent.rglob("*.py"))
    return [tok.encode(files[i % len(files)].read_text()).ids[: 16 + 13 * i] for i in range(count)]


@pytest.fixture(scope="module")
def demo_ref():
    return load_checkpoint(DEMO, dtype=torch.float32, device="cuda")


@pytest.fixture(scope="module")
def demo_fp32():
    return Engine(DEMO, max_batch_size=8, max_seq_len=256, num_speculative_tokens=8, dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_demo_fp32_equals_reference(demo_ref, demo_fp32):
    """The trained demo checkpoint at fp32 on the GPU, k = 0..8, batch 1 and a ragged batch of 8, with
    the overlapped and the synchronous loop: token ids identical to inkling_ref.generate (same GPU).
    The cycle records must agree too, up to draft choices that a last-bit difference can flip (allowed
    in at most 1% of the cycles; the two loops may run a cycle at different padded batch sizes)."""
    prompts = demo_prompts(8)

    def records_differ(got, want) -> int:
        pairs = [(g, w) for gs, ws in zip(got.cycles, want.cycles) for g, w in zip(gs, ws)]
        differ = sum(g != w for g, w in pairs) + abs(sum(map(len, got.cycles)) - sum(map(len, want.cycles)))
        assert differ <= 0.01 * len(pairs), f"{differ} of {len(pairs)} cycles differ"
        return differ

    for k in range(9):
        for batch in (prompts[:1], prompts):
            want = generate(demo_ref, batch, max_new_tokens=48, num_speculative_tokens=k)
            runs = []
            for overlap in (True, False):
                poison(demo_fp32)
                got = demo_fp32.generate(batch, max_new_tokens=48, num_speculative_tokens=k, overlap=overlap)
                assert got.token_ids == want.token_ids, f"k={k}, batch {len(batch)}, overlap={overlap}"
                records_differ(got, want)
                runs.append(got)
                if k >= 1:
                    assert got.stats.acceptance_length > 1.3, "the trained head should be accepted often"
            records_differ(*runs)


@pytest.mark.gpu
def test_gpu_random_model_equals_reference():
    """A random 8-depth model (log-tau inside the depths too), k = 0..8, batch 1 and a ragged batch of 8
    prompts of 1..22 tokens on 4 slots (refills), prefill passes of at most 16 tokens (chunks of 4, 8
    or 16: prompts split over passes, padded rows), with an EOS too (k = 1, 4, 8), with the overlapped
    and the synchronous loop: token ids, cycle records and statistics identical to inkling_ref. Then
    sampling with the reference's uniforms (greedy and sampled drafts, k = 1, 4, 8), both loops."""
    cfg = engine_config(hidden_size=64, num_heads=4, num_kv_heads=2, swa_num_heads=4, swa_num_kv_heads=2,
                        max_position_embeddings=256, num_mtp_depths=8, mtp_apply_log_scaling=True,
                        mtp_layer_types=["sliding", "global", "sliding", "global"] + ["sliding"] * 4)
    model = agreeable_model(cfg, seed=7)
    kw = dict(max_batch_size=4, max_seq_len=64, num_speculative_tokens=8, dtype=torch.float32, prefill_tokens=16,
              prefill_lengths=[4, 8, 16])
    engine = Engine(model, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 5, (1 + 3 * i,), generator=g).tolist() for i in range(8)]
    for k in range(9):
        cases = [(prompts[:1], None), (prompts, None)]
        if k in (1, 4, 8):                                             # an EOS that stops a sequence inside a cycle
            cases.append((prompts, eos_inside_a_cycle(model, prompts, 40, k)))
        for batch, eos_id in cases:
            want = generate(model, batch, max_new_tokens=40, num_speculative_tokens=k, eos_token_id=eos_id)
            for overlap in (True, False):
                poison(engine)
                got = engine.generate(batch, max_new_tokens=40, num_speculative_tokens=k, eos_token_id=eos_id,
                                      overlap=overlap)
                assert_same_result(got, want)
                if k:
                    assert_accepts_and_rejects(got)
                if eos_id is not None:
                    assert eos_cuts(got, eos_id)
    sampler = Engine(model, uniforms="reference", **kw)
    for k in (1, 4, 8):
        for draft_sampling in ("greedy", "sample"):
            args = dict(max_new_tokens=30, num_speculative_tokens=k, temperature=0.8, top_k=4,
                        draft_sampling=draft_sampling, seed=3)
            want = generate(model, prompts, **args)
            for overlap in (True, False):
                poison(sampler)
                assert_same_result(sampler.generate(prompts, overlap=overlap, **args), want)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 8])
def test_gpu_demo_batched_prefill_caches(demo_ref, demo_fp32, k):
    """The demo checkpoint at fp32: prompts of 1, 40, 100 and 250 tokens (sliding window 64) prefilled
    together in passes of at most 128 tokens (the long ones split, padded rows), then a 70-token prompt
    after a cycle of the first: every cache equal to the per-sequence prefill's (demo_fp32, chunks of
    4096) and to the reference's."""
    engine = Engine(DEMO, max_batch_size=8, max_seq_len=256, num_speculative_tokens=8, dtype=torch.float32,
                    prefill_tokens=128)
    src = demo_prompts(8)[7]                                   # 16 + 13 * 7 = 107 tokens
    long = (src * 3)[:250]
    prompts = [src[:1], src[:40], src[:100], long, src[30:100]]
    stops = [len(p) + 4 for p in prompts]
    poison(engine)
    poison(demo_fp32)
    dec = Decoding(k)
    firsts = engine.prefill_batch([1, 4, 6, 7], prompts[:4], dec, stops[:4])
    assert len(engine.timings) >= 3
    for i, (slot, other) in enumerate(zip([1, 4, 6, 7], [0, 1, 2, 3])):
        assert demo_fp32.prefill(other, prompts[i], dec, stops[i]) == firsts[i]
        assert_prefill_state(engine, slot, prompts[i], k, stops[i], firsts[i], demo_fp32, other, demo_ref)
    engine.run_cycle([1], dec)
    first = engine.prefill_batch([0], prompts[4:], dec, stops[4:])[0]
    assert demo_fp32.prefill(4, prompts[4], dec, stops[4]) == first
    assert_prefill_state(engine, 0, prompts[4], k, stops[4], first, demo_fp32, 4, demo_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4, 8])
def test_gpu_demo_caches_after_scripted_cycles(demo_ref, demo_fp32, k):
    prompt = demo_prompts(3)[2]
    rng = random.Random(k)
    script = [k, 0] + [rng.randint(0, k) for _ in range(8)]
    poison(demo_fp32)
    run_scripted_cycles(demo_fp32, demo_ref, prompt, k, script, slot=5)


def counted_accepts(result) -> list[int]:
    """The accepted counts a of every counted cycle (full k, no EOS) of a GenerationResult."""
    return [c.accepted for cycles in result.cycles for c in cycles if c.counted]


def mean_se(x: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of a sample of at least 2 values."""
    m = sum(x) / len(x)
    return m, (sum((v - m) ** 2 for v in x) / (len(x) - 1) / len(x)) ** 0.5


def paired_cycles(a, b) -> list[tuple[int, int]]:
    """(a's accepted count, b's) of the counted cycles that two GenerationResults of the same prompts
    ran on identical contexts: same sequence, same start offset, and both outputs equal up to the end
    of both cycles (so neither trunk chose differently inside them: only the drafts can differ)."""
    pairs = []
    for ta, tb, ca, cb in zip(a.token_ids, b.token_ids, a.cycles, b.cycles):
        agree = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        starts = []
        for cycles in (ca, cb):
            offset, by_start = 1, {}            # token 0 comes from the prefill
            for c in cycles:
                by_start[offset] = c
                offset += len(c.emitted)
            starts.append(by_start)
        for o, x in starts[0].items():
            y = starts[1].get(o)
            if y is not None and x.counted and y.counted and o + max(len(x.emitted), len(y.emitted)) <= agree:
                pairs.append((x.accepted, y.accepted))
    return pairs


def test_paired_cycles_and_mean_se():
    """The statistics of the bf16 test below, on hand-made records (CPU)."""
    from types import SimpleNamespace as NS
    from inkling_ref.decoding.generation import CycleRecord

    def rec(a, emitted, counted=True):
        return CycleRecord(k=2, drafts=[0, 0], accepted=a, emitted=emitted, counted=counted)

    x = NS(token_ids=[[5, 1, 2, 3, 4, 6, 7], [9, 1, 1]],
           cycles=[[rec(2, [1, 2, 3]), rec(0, [4]), rec(1, [6, 7])], [rec(1, [1, 1], counted=False)]])
    y = NS(token_ids=[[5, 1, 2, 3, 4, 8, 8], [9, 1, 1]],
           cycles=[[rec(1, [1, 2]), rec(1, [3, 4]), rec(0, [8]), rec(0, [8])], [rec(1, [1, 1])]])
    # sequence 0: only the cycles starting at offset 1 pair (offset 3 holds a cycle of y alone; the
    # cycles at offset 5 run past the first disagreement, token 5); sequence 1: x's cycle is not counted
    assert paired_cycles(x, y) == [(2, 1)]
    assert paired_cycles(y, x) == [(1, 2)]
    m, se = mean_se([1.0, 2.0, 4.0, 5.0])
    assert m == 3.0 and abs(se - (10 / 3 / 4) ** 0.5) < 1e-12


@pytest.mark.gpu
def test_gpu_demo_bf16_equals_its_plain_decoding_up_to_near_ties(demo_ref, demo_fp32):
    """bf16: speculative output == the same engine's plain decoding (k = 0), except from a first
    divergence where the trunk's top-2 logits (fp32 reference) are within 0.05.

    And bf16 drafts are as good as fp32 drafts (k = 4, 8), checked as statistics of the accepted count
    a per cycle against the fp32 engine's:
      * on the cycles the two engines ran on identical contexts (`paired_cycles`, at least 20), the
        mean of the paired differences is within 3 standard errors of 0 (no bias either way);
      * over all counted cycles, the two acceptance lengths mean(a + 1) are within 3 standard errors
        of their difference. Once an output leaves the other at a near tie the two engines draft on
        different text, so these are two samples; a fixed tolerance (5 % was tried) is about one
        standard error at 8 prompts x 64 tokens, which the demo checkpoint exceeds at k = 4."""
    engine = Engine(DEMO, max_batch_size=8, max_seq_len=256, num_speculative_tokens=8, dtype=torch.bfloat16)
    prompts = demo_prompts(8)
    plain = engine.generate(prompts, max_new_tokens=64, num_speculative_tokens=0).token_ids
    for k in (1, 4, 8):
        spec = engine.generate(prompts, max_new_tokens=64, num_speculative_tokens=k)
        for prompt, p, s in zip(prompts, plain, spec.token_ids):
            j = next((i for i, (x, y) in enumerate(zip(p, s)) if x != y), None)
            if j is None:
                continue
            with torch.no_grad():
                logits = demo_ref.logits(torch.tensor([prompt + p[:j]], device="cuda"))[0, -1].float()
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] < 0.05, f"k={k}: diverged at token {j} with a trunk margin {top2[0] - top2[1]:.3f}"
        if k in (4, 8):
            ref = demo_fp32.generate(prompts, max_new_tokens=64, num_speculative_tokens=k)
            (mb, sb), (mf, sf) = mean_se(counted_accepts(spec)), mean_se(counted_accepts(ref))
            pairs = paired_cycles(spec, ref)
            md, sd = mean_se([x - y for x, y in pairs]) if len(pairs) >= 2 else (float("nan"), 0.0)
            info = (f"k={k}: acceptance length bf16 {mb + 1:.3f} +- {sb:.3f} ({len(counted_accepts(spec))} cycles), "
                    f"fp32 {mf + 1:.3f} +- {sf:.3f} ({len(counted_accepts(ref))}); {len(pairs)} paired cycles, "
                    f"{sum(x == y for x, y in pairs)} with equal counts, mean difference {md:+.3f} +- {sd:.3f}")
            print(info)
            assert len(pairs) >= 20, info
            assert abs(md) <= 3 * sd, info
            assert abs(mb - mf) <= 3 * (sb ** 2 + sf ** 2) ** 0.5, info


@pytest.mark.gpu
def test_gpu_cycle_has_no_host_sync_and_replays_as_graphs(model):
    """The cycle and a batched prefill pass (split prompts, padded rows) run eagerly under sync-debug
    "error" (greedy and sampled, with a padded row), and the graph engine (one replay per step)
    produces exactly what the eager engine produces, sampling with device uniforms included."""
    prompts = [[1, 2, 3, 4, 0], [2], [0, 1, 4]]
    graphs = Engine(model, max_batch_size=4, max_seq_len=40, num_speculative_tokens=3, dtype=torch.float32)
    eager = Engine(model, max_batch_size=4, max_seq_len=40, num_speculative_tokens=3, dtype=torch.float32,
                   use_cuda_graphs=False, batch_sizes=[2, 4], prefill_tokens=8, prefill_lengths=[2, 4])
    for dec in (Decoding(3), Decoding(3, SamplingParams(0.9, top_k=3), "sample")):
        eager.prefill_batch([1, 2], prompts[:2], dec, [30, 30])        # compile first
        eager.prefill(0, prompts[0], dec, 30)
        batch = eager.make_batch([0], 3)
        eager.steps.cycle(batch, dec)
        with sync_debug_error_but_result_waits() as waits:
            eager.steps.cycle(batch, dec)
            eager.prefill_batch([1, 2], prompts[:2], dec, [30, 30])
        assert len(waits) == len(eager.timings) == 2                   # two passes: [1..5] in chunks of 4 + 1
    steps = 0
    for kw in (dict(), dict(temperature=0.9, top_k=3, draft_sampling="sample", seed=7)):
        got = graphs.generate(prompts, max_new_tokens=20, **kw)
        steps += len(graphs.timings)                  # one replay per step (a pass or a cycle of the batch)
        want = eager.generate(prompts, max_new_tokens=20, **kw)
        assert_same_result(got, want)
    assert not eager.graphs
    assert sum(g.replays for g in graphs.graphs.values()) == steps > 0


@contextlib.contextmanager
def sync_debug_error_but_result_waits():
    """torch.cuda.set_sync_debug_mode("error") inside: any synchronizing CUDA call raises (a blocking
    copy, .item(), a stream or device sync), except torch.cuda.Event.synchronize, the engine's wait for a
    step's result copy, which is let through and counted (the events waited on, yielded as a list)."""
    waits, wait = [], torch.cuda.Event.synchronize

    def counted_wait(event):
        torch.cuda.set_sync_debug_mode(0)
        try:
            wait(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")
        waits.append(event)

    torch.cuda.synchronize()
    torch.cuda.Event.synchronize = counted_wait
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield waits
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.Event.synchronize = wait


@pytest.mark.gpu
@pytest.mark.parametrize("sampling", [False, True])
def test_gpu_overlapped_loop_waits_only_for_the_result_copies(model, sampling):
    """A whole overlapped `generate` (6 prompts on 4 slots: refills, prompts split over prefill passes,
    an EOS), once its graphs are captured, under sync-debug "error": any synchronizing CUDA call raises
    (a blocking copy, .item(), a stream or device sync), except the one wait per step for its result
    copy (torch.cuda.Event.synchronize, counted: one per step). Same result as the synchronous loop."""
    engine = Engine(model, max_batch_size=4, max_seq_len=48, num_speculative_tokens=3, dtype=torch.float32,
                    prefill_tokens=16, prefill_lengths=[4, 8, 16])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 5, (n,), generator=g).tolist() for n in (1, 9, 20, 3, 14, 6)]
    kw = dict(max_new_tokens=24)
    if sampling:
        kw.update(temperature=0.9, draft_sampling="sample", seed=2)
    kw["eos_token_id"] = engine.generate(prompts, overlap=False, **kw).token_ids[2][12]   # stops sequence 2 early
    want = engine.generate(prompts, overlap=False, **kw)
    engine.generate(prompts, overlap=True, **kw)                     # captures what the overlapped schedule needs
    captured = len(engine.graphs)
    with sync_debug_error_but_result_waits() as waits:
        got = engine.generate(prompts, overlap=True, **kw)
    assert_same_result(got, want)
    assert len(waits) == len(engine.timings) and len(set(map(id, waits))) == len(waits)
    assert len(engine.graphs) == captured
    assert any(len(t) < 24 for t in got.token_ids) and sum(t.kind == "prefill" for t in engine.timings) >= 4


@pytest.mark.gpu
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_gpu_sampled_distribution_with_device_uniforms(model, draft_sampling):
    """Philox uniforms on the device: the first three tokens of 4000 sequences (x_L from the prefill,
    then a cycle with k_eff = 1: an accepted draft + bonus, or a correction + a k_eff = 0 cycle) follow
    the trunk's own sampling distribution (exact, from the reference's logits): chi-square, p > 1e-3."""
    engine = Engine(model, max_batch_size=64, max_seq_len=16, num_speculative_tokens=2, dtype=torch.float32)
    prompt, N, params = [1, 2, 3], 4000, SamplingParams(1.0)
    res = engine.generate([prompt] * N, max_new_tokens=3, temperature=1.0, draft_sampling=draft_sampling, seed=2)
    assert_first_three_tokens_follow_the_trunk(model, res, prompt, params)
    assert_accepts_and_rejects(res)
