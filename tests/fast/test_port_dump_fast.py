"""Dumps written by the fast engine (inkling_mtp.fast_dump.capture_fast) checked by the port checker.

CPU (the Triton interpreter): a tiny random 3-depth model, float32 and bfloat16, passes; the same engine
made to run depth 0's weights for every draft step is diagnosed as that mistake.
GPU (@pytest.mark.gpu): the demo checkpoint at k = 8, float32 and bfloat16, passes; the per-depth errors
are printed (docs/port_checker.md quotes them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine import one_thread  # noqa: F401 (its autouse fixture: one CPU thread)

import inkling_ref
from inkling_fast import Engine
from inkling_mtp.fast_dump import capture_fast
from inkling_ref import InklingConfig, random_model, save_checkpoint
from inkling_ref.port_check import check_dump, load_head, read_dump

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"



def tiny_config() -> InklingConfig:
    """2 trunk layers (sliding + dense, global + MoE with log-tau from position 6), window 5, 4 MTP depths
    (sliding, global, sliding, sliding), 40 tokens: small enough for the interpreter."""
    return InklingConfig(
        vocab_size=48, unpadded_vocab_size=40, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, rel_extent=12, swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=5, d_rel=4,
        log_scaling_n_floor=6, layer_types=["sliding", "global"], mlp_types=["dense", "moe"],
        dense_intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, route_scale=1.5, mup=2.0, max_position_embeddings=64, num_mtp_depths=4,
        mtp_layer_types=["sliding", "global", "sliding", "sliding"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, its checkpoint directory, the head read from it)."""
    model = random_model(tiny_config(), seed=3)
    ckpt = tmp_path_factory.mktemp("tiny") / "ckpt"
    save_checkpoint(model, ckpt)
    return model, ckpt, load_head(ckpt, num_depths=3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_engine_dump_passes(tiny, tmp_path, dtype):
    model, _, head = tiny
    engine = Engine(model, max_batch_size=2, max_seq_len=32, num_speculative_tokens=3, dtype=dtype, device=DEVICE)
    capture_fast(engine, [3, 1, 4, 1, 5, 9, 2, 6], 3, 4, tmp_path / "d.safetensors", slot=1)
    dump = read_dump(tmp_path / "d.safetensors")
    assert dump.engine_dtype == dtype and dump["row_position"].min() == 0     # the prefill's rows are in
    r = check_dump(head, dump)
    print(r.render())
    assert r.passed, r.render()
    assert r.correct_error <= (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.slow
def test_fast_engine_running_depth_0_everywhere_is_diagnosed(tiny, tmp_path):
    model, _, head = tiny
    engine = Engine(model, max_batch_size=1, max_seq_len=32, num_speculative_tokens=3, dtype=torch.bfloat16,
                    device=DEVICE)
    engine.W.depths[1:] = [engine.W.depths[0]] * 2          # a port that indexes the depths' weights wrongly
    capture_fast(engine, [3, 1, 4, 1, 5, 9, 2, 6], 3, 4, tmp_path / "d.safetensors")
    r = check_dump(head, read_dump(tmp_path / "d.safetensors"))
    print(r.render())
    assert not r.passed and r.diagnosis[0].mistake == "depth 0's module reused for every draft step"
    assert (r.first_divergence.step, r.first_divergence.depth) == (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_demo_fast_engine_dump_passes(tmp_path, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    k, prompt = 8, json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"][0]["ids"][:200]
    engine = Engine(inkling_ref.DEFAULT_CHECKPOINT, max_batch_size=1, max_seq_len=320, num_speculative_tokens=k,
                    dtype=dtype)
    capture_fast(engine, prompt, k, 10, tmp_path / "d.safetensors")
    head = load_head(inkling_ref.DEFAULT_CHECKPOINT, num_depths=k, device="cuda")
    r = check_dump(head, read_dump(tmp_path / "d.safetensors"))
    print(r.render())
    print("per depth (aggregate / worst row):", [(d.depth, f"{d.error:.2e}", f"{d.worst_row:.2e}") for d in r.depths])
    assert r.passed, r.render()
