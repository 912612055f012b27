"""The small-batch MoE: twin vs inkling_ref.moe.MoE, router kernel vs twin (ties, forced routing), expert
kernels vs twin for random routings, collisions, no shared experts and odd widths, the whole layer vs the
reference, mutants of the kernels that the tests must catch, and on a GPU the real widths (256 experts,
top-6, 2 shared) and a run without host sync, replayed from a CUDA graph."""

import importlib

import pytest
import torch
from helpers import (DTYPES, TOL, device, load_benchmark, poison, randint, randn,  # noqa: F401 (fixture)
                     run_without_sync_then_capture)

from configs import tiny_config
from inkling_fast.kernels.moe import moe, moe_experts, moe_experts_torch, moe_torch
from inkling_fast.kernels.moe_router import moe_route, moe_route_torch
from inkling_ref.moe import MoE
from inkling_ref.random_init import randomize_
from inkling_ref.testing import rel_l2
from mutants import load_mutant

SMALL = dict(H=64, F=32, R=16, K=3, S=2)          # CPU sizes (the interpreter is slow)


def reference_moe(H, F, R, K, S, seed, dtype=torch.float32, route_scale=2.5) -> MoE:
    cfg = tiny_config(hidden_size=H, moe_intermediate_size=F, n_routed_experts=R, num_experts_per_tok=K,
                      n_shared_experts=S, route_scale=route_scale)
    return randomize_(MoE(cfg), seed).to(dtype).eval()


def params(m: MoE, dtype=None, device="cpu"):
    """The reference module's tensors in the order of `moe` / `moe_torch` (after x)."""
    t = lambda p, dt=dtype: p.detach().to(device=device, dtype=dt or p.dtype).contiguous()  # noqa: E731
    return (t(m.router), t(m.router_bias, m.router_bias.dtype), t(m.gate_global_scale, m.router_bias.dtype),
            m.route_scale,
            m.top_k, t(m.experts_gate_up), t(m.experts_down), t(m.shared_gate_up), t(m.shared_down))


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(dim=1).values.cpu(), b.long().sort(dim=1).values.cpu())


def random_routing(N, R, K, S, gen, collide=False):
    """chosen [N, K] distinct per token (collide: every token picks experts 0..K-1, in shuffled order),
    weights [N, K + S] positive, not normalized (the expert kernels must not assume it)."""
    if collide:
        chosen = torch.stack([torch.randperm(K, generator=gen) for _ in range(N)])
    else:
        chosen = torch.stack([torch.randperm(R, generator=gen)[:K] for _ in range(N)])
    return chosen, torch.rand(N, K + S, generator=gen) + 0.1


def expert_weights(R, S, F, H, dtype, device, gen):
    return (randn(R, 2 * F, H, dtype=dtype, device=device, gen=gen, scale=H ** -0.5),
            randn(R, H, F, dtype=dtype, device=device, gen=gen, scale=F ** -0.5),
            randn(S, 2 * F, H, dtype=dtype, device=device, gen=gen, scale=H ** -0.5) if S else None,
            randn(S, H, F, dtype=dtype, device=device, gen=gen, scale=F ** -0.5) if S else None)


# ----------------------------------------------------------------------------- twin vs reference
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_twin_matches_reference(dtype):
    m = reference_moe(**SMALL, seed=1, dtype=dtype)
    g = torch.Generator().manual_seed(2)
    x = randn(17, SMALL["H"], dtype=dtype, gen=g)
    with torch.no_grad():
        want = m(x)
        chosen, w_routed, w_shared = m.route(x)
    chosen_t, weights_t = moe_route_torch(x, *params(m)[:5])
    assert same_sets(chosen_t, chosen)
    assert rel_l2(weights_t, torch.cat([w_routed, w_shared], 1)) <= 1e-6
    assert rel_l2(moe_torch(x, *params(m)), want) <= (1e-12 if dtype == torch.float64 else 1e-5)
    # the bias changes the selection here (so a bias-free router would be caught) ...
    no_bias = moe_route_torch(x, *params(m)[:1], torch.zeros_like(m.router_bias), *params(m)[2:5])[0]
    assert not same_sets(no_bias, chosen)


