"""Run every kernel benchmark (`benchmarks/bench_*.py`) on the GPU and write docs/benchmarks/kernels.md.

    python benchmarks/kernels.py                 # all
    python benchmarks/kernels.py norms swiglu    # only bench_norms.py and bench_swiglu.py
    python benchmarks/kernels.py --out /tmp/kernels_other_gpu.md norms   # another file

Each section of kernels.md carries its own provenance line (GPU, torch, date, commit, command, copy
bandwidth); a run replaces the sections it measured and keeps the others, with their own lines.
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
    out, out_arg = HERE.parent / "docs" / "benchmarks" / "kernels.md", None
    if "--out" in argv:  # another file (e.g. a run on another GPU model): python benchmarks/kernels.py --out F ...
        i = argv.index("--out")
        out_arg, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        out = Path(out_arg) if Path(out_arg).is_absolute() else Path.cwd() / out_arg
    wanted = set(argv)
    mods = sorted(HERE.glob("bench_*.py"))
    if wanted:
        mods = [m for m in mods if m.stem.removeprefix("bench_") in wanted]
    ctx = harness.Context(copy_gbps=harness.measure_copy_bandwidth(),
                          device_name=torch.cuda.get_device_name())
    print(f"copy bandwidth {ctx.copy_gbps:.0f} GB/s on {ctx.device_name}", flush=True)
    if wanted:  # run in the order given
        mods.sort(key=lambda m: argv.index(m.stem.removeprefix("bench_")))
    out.parent.mkdir(parents=True, exist_ok=True)
    command = ("python benchmarks/kernels.py " + ("" if out_arg is None else f"--out {out_arg} ")
               + " ".join(argv)).strip()
    sections = read_sections(out)
    for path in mods:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod  # dataclasses in the module look themselves up there
        spec.loader.exec_module(mod)
        rows = mod.run(ctx)
        table = harness.markdown_table(ctx, mod.SECTION, rows, command)
        print(table, flush=True)
        sections[mod.SECTION] = table
        # written after every section, so a run cut short keeps what it measured
        out.write_text(HEADER + "\n" + "\n".join(sections.values()))
        print(f"wrote {out} (section {mod.SECTION!r})", flush=True)


HEADER = """# Kernel benchmarks

Each table: times are medians of `triton.testing.do_bench` (CUDA events, after warm-up) over input
sets rotated to exceed the L2 (50 MB on an H100, 60 MB on an H200); '% of copy BW' = (floor bytes /
measured device-to-device copy bandwidth, bytes read + written) / kernel time; the torch twin is the
baseline measured in the same run. The line under each title says where (which GPU), when and how that table was measured.
"""


def read_sections(path: Path) -> dict[str, str]:
    """The '## ' sections of an existing kernels.md, by title (text up to the next section)."""
    if not path.exists():
        return {}
    sections, title = {}, None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("## "):
            title = line[3:].strip()
            sections[title] = ""
        if title is not None:
            sections[title] += line
    return {t: body.rstrip("\n") + "\n" for t, body in sections.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
