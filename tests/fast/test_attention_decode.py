"""attention_decode (decode T = 1, verify/draft windows T = k+1, split-KV): the twin (with the prep
twin) against the reference Attention on a flat history, the kernel against the twin on rings
(wrap-around, ragged lengths, padding rows, poisoned outputs), the split-KV merge under large
logits, and the kernels end to end against the reference. Real sizes on the GPU."""

import os
import sys

import pytest
import torch

from attn_helpers import Spec, build_case, rel_l2
from inkling_fast.kernels.attention_decode import (MIN_SPLIT_KEYS, attention_decode, attention_decode_torch,
                                                   choose_num_splits)
from inkling_fast.kernels.attention_prep import attention_prep, attention_prep_torch

SLIDING = Spec("sliding", nH=6, nKV=2, hd=16, extent=11, d_rel=5, H=24)
GLOBAL = Spec("global", nH=4, nKV=1, hd=16, extent=13, d_rel=5, H=24, log_tau=(7, 0.3))
ODD = Spec("global", nH=6, nKV=3, hd=12, extent=9, d_rel=3, K=3, H=20, log_tau=(5, 0.2))
SPECS = {"sliding": SLIDING, "global-logtau": GLOBAL, "odd-hd12": ODD}
LENGTHS = [0, 5, 23, 40]          # contexts: fresh, shorter than the extent, rings wrapped
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def prepared(case, prep_fn=attention_prep_torch):
    """Run the prep (writes the caches); returns (prep, state)."""
    state = case.clone_state()
    prep = prep_fn(case.q, case.k_in, case.v_in, case.r, **(case.prep_kwargs() | state))
    return prep, state


@pytest.mark.parametrize("T,rows", [(1, [1, 1, 1, 0]), (3, [3, 2, 3, 1])], ids=["decode", "window"])
@pytest.mark.parametrize("name", list(SPECS))
def test_twin_matches_reference(name, T, rows):
    """float64, prep twin + attention twin == reference Attention (ragged lengths, padding)."""
    spec = SPECS[name]
    case = build_case(spec, LENGTHS, rows, T, dtype=torch.float64, seed=31 + T)
    prep, state = prepared(case)
    out = attention_decode_torch(prep.q, prep.rel, state["k_cache"], state["v_cache"], case.slot, case.pos,
                                 window=spec.window)
    v = case.valid
    assert rel_l2(out[v], case.out[v]) < 1e-12


def test_twin_respects_mask_and_extent():
    """The reference differs from a copy without the extent cut-off / without the window, so the
    agreement above pins both (a twin that ignored them would fail)."""
    case = build_case(SLIDING, [30], [2], 2, dtype=torch.float64, seed=33)
    prep, state = prepared(case)
    args = (prep.q, prep.rel, state["k_cache"], state["v_cache"], case.slot, case.pos)
    good = attention_decode_torch(*args, window=SLIDING.window)
    assert rel_l2(good[case.valid], case.out[case.valid]) < 1e-12
    wider = attention_decode_torch(*args, window=SLIDING.window + 1)
    assert rel_l2(wider[case.valid], case.out[case.valid]) > 1e-3


def run_kernel(case, prep, state, **kw):
    """The kernel with a NaN-poisoned output; checks padding rows stayed poisoned."""
    out = torch.full_like(prep.q, float("nan"))
    res = attention_decode(prep.q, prep.rel, state["k_cache"], state["v_cache"], case.slot, case.pos,
                           window=case.spec.window, out=out, **kw)
    assert res is out
    assert out[~case.valid].isnan().all(), "a padding row was written"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,rows,splits", [(1, [1, 1, 1, 0], 1), (1, [1, 1, 1, 1], 3), (4, [4, 2, 3, 0], 2)],
                         ids=["decode", "decode-split3", "window-split2"])
@pytest.mark.parametrize("name", list(SPECS))
def test_kernel_matches_twin(name, T, rows, splits, dtype):
    spec = SPECS[name]
    case = build_case(spec, LENGTHS, rows, T, dtype=dtype, seed=41 + T + splits)
    prep, state = prepared(case)
    twin = attention_decode_torch(prep.q, prep.rel, state["k_cache"], state["v_cache"], case.slot, case.pos,
                                  window=spec.window)
    out = run_kernel(case, prep, state, num_splits=splits)
    v = case.valid
    assert rel_l2(out[v], twin[v]) <= TOL[dtype]


def test_kernels_match_reference_end_to_end():
    """fp32: prep kernel + attention kernel == reference Attention, global (log-tau) and sliding."""
    for spec, T, rows in ((GLOBAL, 3, [3, 1, 2, 3]), (SLIDING, 2, [2, 2, 0, 1])):
        case = build_case(spec, LENGTHS, rows, T, dtype=torch.float32, seed=51)
        prep, state = prepared(case, attention_prep)
        out = run_kernel(case, prep, state, num_splits=2)
        assert rel_l2(out[case.valid], case.out[case.valid]) <= 1e-5


