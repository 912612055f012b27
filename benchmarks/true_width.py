"""The whole engine at true Inkling-Small width, measured against its floors and the cost model.

    python benchmarks/true_width.py --out DIR          # GPU: measure; DIR/true_width.json, DIR/true_width.md
    python benchmarks/true_width.py --tiny --out DIR   # CPU (TRITON_INTERPRET=1): tiny widths, every step, no timing
    python benchmarks/true_width.py --render JSON [--md PATH]   # the page from a run's JSON
                                                       # (default PATH: docs/benchmarks/true_width.md)

Options: --batches 1,4,16,64  --ks 0,1,2,4,8  --context 4096  --new-tokens 16  --moe-layers N (default: as
many as fit)  --headroom-gib G  --budget-s S (the run skips what would not finish in S seconds; default 270).

One process, in this order (each step records what it measured in the JSON, which is written after each):

1. The slice. Inkling-Small's layers 0, 1, ... in their real order (two sliding layers with the dense
   MLP, then sliding MoE layers, the last of them global: six layers make layers 0-5 of the real model),
   every MoE layer with all 256 experts, and all 8 MTP depths (global: 1 and 3), random bf16 weights drawn
   on the device (benchmarks/true_scale.py: routers that spread tokens over experts as a trained,
   load-balanced router does). As many MoE layers as fit: the engine has no memory plan of its own, so
   `memory_plan` computes one from the shapes (weights, the engine's caches for batch max(batches) at
   context + new tokens, the slot state, the largest transient of a prefill pass) and the slice takes the
   most MoE layers whose plan, plus headroom, fits the device's free memory.
2. The cost model's inputs, measured in the same run on the slice's own weights and caches (what
   `benchmarks/engine.py layers head` measures on blocks it draws for itself: a second set of 256 experts
   would not fit beside the slice, and the comparison wants the slice's own layers): one layer of each kind
   (forward.block_forward, CUDA-graph replay, context `context`, random inputs) at every batch x T = k + 1,
   the greedy LM head at every batch x T rows, one depth step (depth 0 and the argmax of its last row)
   at every batch x rows = k + 1; and, for the prefill, one chunk of min(prefill budget, context) tokens
   through each layer kind and each depth kind.
3. Whole `Engine.generate` calls, CUDA graphs, greedy, prompts of `context` random tokens, `new_tokens`
   new tokens, at every batch x k (random weights reject nearly every draft: every cycle rolls back):
   the steady wall time per cycle (benchmarks/engine.py `steady_cycles`: the cycles that ran all B
   sequences, overlapped host loop), and the prefill: generate(max_new_tokens=1) with its graphs already
   captured, against its floors (the FLOPs of the pass at the GEMM rate measured here, and the bytes it
   must read at the copy bandwidth).
4. The cycle split at each batch (one batched prefill, then per k the draft chain, the verify pass, the
   accept step and the whole cycle each captured and replayed, the length rolled back after each replay):
   the device time per cycle and its parts; accept + commit = cycle - draft - verify - the LM head of
   the verify rows (the model counts that head in the verify), whose median is the model's accept term.
5. Where a cycle's time goes beyond the isolated layers, at k = 0: each trunk layer replayed on the inputs
   the engine's own verify gives it (recorded from an eager verify), against the same layer on the
   isolated benchmark's random inputs; how many distinct experts each MoE layer's tokens select in both;
   and, at the batch nearest 16, the kernels of one cycle replay against those of the isolated layers and
   LM head, from the profiler.
6. The model: `inkling_fast.cost_model.cycle_parts` for the slice's layer mix, from this run's costs and
   from the committed docs/benchmarks/engine.json, against the steady and the device cycle times; then the
   42-layer Inkling-Small from this run's per-layer costs: cycle times, decode tokens/s at the demo's
   acceptance (docs/benchmarks/demo_acceptance.json) and at vLLM's per-position acceptance for Inkling
   (docs/spec/mtp-cycle.md §6), and whole requests (a `context`-token prompt, 256 new tokens) with the
   prefill costed from the per-kind chunks (checked against the slice's measured prefill).

The engine's API used: the constructor, `generate`, `timings`, and for the split the steps the engine's
docstring lists for driving it by hand (prefill_batch, make_batch, and steps.draft, verify, accept, cycle), its
`trunk_caches` / `depth_caches` and `state.n`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

TINY = "--tiny" in sys.argv
if TINY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before any kernel module is imported
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import engine as bench  # noqa: E402  (benchmarks/engine.py: timing helpers, steady cycles)
import harness  # noqa: E402
import true_scale  # noqa: E402
from inkling_fast import Engine, cost_model, forward  # noqa: E402
from inkling_fast.caches import kv_capacity, ring_rows  # noqa: E402
from inkling_fast.step_io import Decoding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not TINY else "cpu"
BF16 = torch.bfloat16
MD_DEFAULT = ROOT / "docs" / "benchmarks" / "true_width.md"
ENGINE_JSON = ROOT / "docs" / "benchmarks" / "engine.json"
DEMO_ACCEPTANCE = ROOT / "docs" / "benchmarks" / "demo_acceptance.json"
# vLLM, Inkling on GSM8K, k = 8: P(drafts 1..j accepted), j = 1..8; k = 1: 83.6 % (docs/spec/mtp-cycle.md §6)
VLLM_PER_POSITION = {8: [0.757, 0.601, 0.498, 0.411, 0.354, 0.298, 0.261, 0.223], 1: [0.836]}
REQUEST_NEW_TOKENS = 256

if TINY:
    GRID = dict(batches=(2,), ks=(0, 1), context=8, new_tokens=4, prefill_tokens=16, prefill_lengths=[8], depths=1,
                budget_s=3600.0, headroom_gib=0.0, device_gib=0.25, max_moe=2)
else:
    GRID = dict(batches=(1, 4, 16, 64), ks=(0, 1, 2, 4, 8), context=4096, new_tokens=16, prefill_tokens=4096,
                prefill_lengths=None, depths=8, budget_s=300.0, headroom_gib=6.0, device_gib=None, max_moe=40)


def arg(flag: str, default=None):
    argv = sys.argv[1:]
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else default


def log(*a):
    print(*a, flush=True)


# ============================================================================ configs and plans
def slice_config(n_moe: int) -> "true_scale.InklingConfig":
    """Layers 0 .. n_moe + 1 of Inkling-Small's order: 2 sliding + dense, then n_moe MoE layers, sliding
    but the last (global). Tiny widths under --tiny."""
    types = ["sliding"] * (1 + n_moe) + ["global"]
    mlps = ["dense"] * 2 + ["moe"] * n_moe
    changes = dict(num_layers=len(types), layer_types=types, mlp_types=mlps)
    if TINY:
        changes.update(hidden_size=32, num_heads=2, num_kv_heads=1, swa_num_heads=2, swa_num_kv_heads=1, head_dim=16,
                       swa_head_dim=16, sliding_window=6, rel_extent=12, d_rel=4, dense_intermediate_size=24,
                       moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       vocab_size=200, unpadded_vocab_size=150, max_position_embeddings=64, num_mtp_depths=GRID["depths"],
                       mtp_layer_types=["sliding", "global"][: GRID["depths"]])
    return true_scale.inkling_small(**changes)


def layer_kinds(cfg) -> list[str]:
    return cost_model.trunk_layer_kinds(cfg)


def memory_plan(cfg, slots: int, max_seq_len: int, k: int, prefill_tokens: int, dtype_bytes: int = 2) -> dict:
    """Bytes the engine holds for the slice `cfg` (what the engine would need as a plan; it has none):
    weights (cost_model.layer_weight_elements per layer and depth, embedding and LM head), the caches of
    inkling_fast.caches (KV: kv_capacity rows; conv rings: ring_rows rows; per trunk layer and depth),
    the slot state (token buffer, every hidden H_p), and an estimate of the largest transient of a prefill
    pass of `prefill_tokens` tokens (the fp32 relative logits of the prefill attention over the global
    extent, the grouped MoE's fp32 pair outputs, the dense MLP's gate/up activations)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    b = dtype_bytes
    trunk = sum(cost_model.layer_weight_elements(kind, cfg) for kind in layer_kinds(cfg))
    depth_kinds = cfg.mtp_layer_types[:k]
    depths = sum(cost_model.layer_weight_elements(f"mtp_{t}", cfg) for t in depth_kinds)
    weights = (trunk + depths + 2 * V * H + 2 * H) * b

    def cache(kind: str) -> int:
        nH, nKV, hd, _ = cfg.attention_shape(kind)
        cap = kv_capacity(cfg.sliding_window if kind == "sliding" else None, max_seq_len, k)
        R = ring_rows(cfg.conv_kernel_size, k)
        return slots * (2 * cap * nKV * hd + 2 * R * nKV * hd + 2 * R * H) * b

    caches = sum(cache(t) for t in cfg.layer_types) + sum(cache(t) for t in depth_kinds)
    state = (slots + 1) * ((max_seq_len + k + 1) * 8 + (max_seq_len + k + 1) * H * b + 5 * 8 + 1)   # + n, stop, eos, seeds, counters, done
    P = prefill_tokens
    nH, _, _, E = cfg.attention_shape("global")
    transient = P * (nH * E * 4 + (cfg.num_experts_per_tok + cfg.n_shared_experts) * H * 4
                     + 2 * cfg.dense_intermediate_size * b + 8 * H * b)
    return dict(weights=weights, caches=caches, state=state, transient=transient,
                total=weights + caches + state + transient)


