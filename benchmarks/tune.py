"""Launch-configuration sweeps of the memory-bound kernels (a script, not a test; H200).

    python benchmarks/tune.py OUT_DIR [short_conv] [short_conv_strips] [short_conv_window] [copy_ceiling] [norms] [attention]
    python benchmarks/tune.py OUT_DIR --dry        # CPU: tiny sizes through the interpreter, no timing

For each kernel, each benchmark case of its `bench_*.py` at large sizes, and each candidate launch
configuration, the script checks the kernel against its torch twin (relative L2 <= 1e-2 on one input
set) and times it the way the benchmarks do (`harness.bench` / `harness.bench_graph`: medians over
input sets rotated past the L2). Candidates are applied by replacing the module's `launch_config`
(and, for attention, the split count). It writes OUT_DIR/tune_<kernel>.jsonl (every
timing) and prints, per case, the best configuration against the current default. The defaults in
the kernel modules are then set by hand from these tables (docs/benchmarks/tuning.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

DRY = "--dry" in sys.argv   # CPU: tiny sizes through the interpreter, no timing (checks the script)
if DRY:
    import os
    os.environ.setdefault("TRITON_INTERPRET", "1")

import harness  # noqa: E402
import triton  # noqa: E402  (after TRITON_INTERPRET is set)


def floor_us(nbytes: int, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e6


def measure(check, time, label) -> tuple[float, float]:
    """(relative L2 error, µs) of one configuration: `check()` gives the error against the twin, `time()`
    the ms (run only if the error is within 1e-2). A configuration that does not compile or fit gives
    (inf, nan)."""
    try:
        err = check()
        return err, (1.0 if DRY else time() * 1e3) if err <= 1e-2 else float("nan")
    except Exception as e:
        print(f"    {label}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return float("inf"), float("nan")


def record(log, out: list, **rec) -> None:
    """Keep one timing and append it to the JSON-lines log at once (a run cut short keeps it)."""
    out.append(rec)
    log.write(json.dumps(rec) + "\n")
    log.flush()


def summarize(label: str, rows: list[dict], is_default, floor: float | None = None) -> None:
    """Print the case's default and best configuration."""
    ok = [r for r in rows if r["us"] == r["us"]]
    best = min(ok, key=lambda r: r["us"])
    dflt = next((r for r in ok if is_default(r)), None)
    fl = f"floor {floor:7.1f} us  " if floor is not None else ""
    print(f"  {label:<52} {fl}default {dflt['us'] if dflt else float('nan'):8.1f} us  best {best['us']:8.1f} us "
          f"({best['pct']:.0f}%) {best['config']}", flush=True)


def sweep_cases(cases, module, configs, gbps, log, attr="launch_config", tag=""):
    """Time each harness.Case under each configuration of `module.<attr>` (None = the default); `tag`
    prefixes the printed labels."""
    default = getattr(module, attr)
    out = []
    for case in cases:
        sets = harness.rotating_inputs(case.make, case.bytes)
        timer = harness.bench_graph if case.graph else harness.bench
        rows = []
        for cfg in [None] + configs:
            setattr(module, attr, default if cfg is None else (lambda *a, cfg=cfg: tuple(cfg)))
            try:
                err, us = measure(lambda: harness.agreement(case, sets[0]), lambda: timer(case.fn, sets), cfg)
            finally:
                setattr(module, attr, default)
            record(log, rows, kernel=case.kernel, case=case.case, config=cfg, us=us, err=err, knob=attr,
                   pct=100 * floor_us(case.bytes, gbps) / us if us == us else None)
        summarize(f"{tag}{case.kernel} {case.case}", rows, lambda r: r["config"] is None)
        out += rows
        del sets
        if not DRY:
            torch.cuda.empty_cache()
    return out


