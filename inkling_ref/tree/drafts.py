"""Tree drafts from the MTP depths, verified in one trunk pass (greedy decoding, one sequence).

A chain cycle (speculative.py) drafts one token per depth: depth m reads draft d_m and proposes
d_{m+1}. A depth is a next-token model conditioned on a token, so it can equally be asked about its
second or third most likely token, and each of those can be continued by the next depth: a tree.

    spec  = TreeSpec.from_branching([2, 2, 1, 1])   shape fixed in advance: 2 + 4 + 4 + 4 = 14 drafts
    state = speculative.prefill(model, prompt)
    loop:
        tree = draft_tree(model, state, spec)       depth m expands every level-m node into its top-b
        v    = verify_tree(model, state, tree)      trunk over root + all nodes, one pass, tree masks
        path, b = accept_tree_greedy(tree, v.logits)  the longest root-to-leaf path the trunk agrees with
        commit_tree(state, tree, path, b, v)        keep exactly the rows of the accepted path

Notation as in speculative.py: committed x_0 .. x_{n-1}, x_{n-1} pending. The root (node 0) is x_{n-1};
a node at level i (1..D) is a candidate for position n-1+i. The one rule of the chain still holds
along every root-to-leaf path v_0 = x_{n-1}, v_1, .., v_D: depth m at row p reads (h^{m-1}_p, token
slot p+m+1) where slot n-1+i holds v_i. Hence in depth m, node u at level i has its own row at position

    n-2-m+level(u)       token = u's token, hidden = depth m-1's row of u's parent,
                         predecessor (short convs, attention) = the row of u's parent

and the root's row in depth m is the last committed row, n-2-m. Rows of depth m below n-2-m hold
committed tokens and are shared by every node (the window [w0, n-2-m], as in the chain). Candidates
for u's children are the top-b of depth level(u)'s logits at u's row (position n-2): the first child
is the top-1, so the branching [1, .., 1] is exactly the greedy chain.

Verify: the trunk runs root + nodes in one pass with `parents` (tree_paths.py): a node sits at
position n-1+level, attends to the committed prefix and its own ancestors, and each short conv reads
the node's last K-1 inputs along its ancestor path. Commit keeps, in every cache, the committed rows
plus the rows of the accepted path, in order: what a chain cycle that drafted that path keeps after
its own commit, minus the stale rows a chain leaves behind (rows whose token slot held a rejected
draft), which the next window would rewrite before anything reads them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..decoding import speculative as S
from ..model.cache import LayerCache
from ..model.model import InklingModel

# candidates(m, logits [V], position, count) -> the `count` tokens depth m proposes, best first, for
# the children of one node (at absolute `position`). Default: the top `count`; tests plug in scripts.
CandidateSelector = Callable[[int, torch.Tensor, int, int], list[int]]


def top_candidates(m: int, logits: torch.Tensor, position: int, count: int) -> list[int]:
    """The `count` most likely tokens, best first; ties to the lowest id (so the first is the argmax)."""
    order = torch.sort(logits, descending=True, stable=True).indices
    return order[:count].tolist()


# ============================================================================ the shape

@dataclass(frozen=True)
class TreeSpec:
    """A draft tree's shape, fixed before any token is known.

    Each draft node is named by its ranks from the root: (0,) the top-1 of depth 0, (1,) its second
    choice, (0, 1) the second choice of depth 1 after (0,), ... The set must be prefix-closed. Nodes
    are numbered 1..N level by level and, within a level, by their rank path, so a parent comes before
    its children and siblings are ordered by rank; node 0 is the root (the pending token)."""
    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...] = field(init=False)     # [N+1], parents[0] = -1
    levels: tuple[int, ...] = field(init=False)      # [N+1], levels[0] = 0
    ranks: tuple[int, ...] = field(init=False)       # [N+1], ranks[0] = 0 (unused)
    children: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self):
        paths = sorted({tuple(int(r) for r in p) for p in self.paths}, key=lambda p: (len(p), p))
        if len(paths) != len(self.paths):
            raise ValueError("tree paths must be distinct")
        known = {(): 0}
        parents, levels, ranks = [-1], [0], [0]
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"tree path {p}: a node is a non-empty tuple of ranks >= 0")
            if p[:-1] not in known:
                raise ValueError(f"tree path {p}: its parent {p[:-1]} is not in the tree (paths must be "
                                 "prefix-closed)")
            known[p] = len(parents)
            parents.append(known[p[:-1]])
            levels.append(len(p))
            ranks.append(p[-1])
        children = [[] for _ in parents]
        for u in range(1, len(parents)):
            children[parents[u]].append(u)
        object.__setattr__(self, "paths", tuple(paths))
        object.__setattr__(self, "parents", tuple(parents))
        object.__setattr__(self, "levels", tuple(levels))
        object.__setattr__(self, "ranks", tuple(ranks))
        object.__setattr__(self, "children", tuple(tuple(c) for c in children))

    @classmethod
    def from_branching(cls, branching: list[int]) -> "TreeSpec":
        """Every node at level i-1 gets the top branching[i-1] candidates: [2, 2, 1, 1] has 2, 4, 4, 4
        nodes on levels 1..4. [1] * k is the chain of k drafts."""
        if any(not isinstance(b, int) or b < 1 for b in branching):
            raise ValueError(f"branching {list(branching)}: every level needs an integer branching >= 1")
        paths, level = [], [()]
        for b in branching:
            level = [p + (r,) for p in level for r in range(b)]
            paths += level
        return cls(tuple(paths))

    @classmethod
    def chain(cls, k: int) -> "TreeSpec":
        return cls.from_branching([1] * k)

    @property
    def num_nodes(self) -> int:
        """Draft nodes (the root not counted); the trunk verifies num_nodes + 1 tokens."""
        return len(self.parents) - 1

    @property
    def depth(self) -> int:
        """The deepest level = the number of MTP depths the draft uses."""
        return max(self.levels)

    def level_sizes(self) -> list[int]:
        """Nodes per level 1..depth."""
        return [self.levels.count(i) for i in range(1, self.depth + 1)]

    def expanding(self, level: int) -> list[int]:
        """Nodes at `level` that have children (depth `level` computes their candidates)."""
        return [u for u in range(len(self.parents)) if self.levels[u] == level and self.children[u]]

    def depth_rows(self, m: int) -> list[int]:
        """The draft nodes that need a row in depth m: every node at levels 1..m on the way to a node
        that depth m expands (itself included), in node order."""
        need = set()
        for u in self.expanding(m):
            while u > 0:
                need.add(u)
                u = self.parents[u]
        return sorted(need)

    def truncated(self, depth: int) -> "TreeSpec":
        """The same tree cut below `depth` levels (near the length limit)."""
        return TreeSpec(tuple(p for p in self.paths if len(p) <= depth))

    def path_to(self, u: int) -> list[int]:
        """Nodes from level 1 down to u."""
        out = []
        while u > 0:
            out.append(u)
            u = self.parents[u]
        return out[::-1]

    def leaves(self) -> list[int]:
        return [u for u in range(1, len(self.parents)) if not self.children[u]]

    def branching(self) -> list[int] | None:
        """[b_1, .., b_D] when the tree is TreeSpec.from_branching of it, else None (a sparse tree)."""
        firsts = [next(u for u in range(len(self.parents)) if self.levels[u] == i) for i in range(self.depth)]
        b = [len(self.children[u]) for u in firsts]
        return b if TreeSpec.from_branching(b).paths == self.paths else None

    def describe(self) -> str:
        b = self.branching()
        return f"branching {b}" if b is not None else f"nodes per level {self.level_sizes()}"


# ============================================================================ one cycle

@dataclass
class DraftTree:
    spec: TreeSpec
    tokens: list[int]                 # [N+1]: tokens[0] = x_{n-1}, tokens[u] = node u's draft
    logits: torch.Tensor              # [N+1, V]: row u = the depth logits u was chosen from (row 0: zeros)
    window_start: int                 # w0: the first row every depth (re)computed
    depth_rows: list[dict[int, int]]  # per depth m: node -> its row's index in depth m's cache
    depth_committed: list[int]        # per depth m: cache rows 0..this-1 hold committed tokens


@dataclass
class TreeVerifyResult:
    logits: torch.Tensor              # [N+1, V]: row u judges u's children (and gives the bonus at a leaf)
    hiddens: torch.Tensor             # [N+1, H]: H at node u (position n-1+level(u))


def _ids(tokens: list[int], device) -> torch.Tensor:
    return torch.tensor([tokens], dtype=torch.long, device=device)


def run_depth(model: InklingModel, m: int, h_prev: torch.Tensor, tokens: torch.Tensor, cache: LayerCache,
              parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth m over rows that form a tree (`parents`, tree_paths.py): h_prev [1, R, H], tokens [1, R]
    -> (out [1, R, H], logits [1, R, V]); the rows are appended to `cache` in row order."""
    y = model.mtp.depths[m](h_prev, model.trunk.embed_tokens(tokens), cache, parents)
    out = model.mtp.chain(y)
    return out, model.trunk.readout(out)


