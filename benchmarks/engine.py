"""Engine benchmarks (a script, not a test): writes docs/benchmarks/engine.{json,md} and its plots.

    python benchmarks/engine.py                    # GPU: every section
    python benchmarks/engine.py demo head          # only some sections (the JSON keeps the others)
    python benchmarks/engine.py requests --out $OUT --baseline-src /path/to/older/checkout
                                                   # whole requests, this tree and an older one side by side
    python benchmarks/engine.py --dry              # CPU, TRITON_INTERPRET=1: tiny sizes, no timing
    python benchmarks/engine.py --report           # rewrite engine.md and the plots from engine.json

--out DIR writes engine.json, engine.md and the plots into DIR (starting from DIR/engine.json, or
else docs/benchmarks/engine.json, so that the sections not run are kept) instead of docs/benchmarks/.

Sections (docs/benchmarks/engine.md explains each table; the JSON layout is what
inkling_fast.cost_model reads):
  demo      the bundled demo checkpoint, bf16: end-to-end tokens/s of the fast engine (CUDA graphs and
            eager), the reference on the GPU and transformers' `generate` on the same trunk; and the
            cycle split (draft chain / verify / accept+commit), each part captured and replayed alone.
  requests  whole requests on the demo checkpoint, bf16, CUDA graphs: (a) a fixed workload (240-token
            prompts, 128 new tokens, greedy, batch 1/4/16/32, k = 0/1/2/4/8): whole `generate` calls,
            prefill (generate with max_new_tokens=1) and decode (the rest) separately, best of 3, with
            the overlapped and the synchronous host loop; the prefill passes' device time (their graphs
            replayed) against their wall time, and eager; (b) a serving-like workload (128 requests,
            prompt and output lengths drawn at random, all submitted at once to max_batch_size 32):
            requests/s, output tokens/s, mean time per output token, k = 0/2/4/8; (c) host time per
            steady cycle of both loops against the captured cycle's device time. With
            --baseline-src DIR the same workloads run on DIR's inkling_fast in a subprocess (an older
            checkout: its one loop, its API), reported beside this tree's.
  head      the true-size MTP head at Inkling-Small width (random bf16 weights, 8 depths, shared LM head
            of 201024 x 4096): one depth step and the 8-depth draft chain in one CUDA graph against the
            HBM floor of the bytes they must read (weights + KV), with acceptance forced to sweep a.
  layers    one true-width Inkling-Small trunk layer of each kind (sliding/global attention + MoE with
            realistic routing, sliding + dense) and the LM head, at T = 1..9 tokens per sequence and
            batch 1..64: the per-layer costs of the cost model.

Method: CUDA-graph replay timed with `triton.testing.do_bench` (warm-up, CUDA
events, median); the weights read per call (>= 0.5 GB) are far beyond the 60 MB L2, except the demo
checkpoint's (24 MB), which is what a model that small gets. Floors use the device-to-device copy
bandwidth measured in the same run. End-to-end runs are wall-clock times of whole `generate` calls
(prefill, cycles and the host loop), after a warm-up call that captures the graphs; the engine's
per-step host timings (`Engine.timings`) split them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from types import SimpleNamespace
from pathlib import Path

import torch

DRY = "--dry" in sys.argv
if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = os.environ.get("INKLING_SRC")     # set by --baseline-src for its subprocess: the tree to import from
sys.path[:0] = [str(HERE)] + ([SRC] if SRC else []) + [str(ROOT)]

import random  # noqa: E402
import subprocess  # noqa: E402

import harness  # noqa: E402
import true_scale  # noqa: E402
from inkling_fast import Engine  # noqa: E402
from inkling_fast import cost_model, forward  # noqa: E402
from inkling_fast.caches import LayerCache  # noqa: E402
from inkling_ref import generate, load_checkpoint  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / "inkling_ref" / "default_checkpoint"   # this tree's demo, also under --baseline-src
OUT_JSON = ROOT / "docs" / "benchmarks" / "engine.json"
DEV = "cuda" if torch.cuda.is_available() and not DRY else "cpu"
BF16 = torch.bfloat16

if DRY:
    GRID = dict(demo_batches=(1, 2), demo_ks=(0, 1), new_tokens=4, prompt_len=8, split_ks=(0, 1),
                eager=((1, 0),), ref=((1, 0),), hf_batches=(1,), head_batches=(1, 2), head_rows=(1, 3),
                chain_batches=(1,), chain_as=(0, 2), layer_batches=(1, 2), layer_T=(1, 3), context=40,
                req_batches=(1, 2), req_ks=(0, 1), req_repeats=1, req_eager=((2, 1),), serve_requests=5,
                serve_ks=(0, 1), serve_batch=2, serve_prompt=(3, 12), serve_out=(2, 5), serve_repeats=1)
else:
    GRID = dict(demo_batches=(1, 4, 16, 32), demo_ks=(0, 1, 2, 4, 8), new_tokens=128, prompt_len=240,
                split_ks=(0, 1, 2, 4, 8), eager=((1, 0), (1, 4), (32, 0), (32, 4)), ref=((1, 0), (1, 4)),
                hf_batches=(1, 32), head_batches=(1, 2, 4, 8, 16, 32, 64), head_rows=(1, 2, 3, 5, 9),
                chain_batches=(1, 4, 16, 32), chain_as=(0, 4, 8), layer_batches=(1, 2, 4, 8, 16, 32, 64),
                layer_T=(1, 2, 3, 5, 9), context=4096,
                req_batches=(1, 4, 16, 32), req_ks=(0, 1, 2, 4, 8), req_repeats=3, req_eager=((1, 0), (32, 4)),
                serve_requests=128, serve_ks=(0, 2, 4, 8), serve_batch=32, serve_prompt=(32, 1024),
                serve_out=(16, 256), serve_repeats=2)

GRID.update((key, tuple(v) if isinstance(v, list) else v)   # JSON lists as the tuples above
            for key, v in json.loads(os.environ.get("INKLING_BENCH_GRID", "{}")).items())  # e.g. '{"req_repeats": 2}': a smaller run


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

    from inkling_ref.io import transformers_layout
    from inkling_ref.io.names import to_released

    hc = InklingTextConfig(**model.config.to_transformers_dict())
    hf = InklingForCausalLM(hc).eval()
    released = {to_released(n): p.detach() for n, p in model.trunk.named_parameters(prefix="trunk")}
    sd = transformers_layout.match_model_names(transformers_layout.from_released(released), hf.state_dict())
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return hf.to(device=device, dtype=dtype)


def run_demo(res: dict) -> None:
    from inkling_fast.step_io import Decoding   # this tree's engine parts (not under --baseline-src)
    g = GRID
    N, L = g["new_tokens"], g["prompt_len"]
    model = load_checkpoint(DEFAULT_CHECKPOINT)                      # float32, CPU: the engines copy it
    prompts = demo_prompts(max(g["demo_batches"]), L)
    kmax = max(g["demo_ks"] + g["split_ks"])
    sizes = list(g["demo_batches"])
    e2e, split = [], []

    def e2e_fast(eng, name, B, k):
        """generate() end to end (after a warm-up call that captures the graphs); decode time = generate's
        wall time less the prefill's (until the last prefill pass's result was on the host), so decode
        tokens/s leaves the prefill out; steady: the cycles that ran all B sequences (`steady_cycles`)."""
        eng.generate(prompts[:B], max_new_tokens=min(N, 2 * k + 4), num_speculative_tokens=k)  # capture, warm
        r = eng.generate(prompts[:B], max_new_tokens=N, num_speculative_tokens=k)
        decode_s = r.elapsed_s - prefill_seconds(eng)
        steady = steady_cycles(eng.timings, B)
        row = dict(engine=name, batch=B, k=k, new_tokens=N, seconds=r.elapsed_s,
                   tokens_per_s=B * N / r.elapsed_s, decode_seconds=decode_s,
                   decode_tokens_per_s=B * (N - 1) / decode_s,                    # x_L comes from the prefill
                   steady_tokens_per_s=steady["tokens"] / steady["seconds"],
                   steady_acceptance_length=steady["tokens"] / (B * steady["cycles"]),
                   steady_cycles=steady["cycles"], steady_ms_per_cycle=1e3 * steady["seconds"] / steady["cycles"],
                   steady_host_ms_per_cycle=steady["host_ms"],
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
    for B in sizes:
        for k in g["split_ks"]:
            slots, dec = list(range(B)), Decoding(k)
            eng.prefill_batch(slots, prompts[:B], dec, [L + N] * B)
            batch = eng.make_batch(slots, k)
            st = eng.state
            n0 = st.n.clone()
            if k > 0:
                gd, (drafts, q, scores) = capture(lambda: eng.steps.draft(batch, dec))
            else:                                                        # plain decoding: no draft chain
                gd, (drafts, q, scores) = None, eng.steps.draft(batch, dec)
            gv, (hidden, k_eff) = capture(lambda: eng.steps.verify(batch, dec))
            ga, _ = capture(lambda: eng.steps.accept(batch, dec, drafts, q, scores, hidden, k_eff))

            def whole():
                out = eng.steps.cycle(batch, dec)
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


# ============================================================================ whole requests
def steady_cycles(timings, B: int) -> dict | None:
    """The longest run of consecutive steps that are cycles of all B sequences (no prefill pass between),
    from `Engine.timings`: wall seconds from the first one's result on the host to the last one's, the
    cycles and tokens after the first, and the mean host time per cycle (launch + booking, no wait)."""
    best, run = [], []
    for t in timings:
        run = run + [t] if t.kind == "cycle" and t.rows == B else []
        if len(run) > len(best):
            best = run
    if len(best) < 2:
        return None
    return dict(seconds=best[-1].ready_s - best[0].ready_s, cycles=len(best) - 1,
                tokens=sum(t.tokens for t in best[1:]), host_ms=1e3 * sum(t.host_s for t in best[1:]) / (len(best) - 1))


def prefill_seconds(eng) -> float:
    """From the start of the last `generate` until its last prefill pass's result was on the host."""
    return max(t.ready_s for t in eng.timings if t.kind == "prefill") - eng.started_s


