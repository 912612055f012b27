"""Benchmark of SwiGLU on interleaved w13 output (bf16), with and without the fused global_scale, at the
dense MLP widths of Inkling-Small (F 16384) and Inkling (F 24576), against its torch twin.

    python benchmarks/kernels.py swiglu          # GPU: times, writes docs/benchmarks/kernels.md
    python benchmarks/bench_swiglu.py --dry      # CPU: small sizes through the interpreter, no timing

Byte floor: gu read N*2F*E + y written N*F*E (+ the scale, 2 bytes), E = 2 (bf16).
Rows <= 16 (decode) are timed through CUDA-graph replays; larger row counts are timed directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from harness import Case  # noqa: E402
from inkling_fast.kernels.swiglu import swiglu, swiglu_torch  # noqa: E402

SECTION = "SwiGLU on interleaved w13 output (bf16)"
E = 2
WIDTHS = {"Small": 16384, "Inkling": 24576}   # dense intermediate size F
ROWS = (1, 4, 16, 4096, 16384)
DECODE_ROWS = 16


def cases(device: str, widths=WIDTHS, rows=ROWS) -> list[Case]:
    dt = torch.bfloat16
    out = []
    for model, F in widths.items():
        for N in rows:
            for scaled in (False, True):
                label = f"{model} F={F} rows={N}" + (" x global_scale" if scaled else "")
                # gu N*2F*E + y N*F*E (+ scale 2 bytes)
                out.append(Case(
                    "swiglu", label, 3 * N * F * E + (E if scaled else 0),
                    make=lambda N=N, F=F, scaled=scaled: (
                        torch.randn(N, 2 * F, dtype=dt, device=device) * 2,
                        torch.tensor([0.8], dtype=dt, device=device) if scaled else None,
                        torch.empty(N, F, dtype=dt, device=device)),
                    fn=lambda gu, s, o: swiglu(gu, s, out=o),
                    twin=lambda gu, s, o: swiglu_torch(gu, s),
                    graph=N <= DECODE_ROWS))
    return out


def run(ctx: harness.Context) -> list[harness.Row]:
    return harness.run_cases(cases("cuda"))


def dry() -> None:
    """Every case at small sizes, checked against its twin (no timing)."""
    harness.dry_run(cases("cpu", widths={"tiny": 37, "wide": 1500}, rows=(1, 5)))


if __name__ == "__main__":
    harness.main("swiglu", dry)
