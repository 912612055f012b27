"""Benchmarks of the norm kernels (bf16, Inkling-Small H 4096 and Inkling H 6144): embedding + RMSNorm
(alone, chained with layer 0's attn_norm, the MTP double norm), RMSNorm, residual add + RMSNorm, and the
MTP input fusion, each against its torch twin.

    python benchmarks/kernels.py norms          # GPU: times, writes docs/benchmarks/kernels.md
    python benchmarks/bench_norms.py --dry      # CPU: small sizes through the interpreter, no timing

Byte floors (bf16 = 2 bytes, int32 ids = 4 bytes), written next to each case below.
Every case is timed through CUDA-graph replays (device time: the wrapper's host work would otherwise
hide kernels of a few microseconds and make the timings noisy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from harness import Case  # noqa: E402
from inkling_fast.kernels.embed_norm import embed_norm, embed_norm_torch  # noqa: E402
from inkling_fast.kernels.mtp_input import mtp_input, mtp_input_torch  # noqa: E402
from inkling_fast.kernels.rms_norm import add_rms_norm, add_rms_norm_torch, rms_norm, rms_norm_torch  # noqa: E402

SECTION = "Norms: embedding + RMSNorm, RMSNorm, residual add + RMSNorm, MTP input (bf16)"
EPS = 1e-6
E = 2                                     # bytes per bf16 element
WIDTHS = {"Small": 4096, "Inkling": 6144}
ROWS = (1, 4, 16, 4096, 16384)
VOCAB = 201024                            # padded vocabulary (the embedding table's rows)


def cases(device: str, widths=WIDTHS, rows=ROWS, vocab=VOCAB) -> list[Case]:
    dt = torch.bfloat16
    tables: dict[int, torch.Tensor] = {}

    def table(H):  # one table per width, shared by the input sets (it is far larger than L2)
        if H not in tables:
            tables[H] = torch.randn(vocab, H, dtype=dt, device=device)
        return tables[H]

    def ids(N):
        return torch.randint(0, vocab, (N,), dtype=torch.int32, device=device)

    def w(H):
        return (0.7 + 0.6 * torch.rand(H, device=device)).to(dt)

    def x(N, H):
        return torch.randn(N, H, dtype=dt, device=device)

    def empty(N, H):
        return torch.empty(N, H, dtype=dt, device=device)

    out = []
    for model, H in widths.items():
        for N in rows:
            label, graph = f"{model} H={H} rows={N}", True
            out += [
                # ids 4N + gathered rows N*H*E + weight H*E + e N*H*E
                Case("embed_norm", label, 4 * N + 2 * N * H * E + H * E,
                     make=lambda N=N, H=H: (ids(N), table(H), w(H), empty(N, H)),
                     fn=lambda i, t, w1, o: embed_norm(i, t, w1, EPS, check_ids=False, out=o),
                     twin=lambda i, t, w1, o: embed_norm_torch(i, t, w1, EPS), graph=graph),
                # trunk layer 0 (e and attn_norm(e)): ids 4N + rows N*H*E + 2 weights 2H*E + e, n 2*N*H*E
                Case("embed_norm x2", label, 4 * N + 3 * N * H * E + 2 * H * E,
                     make=lambda N=N, H=H: (ids(N), table(H), w(H), w(H), empty(N, H), empty(N, H)),
                     fn=lambda i, t, w1, w2, o, o2: embed_norm(i, t, w1, EPS, weight2=w2, check_ids=False,
                                                               out=o, out2=o2),
                     twin=lambda i, t, w1, w2, o, o2: embed_norm_torch(i, t, w1, EPS, weight2=w2), graph=graph),
                # MTP double norm (only n): ids 4N + rows N*H*E + 2 weights 2H*E + n N*H*E
                Case("embed_norm mtp", label, 4 * N + 2 * N * H * E + 2 * H * E,
                     make=lambda N=N, H=H: (ids(N), table(H), w(H), w(H), empty(N, H)),
                     fn=lambda i, t, w1, w2, o2: embed_norm(i, t, w1, EPS, weight2=w2, store_first=False,
                                                            check_ids=False, out2=o2)[1],
                     twin=lambda i, t, w1, w2, o2: embed_norm_torch(i, t, w1, EPS, weight2=w2)[1], graph=graph),
                # x N*H*E + weight H*E + y N*H*E
                Case("rms_norm", label, 2 * N * H * E + H * E,
                     make=lambda N=N, H=H: (x(N, H), w(H), empty(N, H)),
                     fn=lambda a, w1, o: rms_norm(a, w1, EPS, out=o),
                     twin=lambda a, w1, o: rms_norm_torch(a, w1, EPS), graph=graph),
                # x, residual 2*N*H*E + weight H*E + sum, y 2*N*H*E
                Case("add_rms_norm", label, 4 * N * H * E + H * E,
                     make=lambda N=N, H=H: (x(N, H), x(N, H), w(H), empty(N, H), empty(N, H)),
                     fn=lambda a, r, w1, s, o: add_rms_norm(a, r, w1, EPS, out_sum=s, out=o),
                     twin=lambda a, r, w1, s, o: add_rms_norm_torch(a, r, w1, EPS), graph=graph),
                # h N*H*E + ids 4N + rows N*H*E + 3 weights 3H*E + c 2*N*H*E
                Case("mtp_input", label, 4 * N * H * E + 4 * N + 3 * H * E,
                     make=lambda N=N, H=H: (x(N, H), ids(N), table(H), w(H), w(H), w(H), empty(N, 2 * H)),
                     fn=lambda h, i, t, wh, wb, we, o: mtp_input(h, i, t, wh, wb, we, EPS, out=o, check_ids=False),
                     twin=lambda h, i, t, wh, wb, we, o: mtp_input_torch(h, i, t, wh, wb, we, EPS), graph=graph),
            ]
    return out


def run(ctx: harness.Context) -> list[harness.Row]:
    return harness.run_cases(cases("cuda"))


def dry() -> None:
    """Every case at small sizes, checked against its twin (no timing)."""
    harness.dry_run(cases("cpu", widths={"tiny": 40, "odd": 72}, rows=(1, 5), vocab=97))


if __name__ == "__main__":
    harness.main("norms", dry)
