"""The MTP input fusion: twin vs what the reference MTPDepth feeds its input_proj, kernel vs twin."""

import pytest
import torch
from configs import tiny_config
from helpers import DTYPES, TOL, device, norm_weight, poison, randn  # noqa: F401 (fixture)

import inkling_fast.kernels.mtp_input as module
from inkling_fast.kernels.mtp_input import mtp_input, mtp_input_torch
from inkling_ref import random_model
from inkling_ref.testing import rel_l2

EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [0, 1])
def test_twin_matches_reference_depth(dtype, m):
    """Capture the input of depth m's input_proj during the reference forward and compare."""
    cfg = tiny_config()
    model = random_model(cfg, seed=7 + m, dtype=dtype)
    trunk, depth = model.trunk, model.mtp.depths[m]
    g = torch.Generator().manual_seed(8)
    h_prev = randn(2, 5, cfg.hidden_size, dtype=dtype, gen=g, scale=2.0)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=g)
    captured = []
    hook = depth.input_proj.register_forward_hook(lambda mod, inp, out: captured.append(inp[0]))
    with torch.no_grad():
        depth(h_prev, trunk.embed_tokens(ids))
        c = mtp_input_torch(h_prev, ids, trunk.embed.weight, depth.hidden_norm.weight, trunk.embed_norm.weight,
                            depth.embed_norm.weight, cfg.rms_norm_eps)
    hook.remove()
    (c_ref,) = captured
    assert c.shape == c_ref.shape == (2, 5, 2 * cfg.hidden_size) and c.dtype == dtype
    assert rel_l2(c, c_ref) <= TOL[dtype]
    # the comparison can fail: the known bug "embedding first" is far off
    H = cfg.hidden_size
    assert rel_l2(torch.cat([c[..., H:], c[..., :H]], -1), c_ref) > 0.1


def _inputs(device, dtype, V, H, lead, seed):
    g = torch.Generator().manual_seed(seed)
    h = randn(*lead, H, dtype=dtype, device=device, gen=g, scale=3.0)
    ids = torch.randint(0, V, lead, generator=g).to(device)
    table = randn(V, H, dtype=dtype, device=device, gen=g, scale=0.5)
    norms = [norm_weight(H, device, g) for _ in range(3)]
    return h, ids, table, norms


@pytest.mark.parametrize("chunk", [None, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V,H,lead", [(97, 40, (3, 5)), (31, 72, (7,)), (11, 300, (1, 2))])
def test_kernel_matches_twin(device, monkeypatch, dtype, V, H, lead, chunk):
    """chunk=16: rows read in several pieces, the last one cut by H (None: the default, one piece here)."""
    if chunk is not None:
        monkeypatch.setattr(module, "launch_config", lambda H, n_rows: (chunk, 1))
    h, ids, table, (wh, wb, we) = _inputs(device, dtype, V, H, lead, seed=H)
    ref = mtp_input_torch(h, ids, table, wh, wb, we, EPS)
    out = poison(torch.empty(lead + (2 * H,), dtype=dtype, device=device))
    c = mtp_input(h, ids, table, wh, wb, we, EPS, out=out)
    assert c is out
    assert rel_l2(c[..., :H], ref[..., :H]) <= TOL[dtype] and rel_l2(c[..., H:], ref[..., H:]) <= TOL[dtype]
    # a strided h_prev (a slice of a wider buffer) and int32 ids
    wide = torch.cat([h, h[..., :3]], -1)[..., :H]
    assert rel_l2(mtp_input(wide, ids.int(), table, wh, wb, we, EPS), ref) <= TOL[dtype]


def test_out_of_range_ids(device):
    h, ids, table, (wh, wb, we) = _inputs(device, torch.float32, 17, 40, (4,), seed=9)
    ids_bad = ids.clone()
    ids_bad[2] = 17
    with pytest.raises(ValueError, match="ids out of range"):
        mtp_input(h, ids_bad, table, wh, wb, we, EPS)
    c = mtp_input(h, ids_bad, table, wh, wb, we, EPS, check_ids=False)
    ref = mtp_input_torch(h, ids, table, wh, wb, we, EPS)
    assert torch.isnan(c[2, 40:]).all()
    assert rel_l2(c[2, :40], ref[2, :40]) <= 1e-5  # the hidden half of that row is unaffected
    assert rel_l2(c[[0, 1, 3]], ref[[0, 1, 3]]) <= 1e-5


def test_errors_name_the_argument(device):
    h, ids, table, (wh, wb, we) = _inputs(device, torch.float32, 17, 40, (4,), seed=10)
    with pytest.raises(ValueError, match="ids has shape"):
        mtp_input(h, ids[:3], table, wh, wb, we, EPS)
    with pytest.raises(ValueError, match="ids must be int32/int64"):
        mtp_input(h, ids.float(), table, wh, wb, we, EPS)
    with pytest.raises(ValueError, match="table must be"):
        mtp_input(h, ids, table.to(torch.bfloat16), wh, wb, we, EPS)
    with pytest.raises(ValueError, match="hidden_norm"):
        mtp_input(h, ids, table, wh[:39], wb, we, EPS)
    with pytest.raises(ValueError, match="backbone_embed_norm"):
        mtp_input(h, ids, table, wh, wb.to("meta"), we, EPS)
    with pytest.raises(ValueError, match="embed_norm"):
        mtp_input(h, ids, table, wh, wb, torch.ones(40, 1, device=device), EPS)
    with pytest.raises(ValueError, match="out must be"):
        mtp_input(h, ids, table, wh, wb, we, EPS, out=torch.empty(80, 4, device=device).t())
    with pytest.raises(ValueError, match="out has shape"):
        mtp_input(h, ids, table, wh, wb, we, EPS, out=torch.empty(4, 40, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [4096, 6144])
@pytest.mark.parametrize("rows", [1, 7, 16, 1031])
def test_real_sizes(H, rows, dtype):
    h, ids, table, (wh, wb, we) = _inputs("cuda", dtype, 5003, H, (rows,), seed=rows)
    wh, wb, we = wh.to(dtype), wb.to(dtype), we.to(dtype)
    ref = mtp_input_torch(h, ids, table, wh, wb, we, EPS)
    c = mtp_input(h, ids, table, wh, wb, we, EPS, out=poison(torch.empty_like(ref)), check_ids=False)
    assert rel_l2(c[:, :H], ref[:, :H]) <= TOL[dtype] and rel_l2(c[:, H:], ref[:, H:]) <= TOL[dtype]
