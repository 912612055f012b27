"""SwiGLU on interleaved w13 output (+ global_scale): twin vs inkling_ref, kernel vs twin."""

import pytest
import torch
from helpers import DTYPES, TOL, device, poison, randn  # noqa: F401 (fixture)

from inkling_fast.kernels.swiglu import swiglu, swiglu_torch
from inkling_ref.model.mlp import DenseMLP, swiglu_interleaved
from inkling_ref.testing import rel_l2


@pytest.mark.parametrize("dtype", DTYPES)
def test_twin_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    gu = randn(3, 5, 2 * 37, dtype=dtype, gen=g, scale=2.0)
    assert rel_l2(swiglu_torch(gu), swiglu_interleaved(gu)) <= TOL[dtype]
    assert rel_l2(swiglu_torch(gu), swiglu_interleaved(gu.double())) <= TOL[dtype]  # against float64
    # the known silent bug (gate = first half, up = second half) is far off
    F = gu.shape[-1] // 2
    halves = torch.nn.functional.silu(gu[..., :F].float()) * gu[..., F:].float()
    assert rel_l2(halves, swiglu_interleaved(gu.double())) > 0.1


def test_global_scale_before_down_matches_dense_mlp():
    """y = down(swiglu(gu)) * s == down(swiglu(gu) * s): the fused scale reproduces DenseMLP."""
    g = torch.Generator().manual_seed(2)
    mlp = DenseMLP(40, 37)
    with torch.no_grad():
        for p in (mlp.gate_up.weight, mlp.down.weight):
            p.copy_(randn(*p.shape, gen=g, scale=p.shape[1] ** -0.5))
        mlp.global_scale.fill_(1.37)
        x = randn(2, 5, 40, gen=g)
        fused = mlp.down(swiglu_torch(mlp.gate_up(x), mlp.global_scale))
        assert rel_l2(fused, mlp(x)) <= 1e-5
        assert rel_l2(mlp.down(swiglu_torch(mlp.gate_up(x))), mlp(x)) > 0.1  # the scale is not a no-op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 2 * 37), (1, 2 * 64), (9, 2 * 301), (2 * 5,)])
@pytest.mark.parametrize("scaled", [False, True])
def test_kernel_matches_twin(device, dtype, shape, scaled):
    g = torch.Generator().manual_seed(shape[-1])
    gu = randn(*shape, dtype=dtype, device=device, gen=g, scale=3.0)
    scale = torch.tensor([0.73], device=device) if scaled else None
    out = poison(torch.empty(shape[:-1] + (shape[-1] // 2,), dtype=dtype, device=device))
    y = swiglu(gu, scale, out=out)
    assert y is out
    assert rel_l2(y, swiglu_torch(gu, scale)) <= TOL[dtype]


def test_errors_name_the_argument(device):
    gu = torch.randn(4, 10, device=device)
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.randn(4, 9, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(torch.randn(10, 4, device=device).t())
    with pytest.raises(ValueError, match="global_scale"):
        swiglu(gu, torch.ones(2, device=device))
    with pytest.raises(ValueError, match="global_scale"):
        swiglu(gu, torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match="out has shape"):
        swiglu(gu, out=torch.empty(4, 10, device=device))
    with pytest.raises(ValueError, match="gu must be"):
        swiglu(gu.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F", [16384, 24576])
@pytest.mark.parametrize("rows", [1, 7, 16, 1031])
def test_real_sizes(F, rows, dtype):
    g = torch.Generator().manual_seed(rows)
    gu = randn(rows, 2 * F, dtype=dtype, device="cuda", gen=g, scale=3.0)
    scale = torch.tensor([0.73], device="cuda", dtype=dtype)
    for s in (None, scale):
        y = swiglu(gu, s, out=poison(torch.empty(rows, F, dtype=dtype, device="cuda")))
        assert rel_l2(y, swiglu_torch(gu, s)) <= TOL[dtype]
