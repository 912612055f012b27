"""The short conv over a position-addressed ring.

A schedule of calls like the MTP cycle's (chunked prefill, decode steps, verify windows with
rollback, padded rows, batch rows reordered between calls) runs against a flat history (every
input ever written, by sequence and position) and `inkling_ref.conv.ShortConv` over it:
  * the twin, with a ring large enough to be flat (no wrap), against the reference;
  * the kernel, with the smallest legal ring (R = K + k: wrap-around, and the two-launch path
    for chunks with T + K - 1 > R), against the reference and, bit for bit on the ring, the twin.
Rings start poisoned with NaN, so a read of a row nobody wrote shows up; slots that belong to no
sequence must stay untouched.
"""

import pytest
import torch
from helpers import TOL, bits_equal, device, poison, randn, rel_l2  # noqa: F401 (fixture)

from inkling_fast.kernels.short_conv import short_conv, short_conv_torch
from inkling_ref.conv import ShortConv

DTYPES = [torch.float32, torch.bfloat16]
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,R", [(4, 4 + SPEC_K), (2, 2 + SPEC_K), (4, 11), (5, 5 + SPEC_K)])
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_matches_reference_and_twin(device, dtype, K, R, residual):
    """The default routing: K <= 4: the chunk of T = 17 takes the strip kernel, the verify windows
    (T = 4) the window kernel, the rest tiles; K = 5: tiles throughout."""
    run_schedule(short_conv, dtype, K, R, device, residual, seed=10 * K + R, twin_ring=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_tap_major_weights(device, monkeypatch, dtype, residual):
    """Tap-major weights (strides (1, C)): windows and decode steps (T <= 16) read them as tile-shaped
    loads (W_TILE), prefill chunks as vectors; both against the reference and, bit for bit, the twin.
    The window kernel is switched off, so the verify windows take the tiles too."""
    import inkling_fast.kernels.short_conv as module
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: False)
    assert tap_major(torch.zeros(C, 1, 4)).stride() == (1, C)
    run_schedule(short_conv, dtype, 4, 4 + SPEC_K, device, residual, seed=77 + residual, twin_ring=True,
                 weight_layout=tap_major)


@pytest.mark.parametrize("config", [(2, 16, 1), (4, 32, 2), (16, 8, 1)])
@pytest.mark.parametrize("layout", ["[C, 1, K]", "tap-major"])
def test_kernel_any_tile_shape(device, monkeypatch, config, layout):
    """Tiles of (rows, channels) other than the default: tiles that straddle sequences (rows of the
    flattened B * T index) and channel tiles that end inside C; the ring-write launch of long chunks
    takes odd channel tiles too and scans pos in pieces of 8 rows (several per chunk). The window
    kernel is switched off, so every window takes the tiles."""
    import inkling_fast.kernels.short_conv as module
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: False)
    monkeypatch.setattr(module, "launch_config", lambda n_rows, C, T: config)
    monkeypatch.setattr(module, "write_launch_config", lambda T, C: (8, config[1], config[2]))
    run_schedule(short_conv, torch.float32, 4, 4 + SPEC_K, device, True, seed=sum(config), twin_ring=True,
                 weight_layout=tap_major if layout == "tap-major" else (lambda w: w))


@pytest.mark.parametrize("config", [(4, 16, 1), (8, 32, 2), (16, 8, 1)])
@pytest.mark.parametrize("K", [4, 3])
def test_kernel_any_strip_shape(device, monkeypatch, config, K):
    """Strips of 4, 8 and 16 rows (L, BLOCK_C, warps) with channel tiles that end inside C, every chunk
    of the schedule (T = 10, 9, 17) taking them: several strips per sequence (the history carried in
    from the strip before, through x), runs that start inside a strip after leading padding (history
    from the ring) and strips of padding only."""
    import inkling_fast.kernels.short_conv as module
    monkeypatch.setattr(module, "STRIP_MIN_T", 5)
    monkeypatch.setattr(module, "strip_launch_config", lambda C: config)
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_strip_kernel", "_ring_write_kernel"))
    run_schedule(short_conv, torch.float32, K, K + SPEC_K, device, True, seed=sum(config) + K, twin_ring=True,
                 weight_layout=tap_major)
    assert sum(name == "_strip_kernel" for name, _ in seen) == 3  # one launch per chunk


def test_twin_matches_reference_with_wraparound():
    """The twin on the smallest ring too (its own ring indexing against the flat reference)."""
    run_schedule(short_conv_torch, torch.float32, 4, 4 + SPEC_K, "cpu", True, seed=5)


