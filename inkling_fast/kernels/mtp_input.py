"""The input of an MTP depth's input_proj, built in one launch:

    c = [ rms(h_prev; hidden_norm) | rms(rms(E[x]; backbone_embed_norm); embed_norm) ]   [N, 2H]
          hidden FIRST                embedding second (double-normed)

Shapes: h_prev [..., H] (last dimension contiguous), ids [...] int32/int64, table [V, H], norms [H];
c [..., 2H] in h_prev's dtype. fp32 math, weights multiplied in fp32.

Grid (N, 2): program (i, 0) norms row i of h_prev into c[i, :H]; program (i, 1) gathers E[x_i],
norms it twice (the first result rounded to the model dtype, as the reference's trunk embedding
is a model-dtype tensor) and writes c[i, H:]. Two ways to hold a row (`launch_config`):
  * up to DECODE_ROWS rows (decode steps and the windows of small batches): the whole row as one
    power-of-two piece in registers, read once (a short call is latency-bound: one pass is best);
  * more rows: pieces of at most 2048 lanes (so H = 6144 is three full pieces, no masked lanes),
    one pass per norm and one to write, the later passes re-reading the row from L1/L2.
Out-of-range ids: NaN in c[i, H:] when check_ids=False, an error when True (see embed_norm.py).

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (FLOAT_DTYPES, INDEX_DTYPES, check_ids_in_range, check_kernel_device, check_tensor, need,
                     out_tensor)

DECODE_ROWS = 64   # up to this many rows: one piece per row (see launch_config)


@triton.jit
def _sum_squares(base, H, ok, CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    """sum_i x_i^2 over the row at `base` (nothing loaded when ok is False), read in CHUNK pieces."""
    offs = tl.arange(0, CHUNK)
    ss = tl.zeros([CHUNK], dtype=tl.float32)
    for i in tl.static_range(NCHUNK):
        o = i * CHUNK + offs
        x = tl.load(base + o, mask=tl.where(ok, o < H, False), other=0.0).to(tl.float32)
        ss += x * x
    return tl.sum(ss, 0)


@triton.jit
def _rounded_embedding(x, wb_ptr, o, m, r1, dt: tl.constexpr):
    """e = round(E[x] * r1 * wb) at offsets o (x: the fp32 embedding values there), back in fp32: the
    trunk's normed embedding, a model-dtype tensor in the reference."""
    wb = tl.load(wb_ptr + o, mask=m, other=0.0).to(tl.float32)
    return (x * r1 * wb).to(dt).to(tl.float32)


@triton.jit
def _embedding_piece(base, wb_ptr, o, m, ok, r1, dt: tl.constexpr):
    """`_rounded_embedding` of the piece at offsets o, read from the table row at `base`."""
    x = tl.load(base + o, mask=tl.where(ok, m, False), other=0.0).to(tl.float32)
    return _rounded_embedding(x, wb_ptr, o, m, r1, dt)


