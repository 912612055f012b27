"""The steps of a dump, and the rules a dump's fields obey (checked before anything is recomputed).

A step is one draft phase. Its token slots are x_0..x_{n-1}, d_1..d_k: depth m at row p reads slot
p+m+1 (docs/spec/mtp-cycle.md §1). In a step every depth m < k ran a contiguous range of rows ending at
n-2 (the row that drafts d_{m+1}), and depth m's rows lie inside depth m-1's (its input is their output).
Between steps, n grows by the a accepted drafts plus the trunk's token, and the accepted drafts are the
committed tokens that follow x_{n-1}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    index: int
    n: int                     # committed tokens when the depths ran (x_{n-1} pending)
    k: int                     # depths run, d_1..d_k drafted
    drafts: list[int]
    slots: list[int]           # x_0..x_{n-1}, d_1..d_k
    rows: list[range]          # rows[m]: the positions depth m ran
    first: list[int]           # first[m]: the dump row index of depth m's first row in this step
    next_n: int | None         # n after this step's commit (None after the last step)


def sort_rows(f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The row fields in (step, depth, position) order."""
    span = int(f["row_position"].max()) + 1
    key = (f["row_step"] * (int(f["row_depth"].max()) + 1) + f["row_depth"]) * span + f["row_position"]
    order = torch.argsort(key)
    return {n: t[order] if n.startswith("row_") else t for n, t in f.items()}


def steps_of(dump) -> list[Step]:
    """The dump's steps (its fields already checked by check_fields)."""
    f = dump.fields
    tokens = f["tokens"].tolist()
    ns, ks = f["step_n"].tolist(), f["step_k"].tolist()
    step, depth, pos = f["row_step"].tolist(), f["row_depth"].tolist(), f["row_position"].tolist()
    first: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip(step, depth)):
        first.setdefault(key, i)
        last[key] = i
    out = []
    for c, (n, k) in enumerate(zip(ns, ks)):
        drafts = f["step_drafts"][c, :k].tolist()
        out.append(Step(c, n, k, drafts, tokens[:n] + drafts,
                        [range(pos[first[c, m]], pos[last[c, m]] + 1) for m in range(k)],
                        [first[c, m] for m in range(k)], ns[c + 1] if c + 1 < len(ns) else None))
    return out


class Problem(Exception):
    """The first rule a dump's fields break (dump.read_dump turns it into a DumpError naming the file)."""


def check_fields(f: dict[str, torch.Tensor]) -> None:
    """Shapes, ranges, steps and rows of a dump's fields; Problem naming the first that is wrong."""
    def need(ok: bool, why: str) -> None:
        if not ok:
            raise Problem(why)

    N, (P, H), S, R = len(f["tokens"]), f["hidden"].shape, len(f["step_n"]), len(f["row_step"])
    need(N >= 2 and P >= 1 and S >= 1 and R >= 1, f"empty dump: {N} tokens, {P} hidden rows, {S} steps, {R} rows "
                                                  "(a dump needs at least one step with its rows)")
    for name in ("step_k", "step_drafts"):
        need(f[name].shape[0] == S, f"field {name!r} has {f[name].shape[0]} entries for the {S} steps of step_n")
    for name in ("row_depth", "row_position", "row_hidden", "row_token", "row_logits", "row_hidden_in"):
        if name in f:
            need(f[name].shape[0] == R, f"field {name!r} has {f[name].shape[0]} rows; row_step lists {R}")
    for name in ("row_hidden", "row_hidden_in"):
        if name in f:
            need(f[name].shape[1] == H, f"field {name!r} is {f[name].shape[1]} wide; hidden is {H} wide")
    for name in ("tokens", "row_token"):
        if name in f:
            need(bool((f[name] >= 0).all()), f"field {name!r} holds negative token ids")
    need(bool(torch.isfinite(f["hidden"]).all()), "field 'hidden' holds NaN or infinite values")

    ns, ks = f["step_n"].tolist(), f["step_k"].tolist()
    K = f["step_drafts"].shape[1]
    for c, (n, k) in enumerate(zip(ns, ks)):
        need(n >= 2, f"step {c}: n = {n}; a step needs at least the prompt's first token and x_n-1 (n >= 2)")
        need(1 <= k <= K, f"step {c}: k = {k}; it must be 1..{K} (the columns of step_drafts)")
        drafts = f["step_drafts"][c, :k].tolist()
        need(min(drafts) >= 0, f"step {c}: step_drafts holds {drafts} for its k = {k} drafts (ids must be >= 0)")
        if c + 1 < S:
            a = ns[c + 1] - n - 1
            need(0 <= a <= k, f"steps {c} and {c + 1}: n goes {n} -> {ns[c + 1]}; a step commits its accepted "
                              f"drafts and one token: n + 1 .. n + k + 1 (k = {k})")
            need(N >= n + a, f"field 'tokens' has {N} tokens; step {c + 1} has n = {ns[c + 1]}")
            committed = f["tokens"][n: n + a].tolist()
            need(committed == drafts[:a], f"step {c} accepted {a} draft(s) (n goes {n} -> {ns[c + 1]}) but "
                                          f"tokens[{n}:{n + a}] = {committed} are not its drafts {drafts[:a]}")
    need(N >= ns[-1], f"field 'tokens' has {N} tokens; the last step has n = {ns[-1]}")
    need(P >= max(ns) - 1, f"field 'hidden' has {P} rows; the steps read H_p up to p = {max(ns) - 2}")

    step, depth, pos = f["row_step"], f["row_depth"], f["row_position"]
    need(bool(((step >= 0) & (step < S)).all()), f"field 'row_step' must be in 0..{S - 1}")
    k_of_row = f["step_k"][step.clamp(0, S - 1)]
    need(bool(((depth >= 0) & (depth < k_of_row)).all()), "field 'row_depth': a row's depth must be below its "
                                                          "step's k")
    need(bool((pos >= 0).all()), "field 'row_position' holds negative positions")
    ranges: dict[tuple[int, int], list[int]] = {}
    for s, m, p in zip(step.tolist(), depth.tolist(), pos.tolist()):
        ranges.setdefault((s, m), []).append(p)
    for c, (n, k) in enumerate(zip(ns, ks)):
        lo_prev = 0
        for m in range(k):
            ps = sorted(ranges.get((c, m), []))
            need(bool(ps), f"step {c}: depth {m} ran no row (each of the step's k = {k} depths drafts from row "
                           f"n-2 = {n - 2})")
            need(ps == list(range(ps[0], n - 1)), f"step {c}, depth {m}: rows {ps[0]}..{ps[-1]} with {_gaps(ps, n)}; "
                                                  f"a depth's rows in a step must be contiguous, once each, ending "
                                                  f"at n-2 = {n - 2}")
            need(ps[0] >= lo_prev, f"step {c}: depth {m} ran row {ps[0]}, which depth {m - 1} did not run "
                                   f"(it starts at {lo_prev}); depth {m} reads depth {m - 1}'s output")
            lo_prev = ps[0]


def _gaps(ps: list[int], n: int) -> str:
    """What keeps the positions ps from being ps[0]..n-2, once each."""
    seen = set(ps)
    said = [f"{len(ps) - len(seen)} repeated"] if len(seen) < len(ps) else []
    missing = [p for p in range(ps[0], n - 1) if p not in seen]
    if missing:
        said.append(f"{len(missing)} missing (first {missing[0]})")
    if ps[-1] > n - 2:
        said.append(f"rows past n-2 = {n - 2}")
    return ", ".join(said)
