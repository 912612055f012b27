"""When does k-depth MTP pay off? A cost model of the speculative cycle from measured costs.

The model (docs/cost_model.md has the assumptions and limits):

    cycle(B, k)   = verify(B, k) + draft(B, k) + accept                      (k >= 1)
    verify(B, k)  = sum over trunk layers of layer_ms(kind, B, T) + lm_head_argmax_ms(B * T),  T = k + 1
    draft(B, k)   = k * depth_step_ms(B, rows = k + 1)
    plain(B)      = verify(B, 0)                                             (k = 0: T = 1, no draft)
    L(k)          = 1 + sum_{j=1..k} P(drafts 1..j all accepted)             (acceptance length)
    tokens/s      = B * L(k) / cycle(B, k)
    speedup(B, k) = tokens/s(B, k) / tokens/s(B, 0)

Every cost is a measured median of `docs/benchmarks/engine.json` (written by `benchmarks/engine.py`
on a GPU; its format: the `Costs` docstring). Between measured batch sizes (and T / rows) costs
are interpolated linearly; outside the measured grid the model raises instead of extrapolating.

Also here: the finite-generation correction used to check the model against the demo engine's
end-to-end runs (`demo_validation`), and the byte counts that explain why verify is expensive at
batch 1 (`expected_distinct_experts`, `layer_floor_bytes`). Pure Python: no torch, no GPU.
"""

from __future__ import annotations

import bisect
import math
import statistics

TRUNK_KINDS = ("sliding_dense", "sliding_moe", "global_dense", "global_moe")
LM_HEAD_KINDS = ("lm_head_argmax", "lm_head_logits")


class CostModelError(ValueError):
    """Bad or incomplete measurements / arguments; the message names the field or grid point."""


# ====================================================================== the model's shape (config)

def inkling_small_config() -> dict:
    """Inkling-Small at true scale, spelled as `inkling_ref.InklingConfig` fields (docs/spec/inkling-architecture.md §4).

    42 layers, every sixth global (5, 11, ..., 41), the first 2 with a dense MLP; 8 MTP depths,
    depths 1 and 3 global."""
    num_layers, dense_mlp_idx = 42, 2
    return dict(
        vocab_size=201024, unpadded_vocab_size=200058, hidden_size=4096, num_layers=num_layers,
        num_heads=32, num_kv_heads=8, head_dim=128, rel_extent=1024,
        swa_num_heads=32, swa_num_kv_heads=8, swa_head_dim=128, sliding_window=512, d_rel=16,
        layer_types=["global" if (i + 1) % 6 == 0 else "sliding" for i in range(num_layers)],
        mlp_types=["dense" if i < dense_mlp_idx else "moe" for i in range(num_layers)],
        dense_intermediate_size=16384, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=2, route_scale=8.0,
        mup=16.0, conv_kernel_size=4, max_position_embeddings=131072,
        num_mtp_depths=8,
        mtp_layer_types=["sliding" if d in (0, 2, 4, 5, 6, 7) else "global" for d in range(8)],
    )


def _cfg(cfg, name):
    """cfg[name] for a dict, cfg.name for an InklingConfig; a clear error when absent."""
    try:
        return cfg[name] if isinstance(cfg, dict) else getattr(cfg, name)
    except (KeyError, AttributeError):
        raise CostModelError(f"config lacks '{name}'") from None


def trunk_layer_kinds(cfg) -> list[str]:
    """Per trunk layer, its measured kind: '<layer_type>_<mlp_type>', e.g. 'sliding_moe'."""
    types, mlps = _cfg(cfg, "layer_types"), _cfg(cfg, "mlp_types")
    if len(types) != _cfg(cfg, "num_layers") or len(mlps) != len(types):
        raise CostModelError(f"config: layer_types ({len(types)}) and mlp_types ({len(mlps)}) must both have "
                             f"num_layers = {_cfg(cfg, 'num_layers')} entries")
    kinds = [f"{t}_{m}" for t, m in zip(types, mlps)]
    bad = sorted(set(kinds) - set(TRUNK_KINDS))
    if bad:
        raise CostModelError(f"config: layer kinds {bad} are not among {TRUNK_KINDS}")
    return kinds


def trunk_layer_counts(cfg) -> dict[str, int]:
    """{kind: number of trunk layers of that kind}, e.g. Inkling-Small: 2 sliding_dense, 33 sliding_moe,
    7 global_moe."""
    counts: dict[str, int] = {}
    for kind in trunk_layer_kinds(cfg):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ====================================================================== acceptance

def check_per_position(per_position, name: str = "per_position") -> list[float]:
    """Validate a per-position acceptance curve: per_position[j-1] = P(drafts 1..j all accepted).

    That is a marginal (cumulative) probability, so it lies in [0, 1] and never increases with j; a
    curve that increases was probably given as conditional acceptance (P(d_j | d_1..d_{j-1}))."""
    pp = [float(v) for v in per_position]
    for j, v in enumerate(pp, start=1):
        if not (0.0 <= v <= 1.0):
            raise CostModelError(f"{name}[{j - 1}] = {v}: an acceptance probability must lie in [0, 1]")
    for j in range(1, len(pp)):
        if pp[j] > pp[j - 1] + 1e-12:
            raise CostModelError(f"{name} increases at position {j + 1} ({pp[j - 1]:.4f} -> {pp[j]:.4f}): "
                                 "expected P(first j drafts accepted), which never increases (was the "
                                 "conditional acceptance passed instead?)")
    return pp


