"""Embedding gather + RMSNorm (+ a chained second RMSNorm): twin vs the reference trunk, kernel vs twin."""

import pytest
import torch
from configs import tiny_config
from helpers import DTYPES, TOL, device, norm_weight, poison, randn  # noqa: F401 (fixture)

from inkling_fast.kernels.embed_norm import embed_norm, embed_norm_torch
from inkling_ref import random_model
from inkling_ref.testing import rel_l2

EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_matches_reference_trunk(dtype):
    cfg = tiny_config()
    model = random_model(cfg, seed=3, dtype=dtype)
    trunk, depth = model.trunk, model.mtp.depths[1]
    ids = torch.randint(0, cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        e_ref = trunk.embed_tokens(ids)
        attn_in_ref = trunk.layers[0].attn_norm(e_ref)   # trunk layer 0's first norm
        double_ref = depth.embed_norm(e_ref)              # the MTP double-normed embedding
        e = embed_norm_torch(ids, trunk.embed.weight, trunk.embed_norm.weight, cfg.rms_norm_eps)
        e2, attn_in = embed_norm_torch(ids, trunk.embed.weight, trunk.embed_norm.weight, cfg.rms_norm_eps,
                                       weight2=trunk.layers[0].attn_norm.weight)
        _, double = embed_norm_torch(ids, trunk.embed.weight, trunk.embed_norm.weight, cfg.rms_norm_eps,
                                     weight2=depth.embed_norm.weight)
    assert e.dtype == dtype
    for got, want in ((e, e_ref), (e2, e_ref), (attn_in, attn_in_ref), (double, double_ref)):
        assert rel_l2(got, want) <= TOL[dtype]


def _inputs(device, dtype, V, H, ids_shape, ids_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    table = randn(V, H, dtype=dtype, device=device, gen=g, scale=0.7)
    ids = torch.randint(0, V, ids_shape, generator=g).to(device=device, dtype=ids_dtype)
    return g, table, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,H,ids_shape,ids_dtype", [(97, 40, (3, 5), torch.int64), (61, 72, (7,), torch.int32),
                                                      (13, 300, (2, 3), torch.int32)])
def test_kernel_matches_twin(device, dtype, V, H, ids_shape, ids_dtype):
    """H not a power of two (lanes masked past H), ids of both dtypes, poisoned outputs."""
    g, table, ids = _inputs(device, dtype, V, H, ids_shape, ids_dtype, seed=V + H)
    w1, w2 = norm_weight(H, device, g), norm_weight(H, device, g).to(dtype)
    shape = ids_shape + (H,)
    e_ref, n_ref = embed_norm_torch(ids, table, w1, EPS, weight2=w2)

    e = embed_norm(ids, table, w1, EPS, out=poison(torch.empty(shape, dtype=dtype, device=device)))
    assert e.shape == shape and rel_l2(e, e_ref) <= TOL[dtype]

    out, out2 = (poison(torch.empty(shape, dtype=dtype, device=device)) for _ in range(2))
    e, n = embed_norm(ids, table, w1, EPS, weight2=w2, out=out, out2=out2)
    assert e is out and n is out2
    assert rel_l2(e, e_ref) <= TOL[dtype] and rel_l2(n, n_ref) <= TOL[dtype]

    e, n = embed_norm(ids, table, w1, EPS, weight2=w2, store_first=False)
    assert e is None and rel_l2(n, n_ref) <= TOL[dtype]


def test_out_of_range_ids(device):
    g, table, ids = _inputs(device, torch.float32, 29, 40, (2, 4), torch.int64, seed=5)
    w1, w2 = norm_weight(40, device, g), norm_weight(40, device, g)
    for bad in (29, -1):
        ids_bad = ids.clone()
        ids_bad[1, 2] = bad
        with pytest.raises(ValueError, match="ids out of range"):
            embed_norm(ids_bad, table, w1, EPS)
        # unchecked (the CUDA-graph path): the bad row is NaN, nothing outside the table is read,
        # every other row is right
        e, n = embed_norm(ids_bad, table, w1, EPS, weight2=w2, check_ids=False)
        e_ref, n_ref = embed_norm_torch(ids, table, w1, EPS, weight2=w2)
        for got, want in ((e, e_ref), (n, n_ref)):
            assert torch.isnan(got[1, 2]).all()
            keep = torch.ones(2, 4, dtype=torch.bool)
            keep[1, 2] = False
            assert rel_l2(got[keep], want[keep]) <= TOL[torch.float32]


def test_errors_name_the_argument(device):
    g, table, ids = _inputs(device, torch.float32, 29, 40, (5,), torch.int64, seed=6)
    w = norm_weight(40, device, g)
    with pytest.raises(ValueError, match="ids must be int32/int64"):
        embed_norm(ids.float(), table, w, EPS)
    with pytest.raises(ValueError, match="table"):
        embed_norm(ids, table.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="weight has shape"):
        embed_norm(ids, table, w[:39], EPS)
    with pytest.raises(ValueError, match="weight2 has shape"):
        embed_norm(ids, table, w, EPS, weight2=torch.ones(41, device=device))
    with pytest.raises(ValueError, match="store_first=False needs weight2"):
        embed_norm(ids, table, w, EPS, store_first=False)
    with pytest.raises(ValueError, match="out has shape"):
        embed_norm(ids, table, w, EPS, out=torch.empty(5, 41, device=device))
    with pytest.raises(ValueError, match="out2 must be"):
        embed_norm(ids, table, w, EPS, weight2=w, out2=torch.empty(5, 40, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="ids is on"):
        embed_norm(ids.to("meta"), table, w, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [4096, 6144])
@pytest.mark.parametrize("rows", [1, 7, 16, 1031])
def test_real_sizes(H, rows, dtype):
    g, table, ids = _inputs("cuda", dtype, 5003, H, (rows,), torch.int32, seed=rows)
    w1, w2 = norm_weight(H, "cuda", g).to(dtype), norm_weight(H, "cuda", g).to(dtype)
    e_ref, n_ref = embed_norm_torch(ids, table, w1, EPS, weight2=w2)
    e, n = embed_norm(ids, table, w1, EPS, weight2=w2, out=poison(torch.empty_like(e_ref)),
                      out2=poison(torch.empty_like(n_ref)))
    assert rel_l2(e, e_ref) <= TOL[dtype] and rel_l2(n, n_ref) <= TOL[dtype]
    _, n = embed_norm(ids, table, w1, EPS, weight2=w2, store_first=False, check_ids=False,
                      out2=poison(torch.empty_like(n_ref)))
    assert rel_l2(n, n_ref) <= TOL[dtype]
