"""The many-token MoE (grouped GEMM over pairs sorted by expert): its twin against inkling_ref.model.moe.MoE and
moe_torch, the kernels against the twin for odd token counts, tile sizes and widths, routing extremes (every
token on one expert, most experts empty, the last expert id alone), the whole layer against the reference
and against the few-token `moe`, the dispatch in forward.mlp_forward, errors, and on a GPU the Inkling-Small
widths (256 experts, top-6, 2 shared) at 37 and 576 tokens, all 4096 tokens on six experts, determinism, and
a run without host sync that is captured in a CUDA graph and replayed."""

from functools import partial

import pytest
import torch
from helpers import TOL, device, load_benchmark, poison, randn  # noqa: F401 (fixture)
from moe_helpers import (SMALL, WIDTHS, assert_experts_match_twin, check_captured_in_a_cuda_graph,
                         check_errors_name_the_argument, check_forced_routing, check_odd_widths_and_no_shared,
                         check_routing, error_case, expert_weights, experts_case, params, random_routing,
                         real_layer, reference_moe)

from inkling_fast import forward
from inkling_fast.kernels.moe import moe, moe_torch
from inkling_fast.kernels.moe_grouped import (block_m_for, moe_grouped, moe_grouped_experts,
                                              moe_grouped_experts_torch, moe_grouped_torch)
from inkling_fast.kernels.moe_router import moe_route
from inkling_fast.weights import MoEWeights
from inkling_ref.testing import rel_l2


