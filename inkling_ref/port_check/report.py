"""What the checker found, and how it is printed. Built by check.check_dump."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DepthResult:
    depth: int
    rows: int
    error: float              # ||engine - reference|| / ||reference|| over the depth's rows
    worst_row: float          # the largest per-row relative error
    failing_rows: int         # rows above the tolerance, or whose token differs beyond a near tie
    agreement: int            # rows whose token (the engine's argmax) equals the reference's argmax
    near_ties: int            # rows whose token differs only within the row's own logit error
    drafts: int               # steps that drafted with this depth
    drafts_agree: int         # of those, drafts equal to the reference's argmax (or a near tie)


@dataclass
class Divergence:
    step: int
    position: int
    depth: int
    why: str


@dataclass
class Candidate:
    mistake: str
    error: float              # ||engine - variant|| / ||variant|| over every row
    distance: float           # how far the mistake alone moves this dump's outputs (relative)
    reproduces: bool


@dataclass
class Diagnosis:
    mistake: str
    evidence: str
    cost: str
    fix: str


@dataclass
class Report:
    passed: bool
    dump: str
    summary: str              # the dump and the reference in one line
    tolerance: float
    correct_error: float      # ||engine - correct|| / ||correct|| over every row
    depths: list[DepthResult]
    first_divergence: Divergence | None
    findings: list[str] = field(default_factory=list)       # what the dump's structure and inputs show
    diagnosis: list[Diagnosis] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)   # every known mistake, best first
    invisible_below: float = 0.0      # a mistake moving the outputs less than this cannot be named from the dump

    def to_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        lines = [f"port check: {'PASS' if self.passed else 'FAIL'}  {self.dump}", f"  {self.summary}",
                 f"  tolerance: relative error {self.tolerance:.0e} per row (docs/port_checker.md)", "",
                 "  depth   rows   rel. error (all / worst row)   argmax agreement   drafts   failing rows"]
        for d in self.depths:
            drafts = f"{d.drafts_agree}/{d.drafts}"
            agree = f"{d.agreement}/{d.rows}" + (f" ({d.near_ties} near ties)" if d.near_ties else "")
            lines.append(f"  {d.depth:>5}  {d.rows:>5}   {d.error:8.1e} / {d.worst_row:8.1e}            "
                         f"{agree:<18} {drafts:>6}   {d.failing_rows:>12}")
        lines.append("")
        if self.first_divergence is None:
            lines.append("  first divergence: none")
        else:
            f = self.first_divergence
            lines.append(f"  first divergence: step {f.step}, position {f.position}, depth {f.depth} ({f.why})")
        for finding in self.findings:
            lines.append(f"  found: {finding}")
        for i, d in enumerate(self.diagnosis):
            lines += [f"  {'diagnosis' if i == 0 else 'also'}: {d.mistake}", f"    evidence: {d.evidence}",
                      f"    expected cost: {d.cost}", f"    fix: {d.fix}"]
        if not self.passed and not self.diagnosis:
            lines.append("  diagnosis: no known mistake reproduces these outputs (closest below); docs/port_checker.md "
                         "says how to narrow it down")
        seen = [c for c in self.candidates if c.distance > self.invisible_below]
        unseen = [c.mistake for c in self.candidates if c.distance <= self.invisible_below]
        if seen:
            lines.append("  known mistakes, closest first (relative error against each):")
            lines.append(f"    {self.correct_error:8.1e}  none (the correct computation)")
            lines += [f"    {c.error:8.1e}  {c.mistake}" for c in seen]
        if unseen:
            lines.append(f"  not visible in this dump (they move its outputs by less than {self.invisible_below:.0e}): "
                         + "; ".join(unseen))
        return "\n".join(lines)
