"""Static sm_90a compile of the short-conv window kernels, on the CPU (no GPU, no timing).

    python scripts/short_conv_sass.py                 # 1024 x 5 windows at C = 4096 with the residual
    python scripts/short_conv_sass.py --C 6144 --B 1024 --T 9

Compiles the lean tile kernel (what windows of many rows take today) and the window-kernel candidate
(`inkling_fast.kernels.short_conv_window`) with Triton's own ptxas for sm_90a, specialized the way
the JIT specializes a launch of that size (integer arguments equal to 1 become constants, pointers
and integers divisible by 16 carry that hint), and prints per configuration: registers, stack,
the SASS instruction count (non-NOP lines of `cuobjdump -sass`; the kernels have no loops, so this
tracks the instructions a thread issues), that count per output element a thread computes, and the
memory and barrier instructions by kind. These are static counts: what they predict for time is for the
GPU to say (docs/benchmarks/tuning.md).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import inkling_fast.kernels.short_conv as tiles  # noqa: E402
import inkling_fast.kernels.short_conv_window as windows  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = ("x_ptr", "ring_ptr", "w_ptr", "slot_ptr", "pos_ptr", "res_ptr", "out_ptr", "zero_ptr")


def compile_sass(fn, values: dict, constexprs: dict, num_warps: int) -> tuple[int, int, Counter]:
    """(registers, stack bytes, opcode counts) of `fn` compiled for sm_90a with the given runtime
    argument values (for the JIT's specialization) and constexprs."""
    sig, consts, attrs = {}, dict(constexprs), {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*i32" if name in ("slot_ptr", "pos_ptr") else "*bf16"
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
        elif values[name] == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if values[name] % 16 == 0:
                attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    ops = Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)", line)
        if m and m.group(2) != "NOP":
            ops[m.group(2)] += 1
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)), ops


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1024)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--C", type=int, default=4096)
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--no-residual", action="store_true")
    a = ap.parse_args(argv)
    B, T, C, K, R, res = a.B, a.T, a.C, a.K, a.T + a.K - 1, not a.no_residual
    values = dict(B=B, N=B * T, T=T, C=C, R=R, n_slots=B, sx_b=T * C, sx_t=C, sr_s=R * C, sr_r=C, sw_c=1, sw_k=C,
                  sp_b=T, sp_t=1, sres_b=T * C, sres_t=C, so_b=T * C, so_t=C)
    print(f"B={B} T={T} C={C} K={K} R={R} residual={res}; Triton {triton.__version__}, sm_90a, static counts")
    print(f"{'kernel (config)':<26} {'regs':>4} {'stack':>5} {'SASS':>5} {'/elem':>5}  memory / barrier instructions")
    br, bc, w = tiles.launch_config(B * T, C, T)
    # (label, kernel, constexprs, warps, output elements a program computes)
    runs = [(f"lean tile {(br, bc, w)}", tiles._short_conv_kernel,
             dict(K=K, BLOCK_R=br, BLOCK_C=bc, HAS_RES=res, WRITE=True, T_CONST=T, W_TILE=True, LEAN=True), w, br * bc)]
    for bs, bcw, ww in [(4, 256, 4), (4, 128, 4), (8, 128, 4), (1, 256, 1)]:
        runs.append((f"window {(bs, bcw, ww)}", windows._window_kernel,
                     dict(T=T, K=K, BLOCK_S=bs, BLOCK_C=bcw, HAS_RES=res, WRITE=True), ww, bs * bcw * T))
    for label, fn, cx, warps, elems in runs:
        regs, stack, ops = compile_sass(fn, values, cx, warps)
        n = sum(ops.values())
        mem = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDG", "STG", "LDS", "STS", "BAR"))}
        print(f"{label:<26} {regs:>4} {stack:>5} {n:>5} {n / (elems / (32 * warps)):>5.1f}  {mem}", flush=True)


if __name__ == "__main__":
    main()
