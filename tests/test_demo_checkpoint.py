"""The bundled demo checkpoint (trained, 8 MTP depths) in float64 on the committed held-out prompts:
speculative greedy output equals plain greedy output, and the acceptance length at k = 4 has not
regressed below 0.9 x the value measured when the checkpoint was made (scripts/eval_demo.py)."""

import json
from pathlib import Path

import pytest
import torch

from inkling_ref import generate, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "inkling_ref" / "default_checkpoint"


@pytest.fixture(scope="module")
def reference():
    return json.loads((ROOT / "docs" / "benchmarks" / "demo_acceptance.json").read_text())["ci_reference"]


def test_speculative_equals_plain_and_acceptance_holds(reference):
    prompts = json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"][: reference["prompts"]]
    ids = [p["ids"] for p in prompts]
    assert all(len(p) > 128 for p in ids)  # longer than the sliding window (64) and the extent (128)
    model = load_checkpoint(CHECKPOINT, dtype=torch.float64, num_mtp_depths=reference["k"])
    plain = generate(model, ids, max_new_tokens=reference["new_tokens"])
    spec = generate(model, ids, max_new_tokens=reference["new_tokens"], num_speculative_tokens=reference["k"])
    assert spec.token_ids == plain.token_ids
    s = spec.stats
    print(f"acceptance length {s.acceptance_length:.4f} over {s.num_cycles} cycles "
          f"(made: {reference['acceptance_length']:.4f}); per-position {[round(v, 3) for v in s.per_position.values()]}")
    assert s.num_cycles >= 200
    assert s.acceptance_length >= 0.9 * reference["acceptance_length"]
    assert s.acceptance_length >= 2.0  # the target at k = 4 (greedy, held-out code)


def test_checkpoint_is_within_the_size_budget():
    files = {p.name: p.stat().st_size for p in CHECKPOINT.iterdir()}
    assert {"config.json", "model.safetensors", "mtp.safetensors", "tokenizer.json", "README.md"} <= set(files)
    assert sum(files.values()) <= 25_000_000
    assert all(size < 15 * 2**20 for size in files.values())
    cfg = json.loads((CHECKPOINT / "config.json").read_text())
    assert cfg["mtp_config"]["num_nextn_predict_layers"] == 8
    assert cfg["mtp_config"]["local_layer_ids"] == [0, 2, 4, 5, 6, 7]


def test_mtp_weights_left_random_are_caught(reference, tmp_path):
    """The public-engine bug 'MTP weights silently not loaded': a loader that leaves the head random
    still decodes losslessly, so only the acceptance check can see it. It must."""
    from mutants import load_mutant
    pkg = load_mutant(tmp_path, [("io/checkpoint.py", "                t = s.get_tensor(released)\n",
                                  "                t = s.get_tensor(released)\n"
                                  "                if released.startswith('model.mtp.'):  # MUTANT: head left random\n"
                                  "                    t = torch.randn_like(t.float()).to(t.dtype) * 0.02\n")])
    prompts = json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"][:2]
    model = pkg.load_checkpoint(CHECKPOINT, dtype=torch.float32, num_mtp_depths=4)
    res = pkg.generate(model, [p["ids"] for p in prompts], max_new_tokens=40, num_speculative_tokens=4)
    assert res.stats.acceptance_length < 0.9 * reference["acceptance_length"]
