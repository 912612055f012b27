"""The short conv over a position-addressed ring.

A schedule of calls like the MTP cycle's (chunked prefill, decode steps, verify windows with
rollback, padded rows, batch rows reordered between calls) runs against a flat history (every
input ever written, by sequence and position) and `inkling_ref.model.conv.ShortConv` over it:
  * the twin, with a ring large enough to be flat (no wrap), against the reference;
  * the kernel, with the smallest legal ring (R = K + k: wrap-around, and the two-launch path
    for chunks with T + K - 1 > R), against the reference and, bit for bit on the ring, the twin.
Each path of the wrapper is forced in turn (the ring written by the conv kernel or by the second
launch; tile shapes other than the default), and checked the same way.
Rings start poisoned with NaN, so a read of a row nobody wrote shows up; slots that belong to no
sequence must stay untouched.
"""

import pytest
import torch
from helpers import DTYPES, TOL, device, poison, randn  # noqa: F401 (fixture)

import inkling_fast.kernels.short_conv as module
from inkling_fast.kernels.short_conv import short_conv, short_conv_torch
from inkling_ref.model.conv import ShortConv
from inkling_ref.testing import bits_equal, rel_l2

C = 37                  # odd channel count
SLOTS = 5
SEQ_SLOT = [3, 0, 2]    # sequence i lives in slot SEQ_SLOT[i]; slots 1 and 4 belong to nobody
SPEC_K = 3              # speculative tokens: verify windows of k + 1 = 4 rows
# (kind, T): positions run to 55, far past the small rings; T = 10, 9, 17 exceed R - K + 1
STEPS = [("prefill", 10), ("decode", 1), ("verify", 4), ("verify", 4), ("decode", 1), ("prefill", 9),
         ("verify", 4), ("prefill", 17), ("verify", 4), ("decode", 1)]


def _positions(kind: str, T: int, n: list[int], step: int, g: torch.Generator):
    """Positions [3, T] of the call for each sequence (lengths n so far) and the lengths after it.
    One sequence per call gets padding: leading + trailing (prefill), a short window (verify), none
    at all (decode). Verify windows keep a random number of their rows (the rest is rolled back)."""
    pos = torch.full((3, T), -1, dtype=torch.int32)
    new_n = list(n)
    for i in range(3):
        lead, count = 0, T
        if i == step % 3:
            lead, count = {"prefill": (2, T - 5), "verify": (0, 2), "decode": (0, 0)}[kind]
        pos[i, lead:lead + count] = torch.arange(n[i], n[i] + count, dtype=torch.int32)
        accepted = int(torch.randint(1, count + 1, (1,), generator=g)) if kind == "verify" and count else count
        new_n[i] = n[i] + accepted
    return pos, new_n


