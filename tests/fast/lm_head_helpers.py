"""Shared pieces of the LM-head tests: exact float64 logits and argmax, the argmax property up to float32
rounding, and the checks that `lm_head_argmax` (few rows) and `lm_head_rows` (many rows) must both pass.

A `kernel` below is either of them: kernel(h, weight, vocab_out=None, mup=1.0, ids_out=None,
vals_out=None) -> (ids int64 [T], vals float32 [T]). Each check takes the row count T that exercises
the kernel's own tiling; every other size is fixed here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import poison, randint, randn, run_without_sync_then_capture

from inkling_fast.kernels.lm_head_argmax import lm_head_argmax_torch
from inkling_ref.testing import rel_l2

# The real vocabulary: padded rows of the unembedding V_REAL, ids a token may take V_OUT_REAL.
V_REAL, V_OUT_REAL = 201024, 200058


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


def check_matches_twin(kernel, device, dtype, T, H, V, V_out):
    """Random rows: the kernel writes into given ids_out / vals_out (poisoned first) and returns them,
    its ids are the twin's, its values within 1e-5 of the twin's (float32 accumulation on both sides),
    and its ids are an argmax of the float64 logits."""
    g = torch.Generator().manual_seed(T * 1000 + H)
    h = randn(T, H, dtype=dtype, device=device, gen=g)
    W = randn(V, H, dtype=dtype, device=device, gen=g, scale=H ** -0.5)
    ids_out = poison(torch.empty(T, dtype=torch.int64, device=device))
    vals_out = poison(torch.empty(T, dtype=torch.float32, device=device))
    ids, vals = kernel(h, W, V_out, mup=3.0, ids_out=ids_out, vals_out=vals_out)
    assert ids is ids_out and vals is vals_out
    twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_out, mup=3.0)
    assert torch.equal(ids, twin_ids)
    assert rel_l2(vals, twin_vals) <= 1e-5
    assert_is_argmax(ids, h, W, V_out, 3.0, vals)


def check_exact_ties(kernel, device, dtype, T, copies: dict[int, list[int]]):
    """T integer-valued rows of H = 48 over a vocabulary of 300 ids, V_out = 280: the dot products are
    exact, and copies[t] lists the ids that hold row t's strongest vector (logit 2 * sum |h_t|, above
    every other). A row with two or more copies below V_out has a true tie; copies at ids >= V_out do
    not count. The lowest copy below V_out must win, in the kernel and in the twin, with the exact
    maximum as value."""
    g = torch.Generator().manual_seed(7)
    H, V, V_out = 48, 300, 280
    h = randint(-2, 3, T, H, dtype=dtype, gen=g)
    W = randint(-1, 2, V, H, dtype=dtype, gen=g)                     # |other logits| <= sum |h_t|
    for t, rows in copies.items():
        strong = 2 * torch.sign(h[t].float()).to(dtype)              # logit 2 * sum |h_t|: the maximum
        for r in rows:
            W[r] = strong
    h, W = h.to(device), W.to(device)
    want = exact_argmax(h, W, V_out)
    exact = exact_logits(h, W, V_out).cpu()
    ties = (exact == exact.max(dim=1, keepdim=True).values).sum(dim=1)
    tied = [t for t, rows in copies.items() if sum(r < V_out for r in rows) >= 2]
    assert all(ties[t] >= 2 for t in tied)                           # these rows really have a tie
    assert [want[t].item() for t in copies] == [rows[0] for rows in copies.values()]
    ids, vals = kernel(h, W, V_out)
    assert ids.cpu().tolist() == want.tolist()
    assert torch.equal(vals.cpu().double(), exact.max(dim=1).values)
    assert torch.equal(lm_head_argmax_torch(h, W, V_out)[0].cpu(), want)


def check_many_natural_ties(kernel, device, dtype, T):
    """Values in {-1, 0, 1} over a short H: most rows have many tied maxima scattered over the tiles,
    and the kernel picks the lowest tied id in every row."""
    g = torch.Generator().manual_seed(8)
    H, V, V_out = 6, 500, 433
    h = randint(-1, 2, T, H, dtype=dtype, device=device, gen=g)
    W = randint(-1, 2, V, H, dtype=dtype, device=device, gen=g)
    ids, _ = kernel(h, W, V_out)
    assert ids.cpu().tolist() == exact_argmax(h, W, V_out).tolist()
    exact = exact_logits(h, W, V_out).cpu()
    assert ((exact == exact.max(dim=1, keepdim=True).values).sum(dim=1) > 1).float().mean() > 0.5


def check_padding_rows_never_win(kernel, device, T):
    """Rows of the unembedding at ids >= V_out that would win row 0 are never picked when V_out is
    given (the twin's ids), and do win without it."""
    g = torch.Generator().manual_seed(9)
    h = randn(T, 40, device=device, gen=g)
    W = randn(200, 40, device=device, gen=g)
    W[150:] = 100 * h[0]
    ids, _ = kernel(h, W, 150)
    assert (ids < 150).all()
    assert torch.equal(ids, lm_head_argmax_torch(h, W, 150)[0])
    assert kernel(h, W)[0][0].item() >= 150


def check_errors_name_the_argument(kernel, device):
    """Each bad argument raises a ValueError naming it; zero rows give empty results."""
    h = torch.randn(3, 40, device=device)
    W = torch.randn(100, 40, device=device)
    with pytest.raises(ValueError, match="h must be"):
        kernel(h[0], W)
    with pytest.raises(ValueError, match="weight has dtype"):
        kernel(h, W.double())
    with pytest.raises(ValueError, match="weight has 41 columns"):
        kernel(h, torch.randn(100, 41, device=device))
    with pytest.raises(ValueError, match="vocab_out"):
        kernel(h, W, 101)
    with pytest.raises(ValueError, match="vocab_out"):
        kernel(h, W, 0)
    with pytest.raises(ValueError, match="mup"):
        kernel(h, W, 90, mup=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.randn(40, 3, device=device).T, W)
    with pytest.raises(ValueError, match="ids_out"):
        kernel(h, W, ids_out=torch.empty(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="vals_out"):
        kernel(h, W, vals_out=torch.empty(4, device=device))
    ids, vals = kernel(h[:0], W)
    assert ids.shape == (0,) and vals.shape == (0,)


def check_captured_in_a_cuda_graph(kernel, T, want_ids):
    """GPU only. A call on T bf16 rows (H = 4096, V = 32768, V_out = 32000, mup = 16) runs without a
    host sync and is captured in a CUDA graph; each replay on new hidden states (ids poisoned first)
    gives an argmax of the new logits, with the ids of want_ids(h, W, V_out)."""
    g = torch.Generator(device="cuda").manual_seed(11)
    H, V, V_out = 4096, 32768, 32000
    W = randn(V, H, dtype=torch.bfloat16, device="cuda", gen=g, scale=H ** -0.5)
    h_static = randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g)
    ids_static = torch.empty(T, dtype=torch.int64, device="cuda")
    vals_static = torch.empty(T, dtype=torch.float32, device="cuda")
    kernel(h_static, W, V_out, 16.0, ids_static, vals_static)                # compile
    graph = run_without_sync_then_capture(lambda: kernel(h_static, W, V_out, 16.0, ids_static, vals_static))
    for _ in range(3):
        h_static.copy_(randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g))
        poison(ids_static)
        graph.replay()
        torch.cuda.synchronize()
        assert_is_argmax(ids_static, h_static, W, V_out, 16.0, vals_static)
        assert torch.equal(ids_static, want_ids(h_static, W, V_out))
