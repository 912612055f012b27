"""Greedy LM head for many rows (`lm_head_rows`): kernel vs twin over several row and vocabulary tiles, exact
ties (lowest id wins) across groups, tiles and row tiles, padding rows, torch.argmax's tie rule (the twin's
and GEMM + argmax's), the dispatch in forward.greedy_tokens, errors, and on a GPU the Inkling-Small LM head
at 576 rows, real-size ties and a CUDA graph without host sync."""

from types import SimpleNamespace

import pytest
import torch
from helpers import DTYPES, device, randint, randn  # noqa: F401 (fixture)
from lm_head_helpers import (V_OUT_REAL, V_REAL, assert_is_argmax, check_captured_in_a_cuda_graph,
                             check_errors_name_the_argument, check_exact_ties, check_many_natural_ties,
                             check_matches_twin, check_padding_rows_never_win, exact_argmax)

from inkling_fast import forward
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_torch
from inkling_fast.kernels.lm_head_rows import lm_head_rows
from inkling_ref.testing import rel_l2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,V,V_out", [(1, 40, 300, 290), (70, 72, 257, 200), (150, 64, 130, 130), (33, 33, 64, 1)])
def test_kernel_matches_twin(device, dtype, T, H, V, V_out):
    """Rows over several row tiles (70, 150: the last one partial), vocabularies over several tiles with a
    masked tail, H not a multiple of BLOCK_K (33, 72), a one-id vocabulary."""
    check_matches_twin(lm_head_rows, device, dtype, T, H, V, V_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_go_to_the_lowest_id(device, dtype):
    """Integer-valued inputs make the dot products exact; copies of one row's strongest vector give true
    ties inside one group of 64 ids, across groups of one tile, across vocabulary tiles, in rows of every
    row tile (70 rows: three tiles of 32 under the interpreter, the last partial); copies at ids >= V_out
    do not count."""
    copies = {0: [3, 9, 200], 7: [70, 71, 260], 14: [130, 250, 278], 21: [64, 128, 192], 28: [279, 285, 299],
              35: [10, 11, 12], 42: [100, 150, 277], 49: [65, 66, 270], 56: [0, 1, 2], 69: [22, 23, 24]}
    check_exact_ties(lm_head_rows, device, dtype, 70, copies)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_natural_ties(device, dtype):
    check_many_natural_ties(lm_head_rows, device, dtype, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_argmax_takes_the_first_maximum(device, dtype):
    """The twin (and GEMM + argmax) rely on torch.argmax returning the first maximal index: ties at ids
    5, 77 and 4000 of a 5000-wide row, and bf16 logits whose float32 values differ but round to one value."""
    x = torch.zeros(3, 5000, dtype=dtype, device=device)
    x[:, [5, 77, 4000]] = 2.0
    x[1, 3] = 1.0
    x[2, 4999] = 2.0
    assert torch.argmax(x, dim=-1).tolist() == [5, 5, 5]
    assert torch.argmax(x[:, 6:], dim=-1).tolist() == [71, 71, 71]
    if dtype == torch.bfloat16:   # 1 + 2^-10 rounds to 1 in bf16: the float32 winner (id 9) becomes a tie, id 2 wins
        f = torch.zeros(1, 16, device=device)
        f[0, 2], f[0, 9] = 1.0, 1.0 + 2.0 ** -10
        assert torch.argmax(f, -1).item() == 9 and torch.argmax(f.bfloat16(), -1).item() == 2


def test_padding_rows_never_win(device):
    check_padding_rows_never_win(lm_head_rows, device, 40)


@pytest.mark.parametrize("many", [0, 10**9])
def test_greedy_tokens_takes_either_path(device, monkeypatch, many):
    """forward.MANY_ROWS = 0 forces lm_head_rows, 10**9 lm_head_argmax: the same ids as the twin (with exact
    ties in the rows) on 37 rows."""
    g = torch.Generator().manual_seed(10)
    T, H, V, V_out = 37, 24, 130, 120
    h = randint(-2, 3, T, H, gen=g).to(device)
    W = randint(-1, 2, V, H, gen=g).to(device)
    W[100] = W[17]                                                   # ties wherever row 17 wins
    model = SimpleNamespace(unembed=W, vocab_out=V_out, mup=3.0)
    monkeypatch.setattr(forward, "MANY_ROWS", many)
    called = []
    for name in ("lm_head_argmax", "lm_head_rows"):
        real = getattr(forward, name)
        monkeypatch.setattr(forward, name, lambda *a, _real=real, _name=name, **kw: called.append(_name) or
                            _real(*a, **kw))
    scores = torch.full((T,), float("nan"), device=device)               # poisoned: every row must be written
    ids = forward.greedy_tokens(model, h, scores_out=scores)
    assert called == (["lm_head_rows"] if many == 0 else ["lm_head_argmax"])
    assert torch.equal(ids.cpu(), exact_argmax(h, W, V_out))
    want = (h.double() @ W.double()[:V_out].T).amax(dim=1) / 3.0         # the maximum logit of each row
    assert torch.allclose(scores.cpu().double(), want.cpu(), rtol=1e-6, atol=1e-6)


def test_errors_name_the_argument(device):
    check_errors_name_the_argument(lm_head_rows, device)


# ----------------------------------------------------------------------------- GPU: real sizes
@pytest.mark.gpu
def test_real_size():
    """Inkling-Small's LM head (201024 x 4096, bf16) over a batch-64 verify pass (64 x 9 rows): an argmax of
    the float32 logits in every row (another id only at a float32 near tie), values as the twin's, and the
    same ids as the few-row kernel."""
    H, T = 4096, 576
    g = torch.Generator(device="cuda").manual_seed(T)
    W = randn(V_REAL, H, dtype=torch.bfloat16, device="cuda", gen=g, scale=H ** -0.5)
    h = randn(T, H, dtype=torch.bfloat16, device="cuda", gen=g)
    ids, vals = lm_head_rows(h, W, V_OUT_REAL, mup=16.0)
    twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_OUT_REAL, mup=16.0)
    assert_is_argmax(ids, h, W, V_OUT_REAL, 16.0, vals, rtol=1e-5)
    assert rel_l2(vals, twin_vals) <= 1e-5
    assert (ids != twin_ids).sum().item() <= max(1, T // 256), "more rows than near ties explain differ from the twin"
    assert (ids != lm_head_argmax(h, W, V_OUT_REAL, 16.0)[0]).sum().item() <= max(1, T // 256)


@pytest.mark.gpu
def test_real_size_ties():
    """Exact ties in 576 rows at the real size: the lowest id wins in every row."""
    H, T = 4096, 576
    g = torch.Generator(device="cuda").manual_seed(H + 1)
    h = randint(-2, 3, T, H, dtype=torch.bfloat16, device="cuda", gen=g)
    W = randint(-1, 2, V_REAL, H, dtype=torch.bfloat16, device="cuda", gen=g)
    want = []
    for t in range(0, T, 72):                                        # 8 rows in different row tiles
        strong = 2 * torch.sign(h[t].float()).bfloat16()
        base = 1000 + 25_000 * (t // 72)
        for r in (base, base + 1, 190_000 + t, V_OUT_REAL + t // 72):
            W[r] = strong
        want.append(base)
    ids, _ = lm_head_rows(h, W, V_OUT_REAL)
    assert ids[::72].tolist() == want
    assert ids[::72].tolist() == exact_argmax(h[::72], W, V_OUT_REAL).tolist()


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_without_host_sync():
    """576 rows; each replay gives the ids of an uncaptured call."""
    check_captured_in_a_cuda_graph(lm_head_rows, 576, lambda h, W, V_out: lm_head_rows(h, W, V_out, 16.0)[0])
