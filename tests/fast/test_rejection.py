"""Sampling on the device with explicit uniforms: the filters (sampling_probs) against
inkling_ref.decoding.sampling.probs, the inverse-CDF kernel against inkling_ref.decoding.sampling.sample, the rejection
kernel against inkling_ref.decoding.sampling.rejection_sample (same uniforms in, same tokens out), the Philox
uniforms against published test vectors, and on a GPU the whole sampled accept step (uniforms, filters,
draft sampling, rejection) at the real vocabulary, under sync-debug "error" and replayed from a graph."""

import pytest
import torch
from helpers import device, poison, run_without_sync_then_capture  # noqa: F401 (fixture)

from inkling_fast.kernels.rejection import rejection_sample, rejection_sample_torch
from inkling_fast.kernels.sampling import sample_tokens, sample_tokens_torch, sampling_probs
from inkling_fast.kernels.uniforms import philox4x32_torch, philox_uniforms, philox_uniforms_torch
from inkling_ref.decoding.sampling import SamplingParams, probs, sample
from inkling_ref.decoding.sampling import rejection_sample as ref_rejection_sample

PARAMS = [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.3, top_p=0.8),
          SamplingParams(0.9, top_k=40, top_p=0.6), SamplingParams(2.0, top_k=1), SamplingParams(0.5, top_p=1.0)]


def ref_rows(p: torch.Tensor, q, drafts, u_acc, u_fin, k_eff):
    """inkling_ref.decoding.sampling.rejection_sample one sequence at a time (greedy drafting: one-hot q)."""
    out = []
    for b in range(p.shape[0]):
        ke = int(k_eff[b])
        pb = p[b, : ke + 1].double().cpu()
        qb = (q[b, :ke].double().cpu() if q is not None
              else torch.nn.functional.one_hot(drafts[b, :ke].cpu().long(), p.shape[-1]).double())
        out.append(ref_rejection_sample(pb, qb, drafts[b, :ke].tolist(), u_acc[b, :ke].tolist(), float(u_fin[b])))
    return out


# ----------------------------------------------------------------------------- filters
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_sampling_probs_match_reference(params):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 300, generator=g) * 2
    logits[0, 0, 10:20] = logits[0, 0].max()              # ties at the top (top-k keeps the lower ids)
    got, want = sampling_probs(logits, params.temperature, params.top_k, params.top_p), probs(logits, params)
    assert got.dtype == torch.float64
    assert torch.equal(got > 0, want > 0)                  # the same ids survive the filters
    assert (got - want).abs().max() <= 1e-15
    with pytest.raises(ValueError, match="greedy"):
        sampling_probs(logits, 0.0)


# ----------------------------------------------------------------------------- inverse CDF
def test_sample_tokens_match_reference(device):
    g = torch.Generator().manual_seed(2)
    V = 1500                                               # > one 1024-wide block of the scan
    p = sampling_probs(torch.randn(9, V, generator=g) * 3, 0.8, top_k=300)
    u = torch.rand(9, generator=g, dtype=torch.float64)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53                       # the ends of [0, 1)
    p[2, 1000:] = 0                                        # a zero tail, then u at the top: the guard
    u[2] = 1.0 - 2.0**-53
    want = [sample(p[i], float(u[i])) for i in range(9)]
    assert sample_tokens_torch(p, u).tolist() == want
    out = poison(torch.empty(9, dtype=torch.int64, device=device))
    got = sample_tokens(p.to(device), u.to(device), out=out)
    assert got is out and got.tolist() == want
    assert all(p[i, want[i]] > 0 for i in range(9))


