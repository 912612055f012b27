"""Benchmark of the many-token paths against the few-token kernels, bf16, CUDA-graph replays:

  MoE      `moe` over chunks of 256 tokens (as forward.mlp_forward ran it before the grouped path) vs
           `moe_grouped`, N = 1 .. 7680 tokens, at the demo checkpoint's MoE sizes (H 256, Fm 96,
           8 experts top-2 + 1 shared) and Inkling-Small's (H 4096, Fm 2048, 256 experts top-6 + 2
           shared), routing from a random router drawn like a trained, load-balanced one
           (benchmarks/true_scale.py). Floor: the bytes of the distinct experts the tokens select plus
           the shared ones, each read once, + router + x in and out, at the measured copy bandwidth.
  LM head  greedy selection at Inkling-Small's LM head (V 201024, V_out 200058, H 4096), T = 1 .. 1024
           rows: `lm_head_argmax` (few rows), `lm_head_rows` (many rows), GEMM + argmax with bf16
           logits and with float32 logits (cuBLAS, when torch.mm takes out_dtype), and the plain
           logits GEMM `F.linear(h / mup, W)[:, :V_out]` (what benchmarks/engine.py times as the
           LM head's logits).

    python benchmarks/bench_many_tokens.py --out $OUT/many_tokens.json   # GPU: everything; prints the
                                                                         # crossovers and the targets
    python benchmarks/kernels.py many_tokens        # GPU: the same tables into docs/benchmarks/kernels.md
    python benchmarks/bench_many_tokens.py --dry    # CPU: tiny sizes through the interpreter, checks only

Every case is checked before it is timed: `moe_grouped` against its twin on the kernel's own routing
(and against the chunked `moe`), the LM-head paths' ids against the float32 logits (an argmax up to a
float32 near tie) and their values against the twin. Input sets are rotated (harness.rotating_inputs);
times are medians of graph replays (harness.bench_graph). Targets: Inkling-Small MoE over 576 tokens
<= 1.5x its expert-bytes floor; LM head over 576 rows <= 1.1x the logits GEMM.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import torch

DRY = "--dry" in sys.argv[1:] or os.environ.get("INKLING_BENCH_DRY", "0") not in ("", "0")
if DRY or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import harness  # noqa: E402
import true_scale  # noqa: E402
from bench_moe import floor_bytes as moe_floor_bytes  # noqa: E402
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_torch  # noqa: E402
from inkling_fast.kernels.lm_head_rows import lm_head_rows  # noqa: E402
from inkling_fast.kernels.moe import MAX_TOKENS, moe  # noqa: E402
from inkling_fast.kernels.moe_grouped import block_m_for, moe_grouped, moe_grouped_experts_torch  # noqa: E402
from inkling_fast.kernels.moe_router import moe_route  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402

SECTION = "Many tokens: grouped MoE vs the few-token MoE, LM head for many rows (bf16, graph replays)"
MOE_SIZES = {"demo": dict(hidden_size=256, moe_intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=1, route_scale=2.0),
             "Inkling-Small": {}}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 576, 1024, 4096, 7680)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 576, 1024)
V, V_OUT, H_HEAD, MUP = 201024, 200058, 4096, 16.0
E = 2  # bytes per bf16
TARGET_MOE, TARGET_HEAD = 1.5, 1.1
DRY_SIZES = dict(MOE_SIZES={"tiny": dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16,
                                         num_experts_per_tok=3, n_shared_experts=2, route_scale=2.0)},
                 TOKENS=(3, 40), ROWS=(3, 70), V=300, V_OUT=290, H_HEAD=64)


# ----------------------------------------------------------------------------- MoE
def moe_layer(changes: dict, device: str):
    """Random bf16 MoE weights (true_scale.random_moe: realistic routing), in the order `moe` takes them."""
    w = true_scale.random_moe(true_scale.inkling_small(**changes), true_scale._Draw(device, torch.bfloat16, 7))
    return (w.router, w.router_bias, w.gate_global_scale, w.route_scale, w.top_k, w.w13, w.w2, w.shared_w13,
            w.shared_w2)


def moe_chunked(x: torch.Tensor, lyr, out: torch.Tensor) -> torch.Tensor:
    """The few-token kernels over chunks of at most 256 tokens (their limit)."""
    for c0 in range(0, x.shape[0], MAX_TOKENS):
        moe(x[c0: c0 + MAX_TOKENS], *lyr, out=out[c0: c0 + MAX_TOKENS])
    return out


def check_moe(x: torch.Tensor, lyr) -> tuple[float, float]:
    """(rel L2 of moe_grouped vs its twin on the kernel's routing, vs the chunked few-token kernels)."""
    y = moe_grouped(x, *lyr)
    chosen, weights = moe_route(x, *lyr[:5])
    twin = moe_grouped_experts_torch(x, chosen.long(), weights, *lyr[5:])
    few = moe_chunked(x, lyr, torch.empty_like(x))
    err = rel_l2(y, twin), rel_l2(y, few)
    if not max(err) <= 1e-2:
        raise RuntimeError(f"moe_grouped N={x.shape[0]}: relative L2 {err[0]:.2e} vs twin, {err[1]:.2e} vs moe")
    return err


def measure_moe(ctx: harness.Context, device: str, timed: bool, model: str, changes: dict, lyr, N: int) -> dict:
    """One MoE case: N tokens through the layer `lyr` (of the sizes `changes` gives), checked, then both
    paths timed when `timed`."""
    H, F = lyr[5].shape[2], lyr[6].shape[2]
    R, K, S = lyr[5].shape[0], lyr[4], lyr[7].shape[0]
    sets = harness.rotating_inputs(lambda: (torch.randn(N, H, device=device).bfloat16(),),
                                   (S + min(R, N * K)) * 3 * F * H * E)
    floors = [moe_floor_bytes(s[0], lyr) for s in sets]
    nbytes = sum(f for f, _ in floors) // len(floors)
    distinct = sum(d for _, d in floors) / len(floors)
    err_twin, err_few = check_moe(sets[0][0], lyr)
    r = dict(model=model, H=H, F=F, R=R, top_k=K, S=S, N=N, block_m=block_m_for(N, K, R),
             distinct_experts=distinct, floor_bytes=nbytes, rel_l2_twin=err_twin, rel_l2_moe=err_few)
    if timed:
        r["ms_moe"] = harness.bench_graph(lambda x: moe_chunked(x, lyr, torch.empty_like(x)), sets)
        r["ms_grouped"] = harness.bench_graph(lambda x: moe_grouped(x, *lyr), sets)
        r["ms_floor"] = nbytes / (ctx.copy_gbps * 1e9) * 1e3
        print(f"  MoE {model:<13} N={N:<5} moe {r['ms_moe'] * 1e3:9.1f} us  grouped "
              f"{r['ms_grouped'] * 1e3:9.1f} us"
              f"  floor {r['ms_floor'] * 1e3:9.1f} us  ({distinct:.1f} routed experts, BLOCK_M {r['block_m']})",
              flush=True)
    else:
        print(f"dry  MoE {model} N={N}: {distinct:.1f} routed experts, floor bytes {nbytes:,}, rel L2 "
              f"{err_twin:.1e} vs twin, {err_few:.1e} vs moe", flush=True)
    return r


def run_moe(ctx: harness.Context, device: str, timed: bool) -> list[dict]:
    return harness.per_model(MOE_SIZES, lambda changes: moe_layer(changes, device), TOKENS,
                             partial(measure_moe, ctx, device, timed))


# ----------------------------------------------------------------------------- LM head
def mm_fp32_available(device: str) -> bool:
    """Whether torch.mm takes out_dtype=float32 for bf16 operands here (cuBLAS, float32 logits)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def logits_gemm(h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(h / MUP, W)[:, :V_OUT]


def gemm_argmax_bf16(h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.argmax(torch.nn.functional.linear(h, W)[:, :V_OUT], dim=-1)


def gemm_argmax_fp32(h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return torch.argmax(torch.mm(h, W.T, out_dtype=torch.float32)[:, :V_OUT], dim=-1)


def check_head(h: torch.Tensor, W: torch.Tensor, w_norm: float, fp32: bool) -> dict:
    """lm_head_rows and lm_head_argmax pick an argmax of the float32 logits (up to a float32 near tie) with
    the twin's values; returns in how many rows each other path picked another id than lm_head_rows."""
    ids, vals = lm_head_rows(h, W, V_OUT, MUP)
    twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_OUT, MUP)
    got = (h.float() * W[ids].float()).sum(-1)                            # the winners' float32 logits
    tol = 1e-5 * h.float().norm(dim=1) * w_norm                          # w_norm: the largest row norm of W[:V_out]
    if not ((got >= twin_vals * MUP - tol).all() and (ids < V_OUT).all()):
        raise RuntimeError("lm_head_rows picked a non-maximal id")
    if not rel_l2(vals, twin_vals) <= 1e-5:
        raise RuntimeError("lm_head_rows values differ from the twin")
    few_ids = lm_head_argmax(h, W, V_OUT, MUP)[0]
    differ = dict(twin=int((ids != twin_ids).sum()), lm_head_argmax=int((ids != few_ids).sum()),
                  gemm_argmax_bf16=int((ids != gemm_argmax_bf16(h, W)).sum()))
    if fp32:
        differ["gemm_argmax_fp32"] = int((ids != gemm_argmax_fp32(h, W)).sum())
    if differ["twin"] > max(1, h.shape[0] // 256) or differ["lm_head_argmax"] > max(1, h.shape[0] // 256):
        raise RuntimeError(f"lm_head_rows differs from the twin / lm_head_argmax in too many rows: {differ}")
    return differ


def run_head(ctx: harness.Context, device: str, timed: bool) -> list[dict]:
    W = true_scale._Draw(device, torch.bfloat16, 9).normal(V, H_HEAD, std=H_HEAD ** -0.5)
    fp32 = mm_fp32_available(device)
    w_norm = max(W[v0: min(v0 + 16384, V_OUT)].float().norm(dim=1).max().item() for v0 in range(0, V_OUT, 16384))
    rows = []
    for T in ROWS:
        nbytes = V_OUT * H_HEAD * E + T * H_HEAD * E + T * 12
        sets = harness.rotating_inputs(lambda: (torch.randn(T, H_HEAD, device=device).bfloat16(), W), nbytes)
        r = dict(T=T, H=H_HEAD, V=V, V_out=V_OUT, floor_bytes=nbytes, ids_differ=check_head(*sets[0], w_norm, fp32))
        if timed:
            r["ms_lm_head_argmax"] = harness.bench_graph(lambda h, w: lm_head_argmax(h, w, V_OUT, MUP), sets)
            r["ms_lm_head_rows"] = harness.bench_graph(lambda h, w: lm_head_rows(h, w, V_OUT, MUP), sets)
            r["ms_logits_gemm"] = harness.bench_graph(logits_gemm, sets)
            r["ms_gemm_argmax_bf16"] = harness.bench_graph(gemm_argmax_bf16, sets)
            if fp32:
                r["ms_gemm_argmax_fp32"] = harness.bench_graph(gemm_argmax_fp32, sets)
            r["ms_floor"] = nbytes / (ctx.copy_gbps * 1e9) * 1e3
            print(f"  LM head T={T:<5} argmax {r['ms_lm_head_argmax'] * 1e3:8.1f} us  rows "
                  f"{r['ms_lm_head_rows'] * 1e3:8.1f} us  logits GEMM {r['ms_logits_gemm'] * 1e3:8.1f} us  "
                  f"GEMM+argmax bf16 "
                  f"{r['ms_gemm_argmax_bf16'] * 1e3:8.1f} us  fp32 "
                  f"{r.get('ms_gemm_argmax_fp32', float('nan')) * 1e3:8.1f} us  ids differ {r['ids_differ']}",
                  flush=True)
        else:
            print(f"dry  LM head T={T}: bytes {nbytes:,}, ids differ from lm_head_rows {r['ids_differ']}", flush=True)
        rows.append(r)
        del sets
    del W
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- summary
def crossover(rows: list[dict], n_key: str, few: str, many: str) -> int | None:
    """The smallest size from which on the many-token path is at least as fast at every larger size measured."""
    best = None
    for r in sorted(rows, key=lambda r: -r[n_key]):
        if r[many] <= r[few]:
            best = r[n_key]
        else:
            break
    return best


def summarize(res: dict) -> dict:
    out = dict(crossovers={}, targets={})
    for model in MOE_SIZES:
        rows = [r for r in res["moe"] if r["model"] == model]
        out["crossovers"][f"moe {model}"] = crossover(rows, "N", "ms_moe", "ms_grouped")
    out["crossovers"]["lm_head"] = crossover(res["lm_head"], "T", "ms_lm_head_argmax", "ms_lm_head_rows")
    r = next((r for r in res["moe"] if r["model"] == "Inkling-Small" and r["N"] == 576), None)
    if r:
        out["targets"]["moe Inkling-Small N=576 x floor"] = dict(value=r["ms_grouped"] / r["ms_floor"],
                                                                 target=TARGET_MOE)
    r = next((r for r in res["lm_head"] if r["T"] == 576), None)
    if r:
        out["targets"]["lm_head_rows T=576 x logits GEMM"] = dict(value=r["ms_lm_head_rows"] / r["ms_logits_gemm"],
                                                                  target=TARGET_HEAD)
        if "ms_gemm_argmax_fp32" in r:
            out["targets"]["GEMM fp32 + argmax T=576 x logits GEMM"] = dict(
                value=r["ms_gemm_argmax_fp32"] / r["ms_logits_gemm"], target=TARGET_HEAD)
    return out


def measure(ctx: harness.Context) -> dict:
    res = dict(gpu=ctx.device_name, torch=torch.__version__, commit=harness.git_commit(), copy_gbps=ctx.copy_gbps,
               command="python " + " ".join(["benchmarks/bench_many_tokens.py"] + sys.argv[1:]))
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    res["moe"] = run_moe(ctx, "cuda", timed=True) if only in (None, "moe") else []
    res["lm_head"] = run_head(ctx, "cuda", timed=True) if only in (None, "head") else []
    res.update(summarize(res))
    for name, n in res["crossovers"].items():
        print(f"crossover {name}: many-token path from {n if n is not None else 'never (within the sizes measured)'}")
    for name, t in res["targets"].items():
        met = "MET" if t["value"] <= t["target"] else "MISSED"
        print(f"target {name}: {t['value']:.2f} (target <= {t['target']}) {met}")
    return res


def run(ctx: harness.Context) -> list[harness.Row]:
    """For benchmarks/kernels.py: the grouped MoE (twin column = chunked `moe`) and lm_head_rows (twin
    column = `lm_head_argmax`), floors as above."""
    res = measure(ctx)
    rows = [harness.Row("moe_grouped", f"{r['model']} N={r['N']}", r["floor_bytes"], r["ms_grouped"], r["ms_moe"],
                        f"twin column = moe in chunks of 256; {r['distinct_experts']:.1f} routed experts; "
                        f"BLOCK_M {r['block_m']}") for r in res["moe"]]
    rows += [harness.Row("lm_head_rows", f"H={r['H']} T={r['T']}", r["floor_bytes"], r["ms_lm_head_rows"],
                         r["ms_lm_head_argmax"], f"twin column = lm_head_argmax; logits GEMM "
                         f"{r['ms_logits_gemm'] * 1e3:.1f} us") for r in res["lm_head"]]
    return rows


def dry_run() -> None:
    """Tiny sizes (on CPU through the interpreter): build every case and run its checks, no timing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = harness.Context(copy_gbps=float("nan"), device_name="dry run")
    saved = {name: globals()[name] for name in DRY_SIZES}
    globals().update(DRY_SIZES)
    try:
        run_moe(ctx, device, timed=False)
        run_head(ctx, device, timed=False)
    finally:
        globals().update(saved)


def main(argv: list[str]) -> None:
    """--out FILE: the JSON; --only moe|head: one of the two tables; --tokens / --rows 1,64,576: other sizes."""
    global TOKENS, ROWS
    for flag in ("--tokens", "--rows"):
        if flag in argv:
            sizes = tuple(int(x) for x in argv[argv.index(flag) + 1].split(","))
            TOKENS, ROWS = (sizes, ROWS) if flag == "--tokens" else (TOKENS, sizes)
    if DRY:
        dry_run()
        return
    if not torch.cuda.is_available():
        raise SystemExit("timing needs a CUDA GPU; `--dry` checks the cases on CPU")
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
    ctx = harness.Context(copy_gbps=harness.measure_copy_bandwidth(), device_name=torch.cuda.get_device_name())
    print(f"copy bandwidth {ctx.copy_gbps:.0f} GB/s on {ctx.device_name}", flush=True)
    res = measure(ctx)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
