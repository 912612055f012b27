"""A short engine run for compute-sanitizer: batched prefill passes with chunk splits and padding,
padded cycle batches, ring wrap-around, both host loops, eager and graphs.

    compute-sanitizer --tool memcheck python scripts/sanitize_engine.py

A tiny random Inkling (sliding window 8, conv kernel 4, a dense and an MoE layer, 3 MTP depths) on the
GPU, k = 3, max_batch_size 4 with the single captured batch size 4. Five prompts (1, 6, 13, 30 and 2
tokens) on the 4 slots: prefill passes of at most 16 tokens (4 rows of 4 tokens, or fewer rows of 8 or
16) split the 13- and 30-token prompts over several passes with padded rows and chunk tails, the fifth
prompt is prefilled into the first freed slot between cycles, and cycles run with padded rows as
sequences stop. Every sequence reaches 40+ positions, so the sliding KV rings (12 rows), the conv
rings (7 rows) and the hidden ring (8 rows) wrap several times. Greedy (overlapped and synchronous
loop, and with an EOS) and sampled (device uniforms, sampled drafts), float32 eager and bfloat16 in
CUDA graphs (the reference runs on the CPU: memcheck slows every GPU launch down). Memcheck must report 0 errors; the script also checks that the fp32 greedy output
equals inkling_ref.generate's (both loops) and prints OK.
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
    model = random_model(config(), seed=0)            # the reference runs on the CPU: memcheck watches the GPU
    prompts = [[5], [1, 2, 3, 4, 5, 6], list(range(7, 20)), list(range(20, 50)), [60, 61]]
    N = 30
    want = generate(model, prompts, max_new_tokens=N, num_speculative_tokens=3).token_ids
    eos = want[3][N // 2]
    want_eos = generate(model, prompts, max_new_tokens=N, num_speculative_tokens=3, eos_token_id=eos).token_ids
    for dtype, graphs in ((torch.float32, False), (torch.bfloat16, True)):   # eager and captured kernels alike
        engine = Engine(model, max_batch_size=4, max_seq_len=64, num_speculative_tokens=3, dtype=dtype,
                        use_cuda_graphs=graphs, batch_sizes=[4], prefill_tokens=16, prefill_lengths=[4, 8, 16])
        greedy = engine.generate(prompts, max_new_tokens=N).token_ids
        passes = sum(t.kind == "prefill" for t in engine.timings)
        synchronous = engine.generate(prompts, max_new_tokens=N, overlap=False).token_ids
        stopped = engine.generate(prompts, max_new_tokens=N, eos_token_id=eos).token_ids
        sampled = engine.generate(prompts, max_new_tokens=N, temperature=0.8, top_k=20,
                                  draft_sampling="sample", seed=1).token_ids
        torch.cuda.synchronize()
        for out in (greedy, synchronous, sampled):
            assert [len(t) for t in out] == [N] * len(prompts) and all(0 <= x < 64 for t in out for x in t)
        assert passes >= 4, f"expected the prompts split over several prefill passes, got {passes}"
        if dtype == torch.float32:
            assert greedy == want and synchronous == want, f"fp32 greedy differs from inkling_ref (graphs={graphs})"
            assert stopped == want_eos, f"fp32 greedy with an EOS differs from inkling_ref (graphs={graphs})"
        print(f"{dtype} graphs={graphs}: ok ({passes} prefill passes, {len(engine.graphs)} graphs captured)")
    print("sanitize_engine: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
