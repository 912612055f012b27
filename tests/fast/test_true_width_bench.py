"""benchmarks/true_width.py's own arithmetic, on the CPU: the memory plan it sizes the slice with
against what an Engine of that slice allocates, and the closed form of the attended keys its FLOP
floor uses against a count."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import load_benchmark

from inkling_fast import Engine

tw = load_benchmark("true_width")
true_scale = load_benchmark("true_scale")


def tensor_bytes(*objs) -> int:
    seen, total = set(), 0
    for obj in objs:
        for t in (getattr(obj, f.name) for f in dataclasses.fields(obj)):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("k", [1, 3])
def test_memory_plan_matches_the_engine(k):
    """Weights, caches and slot state of the plan == the bytes of an Engine of the same slice (tiny
    widths; the router bias, kept in float32, is the only weight not in the model dtype)."""
    cfg = true_scale.inkling_small(
        hidden_size=32, num_heads=2, num_kv_heads=1, swa_num_heads=2, swa_num_kv_heads=1, head_dim=16, swa_head_dim=16,
        sliding_window=6, rel_extent=12, d_rel=4, dense_intermediate_size=24, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, vocab_size=200, unpadded_vocab_size=150,
        max_position_embeddings=64, num_layers=4, layer_types=["sliding", "sliding", "sliding", "global"],
        mlp_types=["dense", "dense", "moe", "moe"], num_mtp_depths=3, mtp_layer_types=["sliding", "global", "sliding"])
    head = true_scale.random_head(cfg, k, device="cpu")
    blocks = [true_scale.random_block(cfg, t, m, "cpu", seed=i) for i, (t, m) in enumerate(zip(cfg.layer_types, cfg.mlp_types))]
    W = dataclasses.replace(head, blocks=blocks)
    slots, max_seq_len = 3, 40
    engine = Engine(W, max_batch_size=slots, max_seq_len=max_seq_len, num_speculative_tokens=k, dtype=torch.bfloat16,
                    device="cpu")
    plan = tw.memory_plan(cfg, slots, max_seq_len, k, prefill_tokens=64)
    moe_layers = cfg.mlp_types.count("moe")
    assert true_scale.weight_bytes(W) == plan["weights"] + moe_layers * cfg.n_routed_experts * 2
    assert tensor_bytes(*engine.trunk_caches, *engine.depth_caches) == plan["caches"]
    assert tensor_bytes(engine.state) == plan["state"]


def test_attended_keys_closed_form():
    for window in (None, 1, 5):
        for first in range(0, 12):
            for last in range(first, 20):
                count = sum(min(p + 1, window) if window else p + 1 for p in range(first, last))
                assert tw._keys(first, last, window) == count, (first, last, window)