def _reference(hist: torch.Tensor, weight: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """ShortConv over each sequence's flat history, read at the call's positions: [B, T, C]."""
    conv = ShortConv(C, weight.shape[-1])
    with torch.no_grad():
        conv.weight.copy_(weight.reshape(C, 1, -1))
        y = conv(hist)                                              # [3, L, C]
    return y[seq[:, None], pos.long().clamp(min=0)]


def tap_major(weight: torch.Tensor) -> torch.Tensor:
    """[C, 1, K] or [C, K] -> the same values as a [C, K] view with strides (1, C) (what
    inkling_fast.weights stores: windows and decode steps read each tap's weights as one vector)."""
    w = weight.reshape(weight.shape[0], -1)
    return w.t().contiguous().t()


def run_schedule(fn, dtype, K, R, device, residual: bool, seed: int, twin_ring: bool = False,
                 weight_layout=lambda w: w):
    """Run STEPS through fn (short_conv or short_conv_torch), checking every call.
    With twin_ring, the twin runs in lockstep on its own ring, and the rings must agree bit for bit.
    `weight_layout` maps the [C, 1, K] weight to the layout passed in (e.g. `tap_major`)."""
    g = torch.Generator().manual_seed(seed)
    weight = randn(C, 1, K, gen=g, scale=0.5)
    L = 64
    hist = torch.zeros(3, L, C, dtype=dtype)                       # flat history, by sequence
    written = [-1, -1, -1]                                          # highest position written so far
    ring = poison(torch.empty(SLOTS, R, C, dtype=dtype, device=device))
    ring_twin = ring.clone()
    untouched = ring[[1, 4]].clone()
    n = [0, 0, 0]
    for step, (kind, T) in enumerate(STEPS):
        pos_seq, n_after = _positions(kind, T, n, step, g)
        seq = torch.randperm(3, generator=g)                        # batch row b holds sequence seq[b]
        pos = pos_seq[seq]
        slot = torch.tensor(SEQ_SLOT, dtype=torch.int32)[seq]
        x = randn(3, T, C, dtype=dtype, gen=g)
        res = randn(3, T, C, dtype=dtype, gen=g, scale=2.0) if residual else None
        valid = pos >= 0
        b_idx, t_idx = valid.nonzero(as_tuple=True)
        hist[seq[b_idx], pos[b_idx, t_idx].long()] = x[b_idx, t_idx]
        for b, t in zip(b_idx.tolist(), t_idx.tolist()):
            written[seq[b]] = max(written[seq[b]], int(pos[b, t]))
        ref = _reference(hist, weight, seq, pos)
        if residual:
            ref = (res.float() + ref.float()).to(dtype)

        dev = dict(device=device)
        args = (x.to(**dev), ring, weight_layout(weight.to(**dev)), slot.to(**dev), pos.to(**dev))
        kw = {} if res is None else {"residual": res.to(**dev)}
        out = fn(*args, **kw).cpu()
        where = f"step {step} ({kind}, T={T})"
        assert rel_l2(out[valid], ref[valid]) <= TOL[dtype], where
        assert (out[~valid] == 0).all(), where                      # padding rows: 0
        assert bits_equal(ring[[1, 4]], untouched), where           # nobody's slots: untouched
        if twin_ring:
            out_twin = short_conv_torch(x.to(**dev), ring_twin, *args[2:], **kw).cpu()
            assert rel_l2(out[valid], out_twin[valid]) <= TOL[dtype], where
            assert bits_equal(ring, ring_twin), where
        # what the next call needs: the K-1 inputs before each sequence's next position
        for i in range(3):
            for p in range(max(0, n_after[i] - (K - 1)), n_after[i]):
                assert bits_equal(ring[SEQ_SLOT[i], p % R].cpu(), hist[i, p]), f"{where}, seq {i}, pos {p}"
        n = n_after
    return ring.cpu(), hist, written



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("residual", [False, True])
def test_twin_matches_reference_flat(dtype, K, residual):
    R = 64  # larger than every position: the ring is the flat history itself
    ring, hist, written = run_schedule(short_conv_torch, dtype, K, R, "cpu", residual, seed=K)
    for i in range(3):
        L = written[i] + 1
        assert bits_equal(ring[SEQ_SLOT[i], :L], hist[i, :L])       # every input, at its position
        assert torch.isnan(ring[SEQ_SLOT[i], L:].float()).all()     # nothing beyond


def test_twin_matches_reference_with_wraparound():
    """The twin on the smallest ring too (its own ring indexing against the flat reference)."""
    run_schedule(short_conv_torch, torch.float32, 4, 4 + SPEC_K, "cpu", True, seed=5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,R", [(4, 4 + SPEC_K), (2, 2 + SPEC_K), (4, 11), (5, 5 + SPEC_K)])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_matches_reference_and_twin(device, dtype, K, R, residual):
    """Decode steps and windows (T + K - 1 <= R: the kernel writes the ring) and chunks of T = 10, 9,
    17 (more rows than the ring: the outputs first, then the ring write), weights [C, 1, K]."""
    run_schedule(short_conv, dtype, K, R, device, residual, seed=10 * K + R, twin_ring=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_tap_major_weights(device, dtype):
    """Tap-major weights (strides (1, C)), the layout inkling_fast.weights stores."""
    assert tap_major(torch.zeros(C, 1, 4)).stride() == (1, C)
    run_schedule(short_conv, dtype, 4, 4 + SPEC_K, device, True, seed=77, twin_ring=True, weight_layout=tap_major)


def test_kernel_writes_the_ring_in_a_second_launch_everywhere(device, monkeypatch):
    """The second-launch ring write (`commit_rows`) forced on every call, decode steps and windows
    included: it must leave the same ring and outputs as the write inside the conv kernel."""
    monkeypatch.setattr(module, "writes_as_it_goes", lambda T, K, R: False)
    run_schedule(short_conv, torch.float32, 4, 4 + SPEC_K, device, True, seed=78, twin_ring=True,
                 weight_layout=tap_major)


@pytest.mark.parametrize("config", [(2, 16, 1), (16, 8, 2), (1, 64, 1)])
def test_kernel_any_tile_shape(device, monkeypatch, config):
    """Tiles of (rows, channels, warps) other than the default: row tiles that straddle sequences
    (rows of the flattened B * T index) or hold one row, and channel tiles that end inside C."""
    monkeypatch.setattr(module, "launch_config", lambda C: config)
    run_schedule(short_conv, torch.float32, 4, 4 + SPEC_K, device, True, seed=sum(config), twin_ring=True,
                 weight_layout=tap_major)


def _one_call(device, B=3, T=4, R=7, K=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(B, T, C, dtype=dtype, device=device, gen=g)
    ring = randn(SLOTS, R, C, dtype=dtype, device=device, gen=g)
    weight = randn(C, K, device=device, gen=g)
    slot = torch.tensor([3, 0, 2, 1, 4][:B], dtype=torch.int32, device=device)
    pos = (torch.arange(T, dtype=torch.int32) + 20 + 3 * torch.arange(B, dtype=torch.int32)[:, None]).to(device)
    res = randn(B, T, C, dtype=dtype, device=device, gen=g)
    return x, ring, weight, slot, pos, res


def check_one_call(x, ring, weight, slot, pos, res, tol: float) -> None:
    """The kernel (poisoned output) against the twin on the same call from the same ring: valid rows
    within tol, padding rows 0, the rings bit for bit."""
    ring_twin = ring.clone()
    ref = short_conv_torch(x, ring_twin, weight, slot, pos, residual=res)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    valid = pos >= 0
    assert rel_l2(out[valid], ref[valid]) <= tol
    assert (out[~valid] == 0).all()
    assert bits_equal(ring, ring_twin)


def record_launches(monkeypatch) -> list:
    """Record, in order, each launch of the conv kernel (with its WRITE flag) and of the ring write."""
    seen = []

    class Recorder:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append(("conv", meta["WRITE"]))
                return self.real[grid](*args, **meta)
            return launch

    def commit(*args):
        seen.append(("ring write", None))
        return real_commit(*args)

    real_commit = module.commit_rows
    monkeypatch.setattr(module, "_short_conv_kernel", Recorder(module._short_conv_kernel))
    monkeypatch.setattr(module, "commit_rows", commit)
    return seen


@pytest.mark.parametrize("T,R", [(1, 7), (4, 7), (5, 7), (19, 7), (19, 22), (19, 21)])
def test_reads_before_writes_when_the_ring_is_short(device, monkeypatch, T, R):
    """K = 4: a call of T <= R - K + 1 rows reads and writes disjoint ring rows and may write as it
    goes; a longer call must put every read before every write (the conv without writes, then the
    ring write). The CPU interpreter runs programs one after another, so a race could not show
    there: this pins the order."""
    seen = record_launches(monkeypatch)
    x, ring, weight, slot, pos, _ = _one_call(device, T=T, R=R)
    ring_twin = ring.clone()
    out = short_conv(x, ring, weight, slot, pos)
    disjoint = T + 4 - 1 <= R
    assert seen == ([("conv", True)] if disjoint else [("conv", False), ("ring write", None)])
    assert rel_l2(out, short_conv_torch(x, ring_twin, weight, slot, pos)) <= 1e-5
    assert bits_equal(ring, ring_twin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,K", [(21, 5, 4), (13, 9, 3), (7, 16, 2)])
def test_windows_with_padding_and_early_positions(device, dtype, B, T, K):
    """Windows of many sequences against the twin: rows whose taps reach before position 0, leading
    padding (the history then comes from the ring at the run's first row), trailing padding, a fully
    padded row, both, a last row tile that ends past B * T; a poisoned output and ring."""
    Cw, R = 48, T + K - 1
    g = torch.Generator().manual_seed(B * T + K)
    x = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    ring = poison(torch.empty(B + 1, R, Cw, dtype=dtype))
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    start = torch.randint(K, 50, (B,), generator=g)
    start[:3] = torch.tensor([0, 1, 2])              # taps before position 0
    pos = (start[:, None] + torch.arange(T)).to(torch.int32)
    pos[3, :T // 2] = -1                              # leading padding (positions from 0 after it)
    pos[3, T // 2:] = torch.arange(T - T // 2, dtype=torch.int32)
    pos[5, (T + 1) // 2:] = -1                        # trailing padding
    pos[6] = -1                                       # nothing at all
    pos[4, 0] = pos[4, -1] = -1                       # both
    for b in range(B):  # the history the windows read: the K-1 positions before each run that exist
        valid_pos = pos[b][pos[b] >= 0]
        first = int(valid_pos.min()) if len(valid_pos) else 0
        for q in range(max(0, first - (K - 1)), first):
            ring[int(slot[b]), q % R] = randn(Cw, dtype=dtype, gen=g)
    ring = ring.to(device)
    weight = tap_major(randn(Cw, K, gen=g, scale=0.5).to(device))
    res = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    slot, pos = slot.to(device), pos.to(device)
    check_one_call(x, ring, weight, slot, pos, res, TOL[dtype])


@pytest.mark.parametrize("valid", ["none", "lead 3 trail 10", "exactly R", "R - 2", "one", "all"])
def test_long_chunk_ring_writes(device, valid):
    """The ring write of long chunks (T = 19 > R - K + 1, R = 7) keeps each sequence's last R valid
    rows: trailing padding longer than the ring, runs of R, fewer than R and one valid rows, a
    sequence with none (writes nothing), and an unchecked bad slot (writes nothing)."""
    T, R = 19, 7
    x, ring, weight, slot, pos, _ = _one_call(device, T=T, R=R)
    lead, n = {"none": (0, 0), "lead 3 trail 10": (3, 6), "exactly R": (5, R), "R - 2": (0, R - 2),
               "one": (9, 1), "all": (0, T)}[valid]
    pos[1] = -1
    pos[1, lead:lead + n] = torch.arange(30, 30 + n, dtype=torch.int32, device=device)
    ring_twin = ring.clone()
    out = short_conv(x, ring, weight, slot, pos)
    ref = short_conv_torch(x, ring_twin, weight, slot, pos)
    assert rel_l2(out, ref) <= 1e-5
    assert bits_equal(ring, ring_twin)
    slot[2] = SLOTS  # out of range, unchecked: its ring rows stay as they are, its outputs NaN
    ring_before = ring.clone()
    out = short_conv(x, ring, weight, slot, pos, check=False)
    assert torch.isnan(out[2]).all()
    ring_twin = ring_before.clone()
    ref = short_conv_torch(x[:2], ring_twin, weight, slot[:2], pos[:2])
    assert rel_l2(out[:2], ref) <= 1e-5
    assert bits_equal(ring, ring_twin)  # only rows 0 and 1 wrote


def test_residual_in_place(device):
    x, ring, weight, slot, pos, res = _one_call(device)
    ref = short_conv_torch(x, ring.clone(), weight, slot, pos, residual=res)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=res)
    assert out is res and rel_l2(res, ref) <= 1e-5


def test_unchecked_bad_slot_touches_nothing(device):
    """check=False (the CUDA-graph path): a bad slot gives NaN rows and no memory access."""
    x, ring, weight, slot, pos, _ = _one_call(device)
    slot[1] = SLOTS  # out of range
    ring_before = ring.clone()
    out = short_conv(x, ring, weight, slot, pos, check=False)
    assert torch.isnan(out[1]).all()
    good = torch.tensor([0, 2])
    twin_ring = ring_before.clone()
    ref = short_conv_torch(x[good], twin_ring, weight, slot[good], pos[good])
    assert rel_l2(out[good], ref) <= 1e-5
    assert bits_equal(ring, twin_ring)  # only the good rows wrote
    with pytest.raises(ValueError, match="slot out of range"):
        short_conv(x, ring, weight, slot, pos)


def test_index_contract_errors(device):
    x, ring, weight, slot, pos, _ = _one_call(device)
    bad = pos.clone()
    bad[0, 1] = -2
    with pytest.raises(ValueError, match="below -1"):
        short_conv(x, ring, weight, slot, bad)
    bad = pos.clone()
    bad[0, 2] += 1
    with pytest.raises(ValueError, match="not consecutive"):
        short_conv(x, ring, weight, slot, bad)
    bad = pos.clone()
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="one run"):
        short_conv(x, ring, weight, slot, bad)
    dup = slot.clone()
    dup[2] = dup[0]
    with pytest.raises(ValueError, match="same slot"):
        short_conv(x, ring, weight, dup, pos)
    pad = pos.clone()
    pad[2] = -1  # a fully padded row may share a slot (it reads and writes nothing)
    out = short_conv(x, ring, weight, dup, pad)
    assert (out[2] == 0).all()


def test_shape_and_dtype_errors(device):
    x, ring, weight, slot, pos, res = _one_call(device)
    cases = [
        (dict(x=x[..., :-1]), "ring must be a tensor"),
        (dict(x=x.long()), "x has dtype"),
        (dict(ring=ring.to(torch.bfloat16)), "ring has dtype"),
        (dict(ring=ring[:, :2]), "needs at least"),
        (dict(ring=ring.transpose(0, 1).contiguous().transpose(0, 1)), "ring must be contiguous"),
        (dict(weight=weight[:-1]), "weight must be"),
        (dict(weight=weight[:, None, None]), "weight must be"),
        (dict(slot=slot.long()), "slot has dtype"),
        (dict(pos=pos[:, :-1]), "pos has shape"),
        (dict(pos=pos.to("meta")), "pos is on"),
        (dict(residual=res[:, :-1]), "residual has shape"),
        (dict(out=torch.empty(3, 4, C, dtype=torch.bfloat16, device=device)), "out has dtype"),
        (dict(out=x), "must not alias"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous last dimension"),
    ]
    base = dict(x=x, ring=ring, weight=weight, slot=slot, pos=pos)
    for change, msg in cases:
        with pytest.raises(ValueError, match=msg):
            short_conv(**{**base, **change})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Cg", [4096, 6144])
@pytest.mark.parametrize("B,T", [(1, 1), (64, 1), (32, 5), (64, 9), (1, 256), (3, 1031)])
@pytest.mark.parametrize("layout", ["[C, 1, K]", "tap-major"])
def test_real_sizes(Cg, B, T, dtype, layout):
    """Real widths at the engine's shapes: decode steps, windows of k + 1 rows with the engine's ring
    (R = K + k: the ring written by the conv kernel), prefill chunks (T > R: the ring written by the
    second launch, with thousands of programs in flight, so a race would show); padding rows; the
    residual fused at C = 6144."""
    K = 4
    R = T + K - 1 if T <= 9 else 8
    g = torch.Generator().manual_seed(Cg + B + T)
    x = randn(B, T, Cg, dtype=dtype, device="cuda", gen=g)
    ring = randn(B + 2, R, Cg, dtype=dtype, device="cuda", gen=g)
    weight = randn(Cg, 1, K, device="cuda", gen=g, scale=0.5).to(dtype)
    if layout == "tap-major":
        weight = tap_major(weight)
    slot = torch.randperm(B + 2, generator=g)[:B].to(torch.int32).cuda()
    start = torch.randint(0, 40, (B, 1), generator=g)
    pos = (start + torch.arange(T)).to(torch.int32)
    if B > 2:
        pos[1, T // 2 + 1:] = -1  # a row with trailing padding
        pos[2, :(T + 1) // 2] = -1  # and one with leading padding
    pos = pos.cuda()
    res = randn(B, T, Cg, dtype=dtype, device="cuda", gen=g) if Cg == 6144 else None
    check_one_call(x, ring, weight, slot, pos, res, TOL[dtype])


@pytest.mark.gpu
def test_graph_capture():
    """Kernel (check=False) and twin both capture into a CUDA graph and replay to the eager result,
    on a window (one launch) and on a chunk longer than the ring (two launches)."""
    for T, R in ((4, 8), (19, 8)):
        x, ring, weight, slot, pos, res = _one_call("cuda", B=5, T=T, R=R, dtype=torch.bfloat16)
        ring_k, ring_t = ring.clone(), ring.clone()
        ref_k = short_conv(x, ring_k, weight, slot, pos, residual=res, check=False).clone()
        ref_t = short_conv_torch(x, ring_t, weight, slot, pos, residual=res).clone()
        rings = [ring.clone(), ring.clone()]
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):  # warm-up (compilation) outside the capture
            short_conv(x, ring.clone(), weight, slot, pos, residual=res, check=False)
            short_conv_torch(x, ring.clone(), weight, slot, pos, residual=res)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_k = short_conv(x, rings[0], weight, slot, pos, residual=res, check=False)
            out_t = short_conv_torch(x, rings[1], weight, slot, pos, residual=res)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_k, ref_k) and bits_equal(rings[0], ring_k)
        assert torch.equal(out_t, ref_t) and bits_equal(rings[1], ring_t)
