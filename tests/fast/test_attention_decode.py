"""attention_decode (decode T = 1, verify/draft windows T = k+1, split-KV): the twin (with the prep
twin) against the reference Attention on a flat history, the kernel against the twin on rings
(wrap-around, ragged lengths, padding rows, poisoned outputs), the split-KV merge under large
logits, and the kernels end to end against the reference. Real sizes on the GPU."""

import contextlib
import importlib
import os
import warnings

import pytest
import torch

from attn_helpers import REAL, AddressCheck, Spec, build_case
from helpers import TOL, load_benchmark
from inkling_fast.kernels.attention_decode import (MAX_SPLITS, MIN_SPLIT_KEYS, attention_decode,
                                                   attention_decode_torch, choose_num_splits, sm_count)
from inkling_fast.kernels.common import interpreting
from inkling_fast.kernels.attention_prep import attention_prep, attention_prep_torch
from inkling_ref.testing import rel_l2
from mutants import load_mutant

SLIDING = Spec("sliding", nH=6, nKV=2, hd=16, extent=11, d_rel=5, H=24)
GLOBAL = Spec("global", nH=4, nKV=1, hd=16, extent=13, d_rel=5, H=24, log_tau=(7, 0.3))
ODD = Spec("global", nH=6, nKV=3, hd=12, extent=9, d_rel=3, K=3, H=20, log_tau=(5, 0.2))
SPECS = {"sliding": SLIDING, "global-logtau": GLOBAL, "odd-hd12": ODD}
LENGTHS = [0, 5, 23, 40]          # contexts: fresh, shorter than the extent, rings wrapped


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


def test_split_merge_ignores_what_unwritten_partials_hold(monkeypatch):
    """The split buffers come from torch.empty and padding rows never write theirs: the merge must not
    compute on them. Buffers pre-filled with +inf (what freed memory may hold) must leave the result
    bit-identical, the padding rows untouched, and (in the interpreter, where the merge is numpy)
    raise no floating-point warning: inf - inf in the max shift used to reach nbval's stderr check."""
    case = build_case(GLOBAL, [37, 44, 9], [1, 0, 1], 1, dtype=torch.float32, seed=54)
    prep, state = prepared(case)
    clean = run_kernel(case, prep, state, num_splits=3)
    real_empty = torch.empty

    def empty_full_of_inf(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("inf"))

    monkeypatch.setattr(torch, "empty", empty_full_of_inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dirty = run_kernel(case, prep, state, num_splits=3)
    monkeypatch.undo()
    assert torch.equal(dirty[case.valid], clean[case.valid])


def test_choose_num_splits_is_a_valid_split_count():
    """The automatic split count (a launch choice, free to change) is one the kernel accepts: 1 when
    there are too few keys to split, else between 1 and MAX_SPLITS, for any sizes; that every
    split count gives the same result is pinned by the kernel tests above (num_splits 1 to 4)."""
    for programs in (1, 8, 32, 263, 264, 4096):
        for max_keys in (1, 10, MIN_SPLIT_KEYS, 515, 40000):
            for sms in (4, 132):
                S = choose_num_splits(programs, max_keys, sms)
                assert isinstance(S, int) and 1 <= S <= MAX_SPLITS
                assert S == 1 or max_keys > MIN_SPLIT_KEYS


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


def big_cache_case(tmp_path, dtype=torch.float32, seed=54):
    """A global-layer call whose KV cache has more than 2^31 elements (nKV 1, hd 16, cap 40 and
    3,355,445 slots; file-backed and sparse, so only the rows written cost memory), read at its last
    two slots: the last slot starts at element 2,147,484,160 > 2^31, the one before crosses 2^31 at
    its row 8. Returns the arguments of attention_decode (the two rows: T=3, one padding row)."""
    nH, nKV, hd, cap, E, T = 2, 1, 16, 40, 8, 3
    slots = 2**31 // (cap * nKV * hd) + 2
    assert (slots - 1) * cap * nKV * hd > 2**31
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.from_file(str(tmp_path / f"{n}.bin"), shared=True, size=slots * cap * nKV * hd,
                                        dtype=dtype).view(slots, cap, nKV, hd) for n in ("k", "v"))
    slot = torch.tensor([slots - 1, slots - 2], dtype=torch.int32)
    for s in slot.tolist():
        k_cache[s] = torch.randn(cap, nKV, hd, generator=g).to(dtype)
        v_cache[s] = torch.randn(cap, nKV, hd, generator=g).to(dtype)
    pos = torch.tensor([[36, 37, 38], [17, 18, -1]], dtype=torch.int32)
    q = torch.randn(2, T, nH, hd, generator=g).to(dtype)
    rel = torch.randn(2, T, nH, E, generator=g)
    return q, rel, k_cache, v_cache, slot, pos


