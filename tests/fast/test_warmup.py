"""Engine.warmup: the setup of a request paid up front (inkling_fast/warmup.py). On a GPU
test_compile_count.py counts the builds and captures themselves; here the contract that holds
everywhere: warming up changes no result, the build counter counts what Triton's hook reports, and
the build-only trace on meta tensors launches exactly what the real steps launch."""

import pytest
import torch
from test_engine import DEVICE, agreeable_model, assert_same_result, engine_config
from test_engine import exact_fp32, one_thread  # noqa: F401 (its autouse fixtures: TF32 off, one CPU thread)

from inkling_fast import Engine, forward
from inkling_fast.engine import DecodeMode
from inkling_fast.warmup import SetupReport, build_record, count_kernel_builds, launches_build_only, to_meta, trace_steps
from inkling_ref.sampling import SamplingParams
from inkling_ref import generate


def test_warmup_then_generate_equals_reference():
    model = agreeable_model(engine_config(), seed=7)
    engine = Engine(model, max_batch_size=1, max_seq_len=20, num_speculative_tokens=2, dtype=torch.float32,
                    device=DEVICE)
    report = engine.warmup([3, 1, 4], max_new_tokens=5, num_speculative_tokens=2)
    assert isinstance(report, SetupReport) and report.seconds > 0
    if DEVICE == "cpu":                                   # interpreted: nothing is built, no graph exists
        assert report.kernels_built is None and report.graphs_captured == 0
        assert str(report).startswith("setup ") and "graphs captured: 0" in str(report)
    else:
        assert report.graphs_captured == 2 and report.kernels_built is not None
    got = engine.generate([3, 1, 4], max_new_tokens=5, num_speculative_tokens=2)
    assert_same_result(got, generate(model, [3, 1, 4], max_new_tokens=5, num_speculative_tokens=2))
    assert engine.warmup([3, 1, 4], max_new_tokens=5, num_speculative_tokens=2).graphs_captured == 0


def test_build_counter_counts_hook_calls_and_restores_the_previous_hook():
    knobs = pytest.importorskip("triton").knobs
    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: seen.append(kw.get("key"))
    try:
        with count_kernel_builds() as built:
            assert built == [0]
            for key in ("a", "b", "c"):                  # what Triton does after each kernel build
                knobs.runtime.jit_post_compile_hook(key=key)
        assert built == [3] and seen == ["a", "b", "c"]  # counted, and the hook found there still called
        knobs.runtime.jit_post_compile_hook(key="d")     # after the block: no longer counted
        assert built == [3] and seen[-1] == "d"
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_to_meta_keeps_shape_strides_offset_and_alignment():
    base = torch.zeros(5, 24, device=DEVICE)
    view = base[1:, 3:19:2]                                  # offset 27 floats, strides (24, 2)
    m = to_meta([(view, 7), {"kept": 1}])
    t = m[0][0]
    assert t.device.type == "meta" and m[0][1] == 7 and m[1] == {"kept": 1}
    assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == \
        (view.shape, view.stride(), view.storage_offset(), view.dtype)
    assert t.data_ptr() == 27 * 4                            # an address whose alignment class is the view's


RAGGED = [[3, 1, 4, 1, 0, 2, 0, 3, 1, 4, 4, 2, 1, 3, 0, 2, 2, 1, 4, 3], [2], [4, 4, 0, 1, 2, 3, 1]]
MODES = {"greedy": DecodeMode(),
         "sampled": DecodeMode(SamplingParams(0.8, None, 0.9), "sample")}


@pytest.fixture(scope="module")
def engine3():
    """Three slots, a prefill budget of 24 tokens: the 20-token prompt takes two passes."""
    model = agreeable_model(engine_config(), seed=5)
    return Engine(model, max_batch_size=3, max_seq_len=40, num_speculative_tokens=3, dtype=torch.float32,
                  device=DEVICE, use_cuda_graphs=False, prefill_tokens=24)