def acceptance_length(per_position) -> float:
    """L = E[tokens per cycle] = E[a + 1] = 1 + sum_j P(a >= j), with P(a >= j) = per_position[j-1]."""
    return 1.0 + sum(check_per_position(per_position))


def accepted_pmf(per_position, k_eff: int | None = None) -> list[float]:
    """P(a = j) for j = 0..k_eff, the accepted count when only the first k_eff drafts are judged
    (a = min(A, k_eff), A the count with all k drafts): P(a = j) = P(A >= j) - P(A >= j + 1), and
    the last entry takes P(A >= k_eff)."""
    pp = check_per_position(per_position)
    k_eff = len(pp) if k_eff is None else k_eff
    if not 0 <= k_eff <= len(pp):
        raise CostModelError(f"k_eff = {k_eff} must lie in 0..{len(pp)} (the curve's length)")
    at_least = [1.0] + pp[:k_eff]                        # P(A >= j), j = 0..k_eff
    return [at_least[j] - at_least[j + 1] for j in range(k_eff)] + [at_least[k_eff]]


def load_acceptance(acceptance: dict, run: str = "greedy") -> dict[int, list[float]]:
    """{k: per_position} from docs/benchmarks/demo_acceptance.json's runs[run][str(k)].per_position."""
    runs = acceptance.get("runs")
    if not isinstance(runs, dict):
        raise CostModelError("acceptance file lacks 'runs'")
    if run not in runs:
        raise CostModelError(f"acceptance file has no run '{run}' (runs: {sorted(runs)})")
    curves = {}
    for k, entry in runs[run].items():
        if "per_position" not in entry:
            raise CostModelError(f"acceptance file: runs.{run}.{k} lacks 'per_position'")
        pp = check_per_position(entry["per_position"], f"runs.{run}.{k}.per_position")
        if len(pp) != int(k):
            raise CostModelError(f"acceptance file: runs.{run}.{k}.per_position has {len(pp)} entries, expected {k}")
        curves[int(k)] = pp
    return curves


def per_position_for_k(curves: dict[int, list[float]], k: int) -> tuple[list[float], str]:
    """(per_position for depth k, where it came from). k measured: that curve ('measured'). Otherwise
    the first k entries of the deepest measured curve ('prefix of k=K'): this ASSUMES that P(first j
    drafts accepted) does not depend on how many drafts the cycle makes (notebook 05 compares the
    k = 8 prefixes with the measured k = 1, 2, 4 curves)."""
    if k == 0:
        return [], "no drafts"
    if k in curves:
        return list(curves[k]), "measured"
    deepest = max(curves) if curves else 0
    if k > deepest:
        raise CostModelError(f"no acceptance curve for k = {k}: the deepest measured is k = {deepest}")
    return list(curves[deepest][:k]), f"prefix of k={deepest}"


# ====================================================================== interpolation

def _bracket(x: float, xs: list, what: str, axis: str) -> tuple[int, int, float]:
    """Indices (i, j) of the grid points around x and the weight w of xs[j]: x = (1-w) xs[i] + w xs[j]."""
    if not xs:
        raise CostModelError(f"{what}: no measurements")
    if x < xs[0] or x > xs[-1]:
        raise CostModelError(f"{what}: {axis} = {x} is outside the measured {axis} range {xs[0]}..{xs[-1]} "
                             "(the model interpolates between measurements, it never extrapolates)")
    j = bisect.bisect_left(xs, x)
    if xs[j] == x:
        return j, j, 0.0
    return j - 1, j, (x - xs[j - 1]) / (xs[j] - xs[j - 1])


class Grid1D:
    """Linear interpolation of measured values y(x) between measured x (exact at grid points)."""

    def __init__(self, points: dict, what: str, axis: str):
        self.what, self.axis = what, axis
        self.xs = sorted(points)
        self.ys = [points[x] for x in self.xs]

    def __call__(self, x: float) -> float:
        i, j, w = _bracket(x, self.xs, self.what, self.axis)
        return (1 - w) * self.ys[i] + w * self.ys[j]


