"""What the fast engine compiles and captures: Triton kernel compilations and CUDA-graph captures of a
batch-1 greedy `Engine.generate` (float32, as the CLI runs it) and a batch-8 sampled one (bf16) on tiny
random models. A second call with the same shapes must compile nothing and capture nothing; the first
compiles each kernel at most once per distinct set of compile-time constants the call needs, and captures
one graph per prefill-pass shape and per cycle batch size it runs.

GPU only: under the CPU interpreter (CI) no kernel is compiled, so there is nothing to count.

A kernel is compiled once per *specialization*: its constexpr arguments, and Triton's classes of the
others (an integer equal to 1, divisible by 16, or neither; a pointer 16-byte aligned or not). Sizes that
change from call to call (row, token, pair and batch counts) are runtime arguments of the kernels
(`do_not_specialize`), so a kernel's specializations follow from the model and from a few tile choices
of its wrapper. The bounds below count those choices, kernel by kernel, from the wrappers' launch code
and the shapes the call runs, which come from the engine's own plan:

    prefill pass (B, T)   prefill_plan.prefill_passes over the prompts: the trunk and every depth over B x T tokens
                          (padding rows and tokens included), the first token x_L over B rows
    cycle at batch B      every depth over a window of B x (k+1) tokens, the drafts' LM head over B rows,
                          the verify over B x (k+1) tokens (greedy: and its LM head over as many rows)

The models' widths are multiples of 16, as every Inkling model's: strides and element counts that scale
with the rows then keep one divisibility class.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
import torch
import triton
from test_engine import agreeable_model, engine_config

from inkling_fast import Engine, forward
from inkling_fast.prefill_plan import prefill_passes
from inkling_fast.step_io import CycleKey, PrefillKey
from inkling_fast.kernels import lm_head_rows, mtp_input, short_conv
from inkling_fast.kernels.attention_decode import MIN_SPLIT_KEYS
from inkling_fast.kernels.lm_head_argmax import MAX_BLOCK_T
from inkling_fast.kernels.moe import MAX_TOKENS
from inkling_fast.kernels.moe_grouped import block_m_for

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="counts Triton compilations: under the CPU interpreter nothing is compiled")
K = 4                  # drafts per cycle (the README's --k 4)
PAIR_TILE = 32         # moe.moe_experts: one pair tile up to 32 (token, expert) pairs, a wider one above
ROUTER_TILE = 16       # moe_router.moe_route: one token tile up to 16 tokens, a wider one above


def tiny_model(dtype):
    """engine_config's model with q, k, v, r and the dense MLP 16-aligned (d_rel 8: r = 2 x 8 = 16)."""
    return agreeable_model(engine_config(d_rel=8, dense_intermediate_size=32), seed=11, dtype=dtype)


