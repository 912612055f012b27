"""What every kernel module shares: the interpreter flag, dtype sets, six small Triton helpers and
the argument checks of the wrappers.

    interpreting()                     Triton runs kernels on the CPU (TRITON_INTERPRET), as Triton reads it
    FLOAT_DTYPES, INDEX_DTYPES, PROB_DTYPES
    round_to(x, dtype, FIX_BF16)       @triton.jit: x.to(dtype) rounded to nearest even, also in the interpreter
    both(mask, flag)                   @triton.jit: a vector mask AND a scalar flag
    dot(a, b, acc, FP32_DOT)           @triton.jit: acc + a @ b with float32 accumulation
    k_tile_masks(...)                  @triton.jit: the load masks of one K tile of A and of B
    k_loop(acc, a_ptrs, b_ptrs, ...)   @triton.jit: acc + A @ B over a whole K axis, tile by tile, masked
    k_loop_pair(...)                   @triton.jit: the same for two A operands that share one B
    pipeline_stages(stages, nbytes)    num_stages of a K loop, capped so its buffers fit shared memory
    need(ok, msg)                      raise ValueError(msg) unless ok
    check_tensor(name, t, ...)         one clear ValueError naming the argument and what would be valid
    out_tensor(name, t, shape, ...)    a given output buffer checked, or a new one
    check_kernel_device(name, t)       CUDA tensors, or CPU tensors under the interpreter
    starts_like(t, *others)            t begins where one of the others begins (an aliased output)
    refuse_sync_in_capture(flag)       a host-side check (a device sync) asked for inside a CUDA graph capture
    check_ids_in_range(ids, V)         host-side: every token id in [0, V)

Interpreter workarounds (taken only when `interpreting()`; the compiled GPU kernels never see them):
the CPU interpreter converts float32 -> bfloat16 by truncation where the GPU rounds to nearest even,
multiplies bf16 `tl.dot` operands wrongly, and rejects `vector_mask & scalar_bool` as a load mask.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # activations, weights, caches
INDEX_DTYPES = (torch.int32, torch.int64)                       # token ids, draft ids, counts
PROB_DTYPES = (torch.float32, torch.float64)                    # probabilities the samplers read

_TRUTHY = ("1", "y", "yes", "on", "true")   # Triton's own spellings (its getenv_bool), any case


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter: TRITON_INTERPRET read exactly as
    Triton reads it (`triton.knobs.runtime.interpret`: 1, y, yes, on or true, in any case); Triton
    versions without `triton.knobs` get the same rule from the environment."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUTHY


# ----------------------------------------------------------------------------------------------- Triton helpers
@triton.jit
def round_to(x, dtype: tl.constexpr, FIX_BF16: tl.constexpr):
    """x (float32).to(dtype), rounding to nearest even. FIX_BF16 (pass `interpreting()`): round the
    float32 bits first, so that the interpreter's truncating conversion is then exact."""
    if FIX_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def both(vec_mask, flag):
    """vec_mask & flag for a scalar flag, spelled with where (the interpreter rejects the `&` form)."""
    return tl.where(flag, vec_mask, False)


