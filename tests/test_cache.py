"""Trunk caches (KV + the four conv states per layer): every cached way of running a sequence gives the
full forward's logits, in float64, to a relative error below 1e-12.

Cached calls receive only the new token ids: prefill, single-token decode, multi-token forwards on top
of a cache (the verify pass), truncation back to a shorter length. The sequences are longer than every
window and relative extent, and log-tau is active, so positions must be right for the test to pass.
"""

import pytest
import torch

import inkling_ref
from configs import tiny_config
from inkling_ref.testing import rel_l2
from mutants import load_mutant

BOUND = 1e-12
CFG = tiny_config(num_mtp_depths=0, mtp_layer_types=[])  # sliding/dense, global/dense, sliding/MoE, global/MoE
T = 40  # > window (8), > rel_extent (16), log-tau from position 7
STATE = ("keys", "values", "k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in")


def make(package=inkling_ref, seed=5):
    model = package.random_model(CFG, seed=seed, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_out, (2, T), generator=torch.Generator().manual_seed(seed + 100))
    return model, ids


@torch.no_grad()
def run_chunks(model, ids, chunks, cache):
    """Feed ids in consecutive chunks of the given sizes through the cached trunk -> logits [B, sum, V]."""
    out, start = [], 0
    for n in chunks:
        out.append(model.trunk.readout(model.trunk(ids[:, start:start + n], cache)))
        start += n
    assert start == ids.shape[1]
    return torch.cat(out, dim=1)


@torch.no_grad()
def full(model, ids):
    return model.logits(ids)


def decode_error(package=inkling_ref, prefill=13):
    """Prefill `prefill` tokens, then decode one token at a time to T."""
    model, ids = make(package)
    cache = package.TrunkCache(CFG.num_layers)
    got = run_chunks(model, ids, [prefill] + [1] * (T - prefill), cache)
    assert cache.length == T
    return rel_l2(got, full(model, ids))


def verify_error(package=inkling_ref, chunks=(9, 4, 4, 1, 4, 7, 2, 1, 8)):
    """Prefill, then multi-token forwards on top of the cache (verify passes of k + 1 tokens)."""
    model, ids = make(package)
    cache = package.TrunkCache(CFG.num_layers)
    got = run_chunks(model, ids, list(chunks), cache)
    return rel_l2(got, full(model, ids))


def truncate_error(package=inkling_ref, keep=21):
    """Run 33 tokens, truncate to `keep`, continue with different tokens: equals a fresh full forward of the
    new sequence (the rollback of a rejected draft)."""
    model, ids = make(package)
    cache = package.TrunkCache(CFG.num_layers)
    run_chunks(model, ids[:, :33], [20, 5, 1, 7], cache)
    cache.truncate(keep)
    assert cache.length == keep
    new = (ids[:, keep:] + 1 + torch.arange(T - keep)) % CFG.vocab_out  # differs from the old tokens
    assert (new != ids[:, keep:]).all()
    sizes = [1, 4, 1, 1, 5, 7, 3, 1, 9, 2, 6]
    chunks = [c for i, c in enumerate(sizes) if sum(sizes[:i + 1]) <= T - keep]
    chunks.append(T - keep - sum(chunks))
    got = run_chunks(model, new, [c for c in chunks if c], cache)
    return rel_l2(got, full(model, torch.cat([ids[:, :keep], new], dim=1))[:, keep:])


def test_prefill_and_token_by_token_decode_equal_full_forward():
    for prefill in (1, 13):
        err = decode_error(prefill=prefill)
        print(f"prefill {prefill} + decode: relative L2 error {err:.1e}")
        assert err < BOUND


@pytest.mark.parametrize("chunks", [(9, 4, 4, 1, 4, 7, 2, 1, 8), (1, 1, 17, 3, 3, 3, 12), (40,)])
def test_multi_token_forwards_on_a_cache_equal_full_forward(chunks):
    err = verify_error(chunks=chunks)
    print(f"chunks {chunks}: relative L2 error {err:.1e}")
    assert err < BOUND


