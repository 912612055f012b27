"""Relative-bias attention over the position-addressed KV cache: decode (T = 1) and verify/draft
windows (T = k + 1), with split-KV (flash-decoding) for long contexts.

Inputs are what `attention_prep` produced: q' [B, T, nH, hd] (q-normed, tau-scaled), L_rel'
[B, T, nH, E] (fp32, tau-scaled), and the caches k/v [slots, cap, nKV, hd] holding every position
up to each row's last one (position j at row j % cap). For the query row at position p, head h
(KV head g = h // G, G = nH / nKV) and key position j:

    logit(p, j) = q'_p . k_j / hd  +  L_rel'[p, h, p - j] * [p - j < E]
    visible     = j <= p  and  (sliding: j > p - window)  and  p >= 0
    out[p, h]   = softmax_j(logit) @ v

Kernel design:

* **One program per (batch row, KV head, KV split)**; it holds all G query heads and all T window
  rows as the M = T*G rows of one tile (row m = (t, i), head h = g*G + i), so each K/V tile is
  loaded once per KV head and used for the whole window. M is padded to a power of two >= 16 (the
  smallest tl.dot); decode of Inkling-Small uses 4 of 16 rows, a T = 9 window 36 of 64.
* **Key range.** The program's keys are [k_lo, k_hi] = [min over rows of the first visible key,
  max over rows of p]; per-row causal/window masks cut each row's part. Split s of S takes the s-th
  BLOCK_N-aligned chunk of that range, so S is a launch constant while the work follows each row's
  actual length (splits past the end write an empty partial and stop).
* **Bias band.** Keys older than p_min - E + 1 carry no bias for any row: the loop runs in two
  parts, the first without touching L_rel, the second (the band, at most E + T - 1 keys) gathering
  L_rel'[row, p - j] (a contiguous run per row, read once).
* **Online softmax** in base 2 (scores times log2(e)), fp32 accumulators; rows that have seen no
  visible key yet keep m = -inf without producing NaN; padding rows (pos = -1) mask every key and
  store nothing.
* **Split-KV**: each split writes its normalized partial output and its log-sum-exp (fp32
  [B, T, nH, S, hd] and [B, T, nH, S]); `_merge_kernel` combines them with weights
  2^(lse_s - max_s lse) (empty splits have lse = -inf and weight 0). S = 1 writes `out` directly.
  `choose_num_splits` picks S from host-known sizes only (batch, KV heads, the largest possible key
  count, the SM count) so a CUDA graph sees one S per shape: as many programs as fit one wave of
  two per SM, at least MIN_SPLIT_KEYS keys per split.
* **Query tiles.** The same kernel tiles long query ranges (prefill, attention_prefill.py): grid
  axis 2 is (query tile, split); with FLAT_KV the call's own keys are read from flat [B, T, nKV, hd]
  tensors instead of the cache (history keys still come from the cache).
* dots: bf16/fp16 operands with fp32 accumulation; fp32 operands with input_precision="ieee"
  (exact fp32, the fast-path convention). The probabilities are rounded to the value dtype before
  the P @ V dot (bf16: the usual flash-attention rounding).
* Interpreter (CI) only, constexpr INTERPRET: the dot operands are upcast to fp32 and the output is
  rounded to nearest even by hand (`round_to`), the CPU interpreter's bf16 dot and conversion being
  wrong (inkling_fast/kernels/common.py). The compiled GPU kernel takes neither branch.

The wrapper validates shapes/dtypes/devices and, for sliding layers, cap >= window + T - 1 (the
ring must hold the oldest key of the first row and the newest of the last). Positions are not
inspected on the host: a global layer's cap must exceed every position.

Copy with it: common.py (kernels/; nothing else beyond torch and triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FLOAT_DTYPES, both, interpreting, need, out_tensor, round_to

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 128   # fewest keys worth a split of their own
MAX_SPLITS = 64
_SM_COUNT: dict = {}


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _attend_tile(acc, m_i, l_i, q, start, end, b, s, g, d, dmask, rows, row_ok, p_m, lo_m,
                 k_ptr, v_ptr, kf_ptr, vf_ptr, rel_ptr, pos_ptr, T, CAP, E, off, qk_scale,
                 NKV: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                 HAS_BIAS: tl.constexpr, FLAT_KV: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """One BLOCK_N tile of keys start..min(start+BLOCK_N, end)-1 for all M rows (online softmax)."""
    j = start + tl.arange(0, BLOCK_N)
    jm = j < end
    kv_mask = jm[:, None] & dmask[None, :]
    cache_off = ((s * CAP + j % CAP) * NKV + g) * HD
    if FLAT_KV:
        fr = j - off                                   # the call's row that may hold key j
        fm = jm & (fr >= 0) & (fr < T)
        inc = fm & (tl.load(pos_ptr + b * T + fr, mask=fm, other=-1) == j)
        flat_off = ((b * T + fr).to(tl.int64) * NKV + g) * HD
        cm = kv_mask & (inc == 0)[:, None]
        fmask = kv_mask & inc[:, None]
        kt = (tl.load(k_ptr + cache_off[:, None] + d[None, :], mask=cm, other=0.0)
              + tl.load(kf_ptr + flat_off[:, None] + d[None, :], mask=fmask, other=0.0))
        vt = (tl.load(v_ptr + cache_off[:, None] + d[None, :], mask=cm, other=0.0)
              + tl.load(vf_ptr + flat_off[:, None] + d[None, :], mask=fmask, other=0.0))
    else:
        kt = tl.load(k_ptr + cache_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(v_ptr + cache_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if INTERPRET:
        sc = tl.dot(q.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(kt), input_precision=PREC)
    sc = sc * qk_scale
    vis = row_ok[:, None] & jm[None, :] & (j[None, :] <= p_m[:, None]) & (j[None, :] >= lo_m[:, None])
    if HAS_BIAS:
        dist = p_m[:, None] - j[None, :]
        bias = tl.load(rel_ptr + rows[:, None] * E + dist, mask=vis & (dist < E), other=0.0)
        sc += bias * 1.4426950408889634
    sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if INTERPRET:
        pv = tl.dot(pr, vt.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(pr.to(vt.dtype), vt, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["T", "NUM_SPLITS"])
def _attention_kernel(
    q_ptr, rel_ptr, k_ptr, v_ptr, kf_ptr, vf_ptr, out_ptr, part_o_ptr, part_lse_ptr, slot_ptr, pos_ptr,
    T, CAP, E, WINDOW, qk_scale, NUM_SPLITS,
    NKV: tl.constexpr, G: tl.constexpr, HD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, FLAT_KV: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    qt = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    NH = NKV * G
    BIG = 1 << 30

    m = tl.arange(0, BLOCK_M)
    tq = m // G                                        # window row within this query tile
    t = qt * BLOCK_T + tq
    row_ok = (tq < BLOCK_T) & (t < T)
    p_m = tl.load(pos_ptr + b * T + t, mask=row_ok, other=-1)
    row_ok = row_ok & (p_m >= 0)
    h = g * G + m % G
    rows = (b * T + t).to(tl.int64) * NH + h           # flat index of (b, t, h)
    if HAS_WINDOW:
        lo_m = tl.maximum(p_m - WINDOW + 1, 0)
    else:
        lo_m = tl.zeros([BLOCK_M], dtype=tl.int32)

    # keys of this program: split `split` of [k_lo, k_hi]; keys >= band may carry a bias
    k_hi = tl.max(tl.where(row_ok, p_m, -1), 0)
    k_lo = tl.min(tl.where(row_ok, lo_m, BIG), 0)
    p_min = tl.min(tl.where(row_ok, p_m, BIG), 0)
    n_keys = tl.maximum(k_hi + 1 - k_lo, 0)
    chunk = (n_keys + NUM_SPLITS - 1) // NUM_SPLITS
    chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    s_lo = k_lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, k_hi + 1)
    band = tl.minimum(tl.maximum(p_min - E + 1, s_lo), s_hi)
    if FLAT_KV:
        off = tl.max(tl.where(row_ok, p_m - t, -BIG), 0)   # position - row, the same for every valid row
    else:
        off = 0

    d = tl.arange(0, BLOCK_D)
    if HD == BLOCK_D:   # a constant mask keeps the K/V loads 16-byte vectors (d < HD is not known constant)
        dmask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dmask = d < HD
    s = tl.load(slot_ptr + b).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * HD + d[None, :], mask=row_ok[:, None] & dmask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(s_lo, band, BLOCK_N):           # beyond every row's extent: no bias
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, band, b, s, g, d, dmask, rows, row_ok, p_m,
                                     lo_m, k_ptr, v_ptr, kf_ptr, vf_ptr, rel_ptr, pos_ptr, T, CAP, E, off,
                                     qk_scale, NKV, HD, BLOCK_N, False, FLAT_KV, PREC, INTERPRET)
    for start in range(band, s_hi, BLOCK_N):           # the band: L_rel gathered per row
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, start, s_hi, b, s, g, d, dmask, rows, row_ok, p_m,
                                     lo_m, k_ptr, v_ptr, kf_ptr, vf_ptr, rel_ptr, pos_ptr, T, CAP, E, off,
                                     qk_scale, NKV, HD, BLOCK_N, True, FLAT_KV, PREC, INTERPRET)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = row_ok[:, None] & dmask[None, :]
    if SPLIT:
        part = rows * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HD + d[None, :], o, mask=omask)
        tl.store(part_lse_ptr + part, tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
    else:
        tl.store(out_ptr + rows[:, None] * HD + d[None, :], round_to(o, out_ptr.dtype.element_ty, INTERPRET),
                 mask=omask)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _merge_kernel(part_o_ptr, part_lse_ptr, out_ptr, pos_ptr, NUM_SPLITS, NH: tl.constexpr, HD: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """out[row, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M), M = max_s lse_s.
    The position, the log-sum-exps and the partials are loaded together (one round trip to memory:
    this kernel is pure latency at decode sizes). A padding row's partials were never written: they are
    selected away (lse -> -inf, o -> 0) before any arithmetic, so that whatever the buffers held (inf
    included) computes nothing, and the row stores nothing."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    ok = tl.load(pos_ptr + row) >= 0
    sidx = tl.arange(0, BLOCK_S)
    sm = sidx < NUM_SPLITS
    base = (row.to(tl.int64) * NH + h) * NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    lse = tl.load(part_lse_ptr + base + sidx, mask=sm, other=float("-inf"))
    o = tl.load(part_o_ptr + (base + sidx)[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
    lse = tl.where(ok, lse, float("-inf"))
    o = tl.where(ok, o, 0.0)
    mx = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx))
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + (row.to(tl.int64) * NH + h) * HD + d, round_to(res, out_ptr.dtype.element_ty, INTERPRET),
             mask=both(dm, ok))