def _one_call(device, B=3, T=4, R=7, K=4, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(B, T, C, dtype=dtype, device=device, gen=g)
    ring = randn(SLOTS, R, C, dtype=dtype, device=device, gen=g)
    weight = randn(C, K, device=device, gen=g)
    slot = torch.tensor([3, 0, 2, 1, 4][:B], dtype=torch.int32, device=device)
    pos = (torch.arange(T, dtype=torch.int32) + 20 + 3 * torch.arange(B, dtype=torch.int32)[:, None]).to(device)
    res = randn(B, T, C, dtype=dtype, device=device, gen=g)
    return x, ring, weight, slot, pos, res


def record_launches(monkeypatch, names=("_short_conv_kernel", "_ring_write_kernel")) -> list:
    """Wrap the named kernels of the module so that each launch appends (kernel name, its meta
    arguments) to the returned list, then runs the real kernel."""
    import inkling_fast.kernels.short_conv as module

    seen = []

    class Recorder:
        def __init__(self, name):
            self.name, self.real = name, getattr(module, name)

        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append((self.name, meta))
                return self.real[grid](*args, **meta)
            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recorder(name))
    return seen


ONE_LAUNCH = [("_short_conv_kernel", True)]                           # outputs and ring writes together
TWO_LAUNCHES = [("_short_conv_kernel", False), ("_ring_write_kernel", None)]   # every read, then the writes
STRIP_ONE = [("_strip_kernel", True)]
STRIP_TWO = [("_strip_kernel", False), ("_ring_write_kernel", None)]
WINDOW_ONE = [("_window_kernel", True)]
WINDOW_TWO = [("_window_kernel", False), ("_ring_write_kernel", None)]


@pytest.mark.parametrize("T,R,launches", [(1, 7, ONE_LAUNCH), (4, 7, ONE_LAUNCH), (5, 7, TWO_LAUNCHES),
                                          (4, 7, WINDOW_ONE), (5, 7, WINDOW_TWO), (16, 18, WINDOW_TWO),
                                          (19, 7, STRIP_TWO), (19, 22, STRIP_ONE), (19, 21, STRIP_TWO)])
def test_reads_before_writes_when_the_ring_is_short(device, monkeypatch, T, R, launches):
    """K = 4: a call of T <= R - K + 1 rows reads and writes disjoint ring rows (one launch); longer
    calls must put every read before every write (two launches, in that order), tiles, windows (the
    window kernel switched on or off for the case) or strips. The CPU interpreter runs programs one
    after another, so a race could not show there: this pins the split."""
    import inkling_fast.kernels.short_conv as module
    on = launches[0][0] == "_window_kernel"
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: on)
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_window_kernel", "_strip_kernel",
                                               "_ring_write_kernel"))
    x, ring, weight, slot, pos, _ = _one_call(device, T=T, R=R)
    ring_twin = ring.clone()
    out = short_conv(x, ring, weight, slot, pos)
    assert [(name, meta.get("WRITE")) for name, meta in seen] == launches
    assert rel_l2(out, short_conv_torch(x, ring_twin, weight, slot, pos)) <= 1e-5
    assert bits_equal(ring, ring_twin)


@pytest.mark.parametrize("T,K,layout,expect", [
    (4, 5, "[C, K]", ("_short_conv_kernel", 4, False)), (4, 5, "tap-major", ("_short_conv_kernel", 4, True)),
    (1, 4, "tap-major", ("_short_conv_kernel", 1, True)), (2, 4, "tap-major", ("_window_kernel", None, None)),
    (5, 4, "[C, K]", ("_window_kernel", None, None)), (6, 4, "tap-major", ("_short_conv_kernel", 6, True)),
    (16, 4, "tap-major", ("_short_conv_kernel", 16, True)),
    (17, 4, "tap-major", ("_strip_kernel", None, None)), (19, 2, "[C, K]", ("_strip_kernel", None, None)),
    (19, 5, "tap-major", ("_short_conv_kernel", 0, False)),
    (16, 4, "windows at WINDOW_MIN_ELEMENTS", ("_window_kernel", None, None)),
    (16, 4, "windows one element short", ("_short_conv_kernel", 16, True)),
    (16, 5, "windows at WINDOW_MIN_ELEMENTS", ("_short_conv_kernel", 16, True))])
