"""attention_prep: its torch twin against the reference Attention on a flat history, the Triton kernel
against the twin (rings with wrap-around, padding, poisoned outputs and caches), the prefill mode,
and the wrapper's errors. Real head counts run on the GPU (`@pytest.mark.gpu`)."""

import pytest
import torch
from einops import rearrange

from attn_helpers import REAL, Spec, build_case
from helpers import TOL
from inkling_fast.kernels.attention_prep import attention_prep, attention_prep_torch
from inkling_ref.model.attention import log_tau
from inkling_ref.model.norm import rms_norm
from inkling_ref.testing import bits_equal, rel_l2

# CPU specs: GQA 3 with an odd head count, GQA 4 with log-tau from position 7, odd head_dim + conv K=3
SLIDING = Spec("sliding", nH=6, nKV=2, hd=16, extent=11, d_rel=5, H=24)
GLOBAL = Spec("global", nH=4, nKV=1, hd=16, extent=13, d_rel=5, H=24, log_tau=(7, 0.3))
ODD = Spec("global", nH=6, nKV=3, hd=12, extent=9, d_rel=3, K=3, H=20, log_tau=(5, 0.2))
LENGTHS = [0, 2, 23, 40]          # a fresh sequence, one shorter than K-1, rings wrapped many times


def reference_q_rel(case):
    """q' and L_rel' from the reference's own building blocks (q_norm, log_tau, the einsum)."""
    s, ref = case.spec, case.ref
    B, T = case.pos.shape
    dt = ref.rel_proj.dtype
    q = rms_norm(rearrange(case.q.to(dt), "b t (h d) -> b t h d", d=s.hd), ref.q_norm.weight, s.eps)
    rel = torch.einsum("bthr,re->bthe", rearrange(case.r.to(dt), "b t (h r) -> b t h r", r=s.d_rel), ref.rel_proj)
    if ref.n_floor is not None:
        tau = log_tau(case.pos.clamp(min=0).flatten(), ref.n_floor, ref.alpha).to(dt).view(B, T, 1, 1)
        q, rel = q * tau, rel * tau
    return q, rel


@pytest.mark.parametrize("spec", [SLIDING, GLOBAL, ODD], ids=["sliding", "global-logtau", "odd-K3"])
def test_twin_matches_reference(spec):
    """float64: the twin's cache rows equal the reference's new keys/values (conv through the ring =
    conv over the flat history), its ring rows the reference's conv inputs, q'/L_rel' the reference's."""
    case = build_case(spec, LENGTHS, [3, 3, 1, 2], 3, dtype=torch.float64, seed=11)
    state = case.clone_state()
    kw = case.prep_kwargs() | state
    prep = attention_prep_torch(case.q, case.k_in, case.v_in, case.r, **kw)
    v = case.valid
    b_i, t_i = v.nonzero(as_tuple=True)
    s_i, p_i = case.slot.long()[b_i], case.pos[b_i, t_i].long()
    cap, R = case.k_cache.shape[1], case.k_ring.shape[1]
    assert rel_l2(state["k_cache"][s_i, p_i % cap], case.k_new[v]) < 1e-12
    assert rel_l2(state["v_cache"][s_i, p_i % cap], case.v_new[v]) < 1e-12
    assert torch.equal(state["k_ring"][s_i, p_i % R], case.k_in[v])
    q_ref, rel_ref = reference_q_rel(case)
    assert rel_l2(prep.q[v], q_ref[v]) < 1e-12
    assert rel_l2(prep.rel[v], rel_ref[v]) < 1e-12


def run_both(case, **extra):
    """Kernel and twin from the same state; the kernel's outputs are NaN-poisoned first."""
    B, T = case.pos.shape
    s, dt, dev = case.spec, case.k_cache.dtype, case.k_cache.device
    twin_state, kern_state = case.clone_state(), case.clone_state()
    twin = attention_prep_torch(case.q, case.k_in, case.v_in, case.r, **(case.prep_kwargs() | twin_state), **extra)
    nan = float("nan")
    outs = dict(q_out=torch.full((B, T, s.nH, s.hd), nan, dtype=dt, device=dev),
                rel_out=torch.full((B, T, s.nH, s.extent), nan, dtype=torch.float32, device=dev))
    if extra.get("flat_kv"):
        outs |= dict(k_out=torch.full((B, T, s.nKV, s.hd), nan, dtype=dt, device=dev),
                     v_out=torch.full((B, T, s.nKV, s.hd), nan, dtype=dt, device=dev))
    kern = attention_prep(case.q, case.k_in, case.v_in, case.r, **(case.prep_kwargs() | kern_state), **extra, **outs)
    assert kern.q is outs["q_out"] and kern.rel is outs["rel_out"]
    return twin, twin_state, kern, kern_state