def tune_short_conv(gbps, log):
    import bench_short_conv as bsc
    import inkling_fast.kernels.short_conv as mod
    cases = (bsc.cases("cpu", streams={"kv tiny": (37, False), "H tiny": (300, True)}, shapes=((3, 4), (2, 19)))
             if DRY else bsc.cases("cuda", shapes=((1024, 5), (4, 4096))))
    configs = [(max(1, e // bc), bc, w) for bc in (256, 512, 1024) for e in (2048, 4096) for w in (4, 8)]
    out = sweep_cases(cases, mod, configs, gbps, log)
    # the ring-write launch of long chunks (T + K - 1 > R): (BLOCK_T, BLOCK_C, warps)
    long = [c for c in cases if "T=4096" in c.case or "T=19" in c.case]
    return out + sweep_cases(long, mod, [(1024, 1024, 4), (4096, 1024, 8), (2048, 256, 4)], gbps, log,
                             attr="write_launch_config")


# (B, T): decode steps, draft / verify windows of k + 1 = 2, 5, 9 and 16 rows, few and many sequences
WINDOW_SHAPES = ((1, 1), (16, 1), (256, 1), (8, 2), (64, 2), (3, 5), (256, 5), (1024, 5), (16, 9), (256, 9),
                 (16, 16), (64, 16))


def tune_short_conv_strips(gbps, log):
    """The strip kernel of prefill chunks (T > 16, K <= 4): (L rows, BLOCK_C, warps) of
    `strip_launch_config` on 4 x 4096 and 1 x 2048 rows at the four widths (the chunk's ring-write launch
    included: it is part of every such call)."""
    import bench_short_conv as bsc
    import inkling_fast.kernels.short_conv as mod
    cases = (bsc.cases("cpu", streams={"kv tiny": (37, False), "H tiny": (300, True)}, shapes=((2, 19),))
             if DRY else bsc.cases("cuda", shapes=((4, 4096), (1, 2048))))
    configs = [(32, 256, 1), (32, 128, 1), (16, 256, 1), (64, 256, 1), (16, 128, 1), (32, 256, 2),
               (32, 512, 2), (64, 512, 4), (128, 256, 1)]
    if DRY:
        configs = [(4, 16, 1), (8, 32, 1)]
    return sweep_cases(cases, mod, configs, gbps, log, attr="strip_launch_config")


def tune_short_conv_window(gbps, log):
    """The window kernel (`inkling_fast.kernels.short_conv_window`) against the tiles (lean above
    LEAN_MIN_ROWS rows) on decode steps and windows: first the tiles (the window kernel switched off),
    then the window kernel switched on for every case under its default config and each
    (BLOCK_S, BLOCK_C, warps). The default routing (`takes_window_kernel`) is set from these tables."""
    import bench_short_conv as bsc
    import inkling_fast.kernels.short_conv as mod
    cases = (bsc.cases("cpu", streams={"kv tiny": (37, False), "H tiny": (300, True)}, shapes=((3, 4), (20, 4)))
             if DRY else bsc.cases("cuda", shapes=WINDOW_SHAPES))
    configs = [(4, 256, 4), (4, 128, 4), (2, 128, 2), (1, 256, 1), (8, 128, 4)]
    if DRY:
        configs = [(2, 16, 1), (4, 32, 2)]
    route = mod.takes_window_kernel
    out = []
    try:
        mod.takes_window_kernel = lambda B, T, C: False
        out += sweep_cases(cases, mod, [], gbps, log, tag="tiles ")
        mod.takes_window_kernel = lambda B, T, C: True
        out += sweep_cases(cases, mod, configs, gbps, log, attr="window_launch_config", tag="window ")
    finally:
        mod.takes_window_kernel = route
    return out


def tune_copy_ceiling(gbps, log):
    """The ceiling of a call of each short-conv case's size: `dst.copy_(src)` on bf16 buffers moving the
    case's floor bytes (half read, half written), rotated past the L2 and replayed from a CUDA graph as
    the conv is. Each size is timed with its element count as is and rounded up to 4096 elements (an
    unaligned count may leave torch's vectorized copy path)."""
    import bench_short_conv as bsc
    cases = (bsc.cases("cpu", streams={"kv tiny": (37, False)}, shapes=((3, 4),)) if DRY
             else bsc.cases("cuda", shapes=((3, 5), (256, 5), (1024, 5), (4, 4096))))
    dev = "cpu" if DRY else "cuda"
    out = []
    for case in cases:
        for rounded in (False, True):
            n = case.bytes // 4                                   # bf16 elements read (= written)
            if rounded:
                n = -(-n // 4096) * 4096
            sets = harness.rotating_inputs(
                lambda n=n: (torch.randn(n, dtype=torch.bfloat16, device=dev),
                             torch.empty(n, dtype=torch.bfloat16, device=dev)), 4 * n)
            us = 1.0 if DRY else harness.bench_graph(lambda s, d: d.copy_(s), sets) * 1e3
            nbytes = 4 * n
            record(log, out, kernel="copy", case=case.case, elements=n, rounded=rounded, us=us,
                   pct=100 * floor_us(nbytes, gbps) / us)
            print(f"  copy of {case.case:<44} {'rounded' if rounded else 'as is  '} n={n:>10} "
                  f"{us:8.1f} us ({out[-1]['pct']:.0f}%)", flush=True)
            del sets
    return out


def tune_norms(gbps, log):
    import bench_norms as bn
    import inkling_fast.kernels.embed_norm as en
    import inkling_fast.kernels.mtp_input as mi
    import inkling_fast.kernels.rms_norm as rn
    mods = {"embed_norm": en, "embed_norm x2": en, "embed_norm mtp": en, "rms_norm": rn, "add_rms_norm": rn,
            "mtp_input": mi}
    configs = [(r, w) for r in (1, 2, 4) for w in (4, 8, 16)]
    out = []
    for case in (bn.cases("cpu", widths={"tiny": 40}, rows=(5,), vocab=97) if DRY
                 else bn.cases("cuda", rows=(4096, 16384))):
        out += sweep_cases([case], mods[case.kernel], configs, gbps, log)
    return out


# (T, B, ctx): split counts and (BLOCK_N, warps, stages) to time. The split counts bracket the
# automatic choice; the configurations are the decode tile's (T = 1) and the windows' candidates.
ATTENTION_SWEEP = [
    ((1, 1, 8192), (16, 24, 33, 48), [(64, 4, 3), (64, 4, 2), (32, 4, 3)]),
    ((1, 1, 32768), (16, 24, 33, 48), [(64, 4, 3), (64, 4, 2), (32, 4, 3)]),
    ((1, 4, 8192), (4, 6, 8, 9, 16), [(64, 4, 3), (64, 4, 2)]),
    ((1, 4, 32768), (4, 6, 8, 9, 16), [(64, 4, 3), (64, 4, 2)]),
    ((1, 32, 8192), (1, 2), [(64, 4, 3), (64, 4, 2)]),
    ((5, 1, 8192), (16, 33), [(32, 4, 3), (64, 4, 3), (64, 8, 3)]),
    ((5, 4, 32768), (8, 9), [(32, 4, 3), (64, 4, 3), (64, 8, 3)]),
    ((5, 32, 8192), (1, 2), [(32, 4, 3), (64, 4, 3), (64, 8, 3), (32, 4, 2)]),
    ((9, 1, 8192), (16, 33), [(32, 4, 3), (64, 4, 2), (64, 8, 2)]),
    ((9, 4, 32768), (8, 9), [(32, 4, 3), (64, 4, 2), (64, 8, 2)]),
    ((9, 32, 8192), (1, 2), [(32, 4, 3), (64, 4, 2), (64, 8, 2)]),
]


def tune_attention(gbps, log):
    import bench_attention as ba
    import inkling_fast.kernels.attention_decode as mod
    from inkling_fast.kernels.attention_decode import choose_num_splits, sm_count
    dev = "cpu" if DRY else "cuda"
    sms = sm_count(torch.device(dev))
    small = dict(nh=4, nkv=2, hd=16, scale=256) if DRY else {}      # the dry run's tiny heads
    fns_kw = dict(nh=4, scale=256) if DRY else {}
    default_cfg = mod.launch_config
    out = []
    for (T, B, ctx), splits, cfgs in ATTENTION_SWEEP[: 2 if DRY else None]:
        if DRY:
            splits, cfgs = splits[:2], [(16, 4, 1)]
        base = ba.Case("attention", "global", T, B, ctx)
        auto = choose_num_splits(B * ba.NKV, ctx + T, sms)
        if DRY:
            sets = [ba.make_inputs(base, dev, **small)]
        else:
            sets = harness.rotating_inputs(lambda: ba.make_inputs(base, dev), ba.floor_bytes(base))
        ref = ba._fns(base, **fns_kw)[1](*sets[0]).double()
        fl = floor_us(ba.floor_bytes(base), gbps)

        def check(kernel):
            o = kernel(*sets[0]).double()
            return ((o - ref).norm() / ref.norm()).item() if bool(torch.isfinite(o).all()) else float("inf")

        rows = []
        for cfg in cfgs:
            for S in splits:
                kernel = ba._fns(ba.Case("attention", "global", T, B, ctx, splits=S), **fns_kw)[0]
                mod.launch_config = lambda *a, cfg=cfg: cfg
                try:
                    err, us = measure(lambda: check(kernel), lambda: harness.bench_graph(kernel, sets), (cfg, S))
                finally:
                    mod.launch_config = default_cfg
                record(log, rows, kernel="attention", case=base.label, config=[*cfg, S], us=us, err=err,
                       pct=100 * fl / us if us == us else None, auto_splits=auto)
        block_m = max(16, triton.next_power_of_2(T * (ba.NH // ba.NKV)))
        dflt = [*default_cfg(block_m, 128, torch.bfloat16), auto]
        summarize(f"attention {base.label} (auto S={auto})", rows, lambda r: r["config"] == dflt, fl)
        out += rows
        del sets
        if not DRY:
            torch.cuda.empty_cache()
    return out


def main(argv):
    argv = [a for a in argv if a != "--dry"]
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = argv[1:] or ["short_conv", "short_conv_window", "norms", "attention"]
    gbps = 4000.0 if DRY else harness.measure_copy_bandwidth()
    device = "cpu (dry run)" if DRY else torch.cuda.get_device_name()
    print(f"copy bandwidth {gbps:.0f} GB/s on {device}", flush=True)
    for name in wanted:
        t0 = time.time()
        with open(out_dir / f"tune_{name}.jsonl", "w") as log:
            log.write(json.dumps(dict(copy_gbps=gbps, device=device,
                                      commit=harness.git_commit())) + "\n")
            globals()[f"tune_{name}"](gbps, log)
        print(f"[{name}] {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available() and not DRY:
        raise SystemExit("tuning needs a CUDA GPU (or --dry on the CPU)")
    main(sys.argv[1:])
