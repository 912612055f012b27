"""Benchmark of the small-batch MoE layer (`moe`: device router + per-expert fused SwiGLU kernels, bf16)
against a straightforward grouped torch implementation (`moe_torch`: the same router in torch, then one
pass per touched expert over its tokens) and against the floor of the distinct experts' bytes, at
256 routed experts, top-6, 2 shared, route_scale 8, for the expert widths of Inkling-Small (H 4096,
Fm 2048) and Inkling (H 6144, Fm 3072), N = 1..64 tokens, realistic routing from a random router.

    python benchmarks/kernels.py moe              # GPU: times, writes docs/benchmarks/kernels.md
    python benchmarks/bench_moe.py --dry          # CPU: tiny sizes through the interpreter, no timing
    INKLING_BENCH_DRY=1 python benchmarks/bench_moe.py       # the same

Floor bytes (per input set, averaged over the rotated sets):
    (D + S) * 3 * Fm * H * 2     the distinct touched experts' W13 [2Fm, H] and W2 [H, Fm], bf16
  + (R + S) * H * 2 + R * 4      router weight (bf16) and selection bias (fp32)
  + 2 * N * H * 2                x in, out written
with D = the number of distinct routed experts the set's tokens select (about 256 * (1 - (1 - 6/256)^N):
6 at N = 1, 23 at N = 4, 199 at N = 64). The kernel is timed as CUDA-graph replays (the engine captures
it); the grouped torch path synchronizes with the host (it lists the touched experts), so it is timed
directly. Design goal: within 1.5x of the floor (>= 67% of copy bandwidth) at N >= 4.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from inkling_fast.kernels.moe import moe, moe_experts_torch, moe_torch  # noqa: E402
from inkling_fast.kernels.moe_router import moe_route, moe_route_torch  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402

SECTION = "Small-batch MoE vs grouped torch and the distinct-expert floor (bf16, 256 experts top-6 + 2 shared)"
WIDTHS = {"Inkling-Small": (4096, 2048), "Inkling": (6144, 3072)}
TOKENS = (1, 2, 4, 8, 16, 32, 64)
R, K, S, ROUTE_SCALE = 256, 6, 2, 8.0
E = 2  # bytes per bf16


def layer(H: int, F: int, R: int, S: int, top_k: int, device: str):
    """Random bf16 weights (drawn on the device, slice by slice), a router whose logits have a spread
    like a trained one's (std ~2) and a small selection bias (std 0.005), so that N tokens touch about as
    many distinct experts as uniform top-6 routing, as a load-balanced trained router does (a large
    bias, e.g. std 0.2, would dominate the saturated sigmoid scores and send the tokens to a few
    experts, a much smaller floor); in the order `moe` takes them."""
    g = torch.Generator(device=device).manual_seed(H + F)

    def r(*shape, std):
        return (torch.randn(*shape, device=device, generator=g) * std).bfloat16()

    w13 = torch.empty(R, 2 * F, H, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(R, H, F, dtype=torch.bfloat16, device=device)
    for e in range(0, R, 16):
        w13[e: e + 16] = r(min(16, R - e), 2 * F, H, std=H ** -0.5)
        w2[e: e + 16] = r(min(16, R - e), H, F, std=F ** -0.5)
    router = r(R + S, H, std=2.0 / H ** 0.5)
    bias = torch.randn(R, device=device, generator=g) * 0.005
    scale = torch.tensor([1.3], device=device)
    return (router, bias, scale, ROUTE_SCALE, top_k, w13, w2,
            r(S, 2 * F, H, std=H ** -0.5), r(S, H, F, std=F ** -0.5))


def floor_bytes(x: torch.Tensor, lyr) -> tuple[int, int]:
    """(floor bytes, distinct routed experts) of one input set; routing from the torch router."""
    router, bias, scale, route_scale, top_k, w13 = lyr[:6]
    N, H = x.shape
    Rr, F2 = w13.shape[0], w13.shape[1]
    S_ = router.shape[0] - Rr
    D = int(torch.unique(moe_route_torch(x, router, bias, scale, route_scale, top_k)[0]).numel())
    return (D + S_) * 3 * (F2 // 2) * H * E + (Rr + S_) * H * E + Rr * 4 + 2 * N * H * E, D


def check(x: torch.Tensor, lyr) -> float:
    """The kernel against the grouped torch experts on the kernel's own routing (so a near tie of the
    k-th router score cannot make the two pick different experts); returns the relative L2 error."""
    y = moe(x, *lyr)
    chosen, weights = moe_route(x, *lyr[:5])
    want = moe_experts_torch(x, chosen.long(), weights, *lyr[5:])
    err = rel_l2(y, want)
    if not err <= 1e-2:
        raise RuntimeError(f"moe and the grouped torch experts disagree: relative L2 {err:.2e}")
    return err


def measure(ctx: harness.Context, model: str, widths: tuple[int, int], lyr, N: int) -> harness.Row:
    """One case: N tokens through the layer `lyr` of expert widths (H, Fm), checked, then both paths timed."""
    H, F = widths
    # each set reads >= 3 experts (~150-340 MB): 2 sets already exceed the L2 many times over
    sets = harness.rotating_inputs(lambda: (torch.randn(N, H, device="cuda").bfloat16(),),
                                   (S + 1) * 3 * F * H * E)
    floors = [floor_bytes(s[0], lyr) for s in sets]
    nbytes = sum(f for f, _ in floors) // len(floors)
    d_mean = sum(d for _, d in floors) / len(floors)
    err = check(sets[0][0], lyr)
    ms = harness.bench_graph(lambda x: moe(x, *lyr), sets)
    ms_torch = harness.bench(lambda x: moe_torch(x, *lyr), sets)
    note = (f"{d_mean:.1f} routed + {S} shared experts; kernel graph replay, grouped torch direct "
            f"(host sync); rel L2 {err:.1e}")
    row = harness.Row("moe", f"{model} H={H} Fm={F} N={N}", nbytes, ms, ms_torch, note)
    floor_us = nbytes / (ctx.copy_gbps * 1e9) * 1e6
    print(f"  {row.case:<34} {ms * 1e3:9.1f} us  floor {floor_us:9.1f} us  grouped torch "
          f"{ms_torch * 1e3:9.1f} us", flush=True)
    return row


def run(ctx: harness.Context) -> list[harness.Row]:
    return harness.per_model(WIDTHS, lambda widths: layer(*widths, R, S, K, "cuda"), TOKENS, partial(measure, ctx))


def dry_run() -> None:
    """Tiny sizes (H 64, Fm 32, 16 experts top-3 + 2 shared; on CPU through the interpreter): build the
    cases and check the kernel against the grouped torch path, no timing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lyr = layer(64, 32, 16, 2, 3, device)
    for N in (1, 5):
        x = torch.randn(N, 64, device=device).bfloat16()
        nbytes, D = floor_bytes(x, lyr)
        err = check(x, lyr)
        ref = moe_torch(x, *lyr)
        print(f"dry  moe H=64 Fm=32 N={N}: {D} routed experts touched, bytes {nbytes:,}, rel L2 {err:.1e}, "
              f"grouped torch ran ({tuple(ref.shape)})")


if __name__ == "__main__":
    harness.main("moe", dry_run)
