"""Per-sequence uniforms generated on the device: counter-based (Philox 4x32-10), seeded per sequence.

    u[b, i] = uniform53(Philox(key = seed[b], counter = counter[b] + i)),   i < n
    counter[b] += n                                    (in place, on the device)

Sequence b's stream depends only on (seed[b], its counter): the same in any batch, any batch size and
on any device (Philox is integer arithmetic; the CPU interpreter and the GPU give the same bits).
Each draw takes two of the four 32-bit Philox outputs for one 53-bit float64 in [0, 1):
u = ((r0 >> 5) * 2^26 + (r1 >> 6)) / 2^53 (the layout numpy uses), so u < 1 always.

A speculative cycle draws, per sequence, k uniforms for sampled drafts (only when drafting samples),
k for the acceptance tests and one for the correction/bonus, the order inkling_ref.generate uses
(its uniforms come from torch.Generator on the host instead: the two streams differ, the uses agree).
No host sync: the counters live on the device, so a captured CUDA graph draws fresh uniforms on
every replay.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_kernel_device, check_tensor, need, out_tensor


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["seed_ptr", "counter_ptr"])
def _philox_uniforms_kernel(seed_ptr, counter_ptr, out_ptr, n, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seed_ptr + b)
    start = tl.load(counter_ptr + b)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)                           # 64-bit key
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        c = start + i                                                 # 64-bit counter: words c0, c1
        c0 = (c & 0xFFFFFFFF).to(tl.uint32)
        c1 = ((c >> 32) & 0xFFFFFFFF).to(tl.uint32)
        # Philox 4x32-10 itself (not tl.randint4x, whose handling of 64-bit offsets changed across
        # Triton versions): the same bits under Triton 3.6 and 3.9
        r0, r1, _, _ = tl.philox_impl(c0, c1, c0 * 0, c0 * 0, k0, k1)
        hi = (r0 >> 5).to(tl.float64)                                 # 27 bits
        lo = (r1 >> 6).to(tl.float64)                                 # 26 bits
        u = (hi * 67108864.0 + lo) * (1.0 / 9007199254740992.0)       # (hi * 2^26 + lo) / 2^53
        tl.store(out_ptr + b * n + i, u, mask=i < n)
    tl.store(counter_ptr + b, start + n)


def philox_uniforms(seeds: torch.Tensor, counters: torch.Tensor, n: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """seeds: int64 [B] (one per sequence); counters: int64 [B], advanced by n in place; n >= 0.
    Returns float64 [B, n] uniforms in [0, 1) (into `out` when given). One launch, no host sync."""
    check_tensor("seeds", seeds, dtypes=torch.int64)
    need(seeds.dim() == 1, f"seeds must be an int64 tensor [B], got shape {tuple(seeds.shape)}")
    check_kernel_device("seeds", seeds)
    B = seeds.shape[0]
    check_tensor("counters", counters, (B,), torch.int64, seeds.device, contiguous=True)
    need(isinstance(n, int) and n >= 0, f"n must be an int >= 0, got {n!r}")
    out = out_tensor("out", out, (B, n), torch.float64, seeds.device)
    if B > 0:
        _philox_uniforms_kernel[(B,)](seeds.contiguous(), counters, out, n,
                                      BLOCK=min(1024, max(16, triton.next_power_of_2(max(n, 1)))), num_warps=1)
    return out


def philox_uniforms_torch(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """The twin: the same stream in plain integer torch (the counters are not advanced)."""
    M32 = 0xFFFFFFFF
    c = counters.long()[:, None] + torch.arange(n, device=counters.device)[None]   # [B, n] 64-bit counters
    s = seeds.long()[:, None].expand_as(c)
    zero = torch.zeros_like(c)
    r0, r1, _, _ = philox4x32_torch(c & M32, (c >> 32) & M32, zero, zero, s & M32, (s >> 32) & M32)
    return ((r0 >> 5).double() * 67108864.0 + (r1 >> 6).double()) / 9007199254740992.0


def philox4x32_torch(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox 4x32 (Salmon et al., SC'11) on int64 tensors holding 32-bit values: counter (c0..c3),
    key (k0, k1) -> four 32-bit outputs. Products of two 32-bit values need 64 unsigned bits, so they
    are formed from 16-bit halves (int64 is signed)."""
    M32 = 0xFFFFFFFF
    for _ in range(rounds):
        p0_hi, p0_lo = _mulhilo(0xD2511F53, c0)
        p1_hi, p1_lo = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = (p1_hi ^ c1 ^ k0), p1_lo, (p0_hi ^ c3 ^ k1), p0_lo
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b) >> 32 and (a * b) & 0xFFFFFFFF for 0 <= a, b < 2^32, in int64 without overflow."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_lo = a_lo * b_lo
    mid1 = a_hi * b_lo
    mid2 = a_lo * b_hi
    mid = (lo_lo >> 16) + (mid1 & 0xFFFF) + (mid2 & 0xFFFF)
    lo = ((mid & 0xFFFF) << 16) | (lo_lo & 0xFFFF)
    hi = a_hi * b_hi + (mid1 >> 16) + (mid2 >> 16) + (mid >> 16)
    return hi & 0xFFFFFFFF, lo