def test_launch_choices(device, monkeypatch, T, K, layout, expect):
    """The measured launch choices (docs/benchmarks/tuning.md): chunks of T > 16 rows take strips when
    K <= 4; windows of 2 ... 5 rows the window kernel when K <= 4, longer ones (T <= 16) only from
    WINDOW_MIN_ELEMENTS elements (B * T * C) on; the rest tiles, dividing by T as a constant when
    T <= 16, with the tile-shaped weight load only for tap-major weights of windows and decode steps
    (with [C, K] weights it becomes one scalar load per element and is slower; tiles of long chunks keep
    1-D weight loads)."""
    import inkling_fast.kernels.short_conv as module
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_window_kernel", "_strip_kernel"))
    if layout.startswith("windows"):  # 5 x 16 rows of C channels, tap-major weights
        short = layout.endswith("short")
        monkeypatch.setattr(module, "WINDOW_MIN_ELEMENTS", 5 * T * C + short)
        x, ring, weight, slot, pos, _ = _one_call(device, B=5, T=T, R=8 + K, K=K)
        assert x.numel() == 5 * T * C
        layout = "tap-major"
    else:
        x, ring, weight, slot, pos, _ = _one_call(device, T=T, R=8, K=K)
    short_conv(x, ring, tap_major(weight) if layout == "tap-major" else weight, slot, pos)
    name, meta = seen[0]
    assert (name, meta.get("T_CONST"), meta.get("W_TILE")) == expect


@pytest.mark.parametrize("B,C,expect", [(3, 4096, (4, 128, 4)), (92, 4096, (4, 128, 4)), (93, 4096, (4, 256, 4)),
                                        (1024, 1024, (4, 256, 4)), (380, 1024, (4, 128, 4)), (381, 1024, (4, 256, 4)),
                                        (2000, 48, (4, 64, 4)), (1, 8, (4, 16, 4))])
def test_window_launch_config(B, C, expect):
    """256 channels a program once that grid has >= 384 programs (93 sequences at C = 4096: 24 x 16),
    else 128; never wider than C rounded up to a power of two (at least 16)."""
    from inkling_fast.kernels.short_conv_window import window_launch_config
    assert window_launch_config(B, C, 5) == expect


@pytest.mark.parametrize("valid", ["none", "lead 3 trail 10", "exactly R", "R - 2", "one", "all"])
def test_long_chunk_ring_writes(device, valid):
    """The ring-write launch of long chunks (T = 19 > R - K + 1, R = 7) finds each sequence's last
    valid row itself: trailing padding longer than the ring, runs of R, fewer than R and one valid
    rows, a sequence with none (writes nothing), and an unchecked bad slot (writes nothing)."""
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [21, 40])
def test_lean_windows(device, monkeypatch, dtype, B):
    """Windows of more than LEAN_MIN_ROWS rows with C a multiple of the channel tile take the lean tile
    kernel (int32 offsets, no load masks, taps that read nothing read a zero row): against the twin,
    with rows whose taps reach before position 0, leading and trailing padding, a fully padded row,
    a last row tile that ends past B * T (B = 21: 105 rows), and the ring bit for bit. (The window
    kernel, which takes such windows by default, is switched off.)"""
    import inkling_fast.kernels.short_conv as module
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: False)
    seen = record_launches(monkeypatch, names=("_short_conv_kernel",))
    T, Cw, R, K = 5, 64, 8, 4
    g = torch.Generator().manual_seed(B)
    x = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    ring = poison(torch.empty(B + 1, R, Cw, dtype=dtype, device=device))
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    start = torch.randint(3, 50, (B,), generator=g)
    start[:4] = torch.tensor([0, 1, 2, 0])           # taps before position 0
    pos = (start[:, None] + torch.arange(T)).to(torch.int32)
    pos[3, :2] = -1                                   # leading padding (positions from 0 after it)
    pos[3, 2:] = torch.arange(3, dtype=torch.int32)
    pos[5, 3:] = -1                                   # trailing padding
    pos[6] = -1                                       # nothing at all
    ring = ring.cpu()
    for b in range(B):  # the history the windows read: positions start - 3 .. start - 1 that exist
        for q in range(max(0, int(start[b]) - (K - 1)), int(start[b])):
            ring[int(slot[b]), q % R] = randn(Cw, dtype=dtype, gen=g)
    ring = ring.to(device)
    weight = tap_major(randn(Cw, K, gen=g, scale=0.5).to(device))
    res = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    slot, pos = slot.to(device), pos.to(device)
    ring_twin = ring.clone()
    ref = short_conv_torch(x, ring_twin, weight, slot, pos, residual=res)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    assert seen[0][1]["LEAN"] is True
    valid = pos >= 0
    assert rel_l2(out[valid], ref[valid]) <= TOL[dtype]
    assert (out[~valid] == 0).all()
    assert bits_equal(ring, ring_twin)
    monkeypatch.setattr(module, "LEAN_MIN_ROWS", B * T)  # the same call on the masked kernel
    ring_masked = ring_twin.clone()
    out_masked = short_conv(x, ring_masked, weight, slot, pos, residual=res)
    assert seen[-1][1]["LEAN"] is False
    assert bits_equal(out, out_masked)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,K", [(21, 5, 4), (40, 5, 3), (13, 9, 4), (7, 16, 2), (33, 2, 4)])