# ============================================================================ floors
def _keys(first: int, last: int, window: int | None) -> int:
    """Keys attended by the queries at positions first .. last - 1 (causal, windowed when window)."""
    def upto(n: int) -> int:                         # sum over p < n of min(p + 1, window)
        if window is None or n <= window:
            return n * (n + 1) // 2
        return window * (window + 1) // 2 + (n - window) * window
    return upto(last) - upto(first) if last > first else 0


def gemm_params(cfg, attn: str, mlp: str) -> int:
    """Weight elements one token multiplies in a block: q, k, v, r, o; the dense MLP, or the router, the
    top-k routed and the shared experts."""
    nH, nKV, hd, _ = cfg.attention_shape(attn)
    H = cfg.hidden_size
    n = H * (nH * hd + 2 * nKV * hd + nH * cfg.d_rel) + nH * hd * H
    if mlp == "dense":
        return n + 3 * cfg.dense_intermediate_size * H
    R, S = cfg.n_routed_experts, cfg.n_shared_experts
    return n + (cfg.num_experts_per_tok + S) * 3 * cfg.moe_intermediate_size * H + (R + S) * H


def prefill_work(cfg, L: int, k: int) -> dict:
    """FLOPs of the prefill of one prompt of L tokens with k depths (the trunk over L rows, depth m over
    rows 0 .. L-2-k, the LM head of the last row), and the weight bytes one pass reads (bf16; a pass of
    thousands of tokens touches every expert)."""
    H = cfg.hidden_size
    flops = 0
    for attn, mlp in zip(cfg.layer_types, cfg.mlp_types):
        nH, _, hd, _ = cfg.attention_shape(attn)
        flops += 2 * L * gemm_params(cfg, attn, mlp) + 4 * nH * hd * _keys(0, L, cfg.sliding_window if attn == "sliding" else None)
    rows = max(0, L - 1 - k)
    for attn in cfg.mtp_layer_types[:k]:
        nH, _, hd, _ = cfg.attention_shape(attn)
        flops += 2 * rows * (2 * H * H + gemm_params(cfg, attn, "dense"))
        flops += 4 * nH * hd * _keys(0, rows, cfg.sliding_window if attn == "sliding" else None)
    flops += 2 * cfg.vocab_size * H
    weight_bytes = 2 * (sum(cost_model.layer_weight_elements(kind, cfg) for kind in layer_kinds(cfg))
                        + sum(cost_model.layer_weight_elements(f"mtp_{t}", cfg) for t in cfg.mtp_layer_types[:k])
                        + cfg.vocab_size * H)
    return dict(flops=flops, pass_weight_bytes=weight_bytes)


# ============================================================================ timing
class Budget:
    """The run's time limit: steps ask whether an estimate still fits, and what is skipped is noted."""

    def __init__(self, seconds: float):
        self.start, self.seconds, self.skipped = time.perf_counter(), seconds, []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, estimate_s: float, what: str) -> bool:
        ok = self.elapsed() + estimate_s <= self.seconds
        if not ok:
            self.skipped.append(what)
            log(f"  skipped (time budget): {what}")
        return ok


def time_ms(fn, rep: int = 50) -> float:
    """Median ms of fn as a CUDA-graph replay (benchmarks/engine.py graph_ms); on the CPU (--tiny) the
    wall time of one eager call, so that every later step gets positive numbers."""
    if DEV == "cuda":
        return bench.graph_ms(fn, rep=rep)
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def capture(fn):
    """(graph, output): benchmarks/engine.py's capture on the GPU; on the CPU fn runs once, no graph."""
    return bench.capture(fn) if DEV == "cuda" else (None, fn())


def replay_ms(graph, fallback) -> float:
    return bench.replay_ms(graph) if graph is not None else time_ms(fallback)


def gemm_tflops() -> float | None:
    """The bf16 GEMM rate this GPU reaches (8192^3, graph replay): the FLOP floor's rate."""
    if DEV != "cuda":
        return None
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms = bench.graph_ms(lambda: a @ a, rep=100)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


# ============================================================================ measurements
def kind_blocks(cfg) -> dict[str, int]:
    """The first trunk layer of each kind in the slice."""
    out = {}
    for i, kind in enumerate(layer_kinds(cfg)):
        out.setdefault(kind, i)
    return out


