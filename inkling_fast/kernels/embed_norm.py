"""Embedding gather + RMSNorm, optionally chained with a second RMSNorm, in one launch.

    e = rms(E[id]; w1)          the trunk's normed embedding (the residual stream of layer 0)
    n = rms(e; w2)              optional: layer 0's attn_norm, or an MTP depth's embed_norm
                                (the MTP double norm rms(rms(E[x]; backbone_embed_norm); embed_norm))

e is rounded to the table's dtype before the second norm, as in the reference, where it is a tensor
of the model dtype. One token per program, its row in one or two power-of-two pieces (`pieces`),
`launch_config` warps; fp32 math, weights multiplied in fp32.

Token ids outside [0, V) never touch memory outside the table: with `check_ids=False` (the
engine's sync-free path) their rows come out NaN; with `check_ids=True` the wrapper raises first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import FLOAT_DTYPES, interpreting


@triton.jit
def _load_piece(table_ptr, w_ptr, src, ok, table_row, H, START: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [START, START + BLOCK) of the gathered row (fp32) and of weight w; masked past H."""
    offs = START + tl.arange(0, BLOCK)
    h_in = offs < H
    x = tl.load(table_ptr + src * table_row + offs, mask=tl.where(ok, h_in, False), other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=h_in, other=0.0).to(tl.float32)
    return offs, h_in, x, w


@triton.jit
def _embed_norm_kernel(ids_ptr, table_ptr, w1_ptr, w2_ptr, e_ptr, n_ptr, V, H, table_row, eps,
                       B1: tl.constexpr, B2: tl.constexpr, SECOND: tl.constexpr, STORE_FIRST: tl.constexpr):
    # One token per program. Its row of H columns is held as two power-of-two pieces, B1 + B2 >= H
    # (B2 = 0: one piece), so that H = 6144 takes 4096 + 2048 lanes instead of 8192 with a quarter of
    # them masked off. 1-D pieces: each sum of squares is a scalar, shared by both without re-layout.
    # (A vector & scalar-bool mask is spelled with where: the Triton 3.9 interpreter rejects `&`.)
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    ok = (tok >= 0) & (tok < V)
    src = tl.where(ok, tok, 0)
    # both pieces are loaded before the first sum: a reduction ends in a barrier, and a load written
    # after it would wait for it (two memory round trips instead of one)
    o1, h1, x1, w11 = _load_piece(table_ptr, w1_ptr, src, ok, table_row, H, 0, B1)
    if B2 > 0:
        o2, h2, x2, w12 = _load_piece(table_ptr, w1_ptr, src, ok, table_row, H, B1, B2)
    ss = tl.sum(x1 * x1, 0)
    if B2 > 0:
        ss += tl.sum(x2 * x2, 0)
    r1 = tl.where(ok, tl.rsqrt(ss / H + eps), float("nan"))   # a bad id: NaN row
    e1 = (x1 * r1 * w11).to(table_ptr.dtype.element_ty)
    if B2 > 0:
        e2 = (x2 * r1 * w12).to(table_ptr.dtype.element_ty)
    if STORE_FIRST:
        tl.store(e_ptr + row * H + o1, e1, mask=h1)
        if B2 > 0:
            tl.store(e_ptr + row * H + o2, e2, mask=h2)
    if SECOND:
        # the second norm of e as rounded to the table's dtype (the reference's tensor)
        f1 = e1.to(tl.float32)
        ss2 = tl.sum(f1 * f1, 0)
        if B2 > 0:
            f2 = e2.to(tl.float32)
            ss2 += tl.sum(f2 * f2, 0)
        r2 = tl.rsqrt(ss2 / H + eps)
        w21 = tl.load(w2_ptr + o1, mask=h1, other=0.0).to(tl.float32)
        tl.store(n_ptr + row * H + o1, (f1 * r2 * w21).to(table_ptr.dtype.element_ty), mask=h1)
        if B2 > 0:
            w22 = tl.load(w2_ptr + o2, mask=h2, other=0.0).to(tl.float32)
            tl.store(n_ptr + row * H + o2, (f2 * r2 * w22).to(table_ptr.dtype.element_ty), mask=h2)


def pieces(H: int, n_rows: int) -> tuple[int, int]:
    """(B1, B2): the lanes of a row's two pieces. Above 64 rows an H that is not a power of two is split
    as the largest power of two below it plus the rest rounded up (6144 = 4096 + 2048); at decode sizes
    one padded piece. A/B of 2026-12-04 in docs/benchmarks/tuning.md."""
    whole = triton.next_power_of_2(H)
    if whole == H or n_rows <= 64:
        return whole, 0
    b1 = whole // 2
    return b1, triton.next_power_of_2(H - b1)


