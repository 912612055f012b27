"""The request checks and the cycle record that the reference (`inkling_ref.generate`) and the fast
engine (`inkling_fast.Engine`) share: one `generation.validate` under each one's `Limits`, one
`CycleRecord.of_cycle`; and the prompt forms `generate` accepts."""

import numpy as np
import pytest
import torch

from configs import tiny_config
from inkling_ref import CycleRecord, generate, random_model
from inkling_ref.decoding.generation import Limits, normalize_prompts, validate

MODEL = random_model(tiny_config(num_mtp_depths=2), seed=3)  # vocabulary 91, 256 positions, 2 depths


@pytest.mark.parametrize("given", [
    [5, 6, 7], (5, 6, 7), [np.int64(5), 6, np.int32(7)], np.array([5, 6, 7]), torch.tensor([5, 6, 7]),
    torch.tensor([5, 6, 7], dtype=torch.int32), [torch.tensor([5, 6, 7])],
])
def test_one_prompt_in_every_integer_form(given):
    assert normalize_prompts(given) == [[5, 6, 7]]
    assert all(type(t) is int for t in normalize_prompts(given)[0])


def test_a_batch_in_every_integer_form():
    want = [[1, 2, 3], [4, 5, 6]]
    for given in (want, np.array(want), torch.tensor(want), [np.array([1, 2, 3]), [4, 5, 6]]):
        assert normalize_prompts(given) == want
    ragged = [[1, 2], [3]]
    assert normalize_prompts(ragged) == ragged


def test_a_numpy_prompt_decodes_as_its_list():
    a = generate(MODEL, np.array([3, 1, 4]), max_new_tokens=4, num_speculative_tokens=2)
    b = generate(MODEL, [3, 1, 4], max_new_tokens=4, num_speculative_tokens=2)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("drafts,a,b,eos,want_emitted,want_counted", [
    ([7, 8, 9], 3, 4, None, [7, 8, 9, 4], True),     # all accepted, then the bonus
    ([7, 8, 9], 1, 4, None, [7, 4], True),           # d_2 rejected, then the correction
    ([7, 8, 9], 0, 4, None, [4], True),
    ([7, 2, 9], 3, 4, 2, [7, 2], False),             # EOS among the accepted drafts: cut there, not counted
    ([7, 8, 9], 2, 2, 2, [7, 8, 2], False),          # EOS as the next token
    ([7, 8], 2, 4, None, [7, 8, 4], False),          # k_eff = 2 < k = 3 (the length limit): not counted
])
def test_cycle_record(drafts, a, b, eos, want_emitted, want_counted):
    r = CycleRecord.of_cycle(3, drafts, a, b, eos)
    assert (r.k, r.drafts, r.accepted, r.emitted, r.counted) == (len(drafts), drafts, a, want_emitted, want_counted)


def test_limits_name_their_owner():
    """The same check speaks of the model, an engine's caches, or the command line's flags."""
    ref = Limits.of_model(MODEL)
    engine = Limits(91, ((256, "the model's maximum length {n}"), (20, "the engine's max_seq_len={n}")), 2,
                    "{k_arg} is beyond this engine's {depths} loaded MTP depths")
    with pytest.raises(ValueError, match=r"^num_speculative_tokens=3 needs 3 MTP depths; the model has 2 loaded$"):
        validate(ref, [[1, 2]], 4, 3)
    with pytest.raises(ValueError, match=r"^num_speculative_tokens=3 is beyond this engine's 2 loaded MTP depths$"):
        validate(engine, [[1, 2]], 4, 3)
    with pytest.raises(ValueError, match=r"beyond the engine's max_seq_len=20: at most 18 new tokens fit$"):
        validate(engine, [[1, 2]], 19, 2)
    validate(ref, [[1, 2]], 19, 2)  # the model alone has room
    flags = {"max_new_tokens": "--max-new-tokens", "prompt_ids": "the prompt (--prompt-ids)"}
    with pytest.raises(ValueError, match=r"^the prompt \(--prompt-ids\) has 2 tokens; with --max-new-tokens 255 "):
        validate(ref, [[1, 2]], 255, 0, flags=flags)
    with pytest.raises(ValueError, match=r"^prompt 1 has token ids out of range 0..90: \[91\]$"):
        validate(ref, [[1, 2], [91]], 4, 0)


def test_the_engine_validates_with_the_shared_check():
    """Engine.validate is generation.validate under the engine's limits: what the reference refuses, the
    engine refuses with the same words (its own limits aside), including checks the engine's former copy
    lacked (a seed or EOS id of the wrong kind)."""
    from inkling_fast import Engine
    engine = Engine(MODEL, max_batch_size=1, max_seq_len=24, num_speculative_tokens=2, dtype=torch.float32,
                    device="cpu", use_cuda_graphs=False)
    ref = Limits.of_model(MODEL)
    for args, kwargs in [(([[1, 91]], 4, 2, "greedy"), {}), (([[]], 4, 2, "greedy"), {}),
                         (([[1, 2]], 0, 2, "greedy"), {}), (([[1, 2]], 4, 2, "beam"), {}),
                         (([[1, 2]], 4, 2, "greedy"), dict(seed=1.5)),
                         (([[1, 2]], 4, 2, "greedy"), dict(eos_token_id=91))]:
        with pytest.raises(ValueError) as want:
            validate(ref, *args, **kwargs)
        with pytest.raises(ValueError) as got:
            engine.validate(*args, **kwargs)
        assert str(got.value) == str(want.value)
    with pytest.raises(ValueError, match="beyond the engine's max_seq_len=24"):
        engine.validate([[1, 2]], 23, 2, "greedy")
