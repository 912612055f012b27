"""Shared pieces of the MoE tests: the reference layer and its tensors, random routings and expert weights,
the real-size layer, and the checks that the few-token path (`moe_experts`, `moe`) and the many-token path
(`moe_grouped_experts`, `moe_grouped`) must both pass.

An `experts` function below is either expert kernel: experts(x, chosen, weights, w13, w2, shared_w13,
shared_w2, out=None) -> y [N, H]; its `twin` takes the same tensors (chosen int64) and no out. A
`layer_fn` is either whole layer: layer_fn(x, *layer, out=None) -> y [N, H], where `layer` holds the
tensors of `params` (router_weight, router_bias, gate_global_scale, route_scale, top_k, w13, w2,
shared_w13, shared_w2).
"""

from __future__ import annotations

import pytest
import torch
from helpers import TOL, poison, randn, run_without_sync_then_capture

from configs import tiny_config
from inkling_fast.kernels.moe_router import moe_route, moe_route_torch
from inkling_ref.model.moe import MoE
from inkling_ref.model.random_init import randomize_
from inkling_ref.testing import rel_l2

SMALL = dict(H=64, F=32, R=16, K=3, S=2)          # CPU sizes (the interpreter is slow)


def reference_moe(H, F, R, K, S, seed, dtype=torch.float32, route_scale=2.5) -> MoE:
    """A randomized inkling_ref.model.moe.MoE of these widths, in eval mode."""
    cfg = tiny_config(hidden_size=H, moe_intermediate_size=F, n_routed_experts=R, num_experts_per_tok=K,
                      n_shared_experts=S, route_scale=route_scale)
    return randomize_(MoE(cfg), seed).to(dtype).eval()


def params(m: MoE, dtype=None, device="cpu"):
    """The reference module's tensors in the order of `moe` / `moe_torch` (after x)."""
    t = lambda p, dt=dtype: p.detach().to(device=device, dtype=dt or p.dtype).contiguous()  # noqa: E731
    return (t(m.router), t(m.router_bias, m.router_bias.dtype), t(m.gate_global_scale, m.router_bias.dtype),
            m.route_scale,
            m.top_k, t(m.experts_gate_up), t(m.experts_down), t(m.shared_gate_up), t(m.shared_down))


def random_routing(N, R, K, S, gen, collide=False):
    """chosen [N, K] distinct per token (collide: every token picks experts 0..K-1, in shuffled order),
    weights [N, K + S] positive, not normalized (the expert kernels must not assume it)."""
    if collide:
        chosen = torch.stack([torch.randperm(K, generator=gen) for _ in range(N)])
    else:
        chosen = torch.stack([torch.randperm(R, generator=gen)[:K] for _ in range(N)])
    return chosen, torch.rand(N, K + S, generator=gen) + 0.1


def expert_weights(R, S, F, H, dtype, device, gen):
    """w13 [R, 2F, H], w2 [R, H, F], shared_w13 [S, 2F, H], shared_w2 [S, H, F] (None, None for S = 0),
    random at the scale of a unit-variance input."""
    return (randn(R, 2 * F, H, dtype=dtype, device=device, gen=gen, scale=H ** -0.5),
            randn(R, H, F, dtype=dtype, device=device, gen=gen, scale=F ** -0.5),
            randn(S, 2 * F, H, dtype=dtype, device=device, gen=gen, scale=H ** -0.5) if S else None,
            randn(S, H, F, dtype=dtype, device=device, gen=gen, scale=F ** -0.5) if S else None)


def experts_case(N, H, F, R, K, S, dtype, device, seed, routing=random_routing):
    """(x, chosen, weights, w): x [N, H] of dtype, a routing drawn by routing(N, R, K, S, gen) (chosen
    int64 [N, K], weights float32 [N, K + S]) and the expert weights w of `expert_weights`, in that order
    from one CPU generator seeded `seed`, all on device."""
    g = torch.Generator().manual_seed(seed)
    x = randn(N, H, dtype=dtype, device=device, gen=g)
    chosen, weights = routing(N, R, K, S, g)
    return x, chosen.to(device), weights.to(device), expert_weights(R, S, F, H, dtype, device, g)