def serving_workload(n: int, max_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n requests: output length uniform in serve_out; prompt length uniform in serve_prompt, capped so
    that every prompt fits the model's maximum length with the longest output (max_len - the top of
    serve_out: one limit per call also fits an older engine); the prompt a window at a random offset of a
    random held-out prompt (data/heldout_prompts.json: 24 of 256 tokens), or of the 24 laid end to
    end when longer."""
    ids = [p["ids"] for p in json.loads((ROOT / "data" / "heldout_prompts.json").read_text())["prompts"]]
    stream = [t for p in ids for t in p]
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = GRID["serve_prompt"], GRID["serve_out"]
    prompts, outs = [], []
    for _ in range(n):
        out = rng.randint(o_lo, o_hi)
        length = rng.randint(p_lo, min(p_hi, max_len - o_hi))
        src = ids[rng.randrange(len(ids))]
        src = src if length <= len(src) else stream
        start = rng.randint(0, len(src) - length)
        prompts.append(src[start: start + length])
        outs.append(out)
    return prompts, outs


def run_requests(res: dict) -> None:
    """Section `requests`; with --baseline-src, the same in a subprocess on the older tree (its
    inkling_fast and inkling_ref; the demo checkpoint and the prompts of this tree)."""
    out = requests_workloads()
    baseline = arg_value("--baseline-src")
    if baseline:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / f"engine_requests_baseline_{os.getpid()}.json"
        commit = os.environ.get("INKLING_BASELINE_COMMIT") or _git_commit_of(baseline)
        # the same weights and prompts: the older tree needs only its packages
        env = dict(os.environ, INKLING_SRC=str(Path(baseline).resolve()), INKLING_COMMIT=commit,
                   INKLING_CHECKPOINT=str(Path(DEFAULT_CHECKPOINT).resolve()))
        cmd = [sys.executable, str(Path(__file__).resolve()), "requests", "--as-baseline", "--json-out", str(path)]
        log(f"baseline: {baseline} (commit {commit}) in a subprocess")
        subprocess.run(cmd + (["--dry"] if DRY else []), env=env, check=True)
        out["baseline"] = dict(json.loads(path.read_text()), src=str(baseline), commit=commit)
    res["requests"] = out


def arg_value(flag: str) -> str | None:
    argv = sys.argv[1:]
    return argv[argv.index(flag) + 1] if flag in argv and argv.index(flag) + 1 < len(argv) else None


def _git_commit_of(path: str) -> str:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def requests_model():
    """The demo checkpoint (float32, CPU: the engines copy it); a dry run takes a tiny random model with
    the demo's vocabulary and maximum length instead (the interpreter is too slow for the demo's)."""
    if not DRY:
        return load_checkpoint(os.environ.get("INKLING_CHECKPOINT") or DEFAULT_CHECKPOINT)
    from inkling_ref import InklingConfig, random_model
    return random_model(InklingConfig(
        vocab_size=4032, unpadded_vocab_size=4000, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=16, rel_extent=12, swa_num_heads=2, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=5,
        d_rel=4, layer_types=["sliding", "global"], mlp_types=["dense", "moe"], dense_intermediate_size=24,
        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        conv_kernel_size=4, max_position_embeddings=512, num_mtp_depths=1, mtp_layer_types=["sliding"]), seed=0)


def requests_workloads() -> dict:
    """(a) fixed workload, prefill split, (b) serving, (c) steady cycles: this process's inkling_fast."""
    g = GRID
    N, L = g["new_tokens"], g["prompt_len"]
    model = requests_model()
    prompts = demo_prompts(max(g["req_batches"]), L)
    kmax = max(g["req_ks"] + g["serve_ks"])
    sizes = list(g["req_batches"])
    loops = ("overlap", "sync")
    internals = hasattr(Engine, "request")       # this tree's engine parts; a --baseline-src tree may predate them
    graphs = DEV == "cuda"

    def engine(**kw):
        return Engine(model, num_speculative_tokens=kmax, dtype=BF16, **{"use_cuda_graphs": graphs, **kw})

    def call(eng, batch, limit, k, loop):
        return eng.generate(batch, max_new_tokens=limit, num_speculative_tokens=k, overlap=loop == "overlap")

    fixed, split, steady_rows = [], [], []
    eng = engine(max_batch_size=max(sizes), max_seq_len=L + N + 1, batch_sizes=sizes)
    log("fixed workload: whole generate calls, prefill alone (max_new_tokens=1), best of "
        f"{g['req_repeats']}")
    for B in sizes:
        for k in g["req_ks"]:
            for loop in loops:
                call(eng, prompts[:B], N, k, loop)                      # warm-up: captures the graphs
                call(eng, prompts[:B], 1, k, loop)
                whole, pre, best = [], [], None
                for _ in range(g["req_repeats"]):
                    r = call(eng, prompts[:B], N, k, loop)
                    steady = steady_cycles(eng.timings, B)
                    whole.append(r.elapsed_s)
                    if r.elapsed_s == min(whole):
                        best = (r, steady)
                    pre.append(call(eng, prompts[:B], 1, k, loop).elapsed_s)
                r, steady = best
                row = dict(loop=loop, batch=B, k=k, prompt_len=L, new_tokens=N, whole_ms=1e3 * min(whole),
                           prefill_ms=1e3 * min(pre), decode_ms=1e3 * (min(whole) - min(pre)), whole_runs_ms=[
                               1e3 * w for w in whole], prefill_runs_ms=[1e3 * p for p in pre],
                           tokens_per_s=B * N / min(whole),
                           acceptance_length=r.stats.acceptance_length if k > 0 else 1.0)
                if steady:
                    row.update(steady_ms_per_cycle=1e3 * steady["seconds"] / steady["cycles"],
                               steady_host_ms_per_cycle=steady["host_ms"], steady_cycles=steady["cycles"],
                               steady_acceptance_length=steady["tokens"] / (B * steady["cycles"]))
                log(f"  {loop:>8} B={B:<3} k={k}  whole {row['whole_ms']:8.2f} ms = prefill {row['prefill_ms']:7.2f}"
                    f" + decode {row['decode_ms']:8.2f}" + (f"   steady {row['steady_ms_per_cycle']:.3f} ms/cycle"
                                                            if steady else ""))
                fixed.append(row)
            if internals and graphs:
                dev_ms = device_cycle_ms(eng, prompts[:B], k, L + N)
                rows = {r["loop"]: r for r in fixed if r["batch"] == B and r["k"] == k}
                steady_rows.append(dict(batch=B, k=k, device_ms=dev_ms, **{
                    f"{lp}_{f}": rows[lp].get(f"steady_{f}") for lp in loops
                    for f in ("ms_per_cycle", "host_ms_per_cycle")}))
                split.append(prefill_split(eng, prompts[:B], k))
                log(f"  B={B:<3} k={k}  device cycle {dev_ms:.3f} ms; prefill passes {split[-1]['passes']}: device "
                    f"{split[-1]['device_ms']:.3f} ms")
    del eng
    if internals:
        for B, k in g["req_eager"]:
            eager = engine(max_batch_size=max(sizes), max_seq_len=L + N + 1, batch_sizes=sizes, use_cuda_graphs=False)
            call(eager, prompts[:B], 1, k, "overlap")
            ms = 1e3 * min(call(eager, prompts[:B], 1, k, "overlap").elapsed_s for _ in range(g["req_repeats"]))
            for row in split:
                if row["batch"] == B and row["k"] == k:
                    row["eager_prefill_ms"] = ms
            log(f"  eager prefill B={B} k={k}: {ms:.2f} ms")
            del eager

    serving = []
    max_len = model.config.max_position_embeddings
    reqs, outs = serving_workload(g["serve_requests"], max_len)
    eng = engine(max_batch_size=g["serve_batch"], max_seq_len=max_len)
    log(f"serving: {len(reqs)} requests, prompts {min(map(len, reqs))}..{max(map(len, reqs))} tokens, outputs "
        f"{min(outs)}..{max(outs)}, max_batch_size {g['serve_batch']}")
    for k in g["serve_ks"]:
        for loop in loops:
            runs = []
            for _ in range(g["serve_repeats"] + 1):                     # the first run captures the graphs
                start = time.perf_counter()
                r = call(eng, reqs, outs, k, loop)
                times, tokens = eng.request_times, r.token_ids
                assert [len(t) for t in tokens] == outs, "every request must get exactly its output length"
                tpot = [(d - f) / (n - 1) for (f, d), n in zip(times, outs) if n > 1]
                ttft = [f - start for f, _ in times]
                runs.append(dict(seconds=r.elapsed_s, requests_per_s=len(reqs) / r.elapsed_s,
                                 output_tokens_per_s=sum(outs) / r.elapsed_s,
                                 mean_tpot_ms=1e3 * sum(tpot) / len(tpot), mean_ttft_ms=1e3 * sum(ttft) / len(ttft),
                                 acceptance_length=r.stats.acceptance_length if k > 0 else 1.0))
            best = min(runs[1:], key=lambda x: x["seconds"])
            serving.append(dict(loop=loop, k=k, requests=len(reqs), output_tokens=sum(outs),
                                runs_s=[x["seconds"] for x in runs[1:]], **best))
            log(f"  {loop:>8} k={k}  {best['requests_per_s']:7.2f} req/s  {best['output_tokens_per_s']:8.0f} tok/s  "
                f"TPOT {best['mean_tpot_ms']:.3f} ms  TTFT {best['mean_ttft_ms']:.1f} ms")
    del eng
    return dict(prompt_len=L, new_tokens=N, dtype="bfloat16", batch_sizes=sizes, fixed=fixed, prefill_split=split,
                steady=steady_rows, serving=serving,
                serving_workload=dict(requests=len(reqs), max_batch_size=g["serve_batch"], prompt_range=g["serve_prompt"],
                                      output_range=g["serve_out"], model_max_len=max_len,
                                      prompt_lengths=[len(p) for p in reqs], output_lengths=outs))