def cost_inputs(eng: Engine, W, cfg, res: dict, budget: Budget) -> None:
    """Step 2: the cost model's per-layer, LM-head and depth-step costs on the slice's weights and the
    engine's caches (context GRID['context']), and the prefill chunk costs per kind."""
    g, H, ctx = GRID, cfg.hidden_size, GRID["context"]
    Ts = sorted({k + 1 for k in g["ks"]})
    rows_k = sorted({k + 1 for k in g["ks"] if k > 0})
    eps = cfg.rms_norm_eps
    layers, lm, steps, chunks = [], [], [], []
    for kind, i in kind_blocks(cfg).items():
        w, cache = W.blocks[i], eng.trunk_caches[i]
        for B in g["batches"]:
            slot = torch.arange(B, dtype=torch.int32, device=DEV)
            for T in Ts:
                h = torch.randn(B, T, H, device=DEV).to(BF16)
                pos = (ctx + torch.arange(T, device=DEV)).int().expand(B, T).contiguous()
                ms = time_ms(lambda: forward.block_forward(w, cache, h, slot, pos, eps, False))
                layers.append(dict(kind=kind, batch=B, T=T, ms=ms))
        log(f"  layer {kind}: " + " ".join(f"{r['batch']}x{r['T']}={r['ms']:.3f}" for r in layers if r["kind"] == kind))
    for N in sorted({B * T for B in g["batches"] for T in Ts}):
        h = torch.randn(N, H, device=DEV).to(BF16)
        lm.append(dict(kind="lm_head_argmax", batch=N, T=1, ms=time_ms(lambda: forward.greedy_tokens(W, h))))
    log("  LM head: " + " ".join(f"{r['batch']}={r['ms']:.3f}" for r in lm))
    for B in g["batches"]:
        slot = torch.arange(B, dtype=torch.int32, device=DEV)
        for R in rows_k:
            h = torch.randn(B, R, H, device=DEV).to(BF16)
            ids = torch.randint(0, cfg.vocab_out, (B, R), device=DEV)
            pos = (ctx + torch.arange(R, device=DEV)).int().expand(B, R).contiguous()

            def step():
                out = forward.depth_forward(W, 0, eng.depth_caches[0], h, ids, slot, pos)
                return forward.greedy_tokens(W, out[:, -1])

            steps.append(dict(batch=B, rows=R, ms=time_ms(step)))
    log("  depth step: " + " ".join(f"{r['batch']}x{r['rows']}={r['ms']:.3f}" for r in steps))
    C = min(g["prefill_tokens"], ctx)
    slot = torch.zeros(1, dtype=torch.int32, device=DEV)
    pos = torch.arange(C, dtype=torch.int32, device=DEV)[None]
    h = torch.randn(1, C, H, device=DEV).to(BF16)
    ids = torch.randint(0, cfg.vocab_out, (1, C), device=DEV)
    for kind, i in kind_blocks(cfg).items():
        w, cache = W.blocks[i], eng.trunk_caches[i]
        chunks.append(dict(kind=kind, tokens=C, ms=time_ms(lambda: forward.block_forward(w, cache, h, slot, pos, eps, True),
                                                           rep=100)))
    for m, t in enumerate(cfg.mtp_layer_types[: len(W.depths)]):
        if any(c["kind"] == f"mtp_{t}" for c in chunks):
            continue
        chunks.append(dict(kind=f"mtp_{t}", tokens=C, ms=time_ms(
            lambda: forward.depth_forward(W, m, eng.depth_caches[m], h, ids, slot, pos, prefill=True), rep=100)))
    log("  prefill chunks: " + " ".join(f"{c['kind']}={c['ms']:.3f}" for c in chunks))
    res["costs"] = dict(context=ctx, layers=layers, lm_head=lm, depth_step=steps, prefill_chunks=chunks)


def generate_grid(eng: Engine, prompts, cfg, res: dict, budget: Budget) -> None:
    """Step 3: whole generate calls at every batch x k, and the prefill alone at k = 0 and max k."""
    g = GRID
    N, L = g["new_tokens"], g["context"]
    rows, pre = res.setdefault("generate", []), res.setdefault("prefill", [])
    kmax = max(g["ks"])
    for B in g["batches"]:
        for k in g["ks"]:
            if not budget.fits(3.0 + B * L * (1 + k) / 2e5 * (0 if TINY else 1), f"generate B={B} k={k}"):
                continue
            r = eng.generate(prompts[:B], max_new_tokens=N, num_speculative_tokens=k)
            steady = bench.steady_cycles(eng.timings, B)
            row = dict(batch=B, k=k, new_tokens=N, prompt_len=L, wall_ms=1e3 * r.elapsed_s,
                       first_call_prefill_ms=1e3 * bench.prefill_seconds(eng), cycles=r.stats.num_cycles,
                       acceptance_length=r.stats.acceptance_length if k else 1.0)
            if steady:
                row.update(steady_ms_per_cycle=1e3 * steady["seconds"] / steady["cycles"], steady_cycles=steady["cycles"],
                           steady_host_ms_per_cycle=steady["host_ms"])
            rows.append(row)
            log(f"  B={B:<3} k={k}  generate {row['wall_ms']:9.1f} ms  steady "
                f"{row.get('steady_ms_per_cycle', float('nan')):8.3f} ms/cycle ({row.get('steady_cycles')} cycles)")
        for k in sorted({0, kmax}):
            if not budget.fits(2.0 + B * L * (1 + k) / 4e5 * (0 if TINY else 1), f"prefill B={B} k={k}"):
                continue
            r = eng.generate(prompts[:B], max_new_tokens=1, num_speculative_tokens=k)
            passes = [t.shape for t in eng.timings if t.kind == "prefill"]
            work = prefill_work(cfg, L, k)
            flops = B * work["flops"]
            floor_flop = flops / (res["gemm_tflops"] * 1e12) * 1e3 if res.get("gemm_tflops") else None
            floor_byte = len(passes) * work["pass_weight_bytes"] / (res["copy_gbps"] * 1e9) * 1e3
            pre.append(dict(batch=B, k=k, prompt_len=L, tokens=B * L, wall_ms=1e3 * r.elapsed_s,
                            tokens_per_s=B * L / r.elapsed_s, passes=[list(p) for p in passes], flops=flops,
                            flop_floor_ms=floor_flop, byte_floor_ms=floor_byte))
            log(f"  B={B:<3} k={k}  prefill {1e3 * r.elapsed_s:9.1f} ms  {B * L / r.elapsed_s:9.0f} tokens/s  "
                f"floors: FLOP {floor_flop if floor_flop is None else round(floor_flop, 2)} ms, bytes {floor_byte:.2f} ms")
        write_json(res)