# ----------------------------------------------------------------------------- router kernel
@pytest.mark.parametrize("N", [1, 3, 17])
@pytest.mark.parametrize("dtype,router_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
def test_route_kernel_matches_twin(device, N, dtype, router_dtype):
    m = reference_moe(**SMALL, seed=N)
    g = torch.Generator().manual_seed(10 + N)
    x = randn(N, SMALL["H"], dtype=dtype, device=device, gen=g)
    p = params(m, device=device)
    router = p[0].to(router_dtype)
    chosen, weights = moe_route(x, router, *p[1:5])
    chosen_t, weights_t = moe_route_torch(x, router, *p[1:5])
    assert chosen.dtype == torch.int32 and weights.dtype == torch.float32
    assert same_sets(chosen, chosen_t)
    # the routed weights belong to their experts: compare in expert-id order
    order, order_t = chosen.long().argsort(1), chosen_t.argsort(1)
    K = SMALL["K"]
    assert rel_l2(weights[:, :K].gather(1, order), weights_t[:, :K].gather(1, order_t)) <= 1e-5
    assert rel_l2(weights[:, K:], weights_t[:, K:]) <= 1e-5


def test_route_ties_go_to_the_lower_expert(device):
    """Experts 3, 9 and 12 have identical router rows and bias: equal scores, and they beat all others.
    top-2 must take 3 and 9; their weights are equal. (Integer-valued x and router rows make the
    logits exact, so the three are equal whatever the summation order.)"""
    H, R, S = 64, 16, 2
    g = torch.Generator().manual_seed(3)
    router = randint(-1, 2, R + S, H, gen=g)
    router[9] = router[3]
    router[12] = router[3]
    bias = torch.zeros(R)
    bias[[3, 9, 12]] = 5.0
    x = randint(-1, 2, 5, H, gen=g)
    x, router, bias = x.to(device), router.to(device), bias.to(device)
    chosen, weights = moe_route(x, router, bias, torch.ones(1, device=device), 1.0, 2)
    assert chosen.tolist() == [[3, 9]] * 5
    assert torch.equal(weights[:, 0], weights[:, 1])
    assert rel_l2(weights.sum(1), torch.ones(5, device=device)) <= 1e-6      # route_scale 1, scale 1


# ----------------------------------------------------------------------------- expert kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,collide", [(1, False), (3, False), (17, False), (40, True), (5, True)])
def test_experts_kernel_matches_twin(device, dtype, N, collide):
    H, F, R, K, S = SMALL.values()
    g = torch.Generator().manual_seed(20 + N)
    x = randn(N, H, dtype=dtype, device=device, gen=g)
    chosen, weights = random_routing(N, R, K, S, g, collide)
    chosen, weights = chosen.to(device), weights.to(device)
    w = expert_weights(R, S, F, H, dtype, device, g)
    out = poison(torch.empty(N, H, dtype=dtype, device=device))
    y = moe_experts(x, chosen.int(), weights, *w, out=out)
    assert y is out
    assert rel_l2(y, moe_experts_torch(x, chosen, weights, *w)) <= TOL[dtype]
    if dtype == torch.bfloat16:        # and against float64 math on the same (bf16) values
        want = moe_experts_torch(x.double(), chosen, weights.double(), *[t.double() for t in w])
        assert rel_l2(y, want) <= TOL[dtype]


@pytest.mark.parametrize("H,F,S", [(40, 24, 2), (64, 32, 0), (72, 40, 1)])
def test_experts_odd_widths_and_no_shared(device, H, F, S):
    """H, F not multiples of the tiles (masked K loops and tiles), and S = 0 (no shared experts)."""
    R, K, N = 7, 2, 6
    g = torch.Generator().manual_seed(H + F + S)
    x = randn(N, H, device=device, gen=g)
    chosen, weights = random_routing(N, R, K, S, g)
    chosen, weights = chosen.to(device), weights.to(device)
    w = expert_weights(R, S, F, H, torch.float32, device, g)
    y = moe_experts(x, chosen, weights, *w, out=poison(torch.empty(N, H, device=device)))
    assert rel_l2(y, moe_experts_torch(x, chosen, weights, *w)) <= 1e-5


# ----------------------------------------------------------------------------- the whole layer
@pytest.mark.parametrize("N", [1, 3, 17])
def test_moe_kernel_matches_reference(device, N):
    """Router and experts together, against inkling_ref.moe.MoE (float32)."""
    m = reference_moe(**SMALL, seed=30 + N)
    g = torch.Generator().manual_seed(31 + N)
    x = randn(N, SMALL["H"], gen=g)
    with torch.no_grad():
        want = m(x)
    y = moe(x.to(device), *params(m, device=device), out=poison(torch.empty(N, SMALL["H"], device=device)))
    assert rel_l2(y, want) <= 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_forced_routing(device, dtype):
    """A huge selection bias on experts 5, 6, 7 sends every token there (a collision of 20 tokens per
    expert): the outputs still match the reference (the bias picks, it does not weigh)."""
    m = reference_moe(**SMALL, seed=40)
    with torch.no_grad():
        m.router_bias[[5, 6, 7]] = 50.0
        x = randn(20, SMALL["H"], gen=torch.Generator().manual_seed(41))
        want = m(x)
    p = params(m, dtype=dtype, device=device)          # router and experts in dtype, bias and scale fp32
    chosen, _ = moe_route(x.to(device, dtype), *p[:5])
    assert (chosen.sort(1).values == torch.tensor([5, 6, 7], device=device, dtype=torch.int32)).all()
    assert rel_l2(moe(x.to(device, dtype), *p), want) <= TOL[dtype]


MUTANTS = {  # name: edits of inkling_fast (file, old, new)
    "bias weighs": [("kernels/moe_router.py", "sv = tl.sum(tl.where(hit, s, 0.0), axis=1)",
                     "sv = tl.sum(tl.where(hit, s + bias[None, :], 0.0), axis=1)")],
    "normalized over routed only": [("kernels/moe_router.py",
                                     "sel_s = tl.where(shared[None, :], tl.sigmoid(zs), sel_s)\n"
                                     "    total = tl.sum(sel_s, axis=1)",
                                     "total = tl.sum(sel_s, axis=1)\n"
                                     "    sel_s = tl.where(shared[None, :], tl.sigmoid(zs), sel_s)")],
    "w13 split in halves": [("kernels/moe.py", "(2 * f)[:, None]", "f[:, None]"),
                            ("kernels/moe.py", "u_ptrs = g_ptrs + H ", "u_ptrs = g_ptrs + F * H ")],
    "highest tie wins": [("kernels/moe_router.py",
                          "idx = tl.min(tl.where(score == m[:, None], e[None, :], BLOCK_R), axis=1)",
                          "idx = tl.max(tl.where(score == m[:, None], e[None, :], -1), axis=1)")],
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutants_are_caught(tmp_path, device, name):
    """Deliberately broken kernels fail the checks above (the tests have teeth)."""
    mutant = load_mutant(tmp_path, MUTANTS[name], package="inkling_fast")
    kernels = importlib.import_module(mutant.__name__ + ".kernels.moe")
    router = importlib.import_module(mutant.__name__ + ".kernels.moe_router")
    if name == "highest tie wins":      # the tie test's setting
        g = torch.Generator().manual_seed(3)
        w = randint(-1, 2, 18, 64, gen=g)
        w[9] = w[3]
        bias = torch.zeros(16)
        bias[[3, 9]] = 5.0
        x = randint(-1, 2, 5, 64, gen=g)
        chosen, _ = router.moe_route(x.to(device), w.to(device), bias.to(device), torch.ones(1, device=device),
                                     1.0, 1)
        assert chosen[:, 0].tolist() == [9] * 5          # caught: the tie test wants [3] * 5
        return
    m = reference_moe(**SMALL, seed=50)
    x = randn(7, SMALL["H"], gen=torch.Generator().manual_seed(51))
    with torch.no_grad():
        want = m(x)
    p = params(m, device=device)
    assert rel_l2(moe(x.to(device), *p), want) <= 1e-5                # the original passes
    assert rel_l2(kernels.moe(x.to(device), *p), want) > 1e-3         # the mutant is far off


def test_errors_name_the_argument(device):
    H, F, R, K, S = SMALL.values()
    g = torch.Generator().manual_seed(60)
    x = randn(3, H, device=device, gen=g)
    w13, w2, s13, s2 = expert_weights(R, S, F, H, torch.float32, device, g)
    chosen, weights = random_routing(3, R, K, S, g)
    chosen, weights = chosen.to(device), weights.to(device)
    with pytest.raises(ValueError, match="x must be"):
        moe_experts(x[0], chosen, weights, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="w2 has shape"):
        moe_experts(x, chosen, weights, w13, w2[:, :, :-1], s13, s2)
    with pytest.raises(ValueError, match="w13 must be"):
        moe_experts(x, chosen, weights, w13.bfloat16(), w2, s13, s2)
    with pytest.raises(ValueError, match="shared_w13 and shared_w2"):
        moe_experts(x, chosen, weights, w13, w2, s13, None)
    with pytest.raises(ValueError, match="weights has shape"):
        moe_experts(x, chosen, weights[:, :K], w13, w2, s13, s2)
    with pytest.raises(ValueError, match="chosen must be"):
        moe_experts(x, chosen.float(), weights, w13, w2, s13, s2)
    with pytest.raises(ValueError, match="at most 256"):
        moe_experts(randn(257, H, device=device, gen=g), chosen, weights, w13, w2, s13, s2)
    router = randn(R + S, H, device=device, gen=g)
    bias, scale = torch.zeros(R, device=device), torch.ones(1, device=device)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(x, router, bias, scale, 2.5, R + 1)
    with pytest.raises(ValueError, match="gate_global_scale"):
        moe_route(x, router, bias, torch.ones(2, device=device), 2.5, K)
    with pytest.raises(ValueError, match="router_weight has shape"):
        moe_route(x, router[:, :-1], bias, scale, 2.5, K)
    with pytest.raises(ValueError, match="must add up"):
        moe(x, router[:-1], bias, scale, 2.5, K, w13, w2, s13, s2)


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


@pytest.mark.gpu
@pytest.mark.parametrize("width", list(WIDTHS))
def test_real_sizes(width):
    H, F = WIDTHS[width]
    layer = real_layer(H, F, seed=H)
    g = torch.Generator(device="cuda").manual_seed(1)
    for N in (1, 4, 64):
        x = torch.randn(N, H, device="cuda", generator=g).bfloat16()
        chosen, weights = moe_route(x, *layer[:5])
        check_routing(chosen, weights, x, layer)
        y = moe_experts(x, chosen, weights, *layer[5:], out=poison(torch.empty(N, H, dtype=torch.bfloat16,
                                                                             device="cuda")))
        assert rel_l2(y, moe_experts_torch(x, chosen.long(), weights, *layer[5:])) <= 1e-2
        assert torch.equal(moe(x, *layer), y)                   # the layer = route + experts, bit for bit
    del layer
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_without_host_sync_in_a_cuda_graph():
    H, F = WIDTHS["Inkling-Small"]
    layer = real_layer(H, F, seed=7)
    g = torch.Generator(device="cuda").manual_seed(8)
    N = 8
    x = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    y = torch.empty(N, H, dtype=torch.bfloat16, device="cuda")
    moe(x, *layer, out=y)                           # compile outside the checked region
    graph = run_without_sync_then_capture(lambda: moe(x, *layer, out=y))
    for _ in range(3):
        x.copy_(torch.randn(N, H, device="cuda", generator=g).bfloat16())
        poison(y)
        graph.replay()
        torch.cuda.synchronize()
        chosen, weights = moe_route(x, *layer[:5])
        assert rel_l2(y, moe_experts_torch(x, chosen.long(), weights, *layer[5:])) <= 1e-2


def test_benchmark_dry_run():
    """benchmarks/bench_moe.py imports, builds its cases and passes its checks at tiny sizes (its timing
    runs only on a GPU, through benchmarks/kernels.py)."""
    bench = load_benchmark("bench_moe")
    assert bench.SECTION and callable(bench.run)
    bench.dry_run()
