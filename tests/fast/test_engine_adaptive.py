"""The fast engine with k changing from cycle to cycle (inkling_ref.decoding.adaptive; catch-up passes,
inkling_fast/catchup.py), float32 against the reference.

A scripted k per cycle (long stretches at k = 1 then a jump to the most depths; every k in turn;
k = 0 between) through `generate` on one sequence: the tokens equal plain greedy decoding (lossless),
every cycle's record (its k, drafts, accepted count) equals the reference's under the same script, and
afterwards every depth's cache rows that the engine counts as valid equal the reference's and the
teacher-forced chained fold over the committed tokens. The tiny model's rings wrap within ~15
positions, so a catch-up that read history a depth had overwritten would fail here. `auto` through the
fast engine: test_engine_auto.py.
"""

import pytest
import torch
from test_engine import (DEVICE, TOL, agreeable_model, compare_rows, engine_config, exact_fp32,  # noqa: F401
                         intact, one_thread, poison)

from inkling_fast import Engine
from inkling_ref import generate, speculative as S
from inkling_ref.decoding.adaptive import ScriptedDepths

SCRIPTS = {
    "k=1 stretch, then the most": [1] * 12 + [4] * 6,
    "every k in turn": [4, 2, 0, 3, 1, 4, 0, 0, 2, 4, 1, 3],
    "down after long acceptances": [4, 4, 1, 4, 4, 2, 4, 4, 1, 1, 4],
}


@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(), seed=3)


def reference_cycles(model, prompt, max_new_tokens, script):
    """The reference's cycle driven by hand with the script (greedy): its final state and records."""
    state, ks = S.prefill(model, prompt), list(script)
    records, out = [], [state.tokens[-1]]
    while len(out) < max_new_tokens:
        k = ks.pop(0) if ks else script[-1]
        k_eff = min(k, max_new_tokens - len(out) - 1)
        d = S.draft(model, state, k_eff)
        v = S.verify(model, state, d.tokens)
        a, b = S.accept_greedy(d.tokens, v.logits)
        S.commit(state, d.tokens, a, b, v)
        out += d.tokens[:a] + [b]
        records.append((k, d.tokens, a))
    return state, records


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_scripted_k_equals_reference_and_keeps_the_caches(model, name):
    script, N = SCRIPTS[name], 36
    prompt = [1, 2, 3, 4, 0, 1, 2, 3, 3, 1, 4]
    engine = Engine(model, max_batch_size=2, max_seq_len=64, num_speculative_tokens=4, dtype=torch.float32,
                    device=DEVICE)
    poison(engine)
    got = engine.generate(prompt, N, ScriptedDepths(list(script)))
    plain = generate(model, prompt, N, 0)
    want = generate(model, prompt, N, ScriptedDepths(list(script)))
    assert got.token_ids == plain.token_ids == want.token_ids               # lossless, any k sequence
    assert got.cycles == want.cycles                                         # k, drafts, a: cycle by cycle
    assert any(t.kind == "catchup" for t in engine.timings), "the script should need a catch-up pass"

    state, records = reference_cycles(model, prompt, N, script)
    assert [(c.planned, c.drafts, c.accepted) for c in got.cycles[0]] == records
    tokens = state.tokens
    assert engine.state.tokens[0, : len(tokens)].tolist() == tokens
    oracle = S.teacher_forced_depth_caches(model, tokens)
    for m in range(4):
        valid = state.depth_valid[m]                                         # the reference's claim, by its rules
        top, n = len(prompt) - 2 - 4, len(prompt) + 1                        # the highest row depth m wrote
        for k, _, a in records:
            top = max(top, n - 2) if k > m else top
            n += a + 1
        rows = intact(engine.depth_caches[m], max(top, valid - 1), valid - 1, engine.max_seq_len)
        compare_rows(engine.depth_caches[m], state.depth_caches[m], 0, rows, f"{name}: depth {m} vs reference", TOL)
        compare_rows(engine.depth_caches[m], oracle[m], 0, rows, f"{name}: depth {m} vs fold", TOL)


def test_step_keys_of_different_kinds_never_share_a_graph():
    """A prefill pass and a catch-up pass of the same batch size, length and decoding are different steps
    (different inputs, different kernels): as keys of the engine's graph table they must not be equal."""
    from inkling_fast.step_io import CatchupKey, CycleKey, Decoding, PrefillKey
    dec = Decoding(4)
    graphs = {PrefillKey(16, 32, dec): "prefill", CatchupKey(16, 32, dec): "catch-up", CycleKey(16, dec): "cycle"}
    assert len(graphs) == 3 and graphs[CatchupKey(16, 32, Decoding(4))] == "catch-up"
    assert PrefillKey(16, 32, dec) != CatchupKey(16, 32, dec)
