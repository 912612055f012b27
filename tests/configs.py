"""Tiny configs shared by the tests: small enough for CPU, odd enough to catch shape bugs."""

from inkling_ref import InklingConfig


def tiny_config(**overrides) -> InklingConfig:
    """4 layers: sliding/dense, global/dense, sliding/MoE, global/MoE; GQA 2 and 4; short window and
    extents so that sequences of ~40 tokens cross them; log-tau active from position 7; 2 MTP depths."""
    base = dict(
        vocab_size=97, unpadded_vocab_size=91, hidden_size=48, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=12, rel_extent=16,
        swa_num_heads=4, swa_num_kv_heads=1, swa_head_dim=8, sliding_window=8,
        d_rel=5, log_scaling_n_floor=7, log_scaling_alpha=0.3,
        layer_types=["sliding", "global", "sliding", "global"],
        mlp_types=["dense", "dense", "moe", "moe"],
        dense_intermediate_size=40, moe_intermediate_size=24,
        n_routed_experts=7, num_experts_per_tok=3, n_shared_experts=2, route_scale=2.5,
        mup=3.0, rms_norm_eps=1e-6, conv_kernel_size=4, max_position_embeddings=256,
        num_mtp_depths=2, mtp_layer_types=["sliding", "global"],
    )
    base.update(overrides)
    return InklingConfig(**base)
