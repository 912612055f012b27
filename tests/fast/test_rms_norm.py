"""RMSNorm and fused residual-add + RMSNorm: twin vs inkling_ref, kernel vs twin."""

import pytest
import torch
from helpers import DTYPES, TOL, assert_rounded_equal, device, norm_weight, poison, randn  # noqa: F401 (fixture)

from inkling_fast.kernels.rms_norm import add_rms_norm, add_rms_norm_torch, rms_norm, rms_norm_torch
from inkling_ref.model.norm import rms_norm as ref_rms_norm
from inkling_ref.testing import rel_l2

EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 40), (3, 5, 72), (1, 33)])
def test_twin_matches_reference(shape, dtype):
    g = torch.Generator().manual_seed(11)
    x, w = randn(*shape, dtype=dtype, gen=g, scale=3.0), norm_weight(shape[-1], "cpu", g)
    assert rel_l2(rms_norm_torch(x, w, EPS), ref_rms_norm(x, w, EPS)) <= TOL[dtype]
    # fp32 against the float64 reference: the twin is accurate, not just consistent
    if dtype == torch.float32:
        assert rel_l2(rms_norm_torch(x, w, EPS), ref_rms_norm(x.double(), w.double(), EPS)) <= 1e-6
    r = randn(*shape, dtype=dtype, gen=g)
    s, y = add_rms_norm_torch(x, r, w, EPS)
    assert torch.equal(s, x + r)  # the block's residual add, in the model dtype
    assert rel_l2(y, ref_rms_norm(x + r, w, EPS)) <= TOL[dtype]


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with a row stride larger than H (a slice of a wider buffer)."""
    wide = torch.full(x.shape[:-1] + (x.shape[-1] + 3,), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,strided", [((7, 40), False), ((3, 5, 72), True), ((1, 33), False), ((2, 3, 300), True)])
def test_rms_norm_kernel_matches_twin(device, shape, strided, dtype):
    g = torch.Generator().manual_seed(12)
    x, w = randn(*shape, dtype=dtype, device=device, gen=g, scale=2.0), norm_weight(shape[-1], device, g)
    if strided:
        x = _strided(x)
    out = poison(torch.empty(shape, dtype=dtype, device=device))
    y = rms_norm(x, w, EPS, out=out)
    assert y is out
    assert rel_l2(y, rms_norm_torch(x, w, EPS)) <= TOL[dtype]
    assert rel_l2(rms_norm(x, w.to(dtype), EPS), rms_norm_torch(x, w.to(dtype), EPS)) <= TOL[dtype]  # model-dtype weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,strided", [((7, 40), False), ((3, 5, 72), True), ((2, 3, 300), False)])
def test_add_rms_norm_kernel_matches_twin(device, shape, strided, dtype):
    g = torch.Generator().manual_seed(13)
    x, r = randn(*shape, dtype=dtype, device=device, gen=g), randn(*shape, dtype=dtype, device=device, gen=g, scale=3.0)
    w = norm_weight(shape[-1], device, g)
    if strided:
        x = _strided(x)
    s_ref, y_ref = add_rms_norm_torch(x, r, w, EPS)
    out_sum, out = poison(torch.empty(shape, dtype=dtype, device=device)), poison(torch.empty(shape, dtype=dtype, device=device))
    s, y = add_rms_norm(x, r, w, EPS, out_sum=out_sum, out=out)
    assert s is out_sum and y is out
    assert_rounded_equal(s, s_ref)  # the sum is one fp32 add rounded once: bit-exact on the GPU
    assert rel_l2(y, y_ref) <= TOL[dtype]
    # in place: the residual stream is updated where it lives
    r_inplace = r.clone()
    s2, y2 = add_rms_norm(x, r_inplace, w, EPS, out_sum=r_inplace)
    assert s2 is r_inplace
    assert_rounded_equal(r_inplace, s_ref)
    assert rel_l2(y2, y_ref) <= TOL[dtype]


def test_errors_name_the_argument(device, monkeypatch):
    x, w = torch.randn(4, 40, device=device), torch.ones(40, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(41, device=device), EPS)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(40, device="meta"), EPS)
    with pytest.raises(ValueError, match="x has dtype"):
        rms_norm(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match="out has shape"):
        rms_norm(x, w, EPS, out=torch.empty(4, 41, device=device))
    with pytest.raises(ValueError, match="out has dtype"):
        rms_norm(x, w, EPS, out=torch.empty(4, 40, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        rms_norm(torch.randn(40, 4, device=device).t(), w, EPS)
    with pytest.raises(ValueError, match="residual has shape"):
        add_rms_norm(x, torch.randn(5, 40, device=device), w, EPS)
    with pytest.raises(ValueError, match="residual has dtype"):
        add_rms_norm(x, torch.randn(4, 40, device=device, dtype=torch.bfloat16), w, EPS)
    with pytest.raises(ValueError, match="must not alias"):
        add_rms_norm(x, x.clone(), w, EPS, out=x)
    if device == "cpu":  # without the interpreter, CPU tensors are refused with a clear message
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="CUDA"):
            rms_norm(x, w, EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [4096, 6144])
@pytest.mark.parametrize("rows", [1, 7, 16, 1031])
def test_real_sizes(H, rows, dtype):
    g = torch.Generator().manual_seed(rows + H)
    x, r = randn(rows, H, dtype=dtype, device="cuda", gen=g), randn(rows, H, dtype=dtype, device="cuda", gen=g)
    w = norm_weight(H, "cuda", g).to(dtype)
    y = rms_norm(x, w, EPS, out=poison(torch.empty_like(x)))
    assert rel_l2(y, rms_norm_torch(x, w, EPS)) <= TOL[dtype]
    assert rel_l2(y, ref_rms_norm(x.cpu(), w.cpu(), EPS).cuda()) <= TOL[dtype]
    s_ref, y_ref = add_rms_norm_torch(x, r, w, EPS)
    s, y = add_rms_norm(x, r, w, EPS, out_sum=poison(torch.empty_like(x)), out=poison(torch.empty_like(x)))
    assert torch.equal(s, s_ref)
    assert rel_l2(y, y_ref) <= TOL[dtype]
