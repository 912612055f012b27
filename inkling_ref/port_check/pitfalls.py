"""The known porting mistakes (docs/pitfalls.md), each rebuilt as a small variant of the depth computation
or of the depths' history, run on a dump's own inputs. The checker picks the one that reproduces an
engine's outputs; the acceptance each costs is the one docs/pitfalls.json measured on the demo checkpoint
(tests/test_port_check.py keeps the numbers below equal to that file).

A depth function has the signature of recompute.correct_depth:
    depth(head, m, h_prev [1, T, H], tokens [1, T], cache) -> out [1, T, H]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .recompute import correct_depth, replay

REFERENCE_ACCEPTANCE = (3.815, 5.258)      # the demo checkpoint without a mistake, k = 4 and k = 8


# ---------------------------------------------------------------------- wrong depth computations
def embed_normed_by_depth_only(head, m, h_prev, tokens, cache):
    """The raw row E[x] reaches the depth, whose embed_norm is then the embedding's only norm."""
    return head.mtp.chain(head.mtp.depths[m](h_prev, head.trunk.embed(tokens), cache))


def embed_normed_by_trunk_only(head, m, h_prev, tokens, cache):
    """rms(E[x]; backbone embed_norm) is concatenated as it is: the depth's embed_norm is skipped."""
    d = head.mtp.depths[m]
    c = torch.cat([d.hidden_norm(h_prev), head.trunk.embed_tokens(tokens)], dim=-1)
    return head.mtp.chain(d.block(d.input_proj(c), cache))


def embedding_first(head, m, h_prev, tokens, cache):
    """The concatenation [e | rms(h_prev)] instead of [rms(h_prev) | e]."""
    d = head.mtp.depths[m]
    e = d.embed_norm(head.trunk.embed_tokens(tokens))
    c = torch.cat([e, d.hidden_norm(h_prev)], dim=-1)
    return head.mtp.chain(d.block(d.input_proj(c), cache))


def final_norm_on_output(head, m, h_prev, tokens, cache):
    """The trunk's final norm applied to the depth's output (read by the LM head and the next depth)."""
    return head.trunk.norm(correct_depth(head, m, h_prev, tokens, cache))


def log_tau_in_depths(head, m, h_prev, tokens, cache):
    """Log-tau scaling in the global depths' attention, as in the trunk's global layers."""
    attn = head.mtp.depths[m].block.attn
    saved = attn.n_floor
    if attn.window is None:
        attn.n_floor = head.config.log_scaling_n_floor
    try:
        return correct_depth(head, m, h_prev, tokens, cache)
    finally:
        attn.n_floor = saved


def depth0_module_everywhere(head, m, h_prev, tokens, cache):
    """Every draft step runs depth 0's weights (each step still keeps its own cache)."""
    return head.mtp.chain(head.mtp.depths[0](h_prev, head.trunk.embed_tokens(tokens), cache))


# ---------------------------------------------------------------------- H as handed to depth 0
def hidden_scale(head, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [P, H] -> [P]: rms(H_p / w_norm) over the channels where the final norm's weight is not
    small. A post-final-norm hidden H_p = rms(h_p) * w_norm gives 1 at every position (up to eps)."""
    w = head.trunk.norm.weight.detach().double().cpu()
    keep = w.abs() > 0.1 * w.pow(2).mean().sqrt()
    u = hidden.double()[:, keep] / w[keep]
    return u.pow(2).mean(dim=1).sqrt()


# ---------------------------------------------------------------------- the table
Reproduce = Callable[..., torch.Tensor]    # (head, dump, steps) -> outputs [R, H]


@dataclass(frozen=True)
class KnownMistake:
    name: str                                  # its row of docs/pitfalls.md (a key of docs/pitfalls.json)
    fix: str
    acceptance: tuple[float, float]            # demo checkpoint with the mistake, k = 4 and k = 8
    reproduce: Reproduce | None                # None: recognized from the dump's inputs (hidden_scale)

    def cost(self) -> str:
        k4, k8 = (100 * (a / r - 1) for a, r in zip(self.acceptance, REFERENCE_ACCEPTANCE))
        return (f"acceptance length {self.acceptance[0]:.3f} at k = 4 ({k4:+.0f} %), {self.acceptance[1]:.3f} "
                f"at k = 8 ({k8:+.0f} %) on the demo checkpoint, against {REFERENCE_ACCEPTANCE[0]:.3f} and "
                f"{REFERENCE_ACCEPTANCE[1]:.3f} without it")


def _with(depth=correct_depth, **kw) -> Reproduce:
    return lambda head, dump, steps: replay(head, dump, steps, depth, **kw)


MUP = "trunk hidden divided by the muP multiplier"
STALE = "stale rows not repaired (the window covers only the new rows)"
OFF_BY_ONE = "drafting off by one (depth m reads token p+m)"

KNOWN_MISTAKES = [
    KnownMistake("embedding normed once, by the depth's norm only",
                 "norm the embedding twice: e = rms(rms(E[x]; trunk embed_norm); depth embed_norm)",
                 (3.827, 5.259), _with(embed_normed_by_depth_only)),
    KnownMistake("embedding normed once, by the trunk's norm only",
                 "apply the depth's own embed_norm after the trunk's (the embedding is normed twice)",
                 (3.807, 5.198), _with(embed_normed_by_trunk_only)),
    KnownMistake("embedding before hidden in the concatenation",
                 "concatenate [rms(h_prev; hidden_norm) | e]: the hidden first, then the embedding",
                 (1.010, 1.011), _with(embedding_first)),
    KnownMistake("trunk final norm before the shared LM head",
                 "feed the depth's output to the LM head and to the next depth without the trunk's final norm",
                 (3.812, 5.237), _with(final_norm_on_output)),
    KnownMistake(MUP, "hand depth 0 the trunk's post-final-norm hidden H, before the division by mup",
                 (3.815, 5.258), None),
    KnownMistake("depths 1..k-1 without history (only depth 0 stateful)",
                 "keep a cache per depth over every position and roll each back by position, never restore it",
                 (2.367, 2.897), _with(history="depth-0-only")),
    KnownMistake(STALE, "after a rejection, rerun every depth from its lowest stale row (n-1-k; "
                        "docs/spec/mtp-cycle.md §3): k rows, or the k+1 rows of the full window",
                 (3.715, 4.854), _with()),
    KnownMistake("depth conv states not rolled back (only K/V are)",
                 "roll the four conv-input states of every depth back with its KV (address them by position)",
                 (3.695, 4.959), _with(history="kv-only")),
    KnownMistake(OFF_BY_ONE, "depth m at row p reads the token at slot p+m+1 (depth 0 reads x_{p+1})",
                 (1.018, 1.019), _with(slot_offset=0)),
    KnownMistake("log-tau inside the MTP depths",
                 "apply no log-tau in the depths (vLLM's semantics; mtp_config.apply_log_scaling is false)",
                 (3.828, 5.269), _with(log_tau_in_depths)),
    KnownMistake("depth 0's module reused for every draft step",
                 "draft step m runs depth m's own weights (model.mtp.layers.m)",
                 (3.278, 3.810), _with(depth0_module_everywhere)),
]
BY_NAME = {k.name: k for k in KNOWN_MISTAKES}