# ----------------------------------------------------------------------------------------------- launch
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (4 stands in for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(programs: int, max_keys: int, sms: int) -> int:
    """Splits per (batch row, KV head, query tile): as many as keep every program in ONE wave of
    2 programs per SM (the decode tile's shared memory allows two), with at least MIN_SPLIT_KEYS keys
    per split. `programs` = B * nKV * query tiles, `max_keys` = the most keys one program can have
    (cap for global layers, window + T - 1 for sliding ones). The count is rounded down, not up: a
    few programs past one wave make a second wave that takes as long as the first. Host-known sizes
    only, so a CUDA graph sees one split count per shape."""
    return max(1, min(2 * sms // programs, triton.cdiv(max_keys, MIN_SPLIT_KEYS), MAX_SPLITS))


def validate_attention_args(q, rel, k_cache, v_cache, slot, pos, window):
    """Shared checks of the decode and prefill wrappers; returns (B, T, nH, hd, nKV, cap, E)."""
    need(isinstance(q, torch.Tensor) and q.dim() == 4, "q: expected [B, T, nH, hd] (attention_prep's q)")
    B, T, nH, hd = q.shape
    need(k_cache.dim() == 4 and tuple(v_cache.shape) == tuple(k_cache.shape),
         f"k_cache/v_cache: expected equal shapes [slots, cap, nKV, hd], got {tuple(k_cache.shape)} and "
         f"{tuple(v_cache.shape)}")
    slots, cap, nKV, hd_c = k_cache.shape
    need(hd_c == hd, f"q: head_dim {hd} differs from the cache's {hd_c}")
    need(nH % nKV == 0, f"q: {nH} query heads is not a multiple of the cache's {nKV} KV heads")
    need(rel.dim() == 4 and tuple(rel.shape[:3]) == (B, T, nH),
         f"rel: expected [B={B}, T={T}, nH={nH}, E], got {tuple(rel.shape)}")
    E = rel.shape[3]
    need(rel.dtype == torch.float32, f"rel: expected float32 (L_rel), got {rel.dtype}")
    need(q.dtype in FLOAT_DTYPES, f"q: dtype {q.dtype} not supported (bf16, fp16, fp32)")
    need(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
         f"k_cache/v_cache: dtypes {k_cache.dtype}/{v_cache.dtype} differ from q's {q.dtype}")
    need(tuple(pos.shape) == (B, T) and pos.dtype == torch.int32, f"pos: expected int32 [B={B}, T={T}]")
    need(tuple(slot.shape) == (B,) and slot.dtype == torch.int32, f"slot: expected int32 [B={B}]")
    for name, x in (("q", q), ("rel", rel), ("k_cache", k_cache), ("v_cache", v_cache), ("slot", slot),
                    ("pos", pos)):
        need(x.device == q.device, f"{name}: on {x.device}, q is on {q.device}")
        need(x.is_contiguous(), f"{name}: must be contiguous")
    if window is not None:
        need(isinstance(window, int) and window >= 1, f"window: expected a positive int or None, got {window!r}")
    return B, T, nH, hd, nKV, cap, E


def launch_config(BLOCK_M: int, BLOCK_D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for a tile of BLOCK_M query rows (T * G, padded) by hd.
    bf16: decode and windows up to 32 rows take 64-key tiles, 4 warps, 3 stages (two programs fit an
    SM); 64-row windows 32-key tiles (the score tile grows with M); the 128-row query tiles of prefill
    32 keys, 8 warps, 2 stages. Tiny head dims (CI): short tiles, so that short contexts span several.
    fp32 (IEEE dots run on FMA units, the test path): 16-key tiles, no pipelining, so that the tiles
    fit shared memory."""
    if dtype == torch.float32:
        return 16, 4 if BLOCK_M <= 16 else 8, 1
    if BLOCK_D <= 32:       # tiny head dims (CI): short tiles so that short contexts span several
        return 16, 4, 2
    if BLOCK_M <= 32:
        return 64, 4, 3
    if BLOCK_M <= 64:
        return 32, 4, 3
    return 32, 8, 2


def launch_attention(q, rel, k_cache, v_cache, k_flat, v_flat, slot, pos, window, num_splits, out, block_t):
    """Launch `_attention_kernel` (+ `_merge_kernel` when num_splits > 1). Arguments already validated."""
    B, T, nH, hd = q.shape
    nKV, cap, E = k_cache.shape[2], k_cache.shape[1], rel.shape[3]
    G = nH // nKV
    BLOCK_D = max(16, triton.next_power_of_2(hd))
    BLOCK_M = max(16, triton.next_power_of_2(block_t * G))
    BLOCK_N, num_warps, num_stages = launch_config(BLOCK_M, BLOCK_D, q.dtype)
    n_qt = triton.cdiv(T, block_t)
    if B * T == 0:
        return out
    split = num_splits > 1
    interp = interpreting()
    if split:
        part_o = torch.empty((B, T, nH, num_splits, hd), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, T, nH, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out
    flat = k_flat is not None
    _attention_kernel[(B, nKV, n_qt * num_splits)](
        q, rel, k_cache, v_cache, k_flat if flat else k_cache, v_flat if flat else v_cache, out, part_o, part_lse,
        slot, pos, T, cap, E, window if window is not None else 0, LOG2E / hd, num_splits,
        NKV=nKV, G=G, HD=hd, BLOCK_T=block_t, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        HAS_WINDOW=window is not None, FLAT_KV=flat, SPLIT=split,
        PREC="ieee" if q.dtype == torch.float32 else None, INTERPRET=interp,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_kernel[(B * T, nH)](part_o, part_lse, out, pos, num_splits, NH=nH, HD=hd,
                                   BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=BLOCK_D,
                                   INTERPRET=interp, num_warps=4)
    return out


def attention_decode(q, rel, k_cache, v_cache, slot, pos, *, window: int | None = None,
                     num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, T, nH, hd] (q-normed, tau-scaled), rel: [B, T, nH, E] fp32 (tau-scaled L_rel),
    k_cache/v_cache: [slots, cap, nKV, hd] holding every key up to each row's last position (write
    them with attention_prep first), slot: int32 [B], pos: int32 [B, T] (-1 = padding), window: the
    sliding window (None = global, full causal). Returns out [B, T, nH, hd] (padding rows untouched).
    num_splits: None chooses from the sizes (`choose_num_splits`); 1 disables split-KV."""
    B, T, nH, hd, nKV, cap, E = validate_attention_args(q, rel, k_cache, v_cache, slot, pos, window)
    if window is not None:
        need(cap >= window + T - 1, f"k_cache: a sliding ring of cap={cap} rows cannot hold the window={window} "
             f"keys of the first row and the T={T} rows of the call: need cap >= window + T - 1 = {window + T - 1}")
    G = nH // nKV
    block_t = T if T * G <= 128 else max(1, 128 // G)
    max_keys = min(cap, window + T - 1) if window is not None else cap
    if num_splits is None:
        num_splits = choose_num_splits(B * nKV * triton.cdiv(T, block_t), max_keys, sm_count(q.device))
    need(isinstance(num_splits, int) and 1 <= num_splits <= 1024, f"num_splits: expected 1..1024, got {num_splits!r}")
    out = out_tensor("out", out, tuple(q.shape), q.dtype, q.device)
    return launch_attention(q, rel, k_cache, v_cache, None, None, slot, pos, window, num_splits, out, block_t)


# ----------------------------------------------------------------------------------------------- twin
def attend_torch(q, rel, keys, values, key_pos, pos, window=None, max_elems: int = 2**28):
    """Vectorized attention of the query rows over explicit keys (the twins' core).

    q: [B, T, nH, hd], rel: [B, T, nH, E], keys/values: [B, n, nKV, hd] at positions key_pos [B, n]
    (-1 = no key), pos: [B, T]. Softmax in fp32 (fp64 for fp64 inputs); rows without a visible key
    (padding) return zeros. Query rows are processed in chunks of at most `max_elems` scores."""
    B, T, nH, hd = q.shape
    n, nKV, E = keys.shape[1], keys.shape[2], rel.shape[-1]
    G = nH // nKV
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    kv_ok = key_pos >= 0
    zero = torch.zeros((), dtype=keys.dtype, device=keys.device)
    keys = torch.where(kv_ok[..., None, None], keys, zero).to(dt)
    values = torch.where(kv_ok[..., None, None], values, zero).to(dt)
    band = min(n, E + T - 1)                       # older keys are beyond every row's extent
    step = max(1, max_elems // max(1, B * nH * n))
    outs = []
    for t0 in range(0, T, step):
        qc, pc, rc = q[:, t0:t0 + step], pos[:, t0:t0 + step], rel[:, t0:t0 + step]
        Tc = qc.shape[1]
        scores = torch.einsum("btgid,bngd->btgin", qc.to(dt).view(B, Tc, nKV, G, hd), keys) / hd
        dist = pc[:, :, None] - key_pos[:, None, :]                        # [B, Tc, n]
        visible = (dist >= 0) & kv_ok[:, None, :] & (pc >= 0)[..., None]
        if window is not None:
            visible &= dist < window
        d_band = dist[..., n - band:]
        inside = (d_band >= 0) & (d_band < E)
        idx = d_band.clamp(0, E - 1)[:, :, None, :].expand(B, Tc, nH, band)
        bias = rc.to(dt).gather(-1, idx).masked_fill(~inside[:, :, None, :], 0.0)
        scores[..., n - band:] += bias.view(B, Tc, nKV, G, band)
        scores = scores.masked_fill(~visible[:, :, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)             # no visible key: zeros
        outs.append(torch.einsum("btgin,bngd->btgid", probs, values).reshape(B, Tc, nH, hd))
    return torch.cat(outs, dim=1).to(q.dtype)


def attention_decode_torch(q, rel, k_cache, v_cache, slot, pos, *, window: int | None = None,
                           num_keys: int | None = None) -> torch.Tensor:
    """The vectorized-torch twin of `attention_decode`: gather each row's last `num_keys` key
    positions from the cache (row = position % cap), mask, softmax in fp32. num_keys defaults to
    window + T - 1 (sliding) or max(pos) + 1 (global; a host sync); pass it to avoid the sync."""
    B, T = pos.shape
    cap = k_cache.shape[1]
    valid = pos >= 0
    last = torch.where(valid, pos, -1).amax(dim=1)                          # [B]
    if num_keys is None:
        num_keys = window + T - 1 if window is not None else int(last.max().item()) + 1
    num_keys = max(1, num_keys)
    key_pos = last[:, None] - num_keys + 1 + torch.arange(num_keys, device=pos.device)   # [B, n]
    key_pos = torch.where(key_pos >= 0, key_pos, -1)
    rows = key_pos.clamp(min=0) % cap
    s = slot.long()[:, None]
    return attend_torch(q, rel, k_cache[s, rows], v_cache[s, rows], key_pos, pos, window)