@torch.no_grad()
def draft_tree(model: InklingModel, state: S.DecodeState, spec: TreeSpec,
               candidates: CandidateSelector = top_candidates) -> DraftTree:
    """Run depths 0..D-1 (D = spec.depth); depth m expands the level-m nodes into their candidates.

    Depth m runs one forward over [committed rows w0..n-2-m | the rows of spec.depth_rows(m)], the
    tree rows following their parents (the root's row is the last committed one). Node rows at a
    negative position (a prompt shorter than the tree is deep) do not exist, as in the chain."""
    D = spec.depth
    if D > model.num_mtp_depths:
        raise ValueError(f"a tree of depth {D} needs {D} MTP depths; the model has {model.num_mtp_depths}")
    n, N = state.n, spec.num_nodes
    device = state.hiddens.device
    w0 = min([max(0, n - 2 - D)] + [state.depth_valid[m] for m in range(D)])
    tokens: list[int] = [state.tokens[-1]] + [-1] * N
    logits = state.hiddens.new_zeros(N + 1, model.config.vocab_out)
    depth_rows: list[dict[int, int]] = []
    depth_committed: list[int] = []
    prev_out, prev_row = None, None        # depth m-1's outputs [R, H] and node -> row index in them
    for m in range(D):
        committed = list(range(w0, n - 1 - m))                      # rows p = w0 .. n-2-m
        nodes = [u for u in spec.depth_rows(m) if n - 2 - m + spec.levels[u] >= 0]
        row = {}                                                    # node -> row index in this forward
        if committed:
            row[0] = len(committed) - 1                             # the root's row: position n-2-m
        parents = list(range(-1, len(committed) - 1))               # committed rows follow each other
        for j, u in enumerate(nodes):
            row[u] = len(committed) + j
            parents.append(row.get(spec.parents[u], -1))            # -1 only before position 0
        ids = [state.tokens[p + m + 1] for p in committed] + [tokens[u] for u in nodes]
        if m == 0:
            h = state.hiddens[w0: n - 1]                            # H_p, p = w0..n-2 (no tree rows)
        else:
            h = torch.cat([prev_out[: len(committed)],              # depth m-1 at the same rows p
                           prev_out[[prev_row[spec.parents[u]] for u in nodes]]])
        cache = state.depth_caches[m]
        cache.truncate(w0)
        out, lg = run_depth(model, m, h[None], _ids(ids, device), cache,
                            torch.tensor(parents, dtype=torch.long, device=device))
        for u in spec.expanding(m):                                 # its row is at position n-2
            ranked = candidates(m, lg[0, row[u]], n + m, max(spec.ranks[c] for c in spec.children[u]) + 1)
            for c in spec.children[u]:
                tokens[c] = ranked[spec.ranks[c]]
                logits[c] = lg[0, row[u]]
        depth_rows.append({u: w0 + r for u, r in row.items() if u > 0})
        depth_committed.append(w0 + len(committed))
        prev_out, prev_row = out[0], row
    return DraftTree(spec=spec, tokens=tokens, logits=logits, window_start=w0, depth_rows=depth_rows,
                     depth_committed=depth_committed)


