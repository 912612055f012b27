"""Keeping the MTP depths' caches current when k changes from cycle to cycle (host only, no tensors).

A cycle at k runs depths 0..k-1 over the window [n-2-k, n-2] (device_steps.py). With one k throughout,
that window reaches back to every row an earlier cycle left stale or never wrote (docs/spec/mtp-cycle.md
§2). When k changes it need not:

    a smaller k      depths k..K-1 do not run, and fall behind by the tokens committed meanwhile
    a longer accept  after a cycle at k1 that accepted a drafts, a cycle at k2 < a starts its window
                     a - k2 rows above the rows depths 0..k2-1 last finished

So before a cycle at k, depths 0..k-1 recompute the rows they miss below the window, from committed
tokens and the trunk's hiddens (a catch-up pass, batched across sequences like a prefill pass:
device_steps.catchup_rows). The reference does the same by starting its window earlier (its `draft`
takes w0 = min(n-2-k, the first row some depth lacks)).

`DepthRows` mirrors, per sequence, what the device knows: the committed length n and, per depth, how
many leading rows equal the teacher-forced fold (`valid`), updated by the same rules as the reference's
`commit` from each booked cycle's accepted count. It is exact for booked steps; for a cycle in flight
at the same k as the next one nothing is missing (a <= k), which is why the scheduler books every
cycle in flight before it changes k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATCHUP_LENGTHS = (8, 32, 128)       # rows per sequence of a catch-up pass (one captured graph each)


@dataclass
class DepthRows:
    """n: committed tokens after the booked steps; valid[m]: leading rows of depth m equal to the fold;
    pending: the k of each launched, not yet booked cycle."""
    n: int = 0
    valid: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    def after_prefill(self, prompt_len: int, k: int, depths: int) -> None:
        """A prefill pass at k wrote depth rows 0..L-2-k of depths 0..k-1; n = L + 1."""
        self.n = prompt_len + 1
        self.valid = [max(0, prompt_len - 1 - k) if m < k else 0 for m in range(depths)]

    def after_cycle(self, k: int, accepted: int) -> None:
        """A booked cycle at k that accepted `accepted` drafts: the reference's commit rule."""
        n = self.n
        for m in range(k):
            self.valid[m] = max(0, min(n - 1, n + accepted - m - 1))
        self.n = n + accepted + 1
        self.pending.pop(0)

    def missing(self, k: int) -> tuple[int, int]:
        """(first row, count) depths 0..k-1 must recompute below the window of a cycle at k; exact when
        nothing is pending, zero when only cycles at this k are (their windows reach back far enough)."""
        if k == 0 or (self.pending and all(p == k for p in self.pending)):
            return 0, 0
        first = min(self.valid[:k])
        return first, max(0, (self.n - 2 - k) - first)

    def caught_up(self, k: int) -> None:
        """Depths 0..k-1 now hold every row below the window of a cycle at k."""
        top = max(0, self.n - 2 - k)
        for m in range(k):
            self.valid[m] = max(self.valid[m], top)


def catchup_passes(needs: list[tuple[int, int]], lengths=CATCHUP_LENGTHS) -> tuple[int, list[list[tuple[int, int]]]]:
    """needs: (first row, count) per sequence. Returns (T, passes): the pass length (the smallest of
    `lengths` that covers the largest count, else the largest), and per pass the (first row, count <= T)
    of each sequence (count 0: nothing to do in that pass)."""
    top = max((c for _, c in needs), default=0)
    T = next((t for t in lengths if t >= top), lengths[-1])
    passes = []
    for start in range(0, top, T):
        passes.append([(first + start, max(0, min(T, count - start))) for first, count in needs])
    return T, passes