def device_cycle_ms(eng, prompts: list[list[int]], k: int, stop: int) -> float:
    """The captured cycle of len(prompts) sequences right after their prefill, replayed with the length
    rolled back after each replay (every replay is the same cycle): ms per cycle on the device."""
    from inkling_fast.step_io import Decoding
    B, dec, st = len(prompts), Decoding(k), eng.state
    slots = list(range(B))
    eng.prefill_batch(slots, prompts, dec, [stop] * B)
    batch = eng.make_batch(slots, k)
    n0 = st.n.clone()

    def whole():
        out = eng.steps.cycle(batch, dec)
        st.n.copy_(n0)
        return out

    graph, _ = capture(whole)
    ms = replay_ms(graph)
    del graph
    return ms


def prefill_split(eng, prompts: list[list[int]], k: int) -> dict:
    """The prefill of `prompts` (generate with max_new_tokens=1, as in the fixed workload): its passes
    (shape B x T), each pass's captured graph replayed alone (device time: it rewrites the same rows),
    against the wall time."""
    from inkling_fast.step_io import Decoding, PrefillKey
    r = eng.generate(prompts, max_new_tokens=1, num_speculative_tokens=k)
    shapes = [t.shape for t in eng.timings if t.kind == "prefill"]
    device = sum(replay_ms(eng.graphs[PrefillKey(B, T, Decoding(k))].graph) for B, T in shapes)
    return dict(batch=len(prompts), k=k, passes=[list(s) for s in shapes], device_ms=device, wall_ms=1e3 * r.elapsed_s)


