"""Benchmark of the short conv over the conv-input ring (bf16, K = 4) at the engine's shapes, against
its torch twin: the attention/MLP-output streams (C = H: 4096 Inkling-Small, 6144 Inkling) with the
fused residual add, on decode steps (B x 1), draft / verify windows of k + 1 rows with the engine's
ring of R = K + k rows (the conv kernel writes the ring), and a prefill chunk of 256 rows of one
sequence (T > R: outputs first, then the ring-write launch).

    python benchmarks/kernels.py short_conv          # GPU: times, writes docs/benchmarks/kernels.md
    python benchmarks/bench_short_conv.py --dry      # CPU: small sizes through the interpreter, no timing

Byte floor (E = 2 bytes per bf16 element; every row's history starts in the ring):
    x B*T*C*E + out B*T*C*E (+ residual B*T*C*E) + ring reads B*(K-1)*C*E + ring writes B*min(T, R)*C*E
    + weights C*K*E + pos 4*B*T + slot 4*B
Weights are tap-major ([C, K] views of contiguous [K, C] tensors), the layout `inkling_fast.weights`
gives the output convs. Every case is timed through CUDA-graph replays (device time: the wrapper's
host work would otherwise hide kernels of a few microseconds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from harness import Case  # noqa: E402
from inkling_fast.kernels.short_conv import short_conv, short_conv_torch  # noqa: E402

SECTION = "Short conv over the conv-input ring (bf16, K=4)"
E = 2
K = 4
STREAMS = {"Small H": (4096, True), "Inkling H": (6144, True)}           # (C, fused residual add)
# (B, T, R): decode steps (k = 0: R = K), windows of k + 1 = 5 and 9 rows (R = K + k), a prefill
# chunk of 256 rows (R = K + 4)
SHAPES = ((1, 1, 4), (32, 1, 4), (64, 1, 4), (1, 5, 8), (32, 5, 8), (64, 9, 12), (1, 256, 8))


def floor_bytes(B: int, T: int, R: int, C: int, residual: bool) -> int:
    rows = B * T * C * E
    return (rows * (3 if residual else 2) + B * (K - 1) * C * E + B * min(T, R) * C * E
            + C * K * E + 4 * B * T + 4 * B)


def cases(device: str, streams=STREAMS, shapes=SHAPES) -> list[Case]:
    dt = torch.bfloat16

    def make(B, T, R, C, residual):
        start = torch.randint(K - 1, 4096, (B, 1))
        pos = (start + torch.arange(T)).to(torch.int32).to(device)
        return (torch.randn(B, T, C, dtype=dt, device=device),
                torch.randn(B, R, C, dtype=dt, device=device),
                (0.5 * torch.randn(K, C, device=device)).to(dt).t(),  # [C, K] tap-major, as the engine stores it
                torch.randperm(B).to(torch.int32).to(device), pos,
                torch.randn(B, T, C, dtype=dt, device=device) if residual else None,
                torch.empty(B, T, C, dtype=dt, device=device))

    out = []
    for name, (C, residual) in streams.items():
        for B, T, R in shapes:
            label = f"{name} C={C} B={B} T={T} R={R}" + (" +residual" if residual else "")
            out.append(Case(
                "short_conv", label, floor_bytes(B, T, R, C, residual),
                make=lambda B=B, T=T, R=R, C=C, residual=residual: make(B, T, R, C, residual),
                fn=lambda x, ring, w, slot, pos, res, o: short_conv(x, ring, w, slot, pos, residual=res, out=o,
                                                                    check=False),
                twin=lambda x, ring, w, slot, pos, res, o: short_conv_torch(x, ring, w, slot, pos, residual=res),
                graph=True))
    return out


def run(ctx: harness.Context) -> list[harness.Row]:
    return harness.run_cases(cases("cuda"))


def dry() -> None:
    """Every case at small sizes, checked against its twin (no timing)."""
    harness.dry_run(cases("cpu", streams={"tiny": (37, False), "H tiny": (300, True)},
                          shapes=((1, 1, 4), (3, 4, 7), (2, 19, 8))))


if __name__ == "__main__":
    harness.main("short_conv", dry)
