"""The trunk reference against Hugging Face transformers' InklingForCausalLM (an implementation
nobody here wrote), on random configs with every parameter randomized, in float64.

transformers computes its RMSNorms, short convs, router and softmax in float32 even in a float64
model, so the bound is a relative L2 error of 1e-6 (measured: about 2e-7)."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")
from transformers import InklingForCausalLM, InklingTextConfig  # noqa: E402

from configs import tiny_config  # noqa: E402
from inkling_ref.io import transformers_layout  # noqa: E402
from inkling_ref.model.attention import log_tau  # noqa: E402
from inkling_ref.io.names import to_released  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402
from mutants import load_mutant  # noqa: E402

BOUND = 1e-6

CONFIGS = {
    # sliding GQA 4, global GQA 2; dense then MoE; log-tau from position 7
    "mixed": tiny_config(num_mtp_depths=0, mtp_layer_types=[]),
    # GQA 1 on global layers, 2 on sliding; conv kernel 3; odd widths
    "gqa1": tiny_config(num_mtp_depths=0, mtp_layer_types=[], num_layers=5, num_heads=3, num_kv_heads=3,
                        head_dim=10, swa_num_heads=6, swa_num_kv_heads=3, swa_head_dim=6, sliding_window=5,
                        rel_extent=11, conv_kernel_size=3, log_scaling_n_floor=4, log_scaling_alpha=0.2,
                        layer_types=["global", "sliding", "sliding", "global", "sliding"],
                        mlp_types=["moe", "dense", "moe", "moe", "dense"], route_scale=1.7, mup=5.0,
                        n_routed_experts=9, num_experts_per_tok=2, n_shared_experts=1),
    # the default layer pattern (layer 5 global), dense_mlp_idx 2, GQA 4 global, 1 sliding
    "pattern": tiny_config(num_mtp_depths=0, mtp_layer_types=[], num_layers=6, layer_types=[],
                           mlp_types=["dense", "dense", "moe", "moe", "moe", "moe"], num_heads=8,
                           num_kv_heads=2, head_dim=8, swa_num_heads=2, swa_num_kv_heads=2,
                           sliding_window=7, rel_extent=13, log_scaling_n_floor=3, route_scale=8.0,
                           mup=16.0, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=6),
}
SEQ_LEN = 45  # longer than every window (<= 8) and relative extent (<= 16)


def hf_model(ref_model):
    """A transformers model holding exactly the reference model's (float64) weights."""
    cfg = ref_model.config
    hc = InklingTextConfig(**cfg.to_transformers_dict())
    hc._experts_implementation = "eager"
    hc._attn_implementation = "eager"
    hf = InklingForCausalLM(hc).to(torch.float64).eval()
    released = {to_released(n): p.detach() for n, p in ref_model.named_parameters()}
    sd = transformers_layout.match_model_names(transformers_layout.from_released(released), hf.state_dict())
    hf.load_state_dict(sd, strict=True)
    return hf


def parity_error(package, cfg, seed):
    ref = package.random_model(cfg, seed=seed, dtype=torch.float64)
    hf = hf_model(ref)
    ids = torch.randint(0, cfg.vocab_out, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return rel_l2(ref.logits(ids), hf(ids).logits)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name):
    cfg = CONFIGS[name]
    # the test really exercises log-tau and the extents
    assert max(log_tau(torch.arange(SEQ_LEN), cfg.log_scaling_n_floor, cfg.log_scaling_alpha)) > 1.05
    assert SEQ_LEN > max(cfg.sliding_window, cfg.rel_extent)
    assert "sliding" in cfg.layer_types and "global" in cfg.layer_types
    assert "dense" in cfg.mlp_types and "moe" in cfg.mlp_types
    import inkling_ref
    err = parity_error(inkling_ref, cfg, seed=11)
    print(f"{name}: relative L2 error vs transformers = {err:.2e}")
    assert err < BOUND


def test_random_model_is_nontrivial():
    """Every norm weight and scale is away from 1, and the router bias changes the top-k."""
    import inkling_ref
    cfg = CONFIGS["mixed"]
    m = inkling_ref.random_model(cfg, seed=3)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight") or name.endswith("global_scale"):
            assert (p - 1).abs().min() > 0, name
            assert (p - 1).abs().mean() > 0.1, name
    moe = m.trunk.layers[2].mlp
    x = torch.randn(64, cfg.hidden_size)
    with torch.no_grad():
        chosen, _, _ = moe.route(x)
        s = torch.sigmoid(x @ moe.router.T)[:, : moe.num_routed]
        unbiased = torch.topk(s, moe.top_k, dim=-1).indices
    differ = (chosen.sort(-1).values != unbiased.sort(-1).values).any(-1).float().mean()
    assert differ > 0.2, f"the router bias changes the top-k of only {differ:.0%} of tokens"


MUTANTS = {
    "w13 split in halves": [("model/mlp.py", 'gu = rearrange(gu, "... (f two) -> ... f two", two=2)\n    g, u = gu[..., 0], gu[..., 1]',
                             'g, u = gu.chunk(2, dim=-1)')],
    "1/sqrt(hd) scale": [("model/attention.py", "/ hd + bias", "/ math.sqrt(hd) + bias")],
    "bias not zeroed beyond extent": [("model/attention.py", "inside = (distance >= 0) & (distance < E)",
                                       "inside = distance >= 0")],
    "router bias in the weights": [("model/moe.py", "active = torch.cat([s.gather(1, chosen)",
                                    "active = torch.cat([(s[:, : self.num_routed] + self.router_bias.to(dt)).gather(1, chosen)")],
    "sconv without residual": [("model/conv.py", "y = x.to(dt) + torch.einsum", "y = torch.einsum")],
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_parity_catches_mutant(mutant, tmp_path):
    pkg = load_mutant(tmp_path, MUTANTS[mutant])
    errs = [parity_error(pkg, cfg, seed=11) for cfg in CONFIGS.values()]
    print(f"{mutant}: errors {[f'{e:.1e}' for e in errs]}")
    assert max(errs) > 1e3 * BOUND, f"the parity test does not notice '{mutant}'"