@torch.no_grad()
def verify_tree(model: InklingModel, state: S.DecodeState, tree: DraftTree) -> TreeVerifyResult:
    """The trunk over root + every node in one pass (on top of its cache): node u at position
    n-1+level(u), attending to positions 0..n-2 and its ancestors, short convs along its path."""
    ids = _ids(tree.tokens, state.hiddens.device)
    model.check_ids(ids)
    parents = torch.tensor(tree.spec.parents, dtype=torch.long, device=ids.device)
    hidden = model.trunk(ids, state.trunk_cache, parents)[0]        # [N+1, H]
    return TreeVerifyResult(logits=model.trunk.readout(hidden), hiddens=hidden)


def accept_tree_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk down from the root while a child holds the trunk's argmax at its parent. Returns (the
    accepted nodes, level 1 first; b = the trunk's argmax at the last of them: correction or bonus)."""
    target = torch.argmax(logits, dim=-1).tolist()                  # [N+1]
    u, path = 0, []
    while True:
        nxt = [c for c in tree.spec.children[u] if tree.tokens[c] == target[u]]
        if not nxt:  # siblings hold distinct candidates: at most one child matches
            return path, target[u]
        u = nxt[0]
        path.append(u)


def keep_rows(cache: LayerCache, rows: list[int]) -> None:
    """Keep only cache rows `rows` (indices along the time dim, in this order); they become 0..len-1."""
    if cache.keys is None:
        if rows:
            raise ValueError(f"cannot keep rows {rows[:4]} of an empty cache")
        return
    index = torch.tensor(rows, dtype=torch.long, device=cache.keys.device)
    cache.keys, cache.values = cache.keys.index_select(2, index), cache.values.index_select(2, index)
    for name in ("k_conv_in", "v_conv_in", "attn_conv_in", "mlp_conv_in"):
        setattr(cache, name, getattr(cache, name).index_select(1, index))


