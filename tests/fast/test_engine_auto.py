"""`num_speculative_tokens="auto"` through the fast engine, float32 against the reference: lossless,
reporting which k ran, learning into the engine's acceptance counts; what the policy is shown (the
batch's rate while a prompt waits, each sequence once none waits); the sticky prefill k; a prompt
admitted below the batch's k, whose catch-up pass holds that sequence alone; and (GPU) that every graph
an auto request needs is captured before it starts.
"""

import random
import time

import pytest
import torch
from test_engine import DEVICE, agreeable_model, engine_config, exact_fp32, one_thread, poison  # noqa: F401
from test_engine_adaptive import reference_cycles

from inkling_fast import Engine, graphs
from inkling_fast.prefill_plan import possible_passes
from inkling_fast.step_io import PrefillKey
from inkling_ref import generate
from inkling_ref.decoding.adaptive import AdaptiveDepth


@pytest.fixture(scope="module")
def model():
    return agreeable_model(engine_config(), seed=3)


def small_engine(model):
    """Two slots, k up to 4, float32; prefill passes of 8 or 16 tokens a row (these prompts are short, and
    the interpreter's time grows with the padded rows)."""
    return Engine(model, max_batch_size=2, max_seq_len=64, num_speculative_tokens=4, dtype=torch.float32,
                  device=DEVICE, prefill_lengths=[8, 16])


def test_auto_is_lossless_and_reports_the_ks_it_ran(model):
    engine = small_engine(model)
    prompts = [[1, 2, 3, 4, 0, 1], [2, 3]]
    got = engine.generate(prompts, 12, "auto")
    assert got.token_ids == generate(model, prompts, 12, 0).token_ids
    assert sum(got.stats.k_used.values()) == sum(len(c) for c in got.cycles)
    assert set(got.stats.k_used) <= set(range(5)) and engine.policy.max_k == 4
    passes = {t.shape for t in engine.timings if t.kind == "prefill"}    # what a GPU captures before the call
    assert passes and passes <= set(possible_passes([len(p) for p in prompts], engine.prefill_lengths,
                                                    engine.batch_sizes, engine.prefill_tokens))
    assert 0 <= engine.setup_s < got.elapsed_s
    counts = engine.policy.acceptance
    seen = sum(counts.accepted) + sum(counts.rejected)
    assert seen > 0, "auto's cycles should have taught it some acceptance"
    engine.generate(prompts, 8, "auto")                       # the next request learns into the same counts
    assert engine.policy.acceptance is counts and sum(counts.accepted) + sum(counts.rejected) > seen


