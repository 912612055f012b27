"""LM-head argmax without the logits: twin vs inkling_ref's readout, kernel vs twin (random, exact
ties, padding rows, several token blocks), errors, and on a GPU the real sizes and a CUDA graph."""

import pytest
import torch
from helpers import (DTYPES, device, load_benchmark, poison, randint, randn,  # noqa: F401 (fixture)
                     run_without_sync_then_capture)

from configs import tiny_config
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_torch
from inkling_ref import random_model
from inkling_ref.testing import rel_l2


def exact_logits(h: torch.Tensor, W: torch.Tensor, V_out: int, chunk: int = 16384) -> torch.Tensor:
    """(h @ W[:V_out]^T) in float64 on h's device, a chunk of the vocabulary at a time: exact for
    integer-valued inputs, within 1e-12 of exact otherwise."""
    return torch.cat([h.double() @ W[v0: min(v0 + chunk, V_out)].double().T for v0 in range(0, V_out, chunk)], 1)


def exact_argmax(h: torch.Tensor, W: torch.Tensor, V_out: int) -> torch.Tensor:
    """The lowest id reaching the maximum of the float64 logits (CPU tensor)."""
    logits = exact_logits(h, W, V_out)
    ids = torch.arange(V_out, device=logits.device)
    is_max = logits == logits.max(dim=1, keepdim=True).values
    return torch.where(is_max, ids, V_out).min(dim=1).values.cpu()


def assert_is_argmax(ids, h, W, V_out, mup, vals=None, rtol=1e-5):
    """ids[t] is an argmax of (h @ W[:V_out]^T)[t] up to float32 rounding: its float64 logit is within
    rtol * (|h_t| * max_v |W_v|) of the float64 maximum (so only a near tie may pick another id)."""
    logits = exact_logits(h, W, V_out)
    assert ((ids >= 0) & (ids < V_out)).all(), ids
    got = logits.gather(1, ids.to(logits.device)[:, None])[:, 0]
    scale = h.double().norm(dim=1) * torch.cat([W[v0: v0 + 16384, :].double().norm(dim=1)
                                                for v0 in range(0, V_out, 16384)])[:V_out].max()
    assert (got >= logits.max(dim=1).values - rtol * scale).all()
    if vals is not None:
        assert rel_l2(vals, logits.max(dim=1).values / mup) <= rtol


def test_twin_matches_reference_readout():
    """The twin's argmax is torch.argmax of inkling_ref's readout (the truncated, mup-scaled logits)."""
    cfg = tiny_config(vocab_size=131, unpadded_vocab_size=117)
    model = random_model(cfg, seed=3, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    hidden = randn(9, cfg.hidden_size, dtype=torch.float64, gen=g)
    with torch.no_grad():
        ref = model.trunk.readout(hidden)                                   # [9, 117]
    W = model.trunk.unembed.weight.detach()
    ids, vals = lm_head_argmax_torch(hidden, W, cfg.vocab_out, cfg.mup)
    assert torch.equal(ids, ref.argmax(dim=-1))
    assert rel_l2(vals, ref.max(dim=-1).values) <= 1e-6
    # the truncation matters: the padded rows hold larger logits for some rows here
    W_big = W.clone()
    W_big[cfg.vocab_out:] = 50 * hidden[0] / hidden[0].norm()
    ids_pad, _ = lm_head_argmax_torch(hidden, W_big, cfg.vocab_out, cfg.mup)
    assert torch.equal(ids_pad, ids)
    assert (lm_head_argmax_torch(hidden, W_big, None, cfg.mup)[0][0] >= cfg.vocab_out).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,V,V_out", [(1, 40, 300, 290), (3, 72, 257, 200), (17, 64, 130, 130),
                                         (70, 40, 100, 65), (5, 33, 64, 1)])
