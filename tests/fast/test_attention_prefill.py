"""The prefill path (attention_prep(flat_kv=True) + attention_prefill): prompts longer than the sliding
ring and than the conv rings, chunked prefill on top of a history, padding; twin vs the reference on
a flat history, kernels vs twin with poisoned outputs and caches, kernels vs the reference."""

import pytest
import torch

from attn_helpers import REAL, DEVICE, Spec, build_case
from inkling_fast.kernels.attention_prefill import attention_prefill, attention_prefill_torch
from inkling_fast.kernels.attention_prep import attention_prep, attention_prep_torch
from inkling_ref.testing import bits_equal, rel_l2

SLIDING = Spec("sliding", nH=4, nKV=2, hd=16, extent=5, d_rel=5, H=24)        # cap 7 < prompt 12
GLOBAL = Spec("global", nH=6, nKV=2, hd=16, extent=7, d_rel=5, H=24, log_tau=(5, 0.3))
SPECS = {"sliding": SLIDING, "global-logtau": GLOBAL}
T = 12
LENGTHS = [0, 5, 13]          # a fresh prompt, and chunks continuing a history
ROWS = [12, 10, 6]


def build(spec, dtype, seed, left=False, device=DEVICE, ref_dtype=torch.float64, lengths=LENGTHS, rows=ROWS, T=T):
    cap = spec.window + 2 if spec.kind == "sliding" else max(lengths) + T + 1
    return build_case(spec, lengths, rows, T, dtype=dtype, ref_dtype=ref_dtype, seed=seed, cap=cap,
                      R=spec.K + 1, left_pad=left, device=device)


def run(case, prep_fn, attn_fn, out=None):
    state = case.clone_state()
    prep = prep_fn(case.q, case.k_in, case.v_in, case.r, flat_kv=True, **(case.prep_kwargs() | state))
    kw = {} if out is None else {"out": out}
    o = attn_fn(prep.q, prep.rel, prep.k, prep.v, state["k_cache"], state["v_cache"], case.slot, case.pos,
                window=case.spec.window, **kw)
    return prep, o, state


def expected_cache(case, name, new):
    """The cache after the call: the history, then the new rows of each batch row's last cap positions."""
    cache = getattr(case, name).clone()
    cap = cache.shape[1]
    valid = case.valid
    last = torch.where(valid, case.pos, -1).amax(1, keepdim=True)
    keep = valid & (case.pos > last - cap)
    b_i, t_i = keep.nonzero(as_tuple=True)
    cache[case.slot.long()[b_i], case.pos[b_i, t_i].long() % cap] = new[b_i, t_i].to(cache.dtype)
    return cache


@pytest.mark.parametrize("left", [False, True], ids=["rightpad", "leftpad"])
@pytest.mark.parametrize("name", list(SPECS))
def test_twin_matches_reference(name, left):
    spec = SPECS[name]
    case = build(spec, torch.float64, seed=61, left=left)
    prep, out, state = run(case, attention_prep_torch, attention_prefill_torch)
    v = case.valid
    assert rel_l2(out[v], case.out[v]) < 1e-12
    assert rel_l2(prep.k[v], case.k_new[v]) < 1e-12
    for name_, new in (("k_cache", case.k_new), ("v_cache", case.v_new)):
        exp = expected_cache(case, name_, new)          # history + the last cap new rows, NaN elsewhere
        nan = exp.isnan()
        assert torch.equal(state[name_].isnan(), nan)
        assert rel_l2(state[name_][~nan], exp[~nan]) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_matches_twin(name, dtype):
    spec = SPECS[name]
    case = build(spec, dtype, seed=62, left=(name == "global-logtau"))
    tp, to, ts = run(case, attention_prep_torch, attention_prefill_torch)
    poisoned = torch.full((len(LENGTHS), T, spec.nH, spec.hd), float("nan"), dtype=dtype, device=DEVICE)
    kp, ko, ks = run(case, attention_prep, attention_prefill, out=poisoned)
    assert ko is poisoned
    v = case.valid
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_l2(ko[v], to[v]) <= tol
    assert rel_l2(ko[v], case.out[v]) <= tol          # and end to end against the reference
    assert ko[~v].isnan().all(), "a padding row was written"
    for name_ in ("k_ring", "v_ring"):
        assert bits_equal(ks[name_], ts[name_])
    for name_, new in (("k_cache", kp.k), ("v_cache", kp.v)):
        # the cache write is a copy of the kernel's own flat keys, and touches nothing else
        assert bits_equal(ks[name_], expected_cache(case, name_, new))


def test_rejects_bad_input():
    case = build(SLIDING, torch.float32, seed=64)
    prep = attention_prep_torch(case.q, case.k_in, case.v_in, case.r, flat_kv=True,
                                **(case.prep_kwargs() | case.clone_state()))
    with pytest.raises(ValueError, match="k_new has shape"):
        attention_prefill(prep.q, prep.rel, prep.k[:, :-1], prep.v, case.k_cache, case.v_cache, case.slot,
                          case.pos, window=SLIDING.window)
    small = case.k_cache[:, : SLIDING.window - 1].contiguous()
    with pytest.raises(ValueError, match="cannot hold the window"):
        attention_prefill(prep.q, prep.rel, prep.k, prep.v, small, small.clone(), case.slot, case.pos,
                          window=SLIDING.window)


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(REAL))
def test_real_sizes_gpu(name):
    """A 4096-token prompt, a 600-token chunk after 3000 positions, a short prompt and an idle row;
    bf16 kernels vs the twin and vs the fp32 reference, caches checked."""
    spec = REAL[name]
    Tp = 4096
    case = build(spec, torch.bfloat16, seed=65, device="cuda", ref_dtype=torch.float32,
                 lengths=[0, 3000, 0, 40], rows=[Tp, 600, 17, 0], T=Tp)
    tp, to, ts = run(case, attention_prep_torch, attention_prefill_torch)
    poisoned = torch.full((4, Tp, spec.nH, spec.hd), float("nan"), dtype=torch.bfloat16, device="cuda")
    kp, ko, ks = run(case, attention_prep, attention_prefill, out=poisoned)
    torch.cuda.synchronize()
    v = case.valid
    assert rel_l2(ko[v], to[v]) <= 1e-2 and rel_l2(ko[v], case.out[v]) <= 1e-2
    assert ko[~v].isnan().all()
    for name_ in ("k_ring", "v_ring"):
        assert bits_equal(ks[name_], ts[name_])
    for name_, new in (("k_cache", kp.k), ("v_cache", kp.v)):
        assert bits_equal(ks[name_], expected_cache(case, name_, new))