def cycle_split(eng: Engine, prompts, cfg, res: dict, budget: Budget, B: int, lm_head_ms) -> None:
    """Step 4 (and 5 at k = 0) at batch B: one batched prefill (k = max), then per k the draft chain,
    the verify, the accept step and the whole cycle (its length rolled back after each replay)."""
    g, st = GRID, eng.state
    kmax = max(g["ks"])
    slots = list(range(B))
    eng.prefill_batch(slots, prompts[:B], Decoding(kmax), [eng.max_seq_len] * B)
    split = res.setdefault("split", [])
    for k in g["ks"]:
        batch, dec = eng.make_batch(slots, k), Decoding(k)
        n0 = st.n.clone()
        gd = None
        if k > 0:
            gd, (drafts, q, scores) = capture(lambda: eng.steps.draft(batch, dec))
        else:
            drafts, q, scores = eng.steps.draft(batch, dec)
        gv, (hidden, k_eff) = capture(lambda: eng.steps.verify(batch, dec))
        ga, _ = capture(lambda: eng.steps.accept(batch, dec, drafts, q, scores, hidden, k_eff))

        def whole():
            out = eng.steps.cycle(batch, dec)
            st.n.copy_(n0)
            return out

        gc, _ = capture(whole)
        d = replay_ms(gd, lambda: eng.steps.draft(batch, dec)) if k > 0 else 0.0
        v = replay_ms(gv, lambda: eng.steps.verify(batch, dec))
        a = replay_ms(ga, lambda: eng.steps.accept(batch, dec, drafts, q, scores, hidden, k_eff))
        c = replay_ms(gc, whole)
        head = lm_head_ms(B * (k + 1))
        row = dict(batch=B, k=k, context=int(n0[0]), cycle_ms=c, draft_ms=d, verify_ms=v, accept_ms=a,
                   verify_lm_head_ms=head, accept_commit_ms=c - d - v - head)
        split.append(row)
        log(f"  B={B:<3} k={k}  device cycle {c:.3f} ms = draft {d:.3f} + verify {v:.3f} + LM head {head:.3f} "
            f"+ accept/commit {row['accept_commit_ms']:.3f}")
        if k == 0:
            diagnose(eng, cfg, res, B, batch, gc, budget)
        del gd, gv, ga, gc
    write_json(res)


def distinct_experts(moe, x: torch.Tensor) -> int:
    """Distinct routed experts the rows of x select (sigmoid(x W_r^T) + bias, top-k, as the router)."""
    z = x.reshape(-1, x.shape[-1]).float() @ moe.router.float().T
    R = moe.router_bias.shape[0]
    chosen = (torch.sigmoid(z[:, :R]) + moe.router_bias.float()).topk(moe.top_k, dim=-1).indices
    return int(chosen.unique().numel())


def diagnose(eng: Engine, cfg, res: dict, B: int, batch, cycle_graph, budget: Budget) -> None:
    """Step 5 at batch B, k = 0: every trunk layer on the inputs the engine's verify gives it, against the
    same layer on random inputs at the cost model's context; the MoE layers' distinct experts on both;
    at the batch nearest 16, the profiler's kernels of one cycle replay against the isolated layers'."""
    if not budget.fits(5.0, f"diagnostics B={B}"):
        return
    W, H, eps, ctx = eng.W, cfg.hidden_size, cfg.rms_norm_eps, GRID["context"]
    seen_blocks, seen_mlp = [], []
    block, mlp = forward.block_forward, forward.mlp_forward

    def spy_block(w, cache, h, slot, pos, eps_, prefill):
        seen_blocks.append((w, cache, h.clone(), slot.clone(), pos.clone()))
        return block(w, cache, h, slot, pos, eps_, prefill)

    def spy_mlp(w, x):
        seen_mlp.append((w, x.clone()))
        return mlp(w, x)

    forward.block_forward, forward.mlp_forward = spy_block, spy_mlp
    try:
        eng.steps.verify(batch, Decoding(0))                    # eager: records each layer's inputs
    finally:
        forward.block_forward, forward.mlp_forward = block, mlp
    rows = []
    moe_inputs = [(w, x) for w, x in seen_mlp if hasattr(w, "router")]
    for i, (w, cache, h, slot, pos) in enumerate(seen_blocks):
        kind = layer_kinds(cfg)[i]
        real = time_ms(lambda: forward.block_forward(w, cache, h, slot, pos, eps, False))
        h_rand = torch.randn_like(h, dtype=torch.float32).to(h.dtype)
        pos_ctx = (ctx + torch.zeros_like(pos))
        rand = time_ms(lambda: forward.block_forward(w, cache, h_rand, slot, pos_ctx, eps, False))
        row = dict(batch=B, layer=i, kind=kind, context=int(pos.max()), engine_inputs_ms=real, random_inputs_ms=rand)
        if cfg.mlp_types[i] == "moe":
            x = next(x for ww, x in moe_inputs if ww is w.mlp)
            x_rand = forward.rms_norm(h_rand, w.mlp_norm, eps)
            row.update(distinct_experts_engine=distinct_experts(w.mlp, x), distinct_experts_random=distinct_experts(w.mlp, x_rand),
                       expected_distinct_uniform=cost_model.expected_distinct_experts(x.reshape(-1, H).shape[0],
                                                                                     cfg.n_routed_experts, cfg.num_experts_per_tok),
                       moe_engine_inputs_ms=time_ms(lambda: forward.mlp_forward(w.mlp, x)),
                       moe_random_inputs_ms=time_ms(lambda: forward.mlp_forward(w.mlp, x_rand)))
        rows.append(row)
        log(f"  B={B:<3} layer {i} {kind:>13}: engine inputs {real:.3f} ms, random inputs {rand:.3f} ms"
            + (f"; experts {row['distinct_experts_engine']} vs {row['distinct_experts_random']}" if "distinct_experts_engine" in row else ""))
    res.setdefault("diagnostics", []).extend(rows)
    nearest = min(GRID["batches"], key=lambda b: abs(b - 16))
    if B == nearest and DEV == "cuda" and cycle_graph is not None and budget.fits(10.0, "kernel profile"):
        res["kernel_profile"] = kernel_profile(eng, cfg, B, cycle_graph, seen_blocks)