def launch_config(H: int, n_rows: int) -> int:
    """num_warps: one padded piece takes 32 elements per thread, at most 8 warps (the fastest on the
    H200 at H = 4096 / 6144 among 4-16 warps: docs/benchmarks/tuning.md); two pieces take 4 warps
    (faster than 8 for 6144 = 4096 + 2048)."""
    if pieces(H, n_rows)[1] > 0:
        return 4
    return max(1, min(8, triton.next_power_of_2(H) // 1024))


def embed_norm_torch(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                     weight2: torch.Tensor | None = None):
    """ids: [...] -> e = rms(table[ids]; weight): [..., H]; with weight2, (e, rms(e; weight2))."""
    x = table[ids.long()].float()
    e = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(table.dtype)
    if weight2 is None:
        return e
    ef = e.float()
    n = (ef * torch.rsqrt(ef.pow(2).mean(-1, keepdim=True) + eps) * weight2.float()).to(table.dtype)
    return e, n


def _check_out(name: str, t: torch.Tensor, shape: tuple, table: torch.Tensor) -> None:
    if t.shape != shape or t.dtype != table.dtype or t.device != table.device or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {table.dtype} tensor of shape {shape} on {table.device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")


def embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
               weight2: torch.Tensor | None = None, store_first: bool = True, check_ids: bool = True,
               out: torch.Tensor | None = None, out2: torch.Tensor | None = None):
    """ids: int32/int64 [...]; table: [V, H]; weight, weight2: [H].

    Without weight2: returns e = rms(table[ids]; weight): [..., H] (written into `out` when given).
    With weight2: returns (e, n), n = rms(e; weight2) (into `out2`); e is None when
    `store_first=False` (the MTP double norm needs only n).
    `check_ids=True` checks the id range on the host (one device sync); pass False inside CUDA graphs."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype not in FLOAT_DTYPES:
        raise ValueError("table must be a float32/float16/bfloat16 tensor [V, H]")
    if table.stride(1) != 1:
        raise ValueError(f"table must have a contiguous last dimension, got strides {table.stride()}")
    if table.device.type != "cuda" and not interpreting():
        raise ValueError(f"table is on {table.device}: the Triton kernels need CUDA tensors "
                         "(CPU tensors only under TRITON_INTERPRET=1)")
    V, H = table.shape
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an int32 or int64 tensor, got "
                         f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.device != table.device:
        raise ValueError(f"ids is on {ids.device}, expected {table.device} (the device of table)")
    for name, w in (("weight", weight), ("weight2", weight2)):
        if w is None and name == "weight2":
            continue
        if not isinstance(w, torch.Tensor) or w.shape != (H,) or w.dtype not in FLOAT_DTYPES \
                or w.device != table.device or w.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous float tensor of shape ({H},) on {table.device}")
    if not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    if weight2 is None and not store_first:
        raise ValueError("store_first=False needs weight2 (otherwise nothing would be written)")
    if check_ids and ids.numel() > 0:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("check_ids=True syncs with the device; pass check_ids=False inside a CUDA graph")
        bad = (ids < 0) | (ids >= V)
        if bool(bad.any()):
            raise ValueError(f"ids out of range [0, {V}): e.g. {ids[bad][:4].tolist()}")
    shape = tuple(ids.shape) + (H,)
    second = weight2 is not None
    if store_first:
        out = torch.empty(shape, dtype=table.dtype, device=table.device) if out is None else out
        _check_out("out", out, shape, table)
    if second:
        out2 = torch.empty(shape, dtype=table.dtype, device=table.device) if out2 is None else out2
        _check_out("out2", out2, shape, table)
    flat = ids.reshape(-1)
    if flat.numel() > 0:
        e_buf = out if store_first else out2  # unused by the kernel when STORE_FIRST is off
        n_buf = out2 if second else out       # unused by the kernel when SECOND is off
        N = flat.numel()
        b1, b2 = pieces(H, N)
        _embed_norm_kernel[(N,)](flat, table, weight, weight2 if second else weight, e_buf, n_buf, V, H,
                                 table.stride(0), float(eps), B1=b1, B2=b2, SECOND=second,
                                 STORE_FIRST=store_first, num_warps=launch_config(H, N))
    if not second:
        return out
    return (out if store_first else None), out2