def written_rows(case, n_rows):
    """[slots, n_rows] bool: the rows (slot[b], pos[b, t] % n_rows) of the valid rows."""
    m = torch.zeros(case.k_cache.shape[0], n_rows, dtype=torch.bool, device=case.pos.device)
    b_i, t_i = case.valid.nonzero(as_tuple=True)
    m[case.slot.long()[b_i], case.pos[b_i, t_i].long() % n_rows] = True
    return m


def check_cache(case, name, kern_state, twin_state, tol):
    """Only the rows at the valid positions changed (bit-exact elsewhere, poison included), and those
    agree with the twin within tol."""
    before, kern, twin = getattr(case, name), kern_state[name], twin_state[name]
    w = written_rows(case, before.shape[1])
    assert bits_equal(kern[~w], before[~w]), f"{name}: the kernel wrote a row it must not touch"
    assert bits_equal(twin[~w], before[~w]), f"{name}: the twin wrote a row it must not touch"
    assert rel_l2(kern[w], twin[w]) <= tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec,T,rows,left", [
    (SLIDING, 1, [1, 1, 0, 1], False),      # decode, one idle batch row
    (GLOBAL, 4, [4, 2, 3, 1], False),       # window rows, right padding, log-tau
    (ODD, 3, [3, 1, 2, 2], True),           # left padding, K=3, hd 12
], ids=["sliding-decode", "global-window", "odd-leftpad"])
def test_kernel_matches_twin(spec, T, rows, left, dtype):
    case = build_case(spec, LENGTHS, rows, T, dtype=dtype, seed=12 + T, left_pad=left)
    twin, twin_state, kern, kern_state = run_both(case)
    v = case.valid
    assert rel_l2(kern.q[v], twin.q[v]) <= TOL[dtype]
    assert rel_l2(kern.rel[v], twin.rel[v]) <= 1e-5
    # padding rows: nothing written (still NaN)
    assert kern.q[~v].isnan().all() and kern.rel[~v].isnan().all()
    # conv rings: exact copies at the valid positions, every other row untouched (still poison)
    for name in ("k_ring", "v_ring"):
        assert bits_equal(kern_state[name], twin_state[name]), name
    for name in ("k_cache", "v_cache"):
        check_cache(case, name, kern_state, twin_state, TOL[dtype])


def test_flat_kv_mode_for_long_calls():
    """T + K - 1 > R (a prompt): flat k/v out, no cache row written, rings hold the last R inputs."""
    spec = GLOBAL
    T = 9
    case = build_case(spec, [0, 5, 17], [9, 6, 8], T, seed=13, R=5)   # R = 5 < T + K - 1 = 12
    twin, twin_state, kern, kern_state = run_both(case, flat_kv=True)
    v = case.valid
    for a, b in ((kern.q, twin.q), (kern.rel, twin.rel), (kern.k, twin.k), (kern.v, twin.v)):
        assert rel_l2(a[v], b[v]) <= 1e-5
    assert rel_l2(kern.k[v], case.k_new[v]) <= 1e-5 and rel_l2(kern.v[v], case.v_new[v]) <= 1e-5
    assert kern.k[~v].isnan().all()
    for name in ("k_ring", "v_ring"):
        assert bits_equal(kern_state[name], twin_state[name]), name
        assert not bits_equal(kern_state[name], getattr(case, name))
    for name in ("k_cache", "v_cache"):
        assert bits_equal(kern_state[name], getattr(case, name)), f"{name} written in flat_kv mode"


def test_checkpoint_conv_layout_accepted():
    """Conv weights in the checkpoint layout [C, 1, K] give the same result as [C, K]."""
    case = build_case(SLIDING, [3, 30], [1, 1], 1, seed=14)
    kw = case.prep_kwargs() | case.clone_state()
    kw["k_conv"], kw["v_conv"] = kw["k_conv"][:, None], kw["v_conv"][:, None]
    a = attention_prep(case.q, case.k_in, case.v_in, case.r, **kw)
    b = attention_prep(case.q, case.k_in, case.v_in, case.r, **(case.prep_kwargs() | case.clone_state()))
    assert torch.equal(a.q, b.q)


