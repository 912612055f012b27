"""Run every kernel benchmark (`benchmarks/bench_*.py`) on the GPU and write docs/benchmarks/kernels.md.

    python benchmarks/kernels.py                 # all
    python benchmarks/kernels.py norm swiglu     # only bench_norm.py and bench_swiglu.py
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import harness  # noqa: E402


def main(argv: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("kernel benchmarks need a CUDA GPU")
    wanted = set(argv)
    mods = sorted(HERE.glob("bench_*.py"))
    if wanted:
        mods = [m for m in mods if m.stem.removeprefix("bench_") in wanted]
    ctx = harness.Context(copy_gbps=harness.measure_copy_bandwidth(),
                          device_name=torch.cuda.get_device_name())
    print(f"copy bandwidth {ctx.copy_gbps:.0f} GB/s on {ctx.device_name}", flush=True)
    if wanted:  # run in the order given
        mods.sort(key=lambda m: argv.index(m.stem.removeprefix("bench_")))
    out = HERE.parent / "docs" / "benchmarks" / "kernels.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/kernels.py " + " ".join(argv)
    parts = []
    for path in mods:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod  # dataclasses in the module look themselves up there
        spec.loader.exec_module(mod)
        rows = mod.run(ctx)
        table = harness.markdown_table(ctx, mod.SECTION, rows)
        print(table, flush=True)
        parts.append(table)
        # written after every section, so a run cut short keeps what it measured
        out.write_text("# Kernel benchmarks (H200)\n\n" + harness.header(ctx, command.strip()) + "\n" + "\n".join(parts))
        print(f"wrote {out} ({len(parts)} of {len(mods)} sections)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