def test_sample_tokens_exact_boundaries(device):
    """u * total exactly on a cumulative boundary: the next id (right-continuous inverse CDF)."""
    p = torch.tensor([[0.25, 0.0, 0.5, 0.25], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    for u0, u1, want in ((0.25, 0.5, [2, 1]), (0.0, 0.0, [0, 0]), (0.75, 0.999, [3, 1])):
        u = torch.tensor([u0, u1], dtype=torch.float64)
        assert [sample(p[i], float(u[i])) for i in range(2)] == want
        assert sample_tokens(p.to(device), u.to(device)).tolist() == want


# ----------------------------------------------------------------------------- rejection sampling
def make_batch(B, K, V, params, gen, greedy_drafts, noise=0.5):
    """Target and draft logits that agree roughly (so a ranges over 0..K), drafts drawn from q with
    the reference's sampler (greedy drafting: the argmax), uniforms, ragged k_eff."""
    target_logits = torch.randn(B, K + 1, V, generator=gen) * 2.5
    spike = torch.randint(0, V, (B, K + 1, 1), generator=gen)          # one likely id per row
    target_logits.scatter_add_(2, spike, torch.full((B, K + 1, 1), 6.0))
    draft_logits = target_logits[:, :K] + noise * torch.randn(B, K, V, generator=gen)
    p = sampling_probs(target_logits, params.temperature, params.top_k, params.top_p)
    q = None if greedy_drafts else sampling_probs(draft_logits, params.temperature, params.top_k, params.top_p)
    u = torch.rand(B, 2 * K + 1, generator=gen, dtype=torch.float64)   # [draft k | accept k | final]
    if greedy_drafts:
        drafts = draft_logits.argmax(-1)
    else:
        drafts = torch.tensor([[sample(q[b, j], float(u[b, j])) for j in range(K)] for b in range(B)],
                              dtype=torch.int64).reshape(B, K)
    k_eff = torch.randint(0, K + 1, (B,), generator=gen)
    k_eff[:2] = K
    return p, q, drafts, u[:, K: 2 * K], u[:, 2 * K], k_eff


@pytest.mark.parametrize("greedy_drafts", [False, True])
@pytest.mark.parametrize("params", PARAMS[:4], ids=str)
def test_twin_matches_reference(params, greedy_drafts):
    g = torch.Generator().manual_seed(3)
    p, q, drafts, u_acc, u_fin, k_eff = make_batch(16, 4, 200, params, g, greedy_drafts)
    a, nxt, emitted = rejection_sample_torch(p, q, drafts, u_acc, u_fin, k_eff)
    ref = ref_rows(p, q, drafts, u_acc, u_fin, k_eff)
    assert a.tolist() == [r[0] for r in ref]
    assert nxt.tolist() == [r[1] for r in ref]
    assert len(set(a.tolist())) >= 3                       # the cases cover several accept counts
    for b, r in enumerate(ref):
        assert emitted[b].tolist() == drafts[b, : r[0]].tolist() + [r[1]] + [-1] * (4 - r[0])


@pytest.mark.parametrize("greedy_drafts", [False, True])
@pytest.mark.parametrize("K,V,params", [(4, 1500, PARAMS[3]), (1, 300, PARAMS[1]), (3, 77, PARAMS[0]),
                                        (0, 50, PARAMS[2])], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_matches_reference(device, K, V, params, greedy_drafts, dtype):
    g = torch.Generator().manual_seed(K * 10 + V)
    p, q, drafts, u_acc, u_fin, k_eff = make_batch(9, K, V, params, g, greedy_drafts)
    p, q = p.to(dtype), (q.to(dtype) if q is not None else None)
    dev = lambda t: t.to(device) if t is not None else None  # noqa: E731
    for ke in (k_eff, None):
        ref = ref_rows(p, q, drafts, u_acc, u_fin, ke if ke is not None else torch.full((9,), K))
        out = tuple(poison(torch.empty(s, dtype=dt, device=device))
                    for s, dt in (((9,), torch.int32), ((9,), torch.int64), ((9, K + 1), torch.int64)))
        a, nxt, emitted = rejection_sample(dev(p), dev(q), dev(drafts), dev(u_acc), dev(u_fin), dev(ke), out=out)
        assert a.tolist() == [r[0] for r in ref]
        assert nxt.tolist() == [r[1] for r in ref]
        twin = rejection_sample_torch(p, q, drafts, u_acc, u_fin, ke)
        assert torch.equal(emitted.cpu(), twin[2])


def test_scripted_corner_cases(device):
    """p == q with a draft q never proposes (residual empty -> sample from p); a draft of zero target
    probability (always rejected); all accepted -> bonus from row k_eff; a draft id outside the
    vocabulary (rejected, no crash)."""
    V = 6
    p = torch.tensor([[[0.5, 0.5, 0, 0, 0, 0], [0, 0, 0.2, 0.8, 0, 0], [0, 0, 0, 0, 0.3, 0.7]]] * 4,
                     dtype=torch.float64)                                   # [4, 3, 6]
    q = p[:, :2].clone()
    drafts = torch.tensor([[2, 3], [0, 5], [1, 3], [9, 3]])                 # row 0: q(2) = 0 = p(2)
    u_acc = torch.tensor([[0.3, 0.3], [0.3, 0.3], [0.99, 0.99], [0.1, 0.1]], dtype=torch.float64)
    u_fin = torch.tensor([0.6, 0.6, 0.8, 0.1], dtype=torch.float64)
    ref = ref_rows(p[:3], q[:3], drafts[:3], u_acc[:3], u_fin[:3], torch.full((3,), 2))
    assert ref == [(0, 1), (1, 3), (2, 5)]
    a, nxt, _ = rejection_sample(p.to(device), q.to(device), drafts.to(device), u_acc.to(device), u_fin.to(device))
    assert list(zip(a.tolist(), nxt.tolist()))[:3] == ref
    assert a[3].item() == 0 and p[3, 0, nxt[3].item()] > 0                  # id 9 >= V: rejected
    assert torch.equal(torch.stack([a.cpu().long(), nxt.cpu()]),
                       torch.stack([x.long() for x in rejection_sample_torch(p, q, drafts, u_acc, u_fin)[:2]]))


def test_errors_name_the_argument(device):
    B, K, V = 2, 3, 10
    p = torch.rand(B, K + 1, V, dtype=torch.float64, device=device)
    q = torch.rand(B, K, V, dtype=torch.float64, device=device)
    d = torch.zeros(B, K, dtype=torch.int64, device=device)
    ua = torch.rand(B, K, dtype=torch.float64, device=device)
    uf = torch.rand(B, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="p must be"):
        rejection_sample(p.half(), q, d, ua, uf)
    with pytest.raises(ValueError, match="q must be"):
        rejection_sample(p, q.float(), d, ua, uf)
    with pytest.raises(ValueError, match="drafts has shape"):
        rejection_sample(p, q, d[:, :2], ua, uf)
    with pytest.raises(ValueError, match="u_accept must be"):
        rejection_sample(p, q, d, ua[:, :2], uf)
    with pytest.raises(ValueError, match="u_final must be"):
        rejection_sample(p, q, d, ua, uf[:1])
    with pytest.raises(ValueError, match="k_eff must be"):
        rejection_sample(p, q, d, ua, uf, torch.zeros(B, device=device))
    with pytest.raises(ValueError, match="u must be"):
        sample_tokens(p[:, 0].contiguous(), uf[:1])
    with pytest.raises(ValueError, match="counters has shape"):
        philox_uniforms(torch.zeros(2, dtype=torch.int64, device=device), torch.zeros(3, dtype=torch.int64,
                                                                                      device=device), 4)


# ----------------------------------------------------------------------------- uniforms
def test_philox_known_answers():
    """Philox 4x32-10 test vectors of Random123 (kat_vectors), through the torch twin."""
    M = 0xFFFFFFFF
    cases = [((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((M, M, M, M, M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for args, want in cases:
        got = philox4x32_torch(*[torch.tensor([x]) for x in args])
        assert [int(x) for x in got] == list(want)


def test_philox_uniforms(device):
    seeds = torch.tensor([1, 2, -5, 2**40 + 3, 1], device=device)
    counters = torch.tensor([0, 7, 2**33 - 5, 5, 0], device=device)    # row 2's counter crosses 2^32
    start = counters.clone()
    u = philox_uniforms(seeds, counters, 37)
    assert torch.equal(counters.cpu(), start.cpu() + 37)                # advanced in place
    assert torch.equal(u.cpu(), philox_uniforms_torch(seeds.cpu(), start.cpu(), 37))
    assert torch.equal(u[0], u[4])                                      # same seed and counter, same stream
    assert not torch.equal(u[0], u[1])
    # the continuation of a stream: 37 then 20 draws == 57 draws in one go
    more = philox_uniforms(seeds, counters, 20)
    assert torch.equal(torch.cat([u, more], 1).cpu(), philox_uniforms_torch(seeds.cpu(), start.cpu(), 57))
    # a sequence's stream does not depend on the batch it sits in
    alone = philox_uniforms(seeds[3:4].clone(), start[3:4].clone(), 37)
    assert torch.equal(alone[0], u[3])


def test_philox_uniforms_are_uniform():
    """20000 draws: in [0, 1), chi-square over 20 bins far below its 0.999 quantile (43.8), and 53 bits."""
    u = philox_uniforms_torch(torch.tensor([12345]), torch.tensor([0]), 20000)[0]
    assert (u >= 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=20, min=0, max=1)
    chi2 = ((counts - 1000) ** 2 / 1000).sum().item()
    assert chi2 < 43.8
    assert ((u * 2.0**32) % 1 != 0).float().mean() > 0.99             # finer than 32-bit floats


# ----------------------------------------------------------------------------- GPU: the whole step
@pytest.mark.gpu
@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_sampled_accept_step_without_host_sync(greedy_drafts):
    """Uniforms (Philox, per-sequence seeds), filters, draft sampling and rejection at the real
    vocabulary, run under sync-debug "error" and replayed from a CUDA graph: every replay draws fresh
    uniforms on the device and gives the reference's tokens for the same uniforms."""
    g = torch.Generator().manual_seed(6)
    B, K, V = 4, 4, 200058
    params = SamplingParams(0.8, top_k=50, top_p=0.9)
    t_logits = torch.empty(B, K + 1, V, device="cuda")
    d_logits = torch.empty(B, K, V, device="cuda")
    seeds = torch.tensor([11, 12, 13, 14], device="cuda")
    counters = torch.zeros(B, dtype=torch.int64, device="cuda")
    k_eff = torch.tensor([4, 2, 4, 1], device="cuda")
    u = torch.empty(B, 2 * K + 1, dtype=torch.float64, device="cuda")
    drafts = torch.empty(B * K, dtype=torch.int64, device="cuda")
    out = (torch.empty(B, dtype=torch.int32, device="cuda"), torch.empty(B, dtype=torch.int64, device="cuda"),
           torch.empty(B, K + 1, dtype=torch.int64, device="cuda"))

    def step():
        philox_uniforms(seeds, counters, 2 * K + 1, out=u)
        p = sampling_probs(t_logits, params.temperature, params.top_k, params.top_p)
        if greedy_drafts:
            q = None
            drafts.view(B, K).copy_(d_logits.argmax(-1))
        else:
            q = sampling_probs(d_logits, params.temperature, params.top_k, params.top_p)
            sample_tokens(q.view(B * K, V), u[:, :K].reshape(B * K), out=drafts)
        rejection_sample(p, q, drafts.view(B, K), u[:, K: 2 * K], u[:, 2 * K], k_eff, out=out)

    def new_logits():
        t = torch.randn(B, K + 1, V, generator=g) * 3
        t_logits.copy_(t)
        d_logits.copy_(t[:, :K] + 0.4 * torch.randn(B, K, V, generator=g))

    def check():
        tl_, dl_, uu = t_logits.cpu(), d_logits.cpu(), u.cpu()
        p = probs(tl_, params)
        q = None if greedy_drafts else probs(dl_, params)
        d = dl_.argmax(-1) if greedy_drafts else torch.tensor(
            [[sample(q[b, j], float(uu[b, j])) for j in range(K)] for b in range(B)])
        assert drafts.view(B, K).cpu().tolist() == d.tolist()
        ref = ref_rows(p, q, d, uu[:, K: 2 * K], uu[:, 2 * K], k_eff.cpu())
        assert out[0].tolist() == [r[0] for r in ref]
        assert out[1].tolist() == [r[1] for r in ref]

    new_logits()
    step()                                   # compile outside the checked region
    graph = run_without_sync_then_capture(step)
    torch.cuda.synchronize()
    check()
    seen = set()
    for _ in range(4):
        new_logits()
        for t in out:
            poison(t)
        before = counters.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(counters, before + 2 * K + 1)      # fresh uniforms on every replay
        check()
        seen.update(out[0].tolist())
    assert len(seen) >= 2