INTERPRETER_ONLY = pytest.mark.skipif(not interpreting(),
                                      reason="AddressCheck instruments the Triton interpreter (CPU runs)")


@INTERPRETER_ONLY
@pytest.mark.parametrize("splits", [1, 3])
def test_cache_offsets_past_int32(tmp_path, splits):
    """Cache offsets are int64: with a KV cache of more than 2^31 elements read at its last slots,
    every address the kernel loads or stores lies inside its tensors (AddressCheck) and the output
    matches the twin: the arithmetic past the point where int32 offsets wrap."""
    q, rel, k, v, slot, pos = big_cache_case(tmp_path)
    out = torch.full_like(q, float("nan"))
    with AddressCheck([q, rel, k, v, slot, pos, out], allow_new=True) as chk:
        attention_decode(q, rel, k, v, slot, pos, num_splits=splits, out=out)
    assert chk.loads > 0 and chk.stores > 0
    valid = pos >= 0
    assert out[~valid].isnan().all(), "a padding row was written"
    twin = attention_decode_torch(q, rel, k, v, slot, pos)
    assert rel_l2(out[valid], twin[valid]) <= 1e-5


@INTERPRETER_ONLY
def test_address_check_catches_int32_cache_offsets(tmp_path):
    """The check above can fail: a kernel whose slot index stays int32 wraps past 2^31 and is caught."""
    mutant = load_mutant(tmp_path, [("kernels/attention_decode.py", "s = tl.load(slot_ptr + b).to(tl.int64)",
                                     "s = tl.load(slot_ptr + b)")], package="inkling_fast")
    broken = importlib.import_module(mutant.__name__ + ".kernels.attention_decode").attention_decode
    from triton.runtime.errors import InterpreterError
    q, rel, k, v, slot, pos = big_cache_case(tmp_path)
    with pytest.raises(InterpreterError, match="load of .* lanes outside every tensor"), \
            AddressCheck([q, rel, k, v, slot, pos], allow_new=True):
        broken(q, rel, k, v, slot, pos, num_splits=1)


@INTERPRETER_ONLY
@pytest.mark.skipif(os.environ.get("INKLING_EXACT_CASE") != "1",
                    reason="1-2 min per T in the interpreter; set INKLING_EXACT_CASE=1 to run")
@pytest.mark.parametrize("T", [1, 9])
def test_benchmark_case_b4_ctx32k_addresses(T):
    """A benchmark case with split-KV (global, B=4, ctx=32768, 32/8 heads, hd 128, bf16, the split
    count chosen for 132 SMs), built by the benchmark itself: every address the kernel and the merge
    touch lies inside their tensors, and the output matches the twin."""
    bench = load_benchmark("bench_attention")
    c = bench.Case("attention", "global", T, 4, 32768)
    q, rel, k, v, slot, pos = bench.make_inputs(c, "cpu")
    S = choose_num_splits(c.B * bench.NKV, c.ctx + T, 132)
    assert S > 1, "the case must exercise split-KV"
    out = torch.full_like(q, float("nan"))
    with AddressCheck([q, rel, k, v, slot, pos, out], allow_new=True) as chk:
        attention_decode(q, rel, k, v, slot, pos, num_splits=S, out=out)
    assert chk.loads >= 2 * k.numel()                  # every K and V element read at least once
    assert rel_l2(out, attention_decode_torch(q, rel, k, v, slot, pos, num_keys=c.ctx + T)) <= 1e-2


def test_benchmark_builds_on_cpu():
    """benchmarks/bench_attention.py imports and builds every case without a GPU (dry run), and its
    tiny versions agree kernel vs twin."""
    mod = load_benchmark("bench_attention")
    rows = mod.dry_run(limit=2)
    assert len(rows) == len(mod.cases()) >= 75 and all(r.bytes > 0 for r in rows)
    assert ["dry run" in r.note for r in rows[:3]] == [True, True, False]


