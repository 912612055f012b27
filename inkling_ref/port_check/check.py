"""`check_dump`: compare an engine's dump with the reference, row by row, and name the known mistake
that reproduces it.

A dump passes when
  1. every row's output is within the tolerance of the correct recomputation (relative L2 error per row),
  2. every token the engine took from a row (its draft, or the argmax of its logits) is the reference's
     argmax, or a near tie: the reference's top logit beats it by no more than twice the largest
     logit error that row's own hidden-state error makes (so such a flip is rounding, not a mistake),
  3. its structure is right: every row a rejection made stale was recomputed, each row consumed the
     token of its slot, each depth read the previous depth's output, and H is the post-final-norm hidden,
  4. no known mistake fits its outputs at least twice as well as the correct computation (this names
     mistakes whose effect is smaller than a 16-bit engine's rounding, without failing correct engines:
     a correct engine's error against a mistake is larger than against the correct computation).
"""

from __future__ import annotations

import torch

from .dump import DumpError, PortDump, probe_of
from .pitfalls import KNOWN_MISTAKES, MUP, OFF_BY_ONE, STALE, BY_NAME, hidden_scale
from .recompute import CannotReplay, recompute
from .report import Candidate, DepthResult, Diagnosis, Divergence, Report
from .schedule import Step, steps_of