def kernel_times(graph) -> dict[str, float]:
    """µs per kernel name in one replay of `graph` (the profiler's CUDA kernel records)."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out[e.name] = out.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
    return out


def kernel_profile(eng: Engine, cfg, B: int, cycle_graph, seen_blocks) -> dict:
    """Kernels of one k = 0 cycle replay against the sum of the isolated layers (the cost model's inputs,
    random inputs at context GRID['context']) and the isolated LM head over B rows."""
    W, H, eps, ctx = eng.W, cfg.hidden_size, cfg.rms_norm_eps, GRID["context"]
    cycle = kernel_times(cycle_graph)
    iso: dict[str, float] = {}
    for i, (w, cache, h, slot, pos) in enumerate(seen_blocks):
        h_rand = torch.randn_like(h, dtype=torch.float32).to(h.dtype)
        pos_ctx = ctx + torch.zeros_like(pos)
        graph, _ = bench.capture(lambda: forward.block_forward(w, cache, h_rand, slot, pos_ctx, eps, False))
        for name, us in kernel_times(graph).items():
            iso[name] = iso.get(name, 0.0) + us
        del graph
    hh = torch.randn(B, H, device=DEV).to(BF16)
    graph, _ = bench.capture(lambda: forward.greedy_tokens(W, hh))
    for name, us in kernel_times(graph).items():
        iso[name] = iso.get(name, 0.0) + us
    names = sorted(set(cycle) | set(iso), key=lambda n: -(cycle.get(n, 0.0) + iso.get(n, 0.0)))
    rows = [dict(kernel=n, cycle_us=cycle.get(n, 0.0), isolated_us=iso.get(n, 0.0)) for n in names]
    log(f"  kernel profile B={B}, k=0: cycle {sum(cycle.values()):.0f} us, isolated layers + LM head {sum(iso.values()):.0f} us")
    return dict(batch=B, k=0, cycle_total_us=sum(cycle.values()), isolated_total_us=sum(iso.values()), kernels=rows)


# ============================================================================ the model
def costs_dict(res: dict) -> dict:
    """This run's measurements in the layout inkling_fast.cost_model.Costs reads (engine.json's), and a
    note on the accept term where it is not this run's own."""
    acc = [r["accept_commit_ms"] for r in res.get("split", []) if r["k"] > 0]
    if not acc:
        demo = json.loads(ENGINE_JSON.read_text())["demo"]["cycle_split"]
        acc_ms = statistics.median(r["accept_commit_ms"] for r in demo)
        return dict(cost_model.true_width_inputs(res, acc_ms), accept_note="accept + commit from "
                    "docs/benchmarks/engine.json's demo section (no cycle split in this run)")
    note = None if statistics.median(acc) >= 0 else \
        f"the median accept + commit came out negative ({statistics.median(acc):.4f} ms): taken as 0"
    return dict(cost_model.true_width_inputs(res), accept_note=note)


def per_position(curves: dict, k: int) -> list[float]:
    return cost_model.per_position_for_k(curves, k)[0]


def model_and_extrapolation(res: dict, cfg) -> None:
    """Step 6."""
    d = costs_dict(res)
    costs = cost_model.Costs(d)
    try:
        committed = cost_model.Costs(json.loads(ENGINE_JSON.read_text()))
    except (cost_model.CostModelError, OSError, KeyError) as e:
        committed = None
        res.setdefault("notes", []).append(f"engine.json not usable for the model: {e!r}")
    split = {(r["batch"], r["k"]): r for r in res.get("split", [])}
    rows = []
    for r in res.get("generate", []):
        B, k = r["batch"], r["k"]
        parts = cost_model.cycle_parts(costs, cfg, B, k)
        row = dict(batch=B, k=k, model=parts, steady_ms=r.get("steady_ms_per_cycle"),
                   device_ms=split.get((B, k), {}).get("cycle_ms"))
        try:
            row["model_engine_json"] = cost_model.cycle_parts(committed, cfg, B, k) if committed else None
        except cost_model.CostModelError as e:
            row["model_engine_json"] = None
            row["engine_json_error"] = str(e)
        for what in ("steady_ms", "device_ms"):
            if row[what]:
                row[f"error_{what}"] = row[what] / parts["cycle"] - 1
        rows.append(row)
    res["model"] = dict(rows=rows, accept_ms=costs.accept_ms, accept_note=d["accept_note"])

    full = cost_model.inkling_small_config()
    demo = cost_model.load_acceptance(json.loads(DEMO_ACCEPTANCE.read_text()))
    chunks = {c["kind"]: c["ms"] / c["tokens"] for c in res["costs"]["prefill_chunks"]}    # ms per token

    def prefill_ms(c, B: int, L: int, k: int) -> float | None:
        kinds = [f"{t}_{m}" for t, m in zip(c["layer_types"], c["mlp_types"])] + \
                [f"mtp_{t}" for t in c["mtp_layer_types"][:k]]
        if any(kd not in chunks for kd in kinds):
            return None
        return B * L * sum(chunks[kd] for kd in kinds)

    slice_cfg = dict(layer_types=cfg.layer_types, mlp_types=cfg.mlp_types, mtp_layer_types=cfg.mtp_layer_types)
    full_cfg = dict(layer_types=full["layer_types"], mlp_types=full["mlp_types"], mtp_layer_types=full["mtp_layer_types"])
    checks = [dict(batch=p["batch"], k=p["k"], measured_ms=p["wall_ms"],
                   model_ms=prefill_ms(slice_cfg, p["batch"], p["prompt_len"], p["k"])) for p in res.get("prefill", [])]
    for c in checks:
        c["error"] = c["measured_ms"] / c["model_ms"] - 1 if c["model_ms"] else None
    measured = {(r["batch"], r["k"]): r for r in rows}
    L, O = GRID["context"], REQUEST_NEW_TOKENS
    ext = []
    for B in GRID["batches"]:
        for k in GRID["ks"]:
            try:
                parts = cost_model.cycle_parts(costs, full, B, k)
            except cost_model.CostModelError as e:
                ext.append(dict(batch=B, k=k, error=str(e)))
                continue
            m = measured.get((B, k))
            offset = (m["steady_ms"] - m["model"]["cycle"]) if m and m.get("steady_ms") else None
            row = dict(batch=B, k=k, cycle_ms=parts["cycle"], verify_ms=parts["verify"], draft_ms=parts["draft"],
                       slice_offset_ms=offset, prefill_ms=prefill_ms(full_cfg, B, L, k))
            for name, curves in (("demo", demo), ("vllm", VLLM_PER_POSITION)):
                pp = per_position(curves, k) if k else []
                Lk = cost_model.acceptance_length(pp)
                row[f"L_{name}"] = Lk
                row[f"tokens_per_s_{name}"] = B * Lk / (parts["cycle"] * 1e-3)
                if row["prefill_ms"] is not None:
                    decode = (O - 1) / Lk * parts["cycle"]
                    row[f"request_ms_{name}"] = row["prefill_ms"] + decode
            ext.append(row)
    for row in ext:
        base = next((r for r in ext if r["batch"] == row["batch"] and r["k"] == 0 and "cycle_ms" in r), None)
        if base and "cycle_ms" in row:
            for name in ("demo", "vllm"):
                row[f"speedup_{name}"] = row[f"tokens_per_s_{name}"] / base[f"tokens_per_s_{name}"]
                if row.get(f"request_ms_{name}") and base.get(f"request_ms_{name}"):
                    row[f"request_speedup_{name}"] = base[f"request_ms_{name}"] / row[f"request_ms_{name}"]
    res["extrapolation"] = dict(config="Inkling-Small, 42 layers (2 sliding dense, 33 sliding MoE, 7 global MoE), 8 depths",
                                request=dict(prompt=L, new_tokens=O), prefill_check=checks, rows=ext)


# ============================================================================ the run
OUT_JSON: Path | None = None


def write_json(res: dict) -> None:
    if OUT_JSON is not None:
        OUT_JSON.write_text(json.dumps(res, indent=1, default=float))


