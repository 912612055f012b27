"""Engine.warmup: the setup of a request paid up front (inkling_fast/warmup.py). On a GPU
test_compile_count.py counts the builds and captures themselves; here the contract that holds
everywhere: warming up changes no result, and the build counter counts what Triton's hook reports."""

import pytest
import torch
from test_engine import DEVICE, agreeable_model, assert_same_result, engine_config
from test_engine import exact_fp32, one_thread  # noqa: F401 (its autouse fixtures: TF32 off, one CPU thread)

from inkling_fast import Engine
from inkling_fast.warmup import SetupReport, count_kernel_builds
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