def commit_tree(state: S.DecodeState, tree: DraftTree, path: list[int], b: int,
                verified: TreeVerifyResult) -> None:
    """Append the accepted drafts and b (n <- n + a + 1, a = len(path)); keep, in every cache, the
    committed rows and the rows of the accepted path, in path order; drop every other tree row.

    Trunk: rows 0..n-2, then the root's and the accepted nodes' rows (positions n-1..n-1+a).
    Depth m: its committed rows 0..n-2-m, then the rows of the accepted nodes v_1..v_min(a, m) while
    they exist (a sparse tree may not have expanded one); depth_valid[m] = the rows kept."""
    spec, n, a = tree.spec, state.n, len(path)
    for i, u in enumerate(path):
        if spec.levels[u] != i + 1 or spec.parents[u] != (path[i - 1] if i else 0):
            raise ValueError(f"accepted nodes {path} are not a path from the root")
    state.tokens += [tree.tokens[u] for u in path] + [b]
    trunk_rows = list(range(n - 1)) + [n - 1 + u for u in [0] + path]
    for layer in state.trunk_cache.layers:
        keep_rows(layer, trunk_rows)
    state.hiddens = torch.cat([state.hiddens, verified.hiddens[[0] + path]])
    for m in range(spec.depth):
        rows = list(range(tree.depth_committed[m]))                 # positions 0..n-2-m
        for i, u in enumerate(path[:m], start=1):
            if n - 2 - m + i < 0:                                   # before position 0: no row
                continue
            if u not in tree.depth_rows[m]:                         # not expanded here: stop
                break
            rows.append(tree.depth_rows[m][u])
        keep_rows(state.depth_caches[m], rows)
        state.depth_valid[m] = len(rows)