def parse_list(flag: str, default: tuple) -> tuple:
    v = arg(flag)
    return tuple(int(x) for x in v.split(",")) if v else default


def run(out_dir: Path) -> dict:
    global OUT_JSON
    g = GRID
    g.update(batches=parse_list("--batches", g["batches"]), ks=parse_list("--ks", g["ks"]),
             context=int(arg("--context", g["context"])), new_tokens=int(arg("--new-tokens", g["new_tokens"])),
             budget_s=float(arg("--budget-s", g["budget_s"])), headroom_gib=float(arg("--headroom-gib", g["headroom_gib"])))
    g["depths"] = max(max(g["ks"]), 1) if TINY else g["depths"]
    out_dir.mkdir(parents=True, exist_ok=True)
    OUT_JSON = out_dir / "true_width.json"
    budget = Budget(g["budget_s"])
    import triton
    res = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "CPU (--tiny: interpreter, no timing)",
               torch=torch.__version__, triton=triton.__version__, date=str(datetime.date.today()),
               commit=harness.git_commit(), command="python benchmarks/true_width.py " + " ".join(sys.argv[1:]),
               tiny=TINY, grid={k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}, notes=[])
    res["copy_gbps"] = harness.measure_copy_bandwidth() if DEV == "cuda" else 1.0
    res["gemm_tflops"] = gemm_tflops()
    log(f"copy {res['copy_gbps']:.0f} GB/s, GEMM {res['gemm_tflops']} TFLOP/s")

    # 1. the slice
    Bmax, ctx, N = max(g["batches"]), g["context"], g["new_tokens"]
    max_seq_len = ctx + max(N, max(g["ks"]) + 2) + 1
    if DEV == "cuda":
        torch.cuda.empty_cache()                        # the bandwidth and GEMM buffers: free for the slice
        free, total = torch.cuda.mem_get_info()
    else:
        free = total = int(g["device_gib"] * 2**30)
    headroom = int(max(g["headroom_gib"] * 2**30, 0.06 * total))
    forced = arg("--moe-layers")
    n_moe = int(forced) if forced else 0
    if not forced:
        for n in range(1, g["max_moe"] + 1):
            cfg_n = slice_config(n)
            if memory_plan(cfg_n, Bmax, max_seq_len, g["depths"], g["prefill_tokens"])["total"] + headroom > free:
                break
            n_moe = n
    if n_moe < 1:
        raise SystemExit(f"not even one MoE layer fits: {free / 2**30:.1f} GiB free")
    cfg = slice_config(n_moe)
    plan = memory_plan(cfg, Bmax, max_seq_len, g["depths"], g["prefill_tokens"])
    log(f"slice: {cfg.num_layers} layers ({n_moe} MoE), {g['depths']} depths; plan {plan['total'] / 2**30:.2f} GiB "
        f"of {free / 2**30:.2f} GiB free (headroom {headroom / 2**30:.1f} GiB)")
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    head = true_scale.random_head(cfg, g["depths"], device=DEV, dtype=BF16, seed=0)
    blocks = [true_scale.random_block(cfg, t, m, DEV, BF16, seed=100 + i)
              for i, (t, m) in enumerate(zip(cfg.layer_types, cfg.mlp_types))]
    W = dataclasses.replace(head, blocks=blocks)
    eng = Engine(W, max_batch_size=Bmax, max_seq_len=max_seq_len, num_speculative_tokens=g["depths"], dtype=BF16,
                 device=DEV, prefill_tokens=g["prefill_tokens"], prefill_lengths=g["prefill_lengths"])
    built = (torch.cuda.memory_allocated() - before) if DEV == "cuda" else None
    res["slice"] = dict(layers=[dict(layer=i, attention=t, mlp=m) for i, (t, m) in enumerate(zip(cfg.layer_types, cfg.mlp_types))],
                        depths=list(cfg.mtp_layer_types[: g["depths"]]), moe_layers=n_moe,
                        routed_experts=cfg.n_routed_experts, parameters=true_scale.weight_bytes(W) // 2,
                        max_batch_size=Bmax, max_seq_len=max_seq_len, prefill_tokens=g["prefill_tokens"])
    res["memory"] = dict(plan=plan, free_at_start=free, device_total=total, headroom=headroom,
                         weights_measured=true_scale.weight_bytes(W), allocated_after_build=built)
    write_json(res)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_out, (Bmax, ctx), generator=gen).tolist()

    # 2. the cost model's inputs
    log("== cost model inputs")
    cost_inputs(eng, W, cfg, res, budget)
    write_json(res)
    heads = {r["batch"]: r["ms"] for r in res["costs"]["lm_head"]}

    def lm_head_ms(rows: int) -> float:
        return heads.get(rows) or cost_model.Grid1D(heads, "lm head", "rows")(rows)

    # 3. whole generate calls
    log("== generate")
    generate_grid(eng, prompts, cfg, res, budget)

    # 4, 5. cycle split and diagnostics: the batch nearest 16 first
    log("== cycle split")
    order = sorted(g["batches"], key=lambda b: (abs(b - 16), b))
    for B in order:
        if budget.fits(5.0 + B * ctx * (1 + max(g["ks"])) / 2e5 * (0 if TINY else 1), f"cycle split B={B}"):
            cycle_split(eng, prompts, cfg, res, budget, B, lm_head_ms)
    if DEV == "cuda":
        res["memory"].update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())

    # 6. the model
    model_and_extrapolation(res, cfg)
    res["elapsed_s"] = budget.elapsed()
    res["skipped"] = budget.skipped
    write_json(res)
    return res


