"""Embedding gather + RMSNorm, optionally chained with a second RMSNorm, in one launch.

    e = rms(E[id]; w1)          the trunk's normed embedding (the residual stream of layer 0)
    n = rms(e; w2)              optional: layer 0's attn_norm, or an MTP depth's embed_norm
                                (the MTP double norm rms(rms(E[x]; backbone_embed_norm); embed_norm))

e is rounded to the table's dtype before the second norm, as in the reference, where it is a tensor
of the model dtype. `launch_config` tokens per program; fp32 math, weights multiplied in fp32.

Token ids outside [0, V) never touch memory outside the table: with `check_ids=False` (the
engine's sync-free path) their rows come out NaN; with `check_ids=True` the wrapper raises first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rms_norm import FLOAT_DTYPES, interpreting


@triton.jit
def _embed_norm_kernel(ids_ptr, table_ptr, w1_ptr, w2_ptr, e_ptr, n_ptr, N, V, H, table_row, eps,
                       ROWS: tl.constexpr, BLOCK_H: tl.constexpr, SECOND: tl.constexpr, STORE_FIRST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)    # ROWS tokens per program
    r_in = row < N
    tok = tl.load(ids_ptr + row, mask=r_in, other=0).to(tl.int64)
    ok = r_in & (tok >= 0) & (tok < V)
    offs = tl.arange(0, BLOCK_H)
    h_in = offs < H
    mask = r_in[:, None] & h_in[None, :]
    x = tl.load(table_ptr + tl.where(ok, tok, 0)[:, None] * table_row + offs[None, :],
                mask=ok[:, None] & h_in[None, :], other=0.0).to(tl.float32)
    w1 = tl.load(w1_ptr + offs, mask=h_in, other=0.0).to(tl.float32)
    r1 = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    e = tl.where(ok[:, None], x * r1[:, None] * w1[None, :], float("nan")).to(table_ptr.dtype.element_ty)
    if STORE_FIRST:
        tl.store(e_ptr + row[:, None] * H + offs[None, :], e, mask=mask)
    if SECOND:
        ef = e.to(tl.float32)
        w2 = tl.load(w2_ptr + offs, mask=h_in, other=0.0).to(tl.float32)
        r2 = tl.rsqrt(tl.sum(ef * ef, axis=1) / H + eps)
        tl.store(n_ptr + row[:, None] * H + offs[None, :], (ef * r2[:, None] * w2[None, :]).to(table_ptr.dtype.element_ty),
                 mask=mask)


def launch_config(H: int, n_rows: int) -> tuple[int, int]:
    """(tokens per program, num_warps): one token, 32 elements per thread, at most 8 warps (the fastest
    on the H200 at H = 4096 / 6144 among 1-4 tokens and 4-16 warps: docs/benchmarks/tuning.md)."""
    return 1, max(1, min(8, triton.next_power_of_2(H) // 1024))


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
        rows, warps = launch_config(H, N)
        _embed_norm_kernel[(triton.cdiv(N, rows),)](flat, table, weight, weight2 if second else weight, e_buf, n_buf,
                                                    N, V, H, table.stride(0), float(eps), ROWS=rows,
                                                    BLOCK_H=triton.next_power_of_2(H), SECOND=second,
                                                    STORE_FIRST=store_first, num_warps=warps)
    if not second:
        return out
    return (out if store_first else None), out2