class FakeStream:
    def __init__(self, name):
        self.name, self.waited_for = name, []

    def wait_stream(self, other):
        self.waited_for.append(other)


def test_bench_graph_warmup_waits_for_the_inputs(monkeypatch):
    """harness.bench_graph warms up on a side stream; the input sets were built on the current
    stream and may still be in flight there, so the side stream must wait for it before the first
    call. (Without the wait the attention benchmark read unwritten slot indices: the illegal memory
    access at B=4 ctx=32k.) CUDA streams and graphs are faked here; each call records its stream and
    whether that stream had waited for the inputs' stream by then."""
    harness = load_benchmark("harness")
    import triton.testing
    inputs_stream = FakeStream("current")
    now = {"stream": inputs_stream, "capturing": False}
    calls = []

    @contextlib.contextmanager
    def use_stream(stream):
        prev, now["stream"] = now["stream"], stream
        try:
            yield
        finally:
            now["stream"] = prev

    @contextlib.contextmanager
    def capture(graph):
        now["capturing"] = True
        try:
            yield
        finally:
            now["capturing"] = False

    class FakeGraph:
        def replay(self):
            calls.append("replay")

    monkeypatch.setattr(torch.cuda, "Stream", lambda: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "stream", use_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: now["stream"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 3.0)[1])

    def fn(x):
        s = now["stream"]
        calls.append(("capture" if now["capturing"] else "warm-up", s.name, s is inputs_stream
                      or inputs_stream in s.waited_for))

    assert harness.bench_graph(fn, [(1,), (2,), (3,)]) == 1.0         # 3 ms per replay of 3 calls
    warm = [i for i, c in enumerate(calls) if c[0] == "warm-up"]
    assert len(warm) == 3 and all(calls[i][1] == "side" for i in warm)
    assert all(calls[i][2] for i in warm), f"warm-up ran before its stream waited for the inputs: {calls}"
    assert "sync" in calls[warm[-1]:calls.index("replay")], "no synchronize between warm-up and replay"
    assert [c[0] for c in calls if isinstance(c, tuple) and c[0] == "capture"] == ["capture"] * 3


# ----------------------------------------------------------------------------------------------- GPU
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


@pytest.mark.gpu
def test_bench_graph_waits_for_the_inputs_gpu():
    """On the GPU: the current stream is kept busy (~0.5 s) before it writes the input, so a warm-up
    that does not wait for it reads the old value and sets the flag; the graph replays (after the
    warm-up) cannot clear it."""
    harness = load_benchmark("harness")
    stale = torch.zeros((), dtype=torch.bool, device="cuda")

    def fn(x):
        torch.logical_or(stale, (x != 1).any(), out=stale)

    x = torch.ones(4096, device="cuda")
    fn(x)                                  # load the kernels now, not inside the race window
    x.zero_()
    torch.cuda.synchronize()
    assert not stale.item()
    torch.cuda._sleep(1_000_000_000)       # ~0.5 s of GPU clock cycles on the current stream
    x.fill_(1.0)                           # the input is ready only after that
    harness.bench_graph(fn, [(x,)])
    assert not stale.item(), "bench_graph's warm-up read the input before the stream that writes it was done"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 9])
def test_benchmark_case_b4_ctx32k_gpu(T):
    """A benchmark case with split-KV (global, B=4, ctx=32768, auto splits), built by the benchmark
    itself and run through harness.bench_graph (rotated sets, side-stream warm-up, capture, replays);
    then the kernel (auto splits, NaN-poisoned output) against the twin on every set."""
    bench = load_benchmark("bench_attention")
    c = bench.Case("attention", "global", T, 4, 32768)
    S = choose_num_splits(c.B * bench.NKV, c.ctx + T, sm_count(torch.device("cuda")))
    assert S > 1, "the case must exercise split-KV"
    sets = bench.harness.rotating_inputs(lambda: bench.make_inputs(c, "cuda"), bench.floor_bytes(c))
    kernel, twin = bench._fns(c)
    assert bench.harness.bench_graph(kernel, sets) > 0
    for q, rel, k, v, slot, pos in sets:
        out = torch.full_like(q, float("nan"))
        attention_decode(q, rel, k, v, slot, pos, out=out)
        assert rel_l2(out, twin(q, rel, k, v, slot, pos)) <= 1e-2
