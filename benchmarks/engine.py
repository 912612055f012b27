"""Engine benchmarks (a script, not a test): writes docs/benchmarks/engine.{json,md} and its plots.

    python benchmarks/engine.py                    # GPU: every section
    python benchmarks/engine.py demo head          # only some sections (the JSON keeps the others)
    python benchmarks/engine.py --dry              # CPU, TRITON_INTERPRET=1: tiny sizes, no timing
    python benchmarks/engine.py --report           # rewrite engine.md and the plots from engine.json

Sections (docs/benchmarks/engine.md explains each table; the JSON layout is what
inkling_fast.cost_model reads):
  demo    the bundled demo checkpoint, bf16: end-to-end tokens/s of the fast engine (CUDA graphs and
          eager), the reference on the GPU and transformers' `generate` on the same trunk; and the
          cycle split (draft chain / verify / accept+commit), each part captured and replayed alone.
  head    the true-size MTP head at Inkling-Small width (random bf16 weights, 8 depths, shared LM head
          of 201024 x 4096): one depth step and the 8-depth draft chain in one CUDA graph against the
          HBM floor of the bytes they must read (weights + KV), with acceptance forced to sweep a.
  layers  one true-width Inkling-Small trunk layer of each kind (sliding/global attention + MoE with
          realistic routing, sliding + dense) and the LM head, at T = 1..9 tokens per sequence and
          batch 1..64: the per-layer costs of the cost model.

Method: CUDA-graph replay timed with `triton.testing.do_bench` (warm-up, CUDA
events, median); the weights read per call (>= 0.5 GB) are far beyond the 60 MB L2, except the demo
checkpoint's (24 MB), which is what a model that small gets. Floors use the device-to-device copy
bandwidth measured in the same run. End-to-end runs are wall-clock times of whole `generate` calls
(they include the host loop: one synchronization per cycle), after a warm-up call that captures the
graphs.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

DRY = "--dry" in sys.argv
if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import harness  # noqa: E402
import true_scale  # noqa: E402
from inkling_fast import Engine  # noqa: E402
from inkling_fast import cost_model, forward  # noqa: E402
from inkling_fast.caches import LayerCache  # noqa: E402
from inkling_fast.engine import DecodeMode  # noqa: E402
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax  # noqa: E402
from inkling_ref import generate, load_checkpoint  # noqa: E402
from inkling_ref.cli import DEFAULT_CHECKPOINT  # noqa: E402

OUT_JSON = ROOT / "docs" / "benchmarks" / "engine.json"
DEV = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
BF16 = torch.bfloat16

if DRY:
    GRID = dict(demo_batches=(1, 2), demo_ks=(0, 1), new_tokens=4, prompt_len=8, split_ks=(0, 1),
                eager=((1, 0),), ref=((1, 0),), hf_batches=(1,), head_batches=(1, 2), head_rows=(1, 3),
                chain_batches=(1,), chain_as=(0, 2), layer_batches=(1, 2), layer_T=(1, 3), context=40)
else:
    GRID = dict(demo_batches=(1, 4, 16, 32), demo_ks=(0, 1, 2, 4, 8), new_tokens=128, prompt_len=240,
                split_ks=(0, 1, 2, 4, 8), eager=((1, 0), (1, 4), (32, 0), (32, 4)), ref=((1, 0), (1, 4)),
                hf_batches=(1, 32), head_batches=(1, 2, 4, 8, 16, 32, 64), head_rows=(1, 2, 3, 5, 9),
                chain_batches=(1, 4, 16, 32), chain_as=(0, 4, 8), layer_batches=(1, 2, 4, 8, 16, 32, 64),
                layer_T=(1, 2, 3, 5, 9), context=4096)


# ============================================================================ timing
def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def capture(fn):
    """harness.capture on the GPU; on the CPU (dry run) fn runs once and no graph is made."""
    return harness.capture(fn) if DEV == "cuda" else (None, fn())


def replay_ms(graph, rep: int = 100) -> float:
    """Median ms of one replay of `graph` (do_bench: warm-up, CUDA events, `rep` ms of replays)."""
    if graph is None:
        return float("nan")
    import triton.testing
    return triton.testing.do_bench(graph.replay, warmup=10, rep=rep, return_mode="median")


def graph_ms(fn, rep: int = 100) -> float:
    return replay_ms(capture(fn)[0], rep)


def eager_ms(fn) -> float:
    if DEV != "cuda":
        fn()
        return float("nan")
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median")


def busy_fraction(graph) -> float | None:
    """Kernel-busy time / wall span of one replay, from the profiler's CUDA kernel records (the union
    of the kernels' intervals over first start .. last end). 1 - this = launch gaps. None if the
    profiler reports no kernels inside graph replays."""
    if graph is None:
        return None
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if len(spans) < 2:
        return None
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / (spans[-1][1] - spans[0][0])


def log(*a):
    print(*a, flush=True)


# ============================================================================ demo checkpoint
def demo_prompts(n: int, length: int) -> list[list[int]]:
    """n held-out prompts of `length` tokens (data/heldout_prompts.json has 24 of 256 tokens: prompt
    i >= 24 is prompt i % 24 shifted by 16 * (i // 24) tokens, so that every prompt differs)."""
    ids = [p["ids"] for p in json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"]]
    out = []
    for i in range(n):
        src, shift = ids[i % len(ids)], 16 * (i // len(ids))
        if shift + length > len(src):
            raise ValueError(f"prompt {i}: {length} tokens from offset {shift} do not fit in {len(src)}")
        out.append(src[shift: shift + length])
    return out


def hf_from_reference(model, dtype, device):
    """transformers' InklingForCausalLM holding the demo trunk's weights (the MTP head is not part of it)."""
    from transformers import InklingForCausalLM, InklingTextConfig

    from inkling_ref import transformers_layout
    from inkling_ref.names import to_released

    hc = InklingTextConfig(**model.config.to_transformers_dict())
    hf = InklingForCausalLM(hc).eval()
    released = {to_released(n): p.detach() for n, p in model.trunk.named_parameters(prefix="trunk")}
    sd = transformers_layout.match_model_names(transformers_layout.from_released(released), hf.state_dict())
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.to(device=device, dtype=dtype)


def run_demo(res: dict) -> None:
    g = GRID
    N, L = g["new_tokens"], g["prompt_len"]
    model = load_checkpoint(DEFAULT_CHECKPOINT)                      # float32, CPU: the engines copy it
    prompts = demo_prompts(max(g["demo_batches"]), L)
    kmax = max(g["demo_ks"] + g["split_ks"])
    sizes = list(g["demo_batches"])
    e2e, split = [], []

    def e2e_fast(eng, name, B, k):
        """generate() end to end; decode time = the wall time inside run_cycle (the cycle, by graph
        replay or eagerly, and its one copy to the host), so decode tokens/s leaves the (eager,
        per-sequence) prefill and the host bookkeeping out."""
        in_cycles = [0.0]
        steady = dict(seconds=0.0, tokens=0, cycles=0)                 # cycles that ran all B sequences
        run_cycle = eng.run_cycle

        def timed(slots, *a, **kw):
            t0 = time.perf_counter()
            out = run_cycle(slots, *a, **kw)                           # ends with a host copy: synchronized
            dt = time.perf_counter() - t0
            in_cycles[0] += dt
            if len(slots) == B:
                steady["seconds"] += dt
                steady["tokens"] += sum(row[0] + 1 for row in out)    # a + 1 tokens per sequence
                steady["cycles"] += 1
            return out

        eng.run_cycle = timed
        try:
            eng.generate(prompts[:B], max_new_tokens=min(N, 2 * k + 4), num_speculative_tokens=k)  # capture, warm
            in_cycles[0] = 0.0
            steady.update(seconds=0.0, tokens=0, cycles=0)
            r = eng.generate(prompts[:B], max_new_tokens=N, num_speculative_tokens=k)
        finally:
            del eng.run_cycle
        row = dict(engine=name, batch=B, k=k, new_tokens=N, seconds=r.elapsed_s,
                   tokens_per_s=B * N / r.elapsed_s, decode_seconds=in_cycles[0],
                   decode_tokens_per_s=B * (N - 1) / in_cycles[0],                # x_L comes from the prefill
                   steady_tokens_per_s=steady["tokens"] / steady["seconds"],
                   steady_acceptance_length=steady["tokens"] / (B * steady["cycles"]),
                   steady_cycles=steady["cycles"], steady_ms_per_cycle=1e3 * steady["seconds"] / steady["cycles"],
                   acceptance_length=r.stats.acceptance_length if k > 0 else 1.0, cycles=r.stats.num_cycles)
        log(f"  {name:>12} B={B:<3} k={k}  {row['tokens_per_s']:9.1f} tok/s  decode {row['decode_tokens_per_s']:9.1f}"
            f"  steady {row['steady_tokens_per_s']:9.1f} ({row['steady_ms_per_cycle']:.3f} ms/cycle, L "
            f"{row['steady_acceptance_length']:.2f})  acc len {row['acceptance_length']:.2f}")
        e2e.append(row)
        return r

    eng = Engine(model, max_batch_size=max(sizes), max_seq_len=L + N + 1, num_speculative_tokens=kmax,
                 dtype=BF16, batch_sizes=sizes, use_cuda_graphs=DEV == "cuda")
    plain = {}
    for B in sizes:
        for k in g["demo_ks"]:
            r = e2e_fast(eng, "fast_graphs", B, k)
            if k == 0:
                plain[B] = r.token_ids

    log("cycle split")
    mode = DecodeMode()
    for B in sizes:
        for k in g["split_ks"]:
            slots = list(range(B))
            for i in slots:
                eng._start(i, prompts[i], i, k, mode, max_new_tokens=N, seed=None)
            batch = eng.make_batch(slots, k)
            st = eng.state
            n0 = st.n.clone()
            if k > 0:
                gd, (drafts, q) = capture(lambda: eng.draft(batch, k, mode))
            else:                                                        # plain decoding: no draft chain
                gd, (drafts, q) = None, eng.draft(batch, k, mode)
            gv, (hidden, k_eff) = capture(lambda: eng.verify(batch, k))
            ga, _ = capture(lambda: eng.accept(batch, k, mode, drafts, q, hidden, k_eff))

            def whole():
                out = eng.cycle(batch, k, mode)
                st.n.copy_(n0)                       # roll the length back: every replay is the same cycle
                return out

            gc, _ = capture(whole)
            d, v, a, c = (replay_ms(gd) if k > 0 else 0.0), replay_ms(gv), replay_ms(ga), replay_ms(gc)
            row = dict(batch=B, k=k, context=int(n0[0]), cycle_ms=c, draft_ms=d, verify_ms=v, accept_ms=a,
                       accept_commit_ms=c - d - v)
            log(f"  B={B:<3} k={k}  cycle {c:.3f} ms = draft {d:.3f} + verify {v:.3f} + accept/commit {c - d - v:.3f}")
            split.append(row)
            del gd, gv, ga, gc
    del eng

    eager = Engine(model, max_batch_size=max(sizes), max_seq_len=L + N + 1, num_speculative_tokens=kmax,
                   dtype=BF16, batch_sizes=sizes, use_cuda_graphs=False)
    for B, k in g["eager"]:
        e2e_fast(eager, "fast_eager", B, k)
    del eager

    ref_model = load_checkpoint(DEFAULT_CHECKPOINT, dtype=BF16, device=DEV)
    n_ref = max(8, N // 4)
    for B, k in g["ref"]:
        generate(ref_model, prompts[:B], max_new_tokens=4, num_speculative_tokens=k)      # warm-up
        sync()
        r = generate(ref_model, prompts[:B], max_new_tokens=n_ref, num_speculative_tokens=k)
        row = dict(engine="ref_gpu", batch=B, k=k, new_tokens=n_ref, seconds=r.elapsed_s,
                   tokens_per_s=B * n_ref / r.elapsed_s, decode_tokens_per_s=None,
                   acceptance_length=r.stats.acceptance_length if k > 0 else 1.0, cycles=r.stats.num_cycles)
        log(f"  {'ref_gpu':>12} B={B:<3} k={k}  {row['tokens_per_s']:9.1f} tok/s")
        e2e.append(row)
    del ref_model

    res["demo"] = dict(prompt_len=L, new_tokens=N, dtype="bfloat16", end_to_end=e2e, cycle_split=split)
    try:
        e2e += run_transformers(model, prompts, plain)
    except Exception as e:  # recorded, not hidden: engine.md says why the rows are missing
        log(f"  transformers baseline failed: {e!r}")
        res.setdefault("notes", []).append(f"transformers baseline not run: {e!r}")


def run_transformers(model, prompts, plain) -> list[dict]:
    g = GRID
    N, L = g["new_tokens"], g["prompt_len"]
    hf = hf_from_reference(model, BF16, DEV)
    rows = []
    for B in g["hf_batches"]:
        ids = torch.tensor(prompts[:B], device=DEV)
        kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            hf.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            sync()
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            sync()
        s = time.perf_counter() - t0
        new = out[:, L:].tolist()
        agree = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                 for a, b in zip(new, plain.get(B, new))]
        row = dict(engine="transformers", batch=B, k=0, new_tokens=N, seconds=s, tokens_per_s=B * N / s,
                   decode_tokens_per_s=None, acceptance_length=None, cycles=None,
                   agree_prefix_with_fast_plain=sorted(agree))
        log(f"  {'transformers':>12} B={B:<3} k=0  {row['tokens_per_s']:9.1f} tok/s  "
            f"(same tokens as the fast engine's plain decoding for the first {sorted(agree)} tokens)")
        rows.append(row)
    return rows


# ============================================================================ true-size MTP head
def head_config():
    if DRY:
        return true_scale.inkling_small(hidden_size=64, num_heads=4, num_kv_heads=2, swa_num_heads=4,
                                        swa_num_kv_heads=2, head_dim=16, swa_head_dim=16, sliding_window=16,
                                        rel_extent=24, dense_intermediate_size=96, moe_intermediate_size=32,
                                        n_routed_experts=16, num_experts_per_tok=3, vocab_size=300,
                                        unpadded_vocab_size=290, d_rel=4)
    return true_scale.inkling_small()


def run_head(res: dict) -> None:
    g, cfg = GRID, head_config()
    ctx, K8 = g["context"], cfg.num_mtp_depths
    W = true_scale.random_head(cfg, K8, device=DEV)
    H, V = cfg.hidden_size, cfg.vocab_out
    Bmax = max(g["head_batches"] + g["chain_batches"])
    eng = Engine(W, max_batch_size=Bmax, max_seq_len=ctx + 2 * K8 + 4, num_speculative_tokens=K8, dtype=BF16,
                 device=DEV, use_cuda_graphs=False,                   # the benchmark captures its own graphs
                 batch_sizes=sorted(set(g["head_batches"] + g["chain_batches"])))
    st = eng.state
    st.tokens.random_(0, V)
    st.hidden.normal_()
    st.stop.fill_(eng.max_seq_len)
    lm_bytes = V * H * 2

    def depth_floor(m: int, B: int, T: int) -> int:
        d = W.depths[m]
        return (true_scale.weight_bytes(d) + lm_bytes + cost_model.kv_bytes(cfg.mtp_layer_types[m], cfg, B, T, ctx)
                + B * T * H * 2 * 3)                                     # embedding rows, h in, h out

    steps = []
    log("MTP depth step (depth 0, sliding)")
    for B in g["head_batches"]:
        for T in g["head_rows"]:
            h = torch.randn(B, T, H, device=DEV).to(BF16)
            ids = torch.randint(0, V, (B, T), device=DEV)
            slot = torch.arange(B, dtype=torch.int32, device=DEV)
            pos = (ctx + torch.arange(T, device=DEV)).int().expand(B, T).contiguous()

            def step():
                out = forward.depth_forward(W, 0, eng.depth_caches[0], h, ids, slot, pos)
                return forward.greedy_tokens(W, out[:, -1])

            ms = graph_ms(step)
            fb = depth_floor(0, B, T)
            floor = fb / (res["copy_gbps"] * 1e9) * 1e3
            steps.append(dict(batch=B, rows=T, ms=ms, floor_ms=floor, bytes=fb))
            log(f"  B={B:<3} rows={T}  {ms:.3f} ms  floor {floor:.3f} ms  ({ms / floor:.2f}x)")

    chain = []
    mode = DecodeMode()
    log(f"{K8}-depth draft chain, one CUDA graph")
    for B in g["chain_batches"]:
        slots = list(range(B))
        batch = eng.make_batch(slots, K8)
        s = batch.slot.long()
        for a in g["chain_as"]:
            st.n[s] = ctx
            eng.draft(batch, K8, mode)                                   # one cycle's drafts, then a forced acceptance
            eng.commit(batch, torch.full((B,), a, device=DEV), torch.zeros(B, dtype=torch.int64, device=DEV))
            graph, _ = capture(lambda: eng.draft(batch, K8, mode))
            gms = replay_ms(graph)
            busy = busy_fraction(graph)
            ems = eager_ms(lambda: eng.draft(batch, K8, mode))
            floor_b = sum(depth_floor(m, B, K8 + 1) for m in range(K8))
            floor = floor_b / (res["copy_gbps"] * 1e9) * 1e3
            step_sum = sum(r["ms"] for r in steps if r["batch"] == B and r["rows"] == K8 + 1) * K8
            chain.append(dict(batch=B, k=K8, a=a, context=int(st.n[0]), graph_ms=gms, eager_ms=ems,
                              steps_sum_ms=step_sum or None, floor_ms=floor, bytes=floor_b, busy_fraction=busy))
            log(f"  B={B:<3} a={a}  graph {gms:.3f} ms  eager {ems:.3f} ms  floor {floor:.3f} ms  "
                f"busy {busy if busy is None else round(busy, 3)}")
            del graph
    res["mtp_head"] = dict(config="Inkling-Small" if not DRY else "tiny (dry run)", context=ctx,
                           depth_step=steps, chain=chain)
    del eng, W


# ============================================================================ true-width trunk layers
def run_layers(res: dict) -> None:
    g, cfg = GRID, head_config()
    ctx, H = g["context"], cfg.hidden_size
    moe = true_scale.random_moe(cfg, true_scale._Draw(DEV, BF16, 7))
    blocks = {"sliding_moe": true_scale.random_block(cfg, "sliding", moe, DEV, seed=1),
              "global_moe": true_scale.random_block(cfg, "global", moe, DEV, seed=2),
              "sliding_dense": true_scale.random_block(cfg, "sliding", "dense", DEV, seed=3)}
    Bmax, Tmax = max(g["layer_batches"]), max(g["layer_T"])
    rows = []
    for kind, w in blocks.items():
        cache = LayerCache.allocate(w.attn, H, cfg.conv_kernel_size, Bmax, ctx + Tmax + 1, Tmax - 1, BF16, DEV)
        cache.k.normal_()
        cache.v.normal_()
        log(f"layer {kind}")
        for B in g["layer_batches"]:
            for T in g["layer_T"]:
                h = torch.randn(B, T, H, device=DEV).to(BF16)
                slot = torch.arange(B, dtype=torch.int32, device=DEV)
                pos = (ctx + torch.arange(T, device=DEV)).int().expand(B, T).contiguous()
                ms = graph_ms(lambda: forward.block_forward(w, cache, h, slot, pos, cfg.rms_norm_eps, False), rep=50)
                rows.append(dict(kind=kind, batch=B, T=T, ms=ms))
                log(f"  B={B:<3} T={T}  {ms:.3f} ms")
        del cache
    del blocks, moe
    unembed = true_scale._Draw(DEV, BF16, 9).normal(cfg.vocab_size, H, std=1.0)
    done = set()
    for B in g["layer_batches"]:
        for T in g["layer_T"]:
            N = B * T
            if N in done:
                continue
            done.add(N)
            h = torch.randn(N, H, device=DEV).to(BF16)
            a = graph_ms(lambda: lm_head_argmax(h, unembed, cfg.vocab_out, float(cfg.mup)), rep=50)
            lg = graph_ms(lambda: torch.nn.functional.linear(h / cfg.mup, unembed)[:, : cfg.vocab_out], rep=50)
            rows += [dict(kind="lm_head_argmax", batch=N, T=1, ms=a), dict(kind="lm_head_logits", batch=N, T=1, ms=lg)]
            log(f"  LM head N={N:<4} argmax {a:.3f} ms  logits {lg:.3f} ms")
    res["layers"] = dict(config="Inkling-Small" if not DRY else "tiny (dry run)", context=ctx, rows=rows)


# ============================================================================ report
def write_markdown(res: dict, path: Path) -> None:
    L = ["# Engine benchmarks", "",
         f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}; date {res['date']}; commit {res['commit']}",
         "", f"Command: `{res['command']}` (writes `docs/benchmarks/engine.json`, this page and its plots).", "",
         f"Measured device-to-device copy bandwidth (bytes read + written): {res['copy_gbps']:.0f} GB/s; floors "
         "below = bytes that must be read / that bandwidth.", ""]
    runs = res.get("section_runs", {})
    if runs:
        L += ["Sections measured by separate runs (the line above is the last run's):", ""]
        L += [f"- {name}: {r['date']}, commit {r['commit']}, `{r['command']}`, copy bandwidth {r['copy_gbps']:.0f} GB/s"
              for name, r in sorted(runs.items())] + [""]
    for note in res.get("notes", []):
        L += [f"Note: {note}", ""]
    demo = res.get("demo")
    if demo:
        e2e = demo["end_to_end"]
        L += ["## Demo checkpoint, end to end", "",
              f"bf16, {demo['prompt_len']}-token held-out prompts, {demo['new_tokens']} new tokens per sequence "
              "(ref_gpu: fewer), greedy. tokens/s counts the whole batch's new tokens over the wall time of "
              "`generate` (prefill included: eager, one sequence after the other); decode tokens/s = the tokens the "
              "cycles produced over the wall time spent in them (graph replay + the one host copy per cycle); "
              "steady: the same over the cycles that ran all B sequences (before any finished), with their "
              "mean wall time per cycle and tokens per sequence per cycle (L). "
              "Speedups: over the same engine's plain decoding (k = 0) at the same batch.", "",
              "| engine | batch | k | tokens/s | speedup vs k=0 | decode tokens/s | decode speedup | steady tokens/s | "
              "steady speedup | steady ms/cycle | steady L | acceptance length | cycles |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        base = {(r["engine"], r["batch"]): r for r in e2e if r["k"] == 0}
        for r in e2e:
            b = base.get((r["engine"], r["batch"]))
            sp = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
            dec = f"{r['decode_tokens_per_s']:.0f}" if r.get("decode_tokens_per_s") else "-"
            dsp = (f"{r['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x"
                   if b and r.get("decode_tokens_per_s") and b.get("decode_tokens_per_s") else "-")
            if r.get("decode_tokens_per_s") and "decode_seconds" not in r and r["batch"] > 1:
                dec = dsp = "unreliable (note)"   # a run before decode was timed inside the cycles
            acc = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") else "-"
            if r.get("steady_tokens_per_s"):
                ssp = (f"{r['steady_tokens_per_s'] / b['steady_tokens_per_s']:.2f}x"
                       if b and b.get("steady_tokens_per_s") else "-")
                st = (f"{r['steady_tokens_per_s']:.0f} | {ssp} | {r['steady_ms_per_cycle']:.3f} | "
                      f"{r['steady_acceptance_length']:.2f}")
            else:
                st = "- | - | - | -"
            L.append(f"| {r['engine']} | {r['batch']} | {r['k']} | {r['tokens_per_s']:.0f} | {sp} | {dec} | {dsp} | "
                     f"{st} | {acc} | {r.get('cycles') or '-'} |")
        fast1 = {(r["batch"], r["k"]): r for r in e2e if r["engine"] == "fast_graphs"}
        comps = []
        for r in e2e:
            if r["engine"] in ("transformers", "ref_gpu", "fast_eager") and (r["batch"], r["k"]) in fast1:
                comps.append(f"{r['engine']} at batch {r['batch']}, k = {r['k']}: fast_graphs is "
                             f"{fast1[(r['batch'], r['k'])]['tokens_per_s'] / r['tokens_per_s']:.1f}x faster")
        best1 = max((r for r in e2e if r["engine"] == "fast_graphs" and r["batch"] == 1), key=lambda r: r["tokens_per_s"],
                    default=None)
        hf1 = next((r for r in e2e if r["engine"] == "transformers" and r["batch"] == 1), None)
        if best1 and hf1:
            comps.append(f"best fast_graphs at batch 1 (k = {best1['k']}) vs transformers' generate at batch 1: "
                         f"{best1['tokens_per_s'] / hf1['tokens_per_s']:.1f}x")
        L += [""] + [f"- {c}" for c in comps] + [""]
        L += ["![demo tokens/s](engine_demo.png)", "",
              "## Demo checkpoint, one cycle split into its parts", "",
              "Fast engine, CUDA graphs: the draft chain (k depths over k+1 rows each, with on-device argmax), "
              "the verify pass (the trunk over k+1 rows + argmax) and the accept step are each captured and "
              "replayed alone; the whole cycle too (with its length rolled back after each replay). "
              "accept+commit = cycle - draft - verify.", "",
              "| batch | k | context | cycle ms | draft ms | verify ms | accept ms | accept+commit ms |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in demo["cycle_split"]:
            L.append(f"| {r['batch']} | {r['k']} | {r['context']} | {r['cycle_ms']:.3f} | {r['draft_ms']:.3f} | "
                     f"{r['verify_ms']:.3f} | {r['accept_ms']:.3f} | {r['accept_commit_ms']:.3f} |")
        L.append("")
    head = res.get("mtp_head")
    if head:
        L += ["## True-size MTP head (Inkling-Small width, random bf16 weights)", "",
              f"Context {head['context']} tokens in every depth cache. One depth step = depth 0 (sliding) over "
              "`rows` rows per sequence + the greedy argmax of the last row over the shared 201024 x 4096 LM head "
              "(the LM head reads 1.6 GB: at small batch it dominates). Floor = depth weights + LM head + KV rows "
              "read + activations, over the copy bandwidth.", "",
              "| batch | rows | ms | floor ms | x floor |", "|---:|---:|---:|---:|---:|"]
        for r in head["depth_step"]:
            L.append(f"| {r['batch']} | {r['rows']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['ms'] / r['floor_ms']:.2f} |")
        L += ["", f"The {max(r['k'] for r in head['chain'])}-depth draft chain (`Engine.draft`: depths 0..7 over the "
              "k+1-row window, drafts fed forward on the device) as one CUDA graph, after a cycle whose acceptance "
              "was forced to a. Busy = kernel time / wall span of one replay from the profiler (1 - busy = launch "
              "gaps).", "",
              "| batch | a | graph ms | eager ms | 8 x one step ms | floor ms | graph x floor | busy |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in head["chain"]:
            busy = f"{100 * r['busy_fraction']:.1f}%" if r.get("busy_fraction") else "-"
            ss = f"{r['steps_sum_ms']:.3f}" if r.get("steps_sum_ms") else "-"
            L.append(f"| {r['batch']} | {r['a']} | {r['graph_ms']:.3f} | {r['eager_ms']:.3f} | {ss} | "
                     f"{r['floor_ms']:.3f} | {r['graph_ms'] / r['floor_ms']:.2f} | {busy} |")
        L += ["", "![MTP head](engine_head.png)", ""]
    lay = res.get("layers")
    if lay:
        L += ["## One true-width Inkling-Small layer (the cost model's inputs)", "",
              f"Context {lay['context']}; graph replay of `forward.block_forward` (attention over the cache, MoE "
              "with a random router drawn so that N tokens touch about as many distinct experts as uniform top-6 "
              "routing, 256 (1 - (1 - 6/256)^N), as a load-balanced trained router does; see "
              "benchmarks/true_scale.py) at batch B x T tokens per sequence; "
              "LM head: N = B*T rows, argmax kernel vs logits GEMM.", ""]
        kinds = [k for k in ("sliding_moe", "global_moe", "sliding_dense") if any(r["kind"] == k for r in lay["rows"])]
        Ts = sorted({r["T"] for r in lay["rows"] if r["kind"] in kinds})
        L += ["| kind | batch | " + " | ".join(f"T={t} ms" for t in Ts) + " |", "|---|---:|" + "---:|" * len(Ts)]
        for kind in kinds:
            for B in sorted({r["batch"] for r in lay["rows"] if r["kind"] == kind}):
                cells = [next((f"{r['ms']:.3f}" for r in lay["rows"] if r["kind"] == kind and r["batch"] == B
                               and r["T"] == t), "-") for t in Ts]
                L.append(f"| {kind} | {B} | " + " | ".join(cells) + " |")
        L += ["", "| LM head rows N | argmax ms | logits ms |", "|---:|---:|---:|"]
        for N in sorted({r["batch"] for r in lay["rows"] if r["kind"] == "lm_head_argmax"}):
            a = next(r["ms"] for r in lay["rows"] if r["kind"] == "lm_head_argmax" and r["batch"] == N)
            lg = next(r["ms"] for r in lay["rows"] if r["kind"] == "lm_head_logits" and r["batch"] == N)
            L.append(f"| {N} | {a:.3f} | {lg:.3f} |")
        L += ["", "![layers](engine_layers.png)", ""]
    path.write_text("\n".join(L))


def plots(res: dict, folder: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def save(fig, path: Path) -> None:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    demo = res.get("demo")
    if demo:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        rows = [r for r in demo["end_to_end"] if r["engine"] == "fast_graphs"]
        for B in sorted({r["batch"] for r in rows}):
            rs = sorted((r for r in rows if r["batch"] == B), key=lambda r: r["k"])
            ks, tps = [r["k"] for r in rs], [r["tokens_per_s"] for r in rs]
            ax[0].plot(ks, tps, "o-", label=f"batch {B}")
            ax[1].plot(ks, [t / tps[0] for t in tps], "o-", label=f"batch {B}")
        ax[0].set(xlabel="k (drafts per cycle)", ylabel="tokens/s", yscale="log", title="demo checkpoint, fast engine")
        ax[1].set(xlabel="k", ylabel="speedup over k = 0", title="speculative speedup")
        ax[1].axhline(1, color="gray", lw=0.8)
        ax[0].legend()
        save(fig, folder / "engine_demo.png")
    head = res.get("mtp_head")
    if head:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for T in sorted({r["rows"] for r in head["depth_step"]}):
            rs = [r for r in head["depth_step"] if r["rows"] == T]
            ax.plot([r["batch"] for r in rs], [r["ms"] for r in rs], "o-", label=f"step, {T} rows")
        rs = [r for r in head["depth_step"] if r["rows"] == 1]
        ax.plot([r["batch"] for r in rs], [r["floor_ms"] for r in rs], "k--", label="HBM floor, 1 row")
        ax.set(xlabel="batch", ylabel="ms", xscale="log", title="one MTP depth step, Inkling-Small width")
        ax.legend(fontsize=7)
        save(fig, folder / "engine_head.png")
    lay = res.get("layers")
    if lay:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        Bs = sorted({r["batch"] for r in lay["rows"] if r["kind"] == "sliding_moe"})
        for kind, style in (("sliding_moe", "-"), ("global_moe", "--"), ("sliding_dense", ":")):
            for B in (Bs[0], Bs[-1]):
                rs = sorted((r for r in lay["rows"] if r["kind"] == kind and r["batch"] == B), key=lambda r: r["T"])
                if rs:
                    ax.plot([r["T"] for r in rs], [r["ms"] for r in rs], "o" + style, label=f"{kind}, batch {B}")
        ax.set(xlabel="T tokens per sequence", ylabel="ms per layer", yscale="log", title="one Inkling-Small layer")
        ax.legend(fontsize=7)
        save(fig, folder / "engine_layers.png")


def main(argv: list[str]) -> None:
    if "--report" in argv:
        res = json.loads(OUT_JSON.read_text())
        write_markdown(res, OUT_JSON.parent / "engine.md")
        plots(res, OUT_JSON.parent)
        log(f"wrote {OUT_JSON.parent / 'engine.md'} and its plots from {OUT_JSON}")
        return
    names = [a for a in argv if not a.startswith("--")]
    sections = {"demo": run_demo, "head": run_head, "layers": run_layers}
    bad = [n for n in names if n not in sections]
    if bad:
        raise SystemExit(f"unknown sections {bad}; choose from {list(sections)}")
    if DEV != "cuda" and not DRY:
        raise SystemExit("engine benchmarks need a CUDA GPU (or --dry on CPU)")
    out = OUT_JSON if not DRY else Path(os.environ.get("TMPDIR", "/tmp")) / "engine_dry.json"
    res = json.loads(out.read_text()) if out.exists() and names else {}
    import triton
    res.update(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "CPU (dry run)", torch=torch.__version__,
               triton=triton.__version__, date=str(datetime.date.today()),
               commit=os.environ.get("INKLING_COMMIT") or harness.git_commit(),
               command="python benchmarks/engine.py " + " ".join(argv))
    res["copy_gbps"] = harness.measure_copy_bandwidth() if DEV == "cuda" else 1.0
    res["notes"] = []
    for name in names or list(sections):
        log(f"== {name}")
        t0 = time.perf_counter()
        sections[name](res)
        res.setdefault("section_runs", {})[name] = {k: res[k] for k in ("date", "commit", "command", "copy_gbps")}
        log(f"== {name} done in {time.perf_counter() - t0:.0f} s")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))                        # after every section
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if not DRY:
        write_markdown(res, out.parent / "engine.md")
        plots(res, out.parent)
    else:
        write_markdown(res, out.with_suffix(".md"))
    log(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