# Per-row tolerance by the dtype of the engine's outputs (docs/port_checker.md justifies the values).
TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.bfloat16: 8e-2, torch.float16: 1e-2}
FIT_RATIO = 0.5         # a mistake that fits the outputs this much better than the correct computation is blamed
FIT_FLOOR = 0.02        # ... when the correct computation's error is above this share of the tolerance
SCALE_TOL = 0.05        # |rms(H_p / w_norm) - 1| allowed


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row ||a - b|| / ||b|| in float64 (inf where either is not finite)."""
    a, b = a.double().cpu(), b.double().cpu()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-300)
    return torch.where(torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1), err, torch.inf)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def validate_against(head, dump: PortDump) -> None:
    """What the dump must share with the checkpoint; DumpError naming the mismatch."""
    cfg, where = head.config, dump.path
    if dump.hidden_size != cfg.hidden_size:
        raise DumpError(f"{where}: its hidden states are {dump.hidden_size} wide and the checkpoint's hidden_size is "
                        f"{cfg.hidden_size}: the dump comes from another model")
    K = int(dump["step_k"].max())
    if K > head.num_mtp_depths:
        raise DumpError(f"{where}: its steps ran {K} depths and the checkpoint has {head.num_mtp_depths}")
    V = cfg.vocab_out
    for name in ("tokens", "step_drafts", "row_token"):
        t = dump.get(name)
        if t is not None and int(t.max()) >= V:
            raise DumpError(f"{where}: field {name!r} holds token id {int(t.max())}; the checkpoint's vocabulary "
                            f"is 0..{V - 1}")
    logits = dump.get("row_logits")
    if logits is not None and logits.shape[1] not in (V, cfg.vocab_size):
        raise DumpError(f"{where}: field 'row_logits' is {logits.shape[1]} wide; the checkpoint's vocabulary is "
                        f"{V} ({cfg.vocab_size} padded)")
    probe = dump.get("checkpoint_probe")
    if probe is not None:
        want = probe_of(head.mtp.depths[0].input_proj.weight)[: len(probe)]
        err = rel(probe.float(), want)
        if len(probe) != len(want) or err > 1e-2:
            raise DumpError(f"{where}: written with another checkpoint: its checkpoint_probe (MTP depth 0 "
                            f"input_proj.weight[0, :16]) differs from this checkpoint's by {err:.2g} (relative)")


@torch.no_grad()
def _tokens(head, dump: PortDump, steps: list[Step], ref: torch.Tensor, chunk: int = 256):
    """Per row: (engine token, reference argmax, near tie). The engine's token is its draft on the row
    that drafted (greedy dumps), else the argmax of its logits (row_logits, or the reference LM head on
    its hidden state)."""
    V, p = head.config.vocab_out, next(head.parameters())
    forced = torch.full((dump.num_rows,), -1, dtype=torch.long)
    if dump.greedy_drafts:
        for s in steps:
            for m in range(s.k):
                forced[s.first[m] + len(s.rows[m]) - 1] = s.drafts[m]
    E, L = dump["row_hidden"], dump.get("row_logits")
    eng, want, tie = [], [], []
    for i in range(0, dump.num_rows, chunk):
        r = head.trunk.readout(ref[i: i + chunk].to(p.dtype)).double()
        e = (L[i: i + chunk, :V] if L is not None else head.trunk.readout(E[i: i + chunk].to(p.device, p.dtype)))
        e = e.to(r.device).double()
        te = torch.where(forced[i: i + chunk].to(r.device) >= 0, forced[i: i + chunk].to(r.device), e.argmax(-1))
        tr = r.argmax(-1)
        gap = r.gather(1, tr[:, None])[:, 0] - r.gather(1, te[:, None])[:, 0]
        err = (e - r).abs().amax(-1)
        eng.append(te.cpu()), want.append(tr.cpu()), tie.append(((te != tr) & (gap <= 2 * err)).cpu())
    return torch.cat(eng), torch.cat(want), torch.cat(tie)


def _schedule_findings(steps: list[Step]) -> list[tuple[str, str | None]]:
    """Rows a rejection made stale that the next step did not recompute."""
    out, valid = [], {}
    for s in steps:
        for m in range(s.k):
            if m in valid and s.rows[m].start > valid[m]:
                out.append((f"step {s.index}, depth {m}: rows {valid[m]}..{s.rows[m].start - 1} were not recomputed "
                            f"after step {s.index - 1} rejected a draft; their token slots held its drafts (stale)",
                            STALE))
        if s.next_n is not None:
            for m in range(s.k):
                valid[m] = max(0, min(s.n - 1, s.next_n - 2 - m))
    return out


def _row_findings(head, dump: PortDump, steps: list[Step], tol: float) -> list[tuple[str, str | None]]:
    """Tokens consumed, inputs read, and the scale of H."""
    out = []
    tokens, h_in = dump.get("row_token"), dump.get("row_hidden_in")
    if tokens is not None:
        bad, early = [], True
        for s in steps:
            for m in range(s.k):
                for t, p in enumerate(s.rows[m]):
                    got = int(tokens[s.first[m] + t])
                    if got != s.slots[p + m + 1]:
                        bad.append((s.index, m, p, got, s.slots[p + m + 1]))
                    early &= got == s.slots[p + m]
        if bad and early:
            out.append((f"every row consumed the token of slot p+m instead of p+m+1 ({len(bad)} rows differ; first: "
                        f"step {bad[0][0]}, depth {bad[0][1]}, position {bad[0][2]})", OFF_BY_ONE))
        elif bad:
            c, m, p, got, want = bad[0]
            out.append((f"{len(bad)} rows consumed another token than their slot p+m+1; first: step {c}, depth {m}, "
                        f"position {p}: {got} instead of {want}", None))
    if h_in is not None:
        for s in steps:
            for m in range(s.k):
                r = s.rows[m]
                rows = slice(s.first[m], s.first[m] + len(r))
                if m == 0:
                    want = dump["hidden"][r.start: r.stop]
                else:
                    prev = s.first[m - 1] + (r.start - s.rows[m - 1].start)
                    want = dump["row_hidden"][prev: prev + len(r)]
                err = float(rel_rows(h_in[rows], want).max())
                if err > tol:
                    what = "H from the field 'hidden'" if m == 0 else f"depth {m - 1}'s output"
                    out.append((f"step {s.index}: depth {m} did not read {what} (relative difference up to "
                                f"{err:.2g})", None))
                    break
    last = max(s.n for s in steps) - 1
    scale = hidden_scale(head, dump["hidden"][:last])
    if float((scale - 1).abs().max()) > SCALE_TOL:
        mid, mup = float(scale.median()), head.config.mup
        if abs(mid * mup - 1) <= SCALE_TOL:
            out.append((f"H handed to depth 0 is the trunk's hidden divided by mup = {mup:g} (rms(H_p / final-norm "
                        f"weight) = {mid:.3f}; 1 for the post-final-norm hidden)", MUP))
        else:
            out.append((f"H handed to depth 0 is not the trunk's post-final-norm hidden: rms(H_p / final-norm weight) "
                        f"ranges {float(scale.min()):.3f}..{float(scale.max()):.3f} instead of 1 (taken before the "
                        "final norm?)", None))
    return out


def check_dump(head, dump: PortDump, tolerance: float | None = None, diagnose: bool = True) -> Report:
    """Check `dump` against the reference head (head_loader.load_head); see the module docstring."""
    validate_against(head, dump)
    tol = TOLERANCE[dump.engine_dtype] if tolerance is None else tolerance
    steps = steps_of(dump)
    ref = recompute(head, dump, steps)
    E = dump["row_hidden"]
    err = rel_rows(E, ref)
    eng, want, tie = _tokens(head, dump, steps, ref)
    bad = (err > tol) | ((eng != want) & ~tie)
    step, depth, pos = dump["row_step"], dump["row_depth"], dump["row_position"]
    drafting = torch.zeros(dump.num_rows, dtype=torch.bool)
    for s in steps:
        for m in range(s.k):
            drafting[s.first[m] + len(s.rows[m]) - 1] = True
    depths = []
    for m in range(int(depth.max()) + 1):
        rows = depth == m
        d = drafting & rows
        depths.append(DepthResult(m, int(rows.sum()), rel(E[rows], ref[rows]), float(err[rows].max()),
                                  int(bad[rows].sum()), int((eng == want)[rows].sum()), int(tie[rows].sum()),
                                  int(d.sum()), int((d & ((eng == want) | tie)).sum())))
    first = None
    if bool(bad.any()):
        i = min(torch.nonzero(bad)[:, 0].tolist(), key=lambda j: (int(step[j]), int(pos[j]), int(depth[j])))
        why = (f"relative error {float(err[i]):.2g} > {tol:g}" if float(err[i]) > tol else
               f"its token {int(eng[i])} is not the reference's argmax {int(want[i])}")
        first = Divergence(int(step[i]), int(pos[i]), int(depth[i]), why)

    found = _schedule_findings(steps) + _row_findings(head, dump, steps, tol)
    C = rel(E, ref)
    candidates, outputs = [], {}
    if diagnose:
        for km in KNOWN_MISTAKES:
            try:
                outputs[km.name] = km.reproduce(head, dump, steps) if km.reproduce is not None else None
            except CannotReplay:
                pass
    for name, V in outputs.items():
        if V is None:
            continue
        # what the mistake alone moves: against the correct maths on your schedule (the schedule itself for
        # the stale-row mistake, whose variant is exactly that replay)
        base = ref if name == STALE or outputs.get(STALE) is None else outputs[STALE]
        e, d = rel(E, V), rel(V, base)
        visible = d > FIT_FLOOR * tol                # else this dump cannot tell the mistake from its absence
        candidates.append(Candidate(name, e, d, visible and e <= FIT_RATIO * C and C > FIT_FLOOR * tol))
    named = [mistake for _, mistake in found if mistake is not None]
    # closest first; mistakes that fit equally well (a schedule that never rolls back cannot tell a
    # missing conv rollback from a missing repair) are ordered by what the dump's structure shows
    best = min((c.error for c in candidates if c.distance > FIT_FLOOR * tol), default=0.0)
    candidates.sort(key=lambda c: (c.distance <= FIT_FLOOR * tol, c.error > 1.01 * best + 1e-12,
                                   c.mistake not in named, c.error))
    blamed = [c for c in candidates if c.reproduces]
    diagnosis = [Diagnosis(c.mistake, f"it reproduces the outputs: relative error {c.error:.2g}, against {C:.2g} for "
                           "the correct computation", BY_NAME[c.mistake].cost(), BY_NAME[c.mistake].fix)
                 for c in blamed[:1]]
    for text, mistake in found:
        if mistake is not None and mistake not in [d.mistake for d in diagnosis]:
            diagnosis.append(Diagnosis(mistake, text, BY_NAME[mistake].cost(), BY_NAME[mistake].fix))
    passed = not bool(bad.any()) and not found and not blamed
    K = max(s.k for s in steps)
    p = next(head.parameters())
    summary = (f"{len(steps)} steps, k = {K}, {dump.num_rows} rows, engine dtype "
               f"{str(dump.engine_dtype).removeprefix('torch.')}"
               f"{', engine ' + dump.metadata['engine'] if 'engine' in dump.metadata else ''}; reference in "
               f"{str(p.dtype).removeprefix('torch.')} on {p.device.type}")
    return Report(passed, dump.path, summary, tol, C, depths, first, [t for t, _ in found], diagnosis, candidates,
                  FIT_FLOOR * tol)