def assert_experts_match_twin(experts, twin, x, chosen, weights, w):
    """experts(x, chosen, weights, *w, out=out) writes into a poisoned out and returns it, within TOL of the
    twin; in bf16 also within TOL of float64 math on the same (bf16) values."""
    out = poison(torch.empty_like(x))
    y = experts(x, chosen, weights, *w, out=out)
    assert y is out
    assert rel_l2(y, twin(x, chosen.long(), weights, *w)) <= TOL[x.dtype]
    if x.dtype == torch.bfloat16:
        want = twin(x.double(), chosen.long(), weights.double(), *[t.double() for t in w])
        assert rel_l2(y, want) <= TOL[x.dtype]


def check_odd_widths_and_no_shared(experts, twin, device, H, F, S, N):
    """N float32 tokens over 7 experts, top-2, at widths H and F (not multiples of the tiles: masked K loops
    and tiles) with S shared experts (0: none): the expert kernel matches its twin."""
    x, chosen, weights, w = experts_case(N, H, F, 7, 2, S, torch.float32, device, seed=H + F + S)
    assert_experts_match_twin(experts, twin, x, chosen, weights, w)


def check_forced_routing(layer_fn, device, dtype, N):
    """A huge selection bias on experts 5, 6, 7 of the SMALL reference sends all N tokens there (a collision
    of N tokens per expert, the other experts empty): the router picks exactly those, and the layer in
    dtype (router and experts; bias and scale float32) still matches the reference within TOL (the bias
    picks, it does not weigh), the same bits on a second call."""
    m = reference_moe(**SMALL, seed=40)
    with torch.no_grad():
        m.router_bias[[5, 6, 7]] = 50.0
        x = randn(N, SMALL["H"], gen=torch.Generator().manual_seed(41))
        want = m(x)
    p = params(m, dtype=dtype, device=device)
    chosen, _ = moe_route(x.to(device, dtype), *p[:5])
    assert (chosen.sort(1).values == torch.tensor([5, 6, 7], device=device, dtype=torch.int32)).all()
    y = layer_fn(x.to(device, dtype), *p)
    assert rel_l2(y, want) <= TOL[dtype]
    assert torch.equal(layer_fn(x.to(device, dtype), *p), y)          # deterministic: bit for bit again


def error_case(device):
    """Valid SMALL arguments for 3 tokens: (x, chosen, weights, (w13, w2, shared_w13, shared_w2), router,
    bias, scale); a test breaks one of them at a time."""
    H, F, R, K, S = SMALL.values()
    x, chosen, weights, w = experts_case(3, H, F, R, K, S, torch.float32, device, seed=60)
    g = torch.Generator().manual_seed(61)
    router = randn(R + S, H, device=device, gen=g)
    return x, chosen, weights, w, router, torch.zeros(R, device=device), torch.ones(1, device=device)


def check_errors_name_the_argument(experts, layer_fn, device):
    """The checks both paths share: a bad expert-kernel or layer argument raises a ValueError that names it."""
    x, chosen, weights, (w13, w2, s13, s2), router, bias, scale = error_case(device)
    H, K, R = x.shape[1], chosen.shape[1], bias.shape[0]
    with pytest.raises(ValueError, match="x must be"):
        experts(x[0], chosen, weights, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="w2 has shape"):
        experts(x, chosen, weights, w13, w2[:, :, :-1], s13, s2)
    with pytest.raises(ValueError, match="w13 must be"):
        experts(x, chosen, weights, w13.bfloat16(), w2, s13, s2)
    with pytest.raises(ValueError, match="shared_w13 and shared_w2"):
        experts(x, chosen, weights, w13, w2, s13, None)
    with pytest.raises(ValueError, match="weights has shape"):
        experts(x, chosen, weights[:, :K], w13, w2, s13, s2)
    with pytest.raises(ValueError, match="chosen must be"):
        experts(x, chosen.float(), weights, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="out has shape"):
        experts(x, chosen, weights, w13, w2, s13, s2, out=torch.empty(4, H, device=device))
    with pytest.raises(ValueError, match="top_k"):
        layer_fn(x, router, bias, scale, 2.5, R + 1, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="must add up"):
        layer_fn(x, router[:-1], bias, scale, 2.5, K, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="route_scale"):
        layer_fn(x, router, bias, scale, float("nan"), K, w13, w2, s13, s2)


