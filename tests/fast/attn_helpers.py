"""Shared pieces of the attention fast-path tests: a reference `Attention` run on a *flat* history
(its LayerCache), and the same history laid out in position-addressed rings and caches.

`build_case` draws, for each batch row b, a random history of n_b positions (keys, values and conv
inputs, exactly as the reference's LayerCache holds them) and T_b new rows, runs the reference
Attention on them (capturing the input of o_proj, i.e. the attention output), and lays out for the
fast path: the projections of the new rows in [B, T] grids (NaN on padding rows), the last `cap`
history keys at row p % cap of a NaN-poisoned KV cache, and the last R conv inputs at row p % R of
NaN-poisoned conv rings, with a shuffled slot per batch row and one unused slot. Tensors live on
DEVICE (CUDA when present, so the small tests also run compiled on a GPU machine).

`AddressCheck` (interpreter only) checks every address a kernel touches against its tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inkling_ref import InklingConfig, LayerCache
from inkling_ref.model.attention import Attention
from inkling_ref.io.config import GLOBAL, SLIDING
from inkling_ref.model.random_init import randomize_

# The small (CI) tests run through the interpreter on CPU and compiled on a GPU machine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class Spec:
    kind: str                 # "sliding" | "global"
    nH: int
    nKV: int
    hd: int
    extent: int               # E; on sliding layers also the window
    d_rel: int = 16
    K: int = 4
    H: int = 64
    log_tau: tuple | None = None   # (n_floor, alpha), global layers only
    eps: float = 1e-6

    @property
    def window(self):
        return self.extent if self.kind == SLIDING else None


def make_ref(spec: Spec, seed: int) -> Attention:
    """A randomized float64 reference Attention (CPU) of the spec's shape."""
    n_floor, alpha = spec.log_tau if spec.log_tau else (None, 0.1)
    cfg = InklingConfig(
        vocab_size=16, unpadded_vocab_size=None, hidden_size=spec.H, num_layers=1,
        num_heads=spec.nH, num_kv_heads=spec.nKV, head_dim=spec.hd, rel_extent=spec.extent,
        swa_num_heads=spec.nH, swa_num_kv_heads=spec.nKV, swa_head_dim=spec.hd, sliding_window=spec.extent,
        d_rel=spec.d_rel, log_scaling_n_floor=n_floor, log_scaling_alpha=alpha, layer_types=[spec.kind],
        mlp_types=["dense"], dense_intermediate_size=8, conv_kernel_size=spec.K, rms_norm_eps=spec.eps,
        max_position_embeddings=1 << 20)
    attn = Attention(cfg, spec.kind, apply_log_tau=spec.log_tau is not None)
    assert (attn.n_floor is not None) == (spec.log_tau is not None and spec.kind == GLOBAL)
    return randomize_(attn.to(torch.float64), seed).eval()


# The GPU tests' real head counts (Inkling-Small 32/8, Inkling 64/8 global and 64/16 sliding; hd 128;
# windows 512, extents 512 / 1024, log-tau from position 256).
REAL = {
    "small-sliding-32/8": Spec("sliding", 32, 8, 128, 512, H=512),
    "small-global-32/8": Spec("global", 32, 8, 128, 1024, H=512, log_tau=(256, 0.1)),
    "inkling-global-64/8": Spec("global", 64, 8, 128, 1024, H=512, log_tau=(256, 0.1)),
    "inkling-sliding-64/16": Spec("sliding", 64, 16, 128, 512, H=512),
}


@dataclass
class Case:
    spec: Spec
    ref: Attention            # reference module (ref dtype, on the device)
    # fast-path inputs
    q: torch.Tensor           # [B, T, nH*hd]
    k_in: torch.Tensor        # [B, T, nKV*hd]
    v_in: torch.Tensor
    r: torch.Tensor           # [B, T, nH*d_rel]
    weights: dict             # q_norm, k_norm, k_conv, v_conv, rel_proj (fast dtype)
    k_ring: torch.Tensor      # [slots, R, C]
    v_ring: torch.Tensor
    k_cache: torch.Tensor     # [slots, cap, nKV, hd]
    v_cache: torch.Tensor
    slot: torch.Tensor        # int32 [B]
    pos: torch.Tensor         # int32 [B, T]
    # reference results (ref dtype)
    out: torch.Tensor         # [B, T, nH, hd] attention output (NaN on padding rows)
    k_new: torch.Tensor       # [B, T, nKV, hd] convolved + normed keys of the new rows (NaN on padding)
    v_new: torch.Tensor

    @property
    def valid(self):
        return self.pos >= 0

    def prep_kwargs(self):
        s = self.spec
        log_tau = s.log_tau if s.kind == GLOBAL else None
        return dict(**self.weights, k_ring=self.k_ring, v_ring=self.v_ring, k_cache=self.k_cache,
                    v_cache=self.v_cache, slot=self.slot, pos=self.pos, eps=s.eps, log_tau=log_tau)

    def clone_state(self):
        """Fresh copies of the mutable state (rings, caches) so two paths can run from the same start."""
        return {n: getattr(self, n).clone() for n in ("k_ring", "v_ring", "k_cache", "v_cache")}


