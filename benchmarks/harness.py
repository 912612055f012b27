"""Benchmark harness for the fast-path kernels (a script library, never a test).

Method: warm-up, CUDA-event timing through
`triton.testing.do_bench`, median of many runs, input sets rotated so that together they exceed the
L2 cache (ROTATE_BYTES), and every kernel compared in the same run against
  * its plain vectorized-torch twin (the baseline), and
  * the floor: the bytes it must move over the device-to-device copy bandwidth measured here.

A benchmark module `benchmarks/bench_<name>.py` imports this module first, and defines
    SECTION = "Title of its table"
    def run(ctx: Context) -> list[Row]
and `python benchmarks/kernels.py` runs them all and writes `docs/benchmarks/kernels.md`. Run as a
script, a module only checks its cases at small sizes (`--dry`, see `main`).
"""

from __future__ import annotations

import datetime
import itertools
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# A benchmark module imports this first: on a machine without a GPU its dry run goes through the
# Triton interpreter, which must be chosen before any kernel module is imported; and the modules
# import inkling_fast / inkling_ref from the repository root.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from inkling_ref.testing import rel_l2  # noqa: E402

L2_BYTES = 60 * 2**20  # H200 L2 cache (an H100 has 50 MB)
ROTATE_BYTES = 4 * L2_BYTES  # input sets rotated per benchmark cover at least this many bytes


@dataclass
class Row:
    kernel: str
    case: str          # e.g. "H=4096 T=1 bf16"
    bytes: int         # the floor's byte count (each input read once, each output written once)
    ms: float          # the kernel, median
    ms_twin: float | None = None   # the torch twin, median
    note: str = ""


@dataclass
class Context:
    copy_gbps: float                      # measured device-to-device copy bandwidth, bytes read + written
    device_name: str
    results: list[Row] = field(default_factory=list)