# ============================================================================ the page
def fmt(x, spec=".3f", none="-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def table(head: list[str], rows: list[list], text: int = 0) -> list[str]:
    """Markdown: the first `text` columns left-aligned, the rest right-aligned."""
    return (["| " + " | ".join(head) + " |", "|" + "".join("---|" if i < text else "---:|" for i in range(len(head)))]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def render(res: dict) -> str:
    gib = 2 ** 30
    L = ["# The whole engine at true Inkling-Small width", ""]
    if res.get("tiny"):
        L += ["**A --tiny run: CPU interpreter, tiny widths. The numbers below are not measurements.**", ""]
    L += [f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}; commit {res['commit']}; {res['date']}.", "",
          f"Command: `{res['command']}` (writes true_width.json; `--render JSON` writes this page from it).", "",
          f"Copy bandwidth (read + write) {res['copy_gbps']:.0f} GB/s; bf16 GEMM (8192^3) "
          f"{fmt(res.get('gemm_tflops'), '.0f')} TFLOP/s: the floors below are bytes / the first and FLOPs / the second.", ""]
    s, mem = res["slice"], res["memory"]
    kinds = ", ".join(f"{r['layer']}: {r['attention']} + {r['mlp']}" for r in s["layers"])
    L += ["## The slice", "",
          f"Inkling-Small's first {len(s['layers'])} layers in the real order ({kinds}), {s['routed_experts']} routed "
          f"experts per MoE layer, MTP depths {', '.join(s['depths'])}; {s['parameters'] / 1e9:.2f} B parameters, random "
          f"bf16 weights (benchmarks/true_scale.py). The engine holds caches for batch {s['max_batch_size']} at "
          f"{s['max_seq_len']} tokens; prefill passes of {s['prefill_tokens']} tokens. The most MoE layers whose memory "
          "plan fits the free memory with the headroom below.", ""]
    plan = mem["plan"]
    prow = [["weights", fmt(plan["weights"] / gib, ".2f"), fmt(mem["weights_measured"] / gib, ".2f")],
            ["caches + slot state", fmt((plan["caches"] + plan["state"]) / gib, ".2f"),
             fmt(((mem.get("allocated_after_build") or 0) - mem["weights_measured"]) / gib, ".2f")
             if mem.get("allocated_after_build") else "-"],
            ["largest prefill transient (estimate)", fmt(plan["transient"] / gib, ".2f"), "-"],
            ["total", fmt(plan["total"] / gib, ".2f"),
             f"{fmt((mem.get('peak_allocated') or 0) / gib, '.2f')} peak allocated, "
             f"{fmt((mem.get('peak_reserved') or 0) / gib, '.2f')} peak reserved"]]
    L += ["## Memory: the plan against what the run used", "",
          f"Free at the start {mem['free_at_start'] / gib:.1f} GiB of {mem['device_total'] / gib:.1f} GiB; headroom kept "
          f"{mem['headroom'] / gib:.1f} GiB (CUDA graphs' pools, cuBLAS workspaces, the measurement's own captures).", "",
          *table(["GiB", "plan", "measured"], prow, text=1), ""]
    pre = res.get("prefill", [])
    if pre:
        rows = []
        for p in pre:
            floor = max(x for x in (p.get("flop_floor_ms"), p.get("byte_floor_ms")) if x is not None)
            rows.append([p["batch"], p["k"], p["tokens"], len(p["passes"]), fmt(p["wall_ms"], ".1f"),
                         fmt(p["tokens_per_s"], ".0f"), fmt(p.get("flop_floor_ms"), ".1f"), fmt(p["byte_floor_ms"], ".1f"),
                         fmt(p["wall_ms"] / floor, ".2f")])
        L += ["## Prefill against its floor", "",
              f"`generate(max_new_tokens=1)` of prompts of {pre[0]['prompt_len']} random tokens (its graphs captured by "
              "a first, untimed call): wall time. FLOP floor: the pass's GEMM and attention FLOPs (trunk over every row, depth m "
              "over rows 0..L-2-k) at the GEMM rate above; byte floor: every pass reads the slice's weights once.", "",
              *table(["batch", "k", "tokens", "passes", "wall ms", "tokens/s", "FLOP floor ms", "byte floor ms", "x floor"],
                     rows), ""]
    model = res.get("model")
    if model:
        rows, within, n, within_dev, n_dev = [], 0, 0, 0, 0
        for r in model["rows"]:
            m = r["model"]
            ej = r.get("model_engine_json")
            err = r.get("error_steady_ms")
            if err is not None:
                n += 1
                within += abs(err) <= 0.10
            if r.get("error_device_ms") is not None:
                n_dev += 1
                within_dev += abs(r["error_device_ms"]) <= 0.10
            rows.append([r["batch"], r["k"], fmt(r["steady_ms"]), fmt(r["device_ms"]), fmt(m["cycle"]),
                         fmt(m["verify"]), fmt(m["draft"]), fmt(m["accept"]), fmt(err, "+.1%"),
                         fmt(r.get("error_device_ms"), "+.1%"), fmt(ej["cycle"] if ej else None),
                         fmt(r["steady_ms"] / ej["cycle"] - 1 if ej and r["steady_ms"] else None, "+.1%")])
        L += ["## The steady cycle against the cost model", "",
              "steady: wall time per cycle of whole `generate` calls (the cycles that ran all B sequences, the "
              "overlapped loop); device: the captured cycle replayed alone (cycle split below). model: "
              "`cost_model.cycle_parts` for this slice's layers from this run's isolated costs (the sum of its layers "
              "and the LM head over B(k+1) rows, k depth steps, the accept term "
              f"{model['accept_ms']:.3f} ms); engine.json: the same from the committed docs/benchmarks/engine.json. "
              f"Within 10 % of this run's model: device {within_dev} of {n_dev}, steady {within} of {n}. The model "
              "prices a cycle with k_eff = k, which the device column replays. The steady window also holds the "
              "request's last cycles, where k_eff = min(k, stop - n - 1) falls below k (random weights reject every "
              f"draft, so with {res['grid']['new_tokens']} new tokens the last k cycles of the request verify fewer "
              "rows than k + 1 and the rest run as padding): at k = 4 and 8 steady is faster than the full-k cycle, "
              "and the model's check is the device column."
              + (f" Note: {model['accept_note']}." if model.get("accept_note") else ""), "",
              *table(["batch", "k", "steady ms", "device ms", "model ms", "model verify", "model draft", "model accept",
                      "error (steady)", "error (device)", "engine.json model ms", "error vs engine.json"], rows), ""]
    split = res.get("split", [])
    if split:
        rows = [[r["batch"], r["k"], r["context"], fmt(r["cycle_ms"]), fmt(r["draft_ms"]), fmt(r["verify_ms"]),
                 fmt(r["verify_lm_head_ms"]), fmt(r["accept_ms"]), fmt(r["accept_commit_ms"])] for r in split]
        L += ["## Where a cycle goes (device time, CUDA-graph replays)", "",
              "After one batched prefill, at each k: the draft chain, the verify pass (the trunk over k+1 rows), the "
              "accept step (the greedy LM head over B(k+1) rows, then the acceptance) and the whole cycle, each "
              "captured and replayed alone. accept + commit = cycle - draft - verify - the isolated LM head of those rows.", "",
              *table(["batch", "k", "context", "cycle ms", "draft ms", "verify ms", "LM head ms (isolated)", "accept ms",
                      "accept + commit ms"], rows), ""]
    diag = res.get("diagnostics", [])
    if diag:
        rows = [[d["batch"], d["layer"], d["kind"], d["context"], fmt(d["engine_inputs_ms"]), fmt(d["random_inputs_ms"]),
                 fmt(d.get("distinct_experts_engine"), "d"), fmt(d.get("distinct_experts_random"), "d"),
                 fmt(d.get("expected_distinct_uniform"), ".0f"), fmt(d.get("moe_engine_inputs_ms")),
                 fmt(d.get("moe_random_inputs_ms"))] for d in diag]
        L += ["## k = 0: each layer on the engine's own inputs against the isolated benchmark's", "",
              "Each trunk layer replayed (CUDA graph) on the inputs the engine's verify gave it (recorded from an eager "
              "verify right after the prefill, at the prompt's end), and on random inputs at the cost model's context; "
              "for MoE layers the distinct routed experts the batch's tokens select on both inputs (uniform top-k routing "
              "expects the next column), and the MoE alone on both.", "",
              *table(["batch", "layer", "kind", "context", "engine inputs ms", "random inputs ms", "experts (engine)",
                      "experts (random)", "uniform", "MoE engine ms", "MoE random ms"], rows), ""]
    prof = res.get("kernel_profile")
    if prof:
        rows = [[f"`{k['kernel'][:80]}`", fmt(k["cycle_us"], ".1f"), fmt(k["isolated_us"], ".1f"),
                 fmt(k["cycle_us"] - k["isolated_us"], "+.1f")] for k in prof["kernels"][:25]]
        L += [f"## Kernels of one cycle (batch {prof['batch']}, k = 0) against the isolated layers", "",
              f"Profiler kernel time in one replay of the captured cycle: {prof['cycle_total_us']:.0f} µs; of the "
              f"isolated layers (random inputs, the cost model's context) and the LM head over {prof['batch']} rows: "
              f"{prof['isolated_total_us']:.0f} µs. The 25 kernels with the most time:", "",
              *table(["kernel", "cycle µs", "isolated µs", "difference µs"], rows, text=1), ""]
    costs = res.get("costs")
    if costs:
        Ts = sorted({r["T"] for r in costs["layers"]})
        rows = []
        for kind in dict.fromkeys(r["kind"] for r in costs["layers"]):
            for B in sorted({r["batch"] for r in costs["layers"] if r["kind"] == kind}):
                rows.append([kind, B] + [fmt(next((r["ms"] for r in costs["layers"] if r["kind"] == kind
                                                   and r["batch"] == B and r["T"] == T), None)) for T in Ts])
        L += ["## The cost model's inputs, measured in this run", "",
              f"One layer of each kind of the slice (its own weights, the engine's caches, context {costs['context']}, "
              "random inputs), CUDA-graph replay, ms:", "",
              *table(["kind", "batch"] + [f"T={T}" for T in Ts], rows, text=1), "",
              "Greedy LM head over N rows: " + ", ".join(f"{r['batch']}: {r['ms']:.3f}" for r in costs["lm_head"]) + " ms.",
              "", "Depth step (depth 0 over `rows` rows + the argmax of its last row): "
              + ", ".join(f"B={r['batch']} x {r['rows']}: {r['ms']:.3f}" for r in costs["depth_step"]) + " ms.", "",
              "One prefill chunk of " + str(costs["prefill_chunks"][0]["tokens"] if costs["prefill_chunks"] else 0)
              + " tokens (positions 0 onwards): " + ", ".join(f"{c['kind']}: {c['ms']:.3f}" for c in costs["prefill_chunks"])
              + " ms.", ""]
    ext = res.get("extrapolation")
    if ext:
        chk = [[c["batch"], c["k"], fmt(c["measured_ms"], ".1f"), fmt(c["model_ms"], ".1f"), fmt(c["error"], "+.1%")]
               for c in ext["prefill_check"]]
        rows = []
        for r in ext["rows"]:
            if "cycle_ms" not in r:
                rows.append([r["batch"], r["k"]] + ["-"] * 11)
                continue
            rows.append([r["batch"], r["k"], fmt(r["cycle_ms"], ".2f"), fmt(r.get("slice_offset_ms"), "+.2f"),
                         fmt(r["L_demo"], ".2f"), fmt(r["tokens_per_s_demo"], ".0f"), fmt(r.get("speedup_demo"), ".2f"),
                         fmt(r["L_vllm"], ".2f"), fmt(r["tokens_per_s_vllm"], ".0f"), fmt(r.get("speedup_vllm"), ".2f"),
                         fmt(r.get("prefill_ms"), ".0f"), fmt(r.get("request_ms_demo"), ".0f"), fmt(r.get("request_ms_vllm"), ".0f")])
        req = ext["request"]
        L += ["## Extrapolated to the 42-layer Inkling-Small", "",
              f"{ext['config']}. Cycle: `cost_model.cycle_parts` with this run's per-layer costs (steady state, every "
              "sequence live, context as measured); slice offset: the slice's measured steady cycle minus its model "
              "cycle at that point (were it a per-cycle overhead, add it). Decode tokens/s = B L / cycle with L the "
              "acceptance length of the demo checkpoint (docs/benchmarks/demo_acceptance.json; k not measured: the "
              "k = 8 prefix) and of vLLM's published per-position acceptance for Inkling (docs/spec/mtp-cycle.md §6). "
              f"Whole request: a {req['prompt']}-token prompt and {req['new_tokens']} new tokens per sequence, "
              "prefill (per-kind chunk costs x the 42 layers' kinds + k depths, per token) + (new tokens - 1) / L "
              "cycles.", "",
              "The prefill model on the slice itself (its measured prefill against the same per-kind chunk costs):", "",
              *table(["batch", "k", "measured ms", "model ms", "error"], chk), "",
              *table(["batch", "k", "cycle ms", "slice offset ms", "L demo", "tokens/s demo", "speedup demo", "L vLLM",
                      "tokens/s vLLM", "speedup vLLM", "prefill ms", "request ms (demo)", "request ms (vLLM)"], rows), ""]
    for note in res.get("notes", []) + [f"skipped for time: {s}" for s in res.get("skipped", [])]:
        L += [f"Note: {note}", ""]
    for finding in res.get("findings", []):
        L += [finding, ""]
    return "\n".join(L)


def summary(res: dict) -> None:
    log("\n(B, k)   steady ms   device ms   model ms   error")
    for r in res.get("model", {}).get("rows", []):
        log(f"({r['batch']:>2}, {r['k']})  {fmt(r['steady_ms']):>10}  {fmt(r['device_ms']):>10}  "
            f"{fmt(r['model']['cycle']):>9}  {fmt(r.get('error_steady_ms'), '+.1%'):>7}")
    for p in res.get("prefill", []):
        floor = max(x for x in (p.get("flop_floor_ms"), p.get("byte_floor_ms")) if x is not None)
        log(f"prefill B={p['batch']} k={p['k']}: {p['tokens_per_s']:.0f} tokens/s, {p['wall_ms'] / floor:.2f}x its floor")
    log(f"elapsed {res.get('elapsed_s', 0):.0f} s; skipped: {res.get('skipped')}")


def main() -> None:
    if "--render" in sys.argv:
        src = Path(arg("--render"))
        res = json.loads(src.read_text())
        md = Path(arg("--md", MD_DEFAULT))
        md.write_text(render(res))
        log(f"wrote {md} from {src}")
        return
    if DEV != "cuda" and not TINY:
        raise SystemExit("true_width needs a CUDA GPU (or --tiny on the CPU)")
    out = Path(arg("--out", os.environ.get("TMPDIR", "/tmp")))
    res = run(out)
    (out / "true_width.md").write_text(render(res))
    summary(res)
    log(f"wrote {out / 'true_width.json'} and {out / 'true_width.md'}")


if __name__ == "__main__":
    main()
