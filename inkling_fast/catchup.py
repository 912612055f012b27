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
takes w0 = min(n-2-k, the first row some depth lacks)), over caches that keep every row.

Where the catch-up starts. Depth m's input at row p is depth m-1's output there, which no cache keeps,
so the pass runs every depth 0..k-1 from the first row any of them lacks, c0. Each of them then reads
its own history below c0 from its caches: the last `window` keys (a ring of window + K + 1 rows on
sliding depths) and the K_conv - 1 conv inputs (rings of K_conv + K rows), K the most drafts a cycle
makes. Those still hold the rows below c0 only while the depth has written at most K rows past c0
(`top`, the highest row written). A depth that has run on since (depth 0 during a long stretch at a
small k, while depth 3 waited) has overwritten them: the pass then starts from row 0 instead, where no
history is needed (a cold catch-up: every row below the window, recomputed).

`DepthRows` mirrors, per sequence, what the device holds: the committed length n and, per depth, how
many leading rows equal the teacher-forced fold (`valid`) and the highest row written (`top`), updated
by the same rules as the reference's `commit` from each booked cycle's accepted count. It is exact for
booked steps; for a cycle in flight at the same k as the next one nothing is missing (a <= k), which
is why the scheduler books every cycle in flight before it changes k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CATCHUP_LENGTHS = (8, 32, 128)       # rows per sequence of a catch-up pass (one captured graph each)


@dataclass
class DepthRows:
    """n: committed tokens after the booked steps; valid[m]: leading rows of depth m equal to the fold;
    top[m]: the highest row depth m has written (-1: none); pending: the k of each launched, not yet
    booked cycle; slack: K, the rows a depth may run past a catch-up's first row (module docstring)."""
    n: int = 0
    valid: list[int] = field(default_factory=list)
    top: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    slack: int = 0

    def after_prefill(self, prompt_len: int, k: int, depths: int) -> None:
        """A prefill pass at k = depths wrote depth rows 0..L-2-k of depths 0..k-1; n = L + 1."""
        self.n, self.slack = prompt_len + 1, depths
        self.valid = [max(0, prompt_len - 1 - k) if m < k else 0 for m in range(depths)]
        self.top = [prompt_len - 2 - k if m < k else -1 for m in range(depths)]

    def after_cycle(self, k: int, accepted: int) -> None:
        """A booked cycle at k that accepted `accepted` drafts: the reference's commit rule."""
        n = self.n
        for m in range(k):
            self.valid[m] = max(0, min(n - 1, n + accepted - m - 1))
            self.top[m] = max(self.top[m], n - 2)
        self.n = n + accepted + 1
        self.pending.pop(0)

    def missing(self, k: int) -> tuple[int, int]:
        """(first row, count) depths 0..k-1 must recompute below the window of a cycle at k: from the
        first row one of them lacks, or from row 0 when a depth has run on too far past it (module
        docstring). Exact when nothing is pending; zero when only cycles at this k are."""
        end = self.n - 2 - k                                   # the window's first row
        if k == 0 or end <= 0 or (self.pending and all(p == k for p in self.pending)):
            return 0, 0
        first = min(self.valid[:k])
        if first >= end:
            return 0, 0
        if max(self.top[:k]) - first > self.slack:             # its history below `first` is overwritten
            first = 0
        return first, end - first

    def caught_up(self, k: int) -> None:
        """Depths 0..k-1 now hold every row below the window of a cycle at k (rows from there on are the
        window's to rewrite)."""
        end = self.n - 2 - k
        for m in range(k):
            self.valid[m] = end
            self.top[m] = max(self.top[m], end - 1)


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