def measure_copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    import triton.testing

    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def rotating_inputs(make, bytes_per_set: int):
    """Build enough input sets (via `make()`) to cover ROTATE_BYTES; returns the list of sets."""
    n = max(2, -(-ROTATE_BYTES // max(bytes_per_set, 1)))
    return [make() for _ in range(min(n, 64))]


def per_model(models: dict, build: Callable, sizes, measure: Callable) -> list:
    """The rows of a benchmark over large models and several sizes: `measure(model, spec, weights, size)` for
    every size of every model of `models` (name -> spec), in order. Each model's weights, `build(spec)`, are
    built once, and dropped with the CUDA cache emptied before the next model's are built: one model's
    weights on the device at a time. `measure` keeps its input sets to itself: they go when it returns."""
    rows = []
    for model, spec in models.items():
        weights = build(spec)
        rows += [measure(model, spec, weights, size) for size in sizes]
        del weights
        torch.cuda.empty_cache()
    return rows


def bench(fn, sets) -> float:
    """Median ms of fn(*s), cycling through the input sets so no run reads a warm cache."""
    import triton.testing

    cycle = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=200, return_mode="median")


def capture(fn, warmups: int = 2):
    """(graph, output) of `fn()` captured in a CUDA graph after `warmups` runs (compile, autotune).

    The warm-up runs on a side stream (as graph capture wants), but the inputs were built on the
    current stream and may still be in flight there: the side stream must wait for it, or the
    warm-up reads unwritten inputs (a garbage cache slot index is an illegal memory access)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def bench_graph(fn, sets) -> float:
    """Median ms per call when the calls are replayed from a CUDA graph (removes launch gaps).
    One graph holds one call per input set; time = graph time / number of sets."""
    import triton.testing

    graph, _ = capture(lambda: [fn(*s) for s in sets], warmups=1)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median")
    return ms / len(sets)


def git_commit() -> str:
    """HEAD's short hash (+dirty); on a machine whose copy of the tree has no .git, $INKLING_COMMIT."""
    if os.environ.get("INKLING_COMMIT"):
        return os.environ["INKLING_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def provenance(ctx: Context, command: str) -> str:
    """One line: where, when and how a table was measured."""
    return (f"Measured on {ctx.device_name}, torch {torch.__version__}, {datetime.date.today()}, commit "
            f"{git_commit()}: `{command}`; copy bandwidth {ctx.copy_gbps:.0f} GB/s.\n")


def markdown_table(ctx: Context, section: str, rows: list[Row], command: str) -> str:
    """The section's title, its provenance line (`command` measured it) and the table."""
    lines = [f"## {section}", "", provenance(ctx, command),
             "| kernel | case | bytes (floor) | kernel µs | % of copy BW | torch twin µs | speedup | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        floor_ms = r.bytes / (ctx.copy_gbps * 1e9) * 1e3
        pct = 100 * floor_ms / r.ms if r.ms > 0 else float("nan")
        twin = f"{r.ms_twin * 1e3:.1f}" if r.ms_twin is not None else "-"
        speed = f"{r.ms_twin / r.ms:.2f}x" if r.ms_twin is not None else "-"
        lines.append(f"| {r.kernel} | {r.case} | {r.bytes:,} | {r.ms * 1e3:.1f} | {pct:.0f}% | {twin} | {speed} | {r.note} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Cases: a benchmark module may describe its work as a list of `Case`s and hand them to
# `run_cases` (GPU: check, then time) or `dry_run` (CPU, TRITON_INTERPRET=1, small sizes: check only).

@dataclass
class Case:
    """One case. `make()` builds an input set (a tuple); `fn(*set)` runs the kernel, `twin(*set)` the
    torch twin; each returns its output (a tensor or a tuple of tensors) for the agreement check."""
    kernel: str
    case: str
    bytes: int                  # the floor (each input read once, each output written once)
    make: Callable[[], tuple]
    fn: Callable
    twin: Callable
    graph: bool = False         # time both through CUDA-graph replays (decode sizes are launch-bound)
    tol: float = 1e-2           # relative L2 allowed between kernel and twin (bf16)


def _fresh(s: tuple) -> tuple:
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in s)


def agreement(case: Case, s: tuple) -> float:
    """Largest relative L2 error of the kernel's outputs against the twin's on set s (each runs on
    its own copy: kernels may write their inputs, e.g. caches). NaN or inf anywhere gives inf."""
    a, b = case.fn(*_fresh(s)), case.twin(*_fresh(s))
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    return max((rel_l2(x, y) for x, y in zip(a, b) if x is not None and y is not None), default=0.0)


def run_cases(cases) -> list[Row]:
    """For each case: build rotating input sets, check kernel against twin, time both (medians)."""
    rows = []
    for case in cases:
        sets = rotating_inputs(case.make, case.bytes)
        err = agreement(case, sets[0])
        if not err <= case.tol:
            raise RuntimeError(f"{case.kernel} [{case.case}]: kernel and twin disagree, relative L2 {err:.2e}")
        timer = bench_graph if case.graph else bench
        row = Row(case.kernel, case.case, case.bytes, timer(case.fn, sets), timer(case.twin, sets),
                  note="graph replay" if case.graph else "")
        print(f"  {row.kernel:>16} {row.case:<34} {row.ms * 1e3:9.1f} us  twin {row.ms_twin * 1e3:9.1f} us",
              flush=True)
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    return rows


def dry_run(cases) -> None:
    """No timing: build one set per case and check kernel against twin (CPU under TRITON_INTERPRET=1
    at small sizes), to catch errors in a benchmark before a GPU run."""
    for case in cases:
        err = agreement(case, case.make())
        print(f"dry  {case.kernel:>16} {case.case:<40} bytes {case.bytes:>12,}  rel L2 {err:.1e}", flush=True)
        if not err <= case.tol:
            raise SystemExit(f"{case.kernel} [{case.case}]: kernel and twin disagree, relative L2 {err:.2e}")


def main(name: str, dry: Callable[[], object]) -> None:
    """A benchmark module run as a script: with `--dry` (or INKLING_BENCH_DRY=1) `dry()` checks the
    cases at small sizes on whatever device there is, without timing; timing runs go through
    `python benchmarks/kernels.py <name>`."""
    if "--dry" in sys.argv[1:] or os.environ.get("INKLING_BENCH_DRY", "0") not in ("", "0"):
        dry()
    else:
        raise SystemExit(f"time with `python benchmarks/kernels.py {name}`; `--dry` checks the cases on CPU")