def test_rejects_bad_input():
    case = build_case(SLIDING, [3, 30], [2, 2], 2, seed=15)

    def call(**change):
        kw = case.prep_kwargs() | case.clone_state()
        args = dict(q=case.q, k_in=case.k_in, v_in=case.v_in, r=case.r)
        for k in list(change):
            if k in args:
                args[k] = change.pop(k)
        return attention_prep(args["q"], args["k_in"], args["v_in"], args["r"], **(kw | change))

    R = case.k_ring.shape[1]
    small = case.k_ring[:, : R - 1].contiguous()
    with pytest.raises(ValueError, match=r"R >= T \+ K - 1.*flat_kv"):
        call(k_ring=small, v_ring=small.clone())
    with pytest.raises(ValueError, match="k_in: expected shape"):
        call(k_in=case.k_in[..., :-1])
    with pytest.raises(ValueError, match="int32"):
        call(pos=case.pos.long())
    with pytest.raises(ValueError, match="v_in: dtype"):
        call(v_in=case.v_in.double())
    with pytest.raises(ValueError, match="k_conv"):
        call(k_conv=case.weights["k_conv"][:-1])
    with pytest.raises(ValueError, match="q_norm"):
        call(q_norm=case.weights["q_norm"][:-1])
    with pytest.raises(ValueError, match="v_cache"):
        call(v_cache=case.v_cache[:, :-1].contiguous())
    cap = case.k_cache.shape[1]
    with pytest.raises(ValueError, match="cap"):
        long = build_case(SLIDING, [0], [cap + 1], cap + 1, seed=16, R=cap + 8, cap=cap)
        attention_prep(long.q, long.k_in, long.v_in, long.r, **(long.prep_kwargs() | long.clone_state()))


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("name", list(REAL))
def test_real_sizes_gpu(name, T):
    """bf16 kernel vs twin and vs the fp32 reference at real head counts; batch 8 with ragged
    histories (0 to 33000, rings wrapped), padding rows, log-tau active on global layers."""
    spec = REAL[name]
    lengths = [0, 1, 17, 600, 4096, 33000, 777, 5]
    rows = [T, T, max(1, T - 2), T, 0, T, 1, T]
    case = build_case(spec, lengths, rows, T, dtype=torch.bfloat16, ref_dtype=torch.float32, device="cuda",
                      seed=20 + T)
    twin, twin_state, kern, kern_state = run_both(case)
    torch.cuda.synchronize()
    v = case.valid
    assert kern.q[~v].isnan().all()
    assert rel_l2(kern.q[v], twin.q[v]) <= 1e-2 and rel_l2(kern.rel[v], twin.rel[v]) <= 1e-5
    for name_ in ("k_ring", "v_ring"):
        assert bits_equal(kern_state[name_], twin_state[name_])
    b_i, t_i = v.nonzero(as_tuple=True)
    cap = case.k_cache.shape[1]
    for name_, ref in (("k_cache", case.k_new), ("v_cache", case.v_new)):
        check_cache(case, name_, kern_state, twin_state, 1e-2)
        assert rel_l2(kern_state[name_][case.slot.long()[b_i], case.pos[b_i, t_i].long() % cap], ref[v]) <= 1e-2


@pytest.mark.parametrize("spec", [SLIDING, ODD], ids=["sliding", "odd-K3"])
def test_padding_right_before_position_zero(spec):
    """A fresh sequence with left padding (an engine's draft window over a short prompt: pos -1, -1, 0,
    1): the conv taps of positions 0.. read zero for the positions before 0, never the padding rows'
    (NaN) inputs, which also hold -1. Kernel and twin against the reference's keys and values."""
    case = build_case(spec, [0, 0, 5], [2, 1, 3], 4, seed=17, left_pad=True)
    twin, twin_state, kern, kern_state = run_both(case)
    v = case.valid
    b_i, t_i = v.nonzero(as_tuple=True)
    s_i, p_i = case.slot.long()[b_i], case.pos[b_i, t_i].long()
    cap = case.k_cache.shape[1]
    for state in (kern_state, twin_state):
        assert rel_l2(state["k_cache"][s_i, p_i % cap], case.k_new[v]) <= 1e-5
        assert rel_l2(state["v_cache"][s_i, p_i % cap], case.v_new[v]) <= 1e-5