class Recording(AdaptiveDepth):
    """AdaptiveDepth that records, per decision, the live count and what it was shown of each sequence."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None):
        self.seen.append((live, None if sequences is None else [left for left, _ in sequences]))
        return super().choose(live, batch, remaining, current, catchup_rows, sequences)


def test_auto_sees_each_sequence_once_nothing_waits_and_prefills_at_the_k_it_ran_most(model):
    """While a prompt waits for a slot, the policy maximizes the batch's tokens per ms (no per-sequence
    view); once none waits, it sees each live sequence's tokens left and its own accepted counts. The
    next auto request of that batch size prefills at the k the last one ran most."""
    engine = small_engine(model)
    prompts, limit = [[1, 2, 3, 4, 0, 1], [2, 3], [3, 1, 2]], [4, 8, 8]
    policy = Recording(4, interval=1)
    got = engine.generate(prompts, limit, policy)
    assert got.token_ids == [generate(model, [p], n, 0).token_ids[0] for p, n in zip(prompts, limit)]
    waiting = [s for _, s in policy.seen[1:]]            # [0]: the first decision, for the prefill
    assert waiting[0] is None, "the third prompt waits: the batch's rate"
    shown = [s for s in waiting if s is not None]
    assert shown and all(0 < left <= 8 for s in shown for left in s)
    assert waiting.index(shown[0]) > 0 and all(s is not None for s in waiting[waiting.index(shown[0]):])
    assert all(len(s) == live for (live, s) in policy.seen[1:] if s is not None)

    got = engine.generate(prompts[:2], 6, "auto")
    most = max(got.stats.k_used, key=got.stats.k_used.get)
    key = next(iter(engine.prefill_depth))
    assert engine.prefill_depth == {key: most}
    ks = []
    launch = engine.scheduler.launch_prefill
    engine.scheduler.launch_prefill = lambda pending, dec: ks.append(dec.k) or launch(pending, dec)
    again = engine.generate(prompts[:2], 6, "auto")
    assert ks and set(ks) == {most}
    assert again.token_ids == generate(model, prompts[:2], 6, 0).token_ids


class PrefillLow(AdaptiveDepth):
    """AdaptiveDepth that prefills at k = 1 (its first decision) and runs every cycle at k = 4."""
    def choose(self, live, batch, remaining, current, catchup_rows=None, sequences=None):
        return 1 if current is None else 4


def test_a_prompt_admitted_below_the_batch_k_catches_up_alone(model):
    """Serving: a prompt takes a freed slot, prefilled at k = 1 while the batch runs k = 4. Only its depth
    rows are missing, so its catch-up pass holds that sequence alone (batch size 1), and each sequence's
    drafts then equal the reference's cycle driven by the same ks (a catch-up that wrote another slot,
    or none, changes them)."""
    engine = small_engine(model)
    poison(engine)
    prompts, limit = [[1, 2, 3, 4, 0, 1], [2, 3, 1, 4, 4, 0, 2], [3, 1, 2, 0, 4, 1, 1, 3, 2]], [3, 12, 8]
    got = engine.generate(prompts, limit, PrefillLow(4))
    catchups = [t for t in engine.timings if t.kind == "catchup"]
    shapes = [(t.shape[0], t.rows) for t in catchups]        # (padded batch size, sequences that miss rows)
    assert shapes[0] == (2, 2) and shapes[-1] == (1, 1), shapes  # both first prompts, then the newcomer alone
    for i, (prompt, n) in enumerate(zip(prompts, limit)):
        assert got.token_ids[i] == generate(model, [prompt], n, 0).token_ids[0]
        ks = [c.planned for c in got.cycles[i]]
        _, records = reference_cycles(model, prompt, n, ks)
        assert [(c.planned, c.drafts, c.accepted) for c in got.cycles[i]] == records, f"sequence {i}"


class RecordedGraph:
    """A CPU stand-in for graphs.StepGraph: records when the step's graph would be captured, and replays
    by running the step on its static input (what a replay computes)."""
    def __init__(self, pool, step, padding_input):
        self.step, self.input, self.replays, self.captured_s = step, padding_input, 0, time.perf_counter()

    def run(self, host_input, upload):
        upload(host_input, self.input)
        self.replays += 1
        return self.step(self.input)


def test_auto_captures_its_prefill_passes_before_the_request_starts(model, monkeypatch):
    """Through graphs (recorded on the CPU): every prefill pass of an auto request (AdaptiveDepth; here one
    that prefills at k = 1, below the engine's 4), the one of a prompt admitted into a freed slot
    included, replays a graph captured at that k before the request's timer started (its cycles are
    captured before it only on a GPU, where their costs are measured up front)."""
    monkeypatch.setattr(graphs, "StepGraph", RecordedGraph)
    engine = small_engine(model)
    engine.runner.use_cuda_graphs = True
    prompts, limit = [[1, 2, 3], [2, 3, 1, 4], [3, 1]], [2, 4, 3]
    got = engine.generate(prompts, limit, PrefillLow(4))
    assert got.token_ids == [generate(model, [p], n, 0).token_ids[0] for p, n in zip(prompts, limit)]
    passes = [t for t in engine.timings if t.kind == "prefill"]
    assert len(passes) >= 2, "the third prompt waits for a slot: a second pass"
    prefill = {key: g for key, g in engine.graphs.items() if isinstance(key, PrefillKey)}
    assert {(key.batch_size, key.length) for key in prefill} >= {t.shape for t in passes}
    assert {key.decoding.k for key in prefill} == {1}, "a request's passes write the depth rows of its prefill k"
    late = [key for key, g in prefill.items() if g.captured_s >= engine.started_s]
    assert not late, f"prefill graphs captured while the request ran: {late}"


@pytest.mark.gpu
def test_gpu_auto_captures_every_graph_before_the_request_starts(model):
    """An auto request's graphs (its cycles and catch-up passes at every k, and every prefill pass it may
    run at its prefill k) are captured before its timer starts, also when its prompts are admitted in
    other groups than in the last call: nothing is captured while a request runs. Lossless throughout."""
    engine = Engine(model, max_batch_size=4, max_seq_len=64, num_speculative_tokens=4, dtype=torch.float32,
                    prefill_tokens=32, prefill_lengths=[4, 8, 16])
    rng = random.Random(5)
    prompts = [[rng.randrange(model.config.vocab_out) for _ in range(rng.randint(1, 20))]
               for _ in range(9)]
    for call in range(3):
        limits = [rng.randint(2, 24) for _ in prompts]        # other finishing times: other admission groups
        got = engine.generate(prompts, limits, "auto")
        assert any(t.kind == "prefill" for t in engine.timings) and engine.setup_s >= 0
        late = [key for key, graph in engine.graphs.items() if graph.captured_s >= engine.started_s]
        assert not late, f"call {call}: graphs captured while the request ran: {late}"
        assert got.token_ids == [generate(model, [p], n, 0).token_ids[0] for p, n in zip(prompts, limits)]
