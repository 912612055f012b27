"""Write a seeded random tiny Inkling (trunk + 8 MTP depths) in the released layout.

    python scripts/make_random_checkpoint.py DIR [--seed 0]

Random weights accept almost no drafts; this checkpoint exists to exercise loading, the CLI and the
cycle end to end. The trained demo checkpoint (scripts/train_demo.py) is the bundled default."""

import argparse

import torch

from inkling_ref import InklingConfig, random_model, save_checkpoint


def tiny_random_config() -> InklingConfig:
    return InklingConfig(
        vocab_size=512, unpadded_vocab_size=500, hidden_size=64, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rel_extent=32,
        swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=16, sliding_window=16,
        d_rel=8, log_scaling_n_floor=None,
        layer_types=["sliding", "global", "sliding", "global"], mlp_types=["dense", "moe", "moe", "moe"],
        dense_intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, route_scale=2.0, mup=4.0, max_position_embeddings=1024,
        num_mtp_depths=8, mtp_layer_types=["sliding", "global", "sliding", "global", "sliding", "sliding",
                                           "sliding", "sliding"],
        bos_token_id=1, eos_token_id=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = random_model(tiny_random_config(), seed=args.seed, dtype=torch.float32)
    save_checkpoint(model, args.out, overwrite=True)
    print(f"wrote a random tiny Inkling ({sum(p.numel() for p in model.parameters()):,} parameters) to {args.out}")


if __name__ == "__main__":
    main()