def planned_steps(engine: Engine, prompt_lengths: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """The engine's own plan of a `generate` of prompts of these lengths, all admitted at once: (B, T) of
    its distinct prefill passes (prefill_plan.prefill_passes), and the batch sizes a cycle may run at
    (sequences finish at different cycles, so any captured size up to the one that holds every prompt)."""
    assert len(prompt_lengths) <= engine.max_batch_size, "more prompts than slots: admissions would interleave"
    passes = prefill_passes(prompt_lengths, engine.prefill_lengths, engine.batch_sizes, engine.prefill_tokens)
    top = engine.scheduler.batch_size_for(len(prompt_lengths))
    return list(dict.fromkeys(passes)), [b for b in engine.batch_sizes if b <= top]


def attention_layers(engine: Engine) -> list[tuple]:
    """Per attention layer of the trunk and the depths: (attention kind, prep kind, K/V width, max keys).
    The attention kernels' constexprs and integer classes are per kind (head shape, window and cache
    rows), attention_prep's also per log-tau; commit_rows copies K/V rows of nKV * hd; a window or
    verify attends to at most `max keys` (attention_decode: the split-KV choice)."""
    out = []
    layers = [(b.attn, c) for b, c in zip(engine.W.blocks, engine.trunk_caches)] + \
             [(d.block.attn, c) for d, c in zip(engine.W.depths, engine.depth_caches)]
    for a, cache in layers:
        cap = cache.k.shape[1]
        kind = (a.num_heads, a.num_kv_heads, a.head_dim, a.window, cap)
        max_keys = cap if a.window is None else min(cap, a.window + engine.k)     # window + T - 1, T = k + 1
        out.append((kind, kind + (a.log_tau is None,), a.num_kv_heads * a.head_dim, max_keys))
    return out


def bounds(engine: Engine, prompt_lengths: list[int], greedy: bool) -> dict[str, int]:
    """Per kernel, the most specializations one `generate` of prompts of these lengths can compile
    (drafts picked greedily, device uniforms)."""
    k, H, dtype = engine.k, engine.config.hidden_size, engine.dtype
    passes, cycles = planned_steps(engine, prompt_lengths)
    pass_tokens = [B * T for B, T in passes]                   # the trunk and every depth over the pass
    window_tokens = [B * (k + 1) for B in cycles]              # each depth's window, the verify
    tokens = pass_tokens + window_tokens
    moe = engine.W.blocks[-1].mlp
    pairs_per_token = moe.top_k + moe.shared_w13.shape[0]
    many = [n for n in tokens if n >= forward.MANY_TOKENS or n > MAX_TOKENS]  # forward.mlp_forward's choice
    few = [n for n in tokens if n not in many]
    head_rows = list(cycles) + ([B for B, _ in passes] + window_tokens if greedy else [])  # drafts (+ x_L, verify)
    rows_head = [r for r in head_rows if r >= forward.MANY_ROWS]
    argmax_head = [r for r in head_rows if r < forward.MANY_ROWS]

    rings = [c.attn_ring.shape[1] for c in engine.trunk_caches + engine.depth_caches] + \
            [c.mlp_ring.shape[1] for c in engine.trunk_caches + engine.depth_caches]
    conv_k = engine.config.conv_kernel_size
    # WRITE: whether a call's rows write the ring as they go (windows) or commit_rows copies them after
    conv_writes = {short_conv.writes_as_it_goes(T, conv_k, R) for T in [T for _, T in passes] + [k + 1]
                   for R in set(rings)}
    layers = attention_layers(engine)
    kinds = {kind for kind, _, _, _ in layers}
    prep_kinds = {prep for _, prep, _, _ in layers}
    # a window splits over the keys only if some layer has more than MIN_SPLIT_KEYS keys to read
    split_kinds = {kind for kind, _, _, max_keys in layers if max_keys > MIN_SPLIT_KEYS}
    copied = {w for _, _, w, _ in layers} | ({H} if False in conv_writes else set())   # commit_rows widths

    b = dict(
        _embed_norm_kernel=1, _rms_norm_kernel=1, _swiglu_kernel=1,     # constexprs of the model only
        _mtp_input_kernel=len({mtp_input.launch_config(H, n) for n in tokens}),
        _short_conv_kernel=len(conv_writes),
        _commit_rows_kernel=len({min(1024, triton.next_power_of_2(w)) for w in copied}),   # BLOCK_C
        _prep_kernel=2 * len(prep_kinds),    # per kind: prefill passes (flat K/V) and windows (into the caches)
        # per kind: prefill passes, and windows split over the keys or not (a choice per batch size)
        _attention_kernel=len(kinds) + len(kinds - split_kinds) + len(split_kinds) * min(2, len(cycles)),
        _router_logits_kernel=len({n <= ROUTER_TILE for n in tokens}),       # two token tiles
        _router_select_kernel=1,
    )
    if split_kinds:
        b.update(_merge_kernel=len(split_kinds) * len(cycles))           # BLOCK_S from the split count
    if few:             # the few-token MoE: two pair tiles
        b.update(_moe_align_kernel=len({n * pairs_per_token <= PAIR_TILE for n in few}),
                 _moe_up_kernel=1, _moe_down_kernel=1, _moe_combine_kernel=1)
    if many:            # the grouped MoE: its GEMMs per BLOCK_M, its plan per token count (two tile widths)
        n_bm = len({block_m_for(n, moe.top_k, moe.w13.shape[0]) for n in many})
        b.update(_count_kernel=1, _scatter_kernel=1, _combine_kernel=1, _plan_kernel=len(set(many)),
                 _grouped_up_kernel=n_bm, _grouped_down_kernel=n_bm)
    if argmax_head:     # BLOCK_T: the rows rounded up to a power of two in 16..MAX_BLOCK_T
        b.update(_lm_head_partial_kernel=len({min(MAX_BLOCK_T, max(16, triton.next_power_of_2(r)))
                                              for r in argmax_head}))
    if rows_head:       # its tiles by rule from the rows and the dtype
        b.update(_lm_head_rows_kernel=len({tuple(sorted(lm_head_rows.launch_config(r, dtype).items()))
                                           for r in rows_head}))
    b.update(_lm_head_reduce_kernel=1)
    if greedy:
        b.update(_greedy_accept_kernel=1)
    else:               # uniforms (BLOCK 16 for x_L's 1 and a cycle's 2k+1 <= 16 draws), x_L, the acceptance
        assert 2 * k + 1 <= 16
        b.update(_philox_uniforms_kernel=1, _sample_kernel=1, _rejection_kernel=1)
    return b


def max_captures(engine: Engine, prompt_lengths: list[int]) -> int:
    """One CUDA graph per distinct prefill-pass shape and per cycle batch size the call may run."""
    passes, cycles = planned_steps(engine, prompt_lengths)
    return len(passes) + len(cycles)


class Counter:
    """Wraps Triton's compile step and CUDA-graph capture: what the code under it compiles and captures."""

    def __init__(self, monkeypatch):
        import triton.runtime.jit as jit
        self.compiles: dict[str, int] = defaultdict(int)
        self.seconds = 0.0
        self.captures = 0
        do_compile = jit.JITFunction._do_compile
        capture_begin = torch.cuda.CUDAGraph.capture_begin

        def counted_compile(fn, *args, **kwargs):
            s = time.perf_counter()
            try:
                return do_compile(fn, *args, **kwargs)
            finally:
                self.compiles[fn.fn.__name__] += 1
                self.seconds += time.perf_counter() - s

        def counted_capture(graph, *args, **kwargs):
            self.captures += 1
            return capture_begin(graph, *args, **kwargs)

        monkeypatch.setattr(jit.JITFunction, "_do_compile", counted_compile)
        monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", counted_capture)

    def take(self) -> tuple[dict[str, int], int]:
        out = dict(self.compiles), self.captures
        self.compiles.clear()
        self.captures = 0
        return out


def check_first_and_second(counter: Counter, engine: Engine, run, prompt_lengths: list[int], greedy: bool) -> None:
    limits = bounds(engine, prompt_lengths, greedy)
    passes, cycles = planned_steps(engine, prompt_lengths)
    passes = set(passes)
    run()
    compiled, captured = counter.take()
    print(f"\nfirst call: {sum(compiled.values())} compilations ({counter.seconds:.1f} s), {captured} captures "
          f"{sorted(engine.graphs, key=str)}: {dict(sorted(compiled.items()))}\nbounds: {dict(sorted(limits.items()))}")
    over = {n: (c, limits.get(n, 0)) for n, c in compiled.items() if c > limits.get(n, 0)}
    assert not over, f"kernels compiled more often than the call needs (count, bound): {over}"
    ran = {(key.batch_size, key.length) for key in engine.graphs if isinstance(key, PrefillKey)}
    cycled = {key.batch_size for key in engine.graphs if isinstance(key, CycleKey)}
    assert ran == passes, f"prefill passes captured {sorted(ran)}, the engine's plan gives {sorted(passes)}"
    assert cycled and cycled <= set(cycles), f"cycles captured at {cycled}"
    assert captured == len(engine.graphs) <= max_captures(engine, prompt_lengths)
    run()
    compiled, captured = counter.take()
    assert compiled == {} and captured == 0, f"the second call compiled {compiled} and captured {captured} graphs"


@pytest.mark.gpu
@GPU_ONLY
def test_batch1_greedy_compiles_once(monkeypatch):
    """The README's shape: one prompt, greedy, k = 4, float32, with a prefill budget of 40 tokens below
    the prompt's 45: the prompt is prefilled in two passes of one row, 40 tokens then 5 padded to 16 (the
    kernels see a token count divisible by 16 and one that is not: each would be its own specialization
    were it not a runtime argument), then cycles at batch 1 (the drafts' LM head over a single row: an
    integer equal to 1 would be its own specialization too)."""
    engine = Engine(tiny_model(torch.float32), max_batch_size=1, max_seq_len=64, num_speculative_tokens=K,
                    dtype=torch.float32, prefill_tokens=40)
    prompt = [(3 * j + 1) % 5 for j in range(45)]
    counter = Counter(monkeypatch)
    check_first_and_second(counter, engine, lambda: engine.generate([prompt], max_new_tokens=12), [len(prompt)],
                           greedy=True)


@pytest.mark.gpu
@GPU_ONLY
def test_batch8_sampled_compiles_once(monkeypatch):
    """Eight prompts of 1 to 23 tokens (one of 16: an integer divisible by 16 would be its own
    specialization), sampled at temperature 0.8 with top-p 0.9, bf16. The prompts share one prefill pass
    of 8 rows, whose tokens reach the grouped MoE; sequences finish at different cycles, so the cycle may
    run (and be captured) at batch 8, 4, 2 and 1."""
    engine = Engine(tiny_model(torch.bfloat16), max_batch_size=8, max_seq_len=48, num_speculative_tokens=K,
                    dtype=torch.bfloat16)
    lengths = [1, 3, 6, 9, 12, 16, 17, 23]
    prompts = [[(7 * i + j) % 5 for j in range(L)] for i, L in enumerate(lengths)]
    counter = Counter(monkeypatch)

    def run():
        engine.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)

    check_first_and_second(counter, engine, run, lengths, greedy=False)