@triton.jit
def dot(a, b, acc, FP32_DOT: tl.constexpr):
    """acc + a @ b in float32. FP32_DOT: the operands are upcast and multiplied exactly
    (input_precision="ieee", not tf32): for float32 or mixed operands, and for bf16/fp16 ones under
    the interpreter (exact: bf16 -> fp32). Otherwise bf16/fp16 operands go to the tensor cores."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def k_tile_masks(a_ok, b_ok, kk, k0, K, EVEN_K: tl.constexpr):
    """Load masks of the K tile starting at k0: A's [M, BLOCK_K] (rows a_ok) and B's [BLOCK_K, N]
    (columns b_ok); EVEN_K (K % BLOCK_K == 0) leaves out the K bound, which every tile then meets."""
    if EVEN_K:
        a_mask = a_ok[:, None]
        b_mask = b_ok[None, :]
    else:
        k_ok = (k0 + kk) < K
        a_mask = a_ok[:, None] & k_ok[None, :]
        b_mask = k_ok[:, None] & b_ok[None, :]
    return a_mask, b_mask


@triton.jit
def k_loop(acc, a_ptrs, b_ptrs, a_ok, b_ok, kk, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
           FP32_DOT: tl.constexpr):
    """acc [M, N] + A [M, K] @ B [K, N], BLOCK_K columns of K at a time: the K loop of every matmul
    kernel here. a_ptrs [M, BLOCK_K] and b_ptrs [BLOCK_K, N] address the first K tile, with K at
    stride 1 in both, so tile k0 is `ptrs + k0`; kk = tl.arange(0, BLOCK_K). Rows of A outside a_ok,
    columns of B outside b_ok and K beyond K load as 0."""
    for k0 in range(0, K, BLOCK_K):
        a_mask, b_mask = k_tile_masks(a_ok, b_ok, kk, k0, K, EVEN_K)
        a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
        acc = dot(a, tl.load(b_ptrs + k0, mask=b_mask, other=0.0), acc, FP32_DOT)
    return acc


@triton.jit
def k_loop_pair(acc1, acc2, a1_ptrs, a2_ptrs, b_ptrs, a_ok, b_ok, kk, K, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, FP32_DOT: tl.constexpr):
    """`k_loop` for two A operands with the same rows and one shared B (the gate and up projections
    of a SwiGLU over the same tokens): each B tile is loaded once for both products."""
    for k0 in range(0, K, BLOCK_K):
        a_mask, b_mask = k_tile_masks(a_ok, b_ok, kk, k0, K, EVEN_K)
        a1 = tl.load(a1_ptrs + k0, mask=a_mask, other=0.0)
        a2 = tl.load(a2_ptrs + k0, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs + k0, mask=b_mask, other=0.0)
        acc1 = dot(a1, b, acc1, FP32_DOT)
        acc2 = dot(a2, b, acc2, FP32_DOT)
    return acc1, acc2


# ----------------------------------------------------------------------------------------------- launch configs
SMEM_BYTES = 160 * 1024   # shared memory a K loop's pipeline buffers may take (Hopper: 227 KB per block)


def pipeline_stages(stages: int, bytes_per_stage: int) -> int:
    """num_stages for a K loop whose every stage buffers `bytes_per_stage` bytes of operand tiles in
    shared memory: `stages`, fewer where that many would not fit SMEM_BYTES (the rest of the block's
    shared memory is left to the epilogue and layout conversions), at least 1. Launch configurations
    are chosen by such rules, not by autotuning: an autotuner compiles and benchmarks every
    candidate on a kernel's first call in each process, which costs seconds of setup per kernel."""
    return max(1, min(stages, SMEM_BYTES // bytes_per_stage))


# ----------------------------------------------------------------------------------------------- checks
def need(ok: bool, msg: str) -> None:
    """Raise ValueError(msg) unless ok: a wrapper's one-line error for a bad argument."""
    if not ok:
        raise ValueError(msg)


def _names(dtypes) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, t, shape: tuple | None = None, dtypes=None, device=None,
                 contiguous: bool = False) -> None:
    """ValueError naming `name` unless t is a tensor with this shape, one of these dtypes (a dtype or
    a tuple), on this device, and contiguous if asked. None skips a check."""
    if isinstance(dtypes, torch.dtype):
        dtypes = (dtypes,)
    if not isinstance(t, torch.Tensor):
        what = f"a {_names(dtypes)} tensor" if dtypes else "a tensor"
        shape_txt = f" of shape {tuple(shape)}" if shape is not None else ""
        raise ValueError(f"{name} must be {what}{shape_txt}, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; {name} must be {_names(dtypes)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


def out_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The output buffer `t` (e.g. a CUDA graph's static one) checked to be a contiguous `dtype`
    tensor of `shape` on `device`, or a new one when t is None."""
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor(name, t, shape, dtype, device, contiguous=True)
    return t


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """The Triton kernels need CUDA tensors; CPU tensors only under the interpreter."""
    if t.device.type != "cuda" and not (t.device.type == "cpu" and interpreting()):
        raise ValueError(f"{name} is on {t.device}: the Triton kernels need CUDA tensors "
                         "(CPU tensors only under TRITON_INTERPRET=1)")


def starts_like(t: torch.Tensor, *others: torch.Tensor) -> bool:
    """t begins at the address where one of `others` begins (an output that would overwrite an input
    other programs still read)."""
    if t.numel() == 0:
        return False
    return t.data_ptr() in [o.data_ptr() for o in others]


def refuse_sync_in_capture(flag: str) -> None:
    """RuntimeError when the current stream is capturing a CUDA graph: the host-side check asked for
    by `flag`=True would synchronize with the device, which a capture cannot contain."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{flag}=True syncs with the device; pass {flag}=False inside a CUDA graph")


def check_ids_in_range(ids: torch.Tensor, V: int) -> None:
    """Host-side check (one device sync) that every id lies in [0, V): ValueError with a few bad ones."""
    refuse_sync_in_capture("check_ids")
    bad = (ids < 0) | (ids >= V)
    if bool(bad.any()):
        raise ValueError(f"ids out of range [0, {V}): e.g. {ids[bad][:4].tolist()}")
