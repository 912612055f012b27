"""Embedding gather + RMSNorm, optionally chained with a second RMSNorm, in one launch.

    e = rms(E[id]; w1)          the trunk's normed embedding (the residual stream of layer 0)
    n = rms(e; w2)              optional: layer 0's attn_norm, or an MTP depth's embed_norm
                                (the MTP double norm rms(rms(E[x]; backbone_embed_norm); embed_norm))

e is rounded to the table's dtype before the second norm, as in the reference, where it is a tensor
of the model dtype. fp32 math, weights multiplied in fp32. Shapes: ids [...] int32/int64; table
[V, H] (last dimension contiguous); weights [H]; e, n [..., H] in the table's dtype.

Program layout: one token per program, its row held whole in registers as BLOCK_H = H rounded up to
a power of two lanes (masked past H): each norm is one in-register reduction, the row is read once.

Token ids outside [0, V) never touch memory outside the table: with `check_ids=False` (the
engine's sync-free path) their rows come out NaN; with `check_ids=True` the wrapper raises first.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (FLOAT_DTYPES, INDEX_DTYPES, both, check_ids_in_range, check_kernel_device, check_tensor, need,
                     out_tensor)


@triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
def _embed_norm_kernel(ids_ptr, table_ptr, w1_ptr, w2_ptr, e_ptr, n_ptr, V, H, table_row, eps,
                       BLOCK_H: tl.constexpr, SECOND: tl.constexpr, STORE_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    ok = (tok >= 0) & (tok < V)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    x = tl.load(table_ptr + tl.where(ok, tok, 0) * table_row + offs, mask=both(m, ok), other=0.0).to(tl.float32)
    w1 = tl.load(w1_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r1 = tl.where(ok, tl.rsqrt(tl.sum(x * x, 0) / H + eps), float("nan"))   # a bad id: NaN row
    e = (x * r1 * w1).to(table_ptr.dtype.element_ty)
    if STORE_FIRST:
        tl.store(e_ptr + row * H + offs, e, mask=m)
    if SECOND:
        f = e.to(tl.float32)             # the second norm of e as rounded to the table's dtype
        r2 = tl.rsqrt(tl.sum(f * f, 0) / H + eps)
        w2 = tl.load(w2_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(n_ptr + row * H + offs, (f * r2 * w2).to(table_ptr.dtype.element_ty), mask=m)


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


def embed_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
               weight2: torch.Tensor | None = None, store_first: bool = True, check_ids: bool = True,
               out: torch.Tensor | None = None, out2: torch.Tensor | None = None):
    """ids: int32/int64 [...]; table: [V, H]; weight, weight2: [H].

    Without weight2: returns e = rms(table[ids]; weight): [..., H] (written into `out` when given).
    With weight2: returns (e, n), n = rms(e; weight2) (into `out2`); e is None when
    `store_first=False` (the MTP double norm needs only n).
    `check_ids=True` checks the id range on the host (one device sync); pass False inside CUDA graphs."""
    check_tensor("table", table, dtypes=FLOAT_DTYPES)
    need(table.dim() == 2 and table.stride(1) == 1,
         f"table must be a tensor [V, H] with a contiguous last dimension, got shape {tuple(table.shape)} "
         f"strides {table.stride()}")
    check_kernel_device("table", table)
    V, H = table.shape
    check_tensor("ids", ids, dtypes=INDEX_DTYPES, device=table.device)
    check_tensor("weight", weight, (H,), FLOAT_DTYPES, table.device, contiguous=True)
    if weight2 is not None:
        check_tensor("weight2", weight2, (H,), FLOAT_DTYPES, table.device, contiguous=True)
    need(isinstance(eps, (int, float)) and eps > 0, f"eps must be a positive number, got {eps!r}")
    if weight2 is None and not store_first:
        raise ValueError("store_first=False needs weight2 (otherwise nothing would be written)")
    if check_ids and ids.numel() > 0:
        check_ids_in_range(ids, V)
    shape = tuple(ids.shape) + (H,)
    second = weight2 is not None
    if store_first:
        out = out_tensor("out", out, shape, table.dtype, table.device)
    if second:
        out2 = out_tensor("out2", out2, shape, table.dtype, table.device)
    flat = ids.reshape(-1)
    if flat.numel() > 0:
        e_buf = out if store_first else out2  # unused by the kernel when STORE_FIRST is off
        n_buf = out2 if second else out       # unused by the kernel when SECOND is off
        block_h = triton.next_power_of_2(H)
        _embed_norm_kernel[(flat.numel(),)](flat, table, weight, weight2 if second else weight, e_buf, n_buf, V, H,
                                            table.stride(0), float(eps), BLOCK_H=block_h, SECOND=second,
                                            STORE_FIRST=store_first, num_warps=max(1, min(8, block_h // 1024)))
    if not second:
        return out
    return (out if store_first else None), out2
