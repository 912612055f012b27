"""What the fast engine compiles and captures: Triton kernel compilations and CUDA-graph captures of a
batch-1 greedy `Engine.generate` (float32, as the CLI runs it) and a batch-8 sampled one (bf16) on tiny
random models. A second call with the same shapes must compile nothing and capture nothing; the first
compiles each kernel at most once per distinct set of compile-time constants the call needs.

GPU only: under the CPU interpreter (CI) no kernel is compiled, so there is nothing to count.

A kernel is compiled once per *specialization*: its constexpr arguments, and Triton's classes of the
others (an integer equal to 1, divisible by 16, or neither; a pointer 16-byte aligned or not). Sizes that
change from call to call (row, token, pair and batch counts) are runtime arguments of the kernels
(`do_not_specialize`), so a kernel's specializations follow from the model and from a few tile choices
of its wrapper. The bounds below count those choices, kernel by kernel, from the wrappers' launch code.
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
from inkling_fast.kernels.moe_grouped import block_m_for

GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="counts Triton compilations: under the CPU interpreter nothing is compiled")
K = 4                  # drafts per cycle (the README's --k 4)
PAIR_TILE = 32         # moe.moe_experts: one pair tile up to 32 (token, expert) pairs, a wider one above
ROUTER_TILE = 16       # moe_router.moe_route: one token tile up to 16 tokens, a wider one above
DECODE_ROWS = 64       # mtp_input.launch_config: one configuration up to 64 rows


def tiny_model(dtype):
    """engine_config's model with q, k, v, r and the dense MLP 16-aligned (d_rel 8: r = 2 x 8 = 16)."""
    return agreeable_model(engine_config(d_rel=8, dense_intermediate_size=32), seed=11, dtype=dtype)


def attention_kinds(engine: Engine) -> tuple[int, int, int]:
    """(global/sliding kinds, (window, log-tau) kinds, distinct widths the commit_rows kernel copies) over
    the trunk's and the depths' attention layers: the attention kernels' constexprs are per (head shape,
    window) kind, attention_prep's also per log-tau; commit_rows copies K/V rows (nKV * hd) and the conv
    inputs of the residual stream (H)."""
    attn = [b.attn for b in engine.W.blocks] + [d.block.attn for d in engine.W.depths]
    shapes = {(a.num_heads, a.num_kv_heads, a.head_dim, a.window is None) for a in attn}
    prep = {(a.num_heads, a.num_kv_heads, a.head_dim, a.window is None, a.log_tau is None) for a in attn}
    widths = {a.num_kv_heads * a.head_dim for a in attn} | {engine.config.hidden_size}
    return len(shapes), len(prep), len(widths)


def head_tile(rows: int) -> int:
    """lm_head_argmax's row tile (BLOCK_T, a constexpr) for this many rows."""
    return min(64, max(16, triton.next_power_of_2(rows)))