@pytest.mark.parametrize("mode, paths", [("sampled", "few"), ("greedy", "many")])
def test_trace_launches_what_the_steps_launch(engine3, mode, paths, monkeypatch):
    """Per step of the request: the kernels launched (in order, with their constexpr arguments) by the
    trace on the meta twin are those of the step run for real on the engine's tensors. Sampled with the
    few-token MoE, and greedy with the many-token MoE and LM head (forced from one token and one row
    on): between them, every kernel the engine has."""
    if paths == "many":
        monkeypatch.setattr(forward, "MANY_TOKENS", 1)
        monkeypatch.setattr(forward, "MANY_ROWS", 1)
    keys = engine3.request_steps([len(p) for p in RAGGED], 3, MODES[mode])
    # one row per pass (24 tokens fit one row of T = 24 or 16): 20 tokens, then 1 and 7 in passes of 16
    assert [key[:-2] for key in keys] == [("prefill", 1, 24), ("prefill", 1, 16), ("cycle", 1), ("cycle", 2),
                                          ("cycle", 3)]
    for key in keys:
        traced, ran = [], []
        trace_steps(engine3, [key], traced)
        with torch.no_grad(), launches_build_only(ran, run=True):
            engine3.step(key, engine3.padding_input(key))
        assert traced and traced == ran, f"{key}: the trace launched {len(traced)} kernels, the step {len(ran)}"


def test_request_steps_cover_what_generate_runs(engine3):
    """The steps a real generate runs are among request_steps, and every (kernel, constexprs) it launches
    is launched by the trace of those steps (sampled: its steps launch every kernel greedy ones do but
    the greedy acceptance)."""
    m = MODES["sampled"]
    keys = engine3.request_steps([len(p) for p in RAGGED], 3, m)
    traced, ran = [], []
    trace_steps(engine3, keys, traced)
    with launches_build_only(ran, run=True):
        engine3.generate(RAGGED, max_new_tokens=[12, 9, 8], num_speculative_tokens=3, seed=1,
                         temperature=m.params.temperature, top_p=m.params.top_p, draft_sampling=m.draft_sampling)
    steps = {(t.kind, *t.shape) for t in engine3.timings}
    assert steps <= {key[:-2] for key in keys}, f"generate ran {sorted(steps)}, request_steps gave {keys}"
    missed = set(ran) - set(traced)
    assert ran and not missed, f"generate launched what the trace did not: {sorted(missed)[:3]}"


def test_build_record_names_what_the_specializations_depend_on(engine3):
    """Two engines built alike share a record; other steps, another cache length or another decode mode
    do not (warmup.build_record)."""
    keys = engine3.request_steps([20, 1], 3, MODES["greedy"])
    record = build_record(engine3, keys)
    assert record is not None and record.name.endswith(".built")

    def like(**changes):
        args = dict(max_batch_size=3, max_seq_len=40, num_speculative_tokens=3, dtype=torch.float32,
                    device=DEVICE, use_cuda_graphs=False, prefill_tokens=24) | changes
        return Engine(agreeable_model(engine_config(), seed=6), **args)

    assert build_record(like(), keys) == record                        # weights' values do not matter
    assert build_record(like(max_seq_len=41), keys) != record
    assert build_record(engine3, keys[:-1]) != record
    assert build_record(engine3, engine3.request_steps([20, 1], 3, MODES["sampled"])) != record


def test_meta_tensors_reach_a_kernel_only_inside_a_build_only_trace():
    """A wrapper given meta tensors refuses them in one line outside the trace (where a launch would
    run on no memory) and takes them inside it, where nothing runs."""
    from inkling_fast.kernels.rms_norm import rms_norm

    x, w = torch.empty(3, 8, device="meta"), torch.empty(8, device="meta")
    with pytest.raises(ValueError, match="x is a meta tensor.*build-only trace"):
        rms_norm(x, w, 1e-6)
    with launches_build_only():
        rms_norm(x, w, 1e-6)
    with pytest.raises(ValueError, match="meta tensor"):       # the block's end withdraws the permission
        rms_norm(x, w, 1e-6)
