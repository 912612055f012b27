"""An independent computation of the MTP depths, written straight from the spec formulas
(docs/spec/inkling-architecture.md §1-2) with per-position loops and no shared helpers: tensors
are read by their *released* checkpoint names, nothing from inkling_ref's modules is called except
the trunk hidden H (itself proven against transformers). It must agree with `mtp_logits`, and
catches what the cycle invariants cannot (both sides of those share the depth module): embed-first
concat, a single-normed embedding, halves instead of interleaved w13."""

import math

import pytest
import torch

from configs import tiny_config
from inkling_ref import random_model
from inkling_ref.io.names import to_released
from inkling_ref.testing import rel_l2
from mutants import DEPTH_MUTANTS, load_mutant


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean() + eps) * w


def conv_at(inputs, w, p):
    """y[p] = x[p] + sum_j w[:, j] * x[p-(K-1)+j], x before position 0 = 0; w: [C, 1, K]."""
    K = w.shape[-1]
    y = inputs[p].clone()
    for j in range(K):
        src = p - (K - 1) + j
        if src >= 0:
            y = y + w[:, 0, j] * inputs[src]
    return y


def depth_by_formula(W, cfg, m, h_prev, tokens):
    """Depth m on rows p = 0..P-1 (token slots `tokens`, hidden inputs h_prev [P, H]) -> out [P, H]."""
    eps = cfg.rms_norm_eps
    pre, blk = f"model.mtp.layers.{m}.", f"model.mtp.layers.{m}.transformer_block."
    sliding = cfg.mtp_layer_types[m] == "sliding"
    nH, nKV, hd, E = cfg.attention_shape("sliding" if sliding else "global")
    P = len(tokens)

    z = []
    for p in range(P):
        e = rms(rms(W["model.llm.embed.weight"][tokens[p]], W["model.llm.embed_norm.weight"], eps),
                W[pre + "embed_norm.weight"], eps)
        c = torch.cat([rms(h_prev[p], W[pre + "hidden_norm.weight"], eps), e])  # hidden first
        z.append(W[pre + "input_proj.weight"] @ c)

    x = [rms(z[p], W[blk + "attn_norm.weight"], eps) for p in range(P)]
    q = [W[blk + "attn.wq_du.weight"] @ x[p] for p in range(P)]
    k_in = [W[blk + "attn.wk_dv.weight"] @ x[p] for p in range(P)]
    v_in = [W[blk + "attn.wv_dv.weight"] @ x[p] for p in range(P)]
    r = [W[blk + "attn.wr_du.weight"] @ x[p] for p in range(P)]
    k = [conv_at(k_in, W[blk + "attn.k_sconv.weight"], p) for p in range(P)]
    v = [conv_at(v_in, W[blk + "attn.v_sconv.weight"], p) for p in range(P)]
    Prel = W[blk + "attn.rel_logits_proj.proj"]  # [d_rel, E]
    d_rel = Prel.shape[0]

    attn = []
    for p in range(P):
        heads = []
        for h in range(nH):
            g = h // (nH // nKV)
            qh = rms(q[p][h * hd:(h + 1) * hd], W[blk + "attn.q_norm.weight"], eps)
            rel = r[p][h * d_rel:(h + 1) * d_rel] @ Prel  # [E]
            keys = [j for j in range(p + 1) if not sliding or p - j < cfg.sliding_window]
            scores = []
            for j in keys:
                kj = rms(k[j][g * hd:(g + 1) * hd], W[blk + "attn.k_norm.weight"], eps)
                bias = rel[p - j] if p - j < E else 0.0
                scores.append(qh @ kj / hd + bias)
            probs = torch.softmax(torch.stack(scores), dim=0)
            heads.append(sum(pr * v[j][g * hd:(g + 1) * hd] for pr, j in zip(probs, keys)))
        attn.append(W[blk + "attn.wo_ud.weight"] @ torch.cat(heads))

    h1 = [z[p] + conv_at(attn, W[blk + "attn_sconv.weight"], p) for p in range(P)]
    mlp = []
    for p in range(P):
        xm = rms(h1[p], W[blk + "mlp_norm.weight"], eps)
        gu = W[blk + "mlp.w13_dn.weight"] @ xm
        gate, up = gu[0::2], gu[1::2]  # interleaved rows
        mlp.append((W[blk + "mlp.w2_md.weight"] @ (gate * torch.sigmoid(gate) * up)) * W[blk + "mlp.global_scale"])
    out = [h1[p] + conv_at(mlp, W[blk + "mlp_sconv.weight"], p) for p in range(P)]
    if cfg.chain_hidden_post_norm:
        out = [rms(o, W["model.mtp.chain_norm.weight"], eps) for o in out]
    return torch.stack(out)


def logits_by_formula(W, cfg, out):
    return (out @ W["model.llm.unembed.weight"].T / cfg.mup)[:, : cfg.vocab_out]


def spec_error(pkg, chain_norm: bool) -> float:
    cfg = tiny_config(num_mtp_depths=2, mtp_layer_types=["global", "sliding"], chain_hidden_post_norm=chain_norm)
    model = pkg.random_model(cfg, seed=21, dtype=torch.float64)
    W = {to_released(n): p.detach() for n, p in model.named_parameters()}
    T = 21  # longer than the window (8) and the global extent (16)
    ids = torch.randint(0, cfg.vocab_out, (1, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model.mtp_logits(ids)
        H = model.hidden(ids)[0]
    h_prev, worst = H[: T - 1], 0.0
    tokens = ids[0].tolist()
    for m in range(2):
        rows = T - 1 - m
        out = depth_by_formula(W, cfg, m, h_prev[:rows], tokens[m + 1: m + 1 + rows])
        want = logits_by_formula(W, cfg, out)
        worst = max(worst, rel_l2(got[m][0], want))
        h_prev = out
    return worst


@pytest.mark.parametrize("chain_norm", [False, True])
def test_mtp_logits_match_spec_formulas(chain_norm):
    import inkling_ref
    err = spec_error(inkling_ref, chain_norm)
    print(f"chain_norm={chain_norm}: relative L2 error {err:.1e}")
    assert err < 1e-12


MUTANTS = DEPTH_MUTANTS


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_spec_formulas_catch_mutant(mutant, tmp_path):
    err = spec_error(load_mutant(tmp_path, MUTANTS[mutant]), chain_norm=False)
    assert err > 1e-3, f"'{mutant}' is not caught (error {err:.1e})"
    assert not math.isnan(err)
