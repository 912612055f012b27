"""The engine with the many-token paths forced everywhere (forward.MANY_TOKENS = MANY_ROWS = 0: every MoE
call through `moe_grouped`, every greedy LM head through `lm_head_rows`) against inkling_ref, float32: the
same tokens, cycles and statistics as the reference, as test_engine.py checks for the few-token kernels."""

import torch
from test_engine import DEVICE, agreeable_model, assert_same_result, engine_config, poison
from test_engine import exact_fp32, one_thread  # noqa: F401 (its autouse fixtures: TF32 off, one CPU thread)

from inkling_fast import Engine, forward
from inkling_ref import generate


def test_engine_on_the_many_token_paths_equals_reference(monkeypatch):
    model = agreeable_model(engine_config(), seed=5)
    engine = Engine(model, max_batch_size=2, max_seq_len=24, num_speculative_tokens=3, dtype=torch.float32,
                    device=DEVICE)
    monkeypatch.setattr(forward, "MANY_TOKENS", 0)
    monkeypatch.setattr(forward, "MANY_ROWS", 0)
    called = set()

    def spy(name):
        real = getattr(forward, name)
        return lambda *args, **kwargs: called.add(name) or real(*args, **kwargs)

    for name in ("moe", "moe_grouped", "lm_head_argmax", "lm_head_rows"):
        monkeypatch.setattr(forward, name, spy(name))
    prompts = [[1, 2, 3, 4, 0], [3, 1]]
    poison(engine)
    got = engine.generate(prompts, max_new_tokens=6, num_speculative_tokens=3)
    assert called == {"moe_grouped", "lm_head_rows"}
    assert_same_result(got, generate(model, prompts, max_new_tokens=6, num_speculative_tokens=3))