def test_window_kernel(device, monkeypatch, dtype, B, T, K):
    """The window kernel (whole sequences a program, the history in registers; switched on for every
    case): against the twin and, bit for bit (outputs and ring), against the tiles on the same call. Rows whose taps reach before position 0, leading and trailing padding
    (the history then comes from the ring at the run's first row), a fully padded row, a last program
    with fewer sequences than BLOCK_S (B = 21, 13, 33), T = 9 and 16 (the eight row buffers refilled)
    and channel tiles that end inside C."""
    import inkling_fast.kernels.short_conv as module
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_window_kernel"))
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: True)
    monkeypatch.setattr(module, "window_launch_config", lambda B, C, T: (4, 32, 2))
    Cw, R = 48, T + K - 1
    g = torch.Generator().manual_seed(B * T + K)
    x = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    ring = poison(torch.empty(B + 1, R, Cw, dtype=dtype, device=device))
    slot = torch.randperm(B + 1, generator=g)[:B].to(torch.int32)
    start = torch.randint(K, 50, (B,), generator=g)
    start[:3] = torch.tensor([0, 1, 2])              # taps before position 0
    pos = (start[:, None] + torch.arange(T)).to(torch.int32)
    pos[3, :T // 2] = -1                              # leading padding (positions from 0 after it)
    pos[3, T // 2:] = torch.arange(T - T // 2, dtype=torch.int32)
    pos[5, (T + 1) // 2:] = -1                        # trailing padding
    pos[6] = -1                                       # nothing at all
    if T > 2:
        pos[4, 0] = pos[4, -1] = -1                   # both
    ring = ring.cpu()
    for b in range(B):  # the history the windows read: the K-1 positions before each run that exist
        valid_pos = pos[b][pos[b] >= 0]
        first = int(valid_pos.min()) if len(valid_pos) else 0
        for q in range(max(0, first - (K - 1)), first):
            ring[int(slot[b]), q % R] = randn(Cw, dtype=dtype, gen=g)
    ring = ring.to(device)
    weight = tap_major(randn(Cw, K, gen=g, scale=0.5).to(device))
    res = randn(B, T, Cw, dtype=dtype, device=device, gen=g)
    slot, pos = slot.to(device), pos.to(device)
    ring_twin, ring_tile = ring.clone(), ring.clone()
    ref = short_conv_torch(x, ring_twin, weight, slot, pos, residual=res)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    assert [name for name, _ in seen] == ["_window_kernel"]
    valid = pos >= 0
    assert rel_l2(out[valid], ref[valid]) <= TOL[dtype]
    assert (out[~valid] == 0).all()
    assert bits_equal(ring, ring_twin)
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: False)  # the same call on the tiles
    out_tile = short_conv(x, ring_tile, weight, slot, pos, residual=res)
    assert seen[-1][0] == "_short_conv_kernel"
    assert bits_equal(out, out_tile)
    assert bits_equal(ring, ring_tile)


@pytest.mark.parametrize("config", [(1, 16, 1), (2, 32, 1), (8, 16, 4)])
@pytest.mark.parametrize("K", [4, 2])
def test_kernel_any_window_shape(device, monkeypatch, config, K):
    """The whole schedule through the window kernel (switched on for every call of T <= 16):
    decode steps, verify windows with rollback and short-padding rows, and the chunks of T = 10 and 9 (more than R - K + 1 rows:
    outputs first, then the ring-write launch), with (BLOCK_S, BLOCK_C, warps) of 1, 2 and 8 sequences
    and channel tiles that end inside C."""
    import inkling_fast.kernels.short_conv as module
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: True)
    monkeypatch.setattr(module, "window_launch_config", lambda B, C, T: config)
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_window_kernel", "_strip_kernel"))
    run_schedule(short_conv, torch.float32, K, K + SPEC_K, device, True, seed=sum(config) + K, twin_ring=True,
                 weight_layout=tap_major)
    assert [name for name, _ in seen].count("_window_kernel") == len([T for _, T in STEPS if T <= 16])


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
        (dict(ring=ring.to(torch.bfloat16)), "ring has dtype"),
        (dict(ring=ring[:, :2]), "needs at least"),
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
@pytest.mark.parametrize("Cg", [1024, 2048, 4096, 6144])
@pytest.mark.parametrize("B,T", [(1, 1), (7, 1), (16, 1), (16, 4), (3, 1031)])
@pytest.mark.parametrize("layout", ["[C, 1, K]", "tap-major"])
def test_real_sizes(Cg, B, T, dtype, layout):
    """Real widths; T = 1031 takes the two-launch path with thousands of programs (a race would show)."""
    K, R = 4, 8
    g = torch.Generator().manual_seed(Cg + B + T)
    x = randn(B, T, Cg, dtype=dtype, device="cuda", gen=g)
    ring = randn(B + 2, R, Cg, dtype=dtype, device="cuda", gen=g)
    weight = randn(Cg, 1, K, device="cuda", gen=g, scale=0.5).to(dtype)
    if layout == "tap-major":
        weight = tap_major(weight)
    slot = torch.randperm(B + 2, generator=g)[:B].to(torch.int32).cuda()
    start = torch.randint(0, 40, (B, 1), generator=g)
    pos = (start + torch.arange(T)).to(torch.int32)
    if B > 1:
        pos[1, T // 2 + 1:] = -1  # a row with trailing padding
    pos = pos.cuda()
    res = randn(B, T, Cg, dtype=dtype, device="cuda", gen=g) if Cg >= 4096 else None
    ring_twin = ring.clone()
    ref = short_conv_torch(x, ring_twin, weight, slot, pos, residual=res)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    valid = pos >= 0
    assert rel_l2(out[valid], ref[valid]) <= TOL[dtype]
    assert bits_equal(ring, ring_twin)


@pytest.mark.gpu
@pytest.mark.parametrize("Cg", [1024, 2048, 4096, 6144])
@pytest.mark.parametrize("B,T", [(1024, 5), (3, 5), (64, 9), (16, 16)])
def test_window_kernel_real_sizes(monkeypatch, Cg, B, T):
    """The window kernel at real widths in bf16 with its committed launch config: bit for bit against
    the tiles (outputs and ring), padded rows included; the residual at C >= 4096."""
    import inkling_fast.kernels.short_conv as module
    K, R = 4, T + 3
    g = torch.Generator().manual_seed(Cg + B + T)
    x = randn(B, T, Cg, dtype=torch.bfloat16, device="cuda", gen=g)
    ring = randn(B + 2, R, Cg, dtype=torch.bfloat16, device="cuda", gen=g)
    weight = tap_major(randn(Cg, K, device="cuda", gen=g, scale=0.5).to(torch.bfloat16))
    slot = torch.randperm(B + 2, generator=g)[:B].to(torch.int32).cuda()
    pos = (torch.randint(0, 40, (B, 1), generator=g) + torch.arange(T)).to(torch.int32)
    pos[1, T // 2 + 1:] = -1  # trailing padding
    pos[2, :2] = -1           # leading padding
    pos = pos.cuda()
    res = randn(B, T, Cg, dtype=torch.bfloat16, device="cuda", gen=g) if Cg >= 4096 else None
    seen = record_launches(monkeypatch, names=("_short_conv_kernel", "_window_kernel"))
    ring_tile = ring.clone()
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: False)
    out_tile = short_conv(x, ring_tile, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    monkeypatch.setattr(module, "takes_window_kernel", lambda B, T, C: True)
    out = short_conv(x, ring, weight, slot, pos, residual=res, out=poison(torch.empty_like(x)))
    assert [name for name, _ in seen] == ["_short_conv_kernel", "_window_kernel"]
    assert bits_equal(out, out_tile)
    assert bits_equal(ring, ring_tile)


@pytest.mark.gpu
def test_graph_capture():
    """Kernel (check=False) and twin both capture into a CUDA graph and replay to the eager result."""
    x, ring, weight, slot, pos, res = _one_call("cuda", B=5, T=4, R=8, dtype=torch.bfloat16)
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