def test_kernel_matches_twin(device, dtype, T, H, V, V_out):
    g = torch.Generator().manual_seed(T * 1000 + H)
    h = randn(T, H, dtype=dtype, device=device, gen=g)
    W = randn(V, H, dtype=dtype, device=device, gen=g, scale=H ** -0.5)
    ids_out = poison(torch.empty(T, dtype=torch.int64, device=device))
    vals_out = poison(torch.empty(T, dtype=torch.float32, device=device))
    ids, vals = lm_head_argmax(h, W, V_out, mup=3.0, ids_out=ids_out, vals_out=vals_out)
    assert ids is ids_out and vals is vals_out
    twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_out, mup=3.0)
    assert torch.equal(ids, twin_ids)
    assert rel_l2(vals, twin_vals) <= 1e-5                  # float32 accumulation on both sides
    assert_is_argmax(ids, h, W, V_out, 3.0, vals)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_id(device, dtype):
    """Integer-valued inputs make the dot products exact: duplicated rows give true ties, inside one
    64-id group, across groups of one tile and across tiles; the lowest id must win every time."""
    g = torch.Generator().manual_seed(7)
    T, H, V, V_out = 5, 48, 300, 280
    h = randint(-2, 3, T, H, dtype=dtype, gen=g)
    W = randint(-1, 2, V, H, dtype=dtype, gen=g)                  # |other logits| <= sum |h_t|
    copies = {0: [3, 9, 200], 1: [70, 71, 260], 2: [130, 250, 278], 3: [64, 128, 192], 4: [279, 285, 299]}
    for t, rows in copies.items():
        strong = 2 * torch.sign(h[t].float()).to(dtype)           # logit 2 * sum |h_t|: the maximum
        for r in rows:
            W[r] = strong
    h, W = h.to(device), W.to(device)
    want = exact_argmax(h, W, V_out)
    exact = exact_logits(h, W, V_out).cpu()
    ties = (exact == exact.max(dim=1, keepdim=True).values).sum(dim=1)
    assert (ties[:4] >= 2).all()                                  # rows 0-3 really have a tie
    assert want.tolist() == [3, 70, 130, 64, 279]                 # row 4: copies >= V_out do not count
    ids, vals = lm_head_argmax(h, W, V_out)
    assert ids.cpu().tolist() == want.tolist()
    assert torch.equal(vals.cpu().double(), exact.max(dim=1).values)
    assert torch.equal(lm_head_argmax_torch(h, W, V_out)[0].cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_natural_ties(device, dtype):
    """Values in {-1, 0, 1} over a short H: most rows have many tied maxima scattered over the tiles."""
    g = torch.Generator().manual_seed(8)
    T, H, V, V_out = 9, 6, 500, 433
    h = randint(-1, 2, T, H, dtype=dtype, device=device, gen=g)
    W = randint(-1, 2, V, H, dtype=dtype, device=device, gen=g)
    ids, _ = lm_head_argmax(h, W, V_out)
    want = exact_argmax(h, W, V_out)
    assert ids.cpu().tolist() == want.tolist()
    exact = exact_logits(h, W, V_out).cpu()
    assert ((exact == exact.max(dim=1, keepdim=True).values).sum(dim=1) > 1).float().mean() > 0.5


def test_padding_rows_never_win(device):
    g = torch.Generator().manual_seed(9)
    h = randn(4, 40, device=device, gen=g)
    W = randn(200, 40, device=device, gen=g)
    W[150:] = 100 * h[0]                                          # rows >= V_out would win row 0
    ids, _ = lm_head_argmax(h, W, 150)
    assert (ids < 150).all()
    assert torch.equal(ids, lm_head_argmax_torch(h, W, 150)[0])
    assert lm_head_argmax(h, W)[0][0].item() >= 150                # without truncation they do win


def test_errors_name_the_argument(device):
    h = torch.randn(3, 40, device=device)
    W = torch.randn(100, 40, device=device)
    with pytest.raises(ValueError, match="h must be"):
        lm_head_argmax(h[0], W)
    with pytest.raises(ValueError, match="weight has dtype"):
        lm_head_argmax(h, W.double())
    with pytest.raises(ValueError, match="weight has 41 columns"):
        lm_head_argmax(h, torch.randn(100, 41, device=device))
    with pytest.raises(ValueError, match="vocab_out"):
        lm_head_argmax(h, W, 101)
    with pytest.raises(ValueError, match="vocab_out"):
        lm_head_argmax(h, W, 0)
    with pytest.raises(ValueError, match="mup"):
        lm_head_argmax(h, W, 90, mup=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        lm_head_argmax(torch.randn(40, 3, device=device).T, W)
    with pytest.raises(ValueError, match="ids_out"):
        lm_head_argmax(h, W, ids_out=torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="vals_out"):
        lm_head_argmax(h, W, vals_out=torch.empty(4, device=device))


# ----------------------------------------------------------------------------- GPU: real sizes
V_REAL, V_OUT_REAL = 201024, 200058


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 6144])
def test_real_sizes(H):
    g = torch.Generator(device="cuda").manual_seed(H)
    W = randn(V_REAL, H, dtype=torch.bfloat16, device="cuda", gen=g, scale=H ** -0.5)
    rows = mismatches = 0
    for T in (1, 2, 5, 16, 33, 64, 100):
        h = randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g)
        ids, vals = lm_head_argmax(h, W, V_OUT_REAL, mup=16.0)
        twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_OUT_REAL, mup=16.0)
        # both accumulate in float32, in different orders: an id may differ only at a near tie
        assert_is_argmax(ids, h, W, V_OUT_REAL, 16.0, vals, rtol=1e-5)
        assert rel_l2(vals, twin_vals) <= 1e-5
        rows += T
        mismatches += (ids != twin_ids).sum().item()
    assert mismatches <= 2, f"{mismatches} of {rows} rows differ from the twin"


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 6144])
def test_real_size_ties(H):
    g = torch.Generator(device="cuda").manual_seed(H + 1)
    T = 8
    h = randint(-2, 3, T, H, dtype=torch.bfloat16, device="cuda", gen=g)
    W = randint(-1, 2, V_REAL, H, dtype=torch.bfloat16, device="cuda", gen=g)
    for t in range(T):
        strong = 2 * torch.sign(h[t].float()).bfloat16()
        for r in (1000 + 25_000 * t, 1001 + 25_000 * t, 190_000 + t, V_OUT_REAL + t):
            W[r] = strong
    want = exact_argmax(h, W, V_OUT_REAL)
    assert want.tolist() == [1000 + 25_000 * t for t in range(T)]
    ids, _ = lm_head_argmax(h, W, V_OUT_REAL)
    assert ids.cpu().tolist() == want.tolist()


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_without_host_sync():
    """Replaying a captured call on new hidden states gives the new argmax (no host sync inside)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    H, T, V, V_out = 4096, 4, 32768, 32000
    W = randn(V, H, dtype=torch.bfloat16, device="cuda", gen=g, scale=H ** -0.5)
    h_static = randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g)
    ids_static = torch.empty(T, dtype=torch.int64, device="cuda")
    vals_static = torch.empty(T, dtype=torch.float32, device="cuda")
    lm_head_argmax(h_static, W, V_out, 16.0, ids_static, vals_static)        # compile
    graph = run_without_sync_then_capture(lambda: lm_head_argmax(h_static, W, V_out, 16.0, ids_static, vals_static))
    for _ in range(3):
        h_static.copy_(randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g))
        poison(ids_static)
        graph.replay()
        torch.cuda.synchronize()
        assert_is_argmax(ids_static, h_static, W, V_out, 16.0, vals_static)
        assert torch.equal(ids_static, lm_head_argmax_torch(h_static, W, V_out)[0])


def test_benchmark_dry_run():
    """benchmarks/bench_lm_head.py imports, builds its cases and passes its checks at tiny sizes (its timing
    runs only on a GPU, through benchmarks/kernels.py)."""
    bench = load_benchmark("bench_lm_head")
    assert bench.SECTION and callable(bench.run)
    bench.dry_run()
