"""Benchmark of greedy selection from the LM head without writing logits (`lm_head_argmax`, bf16) against
the obvious torch path `logits = h @ W[:V_out].T; argmax` (a cuBLAS GEMM writing bf16 logits, then
torch.argmax), at the real vocabulary (V = 201024 rows, V_out = 200058) and the hidden sizes of
Inkling-Small (H 4096) and Inkling (H 6144), T = 1..64 token rows (draft and verify windows).

    python benchmarks/kernels.py lm_head          # GPU: times, writes docs/benchmarks/kernels.md
    python benchmarks/bench_lm_head.py --dry      # CPU: tiny sizes through the interpreter, no timing
    INKLING_BENCH_DRY=1 python benchmarks/bench_lm_head.py    # the same

Floor bytes: W[:V_out] read once (V_out * H * 2) + h (T * H * 2) + ids and values (T * 12); the
arithmetic (2 * T * V_out * H, <= 0.16 PFLOP at T = 64) stays far under the time of those bytes.
Both paths are timed as CUDA-graph replays (harness.bench_graph); W (1.6 / 2.5 GB) is far larger than
the L2, so every call reads it from memory. The 'torch twin' column is the GEMM + argmax path.
Design goals: >= 85% of the floor at T = 1, faster than GEMM + argmax at every T.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax, lm_head_argmax_torch  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402

SECTION = "LM-head argmax without logits vs GEMM + argmax (bf16, V = 201024, V_out = 200058)"
V, V_OUT = 201024, 200058
WIDTHS = {"Inkling-Small": 4096, "Inkling": 6144}
TOKENS = (1, 2, 4, 8, 16, 32, 64)
MUP = 16.0
E = 2  # bytes per bf16


def floor_bytes(T: int, H: int, V_out: int) -> int:
    return V_out * H * E + T * H * E + T * (8 + 4)     # W[:V_out], h, ids (int64) + values (fp32)


def gemm_argmax(h: torch.Tensor, W: torch.Tensor, V_out: int) -> torch.Tensor:
    """The obvious path: full bf16 logits [T, V_out] in memory, then argmax."""
    return torch.argmax(h @ W[:V_out].T, dim=-1)


def check(h: torch.Tensor, W: torch.Tensor, V_out: int) -> int:
    """The kernel's ids are an argmax of the float32 logits (up to float32 rounding at near ties) and
    its values match the twin's; returns in how many rows GEMM + argmax (bf16 logits) picked another id."""
    ids, vals = lm_head_argmax(h, W, V_out, MUP)
    twin_ids, twin_vals = lm_head_argmax_torch(h, W, V_out, MUP)
    got = (h.float() * W[ids].float()).sum(-1)                        # the kernel's winners' logits
    tol = 1e-5 * h.float().norm(dim=1) * W[:V_out].float().norm(dim=1).max()
    if not ((got >= twin_vals * MUP - tol).all() and (ids < V_out).all()):
        raise RuntimeError(f"lm_head_argmax picked a non-maximal id: {ids.tolist()} vs {twin_ids.tolist()}")
    err = rel_l2(vals, twin_vals)
    if not err <= 1e-5:
        raise RuntimeError(f"lm_head_argmax values differ from the twin: relative L2 {err:.2e}")
    return int((gemm_argmax(h, W, V_out) != ids).sum())


def weights(V: int, H: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(H)
    return (torch.randn(V, H, device=device, generator=g) * H ** -0.5).bfloat16()


def measure(model: str, H: int, W: torch.Tensor, T: int) -> harness.Row:
    """One case: T rows of width H against the LM head W, checked, then both paths timed."""
    nbytes = floor_bytes(T, H, V_OUT)
    sets = harness.rotating_inputs(lambda: (torch.randn(T, H, device="cuda").bfloat16(), W), nbytes)
    differ = check(*sets[0], V_OUT)
    ms = harness.bench_graph(lambda h, w: lm_head_argmax(h, w, V_OUT, MUP), sets)
    ms_torch = harness.bench_graph(lambda h, w: gemm_argmax(h, w, V_OUT), sets)
    note = "graph replay; twin column = GEMM + argmax"
    if differ:
        note += f"; bf16 logits changed the argmax of {differ}/{T} rows"
    row = harness.Row("lm_head_argmax", f"{model} H={H} T={T}", nbytes, ms, ms_torch, note)
    print(f"  {row.case:<28} {ms * 1e3:8.1f} us   GEMM+argmax {ms_torch * 1e3:8.1f} us", flush=True)
    return row


def run(ctx: harness.Context) -> list[harness.Row]:
    return harness.per_model(WIDTHS, lambda H: weights(V, H, "cuda"), TOKENS, measure)


def dry_run() -> None:
    """Tiny sizes (on CPU through the interpreter): build every kind of case and check the kernel, no timing."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for H, V_, V_out in ((64, 300, 290), (96, 257, 200)):
        W = weights(V_, H, device)
        for T in (1, 5, 17):
            h = torch.randn(T, H, device=device).bfloat16()
            differ = check(h, W, V_out)
            print(f"dry  lm_head_argmax H={H} V_out={V_out} T={T}: bytes {floor_bytes(T, H, V_out):,}, "
                  f"GEMM+argmax differs in {differ} rows")


if __name__ == "__main__":
    harness.main("lm_head", dry_run)