class Grid2D:
    """Bilinear interpolation on a full product grid of measurements v(x, y) (exact at grid points,
    linear in x at a measured y and vice versa). A missing grid point is an error naming it."""

    def __init__(self, points: dict, what: str, axes: tuple[str, str]):
        self.what, self.axes = what, axes
        self.xs = sorted({x for x, _ in points})
        self.ys = sorted({y for _, y in points})
        missing = [(x, y) for x in self.xs for y in self.ys if (x, y) not in points]
        if missing:
            shown = ", ".join(f"({x}, {y})" for x, y in missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise CostModelError(f"{what}: the grid {axes[0]} x {axes[1]} is incomplete: "
                                 f"missing ({axes[0]}, {axes[1]}) = {shown}")
        self.v = points

    def __call__(self, x: float, y: float) -> float:
        i, j, wx = _bracket(x, self.xs, self.what, self.axes[0])
        m, n, wy = _bracket(y, self.ys, self.what, self.axes[1])
        xi, xj, ym, yn = self.xs[i], self.xs[j], self.ys[m], self.ys[n]
        low = (1 - wx) * self.v[(xi, ym)] + wx * self.v[(xj, ym)]
        high = (1 - wx) * self.v[(xi, yn)] + wx * self.v[(xj, yn)]
        return (1 - wy) * low + wy * high


# ====================================================================== measurements

def _get(d: dict, key: str, where: str):
    if not isinstance(d, dict):
        raise CostModelError(f"{where} must be an object, got {type(d).__name__}")
    if key not in d:
        raise CostModelError(f"{where} lacks '{key}'")
    return d[key]


def _rows(engine: dict, path: str) -> list[dict]:
    """engine['a']['b'] for path 'a.b', which must be a non-empty list of objects."""
    node, keys = engine, path.split(".")
    for i, key in enumerate(keys):
        node = _get(node, key, "engine.json" + "".join("." + k for k in keys[:i]))
    if not isinstance(node, list) or not node:
        raise CostModelError(f"engine.json: {path} must be a non-empty list")
    return node


def _positive(row: dict, key: str, where: str) -> float:
    v = _get(row, key, where)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise CostModelError(f"{where}.{key} = {v!r}: expected a positive number")
    return float(v)


def _count(row: dict, key: str, where: str) -> int:
    v = _get(row, key, where)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CostModelError(f"{where}.{key} = {v!r}: expected a non-negative integer")
    return v


def _grid2(rows: list[dict], path: str, xkey: str, ykey: str, vkey: str, select=None) -> dict:
    """{(row[xkey], row[ykey]): row[vkey]} over the rows that `select` keeps; duplicates are an error."""
    points = {}
    for i, row in enumerate(rows):
        where = f"{path}[{i}]"
        if select is not None and not select(row, where):
            continue
        key = (_count(row, xkey, where), _count(row, ykey, where))
        if key in points:
            raise CostModelError(f"{path}: two rows at ({xkey}, {ykey}) = {key}")
        points[key] = _positive(row, vkey, where)
    return points


class Costs:
    """The measured costs of docs/benchmarks/engine.json that the model uses, validated, with
    interpolation. Keys read (all times are medians in ms):

      layers.rows[]:          kind, batch, T, ms  (kind sliding_moe / global_moe / sliding_dense /
                              lm_head_argmax / lm_head_logits; lm_head_* cover batch * T rows)
      layers.context          (reported, not used in formulas)
      mtp_head.depth_step[]:  batch, rows, ms     (one sliding depth over `rows` rows per sequence +
                              the argmax of its last row over the LM head)
      mtp_head.context        (reported)
      demo.cycle_split[]:     accept_commit_ms    (median over the grid: the accept + commit constant)

    Trunk kinds: full (batch x T) product grids; LM-head kinds: interpolated in rows = batch * T
    (several (batch, T) with one product are averaged: the same work)."""

    def __init__(self, engine: dict):
        rows = _rows(engine, "layers.rows")
        kinds = {}
        for i, row in enumerate(rows):
            kind = _get(row, "kind", f"layers.rows[{i}]")
            if kind not in TRUNK_KINDS + LM_HEAD_KINDS:
                raise CostModelError(f"layers.rows[{i}].kind = {kind!r}: not among {TRUNK_KINDS + LM_HEAD_KINDS}")
            kinds.setdefault(kind, []).append(i)
        self.layer = {}
        for kind in kinds:
            if kind in LM_HEAD_KINDS:
                continue
            pts = _grid2(rows, "layers.rows", "batch", "T", "ms", lambda r, w, k=kind: r["kind"] == k)
            self.layer[kind] = Grid2D(pts, f"layers.rows kind '{kind}'", ("batch", "T"))
        self.lm_head = {}
        for kind in LM_HEAD_KINDS:
            if kind not in kinds:
                continue
            by_rows: dict[int, list[float]] = {}
            for i in kinds[kind]:
                where = f"layers.rows[{i}]"
                n = _count(rows[i], "batch", where) * _count(rows[i], "T", where)
                by_rows.setdefault(n, []).append(_positive(rows[i], "ms", where))
            self.lm_head[kind] = Grid1D({n: statistics.fmean(v) for n, v in by_rows.items()},
                                        f"layers.rows kind '{kind}'", "rows (batch * T)")
        self.layers_context = engine["layers"].get("context")

        steps = _rows(engine, "mtp_head.depth_step")
        self.depth_step = Grid2D(_grid2(steps, "mtp_head.depth_step", "batch", "rows", "ms"),
                                 "mtp_head.depth_step", ("batch", "rows"))
        self.mtp_context = engine["mtp_head"].get("context")

        split = _rows(engine, "demo.cycle_split")
        acc = []
        for i, r in enumerate(split):
            v = _get(r, "accept_commit_ms", f"demo.cycle_split[{i}]")
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise CostModelError(f"demo.cycle_split[{i}].accept_commit_ms = {v!r}: expected a number")
            acc.append(float(v))
        self.accept_ms = statistics.median(acc)
        if not (math.isfinite(self.accept_ms) and self.accept_ms >= 0):
            raise CostModelError(f"demo.cycle_split: the median accept_commit_ms is {self.accept_ms}: "
                                 "not usable as a cost")

    # ---------------------------------------------------------------- lookups
    def layer_ms(self, kind: str, batch: float, T: float) -> float:
        if kind not in self.layer:
            raise CostModelError(f"layers.rows has no kind '{kind}' (measured: {sorted(self.layer)})")
        return self.layer[kind](batch, T)

    def lm_head_ms(self, rows: float, kind: str = "lm_head_argmax") -> float:
        if kind not in self.lm_head:
            raise CostModelError(f"layers.rows has no kind '{kind}' (measured: {sorted(self.lm_head)})")
        return self.lm_head[kind](rows)

    def depth_step_ms(self, batch: float, rows: float) -> float:
        return self.depth_step(batch, rows)

    # ---------------------------------------------------------------- grids
    def batches(self, k: int, cfg) -> list[int]:
        """The measured batch sizes at which cycle(B, k) needs no interpolation in B."""
        grids = [self.layer[kind] for kind in set(trunk_layer_kinds(cfg)) if kind in self.layer]
        common = set.intersection(*(set(g.xs) for g in grids)) if grids else set()
        if k > 0:
            common &= set(self.depth_step.xs)
        return sorted(common)

    def measured_ks(self) -> list[int]:
        """k >= 1 whose T = k + 1 is on every trunk grid and whose rows = k + 1 on the depth-step grid."""
        Ts = set.intersection(*(set(g.ys) for g in self.layer.values()))
        return sorted(t - 1 for t in Ts & set(self.depth_step.ys) if t >= 2)


def true_width_inputs(run: dict, accept_commit_ms: float | None = None) -> dict:
    """The model's inputs, in the layout `Costs` reads, from a run of benchmarks/true_width.py (its JSON):
    the layer, LM-head and depth-step costs it measured on the slice's own weights and caches, and as the
    accept term `accept_commit_ms`, or (None) the median accept + commit of its cycle split over k > 0
    (a negative median, the noise of a difference of replays, counts as 0)."""
    c = _get(run, "costs", "the true-width run")
    if accept_commit_ms is None:
        acc = [r["accept_commit_ms"] for r in run.get("split", []) if r["k"] > 0]
        if not acc:
            raise CostModelError("the true-width run has no cycle split at k > 0: pass accept_commit_ms")
        accept_commit_ms = max(0.0, statistics.median(acc))
    return dict(layers=dict(context=c["context"], rows=c["layers"] + c["lm_head"]),
                mtp_head=dict(context=c["context"], depth_step=c["depth_step"]),
                demo=dict(cycle_split=[dict(accept_commit_ms=accept_commit_ms)]))


def true_width_slice(run: dict) -> dict:
    """The layer mix of a true-width run's slice, as the model's `cfg`: num_layers, layer_types,
    mlp_types, mtp_layer_types."""
    layers = _get(run, "slice", "the true-width run")["layers"]
    return dict(num_layers=len(layers), layer_types=[layer["attention"] for layer in layers],
                mlp_types=[layer["mlp"] for layer in layers], mtp_layer_types=list(run["slice"]["depths"]))


# ====================================================================== the true-scale cycle

def t_verify(costs: Costs, cfg, batch: float, k: int) -> float:
    """ms: every trunk layer over T = k + 1 tokens per sequence, then the greedy LM head over B*T rows."""
    T = k + 1
    total = sum(n * costs.layer_ms(kind, batch, T) for kind, n in trunk_layer_counts(cfg).items())
    return total + costs.lm_head_ms(batch * T, "lm_head_argmax")


def t_draft(costs: Costs, batch: float, k: int) -> float:
    """ms: k depth steps over k + 1 rows each (each with its LM-head argmax of the last row)."""
    return 0.0 if k == 0 else k * costs.depth_step_ms(batch, k + 1)


def cycle_parts(costs: Costs, cfg, batch: float, k: int) -> dict[str, float]:
    """{'verify', 'draft', 'accept', 'cycle'} in ms; k = 0 is plain decoding (no draft, no accept)."""
    if not isinstance(k, int) or k < 0:
        raise CostModelError(f"k = {k!r}: expected an integer >= 0")
    v, d = t_verify(costs, cfg, batch, k), t_draft(costs, batch, k)
    a = costs.accept_ms if k > 0 else 0.0
    return {"verify": v, "draft": d, "accept": a, "cycle": v + d + a}


def tokens_per_s(costs: Costs, cfg, batch: float, k: int, per_position) -> float:
    """B * L(k) / cycle(B, k): steady state, every sequence of the batch live."""
    pp = check_per_position(per_position)
    if len(pp) != k:
        raise CostModelError(f"per_position has {len(pp)} entries but k = {k}")
    return batch * acceptance_length(pp) / (cycle_parts(costs, cfg, batch, k)["cycle"] * 1e-3)


def speedup(costs: Costs, cfg, batch: float, k: int, per_position) -> float:
    return tokens_per_s(costs, cfg, batch, k, per_position) / tokens_per_s(costs, cfg, batch, 0, [])


def predict(costs: Costs, cfg, batches, ks, curves: dict[int, list[float]]) -> list[dict]:
    """One row per (batch, k): the cycle's parts (ms), L, tokens/s, speedup over k = 0, and where the
    acceptance curve of that k came from."""
    out = []
    for B in batches:
        plain = tokens_per_s(costs, cfg, B, 0, [])
        for k in ks:
            pp, source = per_position_for_k(curves, k)
            parts = cycle_parts(costs, cfg, B, k)
            tps = tokens_per_s(costs, cfg, B, k, pp)
            out.append(dict(batch=B, k=k, L=acceptance_length(pp), **parts, tokens_per_s=tps,
                            speedup=tps / plain, acceptance=source))
    return out


def recommend_k(costs: Costs, cfg, batch: float, curves: dict[int, list[float]], ks=None) -> int:
    """argmax over k in ks (default: 0 and the measured ks) of tokens/s(batch, k); ties: smaller k."""
    ks = [0] + costs.measured_ks() if ks is None else list(ks)
    best = max(ks, key=lambda k: (tokens_per_s(costs, cfg, batch, k, per_position_for_k(curves, k)[0]), -k))
    return best


def chain_check(costs: Costs, engine: dict) -> list[dict]:
    """mtp_head.chain (the whole k-depth chain as one graph, depths 1 and 3 global) against the model's
    k * depth_step(B, k + 1) (every depth costed as the measured sliding one)."""
    rows = _rows(engine, "mtp_head.chain")
    out = []
    for i, r in enumerate(rows):
        where = f"mtp_head.chain[{i}]"
        B, k = _count(r, "batch", where), _count(r, "k", where)
        model = t_draft(costs, B, k)
        graph = _positive(r, "graph_ms", where)
        out.append(dict(batch=B, k=k, a=_count(r, "a", where), graph_ms=graph,
                        steps_sum_ms=r.get("steps_sum_ms"), model_ms=model, graph_over_model=graph / model))
    return out


# ====================================================================== demo validation

def host_overhead_ms(engine: dict, engine_name: str = "fast_graphs") -> float | None:
    """The host loop's time per cycle: the median over the steady end-to-end rows of `engine_name`
    (every (batch, k) that demo.cycle_split also has) of the wall time per steady cycle minus the
    captured cycle's device time, and 0 where that median is negative: the overlapped loop hides the
    host work behind the device, and its wall time per cycle, taken between the result copies of
    back-to-back cycles, can come out below the captured cycle replayed alone. None when the run has
    no steady rows (older benchmark versions)."""
    cyc = _grid2(_rows(engine, "demo.cycle_split"), "demo.cycle_split", "batch", "k", "cycle_ms")
    gaps = []
    for i, r in enumerate(_rows(engine, "demo.end_to_end")):
        where = f"demo.end_to_end[{i}]"
        if _get(r, "engine", where) != engine_name or r.get("steady_ms_per_cycle") is None:
            continue
        key = (_count(r, "batch", where), _count(r, "k", where))
        if key in cyc:
            gaps.append(_positive(r, "steady_ms_per_cycle", where) - cyc[key])
    return max(0.0, statistics.median(gaps)) if gaps else None


def demo_validation(engine: dict, curves: dict[int, list[float]], engine_name: str = "fast_graphs",
                    host_ms: float = 0.0) -> list[dict]:
    """The model's cycle formula against the demo engine's measured speedups, per (batch, k >= 1) of
    demo.cycle_split.

    Measured, from the end_to_end rows of `engine_name`:
        speedup = rate(B, k) / rate(B, 0)
      rate: steady_tokens_per_s (the cycles that ran all B sequences) where the run recorded it,
      else decode_tokens_per_s (basis "decode": generate's time less a separately timed prefill).
    Predicted, with the true-scale formula tokens/s = B * L / cycle and cycle_ms from the split:
        speedup = L * cycle_ms(B, 0) / cycle_ms(B, k)     where the split has k = 0 at that batch,
        speedup = (B * L / cycle_ms(B, k)) / rate(B, 0)  else (the error is then that of the rate)
      with L = the engine's own acceptance length in the same run (`err`, held to the target: it
      checks the cycle-time part of the model, the part that carries over to true scale), and with L
      from the acceptance curve of demo_acceptance.json (`err_curve`: measured on other prompts).
    host_ms (argument): a fixed host time added to every captured cycle (0: the device-only formula
    of the true-scale model; `host_overhead_ms(engine)`: the run's median host time per cycle, one
    number for every (batch, k)). Each output row's host_ms (steady runs only) is that row's own wall
    time per steady cycle minus the captured cycle's device time."""
    if not isinstance(host_ms, (int, float)) or not host_ms >= 0:
        raise CostModelError(f"demo_validation: host_ms must be a number >= 0, got {host_ms!r}")
    split = _rows(engine, "demo.cycle_split")
    cyc = _grid2(split, "demo.cycle_split", "batch", "k", "cycle_ms")
    e2e = {}
    for i, r in enumerate(_rows(engine, "demo.end_to_end")):
        where = f"demo.end_to_end[{i}]"
        if _get(r, "engine", where) != engine_name:
            continue
        key = (_count(r, "batch", where), _count(r, "k", where))
        if key in e2e:
            raise CostModelError(f"demo.end_to_end: two '{engine_name}' rows at (batch, k) = {key}")
        if r.get("steady_tokens_per_s") is not None:
            e2e[key] = dict(basis="steady", rate=_positive(r, "steady_tokens_per_s", where),
                            L=_positive(r, "steady_acceptance_length", where),
                            wall_ms=_positive(r, "steady_ms_per_cycle", where))
        else:
            e2e[key] = dict(basis="decode", rate=_positive(r, "decode_tokens_per_s", where),
                            L=_positive(r, "acceptance_length", where), wall_ms=None)
    out = []
    for (B, k) in sorted(cyc):
        if k == 0:
            continue
        for key in ((B, k), (B, 0)):
            if key not in e2e:
                raise CostModelError(f"demo.end_to_end has no '{engine_name}' row at (batch, k) = {key}, "
                                     f"needed to validate demo.cycle_split ({B}, {k})")
        meas, plain = e2e[(B, k)], e2e[(B, 0)]
        pp, source = per_position_for_k(curves, k)
        L_curve = acceptance_length(pp)
        measured = meas["rate"] / plain["rate"]
        if (B, 0) in cyc:
            per_L = (cyc[(B, 0)] + host_ms) / (cyc[(B, k)] + host_ms)
        else:
            per_L = B / ((cyc[(B, k)] + host_ms) * 1e-3) / plain["rate"]
        pred, pred_curve = meas["L"] * per_L, L_curve * per_L
        out.append(dict(batch=B, k=k, basis=meas["basis"], L_engine=meas["L"], L_curve=L_curve,
                        acceptance=source, cycle_ms=cyc[(B, k)], cycle0_ms=cyc.get((B, 0)),
                        speedup_measured=measured, speedup=pred, err=pred / measured - 1,
                        speedup_curve=pred_curve, err_curve=pred_curve / measured - 1, host_term_ms=host_ms,
                        host_ms=meas["wall_ms"] - cyc[(B, k)] if meas["wall_ms"] is not None else None))
    return out


# ====================================================================== bytes: why verify costs more at batch 1

def expected_distinct_experts(n_tokens: float, n_experts: int = 256, top_k: int = 6) -> float:
    """E[#distinct experts] when n_tokens tokens each pick top_k of n_experts uniformly and
    independently: each expert is missed by one token with probability 1 - top_k / n_experts, so
    E = n_experts * (1 - (1 - top_k / n_experts) ** n_tokens)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** n_tokens)


def _attn_shape(cfg, kind: str) -> tuple[int, int, int, int]:
    """(heads, kv heads, head_dim, relative extent E) of a 'sliding' or 'global' attention."""
    if kind == "sliding":
        return (_cfg(cfg, "swa_num_heads"), _cfg(cfg, "swa_num_kv_heads"), _cfg(cfg, "swa_head_dim"),
                _cfg(cfg, "sliding_window"))
    return _cfg(cfg, "num_heads"), _cfg(cfg, "num_kv_heads"), _cfg(cfg, "head_dim"), _cfg(cfg, "rel_extent")


def layer_weight_elements(kind: str, cfg, n_tokens: float | None = None) -> float:
    """Weight elements a layer reads for n_tokens tokens (None: all of them = its parameter count).

    kind: a trunk kind ('sliding_moe', ...) or 'mtp_sliding' / 'mtp_global' (one MTP depth: norms,
    input_proj [H, 2H], a block with a dense MLP). An MoE reads its non-expert weights, its shared
    experts and the expected distinct routed experts of n_tokens (each expert: W13 [2F, H] + W2 [H, F])."""
    if kind not in TRUNK_KINDS + ("mtp_sliding", "mtp_global"):
        raise CostModelError(f"layer_weight_elements: kind {kind!r} is not a trunk kind {TRUNK_KINDS}, "
                             "mtp_sliding or mtp_global")
    H, K = _cfg(cfg, "hidden_size"), _cfg(cfg, "conv_kernel_size")
    if kind.startswith("mtp_"):
        attn, mlp, extra = kind[4:], "dense", 2 * H + 2 * H * H         # hidden_norm, embed_norm, input_proj
    else:
        attn, mlp = kind.split("_")
        extra = 0
    nh, nkv, hd, E = _attn_shape(cfg, attn)
    d_rel = _cfg(cfg, "d_rel")
    n = (H * nh * hd + 2 * H * nkv * hd + H * nh * d_rel + nh * hd * H    # q, k, v, r, o
         + d_rel * E + 2 * nkv * hd * K + 2 * hd                          # rel_proj, k/v convs, q/k norms
         + 2 * H + 2 * H * K)                                             # attn/mlp norms, attn/mlp convs
    if mlp == "dense":
        F = _cfg(cfg, "dense_intermediate_size")
        n += 3 * F * H + 1                                                # gate_up [2F, H], down [H, F], scale
    else:
        R, S, top = _cfg(cfg, "n_routed_experts"), _cfg(cfg, "n_shared_experts"), _cfg(cfg, "num_experts_per_tok")
        F = _cfg(cfg, "moe_intermediate_size")
        routed = R if n_tokens is None else expected_distinct_experts(n_tokens, R, top)
        n += (R + S) * H + R + 1 + (routed + S) * 3 * F * H              # router, bias, scale, experts
    return n + extra


def kv_bytes(attn: str, cfg, batch: int, T: int, context: int, dtype_bytes: int = 2) -> int:
    """K and V cache bytes that T new tokens per sequence read: a sliding layer the last window keys
    (at most window + T - 1 for the T queries), a global one the whole context + T."""
    _, nkv, hd, _ = _attn_shape(cfg, attn)
    keys = min(context + T, _cfg(cfg, "sliding_window") + T - 1) if attn == "sliding" else context + T
    return batch * keys * nkv * hd * 2 * dtype_bytes


def layer_floor_bytes(kind: str, cfg, batch: int, T: int, context: int, dtype_bytes: int = 2) -> float:
    """Expected bytes a measured kind must read for batch x T tokens (weights in the model dtype + KV;
    activations ignored). 'lm_head_argmax': the padded table; 'depth_step': one sliding MTP depth over
    T rows + the LM-head table (its argmax of the last row)."""
    if kind == "lm_head_argmax":
        return _cfg(cfg, "vocab_size") * _cfg(cfg, "hidden_size") * dtype_bytes
    if kind == "depth_step":
        return (layer_weight_elements("mtp_sliding", cfg) * dtype_bytes + kv_bytes("sliding", cfg, batch, T, context)
                + layer_floor_bytes("lm_head_argmax", cfg, batch, T, context, dtype_bytes))
    return (layer_weight_elements(kind, cfg, batch * T) * dtype_bytes
            + kv_bytes(kind.split("_")[0], cfg, batch, T, context, dtype_bytes))


# ====================================================================== tree drafts

# A tree cycle (inkling_ref/tree/drafts.py, docs/tree_drafts.md) verifies T = nodes + 1 tokens per sequence
# and runs, in depth m = 0..D-1, the committed window rows plus the tree rows that depth needs, then
# reads the candidates of the nodes it expands from the LM head:
#
#     verify_tree(B, T)  = sum over trunk layers of layer_ms(kind, B, T) + lm_head_argmax_ms(B * T)
#     draft_tree(B)      = sum_m  block_ms(B, rows_m) + lm_head_argmax_ms(B * heads_m)
#       rows_m           = (D - m + 1) + tree_rows_m      the window [n-2-D, n-2-m] + the tree rows
#       block_ms(B, r)   = depth_step_ms(B, r) - lm_head_argmax_ms(B)   (the step without its argmax)
#     cycle_tree(B)      = verify_tree + draft_tree + accept
#
# For a chain (tree_rows_m = m, heads_m = 1) these are t_verify(B, k) and t_draft(B, k) exactly.
# Tree attention is costed as the dense attention of T queries (the mask and the conv gathers along
# parent paths are assumed free); top-b candidates as the argmax; accept + commit as a chain's.
# Beyond the largest measured T (or rows), a layer over B sequences x T tokens is costed as the same
# number of tokens in sequences of the largest measured length, B * T / T_max sequences of T_max
# ("token-equivalent"): the same weights and expert reads, more KV reads (each extra sequence reads
# its own context), so an upper bound where attention matters; outside the measured batches it raises.

TREE_RUN_KEYS = ("name", "kind", "nodes", "depth", "acceptance_length", "draft_tree_rows", "draft_heads")


def _token_equivalent(batch: float, T: float, T_max: float) -> tuple[float, float, bool]:
    """(batch', T', used) with batch' * T' = batch * T and T' <= T_max."""
    if T <= T_max:
        return batch, T, False
    return batch * T / T_max, T_max, True


def tree_layer_ms(costs: Costs, kind: str, batch: float, T: float) -> float:
    """One trunk layer over T tokens per sequence (token-equivalent beyond the measured T)."""
    if kind not in costs.layer:
        raise CostModelError(f"layers.rows has no kind '{kind}' (measured: {sorted(costs.layer)})")
    b, t, _ = _token_equivalent(batch, T, costs.layer[kind].ys[-1])
    return costs.layer_ms(kind, b, t)


def t_verify_tree(costs: Costs, cfg, batch: float, tokens: int) -> float:
    """ms: every trunk layer over `tokens` (= nodes + 1) per sequence, then the LM-head argmax of all rows."""
    total = sum(n * tree_layer_ms(costs, kind, batch, tokens) for kind, n in trunk_layer_counts(cfg).items())
    return total + costs.lm_head_ms(batch * tokens, "lm_head_argmax")


def depth_block_ms(costs: Costs, batch: float, rows: float) -> float:
    """ms: one MTP depth over `rows` rows per sequence without its LM head: the measured depth step less
    the argmax of B rows it includes (token-equivalent beyond the measured rows)."""
    b, r, _ = _token_equivalent(batch, rows, costs.depth_step.ys[-1])
    ms = costs.depth_step_ms(b, r) - costs.lm_head_ms(b, "lm_head_argmax")
    if ms <= 0:
        raise CostModelError(f"mtp_head.depth_step at (batch {b:g}, rows {r:g}) = {costs.depth_step_ms(b, r):.4f} ms "
                             f"is not above the LM-head argmax of its {b:g} rows ({costs.lm_head_ms(b):.4f} ms)")
    return ms


def check_tree_run(run: dict, where: str = "run") -> dict:
    """A tree (or chain) shape with its measured acceptance, as docs/benchmarks/tree_acceptance.json
    stores it; the per-depth lists must have `depth` entries."""
    if not isinstance(run, dict):
        raise CostModelError(f"{where} must be an object, got {type(run).__name__}")
    for key in TREE_RUN_KEYS:
        if key not in run:
            raise CostModelError(f"{where} lacks '{key}'")
    D, N = run["depth"], run["nodes"]
    if not (isinstance(D, int) and isinstance(N, int) and 1 <= D <= N):
        raise CostModelError(f"{where}: depth {D!r} and nodes {N!r} must be integers with 1 <= depth <= nodes")
    for key in ("draft_tree_rows", "draft_heads"):
        v = run[key]
        if not (isinstance(v, list) and len(v) == D and all(isinstance(x, int) and x >= 0 for x in v)):
            raise CostModelError(f"{where}.{key} = {v!r}: expected {D} non-negative integers (one per depth)")
    if any(h < 1 for h in run["draft_heads"]):
        raise CostModelError(f"{where}.draft_heads = {run['draft_heads']}: every depth expands at least one node")
    tau = run["acceptance_length"]
    if not (isinstance(tau, (int, float)) and 1.0 <= tau <= D + 1):
        raise CostModelError(f"{where}.acceptance_length = {tau!r}: must lie in 1..depth + 1 = {D + 1}")
    return run


def load_tree_acceptance(acceptance: dict) -> list[dict]:
    """The validated runs of docs/benchmarks/tree_acceptance.json (written by scripts/tree_acceptance.py)."""
    runs = acceptance.get("runs") if isinstance(acceptance, dict) else None
    if not isinstance(runs, list) or not runs:
        raise CostModelError("tree acceptance file lacks a non-empty 'runs' list")
    return [check_tree_run(r, f"runs[{i}] ({r.get('name', '?') if isinstance(r, dict) else '?'})")
            for i, r in enumerate(runs)]


def tree_cycle_parts(costs: Costs, cfg, batch: float, run: dict) -> dict[str, float]:
    """{'verify', 'draft', 'accept', 'cycle'} in ms for one cycle of the tree `run` at batch `batch`."""
    run = check_tree_run(run)
    D = run["depth"]
    v = t_verify_tree(costs, cfg, batch, run["nodes"] + 1)
    d = sum(depth_block_ms(costs, batch, (D - m + 1) + run["draft_tree_rows"][m])
            + costs.lm_head_ms(batch * run["draft_heads"][m], "lm_head_argmax") for m in range(D))
    return {"verify": v, "draft": d, "accept": costs.accept_ms, "cycle": v + d + costs.accept_ms}


def tree_tokens_per_s(costs: Costs, cfg, batch: float, run: dict) -> float:
    """B * acceptance length / cycle_tree(B): steady state, every sequence live."""
    return batch * run["acceptance_length"] / (tree_cycle_parts(costs, cfg, batch, run)["cycle"] * 1e-3)


def compare_trees(costs: Costs, cfg, batches, runs: list[dict], kinds=("tree", "grown")) -> list[dict]:
    """Per batch: the best chain and the best tree among `runs` (chains: kind 'chain'; trees: runs of
    `kinds` with more nodes than levels, i.e. not themselves a chain), by predicted tokens/s, and the
    gain of the tree over the chain. Shapes whose costs fall outside the measurements are left out at
    that batch and listed in 'not_predicted'."""
    out = []
    for B in batches:
        plain = tokens_per_s(costs, cfg, B, 0, [])
        rated, skipped = [], []
        for run in runs:
            if run["kind"] != "chain" and (run["kind"] not in kinds or run["nodes"] == run["depth"]):
                continue
            try:
                rated.append((run, tree_tokens_per_s(costs, cfg, B, run)))
            except CostModelError:
                skipped.append(run["name"])
        chains = [(r, t) for r, t in rated if r["kind"] == "chain"]
        trees = [(r, t) for r, t in rated if r["kind"] != "chain"]
        row = dict(batch=B, plain_tokens_per_s=plain, not_predicted=skipped)
        if chains:
            c, tc = max(chains, key=lambda x: x[1])
            row.update(chain=c["name"], chain_tokens_per_s=tc, chain_speedup=tc / plain)
        if trees:
            t, tt = max(trees, key=lambda x: x[1])
            row.update(tree=t["name"], tree_nodes=t["nodes"], tree_tokens_per_s=tt, tree_speedup=tt / plain)
        if chains and trees:
            row["tree_gain"] = tt / tc - 1
        out.append(row)
    return out
