"""Greedy accept / correct / bonus on the device: twin vs inkling_ref.decoding.speculative.accept_greedy, kernel
vs twin (ragged k_eff, K = 0, every prefix length), errors, and on a GPU the whole greedy verify step
(lm_head_argmax + greedy_accept) run under sync-debug "error" and replayed from a CUDA graph."""

import pytest
import torch
from helpers import device, poison, randint, run_without_sync_then_capture  # noqa: F401 (fixture)

from inkling_fast.kernels.accept import greedy_accept, greedy_accept_torch
from inkling_fast.kernels.lm_head_argmax import lm_head_argmax
from inkling_ref.decoding.speculative import accept_greedy


def make_case(B: int, K: int, V: int, gen: torch.Generator):
    """Random verify logits [B, K+1, V] (their argmax is the target), drafts agreeing with the target
    on a random prefix (every length 0..K occurs), a mismatch after it, random k_eff in 0..K."""
    logits = torch.randn(B, K + 1, V, generator=gen)
    target = logits.argmax(dim=-1)                                        # [B, K+1]
    prefix = torch.arange(B) % (K + 1)                                    # 0..K, all of them
    drafts = torch.randint(0, V, (B, K), generator=gen)
    for b in range(B):
        drafts[b, : prefix[b]] = target[b, : prefix[b]]
        if prefix[b] < K:
            drafts[b, prefix[b]] = (target[b, prefix[b]] + 1 + torch.randint(0, V - 1, (), generator=gen)) % V
    k_eff = torch.randint(0, K + 1, (B,), generator=gen)
    return logits, target, drafts, k_eff


def reference(logits, drafts, k_eff):
    """accept_greedy of inkling_ref, one sequence at a time: (a, next, emitted) lists."""
    out = []
    for b in range(drafts.shape[0]):
        ke = int(k_eff[b])
        a, nxt = accept_greedy(drafts[b, :ke].tolist(), logits[b, : ke + 1])
        out.append((a, nxt, drafts[b, :a].tolist() + [nxt]))
    return out


@pytest.mark.parametrize("K", [0, 1, 4, 7])
def test_twin_matches_reference(K):
    g = torch.Generator().manual_seed(K)
    logits, target, drafts, k_eff = make_case(13, K, 50, g)
    for ke in (k_eff, None):
        a, nxt, emitted, bad = greedy_accept_torch(drafts, target, ke)
        assert not bad.any()
        ref = reference(logits, drafts, ke if ke is not None else torch.full((13,), K))
        assert a.tolist() == [r[0] for r in ref]
        assert nxt.tolist() == [r[1] for r in ref]
        for b, r in enumerate(ref):
            assert emitted[b].tolist() == r[2] + [-1] * (K - r[0])


@pytest.mark.parametrize("K", [0, 1, 4, 7])
@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_kernel_matches_twin(device, K, int_dtype):
    g = torch.Generator().manual_seed(100 + K)
    logits, target, drafts, k_eff = make_case(13, K, 50, g)
    drafts, target, k_eff = (t.to(device=device, dtype=int_dtype) for t in (drafts, target, k_eff))
    for ke in (k_eff, None):
        out = tuple(poison(torch.empty(s, dtype=dt, device=device))
                    for s, dt in (((13,), torch.int32), ((13,), torch.int64), ((13, K + 1), torch.int64)))
        got = greedy_accept(drafts, target, ke, out=out)
        assert all(x is y for x, y in zip(got, out))
        want = greedy_accept_torch(drafts, target, ke)
        for x, y in zip(got, want):
            assert torch.equal(x.cpu(), y.cpu())


def test_scripted_outcomes(device):
    """All accepted -> the bonus (target at k); none -> the correction at 0; k_eff cuts the drafts."""
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]], device=device)
    drafts = torch.tensor([[5, 6, 7], [9, 6, 7], [5, 6, 9], [5, 6, 7]], device=device)
    k_eff = torch.tensor([3, 3, 3, 1], device=device)
    a, nxt, emitted, _ = greedy_accept(drafts, target, k_eff)
    assert a.tolist() == [3, 0, 2, 1]
    assert nxt.tolist() == [8, 5, 7, 6]
    assert emitted.tolist() == [[5, 6, 7, 8], [5, -1, -1, -1], [5, 6, 7, -1], [5, 6, -1, -1]]
    # k_eff out of 0..K is clamped
    a, nxt, _, _ = greedy_accept(drafts, target, torch.tensor([7, -2, 3, 3], device=device))
    assert a.tolist() == [3, 0, 2, 3] and nxt.tolist() == [8, 5, 7, 8]


def scored_case(B: int, K: int, gen: torch.Generator):
    """Random finite scores [K, B] and [B, K+1] with NaN, +inf or -inf planted in some rows (several per row
    in some, some beyond k_eff, where they must not count), and the expected first_bad computed by a loop."""
    ds = torch.randn(K, B, generator=gen)
    ts = torch.randn(B, K + 1, generator=gen)
    k_eff = torch.randint(0, K + 1, (B,), generator=gen)
    bad_values = (float("nan"), float("inf"), float("-inf"))
    for b in range(B):
        for _ in range(b % 3):                                   # 0, 1 or 2 plants per row
            j = int(torch.randint(0, 2 * K + 1, (), generator=gen))
            v = bad_values[(b + j) % 3]
            if j < K:
                ds[j, b] = v
            else:
                ts[b, j - K] = v
    want = []
    for b in range(B):
        seq = [ds[j, b] for j in range(K)] + [ts[b, t] for t in range(int(k_eff[b]) + 1)]
        first = next((i for i, x in enumerate(seq) if not torch.isfinite(x)), None)
        want.append(0 if first is None else first + 1)
    return ds, ts, k_eff, want


