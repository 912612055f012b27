"""Shared pieces of the speculative-cycle tests (tests/test_speculative.py, chains; tests/test_tree.py,
trees): the float64 four-depth model they run on, plain greedy decoding as the lossless oracle, and
cache comparisons against a fresh prefill, all to ATOL."""

import torch

import inkling_ref
from configs import tiny_config
from inkling_ref.model.cache import TrunkCache

CACHE_FIELDS = ("keys", "values", "k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in")
ATOL = 1e-12


def four_depth_model(package=inkling_ref, zeroed_head=False):
    """`tiny_config` with 4 MTP depths (sliding, global, sliding, sliding), random in float64 (seed 5),
    built by `package`: inkling_ref, or a mutant copy of it (tests/mutants.py). zeroed_head: every MTP
    parameter zero, so that every draft is token 0."""
    cfg = tiny_config(num_mtp_depths=4, mtp_layer_types=["sliding", "global", "sliding", "sliding"])
    model = package.random_model(cfg, seed=5, dtype=torch.float64)
    if zeroed_head:
        with torch.no_grad():
            for p in model.mtp.parameters():
                p.zero_()
    return model


def plain_greedy(model, prompt, total_len):
    """Greedy decoding by full forwards, no cache (an oracle independent of any cycle code)."""
    seq = list(prompt)
    with torch.no_grad():
        while len(seq) < total_len:
            seq.append(int(model.logits(torch.tensor([seq]))[0, -1].argmax()))
    return seq


def rows_of(t, field, upto):
    """Rows 0..upto-1 of one cache tensor along its time dim."""
    return t[:, :, :upto] if field in ("keys", "values") else t[:, :upto]


def assert_cache_rows_equal(got, want, upto, what):
    """Rows 0..upto-1 of every field of two LayerCaches agree to ATOL (nothing to compare when upto <= 0)."""
    for f in CACHE_FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        if upto <= 0:
            continue
        assert g is not None and rows_of(g, f, upto).shape == rows_of(w, f, upto).shape, f"{what}: {f} shape"
        err = (rows_of(g, f, upto) - rows_of(w, f, upto)).abs().max().item()
        assert err < ATOL, f"{what}: {f} rows 0..{upto - 1} differ by {err:.2e}"


def assert_trunk_cache_is_fresh_prefill(model, state):
    """The state's trunk cache holds n - 1 rows, those of a fresh prefill of the committed tokens but the last."""
    fresh = TrunkCache(len(model.trunk.layers))
    with torch.no_grad():
        model.trunk(torch.tensor([state.tokens[:-1]]), fresh)
    assert state.trunk_cache.length == state.n - 1 == fresh.length
    for i, (got, want) in enumerate(zip(state.trunk_cache.layers, fresh.layers)):
        assert_cache_rows_equal(got, want, state.n - 1, f"trunk layer {i}")