def build_case(spec: Spec, lengths: list[int], rows: list[int], T: int, *, dtype=torch.float32,
               ref_dtype=torch.float64, device=DEVICE, seed=0, cap: int | None = None, R: int | None = None,
               left_pad: bool = False) -> Case:
    """lengths[b]: history length n_b of batch row b; rows[b] <= T: its number of new (valid) rows.
    All parameters and history values are rounded to `dtype` first, so the reference (in ref_dtype)
    and the fast path (in dtype) see the same numbers; the projections are computed by the
    reference in ref_dtype and rounded to dtype for the fast path."""
    B = len(lengths)
    g = torch.Generator().manual_seed(seed)
    ref = make_ref(spec, seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
    ref = ref.to(device=device, dtype=ref_dtype)
    nH, nKV, hd, C, K = spec.nH, spec.nKV, spec.hd, spec.nKV * spec.hd, spec.K
    if cap is None:
        cap = spec.window + T if spec.kind == SLIDING else max(n + T for n in lengths) + 3
    if R is None:
        R = K - 1 + T
    slots = B + 1
    nan = float("nan")

    g_dev = torch.Generator(device=device).manual_seed(seed)   # large histories are drawn on the device

    def rnd(*shape):
        x = torch.randn(*shape, generator=g_dev, device=device, dtype=torch.float64 if ref_dtype == torch.float64
                        else torch.float32)
        return x.to(dtype).to(ref_dtype)

    perm = torch.randperm(slots, generator=g)[:B]
    slot = perm.to(torch.int32).to(device)
    pos = torch.full((B, T), -1, dtype=torch.int32, device=device)
    grid = {n: torch.full((B, T, w), nan, dtype=dtype, device=device)
            for n, w in (("q", nH * hd), ("k_in", C), ("v_in", C), ("r", nH * spec.d_rel))}
    out = torch.full((B, T, nH, hd), nan, dtype=ref_dtype, device=device)
    k_new = torch.full((B, T, nKV, hd), nan, dtype=ref_dtype, device=device)
    v_new = torch.full_like(k_new, nan)
    k_cache = torch.full((slots, cap, nKV, hd), nan, dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, nan)
    k_ring = torch.full((slots, R, C), nan, dtype=dtype, device=device)
    v_ring = torch.full_like(k_ring, nan)

    captured = {}
    hook = ref.o_proj.register_forward_pre_hook(lambda mod, args: captured.__setitem__("a", args[0]))
    try:
        for b, (n, Tb) in enumerate(zip(lengths, rows)):
            assert 0 <= Tb <= T
            s = int(perm[b])
            cache = LayerCache()
            if n:
                cache = LayerCache(keys=rnd(1, nKV, n, hd), values=rnd(1, nKV, n, hd),
                                   k_conv_in=rnd(1, n, C), v_conv_in=rnd(1, n, C))
                keep = torch.arange(max(0, n - cap), n)
                k_cache[s, keep % cap] = cache.keys[0, :, keep].transpose(0, 1).to(dtype)
                v_cache[s, keep % cap] = cache.values[0, :, keep].transpose(0, 1).to(dtype)
                keep = torch.arange(max(0, n - R), n)
                k_ring[s, keep % R] = cache.k_conv_in[0, keep].to(dtype)
                v_ring[s, keep % R] = cache.v_conv_in[0, keep].to(dtype)
            if Tb == 0:
                continue
            x = rnd(1, Tb, spec.H)
            t0 = T - Tb if left_pad else 0
            tt = slice(t0, t0 + Tb)
            with torch.no_grad():
                grid["q"][b, tt] = ref.q_proj(x)[0].to(dtype)
                grid["k_in"][b, tt] = ref.k_proj(x)[0].to(dtype)
                grid["v_in"][b, tt] = ref.v_proj(x)[0].to(dtype)
                grid["r"][b, tt] = ref.r_proj(x)[0].to(dtype)
                ref(x, cache)
            out[b, tt] = captured["a"][0].view(Tb, nH, hd)
            k_new[b, tt] = cache.keys[0, :, n:].transpose(0, 1)
            v_new[b, tt] = cache.values[0, :, n:].transpose(0, 1)
            pos[b, tt] = torch.arange(n, n + Tb, dtype=torch.int32, device=device)
    finally:
        hook.remove()

    weights = dict(q_norm=ref.q_norm.weight.detach().to(dtype), k_norm=ref.k_norm.weight.detach().to(dtype),
                   k_conv=ref.k_conv.weight.detach()[:, 0].to(dtype).contiguous(),
                   v_conv=ref.v_conv.weight.detach()[:, 0].to(dtype).contiguous(),
                   rel_proj=ref.rel_proj.detach().to(dtype).contiguous())
    return Case(spec, ref, grid["q"], grid["k_in"], grid["v_in"], grid["r"], weights, k_ring, v_ring, k_cache,
                v_cache, slot, pos, out, k_new, v_new)


class AddressCheck:
    """Under TRITON_INTERPRET=1: checks every address a kernel loads or stores (its unmasked lanes)
    against the byte ranges of the given tensors and raises IndexError naming the first address that
    lies in none of them. The interpreter itself reads and writes raw memory without any check, so an
    out-of-range offset there is silent (or a segfault); on the GPU it is an illegal memory access.

        with AddressCheck([q, rel, k_cache, ...]) as chk:
            attention_decode(...)
        chk.loads, chk.stores   # unmasked lanes checked (proves the check ran)

    allow_new=True also allows the tensors that torch.empty / torch.empty_like create inside the
    block (a wrapper's own buffers: split-KV partials, default outputs).
    """

    def __init__(self, tensors, allow_new: bool = False):
        self.ranges = [self._range(t) for t in tensors]
        self.allow_new = allow_new
        self.loads = self.stores = 0

    @staticmethod
    def _range(t):
        assert t.is_contiguous(), "AddressCheck: tensors must be contiguous"
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    def _check(self, kind, ptrs, mask):
        from triton.runtime.interpreter import _get_np_dtype
        addr = ptrs.data[np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)].astype(np.uint64)
        if addr.size == 0:
            return 0
        nbytes = np.dtype(_get_np_dtype(ptrs.get_element_ty())).itemsize
        ok = np.zeros(addr.shape, dtype=bool)
        for lo, hi in self.ranges:
            ok |= (addr >= lo) & (addr + nbytes <= hi)
        if not ok.all():
            bad = int(addr[~ok][0])
            raise IndexError(f"{kind} of {int((~ok).sum())} lanes outside every tensor, e.g. address {bad:#x}; "
                             f"tensor ranges {[(hex(lo), hex(hi)) for lo, hi in self.ranges]}")
        return addr.size

    def __enter__(self):
        from triton.runtime import interpreter
        self._builder = interpreter.InterpreterBuilder
        self._orig = (self._builder.create_masked_load, self._builder.create_masked_store)
        load, store = self._orig
        chk = self

        def checked_load(b, ptrs, mask, other, *args):
            chk.loads += chk._check("load", ptrs, mask)
            return load(b, ptrs, mask, other, *args)

        def checked_store(b, ptrs, value, mask, *args):
            chk.stores += chk._check("store", ptrs, mask)
            return store(b, ptrs, value, mask, *args)

        self._builder.create_masked_load, self._builder.create_masked_store = checked_load, checked_store
        self._empty = (torch.empty, torch.empty_like)
        if self.allow_new:
            def tracked(make):
                def new(*args, **kwargs):
                    x = make(*args, **kwargs)
                    chk.ranges.append(chk._range(x))
                    return x
                return new
            torch.empty, torch.empty_like = tracked(torch.empty), tracked(torch.empty_like)
        return self

    def __exit__(self, *exc):
        self._builder.create_masked_load, self._builder.create_masked_store = self._orig
        torch.empty, torch.empty_like = self._empty
        return False
