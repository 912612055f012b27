"""The multi-depth MTP speculative cycle, as explicit steps on an explicit state (one sequence).

Notation (docs/spec/mtp-cycle.md): committed tokens x_0 .. x_{n-1}; the last one, x_{n-1}, was
chosen by the trunk and is not yet fed to it ("pending"). H_p is the trunk's post-final-norm hidden
at position p. k drafts per cycle, made by depths m = 0..k-1 (depth m makes draft d_{m+1}).

The one rule: depth m at position p consumes (h^{m-1}_p, x_{p+m+1}) and predicts x_{p+m+2}, with
h^{-1}_p = H_p. Every depth keeps its own cache over all positions of the sequence.

    state = prefill(model, prompt)              trunk over the prompt; picks x_L; n = L + 1
    loop:
        d      = draft(model, state, k)         depths 0..k-1 over the window [n-2-k, n-2]
                                                (window="minimal": vLLM's rows, see `draft`)
        v      = verify(model, state, d)        trunk over [x_{n-1}, d_1..d_k] at n-1..n-1+k
        a, b   = accept_greedy(d, v.logits)     longest agreeing prefix, then the trunk's token
        commit(state, d, a, b, v)               n <- n + a + 1; roll back what was not accepted

Rollback in this reference is explicit truncation of plain tensors (the fast path uses
position-addressed rings instead; both satisfy the same invariants, tested in tests/).

Every pass checks what it computes: the hidden states it hands on (to the next depth, the caches, the
next cycle) and the logits it picks from must be finite, else `NonFiniteError` names the step. A NaN
argmax "agrees" with every other NaN argmax, so an unchecked run of NaN logits would print one
repeated token and report perfect acceptance; the fast engine flags the same steps on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model.cache import LayerCache, TrunkCache
from ..model.model import InklingModel

# select(m, logits [V], position) -> token: how depth m turns its logits at the last window row into
# the draft for absolute `position` (= n + m). Greedy by default; sampling and tests plug in others.
DraftSelector = Callable[[int, torch.Tensor, int], int]


class NonFiniteError(FloatingPointError):
    """A pass produced a NaN or an infinity: nothing decoded from it can be trusted. The message names the
    step (prefill, draft (MTP depth m), verify) and the likely cause, in one line."""


def non_finite_message(step: str) -> str:
    """The one line of a NonFiniteError in `step`, shared by both engines."""
    return (f"the {step} pass produced NaN or infinite values, so no token can be chosen from it: the weights "
            "overflow with this config.json (a key such as route_scale, logits_mup_width_multiplier or "
            "rms_norm_eps far from the model's own, or weights that are not this model's), or the dtype is too "
            "narrow for them (16-bit dtypes overflow first)")


def check_finite(step: str, *tensors: torch.Tensor) -> None:
    """Raise NonFiniteError naming `step` unless every value of `tensors` is finite."""
    for t in tensors:
        if not bool(torch.isfinite(t).all()):
            raise NonFiniteError(non_finite_message(step))


# Which rows `draft` (re)computes: "full" = k+1 rows [n-2-k, n-2] (one shape every cycle), "minimal" =
# only the rows that are new or stale, as vLLM's speculator runs them.
WINDOWS = ("full", "minimal")


def greedy_select(m: int, logits: torch.Tensor, position: int) -> int:
    """Argmax, ties to the lowest id (torch.argmax returns the first maximum)."""
    return int(torch.argmax(logits))


@dataclass
class DecodeState:
    """Everything one sequence carries between cycles.

    tokens        committed x_0 .. x_{n-1} (x_{n-1} pending: not yet fed to the trunk)
    trunk_cache   trunk KV + conv inputs for positions 0 .. n-2
    hiddens       H_p for p = 0 .. n-2, [n-1, H] (the reference keeps them all; an engine keeps k+1)
    depth_caches  one cache per MTP depth, rows 0 .. (its last window's end)
    depth_valid   per depth, how many leading rows are known to equal the teacher-forced fold
                  (set at commit; the next window starts no later than this)
    """
    tokens: list[int]
    trunk_cache: TrunkCache
    hiddens: torch.Tensor
    depth_caches: list[LayerCache] = field(default_factory=list)
    depth_valid: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass
class DraftResult:
    tokens: list[int]            # d_1 .. d_k
    logits: torch.Tensor         # [k, V]: depth m's logits at the last window row (p = n-2)
    window_start: int            # first row of the window that was (re)computed


@dataclass
class VerifyResult:
    logits: torch.Tensor         # [k+1, V]: row j judges d_{j+1}; row k gives the bonus
    hiddens: torch.Tensor        # [k+1, H]: H at positions n-1 .. n-1+k


def _ids(tokens: list[int], device) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=device)


@torch.no_grad()
def prefill(model: InklingModel, prompt: list[int], select_first: DraftSelector = greedy_select) -> DecodeState:
    """Run the trunk over the prompt x_0..x_{L-1} and pick x_L from its last logits.

    After this, n = L + 1: the trunk cache holds positions 0..L-1 and x_L is pending. The depths
    have not run yet; the first `draft` covers the whole prompt (its window starts at row 0)."""
    if len(prompt) == 0:
        raise ValueError("the prompt is empty: at least one token is needed")
    device = next(model.parameters()).device
    ids = _ids(prompt, device)
    model.check_ids(ids)
    cache = TrunkCache(len(model.trunk.layers))
    hidden = model.trunk(ids, cache)[0]                            # [L, H]
    logits = model.trunk.readout(hidden[-1])
    check_finite("prefill", hidden, logits)
    first = select_first(-1, logits, len(prompt))
    depths = model.num_mtp_depths
    return DecodeState(tokens=list(prompt) + [first], trunk_cache=cache, hiddens=hidden,
                       depth_caches=[LayerCache() for _ in range(depths)], depth_valid=[0] * depths)


@torch.no_grad()
def draft(model: InklingModel, state: DecodeState, k: int, select: DraftSelector = greedy_select,
          window: str = "full") -> DraftResult:
    """Run depths 0..k-1 over the window W = [w0, n-2] and pick the drafts d_1..d_k.

    Every row of W is recomputed, for every depth: rows that were valid are rewritten with the same
    values (up to rounding), stale rows (their token slot held a rejected draft) are repaired, new rows
    are added. Depth m at row p reads token slot p+m+1, which holds x_{p+m+1} when p+m+1 <= n-1 and
    otherwise the draft d_{p+m+2-n} made earlier in this loop.

    The rows that must be (re)computed start at v = min_m depth_valid[m]: v = n-1-k after a cycle that
    rejected a draft (k rows: the k-a-1 stale ones and the a+1 new ones), n-2-k after one that accepted
    all k (k+1 new rows), earlier right after prefill (row 0) or after cycles with a smaller k.
      window="full"     w0 = min(n-2-k, v): always at least k+1 rows, one shape every cycle (after a
                        rejection it recomputes row n-2-k, which was valid)
      window="minimal"  w0 = v: exactly the rows vLLM's speculator runs (it re-prefills r-1 rows for r
                        rejected drafts and pads its query to k+1 slots, the padded slot writing
                        nothing); what a port that must be bit-identical to vLLM in bf16 computes
    Both leave the same values in every cache (exactly so in exact arithmetic)."""
    if k < 0 or k > model.num_mtp_depths:
        raise ValueError(f"k={k} drafts need {k} MTP depths; the model has {model.num_mtp_depths}")
    if window not in WINDOWS:
        raise ValueError(f"window must be one of {WINDOWS}, got {window!r}")
    n = state.n
    v = min(state.depth_valid[:k], default=n - 1)                   # the lowest row some depth must compute
    w0 = v if window == "minimal" else min(max(0, n - 2 - k), v)
    drafts: list[int] = []
    last_logits = []
    h_prev = state.hiddens[w0: n - 1][None]                         # [1, W, H], H_p for p in W
    for m in range(k):
        slots = state.tokens + drafts                               # x_0..x_{n-1}, d_1..d_m
        tokens = slots[w0 + m + 1: n + m]                           # slot p+m+1 for p = w0..n-2
        cache = state.depth_caches[m]
        cache.truncate(w0)                                          # drop rows from the window on
        h_prev, logits = model.mtp_depth(m, h_prev, _ids(tokens, h_prev.device), cache)
        check_finite(f"draft (MTP depth {m})", h_prev, logits[0, -1])
        drafts.append(select(m, logits[0, -1], n + m))              # d_{m+1}, for position n+m
        last_logits.append(logits[0, -1])
    V = model.config.vocab_out
    logits = torch.stack(last_logits) if last_logits else state.hiddens.new_zeros(0, V)
    return DraftResult(tokens=drafts, logits=logits, window_start=w0)


def catchup_rows(state: DecodeState, k: int) -> int:
    """Rows before the window [n-2-k, n-2] that depths 0..k-1 must recompute first: those a long
    acceptance or a smaller k left behind (`draft` covers them by starting its window earlier)."""
    if k == 0:
        return 0
    return max(0, (state.n - 2 - k) - min(state.depth_valid[:k]))


@torch.no_grad()
def verify(model: InklingModel, state: DecodeState, drafts: list[int]) -> VerifyResult:
    """Run the trunk on [x_{n-1}, d_1, .., d_k] at positions n-1 .. n-1+k (on top of its cache).

    Logits at position n-2+j judge d_j (row j-1); the last row gives the bonus token."""
    device = state.hiddens.device
    ids = _ids([state.tokens[-1]] + list(drafts), device)
    model.check_ids(ids)
    hidden = model.trunk(ids, state.trunk_cache)[0]                 # [k+1, H]
    logits = model.trunk.readout(hidden)
    check_finite("verify", hidden, logits)
    return VerifyResult(logits=logits, hiddens=hidden)


def accept_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    """a = length of the longest prefix of drafts equal to the trunk's argmax; b = the trunk's
    argmax at row a (the correction, or the bonus when all k are accepted)."""
    target = torch.argmax(logits, dim=-1).tolist()                  # [k+1]
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a, target[a]


def commit(state: DecodeState, drafts: list[int], a: int, b: int, verified: VerifyResult) -> None:
    """Append d_1..d_a and b: n <- n + a + 1.

    The trunk keeps positions <= n_new - 2 = n-1+a (x_{n-1} and the accepted drafts were verified
    there); the rows of rejected drafts are dropped. Depth caches are left as they are: their rows
    whose token slot held a rejected draft are now stale and the next window rewrites them."""
    n = state.n
    if not 0 <= a <= len(drafts):
        raise ValueError(f"accepted count a={a} outside 0..{len(drafts)}")
    state.tokens += list(drafts[:a]) + [b]
    state.trunk_cache.truncate(n + a)                               # positions 0 .. n-1+a
    state.hiddens = torch.cat([state.hiddens, verified.hiddens[: a + 1]])
    for m in range(len(drafts)):  # the depths that ran in this cycle's draft (rows up to n-2)
        # row p is valid iff its token slot p+m+1 <= n-1+a (a committed token or an accepted draft)
        state.depth_valid[m] = max(0, min(n - 1, n + a - m - 1))


@torch.no_grad()
def teacher_forced_depth_caches(model: InklingModel, tokens: list[int]) -> list[LayerCache]:
    """The depth caches a one-shot chained pass over x_0..x_{n-1} writes (the oracle of invariant 3):
    depth m over rows 0..n-2-m with tokens x_{p+m+1}, hidden inputs from the same fold of depth m-1."""
    device = next(model.parameters()).device
    ids = _ids(tokens, device)
    n = len(tokens)
    h_prev = model.trunk(ids)[:, : n - 1]
    caches = []
    for m in range(model.num_mtp_depths):
        rows = n - 1 - m
        cache = LayerCache()
        if rows > 0:
            h_prev, _ = model.mtp_depth(m, h_prev[:, :rows], ids[:, m + 1: m + 1 + rows], cache)
        caches.append(cache)
    return caches
