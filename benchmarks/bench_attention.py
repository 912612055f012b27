"""Attention decode (T = 1) and verify/draft windows (T = 5, 9) over the position-addressed KV cache,
Inkling-Small heads (32 query / 8 KV, hd 128), bf16, against the vectorized torch twin and the
KV-bytes floor; plus split-KV off vs on, a few sliding-layer cases and the attention prep.

Floor bytes per case = the K and V rows the kernel must read (every key up to each row's last
position on a global layer: ctx + T keys per batch row; window + T - 1 on a sliding layer) + q read
+ out written. The L_rel band the kernel also reads (T * nH * min(E, keys) * 4 bytes per batch row)
is not in the floor; the note gives its size. Each case first checks kernel against twin on one
input set (relative L2 <= 1e-2, in the note), then times both as CUDA-graph replays
(`harness.bench_graph`) over input sets rotated past the L2.

    python benchmarks/kernels.py attention                        # on the GPU
    INKLING_ATTN_CASES=long python benchmarks/kernels.py attention   # only contexts >= 8k (29 cases)
    python benchmarks/bench_attention.py --dry                    # CPU: build every case, run tiny ones
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (first: see its header)
from inkling_fast.kernels.attention_decode import (attention_decode, attention_decode_torch,  # noqa: E402
                                                   choose_num_splits, sm_count)
from inkling_fast.kernels.attention_prep import attention_prep, attention_prep_torch  # noqa: E402
from inkling_ref.testing import rel_l2  # noqa: E402

SECTION = "Attention: decode and windows over the KV cache (Inkling-Small 32/8 heads, hd 128, bf16)"
NH, NKV, HD, D_REL, KSIZE = 32, 8, 128, 16, 4
EXTENT = {"global": 1024, "sliding": 512}
WINDOW = 512


@dataclass(frozen=True)
class Case:
    op: str                 # "attention" | "prep"
    kind: str               # "global" | "sliding"
    T: int
    B: int
    ctx: int                # history length before the window (every batch row)
    splits: int | None = None   # None: choose_num_splits; 1: split-KV off

    @property
    def label(self):
        return f"{self.kind} T={self.T} B={self.B} ctx={self.ctx // 1024}k"


def cases() -> list[Case]:
    if os.environ.get("INKLING_ATTN_CASES") == "long":   # long contexts only (>= 8k)
        return ([Case("attention", "global", T, B, ctx) for T in (1, 5, 9) for B in (1, 4, 32)
                 for ctx in (8192, 16384, 32768)] + [Case("attention", "sliding", 1, B, 32768) for B in (1, 32)])
    out = [Case("attention", "global", T, B, ctx)
           for T in (1, 5, 9) for B in (1, 4, 8, 16, 32) for ctx in (1024, 4096, 8192, 16384, 32768)]
    # split-KV off (S=1) and a sweep of fixed split counts next to the automatic choice of the main grid
    out += [Case("attention", "global", 1, B, ctx, splits=S)
            for B, ctx in ((1, 8192), (1, 32768), (4, 8192), (32, 8192)) for S in (1, 4, 16, 64)]
    out += [Case("attention", "sliding", T, B, 32768) for T in (1, 9) for B in (1, 32)]
    out += [Case("prep", "global", T, B, 8192) for T, B in ((1, 1), (1, 32), (9, 32))]
    return out


def num_keys(c: Case) -> int:
    return c.ctx + c.T if c.kind == "global" else WINDOW + c.T - 1


def floor_bytes(c: Case, nh=NH, nkv=NKV, hd=HD) -> int:
    if c.op == "prep":   # per row: q in/out, k/v in, ring + cache writes, r, L_rel out; K-1 ring reads; P
        C, E = nkv * hd, EXTENT[c.kind]
        per_row = 2 * (2 * nh * hd + 2 * C + 2 * C + 2 * C + nh * D_REL) + 4 * nh * E
        return c.B * (c.T * per_row + 2 * 2 * (KSIZE - 1) * C) + 2 * D_REL * E
    return c.B * (num_keys(c) * nkv * hd * 2 * 2 + 2 * c.T * nh * hd * 2)


def make_inputs(c: Case, device, nh=NH, nkv=NKV, hd=HD, scale=1):
    """Random inputs of one case (ctx divided by `scale` for the dry run). Attention: (q, rel, k_cache,
    v_cache, slot, pos); prep: the projections, weights, rings and caches."""
    g = torch.Generator(device=device).manual_seed(c.B * 1000 + c.T + c.ctx)
    ctx, E = c.ctx // scale, EXTENT[c.kind]
    window = WINDOW // scale if c.kind == "sliding" else None
    if window is not None:
        E = window
    cap = ctx + c.T if window is None else window + c.T
    B, T = c.B, c.T

    def rnd(*shape, dtype=torch.bfloat16, std=1.0):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    slot = torch.randperm(B, generator=g, device=device).to(torch.int32)
    pos = (ctx + torch.arange(T, device=device, dtype=torch.int32)).expand(B, T).contiguous()
    k_cache, v_cache = rnd(B, cap, nkv, hd), rnd(B, cap, nkv, hd)
    if c.op == "attention":
        return (rnd(B, T, nh, hd), rnd(B, T, nh, E, dtype=torch.float32, std=0.3), k_cache, v_cache, slot, pos)
    C, R = nkv * hd, KSIZE - 1 + T
    tensors = dict(q=rnd(B, T, nh * hd), k_in=rnd(B, T, C), v_in=rnd(B, T, C), r=rnd(B, T, nh * D_REL))
    state = dict(q_norm=rnd(hd, std=0.1) + 1, k_norm=rnd(hd, std=0.1) + 1, k_conv=rnd(C, KSIZE, std=0.3),
                 v_conv=rnd(C, KSIZE, std=0.3), rel_proj=rnd(D_REL, E), k_ring=rnd(B, R, C), v_ring=rnd(B, R, C),
                 k_cache=k_cache, v_cache=v_cache, slot=slot, pos=pos)
    return (tensors, state)


def _fns(c: Case, nh=NH, scale=1):
    """(kernel, twin) callables taking one input set."""
    window = WINDOW // scale if c.kind == "sliding" else None
    if c.op == "prep":
        def prep(fn):
            return lambda t, s: fn(t["q"], t["k_in"], t["v_in"], t["r"], **s, eps=1e-6)
        return prep(attention_prep), prep(attention_prep_torch)
    keys = c.ctx // scale + c.T if window is None else window + c.T - 1

    def kernel(q, rel, k, v, slot, pos):
        return attention_decode(q, rel, k, v, slot, pos, window=window, num_splits=c.splits)

    def twin(q, rel, k, v, slot, pos):
        return attention_decode_torch(q, rel, k, v, slot, pos, window=window, num_keys=keys)
    return kernel, twin


def note(c: Case, device) -> str:
    if c.op == "prep":
        return "1 launch; twin timed without a graph (it syncs)"
    cap = c.ctx + c.T if c.kind == "global" else WINDOW + c.T
    max_keys = cap if c.kind == "global" else min(cap, WINDOW + c.T - 1)
    S = c.splits or choose_num_splits(c.B * NKV, max_keys, sm_count(torch.device(device)))
    band = c.B * c.T * NH * min(EXTENT[c.kind], num_keys(c)) * 4
    kv = c.B * num_keys(c) * NKV * HD * 4
    off = " (split-KV off)" if c.splits == 1 else " (fixed)" if c.splits else ""
    return f"S={S}{off}; K+V {kv / 2**20:.1f} MB; L_rel band {band / 2**20:.2f} MB"


def compare(c: Case, kernel, twin, inputs) -> float:
    """Relative L2 of the kernel's output (prep: q') against the twin's on one input set (prep runs
    each on its own copy of the caches it writes). NaN or inf gives inf. Syncs with the host."""
    if c.op == "prep":
        t, s = inputs
        a, b = kernel(t, {k: x.clone() for k, x in s.items()}).q, twin(t, {k: x.clone() for k, x in s.items()}).q
    else:
        a, b = kernel(*inputs), twin(*inputs)
    return rel_l2(a, b)


def run(ctx: harness.Context) -> list[harness.Row]:
    rows = []
    for c in cases():
        sets = harness.rotating_inputs(lambda: make_inputs(c, "cuda"), floor_bytes(c))
        kernel, twin = _fns(c)
        err = compare(c, kernel, twin, sets[0])
        if not err <= 1e-2:
            raise RuntimeError(f"{c.label} {c.op}: kernel vs twin relative L2 {err:.2e}")
        ms = harness.bench_graph(kernel, sets)
        if c.op == "prep":
            ms_twin = harness.bench(twin, sets[:2])   # rewrites the same rows each call: same work
        elif c.splits is None:
            ms_twin = harness.bench_graph(twin, sets)
        else:
            ms_twin = None
        rows.append(harness.Row(c.op if c.splits is None else f"{c.op} S={c.splits}", c.label, floor_bytes(c), ms,
                                ms_twin, f"{note(c, 'cuda')}; rel L2 {err:.1e}"))
        floor_us = floor_bytes(c) / (ctx.copy_gbps * 1e9) * 1e6
        twin_us = ms_twin * 1e3 if ms_twin is not None else float("nan")
        print(f"{c.label:32s} {c.op:9s} {ms * 1e3:9.1f} us  floor {floor_us:8.1f} us  twin {twin_us:9.1f} us  "
              f"{rows[-1].note}", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def dry_run(limit: int | None = None, scale: int = 256, device: str | None = None) -> list[harness.Row]:
    """No timing: build every case's floor and note; run the first `limit` cases at tiny sizes
    (contexts / scale, 4/2 heads, hd 16) through kernel and twin and check they agree. On CPU the
    kernels run in the Triton interpreter (TRITON_INTERPRET=1 must be set before the import)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for i, c in enumerate(cases()):
        row = harness.Row(c.op, c.label, floor_bytes(c), float("nan"), None, note(c, device))
        if limit is None or i < limit:
            small = Case(c.op, c.kind, c.T, min(c.B, 2), c.ctx, c.splits)
            inputs = make_inputs(small, device, nh=4, nkv=2, hd=16, scale=scale)
            kernel, twin = _fns(small, nh=4, scale=scale)
            err = compare(small, kernel, twin, inputs)
            assert err <= 1e-2, f"{c.label}: kernel vs twin relative L2 {err}"
            row.note += f"; dry run rel L2 {err:.1e}"
        rows.append(row)
    return rows


def print_dry_run() -> None:
    for r in dry_run(limit=int(os.environ.get("INKLING_BENCH_DRY_LIMIT", "4"))):
        print(f"{r.kernel:10s} {r.case:32s} floor {r.bytes:>14,d} B  {r.note}")


if __name__ == "__main__":
    harness.main("attention", print_dry_run)
