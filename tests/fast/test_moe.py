"""The small-batch MoE: twin vs inkling_ref.model.moe.MoE, router kernel vs twin (ties, forced routing), expert
kernels vs twin for random routings, collisions, no shared experts and odd widths, the whole layer vs the
reference, mutants of the kernels that the tests must catch, and on a GPU the real widths (256 experts,
top-6, 2 shared) and a run without host sync, replayed from a CUDA graph."""

import importlib
from functools import partial

import pytest
import torch
from helpers import DTYPES, device, load_benchmark, poison, randint, randn  # noqa: F401 (fixture)
from moe_helpers import (SMALL, WIDTHS, assert_experts_match_twin, check_captured_in_a_cuda_graph,
                         check_errors_name_the_argument, check_forced_routing, check_odd_widths_and_no_shared,
                         check_routing, error_case, experts_case, params, random_routing, real_layer,
                         reference_moe)

from inkling_fast.kernels.moe import moe, moe_experts, moe_experts_torch, moe_torch
from inkling_fast.kernels.moe_router import moe_route, moe_route_torch
from inkling_ref.testing import rel_l2
from mutants import load_mutant

def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(dim=1).values.cpu(), b.long().sort(dim=1).values.cpu())


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
    x, chosen, weights, w = experts_case(N, *SMALL.values(), dtype, device, seed=20 + N,
                                         routing=partial(random_routing, collide=collide))
    assert_experts_match_twin(moe_experts, moe_experts_torch, x, chosen.int(), weights, w)


@pytest.mark.parametrize("H,F,S", [(40, 24, 2), (64, 32, 0), (72, 40, 1)])
def test_experts_odd_widths_and_no_shared(device, H, F, S):
    """H, F not multiples of the tiles (masked K loops and tiles), and S = 0 (no shared experts)."""
    check_odd_widths_and_no_shared(moe_experts, moe_experts_torch, device, H, F, S, N=6)


# ----------------------------------------------------------------------------- the whole layer
@pytest.mark.parametrize("N", [1, 3, 17])
def test_moe_kernel_matches_reference(device, N):
    """Router and experts together, against inkling_ref.model.moe.MoE (float32)."""
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
    check_forced_routing(moe, device, dtype, N=20)


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
    """The checks shared with the many-token path, and those of the few-token path alone: its token limit
    and the router's own arguments."""
    check_errors_name_the_argument(moe_experts, moe, device)
    x, chosen, weights, w, router, bias, scale = error_case(device)
    K = chosen.shape[1]
    with pytest.raises(ValueError, match="at most 256"):
        moe_experts(torch.zeros(257, x.shape[1], device=device), chosen, weights, *w)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(x, router, bias, scale, 2.5, bias.shape[0] + 1)
    with pytest.raises(ValueError, match="gate_global_scale"):
        moe_route(x, router, bias, torch.ones(2, device=device), 2.5, K)
    with pytest.raises(ValueError, match="router_weight has shape"):
        moe_route(x, router[:, :-1], bias, scale, 2.5, K)


# ----------------------------------------------------------------------------- GPU: real sizes
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
    layer = real_layer(*WIDTHS["Inkling-Small"], seed=7)
    check_captured_in_a_cuda_graph(moe, moe_experts_torch, layer, N=8, same_bits_as_eager=False)


def test_benchmark_dry_run():
    """benchmarks/bench_moe.py imports, builds its cases and passes its checks at tiny sizes (its timing
    runs only on a GPU, through benchmarks/kernels.py)."""
    bench = load_benchmark("bench_moe")
    assert bench.SECTION and callable(bench.run)
    bench.dry_run()
