"""Where the fast engine's first use goes: kernel compilation, autotuning, warm-up and graph capture
(a script, not a test; needs a CUDA GPU).

    python benchmarks/setup_cost.py --out DIR                 # cold and warm kernel cache, both workloads
    python benchmarks/setup_cost.py --out DIR --src OLD_TREE  # the same for another source tree (before/after)
    python benchmarks/setup_cost.py --out DIR --cli-phases    # the command line's own steps, one by one

Each scenario runs in a fresh Python process with TRITON_CACHE_DIR pointing at an empty folder (cold)
or at the folder a previous cold run filled (warm). Inside it, Triton's JIT compile step, the
autotuner's benchmarking and the engine's graph capture are wrapped with timers, so the setup splits
into: imports, checkpoint load, engine construction, then the first `generate` call (compilations,
autotuning, captures, and the decoding itself) and a second identical call (steady state).

Workloads: `readme`, the README's command (prompt "def fibonacci(n):", batch 1, greedy, k = 4,
64 new tokens, float32 as the CLI runs it, on the bundled checkpoint) and `batch8`, 8 prompts sampled at temperature 0.8
with top-p 0.9, k = 4. The CLI's own wall time (`python -m inkling_mtp generate ...`, or
`inkling_ref.cli` in a tree from before the command line had its own package) is measured too, each
tree's command run from that tree (`python -m` puts the working directory first on the module path):
the fast engine with an empty Triton cache, then twice with the cache it filled, then with that cache
and a new prompt (another length: other prefill shapes), and the reference twice. Writes
DIR/setup_cost[_LABEL].json and prints a table.

`--cli-phases` times instead what `inkling-mtp generate` does for the README command with the fast
engine, step by step in one fresh process (one CPU thread for torch, as the CLI sets): import torch,
load the checkpoint, import Triton and inkling_fast, CUDA init, `Engine(...)`, the warm-up `generate`
and the timed one; with an empty Triton cache, then twice with the cache it filled. Writes
DIR/cli_phases[_LABEL].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = ROOT / "inkling_ref" / "default_checkpoint"
PROMPT = "def fibonacci(n):"
NEW_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments, then"   # another length


# ============================================================================ child: one scenario
def child(workload: str) -> dict:
    t0 = time.perf_counter()
    import torch
    import triton
    import triton.runtime.autotuner as autotuner
    import triton.runtime.jit as jit

    compiles: dict[str, list[float]] = defaultdict(list)
    autotunes: dict[str, list[float]] = defaultdict(list)
    captures: list[tuple[tuple, float]] = []

    do_compile = jit.JITFunction._do_compile

    def timed_compile(self, *a, **kw):
        s = time.perf_counter()
        try:
            return do_compile(self, *a, **kw)
        finally:
            compiles[self.fn.__name__].append(time.perf_counter() - s)

    jit.JITFunction._do_compile = timed_compile
    run = autotuner.Autotuner.run

    def timed_autotune(self, *a, **kw):
        key_before = len(self.cache)
        s = time.perf_counter()
        out = run(self, *a, **kw)
        if len(self.cache) != key_before:           # a new key: this call benchmarked every config
            torch.cuda.synchronize()
            autotunes[self.base_fn.__name__].append(time.perf_counter() - s)
        return out

    autotuner.Autotuner.run = timed_autotune

    from inkling_fast import Engine
    from inkling_fast import graphs
    from inkling_ref import load_checkpoint
    init = graphs.StepGraph.__init__

    def timed_capture(self, pool, step, padding_input):     # a prefill pass's or a cycle's graph
        s = time.perf_counter()
        init(self, pool, step, padding_input)
        torch.cuda.synchronize()
        captures.append((tuple(padding_input.shape), time.perf_counter() - s))

    graphs.StepGraph.__init__ = timed_capture
    t_import = time.perf_counter() - t0

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json"))
    base = tok.encode(PROMPT).ids
    if workload == "readme":                                         # as the CLI runs it: float32
        prompts, kw, B, dtype = [base], dict(max_new_tokens=64, num_speculative_tokens=4), 1, torch.float32
    else:
        prompts = [base + base[:1] * i for i in range(8)]               # 8 prompts of different lengths
        kw = dict(max_new_tokens=64, num_speculative_tokens=4, temperature=0.8, top_p=0.9, seed=0)
        B, dtype = 8, torch.bfloat16

    s = time.perf_counter()
    model = load_checkpoint(DEFAULT_CHECKPOINT, dtype=dtype, num_mtp_depths=4)
    t_load = time.perf_counter() - s
    s = time.perf_counter()
    max_len = max(len(p) for p in prompts) + 64
    engine = Engine(model, max_batch_size=B, max_seq_len=max_len, num_speculative_tokens=4, dtype=dtype)
    torch.cuda.synchronize()
    t_engine = time.perf_counter() - s
    setup_compiles = {n: list(v) for n, v in compiles.items()}

    def gen():
        s = time.perf_counter()
        r = engine.generate(prompts, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - s, r

    t_first, r1 = gen()
    t_second, r2 = gen()
    t_third, _ = gen()
    tokens = r2.num_tokens
    return dict(workload=workload, triton=triton.__version__, torch=torch.__version__,
                gpu=torch.cuda.get_device_name(), t_import=t_import, t_load=t_load, t_engine=t_engine,
                t_first_generate=t_first, t_second_generate=t_second, t_third_generate=t_third,
                tokens=tokens, first_elapsed_s=r1.elapsed_s, second_elapsed_s=r2.elapsed_s,
                compiles={n: dict(count=len(v), seconds=sum(v)) for n, v in compiles.items()},
                compiles_at_construction={n: len(v) for n, v in setup_compiles.items()},
                autotunes={n: dict(count=len(v), seconds=sum(v)) for n, v in autotunes.items()},
                captures=[dict(key=list(k), seconds=t) for k, t in captures])


# ============================================================================ child: the CLI's steps
def cli_phases() -> dict:
    t0 = time.perf_counter()
    phases: dict[str, float] = {}

    def mark(name: str, since: float) -> None:
        phases[name] = time.perf_counter() - since

    s = time.perf_counter()
    import torch
    mark("import_torch", s)
    torch.set_num_threads(1)
    s = time.perf_counter()
    from inkling_ref import load_checkpoint
    from tokenizers import Tokenizer
    prompt = Tokenizer.from_file(str(DEFAULT_CHECKPOINT / "tokenizer.json")).encode(PROMPT).ids
    model = load_checkpoint(DEFAULT_CHECKPOINT, dtype=torch.float32, num_mtp_depths=4)
    mark("load", s)
    s = time.perf_counter()
    import triton
    from inkling_fast import Engine
    from inkling_fast.warmup import count_kernel_builds
    mark("import_triton_and_fast", s)
    s = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    mark("cuda_init", s)
    kw = dict(max_new_tokens=64, num_speculative_tokens=4, eos_token_id=model.config.eos_token_id)
    s = time.perf_counter()
    engine = Engine(model, max_batch_size=1, max_seq_len=len(prompt) + 64, num_speculative_tokens=4,
                    dtype=torch.float32)
    mark("engine", s)
    with count_kernel_builds() as built:
        s = time.perf_counter()
        engine.generate(prompt, **kw)
        torch.cuda.synchronize()
        mark("warmup_generate", s)
    s = time.perf_counter()
    result = engine.generate(prompt, **kw)
    torch.cuda.synchronize()
    mark("timed_generate", s)
    phases["total"] = time.perf_counter() - t0
    return dict(phases=phases, kernels_built=built[0], graphs=len(engine.graphs), tokens=len(result.token_ids[0]),
                tokens_per_s=len(result.token_ids[0]) / result.elapsed_s, gpu=torch.cuda.get_device_name(),
                triton=triton.__version__)


# ============================================================================ parent
def run_child(src: Path, workload: str, cache: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=f"{src}{os.pathsep}{ROOT}")
    cmd = [sys.executable, __file__, "--child", workload]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"scenario {workload} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def time_cli(src: Path, engine: str, cache: Path, prompt: str = PROMPT) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=f"{src}{os.pathsep}{ROOT}")
    module = "inkling_mtp" if (src / "inkling_mtp").is_dir() else "inkling_ref.cli"
    cmd = [sys.executable, "-m", module, "generate", "--checkpoint", str(DEFAULT_CHECKPOINT),
           "--prompt", prompt, "--k", "4",
           "--max-new-tokens", "64", "--engine", engine]
    s = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src)
    wall = time.perf_counter() - s
    lines = [line for line in p.stderr.splitlines() if line.startswith("---")] or p.stderr.strip().splitlines()[-3:]
    return dict(engine=engine, wall_s=wall, rc=p.returncode, stderr_tail=lines)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--src", default=str(ROOT), help="source tree whose inkling_ref / inkling_fast are measured")
    ap.add_argument("--label", default="")
    ap.add_argument("--workloads", default="readme,batch8", help="comma-separated: readme, batch8")
    ap.add_argument("--no-cli", action="store_true", help="skip timing the command line")
    ap.add_argument("--cli-phases", action="store_true", help="time the command line's steps one by one")
    args = ap.parse_args(argv)
    if args.child == "cli-phases":
        print(json.dumps(cli_phases()))
        return
    if args.child:
        print(json.dumps(child(args.child)))
        return
    src, out = Path(args.src).resolve(), Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    label = "_" + args.label if args.label else ""
    if args.cli_phases:
        cache, runs = Path(tempfile.mkdtemp(prefix="triton-cache-")), []
        for state in ("cold", "warm", "warm"):
            r = run_child(src, "cli-phases", cache)
            r["cache"] = state
            runs.append(r)
            print(f"{state}: " + ", ".join(f"{n} {v:.3f} s" for n, v in r["phases"].items()) +
                  f"; kernels {r['kernels_built']}, graphs {r['graphs']}, {r['tokens_per_s']:.0f} tokens/s", flush=True)
        (out / f"cli_phases{label}.json").write_text(json.dumps(dict(src=str(src), runs=runs), indent=1))
        return
    res = dict(src=str(src), scenarios=[], cli=[])
    for workload in [w for w in args.workloads.split(",") if w]:
        cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
        for state in ("cold", "warm"):
            r = run_child(src, workload, cache)
            r["cache"] = state
            res["scenarios"].append(r)
            print(f"{workload:7s} {state}: import {r['t_import']:.1f} s, load {r['t_load']:.1f} s, engine "
                  f"{r['t_engine']:.1f} s, first generate {r['t_first_generate']:.2f} s, second "
                  f"{r['t_second_generate']:.3f} s; compiles {sum(c['count'] for c in r['compiles'].values())} "
                  f"({sum(c['seconds'] for c in r['compiles'].values()):.1f} s), autotune "
                  f"{sum(c['seconds'] for c in r['autotunes'].values()):.1f} s, captures "
                  f"{len(r['captures'])} ({sum(c['seconds'] for c in r['captures']):.2f} s)", flush=True)
    cache = Path(tempfile.mkdtemp(prefix="triton-cache-"))
    runs = (("fast", "cold", PROMPT), ("fast", "warm", PROMPT), ("fast", "warm", PROMPT),
            ("fast", "warm, new prompt", NEW_PROMPT), ("ref", "warm", PROMPT), ("ref", "warm", PROMPT))
    for engine, state, prompt in () if args.no_cli else runs:
        c = time_cli(src, engine, cache, prompt)
        c["cache"] = state
        res["cli"].append(c)
        print(f"cli --engine {engine} ({state} cache): {c['wall_s']:.1f} s wall, rc {c['rc']}: "
              f"{' | '.join(c['stderr_tail'])}", flush=True)
    name = f"setup_cost{label}.json"
    (out / name).write_text(json.dumps(res, indent=1))
    for r in res["scenarios"]:
        if r["cache"] == "cold":
            print(f"\n{r['workload']} cold, per kernel: compilations (s) / autotune (s)")
            for n, c in sorted(r["compiles"].items(), key=lambda x: -x[1]["seconds"]):
                a = r["autotunes"].get(n, {})
                print(f"  {n:40s} {c['count']:3d} {c['seconds']:6.2f}   {a.get('count', 0):2d} "
                      f"{a.get('seconds', 0.0):6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