@triton.jit(do_not_specialize_on_alignment=["ids_ptr"])
def _mtp_input_kernel(h_ptr, ids_ptr, table_ptr, wh_ptr, wb_ptr, we_ptr, c_ptr, V, H, h_row, table_row,
                      c_row, eps, CHUNK: tl.constexpr, NCHUNK: tl.constexpr):
    # One row per program, read in NCHUNK pieces of CHUNK lanes. One piece: a single pass. Several:
    # every pass after the first re-reads the row (L1/L2 hits):
    #   half 0:  r = rsqrt(mean(h^2) + eps)                       then c[:H] = h * r * wh
    #   half 1:  r1 from E[x];  e = round(E[x] * r1 * wb);  r2 from e;  then c[H:] = e * r2 * we
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    dt = c_ptr.dtype.element_ty
    if NCHUNK == 1:
        # the whole row in one piece: one pass, the row stays in registers
        m = offs < H
        if tl.program_id(1) == 0:
            x = tl.load(h_ptr + row * h_row + offs, mask=m, other=0.0).to(tl.float32)
            w = tl.load(wh_ptr + offs, mask=m, other=0.0).to(tl.float32)
            r = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
            tl.store(c_ptr + row * c_row + offs, (x * r * w).to(dt), mask=m)
        else:
            tok = tl.load(ids_ptr + row).to(tl.int64)
            ok = (tok >= 0) & (tok < V)
            x = tl.load(table_ptr + tl.where(ok, tok, 0) * table_row + offs, mask=tl.where(ok, m, False),
                        other=0.0).to(tl.float32)
            r1 = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
            e = _rounded_embedding(x, wb_ptr, offs, m, r1, dt)
            r2 = tl.rsqrt(tl.sum(e * e, 0) / H + eps)
            we = tl.load(we_ptr + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(c_ptr + row * c_row + H + offs, tl.where(ok, e * r2 * we, float("nan")).to(dt), mask=m)
    elif tl.program_id(1) == 0:
        base = h_ptr + row * h_row
        r = tl.rsqrt(_sum_squares(base, H, True, CHUNK, NCHUNK) / H + eps)
        for i in tl.static_range(NCHUNK):
            o = i * CHUNK + offs
            m = o < H
            x = tl.load(base + o, mask=m, other=0.0).to(tl.float32)
            w = tl.load(wh_ptr + o, mask=m, other=0.0).to(tl.float32)
            tl.store(c_ptr + row * c_row + o, (x * r * w).to(dt), mask=m)
    else:
        tok = tl.load(ids_ptr + row).to(tl.int64)
        ok = (tok >= 0) & (tok < V)
        base = table_ptr + tl.where(ok, tok, 0) * table_row
        r1 = tl.rsqrt(_sum_squares(base, H, ok, CHUNK, NCHUNK) / H + eps)
        ss = tl.zeros([CHUNK], dtype=tl.float32)
        for i in tl.static_range(NCHUNK):
            o = i * CHUNK + offs
            e = _embedding_piece(base, wb_ptr, o, o < H, ok, r1, dt)
            ss += e * e
        r2 = tl.rsqrt(tl.sum(ss, 0) / H + eps)
        for i in tl.static_range(NCHUNK):
            o = i * CHUNK + offs
            m = o < H
            e = _embedding_piece(base, wb_ptr, o, m, ok, r1, dt)
            we = tl.load(we_ptr + o, mask=m, other=0.0).to(tl.float32)
            tl.store(c_ptr + row * c_row + H + o, tl.where(ok, e * r2 * we, float("nan")).to(dt), mask=m)


def launch_config(H: int, n_rows: int) -> tuple[int, int]:
    """(CHUNK, num_warps): up to DECODE_ROWS rows the whole row as one piece, up to 8 warps (16-32
    elements per thread at the model widths); more rows pieces of at most 2048 lanes, 4 warps."""
    if n_rows <= DECODE_ROWS:
        block = max(16, triton.next_power_of_2(H))
        return block, max(1, min(8, block // 512))
    chunk = min(2048, max(16, triton.next_power_of_2(H)))
    return chunk, max(1, min(4, chunk // 512))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(dtype)


def mtp_input_torch(h_prev: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, hidden_norm: torch.Tensor,
                    backbone_embed_norm: torch.Tensor, embed_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """h_prev: [..., H], ids: [...] -> c: [..., 2H] in h_prev's dtype."""
    e = _rms(_rms(table[ids.long()], backbone_embed_norm, eps, h_prev.dtype), embed_norm, eps, h_prev.dtype)
    return torch.cat([_rms(h_prev, hidden_norm, eps, h_prev.dtype), e], dim=-1)


def mtp_input(h_prev: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, hidden_norm: torch.Tensor,
              backbone_embed_norm: torch.Tensor, embed_norm: torch.Tensor, eps: float,
              out: torch.Tensor | None = None, check_ids: bool = True) -> torch.Tensor:
    """h_prev: [..., H] (depth 0: the trunk's post-final-norm hidden; else the previous depth's output),
    ids: int32/int64 [...] (the tokens x_{p+m+1}), table: [V, H] (the trunk's embedding), norms: [H].
    Returns c: [..., 2H] = [rms(h_prev; hidden_norm) | rms(rms(E[ids]; backbone_embed_norm); embed_norm)],
    written into `out` (contiguous, e.g. the static input buffer of input_proj) when given.
    `check_ids=True` checks the id range on the host (one device sync); pass False inside CUDA graphs."""
    check_tensor("h_prev", h_prev, dtypes=FLOAT_DTYPES)
    need(h_prev.dim() >= 1 and h_prev.shape[-1] > 0 and h_prev.stride(-1) == 1,
         f"h_prev must have a non-empty contiguous last dimension, got shape {tuple(h_prev.shape)} "
         f"strides {h_prev.stride()}")
    check_kernel_device("h_prev", h_prev)
    H, dev, dt = h_prev.shape[-1], h_prev.device, h_prev.dtype
    check_tensor("ids", ids, tuple(h_prev.shape[:-1]), INDEX_DTYPES, dev)
    check_tensor("table", table, dtypes=dt, device=dev)
    need(table.dim() == 2 and table.shape[1] == H and table.stride(1) == 1,
         f"table must be a [V, {H}] tensor with a contiguous last dimension, got {tuple(table.shape)}")
    for name, w in (("hidden_norm", hidden_norm), ("backbone_embed_norm", backbone_embed_norm),
                    ("embed_norm", embed_norm)):
        check_tensor(name, w, (H,), FLOAT_DTYPES, dev, contiguous=True)
    need(isinstance(eps, (int, float)) and eps > 0, f"eps must be a positive number, got {eps!r}")
    V = table.shape[0]
    if check_ids and ids.numel() > 0:
        check_ids_in_range(ids, V)
    out = out_tensor("out", out, tuple(h_prev.shape[:-1]) + (2 * H,), dt, dev)
    try:
        h2 = h_prev.view(-1, H)
    except RuntimeError:
        raise ValueError(f"h_prev (shape {tuple(h_prev.shape)}, strides {h_prev.stride()}) cannot be viewed "
                         "as [rows, H] without a copy") from None
    N = h2.shape[0]
    if N > 0:
        chunk, warps = launch_config(H, N)
        _mtp_input_kernel[(N, 2)](h2, ids.reshape(-1), table, hidden_norm, backbone_embed_norm, embed_norm, out,
                                  V, H, h2.stride(0), table.stride(0), 2 * H, float(eps), CHUNK=chunk,
                                  NCHUNK=triton.cdiv(H, chunk), num_warps=warps)
    return out