def test_split_merge_is_stable_for_large_logits():
    """Scores of several hundred (exp overflows fp32 without the max shift) and splits whose partial
    maxima differ widely: the log-sum-exp merge must still match the twin."""
    case = build_case(GLOBAL, [37, 44], [1, 1], 1, dtype=torch.float32, seed=52)
    prep, state = prepared(case)
    q = prep.q * 40.0                           # logits ~ +-300 after the 1/hd scale
    rel = prep.rel * 30.0
    twin = attention_decode_torch(q, rel, state["k_cache"], state["v_cache"], case.slot, case.pos)
    assert torch.isfinite(twin).all()
    for splits in (1, 4):
        out = attention_decode(q, rel, state["k_cache"], state["v_cache"], case.slot, case.pos, num_splits=splits)
        assert rel_l2(out, twin) <= 1e-5


def test_choose_num_splits():
    sms = 132
    assert choose_num_splits(8, 40000, sms) == 33              # B=1 x 8 KV heads: fill 2 programs/SM
    assert choose_num_splits(256, 40000, sms) == 2
    assert choose_num_splits(264, 40000, sms) == 1              # enough programs already
    assert choose_num_splits(8, 515, sms) == -(-515 // MIN_SPLIT_KEYS)   # sliding: few keys, few splits
    assert choose_num_splits(8, 10, sms) == 1


def test_rejects_bad_input():
    case = build_case(SLIDING, [12, 30], [2, 2], 2, seed=53)
    prep, state = prepared(case)
    k, v = state["k_cache"], state["v_cache"]
    with pytest.raises(ValueError, match=r"cap >= window \+ T - 1"):
        attention_decode(prep.q, prep.rel, k, v, case.slot, case.pos, window=k.shape[1])
    with pytest.raises(ValueError, match="rel: expected float32"):
        attention_decode(prep.q, prep.rel.double(), k, v, case.slot, case.pos, window=11)
    with pytest.raises(ValueError, match="query heads"):
        attention_decode(prep.q[:, :, :5].contiguous(), prep.rel[:, :, :5].contiguous(), k, v, case.slot, case.pos)
    with pytest.raises(ValueError, match="num_splits"):
        attention_decode(prep.q, prep.rel, k, v, case.slot, case.pos, window=11, num_splits=0)
    with pytest.raises(ValueError, match="slot"):
        attention_decode(prep.q, prep.rel, k, v, case.slot.long(), case.pos, window=11)


def test_benchmark_builds_on_cpu():
    """benchmarks/bench_attention.py imports and builds every case without a GPU (dry run), and its
    tiny versions agree kernel vs twin."""
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    rows = mod.dry_run(limit=2)
    assert len(rows) == len(mod.cases()) >= 75 and all(r.bytes > 0 for r in rows)
    assert ["dry run" in r.note for r in rows[:3]] == [True, True, False]


# ----------------------------------------------------------------------------------------------- GPU
REAL = {
    "small-sliding-32/8": Spec("sliding", 32, 8, 128, 512, H=512),
    "small-global-32/8": Spec("global", 32, 8, 128, 1024, H=512, log_tau=(256, 0.1)),
    "inkling-global-64/8": Spec("global", 64, 8, 128, 1024, H=512, log_tau=(256, 0.1)),
    "inkling-sliding-64/16": Spec("sliding", 64, 16, 128, 512, H=512),
}
CONTEXTS = [1, 17, 600, 4096, 33000]


def ragged(ctx, B):
    """B history lengths around ctx (batch 1: exactly ctx)."""
    if B == 1:
        return [ctx]
    return [ctx, max(0, ctx - 1), ctx // 2, max(0, ctx - 17), 0, ctx // 3 + 5, max(0, ctx - 600), ctx][:B]


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("name", list(REAL))
def test_real_sizes_gpu(name, T, ctx, B):
    """bf16 kernels (prep + attention, auto split-KV and split-KV off) vs the twin on the same caches
    and vs the fp32 reference; ragged lengths, padding rows, ring wrap, log-tau active (n_floor 256)."""
    spec = REAL[name]
    lengths = ragged(ctx, B)
    rows = [T] * B if B == 1 else [T, T, max(1, T - 3), T, T, 0, T, 1]
    case = build_case(spec, lengths, rows, T, dtype=torch.bfloat16, ref_dtype=torch.float32, device="cuda",
                      seed=ctx + T + B)
    prep, state = prepared(case, attention_prep)
    v = case.valid
    twin = attention_decode_torch(prep.q, prep.rel, state["k_cache"], state["v_cache"], case.slot, case.pos,
                                  window=spec.window)
    for splits in (None, 1):
        out = run_kernel(case, prep, state, num_splits=splits)
        assert rel_l2(out[v], twin[v]) <= 1e-2, f"vs twin, num_splits={splits}"
        assert rel_l2(out[v], case.out[v]) <= 1e-2, f"vs reference, num_splits={splits}"


@pytest.mark.gpu
@pytest.mark.parametrize("ctx", [600, 33000])
@pytest.mark.parametrize("name", ["small-global-32/8", "inkling-sliding-64/16"])
def test_real_sizes_fp32_gpu(name, ctx):
    """fp32 end to end (IEEE dots) vs the fp32 reference: relative L2 <= 1e-5, split-KV on."""
    spec = REAL[name]
    case = build_case(spec, ragged(ctx, 8), [5, 5, 2, 5, 5, 0, 5, 1], 5, dtype=torch.float32,
                      ref_dtype=torch.float32, device="cuda", seed=ctx)
    prep, state = prepared(case, attention_prep)
    out = run_kernel(case, prep, state)
    assert rel_l2(out[case.valid], case.out[case.valid]) <= 1e-5