# ----------------------------------------------------------------------------- twin
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_twin_matches_reference(dtype):
    """In float64 / float32 the twin's rounding of act to x's dtype is no rounding (float32) or exact
    (float64): it must be the reference layer."""
    m = reference_moe(**SMALL, seed=1, dtype=dtype)
    x = randn(23, SMALL["H"], dtype=dtype, gen=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = m(x)
    assert rel_l2(moe_grouped_torch(x, *params(m)), want) <= (1e-12 if dtype == torch.float64 else 1e-5)


def test_twin_bf16_rounds_act_once():
    """bf16: the twin against float64 math on the same bf16 values (within the bf16 tolerance), and against
    moe_torch (which also rounds g, u and every expert output to bf16): close, yet not the same numbers."""
    H, F, R, K, S = SMALL.values()
    g = torch.Generator().manual_seed(3)
    x = randn(40, H, dtype=torch.bfloat16, gen=g)
    chosen, weights = random_routing(40, R, K, S, g)
    w = expert_weights(R, S, F, H, torch.bfloat16, "cpu", g)
    twin = moe_grouped_experts_torch(x, chosen, weights, *w)
    exact = moe_grouped_experts_torch(x.double(), chosen, weights.double(), *[t.double() for t in w])
    assert rel_l2(twin, exact) <= TOL[torch.bfloat16]
    m = reference_moe(**SMALL, seed=4, dtype=torch.bfloat16)
    xs = randn(40, H, dtype=torch.bfloat16, gen=g)
    assert rel_l2(moe_grouped_torch(xs, *params(m)), moe_torch(xs, *params(m))) <= TOL[torch.bfloat16]


# ----------------------------------------------------------------------------- expert kernels
@pytest.mark.parametrize("dtype,N,block_m", [(torch.float32, 1, None), (torch.float32, 3, None),
                                             (torch.float32, 37, 16), (torch.float32, 300, None),
                                             (torch.bfloat16, 3, None), (torch.bfloat16, 37, 16)])
def test_experts_kernel_matches_twin(device, dtype, N, block_m):
    """Odd token counts; 37 tokens at 16 rows per tile (tiles with padding rows, experts over two tiles),
    300 at the default (64 rows: more than `moe` takes)."""
    x, chosen, weights, w = experts_case(N, *SMALL.values(), dtype, device, seed=20 + N)
    experts = partial(moe_grouped_experts, block_m=block_m)
    assert_experts_match_twin(experts, moe_grouped_experts_torch, x, chosen.int(), weights, w)


def routing_case(name: str, N: int, R: int, K: int, S: int, gen):
    """Constructed routings: 'all on one' (k = 1: every token on expert 5), 'all on the last' (k = 1,
    every token on expert R - 1: the last tile boundary), 'three full' (every token on 0, 1, 2 in shuffled
    order, the other experts empty)."""
    if name == "three full":
        chosen = torch.stack([torch.randperm(K, generator=gen) for _ in range(N)])
    else:
        chosen = torch.full((N, K), 5 if name == "all on one" else R - 1, dtype=torch.int64)
    return chosen, torch.rand(N, K + S, generator=gen) + 0.1


@pytest.mark.parametrize("name,K,S,block_m", [("all on one", 1, 0, 16), ("all on the last", 1, 2, 16),
                                              ("three full", 3, 2, 32)])
def test_experts_routing_extremes(device, name, K, S, block_m):
    """One expert takes all 41 tokens (three tiles of 16, the last one padded) and all the others are
    empty: the tile -> expert plan must skip every empty expert, before and after the full one."""
    H, F, R, N = 64, 32, 16, 41
    x, chosen, weights, w = experts_case(N, H, F, R, K, S, torch.float32, device, seed=len(name),
                                         routing=partial(routing_case, name))
    experts = partial(moe_grouped_experts, block_m=block_m)
    assert_experts_match_twin(experts, moe_grouped_experts_torch, x, chosen, weights, w)


@pytest.mark.parametrize("H,F,S,block_m", [(40, 24, 2, 16), (64, 40, 0, 32), (72, 40, 1, None)])
def test_experts_odd_widths_and_no_shared(device, H, F, S, block_m):
    """H, F not multiples of the tiles (masked K loops and column tiles), and S = 0."""
    experts = partial(moe_grouped_experts, block_m=block_m)
    check_odd_widths_and_no_shared(experts, moe_grouped_experts_torch, device, H, F, S, N=19)


def test_block_m_follows_tokens_per_expert():
    assert block_m_for(1, 6, 256) == 16 and block_m_for(576, 6, 256) == 16
    assert block_m_for(1024, 6, 256) == 32 and block_m_for(4096, 6, 256) == 128
    assert block_m_for(7680, 6, 256) == 128 and block_m_for(300, 3, 16) == 64


# ----------------------------------------------------------------------------- the whole layer
def test_moe_grouped_matches_reference(device):
    """Router and experts together, against inkling_ref.model.moe.MoE (float32), at 300 tokens: past `moe`'s limit
    (the two paths on the same tokens: test_mlp_forward_takes_either_path)."""
    N = 300
    m = reference_moe(**SMALL, seed=30)
    x = randn(N, SMALL["H"], gen=torch.Generator().manual_seed(31))
    with torch.no_grad():
        want = m(x)
    y = moe_grouped(x.to(device), *params(m, device=device), out=poison(torch.empty(N, SMALL["H"], device=device)))
    assert rel_l2(y, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_grouped_forced_routing(device, dtype):
    """A huge selection bias on experts 5, 6, 7 sends all 45 tokens there (three full experts, the other
    13 empty): the outputs still match the reference (the bias picks, it does not weigh)."""
    check_forced_routing(moe_grouped, device, dtype, N=45)


def test_no_tokens(device):
    H, F, R, K, S = SMALL.values()
    w = expert_weights(R, S, F, H, torch.float32, device, torch.Generator().manual_seed(1))
    x = torch.empty(0, H, device=device)
    y = moe_grouped_experts(x, torch.empty(0, K, dtype=torch.int32, device=device),
                            torch.empty(0, K + S, device=device), *w)
    assert y.shape == (0, H)


# ----------------------------------------------------------------------------- dispatch in forward.py
@pytest.mark.parametrize("many", [0, 10**9])
def test_mlp_forward_takes_either_path(device, monkeypatch, many):
    """forward.MANY_TOKENS = 0 forces the grouped GEMM, 10**9 the few-token kernels (for <= 256 tokens):
    both give the layer of the reference on [B, T, H] = [3, 5, H]."""
    m = reference_moe(**SMALL, seed=50)
    p = params(m, device=device)
    w = MoEWeights(router=p[0], router_bias=p[1], gate_global_scale=p[2], route_scale=p[3], top_k=p[4],
                   w13=p[5], w2=p[6], shared_w13=p[7], shared_w2=p[8])
    x = randn(3, 5, SMALL["H"], gen=torch.Generator().manual_seed(51))
    with torch.no_grad():
        want = m(x)
    monkeypatch.setattr(forward, "MANY_TOKENS", many)
    called = []
    for name in ("moe", "moe_grouped"):
        real = getattr(forward, name)
        monkeypatch.setattr(forward, name,
                            lambda *a, _real=real, _name=name, **k: called.append(_name) or _real(*a, **k))
    y = forward.mlp_forward(w, x.to(device))
    assert called == (["moe_grouped"] if many == 0 else ["moe"])
    assert y.shape == x.shape and rel_l2(y, want) <= 1e-5


def test_errors_name_the_argument(device):
    """The checks shared with the few-token path, and block_m."""
    check_errors_name_the_argument(moe_grouped_experts, moe_grouped, device)
    x, chosen, weights, w, *_ = error_case(device)
    with pytest.raises(ValueError, match="block_m must be"):
        moe_grouped_experts(x, chosen, weights, *w, block_m=24)


# ----------------------------------------------------------------------------- GPU: Inkling-Small
@pytest.fixture(scope="module")
def small_layer():
    """One random Inkling-Small MoE layer (13 GB of bf16 experts), drawn once for the GPU tests below."""
    layer = real_layer(*WIDTHS["Inkling-Small"], seed=4096)
    yield layer
    del layer
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("N", [37, 576])
def test_real_sizes(small_layer, N):
    """Inkling-Small widths (H 4096, Fm 2048, 256 experts top-6 + 2 shared, bf16), at an odd token count
    and at a batch-64 verify pass (64 x 9): the experts against the twin on the kernel's own routing; the
    layer = route + experts bit for bit, and deterministic; at N <= 256 the same layer as the few-token
    `moe`. (4096 tokens: test_real_size_all_tokens_on_six_experts.)"""
    H, layer = WIDTHS["Inkling-Small"][0], small_layer
    x = torch.randn(N, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(N)).bfloat16()
    chosen, weights = moe_route(x, *layer[:5])
    check_routing(chosen, weights, x, layer)
    y = moe_grouped_experts(x, chosen, weights, *layer[5:],
                            out=poison(torch.empty(N, H, dtype=torch.bfloat16, device="cuda")))
    assert rel_l2(y, moe_grouped_experts_torch(x, chosen.long(), weights, *layer[5:])) <= TOL[torch.bfloat16]
    assert torch.equal(moe_grouped(x, *layer), y)
    if N <= 256:
        assert rel_l2(y, moe(x, *layer)) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_real_size_all_tokens_on_six_experts(small_layer):
    """A selection bias of +100 on six experts (the first and last ids among them) sends all 4096 tokens
    there: six full experts of 32 tiles of 128 rows each, 250 empty ones; the layer still equals the twin."""
    H, layer = WIDTHS["Inkling-Small"][0], list(small_layer)
    favourites = [0, 50, 100, 101, 200, 255]
    layer[1] = layer[1].clone()
    layer[1][favourites] += 100.0
    x = torch.randn(4096, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5)).bfloat16()
    chosen, weights = moe_route(x, *layer[:5])
    assert (chosen.sort(1).values == torch.tensor(favourites, device="cuda", dtype=torch.int32)).all()
    y = moe_grouped(x, *layer, out=poison(torch.empty(4096, H, dtype=torch.bfloat16, device="cuda")))
    assert rel_l2(y, moe_grouped_experts_torch(x, chosen.long(), weights, *layer[5:])) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_without_host_sync_in_a_cuda_graph(small_layer):
    """576 tokens (batch 64 x 9 verify rows): no host sync inside (sync debug mode 'error'), captured in a
    CUDA graph, replayed on new inputs: the replay equals an eager call bit for bit."""
    check_captured_in_a_cuda_graph(moe_grouped, moe_grouped_experts_torch, small_layer, N=576,
                                   same_bits_as_eager=True)


def test_benchmark_dry_run():
    """benchmarks/bench_many_tokens.py imports, builds its cases and passes its checks at tiny sizes (its
    timing runs only on a GPU)."""
    bench = load_benchmark("bench_many_tokens")
    assert bench.SECTION and callable(bench.run)
    bench.dry_run()
    rows = [dict(N=n, few=few, many=many) for n, few, many in [(1, 1, 2), (2, 2, 1), (4, 2, 3), (8, 4, 3), (16, 8, 5)]]
    assert bench.crossover(rows, "N", "few", "many") == 8          # from 8 on, the many-token path never loses
    assert bench.crossover(rows[:3], "N", "few", "many") is None