# ----------------------------------------------------------------------------- GPU: real sizes
WIDTHS = {"Inkling-Small": (4096, 2048), "Inkling": (6144, 3072)}
R_REAL, K_REAL, S_REAL, ROUTE_SCALE = 256, 6, 2, 8.0


def real_layer(H, F, seed):
    """Random bf16 weights at real size, drawn on the GPU (29 GB for Inkling)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s, std: (torch.randn(*s, device="cuda", generator=g) * std).bfloat16()  # noqa: E731
    router = r(R_REAL + S_REAL, H, std=2.0 / H ** 0.5)
    bias = torch.randn(R_REAL, device="cuda", generator=g) * 0.2
    scale = torch.tensor([1.3], device="cuda")
    w13 = torch.empty(R_REAL, 2 * F, H, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(R_REAL, H, F, dtype=torch.bfloat16, device="cuda")
    for e in range(0, R_REAL, 32):    # in slices: no float32 copy of the whole tensor
        w13[e: e + 32] = r(min(32, R_REAL - e), 2 * F, H, std=H ** -0.5)
        w2[e: e + 32] = r(min(32, R_REAL - e), H, F, std=F ** -0.5)
    return router, bias, scale, ROUTE_SCALE, K_REAL, w13, w2, r(S_REAL, 2 * F, H, std=H ** -0.5), \
        r(S_REAL, H, F, std=F ** -0.5)


def check_routing(chosen, weights, x, layer):
    """The kernel's routing against the twin: the same sets except at near ties of the k-th score
    (different float32 summation orders), where the kernel's pick must be within 1e-5 of the twin's."""
    chosen_t, weights_t = moe_route_torch(x, *layer[:5])
    R = layer[1].shape[0]
    s = torch.sigmoid(x.float() @ layer[0].float().T)[:, :R] + layer[1]
    kth = s.gather(1, chosen_t).min(1).values
    ok = torch.tensor([set(a) == set(b) for a, b in zip(chosen.tolist(), chosen_t.tolist())], device=x.device)
    near = (s.gather(1, chosen.long()).min(1).values - kth).abs() <= 1e-5
    assert (ok | near).all() and (~ok).sum().item() <= max(1, len(ok) // 10)
    order, order_t = chosen.long().argsort(1), chosen_t.argsort(1)
    K = chosen.shape[1]
    assert rel_l2(weights[ok][:, :K].gather(1, order[ok]), weights_t[ok][:, :K].gather(1, order_t[ok])) <= 1e-5


def check_captured_in_a_cuda_graph(layer_fn, twin, layer, N, same_bits_as_eager):
    """GPU only. layer_fn on N bf16 tokens of the real-size `layer` (see `real_layer`) runs without a host
    sync (sync debug mode 'error') and is captured in a CUDA graph; each of three replays on new inputs
    (output poisoned first) is within TOL of the experts' twin on the router's choice, and with
    same_bits_as_eager equals an eager call bit for bit."""
    H = layer[0].shape[1]
    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    y = torch.empty(N, H, dtype=torch.bfloat16, device="cuda")
    layer_fn(x, *layer, out=y)                       # compile outside the checked region
    graph = run_without_sync_then_capture(lambda: layer_fn(x, *layer, out=y))
    for _ in range(3):
        x.copy_(torch.randn(N, H, device="cuda", generator=g).bfloat16())
        poison(y)
        graph.replay()
        torch.cuda.synchronize()
        if same_bits_as_eager:
            assert torch.equal(y, layer_fn(x, *layer))
        chosen, weights = moe_route(x, *layer[:5])
        assert rel_l2(y, twin(x, chosen.long(), weights, *layer[5:])) <= TOL[torch.bfloat16]
