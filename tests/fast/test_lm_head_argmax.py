"""LM-head argmax without the logits: twin vs inkling_ref's readout, kernel vs twin (random, exact
ties, padding rows, several token blocks), errors, and on a GPU the real sizes and a CUDA graph."""

import pytest
import torch
from helpers import DTYPES, device, load_benchmark, randint, randn  # noqa: F401 (fixture)
from lm_head_helpers import (V_OUT_REAL, V_REAL, assert_is_argmax, check_captured_in_a_cuda_graph,
                             check_errors_name_the_argument, check_exact_ties, check_many_natural_ties,
                             check_matches_twin, check_padding_rows_never_win, exact_argmax)

from configs import tiny_config
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_torch
from inkling_ref import random_model
from inkling_ref.testing import rel_l2


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
    check_matches_twin(lm_head_argmax, device, dtype, T, H, V, V_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_id(device, dtype):
    """True ties inside one 64-id group, across groups of one tile and across tiles; row 4's copies
    at ids >= V_out do not count."""
    copies = {0: [3, 9, 200], 1: [70, 71, 260], 2: [130, 250, 278], 3: [64, 128, 192], 4: [279, 285, 299]}
    check_exact_ties(lm_head_argmax, device, dtype, 5, copies)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_natural_ties(device, dtype):
    check_many_natural_ties(lm_head_argmax, device, dtype, 9)


def test_padding_rows_never_win(device):
    check_padding_rows_never_win(lm_head_argmax, device, 4)


def test_errors_name_the_argument(device):
    check_errors_name_the_argument(lm_head_argmax, device)


# ----------------------------------------------------------------------------- GPU: real sizes
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
    """Replaying a captured call on new hidden states gives the new argmax, the twin's ids."""
    check_captured_in_a_cuda_graph(lm_head_argmax, 4, lambda h, W, V_out: lm_head_argmax_torch(h, W, V_out)[0])


def test_benchmark_dry_run():
    """benchmarks/bench_lm_head.py imports, builds its cases and passes its checks at tiny sizes (its timing
    runs only on a GPU, through benchmarks/kernels.py)."""
    bench = load_benchmark("bench_lm_head")
    assert bench.SECTION and callable(bench.run)
    bench.dry_run()