@pytest.mark.parametrize("keep", [21, 32, 3, 0])
def test_truncate_then_decode_other_tokens_equals_fresh_forward(keep):
    err = truncate_error(keep=keep)
    print(f"truncate to {keep}: relative L2 error {err:.1e}")
    assert err < BOUND


def test_truncate_shortens_every_state_and_rejects_bad_lengths():
    model, ids = make()
    cache = inkling_ref.TrunkCache(CFG.num_layers)
    run_chunks(model, ids[:, :25], [25], cache)
    cache.truncate(17)
    for layer in cache.layers:
        assert layer.keys.shape[2] == layer.values.shape[2] == 17
        for name in STATE[2:]:
            assert getattr(layer, name).shape[1] == 17, name
    for bad in (-1, 18):
        with pytest.raises(ValueError, match=f"length 17 to {bad}"):
            cache.truncate(bad)


@torch.no_grad()
def test_every_cached_state_is_really_used():
    """Corrupting one row that the next step must read changes its output; corrupting a row it must not
    read (a conv input older than K-1 positions, a key outside a sliding window) changes nothing."""
    model, ids = make()
    cache = inkling_ref.TrunkCache(CFG.num_layers)
    run_chunks(model, ids[:, :30], [30], cache)
    n, K, W = 30, CFG.conv_kernel_size, CFG.sliding_window
    step = ids[:, 30:31]
    clean = model.trunk.readout(model.trunk(step, cache.clone()))
    g = torch.Generator().manual_seed(0)

    def output_with(layer, name, row):
        c = cache.clone()
        t = getattr(c.layers[layer], name)
        index = (slice(None), slice(None), row) if name in ("keys", "values") else (slice(None), row)
        t[index] += 3 * torch.randn(t[index].shape, generator=g, dtype=t.dtype)
        return model.trunk.readout(model.trunk(step, c))

    assert CFG.layer_types[0] == "sliding" and CFG.layer_types[1] == "global"
    for name in STATE:
        # layer 1 is global: it reads keys/values at every position, conv inputs at the last K-1
        row = 0 if name in ("keys", "values") else n - (K - 1)
        err = rel_l2(output_with(1, name, row), clean)
        print(f"{name} row {row} corrupted: relative change {err:.1e}")
        assert err > 1e-3, f"the cached {name} is not used"
    for name in STATE[2:]:
        assert torch.equal(output_with(0, name, n - K), clean), f"{name}: a row older than K-1 is read"
    for name in ("keys", "values"):  # the new query at position n sees keys n-W+1 .. n
        assert rel_l2(output_with(0, name, n - W + 1), clean) > 1e-3
        assert torch.equal(output_with(0, name, n - W), clean), f"{name}: a key outside the window is read"


MUTANTS = {
    "log-tau from chunk-relative positions": [("model/attention.py", "tau = log_tau(q_pos, self.n_floor",
                                               "tau = log_tau(q_pos - start, self.n_floor")],
    "attention-output conv ignores its state": [("model/block.py", "past=cache.attn_conv_in if cache is not None else None",
                                                 "past=None")],
    "MLP-output conv ignores its state": [("model/block.py", "past=cache.mlp_conv_in if cache is not None else None",
                                           "past=None")],
    "V conv ignores its state": [("model/attention.py", "past=cache.v_conv_in if cache is not None else None",
                                  "past=None")],
    "truncate keeps the conv inputs": [
        ("model/cache.py", 'for name in ("k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in"):', "for name in ():")],
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_cache_tests_catch_mutant(mutant, tmp_path):
    pkg = load_mutant(tmp_path, MUTANTS[mutant])
    errs = [decode_error(pkg, prefill=25), verify_error(pkg), truncate_error(pkg)]
    print(f"{mutant}: errors decode/verify/truncate {[f'{e:.1e}' for e in errs]}")
    assert max(errs) > 1e6 * BOUND, f"the cache tests do not notice '{mutant}'"