# ============================================================================ true-size MTP head
def head_config():
    return true_scale.tiny_inkling_small() if DRY else true_scale.inkling_small()


def run_head(res: dict) -> None:
    from inkling_fast.step_io import Decoding   # this tree's engine parts (not under --baseline-src)
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
    dec8 = Decoding(K8)
    log(f"{K8}-depth draft chain, one CUDA graph")
    for B in g["chain_batches"]:
        slots = list(range(B))
        batch = eng.make_batch(slots, K8)
        s = batch.slot.long()
        for a in g["chain_as"]:
            st.n[s] = ctx
            eng.steps.draft(batch, dec8)                                 # one cycle's drafts, then a forced acceptance
            eng.steps.commit(batch, torch.full((B,), a, device=DEV), torch.zeros(B, dtype=torch.int64, device=DEV))
            graph, _ = capture(lambda: eng.steps.draft(batch, dec8))
            gms = replay_ms(graph)
            busy = busy_fraction(graph)
            ems = eager_ms(lambda: eng.steps.draft(batch, dec8))
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
    head = SimpleNamespace(unembed=unembed, vocab_out=cfg.vocab_out, mup=float(cfg.mup))   # what greedy_tokens reads
    done = set()
    for B in g["layer_batches"]:
        for T in g["layer_T"]:
            N = B * T
            if N in done:
                continue
            done.add(N)
            h = torch.randn(N, H, device=DEV).to(BF16)
            a = graph_ms(lambda: forward.greedy_tokens(head, h), rep=50)        # the engine's path at N rows
            lg = graph_ms(lambda: torch.nn.functional.linear(h / cfg.mup, unembed)[:, : cfg.vocab_out], rep=50)
            rows += [dict(kind="lm_head_argmax", batch=N, T=1, ms=a), dict(kind="lm_head_logits", batch=N, T=1, ms=lg)]
            log(f"  LM head N={N:<4} greedy {a:.3f} ms  logits {lg:.3f} ms")
    res["layers"] = dict(config="Inkling-Small" if not DRY else "tiny (dry run)", context=ctx, rows=rows)