# ============================================================================ the oracle

def clone_state(state: S.DecodeState) -> S.DecodeState:
    return copy.deepcopy(state)


@torch.no_grad()
def verify_paths(model: InklingModel, state: S.DecodeState, tree: DraftTree) -> TreeVerifyResult:
    """The oracle of verify_tree: every root-to-leaf path verified as a chain (speculative.verify on
    a copy of the state whose trunk cache is cut to the committed rows 0..n-2, so it may be called
    before or after verify_tree). Each node's row comes from the first path through it."""
    spec = tree.spec
    state = clone_state(state)
    state.trunk_cache.truncate(state.n - 1)
    logits = [None] * (spec.num_nodes + 1)
    hiddens = [None] * (spec.num_nodes + 1)
    leaves = spec.leaves() or [0]
    for leaf in leaves:
        nodes = [0] + spec.path_to(leaf)
        v = S.verify(model, clone_state(state), [tree.tokens[u] for u in nodes[1:]])
        for j, u in enumerate(nodes):
            if logits[u] is None:
                logits[u], hiddens[u] = v.logits[j], v.hiddens[j]
    return TreeVerifyResult(logits=torch.stack(logits), hiddens=torch.stack(hiddens))


# ============================================================================ decoding

@dataclass
class TreeCycle:
    depth: int            # levels drafted this cycle (the spec's depth, less near the length limit)
    nodes: int            # draft nodes verified this cycle
    accepted: int         # a: accepted drafts
    ranks: tuple[int, ...]  # the accepted path as candidate ranks per level, () when a = 0
    emitted: list[int]    # accepted drafts then b (cut at EOS)
    counted: bool         # used the full spec and emitted no EOS


@torch.no_grad()
def generate_tree(model: InklingModel, prompt: list[int], max_new_tokens: int, spec: TreeSpec,
                  candidates: CandidateSelector = top_candidates,
                  eos_token_id: int | None = None) -> tuple[list[int], list[TreeCycle]]:
    """Greedy decoding of one prompt with tree drafts: the new tokens (the prefill's first) and one
    record per verify pass. Near the length limit the tree is cut to the levels that still fit."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    max_len = model.config.max_position_embeddings
    if len(prompt) + max_new_tokens > max_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} the "
                         f"sequence would reach {len(prompt) + max_new_tokens}, beyond the model's {max_len}")
    if spec.depth > model.num_mtp_depths:
        raise ValueError(f"a tree of depth {spec.depth} needs {spec.depth} MTP depths; the model has "
                         f"{model.num_mtp_depths}")
    state = S.prefill(model, prompt)
    out = [state.tokens[-1]]
    cycles: list[TreeCycle] = []
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        depth = min(spec.depth, max_new_tokens - len(out) - 1, max_len - state.n)
        sp = spec if depth == spec.depth else spec.truncated(depth)
        tree = draft_tree(model, state, sp, candidates)
        v = verify_tree(model, state, tree)
        path, b = accept_tree_greedy(tree, v.logits)
        commit_tree(state, tree, path, b, v)
        emitted = [tree.tokens[u] for u in path] + [b]
        hit_eos = eos_token_id is not None and eos_token_id in emitted
        if hit_eos:
            emitted = emitted[: emitted.index(eos_token_id) + 1]
        out += emitted
        cycles.append(TreeCycle(depth=depth, nodes=sp.num_nodes, accepted=len(path),
                                ranks=sp.paths[path[-1] - 1] if path else (), emitted=emitted,
                                counted=(sp is spec and not hit_eos)))
    return out, cycles