def bounds(engine: Engine, prompt_lengths: list[int], batch_sizes: list[int], greedy: bool) -> dict[str, int]:
    """Per kernel, the most specializations one `generate` can compile: prompts of these lengths (each
    prefilled in one chunk, below MANY_TOKENS), cycles at these batch sizes, drafts picked greedily."""
    kinds, prep_kinds, widths = attention_kinds(engine)
    moe = engine.W.blocks[-1].mlp
    pairs_per_token = moe.top_k + moe.shared_w13.shape[0]
    depth_rows = [L - 1 - K for L in prompt_lengths if L - 1 - K > 0]      # the depths' prefill rows
    window_tokens = [B * (K + 1) for B in batch_sizes]                       # each depth's window, the verify
    few = [n for n in prompt_lengths + depth_rows + window_tokens if n < forward.MANY_TOKENS]
    many = sorted({n for n in window_tokens if n >= forward.MANY_TOKENS})
    assert max(prompt_lengths) < min(forward.MANY_TOKENS, engine.prefill_chunk)
    assert max(depth_rows + window_tokens) <= DECODE_ROWS
    head_rows = list(batch_sizes) + ([1] + window_tokens if greedy else [])  # drafts (+ first token, verify)
    assert max(head_rows) < forward.MANY_ROWS
    b = dict(
        _embed_norm_kernel=1, _rms_norm_kernel=1, _swiglu_kernel=1,     # constexprs of the model only
        _mtp_input_kernel=1,                                            # every call <= DECODE_ROWS rows
        _short_conv_kernel=2,                 # WRITE: windows write the ring as they go, prefill chunks after
        _commit_rows_kernel=widths,           # BLOCK_C from the width copied
        _prep_kernel=2 * prep_kinds,          # per kind: prefill (flat K/V) and windows (into the caches)
        # per kind: prefill, and windows split over the keys or not (a choice per batch size)
        _attention_kernel=kinds * (1 + min(2, len(batch_sizes))),
        _merge_kernel=kinds * len(batch_sizes),                          # BLOCK_S from the split count
        _router_logits_kernel=len({n <= ROUTER_TILE for n in few + many}),   # two token tiles
        _router_select_kernel=1,
        _moe_align_kernel=len({n * pairs_per_token <= PAIR_TILE for n in few}),   # two pair tiles
        _moe_up_kernel=1, _moe_down_kernel=1, _moe_combine_kernel=1,
        _lm_head_partial_kernel=len({head_tile(r) for r in head_rows}),
        _lm_head_reduce_kernel=1,
    )
    if many:            # the grouped MoE: its GEMMs per BLOCK_M, its plan per token count (two tile widths)
        n_bm = len({block_m_for(n, moe.top_k, moe.w13.shape[0]) for n in many})
        b.update(_count_kernel=1, _scatter_kernel=1, _combine_kernel=1, _plan_kernel=len(many),
                 _grouped_up_kernel=n_bm, _grouped_down_kernel=n_bm)
    if greedy:
        b.update(_greedy_accept_kernel=1)
    else:               # uniforms (BLOCK 16 for 1 and 2k+1 <= 16 draws), the first token, the acceptance
        b.update(_philox_uniforms_kernel=1, _sample_kernel=1, _rejection_kernel=1)
    return b


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


def check_first_and_second(counter: Counter, run, limits: dict[str, int], max_captures: int) -> None:
    run()
    compiled, captured = counter.take()
    print(f"\nfirst call: {sum(compiled.values())} compilations ({counter.seconds:.1f} s), {captured} captures: "
          f"{dict(sorted(compiled.items()))}")
    over = {n: (c, limits.get(n, 0)) for n, c in compiled.items() if c > limits.get(n, 0)}
    assert not over, f"kernels compiled more often than the call needs (count, bound): {over}"
    assert 1 <= captured <= max_captures
    run()
    compiled, captured = counter.take()
    assert compiled == {} and captured == 0, f"the second call compiled {compiled} and captured {captured} graphs"


@pytest.mark.gpu
@GPU_ONLY
def test_batch1_greedy_compiles_once(monkeypatch):
    """The README's shape: one prompt, greedy, k = 4, float32. The prompt has k + 2 tokens, so the depths'
    prefill runs over a single row (an integer argument equal to 1 would be its own specialization)."""
    engine = Engine(tiny_model(torch.float32), max_batch_size=1, max_seq_len=32, num_speculative_tokens=K,
                    dtype=torch.float32)
    prompt = [1, 2, 3, 4, 0, 2][: K + 2]
    counter = Counter(monkeypatch)
    limits = bounds(engine, [len(prompt)], [1], greedy=True)
    check_first_and_second(counter, lambda: engine.generate([prompt], max_new_tokens=12), limits, max_captures=1)


@pytest.mark.gpu
@GPU_ONLY
def test_batch8_sampled_compiles_once(monkeypatch):
    """Eight prompts of 1 to 23 tokens (one of 16: an integer divisible by 16 would be its own
    specialization), sampled at temperature 0.8 with top-p 0.9, bf16. Sequences finish at different cycles,
    so the cycle may run (and be captured) at batch 8, 4, 2 and 1."""
    engine = Engine(tiny_model(torch.bfloat16), max_batch_size=8, max_seq_len=48, num_speculative_tokens=K,
                    dtype=torch.bfloat16)
    lengths = [1, 3, 6, 9, 12, 16, 17, 23]
    prompts = [[(7 * i + j) % 5 for j in range(L)] for i, L in enumerate(lengths)]
    counter = Counter(monkeypatch)
    limits = bounds(engine, lengths, engine.batch_sizes, greedy=False)

    def run():
        engine.generate(prompts, max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)

    check_first_and_second(counter, run, limits, max_captures=len(engine.batch_sizes))