# ============================================================================ report
def provenance_line(res: dict, section: str) -> str:
    """Where, from which commit and by which command a section's tables were measured."""
    run = res.get("section_runs", {}).get(section, res)
    return (f"Measured on {run.get('gpu', res['gpu'])}, commit {run['commit']}, {run['date']}: "
            f"`{run['command']}`.")


def table_head(*columns: str, text: tuple[str, ...] = ()) -> list[str]:
    """The first two lines of a markdown table: the header, and the alignment line that puts the columns named
    in `text` to the left and the others (numbers) to the right."""
    return ["| " + " | ".join(columns) + " |", "|" + "".join("---|" if c in text else "---:|" for c in columns)]


def requests_markdown(res: dict) -> list[str]:
    """The tables of section `requests` (and its baseline, when run with --baseline-src)."""
    req = res["requests"]
    base = req.get("baseline")
    prov = provenance_line(res, "requests")
    intro = prov
    if base:
        intro += (f" Baseline: the same workloads in the same run on the checkout `{base['src']}` (commit "
                  f"{base['commit']}; its one host loop, its API), as a subprocess.")
        prov += f" Baseline: commit {base['commit']}, same run."
    L = ["## Whole requests (demo checkpoint, bf16, CUDA graphs)", "", intro, ""]
    rows = [dict(r, engine="this tree") for r in req["fixed"]]
    rows += [dict(r, engine=f"baseline {base['commit']}") for r in (base or {}).get("fixed", [])]
    plain = {(r["engine"], r["loop"], r["batch"]): r for r in rows if r["k"] == 0}
    L += ["### Fixed workload", "", f"{req['prompt_len']}-token held-out prompts, {req['new_tokens']} new tokens per "
          "sequence, greedy. whole = one `generate` call, prefill = `generate(max_new_tokens=1)` on the same prompts "
          "(every prompt through the prefill, x_L), decode = whole - prefill; each the best of "
          f"{len(req['fixed'][0]['whole_runs_ms'])} calls after a warm-up call. Speedups: over k = 0 of the same "
          "engine and loop at the same batch.", "", prov, "",
          *table_head("engine", "loop", "batch", "k", "whole ms", "prefill ms", "decode ms", "tokens/s",
                      "whole speedup", "decode speedup", "acceptance length", text=("engine", "loop"))]
    for r in rows:
        b = plain.get((r["engine"], r["loop"], r["batch"]))
        sp = f"{b['whole_ms'] / r['whole_ms']:.2f}x" if b else "-"
        dsp = f"{b['decode_ms'] / r['decode_ms']:.2f}x" if b and r["decode_ms"] > 0 else "-"
        L.append(f"| {r['engine']} | {r['loop']} | {r['batch']} | {r['k']} | {r['whole_ms']:.2f} | {r['prefill_ms']:.2f} | "
                 f"{r['decode_ms']:.2f} | {r['tokens_per_s']:.0f} | {sp} | {dsp} | {r['acceptance_length']:.2f} |")
    if req.get("prefill_split"):
        L += ["", "### Prefill passes", "", "The prefill of the fixed workload (`generate(max_new_tokens=1)`, overlapped "
              "loop): its batched passes (rows x chunk length), their captured graphs replayed alone (device time), "
              "against the call's wall time; eager: the same prefill without CUDA graphs.", "", prov, "",
              *table_head("batch", "k", "passes (B x T)", "wall ms", "device ms", "device / wall", "eager wall ms",
                          text=("passes (B x T)",))]
        for r in req["prefill_split"]:
            passes = ", ".join(f"{B}x{T}" for B, T in r["passes"])
            eager = f"{r['eager_prefill_ms']:.2f}" if r.get("eager_prefill_ms") else "-"
            L.append(f"| {r['batch']} | {r['k']} | {passes} | {r['wall_ms']:.2f} | {r['device_ms']:.2f} | "
                     f"{r['device_ms'] / r['wall_ms']:.0%} | {eager} |")
    w = req["serving_workload"]
    srows = [dict(r, engine="this tree") for r in req["serving"]]
    srows += [dict(r, engine=f"baseline {base['commit']}") for r in (base or {}).get("serving", [])]
    splain = {(r["engine"], r["loop"]): r for r in srows if r["k"] == 0}
    lens, outs = w["prompt_lengths"], w["output_lengths"]
    L += ["", "### Serving-like workload", "", f"{w['requests']} requests submitted at once (one `generate` call, one "
          f"max_new_tokens per request) to an engine with max_batch_size {w['max_batch_size']}: prompt lengths "
          f"{min(lens)}..{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}; drawn uniformly from {w['prompt_range'][0]} "
          f"to the lower of {w['prompt_range'][1]} and the model's maximum length {w['model_max_len']} less the longest "
          f"output), windows of the held-out prompts; outputs {min(outs)}..{max(outs)} tokens (mean "
          f"{sum(outs) / len(outs):.0f}). requests/s and output tokens/s over the call's wall time; TPOT: per request, "
          "(time its last token was booked - its first) / (outputs - 1), averaged; TTFT: its first token's time from "
          "the call's start, averaged. Best of the timed runs after a warm-up run.", "", prov, "",
          *table_head("engine", "loop", "k", "requests/s", "output tokens/s", "speedup vs k=0", "mean TPOT ms",
                      "mean TTFT ms", "acceptance length", text=("engine", "loop"))]
    for r in srows:
        b = splain.get((r["engine"], r["loop"]))
        sp = f"{r['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x" if b else "-"
        L.append(f"| {r['engine']} | {r['loop']} | {r['k']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
                 f"{sp} | {r['mean_tpot_ms']:.3f} | {r['mean_ttft_ms']:.1f} | {r['acceptance_length']:.2f} |")
    if req.get("steady"):
        bsteady = {(r["batch"], r["k"]): r.get("steady_ms_per_cycle") for r in (base or {}).get("fixed", [])}
        L += ["", "### Host time per steady cycle", "", "device = the captured cycle of the batch replayed alone (at "
              "the prompt's end); wall = per steady cycle (every sequence of the batch running), from one cycle's "
              "result on the host to the next; host = the loop's own time per cycle outside the wait (launch, and "
              "booking the result). The synchronous loop waits for each cycle before it books it and launches the "
              "next; the overlapped loop launches the next cycle first. Host share = (wall - device) / wall.",
              "", prov, "",
              *table_head("batch", "k", "device ms", "sync wall ms", "sync host ms", "sync host share",
                          "overlap wall ms", "overlap host ms", "overlap host share", "overlap wall / device",
                          "baseline wall ms", "baseline host share")]

        def f(x, fmt=".3f"):
            return "-" if x is None else format(x, fmt)

        def share(wall, d):
            return None if wall is None else (wall - d) / wall

        for r in req["steady"]:
            d = r["device_ms"]
            sync, over, bw = r.get("sync_ms_per_cycle"), r.get("overlap_ms_per_cycle"), bsteady.get((r["batch"], r["k"]))
            L.append(f"| {r['batch']} | {r['k']} | {d:.3f} | {f(sync)} | {f(r.get('sync_host_ms_per_cycle'))} | "
                     f"{f(share(sync, d), '.0%')} | {f(over)} | {f(r.get('overlap_host_ms_per_cycle'))} | "
                     f"{f(share(over, d), '.0%')} | {f(over / d if over else None, '.2f')} | {f(bw)} | "
                     f"{f(share(bw, d), '.0%')} |")
    return L + ["", "![whole-request speedup](engine_requests.png)", ""]