@pytest.mark.parametrize("K", [0, 1, 3, 7])
def test_first_bad_names_the_first_nonfinite_score(device, K):
    """first_bad = 1 + the first NaN/inf in draft-then-verify order (verify rows only up to k_eff), 0 when
    all are finite: kernel (poisoned output) and twin against a plain loop; a, next and emitted unchanged."""
    g = torch.Generator().manual_seed(200 + K)
    logits, target, drafts, _ = make_case(29, K, 50, g)
    ds, ts, k_eff, want = scored_case(29, K, g)
    assert any(w == 0 for w in want) and (K == 0 or any(w > 0 for w in want))
    bad_t = greedy_accept_torch(drafts, target, k_eff, scores=(ds, ts))[3]
    assert bad_t.tolist() == want
    to = dict(device=device)
    out = poison(torch.empty(29, dtype=torch.int32, **to))
    got = greedy_accept(drafts.to(**to), target.to(**to), k_eff.to(**to), scores=(ds.to(**to), ts.to(**to)),
                        first_bad_out=out)
    assert got[3] is out and out.cpu().tolist() == want
    plain = greedy_accept(drafts.to(**to), target.to(**to), k_eff.to(**to))
    for x, y in zip(got[:3], plain[:3]):
        assert torch.equal(x.cpu(), y.cpu())
    assert not plain[3].cpu().any()


def test_errors_name_the_argument(device):
    d = torch.zeros(3, 4, dtype=torch.int64, device=device)
    t = torch.zeros(3, 5, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="drafts must be"):
        greedy_accept(d.float(), t)
    with pytest.raises(ValueError, match="target has shape"):
        greedy_accept(d, t[:, :4])
    with pytest.raises(ValueError, match="target must be"):
        greedy_accept(d, t.float())
    with pytest.raises(ValueError, match="k_eff has shape"):
        greedy_accept(d, t, torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        greedy_accept(torch.zeros(4, 3, dtype=torch.int64, device=device).T, t)
    with pytest.raises(ValueError, match="draft_scores has shape"):
        greedy_accept(d, t, scores=(torch.zeros(3, 4, device=device), torch.zeros(3, 5, device=device)))
    with pytest.raises(ValueError, match="target_scores has dtype"):
        greedy_accept(d, t, scores=(torch.zeros(4, 3, device=device), torch.zeros(3, 5, dtype=torch.float64,
                                                                                  device=device)))
    with pytest.raises(ValueError, match=r"out\[emitted\]"):
        greedy_accept(d, t, out=(torch.empty(3, dtype=torch.int32, device=device),
                                 torch.empty(3, dtype=torch.int64, device=device),
                                 torch.empty(3, 4, dtype=torch.int64, device=device)))


@pytest.mark.gpu
def test_greedy_verify_step_without_host_sync():
    """The greedy verify step of a batch (argmax over the LM head for every verify row, then accept)
    runs under torch.cuda.set_sync_debug_mode("error") and replays from a CUDA graph on new inputs,
    matching inkling_ref's accept_greedy on the logits each time."""
    g = torch.Generator(device="cuda").manual_seed(5)
    B, K, H, V, V_out = 6, 4, 4096, 32768, 32000
    # integer-valued weights and hiddens: exact float32 logits on both sides (ties included)
    W = randint(-1, 2, V, H, dtype=torch.bfloat16, device="cuda", gen=g)
    hid = randint(-2, 3, B * (K + 1), H, dtype=torch.bfloat16, device="cuda", gen=g)
    drafts = torch.zeros(B, K, dtype=torch.int64, device="cuda")
    k_eff = torch.tensor([4, 4, 2, 0, 3, 4], device="cuda")
    ids = torch.empty(B * (K + 1), dtype=torch.int64, device="cuda")
    vals = torch.empty(B * (K + 1), dtype=torch.float32, device="cuda")
    out = (torch.empty(B, dtype=torch.int32, device="cuda"), torch.empty(B, dtype=torch.int64, device="cuda"),
           torch.empty(B, K + 1, dtype=torch.int64, device="cuda"))

    def step():
        lm_head_argmax(hid, W, V_out, 16.0, ids, vals)
        greedy_accept(drafts, ids.view(B, K + 1), k_eff, out=out)

    def new_inputs():
        hid.copy_(randint(-2, 3, B * (K + 1), H, dtype=torch.bfloat16, device="cuda", gen=g))
        logits = (hid.float() @ W[:V_out].float().T).view(B, K + 1, V_out)
        target = logits.argmax(-1)
        # drafts agree with the target on a prefix of length b % (K + 1)
        d = torch.randint(0, V_out, (B, K), generator=g, device="cuda")
        for b in range(B):
            n = b % (K + 1)
            d[b, :n] = target[b, :n]
        drafts.copy_(d)
        return logits.cpu()

    def check(logits):
        ref = reference(logits, drafts.cpu(), k_eff.cpu())
        assert out[0].tolist() == [r[0] for r in ref]
        assert out[1].tolist() == [r[1] for r in ref]

    step()                                  # compile and autotune outside the checked region
    torch.cuda.synchronize()
    logits = new_inputs()
    graph = run_without_sync_then_capture(step)
    torch.cuda.synchronize()
    check(logits)
    for _ in range(3):
        logits = new_inputs()
        for t in out:
            poison(t)
        graph.replay()
        torch.cuda.synchronize()
        check(logits)
