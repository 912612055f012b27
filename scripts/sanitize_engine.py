"""A short engine run for compute-sanitizer: padded batches and ring wrap-around, eager and graphs.

    compute-sanitizer --tool memcheck python scripts/sanitize_engine.py

A tiny random Inkling (sliding window 8, conv kernel 4, a dense and an MoE layer, 3 MTP depths) on the
GPU, k = 3, max_batch_size 4 with the single captured batch size 4: three prompts (1, 6 and 13
tokens) run in a batch with one padded row, and more padded rows as sequences stop; every sequence
reaches 40+ positions, so the sliding KV rings (12 rows), the conv rings (7 rows) and the hidden ring
(8 rows) wrap several times. Greedy and sampled (device uniforms, sampled drafts), float32 and
bfloat16, eager and CUDA graphs. Memcheck must report 0 errors; the script also checks that the
fp32 greedy output equals inkling_ref.generate's and prints OK.
"""

import sys

import torch

from inkling_fast import Engine
from inkling_ref import InklingConfig, generate, random_model


def config() -> InklingConfig:
    return InklingConfig(
        vocab_size=72, unpadded_vocab_size=64, hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rel_extent=24,
        swa_num_heads=4, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=8,
        d_rel=8, log_scaling_n_floor=16, log_scaling_alpha=0.2,
        layer_types=["sliding", "global"], mlp_types=["dense", "moe"],
        dense_intermediate_size=96, moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, route_scale=2.0, mup=2.0, conv_kernel_size=4, max_position_embeddings=128,
        num_mtp_depths=3, mtp_layer_types=["sliding", "global", "sliding"])


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_engine: needs a CUDA GPU", file=sys.stderr)
        return 2
    model = random_model(config(), seed=0).to("cuda")
    prompts = [[5], [1, 2, 3, 4, 5, 6], list(range(7, 20))]
    N = 30
    want = generate(model, prompts, max_new_tokens=N, num_speculative_tokens=3).token_ids
    for dtype in (torch.float32, torch.bfloat16):
        for graphs in (False, True):
            engine = Engine(model, max_batch_size=4, max_seq_len=48, num_speculative_tokens=3, dtype=dtype,
                            use_cuda_graphs=graphs, batch_sizes=[4])
            greedy = engine.generate(prompts, max_new_tokens=N).token_ids
            sampled = engine.generate(prompts, max_new_tokens=N, temperature=0.8, top_k=20,
                                      draft_sampling="sample", seed=1).token_ids
            torch.cuda.synchronize()
            for out in (greedy, sampled):
                assert [len(t) for t in out] == [N] * 3 and all(0 <= x < 64 for t in out for x in t)
            if dtype == torch.float32:
                assert greedy == want, f"fp32 greedy differs from inkling_ref (graphs={graphs})"
            print(f"{dtype} graphs={graphs}: ok ({len(engine.graphs)} graphs captured)")
    print("sanitize_engine: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