def write_markdown(res: dict, path: Path) -> None:
    L = ["# Engine benchmarks", "",
         f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}; date {res['date']}; commit {res['commit']}",
         "", f"Command: `{res['command']}` (writes engine.json, this page and its plots).", "",
         f"Measured device-to-device copy bandwidth (bytes read + written): {res['copy_gbps']:.0f} GB/s; floors "
         "below = bytes that must be read / that bandwidth.", ""]
    runs = res.get("section_runs", {})
    if runs:
        L += ["Sections measured by separate runs (the line above is the last run's):", ""]
        L += [f"- {name}: {r['date']}, commit {r['commit']}, `{r['command']}`, copy bandwidth {r['copy_gbps']:.0f} GB/s"
              for name, r in sorted(runs.items())] + [""]
    for note in res.get("notes", []):
        L += [f"Note: {note}", ""]
    L += ["Every table below times a warmed-up engine. What the first use costs (kernel builds from an empty "
          "or a warm Triton cache, the build record, graph capture; the README command cold and warm against "
          "the reference) is measured by `benchmarks/setup_cost.py`, and its tables are in "
          "[whole_requests.md](whole_requests.md#first-run-of-the-readme-command).", ""]
    demo = res.get("demo")
    if demo:
        e2e = demo["end_to_end"]
        if any("steady_host_ms_per_cycle" in r for r in e2e):
            method = ("`generate` (prefill included: batched passes); decode tokens/s = the tokens after x_L over "
                      "generate's wall time less the prefill's (until the last prefill pass's result was on the "
                      "host); steady: the tokens of the cycles that ran all B sequences (before any finished) over "
                      "the wall time from the first such cycle's result on the host to the last one's, with the "
                      "mean wall time per cycle and tokens per sequence per cycle (L). ")
        else:
            method = ("`generate` (prefill included: eager, one sequence after the other); decode tokens/s = the "
                      "tokens the cycles produced over the wall time spent in them (graph replay + the one host copy "
                      "per cycle); steady: the same over the cycles that ran all B sequences (before any finished), "
                      "with their mean wall time per cycle and tokens per sequence per cycle (L). ")
        L += ["## Demo checkpoint, end to end", "",
              f"bf16, {demo['prompt_len']}-token held-out prompts, {demo['new_tokens']} new tokens per sequence "
              "(ref_gpu: fewer), greedy. tokens/s counts the whole batch's new tokens over the wall time of "
              + method + "Speedups: over the same engine's plain decoding (k = 0) at the same batch.", "",
              provenance_line(res, "demo"), "",
              *table_head("engine", "batch", "k", "tokens/s", "speedup vs k=0", "decode tokens/s", "decode speedup",
                          "steady tokens/s", "steady speedup", "steady ms/cycle", "steady L", "acceptance length",
                          "cycles", text=("engine",))]
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
              "accept+commit = cycle - draft - verify.", "", provenance_line(res, "demo"), "",
              *table_head("batch", "k", "context", "cycle ms", "draft ms", "verify ms", "accept ms",
                          "accept+commit ms")]
        for r in demo["cycle_split"]:
            L.append(f"| {r['batch']} | {r['k']} | {r['context']} | {r['cycle_ms']:.3f} | {r['draft_ms']:.3f} | "
                     f"{r['verify_ms']:.3f} | {r['accept_ms']:.3f} | {r['accept_commit_ms']:.3f} |")
        L.append("")
    if res.get("requests"):
        L += requests_markdown(res)
    head = res.get("mtp_head")
    if head:
        L += ["## True-size MTP head (Inkling-Small width, random bf16 weights)", "",
              f"Context {head['context']} tokens in every depth cache. One depth step = depth 0 (sliding) over "
              "`rows` rows per sequence + the greedy argmax of the last row over the shared 201024 x 4096 LM head "
              "(the LM head reads 1.6 GB: at small batch it dominates). Floor = depth weights + LM head + KV rows "
              "read + activations, over the copy bandwidth.", "", provenance_line(res, "head"), "",
              *table_head("batch", "rows", "ms", "floor ms", "x floor")]
        for r in head["depth_step"]:
            L.append(f"| {r['batch']} | {r['rows']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['ms'] / r['floor_ms']:.2f} |")
        L += ["", f"The {max(r['k'] for r in head['chain'])}-depth draft chain (`Engine.draft`: depths 0..7 over the "
              "k+1-row window, drafts fed forward on the device) as one CUDA graph, after a cycle whose acceptance "
              "was forced to a. Busy = kernel time / wall span of one replay from the profiler (1 - busy = launch "
              "gaps).", "", provenance_line(res, "head"), "",
              *table_head("batch", "a", "graph ms", "eager ms", "8 x one step ms", "floor ms", "graph x floor", "busy")]
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
              "LM head: N = B*T rows, argmax kernel vs logits GEMM.", "", provenance_line(res, "layers"), ""]
        kinds = [k for k in ("sliding_moe", "global_moe", "sliding_dense") if any(r["kind"] == k for r in lay["rows"])]
        Ts = sorted({r["T"] for r in lay["rows"] if r["kind"] in kinds})
        L += table_head("kind", "batch", *(f"T={t} ms" for t in Ts), text=("kind",))
        for kind in kinds:
            for B in sorted({r["batch"] for r in lay["rows"] if r["kind"] == kind}):
                cells = [next((f"{r['ms']:.3f}" for r in lay["rows"] if r["kind"] == kind and r["batch"] == B
                               and r["T"] == t), "-") for t in Ts]
                L.append(f"| {kind} | {B} | " + " | ".join(cells) + " |")
        L += ["", provenance_line(res, "layers"), "", *table_head("LM head rows N", "argmax ms", "logits ms")]
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
    req = res.get("requests")
    if req:
        fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
        base = req.get("baseline") or {}
        for rows, style, name in ((req["fixed"], "o-", "this tree"), (base.get("fixed", []), "s--", "baseline")):
            rows = [r for r in rows if r["loop"] in ("overlap", "baseline")]
            for B in sorted({r["batch"] for r in rows}):
                rs = sorted((r for r in rows if r["batch"] == B), key=lambda r: r["k"])
                ax[0].plot([r["k"] for r in rs], [rs[0]["whole_ms"] / r["whole_ms"] for r in rs], style,
                           label=f"{name}, batch {B}")
        ax[0].set(xlabel="k (drafts per cycle)", ylabel="whole-request speedup over k = 0",
                  title=f"{req['prompt_len']}-token prompts, {req['new_tokens']} new tokens")
        ax[0].axhline(1, color="gray", lw=0.8)
        ax[0].legend(fontsize=6)
        for rows, style, name in ((req["serving"], "o-", "this tree"), (base.get("serving", []), "s--", "baseline")):
            rows = sorted((r for r in rows if r["loop"] in ("overlap", "baseline")), key=lambda r: r["k"])
            if rows:
                ax[1].plot([r["k"] for r in rows], [r["output_tokens_per_s"] for r in rows], style, label=name)
        ax[1].set(xlabel="k", ylabel="output tokens/s", title="serving-like workload")
        ax[1].legend(fontsize=7)
        save(fig, folder / "engine_requests.png")
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
    out_dir = arg_value("--out")
    options = {"--out", "--baseline-src", "--json-out"}
    values = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in options}
    names = [a for a in argv if not a.startswith("--") and a not in values]
    if "--report" in argv:
        src = Path(out_dir) / "engine.json" if out_dir else OUT_JSON
        res = json.loads(src.read_text())
        write_markdown(res, src.parent / "engine.md")
        plots(res, src.parent)
        log(f"wrote {src.parent / 'engine.md'} and its plots from {src}")
        return
    if DEV != "cuda" and not DRY:
        raise SystemExit("engine benchmarks need a CUDA GPU (or --dry on CPU)")
    if "--as-baseline" in argv:                       # the subprocess of --baseline-src: one section, JSON only
        Path(arg_value("--json-out")).write_text(json.dumps(requests_workloads(), indent=1))
        return
    sections = {"demo": run_demo, "requests": run_requests, "head": run_head, "layers": run_layers}
    bad = [n for n in names if n not in sections]
    if bad:
        raise SystemExit(f"unknown sections {bad}; choose from {list(sections)}")
    baseline = arg_value("--baseline-src")
    if baseline and not (Path(baseline) / "inkling_fast" / "engine.py").exists():
        raise SystemExit(f"--baseline-src {baseline}: no inkling_fast/engine.py there (give a checkout's root)")
    if DRY:
        out = Path(out_dir or os.environ.get("TMPDIR", "/tmp")) / ("engine.json" if out_dir else "engine_dry.json")
    else:
        out = Path(out_dir) / "engine.json" if out_dir else OUT_JSON
    start = out if out.exists() else OUT_JSON if out_dir and not DRY else out
    res = json.loads(start.read_text()) if start.exists() and names else {}
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
        res.setdefault("section_runs", {})[name] = {k: res[k] for k in ("gpu", "date", "commit", "command", "copy_gbps")}
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
